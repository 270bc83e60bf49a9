/* tests/fuzz/jsonl.c -- instruction data as JSON lines (--tokens
   FILE.jsonl): input_ids, labels, attention_mask per line. The input is
   given a leading '{' so that it is read as JSON lines. */
static void fuzz_jsonl(const uint8_t *data, size_t n) {
    uint8_t *text = (uint8_t *)malloc(n + 1);
    text[0] = '{';
    memcpy(text + 1, data, n);
    dt_dataset train, val;
    const char *path = fuzz_file("data.jsonl", text, n + 1);
    free(text);
    dt_text_load(path, 1, 0, 8, 0.1, &train, &val);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
}

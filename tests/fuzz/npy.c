/* tests/fuzz/npy.c -- a NumPy token file (--tokens FILE.npy): the magic, the
   header dict, dtype, shape and the ids. */
static void fuzz_npy(const uint8_t *data, size_t n) {
    dt_dataset train, val;
    dt_text_load(fuzz_file("tokens.npy", data, n), 1, 0, 4, 0.1, &train, &val);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
}

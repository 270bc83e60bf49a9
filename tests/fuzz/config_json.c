/* tests/fuzz/config_json.c -- a Hugging Face folder's config.json: read, then
   applied to the flags as --init DIR does (every value checked). */
static void fuzz_config_json(const uint8_t *data, size_t n) {
    fuzz_file("config.json", data, n);
    dt__hf_config hc;
    dt__hf_config_read(fuzz_dir, &hc);
    dt_config c;
    unsigned char given[DT_NFLAGS];
    memset(&c, 0, sizeof c);
    memset(given, 0, sizeof given);
    c.model = DT_MODEL_MLP; c.seq_len = 64; c.vocab = -1;
    dt__apply_hf_model(&c, &hc, given);
    dt__apply_hf_shape(&c, hc, given);
}

/* tests/fuzz/safetensors.c -- the safetensors parser: header length, JSON,
   dtypes, shapes, offsets (the checks of every --init FILE and --resume). */
static void fuzz_safetensors(const uint8_t *data, size_t n) {
    unsigned char *buf = (unsigned char *)malloc(n + 1);     /* the parser owns it */
    memcpy(buf, data, n);
    dt_safetensors *st = dt__safetensors_parse("fuzz.safetensors", buf, n, n, NULL, 0);
    for (int i = 0; i < st->n; i++) {                         /* what a loader then reads */
        dt__st_tensor *t = &st->t[i];
        float row[16];                                        /* at most 2 x 2 x 2 x 2 elements asked for */
        int shape4[4] = { 0 };
        for (int d = 0; d < t->ndim && d < 4; d++) shape4[d] = (int)(t->shape[d] > 0 && t->shape[d] < 3 ? t->shape[d] : 1);
        if (t->ndim <= 4) dt_safetensors_get(st, t->name, row, t->ndim, shape4);
    }
    for (int i = 0; i < st->nmeta; i++) (void)dt_safetensors_meta(st, st->meta[2 * i]);
    dt_safetensors_close(st);
}

/* tests/fuzz/pnm.c -- a PPM or PGM image (P2, P3, P5, P6), decoded and resized
   as the image loader does. */
static void fuzz_pnm(const uint8_t *data, size_t n) {
    char err[256];
    int w = 0, h = 0;
    uint8_t *rgb = dt__decode_pnm(data, n, &w, &h, err, sizeof err);
    if (rgb && w > 0 && h > 0) {
        uint8_t out[3 * 8 * 8];
        dt_image_resize(rgb, 3, w, h, out, 8, 8);
    }
    free(rgb);
}

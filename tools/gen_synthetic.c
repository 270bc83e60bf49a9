/* gen_synthetic: write the synthetic 10-class image set that the stages use by
   default (coloured shapes on noisy backgrounds; PNG with stb, PPM without).

   usage: tools/gen_synthetic DIR [train-images] [val-images] [size] [seed] */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <stdlib.h>
#include <sys/stat.h>

static int number(const char *s, const char *what) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < 1 || v > 100000000) dt_usage_error("%s must be a positive whole number, got '%s'", what, s);
    return (int)v;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 6 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s DIR [train-images=10000] [val-images=2000] [size=32] [seed=20261121]\n", argv[0]);
        return argc < 2 || argc > 6 ? 2 : 0;
    }
    int n_train = argc > 2 ? number(argv[2], "train-images") : 10000;
    int n_val = argc > 3 ? number(argv[3], "val-images") : 2000;
    int size = argc > 4 ? number(argv[4], "size") : 32;
    int seed = argc > 5 ? number(argv[5], "seed") : 20261121;
    struct stat st;
    if (stat(argv[1], &st) == 0) dt_fail("'%s' exists already; give a new folder", argv[1]);
    dt_synthetic_write(argv[1], n_train, n_val, size, (uint64_t)seed);
    printf("wrote %d training and %d validation images of %dx%d to %s\n", n_train, n_val, size, size, argv[1]);
    return 0;
}

/* gen_synthetic: write the synthetic 10-class image set that the stages use by
   default (coloured shapes on noisy backgrounds; PNG with stb, PPM without).

   usage: tools/gen_synthetic DIR [train-images] [val-images] [size] [seed] */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <stdlib.h>
#include <sys/stat.h>

int main(int argc, char **argv) {
    if (argc < 2 || argc > 6 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s DIR [train-images=10000] [val-images=2000] [size=32] [seed=20261121]\n", argv[0]);
        return argc < 2 || argc > 6 ? 2 : 0;
    }
    int n_train = argc > 2 ? (int)dt_flag_number("train-images", argv[2], 1, 100000000, 1) : 10000;
    int n_val = argc > 3 ? (int)dt_flag_number("val-images", argv[3], 1, 100000000, 1) : 2000;
    int size = argc > 4 ? (int)dt_flag_number("size", argv[4], 1, 100000000, 1) : 32;
    int seed = argc > 5 ? (int)dt_flag_number("seed", argv[5], 1, 100000000, 1) : 20261121;
    struct stat st;
    if (stat(argv[1], &st) == 0) dt_fail("'%s' exists already; give a new folder", argv[1]);
    dt_synthetic_write(argv[1], n_train, n_val, size, (uint64_t)seed);
    printf("wrote %d training and %d validation images of %dx%d to %s\n", n_train, n_val, size, size, argv[1]);
    return 0;
}

/* consolidate: turn a sharded checkpoint (a folder in which stage 04 writes one
   file per rank and an index) into a whole checkpoint folder: model.safetensors
   (the weights under their PyTorch names), optimizer.safetensors and
   config.json, as every stage's --resume and --init, and PyTorch,
   transformers' from_pretrained and timm, read it.

   usage: tools/consolidate SHARDED OUT
     SHARDED  the sharded checkpoint's folder (04's "saved ..." line names it)
     OUT      the whole checkpoint folder to write (written whole, or not at all) */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    if (argc != 3 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s SHARDED OUT\n  SHARDED: a sharded checkpoint folder (stage 04); OUT: the whole checkpoint "
                "folder to write\n",
                argv[0]);
        return argc == 2 && !strcmp(argv[1], "--help") ? 0 : 2;
    }
    dt_checkpoint_consolidate(argv[1], argv[2]);
    printf("wrote %s\n", argv[2]);
    return 0;
}

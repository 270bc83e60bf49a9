/* consolidate: turn a sharded checkpoint (stage 04 writes one file per rank and
   an index) into one full checkpoint: the weights under their PyTorch names and
   the optimizer's moments beside them, as every stage's --resume and --init,
   and PyTorch's safetensors.torch.load_file, read it.

   usage: tools/consolidate INDEX OUT
     INDEX  the sharded checkpoint's own path (04's "saved ..." line names it)
     OUT    the full checkpoint to write (written whole, or not at all) */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    if (argc != 3 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s INDEX OUT\n  INDEX: a sharded checkpoint (stage 04); OUT: the full checkpoint to write\n",
                argv[0]);
        return argc == 2 && !strcmp(argv[1], "--help") ? 0 : 2;
    }
    dt_checkpoint_consolidate(argv[1], argv[2]);
    printf("wrote %s\n", argv[2]);
    return 0;
}

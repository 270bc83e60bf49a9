/* merge-lora: fold a LoRA run's adapters into the model they were trained on
   (W + alpha/r B A for each adapted layer) and write that model whole: a
   folder with model.safetensors and config.json, which every stage's --init,
   transformers' from_pretrained and timm read, with no adapters left.

   usage: tools/merge-lora ADAPTER OUT
     ADAPTER  a checkpoint folder of a run with --lora-rank (adapter_config.json,
              adapter_model.safetensors); its frozen model is the folder
              adapter_config.json names, or the run's seed when it named none
     OUT      the folder to write (written whole, or not at all) */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    if (argc != 3 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s ADAPTER OUT\n  ADAPTER: a LoRA checkpoint folder (adapter_config.json, adapter_model.safetensors); "
                "OUT: the merged model's folder to write\n", argv[0]);
        return argc == 2 && !strcmp(argv[1], "--help") ? 0 : 2;
    }
    dt_lora_merge(argv[1], argv[2]);
    printf("wrote %s\n", argv[2]);
    return 0;
}

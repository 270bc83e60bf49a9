/* tests/main.c -- the program tests/test_dtrain: the runner (tests/runner.h),
   or one of the parts of it that some tests run on their own, and the files
   this suite makes, written for the fuzzers. It comes last in the suite's
   one translation unit (tests/helpers.h), after every test file. */
#include "helpers.h"

/* `test_dtrain --write-fuzz-seeds DIR`: the files this suite makes, one
   folder per fuzzing harness (tests/fuzz/), as the fuzzers' first inputs. */
static void seed(const char *dir, const char *target, const char *name, const void *data, size_t n) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, target);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", dir, target, name);
    write_bytes(path, data, n);
}
static void seed_file(const char *dir, const char *target, const char *name, const char *from, size_t skip) {
    size_t n = 0;
    unsigned char *b = read_bytes(from, &n);
    if (b && n >= skip) seed(dir, target, name, b + skip, n - skip);
    free(b);
}
static int write_fuzz_seeds(const char *dir) {
    char tmp[1200];
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) { perror(dir); return 1; }
    snprintf(tmp, sizeof tmp, "%s/.made", dir);
    /* safetensors: the suite's handmade files (F32 and BF16, a scalar), one dtrain writes, with metadata */
    handmade_safetensors(tmp, "F32", 1); seed_file(dir, "safetensors", "handmade-f32", tmp, 0);
    handmade_safetensors(tmp, "BF16", 0); seed_file(dir, "safetensors", "handmade-bf16", tmp, 0);
    float w[6] = { 1, 2, 3, 4, 5, 6 };
    dt_named_tensor t[2] = { { "fc1.weight", w, 2, { 2, 2 } }, { "fc1.bias", w + 4, 1, { 2 } } };
    const char *meta[4] = { "format", "pt", "step", "3" };
    dt_safetensors_write(tmp, t, 2, meta, 2);
    seed_file(dir, "safetensors", "written", tmp, 0);
    /* config.json: the Hugging Face folders the suite makes */
    static const char *const configs[] = {
        "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24, "
        "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256, "
        "\"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
        "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 64}, \"rms_norm_eps\": 1e-06, "
        "\"hidden_act\": \"silu\", \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\"}",
        "{\"model_type\": \"qwen2\", \"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256, \"rope_parameters\": {\"rope_type\": "
        "\"default\", \"rope_theta\": 1000000.0}, \"tie_word_embeddings\": false, \"use_sliding_window\": false, \"sliding_window\": null}",
        ("{\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_embd\": 32, \"n_layer\": 2, \"n_head\": 2, \"n_positions\": 40, "
         "\"n_inner\": null, \"layer_norm_epsilon\": 1e-05, \"activation_function\": \"gelu_new\"}"),   /* (): one string, says clang */
    };
    for (size_t k = 0; k < sizeof configs / sizeof configs[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "config%zu.json", k);
        seed(dir, "config_json", name, configs[k], strlen(configs[k]));
    }
    static const char index_json[] = "{\"metadata\": {\"total_size\": 2048}, \"weight_map\": {\"model.embed_tokens.weight\": "
                                     "\"model-00001-of-00002.safetensors\",\n  \"lm_head.weight\": \"model-00002-of-00002.safetensors\"}}\n";
    seed(dir, "index_json", "index.json", index_json, strlen(index_json));
    /* .npy token files as numpy.save writes them: uint16, uint32 past 65,535, int64 */
    uint16_t u16[12] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };
    uint32_t u32[12] = { 70000, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };
    int64_t i64[12] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };
    write_npy(tmp, "<u2", "(12,)", u16, sizeof u16, 0); seed_file(dir, "npy", "u2.npy", tmp, 0);
    write_npy(tmp, "<u4", "(12,)", u32, sizeof u32, 0); seed_file(dir, "npy", "u4.npy", tmp, 0);
    write_npy(tmp, "<i8", "(3, 4)", i64, sizeof i64, 0); seed_file(dir, "npy", "i8.npy", tmp, 0);
    /* instruction data (the harness puts back the leading '{') */
    make_instruction_data(tmp);
    seed_file(dir, "jsonl", "instructions", tmp, 1);
    /* PPM and PGM, binary and ASCII */
    static const char p6[] = "P6\n2 2\n255\n\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c";
    static const char p5[] = "P5\n# a comment\n3 1\n65535\n\x01\x02\x03\x04\x05\x06";
    static const char p3[] = "P3\n1 2\n15\n1 2 3\n4 5 6\n", p2[] = "P2\n2 1\n255\n0 255\n";
    seed(dir, "pnm", "p6", p6, sizeof p6 - 1); seed(dir, "pnm", "p5", p5, sizeof p5 - 1);
    seed(dir, "pnm", "p3", p3, sizeof p3 - 1); seed(dir, "pnm", "p2", p2, sizeof p2 - 1);
    /* a CIFAR-10 batch of two records */
    unsigned char cifar[2 * 3073];
    for (size_t i = 0; i < sizeof cifar; i++) cifar[i] = (unsigned char)(i % 3073 == 0 ? i / 3073 * 7 : i * 31);
    seed(dir, "cifar", "two-records", cifar, sizeof cifar);
    /* the rendezvous: a hello (first byte 1; 3: with a secret) and a welcome (0; 2) as the ranks send them */
    unsigned char msg[1 + sizeof(dt__welcome)];
    dt__hello *h = (dt__hello *)(msg + 1);
    memset(msg, 0, sizeof msg);
    msg[0] = 1;
    memcpy(h->magic, DT_RDZV_MAGIC, 8);
    snprintf(h->job, sizeof h->job, "SLURM_JOB_ID=1");
    h->rank = 1; h->world = 4; h->pid = 42;
    snprintf(h->where.name, sizeof h->where.name, "host");
    seed(dir, "rendezvous", "hello", msg, 1 + sizeof *h);
    msg[0] = 3;
    seed(dir, "rendezvous", "hello-secret", msg, 1 + sizeof *h);
    dt__welcome *wl = (dt__welcome *)(msg + 1);
    memset(msg, 0, sizeof msg);
    memcpy(wl->magic, DT_RDZV_MAGIC, 8);
    snprintf(wl->shm_name, sizeof wl->shm_name, "/dtrain-%d-4711-0", (int)getuid());
    seed(dir, "rendezvous", "welcome", msg, 1 + sizeof *wl);
    snprintf(wl->refused, sizeof wl->refused, "it belongs to another job ('x')");
    seed(dir, "rendezvous", "refusal", msg, 1 + sizeof *wl);
    unlink(tmp);
    return 0;
}

/* The command that runs the stage binary under test, and the check that it is there. */
static int setup(const char *stage_binary) {
    train_bin = stage_binary;
    struct stat sb;
    if (stat(train_bin, &sb) != 0) { fprintf(stderr, "test_dtrain: no stage binary at %s (run make first)\n", train_bin); return 1; }
    snprintf(train_cpu, sizeof train_cpu, "%s --device cpu", train_bin);
    return 0;
}

/* test_dtrain [--suite S] [-j N] STAGE_BINARY [FILTER], test_dtrain --list
   [FILTER] (tests/runner.h), or one of the parts of this program that some
   tests run on their own. */
int main(int argc, char **argv) {
    self_bin = argv[0];
    if (argc > 1 && !strcmp(argv[1], "--selftest-wrong-memory")) return selftest_wrong_memory();
    if (argc > 1 && !strcmp(argv[1], "--selftest-nproc-port")) return selftest_nproc_port();
    if (argc > 1 && !strcmp(argv[1], "--selftest-nproc-loopback")) return selftest_nproc_loopback();
    if (argc > 2 && !strcmp(argv[1], "--write-fuzz-seeds")) return write_fuzz_seeds(argv[2]);
    if (argc > 2 && !strcmp(argv[1], "--selftest-comm-misuse")) return selftest_comm_misuse(atoi(argv[2]));
    if (argc > 2 && !strcmp(argv[1], "--selftest-stack-misuse")) return selftest_stack_misuse(atoi(argv[2]));
    if (argc > 1 && !strcmp(argv[1], "--selftest-cp-layout")) {    /* a sequence that does not cut into 2C chunks */
        int32_t pos[8];
        dt_cp_positions(DT_CP_ZIGZAG, 30, 4, 0, pos);
        return 0;
    }
    return t_main(argc, argv, setup);
}

/* tests/24-hugging-face.c -- tests of dtrain.h's chapter 24-hugging-face:
   GPT-2, Llama and Qwen2 folders with --init; checkpoints and LoRA adapters
   read by transformers, timm, PyTorch and PEFT. (tests/helpers.h: how the
   suite's files make one program.) */
#include "helpers.h"

/* GPT-2's forward pass, written out plainly in double precision: what the
   first step's loss must be for weights read from a GPT-2-named file. */
static double gelu_tanh_ref(double x) { return 0.5 * x * (1 + tanh(sqrt(2 / 3.14159265358979323846) * (x + 0.044715 * x * x * x))); }
static void layernorm_ref(const double *x, const float *w, const float *b, double *y, int D) {
    double mean = 0, var = 0;
    for (int j = 0; j < D; j++) mean += x[j] / D;
    for (int j = 0; j < D; j++) var += (x[j] - mean) * (x[j] - mean) / D;
    for (int j = 0; j < D; j++) y[j] = (x[j] - mean) / sqrt(var + 1e-5) * w[j] + b[j];
}
typedef struct { const float *wte, *wpe, *lnf_w, *lnf_b, *blk[2][12]; } gpt2_ref_weights;
/* mean next-token loss of one sequence of T + 1 tokens, D = 8, 2 heads, 2 blocks, mlp 32, vocab 256 */
static double gpt2_ref_sequence_loss(const gpt2_ref_weights *W, const unsigned char *tok, int T) {
    enum { D = 8, H = 2, HD = 4, M = 32, V = 256, MAXT = 16 };
    double x[MAXT][D], h[MAXT][D], qkv[MAXT][3 * D], att[MAXT][D], f[MAXT][M], loss = 0;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < D; j++) x[t][j] = W->wte[tok[t] * D + j] + W->wpe[t * D + j];
    for (int l = 0; l < 2; l++) {
        const float *const *B = W->blk[l];   /* ln_1 w b, c_attn w b, c_proj w b, ln_2 w b, c_fc w b, c_proj w b */
        for (int t = 0; t < T; t++) {
            layernorm_ref(x[t], B[0], B[1], h[t], D);
            for (int o = 0; o < 3 * D; o++) { qkv[t][o] = B[3][o]; for (int i = 0; i < D; i++) qkv[t][o] += h[t][i] * B[2][i * 3 * D + o]; }
        }
        for (int hh = 0; hh < H; hh++)
            for (int t = 0; t < T; t++) {
                double s[MAXT], mx = -1e300, sum = 0;
                for (int u = 0; u <= t; u++) {
                    s[u] = 0;
                    for (int d = 0; d < HD; d++) s[u] += qkv[t][hh * HD + d] * qkv[u][D + hh * HD + d] / sqrt((double)HD);
                    if (s[u] > mx) mx = s[u];
                }
                for (int u = 0; u <= t; u++) sum += exp(s[u] - mx);
                for (int d = 0; d < HD; d++) {
                    att[t][hh * HD + d] = 0;
                    for (int u = 0; u <= t; u++) att[t][hh * HD + d] += exp(s[u] - mx) / sum * qkv[u][2 * D + hh * HD + d];
                }
            }
        for (int t = 0; t < T; t++) {
            for (int o = 0; o < D; o++) { double v = B[5][o]; for (int i = 0; i < D; i++) v += att[t][i] * B[4][i * D + o]; x[t][o] += v; }
            layernorm_ref(x[t], B[6], B[7], h[t], D);
            for (int o = 0; o < M; o++) { double v = B[9][o]; for (int i = 0; i < D; i++) v += h[t][i] * B[8][i * M + o]; f[t][o] = gelu_tanh_ref(v); }
            for (int o = 0; o < D; o++) { double v = B[11][o]; for (int i = 0; i < M; i++) v += f[t][i] * B[10][i * D + o]; x[t][o] += v; }
        }
    }
    for (int t = 0; t < T; t++) {
        double y[D], logit[V], mx = -1e300, sum = 0;
        layernorm_ref(x[t], W->lnf_w, W->lnf_b, y, D);
        for (int v = 0; v < V; v++) {
            logit[v] = 0;
            for (int j = 0; j < D; j++) logit[v] += y[j] * W->wte[v * D + j];
            if (logit[v] > mx) mx = logit[v];
        }
        for (int v = 0; v < V; v++) sum += exp(logit[v] - mx);
        loss += log(sum) + mx - logit[tok[t + 1]];
    }
    return loss / T;
}

/* A GPT-2-named file made here -- random weights in GPT-2's layout for a tiny
   config, a position table longer than the context, the causal-mask buffers
   old GPT-2 files carry, "transformer." names for one block -- loads with
   --init; stage 01's first logged loss is the plain forward pass above. */
TEST(gpt2_safetensors_load_with_init_and_give_the_expected_first_loss, QUICK) {
    enum { D = 8, T = 16, M = 32, V = 256, POS = 40 };
    static const char *suffix[12] = { "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                                      "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                      "mlp.c_proj.weight", "mlp.c_proj.bias" };
    static const int64_t shapes[12][2] = { { D, 0 }, { D, 0 }, { D, 3 * D }, { 3 * D, 0 }, { D, D }, { D, 0 }, { D, 0 }, { D, 0 },
                                           { D, M }, { M, 0 }, { M, D }, { D, 0 } };
    dt_named_tensor t[4 + 24 + 2];
    char names[30][64];
    float *bufs[30];
    int n = 0;
    dt__rng r = { 2024 };
    gpt2_ref_weights W;
    for (int k = 0; k < 4 + 24 + 2; k++) {
        int64_t s0, s1;
        if (k < 4) {
            static const char *top[4] = { "wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias" };
            snprintf(names[k], 64, "%s", top[k]);
            s0 = k == 0 ? V : k == 1 ? POS : D; s1 = k < 2 ? D : 0;
        } else if (k < 28) {
            int l = (k - 4) / 12, j = (k - 4) % 12;
            snprintf(names[k], 64, "%sh.%d.%s", l == 1 ? "transformer." : "", l, suffix[j]);
            s0 = shapes[j][0]; s1 = shapes[j][1];
        } else {
            snprintf(names[k], 64, "h.%d.attn.bias", k - 28);               /* GPT-2's mask buffer: ignored */
            s0 = T; s1 = T;
        }
        int64_t numel = s0 * (s1 ? s1 : 1);
        bufs[k] = (float *)malloc(sizeof(float) * (size_t)numel);
        int is_norm_w = strstr(names[k], "ln_") && strstr(names[k], "weight");
        /* the MLP's GELU sees -3 .. 3, and its output moves the logits: the loss tells the GELUs apart */
        double scale = strstr(names[k], "mlp.c_") || !strcmp(names[k], "wte.weight") ? 1.0 : 0.3;
        for (int64_t i = 0; i < numel; i++) bufs[k][i] = (float)(is_norm_w ? 1 + 0.2 * rnd(&r) : scale * rnd(&r));
        dt_named_tensor nt = { names[k], bufs[k], s1 ? 2 : 1, { s0, s1, 0, 0 } };
        t[n++] = nt;
        if (k == 0) W.wte = bufs[k];
        else if (k == 1) W.wpe = bufs[k];
        else if (k == 2) W.lnf_w = bufs[k];
        else if (k == 3) W.lnf_b = bufs[k];
        else if (k < 28) W.blk[(k - 4) / 12][(k - 4) % 12] = bufs[k];
    }
    char file[600], text[600], log[600], out[16384];
    snprintf(file, sizeof file, "%s/gpt2-tiny.safetensors", tmpdir);
    dt_safetensors_write(file, t, n, NULL, 0);
    /* 178 bytes: the first 161 are training, 10 sequences of 16, one batch */
    unsigned char bytes[178];
    for (int i = 0; i < 178; i++) bytes[i] = (unsigned char)("The miller ran to the bridge at noon. "[i % 38]);
    snprintf(text, sizeof text, "%s/gpt2.txt", tmpdir);
    write_bytes(text, bytes, sizeof bytes);
    snprintf(log, sizeof log, "%s/gpt2.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --model gpt --dim 8 --depth 2 --heads 2 --seq-len 16 --data %s --batch-size 10 "
                     "--steps 1 --init %s --log %s --quiet", train_cpu, text, file, log);
    CHECKF(st == 0, "exit %d\n%s", st, out);
    double got[4], want = 0;
    int k = read_losses(log, got, 4);
    for (int s = 0; s < 10; s++) want += gpt2_ref_sequence_loss(&W, bytes + s * T, T) / 10;
    CHECKF(k == 1 && fabs(got[0] - want) < 2e-6, "first loss %.7f (%d logged), the plain GPT-2 forward gives %.7f", got[0], k, want);
    CHECK(want > 3 && want < 12);                                       /* a real loss, not a constant */
    /* a file of another shape is refused, naming the tensor */
    st = run_cmd(out, sizeof out, "%s --model gpt --dim 16 --depth 2 --heads 2 --seq-len 16 --data %s --batch-size 10 --steps 1 --init %s",
                 train_cpu, text, file);
    expect_error(out, st, 1, "wte.weight");
    for (int i = 0; i < n; i++) free(bufs[i]);
}

/* A safetensors file of bf16 tensors, written by hand (dtrain writes f32). */
static void write_safetensors_bf16(const char *path, const dt_named_tensor *t, int n) {
    char header[8192];
    size_t used = (size_t)snprintf(header, sizeof header, "{");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = t[i].shape[0] * (t[i].ndim > 1 ? t[i].shape[1] : 1);
        char shape[64];
        if (t[i].ndim > 1) snprintf(shape, sizeof shape, "%lld,%lld", (long long)t[i].shape[0], (long long)t[i].shape[1]);
        else snprintf(shape, sizeof shape, "%lld", (long long)t[i].shape[0]);
        used += (size_t)snprintf(header + used, sizeof header - used, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%s],"
                                 "\"data_offsets\":[%llu,%llu]}", i ? "," : "", t[i].name, shape,
                                 (unsigned long long)off, (unsigned long long)(off + 2 * (uint64_t)numel));
        off += 2 * (uint64_t)numel;
    }
    used += (size_t)snprintf(header + used, sizeof header - used, "}");
    FILE *f = fopen(path, "wb");
    uint64_t hlen = used;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(hlen >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(header, 1, used, f);
    for (int i = 0; i < n; i++) {
        int64_t numel = t[i].shape[0] * (t[i].ndim > 1 ? t[i].shape[1] : 1);
        for (int64_t k = 0; k < numel; k++) {
            uint16_t h = dt_f32_to_bf16(t[i].data[k]);
            unsigned char b[2] = { (unsigned char)(h & 255), (unsigned char)(h >> 8) };
            fwrite(b, 1, 2, f);
        }
    }
    fclose(f);
}

/* A Hugging Face model folder made here: config.json and random weights in
   the real layouts (Llama with grouped-query attention and a tied head, in
   bf16, one file; Qwen2 with q/k/v biases and a head of its own, f32, two
   files and model.safetensors.index.json). `--init DIR` alone (no --model, no
   shape flags) must train it, and the first loss must be the double-precision
   forward's. */
TEST(hugging_face_llama_and_qwen2_folders_load_with_init_and_give_the_expected_first_loss, QUICK) {
    enum { T = 16, B = 10 };
    unsigned char bytes[178];                    /* the first 161 bytes are training: 10 sequences of 16, one batch */
    for (int i = 0; i < 178; i++) bytes[i] = (unsigned char)("The miller ran to the bridge at noon. "[i % 38]);
    char text[600], dir[600], path[800], log[800], out[16384];
    snprintf(text, sizeof text, "%s/hf.txt", tmpdir);
    write_bytes(text, bytes, sizeof bytes);
    float ids[B * T];
    int32_t labels[B * T];
    for (int i = 0; i < B * T; i++) { ids[i] = bytes[i / T * T + i % T]; labels[i] = bytes[i / T * T + i % T + 1]; }
    for (int variant = 0; variant < 3; variant++) {
        /* 2: Llama 3's rescaled frequencies, heads of 8 so that a pair falls in each band (kept, blended, stretched) */
        int qwen = variant == 1, llama3 = variant == 2, H = llama3 ? 2 : 4, KV = llama3 ? 1 : 2;
        dt_model_config c = { DT_MODEL_LLAMA, 0, 0, 256, 16, 2, H, 0, 24, T, KV, qwen, qwen, qwen ? 1000000.0f : 10000.0f, 1e-6f,
                              llama3 ? 8.0f : 0, llama3 ? 1.0f : 0, llama3 ? 4.0f : 0, llama3 ? 64 : 0, 0, 0, "", 0, 0, 0, 0, 0 };
        dt_model *m = dt_model_create(&c, 17 + variant);
        dt__rng r = { 99 };
        for (int i = 0; i < m->nparams; i++)
            for (int64_t j = 0; j < m->params[i].numel; j++) {
                float *v = &m->params[i].data[j];
                *v = m->params[i].ndim == 1 ? (float)(1 + 0.3 * rnd(&r)) * (strstr(m->params[i].name, "bias") ? 0.5f : 1.0f)
                                            : (float)(0.3 * rnd(&r));
                if (!qwen) *v = dt_bf16_to_f32(dt_f32_to_bf16(*v));     /* what the bf16 file holds */
            }
        snprintf(dir, sizeof dir, "%s/hf-%s", tmpdir, qwen ? "qwen2" : llama3 ? "llama3" : "llama");
        mkdir(dir, 0755);
        snprintf(path, sizeof path, "%s/config.json", dir);
        FILE *f = fopen(path, "w");
        fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n  \"hidden_size\": 16,\n"
                   "  \"intermediate_size\": 24,\n  \"num_hidden_layers\": 2,\n  \"num_attention_heads\": %d,\n"
                   "  \"num_key_value_heads\": %d,\n  \"vocab_size\": 256,\n  \"max_position_embeddings\": 64,\n"
                   "  %s,\n  \"rms_norm_eps\": 1e-06,\n  \"hidden_act\": \"silu\",\n"
                   "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"%s\",\n  \"bos_token_id\": 1\n}\n",
                qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM", qwen ? "qwen2" : "llama", H, KV,
                qwen ? "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0}"   /* transformers 5 */
                : llama3 ? "\"rope_theta\": 10000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                           "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 64}"
                : "\"rope_theta\": 10000.0, \"rope_scaling\": null",                                  /* transformers 4 */
                qwen ? "false" : "true", qwen ? "float32" : "bfloat16");
        fclose(f);
        dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)m->nparams, sizeof *t);
        for (int i = 0; i < m->nparams; i++) {
            dt_named_tensor nt = { m->params[i].name, m->params[i].data, m->params[i].ndim,
                                   { m->params[i].shape[0], m->params[i].ndim > 1 ? m->params[i].shape[1] : 0, 0, 0 } };
            t[i] = nt;
        }
        if (!qwen) {
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
            write_safetensors_bf16(path, t, m->nparams);
        } else {                                  /* two files, the index naming each tensor's */
            int half = m->nparams / 2;
            char f1[900], f2[900];
            snprintf(f1, sizeof f1, "%s/model-00001-of-00002.safetensors", dir);
            snprintf(f2, sizeof f2, "%s/model-00002-of-00002.safetensors", dir);
            dt_safetensors_write(f1, t, half, NULL, 0);
            dt_safetensors_write(f2, t + half, m->nparams - half, NULL, 0);
            snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
            f = fopen(path, "w");
            fprintf(f, "{\"metadata\": {\"total_size\": %lld}, \"weight_map\": {", (long long)m->numel * 4);
            for (int i = 0; i < m->nparams; i++)
                fprintf(f, "%s\n  \"%s\": \"model-0000%d-of-00002.safetensors\"", i ? "," : "", t[i].name, i < half ? 1 : 2);
            fprintf(f, "}}\n");
            fclose(f);
        }
        free(t);
        snprintf(log, sizeof log, "%s.jsonl", dir);
        int st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --batch-size %d --steps 1 --init %s --log %s --quiet",
                         train_cpu, text, T, B, dir, log);
        CHECKF(st == 0, "%s: exit %d\n%s", dir, st, out);
        double got[4], want = llama_ref_loss(m, ids, labels, B, T);
        int k = read_losses(log, got, 4);
        CHECKF(k == 1 && fabs(got[0] - want) < 2e-6, "%s: first loss %.7f (%d logged), the double forward gives %.7f",
               qwen ? "qwen2" : llama3 ? "llama3" : "llama", got[0], k, want);
        if (llama3) {                                                   /* and without the rescaling, another loss */
            dt_model_config plain = m->cfg;
            plain.rope_factor = 0;
            m->cfg = plain;
            double unscaled = llama_ref_loss(m, ids, labels, B, T);
            CHECKF(fabs(unscaled - want) > 1e-4, "llama3: the rescaling changes the loss by %.2g only", fabs(unscaled - want));
            /* the checkpoint records the rescaling: a run resumes it with the four flags, and not without them */
            char ckdir[900], shape[300];
            snprintf(ckdir, sizeof ckdir, "%s-run", dir);
            st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --batch-size %d --steps 1 --epochs 2 --init %s --save-dir %s "
                         "--quiet", train_cpu, text, T, B, dir, ckdir);
            CHECKF(st == 0, "llama3 --save-dir: exit %d\n%s", st, out);
            st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_epoch1'", ckdir);
            out[strcspn(out, "\n")] = 0;
            dt__copy_str(ckdir, sizeof ckdir, out);
            snprintf(shape, sizeof shape, "--model llama --dim 16 --depth 2 --heads 2 --kv-heads 1 --ffn-dim 24 --vocab 256 "
                     "--seq-len %d --batch-size %d --norm-eps 1e-6 --epochs 2 --steps 2", T, B);
            st = run_cmd(out, sizeof out, "%s --data %s %s --rope-factor 8 --rope-low-freq 1 --rope-high-freq 4 "
                         "--rope-original-context 64 --resume %s --quiet", train_cpu, text, shape, ckdir);
            CHECKF(st == 0, "llama3 resumed with --rope-factor ...: exit %d\n%s", st, out);
            st = run_cmd(out, sizeof out, "%s --data %s %s --resume %s", train_cpu, text, shape, ckdir);
            expect_error(out, st, 1, "rope_factor,rope_low_freq,rope_high_freq,rope_original_context");
            st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --steps 1 --init %s --rope-factor 4", train_cpu, text, T, dir);
            expect_error(out, st, 2, "--rope-factor 4 contradicts \"factor\": 8");
            st = run_cmd(out, sizeof out, "%s --data %s --model llama --rope-factor 4 --steps 1", train_cpu, text);
            expect_error(out, st, 2, "go together");
            st = run_cmd(out, sizeof out, "%s --data %s --model gpt --rope-factor 4 --rope-low-freq 1 --rope-high-freq 4 "
                         "--rope-original-context 64 --steps 1", train_cpu, text);
            expect_error(out, st, 2, "are for --model llama");
        }
        CHECK(want > 3 && want < 12);                                   /* a real loss, not a constant */
        /* a flag that contradicts the config is an error naming both */
        st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --dim 32 --steps 1 --init %s", train_cpu, text, T, dir);
        expect_error(out, st, 2, "--dim 32 contradicts");
        CHECKF(strstr(out, "hidden_size") && strstr(out, "config.json"), "the error does not name the config's key:\n%s", out);
        st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --steps 1 --init %s %s", train_cpu, text, T, dir,
                     qwen ? "--model gpt" : "--untied-head");
        expect_error(out, st, 2, qwen ? "--model gpt contradicts" : "--untied-head");
        dt_model_free(m);
    }
    /* a tensor the model has no place for is an error, not dropped */
    snprintf(dir, sizeof dir, "%s/hf-llama", tmpdir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    char spare[900];
    snprintf(spare, sizeof spare, "%s/spare.safetensors", dir);
    float bias[24] = { 0 };
    dt_named_tensor extra = { "model.layers.0.mlp.up_proj.bias", bias, 1, { 24, 0, 0, 0 } };
    dt_safetensors_write(spare, &extra, 1, NULL, 0);
    char kept[900];                                                   /* the weights aside, the spare tensor in their place */
    snprintf(kept, sizeof kept, "%s.kept", path);
    rename(path, kept);
    rename(spare, path);
    int st = run_cmd(out, sizeof out, "%s --data %s --seq-len 16 --batch-size 10 --steps 1 --init %s", train_cpu, text, dir);
    expect_error(out, st, 1, "model.layers.0.mlp.up_proj.bias");
    rename(kept, path);
    /* what dtrain cannot read yet, and values that are no shape, are said, not guessed */
    static const struct { const char *extra, *names; } refused[] = {
        { ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}", "rope_type \"yarn\" are not supported" },
        { ", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}", "rope_type \"dynamic\" are not supported" },
        { ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 32.0}", "rope_type llama3 needs" },
        { ", \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, "
          "\"low_freq_factor\": 4.0, \"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}",
          "0 < low_freq_factor < high_freq_factor" },
        { ", \"mlp_bias\": true", "mlp_bias" },
        { ", \"use_sliding_window\": true, \"sliding_window\": 8", "sliding-window" },
        { ", \"partial_rotary_factor\": 0.5", "partial_rotary_factor" },
        { ", \"num_key_value_heads\": 0", "\"num_key_value_heads\": 0 is not a valid value" },
        { ", \"rope_theta\": 1.0", "rope_theta 1" },
        { ", \"rms_norm_eps\": 0", "\"rms_norm_eps\": 0 is not a valid value" } };
    snprintf(path, sizeof path, "%s/config.json", dir);
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++) {
        FILE *f = fopen(path, "w");
        fprintf(f, "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2, "
                   "\"num_attention_heads\": 4, \"vocab_size\": 256%s}", refused[k].extra);
        fclose(f);
        st = run_cmd(out, sizeof out, "%s --data %s --seq-len 16 --batch-size 10 --steps 1 --init %s", train_cpu, text, dir);
        expect_error(out, st, 2, refused[k].names);
    }
    static const char *const bad_shapes[3][2] = { { "\"num_attention_heads\": 0", "num_attention_heads" },
                                                   { "\"num_attention_heads\": 4.5", "num_attention_heads" },
                                                   { "\"num_attention_heads\": 1e20", "num_attention_heads" } };
    for (int k = 0; k < 3; k++) {
        FILE *f = fopen(path, "w");
        fprintf(f, "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2, "
                   "\"vocab_size\": 256, %s}", bad_shapes[k][0]);
        fclose(f);
        st = run_cmd(out, sizeof out, "%s --data %s --seq-len 16 --batch-size 10 --steps 1 --init %s", train_cpu, text, dir);
        expect_error(out, st, 2, bad_shapes[k][1]);
    }
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"model_type\": \"mistral\", \"hidden_size\": 16}");
    fclose(f);
    st = run_cmd(out, sizeof out, "%s --data %s --seq-len 16 --steps 1 --init %s", train_cpu, text, dir);
    expect_error(out, st, 2, "mistral");
    /* a llama checkpoint records the numbers the model used: a run without
       --rope-theta resumes with --rope-theta 10000, its default */
    snprintf(dir, sizeof dir, "%s/llama-ck", tmpdir);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --data %s --batch-size 2 --epochs 1 "
                 "--steps 2 --save-dir %s --quiet", train_cpu, text, dir);
    CHECKF(st == 0, "llama checkpoint: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --data %s --batch-size 2 --epochs 1 "
                 "--rope-theta 10000 --norm-eps 1e-5 --resume auto --save-dir %s --quiet", train_cpu, text, dir);
    CHECKF(st == 0, "llama resumed with the defaults spelled out: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --data %s --batch-size 2 --epochs 1 "
                 "--rope-theta 500000 --resume auto --save-dir %s", train_cpu, text, dir);
    expect_error(out, st, 1, "kv_heads,untied_head,qkv_bias,rope_theta,norm_eps");
}

/* The python that has torch, safetensors, transformers and timm: $DT_TEST_PYTHON,
   the test environment .ci/run makes (build/pyvenv), or python3. */
static const char *test_python(void) {
    static char python[800];
    const char *env = getenv("DT_TEST_PYTHON");
    if (env && env[0]) return env;
    snprintf(python, sizeof python, "%s/build/pyvenv/bin/python", repo_root());
    return access(python, X_OK) == 0 ? python : "python3";
}

/* A checkpoint folder of each model opens in the tools its users have --
   transformers' from_pretrained on the folder as it is (gpt; llama tied with
   grouped-query attention; Qwen2's layout: untied, q/k/v biases, another rope
   base; Mixtral's experts), timm and a strict load_state_dict (vit, mlp) -- and computes the
   logits dtrain computes from those weights. Stage 04's sharded checkpoint
   does after tools/consolidate. */
TEST(checkpoints_open_in_transformers_timm_and_pytorch, FULL) {
    char out[16384], dir[600], ck[700], in[800], want[800];
    const char *py = test_python(), *check = NULL;
    char checker[800];
    snprintf(checker, sizeof checker, "%s/tests/hf_load_check.py", repo_root());
    check = checker;
    if (run_cmd(out, sizeof out, "%s -c 'import torch, numpy, safetensors, transformers, timm'", py) != 0) {
        size_t len = strlen(out);
        while (len && out[len - 1] == '\n') out[--len] = 0;
        const char *last = strrchr(out, '\n');                           /* python's last line: what is missing */
        SKIP("%.90s cannot import torch, numpy, safetensors, transformers and timm (%.100s); bash .ci/run makes "
             "build/pyvenv with them", py, last ? last + 1 : out);
    }
    /* llama3: llama's weights, read by both sides with Llama 3's rescaled frequencies (config.json rewritten) */
    static const struct { const char *name, *stage, *flags; int text, consolidate, llama3; } cases[] = {
        { "mlp", "01-single-gpu", "--image-size 16 --dim 32 --batch-size 16", 0, 0, 0 },
        { "vit", "01-single-gpu", "--model vit --image-size 16 --patch 4 --dim 32 --depth 2 --heads 2 --batch-size 16", 0, 0, 0 },
        { "gpt", "01-single-gpu", "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4", 1, 0, 0 },
        { "llama", "01-single-gpu", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 4", 1, 0, 0 },
        { "qwen2", "01-single-gpu", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 1 --seq-len 16 --batch-size 4 "
          "--untied-head --qkv-bias --rope-theta 1000000 --norm-eps 1e-6", 1, 0, 0 },
        { "llama-fsdp", "04-fsdp", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 2 --nproc 2",
          1, 1, 0 },
        { "llama3", "01-single-gpu", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 4", 1, 0, 1 },
        { "mixtral", "01-single-gpu", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 4 "
          "--moe-experts 4 --moe-top-k 2", 1, 0, 0 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        snprintf(dir, sizeof dir, "%s/topython-%s", tmpdir, cases[c].name);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --steps 3 --lr 2e-2 --save-dir %s --quiet",
                         stage_bin(cases[c].stage), cases[c].text ? gpt_text() : small_data(), cases[c].flags, dir);
        CHECKF(st == 0, "%s: training: exit %d\n%s", cases[c].name, st, out);
        if (st) continue;
        /* the one folder saved, consolidated when sharded */
        st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step3'", dir);
        CHECKF(st == 0, "%s: no checkpoint of step 3 in %s", cases[c].name, dir);
        if (st) continue;
        out[strcspn(out, "\n")] = 0;
        dt__copy_str(ck, sizeof ck, out);
        if (cases[c].consolidate) {
            snprintf(in, sizeof in, "%s/whole", dir);
            st = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/consolidate"), ck, in);
            CHECKF(st == 0, "%s: consolidate: exit %d\n%s", cases[c].name, st, out);
            dt__copy_str(ck, sizeof ck, in);
        }
        /* dtrain's logits from the folder's weights, on a fixed input */
        char meta[800];
        dt_safetensors *h = dt_safetensors_read(meta_file(ck, meta, sizeof meta));
        dt_model_config mc;
        CHECK(dt__model_config_parse(h, meta, &mc));
        dt_safetensors_close(h);
        if (cases[c].llama3) {           /* heads of 8: one pair of each band, kept, blended and stretched */
            mc.rope_factor = 8; mc.rope_low_freq = 1; mc.rope_high_freq = 4; mc.rope_original_context = 64;
            snprintf(in, sizeof in, "%s/config.json", ck);
            FILE *f = fopen(in, "w");
            CHECK(f != NULL);
            if (f) { dt__config_json(f, &mc); fclose(f); }
        }
        dt_model *m = dt_model_create(&mc, 1);
        dt_model_load_weights(m, ck);
        if (cases[c].llama3) {           /* weights 4x larger, so that the angles weigh in the logits: written back */
            dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)m->nparams, sizeof *t);
            dt_safetensors *w = dt_safetensors_read(meta);
            for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] *= 4;
            for (int i = 0; i < m->nparams; i++) {
                t[i].name = m->params[i].name; t[i].data = m->params[i].data; t[i].ndim = m->params[i].ndim;
                for (int d = 0; d < m->params[i].ndim; d++) t[i].shape[d] = m->params[i].shape[d];
            }
            dt_safetensors_write(meta, t, m->nparams, (const char *const *)w->meta, w->nmeta);
            dt_safetensors_close(w);
            free(t);
        }
        int lang = dt_model_is_language(mc.kind), B = 2;
        int shape[4] = { B, lang ? mc.seq_len : mc.channels, mc.image_size, mc.image_size };
        int ndim = lang ? 2 : 4;
        int64_t count = 1;
        for (int d = 0; d < ndim; d++) count *= shape[d];
        float *x = (float *)malloc(sizeof(float) * (size_t)count);
        uint64_t rng = 77 + c;
        for (int64_t i = 0; i < count; i++) {
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            double u = (double)(rng >> 11) / 9007199254740992.0;
            x[i] = lang ? (float)(int)(u * mc.classes) : (float)(4 * u - 2);
        }
        dt_set_grad_enabled(0);
        dt_step_arena_reset();
        dt_tensor *logits = dt_model_forward(m, dt_tensor_from_host(ndim, shape, x));
        float *y = (float *)malloc(sizeof(float) * (size_t)logits->numel);
        dt_tensor_to_host(logits, y);
        dt_set_grad_enabled(1);
        snprintf(in, sizeof in, "%s/input.f32", dir);
        snprintf(want, sizeof want, "%s/logits.f32", dir);
        write_bytes(in, x, sizeof(float) * (size_t)count);
        write_bytes(want, y, sizeof(float) * (size_t)logits->numel);
        char dims[64];
        if (lang) snprintf(dims, sizeof dims, "%dx%d", shape[0], shape[1]);
        else snprintf(dims, sizeof dims, "%dx%dx%dx%d", shape[0], shape[1], shape[2], shape[3]);
        st = run_cmd(out, sizeof out, "%s %s %s %s %s %s", py, check, ck, in, dims, want);
        CHECKF(st == 0 && strstr(out, "ok: "), "%s: %s did not load %s as dtrain does (exit %d):\n%s", cases[c].name, py, ck, st, out);
        free(x);
        free(y);
        dt_model_free(m);
    }
}

/* A tiny Mixtral made by transformers (tests/hf_make_mixtral.py: its own
   initialisation, weights and router scaled up so that every path and every
   choice of experts matters) trains with `--init DIR` alone, and its first
   loss is the one transformers computes on the same batch. */
TEST(a_mixtral_made_by_transformers_loads_with_init_and_gives_its_first_loss, FULL) {
    enum { T = 16, B = 10 };
    char text[600], dir[600], log[800], out[16384], maker[800];
    unsigned char bytes[178];                    /* the first 161 bytes are training: 10 sequences of 16, one batch */
    for (int i = 0; i < 178; i++) bytes[i] = (unsigned char)("The miller ran to the bridge at noon. "[i % 38]);
    snprintf(text, sizeof text, "%s/mixtral.txt", tmpdir);
    write_bytes(text, bytes, sizeof bytes);
    snprintf(dir, sizeof dir, "%s/mixtral", tmpdir);
    snprintf(maker, sizeof maker, "%s/tests/hf_make_mixtral.py", repo_root());
    int st = run_cmd(out, sizeof out, "%s %s %s %s %d %d", test_python(), maker, dir, text, T, B);
    if (st == 77) SKIP("%.200s", out);
    CHECKF(st == 0, "%s: exit %d\n%s", maker, st, out);
    if (st) return;
    double want = atof(out), got[4];
    snprintf(log, sizeof log, "%s/mixtral.jsonl", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s --seq-len %d --batch-size %d --steps 1 --init %s --log %s", train_cpu, text, T, B,
                 dir, log);
    CHECKF(st == 0 && strstr(out, "4 experts, top-2"), "--init %s: exit %d\n%s", dir, st, out);
    int k = read_losses(log, got, 4);
    CHECKF(k == 1 && fabs(got[0] - want) < 1e-5, "first loss %.7f (%d logged); transformers gives %.7f", got[0], k, want);
    CHECKF(fabs(want - 5.545177) > 0.1, "transformers' loss %.4f is a uniform guess's (ln 256): the test would show nothing", want);
}

/* LoRA adapters open in PEFT: a plain run's checkpoint is the frozen model,
   a LoRA run on it (--init) saves adapters, and transformers +
   PeftModel.from_pretrained compute the logits dtrain computes with them. */
TEST(lora_adapters_open_in_peft, FULL) {
    char out[16384], base[600], dir[600], ck[800], in[800], want[800];
    char checker[800];
    const char *py = test_python();
    snprintf(checker, sizeof checker, "%s/tests/hf_load_check.py", repo_root());
    if (run_cmd(out, sizeof out, "%s -c 'import torch, numpy, safetensors, transformers, peft'", py) != 0) {
        size_t len = strlen(out);
        while (len && out[len - 1] == '\n') out[--len] = 0;
        const char *last = strrchr(out, '\n');
        SKIP("%.90s cannot import torch, numpy, safetensors, transformers and peft (%.100s); bash .ci/run makes "
             "build/pyvenv with them", py, last ? last + 1 : out);
    }
    static const struct { const char *name, *flags, *lora; } cases[] = {
        { "gpt", "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4", "--lora-targets c_attn,c_proj" },
        { "qwen2", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 1 --seq-len 16 --batch-size 4 --untied-head --qkv-bias",
          "--lora-targets q_proj,v_proj,down_proj,lm_head" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        snprintf(base, sizeof base, "%s/peft-base-%s", tmpdir, cases[c].name);
        snprintf(dir, sizeof dir, "%s/peft-lora-%s", tmpdir, cases[c].name);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --steps 2 --lr 2e-2 --save-dir %s --quiet", train_cpu, gpt_text(),
                         cases[c].flags, base);
        CHECKF(st == 0, "%s: the frozen model's run: exit %d\n%s", cases[c].name, st, out);
        snprintf(ck, sizeof ck, "%s/%s_data0-320_step2", base, strcmp(cases[c].name, "gpt") ? "llama" : "gpt");
        st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --steps 3 --lr 5e-2 --lora-rank 4 %s --init %s --save-dir %s --quiet",
                     train_cpu, gpt_text(), cases[c].flags, cases[c].lora, ck, dir);
        CHECKF(st == 0, "%s: the LoRA run: exit %d\n%s", cases[c].name, st, out);
        char adapter[800];
        snprintf(adapter, sizeof adapter, "%s/%s_data0-320_step3", dir, strcmp(cases[c].name, "gpt") ? "llama" : "gpt");
        /* dtrain's logits: the adapter folder alone, its frozen model found through adapter_config.json */
        char meta[900];
        dt_safetensors *h = dt_safetensors_read(meta_file(adapter, meta, sizeof meta));
        dt_model_config mc;
        CHECK(dt__model_config_parse(h, meta, &mc) && mc.lora_rank == 4);
        dt_safetensors_close(h);
        dt_model *m = dt_model_create(&mc, 99);               /* not the runs' seed: every weight comes from the files */
        dt_model_load_weights(m, adapter);
        int shape[2] = { 2, mc.seq_len };
        float x[32];
        for (int i = 0; i < 32; i++) x[i] = (float)((i * 37 + 5) % mc.classes);
        dt_set_grad_enabled(0);
        dt_step_arena_reset();
        dt_tensor *logits = dt_model_forward(m, dt_tensor_from_host(2, shape, x));
        float *y = (float *)malloc(sizeof(float) * (size_t)logits->numel);
        dt_tensor_to_host(logits, y);
        dt_set_grad_enabled(1);
        snprintf(in, sizeof in, "%s/input.f32", dir);
        snprintf(want, sizeof want, "%s/logits.f32", dir);
        write_bytes(in, x, sizeof x);
        write_bytes(want, y, sizeof(float) * (size_t)logits->numel);
        char dims[32];
        snprintf(dims, sizeof dims, "2x%d", mc.seq_len);
        st = run_cmd(out, sizeof out, "%s %s %s %s %s %s %s", py, checker, ck, in, dims, want, adapter);
        CHECKF(st == 0 && strstr(out, "ok: ") && strstr(out, "peft"), "%s: PEFT did not load %s as dtrain does (exit %d):\n%s",
               cases[c].name, adapter, st, out);
        printf("    %s: %s", cases[c].name, out);
        free(y);
        dt_model_free(m);
    }
}

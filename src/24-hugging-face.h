//@ machinery: Hugging Face and PEFT folders (--init), and a training run's checkpoint: weights, optimizer, the run's state
/* ---- Hugging Face folders, LoRA, and a training run's checkpoint ---------------- */

/* Load a model's weights by name (--init), from any safetensors file, a
   checkpoint folder (whole or sharded) or a Hugging Face model folder. A
   missing or misshapen tensor is an error naming it. */
void dt_model_load_weights(dt_model *m, const char *path);

/* Sharded checkpoints (stage 04): a folder in which each rank writes its own
   shard file, "shard<r>-of-<N>.safetensors", and rank 0 then the index,
   "shards.safetensors". --resume and --init take the folder. This turns one
   into a whole checkpoint folder that every stage resumes from and PyTorch,
   transformers and timm read (tools/consolidate). */
void dt_checkpoint_consolidate(const char *path, const char *out_path);
/* LoRA: fold a checkpoint's adapters into its frozen model, W + (alpha/r) B A,
   and write the whole model as a weights folder (model.safetensors and
   config.json) that --init, from_pretrained and timm read. The frozen model
   comes from the folder adapter_config.json names, or else from the seed the
   run started with. tools/merge-lora runs it. */
void dt_lora_merge(const char *adapter_dir, const char *out_path);

/* A run's training checkpoint (the run-driver chapter drives it), a folder: the weights
   (model.safetensors, with the position and RNG seed as metadata), the
   optimizer state (optimizer.safetensors) and config.json. */
typedef struct dt_run dt_run;
void dt_checkpoint_save(dt_run *run, const char *path);
void dt_checkpoint_load(dt_run *r, const char *path);

//@ implementation
/* ---- Hugging Face model folders (--init DIR): config.json gives the shape,
        the weights sit in model.safetensors or in the files that
        model.safetensors.index.json's weight_map names. ---- */

/* A JSON number, true/false (1/0) or null (*is_null); 0 when it is none of them. */
static int dt__json_scalar(dt__json *j, double *v, int *is_null) {
    int c = dt__json_peek(j);
    *is_null = 0;
    if (c < 0) return 0;
    const char *s = j->s + j->pos;
    size_t left = j->len - j->pos;
    if (left >= 4 && !strncmp(s, "true", 4)) { j->pos += 4; *v = 1; return 1; }
    if (left >= 5 && !strncmp(s, "false", 5)) { j->pos += 5; *v = 0; return 1; }
    if (left >= 4 && !strncmp(s, "null", 4)) { j->pos += 4; *is_null = 1; *v = 0; return 1; }
    char num[64];
    size_t n = 0;
    while (n < left && n + 1 < sizeof num && s[n] && (isdigit((unsigned char)s[n]) || strchr("+-.eE", s[n]))) { num[n] = s[n]; n++; }
    num[n] = 0;
    char *end = NULL;
    *v = strtod(num, &end);
    if (!n || *end || !isfinite(*v)) return 0;
    j->pos += n;
    return 1;
}

/* What dtrain reads of a config.json. */
typedef struct dt__hf_config {
    char path[1100];
    char model_type[32], hidden_act[32], rope_type[32];
    /* -1: not in the file */
    double dim, depth, heads, kv_heads, ffn_dim, vocab, max_positions, head_dim, rope_theta, norm_eps, tie, qkv_bias;
    double mlp_bias, sliding_window, use_sliding_window, partial_rotary;
    double experts, experts_per_token, sparse_step, router_aux, router_logits, router_jitter, capacity;   /* Mixtral's, and dtrain's gpt */
    double rope_factor, rope_low_freq, rope_high_freq, rope_original_context;   /* rope_type llama3; 0: not given */
    int has_rope_scaling;
} dt__hf_config;

/* A rope_scaling or rope_parameters object: its rope_type ("default" is no
   rescaling; "llama3" with its factor, low_freq_factor, high_freq_factor and
   original_max_position_embeddings is Llama 3's), rope_theta and
   partial_rotary_factor; any other rope_type, or a rope_scaling of none, is
   rescaled frequencies dtrain does not compute. */
static void dt__hf_rope_object(dt__json *j, dt__hf_config *hc, int is_scaling) {
    dt__json_eat(j, '{');
    while (j->ok && dt__json_peek(j) != '}') {
        char *key = dt__json_str(j);
        dt__json_eat(j, ':');
        if (!key || !j->ok) { free(key); return; }
        double v;
        int is_null;
        if ((!strcmp(key, "rope_type") || !strcmp(key, "type")) && dt__json_peek(j) == '"') {
            char *t = dt__json_str(j);
            dt__copy_str(hc->rope_type, sizeof hc->rope_type, t ? t : "");
            free(t);
        } else if (!strcmp(key, "rope_theta") && dt__json_peek(j) != '"' && dt__json_scalar(j, &v, &is_null)) {
            if (!is_null) hc->rope_theta = v;
        } else if (!strcmp(key, "partial_rotary_factor") && dt__json_peek(j) != '"' && dt__json_scalar(j, &v, &is_null)) {
            if (!is_null) hc->partial_rotary = v;
        } else if ((!strcmp(key, "factor") || !strcmp(key, "low_freq_factor") || !strcmp(key, "high_freq_factor") ||
                    !strcmp(key, "original_max_position_embeddings")) && dt__json_peek(j) != '"' &&
                   dt__json_scalar(j, &v, &is_null)) {
            double *to = !strcmp(key, "factor") ? &hc->rope_factor : !strcmp(key, "low_freq_factor") ? &hc->rope_low_freq
                       : !strcmp(key, "high_freq_factor") ? &hc->rope_high_freq : &hc->rope_original_context;
            if (!is_null) *to = v;
        } else dt__json_skip(j, 0);
        free(key);
        if (dt__json_peek(j) == ',') j->pos++;
    }
    dt__json_eat(j, '}');
    int llama3 = !strcmp(hc->rope_type, "llama3");
    if (!llama3 && (is_scaling ? strcmp(hc->rope_type, "default") != 0 : hc->rope_type[0] && strcmp(hc->rope_type, "default")))
        hc->has_rope_scaling = 1;
}

static void dt__hf_config_read(const char *dir, dt__hf_config *hc) {
    static const struct { const char *key; size_t offset; } fields[] = {
        { "hidden_size", offsetof(dt__hf_config, dim) }, { "n_embd", offsetof(dt__hf_config, dim) },
        { "num_hidden_layers", offsetof(dt__hf_config, depth) }, { "n_layer", offsetof(dt__hf_config, depth) },
        { "num_attention_heads", offsetof(dt__hf_config, heads) }, { "n_head", offsetof(dt__hf_config, heads) },
        { "num_key_value_heads", offsetof(dt__hf_config, kv_heads) }, { "intermediate_size", offsetof(dt__hf_config, ffn_dim) },
        { "n_inner", offsetof(dt__hf_config, ffn_dim) }, { "vocab_size", offsetof(dt__hf_config, vocab) },
        { "max_position_embeddings", offsetof(dt__hf_config, max_positions) },
        { "n_positions", offsetof(dt__hf_config, max_positions) }, { "head_dim", offsetof(dt__hf_config, head_dim) },
        { "rope_theta", offsetof(dt__hf_config, rope_theta) }, { "rms_norm_eps", offsetof(dt__hf_config, norm_eps) },
        { "layer_norm_epsilon", offsetof(dt__hf_config, norm_eps) },
        { "tie_word_embeddings", offsetof(dt__hf_config, tie) }, { "attention_bias", offsetof(dt__hf_config, qkv_bias) },
        { "mlp_bias", offsetof(dt__hf_config, mlp_bias) }, { "sliding_window", offsetof(dt__hf_config, sliding_window) },
        { "use_sliding_window", offsetof(dt__hf_config, use_sliding_window) },
        { "partial_rotary_factor", offsetof(dt__hf_config, partial_rotary) },
        { "num_local_experts", offsetof(dt__hf_config, experts) }, { "num_experts_per_tok", offsetof(dt__hf_config, experts_per_token) },
        { "decoder_sparse_step", offsetof(dt__hf_config, sparse_step) }, { "router_aux_loss_coef", offsetof(dt__hf_config, router_aux) },
        { "output_router_logits", offsetof(dt__hf_config, router_logits) },
        { "router_jitter_noise", offsetof(dt__hf_config, router_jitter) }, { "moe_capacity_factor", offsetof(dt__hf_config, capacity) } };
    memset(hc, 0, sizeof *hc);
    for (int f = 0; f < (int)(sizeof fields / sizeof fields[0]); f++) *(double *)((char *)hc + fields[f].offset) = -1;
    snprintf(hc->path, sizeof hc->path, "%s/config.json", dir);
    size_t len = 0;
    char *text = (char *)dt__read_file(hc->path, &len);
    if (!text) dt_fail("--init %s: a Hugging Face model folder needs %s: %s", dir, hc->path, dt__read_failure());
    dt__json j = { text, 0, len, 1 };
    dt__json_eat(&j, '{');
    while (j.ok && dt__json_peek(&j) != '}') {
        char *key = dt__json_str(&j);
        dt__json_eat(&j, ':');
        if (!key || !j.ok) { free(key); break; }
        int found = -1;
        for (int f = 0; f < (int)(sizeof fields / sizeof fields[0]); f++) if (!strcmp(key, fields[f].key)) found = f;
        int is_string = dt__json_peek(&j) == '"';
        if (found >= 0 && !is_string) {
            double v;
            int is_null;
            if (!dt__json_scalar(&j, &v, &is_null)) dt_fail("'%s': \"%s\" is not a number, true, false or null", hc->path, key);
            /* none of these is ever below 0 (and -1 would read as "not given": n_layer -1 was "no num_hidden_layers") */
            if (!is_null && !(v >= 0)) dt_usage_error("%s: \"%s\": %g is not a valid value (it is never negative)", hc->path, key, v);
            if (!is_null) *(double *)((char *)hc + fields[found].offset) = v;
        } else if ((!strcmp(key, "model_type") || !strcmp(key, "hidden_act")) && is_string) {
            char *v = dt__json_str(&j);
            dt__copy_str(!strcmp(key, "model_type") ? hc->model_type : hc->hidden_act, sizeof hc->model_type, v ? v : "");
            free(v);
        } else if (!strcmp(key, "rope_scaling") || !strcmp(key, "rope_parameters")) {
            /* transformers 4 writes rope_theta beside a rope_scaling (null unless
               the frequencies are rescaled); transformers 5 one rope_parameters
               object holding rope_type and rope_theta */
            double v;
            int is_null = 0;
            if (dt__json_peek(&j) == '{') dt__hf_rope_object(&j, hc, !strcmp(key, "rope_scaling"));
            else if (!dt__json_scalar(&j, &v, &is_null) || !is_null) hc->has_rope_scaling = 1;
        } else dt__json_skip(&j, 0);
        free(key);
        if (dt__json_peek(&j) == ',') j.pos++;
    }
    dt__json_eat(&j, '}');
    if (!j.ok) dt_fail("'%s' is not valid JSON (near byte %zu)", hc->path, j.pos);
    free(text);
    if (!hc->model_type[0]) dt_fail("'%s' has no \"model_type\": which architecture is it?", hc->path);
}

/* The files of a folder's weights: model.safetensors, or every file the
   index's weight_map names (each once, in the order first named). */
static int dt__hf_weight_files(const char *dir, char ***files) {
    char path[1100];
    struct stat s;
    *files = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (stat(path, &s) == 0) {
        *files = (char **)malloc(sizeof(char *));
        if (!*files || !((*files)[0] = strdup(path))) dt_fail("out of memory (--init %s)", dir);
        return 1;
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    size_t len = 0;
    char *text = (char *)dt__read_file(path, &len);
    if (!text)
        dt_fail("--init %s: no model.safetensors and no model.safetensors.index.json in the folder (%s)", dir, dt__read_failure());
    dt__json j = { text, 0, len, 1 };
    int n = 0, have_map = 0;
    dt__json_eat(&j, '{');
    while (j.ok && dt__json_peek(&j) != '}') {
        char *key = dt__json_str(&j);
        dt__json_eat(&j, ':');
        if (key && !strcmp(key, "weight_map") && dt__json_eat(&j, '{')) {
            have_map = 1;
            while (j.ok && dt__json_peek(&j) != '}') {
                char *tensor = dt__json_str(&j), *file = (dt__json_eat(&j, ':'), dt__json_str(&j));
                if (file && (strchr(file, '/') || !strcmp(file, "..")))
                    dt_fail("'%s': weight_map names '%s', not a file of this folder", path, file);
                int seen = 0;
                for (int k = 0; file && k < n; k++) seen |= !strcmp(strrchr((*files)[k], '/') + 1, file);
                if (file && !seen) {
                    char full[1400];
                    snprintf(full, sizeof full, "%s/%s", dir, file);
                    char **grown = (char **)realloc(*files, sizeof(char *) * (size_t)(n + 1));
                    if (!grown || !(grown[n] = strdup(full))) dt_fail("out of memory (--init %s)", dir);
                    *files = grown;
                    n++;
                }
                free(tensor); free(file);
                if (dt__json_peek(&j) == ',') j.pos++;
            }
            dt__json_eat(&j, '}');
        } else dt__json_skip(&j, 0);
        free(key);
        if (dt__json_peek(&j) == ',') j.pos++;
    }
    dt__json_eat(&j, '}');
    if (!j.ok || !have_map || !n) dt_fail("'%s' is not an index of weights (valid JSON with a non-empty \"weight_map\")", path);
    free(text);
    return n;
}

/* A Hugging Face folder's weights: each tensor from the file that holds it.
   A tied model's lm_head (when the folder has one) is the embedding again. */
/* A tensor of the folder that no parameter takes: a part of the model dtrain
   would leave out (an MLP bias, say) unless it is one of the buffers and tied
   copies Hugging Face's files carry. */
static int dt__hf_spare_tensor(const dt_model *m, const char *name) {
    size_t l = strlen(name);
    const char *tail = l >= 10 ? name + l - 10 : "";
    if (!strcmp(name, "lm_head.weight") && !dt_model_param((dt_model *)m, "lm_head.weight")) return 1;   /* tied head */
    if (l >= 19 && !strcmp(name + l - 19, "rotary_emb.inv_freq")) return 1;     /* older Llama files' buffer */
    return !strcmp(tail, ".attn.bias") || (l >= 17 && !strcmp(name + l - 17, ".attn.masked_bias"));   /* GPT-2's masks */
}
static void dt__load_hf_folder(dt_model *m, const char *dir, float *host) {
    char **files = NULL;
    int nfiles = dt__hf_weight_files(dir, &files), *found = (int *)calloc((size_t)m->nparams, sizeof(int));
    if (!found) dt_fail("out of memory (--init %s)", dir);
    for (int f = 0; f < nfiles; f++) {
        dt_safetensors *st = dt_safetensors_read(files[f]);
        for (int k = 0; k < st->n; k++) {
            const char *name = st->t[k].name, *bare = strncmp(name, "transformer.", 12) ? name : name + 12;
            if (!dt_model_param(m, bare) && !dt__hf_spare_tensor(m, name))
                dt_fail("--init %s: '%s' holds '%s', which this model has no place for (%s); a part dtrain would drop", dir,
                        files[f], name, dt__family(m->cfg.kind)->name);
        }
        for (int i = 0; i < m->nparams; i++) {
            dt_tensor *p = &m->params[i];
            char prefixed[200];
            snprintf(prefixed, sizeof prefixed, "transformer.%s", p->name);     /* GPT2LMHeadModel's names */
            int more_rows = !strcmp(p->name, "wpe.weight");
            if (!found[i] && (dt__safetensors_get_rows(st, p->name, host + m->offsets[i], p->ndim, p->shape, more_rows) ||
                              dt__safetensors_get_rows(st, prefixed, host + m->offsets[i], p->ndim, p->shape, more_rows)))
                found[i] = 1;
        }
        dt_safetensors_close(st);
        free(files[f]);
    }
    free(files);
    for (int i = 0; i < m->nparams; i++)
        if (!found[i]) dt_fail("--init %s: no weight file of the folder holds '%s'", dir, m->params[i].name);
    free(found);
}

/* How --init reads a folder. A Hugging Face model folder takes its shape from
   config.json, and dtrain's own gpt and llama checkpoints are such folders;
   its mlp and vit checkpoints (whose config.json is not transformers') and
   sharded ones are read by name, as a file is. */
static int dt__folder_is_hf(const char *dir) {
    char file[4200];
    if (dt__checkpoint_file(dir, "shards.safetensors", file, sizeof file)) return 0;
    if (dt__checkpoint_file(dir, "adapter_config.json", file, sizeof file)) return 0;     /* LoRA's: read by name */
    if (!dt__checkpoint_file(dir, "model.safetensors", file, sizeof file)) return 1;
    dt_safetensors *st = dt__safetensors_read_header(file);
    const char *kind = dt_safetensors_meta(st, "model");
    int hf = !dt_safetensors_meta(st, "dtrain_format") || !kind;
    for (int f = 0; !hf && f < DT__NFAMILIES; f++) hf = !strcmp(kind, dt__model_families[f].name) && dt__model_families[f].language;
    dt_safetensors_close(st);
    return hf;
}

/* The config.json beside a checkpoint's weights: the model's shape in the words
   of the library that has the same model -- transformers for gpt (GPT2LMHeadModel)
   and llama (LlamaForCausalLM, or Qwen2ForCausalLM when q, k and v have biases,
   the one difference between the two), timm for vit (what timm writes when it
   pushes a model to the Hub). A plain MLP has no such library: its file names
   the layers for whoever rebuilds it (tests/hf_load_check.py does). */
static void dt__mlp_config_json(FILE *f, const dt_model_config *c) {
    fprintf(f, "{\n  \"dtrain_model\": \"mlp\",\n  \"layers\": \"fc1 .. fc%d, nn.Linear each, exact GELU between; the image "
            "flattened (channels, rows, columns) first\",\n  \"in_features\": %d,\n  \"hidden_size\": %d,\n"
            "  \"num_hidden_layers\": %d,\n  \"num_classes\": %d\n}\n", c->depth + 1,
            c->channels * c->image_size * c->image_size, c->dim, c->depth, c->classes);
}
static void dt__vit_config_json(FILE *f, const dt_model_config *c) {
    /* timm's registered names fix nothing here: model_args overrides every shape.
       timm's MLP is int(dim * mlp_ratio) wide: a ratio that rounds below is nudged. */
    double ratio = (double)c->mlp_hidden / c->dim;
    if ((int)(c->dim * ratio) != c->mlp_hidden) ratio = (c->mlp_hidden + 0.5) / c->dim;
    fprintf(f, "{\n  \"architecture\": \"vit_base_patch16_224\",\n  \"num_classes\": %d,\n  \"num_features\": %d,\n"
            "  \"global_pool\": \"token\",\n  \"model_args\": {\"img_size\": %d, \"patch_size\": %d, \"in_chans\": %d, "
            "\"embed_dim\": %d, \"depth\": %d, \"num_heads\": %d, \"mlp_ratio\": %.17g, \"num_classes\": %d},\n"
            "  \"pretrained_cfg\": {\"input_size\": [%d, %d, %d], \"num_classes\": %d}\n}\n", c->classes, c->dim,
            c->image_size, c->patch, c->channels, c->dim, c->depth, c->heads, ratio, c->classes,
            c->channels, c->image_size, c->image_size, c->classes);
}
/* A float as JSON that reads back as a float (transformers checks the type): 8 is written 8.0. */
static const char *dt__json_float(char *out, size_t n, float v) {
    snprintf(out, n, "%.9g", (double)v);
    if (!strpbrk(out, ".eEn")) snprintf(out + strlen(out), n - strlen(out), ".0");
    return out;
}
/* A config.json's "{" and the experts' keys: Mixtral's names (Qwen2-MoE's decoder_sparse_step for a
   gpt's every N-th block); the capacity factor is dtrain's (Mixtral drops nothing: transformers reads past it). */
static void dt__config_open(FILE *f, const dt_model_config *c) {
    char coef[32], cap[32];
    if (fprintf(f, "{\n") && !c->moe_experts) return;
    fprintf(f, "  \"num_local_experts\": %d,\n  \"num_experts_per_tok\": %d,\n  \"router_aux_loss_coef\": %s,\n"
            "  \"output_router_logits\": %s,\n  \"router_jitter_noise\": 0.0,\n", c->moe_experts, c->moe_top_k,
            dt__json_float(coef, sizeof coef, c->moe_aux_loss), c->moe_aux_loss > 0 ? "true" : "false");
    if (c->kind == DT_MODEL_GPT) fprintf(f, "  \"decoder_sparse_step\": %d,\n", c->moe_every);
    if (c->moe_capacity > 0) fprintf(f, "  \"moe_capacity_factor\": %s,\n", dt__json_float(cap, sizeof cap, c->moe_capacity));
}
/* GPT-2 with experts has no transformers class: its own model_type, which
   from_pretrained refuses by name rather than load without its experts. */
static void dt__gpt_config_json(FILE *f, const dt_model_config *c) {
    dt__config_open(f, c);
    fprintf(f, "  \"model_type\": \"%s\",\n  \"architectures\": [\"%s\"],\n  \"vocab_size\": %d,\n"
            "  \"n_positions\": %d,\n  \"n_embd\": %d,\n  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": %d,\n"
            "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n  \"tie_word_embeddings\": true,\n"
            "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"torch_dtype\": \"float32\"\n}\n",
            c->moe_experts ? "dtrain_gpt2_moe" : "gpt2", c->moe_experts ? "dtrain's GPT-2 with experts" : "GPT2LMHeadModel",
            c->classes, c->seq_len, c->dim, c->depth, c->heads, c->mlp_hidden);
}
static void dt__llama_config_json(FILE *f, const dt_model_config *c) {
    char scaling[256] = "null", a[32], b[32], d[32];
    if (c->rope_factor > 0)
        snprintf(scaling, sizeof scaling, "{\"rope_type\": \"llama3\", \"factor\": %s, \"low_freq_factor\": %s, "
                 "\"high_freq_factor\": %s, \"original_max_position_embeddings\": %d}", dt__json_float(a, sizeof a, c->rope_factor),
                 dt__json_float(b, sizeof b, c->rope_low_freq), dt__json_float(d, sizeof d, c->rope_high_freq),
                 c->rope_original_context);
    const char *type = c->moe_experts ? "mixtral" : c->qkv_bias ? "qwen2" : "llama";
    const char *arch = c->moe_experts ? "MixtralForCausalLM" : c->qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
    dt__config_open(f, c);
    fprintf(f, "  \"model_type\": \"%s\",\n  \"architectures\": [\"%s\"],\n  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n"
            "  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n"
            "  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n  \"max_position_embeddings\": %d,\n  \"rope_theta\": %.9g,\n"
            "  \"rope_scaling\": %s,\n  \"rms_norm_eps\": %.9g,\n  \"hidden_act\": \"silu\",\n  \"tie_word_embeddings\": %s,\n"
            "%s  \"attention_dropout\": 0.0,\n  \"torch_dtype\": \"float32\"\n}\n", type, arch, c->classes, c->dim, c->mlp_hidden,
            c->depth, c->heads, c->kv_heads, c->dim / c->heads, c->seq_len, (double)c->rope_theta, scaling, (double)c->norm_eps,
            c->untied_head ? "false" : "true",
            c->moe_experts ? "  \"sliding_window\": null,\n" : c->qkv_bias ? "  \"use_sliding_window\": false,\n"
                                                                     : "  \"attention_bias\": false,\n  \"mlp_bias\": false,\n");
}

static void (*const dt__config_jsons[])(FILE *f, const dt_model_config *c) = {     /* in dt_model_kind's order */
    dt__mlp_config_json, dt__vit_config_json, dt__gpt_config_json, dt__llama_config_json };
static void dt__config_json(FILE *f, const dt_model_config *c) { dt__config_jsons[c->kind](f, c); }

/* -- LoRA's folder (PEFT's layout). -- */
static int dt__folder_is_adapter(const char *dir) {
    char file[4200];
    struct stat s;
    return stat(dir, &s) == 0 && S_ISDIR(s.st_mode) && dt__checkpoint_file(dir, "adapter_config.json", file, sizeof file);
}
/* "rank,alpha,targets": what a checkpoint's metadata says of its adapters */
static void dt__lora_string(const dt_model *m, char *out, size_t n) {
    snprintf(out, n, "%d,%.9g,%s", m->cfg.lora_rank, (double)m->cfg.lora_alpha, m->cfg.lora_targets);
}
static void dt__adapter_config_json(FILE *f, const dt_model *m) {
    const dt_model_config *c = &m->cfg;
    char alpha[32];
    fprintf(f, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": %s,\n  \"base_model_name_or_path\": ",
            dt_model_is_language(c->kind) ? "\"CAUSAL_LM\"" : "null");
    if (m->base_source) dt__json_string(f, m->base_source);
    else fprintf(f, "null");
    fprintf(f, ",\n  \"r\": %d,\n  \"lora_alpha\": %s,\n  \"lora_dropout\": 0.0,\n  \"target_modules\": [", c->lora_rank,
            dt__json_float(alpha, sizeof alpha, c->lora_alpha));
    for (const char *t = c->lora_targets; *t;) {
        size_t len = strcspn(t, ",");
        fprintf(f, "%s\"%.*s\"", t == c->lora_targets ? "" : ", ", (int)len, t);
        t += len + (t[len] == ',');
    }
    /* GPT-2's Conv1D stores its weight [in, out]: PEFT's fan_in_fan_out */
    fprintf(f, "],\n  \"fan_in_fan_out\": %s,\n  \"bias\": \"none\",\n  \"inference_mode\": true,\n"
               "  \"init_lora_weights\": true,\n  \"modules_to_save\": null,\n  \"use_rslora\": false,\n  \"use_dora\": false,\n"
               "  \"revision\": null\n}\n", c->kind == DT_MODEL_GPT ? "true" : "false");
}
typedef struct dt__lora_config {
    char path[4200];
    int rank;
    double alpha;
    char targets[256];
    char base[1024];            /* base_model_name_or_path; "" when null */
} dt__lora_config;
static void dt__lora_config_read(const char *dir, dt__lora_config *lc) {
    memset(lc, 0, sizeof *lc);
    dt__path(lc->path, sizeof lc->path, "%s/adapter_config.json", dir);
    size_t len = 0;
    char *text = (char *)dt__read_file(lc->path, &len);
    if (!text) dt_fail("cannot read '%s': %s", lc->path, dt__read_failure());
    dt__json j = { text, 0, len, 1 };
    int lora = 0;
    double v;
    int is_null;
    dt__json_eat(&j, '{');
    while (j.ok && dt__json_peek(&j) != '}') {
        char *key = dt__json_str(&j);
        dt__json_eat(&j, ':');
        if (!key || !j.ok) { free(key); break; }
        if (!strcmp(key, "peft_type") || !strcmp(key, "base_model_name_or_path")) {
            char *val = dt__json_peek(&j) == '"' ? dt__json_str(&j) : NULL;
            if (!val && !(dt__json_scalar(&j, &v, &is_null) && is_null))
                dt_fail("'%s': \"%s\" is not a string", lc->path, key);
            if (!strcmp(key, "peft_type")) lora = val && !strcmp(val, "LORA");
            else dt__copy_str(lc->base, sizeof lc->base, val ? val : "");
            free(val);
        } else if (!strcmp(key, "r") || !strcmp(key, "lora_alpha")) {
            if (!dt__json_scalar(&j, &v, &is_null) || is_null || !(v > 0) || (!strcmp(key, "r") && (v != floor(v) || v > 65536)))
                dt_fail("'%s': \"%s\" is not a positive number%s", lc->path, key, !strcmp(key, "r") ? " (a whole one)" : "");
            if (!strcmp(key, "r")) lc->rank = (int)v;
            else lc->alpha = v;
        } else if (!strcmp(key, "target_modules")) {
            size_t used = 0;
            int list = dt__json_peek(&j) == '[';
            if (list) j.pos++;
            while (j.ok && dt__json_peek(&j) == '"') {
                char *t = dt__json_str(&j);
                int w = t ? snprintf(lc->targets + used, sizeof lc->targets - used, "%s%s", used ? "," : "", t) : 0;
                if (w < 0 || (size_t)w >= sizeof lc->targets - used) dt_fail("'%s': \"target_modules\" is too long", lc->path);
                used += (size_t)w;
                free(t);
                if (!list || dt__json_peek(&j) != ',') break;
                j.pos++;
            }
            if (list) dt__json_eat(&j, ']');
            if (!used) dt_fail("'%s': \"target_modules\" is not a list of layer names", lc->path);
        } else if (!strcmp(key, "use_dora") || !strcmp(key, "use_rslora")) {
            if (!dt__json_scalar(&j, &v, &is_null)) dt_fail("'%s': \"%s\" is not true or false", lc->path, key);
            if (!is_null && v != 0) dt_fail("'%s': %s adapters; dtrain's LoRA is the plain kind", lc->path, key + 4);
        } else if (!strcmp(key, "bias")) {
            char *val = dt__json_peek(&j) == '"' ? dt__json_str(&j) : NULL;
            int none = val && !strcmp(val, "none");
            free(val);
            if (!none) dt_fail("'%s': \"bias\" is not \"none\"; dtrain's adapters train no biases", lc->path);
        } else if (!strcmp(key, "modules_to_save") || !strcmp(key, "layers_to_transform") || !strcmp(key, "layers_pattern") ||
                   !strcmp(key, "rank_pattern") || !strcmp(key, "alpha_pattern")) {
            /* options that change the model: only their empty values are dtrain's LoRA */
            int c = dt__json_peek(&j), empty = 0;
            if (c == '[' || c == '{') {
                size_t at = j.pos;
                j.pos++;
                empty = dt__json_peek(&j) == (c == '[' ? ']' : '}');
                j.pos = at;
                dt__json_skip(&j, 0);
            } else empty = dt__json_scalar(&j, &v, &is_null) && is_null;
            if (!empty) dt_fail("'%s': \"%s\" is set; dtrain's LoRA has no such option", lc->path, key);
        } else dt__json_skip(&j, 0);
        free(key);
        if (dt__json_peek(&j) == ',') j.pos++;
    }
    dt__json_eat(&j, '}');
    if (!j.ok) dt_fail("'%s' is not valid JSON (near byte %zu)", lc->path, j.pos);
    free(text);
    if (!lora) dt_fail("'%s' is no LoRA adapter (its \"peft_type\" is not \"LORA\")", lc->path);
    if (!lc->rank || !(lc->alpha > 0) || !lc->targets[0])
        dt_fail("'%s' lacks \"%s\"", lc->path, !lc->rank ? "r" : !(lc->alpha > 0) ? "lora_alpha" : "target_modules");
}

/* A frozen model drawn from a seed is that seed's: the adapters of another
   seed's would load without a word, and mean nothing. */
static void dt__lora_check_seed(const dt_model *m, dt_safetensors *st, const char *path) {
    const char *s = dt_safetensors_meta(st, "lora_base_seed");
    unsigned long long theirs = s ? strtoull(s, NULL, 10) : 0;
    if (s && theirs != (unsigned long long)m->base_seed)
        dt_fail("'%s' holds adapters of the random frozen model of seed %llu, this run's is seed %llu's: run with --seed %llu", path,
                theirs, (unsigned long long)m->base_seed, theirs);
}
/* The file of an adapter folder whose metadata says what it holds: adapter_model.safetensors, or a
   sharded one's index. */
static int dt__adapter_weights(const char *dir, char *out, size_t n) {
    return dt__checkpoint_file(dir, "adapter_model.safetensors", out, n) || dt__checkpoint_file(dir, "shards.safetensors", out, n);
}
static char *dt__strdup(const char *s) {
    char *c = strdup(s);
    if (!c) dt_fail("out of memory (copying '%.200s')", s);
    return c;
}

static void dt__load_weights(dt_model *m, const char *path);
/* A LoRA model's --init: the frozen model's weights (a file or folder of
   the base), or an adapter folder -- its base, named in adapter_config.json,
   then its adapters. */
static void dt__lora_load(dt_model *m, const char *path) {
    char file[4200];
    const char *base = path;
    if (dt__folder_is_adapter(path)) {
        dt__lora_config lc;
        char ours[320], theirs[320];
        dt__lora_config_read(path, &lc);
        dt__lora_string(m, ours, sizeof ours);
        snprintf(theirs, sizeof theirs, "%d,%.9g,%s", lc.rank, (double)(float)lc.alpha, lc.targets);
        if (strcmp(ours, theirs))
            dt_fail("--init %s: its adapters are rank,alpha,targets %s; this model's are %s", path, theirs, ours);
        if (!dt__adapter_weights(path, file, sizeof file))
            dt_fail("--init %s: an adapter folder without adapter_model.safetensors (or a sharded run's shards.safetensors)", path);
        base = lc.base[0] ? lc.base : NULL;
        if (base) {
            dt_model_load_weights(m->base, base);
            free(m->base_source);
            m->base_source = dt__strdup(base);
        } else if (!m->base_source) {
            dt_safetensors *st = dt__safetensors_read_header(file);
            dt__lora_check_seed(m, st, st->path);
            dt_safetensors_close(st);
        }
        dt__load_weights(m, path);          /* the folder: whole, or sharded */
        return;
    }
    dt_model_load_weights(m->base, base);
    free(m->base_source);
    m->base_source = dt__strdup(base);
}

void dt_model_load_weights(dt_model *m, const char *path) {
    if (m->base) dt__lora_load(m, path);
    else dt__load_weights(m, path);
}
static int dt__hf_spare_tensor(const dt_model *m, const char *name);
static void dt__load_weights(dt_model *model, const char *path) {
    if (model->left_cut_by && !model->parallel)
        dt_fail("loading '%s': %s has run and this model holds only this rank's pieces; load before it", path,
                model->left_cut_by);
    dt_model *m = dt__state_layout(model);
    struct stat s;
    char file[4200];
    int dir = stat(path, &s) == 0 && S_ISDIR(s.st_mode);
    if (dir && dt__folder_is_hf(path)) {
        float *host = dt__state_open(model, NULL, 0, 1);
        dt__load_hf_folder(m, path, host);
        for (int i = 0; i < m->nparams; i++)
            for (int64_t k = 0; k < m->params[i].numel; k++)
                if (!isfinite(host[m->offsets[i] + k]))
                    dt_fail("'%s': tensor '%s' holds NaN/Inf at index %lld", path, m->params[i].name, (long long)k);
        dt__state_close(model, NULL, 0, host, 1);
        return;
    }
    if (dir && !dt__checkpoint_file(path, "shards.safetensors", file, sizeof file))
        dt__checkpoint_weights(path, file, sizeof file);
    if (dir) path = file;
    dt_safetensors *st = dt_safetensors_read(path);
    float *host = dt__state_open(model, NULL, 0, 1);
    if (dt__is_sharded(st)) {
        float *state[3] = { host, NULL, NULL };
        char dir[4200];
        const char *slash = strrchr(path, '/');
        dt__path(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
        dt__sharded_assemble(st, dir, m, 0, state);
    } else
        for (int i = 0; i < m->nparams; i++) {
            /* Hugging Face's files name GPT-2's tensors with or without "transformer."
               (GPT2LMHeadModel or GPT2Model), and hold 1024 positions: the first
               --seq-len of them are taken. */
            dt_tensor *p = &m->params[i];
            int gpt = m->cfg.kind == DT_MODEL_GPT, more_rows = gpt && !strcmp(p->name, "wpe.weight");
            char prefixed[200];
            snprintf(prefixed, sizeof prefixed, "transformer.%s", p->name);
            if (!dt__safetensors_get_rows(st, p->name, host + m->offsets[i], p->ndim, p->shape, more_rows) &&
                !(gpt && dt__safetensors_get_rows(st, prefixed, host + m->offsets[i], p->ndim, p->shape, more_rows)))
                dt_fail("'%s' has no tensor '%s' (it holds %d tensors; is it a checkpoint of this model?)", path,
                        p->name, st->n);
        }
    /* Every tensor of the file is one of the model's: a file of another model, or one with a tensor misnamed, is
       not half taken. What Hugging Face's files hold beside the weights is let be (dt__hf_spare_tensor). */
    for (int k = 0; k < st->n && !dt__is_sharded(st); k++) {
        const char *name = st->t[k].name, *own = m->cfg.kind == DT_MODEL_GPT && !strncmp(name, "transformer.", 12) ? name + 12 : name;
        if (!dt__hf_spare_tensor(m, name) && !dt_model_param(m, own))
            dt_fail("'%s' holds tensor '%s', which this model does not have (%s has %d parameters; is the file of another "
                    "model?)", path, name, dt__model_kind_name(m->cfg.kind), m->nparams);
    }
    /* A NaN here would first show as a NaN loss, and that blames --lr. */
    for (int i = 0; i < m->nparams; i++)
        for (int64_t k = 0; k < m->params[i].numel; k++)
            if (!isfinite(host[m->offsets[i] + k]))
                dt_fail("'%s': tensor '%s' holds NaN/Inf at index %lld", path, m->params[i].name, (long long)k);
    dt__state_close(model, NULL, 0, host, 1);
    dt_safetensors_close(st);
}

/* A checkpoint's "model_config": the shape's numbers, comma-separated, in this
   order; a family writes the first `numbers` of them (its row of the models
   chapter's table), and a model with experts the last four after them. */
typedef struct dt__config_number { const char *name; size_t offset; int is_float; } dt__config_number;
#define DT__CN(field, f) { #field, offsetof(dt_model_config, field), f }
static const dt__config_number dt__config_numbers[] = {
    DT__CN(channels, 0), DT__CN(image_size, 0), DT__CN(classes, 0), DT__CN(dim, 0), DT__CN(depth, 0), DT__CN(heads, 0),
    DT__CN(patch, 0), DT__CN(mlp_hidden, 0), DT__CN(seq_len, 0), DT__CN(kv_heads, 0), DT__CN(untied_head, 0),
    DT__CN(qkv_bias, 0), DT__CN(rope_theta, 1), DT__CN(norm_eps, 1), DT__CN(rope_factor, 1), DT__CN(rope_low_freq, 1),
    DT__CN(rope_high_freq, 1), DT__CN(rope_original_context, 0),
    DT__CN(moe_experts, 0), DT__CN(moe_top_k, 0), DT__CN(moe_every, 0), DT__CN(moe_capacity, 1) };
#undef DT__CN

#define DT__MOE_NUMBERS 4
/* Number k of a model's shape: the family's first ones, then the experts'. */
static const dt__config_number *dt__config_number_at(dt_model_kind kind, int k) {
    int own = dt__family(kind)->numbers, all = (int)(sizeof dt__config_numbers / sizeof dt__config_numbers[0]);
    return &dt__config_numbers[k < own ? k : all - DT__MOE_NUMBERS + (k - own)];
}
static int dt__config_count(const dt_model_config *mc) { return dt__family(mc->kind)->numbers + (mc->moe_experts ? DT__MOE_NUMBERS : 0); }
/* The names of a shape's numbers, comma-separated: "channels,image_size,...". */
static void dt__config_names(const dt_model_config *mc, char *out, size_t n) {
    size_t used = 0;
    out[0] = 0;
    for (int k = 0; k < dt__config_count(mc) && used < n; k++) {
        int w = snprintf(out + used, n - used, "%s%s", k ? "," : "", dt__config_number_at(mc->kind, k)->name);
        used += w > 0 ? (size_t)w : 0;
    }
}

/* A model's shape as a checkpoint's "model_config". */
static void dt__model_config_string(const dt_model_config *mc, char *out, size_t n) {
    size_t used = 0;
    out[0] = 0;
    for (int k = 0; k < dt__config_count(mc) && used < n; k++) {
        const dt__config_number *c = dt__config_number_at(mc->kind, k);
        const char *field = (const char *)mc + c->offset;
        int w = c->is_float ? snprintf(out + used, n - used, "%s%.9g", k ? "," : "", (double)*(const float *)field)
                                               : snprintf(out + used, n - used, "%s%d", k ? "," : "", *(const int *)field);
        used += w > 0 ? (size_t)w : 0;
    }
}

static int dt__model_config_parse(dt_safetensors *st, const char *path, dt_model_config *mc) {
    const char *kind = dt_safetensors_meta(st, "model"), *shape = dt_safetensors_meta(st, "model_config");
    memset(mc, 0, sizeof *mc);
    if (!kind || !shape) return 0;
    int found = -1;
    for (int f = 0; f < DT__NFAMILIES; f++)
        if (!strcmp(kind, dt__model_families[f].name)) found = f;
    if (found < 0) return 0;
    mc->kind = (dt_model_kind)found;
    int commas = 0, got = 0, ok = 1;
    for (const char *p = shape; *p; p++) commas += *p == ',';
    mc->moe_experts = commas + 1 == dt__model_families[found].numbers + DT__MOE_NUMBERS;   /* the experts' four, after */
    int want = dt__config_count(mc);
    char names[400];
    dt__config_names(mc, names, sizeof names);
    for (const char *p = shape; ok && *p; got++) {
        char *end = NULL;
        errno = 0;
        double v = strtod(p, &end);
        ok = end != p && !errno && isfinite(v) && v >= 0 && got < want && (*end == ',' || !*end);
        if (!ok) break;
        const dt__config_number *c = dt__config_number_at(mc->kind, got);
        char *field = (char *)mc + c->offset;
        if (c->is_float) ok = v <= FLT_MAX, *(float *)field = (float)v;
        else if (v == floor(v) && v <= INT_MAX) *(int *)field = (int)v;
        else ok = 0;
        p = *end ? end + 1 : end;
    }
    if (!ok || got != want)
        dt_fail("'%s': metadata 'model_config' is '%s', not %s's %d numbers separated by commas (%s)", path, shape, kind,
                want, names);
    const char *lora = dt_safetensors_meta(st, "lora");      /* "rank,alpha,targets" */
    int used = 0;
    if (lora && (sscanf(lora, "%d,%f,%n", &mc->lora_rank, &mc->lora_alpha, &used) != 2 || !used || mc->lora_rank < 1 ||
                 !(mc->lora_alpha > 0) || strlen(lora + used) >= sizeof mc->lora_targets || !lora[used]))
        dt_fail("'%s': metadata 'lora' is '%s', not RANK,ALPHA,TARGETS", path, lora);
    if (lora) dt__copy_str(mc->lora_targets, sizeof mc->lora_targets, lora + used);
    return 1;
}

void dt_checkpoint_consolidate(const char *path, const char *out_path) {
    dt_safetensors *st = dt__checkpoint_open(path);
    dt_model_config mc;
    if (!dt__is_sharded(st)) dt_fail("'%s' is not a sharded checkpoint (it has no shards.safetensors): it is whole already", path);
    if (!dt__model_config_parse(st, st->path, &mc))
        dt_fail("'%s' does not say which model it holds ('model', 'model_config')", st->path);
    const char *opt = dt_safetensors_meta(st, "optimizer");
    int adamw = opt && !strcmp(opt, "adamw");
    dt_model *m = dt_model_create(&mc, 0);            /* for the names, shapes and units only */
    const char *lora_base = dt_safetensors_meta(st, "lora_base");
    if (m->base && lora_base && *lora_base) m->base_source = dt__strdup(lora_base);    /* for adapter_config.json */
    const char *base_seed = dt_safetensors_meta(st, "lora_base_seed");
    if (base_seed) m->base_seed = strtoull(base_seed, NULL, 10);
    float *state[3] = { NULL, NULL, NULL };
    for (int k = 0; k < (adamw ? 3 : 2); k++)
        if (!(state[k] = (float *)malloc((size_t)m->numel * sizeof(float)))) dt_fail("out of memory (consolidating)");
    dt__sharded_assemble(st, path, m, adamw, state);
    dt__meta_list meta = { NULL, 0 };                  /* the index's, less the layout of the shards */
    dt__meta_add(&meta, "format", "pt");
    dt__meta_add(&meta, "dtrain_format", "checkpoint-2");
    for (int i = 0; i < st->nmeta; i++) {
        const char *key = st->meta[2 * i];
        if (strcmp(key, "format") && strcmp(key, "dtrain_format") && strcmp(key, "shards") && strcmp(key, "unit_numel") &&
            strncmp(key, "shard.", 6))
            dt__meta_add(&meta, key, "%s", st->meta[2 * i + 1]);
    }
    dt__folder w;
    dt__folder_open(&w, out_path, 1);
    dt__folder_write_whole(&w, m, adamw, state, &meta, (int64_t)dt__meta_whole(st, st->path, "step", 0, INT64_MAX));
    dt__folder_commit(&w);
    for (int k = 0; k < 3; k++) free(state[k]);
    dt__meta_free(&meta);
    dt_model_free(m);
    dt_safetensors_close(st);
}

void dt_lora_merge(const char *adapter_dir, const char *out_path) {
    char file[4200];
    if (!dt__folder_is_adapter(adapter_dir)) dt_fail("'%s' is not a LoRA adapter folder (no adapter_config.json)", adapter_dir);
    if (!dt__adapter_weights(adapter_dir, file, sizeof file))
        dt_fail("'%s' holds no adapter_model.safetensors (nor a sharded run's shards.safetensors)", adapter_dir);
    dt_safetensors *st = dt__safetensors_read_header(file);
    dt_model_config mc;
    if (!dt__model_config_parse(st, st->path, &mc) || !mc.lora_rank)
        dt_fail("'%s' does not say which model its adapters belong to (metadata 'model', 'model_config', 'lora': dtrain "
                "writes them)", st->path);
    const char *seed = dt_safetensors_meta(st, "lora_base_seed");
    dt_model *m = dt_model_create(&mc, seed ? strtoull(seed, NULL, 10) : 1);   /* the frozen model of a run without --init */
    dt_safetensors_close(st);
    dt_model_load_weights(m, adapter_dir);
    dt_model *base = m->base;
    int gpt = mc.kind == DT_MODEL_GPT;
    float *w = dt__host_view(base->device, base->flat_data, base->numel), *ad = dt__host_view(m->device, m->flat_data, m->numel);
    for (int i = 0; i < base->nparams; i++) {
        int a = m->lora_of[i], r = mc.lora_rank;
        if (a < 0) continue;
        const dt_tensor *A = &m->params[a], *B = &m->params[a + 1];
        int in = A->shape[1], out = B->shape[0];
        float *W = w + base->offsets[i];
        const float *Av = ad + m->offsets[a], *Bv = ad + m->offsets[a + 1];
        for (int o = 0; o < out; o++)
            for (int k = 0; k < in; k++) {
                double d = 0;
                for (int j = 0; j < r; j++) d += (double)Bv[(size_t)o * r + j] * Av[(size_t)j * in + k];
                W[gpt ? (size_t)k * out + o : (size_t)o * in + k] += (float)(m->lora_scale * d);
            }
    }
    dt__meta_list meta = { NULL, 0 };
    char shape[512];
    dt__model_config_string(&base->cfg, shape, sizeof shape);
    dt__meta_add(&meta, "format", "pt");
    dt__meta_add(&meta, "dtrain_format", "merged-lora-1");
    dt__meta_add(&meta, "model", "%s", dt__model_kind_name(mc.kind));
    dt__meta_add(&meta, "model_config", "%s", shape);
    dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)base->nparams, sizeof *t);
    if (!t) dt_fail("out of memory (merging '%s')", adapter_dir);
    for (int i = 0; i < base->nparams; i++) {
        const dt_tensor *p = &base->params[i];
        t[i].name = p->name; t[i].data = w + base->offsets[i]; t[i].ndim = p->ndim;
        for (int d = 0; d < p->ndim; d++) t[i].shape[d] = p->shape[d];
    }
    dt__folder f;
    dt__folder_open(&f, out_path, 1);
    dt__folder_write_config(&f, base);
    dt__folder_file(&f, "model.safetensors", file, sizeof file);
    dt_safetensors_write(file, t, base->nparams, (const char *const *)meta.kv, meta.n);
    dt__folder_wrote(&f, file);
    dt__folder_commit(&f);
    free(t);
    dt__meta_free(&meta);
    dt__host_view_close(base->device, w, base->flat_data, base->numel, 0);
    dt__host_view_close(m->device, ad, m->flat_data, m->numel, 0);
    dt_model_free(m);
}

/* -- the checkpoint of a training run: weights, optimizer state and the run's
      position, in a folder: whole, or a file per rank and an index (stage 04
      shards it) -- */

static void dt__describe_position(const dt_run *r, char *out, size_t n, const char *what) {
    const char *model = dt__model_kind_name(r->model->cfg.kind);
    long long start = (long long)r->cfg.start_idx, end = (long long)(r->cfg.start_idx + r->loader->ds->n);
    dt__path(out, n, "%s/%s_data%lld-%lld_%s", r->cfg.save_dir, model, start, end, what);
}

/* How many replicas share each step's batch: ranks, or devices of stage 02. */
/* The replicas that each take their own share of a step's samples: ranks
   (the ranks of a tensor-parallel group share one: the loader's world) times
   stage 02's devices. */
static int dt__data_parallel_width(const dt_run *r) { return r->loader->world * (dt__ctx.devices > 1 ? dt__ctx.devices : 1); }

/* What a checkpoint says about the run, beside its tensors. "format": "pt" is
   what transformers' from_pretrained asks of a weights file; dtrain's own
   layout is "dtrain_format". */
static void dt__checkpoint_meta(const dt_run *r, dt__meta_list *l, const char *format) {
    const dt_model_config *mc = &r->model->cfg;
    dt__meta_add(l, "format", "pt");
    dt__meta_add(l, "dtrain_format", "%s", format);
    char shape[512];
    dt__model_config_string(mc, shape, sizeof shape);
    dt__meta_add(l, "model", "%s", dt__model_kind_name(mc->kind));
    dt__meta_add(l, "model_config", "%s", shape);
    dt__meta_add(l, "optimizer", "%s", r->opt->kind == DT_ADAMW ? "adamw" : "sgd");
    dt__meta_add(l, "optimizer_step", "%lld", (long long)r->opt->step);
    dt__meta_add(l, "step", "%lld", (long long)r->step);
    dt__meta_add(l, "epoch", "%d", r->epoch);
    dt__meta_add(l, "batch_in_epoch", "%lld", (long long)r->batch_in_epoch);
    dt__meta_add(l, "seed", "%llu", (unsigned long long)r->cfg.seed);
    dt__meta_add(l, "world_size", "%d", dt__data_parallel_width(r));
    dt__meta_add(l, "data_range", "%lld,%lld", (long long)r->cfg.start_idx, (long long)(r->cfg.start_idx + r->loader->ds->n));
    dt__meta_add(l, "batch_size", "%d", r->cfg.batch_size);
    dt__meta_add(l, "accum_steps", "%d", r->cfg.accum_steps);
    if (r->has_loss) dt__meta_add(l, "loss", "%.17g", r->last_loss);   /* the last step's: the run's final loss */
    if (r->has_best) {                 /* --early-stop and --save-best go on from here */
        dt__meta_add(l, "best_eval_loss", "%.17g", r->best_eval_loss);
        dt__meta_add(l, "best_step", "%lld", (long long)r->best_step);
        dt__meta_add(l, "evals_since_best", "%d", r->evals_since_best);
    }
    if (r->eval_pending) dt__meta_add(l, "eval_pending", "1");     /* stopped where an evaluation was due */
    if (r->mlflow_run_id[0]) dt__meta_add(l, "mlflow_run_id", "%s", r->mlflow_run_id);
    if (r->tensorboard_run[0]) dt__meta_add(l, "tensorboard_run", "%s", r->tensorboard_run);
    if (r->model->base) {
        char lora[320];
        dt__lora_string(r->model, lora, sizeof lora);
        dt__meta_add(l, "lora", "%s", lora);
        dt__meta_add(l, "lora_base", "%s", r->model->base_source ? r->model->base_source : "");   /* "": the seed's */
        if (!r->model->base_source) dt__meta_add(l, "lora_base_seed", "%llu", (unsigned long long)r->model->base_seed);
    }
    if (r->scaler.enabled) {
        dt__meta_add(l, "loss_scale", "%.9g", r->scaler.scale);
        dt__meta_add(l, "loss_scale_good_steps", "%lld", (long long)r->scaler.good_steps);
        dt__meta_add(l, "skipped_steps", "%lld", (long long)r->scaler.skipped);
    }
}

/* Sharded (FSDP): every rank writes its shard into the folder rank 0 made;
   then, once all are on disk, rank 0 the index and config.json, and renames
   the folder. The shards are the model's units, each cut into `world` equal
   slices (the last padded), rank r keeping slice r of each, in unit order. */
static void dt__checkpoint_save_sharded(dt_run *r, const char *path, const dt_shard_view *f) {
    dt_optimizer *o = r->opt;
    const dt_model *m = r->model;
    dt_device where = f->where;
    float *const *own = f->state, *state[3] = { NULL, NULL, NULL };
    const char *names[3] = { "params", o->kind == DT_ADAMW ? "optimizer.exp_avg" : "optimizer.momentum_buffer",
                             "optimizer.exp_avg_sq" };
    dt_named_tensor t[3];
    int n = 0;
    dt__folder w;
    dt__folder_open(&w, path, f->rank == 0);
    dt_barrier(f->comm);                     /* the folder is there before anyone writes into it */
    for (int k = 0; k < 3; k++) {
        if (!own[k]) continue;
        state[k] = dt__host_view(where, own[k], f->numel);
        t[n].name = names[k]; t[n].data = state[k]; t[n].ndim = 1; t[n].shape[0] = f->numel;
        n++;
    }
    char file[4200];
    dt__meta_list meta = { NULL, 0 };
    dt__shard_path(file, sizeof file, w.tmp, f->rank, f->world);
    dt__meta_add(&meta, "dtrain_format", "shard-2");
    dt__meta_add(&meta, "rank", "%d", f->rank);
    dt__meta_add(&meta, "shards", "%d", f->world);
    dt__meta_add(&meta, "step", "%lld", (long long)r->step);
    dt_safetensors_write(file, t, n, (const char *const *)meta.kv, meta.n);
    dt__folder_wrote(&w, file);
    dt__meta_free(&meta);
    for (int k = 0; k < 3; k++) if (state[k]) dt__host_view_close(where, state[k], own[k], f->numel, 0);
    dt_barrier(f->comm);                     /* every shard is on disk before the index names it */
    if (f->rank != 0) {
        dt_barrier(f->comm);                 /* until rank 0 has renamed the folder, a failure removes the shards */
        dt__folder_forget(&w);
        return;
    }
    dt__checkpoint_meta(r, &meta, "sharded-checkpoint-2");
    dt__meta_add(&meta, "shards", "%d", f->world);
    char *units = (char *)malloc((size_t)m->nunits * 24 + 1), *p = units;
    for (int k = 0; k < m->nunits; k++) {
        int64_t end = m->unit_first[k + 1] < m->nparams ? m->offsets[m->unit_first[k + 1]] : m->numel;
        p += sprintf(p, k ? ",%lld" : "%lld", (long long)(end - m->offsets[m->unit_first[k]]));
    }
    dt__meta_add(&meta, "unit_numel", "%s", units);
    free(units);
    for (int k = 0; k < f->world; k++) {
        char key[32];
        struct stat s;
        dt__shard_path(file, sizeof file, w.tmp, k, f->world);
        if (stat(file, &s) != 0) dt_fail("shard %d of '%s', '%s', is not there after the save: %s", k, path, file, strerror(errno));
        snprintf(key, sizeof key, "shard.%d.bytes", k);
        dt__meta_add(&meta, key, "%lld", (long long)s.st_size);
    }
    dt__folder_write_config(&w, r->model);
    dt__folder_file(&w, "shards.safetensors", file, sizeof file);
    dt_safetensors_write(file, NULL, 0, (const char *const *)meta.kv, meta.n);
    dt__folder_wrote(&w, file);
    dt__folder_commit(&w);
    dt__meta_free(&meta);
    dt_barrier(f->comm);
}

void dt_checkpoint_save(dt_run *run, const char *path) {
    dt_model *m = run->model;
    dt_optimizer *o = run->opt;
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    dt_shard_view shards;
    if (rep && rep->shards && rep->shards(who, o, &shards)) { dt__checkpoint_save_sharded(run, path, &shards); return; }
    float *state[3] = { dt__state_open(m, o, 0, 0), dt__state_open(m, o, 1, 0), o->v ? dt__state_open(m, o, 2, 0) : NULL };
    if (state[0]) {                                   /* a wrapper that gathers gives the whole to one rank */
        dt__meta_list meta = { NULL, 0 };
        dt__checkpoint_meta(run, &meta, "checkpoint-2");
        dt__folder w;
        dt__folder_open(&w, path, 1);
        dt__folder_write_whole(&w, dt__state_layout(m), o->kind == DT_ADAMW, state, &meta, run->step);
        dt__folder_commit(&w);
        dt__meta_free(&meta);
    }
    for (int k = 0; k < 3; k++) dt__state_close(m, o, k, state[k], 0);
}

/* A resumed state holding NaN or Inf would first show as a NaN loss, which
   blames --lr; AdamW's second moment (a mean of squares) is never negative.
   Element j of state k (0 weights, 1 and 2 the moments), `what` naming it. */
static void dt__check_resumed(const char *path, const char *what, int k, int adamw, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        if (!isfinite(x[j]))
            dt_fail("'%s': %s holds %s at index %lld (the run that saved it had diverged? resume from an earlier checkpoint)",
                    path, what, isnan(x[j]) ? "NaN" : "Inf", (long long)j);
        if (adamw && k == 2 && x[j] < 0)
            dt_fail("'%s': %s is %g at index %lld, but AdamW's second moment is never negative (a corrupt file?)", path,
                    what, x[j], (long long)j);
    }
}

void dt_checkpoint_load(dt_run *r, const char *path) {
    dt_safetensors *st = dt__checkpoint_open(path);
    dt_model *m = r->model;
    dt_optimizer *o = r->opt;
    const dt_model_config *mc = &m->cfg;
    char want[512], desc[256], names[400];
    dt__meta_required(st, st->path, "dtrain_format");
    dt__model_config_string(mc, want, sizeof want);
    const char *kind = dt__meta_required(st, st->path, "model"), *shape = dt__meta_required(st, st->path, "model_config");
    dt_model_describe(m, desc, sizeof desc);
    dt_model_config theirs;
    if (strcmp(kind, dt__model_kind_name(mc->kind)) || strcmp(shape, want)) {
        if (dt__model_config_parse(st, st->path, &theirs)) dt__config_names(&theirs, names, sizeof names);  /* its own kind's */
        else dt__copy_str(names, sizeof names, "a model dtrain does not know");
        dt_fail("'%s' holds a %s model (%s = %s) but this run builds %s (%s)", path, kind, names, shape, desc, want);
    }
    const char *lora = dt_safetensors_meta(st, "lora"), *lora_base = dt_safetensors_meta(st, "lora_base");
    char lora_want[320] = "";
    if (m->base) dt__lora_string(m, lora_want, sizeof lora_want);
    if (strcmp(lora ? lora : "", lora_want))
        dt_fail("'%s' holds %s%s%s, but this run trains %s%s%s", path, lora ? "LoRA adapters (rank,alpha,targets " : "a whole model",
                lora ? lora : "", lora ? ")" : "", m->base ? "LoRA adapters (" : "the whole model", lora_want, m->base ? ")" : "");
    if (m->base && strcmp(lora_base ? lora_base : "", m->base_source ? m->base_source : ""))
        dt_fail("'%s' holds adapters of the model in '%s', but this run's frozen model is %s%s%s: resume with --init %s", path,
                lora_base && *lora_base ? lora_base : "(the seed's random weights)", m->base_source ? "'" : "",
                m->base_source ? m->base_source : "the seed's random weights", m->base_source ? "'" : "",
                lora_base && *lora_base ? lora_base : "left out");
    if (m->base && !m->base_source) dt__lora_check_seed(m, st, path);
    /* Rank r takes samples r, r + N, r + 2N, ... of the epoch's order, so a step
       of N ranks x B images takes the same N*B samples at any N: a run may
       resume at another world size when the samples per step stay the same. */
    /* Micro-batches (--accum-steps) follow the same rule: a step is K batches. */
    /* ranks times stage 02's devices; bounded so that a step's samples fit in 64 bits */
    int world = (int)dt__meta_whole(st, st->path, "world_size", 1, DT_MAX_RANKS * DT_MAX_RANKS);
    int batch = (int)dt__meta_whole(st, st->path, "batch_size", 1, INT_MAX);
    int accum = dt_safetensors_meta(st, "accum_steps") ? (int)dt__meta_whole(st, st->path, "accum_steps", 1, 1 << 20) : 1;
    int K = r->cfg.accum_steps, now = dt__data_parallel_width(r);
    long long samples = (long long)world * batch * accum, samples_now = (long long)now * r->cfg.batch_size * K;
    if (samples != samples_now) {
        long long per = (long long)now * K, other = samples % per == 0 ? samples / per : 0;
        char hint[96] = "", had_k[32] = "", now_k[32] = "", flag_k[32] = "";
        if (other > 0 && other <= INT_MAX) snprintf(hint, sizeof hint, " --batch-size %lld at this world size, or", other);
        if (accum > 1) snprintf(had_k, sizeof had_k, " x %d micro-batches", accum);
        if (K > 1) snprintf(now_k, sizeof now_k, " x %d micro-batches", K);
        if (accum > 1 || K > 1) snprintf(flag_k, sizeof flag_k, " --accum-steps %d", accum);
        /* Under tensor parallelism the ranks that read different data are the
           groups of --tp ranks: a group reads one share. */
        int group = dt__ctx.job ? dt__ctx.world_size / r->loader->world : 1;
        char what[48] = "ranks", tp[32] = "";
        if (group > 1) {
            snprintf(what, sizeof what, "data-parallel groups");
            snprintf(tp, sizeof tp, " --tp %d", group);
        }
        dt_fail("'%s' was written by %d %s, this run has %d: it took %d x %d%s = %lld samples a step, this run "
                "%d x %d%s = %lld; to continue its data order and schedule resume with%s --nproc %d%s --batch-size %d%s "
                "(--init takes the weights alone)", path, world, what, now, world, batch, had_k, samples, now,
                r->cfg.batch_size, now_k, samples_now, hint, world * group, tp, batch, flag_k);
    }
    if (strcmp(dt__meta_required(st, st->path, "optimizer"), o->kind == DT_ADAMW ? "adamw" : "sgd"))
        dt_fail("'%s' holds %s state but this run uses --optimizer %s", path, dt_safetensors_meta(st, "optimizer"),
                o->kind == DT_ADAMW ? "adamw" : "sgd");
    /* The position. A finished epoch took a step at least, so epoch <= step;
       an epoch's count of steps starts over when it ends, so a checkpoint of a
       run of this shape (the same data, ranks, batch and micro-batches) is
       never past the last step of an epoch. */
    uint64_t s0 = 0, s1 = 0, range[2];
    const char *data_range = dt__meta_required(st, st->path, "data_range");
    if (dt__whole_numbers(data_range, range, 2) != 2 || (s0 = range[0]) >= (s1 = range[1]) || s1 > (uint64_t)INT64_MAX)
        dt_fail("'%s': metadata 'data_range' is '%s', not FIRST,END: two whole numbers, FIRST < END", st->path, data_range);
    int same_data = s0 == (uint64_t)r->cfg.start_idx && s1 == (uint64_t)(r->cfg.start_idx + r->loader->ds->n);
    int same_steps = same_data && world == now && batch == r->cfg.batch_size && accum == K;
    int64_t step = (int64_t)dt__meta_whole(st, st->path, "step", 0, INT64_MAX);
    int64_t optimizer_step = (int64_t)dt__meta_whole(st, st->path, "optimizer_step", 0, (uint64_t)step);
    int epoch = (int)dt__meta_whole(st, st->path, "epoch", 0, (uint64_t)(step < INT_MAX ? step : INT_MAX));
    int64_t batch_in_epoch = (int64_t)dt__meta_whole(st, st->path, "batch_in_epoch", 0,
                                                    (uint64_t)(same_steps ? r->batches_per_epoch - 1 : step));
    uint64_t seed = dt__meta_whole(st, st->path, "seed", 0, UINT64_MAX);
    const char *mlflow_run = dt_safetensors_meta(st, "mlflow_run_id");   /* --mlflow continues that run */
    if (mlflow_run && (strlen(mlflow_run) != 32 || strspn(mlflow_run, "0123456789abcdef") != 32))
        dt_fail("'%s': metadata 'mlflow_run_id' is '%.40s', not an MLflow run id (32 lowercase hex digits)", st->path, mlflow_run);
    dt__copy_str(r->mlflow_run_id, sizeof r->mlflow_run_id, mlflow_run ? mlflow_run : "");
    const char *tb_run = dt_safetensors_meta(st, "tensorboard_run");     /* --tensorboard goes on in that folder */
    if (tb_run && (!*tb_run || strchr(tb_run, '/') || strstr(tb_run, "..") || strlen(tb_run) >= sizeof r->tensorboard_run))
        dt_fail("'%s': metadata 'tensorboard_run' is '%.60s', not the name of a run's folder", st->path, tb_run);
    dt__copy_str(r->tensorboard_run, sizeof r->tensorboard_run, tb_run ? tb_run : "");
    const char *best = dt_safetensors_meta(st, "best_eval_loss");    /* the best evaluation so far, when there was one */
    char *best_end = NULL;
    double best_loss = best ? strtod(best, &best_end) : 0;
    if (best && (best_end == best || *best_end || !isfinite(best_loss)))
        dt_fail("'%s': metadata 'best_eval_loss' is '%.40s', not a finite number", st->path, best);
    int64_t best_step = best ? (int64_t)dt__meta_whole(st, st->path, "best_step", 0, (uint64_t)step) : 0;
    int evals_since_best = best ? (int)dt__meta_whole(st, st->path, "evals_since_best", 0, INT_MAX) : 0;
    int eval_pending = dt_safetensors_meta(st, "eval_pending") ? (int)dt__meta_whole(st, st->path, "eval_pending", 0, 1) : 0;
    const char *loss = dt_safetensors_meta(st, "loss");          /* the last step's; older checkpoints have none */
    char *loss_end = NULL;
    double last_loss = loss ? strtod(loss, &loss_end) : 0;
    if (loss && (loss_end == loss || *loss_end || !isfinite(last_loss)))
        dt_fail("'%s': metadata 'loss' is '%.40s', not a finite number", st->path, loss);
    int fp16 = dt_safetensors_meta(st, "loss_scale") && r->scaler.enabled;   /* fp16 goes on with the scale it had found */
    float scale = fp16 ? dt__meta_positive(st, st->path, "loss_scale") : 0;
    int64_t good_steps = fp16 ? (int64_t)dt__meta_whole(st, st->path, "loss_scale_good_steps", 0, (uint64_t)step) : 0;
    int64_t skipped = fp16 ? (int64_t)dt__meta_whole(st, st->path, "skipped_steps", 0, (uint64_t)step) : 0;
    int adamw = o->kind == DT_ADAMW;
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    dt_shard_view shards, *f = rep && rep->shards && rep->shards(who, o, &shards) ? &shards : NULL;
    if (dt__is_sharded(st) && f && dt__sharded_layout_is(st, path, m, f->world)) {
        /* the same shards: each rank reads its own file, and only that */
        dt_device where = f->where;
        float *const *own = f->state;
        char file[4096];
        for (int k = 0; k < f->world; k++) dt__shard_check(st, path, k, f->world, file, sizeof file);
        dt_safetensors *sh = dt__shard_open(st, path, f->rank, f->world);
        for (int k = 0; k < 3; k++) {
            if (!own[k]) continue;
            float *host = dt__host_view(where, own[k], f->numel);
            dt__shard_get(sh, adamw, k, host, f->numel);
            char what[96];
            snprintf(what, sizeof what, "rank %d's shard of the %s", f->rank, k ? dt__moment_name(adamw, k) : "weights");
            dt__check_resumed(sh->path, what, k, adamw, host, f->numel);
            dt__host_view_close(where, host, own[k], f->numel, 1);
        }
        dt_safetensors_close(sh);
        if (who->step_done) who->step_done(who);   /* ZeRO-1, -2: every rank's whole copy from the new shards */
    } else {
        float *state[3] = { dt__state_open(m, o, 0, 1), dt__state_open(m, o, 1, 1), o->v ? dt__state_open(m, o, 2, 1) : NULL };
        dt_model *L = dt__state_layout(m);
        if (dt__is_sharded(st)) dt__sharded_assemble(st, path, L, adamw, state);
        else {
            /* the weights from model.safetensors, the moments from optimizer.safetensors of the same save */
            char file[4200];
            dt__checkpoint_file(path, "optimizer.safetensors", file, sizeof file);
            dt_safetensors *moments = dt_safetensors_read(file);
            const char *theirs = dt_safetensors_meta(moments, "step"), *ours = dt_safetensors_meta(st, "step");
            if (!theirs || strcmp(theirs, ours))
                dt_fail("'%s' is not the optimizer state of '%s' (it says step %s, the weights step %s)", file, st->path,
                        theirs ? theirs : "?", ours);
            for (int i = 0; i < L->nparams; i++)
                for (int k = 0; k < 3; k++) {
                    dt_tensor *p = &L->params[i];
                    char name[256];
                    dt_safetensors *from = k ? moments : st;
                    if (!state[k]) continue;
                    dt__state_tensor_name(name, sizeof name, adamw, k, p);
                    if (!dt_safetensors_get(from, name, state[k] + L->offsets[i], p->ndim, p->shape))
                        dt_fail("'%s' has no tensor '%s'", from->path, name);
                }
            dt_safetensors_close(moments);
        }
        for (int k = 0; k < 3; k++)
            for (int i = 0; state[k] && i < L->nparams; i++) {
                char name[256], what[300];
                dt__state_tensor_name(name, sizeof name, adamw, k, &L->params[i]);
                snprintf(what, sizeof what, "tensor '%s'", name);
                dt__check_resumed(path, what, k, adamw, state[k] + L->offsets[i], L->params[i].numel);
            }
        for (int k = 0; k < 3; k++) dt__state_close(m, o, k, state[k], 1);
    }
    o->step = optimizer_step;
    r->step = step;
    r->has_loss = loss != NULL;
    r->last_loss = last_loss;
    r->has_best = best != NULL;
    r->best_eval_loss = best_loss;
    r->best_step = best_step;
    r->evals_since_best = evals_since_best;
    r->eval_pending = eval_pending;
    r->epoch = epoch;
    r->batch_in_epoch = batch_in_epoch;
    r->cfg.seed = seed;
    r->loader->seed = r->cfg.seed;
    if (fp16) {
        r->scaler.scale = scale;
        r->scaler.good_steps = good_steps;
        r->scaler.skipped = skipped;
    }
    if (!same_data)
        dt_warn("'%s' was trained on images [%llu, %llu), this run uses [%lld, %lld): the data order will differ",
                path, (unsigned long long)s0, (unsigned long long)s1, (long long)r->cfg.start_idx,
                (long long)(r->cfg.start_idx + r->loader->ds->n));
    if ((batch != r->cfg.batch_size || accum != K) && !r->cfg.quiet && dt__ctx.rank == 0)
        printf("resuming '%s' (%d ranks x %d x %d micro-batches) as %d ranks x %d x %d: the same samples each step\n",
               path, world, batch, accum, now, r->cfg.batch_size, K);
    dt_safetensors_close(st);
}

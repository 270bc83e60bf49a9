//@ machinery: the command line -- one table of flags for every stage
/* ---- the command line --------------------------------------------------- */

typedef struct dt_config {
    const char *stage;
    const char *data;            /* NULL: the synthetic set in data/synthetic (gpt: data/synthetic.txt) */
    const char *tokens;          /* --tokens: a file of uint16 token ids instead of text */
    int image_size;
    dt_model_kind model;
    int dim, depth, heads, patch;
    int seq_len, vocab;          /* gpt, llama: context in tokens; vocabulary (-1: from the data) */
    int kv_heads, ffn_dim;       /* llama: key/value heads, SwiGLU width (0: the defaults) */
    float rope_theta;            /* llama: the rotary embeddings' base */
    int untied_head, qkv_bias;   /* llama: an lm_head of its own; q, k, v biases (Qwen2) */
    float norm_eps;              /* llama: RMSNorm's epsilon (0: 1e-5) */
    float rope_factor, rope_low_freq, rope_high_freq;   /* llama: Llama 3's rescaling, from --init DIR's config.json */
    int rope_original_context;
    int sample;                  /* --sample N: gpt prints N generated tokens at each evaluation */
    int moe_experts, moe_top_k, moe_every;   /* gpt, llama: a mixture of experts (0: none), k a token, every N-th block */
    float moe_capacity, moe_aux_loss;        /* its capacity factor (0: no limit), its balancing loss's coefficient */
    int batch_size, epochs;
    int64_t steps;               /* stop after this many steps (0: run every epoch) */
    float lr, weight_decay, momentum, clip;
    int64_t warmup;              /* -1: 5% of the steps */
    dt_optimizer_kind optimizer;
    uint64_t seed;
    dt_device device;
    const char *log_path, *trace_path, *save_dir, *resume, *init;
    const char *tensorboard;     /* --tensorboard DIR: TensorBoard event files of the scalars */
    const char *mlflow;          /* --mlflow DIR|URL: the run in MLflow's file store, or on its tracking server */
    int eval_every, augment;
    int early_stop, save_best;   /* --early-stop N (0: off), --save-best */
    int log_every;               /* a progress line every N steps (0: about every 3 s, and at each epoch's end) */
    int64_t start_idx, end_idx;  /* end -1: the whole set */
    int bench;
    int quiet;
    float peak_tflops;           /* --bench on a GPU: the peak for MFU (0: look it up by name) */
    int nproc;                   /* --nproc: devices of stage 02, or ranks to start on this machine (03-05) */
    float bucket_mb;             /* --bucket-mb: DDP's gradient buckets (0: one all-reduce after backward) */
    int shard;                   /* --shard: what FSDP shards (a dt_shard_mode; default full; 07: none) */
    int cpu_offload;             /* --cpu-offload: FSDP's shards and optimizer in host memory */
    int quantize_weights;        /* --quantize-weights: 0 none, 1 int8 (ZeRO++'s qwZ) */
    int quantize_grads;          /* --quantize-grads: 0 none, 1 int8, 2 int4 (qgZ) */
    int hierarchical;            /* --hierarchical: a second copy of the weights per machine (hpZ) */
    int quant_block;             /* --quant-block: values per scale (default 256) */
    int ranks_per_machine;       /* --ranks-per-machine: 0, the launcher's machines; N, every N ranks one */
    dt_zeropp zeropp;            /* the five above, as dt_fsdp_set_zeropp takes them */
    int tp;                      /* --tp: ranks per tensor-parallel group (0: every rank of the job) */
    int sequence_parallel;       /* --sequence-parallel: the rows between the split layers split too */
    int pp;                      /* --pp: ranks per pipeline, each a stage of consecutive blocks (0: every rank) */
    int micro_batches;           /* --micro-batches: the pipeline's micro-batches per step (default 1; times --accum-steps) */
    int schedule;                /* --schedule: a dt_pp_schedule (default 1f1b) */
    int cp;                      /* --cp: ranks per context-parallel group (0: every rank of the job) */
    int cp_layout;               /* --cp-layout: a dt_cp_layout (default zig-zag) */
    int ep;                      /* --ep: ranks per expert-parallel group (0: every rank of the job) */
    int recompute;               /* --recompute: each block's activations made again in backward */
    int attention;               /* --attention: DT_ATTENTION_MATMUL or _ONLINE (the CPU's attention body) */
    int lora_rank;               /* --lora-rank: LoRA adapters of this rank on a frozen model (0: none) */
    float lora_alpha;            /* --lora-alpha: their scale is alpha / rank (default 8, PEFT's) */
    const char *lora_targets;    /* --lora-targets: the layers that get one (NULL: the model's default) */
    int accum_steps;             /* --accum-steps: micro-batches per optimizer step (05) */
    int dtype, reduce_dtype;     /* --dtype, --reduce-dtype: a dt_dtype each (05) */
    int explain;                 /* --explain: the cost model's prediction for this run, after 3 steps */
    int link;                    /* --link: the link the prediction assumes (-1: shm on a CPU, nvlink on GPUs) */
    int link_across;             /* --link-across: the link between machines (-1: infiniband) */
    float timeout;               /* --timeout: seconds before a missing rank stops the job */
    dt_comm_kind comm;           /* --comm: the collectives' transport (auto: NCCL on GPUs, else decided at dt_comm_init) */
    int ranks_per_gpu;           /* --ranks-per-gpu: how many ranks may share one GPU (default 1) */
    int rank, world_size, local_rank;   /* this process's place in the job (from the environment) */
    int local_ranks;             /* ranks on this machine (0: the launcher did not say) */
} dt_config;

/* Parse the shared command line; a wrong flag, a value out of its range or a
   flag of another stage exits with status 2. */
dt_config dt_parse_args(int argc, char **argv, const char *stage);
/* The model config the flags describe, for images of this shape. */
dt_model_config dt_model_config_from(const dt_config *cfg, int channels, int image_size, int classes);
/* A tool's numeric flag: TEXT as a number from LO to HI (a whole one when
   WHOLE), or a usage error naming FLAG -- "--reps x" is not 0 calls. Read
   by strtod, so 1e3 and 32.0 are whole numbers too. */
double dt_flag_number(const char *flag, const char *text, double lo, double hi, int whole);

/* Load --data (or make the synthetic set), applying --image-size and the slice.
   With --bench: random images in memory instead, enough for a few batches; the
   stage's own loop then times its steps (two warm-up steps, then about three
   seconds, or --steps) and dt_run_finish prints one "bench:" line. */
void dt_load_data(const dt_config *cfg, dt_dataset *train, dt_dataset *val);

//@ implementation
/* ==== the command line ======================================================
   Every stage takes the same flags (and those of its own lesson: one table,
   dt__flags, says which stage takes which), so that runs of different stages
   can be compared line by line -- and so that the stage files hold only the
   lesson. The flags also say what data to load (dt_load_data). */

typedef enum { DT_ARG_INT, DT_ARG_I64, DT_ARG_FLOAT, DT_ARG_STR, DT_ARG_SWITCH, DT_ARG_CHOICE } dt__arg_type;
enum { DT_LO_OPEN = 1, DT_HI_OPEN = 2 };
typedef struct dt__flag {
    const char *name;
    const char *stages;          /* the stages that take it, by number: "45" is 04-fsdp and 05 */
    const char *metavar, *help;
    dt__arg_type type;
    size_t offset;               /* where in dt_config the value goes */
    const char *choices;         /* DT_ARG_CHOICE: "a|b|c", stored as the index */
    double lo, hi;               /* a number: the values it may take (DT_LO_OPEN, DT_HI_OPEN: the bound itself not) */
    int open;
} dt__flag;

/* The stages, numbered as in the stages column. A program of another name (a
   tool, a test) takes every flag. */
static const char *const dt__stage_names[] = { "01-single-gpu", "02-dp", "03-ddp", "04-fsdp", "05-accum-mixed-precision",
                                                "06-tensor-parallel", "07-pipeline-parallel", "08-context-parallel",
                                                "09-expert-parallel" };
static char dt__stage_digit(const char *stage) {
    for (int i = 0; i < (int)(sizeof dt__stage_names / sizeof dt__stage_names[0]); i++)
        if (!strcmp(stage, dt__stage_names[i])) return (char)('1' + i);
    return 0;
}

#define DT_CFG(field) offsetof(dt_config, field)
#define DT_MIN(lo) lo, HUGE_VAL, 0               /* lo or more */
#define DT_ABOVE(lo) lo, HUGE_VAL, DT_LO_OPEN    /* more than lo */
#define DT_RANGE(lo, hi) lo, hi, 0
#define DT_NOT_A_NUMBER 0, 0, 0
static const dt__flag dt__flags[] = {
    { "--data", "123456789", "DIR", "image folder (DIR/train/<class>/*, DIR/val/<class>/*) or CIFAR-10 binary folder; gpt: a .txt\n"
      "                          file or a folder of them, read as bytes (default: the synthetic set in data/synthetic,\n"
      "                          gpt: the text data/synthetic.txt, made on first use)", DT_ARG_STR, DT_CFG(data), NULL, DT_NOT_A_NUMBER },
    { "--tokens", "123456789", "FILE", "gpt, llama: train on token ids instead of bytes: a NumPy .npy array (uint16, uint32,\n"
      "                          int32 or int64), or raw little-endian uint16", DT_ARG_STR,
      DT_CFG(tokens), NULL, DT_NOT_A_NUMBER },
    { "--image-size", "123456789", "N", "images are resized to N x N (default 32)", DT_ARG_INT, DT_CFG(image_size), NULL, DT_RANGE(1, 4096) },
    { "--model", "123456789", "mlp|vit|gpt|llama", "the model (default mlp); gpt, llama: causal language models on text\n"
      "                          (GPT-2's layout, and Llama's: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)",
      DT_ARG_CHOICE, DT_CFG(model), "mlp|vit|gpt|llama", DT_NOT_A_NUMBER },
    { "--dim", "123456789", "N", "mlp: hidden width (1024); vit: embedding width (192); gpt, llama: (128)", DT_ARG_INT, DT_CFG(dim), NULL, DT_MIN(1) },
    { "--depth", "123456789", "N", "mlp: hidden layers (2); vit: transformer blocks (6); gpt, llama: (4)", DT_ARG_INT, DT_CFG(depth), NULL, DT_MIN(0) },
    { "--heads", "123456789", "N", "vit: attention heads (3); gpt, llama: (4)", DT_ARG_INT, DT_CFG(heads), NULL, DT_MIN(1) },
    { "--patch", "123456789", "N", "vit: patch size (4)", DT_ARG_INT, DT_CFG(patch), NULL, DT_MIN(1) },
    { "--seq-len", "123456789", "N", "gpt, llama: tokens per sequence, the context (default 64)", DT_ARG_INT, DT_CFG(seq_len), NULL, DT_RANGE(1, 65536) },
    { "--vocab", "123456789", "N", "gpt, llama: vocabulary (default: 256 for bytes, the largest id + 1 for --tokens)", DT_ARG_INT,
      DT_CFG(vocab), NULL, DT_RANGE(1, 16777216) },             /* ids are held as floats: exact to 2^24 */
    { "--sample", "123456789", "N", "gpt, llama: print N generated tokens (bytes) after each evaluation (default 0)", DT_ARG_INT,
      DT_CFG(sample), NULL, DT_MIN(0) },
    { "--moe-experts", "123459", "E", "gpt, llama: a mixture of E expert MLPs in place of the MLP, each token sent to\n"
      "                          --moe-top-k of them (default 0: none; llama: Mixtral's layout)", DT_ARG_INT, DT_CFG(moe_experts),
      NULL, DT_RANGE(0, 4096) },
    { "--moe-top-k", "123459", "K", "the experts each token goes to (default 2, or 1 with one expert)", DT_ARG_INT, DT_CFG(moe_top_k),
      NULL, DT_MIN(1) },
    { "--moe-every", "123459", "N", "gpt: experts in every N-th block only, the others dense (default 1: every block)", DT_ARG_INT,
      DT_CFG(moe_every), NULL, DT_MIN(1) },
    { "--moe-capacity", "123459", "C", "each expert takes at most C x K x tokens / E of a batch's choices, the rest dropped\n"
      "                          (default 0: no limit)", DT_ARG_FLOAT, DT_CFG(moe_capacity), NULL, DT_MIN(0) },
    { "--moe-aux-loss", "123459", "X", "the load-balancing loss's coefficient (Switch Transformer's; default 0: none)", DT_ARG_FLOAT,
      DT_CFG(moe_aux_loss), NULL, DT_MIN(0) },
    { "--kv-heads", "123456789", "N", "llama: key/value heads, each serving --heads / N query heads (default: half the heads\n"
      "                          when their number is even, else all of them)", DT_ARG_INT, DT_CFG(kv_heads), NULL, DT_MIN(1) },
    { "--ffn-dim", "123456789", "N", "llama: the SwiGLU MLP's width (default 8/3 x --dim, rounded up to a multiple of 32)",
      DT_ARG_INT, DT_CFG(ffn_dim), NULL, DT_MIN(1) },
    { "--rope-theta", "123456789", "X", "llama: the rotary embeddings' base (default 10000)", DT_ARG_FLOAT, DT_CFG(rope_theta), NULL,
      DT_ABOVE(1) },
    { "--norm-eps", "123456789", "X", "llama: RMSNorm's epsilon (default 1e-5)", DT_ARG_FLOAT, DT_CFG(norm_eps), NULL, DT_ABOVE(0) },
    { "--rope-factor", "123456789", "X", "llama: Llama 3's rescaled rotary frequencies (rope_type llama3, with the three below;\n"
      "                          default: none, or --init DIR's config.json): slow ones divided by X", DT_ARG_FLOAT,
      DT_CFG(rope_factor), NULL, DT_ABOVE(0) },
    { "--rope-low-freq", "123456789", "X", "llama 3: wavelengths over ORIGINAL / X are divided by --rope-factor", DT_ARG_FLOAT,
      DT_CFG(rope_low_freq), NULL, DT_ABOVE(0) },
    { "--rope-high-freq", "123456789", "X", "llama 3: wavelengths under ORIGINAL / X are kept (between: blended)", DT_ARG_FLOAT,
      DT_CFG(rope_high_freq), NULL, DT_ABOVE(0) },
    { "--rope-original-context", "123456789", "ORIGINAL", "llama 3: the context the frequencies were made for", DT_ARG_INT,
      DT_CFG(rope_original_context), NULL, DT_MIN(1) },
    { "--untied-head", "123456789", NULL, "llama: an lm_head.weight of its own (default: the head is the token embedding)",
      DT_ARG_SWITCH, DT_CFG(untied_head), NULL, DT_NOT_A_NUMBER },
    { "--qkv-bias", "123456789", NULL, "llama: biases on the q, k and v projections, as Qwen2 has", DT_ARG_SWITCH, DT_CFG(qkv_bias),
      NULL, DT_NOT_A_NUMBER },
    { "--batch-size", "123456789", "N", "images (gpt, llama: sequences) per step (default 128; gpt, llama 32)", DT_ARG_INT, DT_CFG(batch_size), NULL, DT_MIN(1) },
    { "--epochs", "123456789", "N", "passes over the training set (default 10; gpt, llama 2)", DT_ARG_INT, DT_CFG(epochs), NULL, DT_MIN(1) },
    { "--steps", "123456789", "N", "stop after N steps in all (default: run every epoch)", DT_ARG_I64, DT_CFG(steps), NULL, DT_MIN(0) },
    { "--lr", "123456789", "X", "peak learning rate (default 1e-3; gpt, llama 3e-3)", DT_ARG_FLOAT, DT_CFG(lr), NULL, DT_ABOVE(0) },
    { "--optimizer", "123456789", "adamw|sgd", "the optimizer (default adamw)", DT_ARG_CHOICE, DT_CFG(optimizer), "adamw|sgd", DT_NOT_A_NUMBER },
    { "--weight-decay", "123456789", "X", "decoupled weight decay of 2-D weights (default 0.05)", DT_ARG_FLOAT, DT_CFG(weight_decay),
      NULL, DT_MIN(0) },
    { "--momentum", "123456789", "X", "sgd momentum (default 0.9)", DT_ARG_FLOAT, DT_CFG(momentum), NULL, 0, 1, DT_HI_OPEN },
    { "--clip", "123456789", "X", "clip the gradient norm to X, 0 for none (default 1.0)", DT_ARG_FLOAT, DT_CFG(clip), NULL, DT_MIN(0) },
    { "--warmup", "123456789", "N", "linear warmup steps before the cosine decay (default 5% of the steps)", DT_ARG_I64, DT_CFG(warmup),
      NULL, DT_MIN(0) },
    { "--augment", "123456789", "0|1", "random crop + horizontal flip (default 1)", DT_ARG_INT, DT_CFG(augment), NULL, DT_RANGE(0, 1) },
    { "--seed", "123456789", "N", "seed for initialisation, shuffling and augmentation (default 1)", DT_ARG_I64, DT_CFG(seed), NULL, DT_MIN(0) },
    { "--device", "123456789", "cpu|cuda|auto", "where to train (default auto: cuda when a GPU is visible)", DT_ARG_CHOICE, DT_CFG(device),
      "cpu|cuda|auto", DT_NOT_A_NUMBER },
    { "--log", "123456789", "FILE", "write one JSON object per step, evaluation and summary", DT_ARG_STR, DT_CFG(log_path), NULL, DT_NOT_A_NUMBER },
    { "--tensorboard", "123456789", "DIR", "write the loss, learning rate, speed, memory and evaluation as TensorBoard event files in\n"
      "                          DIR (tensorboard --logdir DIR shows them; a resumed run adds a file)", DT_ARG_STR, DT_CFG(tensorboard),
      NULL, DT_NOT_A_NUMBER },
    { "--mlflow", "123456789", "DIR|URL", "record the run in MLflow, experiment \"dtrain\": flags as params, the figures of --log\n"
      "                          as metrics. URL http://HOST:PORT (https:// too): a tracking server, live, from a thread of its\n"
      "                          own (`mlflow server`; a server that goes away is a warning, never a stop). DIR: MLflow's\n"
      "                          file store (MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri DIR). A resumed run\n"
      "                          continues its MLflow run", DT_ARG_STR, DT_CFG(mlflow), NULL, DT_NOT_A_NUMBER },
    { "--trace", "123456789", "FILE", "write a Chrome/Perfetto trace of the step phases", DT_ARG_STR, DT_CFG(trace_path), NULL, DT_NOT_A_NUMBER },
    { "--save-dir", "123456789", "DIR", "write a checkpoint at the end of every epoch", DT_ARG_STR, DT_CFG(save_dir), NULL, DT_NOT_A_NUMBER },
    { "--resume", "123456789", "DIR|auto", "continue exactly where a checkpoint (a folder) stopped; auto: the newest in --save-dir (none: start\n"
      "                          fresh), what a requeued job runs after preemption", DT_ARG_STR, DT_CFG(resume), NULL, DT_NOT_A_NUMBER },
    { "--init", "123456789", "FILE|DIR", "start from these weights (safetensors, PyTorch/timm/Hugging Face names), a dtrain\n"
      "                          checkpoint, or a Hugging Face model folder (config.json gives the model and its shape)", DT_ARG_STR, DT_CFG(init),
      NULL, DT_NOT_A_NUMBER },
    { "--eval-every", "123456789", "N", "evaluate every N steps as well as after each epoch (default 0: epochs only)", DT_ARG_INT,
      DT_CFG(eval_every), NULL, DT_MIN(0) },
    { "--early-stop", "123456789", "N", "stop when the evaluation loss has not improved for N evaluations in a row (default 0: never;\n"
      "                          a resumed run keeps the count)", DT_ARG_INT, DT_CFG(early_stop), NULL, DT_MIN(0) },
    { "--save-best", "123456789", NULL, "keep the checkpoint of the best evaluation so far beside the others, as --save-dir's\n"
      "                          <model>_data<A>-<B>_best (replaced when an evaluation beats it)", DT_ARG_SWITCH, DT_CFG(save_best), NULL,
      DT_NOT_A_NUMBER },
    { "--log-every", "123456789", "N", "print a progress line every N steps (default: about every 3 s, and each epoch's last step)",
      DT_ARG_INT, DT_CFG(log_every), NULL, DT_MIN(1) },
    { "--start-idx", "123456789", "N", "train on images [N, end) of the training set (default 0)", DT_ARG_I64, DT_CFG(start_idx), NULL, DT_MIN(0) },
    { "--end-idx", "123456789", "N", "... up to image N (default: all)", DT_ARG_I64, DT_CFG(end_idx), NULL, DT_MIN(1) },
    { "--bench", "123456789", NULL, "time this stage's training steps on random in-memory data, print one line, exit", DT_ARG_SWITCH,
      DT_CFG(bench), NULL, DT_NOT_A_NUMBER },
    { "--quiet", "123456789", NULL, "print only errors and the summary", DT_ARG_SWITCH, DT_CFG(quiet), NULL, DT_NOT_A_NUMBER },
    { "--peak-tflops", "123456789", "X", "--bench on a GPU: its peak for MFU (default: the fp32 peak, looked up by name; 05 with --dtype:\n"
      "                          give the 16-bit one)", DT_ARG_FLOAT, DT_CFG(peak_tflops), NULL, DT_ABOVE(0) },
    { "--nproc", "23456789", "N", "02: devices driven by this one process; 03-09: ranks started on this machine (default 1)", DT_ARG_INT,
      DT_CFG(nproc), NULL, DT_RANGE(1, DT_MAX_RANKS) },
    { "--shard", "456789", "optimizer|grads|full", "FSDP: shard optimizer state (ZeRO-1), + gradients (ZeRO-2), + parameters (ZeRO-3, default);\n"
      "                          06, 07: FSDP over the data-parallel groups, around the split layers or the pipelines\n"
      "                          (default: none, DDP)",
      DT_ARG_CHOICE, DT_CFG(shard), "optimizer|grads|full", DT_NOT_A_NUMBER },
    { "--cpu-offload", "456789", NULL, "FSDP: keep shards and optimizer state in host memory, step on the CPU", DT_ARG_SWITCH,
      DT_CFG(cpu_offload), NULL, DT_NOT_A_NUMBER },
    { "--quantize-weights", "456789", "none|int8", "ZeRO++ qwZ (with --shard full): gather each unit's weights as int8, a scale per\n"
      "                          --quant-block values (default none)", DT_ARG_CHOICE, DT_CFG(quantize_weights), "none|int8",
      DT_NOT_A_NUMBER },
    { "--quantize-grads", "456789", "none|int8|int4", "ZeRO++ qgZ: reduce-scatter gradients quantized, within each machine first, then\n"
      "                          across (default none)", DT_ARG_CHOICE, DT_CFG(quantize_grads), "none|int8|int4", DT_NOT_A_NUMBER },
    { "--hierarchical", "456789", NULL, "ZeRO++ hpZ (with --shard full): each machine keeps a second copy of the weights, cut over\n"
      "                          its ranks, so backward's gathers stay inside it", DT_ARG_SWITCH, DT_CFG(hierarchical), NULL,
      DT_NOT_A_NUMBER },
    { "--quant-block", "456789", "N", "ZeRO++: values that share one scale (default 256; even, 8 to 65536)", DT_ARG_INT,
      DT_CFG(quant_block), NULL, DT_RANGE(8, 65536) },
    { "--ranks-per-machine", "456789", "N", "take every N consecutive ranks of the data-parallel group (04, 05: the job) as one\n"
      "                          machine, for ZeRO++ and the bytes counted across machines (default: the machines the\n"
      "                          launcher put them on; N shows them on one)", DT_ARG_INT, DT_CFG(ranks_per_machine), NULL,
      DT_RANGE(1, DT_MAX_RANKS) },
    { "--recompute", "123456789", NULL, "activation checkpointing: keep each block's input and output only, run its forward again in\n"
      "                          backward (the same bits; less memory, one more forward per step)", DT_ARG_SWITCH, DT_CFG(recompute), NULL,
      DT_NOT_A_NUMBER },
    { "--attention", "12345679", "matmul|online", "attention: keep each head's T x T probabilities (matmul, the default), or\n"
      "                          FlashAttention's online softmax, which keeps T numbers a head and makes them again in\n"
      "                          backward (online: the same values within rounding; heads of at most 128 on a GPU)", DT_ARG_CHOICE,
      DT_CFG(attention), "matmul|online", DT_NOT_A_NUMBER },
    { "--lora-rank", "123456789", "R", "LoRA: freeze the model, train adapters of rank R beside the --lora-targets layers (saved\n"
      "                          in PEFT's layout; tools/merge-lora folds them in)", DT_ARG_INT, DT_CFG(lora_rank), NULL, DT_MIN(1) },
    { "--lora-alpha", "123456789", "A", "LoRA: the adapters' output is scaled by A / R (default 8)", DT_ARG_FLOAT, DT_CFG(lora_alpha),
      NULL, DT_ABOVE(0) },
    { "--lora-targets", "123456789", "NAMES", "LoRA: comma-separated layer names (default: gpt c_attn; llama q_proj,v_proj; vit qkv;\n"
      "                          mlp every layer; vit also proj, fc1, fc2, head; llama k_proj, o_proj, gate_proj, ...)",
      DT_ARG_STR, DT_CFG(lora_targets), NULL, DT_NOT_A_NUMBER },
    { "--accum-steps", "57", "N", "micro-batches of --batch-size per optimizer step; gradients add up locally (default 1;\n"
      "                          07: a pipeline's micro-batches are its accumulation: K x --micro-batches of a K x\n"
      "                          --batch-size step)", DT_ARG_INT, DT_CFG(accum_steps), NULL, DT_MIN(1) },
    { "--dtype", "5789", "fp32|bf16|fp16", "activations and matmuls in this type, f32 master weights (default fp32; 07: the\n"
      "                          activations and gradients stages send too, and no fp16; 08, 09: bf16 or fp32)",
      DT_ARG_CHOICE, DT_CFG(dtype), "fp32|bf16|fp16", DT_NOT_A_NUMBER },
    { "--reduce-dtype", "5", "fp32|bf16|fp16", "the type gradients are reduce-scattered in (default fp32)",
      DT_ARG_CHOICE, DT_CFG(reduce_dtype), "fp32|bf16|fp16", DT_NOT_A_NUMBER },
    { "--explain", "123456789", NULL, "after 3 steps, print the cost model's prediction for this run: speedup, compute : "
      "communication,\n                          and what would change it", DT_ARG_SWITCH, DT_CFG(explain), NULL, DT_NOT_A_NUMBER },
    { "--link", "123456789", "shm|pcie|nvlink|infiniband", "--explain: the link between ranks (default: shm on a CPU, nvlink on GPUs)",
      DT_ARG_CHOICE, DT_CFG(link), "shm|pcie|nvlink|infiniband", DT_NOT_A_NUMBER },
    { "--link-across", "456789", "infiniband|ethernet|pcie|nvlink|shm", "--explain: the link between machines (default infiniband;\n"
      "                          the machines: --ranks-per-machine, or as the launcher placed the ranks)", DT_ARG_CHOICE,
      DT_CFG(link_across), "infiniband|ethernet|pcie|nvlink|shm", DT_NOT_A_NUMBER },
    { "--tp", "67", "T", "tensor parallelism: ranks per group that split every block's layers (06: default 0, the whole\n"
      "                          job, a job of N ranks is N/T data-parallel groups of T; 07: default 1, each stage's blocks\n"
      "                          split over T ranks)", DT_ARG_INT, DT_CFG(tp), NULL, DT_MIN(0) },
    { "--sequence-parallel", "6", NULL, "tensor parallelism: the norms and residual adds between the split layers work on\n"
      "                          1/T of the tokens each (all-reduces become reduce-scatter + all-gather)", DT_ARG_SWITCH,
      DT_CFG(sequence_parallel), NULL, DT_NOT_A_NUMBER },
    { "--pp", "7", "P", "pipeline parallelism: stages per pipeline, each a run of consecutive blocks (default 0: every\n"
      "                          rank a stage; a job of N ranks is N/(P x T) data-parallel pipelines of P stages of --tp T)",
      DT_ARG_INT, DT_CFG(pp), NULL, DT_MIN(0) },
    { "--micro-batches", "7", "M", "pipeline parallelism: micro-batches per step, each --batch-size / M (default 1)", DT_ARG_INT,
      DT_CFG(micro_batches), NULL, DT_RANGE(1, DT_COMM_QUEUE) },   /* the sends a stage has in flight */
    { "--schedule", "7", "gpipe|1f1b", "pipeline parallelism: every forward then every backward (gpipe), or each backward as\n"
      "                          soon as it can run (1f1b, the default: at most --pp micro-batches' activations kept)",
      DT_ARG_CHOICE, DT_CFG(schedule), "gpipe|1f1b", DT_NOT_A_NUMBER },
    { "--cp", "8", "C", "context parallelism: ranks per group, each keeping 1/C of every sequence's tokens (default 0: the\n"
      "                          whole job; a job of N ranks is N/C data-parallel groups of C)", DT_ARG_INT, DT_CFG(cp), NULL,
      DT_MIN(0) },
    { "--cp-layout", "8", "zigzag|contiguous", "context parallelism: which tokens a rank keeps -- chunks r and 2C-1-r of 2C\n"
      "                          (zigzag, the default: the same causal work on every rank) or chunk r of C (contiguous)",
      DT_ARG_CHOICE, DT_CFG(cp_layout), "zigzag|contiguous", DT_NOT_A_NUMBER },
    { "--ep", "9", "P", "expert parallelism: ranks per group, each keeping E/P of every MoE layer's experts (default 0:\n"
      "                          the whole job; a job of N ranks is N/P data-parallel groups of P)", DT_ARG_INT, DT_CFG(ep), NULL,
      DT_MIN(0) },
    { "--bucket-mb", "36789", "X", "DDP: all-reduce gradients in buckets of X MB during backward; 0: all at once after it (default 25)",
      DT_ARG_FLOAT, DT_CFG(bucket_mb), NULL, DT_MIN(0) },
    { "--comm", "3456789", "shm|nccl|mpi|auto", "the ranks' transport: shared memory (one machine), NCCL (GPUs), MPI (CPUs on\n"
      "                          several machines, under mpirun or srun --mpi=pmix); default auto: NCCL on GPUs, else shm,\n"
      "                          or MPI when an MPI launcher started ranks on several machines", DT_ARG_CHOICE, DT_CFG(comm),
      "shm|nccl|mpi|auto", DT_NOT_A_NUMBER },
    { "--timeout", "23456789", "S", "stop when a rank (02: a device) has not answered for S seconds (default 60)", DT_ARG_FLOAT,
      DT_CFG(timeout), NULL, DT_ABOVE(0) },
    { "--ranks-per-gpu", "3456789", "N", "let N ranks share one GPU (default 1: a GPU per rank; NCCL 2.30+ does it best)", DT_ARG_INT,
      DT_CFG(ranks_per_gpu), NULL, DT_MIN(1) },
};
#undef DT_CFG
#undef DT_MIN
#undef DT_ABOVE
#undef DT_RANGE
#undef DT_NOT_A_NUMBER
enum { DT_NFLAGS = sizeof dt__flags / sizeof dt__flags[0] };

static int dt__flag_of_stage(const dt__flag *f, char stage) { return !stage || strchr(f->stages, stage); }
/* Whether `stage` takes the flag `name` (what it can do, rather than which it is). */
static int dt__stage_takes(const char *stage, const char *name) {
    for (size_t i = 0; i < sizeof dt__flags / sizeof dt__flags[0]; i++)
        if (!strcmp(dt__flags[i].name, name)) return dt__stage_digit(stage) && dt__flag_of_stage(&dt__flags[i], dt__stage_digit(stage));
    return 0;
}

static void dt__print_help(const char *stage) {
    printf("%s: train a model with dtrain\n\nusage: %s [flags]\n\n", stage, dt__usage_program);   /* dt_parse_args set it */
    for (int i = 0; i < DT_NFLAGS; i++) {
        char left[64];
        if (!dt__flag_of_stage(&dt__flags[i], dt__stage_digit(stage))) continue;
        snprintf(left, sizeof left, "%s %s", dt__flags[i].name, dt__flags[i].metavar ? dt__flags[i].metavar : "");
        if (strlen(left) < 24) printf("  %-24s%s\n", left, dt__flags[i].help);
        else printf("  %s\n  %-24s%s\n", left, "", dt__flags[i].help);   /* a long one on a line of its own */
    }
    printf("  %-24s%s\n\nThreads: OMP_NUM_THREADS (default: every core).\n", "--help", "this list");
}

/* "--shard is a flag of 04-fsdp and 05-accum-mixed-precision, not 01-single-gpu" */
static void dt__flag_of_other_stages(const dt__flag *f, const char *stage) {
    char list[256] = "";
    size_t n = strlen(f->stages);
    for (size_t i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i == 0 ? "" : i + 1 < n ? ", " : " and ",
                 dt__stage_names[f->stages[i] - '1']);
    dt_usage_error("%s is a flag of %s, not %s", f->name, list, stage);
}

static void dt__flag_check_range(const dt__flag *f, double v, const char *val) {
    int lo_ok = f->open & DT_LO_OPEN ? v > f->lo : v >= f->lo, hi_ok = f->open & DT_HI_OPEN ? v < f->hi : v <= f->hi;
    if (lo_ok && hi_ok) return;
    char range[96];
    int n = snprintf(range, sizeof range, "%s %.10g", f->open & DT_LO_OPEN ? "more than" : "at least", f->lo);
    if (isfinite(f->hi) && !f->open) snprintf(range, sizeof range, "between %.10g and %.10g", f->lo, f->hi);
    else if (isfinite(f->hi))
        snprintf(range + n, sizeof range - (size_t)n, " and %s %.10g", f->open & DT_HI_OPEN ? "less than" : "at most", f->hi);
    dt_usage_error("%s must be %s, got %s", f->name, range, val);
}

double dt_flag_number(const char *flag, const char *text, double lo, double hi, int whole) {
    char *end = NULL;
    errno = 0;
    double v = text ? strtod(text, &end) : NAN;
    if (!text || end == text || *end || errno || !(v >= lo && v <= hi) || (whole && v != floor(v)))
        dt_usage_error("%s must be a %s from %.10g to %.10g, got '%s'", flag, whole ? "whole number" : "number", lo, hi,
                       text ? text : "(nothing)");
    return v;
}

/* Was this flag on the command line? (What a flag not given means is decided
   after all are read: a default may depend on --model.) */
static int dt__given(const unsigned char *given, const char *name) {
    for (int k = 0; k < DT_NFLAGS; k++) if (!strcmp(dt__flags[k].name, name)) return given[k];
    dt_fail("internal error: no flag '%s' in dt__flags", name);
}

/* A switch (a yes/no flag, no value)? */
static int dt__flag_is_switch(const char *name) {
    for (int k = 0; k < DT_NFLAGS; k++) if (!strcmp(dt__flags[k].name, name)) return dt__flags[k].type == DT_ARG_SWITCH;
    dt_fail("internal error: no flag '%s' in dt__flags", name);
}

/* A number config.json gives (-1: it does not) becomes the flag's value; a
   flag given with another value is an error that names both. */
static void dt__hf_take(const dt__hf_config *hc, const char *key, double from_config, const char *flag, int given,
                        float *f_value, int *i_value) {
    if (from_config == -1) return;
    /* whole numbers of at least 1 (0 or 1 for a switch's); a positive base and epsilon */
    int yes_no = i_value && dt__flag_is_switch(flag);
    if (i_value ? from_config != floor(from_config) || from_config < (yes_no ? 0 : 1) || from_config > 16777216
                : !(from_config > 0) || from_config > 1e30)
        dt_usage_error("%s: \"%s\": %g is not a valid value%s", hc->path, key, from_config,
                       i_value ? (yes_no ? " (true or false)" : " (a whole number from 1 to 16777216)") : " (a positive number)");
    double have = f_value ? (double)*f_value : (double)*i_value;
    if (given && fabs(have - from_config) > 1e-6 * fabs(from_config))
        dt_usage_error("%s %g contradicts \"%s\": %g in %s (the folder's config gives the shape; leave the flag out)", flag,
                       have, key, from_config, hc->path);
    if (f_value) *f_value = (float)from_config;
    else *i_value = (int)from_config;
}
/* The model: before the defaults that depend on it. */
static int dt__hf_is(const dt__hf_config *hc, const char *type) { return !strcmp(hc->model_type, type); }
static int dt__hf_gpt2(const dt__hf_config *hc) { return dt__hf_is(hc, "gpt2") || dt__hf_is(hc, "dtrain_gpt2_moe"); }
static void dt__apply_hf_model(dt_config *c, const dt__hf_config *hc, const unsigned char *given) {
    int llama = dt__hf_is(hc, "llama") || dt__hf_is(hc, "mixtral"), qwen2 = dt__hf_is(hc, "qwen2"), gpt2 = dt__hf_gpt2(hc);
    if (!llama && !qwen2 && !gpt2)
        dt_usage_error("%s: model_type \"%s\" is not one dtrain trains (llama, qwen2, mixtral, gpt2)", hc->path, hc->model_type);
    dt_model_kind kind = gpt2 ? DT_MODEL_GPT : DT_MODEL_LLAMA;
    if (dt__given(given, "--model") && c->model != kind)
        dt_usage_error("--model %s contradicts \"model_type\": \"%s\" in %s", dt__family((dt_model_kind)c->model)->name,
                       hc->model_type, hc->path);
    c->model = kind;
}
/* The shape: over the defaults. */
/* The experts (Mixtral's keys; a gpt's from dtrain): over the flags' defaults. */
static void dt__apply_hf_experts(dt_config *c, dt__hf_config hc, const unsigned char *given) {
    int mixtral = dt__hf_is(&hc, "mixtral");
    if (!mixtral && !dt__hf_is(&hc, "dtrain_gpt2_moe")) return;
    if (!(hc.experts >= 1 && hc.experts <= 4096))
        dt_usage_error("%s: a model_type \"%s\" needs num_local_experts from 1 to 4096 (it has %g)", hc.path, hc.model_type, hc.experts);
    if (hc.router_jitter > 0) dt_usage_error("%s: router_jitter_noise %g; dtrain's router adds no noise", hc.path, hc.router_jitter);
    if (hc.experts_per_token == -1) hc.experts_per_token = 2;                       /* Hugging Face's defaults */
    if (hc.sparse_step == -1) hc.sparse_step = 1;
    double coef = hc.router_logits > 0 && hc.router_aux != -1 ? hc.router_aux : 0, capacity = hc.capacity;
    dt__hf_take(&hc, "num_local_experts", hc.experts, "--moe-experts", dt__given(given, "--moe-experts"), NULL, &c->moe_experts);
    dt__hf_take(&hc, "num_experts_per_tok", hc.experts_per_token, "--moe-top-k", dt__given(given, "--moe-top-k"), NULL,
                &c->moe_top_k);
    if (!mixtral)
        dt__hf_take(&hc, "decoder_sparse_step", hc.sparse_step, "--moe-every", dt__given(given, "--moe-every"), NULL, &c->moe_every);
    if (!dt__given(given, "--moe-aux-loss")) c->moe_aux_loss = (float)coef;         /* a coefficient for training: a flag may change it */
    if (capacity > 0 && !dt__given(given, "--moe-capacity")) c->moe_capacity = (float)capacity;   /* the flag may change it */
}
static void dt__apply_hf_shape(dt_config *c, dt__hf_config hc, const unsigned char *given) {
    int llama = dt__hf_is(&hc, "llama") || dt__hf_is(&hc, "mixtral"), qwen2 = dt__hf_is(&hc, "qwen2"), gpt2 = dt__hf_gpt2(&hc);
    const char *missing = hc.dim == -1 ? "hidden_size" : hc.depth == -1 ? "num_hidden_layers" : hc.heads == -1 ? "num_attention_heads"
                        : hc.vocab == -1 ? "vocab_size" : !gpt2 && hc.ffn_dim == -1 ? "intermediate_size" : NULL;
    if (missing) dt_usage_error("%s has no \"%s\"", hc.path, missing);
    dt__hf_take(&hc, "hidden_size", hc.dim, "--dim", dt__given(given, "--dim"), NULL, &c->dim);
    dt__hf_take(&hc, "num_hidden_layers", hc.depth, "--depth", dt__given(given, "--depth"), NULL, &c->depth);
    dt__hf_take(&hc, "num_attention_heads", hc.heads, "--heads", dt__given(given, "--heads"), NULL, &c->heads);
    dt__hf_take(&hc, "vocab_size", hc.vocab, "--vocab", dt__given(given, "--vocab"), NULL, &c->vocab);
    if (hc.head_dim != -1 && hc.head_dim * c->heads != c->dim)
        dt_usage_error("%s: head_dim %g is not hidden_size / num_attention_heads = %d; dtrain's heads split the width",
                       hc.path, hc.head_dim, c->dim / c->heads);
    if (hc.max_positions >= 1 && hc.max_positions == floor(hc.max_positions) && c->seq_len > hc.max_positions &&
        !dt__given(given, "--seq-len"))
        c->seq_len = (int)hc.max_positions;             /* the default context, cut to the model's */
    if (hc.max_positions != -1 && c->seq_len > hc.max_positions)
        dt_usage_error("--seq-len %d is longer than the model's context, \"max_position_embeddings\": %g in %s", c->seq_len,
                       hc.max_positions, hc.path);
    if (gpt2) {
        if (hc.ffn_dim != -1 && hc.ffn_dim != 4 * c->dim)
            dt_usage_error("%s: n_inner %g; dtrain's GPT-2 MLP is 4 x n_embd = %d wide", hc.path, hc.ffn_dim, 4 * c->dim);
        if (hc.norm_eps != -1 && fabs(hc.norm_eps - 1e-5) > 1e-12)     /* it was read past, and the model's 1e-5 used */
            dt_usage_error("%s: layer_norm_epsilon %g; dtrain's GPT-2 LayerNorms use GPT-2's 1e-5", hc.path, hc.norm_eps);
        return;
    }
    if (hc.has_rope_scaling)
        dt_usage_error("%s: rescaled rotary frequencies of rope_type \"%s\" are not supported (\"default\" and Llama 3's "
                       "\"llama3\" are)", hc.path, hc.rope_type[0] ? hc.rope_type : "?");
    if (!strcmp(hc.rope_type, "llama3")) {
        if (!(hc.rope_factor > 0 && hc.rope_factor < 1e6) || !(hc.rope_low_freq > 0) || !(hc.rope_high_freq > hc.rope_low_freq) ||
            !(hc.rope_high_freq < 1e6) || !(hc.rope_original_context >= 1 && hc.rope_original_context <= INT_MAX) ||
            hc.rope_original_context != floor(hc.rope_original_context))
            dt_usage_error("%s: rope_type llama3 needs a positive factor, 0 < low_freq_factor < high_freq_factor and a whole "
                           "original_max_position_embeddings (it has %g, %g, %g, %g)", hc.path, hc.rope_factor,
                           hc.rope_low_freq, hc.rope_high_freq, hc.rope_original_context);
        dt__hf_take(&hc, "factor", hc.rope_factor, "--rope-factor", dt__given(given, "--rope-factor"), &c->rope_factor, NULL);
        dt__hf_take(&hc, "low_freq_factor", hc.rope_low_freq, "--rope-low-freq", dt__given(given, "--rope-low-freq"),
                    &c->rope_low_freq, NULL);
        dt__hf_take(&hc, "high_freq_factor", hc.rope_high_freq, "--rope-high-freq", dt__given(given, "--rope-high-freq"),
                    &c->rope_high_freq, NULL);
        dt__hf_take(&hc, "original_max_position_embeddings", hc.rope_original_context, "--rope-original-context",
                    dt__given(given, "--rope-original-context"), NULL, &c->rope_original_context);
    } else if (c->rope_factor > 0)
        dt_usage_error("--rope-factor contradicts %s, whose rotary frequencies are not rescaled", hc.path);
    if (hc.partial_rotary != -1 && hc.partial_rotary != 1)
        dt_usage_error("%s: partial_rotary_factor %g; dtrain rotates whole heads", hc.path, hc.partial_rotary);
    if (hc.mlp_bias > 0) dt_usage_error("%s: mlp_bias true (biases on gate, up and down) is not supported", hc.path);
    if ((hc.use_sliding_window > 0 || dt__hf_is(&hc, "mixtral")) && hc.sliding_window != -1 && hc.sliding_window < c->seq_len)
        dt_usage_error("%s: sliding-window attention of %g tokens, shorter than --seq-len %d: dtrain attends to the whole "
                       "context", hc.path, hc.sliding_window, c->seq_len);
    if (hc.hidden_act[0] && strcmp(hc.hidden_act, "silu"))
        dt_usage_error("%s: hidden_act \"%s\"; dtrain's SwiGLU uses silu", hc.path, hc.hidden_act);
    if (llama && hc.qkv_bias > 0)
        dt_usage_error("%s: attention_bias true (biases on o_proj too) is not supported; Qwen2's q/k/v biases are", hc.path);
    /* Hugging Face's defaults where the file says nothing (Mixtral's own base and epsilon) */
    if (hc.kv_heads == -1) hc.kv_heads = hc.heads;
    if (hc.rope_theta == -1) hc.rope_theta = dt__hf_is(&hc, "mixtral") ? 1e6 : 10000;
    if (hc.norm_eps == -1 && dt__hf_is(&hc, "mixtral")) hc.norm_eps = 1e-5;
    if (hc.tie == -1) hc.tie = 0;
    if (hc.norm_eps == -1) hc.norm_eps = 1e-6;
    hc.qkv_bias = qwen2;
    dt__hf_take(&hc, "num_key_value_heads", hc.kv_heads, "--kv-heads", dt__given(given, "--kv-heads"), NULL, &c->kv_heads);
    dt__hf_take(&hc, "intermediate_size", hc.ffn_dim, "--ffn-dim", dt__given(given, "--ffn-dim"), NULL, &c->ffn_dim);
    if (hc.rope_theta <= 1) dt_usage_error("%s: rope_theta %g; the rotary base must be above 1", hc.path, hc.rope_theta);
    dt__hf_take(&hc, "rope_theta", hc.rope_theta, "--rope-theta", dt__given(given, "--rope-theta"), &c->rope_theta, NULL);
    double untied = 1 - hc.tie, bias = hc.qkv_bias;
    dt__hf_take(&hc, "tie_word_embeddings (as --untied-head)", untied, "--untied-head", dt__given(given, "--untied-head"), NULL,
                &c->untied_head);
    dt__hf_take(&hc, "model_type (qwen2: q/k/v biases)", bias, "--qkv-bias", dt__given(given, "--qkv-bias"), NULL, &c->qkv_bias);
    dt__hf_take(&hc, "rms_norm_eps", hc.norm_eps, "--norm-eps", dt__given(given, "--norm-eps"), &c->norm_eps, NULL);
}

dt_config dt_parse_args(int argc, char **argv, const char *stage) {
    dt_config c;
    unsigned char given[DT_NFLAGS];
    memset(&c, 0, sizeof c);
    memset(given, 0, sizeof given);
    c.stage = stage;
    dt__usage_program = argc > 0 && argv[0] ? argv[0] : stage;
    c.nproc = 1; c.timeout = 60; c.ranks_per_gpu = 1; c.bucket_mb = 25; c.shard = 2; c.accum_steps = 1; c.link = -1; c.link_across = -1; c.quant_block = 256;
    c.micro_batches = 1; c.schedule = DT_SCHEDULE_1F1B;
    c.image_size = 32; c.model = DT_MODEL_MLP; c.vocab = -1; c.seq_len = 64;
    c.weight_decay = 0.05f; c.momentum = 0.9f; c.clip = 1.0f;
    c.warmup = -1; c.optimizer = DT_ADAMW; c.seed = 1; c.device = (dt_device)2; /* auto */
    c.comm = DT_COMM_AUTO;
    c.log_every = 0; c.augment = 1; c.end_idx = -1;        /* --log-every 0: progress by the clock */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *val = NULL;
        char name[64];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) { dt__print_help(stage); exit(0); }
        const char *eq = strchr(arg, '=');
        size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
        if (nlen >= sizeof name) nlen = sizeof name - 1;
        memcpy(name, arg, nlen); name[nlen] = 0;
        const dt__flag *f = NULL;
        for (int k = 0; k < DT_NFLAGS; k++)
            if (!strcmp(dt__flags[k].name, name)) { f = &dt__flags[k]; given[k] = 1; }
        if (!f) dt_usage_error("unknown flag '%s' for %s", arg, stage);
        /* taken in silence, a flag of another stage would leave its user believing it did something */
        if (!dt__flag_of_stage(f, dt__stage_digit(stage))) dt__flag_of_other_stages(f, stage);
        char *dst = (char *)&c + f->offset;
        if (f->type == DT_ARG_SWITCH) { if (eq) dt_usage_error("%s takes no value", name); *(int *)dst = 1; continue; }
        if (eq) val = eq + 1;
        else if (i + 1 < argc) val = argv[++i];
        else dt_usage_error("%s needs a value (%s)", name, f->metavar);
        char *end = NULL;
        errno = 0;
        switch (f->type) {
        case DT_ARG_INT: case DT_ARG_I64: {
            long long v = strtoll(val, &end, 10);
            if (!*val || *end || errno) dt_usage_error("%s expects a whole number, got '%s'", name, val);
            dt__flag_check_range(f, (double)v, val);
            if (f->type == DT_ARG_INT) {
                if (v < -2147483647LL || v > 2147483647LL) dt_usage_error("%s: %s is out of range", name, val);
                *(int *)dst = (int)v;
            } else *(int64_t *)dst = v;
            break;
        }
        case DT_ARG_FLOAT: {
            double v = strtod(val, &end);
            if (!*val || *end || errno || !isfinite(v) || !isfinite((float)v))
                dt_usage_error("%s expects a number (of a float's range), got '%s'", name, val);
            dt__flag_check_range(f, v, val);
            *(float *)dst = (float)v;
            break;
        }
        case DT_ARG_STR: *(const char **)dst = val; break;
        case DT_ARG_CHOICE: {
            int idx = 0, found = -1;
            for (const char *p = f->choices; *p; idx++) {
                size_t l = strcspn(p, "|");
                if (strlen(val) == l && !strncmp(p, val, l)) found = idx;
                p += l + (p[l] == '|');
            }
            if (found < 0) dt_usage_error("%s must be one of %s, got '%s'", name, f->choices, val);
            *(int *)dst = found;
            break;
        }
        case DT_ARG_SWITCH: break;
        }
    }
    /* --init DIR: an adapter folder gives LoRA's settings, and its base the model */
    const char *model_dir = c.init;
    if (c.init && dt__folder_is_adapter(c.init)) {
        dt__lora_config lc;
        dt__lora_config_read(c.init, &lc);
        if ((dt__given(given, "--lora-rank") && c.lora_rank != lc.rank) ||
            (dt__given(given, "--lora-alpha") && c.lora_alpha != (float)lc.alpha) ||
            (dt__given(given, "--lora-targets") && strcmp(c.lora_targets, lc.targets)))
            dt_usage_error("--lora-rank %d --lora-alpha %g --lora-targets %s contradict '%s' (r %d, lora_alpha %g, target_modules "
                           "%s): leave them out", c.lora_rank, (double)c.lora_alpha, c.lora_targets ? c.lora_targets : "(default)",
                           lc.path, lc.rank, lc.alpha, lc.targets);
        static char targets[256];
        dt__copy_str(targets, sizeof targets, lc.targets);
        c.lora_rank = lc.rank; c.lora_alpha = (float)lc.alpha; c.lora_targets = targets;
        static char base[1024];
        dt__copy_str(base, sizeof base, lc.base);
        model_dir = base[0] ? base : NULL;
    }
    if (!c.lora_rank && (dt__given(given, "--lora-alpha") || dt__given(given, "--lora-targets")))
        dt_usage_error("--lora-alpha and --lora-targets go with --lora-rank");
    if (c.lora_rank && !dt__given(given, "--lora-alpha") && !(c.lora_alpha > 0)) c.lora_alpha = 8;
    if (c.lora_targets && (!*c.lora_targets || strlen(c.lora_targets) >= 256 ||
                           strspn(c.lora_targets, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,") !=
                               strlen(c.lora_targets) ||
                           c.lora_targets[0] == ',' || c.lora_targets[strlen(c.lora_targets) - 1] == ',' ||
                           strstr(c.lora_targets, ",,")))
        dt_usage_error("--lora-targets '%s': layer names (letters, digits, _ and .) separated by commas", c.lora_targets);
    struct stat init_st;                        /* --init DIR: a Hugging Face folder's config.json gives the model */
    int hf = model_dir && stat(model_dir, &init_st) == 0 && S_ISDIR(init_st.st_mode) && dt__folder_is_hf(model_dir);
    dt__hf_config hc;
    if (hf) { dt__hf_config_read(model_dir, &hc); dt__apply_hf_model(&c, &hc, given); }
    int vit = c.model == DT_MODEL_VIT, gpt = dt_model_is_language((dt_model_kind)c.model), llama = c.model == DT_MODEL_LLAMA;
    /* the defaults that depend on the model */
    if (!dt__given(given, "--batch-size")) c.batch_size = gpt ? 32 : 128;
    if (!dt__given(given, "--epochs")) c.epochs = gpt ? 2 : 10;
    if (!dt__given(given, "--lr")) c.lr = gpt ? 3e-3f : 1e-3f;
    if (!dt__given(given, "--dim")) c.dim = vit ? 192 : gpt ? 128 : 1024;
    if (!dt__given(given, "--depth")) c.depth = vit ? 6 : gpt ? 4 : 2;
    if (!dt__given(given, "--heads")) c.heads = gpt ? 4 : 3;
    if (!dt__given(given, "--patch")) c.patch = 4;
    if (hf) dt__apply_hf_shape(&c, hc, given);              /* and its shape */
    if (hf) dt__apply_hf_experts(&c, hc, given);            /* and its experts */
    /* values in range that make no sense together */
    if (!gpt && (dt__given(given, "--seq-len") || dt__given(given, "--vocab") || c.tokens || dt__given(given, "--sample")))
        dt_usage_error("--seq-len, --vocab, --tokens and --sample are for the language models (--model gpt or llama)");
    int rope_given = (c.rope_factor > 0) + (c.rope_low_freq > 0) + (c.rope_high_freq > 0) + (c.rope_original_context > 0);
    if (!llama && (c.kv_heads || c.ffn_dim || c.rope_theta > 0 || c.norm_eps > 0 || c.untied_head || c.qkv_bias || rope_given))
        dt_usage_error("--kv-heads, --ffn-dim, --rope-theta, --norm-eps, --untied-head, --qkv-bias and --rope-factor, "
                       "--rope-low-freq, --rope-high-freq, --rope-original-context are for --model llama");
    if (rope_given && (rope_given < 4 || !(c.rope_high_freq > c.rope_low_freq)))
        dt_usage_error("--rope-factor, --rope-low-freq, --rope-high-freq and --rope-original-context go together (Llama 3's "
                       "rescaling), with --rope-low-freq below --rope-high-freq");
    if (llama && !c.kv_heads) c.kv_heads = c.heads % 2 ? c.heads : c.heads / 2;
    if (llama && !c.ffn_dim) c.ffn_dim = (8 * c.dim / 3 + 31) / 32 * 32;
    if (llama && c.heads % c.kv_heads)
        dt_usage_error("--heads %d must be a multiple of --kv-heads %d (each key/value head serves a group)", c.heads, c.kv_heads);
    if (llama && c.dim % c.heads == 0 && (c.dim / c.heads) % 2)
        dt_usage_error("--dim %d / --heads %d = %d: llama's head width must be even (rotary embeddings turn pairs)", c.dim,
                       c.heads, c.dim / c.heads);
    if (!c.moe_experts && (c.moe_top_k || c.moe_every || c.moe_capacity > 0 || c.moe_aux_loss > 0))
        dt_usage_error("--moe-top-k, --moe-every, --moe-capacity and --moe-aux-loss go with --moe-experts");
    if (c.moe_experts && !gpt) dt_usage_error("--moe-experts: the experts replace a language model's MLP (--model gpt or llama)");
    if (c.moe_experts && !c.moe_top_k) c.moe_top_k = c.moe_experts > 1 ? 2 : 1;
    if (c.moe_top_k > c.moe_experts && c.moe_experts)
        dt_usage_error("--moe-top-k %d: a token cannot go to more than the %d experts (--moe-experts)", c.moe_top_k, c.moe_experts);
    if (llama && c.moe_every > 1)
        dt_usage_error("--moe-every %d: llama's experts are Mixtral's, in every block (--moe-every is for gpt)", c.moe_every);
    if (c.moe_experts && c.qkv_bias)
        dt_usage_error("--moe-experts with --qkv-bias: Mixtral's layout has no q/k/v biases (and Qwen2-MoE's shared experts are not built)");
    if (c.moe_experts && !c.moe_every) c.moe_every = 1;
    /* The balancing loss and the capacity are taken over the step's whole batch: 02's replicas
       run one after another, and a micro-batch of --accum-steps is not the whole. */
    int whole_batch = c.moe_aux_loss > 0 || c.moe_capacity > 0, one_device = !dt__stage_takes(stage, "--nproc");
    if (whole_batch && (!strcmp(stage, "02-dp") || c.accum_steps > 1))
        dt_usage_error("%s%s: --moe-capacity and --moe-aux-loss%s are taken over the step's whole batch, which %s does not see "
                       "at once (01, 03, 04 and 05 without accumulation do; give them 0 to train without)", stage,
                       c.accum_steps > 1 ? " --accum-steps" : "",
                       dt__given(given, "--moe-aux-loss") || dt__given(given, "--moe-capacity") ? "" : " (from --init's config.json)",
                       c.accum_steps > 1 ? "a micro-batch" : "this stage");
    /* DDP starts a bucket's all-reduce when its gradients are ready, and the
       ranks' tokens skip different experts: a route gathered again in
       backward (--recompute) could meet the buckets in another order on each rank. */
    if (whole_batch && !one_device && c.recompute && c.bucket_mb > 0 && !dt__stage_takes(stage, "--shard"))
        dt_usage_error("%s --recompute with --moe-capacity or --moe-aux-loss: the recomputed route gathers every rank's "
                       "probabilities again in backward, beside DDP's bucket all-reduces (--bucket-mb 0, or 04, allows it)", stage);
    if (c.tokens && c.data) dt_usage_error("--data and --tokens exclude each other (text as bytes, or token ids)");
    /* A pipeline (a stage that takes --micro-batches) already adds up its
       micro-batches' gradients before the optimizer steps: accumulating K
       steps is K times the micro-batches of a K times larger batch, in one
       flush of the pipeline (one fill and one drain, not K). */
    if (dt__stage_takes(stage, "--micro-batches") && c.accum_steps > 1) {
        if ((int64_t)c.micro_batches * c.accum_steps > DT_COMM_QUEUE)
            dt_usage_error("--accum-steps %d x --micro-batches %d: a pipeline runs at most %d micro-batches a step",
                           c.accum_steps, c.micro_batches, DT_COMM_QUEUE);
        if ((int64_t)c.batch_size * c.accum_steps > INT_MAX / 2)
            dt_usage_error("--accum-steps %d x --batch-size %d is too large a step", c.accum_steps, c.batch_size);
        c.micro_batches *= c.accum_steps;
        c.batch_size *= c.accum_steps;
        c.accum_steps = 1;
    }
    if ((dt__stage_takes(stage, "--tp") || dt__stage_takes(stage, "--cp") || dt__stage_takes(stage, "--ep")) &&
        !dt__given(given, "--shard"))
        c.shard = DT_SHARD_NONE;                                            /* 06-09: DDP's */
    int zpp = c.quantize_weights || c.quantize_grads || c.hierarchical;
    if (!zpp && dt__given(given, "--quant-block"))
        dt_usage_error("--quant-block goes with ZeRO++'s --quantize-weights or --quantize-grads");
    if (c.quantize_grads && c.reduce_dtype != DT_F32)
        dt_usage_error("--quantize-grads with --reduce-dtype: the gradients travel quantized, so no reduce dtype applies; drop one");
    if (zpp && c.shard == DT_SHARD_NONE)
        dt_usage_error("--quantize-weights, --quantize-grads and --hierarchical change how a sharded engine's collectives "
                       "travel; %s shards nothing by default: add --shard full", stage);
    if ((c.quantize_weights || c.hierarchical) && c.shard != DT_SHARD_FULL)
        dt_usage_error("--quantize-weights and --hierarchical change how ZeRO-3 gathers each unit's parameters: they need "
                       "--shard full");
    if (c.quant_block % 2) dt_usage_error("--quant-block %d: an even number (two int4 codes share a byte)", c.quant_block);
    c.zeropp = (dt_zeropp){ c.quantize_weights ? 8 : 0, c.quantize_grads == 1 ? 8 : c.quantize_grads == 2 ? 4 : 0,
                            c.hierarchical, c.quant_block, c.ranks_per_machine };
    if (dt__stage_takes(stage, "--pp") && !dt__given(given, "--tp")) c.tp = 1;      /* 07: whole layers in each stage */
    if ((dt__stage_takes(stage, "--cp") || dt__stage_takes(stage, "--ep")) && c.dtype == DT_F16)
        dt_usage_error("--dtype fp16: fp16 needs its loss scaled (stage 05), which %s does not do; use --dtype bf16, whose "
                       "range is f32's", stage);
    if (dt__stage_takes(stage, "--micro-batches") && c.dtype == DT_F16)
        dt_usage_error("--dtype fp16: fp16 needs its loss scaled (stage 05), which the pipeline does not carry from stage to "
                       "stage; use --dtype bf16, whose range is f32's");
    if (c.end_idx >= 0 && c.end_idx <= c.start_idx) dt_usage_error("--end-idx must be greater than --start-idx");
    if (c.attention == DT_ATTENTION_ONLINE && c.device == DT_CUDA && (vit || gpt) && c.heads > 0 &&
        c.dim / c.heads > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_usage_error("--attention online --device cuda: heads of --dim %d / --heads %d = %d columns; the GPU's online kernel "
                       "takes at most %d", c.dim, c.heads, c.dim / c.heads, DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    if (c.resume && c.init && strcmp(c.resume, "auto") && !c.lora_rank)   /* auto: --init when there is no checkpoint yet */
        dt_usage_error("--resume and --init exclude each other (resume restores the weights; with LoRA --init gives the frozen model)");
    if ((vit || gpt) && c.depth < 1)
        dt_usage_error("--depth must be at least 1 for --model %s, got %d", dt__family((dt_model_kind)c.model)->name, c.depth);
    if ((vit || gpt) && c.dim % c.heads) dt_usage_error("--dim %d must be divisible by --heads %d", c.dim, c.heads);
    if (vit && c.image_size % c.patch) dt_usage_error("--image-size %d must be a multiple of --patch %d", c.image_size, c.patch);
    /* --nproc N: stage 02 drives N devices from this one process (threads); from 03 on, N processes start here */
    char why[256];
    int ranks = strncmp(stage, "02", 2) ? c.nproc : 1;
    if (c.device == DT_CUDA && ranks > 1 && !dt_nccl_available(why, sizeof why))
        dt_usage_error("--device cuda --nproc %d: ranks on GPUs talk through NCCL, and %s", c.nproc, why);
    if (c.comm == DT_COMM_MPI && c.nproc > 1)
        dt_usage_error("--comm mpi --nproc %d: MPI's ranks are started by mpirun or srun --mpi=pmix, not by --nproc", c.nproc);
#ifndef DT_HAVE_MPI
    if (c.comm == DT_COMM_MPI)
        dt_usage_error("--comm mpi: " DT__NO_MPI);
#endif
    if (strncmp(stage, "02", 2)) dt_launch(c.nproc, c.timeout);   /* before any thread or device exists */
    if (!c.bench) dt__catch_stop_signals();     /* from here a signal stops the run after a step, saved */
    dt__flush_subnormals();
    dt_rank_from_env(&c.rank, &c.world_size, &c.local_rank);
    c.local_ranks = dt_local_ranks_from_env();
    dt__ctx.rank = c.rank;                      /* error lines name their rank from here on */
    dt__ctx.world_size = c.world_size;
    if ((int)c.device == 2)                    /* auto, decided by each rank after the fork */
        c.device = dt_cuda_available(why, sizeof why) ? DT_CUDA : DT_CPU;
    /* NCCL carries GPU memory; shared memory and MPI carry host memory */
    if (c.comm == DT_COMM_AUTO && c.device == DT_CUDA) c.comm = DT_COMM_NCCL;
    if ((c.comm == DT_COMM_NCCL) != (c.device == DT_CUDA))
        dt_fail("--comm %s carries %s memory, and this run trains on the %s: %s",
                c.comm == DT_COMM_NCCL ? "nccl" : c.comm == DT_COMM_MPI ? "mpi" : "shm", c.comm == DT_COMM_NCCL ? "GPU" : "host",
                c.device == DT_CUDA ? "GPU" : "CPU",
                c.device == DT_CUDA ? "leave --comm out (auto) or give --comm nccl" : "give --comm shm, mpi or auto");
    if (c.device == DT_CUDA && c.world_size > 1 && !dt_nccl_available(why, sizeof why))
        dt_fail("%d ranks on GPUs talk through NCCL, and %s", c.world_size, why);
#ifdef DT_HAVE_CUDA
    if (c.device == DT_CUDA) {
        int gpus = dt_cuda_device_count(why, sizeof why);
        if (gpus == 0) dt_fail("cannot use the GPU: %s (run with --device cpu)", why);
        if (dt_gpu_for_rank(c.local_rank, c.local_ranks, gpus, c.ranks_per_gpu, why, sizeof why) < 0) dt_fail("%s", why);
        int local = c.local_ranks > c.local_rank ? c.local_ranks : c.local_rank + 1;
        if (local > gpus && c.world_size > 1) dt__share_gpus(c.rank, local, gpus);
    }
#endif
    dt_set_device(c.device, c.local_rank);
    return c;
}

dt_model_config dt_model_config_from(const dt_config *cfg, int channels, int image_size, int classes) {
    dt_model_config m;
    memset(&m, 0, sizeof m);
    m.kind = cfg->model; m.channels = channels; m.image_size = image_size; m.classes = classes;
    m.dim = cfg->dim; m.depth = cfg->depth; m.heads = cfg->heads; m.patch = cfg->patch; m.mlp_hidden = 4 * cfg->dim;
    if (dt_model_is_language(cfg->model)) { m.seq_len = cfg->seq_len; m.channels = m.image_size = m.patch = 0; }
    if (cfg->model == DT_MODEL_LLAMA) {
        m.mlp_hidden = cfg->ffn_dim; m.kv_heads = cfg->kv_heads; m.untied_head = cfg->untied_head; m.qkv_bias = cfg->qkv_bias;
        m.rope_theta = cfg->rope_theta; m.norm_eps = cfg->norm_eps;      /* 0: dt_model_create's defaults */
        m.rope_factor = cfg->rope_factor; m.rope_low_freq = cfg->rope_low_freq; m.rope_high_freq = cfg->rope_high_freq;
        m.rope_original_context = cfg->rope_original_context;
    }
    m.moe_experts = cfg->moe_experts; m.moe_top_k = cfg->moe_top_k; m.moe_every = cfg->moe_every;
    m.moe_capacity = cfg->moe_capacity; m.moe_aux_loss = cfg->moe_aux_loss;
    m.lora_rank = cfg->lora_rank;
    m.lora_alpha = cfg->lora_alpha;
    if (cfg->lora_targets) dt__copy_str(m.lora_targets, sizeof m.lora_targets, cfg->lora_targets);
    return m;
}

/* --bench: random pixels and labels, a few batches' worth for every rank or device (and no
   validation set: dt_load_data leaves it empty). */
static void dt__bench_data(const dt_config *cfg, dt_dataset *train) {
    int ranks = cfg->nproc > cfg->world_size ? cfg->nproc : cfg->world_size;
    int64_t n = (int64_t)cfg->batch_size * ranks * 4;
    dt__dataset_alloc(train, n, cfg->image_size, 10);
    dt__rng rng = { cfg->seed };
    size_t bytes = (size_t)n * 3 * cfg->image_size * cfg->image_size;
    for (size_t i = 0; i < bytes; i++) train->pixels[i] = (uint8_t)(dt__rng_u64(&rng) >> 56);
    for (int64_t i = 0; i < n; i++) train->labels[i] = (int32_t)(dt__rng_u64(&rng) % 10);
    for (int c = 0; c < 10; c++) {
        char name[24];
        snprintf(name, sizeof name, "class%d", c);
        train->class_names[c] = strdup(name);
    }
    dt__copy_str(train->source, sizeof train->source, "random images in memory (--bench)");
}

/* The language models: text, from --data or --tokens, or the built-in text; --bench: random tokens. */
static void dt__load_text(const dt_config *cfg, dt_dataset *train, dt_dataset *val) {
    if (cfg->bench) {
        int ranks = cfg->nproc > cfg->world_size ? cfg->nproc : cfg->world_size, V = cfg->vocab > 0 ? cfg->vocab : 256;
        int64_t n = (int64_t)cfg->batch_size * ranks * 4 * cfg->seq_len + 1;
        int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
        if (!tok) dt_fail("out of memory (--bench)");
        dt__rng rng = { cfg->seed };
        for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)(dt__rng_u64(&rng) % (uint64_t)V);
        dt__text_split(tok, n, V, cfg->seq_len, "random tokens in memory (--bench)", train);
        free(tok);
        return;                          /* no validation set: dt_load_data left it empty */
    }
    const char *path = cfg->tokens ? cfg->tokens : cfg->data;
    if (!path) {
        path = "data/synthetic.txt";
        struct stat st;
        if (cfg->local_rank == 0 && stat(path, &st) != 0) {   /* one rank per machine writes it */
            if (!cfg->quiet) { printf("first use: writing the built-in text to %s (1 MB of generated sentences) ...\n", path); fflush(stdout); }
            if (stat("data", &st) != 0) dt__mkdir("data");
            char tmp[256];
            snprintf(tmp, sizeof tmp, "%s.partial", path);
            dt_synthetic_text_write(tmp, 1000000, 20261121);
            if (rename(tmp, path) != 0) dt_fail("cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
        }
        if (dt__ctx.job && dt__ctx.world_size > 1) dt_barrier(dt__ctx.job);
    }
    dt_text_load(path, cfg->tokens != NULL, cfg->vocab, cfg->seq_len, 0.1, train, val);
    dt_dataset_slice(train, cfg->start_idx, cfg->end_idx);
}

void dt_load_data(const dt_config *cfg, dt_dataset *train, dt_dataset *val) {
    memset(train, 0, sizeof *train);     /* the caller's sets start empty, whichever path fills them */
    memset(val, 0, sizeof *val);
    if (dt_model_is_language(cfg->model)) { dt__load_text(cfg, train, val); return; }
    if (cfg->bench) { dt__bench_data(cfg, train); return; }
    const char *dir = cfg->data;
    if (!dir) {
        dir = "data/synthetic";
        struct stat st;
        /* In a job, one rank per machine writes it while the others wait. */
        if (cfg->local_rank == 0 && stat(dir, &st) != 0) {
            if (!cfg->quiet) { printf("first use: writing the synthetic data set to %s (10000 + 2000 images) ...\n", dir); fflush(stdout); }
            if (stat("data", &st) != 0) dt__mkdir("data");
            dt_synthetic_write(dir, 10000, 2000, 32, 20261121);
        }
        if (dt__ctx.job && dt__ctx.world_size > 1) dt_barrier(dt__ctx.job);
    }
    double t0 = dt_now_ms();
    dt_dataset_load(dir, "train", cfg->image_size, NULL, train);
    dt_dataset_load(dir, "val", cfg->image_size, train, val);
    dt_dataset_slice(train, cfg->start_idx, cfg->end_idx);
    if (!cfg->quiet && dt__ctx.rank == 0) { printf("loaded %s in %.1f s\n", dir, (dt_now_ms() - t0) / 1e3); fflush(stdout); }
}


/* dtrain.h -- train a neural network on one device, then on many.            v0.1

   A single-header C library in the style of stb: the tensor, the kernels, the
   autograd tape, the models, the optimizer, the data loader, checkpoints and
   metrics live in this one file, written to be read top to bottom.

   USE
       In exactly one C file:
           #define DTRAIN_IMPLEMENTATION
           #include "dtrain.h"
       Everywhere else, just #include "dtrain.h". A build of several programs
       may compile the implementation once on its own (dtrain.c is that one
       file: cc -c dtrain.c) and each program with
       -DDTRAIN_IMPLEMENTATION_ELSEWHERE, linked to dtrain.o, as the Makefile
       does; such a program includes the system headers it uses itself (the
       implementation's are not in its way then).

       Optional, before the include in that one file (the Makefile sets them):
           DT_HAVE_STB    decode images with stb_image (PNG, JPEG, BMP, ...) and
                          write PNGs with stb_image_write; link with -lstb.
                          Without it, PPM/PGM images are read by this header.
           DT_HAVE_CBLAS  send matrix multiplies to a system BLAS (cblas_sgemm).
           DT_HAVE_CUDA   this program also has the CUDA backend (--device cuda):
                          compile this same header once with nvcc,
                              nvcc -x cu -DDTRAIN_CUDA_IMPLEMENTATION -c dtrain.h -o dtrain_cuda.o
                          and link dtrain_cuda.o -lcudart -ldl -lstdc++ (cuBLAS
                          is loaded when a GPU is first used: the cuda chapter).
           DT_HAVE_MPI    ranks on several CPU machines talk through MPI (--comm
                          mpi): compile with $(mpicc --showme:compile), link
                          with $(mpicc --showme:link), start with mpirun or srun.
       Build with OpenMP (-fopenmp) to use every core; OMP_NUM_THREADS picks how many.
       For speed, as the Makefile does: -O3 -march=native -fno-math-errno
       -fno-trapping-math. The last two change no result; without the last,
       gcc on a processor with AVX2 and no AVX-512 (most laptops) leaves exp,
       erf, tanh and the GELUs scalar (it will not turn a float choice,
       x < a ? a : x, into a vector blend).

   WHAT IT TEACHES, CHAPTER BY CHAPTER
       The chapters are the files src/NN-name.h this header is assembled from
       (HOW THIS FILE IS MADE, below). First the lessons, in the order the
       stages teach them:
       01 errors        every failure says what went wrong and what to do, then exits
       02 devices and   the device (CPU or GPU), and where the bytes go: parameters,
          memory        gradients, optimizer state, activations, communication,
                        data -- counted per arena; a clock and the core count
       03 tensors       a shape, a dtype, a pointer to the data and one to its
                        gradient
       04 matmul        the matmul every linear layer goes through
       05 autograd      the ops: each appends its backward to a tape; dt_backward()
                        walks it in reverse. Activations live in a per-step arena.
                        The callbacks a parallel wrapper implements (dt_parallel),
                        and how wrappers stack; linear, GELU, the norms, SwiGLU,
                        the residual
       06 attention     tensor parallelism's collectives as ops on the tape;
          and loss      attention, rotary embeddings, embeddings, the cross-entropy
       07 models        an MLP and a Vision Transformer with PyTorch/timm names, and two
                        causal language models with Hugging Face's names: GPT-2, and
                        Llama (RMSNorm, rotary embeddings, grouped-query attention,
                        SwiGLU; Qwen2's q/k/v biases), one table row per family;
                        activation recompute, block by block; LoRA; where tensor
                        parallelism may cut each parameter and which block reads
                        it (dt_split); any run of blocks on its own, for a
                        pipeline stage (dt_model_forward_blocks)
       08 optimizer     AdamW, SGD with momentum, gradient clipping, warmup + cosine
       09 mixed         bf16/fp16 activations and matmul operands, f32 master
          precision     weights and sums, dynamic loss scaling for fp16
       10 collectives   all-reduce, reduce-scatter, all-gather, broadcast, send and
                        recv over shared memory (threads or processes, sums in
                        rank order), NCCL or MPI (CPU ranks on several
                        machines), behind one table (dt_comm_backend); groups
                        (dt_comm_split) and a mesh of named dimensions
       11 data          DataParallel: one process, N devices, device 0 in charge
          parallel      (scatter, gather, reduce; its bottleneck); what every
                        data-parallel wrapper records of its communication
       12 DDP           DistributedDataParallel: a replica per process, gradients
                        averaged in buckets while backward runs; no-sync for
                        gradient accumulation
       13 FSDP          Fully Sharded Data Parallel: each rank keeps 1/N of every
                        unit, gathered to compute, gradients reduce-scattered;
                        ZeRO-1/2/3 side by side; CPU offload; no-sync; the
                        data-parallel engine a stage applies last (DDP or FSDP)
       14 tensor        each rank computes 1/T of every block: Megatron-LM's
          parallel      column- and row-parallel layers, the vocabulary split with
                        its cross-entropy, sequence parallelism; the engine
                        around it over the groups: DDP, or FSDP (2-D)
       15 pipeline      each rank a stage of consecutive blocks, micro-batches in
          parallel      GPipe's or 1F1B's order, each with its arena; with tensor
                        parallelism inside the stages and data parallel pipelines:
                        all three on a mesh. Each wrapper (11-15) is one
                        dt_parallel; calls in the wrong order are errors that say
                        what to call first
       16 backend       the per-element arithmetic (DT_HD) that the CPU loops and
          tables        the GPU kernels share, and what a device (dt_backend) and a
                        transport (dt_comm_backend) must provide
       Then the machinery that runs a training, which no lesson calls (the
       lessons compile without it: tools/assemble --lessons):
       17 data          image folders, CIFAR-10 binaries, text (bytes or token ids),
                        instruction examples whose prompts the loss ignores,
                        shuffling, rank sharding, augmentation, and synthetic
                        images and text made on first use
       18 launching     --nproc, torchrun/SLURM/Open MPI variables, a TCP rendezvous
                        that turns strangers away, a job that stops, naming the
                        rank, when one rank dies, and signals (SIGTERM: preempted)
                        that stop every rank after the same step, saved
       19 checkpoints   safetensors files written atomically; exact resume; sharded
                        (a file per rank and an index), consolidated, resharded
       20 hugging face  Hugging Face and PEFT model folders (--init), and a
                        training run's checkpoint: weights, optimizer, the run
       21 evaluation    validation loss and accuracy over every rank's share, and
                        text generated by a language model
       22 metrics       time charged to phases, Chrome traces, progress lines with
                        an ETA, TensorBoard and MLflow, and the one-line benchmark
                        report (--bench)
       23 cost model    predicts how a stage scales, and why (--explain): the
                        communication each wrapper sends and hides, a pipeline's
                        bubble
       24 command line  one table of flags for every stage, and the data they name
       25 run driver    the loop every stage shares: --init/--resume, batches, the
                        job's mean loss, JSON-lines logs, evaluation and checkpoints
                        at each epoch's end, stopping every rank alike on a signal; what
                        the machinery asks of a wrapper (dt_parallel_report)
       And the backend:
       26 CUDA          the GPU bodies of the ops, behind one table (dt_backend):
                        indexing, reductions and launch shape are all that differ.
                        Earlier chapters reach it only through what the backend
                        tables chapter declares: the tables (dt_backend,
                        dt_comm_backend), dt_cuda_backend, dt_cuda_device_count
                        and the dt_nccl_* calls a NCCL communicator is made of

   HOW THIS FILE IS MADE
       It is assembled from chapter files, src/NN-name.h in the project, by
       tools/assemble: make runs it when a chapter changes, and CI checks that
       the committed dtrain.h is the assembly. A chapter holds its declarations
       and its implementation together (the CUDA chapter implements the tables
       16 declares); this file puts every chapter's declarations first, then every
       implementation, then what the wrapper chapters (13-15) answer to the
       machinery (their dt_parallel_report: checkpoints, memory tables, figures
       for the log and the cost model), then the CUDA backend, and a line
       [src/NN-name.h] in a comment marks where each part begins (00 is this
       preface). Edit the chapters; a copy of this file alone needs none of them.

   A FAILURE NEVER CRASHES
       Bad flags exit with status 2, everything else that goes wrong (a missing
       folder, a corrupt image, a truncated checkpoint, a full disk) exits with
       status 1 after one line that starts with "dtrain: error:" and names the
       file or flag. A run stopped by SIGTERM or SIGUSR1 saves and exits with 75
       (preempted: run it again with --resume auto), by Ctrl-C with 130.

   STRUCTS YOU GET BACK
       A function that returns a struct or fills one in for you (dt_parse_args,
       dt_load_data, dt_dataset_load, dt_text_load, dt_loader_create,
       dt_loader_next, dt_run_start, dt_link_preset, ...) sets all of it to zero
       before writing its fields, so you may declare it uninitialised: a field
       that path does not use is 0 or NULL, never what your stack held.
       `make test-msan` (MemorySanitizer) checks that nothing reads a byte
       before something wrote it.

   NAMES
       dt_ names are the API: everything declared above the IMPLEMENTATION
       line. dt__ names (two underscores, as stb_image's stbi__) are the
       implementation's own and may change. Macros keep DT_ either way. The test suite builds with
       -DDT_TESTING, which compiles in hooks (a rank that dies on cue, a
       signal at a given step) that no other build has.

   LICENSE: MIT. Copy this file into your project and change what you like.
*/
#ifndef DTRAIN_H
#define DTRAIN_H

/* The implementation uses POSIX (fsync, open_memstream, posix_memalign). */
#if defined(DTRAIN_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif

/* -DDTRAIN_IMPLEMENTATION_ELSEWHERE: the implementation is compiled on its own
   and linked (USE, above); this program's DTRAIN_IMPLEMENTATION then asks for
   the declarations only. */
#ifdef DTRAIN_IMPLEMENTATION_ELSEWHERE
#undef DTRAIN_IMPLEMENTATION
#endif

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* DT_HD marks the per-element arithmetic that the CPU loops and the CUDA kernels
   share. In plain C it is empty; nvcc sees __host__ __device__. */
#if defined(__CUDACC__)
#define DT_HD __host__ __device__
#else
#define DT_HD
#endif

/* [src/01-errors.h] */
/* ---- errors -------------------------------------------------------------- */

/* Print "dtrain: error: <message>" (prefixed by the rank when there are several)
   and exit with status 1. Messages name the file or flag at fault. */
void dt_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;
/* A command-line mistake: the error, a short usage line, exit status 2. */
void dt_usage_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;
/* Print a warning line to stderr and carry on. */
void dt_warn(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* [src/02-devices-and-memory.h] */
/* ---- devices and memory ------------------------------------------------------ */

typedef enum { DT_CPU = 0, DT_CUDA = 1 } dt_device;

/* Where tensors, parameters and kernels live from now on (default: the CPU).
   DT_CUDA needs a build with CUDA (the Makefile does it when nvcc is found) and
   a visible GPU; without them it is an error that says which is missing.
   local_rank picks the GPU when a machine has several. */
void dt_set_device(dt_device device, int local_rank);
dt_device dt_current_device(void);
/* 1 when this build has CUDA and a GPU is visible; else 0, and why in `why`. */
int dt_cuda_available(char *why, size_t n);
/* Copies between host memory and memory of the current device (a plain
   memcpy on the CPU). On a GPU they wait for queued kernels to finish. */
void dt_upload(void *device_dst, const void *host_src, size_t bytes);
void dt_download(void *host_dst, const void *device_src, size_t bytes);
/* Wait until every queued kernel has finished (nothing to do on the CPU). */
void dt_synchronize(void);
/* Milliseconds on a monotonic clock, and the threads OpenMP uses (1 without it). */
double dt_now_ms(void);
int dt_threads(void);

/* Every byte the library allocates is counted in one of these arenas, so the
   summary can say where the memory went -- the lesson of sharding (stage 04). */
typedef enum {
    DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM, DT_ARENA_ACTS,
    DT_ARENA_COMM, DT_ARENA_DATA, DT_ARENA_COUNT
} dt_arena;

/* Zeroed, 64-byte aligned host memory counted in `arena`. Fails loudly when out of memory. */
void *dt_alloc(dt_arena arena, size_t bytes);
/* Give back memory from dt_alloc; `bytes` must be what was asked for. */
void dt_free(dt_arena arena, void *ptr, size_t bytes);
/* The same on a given device: GPU memory is counted in the same arenas. */
void *dt_alloc_on(dt_device device, dt_arena arena, size_t bytes);
void dt_free_on(dt_device device, dt_arena arena, void *ptr, size_t bytes);
/* Bytes held now and at most, per arena. */
size_t dt_mem_now(dt_arena arena);
size_t dt_mem_peak(dt_arena arena);
size_t dt_mem_total_now(void);
size_t dt_mem_total_peak(void);
/* Host memory that holds what was moved off the device (FSDP's --cpu-offload),
   counted apart from the device's so that the move shows. */
void *dt_alloc_host(dt_arena arena, size_t bytes);
void dt_free_host(dt_arena arena, void *ptr, size_t bytes);
size_t dt_mem_host_now(dt_arena arena);
size_t dt_mem_host_peak(dt_arena arena);
/* Forget the peaks (set them to what is held now): the run does it once set up,
   so that peaks are those of training, not of building the model. */
void dt_mem_reset_peaks(void);
const char *dt_arena_name(dt_arena arena);

/* The per-step arena holds activations and their gradients. It is a bump
   allocator: one pointer moves forward, and dt_step_arena_reset() moves it back
   at the start of each step. After the first step it never calls malloc again. */
void *dt_step_alloc(size_t bytes);
void dt_step_arena_reset(void);

/* [src/03-tensors.h] */
/* ---- tensors ---------------------------------------------------------------- */

typedef enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 } dt_dtype;

typedef struct dt_tensor {
    const char *name;          /* parameters only: "blocks.0.attn.qkv.weight" */
    int ndim;
    int shape[4];
    int64_t numel;
    /* The bits of `data`: f32, or -- activations under mixed precision, see
       the mixed-precision chapter -- bf16 or f16, read and written through data16 then. */
    dt_dtype dtype;
    union { float *data; uint16_t *data16; };  /* on `device`: not readable by the host when that is a GPU */
    /* NULL until a gradient flows into it. An activation's gradient has the
       activation's dtype; a parameter's is always f32 (the master gradient). */
    union { float *grad; uint16_t *grad16; };
    dt_device device;
    int requires_grad;         /* parameters, and anything computed from them */
    int is_param;
    int hook_gen, first_use;   /* parameters: where the tape last reads them (grad ready) */
    struct dt_parallel *parallel;   /* parameters: the wrapper their model is in (the autograd chapter), or NULL */
} dt_tensor;

/* A tensor of f32 in the per-step arena (gone at the next reset). Contents are zero. */
dt_tensor *dt_tensor_new(int ndim, const int *shape);
dt_tensor *dt_tensor_2d(int rows, int cols);
/* Rows of a 2-D view: shape[0] x (product of the rest). */
int64_t dt_tensor_rows(const dt_tensor *t);
int64_t dt_tensor_cols(const dt_tensor *t);
/* The gradient buffer of t, allocated (zeroed) on first use. */
float *dt_grad(dt_tensor *t);
/* A tensor on the current device holding a copy of n host floats. */
dt_tensor *dt_tensor_from_host(int ndim, const int *shape, const float *host);
/* Copy a tensor's values (or its gradient) to host memory of t->numel floats. */
void dt_tensor_to_host(const dt_tensor *t, float *host);
void dt_tensor_grad_to_host(const dt_tensor *t, float *host);
/* The first element, on the host: a loss. */
float dt_tensor_item(const dt_tensor *t);
/* Bytes per element (4 or 2), and "fp32", "bf16", "fp16". */
size_t dt_dtype_size(dt_dtype d);
const char *dt_dtype_name(dt_dtype d);

/* [src/04-matmul.h] */
/* ---- kernels ------------------------------------------------------------------ */

/* C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major; op transposes
   when trans_a / trans_b is set. The one routine every matmul goes through. */
void dt_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha,
             const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* Per-element arithmetic, shared with the GPU kernels. */
/* exp, tanh and erf in plain float arithmetic, with no call into libm, so that
   a compiler turns a loop of them into vector instructions (libm's are one
   value per call: a third of the GPT's step went to tanhf and expm1f). The
   same bits on the CPU and the GPU. Accuracy, tested against libm over a dense
   grid: exp within 4 ulps (relative 5e-7); tanh and erf within 5e-7 absolute. */
DT_HD static inline float dt_exp_value(float x);
DT_HD static inline float dt_tanh_value(float x);
DT_HD static inline float dt_erf_value(float x);
DT_HD static inline float dt_gelu_value(float x);        /* x * Phi(x), exact erf */
DT_HD static inline float dt_gelu_derivative(float x);
/* GPT-2's GELU: the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
DT_HD static inline float dt_gelu_tanh_value(float x);
DT_HD static inline float dt_gelu_tanh_derivative(float x);
/* Llama's SiLU, x * sigmoid(x), and its derivative */
DT_HD static inline float dt_silu_value(float x);
DT_HD static inline float dt_silu_derivative(float x);
/* Half types: round to nearest even; inf, NaN and subnormals survive. */
DT_HD static inline uint16_t dt_f32_to_bf16(float f);
DT_HD static inline float dt_bf16_to_f32(uint16_t h);
DT_HD static inline uint16_t dt_f32_to_f16(float f);
DT_HD static inline float dt_f16_to_f32(uint16_t h);

/* [src/05-autograd.h] */
/* ---- autograd: the ops ------------------------------------------------------ */

/* Each op computes its output now and, when gradients are on and an input
   requires them, appends its backward to the tape. */
dt_tensor *dt_linear(dt_tensor *x, dt_tensor *weight, dt_tensor *bias); /* x W^T + b */
/* x W + b with W stored [in, out]: the layout of GPT-2's Conv1D layers */
dt_tensor *dt_linear_in_out(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_gelu(dt_tensor *x);
dt_tensor *dt_gelu_tanh(dt_tensor *x);                                    /* GPT-2's GELU */
/* dt_gelu(dt_linear(...)) and dt_gelu_tanh(dt_linear_in_out(...)) in one
   pass (the same results and tape) */
dt_tensor *dt_linear_gelu(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_linear_in_out_gelu_tanh(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_layernorm(dt_tensor *x, dt_tensor *weight, dt_tensor *bias, float eps);
/* Llama's norm: x / sqrt(mean(x^2) + eps) * weight, no mean taken out, no bias */
dt_tensor *dt_rmsnorm(dt_tensor *x, dt_tensor *weight, float eps);
dt_tensor *dt_add(dt_tensor *a, dt_tensor *b);
dt_tensor *dt_scale(dt_tensor *x, float factor);                         /* factor x */
/* Llama's MLP activation: silu(gate) * up, element by element (SwiGLU) */
dt_tensor *dt_swiglu(dt_tensor *gate, dt_tensor *up);

/* Convert n values between f32, bf16 and f16 buffers on the current device. */
void dt_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n);
/* Element i of a buffer of dtype t, as f32; and an f32 stored there (a 16-bit
   dtype rounded to nearest even). */
float dt_load_f32(const void *p, int64_t i, dt_dtype t);
void dt_store_f32(void *p, int64_t i, dt_dtype t, float v);
/* Gradients on or off (off for evaluation: no tape, no gradient buffers). */
void dt_set_grad_enabled(int on);
/* Walk the tape backwards from a scalar loss, filling every .grad. */
void dt_backward(dt_tensor *loss);
/* The same from any tensor `loss`, given `seed`: d(objective)/d(loss), loss->numel values. */
void dt_backward_from(dt_tensor *loss, const float *seed);

/* A parallel wrapper (the parallel chapters: DataParallel, DDP, FSDP, TP, PP) is this one set of
   callbacks. Each is called by the code that owns its moment of a step: the
   model's forward (a unit begins, ends), the tape (a parameter's gradient is
   final: DDP starts all-reducing its bucket while backward goes on), the
   wrapper's own sync function (backward is done), the optimizer (which
   parameters it steps, when it is created; the step is done). A NULL
   callback: nothing to do at that moment -- DDP has no units, DataParallel
   only sums gradients when backward is done. A wrapper attaches itself with dt_model_set_parallel
   (the models chapter): the model and each of its parameters then point to it, so
   nothing is looked up in global state.
   Wrappers stack, as picotron's do: tensor parallelism cuts every layer,
   pipeline parallelism cuts the blocks into stages around it, and a
   data-parallel engine (DDP, FSDP) wraps the stack, averaging or sharding
   over the data groups what the others split. The outer one names the
   inner (`inner`) and becomes the model's; backward_done and step_done then
   run for each wrapper of the stack, outer first, and the layers' sums
   (tp_sum and the rest) are the inner's, found by dt_parallel_splitting.
   The moments inside a step (unit_begin, unit_end, grad_ready) go to the
   outer one alone: the engine's, as only it gathers units and averages
   gradients. */
typedef struct dt_parallel dt_parallel;
struct dt_optimizer;
struct dt_parallel {
    /* The wrapper's public functions, which the order mistakes name:
       "dt_fsdp_create", "dt_fsdp_sync_grads", "dt_fsdp_free". */
    const char *create_fn, *sync_fn, *free_fn;
    /* The wrapper this one wraps (set before dt_model_set_parallel), or NULL. */
    dt_parallel *inner;
    void (*unit_begin)(dt_parallel *par, int unit);
    void (*unit_end)(dt_parallel *par, int unit);
    void (*grad_ready)(dt_parallel *par, dt_tensor *param);
    void (*backward_done)(dt_parallel *par);
    void (*step_done)(dt_parallel *par);
    /* Pipeline parallelism runs M backwards a step, and says before each
       whether it is the step's last: an engine around it that averages
       whole gradients (DDP) waits for that one (its no-sync). NULL: it
       communicates after every backward (FSDP's ZeRO-2 and -3, which keep
       gradients sharded by reducing each micro-batch's at once). */
    void (*set_sync)(dt_parallel *par, int sync);
    /* Gradients this rank holds in common with ranks outside the engine's
       group -- a tied vocabulary, held by a pipeline's first and last
       stage -- added up across them. The engine around it calls this once
       a step, when those gradients are whole and final and before it
       shards them (it may average first: the two commute). */
    void (*sum_shared_grads)(dt_parallel *par);
    void (*optimizer_view)(dt_parallel *par, struct dt_optimizer *opt);
    /* A sharded optimizer's partial sums (its gradient norm's), added over
       the ranks that share the model: what clipping needs of the whole. */
    void (*sum_over_ranks)(dt_parallel *par, float *values, int n);
    /* Tensor parallelism (stage 06): sum n f32 values on the device -- an
       activation or its gradient -- over the ranks that split the layers,
       in place. NULL: no layer is split, and dt_tp_copy and dt_tp_sum are
       the identity. */
    void (*tp_sum)(dt_parallel *par, float *values, int64_t n);
    /* The same group's largest of n values (each row's largest logit, when
       the vocabulary is split), and its all-gather (each rank's n values,
       rank after rank: the whole logits, for evaluation); NULL without it. */
    void (*tp_max)(dt_parallel *par, float *values, int64_t n);
    void (*tp_all_gather)(dt_parallel *par, const float *mine, float *all, int64_t n);
    /* Sequence parallelism (--sequence-parallel): the same group's all-gather
       (each rank's n values, rank after rank) and reduce-scatter (the sum,
       this rank keeping its n of n x tp_size), on the device; NULL without
       it. tp_rank, tp_size: this rank's place in the group. */
    void (*sp_all_gather)(dt_parallel *par, const float *mine, float *all, int64_t n);
    void (*sp_reduce_scatter)(dt_parallel *par, const float *all, float *mine, int64_t n);
    int tp_rank, tp_size;
    /* Kept by the same wrapper, for the cost model: the sums of this step's
       training so far (an all-gather or a reduce-scatter counts half), their
       bytes and their time. */
    double tp_sums, tp_sum_bytes, tp_sum_ms;
    /* The share of the data this rank reads, data_rank of data_ranks (what
       dt_evaluate splits by): 0 ranks means the job's rank and size. */
    int data_rank, data_ranks;
    /* The ranks whose gradients of the same parameters a data-parallel engine
       around must average: 0, the data_ranks groups (each holds other
       pieces: tensor and pipeline parallelism); context parallelism, every
       rank of the job (each holds the whole model and a part of every
       gradient, its tokens'; only the groups read other batches). */
    int grad_ranks;
    /* Kept by the ops: 1 between dt_sp_split and dt_sp_gather, where each rank
       holds its share of the rows (and backward, walking back, sets it again). */
    int rows_split;
    /* A wrapper that cuts the model (tensor, pipeline parallelism): its
       parameters in their whole shapes, a shell without buffers (NULL: the
       model's own), which the flop count and checkpoints go by. */
    struct dt_model *whole;
    /* Pipeline parallelism (stage 07): the model's forward as the pipeline
       runs it -- this rank's blocks, the activations passed from stage to
       stage, the last stage's logits given to every rank -- for what calls
       dt_model_forward without gradients (evaluation, generation); NULL: the
       model's own. */
    dt_tensor *(*forward)(dt_parallel *par, dt_tensor *inputs);
    /* What the machinery asks of a wrapper besides -- a checkpoint of the
       whole model, what each rank holds, the figures of a step for the log,
       --bench and the cost model -- is not here: it is the run driver's
       dt_parallel_report, which each wrapper fills at its chapter's end. */
    /* Kept by the library: a backward ran since backward_done did, so the
       gradients are this rank's own, not yet the average the optimizer needs. */
    int grads_pending;
};
/* backward_done, called by each wrapper's sync function (dt_ddp_sync_grads,
   ...), then each inner wrapper's: fails unless a backward has run since the
   last one. */
void dt_parallel_backward_done(dt_parallel *par);
/* The wrapper of a stack that splits the layers (its tp_sum set), or NULL:
   what dt_tp_copy and the other ops of tensor parallelism use. */
dt_parallel *dt_parallel_splitting(dt_parallel *par);
/* Floating-point operations counted by the matmuls since the last reset. */
double dt_flops_counted(void);
void dt_flops_reset(void);

/* Tensor parallelism's two conjugate ops (Megatron-LM's f and g), which put
   its communication on the tape so that backward needs no special case. A
   column-parallel layer (each rank computes its share of the outputs) reads
   dt_tp_copy(x): the input itself, but in backward each rank holds only its
   share's part of x's gradient, so they are summed over the group. A
   row-parallel layer (each rank multiplies its share of the inputs) gives
   partial outputs: dt_tp_sum adds them up over the group, and in backward
   every rank needs the whole gradient, which it has. Without a wrapper that
   gives tp_sum, both return x. */
dt_tensor *dt_tp_copy(dt_parallel *par, dt_tensor *x);
dt_tensor *dt_tp_sum(dt_parallel *par, dt_tensor *x);
/* Sequence parallelism (Korthikanti et al., 2022): between the split layers,
   where the norms and residual adds work row by row, each rank of the group
   keeps 1/T of the rows (tokens) instead of all of them. dt_sp_split enters
   that region (this rank's rows; backward all-gathers their gradients),
   dt_sp_gather leaves it (every row again; backward keeps this rank's). In
   between, dt_tp_copy becomes an all-gather of the rows (backward: a
   reduce-scatter) and dt_tp_sum a reduce-scatter (backward: an all-gather):
   the same bytes as the all-reduces they replace, as each all-reduce is a
   reduce-scatter then an all-gather. Without a wrapper that gives
   sp_all_gather, both return x; so they do when the rows do not split evenly
   and no gradient is wanted (generation), and with gradients that is an error. */
dt_tensor *dt_sp_split(dt_parallel *par, dt_tensor *x);
dt_tensor *dt_sp_gather(dt_parallel *par, dt_tensor *x);

/* [src/06-attention-and-loss.h] */
/* ---- autograd: attention, embeddings, the loss ---- */

/* x [rows, cols] + bias [cols] on every row: a row-parallel layer's bias, added
   once, after the sum. */
dt_tensor *dt_add_bias(dt_tensor *x, dt_tensor *bias);

/* Llama's attention input: q [B*T, H*hd], k and v [B*T, KV*hd] -> qkv
   [B*T, 3*H*hd] as dt_attention reads it. q and k are rotated by their
   position (rotary embeddings, Hugging Face's rotate-half pairs j and
   j + hd/2, angle t / theta^(2j/hd)); each of the KV key/value heads serves
   H/KV query heads (grouped-query attention), so it is repeated that often.
   Llama 3 rescales the frequencies (rope_type "llama3"): those slower than
   original_context / low_freq are divided by factor, those faster than
   original_context / high_freq kept, the ones between blended. factor 0: none. */
typedef struct dt_rope { float theta, factor, low_freq, high_freq; int original_context; } dt_rope;
dt_tensor *dt_rotary_qkv(dt_tensor *q, dt_tensor *k, dt_tensor *v, int B, int T, int H, int KV, dt_rope rope);
/* qkv: [B*T, 3*D] laid out as timm's (q | k | v, the H heads side by side) -> [B*T, D] */
dt_tensor *dt_attention(dt_tensor *qkv, int B, int T, int H, int causal);
/* How attention computes on the CPU. DT_ATTENTION_MATMUL (the default): each
   head's T x T probabilities made by two matmuls and kept for backward.
   DT_ATTENTION_ONLINE: never stored -- FlashAttention's online softmax (Dao
   et al., 2022): a row's keys are visited in blocks, its running largest
   score and sum rescaling what came before, and only the row's log-sum-exp
   is kept; backward makes each probability again from it. T x T floats a
   head become T (and the output, kept in f32); the same values within
   rounding. The recurrence is per-element arithmetic that GPU kernels share
   (dt_online_softmax_rescale: the GPU's online attention kernels, its row
   softmax and its classifier run it too). (--attention) */
typedef enum { DT_ATTENTION_MATMUL = 0, DT_ATTENTION_ONLINE = 1 } dt_attention_body;
void dt_set_attention_body(dt_attention_body body);
/* Context parallelism (stage 08): this thread holds T tokens of each
   sequence, at `positions` (ascending) of the whole, and attention's keys go
   around `ring` (dt_ring_attention, the context-parallel chapter). The ops
   that depend on where a token sits read it: learned position embeddings
   (dt_token_embedding: wpe's rows at the positions), rotary angles
   (dt_rotary_qkv) and dt_attention. Set by the context-parallel wrapper
   for this thread; NULL (the default): every sequence is whole here. */
typedef struct dt_sequence_split { struct dt_comm *ring; const int32_t *positions; int T; } dt_sequence_split;
void dt_set_sequence_split(const dt_sequence_split *split);
/* One row of the online softmax: m, the largest score seen so far. A block
   of new scores whose largest is block_max moves m up to it; what the row
   summed before (exp(s - m_old) each) is to be multiplied by the factor
   returned, exp(m_old - m_new) (0 before any score). */
DT_HD static inline float dt_online_softmax_rescale(float *m, float block_max);
/* The fused classifier's gradient of one logit x of a row whose largest
   value is m and sum of exp(x - m) is l: (p - onehot) * scale, p its
   softmax, exp(x - m) / l, rounded once (dt_cross_entropy's backward, on
   any device; inv_l = 1 / l in double). */
DT_HD static inline float dt_cross_entropy_grad(float x, float m, double inv_l, float onehot, float scale);
/* token ids [B, T] (whole numbers held as f32) -> [B*T, D]: row (b, t) is
   wte[token] + wpe[t], the token's embedding plus its position's (wpe NULL:
   no position embedding, as in Llama, whose attention rotates by position) */
dt_tensor *dt_token_embedding(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe);
/* patches [B*P, D] -> tokens [B*(P+1), D]: class token first, position embedding added */
dt_tensor *dt_vit_tokens(dt_tensor *patches, dt_tensor *cls, dt_tensor *pos, int B);
/* x [B*T, D] -> [B, D]: token `index` of each sequence */
dt_tensor *dt_select_token(dt_tensor *x, int B, int T, int index);
/* A label of DT_IGNORE_INDEX (-100, as in PyTorch and Hugging Face) adds
   nothing to the loss: an instruction's prompt, an example's padding. */
#define DT_IGNORE_INDEX (-100)
/* Mean cross-entropy of logits [B, C] against labels, over the labels that are
   not ignored; a 1-element tensor. A language model's logits [B*T, vocab]
   take a label per row: the next token. Logits whose vocabulary tensor
   parallelism split (stage 06) are scored with the group: a collective. */
dt_tensor *dt_cross_entropy(dt_tensor *logits, const int32_t *labels);
/* A model's logits on the host, rows x the whole vocabulary (the columns of
   a vocabulary split by tensor parallelism gathered first: a collective). */
void dt_logits_to_host(const dt_tensor *logits, float *host);
/* Make dt_cross_entropy of these labels (this very array, until the step
   arena is reset) divide its sum by `divisor` instead of by the labels it
   counts. For masked data the run driver sets the targets that count in the
   whole step, over every rank and micro-batch, divided by ranks x
   micro-batches: DDP's mean of the gradients and accumulation's 1/K then make
   it the mean over the step's targets, so N ranks train exactly as one device
   with N times the batch however the prompts fall (each rank's own mean would
   weigh a short answer's tokens more). */
void dt_cross_entropy_set_divisor(const int32_t *labels, double divisor);
/* images [B, C, H, W] -> [B*(H/p)*(W/p), C*p*p], each row one patch in (c, y, x)
   order, so a conv with kernel = stride = p is a linear layer on these rows. */
dt_tensor *dt_patchify(const dt_tensor *images, int patch);

/* [src/07-models.h] */
/* ---- models --------------------------------------------------------------------- */

typedef enum { DT_MODEL_MLP = 0, DT_MODEL_VIT = 1, DT_MODEL_GPT = 2, DT_MODEL_LLAMA = 3 } dt_model_kind;

typedef struct dt_model_config {
    dt_model_kind kind;
    int channels, image_size, classes;           /* gpt, llama: classes is the vocabulary */
    int dim, depth, heads, patch, mlp_hidden;    /* mlp: dim = hidden width, depth = hidden layers;
                                                    llama: mlp_hidden is the SwiGLU width (--ffn-dim) */
    int seq_len;                                 /* gpt, llama: the context, in tokens */
    /* llama only; 0 takes the default in brackets */
    int kv_heads;                                /* key/value heads, grouped-query attention [heads] */
    int untied_head;                             /* 1: an lm_head.weight of its own; 0: the head is embed_tokens */
    int qkv_bias;                                /* 1: q, k and v projections with biases (Qwen2) */
    float rope_theta;                            /* the rotary embeddings' base [10000] */
    float norm_eps;                              /* RMSNorm's epsilon [1e-5] */
    float rope_factor, rope_low_freq, rope_high_freq;   /* Llama 3's rescaled frequencies (dt_rope); 0: none */
    int rope_original_context;
    /* LoRA (--lora-rank): the weights above frozen, and beside each targeted
       linear layer a trainable pair A [rank, in], B [out, rank]: y = x W^T + b
       + (alpha / rank) (x A^T) B^T. rank 0: none. */
    int lora_rank;
    float lora_alpha;
    char lora_targets[256];                      /* module names, comma-separated: "q_proj,v_proj" */
} dt_model_config;

/* Where tensor parallelism (stage 06) may cut a parameter: the model says,
   the wrapper cuts (the tensor-parallel chapter). dim -1: whole on every rank (norms,
   position embeddings, the ViT's head, a row-parallel layer's bias). Otherwise dimension
   dim is cut into equal pieces, one per rank, in `parts` groups that are
   cut alike (the q, k and v of a fused projection: each rank takes its heads
   of all three), each piece a whole number of `align` (a head's width:
   attention is split by heads). A weight cut along its outputs is a
   column-parallel layer, along its inputs a row-parallel one. */
typedef struct dt_split {
    int dim, parts, align;
    int rows;      /* read between dt_sp_split and dt_sp_gather: under --sequence-parallel each rank's
                      gradient of a whole parameter is then its rows' part, summed over the group */
    int vocab;     /* the vocabulary's rows (an embedding, a head): cut only when they divide by T
                      (GPT-2's 50,257 do not), whole otherwise */
    /* Pipeline parallelism (stage 07) gives each rank a run of blocks, so it
       asks which block reads the parameter: -1 the embedding (the first
       stage), dt_model_blocks the head (the last); dt_model_create sets it
       from the parameter's unit. head: read by the head though it sits in
       the embedding's unit (the GPT's final norm). tied: read by the
       embedding and by the head (a tied vocabulary), so the first and the
       last stage each hold it, and add up its two gradients. */
    int block, head, tied;
} dt_split;

typedef struct dt_model {
    dt_model_config cfg;
    int nparams;
    dt_tensor *params;         /* in forward order; data and grad point into the flat buffers */
    float *flat_data;          /* every parameter, one after another: what DDP and FSDP move */
    float *flat_grad;
    int64_t numel;
    int64_t *offsets;          /* where each parameter starts in the flat buffers */
    dt_split *splits;          /* per parameter: where tensor parallelism may cut it */
    dt_device device;          /* where the flat buffers live */
    /* Units: the pieces FSDP gathers one at a time -- a linear layer of the MLP;
       the embedding, each block, and the norm + head of the ViT. Unit u holds
       parameters unit_first[u] .. unit_first[u + 1] - 1. */
    int nunits;
    int *unit_first;
    /* -1, or the unit whose forward begins before every other unit's and ends
       after them: the GPT's embeddings and final norm, because its head reads
       the token embedding again (tied weights). FSDP keeps it gathered for the
       whole step, as PyTorch's FSDP does with its root unit. */
    int outer_unit;
    dt_parallel *parallel;     /* the wrapper this model is in (the parallel chapters), or NULL */
    int optimizers;            /* optimizers created on it and not freed yet */
    int recompute;             /* --recompute: each block's activations are made again in backward */
    /* Set by dt_tp_free (its name): the split parameters stay this rank's
       pieces, so the model can be freed but no longer run. */
    const char *left_cut_by;
    /* LoRA: the frozen model the adapters (this model's parameters) sit on,
       with no gradients and no optimizer state, never communicated; NULL
       without LoRA. lora_of[i]: where base parameter i's A is in params (B
       follows it), or -1. */
    struct dt_model *base;
    char *base_source;         /* where base's weights came from (--init's path), or NULL: the seed's */
    int *lora_of;
    float lora_scale;          /* alpha / rank */
    uint64_t base_seed;        /* the seed base's weights were drawn from (they stay, without --init) */
} dt_model;

/* Build a model with freshly initialised weights (seeded, so runs repeat) on
   the current device. The same seed gives the same weights on CPU and GPU. */
dt_model *dt_model_create(const dt_model_config *cfg, uint64_t seed);
/* Fails while a wrapper or an optimizer still holds the model: free those first. */
void dt_model_free(dt_model *m);
/* A parallel wrapper attaches itself (its create function calls this) and
   detaches (NULL, from its free function), before the optimizer (which steps
   what the wrapper gives it) and after it: the other orders are errors that
   say what to call first. A wrapper whose `inner` is the model's wraps it (a
   stack); detached, it leaves the model to the inner one again. */
void dt_model_set_parallel(dt_model *m, dt_parallel *par);
/* The model in its whole shapes: what a wrapper that cut it (tensor, pipeline
   parallelism; in a stack, the one inside) keeps as its `whole`; else m. */
const dt_model *dt_model_whole(const dt_model *m);
/* Activation recompute (--recompute) on or off: in training, each block keeps
   only its input and output, and its forward runs again when backward
   reaches it. The same bits, less memory, one more forward per step. */
void dt_model_set_recompute(dt_model *m, int on);
/* images [B, C, S, S] scaled to [-1, 1] -> logits [B, classes];
   gpt, llama: token ids [B, T] -> logits [B*T, vocab], row (b, t) predicting token t + 1 */
dt_tensor *dt_model_forward(dt_model *m, dt_tensor *inputs);
/* A model is an embedding, dt_model_blocks(m) blocks (the mlp's: its layers)
   and a head. Pipeline parallelism (stage 07) runs a share of them on each
   rank: blocks [first, end), from the embedding of `inputs` when first is 0,
   else from x (the activation the stage before computed), to the logits
   when end is dt_model_blocks(m), else to the activation the next stage
   takes. inputs give the shapes (B, and T) either way. */
int dt_model_blocks(const dt_model *m);
dt_tensor *dt_model_forward_blocks(dt_model *m, dt_tensor *inputs, dt_tensor *x, int first, int end);
/* Model FLOPs of one token's training step (forward and backward): 6 per
   parameter that multiplies (every one but the position embeddings, and
   Llama's token embedding when its head is a matrix of its own), plus the
   attention's 12 x depth x dim x context. Tokens/s times this is what MFU
   uses. 0 for the image models. */
double dt_model_flops_per_token(const dt_model *m);
dt_tensor *dt_model_param(dt_model *m, const char *name); /* NULL when absent */
void dt_model_zero_grad(dt_model *m);
/* Describes the model in one line: "vit dim=192 depth=6 heads=3 patch=4 (5.36M params)". */
void dt_model_describe(const dt_model *m, char *out, size_t n);
/* 1 for the language models (gpt, llama: token ids in, next-token logits out) */
int dt_model_is_language(dt_model_kind kind);

/* A batch the loader gives a model (the data chapter fills it; the pipeline cuts it into micro-batches). */
typedef struct dt_batch {
    dt_tensor *inputs;         /* images [B, C, S, S] in [-1, 1], or token ids [B, T] */
    int32_t *labels;           /* [B] classes, or [B*T] next tokens */
    int size;                  /* B */
} dt_batch;

/* [src/08-optimizer.h] */
/* ---- optimizer ----------------------------------------------------------------- */

typedef enum { DT_ADAMW = 0, DT_SGD = 1 } dt_optimizer_kind;

typedef struct dt_optimizer {
    dt_optimizer_kind kind;
    float beta1, beta2, eps, weight_decay, momentum, clip_norm;
    int64_t step;              /* optimizer steps taken (AdamW's bias correction uses it) */
    float *m, *v;              /* AdamW's moments, or SGD's momentum in m */
    dt_model *model;
    float last_grad_norm;
    /* What it updates: flat buffers of numel values, cut into slices that share
       a weight decay -- one per parameter, or, when FSDP shards the model, one
       per part of a parameter that lies in this rank's shard. */
    float *params, *grads;
    int64_t numel;
    int nslices;
    /* copy: another rank of the wrapper's group holds the same gradient and
       counts it in the norm (a replicated parameter under tensor parallelism) */
    struct dt_param_slice { int64_t offset, length; int decay, copy; } *slices;
    dt_parallel *sharded_by;   /* sharded: its wrapper sums the gradient norm over the ranks */
    dt_device device;          /* where its buffers are and it computes */
    int offloaded;             /* its buffers are host memory (FSDP's --cpu-offload) */
} dt_optimizer;

/* It steps what the model's parallel wrapper gives it (FSDP: this rank's
   shard), so a wrapper must exist before it or not at all. */
dt_optimizer *dt_optimizer_create(dt_model *model, dt_optimizer_kind kind, float weight_decay,
                                  float momentum, float clip_norm);
void dt_optimizer_free(dt_optimizer *opt);
/* Clip the gradients (when clip_norm > 0), update every parameter, zero the
   gradients, then tell the wrapper the step is done (FSDP's ZeRO-1 and -2
   gather the new parameters). Fails while the wrapper has not synchronised
   the gradients of the last backward. */
void dt_optimizer_step(dt_optimizer *opt, float lr);
/* Linear warmup from 0 over `warmup` steps, then cosine decay to 0 at `total`. */
float dt_schedule_lr(float base_lr, int64_t step, int64_t warmup, int64_t total);
/* The per-element updates (PyTorch's AdamW and SGD), shared with the GPU kernels. */
DT_HD static inline void dt_adamw_update(float *p, float *m, float *v, float g, float lr,
                                         float beta1, float beta2, float eps, float wd,
                                         float bias_correction1, float bias_correction2);
DT_HD static inline void dt_sgd_update(float *p, float *buf, float g, float lr, float momentum,
                                       float wd);

/* [src/09-mixed-precision.h] */
/* ---- mixed precision ------------------------------------------------------------ */

/* The dtype activations are stored in and matmuls read (default DT_F32). With
   DT_BF16 or DT_F16, parameters, their gradients and the optimizer state stay
   f32 -- the master weights -- and every op reads its inputs rounded to 16 bits
   and stores its output in 16 bits; layernorm statistics, softmax, the loss and
   every sum inside a matmul stay f32. A parallel wrapper fixes its buffers
   to it when created, so changing it while one exists is an error. */
void dt_set_compute_dtype(dt_dtype dtype);
dt_dtype dt_compute_dtype(void);

/* Dynamic loss scaling, for fp16: its smallest number is 6e-8 (2^-24), and
   gradients of activations fall below it and become 0. Multiplying the loss by
   `scale` lifts every gradient by the same factor; the optimizer sees them
   divided again. Too large a scale makes some gradient inf: that step is
   skipped and the scale halved. After growth_interval good steps in a row it
   doubles. bf16 has f32's exponent range and needs none (enabled 0, scale 1). */
typedef struct dt_loss_scaler {
    int enabled;
    float scale;               /* starts at 65536 */
    int growth_interval;       /* 2000 */
    int64_t good_steps;        /* since the last skip or growth */
    int64_t skipped;           /* steps skipped so far */
    int last_skipped;          /* the last step was skipped */
} dt_loss_scaler;
dt_loss_scaler dt_loss_scaler_create(dt_dtype dtype);
/* Backward of loss * scale / accum_steps: each of accum_steps micro-batches
   adds its share, so their sum is the gradient of the mean over all of them. */
void dt_backward_scaled(dt_tensor *loss, const dt_loss_scaler *scaler, int accum_steps);
/* After the gradients are synchronised, before the optimizer: returns 1 with
   the gradients divided by the scale; or, when any gradient on any rank is inf
   or NaN, 0 with the gradients zeroed, the scale halved and the step to be
   skipped -- every rank decides alike, as the check is summed over them. */
int dt_loss_scaler_unscale(dt_loss_scaler *scaler, dt_optimizer *opt);

/* [src/10-collectives.h] */
/* ---- collectives ---------------------------------------------------------------- */

/* A communicator joins the ranks of one job. Backends: shared memory for host
   buffers (ranks that are threads of one process, or processes of one machine;
   the same algorithm, summing in rank order, so results never depend on timing)
   and NCCL for GPU buffers. Every call is collective: each rank makes the same
   calls in the same order -- except dt_send and dt_recv, which only the two
   ranks of a pair make. A communicator splits into groups (dt_comm_split, and
   a mesh of named dimensions, dt_mesh_create): tensor parallelism all-reduces
   within a group of ranks, pipeline parallelism sends activations from one
   rank to the next. */
typedef struct dt_comm dt_comm;
typedef struct dt_comm_group dt_comm_group;     /* the shared state of thread ranks */
/* AUTO: on the host, shared memory when every rank is on one machine and MPI
   when they are not (a build with MPI, ranks started by mpirun or srun). */
typedef enum { DT_COMM_SHM = 0, DT_COMM_NCCL = 1, DT_COMM_MPI = 2, DT_COMM_AUTO = 3 } dt_comm_kind;
#ifndef DT_HAVE_MPI
/* What --comm mpi is told in a program compiled without MPI (the stages, dt_comm_init, tools/collectives). */
#define DT__NO_MPI "this build has no MPI (it is compiled in with -DDT_HAVE_MPI, which make adds when it finds mpicc: " \
                   "install libopenmpi-dev, or MPICH, and build again)"
#endif
typedef enum { DT_SUM = 0, DT_AVG = 1, DT_MAX = 2 } dt_reduce_op;   /* MAX: a split vocabulary's largest logit */
typedef int64_t dt_comm_handle;                 /* what an asynchronous call returns */
/* Every call a communicator queues, the same for every backend (the cuda chapter's
   NCCL code switches on it too). */
typedef enum { DT_COLL_ALL_REDUCE, DT_COLL_REDUCE_SCATTER, DT_COLL_ALL_GATHER, DT_COLL_BROADCAST, DT_COLL_REDUCE,
               DT_COLL_BARRIER, DT_COLL_SEND, DT_COLL_RECV, DT_COLL_RING_SHIFT } dt_coll;

/* Threads of one process (stage 02 on the CPU): one group, then one join per thread. */
dt_comm_group *dt_comm_group_create(int world, double timeout_s);
dt_comm *dt_comm_join(dt_comm_group *g, int rank);
void dt_comm_group_free(dt_comm_group *group);   /* after every member is freed: else an error */
void dt_comm_free(dt_comm *c);
int dt_comm_rank(const dt_comm *c);
int dt_comm_size(const dt_comm *c);
const char *dt_comm_backend_name(const dt_comm *c);   /* "shared memory", "NCCL", "MPI" */
int dt_comm_sums_in_rank_order(const dt_comm *c);      /* 0: MPI's own order (a tree, a ring) */

/* Asynchronous collectives run in order on a communication thread (shared memory)
   or stream (NCCL); dt_comm_wait() returns when the call behind a handle is done
   -- on GPUs, when the GPU's later work waits for it (the host does not), so
   its result is read through the device's stream, as every copy is.
   dt_barrier holds the host on both. count is in elements of dtype; send and
   recv may be the same buffer. */
dt_comm_handle dt_all_reduce_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype,
                                   dt_reduce_op op);
/* send holds world * count elements; recv gets this rank's count of the reduction. */
dt_comm_handle dt_reduce_scatter_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype,
                                       dt_reduce_op op);
/* send holds count elements; recv gets world * count, rank after rank. */
dt_comm_handle dt_all_gather_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype);
dt_comm_handle dt_broadcast_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int root);
dt_comm_handle dt_reduce_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype,
                               dt_reduce_op op, int root);
void dt_comm_wait(dt_comm *c, dt_comm_handle h);
/* The same, waiting for the result. */
void dt_all_reduce(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op);
void dt_reduce_scatter(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op);
void dt_all_gather(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype);
void dt_broadcast(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int root);
void dt_reduce(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op, int root);
void dt_barrier(dt_comm *c);
/* Start-up check: every rank must hold the same value of `what` (a flag, a model
   shape); otherwise every rank stops with a message naming the ranks and values. */
void dt_comm_check_agree(dt_comm *c, const char *what, const char *value);

/* Point-to-point: only `peer` and this rank take part. A send finishes when its
   peer has received it (as NCCL's do, unless grouped), so two ranks that both
   send first wait for each other: one of them must receive first. The two
   sides must agree on count and dtype; shared memory checks that they do. */
dt_comm_handle dt_send_async(dt_comm *c, const void *buf, int64_t count, dt_dtype dtype, int peer);
dt_comm_handle dt_recv_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int peer);
void dt_send(dt_comm *c, const void *buf, int64_t count, dt_dtype dtype, int peer);
void dt_recv(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int peer);
/* A ring shift, collective: every rank sends `send` to the next rank, (rank + 1)
   % size, and receives the previous rank's into `recv`, all at the same time --
   one step of a ring (context parallelism passes keys and values around one).
   Every rank gives the same count and dtype; send and recv must not overlap. */
dt_comm_handle dt_ring_shift_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype);
void dt_ring_shift(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype);

/* Groups: collective over comm; the ranks that pass the same color (>= 0) form a
   new communicator, ranked by (key, rank in comm). It has its own queue and, on
   the CPU, its own shared memory, so groups run side by side; a rank that dies
   still stops the whole job. Free it with dt_comm_free before comm. */
dt_comm *dt_comm_split(dt_comm *comm, int color, int key);

/* A mesh: the ranks of comm as a grid of named dimensions, the last varying
   fastest (a 2 x 2 "dp" x "tp" mesh: ranks 0, 1 are one tensor-parallel pair,
   ranks 0, 2 one data-parallel pair). Each dimension gets a communicator of the
   ranks that differ only along it. The sizes must multiply to comm's size. */
typedef struct dt_mesh dt_mesh;
#define DT_MESH_MAX_DIMS 4
dt_mesh *dt_mesh_create(dt_comm *comm, int ndims, const int *sizes, const char *const *names);
dt_comm *dt_mesh_comm(const dt_mesh *mesh, const char *name);   /* the group along `name` */
int dt_mesh_coord(const dt_mesh *mesh, const char *name);       /* this rank's place along it */
void dt_mesh_free(dt_mesh *mesh);                               /* frees its communicators */

/* [src/11-data-parallel.h] */
/* ---- data parallelism: DataParallel ----------------------------------------- */

/* DataParallel (stage 02): one process drives N devices. Device 0 holds the
   model and the optimizer; every other device holds a replica, run by a thread
   of its own. Each step: replicate (device 0's parameters broadcast to every
   replica), scatter (each device takes its slice of the batch), forward on
   every device at once, gather (the logits back to device 0, where the loss is
   computed). Backward runs on every device, then the gradients are summed onto
   device 0 (reduce), which steps alone. Device 0 does more than the others:
   that is DataParallel's bottleneck, and the reason for DDP. */
typedef struct dt_dp dt_dp;
/* Start devices-1 replica threads (devices <= 1: none, the model runs alone). */
dt_dp *dt_dp_create(dt_model *model, int devices, double timeout_s);
/* Replicate, scatter the inputs [N*B, ...] in N slices, run every device's
   forward, gather the logits on device 0, device after device ([N*B, classes],
   or a language model's [N*B*T, vocab]). The gather is on the tape: its
   backward hands each device its slice of the gradient and starts that
   device's backward while device 0 goes on with its own. */
dt_tensor *dt_dp_forward(dt_dp *dp, dt_tensor *inputs);
/* Wait for every device's backward, then sum their gradients into device 0's. */
void dt_dp_reduce_grads(dt_dp *dp);
int dt_dp_devices(const dt_dp *dp);
/* Stop the replicas; prints each device's peak memory unless quiet. */
void dt_dp_free(dt_dp *dp, int quiet);

/* [src/12-ddp.h] */
/* ---- DistributedDataParallel ------------------------------------------------ */
/* DistributedDataParallel (stage 03, and the engine of 06-07 without
   --shard): one process per device, each with a whole replica and its own
   optimizer; only gradients travel. They travel in
   buckets: runs of parameters taken in reverse order (the order backward
   finishes them), about bucket_mb each (the first one 1 MB, so communication
   starts early). A bucket's all-reduce (average) starts the moment its last
   gradient is final, on the communication thread or stream, while backward
   goes on. bucket_mb 0: one all-reduce of everything after backward, the
   no-overlap baseline (same bits: the sums run in rank order either way). */
typedef struct dt_ddp dt_ddp;
/* Broadcast rank 0's parameters (every replica starts equal) and plan the
   buckets. A model that tensor or pipeline parallelism holds is wrapped
   with it (a stack): comm is then the ranks that hold the same pieces. */
dt_ddp *dt_ddp_create(dt_model *model, dt_comm *comm, double bucket_mb);
/* After backward: start what has not started, wait for every bucket. Every
   rank then holds the average gradient. */
void dt_ddp_sync_grads(dt_ddp *ddp);
int dt_ddp_buckets(const dt_ddp *ddp);
/* Gradient accumulation (stage 05): with sync 0 the backward passes that follow
   leave their gradients to add up locally and communicate nothing (PyTorch's
   no_sync()); the backward after dt_ddp_set_sync(ddp, 1) all-reduces the sum. */
void dt_ddp_set_sync(dt_ddp *ddp, int sync);
void dt_ddp_free(dt_ddp *ddp);

/* [src/13-fsdp.h] */
/* ---- fully sharded data parallel --------------------------------------------- */

/* Fully sharded data parallel (stages 04-05, and the engine of 06-07 with
   --shard): like DDP, but no rank keeps the
   whole model. Each unit's parameters are one flat buffer padded to a multiple
   of N; rank r keeps elements [r, r + 1) * size/N of it -- its shard -- and the
   optimizer state of that shard only. The mode chooses what is sharded, as the
   ZeRO paper's stages do:
     DT_SHARD_OPTIMIZER  optimizer state (ZeRO-1): gradients reduce-scattered
                         after backward, each rank steps its shard, the new
                         parameters are all-gathered
     DT_SHARD_GRADS      + gradients (ZeRO-2): each unit's gradients are
                         reduce-scattered as soon as its backward is done
                         (the outer unit's after backward, with the rest of
                         the step's sums)
     DT_SHARD_FULL       + parameters (ZeRO-3): a unit is all-gathered just
                         before its forward, freed after it, gathered again
                         just before its backward; the next unit's all-gather
                         is started while one computes (prefetch), and the
                         last unit stays gathered from its forward into its
                         backward, which needs it first
   Checkpoints of a sharded model are sharded too (the checkpoints chapter). */
typedef enum { DT_SHARD_NONE = -1, DT_SHARD_OPTIMIZER = 0, DT_SHARD_GRADS = 1, DT_SHARD_FULL = 2 } dt_shard_mode;   /* NONE: 06's and 07's default (DDP) */
typedef struct dt_fsdp dt_fsdp;
/* Broadcast rank 0's parameters, keep this rank's shards, free the rest. The
   optimizer, created after this, holds the shard's state only. cpu_offload:
   the shards and the optimizer state live in host memory, the optimizer steps
   on the CPU, and a unit's shard is copied to the device just before its
   all-gather (on a CPU-only run, between the device and host arenas). */
dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload);
/* After backward: DT_SHARD_OPTIMIZER reduce-scatters every gradient now; the
   other modes did it unit by unit during backward, all but the outer unit's,
   which they reduce-scatter now (after what the wrappers inside add up). */
void dt_fsdp_sync_grads(dt_fsdp *fsdp);
/* Gradient accumulation (stage 05), as dt_ddp_set_sync: with sync 0 no unit is
   reduce-scattered, and each unit's whole gradient adds up in a buffer of the
   model's size (PyTorch's FSDP no_sync() keeps unsharded gradients too: fewer
   collectives, paid for in memory); the next synchronised backward
   reduce-scatters the sums. */
void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync);
/* Reduce-scatter gradients in this dtype (default f32), as PyTorch's
   MixedPrecision(reduce_dtype=...). Parameters are gathered in the compute
   dtype that was set when dt_fsdp_create ran (the mixed-precision chapter). */
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype);
void dt_fsdp_free(dt_fsdp *fsdp);

/* The data-parallel engine a stage applies last, over the ranks that hold
   the same model or the same pieces of it (06: around tensor parallelism,
   over dt_tp_data_group; 07: around a pipeline, over dt_pp_data_group): DDP
   when nothing is sharded (DT_SHARD_NONE, with bucket_mb), else FSDP in that
   mode, with cpu_offload. Create it before the optimizer, sync after
   backward (it syncs the wrappers inside it too), free it before what it
   wraps. */
typedef struct dt_data_parallel dt_data_parallel;
dt_data_parallel *dt_data_parallel_create(dt_model *model, dt_comm *comm, dt_shard_mode shard, int cpu_offload,
                                          double bucket_mb);
void dt_data_parallel_sync_grads(dt_data_parallel *dp);
void dt_data_parallel_free(dt_data_parallel *dp);

/* [src/14-tensor-parallel.h] */
/* Tensor parallelism (stage 06), as Megatron-LM splits a transformer: every
   rank of a group of T keeps 1/T of each large weight and computes 1/T of
   each layer. In a block, the first MLP layer is column-parallel (each rank
   computes 1/T of the hidden units, and GELU runs on them where they are),
   the second row-parallel (partial outputs, summed over the group);
   attention is split by heads: q, k and v column-parallel, the output
   projection row-parallel. So a block costs two sums of its activations in
   forward (dt_tp_sum) and two of their gradients in backward (dt_tp_copy),
   and no weight ever travels. A language model's vocabulary (its embedding
   and its head, tied or not) is cut by tokens: each rank looks up and
   scores 1/T of them, and dt_cross_entropy takes the group's max and sum of
   each row. Llama's q, k and v are cut by their heads (k and v by the
   key/value heads), its gated MLP as the GPT's. Norms and
   position embeddings stay whole on every rank, where they compute the same
   values and get the same gradients. The model says where each parameter may be cut (dt_split); this
   wrapper cuts. With a job larger than T, the ranks form a mesh of
   data-parallel x tensor-parallel groups ("dp" x "tp", tp varying fastest):
   each group of T shares a batch, and a data-parallel engine wraps the cut
   model over the "dp" groups (dt_tp_data_group): DDP averages each piece's
   gradient over the groups, FSDP shards the pieces over them too (2-D
   parallelism: each rank keeps 1/(T x D) of a split weight). */
typedef struct dt_tp dt_tp;
/* Keep this rank's piece of every split parameter (the weights drawn whole
   from the seed, as in stage 01, then cut). tp 0: the whole job is one group.
   sequence_parallel: between the split layers each rank keeps 1/T of the
   rows too (dt_sp_split), and the gradients of the whole parameters read
   there (the blocks' norms, the row-parallel biases) are summed over the
   group after backward. */
dt_tp *dt_tp_create(dt_model *model, dt_comm *comm, int tp, int sequence_parallel);
/* After backward: the split layers need nothing (their sums ran on the tape);
   with --sequence-parallel the whole parameters read where the rows are
   split are summed over the group. With more than one group the engine that
   wraps it syncs (and this runs inside its sync); unwrapped, that is an
   error that says so. */
void dt_tp_sync_grads(dt_tp *tp);
/* The ranks that hold the same pieces, one per group ("dp"): what a
   data-parallel engine wrapping this one averages or shards over. */
dt_comm *dt_tp_data_group(const dt_tp *tp);
/* This rank's group among the data-parallel groups, and how many there are:
   the loader's rank and world (every rank of a group reads the same batch). */
int dt_tp_data_rank(const dt_tp *tp);
int dt_tp_data_ranks(const dt_tp *tp);
/* The model stays cut (this rank's pieces): after this it can be freed, and
   a forward is an error that says so. */
void dt_tp_free(dt_tp *tp);

/* [src/15-pipeline-parallel.h] */
/* Pipeline parallelism (stage 07): each rank of a pipeline of P keeps a run
   of consecutive blocks, its stage (balanced by parameters; the embedding
   with the first, the head with the last); a batch goes through in M
   micro-batches, in the order the schedule gives each stage. It cuts the
   ranks of `comm` into pipelines of P stages (pp 0: one pipeline of them
   all). Around tensor parallelism, comm is dt_tp_data_group: each stage is
   then T ranks that split its blocks' layers as stage 06 does. With more
   than one pipeline, a data-parallel engine wraps this one over
   dt_pp_data_group, as in 06 -- DDP, which averages once a step, after the
   last micro-batch; or FSDP, ZeRO-1 once a step, ZeRO-2 and -3 each
   micro-batch's gradients as its backward ends (so they stay sharded). */
typedef struct dt_pp dt_pp;
typedef enum { DT_SCHEDULE_GPIPE = 0, DT_SCHEDULE_1F1B = 1 } dt_pp_schedule;
dt_pp *dt_pp_create(dt_model *model, dt_comm *comm, int pp, int micro_batches, dt_pp_schedule schedule);
/* A step's forward and backward: the batch cut into the micro-batches, each
   stage running its forwards and backwards in the schedule's order, sending
   activations on and gradients back. Returns the batch's mean loss, on every
   rank (the last stage computes it). Collective over the pipeline. */
dt_tensor *dt_pp_forward_backward(dt_pp *pp, const dt_batch *batch);
/* After it, unwrapped (one pipeline): the first and last stage add up the
   gradients of a tied vocabulary (each holds it). Wrapped, the engine's
   sync does, and this is an error naming it. */
void dt_pp_sync_grads(dt_pp *pp);
/* The ranks that hold the same stage, one per pipeline ("dp"): what a
   data-parallel engine wrapping this one averages or shards over; and this
   rank's pipeline among them, and how many: the loader's rank and world
   (every stage of a pipeline reads the same batch). */
dt_comm *dt_pp_data_group(const dt_pp *pp);
int dt_pp_data_rank(const dt_pp *pp);
int dt_pp_data_ranks(const dt_pp *pp);
/* The model stays cut (this rank's blocks), as after dt_tp_free. */
void dt_pp_free(dt_pp *pp);

/* [src/16-context-parallel.h] */
/* Context parallelism (stage 08) splits every sequence along its length: each
   of C ranks holds T/C of its tokens. Everything in a transformer but
   attention works on each token alone, so it runs on a rank's tokens as it
   would on the whole sequence (at the tokens' true positions). Attention needs
   every key: the keys and values go around a ring of the C ranks (ring
   attention, Liu et al., 2023). In C steps each rank attends its queries to
   the block of keys it holds while the next block is on its way
   (dt_ring_shift_async), and merges the partial results by the online softmax
   -- what FlashAttention does between blocks of keys on one device
   (dt_online_softmax_rescale), done here between ranks. The result is exact:
   the rows of whole-sequence attention, within rounding. Backward sends the
   keys and values around again, each block's gradient sum travelling one
   step behind it until it reaches the rank that owns it.

   The ops that depend on where a token sits -- learned position embeddings,
   rotary angles, attention -- read a thread's sequence split
   (dt_set_sequence_split, the attention chapter): its tokens' positions and
   the ring. So a model runs unchanged on a rank's share of each sequence.

   A causal model's late tokens attend to more keys than its early ones, so
   cutting a sequence into C contiguous pieces gives the last rank about
   2C - 1 times the first's work. The zig-zag layout cuts it into 2C chunks and
   gives rank r chunks r and 2C - 1 - r, an early one and a late one: the same
   work on every rank (dt_ring_attention_scores counts it). */
typedef enum { DT_CP_ZIGZAG = 0, DT_CP_CONTIGUOUS = 1 } dt_cp_layout;
/* The positions, in a sequence of T tokens, of the T / C tokens that rank
   `rank` of C holds, in the order it holds them (ascending). T must be a
   multiple of 2C (zig-zag) or of C (contiguous); otherwise an error. */
void dt_cp_positions(dt_cp_layout layout, int T, int C, int rank, int32_t *positions);
/* dt_attention of a sequence split along its length over the ranks of
   `ring`: qkv [B*T, 3*D] holds this rank's T tokens of each of B sequences,
   at the places `positions` (T of them, ascending, the same for every
   sequence; a causal query sees the keys at its place and before). Out:
   [B*T, D], the rows of whole-sequence attention for this rank's tokens. A
   collective of the ring, forward and backward; on the CPU or a GPU (whose
   kernels, heads of at most DT_ATTENTION_ONLINE_MAX_HEAD_DIM, have not run yet). */
dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring);
/* Query-key score products the ring attention made on this thread so far,
   forward and backward: a rank's attention work, counted, not timed (by the
   CPU's bodies: the GPU's kernels do not count). */
int64_t dt_ring_attention_scores(void);

/* The wrapper (stage 08): a job of N ranks is N/C data-parallel groups of C
   ranks ("dp" x "cp", cp varying fastest); the ranks of a group read the same
   batch and each keeps its tokens of every sequence (dt_cp_split_batch).
   cp 0: the whole job is one group. A language model (gpt, llama) whose
   context cuts into the layout's chunks. It cuts no weight: every
   rank holds the whole model and, after backward, a part of every gradient
   (its tokens'), so a data-parallel engine must wrap it over every rank of the
   job (dt_cp_data_group) -- the mean of the ranks' gradients is the
   gradient of the mean loss over all the tokens of all the groups' batches.
   Evaluation splits its sequences around the ring too. */
typedef struct dt_cp dt_cp;
dt_cp *dt_cp_create(dt_model *model, dt_comm *comm, int cp, dt_cp_layout layout);
/* Keep this rank's tokens of the batch's sequences: inputs [B, T] become
   [B, T/C], the labels likewise (in the step arena). */
void dt_cp_split_batch(dt_cp *cp, dt_batch *batch);
/* Every rank of the job: what the data-parallel engine around averages over. */
dt_comm *dt_cp_data_group(const dt_cp *cp);
/* This rank's group among the data-parallel groups, and how many there are:
   the loader's rank and world (every rank of a group reads the same batch). */
int dt_cp_data_rank(const dt_cp *cp);
int dt_cp_data_ranks(const dt_cp *cp);
void dt_cp_free(dt_cp *cp);

/* [src/17-backend-tables.h] */
/* ---- per-element arithmetic (declared above; defined here because every file
        that includes the header, and nvcc, needs the bodies) ------------------ */
#include <math.h>
#include <string.h>

/* exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln 2 / 2: ln 2 in two
   parts (Cody and Waite) keeps r exact, a degree-6 Taylor polynomial gives
   exp(r), and n goes straight into the exponent bits. This is the arithmetic
   alone, for c in (-87.3, 88] and not NaN: tanh and erf only ask for exp of
   such a c, and skip dt_exp_value's choices (a quarter of a vectorised
   loop's instructions) with the same bits. */
DT_HD static inline float dt__exp_in_range(float c) {
    float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;    /* round to nearest: 1.5 x 2^23 */
    float r = (c - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33333377e-3f
                  + r * 1.38888892e-3f)))));
    uint32_t scale = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &scale, 4);
    return p * two_n;
}
/* Any x (softmax, cross-entropy and SiLU pass unbounded ones). Below -87.3
   the result would be subnormal: 0, as the flushed arithmetic everywhere
   else makes it; above 88 it is exp(88). */
DT_HD static inline float dt_exp_value(float x) {
    float c = x > -87.3f ? x : -87.3f;          /* NaN: worked as -87.3 (no undefined cast), returned as NaN */
    c = c < 88.0f ? c : 88.0f;                  /* two plain choices: one nested choice made longer vector code */
    float e = c > -87.3f ? dt__exp_in_range(c) : 0.0f;
    return x == x ? e : x;
}
/* tanh(x) = 1 - 2 / (exp(2|x|) + 1), with x's sign; 1 in float beyond |x| = 10. */
DT_HD static inline float dt_tanh_value(float x) {
    float a = fabsf(x) < 10.0f ? fabsf(x) : 10.0f;
    float t = 1.0f - 2.0f / (dt__exp_in_range(2.0f * a) + 1.0f);     /* 2a in [0, 20]; a NaN x gives a = 10 */
    return x == x ? (x < 0 ? -t : t) : x;                        /* NaN stays NaN */
}
/* Abramowitz and Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + ...)) exp(-x^2),
   t = 1 / (1 + p |x|), within 1.5e-7 of erf, with x's sign. The exp(-x^2)
   it used goes to *gauss (0 past |x| = 9, where erf is +-1 in float): GELU's
   derivative needs it too. */
DT_HD static inline float dt__erf_and_gauss(float x, float *gauss) {
    float a = fabsf(x) < 9.0f ? fabsf(x) : 9.0f;
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    *gauss = fabsf(x) < 9.0f ? dt__exp_in_range(-a * a) : 0.0f;     /* -a^2 in [-81, 0]; NaN x: a = 9 */
    float e = 1.0f - poly * *gauss;
    return x == x ? (x < 0 ? -e : e) : x;                        /* NaN stays NaN */
}
DT_HD static inline float dt_erf_value(float x) {
    float gauss;
    return dt__erf_and_gauss(x, &gauss);
}
DT_HD static inline float dt_gelu_value(float x) {
    return 0.5f * x * (1.0f + dt_erf_value(x * 0.70710678118654752f));
}
/* d/dx [x Phi(x)] = Phi(x) + x phi(x), where phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
   and exp(-x^2 / 2) is the one erf(x / sqrt 2) computed: one exp, not two
   (past |x| = 12.7 it is 0, and the derivative Phi(x), 0 or 1) */
DT_HD static inline float dt_gelu_derivative(float x) {
    float gauss, cdf = 0.5f * (1.0f + dt__erf_and_gauss(x * 0.70710678118654752f, &gauss));
    return cdf + x * (0.39894228040143268f * gauss);
}
DT_HD static inline float dt_gelu_tanh_value(float x) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);      /* sqrt(2/pi) (x + 0.044715 x^3) */
    return 0.5f * x * (1.0f + dt_tanh_value(u));
}
DT_HD static inline float dt_gelu_tanh_derivative(float x) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x), t = dt_tanh_value(u);
    float du = 0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
/* sigmoid(x) = 1 / (1 + exp(-x)); exp(-x) saturates at exp(88), where
   sigmoid is 0 in float anyway */
DT_HD static inline float dt_silu_value(float x) { return x * (1.0f / (1.0f + dt_exp_value(-x))); }
/* The online softmax's step: m moves up to the block's largest score, and
   what was summed on the old scale shrinks by exp(m_old - m_new). */
DT_HD static inline float dt_online_softmax_rescale(float *m, float block_max) {
    float old = *m, now = old > block_max ? old : block_max;
    *m = now;
    return old == -INFINITY ? 0.0f : dt_exp_value(old - now);
}
DT_HD static inline float dt_cross_entropy_grad(float x, float m, double inv_l, float onehot, float scale) {
    return ((float)((double)dt_exp_value(x - m) * inv_l) - onehot) * scale;
}
DT_HD static inline float dt_silu_derivative(float x) {
    float sg = 1.0f / (1.0f + dt_exp_value(-x));
    return sg * (1.0f + x * (1.0f - sg));
}

DT_HD static inline uint32_t dt_float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
DT_HD static inline float dt_bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bf16 is the top half of an f32: round the bottom half to nearest even. */
DT_HD static inline uint16_t dt_f32_to_bf16(float f) {
    uint32_t x = dt_float_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
DT_HD static inline float dt_bf16_to_f32(uint16_t h) { return dt_bits_float((uint32_t)h << 16); }

/* f16: 5 exponent bits (bias 15), 10 mantissa bits; below 2^-14 the numbers
   are subnormal (m * 2^-24), above 65504 they round to infinity. */
DT_HD static inline uint16_t dt_f32_to_f16(float f) {
    uint32_t x = dt_float_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return (uint16_t)(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);       /* >= 65520: inf */
    if (x < 0x38800000u) {                                           /* subnormal or zero */
        if (x <= 0x33000000u) return sign;                           /* <= 2^-25: rounds to 0 */
        uint32_t e = x >> 23, m = (x & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - e;
        uint32_t half = m >> shift, rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = x - 0x38000000u;                                    /* rebias 127 -> 15 */
    uint32_t half = r >> 13, rem = r & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;    /* a carry bumps the exponent */
    return (uint16_t)(sign | half);
}
DT_HD static inline float dt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    if (e == 0) {
        if (m == 0) bits = sign;
        else {                                                       /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3FFu) << 13);
        }
    } else if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else bits = sign | ((e + 112u) << 23) | (m << 13);
    return dt_bits_float(bits);
}

/* GPU launch shape, here so that a CPU test can check it: a grid is capped
   (DT_MAX_BLOCKS blocks of DT_THREADS), so every kernel loops -- thread i
   takes items i, i + stride, ...; a warp-per-row kernel takes rows w, w +
   warps, ... -- and no item is left out however large the tensor. */
#define DT_THREADS 256
#define DT_MAX_BLOCKS (65535 * 8)
DT_HD static inline unsigned dt_blocks_for(int64_t threads) {
    int64_t b = (threads + DT_THREADS - 1) / DT_THREADS;
    return (unsigned)(b < 1 ? 1 : b > DT_MAX_BLOCKS ? DT_MAX_BLOCKS : b);
}
DT_HD static inline int64_t dt_grid_first(unsigned block, unsigned block_dim, unsigned thread) {
    return (int64_t)block * block_dim + thread;
}
DT_HD static inline int64_t dt_grid_stride(unsigned grid_dim, unsigned block_dim) { return (int64_t)grid_dim * block_dim; }

/* AdamW exactly as torch.optim.AdamW: decoupled weight decay, then the moments,
   then the bias-corrected step. */
DT_HD static inline void dt_adamw_update(float *p, float *m, float *v, float g, float lr,
                                         float beta1, float beta2, float eps, float wd,
                                         float bias_correction1, float bias_correction2) {
    float pv = *p * (1.0f - lr * wd);
    float mv = beta1 * *m + (1.0f - beta1) * g;
    float vv = beta2 * *v + (1.0f - beta2) * g * g;
    float denom = sqrtf(vv / bias_correction2) + eps;
    *p = pv - (lr / bias_correction1) * mv / denom;
    *m = mv;
    *v = vv;
}
/* SGD with momentum as torch.optim.SGD (dampening 0): weight decay joins the
   gradient, the buffer accumulates it, the parameter follows the buffer. */
DT_HD static inline void dt_sgd_update(float *p, float *buf, float g, float lr, float momentum,
                                       float wd) {
    float gv = g + wd * *p;
    float b = momentum * *buf + gv;
    *buf = b;
    *p -= lr * b;
}

/* ---- the device backend: what a GPU must provide -------------------------------
   The ops of the autograd chapter are written once. Each checks where its tensors live and
   either runs its CPU loop or calls the matching entry of this table, which the
   CUDA chapter at the end of this file fills in. So the table is the whole
   contract between the library and a device: memory, copies, and one body per
   op. All pointers are device pointers, calls queue in order on one stream,
   backward bodies ADD into their gradient outputs (as the CPU loops do), and a
   NULL gradient output means that gradient is not wanted. */
typedef struct dt_backend {
    char name[256];                                  /* "NVIDIA H100 80GB HBM3" */
    void *(*alloc)(size_t bytes);                    /* not zeroed */
    void (*release)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*upload)(void *dst, const void *host_src, size_t bytes);
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*synchronize)(void);
    void (*gemm)(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc);
    /* mixed precision: A and B in 16 bits (`dtype`), C in f32, products summed in f32 */
    void (*gemm_half)(dt_dtype dtype, int ta, int tb, int M, int N, int K, const void *A, int lda,
                      const void *B, int ldb, float beta, float *C, int ldc);
    void (*add_bias)(float *y, const float *bias, int rows, int cols);
    void (*sum_rows)(const float *x, float *out, int rows, int cols);   /* out[j] += sum_i x[i,j] */
    void (*gelu_forward)(const float *x, float *y, int64_t n, int tanh_form);
    void (*gelu_backward)(const float *x, const float *dy, float *dx, int64_t n, int tanh_form);
    void (*layernorm_forward)(const float *x, const float *w, const float *b, float *y, float *stats,
                              int rows, int cols, float eps);
    void (*layernorm_backward)(const float *x, const float *w, const float *dy, const float *stats,
                               float *dx, float *dw, float *db, int rows, int cols);
    /* Llama's: stats as LayerNorm's with every mean 0, so dw is LayerNorm's sum */
    void (*rmsnorm_forward)(const float *x, const float *w, float *y, float *stats, int rows, int cols, float eps);
    void (*rmsnorm_backward)(const float *x, const float *w, const float *dy, const float *stats, float *dx, float *dw,
                             int rows, int cols);
    void (*swiglu_forward)(const float *gate, const float *up, float *y, int64_t n);
    void (*swiglu_backward)(const float *gate, const float *up, const float *dy, float *dgate, float *dup, int64_t n);
    /* cs: (cos, sin) of each position t < T and pair j < hd/2, [T, hd/2, 2] */
    void (*rotary_qkv_forward)(const float *q, const float *k, const float *v, const float *cs, float *qkv, int BT, int T,
                               int H, int KV, int hd);
    void (*rotary_qkv_backward)(const float *cs, const float *dqkv, float *dq, float *dk, float *dv, int BT, int T, int H,
                                int KV, int hd);
    void (*add)(const float *a, const float *b, float *y, int64_t n);
    void (*accumulate)(float *dst, const float *src, int64_t n);        /* dst += src */
    /* saved, scratch: DT_ATTENTION_SAVED_FLOATS, DT_ATTENTION_SCRATCH_FLOATS floats */
    void (*attention_forward)(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                              float scale, int causal);
    void (*attention_backward)(const float *saved, const float *dout, float *dqkv, float *scratch,
                               int B, int T, int H, int D, float scale);
    /* --attention online: saved is [B*H, T] log-sum-exps, then the output [B*T, D]
       (the CPU's layout); backward reads qkv again; scratch: B*H*T floats.
       Heads of at most DT_ATTENTION_ONLINE_MAX_HEAD_DIM. */
    void (*attention_forward_online)(const float *qkv, float *out, float *saved, int B, int T, int H, int D, float scale,
                                     int causal);
    void (*attention_backward_online)(const float *qkv, const float *saved, const float *dout, float *dqkv, float *scratch,
                                      int B, int T, int H, int D, float scale, int causal);
    /* Context parallelism's ring, a block at a time (dt_ring_attention): blk
       holds the block's T positions (f32), then its K and V [B*T, D]; qpos:
       this rank's T positions. Forward carries each row's m (in lse), l and
       unnormalised output (in O) from block to block -- first: from nothing;
       out non-NULL: the last block, which finishes them (O, out the output,
       lse the log-sum-exp). Backward adds dQ into dqkv and the block's dK,
       dV into dkv (dK [B*T, D], then dV); dots: B*H*T floats of scratch.
       The same heads as --attention online's. */
    void (*ring_attention_step)(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                float *out, int first, int B, int T, int H, int D, float scale, int causal);
    void (*ring_attention_backward_step)(const float *qkv, const float *blk, const float *qpos, const float *lse, const float *O,
                                         const float *dout, float *dots, float *dqkv, float *dkv, int B, int T, int H, int D,
                                         float scale, int causal);
    /* rows x cols floats from src (row stride ld_src) into dst (ld_dst): copied, or added (add 1) */
    void (*copy_columns)(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add);
    /* tokens: ids as f32. Backward: dwte, dwpe may be NULL; by_token lists the
       rows grouped by token: order[BT] (each group's rows ascending), then
       start[groups + 1] into it, then the token of each group, token[groups] */
    /* first, V: wte holds tokens first .. first + V - 1 (a rank's share of a
       split vocabulary); a row whose token is not among them gets zeros (+ wpe) */
    void (*token_embedding_forward)(const float *tokens, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                    int first, int V);
    void (*token_embedding_backward)(const int32_t *by_token, int groups, const float *dy, float *dwte, float *dwpe, int BT,
                                     int T, int D);
    void (*vit_tokens_forward)(const float *patches, const float *cls, const float *pos, float *y,
                               int B, int P, int D);
    void (*vit_tokens_backward)(const float *dy, float *dpatches, float *dcls, float *dpos, int B, int P, int D);
    void (*select_token_forward)(const float *x, float *y, int B, int T, int index, int D);
    void (*select_token_backward)(const float *dy, float *dx, int B, int T, int index, int D);
    /* The fused classifier. Forward: each row's largest value m, and 1 / l,
       l its sum of exp(x - m); rows whose label is DT_IGNORE_INDEX add
       nothing; the sum is divided by `divisor`. Backward: dlogits +=
       dt_cross_entropy_grad of each logit, in one pass. */
    void (*cross_entropy_forward)(const float *logits, const int32_t *labels, double *inv_l, float *m, float *loss,
                                  int B, int C, double divisor);
    void (*cross_entropy_backward)(const float *logits, const double *inv_l, const float *m, const int32_t *labels,
                                   const float *dloss, float *dlogits, int B, int C, float divisor);
    /* A vocabulary split over ranks: stats gets each row's m, then its l
       (over these C columns), then its x[label] (0 where the label is not
       among them); the group merges the rows' numbers between. */
    void (*softmax_row_stats)(const float *x, const int32_t *labels, float *stats, int B, int C);
    void (*patchify)(const float *images, float *patches, int B, int C, int H, int W, int p);
    double (*sum_squares)(const float *x, int64_t n);                   /* waits for the result */
    void (*scale)(float *x, float c, int64_t n);
    void (*adamw)(float *p, float *m, float *v, const float *g, int64_t n, float lr, float beta1,
                  float beta2, float eps, float wd, float bias_correction1, float bias_correction2);
    void (*sgd)(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd);
    void (*convert)(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n);
    int (*owns)(const void *p);                      /* 1 when p is memory of this device */
} dt_backend;

/* Attention on a GPU keeps Q, K and V in head-major order ([B*H, T, hd] each,
   so that one strided-batched matmul covers every head) beside the softmax
   probabilities P [B*H, T, T], with room for the output in that order; backward
   needs room for dP, dO and dQ, dK, dV. */
#define DT_ATTENTION_SAVED_FLOATS(B, T, H, D) ((int64_t)(B) * (H) * (T) * (T) + 4LL * (B) * (T) * (D))   /* P, Q, K, V, O */
#define DT_ATTENTION_SCRATCH_FLOATS(B, T, H, D) ((int64_t)(B) * (H) * (T) * (T) + 4LL * (B) * (T) * (D)) /* dP, dO, dQ, dK, dV */
/* The online kernels' widest head: a lane holds 4 of its columns. */
#define DT_ATTENTION_ONLINE_MAX_HEAD_DIM 128

/* ---- the collective backend: what a transport must provide --------------------
   The collectives chapter owns the queue and the communication thread; a backend moves the
   bytes. Every backend fills in every entry, and the shared code only calls
   through the table: shared memory, NCCL and MPI are three tables. A call is
   queued by the caller, started and finished by the communication thread, and
   waited for by the caller: on shared memory the thread does the whole work in
   `start`; on a GPU `start` only puts it on NCCL's stream, `finish` watches it
   to the end, and `wait` makes the caller's later kernels wait for it on the
   GPU: the host waits only until the call is on NCCL's stream, never for its
   result. `memory` is the one kind of buffer it takes: the collectives chapter refuses any
   other before the call is queued. */
typedef struct dt_comm_op {
    dt_coll kind;
    const void *send;
    void *recv;
    int64_t count;
    dt_dtype dtype;
    dt_reduce_op op;
    int root;                                                  /* the root; for send and recv the peer */
    int from;                                                  /* a ring shift's: root, the next rank; from, the one before */
} dt_comm_op;
typedef struct dt_comm_backend {
    const char *name;
    dt_device memory;                                          /* where the buffers of its calls live */
    void (*submitted)(dt_comm *c, int64_t h);                  /* caller: call h is queued */
    void (*start)(dt_comm *c, int64_t h, const dt_comm_op *o); /* communication thread */
    void (*finish)(dt_comm *c, int64_t h);                     /* communication thread, after start */
    void (*wait)(dt_comm *c, int64_t h);                       /* caller, lock held: h started, not yet finished */
    /* caller, parent idle: make child's transport, collectively over parent */
    void (*split)(dt_comm *parent, dt_comm *child, int color, int key);
    void (*close)(dt_comm *c);                                 /* caller, after the thread has stopped */
    /* 1: its ranks are on one machine, so a group gets a shared segment, which
       the watchdog reads every rank through; 0 (MPI): each rank a header of
       its own, and a dead rank is the launcher's to notice */
    int shares_memory;
    int sums_in_rank_order;                                    /* 1: the same bits at any number of ranks, run after run */
} dt_comm_backend;

/* ---- the GPU collectives: what the collectives chapter asks of NCCL (the cuda chapter) -----------
   The collectives chapter owns the queue, the communication thread and the watchdog; NCCL
   only issues calls and answers questions, so a dead peer or a timeout is
   noticed by the same loop on CPUs and GPUs. The communicator is non-blocking:
   any call may leave it "in progress", and dt_nccl_progress says when it is
   ready for the next one. Every buffer is device memory. */
#define DT_COMM_QUEUE 256                 /* collectives in flight per communicator, at most */
/* The cuda chapter's two entry points (only in a build with
   CUDA): how many GPUs are visible (0, and why, when none), and the backend
   table of GPU local_rank % count, or NULL and why. */
int dt_cuda_device_count(char *why, size_t n);
const dt_backend *dt_cuda_backend(int local_rank, char *why, size_t n);

typedef struct dt_nccl dt_nccl;
/* 1 when this build has NCCL; else 0, and what to install in `why`. */
int dt_nccl_available(char *why, size_t n);
/* NCCL's version as a number (2.30.3 is 23003); 0 without NCCL. */
int dt_nccl_version(void);
int dt_nccl_unique_id(unsigned char *out, size_t n);
/* Start joining the communicator (non-blocking); poll dt_nccl_progress until it is ready. */
dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world);
/* The same for the group of `color` (ncclCommSplit), collectively over parent. */
dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key);
/* 1: ready for the next call; 0: still in progress; -1: failed, and why. */
int dt_nccl_progress(dt_nccl *s, char *why, size_t n);
/* The caller's thread, at submission: collective `slot` may start once the
   kernels queued so far on the compute stream are done (its input is theirs). */
void dt_nccl_mark_inputs(dt_nccl *s, int slot);
/* The communication thread: issue call `slot` on NCCL's stream, then, once
   dt_nccl_progress says ready, record its done-event. */
void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o);
void dt_nccl_mark_done(dt_nccl *s, int slot);
int dt_nccl_finished(dt_nccl *s, int slot);           /* 1 when its done-event has fired */
/* The caller's thread: kernels queued from now on wait for collective `slot`. */
void dt_nccl_stream_wait(dt_nccl *s, int slot);
void dt_nccl_abort(dt_nccl *s);                       /* only from the thread that issues its calls */
/* Closing: finalize (poll dt_nccl_progress until ready), then free. */
void dt_nccl_finalize(dt_nccl *s);
void dt_nccl_free(dt_nccl *s);

/* [src/18-data.h] */
/* ---- data ---------------------------------------------------------------------- */

typedef struct dt_dataset {
    int64_t n;                 /* images, or text sequences */
    int channels, size, num_classes;
    uint8_t *pixels;           /* n images, channels first, each channels*size*size bytes */
    int32_t *labels;
    char **class_names;        /* num_classes names (folder names, or CIFAR-10's) */
    char source[512];
    int64_t capacity;          /* images allocated (n shrinks when the set is sliced) */
    /* Text: a run of token ids (num_classes is the vocabulary). Sequence i is
       tokens [i*seq_len, (i+1)*seq_len]: seq_len inputs, and the same shifted
       by one as the labels, so neighbours share one token. */
    int32_t *tokens;
    int64_t ntokens, tokens_capacity;
    int seq_len;
    /* Instruction data (JSON lines): every example a sequence of its own.
       Sequence i is tokens [i*seq_len, (i+1)*seq_len) with its labels at the
       same places here, DT_IGNORE_INDEX where the loss ignores a position (a
       prompt, the padding). NULL for plain text. */
    int32_t *targets;
} dt_dataset;

/* Load `split` ("train" or "val") of an image folder (DIR/split/<class>/<file>)
   or of a CIFAR-10 binary folder, every image resized to size x size RGB. For
   "val" of an image folder, class names must match `classes_from` (may be NULL). */
void dt_dataset_load(const char *dir, const char *split, int size,
                     const dt_dataset *classes_from, dt_dataset *ds);
void dt_dataset_free(dt_dataset *ds);
/* Text: a .txt file, or a folder of them joined in name order, read as bytes
   (vocabulary 256); or, is_tokens, a file of token ids: a NumPy .npy array
   (one dimension; uint16, uint32, int32 or int64), JSON lines of instruction
   examples (a file whose first character, past white space and a UTF-8
   byte-order mark, is `{`: see "instruction data" below), or else little-endian uint16 ids (vocab 0: the largest id + 1). The
   last val_fraction of the tokens (of the examples, for JSON lines), by
   position, is the validation set. */
void dt_text_load(const char *path, int is_tokens, int vocab, int seq_len, double val_fraction, dt_dataset *train,
                  dt_dataset *val);
/* Write `bytes` of English-like generated text (sentences from a small grammar
   over a few hundred words) to path: the built-in text of --model gpt. */
void dt_synthetic_text_write(const char *path, int64_t bytes, uint64_t seed);
/* The loss to beat, in nats per token: the cross-entropy of `eval`'s tokens
   under the token frequencies of `train` (a model that ignores context). */
double dt_unigram_loss(const dt_dataset *train, const dt_dataset *eval);
/* Keep images (or sequences) [start, end) only: --start-idx/--end-idx. */
void dt_dataset_slice(dt_dataset *ds, int64_t start, int64_t end);

/* Decode one image file to 8-bit RGB (grey and alpha are converted) and resize
   it to size x size. Returns NULL and a reason in err when it cannot. */
uint8_t *dt_image_load_rgb(const char *path, int size, char *err, size_t errlen);
/* Bilinear resize of channels-first 8-bit planes. */
void dt_image_resize(const uint8_t *src, int channels, int w, int h, uint8_t *dst, int dw, int dh);

/* The sample order of one epoch for one rank, like PyTorch's DistributedSampler:
   a permutation seeded by (seed, epoch), padded by wrapping to a multiple of
   world, then every world-th index starting at rank. Writes ceil(n/world)
   indices to out and returns that count. */
int64_t dt_sampler_indices(int64_t n, uint64_t seed, int epoch, int shuffle, int rank, int world,
                           int64_t *out);

typedef struct dt_loader {
    const dt_dataset *ds;
    int batch_size, rank, world, shuffle, augment, drop_last;
    uint64_t seed;
    int epoch;
    int64_t *order, count, pos;
    int64_t *counted;          /* instruction data: the targets that count in each batch, every rank's together */
} dt_loader;

dt_loader dt_loader_create(const dt_dataset *ds, int batch_size, uint64_t seed, int shuffle,
                           int augment, int drop_last, int rank, int world);
void dt_loader_free(dt_loader *l);
/* Begin `epoch`, skipping the first `skip_batches` (resume in mid-epoch). */
void dt_loader_start_epoch(dt_loader *l, int epoch, int64_t skip_batches);
/* The next batch, in the per-step arena; 0 at the end of the epoch. */
int dt_loader_next(dt_loader *l, dt_batch *b);
int64_t dt_loader_batches_per_epoch(const dt_loader *l);
/* Instruction data: the targets that count (not DT_IGNORE_INDEX) in the next
   `batches` batches of every rank of the loader's world. */
int64_t dt_loader_counted_targets(const dt_loader *l, int batches);

/* Write a learnable 10-class synthetic image set to dir/train and dir/val (PNG
   with stb, PPM without): coloured shapes on noisy backgrounds. */
void dt_synthetic_write(const char *dir, int n_train, int n_val, int size, uint64_t seed);

/* [src/19-launching.h] */
/* ---- launching ranks --------------------------------------------------------- */

/* --nproc N: fork N copies of this program on this machine, before any device or
   thread is started, each with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
   MASTER_PORT set as torchrun would (rank 0 inherits a socket already
   listening there), and a job id. Returns in each child; the
   parent passes SIGINT, SIGTERM and SIGUSR1 on to the ranks, waits, and exits
   with the worst status a rank had. Does nothing when nproc <= 1 or when this
   process is already a launched rank. */
void dt_launch(int nproc, double timeout_s);
/* Each rank of a job of processes: join the job the environment describes (see dt_rank_from_env) with a
   TCP rendezvous at MASTER_ADDR:MASTER_PORT. A rank that does not arrive, or dies
   later, stops the others within timeout_s seconds with a message naming it.
   kind DT_COMM_MPI joins MPI's job instead (no rendezvous; mpirun or srun
   started the ranks); DT_COMM_AUTO is shared memory, or MPI when an MPI
   launcher started ranks on several hosts. */
dt_comm *dt_comm_init(dt_comm_kind kind, double timeout_s);
/* This process's place in the job, from torchrun's (RANK, WORLD_SIZE,
   LOCAL_RANK), SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), Open MPI's
   (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK) or MPICH's (PMI_RANK, PMI_SIZE,
   MPI_LOCALRANKID) variables; 0, 1, 0 without them. */
void dt_rank_from_env(int *rank, int *world, int *local_rank);
/* How many ranks run on this machine, from LOCAL_WORLD_SIZE (torchrun, --nproc),
   OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE or MPI_LOCALNRANKS; 0 when
   none says. */
int dt_local_ranks_from_env(void);
/* The GPU of local rank `local_rank` of `local_ranks` on a machine with `gpus`
   visible: local_rank % gpus. More ranks than GPUs is refused (returns -1 and
   says why, naming both counts) unless ranks_per_gpu lets that many share one. */
int dt_gpu_for_rank(int local_rank, int local_ranks, int gpus, int ranks_per_gpu, char *why, size_t n);

/* [src/20-checkpoints.h] */
/* ---- checkpoints (safetensors) ------------------------------------------------ */

/* A safetensors file: 8-byte little-endian header length, a JSON header naming
   each tensor's dtype, shape and byte range, then the raw data. PyTorch, numpy
   and Hugging Face read it. Writes go to FILE.tmp, then fsync, then rename:
   an existing file is replaced whole or not at all. */
typedef struct dt_named_tensor { const char *name; const float *data; int ndim; int64_t shape[4]; } dt_named_tensor;
void dt_safetensors_write(const char *path, const dt_named_tensor *tensors, int count,
                          const char *const *meta_kv, int meta_count);

typedef struct dt_safetensors dt_safetensors;   /* a file read whole and checked */
dt_safetensors *dt_safetensors_read(const char *path);
void dt_safetensors_close(dt_safetensors *st);
/* Copy tensor `name` into dst as f32 (F32, F16, BF16 and F64 are read); returns 0
   when absent, fails when its shape differs from the expected one. */
int dt_safetensors_get(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape);
const char *dt_safetensors_meta(dt_safetensors *st, const char *key); /* NULL when absent */

/* [src/21-hugging-face.h] */
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

/* [src/22-evaluation.h] */
/* ---- evaluation --------------------------------------------------------- */

/* Mean loss and accuracy of the model over a data set, without gradients. In a
   job every rank evaluates its share and the sums are all-reduced; under
   tensor parallelism the share is its group's (the ranks of a group evaluate
   it together). */
void dt_evaluate(dt_model *m, const dt_dataset *ds, int batch_size, double *loss, double *acc);
/* gpt: continue `prompt` (n_prompt token ids) by n_new tokens into out, each
   drawn from the softmax of the last position's logits / temperature, seeded.
   Collective in a job: every rank calls it alike (FSDP gathers, tensor
   parallelism gathers the logits); rank 0's draws count. */
void dt_generate(dt_model *m, const int32_t *prompt, int n_prompt, int n_new, float temperature, uint64_t seed,
                 int32_t *out);

/* [src/23-metrics.h] */
/* ---- metrics and traces ------------------------------------------------- */

/* The phases of a training step, timed and traced. */
typedef enum { DT_PHASE_DATA, DT_PHASE_FWD, DT_PHASE_BWD, DT_PHASE_COMM, DT_PHASE_OPT,
               DT_PHASE_EVAL, DT_PHASE_CKPT, DT_PHASE_COUNT } dt_phase_kind;
/* A --trace file's tracks (its "tid"s, which tools/trace-summary reads): one
   per phase, then the communication thread's and the pipeline's. */
enum { DT_TRACK_COMM = DT_PHASE_COUNT, DT_TRACK_PIPELINE };

/* Charge the time since the last mark to `phase` (and draw it in the trace). */
void dt_phase(dt_run *run, dt_phase_kind phase);

/* TensorBoard's event files (--tensorboard DIR), written without TensorFlow.
   A file of records, each framed as TFRecord frames it: the length as a
   little-endian uint64, its masked CRC-32C, the bytes, their masked CRC-32C.
   Each record is an Event protocol buffer: the first says the format
   ("brain.Event:2"), each one after it holds a wall time, a step and a
   scalar. dt_tensorboard_open makes DIR and opens
   DIR/events.out.tfevents.<seconds>.<host>.<pid> (NULL, errno set, when it
   cannot); the others return 0 when a write failed (errno says why). */
typedef struct dt_tensorboard dt_tensorboard;
dt_tensorboard *dt_tensorboard_open(const char *dir);
int dt_tensorboard_scalar(dt_tensorboard *tb, const char *tag, float value, int64_t step, double wall_time);
/* A SessionLog START at `step`: TensorBoard drops what an earlier file of
   the run logged at that step or after (a run resumed from a checkpoint). */
int dt_tensorboard_restart(dt_tensorboard *tb, int64_t step, double wall_time);
int dt_tensorboard_close(dt_tensorboard *tb);
const char *dt_tensorboard_path(const dt_tensorboard *tb);
/* CRC-32C (Castagnoli's polynomial), and TFRecord's mask of it: rotated
   right by 15 bits, plus 0xa282ead8 (a CRC of data that holds CRCs is weak). */
uint32_t dt_crc32c(const void *data, size_t n);
uint32_t dt_crc32c_masked(const void *data, size_t n);

/* MLflow's file store (--mlflow DIR; `mlflow ui --backend-store-uri DIR`):
   DIR/<experiment id>/meta.yaml names the experiment; each run is a folder
   DIR/<experiment id>/<run id>/ of meta.yaml (name, times, status), params/
   and tags/ (a file per key holding its value) and metrics/ (a file per key,
   a line "<ms since 1970> <value> <step>" per point). dt_mlflow_open finds
   the experiment by name or makes it, and starts a run -- or, given the id
   of an earlier one, continues it. Each call returns 0 when a write failed
   (errno says why); dt_mlflow_path names the run's folder. */
typedef struct dt_mlflow dt_mlflow;
typedef enum { DT_MLFLOW_RUNNING = 1, DT_MLFLOW_FINISHED = 3, DT_MLFLOW_FAILED = 4, DT_MLFLOW_KILLED = 5 } dt_mlflow_status;
dt_mlflow *dt_mlflow_open(const char *dir, const char *experiment, const char *run_name, const char *run_id);
int dt_mlflow_param(dt_mlflow *ml, const char *key, const char *value);
int dt_mlflow_tag(dt_mlflow *ml, const char *key, const char *value);
int dt_mlflow_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms);
int dt_mlflow_close(dt_mlflow *ml, dt_mlflow_status status);
const char *dt_mlflow_path(const dt_mlflow *ml);
const char *dt_mlflow_run_id(const dt_mlflow *ml);
int dt_mlflow_run_id_valid(const char *id);     /* 32 lowercase hex digits */

/* [src/24-cost-model.h] */
/* ---- the cost model ----------------------------------------------------- */

/* The cost model: does it scale, and why not? A step of N ranks costs its
   compute plus the communication that compute could not hide. Communication
   follows the alpha-beta model of a link -- a message of b bytes takes
   latency + b / bandwidth -- on a ring, where each of N ranks sends and
   receives (N-1)/N of the buffer per all-gather or reduce-scatter, twice
   that per all-reduce (a reduce-scatter and then an all-gather). */
typedef struct dt_link {
    char name[64];
    double latency_us;         /* per message hop */
    double bandwidth_gbs;      /* bus bandwidth, GB/s, as nccl-tests reports it */
} dt_link;
/* "shm" (shared memory on this machine, as tools/collectives measured it),
   "pcie", "nvlink", "infiniband": rough figures of common links (see the
   definitions). Returns 0 for an unknown name. */
int dt_link_preset(const char *name, dt_link *out);
/* Milliseconds of one ring collective over n ranks, of a buffer of `bytes`
   (the whole buffer: what each rank holds after an all-gather). */
double dt_cost_all_reduce_ms(const dt_link *link, int n, double bytes);
double dt_cost_all_gather_ms(const dt_link *link, int n, double bytes);      /* = reduce-scatter */
/* How many buckets DDP makes of `params` f32 gradients (the first 1 MB, then bucket_mb). */
int dt_cost_ddp_buckets(double params, double bucket_mb);

/* What a step of each parallel scheme computes and communicates, as the
   cost model prices it: the run fills it from what the last step measured,
   and a wrapper that splits or shards the model its own part (its
   dt_parallel_report's cost_input, the run-driver chapter). */
typedef enum { DT_PAR_NONE = 0, DT_PAR_DP, DT_PAR_DDP, DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3, DT_PAR_TP, DT_PAR_PP,
               DT_PAR_CP } dt_parallelism;
typedef struct dt_cost_input {
    dt_parallelism kind;
    double compute_ms;         /* one rank's forward + backward for one micro-batch, on its own device */
    double contention;         /* how much slower that compute runs when N ranks share the device(s): 1 on
                                  GPUs of their own; on a CPU about N (the ranks share its cores) */
    double backward_share;     /* the part of compute that is backward, which DDP's buckets hide behind (~2/3) */
    double params;             /* parameter count */
    double gather_bytes;       /* bytes per parameter gathered (FSDP: 4, or 2 in bf16/fp16) */
    double reduce_bytes;       /* bytes per gradient reduced (4, or 2 with --reduce-dtype bf16) */
    int accum_steps;           /* micro-batches per optimizer step */
    int messages;              /* collectives per step on the critical path: DDP's buckets, FSDP's units */
    double optimizer_ms;       /* the optimizer's step, on its own device: sharded (ZeRO), each rank does 1/N */
    /* tensor parallelism: the share of compute (and optimizer) in the split
       layers, which N ranks divide; the sums of activations or their
       gradients per micro-batch (4 per transformer block: 2 forward, 2
       backward), and the bytes of each (batch x tokens x width x 4) */
    double tp_share, tp_sums, tp_bytes;
    /* ... and, for a pipeline (DT_PAR_PP) whose stages split their layers
       too (07's --tp), how many ranks each stage's layers are split over
       (0 or 1: none); tp_sums then counts the whole model's sums per
       micro-batch, and tp_bytes those of a micro-batch. Tensor parallelism
       alone (DT_PAR_TP) has its T in dt_cost_predict's n. */
    int tp_ranks;
    /* ... and with more ranks than T (or P), the data-parallel groups of T
       (pipelines of P): after backward each rank's gradients (tensor: params
       x (tp_share / T + 1 - tp_share) x reduce_bytes; pipeline: its stage's)
       are averaged over them, exposed (0 or 1: one group) */
    int dp_groups;
    /* pipeline parallelism: the micro-batches of a step; the largest
       stage's share of the compute times P (1 when the stages are even: the
       slowest stage sets the pipeline's pace); the bytes of one activation
       sent on (micro-batch x tokens x width x 4), a gradient as many back */
    int pp_micro_batches;
    double pp_balance, pp_bytes;
    double pp_measured_bubble;  /* ... and the share of the step this rank waited, as measured: printed beside the
                                   formula's, not used by the prediction */
    /* tensor or pipeline parallelism inside FSDP (06, 07 --shard): the ZeRO
       stage (1, 2, 3; 0: DDP) over the data-parallel groups. Each group
       steps 1/D of the optimizer; ZeRO-3 gathers the parameters twice, 1.5x
       DDP's bytes; around a pipeline ZeRO-2 and -3 do so each micro-batch
       (ZeRO-2: M reduce-scatters and one all-gather, (M + 1) / 2 DDP's) */
    int dp_shard;
    /* context parallelism (DT_PAR_CP; n: the C ranks that split each
       sequence, compute_ms one rank's of the whole sequences): attention's
       share of that compute (the rest is per token: it divides by C); the
       keys and values of one layer, the whole micro-batch's (micro-batch x
       T x 2 x width x 4: a rank's block is 1/C of it); the layers the ring
       goes around; 1 when a causal model is cut into contiguous pieces, so
       that the last rank's attention is about (2C - 1) / C the mean's (0:
       zig-zag, or no mask: every rank the same). Forward sends the block on
       C - 1 times, each behind a block's attention; backward sends it on
       C - 1 times again and each block's gradient sum C times (as many
       bytes), two transfers behind each block's backward and the last,
       which brings each sum home, waited for. The gradients are averaged
       over every rank of the job (dp_groups x C): DDP's behind backward, or
       sharded (dp_shard). */
    double cp_attention_share, cp_kv_bytes;
    int cp_layers, cp_contiguous;
} dt_cost_input;

typedef struct dt_cost_prediction {
    int ranks;
    double compute_ms;         /* per optimizer step, on one rank: forward, backward and optimizer */
    double comm_ms;            /* communication per optimizer step */
    double exposed_ms;         /* the part of it compute does not hide */
    double step_ms, speedup, efficiency;   /* speedup: samples/s against one rank with the same batch */
    double bytes;              /* bytes each rank sends per step */
    double bubble;             /* pipeline parallelism: the share of the step a stage waits, (P - 1) / (M + P - 1) */
} dt_cost_prediction;
/* Predict a step of `ranks` ranks: DDP all-reduces the gradients once per
   step behind backward; DP (02) also broadcasts the parameters, hiding
   nothing; ZeRO-1 and -2 reduce-scatter the gradients and all-gather the
   parameters (the same bytes as DDP, not hidden here); ZeRO-3 all-gathers the
   parameters twice per micro-batch, prefetched behind compute, and
   reduce-scatters the gradients: 1.5x DDP's bytes. Tensor parallelism
   divides the split layers' compute by N and all-reduces activations inside
   forward and backward, where nothing hides them; its N ranks share one
   batch, so its speedup is against one rank with that batch, not N times it.
   Context parallelism divides the work by N too, the busiest rank's
   attention setting the pace, and passes key/value blocks around a ring. */
dt_cost_prediction dt_cost_predict(const dt_cost_input *in, const dt_link *l, int n);
/* Print the prediction, the compute-to-communication ratio, and what bigger
   batches, accumulation, bf16 communication or fewer ranks would change. */
void dt_cost_explain(FILE *out, const dt_cost_input *in, const dt_link *l, int n);

/* [src/25-command-line.h] */
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
    int batch_size, epochs;
    int64_t steps;               /* stop after this many steps (0: run every epoch) */
    float lr, weight_decay, momentum, clip;
    int64_t warmup;              /* -1: 5% of the steps */
    dt_optimizer_kind optimizer;
    uint64_t seed;
    dt_device device;
    const char *log_path, *trace_path, *save_dir, *resume, *init;
    const char *tensorboard;     /* --tensorboard DIR: TensorBoard event files of the scalars */
    const char *mlflow;          /* --mlflow DIR: the run in MLflow's file store */
    int eval_every, augment;
    int log_every;               /* a progress line every N steps (0: about every 3 s, and at each epoch's end) */
    int64_t start_idx, end_idx;  /* end -1: the whole set */
    int bench;
    int quiet;
    float peak_tflops;           /* --bench on a GPU: the peak for MFU (0: look it up by name) */
    int nproc;                   /* --nproc: devices of stage 02, or ranks to start on this machine (03-05) */
    float bucket_mb;             /* --bucket-mb: DDP's gradient buckets (0: one all-reduce after backward) */
    int shard;                   /* --shard: what FSDP shards (a dt_shard_mode; default full; 07: none) */
    int cpu_offload;             /* --cpu-offload: FSDP's shards and optimizer in host memory */
    int tp;                      /* --tp: ranks per tensor-parallel group (0: every rank of the job) */
    int sequence_parallel;       /* --sequence-parallel: the rows between the split layers split too */
    int pp;                      /* --pp: ranks per pipeline, each a stage of consecutive blocks (0: every rank) */
    int micro_batches;           /* --micro-batches: the pipeline's micro-batches per step (default 1; times --accum-steps) */
    int schedule;                /* --schedule: a dt_pp_schedule (default 1f1b) */
    int cp;                      /* --cp: ranks per context-parallel group (0: every rank of the job) */
    int cp_layout;               /* --cp-layout: a dt_cp_layout (default zig-zag) */
    int recompute;               /* --recompute: each block's activations made again in backward */
    int attention;               /* --attention: DT_ATTENTION_MATMUL or _ONLINE (the CPU's attention body) */
    int lora_rank;               /* --lora-rank: LoRA adapters of this rank on a frozen model (0: none) */
    float lora_alpha;            /* --lora-alpha: their scale is alpha / rank (default 8, PEFT's) */
    const char *lora_targets;    /* --lora-targets: the layers that get one (NULL: the model's default) */
    int accum_steps;             /* --accum-steps: micro-batches per optimizer step (05) */
    int dtype, reduce_dtype;     /* --dtype, --reduce-dtype: a dt_dtype each (05) */
    int explain;                 /* --explain: the cost model's prediction for this run, after 3 steps */
    int link;                    /* --link: the link the prediction assumes (-1: shm on a CPU, nvlink on GPUs) */
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

/* Load --data (or make the synthetic set), applying --image-size and the slice.
   With --bench: random images in memory instead, enough for a few batches; the
   stage's own loop then times its steps (two warm-up steps, then about three
   seconds, or --steps) and dt_run_finish prints one "bench:" line. */
void dt_load_data(const dt_config *cfg, dt_dataset *train, dt_dataset *val);

/* [src/26-run-driver.h] */
/* ---- the run driver ----------------------------------------------------- */

/* A training run: the position (epoch, step), the schedule, the logs. */
struct dt_run {
    dt_config cfg;
    dt_model *model;
    dt_optimizer *opt;
    dt_loader *loader;
    const dt_dataset *val;
    int epoch;
    int64_t step, total_steps, stop_step, batches_per_epoch, batch_in_epoch, warmup;
    double phase_ms[DT_PHASE_COUNT], mark_ms, step_start_ms, start_ms, samples, train_ms;
    double last_loss, loss_sum;             /* the last step's loss (has_loss: there was one); since the last line */
    int has_loss;
    int64_t loss_count, steps_run;
    double eval_loss, eval_acc;
    double unigram_loss;       /* gpt: the validation loss of a model that ignores context */
    int micro;                 /* micro-batches of this step done so far (--accum-steps) */
    double micro_loss;         /* and the sum of their losses */
    double loss_divisor;       /* masked data: this step's targets / (ranks x micro-batches) */
    dt_loss_scaler scaler;     /* --dtype fp16's loss scale (disabled otherwise) */
    FILE *log, *trace;
    char trace_path[4096];     /* this rank's trace file (run.rank1.json), for the errors that name it */
    dt_tensorboard *tb;        /* --tensorboard: rank 0's event file, or NULL */
    dt_mlflow *mlflow;         /* --mlflow: rank 0's run in the file store, or NULL */
    char mlflow_run_id[40];    /* --mlflow: this run's id (from the checkpoint it resumed, or new); "": none */
    char tensorboard_run[160]; /* --tensorboard: this run's folder in DIR ("<stage>-<model>-<time>-<pid>") */
    double step_ms_avg;        /* the recent time of a step, for the ETA (dt__eta_update) */
    double line_ms;            /* when the last progress line was printed */
    int stop;
    int stopped_by;            /* the signal every rank agreed to stop on (SIGTERM, SIGUSR1, SIGINT), or 0 */
    char resume_path[4096];    /* --resume auto: the newest complete checkpoint in --save-dir */
    /* --bench: the timed steps (after two warm-up steps) and what they spent */
    int64_t bench_first;
    double bench_t0, bench_phase_ms[DT_PHASE_COUNT], bench_comm_ms, bench_hidden_ms;
};

/* What the machinery asks of a parallel wrapper, beside what training asks
   of it (dt_parallel, the autograd chapter). A wrapper that cuts or shards
   the model fills one at its chapter's end (the part "for the machinery",
   which dtrain.h puts after the machinery's implementation) and the run
   finds it by the wrapper's create_fn; a wrapper without one (DataParallel,
   DDP) keeps the whole model on every rank, which is what the machinery
   assumes of it. Any entry may be NULL: nothing to add.
     state_open, state_close  a checkpoint sees the model whole: the state
         `which` (0 the parameters, 1 and 2 the optimizer's moments) as one
         host array in the order of the whole model's parameters: a
         collective of the wrapper's ranks, which may give NULL to a rank
         that will not write. To load, the array (the checkpoints chapter's,
         when the model is cut) is filled from a file, and
         state_close(written 1) gives each rank its part of it.
     shards  a sharded checkpoint writes each rank's state as it is: fills
         `view` and returns 1 (0: this wrapper's state is not flat shards).
     memory_table  what each rank holds, printed at start-up.
     label  what --bench's stage= adds ("/full+offload").
     log_fields  what a step's --log record adds (",\"name\":value...").
     cost_input  fills its part of `in` from what the last step measured
         (in's compute_ms: this rank's forward and backward of a micro-batch;
         optimizer_ms: this rank's step, which it makes the whole model's;
         accum_steps set) and returns how many ranks split or shard the model.
     bench_fields  the " key=value" pairs --bench adds (what the cost model
         needs of it).
     whole_from_local, local_from_whole  for a wrapper that cut the model
         (without state_open: the checkpoints chapter calls them with the
         model as the layout, on the first data-parallel copy) and for the
         wrapper around it (FSDP around tensor parallelism, a pipeline
         around it): the whole state from this rank's (`local`, on the
         model's device, laid out as `layout`: what this wrapper left of
         the model; a collective, NULL where the rank will not write), and
         back. */
typedef struct dt_shard_view {
    float *state[3];           /* this rank's shard of the parameters and of the two moments (NULL: none) */
    int64_t numel;             /* elements in each */
    dt_device where;           /* where they live (the host, offloaded) */
    int rank, world;           /* which shard, of how many */
    dt_comm *comm;             /* the ranks that hold the others */
} dt_shard_view;
typedef struct dt_parallel_report {
    const char *create_fn;     /* whose: dt_parallel's create_fn ("dt_fsdp_create") */
    float *(*state_open)(dt_parallel *par, dt_optimizer *opt, int which);
    void (*state_close)(dt_parallel *par, dt_optimizer *opt, int which, float *host, int written);
    int (*shards)(dt_parallel *par, dt_optimizer *opt, dt_shard_view *view);
    void (*memory_table)(const dt_parallel *par, const dt_optimizer *opt);
    void (*label)(const dt_parallel *par, char *out, size_t n);
    void (*log_fields)(const dt_parallel *par, FILE *log);
    int (*cost_input)(const dt_parallel *par, dt_cost_input *in);
    void (*bench_fields)(const dt_parallel *par, FILE *out, int accum_steps);
    float *(*whole_from_local)(dt_parallel *par, const dt_model *layout, float *local);
    void (*local_from_whole)(dt_parallel *par, const dt_model *layout, float *whole, float *local);
} dt_parallel_report;
/* The report that answers for a model's wrappers: the outermost of the stack
   that has one (DDP has none: around tensor parallelism, the latter's
   answers), and in *owner the wrapper it is of; NULL (and *owner NULL) when
   none has one. */
const dt_parallel_report *dt_parallel_report_of(dt_parallel *par, dt_parallel **owner);

/* Set up a run: --init or --resume, the log and trace files, a header line. In
   a job of several ranks (dt_comm_init), the ranks first check that they agree
   on the flags that must match. */
void dt_run_start(dt_run *run, const dt_config *cfg, dt_model *model, dt_optimizer *opt,
                  dt_loader *loader, const dt_dataset *val);
/* Start the next epoch's data order; 0 when every epoch (or --steps) is done. */
int dt_next_epoch(dt_run *run);
/* Begin a step (reset the step arena, start the clock) and fetch its batch; 0 at
   the end of the epoch. With --accum-steps K a step takes K batches (micro-
   batches): each call fetches the next, and a step begins with every K-th. */
int dt_next_batch(dt_run *run, dt_batch *batch);
/* 1 when the batch just fetched is the last of its step: the one whose backward
   communicates (always, when --accum-steps is 1). */
int dt_last_micro_batch(const dt_run *run);
/* After the backward of a micro-batch that is not the last: count its loss. */
void dt_micro_batch_end(dt_run *run, dt_tensor *loss);
/* The learning rate of the step about to run (warmup, then cosine). */
float dt_run_lr(const dt_run *run);
/* Called once per training step, right before the batch is fetched. */
void dt_step_begin(dt_run *run);
/* After the optimizer: log, print progress, evaluate; returns 1 when --steps is
   reached. In a job the logged loss is the mean over every rank's batch (and
   over the step's micro-batches). Progress prints about every 3 s and at each
   epoch's last step (--log-every N: every N-th step instead). A write to --log
   or --trace that fails, here or anywhere, is an error naming the file. */
int dt_step_end(dt_run *run, dt_tensor *loss, int batch_size);
/* At an epoch's end: evaluate and write a checkpoint (when --save-dir is given). */
void dt_epoch_end(dt_run *run);
/* The summary line, the summary log record; closes files (and fails if their
   last writes did). Returns the exit status.
   With --bench it prints the one "bench:" line instead. */
int dt_run_finish(dt_run *run);

#ifdef __cplusplus
}
#endif

#endif /* DTRAIN_H */

/* [src/00-front.h] */
/* ================================================================================
   IMPLEMENTATION
   ================================================================================ */
#if defined(DTRAIN_IMPLEMENTATION) && !defined(DTRAIN_IMPLEMENTATION_DONE)
#define DTRAIN_IMPLEMENTATION_DONE

#include <stdarg.h>
#include <stdlib.h>
#include <limits.h>
#include <float.h>
#include <errno.h>
#include <ctype.h>
#include <time.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <fcntl.h>
#include <signal.h>
#ifdef _OPENMP
#include <omp.h>
#define DT_OMP(x) _Pragma(x)
#else
#define DT_OMP(x)
#endif
#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>
#include <pmmintrin.h>
#endif
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif
#ifdef DT_HAVE_STB
#include <stb/stb_image.h>
#include <stb/stb_image_write.h>
#endif
#ifdef DT_HAVE_CBLAS
#include <cblas.h>
#endif
#ifdef DT_HAVE_MPI
#include <mpi.h>
#endif

/* One context per rank: memory counters, the tape, the step arena. A rank is
   usually a process; in stage 02 every device is a thread of one process, so
   the context is per thread, and each device counts its own memory and keeps
   its own tape. What else is global is per process and says so where it is
   declared: the files to remove on failure (the errors chapter), the communicator that
   tells the others when this process fails (the collectives chapter), the signals caught
   (the launching chapter). */
#if defined(__cplusplus)
#define DT_THREAD_LOCAL thread_local
#else
#define DT_THREAD_LOCAL _Thread_local
#endif
typedef struct dt__tape_entry dt__tape_entry;
typedef void (*dt__backward_fn)(dt__tape_entry *e);
struct dt__tape_entry {
    dt__backward_fn backward;
    dt_tensor *out;
    dt_tensor *in[4];
    int iarg[4];
    float farg[2];
    void *saved;               /* op-specific buffers, in the step arena */
};

/* The step arena: one block, and blocks allocated when it ran out (first step only). */
typedef struct dt__step_arena {
    char *base;
    size_t cap, used, high, peak;      /* high: bytes taken now; peak: the most at once this step */
    void **spill;
    size_t *spill_bytes;
    int nspill, spill_cap;
} dt__step_arena;

typedef struct dt__context {
    int rank, world_size;
    dt_device device;
    const dt_backend *gpu;             /* the kernels of the GPU, when device is DT_CUDA */
    size_t mem_now[DT_ARENA_COUNT], mem_peak[DT_ARENA_COUNT], mem_total, mem_total_peak;
    size_t host_now[DT_ARENA_COUNT], host_peak[DT_ARENA_COUNT];     /* offloaded (dt_alloc_host) */
    dt__step_arena step[2];             /* per device: host (tensor headers, host data) and GPU */
    dt__step_arena scratch[2];          /* per device: f32 working copies that live for one op */
    dt_dtype compute_dtype;            /* activations and matmul inputs (the mixed-precision chapter); f32 by default */
    dt__tape_entry *tape;
    int tape_len, tape_cap;
    int grad_enabled;
    int wrappers;                      /* parallel wrappers attached to models (dt_model_set_parallel) */
    double flops;
    int backward_generation;
    dt_comm *job;                      /* the communicator of a job of processes (dt_comm_init) */
    int devices;                       /* > 1: this thread drives that many devices (stage 02) */
    /* What the parallel wrappers communicated during this step, for the step's
       log line and the trace: total time, the part hidden behind backward, and
       each collective's interval on the communication track. */
    double comm_ms, comm_hidden_ms;
    /* When the last backward's compute ended: dt_backward_from sets it, and
       dt_phase(DT_PHASE_BWD) moves it to the moment the device had finished
       too -- the end of the trace's backward span. DDP's hidden part is
       measured up to it, so the log and tools/trace-summary count the same
       overlap, and a pause between backward and the wait is not called hidden. */
    double backward_end_ms;
    struct { char name[32]; double t0, t1; int pipeline; } comm_events[256];   /* pipeline: on its own track */
    int ncomm_events;
    int64_t grad_collectives;          /* gradient all-reduces and reduce-scatters issued this step */
    int grads_scaled;                  /* gradients still hold the fp16 loss scale (the mixed-precision chapter) */
    uint64_t step_resets;              /* dt_step_arena_reset calls: what lives in the step arena is this step's */
    uint64_t arena_rewinds;            /* those, and the returns to a mark in mid-step: a cache in the arena is this old */
    /* The rotary embeddings' (cos, sin) table, in the step arena: every layer
       of a step asks for the same one. */
    struct { uint64_t made_at; int T, hd; dt_rope rope; dt_device device; float *cs; } rope;   /* made_at: arena_rewinds */
    /* dt_cross_entropy_set_divisor's labels and divisor, for one step */
    struct { uint64_t step; const int32_t *labels; double divisor; } loss_divisor;
} dt__context;

static DT_THREAD_LOCAL dt__context dt__ctx = { .world_size = 1, .grad_enabled = 1 };

/* [src/01-errors.h] */
/* ==== errors =================================================================
   A library for learners fails early and says why. There is no error code to
   forget to check: the message names the culprit and the program exits. */

static void dt__vmessage(const char *kind, const char *fmt, va_list ap) {
    char line[2048];             /* one write per message: ranks failing together do not interleave */
    int n;
    fflush(stdout);
    if (dt__ctx.world_size > 1) n = snprintf(line, sizeof line, "dtrain[rank %d]: %s: ", dt__ctx.rank, kind);
    else n = snprintf(line, sizeof line, "dtrain: %s: ", kind);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    strcat(line, "\n");
    fputs(line, stderr);
    fflush(stderr);
}
/* What to remove if the program stops early: a shared-memory segment whose
   name has not yet been shared out, a checkpoint's .tmp file and the folder
   it is written into. dt_fail and a second Ctrl-C remove them, so a job
   stopped at any moment leaves nothing behind. unlink() and rmdir() are safe
   inside a signal handler, hence plain paths. */
#define DT_CLEANUP_SLOTS 16
static void dt__copy_str(char *out, size_t n, const char *s);
static char dt__cleanup_paths[DT_CLEANUP_SLOTS][4096];
static volatile sig_atomic_t dt__cleanup_used[DT_CLEANUP_SLOTS];
static int dt__cleanup_add(const char *path) {
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++) {
        sig_atomic_t unused = 0;             /* 2: taken by a thread that is writing its path */
        if (__atomic_compare_exchange_n(&dt__cleanup_used[i], &unused, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            dt__copy_str(dt__cleanup_paths[i], sizeof dt__cleanup_paths[i], path);
            __atomic_signal_fence(__ATOMIC_RELEASE);     /* the path is whole before a handler may read it */
            dt__cleanup_used[i] = 1;
            return i;
        }
    }
    return -1;                               /* full: that file is merely not cleaned up */
}
static void dt__cleanup_done(int slot) { if (slot >= 0) dt__cleanup_used[slot] = 0; }
/* What empties a folder rmdir could not remove: set by the chapter that
   registers such a folder (checkpoints: a NAME.tmp loses dtrain's files, and
   only those), so that this chapter knows nothing of what the files are. */
static void (*dt__cleanup_empty_folder)(const char *path);
/* in_handler: called from a signal handler, where only unlink and rmdir may be
   used. Otherwise a folder that is not yet empty -- a checkpoint's NAME.tmp in
   which another rank, killed, left its half-written shard -- is emptied and
   goes too. */
static void dt__cleanup_run_in(int in_handler) {
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++)          /* the files, then the folders they emptied */
        if (dt__cleanup_used[i] == 1 && unlink(dt__cleanup_paths[i]) == 0) dt__cleanup_used[i] = 0;
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++)
        if (dt__cleanup_used[i] == 1) {
            if (rmdir(dt__cleanup_paths[i]) != 0 && !in_handler && dt__cleanup_empty_folder)
                dt__cleanup_empty_folder(dt__cleanup_paths[i]);
            dt__cleanup_used[i] = 0;
        }
}
static void dt__cleanup_run(void) { dt__cleanup_run_in(1); }

/* Who must hear of a failure before this process exits: the collectives
   (the collectives chapter) put a function here once a communicator is open, so that the
   other ranks stop at once instead of waiting for their timeout. */
static void (*dt__on_fail)(void);
/* ... and the run's tracking (the run-driver chapter): an MLflow run marked FAILED. */
static void (*dt__on_fail_tracking)(void);
#ifdef DT_FUZZING
/* The fuzzing harnesses (tests/fuzz/) take an error back instead of the exit:
   an input refused with a clear error is a correct result, and the next
   input follows in the same process. */
static void (*dt__fuzz_refused)(void);
#define DT__FUZZ_REFUSED() do { if (dt__fuzz_refused) dt__fuzz_refused(); } while (0)
#else
#define DT__FUZZ_REFUSED() ((void)0)
#endif
void dt_fail(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("error", fmt, ap); va_end(ap);
    DT__FUZZ_REFUSED();
    dt__cleanup_run_in(0);
    void (*track)(void) = dt__on_fail_tracking;
    dt__on_fail_tracking = NULL;             /* once: its own writes may fail */
    if (track) track();
    void (*tell)(void) = __atomic_load_n(&dt__on_fail, __ATOMIC_ACQUIRE);
    if (tell) tell();            /* the other ranks must not wait for us */
    exit(1);
}
void dt_usage_error(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("error", fmt, ap); va_end(ap);
    DT__FUZZ_REFUSED();
    fprintf(stderr, "usage: train [--flag value ...]; run with --help for the flags\n");
    exit(2);
}
/* Paths and parameter names are built with this: one that does not fit is an
   error, never a silently shortened name. */
static void dt__path(char *out, size_t n, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void dt__path(char *out, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    if (len < 0 || (size_t)len >= n) dt_fail("name or path too long (over %zu characters): %.60s...", n - 1, out);
}
/* Copy a string, shortening it to fit (for labels and messages only). */
static void dt__copy_str(char *out, size_t n, const char *s) {
    size_t l = strlen(s);
    if (l >= n) l = n - 1;
    memcpy(out, s, l);
    out[l] = 0;
}
void dt_warn(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("warning", fmt, ap); va_end(ap);
}
/* Sizes made of numbers from flags and files (shapes, counts, offsets) are
   multiplied and added here: a product that would wrap around is an error
   naming what it sized, never a small buffer that later writes overrun. */
static int64_t dt__size_mul(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
        dt_fail("%s: a size out of range (%lld x %lld)", what, (long long)a, (long long)b);
    return r;
}
static int64_t dt__size_add(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r))
        dt_fail("%s: a size out of range (%lld + %lld)", what, (long long)a, (long long)b);
    return r;
}
/* This machine's memory in bytes (0 when the system does not say). */
static double dt__host_memory_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (double)pages * (double)page : 0;
}
/* A file cut short by a full disk or a quota must stop the program, or a log
   that ends early reads as a run that ended early. stdio reports a failed
   write late -- at the flush the buffer's filling causes, or at fclose -- and
   keeps the error in the stream, so one look after each record finds it.
   `flag` names the option the path came from ("--log"), or is NULL. */
static void dt__write_failed(const char *flag, const char *path, int err) {
    if (!err) err = EIO;            /* ferror without an errno: say something true */
    if (flag) dt_fail("cannot write %s '%s': %s", flag, path, strerror(err));
    dt_fail("cannot write '%s': %s", path, strerror(err));
}
static void dt__file_check(FILE *f, const char *flag, const char *path) {
    if (ferror(f)) dt__write_failed(flag, path, errno);
}
static void dt__file_close(FILE *f, const char *flag, const char *path) {
    int failed = fflush(f) != 0 || ferror(f), err = errno;
    if (fclose(f) != 0 && !failed) { failed = 1; err = errno; }
    if (failed) dt__write_failed(flag, path, err);
}

/* [src/02-devices-and-memory.h] */
/* ==== devices and memory =====================================================
   Every allocation names its arena. The counters are how a student sees that
   Adam's state is twice the parameters, or that activations dominate at large
   batch sizes. */

/* A clock for timeouts and timings, and the cores OpenMP may use: what the
   sections below ask of the machine besides memory. */
double dt_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
int dt_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
/* Inside a parallel region: this thread's number, and the team's size. */
static int dt__thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static int dt__team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static const char *dt__arena_names[DT_ARENA_COUNT] = {
    "params", "grads", "optimizer", "activations", "comm", "data" };
const char *dt_arena_name(dt_arena arena) { return dt__arena_names[arena]; }

static void dt__mem_count(dt_arena a, size_t bytes, int sign) {
    if (sign > 0) { dt__ctx.mem_now[a] += bytes; dt__ctx.mem_total += bytes; }
    else { dt__ctx.mem_now[a] -= bytes; dt__ctx.mem_total -= bytes; }
    if (dt__ctx.mem_now[a] > dt__ctx.mem_peak[a]) dt__ctx.mem_peak[a] = dt__ctx.mem_now[a];
    if (dt__ctx.mem_total > dt__ctx.mem_total_peak) dt__ctx.mem_total_peak = dt__ctx.mem_total;
}

static void *dt__alloc_uncounted(dt_arena arena, size_t bytes) {
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = NULL;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0 || !p)
        dt_fail("out of memory allocating %zu bytes for %s", bytes, dt__arena_names[arena]);
    memset(p, 0, rounded);
    return p;
}
void *dt_alloc(dt_arena arena, size_t bytes) {
    void *p = dt__alloc_uncounted(arena, bytes);
    dt__mem_count(arena, bytes, +1);
    return p;
}
void dt_free(dt_arena arena, void *ptr, size_t bytes) {
    if (!ptr) return;
    free(ptr);
    dt__mem_count(arena, bytes, -1);
}
void *dt_alloc_host(dt_arena arena, size_t bytes) {
    void *p = dt__alloc_uncounted(arena, bytes);
    dt__ctx.host_now[arena] += bytes;
    if (dt__ctx.host_now[arena] > dt__ctx.host_peak[arena]) dt__ctx.host_peak[arena] = dt__ctx.host_now[arena];
    return p;
}
void dt_free_host(dt_arena arena, void *ptr, size_t bytes) {
    if (!ptr) return;
    free(ptr);
    dt__ctx.host_now[arena] -= bytes;
}
size_t dt_mem_host_now(dt_arena arena) { return dt__ctx.host_now[arena]; }
size_t dt_mem_host_peak(dt_arena arena) { return dt__ctx.host_peak[arena]; }
void dt_mem_reset_peaks(void) {
    for (int a = 0; a < DT_ARENA_COUNT; a++) { dt__ctx.mem_peak[a] = dt__ctx.mem_now[a]; dt__ctx.host_peak[a] = dt__ctx.host_now[a]; }
    dt__ctx.mem_total_peak = dt__ctx.mem_total;
}
size_t dt_mem_now(dt_arena arena) { return dt__ctx.mem_now[arena]; }
size_t dt_mem_peak(dt_arena arena) { return dt__ctx.mem_peak[arena]; }
size_t dt_mem_total_now(void) { return dt__ctx.mem_total; }
size_t dt_mem_total_peak(void) { return dt__ctx.mem_total_peak; }

/* The backend of a device: NULL for the CPU, whose bodies are the loops below. */
static const dt_backend *dt__backend_of(dt_device d) {
    if (d == DT_CPU) return NULL;
    if (!dt__ctx.gpu) dt_fail("GPU memory or kernels used before dt_set_device(DT_CUDA, ...)");
    return dt__ctx.gpu;
}

/* Zero memory on a device; a GPU does it in its queue. */
static void dt__zero_on(dt_device d, void *p, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (gpu) gpu->zero(p, bytes);
    else memset(p, 0, bytes);
}

void *dt_alloc_on(dt_device device, dt_arena arena, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(device);
    if (!gpu) return dt_alloc(arena, bytes);
    void *p = gpu->alloc(bytes ? bytes : 1);
    dt__zero_on(device, p, bytes);
    dt__mem_count(arena, bytes, +1);
    return p;
}
void dt_free_on(dt_device device, dt_arena arena, void *ptr, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(device);
    if (!ptr) return;
    if (!gpu) { dt_free(arena, ptr, bytes); return; }
    gpu->release(ptr);
    dt__mem_count(arena, bytes, -1);
}

/* Set once this process has asked CUDA anything. A CUDA context does not
   survive fork(), so dt_launch refuses to fork after it (the launcher process
   never touches CUDA: each rank decides its device after the fork). */
static int dt__cuda_touched;

int dt_cuda_available(char *why, size_t n) {
#ifdef DT_HAVE_CUDA
    if (dt__ctx.gpu) return 1;
    dt__cuda_touched = 1;
    return dt_cuda_device_count(why, n) > 0;
#else
    dt__copy_str(why, n, "this build has no CUDA (nvcc was not found, or make CUDA=0)");
    return 0;
#endif
}

void dt_set_device(dt_device device, int local_rank) {
    if (device == DT_CUDA && !dt__ctx.gpu) {
#ifdef DT_HAVE_CUDA
        char why[256] = "";
        dt__cuda_touched = 1;
        dt__ctx.gpu = dt_cuda_backend(local_rank, why, sizeof why);
        if (!dt__ctx.gpu) dt_fail("cannot use the GPU: %s (run with --device cpu)", why);
#else
        (void)local_rank;
        dt_fail("--device cuda: this build has no CUDA (nvcc was not found, or make CUDA=0); use --device cpu");
#endif
    }
    dt__ctx.device = device;
}
dt_device dt_current_device(void) { return dt__ctx.device; }

static void dt__download_from(dt_device d, void *dst, const void *src, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (bytes == 0) return;
    if (gpu) gpu->download(dst, src, bytes);
    else memmove(dst, src, bytes);
}

static void dt__upload_to(dt_device d, void *dst, const void *src, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (bytes == 0) return;
    if (gpu) gpu->upload(dst, src, bytes);
    else memmove(dst, src, bytes);
}
void dt_upload(void *device_dst, const void *host_src, size_t bytes) { dt__upload_to(dt__ctx.device, device_dst, host_src, bytes); }
void dt_download(void *host_dst, const void *device_src, size_t bytes) { dt__download_from(dt__ctx.device, host_dst, device_src, bytes); }
void dt_synchronize(void) {
    if (dt__ctx.device == DT_CUDA) dt__backend_of(DT_CUDA)->synchronize();
}

/* Files are read and written from host memory. A buffer on a GPU is seen
   through a host copy: downloaded when opened, uploaded when closed if it was
   written. On the CPU the "copy" is the buffer itself. */
static float *dt__host_view(dt_device d, float *buf, int64_t n) {
    if (d == DT_CPU) return buf;
    float *host = (float *)malloc((size_t)n * sizeof(float) + 1);
    if (!host) dt_fail("out of memory (%lld floats to copy from the GPU)", (long long)n);
    dt__download_from(d, host, buf, (size_t)n * sizeof(float));
    return host;
}
static void dt__host_view_close(dt_device d, float *host, float *buf, int64_t n, int written) {
    if (d == DT_CPU) return;
    if (written) dt__backend_of(d)->upload(buf, host, (size_t)n * sizeof(float));
    free(host);
}

/* Step-arena memory on `device` whose every byte the caller is about to write:
   op outputs skip the zeroing that gradient buffers need. */
static void *dt__arena_take(dt__step_arena *a, dt_device device, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    a->high += bytes;
    if (a->high > a->peak) a->peak = a->high;
    if (a->used + bytes <= a->cap) {
        void *p = a->base + a->used;
        a->used += bytes;
        return p;
    }
    /* Out of room (only in the first steps): a spill block, merged at the reset. */
    if (a->nspill == a->spill_cap) {
        a->spill_cap = a->spill_cap ? 2 * a->spill_cap : 64;
        a->spill = (void **)realloc(a->spill, a->spill_cap * sizeof(void *));
        a->spill_bytes = (size_t *)realloc(a->spill_bytes, a->spill_cap * sizeof(size_t));
        if (!a->spill || !a->spill_bytes) dt_fail("out of memory (step arena)");
    }
    void *p = dt_alloc_on(device, DT_ARENA_ACTS, bytes);
    a->spill[a->nspill] = p;
    a->spill_bytes[a->nspill++] = bytes;
    return p;
}
static void *dt__step_alloc_on(dt_device device, size_t bytes) { return dt__arena_take(&dt__ctx.step[device], device, bytes); }
static void *dt__step_alloc_uninit(size_t bytes) { return dt__step_alloc_on(DT_CPU, bytes); }
/* Data of activations and their gradients: on the device that runs the ops. */
static void *dt__step_data(size_t bytes) { return dt__step_alloc_on(dt__ctx.device, bytes); }

void *dt_step_alloc(size_t bytes) {
    void *p = dt__step_alloc_uninit(bytes);
    memset(p, 0, bytes);
    return p;
}

static void dt__arena_rewind(dt__step_arena *a, dt_device d) {
    if (a->nspill > 0 || a->peak > a->cap) {
        /* Grow the block to the high-water mark so the next step fits in one:
           after the first step there is no malloc (or cudaMalloc) at all. */
        size_t need = a->peak;
        for (int i = 0; i < a->nspill; i++) dt_free_on(d, DT_ARENA_ACTS, a->spill[i], a->spill_bytes[i]);
        a->nspill = 0;
        if (need > a->cap) {
            dt_free_on(d, DT_ARENA_ACTS, a->base, a->cap);
            a->cap = need + need / 8;
            a->base = (char *)dt_alloc_on(d, DT_ARENA_ACTS, a->cap);
        }
    }
    a->used = 0;
    a->high = 0;
    a->peak = 0;
}
void dt_step_arena_reset(void) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&dt__ctx.step[d], (dt_device)d);
    dt__ctx.tape_len = 0;
    dt__ctx.step_resets++;
    dt__ctx.arena_rewinds++;
}

/* A place in the step arena to come back to in mid-step: what was taken after
   it is given back (activation recompute, the models chapter, drops a block's
   activations so). Nothing taken after the mark may be used again. */
typedef struct { size_t used[2], high[2]; int nspill[2]; } dt__step_mark;
static dt__step_mark dt__step_mark_now(void) {
    dt__step_mark k;
    for (int d = 0; d < 2; d++) {
        k.used[d] = dt__ctx.step[d].used; k.high[d] = dt__ctx.step[d].high; k.nspill[d] = dt__ctx.step[d].nspill;
    }
    return k;
}
static void dt__step_back_to(const dt__step_mark *k) {
    for (int d = 0; d < 2; d++) {
        dt__step_arena *a = &dt__ctx.step[d];
        for (int i = k->nspill[d]; i < a->nspill; i++) dt_free_on((dt_device)d, DT_ARENA_ACTS, a->spill[i], a->spill_bytes[i]);
        a->nspill = k->nspill[d]; a->used = k->used[d]; a->high = k->high[d];
    }
    dt__ctx.arena_rewinds++;             /* what was cached after the mark is gone */
}

/* Arenas of one's own: pipeline parallelism (the pipeline-parallel chapter) keeps each micro-
   batch's activations apart, so that one micro-batch's go back when its
   backward is done while others' stay. Swapping puts `other` (one arena per
   device) where the step arena is, and the step arena in `other`; released,
   an arena keeps its block (grown to its high-water mark) for the next use. */
static void dt__step_arena_swap(dt__step_arena other[2]) {
    for (int d = 0; d < 2; d++) {
        dt__step_arena keep = dt__ctx.step[d];
        dt__ctx.step[d] = other[d];
        other[d] = keep;
    }
    dt__ctx.arena_rewinds++;             /* a cache in the arena that was in place is not this one's */
}
static void dt__step_arena_release(dt__step_arena a[2]) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&a[d], (dt_device)d);
    dt__ctx.arena_rewinds++;             /* what was cached in it is gone */
}
static void dt__step_arena_free(dt__step_arena a[2]) {
    for (int d = 0; d < 2; d++) {
        dt__arena_rewind(&a[d], (dt_device)d);
        if (a[d].base) dt_free_on((dt_device)d, DT_ARENA_ACTS, a[d].base, a[d].cap);
        free(a[d].spill);
        free(a[d].spill_bytes);
        memset(&a[d], 0, sizeof a[d]);
    }
}

/* The scratch arena works the same way but lives for one op only: under mixed
   precision (the mixed-precision chapter) an op reads its 16-bit inputs into f32 copies here,
   computes, and stores its output in 16 bits; the copies are gone at the next
   op, so only the 16-bit tensors stay for backward. */
static void *dt__scratch_on(dt_device device, size_t bytes) { return dt__arena_take(&dt__ctx.scratch[device], device, bytes); }
static void dt__scratch_reset(void) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&dt__ctx.scratch[d], (dt_device)d);
}

/* Numbers below 1.2e-38 ("subnormals") cost x86 cores up to a hundred times the
   time of ordinary ones, and training makes them: AdamW squares gradients that
   have become tiny. GPUs flush them to zero in their fast paths; so do we, in
   every thread of a training process (the control register is per thread).
   The effect on results is below anything a float can tell apart in training. */
static void dt__flush_subnormals_here(void) {          /* this thread only */
#if defined(__x86_64__) || defined(__SSE2__)
    _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
    _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
#endif
}
static void dt__flush_subnormals(void) {               /* this thread and its OpenMP team */
    DT_OMP("omp parallel")
    dt__flush_subnormals_here();
    dt__flush_subnormals_here();
}

/* [src/03-tensors.h] */
/* ==== tensors ================================================================
   A tensor is a shape, a dtype and a pointer. Activations are carved out of
   the step arena; parameters point into the model's flat buffers. Data is f32
   unless mixed precision (the mixed-precision chapter) stores activations in 16 bits. */

size_t dt_dtype_size(dt_dtype d) { return d == DT_F32 ? 4 : 2; }
const char *dt_dtype_name(dt_dtype d) { return d == DT_F32 ? "fp32" : d == DT_BF16 ? "bf16" : "fp16"; }

/* A tensor in the step arena, on the current device, its data not zeroed. The
   header always lives on the host. */
static dt_tensor *dt__tensor_alloc(int ndim, const int *shape, dt_dtype dtype) {
    dt_tensor *t = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = shape[i]; t->numel = dt__size_mul(t->numel, shape[i], "an activation"); }
    t->device = dt__ctx.device;
    t->dtype = dtype;
    t->data = (float *)dt__step_data((size_t)dt__size_mul(t->numel, (int64_t)dt_dtype_size(dtype), "an activation"));
    return t;
}
/* An op's output: every element is written by the op, so it is not zeroed.
   It is stored in the compute dtype (f32, or bf16/f16 under mixed precision). */
static dt_tensor *dt__tensor_out(int ndim, const int *shape) { return dt__tensor_alloc(ndim, shape, dt__ctx.compute_dtype); }
static dt_tensor *dt__tensor_out_2d(int rows, int cols) { int s[2] = { rows, cols }; return dt__tensor_out(2, s); }
dt_tensor *dt_tensor_new(int ndim, const int *shape) {
    dt_tensor *t = dt__tensor_alloc(ndim, shape, DT_F32);
    dt__zero_on(t->device, t->data, (size_t)t->numel * sizeof(float));
    return t;
}
dt_tensor *dt_tensor_2d(int rows, int cols) { int s[2] = { rows, cols }; return dt_tensor_new(2, s); }
dt_tensor *dt_tensor_from_host(int ndim, const int *shape, const float *host) {
    dt_tensor *t = dt__tensor_alloc(ndim, shape, DT_F32);
    dt_upload(t->data, host, (size_t)t->numel * sizeof(float));
    return t;
}
int64_t dt_tensor_rows(const dt_tensor *t) { return t->shape[0]; }
int64_t dt_tensor_cols(const dt_tensor *t) { return t->numel / t->shape[0]; }
/* A parameter's gradient is f32 whatever its data holds: the optimizer and the
   collectives read it. An activation's has the activation's dtype. */
static dt_dtype dt__grad_dtype(const dt_tensor *t) { return t->is_param ? DT_F32 : t->dtype; }
float *dt_grad(dt_tensor *t) {
    if (!t->grad) {                                /* a gradient lives beside its tensor */
        size_t bytes = (size_t)t->numel * dt_dtype_size(dt__grad_dtype(t));
        t->grad = (float *)dt__step_alloc_on(t->device, bytes);
        dt__zero_on(t->device, t->grad, bytes);
    }
    return t->grad;
}
/* -- precision conversion: mixed precision converts every activation twice, so
      the CPU loops are written one per direction, where the compiler turns
      them into vector code; x86's F16C instructions convert f16 eight at a
      time, rounding to nearest even as dt_f32_to_f16 does (a test holds them
      to it, bit for bit). -- */
static void dt__f32_to_half_cpu(const float *x, uint16_t *h, dt_dtype to, int64_t n) {
    int64_t i = 0;
    if (to == DT_BF16) {
        for (; i < n; i++) h[i] = dt_f32_to_bf16(x[i]);
        return;
    }
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = dt_f32_to_f16(x[i]);
}
static void dt__half_to_f32_cpu(const uint16_t *h, float *x, dt_dtype from, int64_t n) {
    int64_t i = 0;
    if (from == DT_BF16) {
        for (; i < n; i++) x[i] = dt_bf16_to_f32(h[i]);
        return;
    }
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) x[i] = dt_f16_to_f32(h[i]);
}
/* n values of any dtype on device d, as f32 on the host. */
static void dt__download_as_f32(dt_device d, float *host, const void *src, dt_dtype dtype, int64_t n) {
    if (dtype == DT_F32) { dt__download_from(d, host, src, (size_t)n * sizeof(float)); return; }
    uint16_t *h = (uint16_t *)malloc((size_t)n * 2 + 1);
    if (!h) dt_fail("out of memory");
    dt__download_from(d, h, src, (size_t)n * 2);
    dt__half_to_f32_cpu(h, host, dtype, n);
    free(h);
}
void dt_tensor_to_host(const dt_tensor *t, float *host) { dt__download_as_f32(t->device, host, t->data, t->dtype, t->numel); }
void dt_tensor_grad_to_host(const dt_tensor *t, float *host) {
    if (!t->grad) { memset(host, 0, (size_t)t->numel * sizeof(float)); return; }
    dt__download_as_f32(t->device, host, t->grad, dt__grad_dtype(t), t->numel);
}
float dt_tensor_item(const dt_tensor *t) {
    float v;
    dt__download_as_f32(t->device, &v, t->data, t->dtype, 1);
    return v;
}

/* Which body runs an op: the tensor's device must be the one dtrain runs on,
   and a GPU tensor gets the GPU's kernels (NULL means the CPU loop). */
static const dt_backend *dt__backend_for(const dt_tensor *t) {
    if (t->device != dt__ctx.device)
        dt_fail("tensor %s is on the %s but dtrain runs on the %s now (see dt_set_device)", t->name ? t->name : "",
                t->device == DT_CUDA ? "GPU" : "CPU", dt__ctx.device == DT_CUDA ? "GPU" : "CPU");
    return dt__backend_of(t->device);
}

/* [src/04-matmul.h] */
/* ==== kernels: matrix multiply ===============================================
   Nearly all of training's arithmetic is matmul, so this is where speed lives.
   The classic recipe (Goto and van de Geijn): cut K into KC-deep slabs and N
   into NC-wide panels, copy ("pack") each KC x NC panel of B once into
   NR-column strips, k-major and zero-padded, and let a small register-blocked
   kernel compute an MR x NR tile of C from MR rows of A and one B strip. The
   MR x NR accumulators stay in vector registers for the whole KC loop; the
   kernel broadcasts one A value per row and multiplies it into a B row.
   A is read where it lies whenever it can be: the kernel only needs A's rows
   (or columns) to step by a fixed stride, so the common x W^T case packs
   nothing but B, which every block of rows shares. Copying costs as much as a
   few multiply-adds per value, and an activation's rows are read only N / NR
   times: packing A too, as the recipe does, cost up to a third of the time on
   this project's skinny shapes (N = 192). A transposed A (the weight gradient
   dY^T X) and the last few rows are copied into a small block per thread.
   Each C element is owned by one thread and summed in one fixed order (k
   within a slab, then slab after slab), so the bits do not depend on the
   thread count or on how the rows are cut into blocks. */

#if defined(__GNUC__) && defined(__AVX512F__)
#define DT_VL 16
#define DT_MR 8
#elif defined(__GNUC__) && defined(__AVX__)
#define DT_VL 8
#define DT_MR 6
#else
#define DT_VL 4
#define DT_MR 4
#endif
#define DT_NR (2 * DT_VL)
#define DT_KC 256
#define DT_MC (DT_MR * 8)
#define DT_NC 1024
/* Packing space, one buffer per calling thread, kept between calls (and freed
   with the device's arenas): attention makes thousands of small matmuls per
   step, and a fresh allocation for each costs more (the kernel zeroing new
   pages) than the arithmetic. Declared outside the built-in routine: the
   arenas free it in any build. */
static DT_THREAD_LOCAL float *dt__pack_buffer;
static DT_THREAD_LOCAL size_t dt__pack_floats;

/* The vector type, and the kernels' multiply-add, which attention (the attention-and-loss chapter)
   uses in every build. */
#if defined(__GNUC__)
typedef float dt__vec __attribute__((vector_size(DT_VL * 4), aligned(4)));
#define DT__INLINE static inline __attribute__((always_inline))
/* A vector's load and store at any float's address. Not memcpy into a
   dt__vec: gcc tuned for AMD's Zen (-march=native on a Ryzen or an EPYC)
   copies 32 bytes as two 16-byte halves through the stack and reads them
   back whole, a store the processor cannot forward, and kept the kernel's
   accumulators in memory: on an EPYC (Zen 3) the matmul ran at 10 GFLOP/s
   a thread, and 70-90 with these loads, OpenBLAS's speed there. gcc 12 makes
   the same round trip for -march=skylake-avx512 too. may_alias: floats read
   as a vector. */
typedef float dt__vec_at __attribute__((vector_size(DT_VL * 4), aligned(4), may_alias));
DT__INLINE dt__vec dt__vload(const float *p) { return *(const dt__vec_at *)p; }
DT__INLINE void dt__vstore(float *p, dt__vec v) { *(dt__vec_at *)p = v; }
#else
#define DT__INLINE static inline
#endif
/* c + s * b in one rounding (a fused multiply-add) where the processor has it:
   one instruction instead of two, so the kernel does twice the arithmetic per
   cycle. gcc under -std=c11 never fuses on its own (-ffp-contract=off), so the
   kernel asks. A result then differs from the unfused one in the last bit;
   every run of a build still gives the same bits, at any thread count. */
#if defined(__GNUC__) && defined(__AVX512F__) && DT_VL == 16
#include <immintrin.h>
#define DT__MADD(c, s, b) ((dt__vec)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)(b), (__m512)(c)))
#elif defined(__GNUC__) && defined(__FMA__) && DT_VL == 8
#include <immintrin.h>
#define DT__MADD(c, s, b) ((dt__vec)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)(b), (__m256)(c)))
#else
#define DT__MADD(c, s, b) ((c) + (s) * (b))
#endif

/* What a linear layer's matmul does to C as it stores it: add a bias to
   every row, then, where `gelu` is set, write GELU of the result into a
   second matrix laid out as C. The built-in routine does both on each tile
   while it is in registers or the L1 cache, which saves the passes over the
   output that separate ops would make. */
typedef struct dt__epilogue { const float *bias; float *gelu; int tanh_form; } dt__epilogue;
static void dt__gelu_rows(const float *restrict x, float *restrict y, ptrdiff_t ld, int rows, int cols, int tanh_form) {
    for (int i = 0; i < rows; i++) {                 /* a loop per form: each vectorises */
        const float *xr = x + i * ld;
        float *yr = y + i * ld;
        if (tanh_form) for (int j = 0; j < cols; j++) yr[j] = dt_gelu_tanh_value(xr[j]);
        else for (int j = 0; j < cols; j++) yr[j] = dt_gelu_value(xr[j]);
    }
}

/* With a system BLAS (DT_HAVE_CBLAS) none of the routine below is compiled. */
#ifndef DT_HAVE_CBLAS

/* One MR x NR tile of C = alpha * (sum over k of a(i, k) b[k][j]) + beta * C,
   where a(i, k) = a[i * row_step + k * k_step]: A's rows in place (k_step 1),
   or a transposed or packed block (row_step 1). Inlined at each call, so the
   strides that are constants there cost nothing. Only the first rows x cols
   of the tile are written. A bias (the tile's columns of it; NULL for none)
   is added to each row as the tile is stored: on the last slab, after the
   sum, so its bits are those of adding it afterwards. */
DT__INLINE void dt__gemm_micro(int kc, const float *restrict a, ptrdiff_t row_step, ptrdiff_t k_step,
                               const float *restrict b, float alpha, float beta, float *restrict C, int ldc,
                               int rows, int cols, const float *restrict bias) {
    float acc[DT_MR * DT_NR];
#if defined(__GNUC__)
    dt__vec c0[DT_MR], c1[DT_MR];
    for (int i = 0; i < DT_MR; i++) { c0[i] = (dt__vec){0}; c1[i] = (dt__vec){0}; }
    for (int k = 0; k < kc; k++) {
        dt__vec b0 = dt__vload(b + (size_t)k * DT_NR), b1 = dt__vload(b + (size_t)k * DT_NR + DT_VL);
#pragma GCC unroll 16
        for (int i = 0; i < DT_MR; i++) {
            float s = a[i * row_step + k * k_step];
            c0[i] = DT__MADD(c0[i], s, b0);
            c1[i] = DT__MADD(c1[i], s, b1);
        }
    }
    if (rows == DT_MR && cols == DT_NR) {            /* a whole tile: C in vectors */
        dt__vec bias0 = { 0 }, bias1 = { 0 };
        if (bias) { bias0 = dt__vload(bias); bias1 = dt__vload(bias + DT_VL); }
        for (int i = 0; i < DT_MR; i++) {
            float *c = C + (size_t)i * ldc;
            dt__vec o0, o1;
            if (beta == 0.0f) { o0 = alpha * c0[i]; o1 = alpha * c1[i]; }
            else {
                o0 = dt__vload(c);
                o1 = dt__vload(c + DT_VL);
                if (beta == 1.0f) { o0 += alpha * c0[i]; o1 += alpha * c1[i]; }
                else { o0 = beta * o0 + alpha * c0[i]; o1 = beta * o1 + alpha * c1[i]; }
            }
            if (bias) { o0 += bias0; o1 += bias1; }
            dt__vstore(c, o0);
            dt__vstore(c + DT_VL, o1);
        }
        return;
    }
    for (int i = 0; i < DT_MR; i++) {
        dt__vstore(acc + i * DT_NR, c0[i]);
        dt__vstore(acc + i * DT_NR + DT_VL, c1[i]);
    }
#else
    for (int i = 0; i < DT_MR * DT_NR; i++) acc[i] = 0;
    for (int k = 0; k < kc; k++)
        for (int i = 0; i < DT_MR; i++)
            for (int j = 0; j < DT_NR; j++) acc[i * DT_NR + j] += a[i * row_step + k * k_step] * b[k * DT_NR + j];
#endif
    for (int i = 0; i < rows; i++) {                 /* the edge of C, or no vectors */
        float *c = C + (size_t)i * ldc;
        const float *r = acc + i * DT_NR;
        if (beta == 0.0f) for (int j = 0; j < cols; j++) c[j] = alpha * r[j];
        else if (beta == 1.0f) for (int j = 0; j < cols; j++) c[j] += alpha * r[j];
        else for (int j = 0; j < cols; j++) c[j] = beta * c[j] + alpha * r[j];
        if (bias) for (int j = 0; j < cols; j++) c[j] += bias[j];
    }
}

/* Copy A[i0:i0+rows, k0:k0+kc] (the last rows of a block, fewer than MR) into
   one MR-row strip, k-major, zero-padded (what dt__gemm_micro reads with
   row_step 1, k_step MR). */
static void dt__pack_a(const float *A, int lda, int i0, int rows, int k0, int kc, float *dst) {
    for (int k = 0; k < kc; k++) {
        float *d = dst + (size_t)k * DT_MR;
        for (int i = 0; i < rows; i++) d[i] = A[(size_t)(i0 + i) * lda + k0 + k];
        for (int i = rows; i < DT_MR; i++) d[i] = 0;
    }
}
/* A transposed A's whole block of mc rows (A's columns i0..i0+mc) at once,
   a row of A at a time: each row's mc floats are read in one go, where strip
   by strip they would be read in MR-float pieces, a cache line fetched for
   each k and each strip. */
static void dt__pack_a_block_trans(const float *A, int lda, int i0, int mc, int k0, int kc, float *block) {
    for (int k = 0; k < kc; k++) {
        const float *src = A + (size_t)(k0 + k) * lda + i0;
        for (int is = 0; is < mc; is += DT_MR) {
            float *d = block + (size_t)is * kc + (size_t)k * DT_MR;
            if (mc - is >= DT_MR) { memcpy(d, src + is, DT_MR * sizeof(float)); continue; }
            for (int i = 0; i < DT_MR; i++) d[i] = is + i < mc ? src[is + i] : 0.0f;
        }
    }
}
/* Copy op(B)[k0:k0+kc, j0:j0+cols] into one NR-column strip, k-major,
   zero-padded. A transposed B (the weight in x W^T) is read a row at a time. */
static void dt__pack_b(int trans, const float *B, int ldb, int k0, int kc, int j0, int cols, float *dst) {
    if (trans) {
        for (int j = 0; j < DT_NR; j++) {
            const float *src = B + (size_t)(j0 + j) * ldb + k0;
            if (j < cols) for (int k = 0; k < kc; k++) dst[k * DT_NR + j] = src[k];
            else for (int k = 0; k < kc; k++) dst[k * DT_NR + j] = 0;
        }
        return;
    }
    for (int k = 0; k < kc; k++) {
        const float *src = B + (size_t)(k0 + k) * ldb + j0;
        float *d = dst + (size_t)k * DT_NR;
        if (cols == DT_NR) { memcpy(d, src, DT_NR * sizeof(float)); continue; }
        for (int j = 0; j < cols; j++) d[j] = src[j];
        for (int j = cols; j < DT_NR; j++) d[j] = 0;
    }
}

static float *dt__pack_space(size_t floats) {
    if (floats > dt__pack_floats) {
        free(dt__pack_buffer);
        dt__pack_buffer = (float *)malloc(floats * sizeof(float));
        if (!dt__pack_buffer) dt_fail("out of memory in matmul");
        dt__pack_floats = floats;
    }
    return dt__pack_buffer;
}

/* Blocks of rows: as many as a multiple of the thread count, each at most
   MC rows, cut at whole MR-row strips as evenly as they go (4160 rows for 2
   threads with AVX-512: 66 blocks of 7 or 8 strips of 8, 33 per thread). */
static int dt__gemm_blocks(int M, int threads) {
    return threads * ((M + threads * DT_MC - 1) / (threads * DT_MC));
}

/* The threads the routine's parallel region will have: one when it is called
   from inside another parallel region (attention's loop over heads) and
   OpenMP runs no nested teams, as by default. */
static int dt__gemm_threads(void) {
#ifdef _OPENMP
    if (omp_get_active_level() >= omp_get_max_active_levels()) return 1;
#endif
    return dt_threads();
}

static void dt__gemm_builtin(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                            const float *B, int ldb, float beta, float *C, int ldc, const dt__epilogue *ep) {
    int threads = dt__gemm_threads();
    float *space = dt__pack_space((size_t)DT_KC * DT_NC + (size_t)threads * DT_MC * DT_KC);
    float *panel = space;                              /* B's panel: shared by the threads */
    int blocks_m = dt__gemm_blocks(M, threads), strips_m = (M + DT_MR - 1) / DT_MR;
    for (int k0 = 0; k0 < K; k0 += DT_KC) {
        int kc = K - k0 < DT_KC ? K - k0 : DT_KC;
        float b_eff = k0 == 0 ? beta : 1.0f;            /* later slabs add to the first */
        const float *bias_now = ep && k0 + kc == K ? ep->bias : NULL;   /* the epilogue: on the last slab */
        float *gelu_now = ep && k0 + kc == K ? ep->gelu : NULL;
        for (int j0 = 0; j0 < N; j0 += DT_NC) {
            int nc = N - j0 < DT_NC ? N - j0 : DT_NC, strips = (nc + DT_NR - 1) / DT_NR;
            DT_OMP("omp parallel num_threads(threads) if(blocks_m > 1 && (double)M * nc * kc > 65536.0)")
            {
                DT_OMP("omp for schedule(static)")
                for (int s = 0; s < strips; s++) {
                    int cols = nc - s * DT_NR < DT_NR ? nc - s * DT_NR : DT_NR;
                    dt__pack_b(tb, B, ldb, k0, kc, j0 + s * DT_NR, cols, panel + (size_t)s * DT_NR * kc);
                }
                float *block = space + (size_t)DT_KC * DT_NC + (size_t)dt__thread_num() * DT_MC * DT_KC;
                DT_OMP("omp for schedule(static)")
                for (int bm = 0; bm < blocks_m; bm++) {
                    int i0 = (int)((int64_t)bm * strips_m / blocks_m) * DT_MR;
                    int i1 = (int)((int64_t)(bm + 1) * strips_m / blocks_m) * DT_MR, mc = (i1 < M ? i1 : M) - i0;
                    if (mc <= 0) continue;                     /* fewer strips than blocks */
                    int in_place = ta ? 0 : mc / DT_MR * DT_MR;  /* A's rows read where they lie */
                    if (ta) dt__pack_a_block_trans(A, lda, i0, mc, k0, kc, block);
                    else
                        for (int is = in_place; is < mc; is += DT_MR)
                            dt__pack_a(A, lda, i0 + is, mc - is < DT_MR ? mc - is : DT_MR, k0, kc, block + (size_t)is * kc);
                    for (int s = 0; s < strips; s++) {
                        int js = s * DT_NR, cols = nc - js < DT_NR ? nc - js : DT_NR;
                        const float *b = panel + (size_t)s * DT_NR * kc;
                        for (int is = 0; is < mc; is += DT_MR) {
                            int rows = mc - is < DT_MR ? mc - is : DT_MR;
                            float *c = C + (size_t)(i0 + is) * ldc + j0 + js;
                            if (is < in_place)
                                dt__gemm_micro(kc, A + (size_t)(i0 + is) * lda + k0, lda, 1, b, alpha, b_eff, c, ldc, rows, cols,
                                               bias_now ? bias_now + j0 + js : NULL);
                            else
                                dt__gemm_micro(kc, block + (size_t)is * kc, 1, DT_MR, b, alpha, b_eff, c, ldc, rows, cols,
                                               bias_now ? bias_now + j0 + js : NULL);
                            if (gelu_now)
                                dt__gelu_rows(c, gelu_now + (size_t)(i0 + is) * ldc + j0 + js, ldc, rows, cols, ep->tanh_form);
                        }
                    }
                }
            }
        }
    }
}
#endif /* !DT_HAVE_CBLAS */

/* dt_gemm and then the epilogue (NULL: none). With a system BLAS, or with
   nothing to multiply, the epilogue is a loop afterwards. */
static void dt__gemm_epilogue(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                              const float *B, int ldb, float beta, float *C, int ldc, const dt__epilogue *ep) {
    if (M <= 0 || N <= 0) return;
#ifndef DT_HAVE_CBLAS
    if (K > 0) {
        dt__gemm_builtin(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ep);
        return;
    }
#endif
    if (K <= 0)                          /* nothing to multiply: C = beta * C */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
#ifdef DT_HAVE_CBLAS
    else
        cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
    if (!ep) return;
    DT_OMP("omp parallel for if((double)M * N > 32768.0)")
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        if (ep->bias) for (int j = 0; j < N; j++) c[j] += ep->bias[j];
        if (ep->gelu) dt__gelu_rows(c, ep->gelu + (size_t)i * ldc, ldc, 1, N, ep->tanh_form);
    }
}
void dt_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
             const float *B, int ldb, float beta, float *C, int ldc) {
    dt__gemm_epilogue(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, NULL);
}

/* -- attention's per-head products (the attention chapter's tiled and online
      bodies): small, read in place, one register-blocked loop for all of them -- */
/* rows x vecs accumulators, vecs operands and a broadcast fit the registers:
   6 x 4 + 4 + 1 of AVX-512's 32, 6 x 2 + 2 + 1 of the 16 of AVX2 or SSE
   (3 x 4 there needed 17, and the spills cost nearly a third of attention's
   time on an EPYC) */
#define DT__ATT_ROWS 6
#define DT__ATT_VECS (DT_VL == 16 ? 4 : 2)

/* c[r][x] (+)= alpha * sum over k < kc of a[r * row_step + k * k_step] * b[k * b_step + x]
   for r < rows and x < NV vectors: rows x NV accumulators in registers. Rows
   from `rows` to DT__ATT_ROWS repeat the last row's reads (nothing past the
   operands is touched) and are not stored. */
DT__INLINE void dt__att_tile(int NV, int kc, const float *a, ptrdiff_t row_step, ptrdiff_t k_step, const float *b,
                             ptrdiff_t b_step, float alpha, int add, float *c, ptrdiff_t ldc, int rows) {
    const float *ar[DT__ATT_ROWS];
    for (int r = 0; r < DT__ATT_ROWS; r++) ar[r] = a + (r < rows ? r : rows - 1) * row_step;
#if defined(__GNUC__)
    dt__vec acc[DT__ATT_ROWS][DT__ATT_VECS];   /* in registers: every index below is a constant */
#pragma GCC unroll 8
    for (int r = 0; r < DT__ATT_ROWS; r++)
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) acc[r][x] = (dt__vec){ 0 };
    for (int k = 0; k < kc; k++) {
        dt__vec bv[DT__ATT_VECS];
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) bv[x] = dt__vload(b + k * b_step + x * DT_VL);
#pragma GCC unroll 8
        for (int r = 0; r < DT__ATT_ROWS; r++) {
            float s = ar[r][k * k_step];
#pragma GCC unroll 4
            for (int x = 0; x < NV; x++) acc[r][x] = DT__MADD(acc[r][x], s, bv[x]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < DT__ATT_ROWS; r++)
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) {
            if (r >= rows) continue;
            float *cp = c + r * ldc + x * DT_VL;
            dt__vec o = alpha * acc[r][x];
            if (add) o = dt__vload(cp) + o;
            dt__vstore(cp, o);
        }
#else
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < NV * DT_VL; x++) {
            float s = 0;
            for (int k = 0; k < kc; k++) s += ar[r][k * k_step] * b[k * b_step + x];
            c[r * ldc + x] = add ? c[r * ldc + x] + alpha * s : alpha * s;
        }
#endif
}
/* The same over `vecs` vectors of columns, DT__ATT_VECS at a time. */
static void dt__att_product(int vecs, int kc, const float *a, ptrdiff_t row_step, ptrdiff_t k_step, const float *b,
                            ptrdiff_t b_step, float alpha, int add, float *c, ptrdiff_t ldc, int rows) {
    for (int x0 = 0; x0 < vecs; x0 += DT__ATT_VECS) {
        const float *bx = b + x0 * DT_VL;
        float *cx = c + x0 * DT_VL;
        switch (vecs - x0 < DT__ATT_VECS ? vecs - x0 : DT__ATT_VECS) {
        case 1: dt__att_tile(1, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
#if DT__ATT_VECS == 4
        case 2: dt__att_tile(2, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
        case 3: dt__att_tile(3, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
#endif
        default: dt__att_tile(DT__ATT_VECS, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
        }
    }
}
static int dt__att_padded(int T) { return (T + DT_VL - 1) / DT_VL * DT_VL; }
/* dst[d][j] = src[j * ld + d] for d < hd, j < T, rows of Tp with zeros after T */
static void dt__att_transpose(const float *src, ptrdiff_t ld, int T, int hd, float *dst, int Tp) {
    for (int j = 0; j < T; j++)
        for (int d = 0; d < hd; d++) dst[(size_t)d * Tp + j] = src[(size_t)j * ld + d];
    for (int d = 0; d < hd; d++)
        for (int j = T; j < Tp; j++) dst[(size_t)d * Tp + j] = 0.0f;
}
/* [src/05-autograd.h] */
/* ==== autograd ===============================================================
   Reverse-mode differentiation with a tape. Each op computes its output at once
   and, if gradients are on and any input needs one, appends an entry: which
   function computes the input gradients from the output gradient, and what it
   saved (layernorm's mean and 1/std, attention's probabilities). dt_backward()
   seeds d(loss)/d(loss) = 1 and calls the entries from last to first. Every
   backward ADDS into .grad, because a tensor used twice (a residual) receives
   gradient from both uses. */

void dt_set_grad_enabled(int on) { dt__ctx.grad_enabled = on; }
double dt_flops_counted(void) { return dt__ctx.flops; }
void dt_flops_reset(void) { dt__ctx.flops = 0; }

static int dt__wants_grad(dt_tensor *a, dt_tensor *b, dt_tensor *c) {
    if (!dt__ctx.grad_enabled) return 0;
    return (a && a->requires_grad) || (b && b->requires_grad) || (c && c->requires_grad);
}

/* A new, zeroed entry at the end of the tape. */
static dt__tape_entry *dt__tape_append(dt__backward_fn fn) {
    if (dt__ctx.tape_len == dt__ctx.tape_cap) {
        dt__ctx.tape_cap = dt__ctx.tape_cap ? 2 * dt__ctx.tape_cap : 256;
        dt__ctx.tape = (dt__tape_entry *)realloc(dt__ctx.tape, dt__ctx.tape_cap * sizeof(dt__tape_entry));
        if (!dt__ctx.tape) dt_fail("out of memory (autograd tape)");
    }
    dt__tape_entry *e = &dt__ctx.tape[dt__ctx.tape_len++];
    memset(e, 0, sizeof *e);
    e->backward = fn;
    return e;
}

static dt__tape_entry *dt__tape_push(dt__backward_fn fn, dt_tensor *out, dt_tensor *a, dt_tensor *b, dt_tensor *c) {
    dt__tape_entry *e = dt__tape_append(fn);
    e->out = out;
    e->in[0] = a; e->in[1] = b; e->in[2] = c;
    out->requires_grad = 1;
    return e;
}

/* A mark on the tape with no tensor: its function runs when backward reaches
   it. FSDP uses two per unit, to gather before the unit's backward and to
   reduce-scatter after it. */
static void dt__tape_mark(dt__backward_fn fn, void *user, int arg) {
    dt__tape_entry *e = dt__tape_append(fn);
    e->saved = user;
    e->iarg[0] = arg;
}

/* Backward from a scalar loss, seeded with d(loss)/d(loss) = seed: 1, or a
   loss scale (the mixed-precision chapter). */
static void dt__backward_seeded(dt_tensor *loss, float seed) {
    if (loss->numel != 1) dt_fail("backward needs a scalar loss, got %lld elements", (long long)loss->numel);
    dt_backward_from(loss, &seed);
}
void dt_backward(dt_tensor *loss) { dt__backward_seeded(loss, 1.0f); }

/* Walk the tape's entries [lo, hi) from last to first. First, where each
   parameter is read first among them: its gradient is final once the walk has
   passed that entry -- the moment DDP may start communicating it. */
static void dt__tape_walk(int lo, int hi) {
    int generation = dt__ctx.backward_generation;
    for (int i = lo; i < hi; i++)
        for (int j = 0; j < 4; j++) {
            dt_tensor *p = dt__ctx.tape[i].in[j];
            if (p && p->is_param && p->hook_gen != generation) { p->hook_gen = generation; p->first_use = i; }
            if (p && p->is_param && p->parallel) p->parallel->grads_pending = 1;
        }
    for (int i = hi - 1; i >= lo; i--) {
        dt__tape_entry *e = &dt__ctx.tape[i];
        dt__scratch_reset();
        if (!e->out || e->out->grad) e->backward(e);
        e = &dt__ctx.tape[i];          /* a recomputed block (the models chapter) grows the tape, which may move it */
        for (int j = 0; j < 4; j++) {
            dt_tensor *p = e->in[j];
            if (p && p->is_param && p->first_use == i && p->hook_gen == generation && p->parallel && p->parallel->grad_ready)
                p->parallel->grad_ready(p->parallel, p);
        }
    }
}

void dt_backward_from(dt_tensor *loss, const float *seed) {
    if (!loss->requires_grad) dt_fail("the loss does not depend on any parameter (were gradients disabled?)");
    dt__ctx.backward_generation++;
    dt__backend_for(loss);
    dt_upload(dt_grad(loss), seed, sizeof(float) * (size_t)loss->numel);
    dt__tape_walk(0, dt__ctx.tape_len);
    dt__ctx.tape_len = 0;
    dt__ctx.backward_end_ms = dt_now_ms();
}

/* Backward over a run of the tape, [lo, hi), from `out`, whose gradient is
   already in place: pipeline parallelism (the pipeline-parallel chapter) walks one micro-batch's
   forward at a time, from the gradient the next stage sent back. The tape
   stays as it is (the step's end empties it). */
static void dt__backward_span(dt_tensor *out, int lo, int hi) {
    if (!out->requires_grad || !out->grad) dt_fail("a backward from a tensor that has no gradient to pass back");
    dt__ctx.backward_generation++;
    dt__backend_for(out);
    dt__tape_walk(lo, hi);
}

dt_parallel *dt_parallel_splitting(dt_parallel *par) {
    while (par && !par->tp_sum) par = par->inner;
    return par;
}
void dt_parallel_backward_done(dt_parallel *par) {
    if (!par->grads_pending)
        dt_fail("%s: no backward has run since the gradients were last synchronised; call it after dt_backward",
                par->sync_fn);
    par->grads_pending = 0;
    for (dt_parallel *q = par; q; q = q->inner) {
        if (q->backward_done) q->backward_done(q);
        q->rows_split = 0;        /* no rows-split region outlives its step */
    }
}

/* Round f32 values to a 16-bit type and widen them again, in one pass. */
static void dt__round_f32_cpu(const float *x, float *y, dt_dtype to, int64_t n) {
    uint16_t h[256];
    for (int64_t i = 0; i < n; i += 256) {
        int64_t c = n - i < 256 ? n - i : 256;
        dt__f32_to_half_cpu(x + i, h, to, c);
        dt__half_to_f32_cpu(h, y + i, to, c);
    }
}
float dt_load_f32(const void *p, int64_t i, dt_dtype t) {
    return t == DT_F32 ? ((const float *)p)[i] : t == DT_BF16 ? dt_bf16_to_f32(((const uint16_t *)p)[i])
                                                              : dt_f16_to_f32(((const uint16_t *)p)[i]);
}
void dt_store_f32(void *p, int64_t i, dt_dtype t, float v) {
    if (t == DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = t == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
}
void dt_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n) {
    const dt_backend *gpu = dt__backend_of(dt__ctx.device);
    if (gpu) { gpu->convert(src, from, dst, to, n); return; }
    const int64_t chunk = 16384;              /* cores share the work when there is enough */
    DT_OMP("omp parallel for schedule(static) if(n > 4 * chunk)")
    for (int64_t i = 0; i < n; i += chunk) {
        int64_t c = n - i < chunk ? n - i : chunk;
        if (from == to) memcpy((char *)dst + i * dt_dtype_size(to), (const char *)src + i * dt_dtype_size(to), (size_t)c * dt_dtype_size(to));
        else if (from == DT_F32) dt__f32_to_half_cpu((const float *)src + i, (uint16_t *)dst + i, to, c);
        else if (to == DT_F32) dt__half_to_f32_cpu((const uint16_t *)src + i, (float *)dst + i, from, c);
        else
            for (int64_t k = i; k < i + c; k++) {       /* bf16 <-> f16, through f32 */
                float v = from == DT_BF16 ? dt_bf16_to_f32(((const uint16_t *)src)[k]) : dt_f16_to_f32(((const uint16_t *)src)[k]);
                ((uint16_t *)dst)[k] = to == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
            }
    }
}

/* -- how an op sees its tensors. Ops compute in f32. With f32 everywhere the
      views below are the tensors' own buffers and cost nothing. Under mixed
      precision (the mixed-precision chapter) an op reads every input as f32 values rounded to
      the compute dtype -- a 16-bit activation widened, or an f32 master weight
      narrowed, the cast PyTorch's autocast makes -- into the scratch arena,
      and stores its output narrowed to 16 bits. Gradients travel the same way:
      an activation's in its own dtype, a parameter's added to its f32 master
      gradient after rounding, as a 16-bit copy's gradient would have been. -- */
static int dt__mixed(void) { return dt__ctx.compute_dtype != DT_F32; }

/* On the CPU: n f32 values rounded to the compute dtype (y may be x), the
   cores sharing the work. */
static void dt__round_to_compute_cpu(const float *x, float *y, int64_t n) {
    const int64_t chunk = 16384;
    dt_dtype to = dt__ctx.compute_dtype;          /* read here: the context is per thread */
    DT_OMP("omp parallel for schedule(static) if(n > 4 * chunk)")
    for (int64_t i = 0; i < n; i += chunk) dt__round_f32_cpu(x + i, y + i, to, n - i < chunk ? n - i : chunk);
}
/* n values of dtype `from` at src as f32 in the scratch arena; f32 values are
   rounded to the compute dtype on the way (a 16-bit copy, widened again). */
static float *dt__scratch_f32(const void *src, dt_dtype from, int64_t n) {
    float *f = (float *)dt__scratch_on(dt__ctx.device, (size_t)n * sizeof(float));
    if (from == DT_F32 && dt__mixed() && dt__ctx.device == DT_CPU) {      /* the same, in one pass */
        dt__round_to_compute_cpu((const float *)src, f, n);
        return f;
    }
    if (from == DT_F32 && dt__mixed()) {
        void *half = dt__scratch_on(dt__ctx.device, (size_t)n * 2);
        dt_convert(src, DT_F32, half, dt__ctx.compute_dtype, n);
        src = half;
        from = dt__ctx.compute_dtype;
    }
    dt_convert(src, from, f, DT_F32, n);
    return f;
}
static const float *dt__in(const dt_tensor *t) {
    if (t->dtype == DT_F32 && !dt__mixed()) return t->data;
    return dt__scratch_f32(t->data, t->dtype, t->numel);
}
/* d(loss)/d(out) of an op's output, as f32. */
static const float *dt__grad_in(const dt_tensor *t) {
    dt_dtype g = dt__grad_dtype(t);
    if (g == DT_F32) return t->grad;
    return dt__scratch_f32(t->grad, g, t->numel);
}
/* Where an op writes its output as f32, and the store into the output's dtype. */
static float *dt__out(dt_tensor *y) {
    return y->dtype == DT_F32 ? y->data : (float *)dt__scratch_on(y->device, (size_t)y->numel * sizeof(float));
}
static void dt__out_done(dt_tensor *y, float *v) {
    if (v != y->data) dt_convert(v, DT_F32, y->data, y->dtype, y->numel);
}
/* Where a backward ADDS d(loss)/d(t) as f32, and the store after. */
static float *dt__grad_acc(dt_tensor *t) {
    dt_dtype g = dt__grad_dtype(t);
    float *grad = dt_grad(t);
    if (g == DT_F32 && !(t->is_param && dt__mixed())) return grad;
    float *f = (float *)dt__scratch_on(t->device, (size_t)t->numel * sizeof(float));
    if (g == DT_F32) dt__zero_on(t->device, f, (size_t)t->numel * sizeof(float));   /* a parameter's share */
    else dt_convert(grad, g, f, DT_F32, t->numel);
    return f;
}
static void dt__grad_acc_done(dt_tensor *t, float *f) {
    if (f == t->grad) return;
    if (dt__grad_dtype(t) != DT_F32) { dt_convert(f, DT_F32, t->grad, t->dtype, t->numel); return; }
    /* a parameter: its 16-bit gradient, added to the f32 master gradient */
    const dt_backend *gpu = dt__backend_of(t->device);
    if (gpu) { gpu->accumulate(t->grad, dt__scratch_f32(f, DT_F32, t->numel), t->numel); return; }
    int64_t n = t->numel;
    float *g = t->grad;
    dt__round_to_compute_cpu(f, f, n);                  /* in place: no second copy of a big weight */
    DT_OMP("omp parallel for if(n > 65536)")
    for (int64_t i = 0; i < n; i++) g[i] += f[i];
}
/* The same, for a backward that can write its share instead of adding it: an
   activation's gradient that no op has touched yet comes unzeroed, *first is
   1, and the caller must write every element. On the CPU the element-wise
   ops are bound by memory, not arithmetic: zeroing a buffer and then reading
   it back to add cost a third of GELU's and the residual's backward, and a
   memset of every activation's gradient besides. A GPU's kernels only add
   (the backend table has no overwriting form), so there *first is 0. */
static float *dt__grad_acc_first(dt_tensor *t, int *first) {
    *first = !t->grad && !t->is_param && !dt__backend_of(t->device);
    if (!*first) return dt__grad_acc(t);
    t->grad = (float *)dt__step_alloc_on(t->device, (size_t)t->numel * dt_dtype_size(dt__grad_dtype(t)));
    float *f = dt__grad_dtype(t) == DT_F32 ? t->grad
                                            : (float *)dt__scratch_on(t->device, (size_t)t->numel * sizeof(float));
#ifdef DT_TESTING
    /* The arena hands back last step's memory, which no sanitizer sees as
       unwritten: in the tests' builds an element the caller forgets is NaN. */
    for (int64_t i = 0; i < t->numel; i++) f[i] = NAN;
#endif
    return f;                                      /* a 16-bit gradient: converted by _done */
}

/* A matmul operand: a 2-D tensor's data (or gradient), row-major. */
typedef struct dt__operand { const dt_tensor *t; int grad; } dt__operand;
static dt__operand dt__op_data(const dt_tensor *t) { dt__operand o = { t, 0 }; return o; }
static dt__operand dt__op_grad(const dt_tensor *t) { dt__operand o = { t, 1 }; return o; }
/* Its values in the compute dtype: the tensor's own buffer, or a 16-bit copy
   in the scratch arena (what a GPU's tensor cores read). */
static const void *dt__operand_half(dt__operand o) {
    dt_dtype have = o.grad ? dt__grad_dtype(o.t) : o.t->dtype;
    const void *src = o.grad ? (const void *)o.t->grad : (const void *)o.t->data;
    if (have == dt__ctx.compute_dtype) return src;
    void *half = dt__scratch_on(o.t->device, (size_t)o.t->numel * 2);
    dt_convert(src, have, half, dt__ctx.compute_dtype, o.t->numel);
    return half;
}
/* The matmuls of linear layers: C[M,N] (+)= op(A) op(B), A and B seen in the
   compute dtype. A GPU multiplies 16-bit operands on its tensor cores,
   summing in f32; the CPU widens them to f32 first (dt__in and dt__grad_in) --
   products of 16-bit numbers are exact in f32, so both sum the same products.
   The epilogue (linear's forward; NULL elsewhere; ldc = N) is the CPU
   matmul's own, and kernels after the matmul on a GPU. */
static void dt__gpu_epilogue(const dt_backend *gpu, float *C, int M, int N, const dt__epilogue *ep) {
    if (ep && ep->bias) gpu->add_bias(C, ep->bias, M, N);
    if (ep && ep->gelu) gpu->gelu_forward(C, ep->gelu, (int64_t)M * N, ep->tanh_form);
}
static void dt__matmul_op(const dt_backend *gpu, int ta, int tb, int M, int N, int K, dt__operand A, dt__operand B,
                         float beta, float *C, int ldc, const dt__epilogue *ep) {
    int lda = (int)dt_tensor_cols(A.t), ldb = (int)dt_tensor_cols(B.t);
    if (gpu && dt__mixed()) {
        gpu->gemm_half(dt__ctx.compute_dtype, ta, tb, M, N, K, dt__operand_half(A), lda, dt__operand_half(B), ldb, beta, C, ldc);
        dt__gpu_epilogue(gpu, C, M, N, ep);
        return;
    }
    const float *a = A.grad ? dt__grad_in(A.t) : dt__in(A.t), *b = B.grad ? dt__grad_in(B.t) : dt__in(B.t);
    if (gpu) {
        gpu->gemm(ta, tb, M, N, K, 1.0f, a, lda, b, ldb, beta, C, ldc);
        dt__gpu_epilogue(gpu, C, M, N, ep);
    } else dt__gemm_epilogue(ta, tb, M, N, K, 1.0f, a, lda, b, ldb, beta, C, ldc, ep);
}

/* -- linear: y = x W^T + b. The three matmuls of every layer's training step.
      GPT-2 stores its weights the other way round, [in, out] (in_out, in
      iarg[0]): the same matmuls with the weight's transposes flipped. -- */
static void dt__linear_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *b = e->in[2], *y = e->out;
    int in_out = e->iarg[0];
    int N = (int)dt_tensor_rows(x), in = (int)dt_tensor_cols(x), out = (int)dt_tensor_cols(y);
    const dt_backend *gpu = dt__backend_for(y);
    if (x->requires_grad) {              /* dx = dy W (in_out: dy W^T) */
        int first;
        float *dx = dt__grad_acc_first(x, &first);
        dt__matmul_op(gpu, 0, in_out, N, in, out, dt__op_grad(y), dt__op_data(w), first ? 0.0f : 1.0f, dx, in, NULL);
        dt__grad_acc_done(x, dx);
        dt__ctx.flops += 2.0 * N * in * out;
    }
    if (w->requires_grad) {              /* dW = dy^T x (in_out: x^T dy) */
        float *dw = dt__grad_acc(w);
        if (in_out) dt__matmul_op(gpu, 1, 0, in, out, N, dt__op_data(x), dt__op_grad(y), 1.0f, dw, out, NULL);
        else dt__matmul_op(gpu, 1, 0, out, in, N, dt__op_grad(y), dt__op_data(x), 1.0f, dw, in, NULL);
        dt__grad_acc_done(w, dw);
        dt__ctx.flops += 2.0 * N * in * out;
    }
    if (b && b->requires_grad) {         /* db = sum of dy over rows, in row order */
        float *db = dt__grad_acc(b);
        const float *dyf = dt__grad_in(y);
        if (gpu) gpu->sum_rows(dyf, db, N, out);
        else {                           /* each thread a band of columns: every sum keeps its order */
            DT_OMP("omp parallel if((double)N * out > 65536.0)")
            {
                int t = dt__thread_num(), nt = dt__team_size();
                int j0 = (int)((int64_t)out * t / nt), j1 = (int)((int64_t)out * (t + 1) / nt);
                for (int i = 0; i < N; i++)
                    for (int j = j0; j < j1; j++) db[j] += dyf[(size_t)i * out + j];
            }
        }
        dt__grad_acc_done(b, db);
    }
}
/* act: where linear + GELU (below) wants GELU of y, computed as y is stored */
static dt_tensor *dt__linear_layout(dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out, dt_tensor *act, int tanh_form) {
    int N = (int)dt_tensor_rows(x), in = (int)dt_tensor_cols(x);
    int out = (int)(in_out ? dt_tensor_cols(w) : dt_tensor_rows(w)), w_in = (int)(in_out ? dt_tensor_rows(w) : dt_tensor_cols(w));
    if (w_in != in)
        dt_fail("linear %s: input has %d features, weight expects %d", w->name ? w->name : "", in, w_in);
    const dt_backend *gpu = dt__backend_for(x);
    dt__backend_for(w);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(N, out);
    float *yv = dt__out(y);
    float *actv = act ? dt__out(act) : NULL;
    dt__epilogue ep = { b ? dt__in(b) : NULL, actv, tanh_form };
    dt__matmul_op(gpu, 0, !in_out, N, out, in, dt__op_data(x), dt__op_data(w), 0.0f, yv, out, b || act ? &ep : NULL);
    dt__ctx.flops += 2.0 * N * in * out;
    dt__out_done(y, yv);
    if (act) dt__out_done(act, actv);
    if (dt__wants_grad(x, w, b)) dt__tape_push(dt__linear_backward, y, x, w, b)->iarg[0] = in_out;
    return y;
}
dt_tensor *dt_linear(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_layout(x, weight, bias, 0, NULL, 0); }
dt_tensor *dt_linear_in_out(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_layout(x, weight, bias, 1, NULL, 0); }

/* -- GELU: the exact erf form (PyTorch's nn.GELU() and timm), or the tanh
      approximation GPT-2 was trained with (tanh_form, in iarg[0]) -- */
static void dt__gelu_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    int first;
    float *dx = dt__grad_acc_first(x, &first);
    const float *dy = dt__grad_in(e->out), *xv = dt__in(x);
    int64_t n = x->numel;
    int tanh_form = e->iarg[0];
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->gelu_backward(xv, dy, dx, n, tanh_form);
    else {
        /* one loop per form, and per write or add: a choice inside would keep
           the compiler from vectorising */
        if (tanh_form && first) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * dt_gelu_tanh_derivative(xv[i]);
        } else if (tanh_form) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * dt_gelu_tanh_derivative(xv[i]);
        } else if (first) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * dt_gelu_derivative(xv[i]);
        } else {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * dt_gelu_derivative(xv[i]);
        }
    }
    dt__grad_acc_done(x, dx);
}
static dt_tensor *dt__gelu_form(dt_tensor *x, int tanh_form) {
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    int64_t n = x->numel;
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    if (gpu) gpu->gelu_forward(xv, yv, n, tanh_form);
    else {
        if (tanh_form) {                            /* one loop per form, as in backward */
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) yv[i] = dt_gelu_tanh_value(xv[i]);
        } else {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) yv[i] = dt_gelu_value(xv[i]);
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__gelu_backward, y, x, NULL, NULL)->iarg[0] = tanh_form;
    return y;
}
dt_tensor *dt_gelu(dt_tensor *x) { return dt__gelu_form(x, 0); }
dt_tensor *dt_gelu_tanh(dt_tensor *x) { return dt__gelu_form(x, 1); }

/* -- linear, then GELU: the first layer of a transformer's MLP. On the tape
      they are the two ops above, so the backward is theirs, but the forward
      is one pass: the matmul writes y and GELU(y) from each tile while it is
      hot (see dt__epilogue), which saves two passes over a B*T x 4D matrix.
      Under mixed precision y is rounded to 16 bits before GELU reads it, so
      there the two ops simply run one after the other. -- */
static dt_tensor *dt__linear_gelu(dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out, int tanh_form) {
    if (dt__mixed()) return dt__gelu_form(dt__linear_layout(x, w, b, in_out, NULL, 0), tanh_form);
    dt_tensor *act = dt__tensor_out_2d((int)dt_tensor_rows(x), (int)(in_out ? dt_tensor_cols(w) : dt_tensor_rows(w)));
    dt_tensor *y = dt__linear_layout(x, w, b, in_out, act, tanh_form);
    if (dt__wants_grad(y, NULL, NULL)) dt__tape_push(dt__gelu_backward, act, y, NULL, NULL)->iarg[0] = tanh_form;
    return act;
}
dt_tensor *dt_linear_gelu(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_gelu(x, weight, bias, 0, 0); }
dt_tensor *dt_linear_in_out_gelu_tanh(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) {
    return dt__linear_gelu(x, weight, bias, 1, 1);
}

/* -- LayerNorm over the last dimension. Saves mean and 1/std per row.
      A row's sums run in DT_LANES interleaved partial sums, added up in a
      fixed order at the end: one running sum is a chain the compiler may not
      reorder, so it could not use vector instructions, and the row loops are
      most of LayerNorm's time. Sums in float: rows of up to a few thousand
      values lose nothing a test sees; the weight's gradient, summed over
      millions of rows, stays in double below. -- */
#define DT_LANES 16
/* sum of f(j) for j < D as DT_LANES partial sums; `acc` must start at zero */
#define DT__LANE_SUM(acc, D, j, expr)                                          \
    do {                                                                       \
        int j##_0 = 0;                                                         \
        for (; j##_0 + DT_LANES <= (D); j##_0 += DT_LANES)                     \
            for (int l_ = 0; l_ < DT_LANES; l_++) { int j = j##_0 + l_; acc[l_] += (expr); } \
        for (int j = j##_0; j < (D); j++) acc[j % DT_LANES] += (expr);         \
    } while (0)
static float dt__lanes_total(const float *acc) {
    float s = 0;
    for (int l = 0; l < DT_LANES; l++) s += acc[l];
    return s;
}
/* A norm's weight and bias gradients: dw += sum over rows of dy * x-hat, db +=
   sum of dy (stats: the rows' means, then their 1/std; RMSNorm's means are 0).
   A sum over every row, in double: in float, 4 million rows lost 8e-5 of it
   (the first GPU run, 2026-11-24, whose blocked sums were the closer ones).
   Columns are dealt to threads; each sums its rows in order. */
static void dt__norm_weight_grads(const float *xv, const float *dy, const float *stats, int N, int D, float *dw, float *db) {
    double *sum = (double *)dt_step_alloc(sizeof(double) * 2 * (size_t)D);
    DT_OMP("omp parallel for schedule(static) if((int64_t)N * D > 65536)")
    for (int j0 = 0; j0 < D; j0 += 16) {
        int j1 = j0 + 16 < D ? j0 + 16 : D;
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D, *dyr = dy + (size_t)i * D;
            float mean = stats[i], rstd = stats[N + i];
            for (int j = j0; j < j1; j++) {
                sum[j] += (double)dyr[j] * ((xr[j] - mean) * rstd);
                sum[D + j] += dyr[j];
            }
        }
    }
    if (dw) for (int j = 0; j < D; j++) dw[j] += (float)sum[j];
    if (db) for (int j = 0; j < D; j++) db[j] += (float)sum[D + j];
}
static void dt__layernorm_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *b = e->in[2], *y = e->out;
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const float *stats = (const float *)e->saved;      /* mean[N], rstd[N] */
    const float *dy = dt__grad_in(y), *xv = dt__in(x), *wv = w ? dt__in(w) : NULL;
    int first = 0;
    float *dx = x->requires_grad ? dt__grad_acc_first(x, &first) : NULL;
    float *dw = w && w->requires_grad ? dt__grad_acc(w) : NULL, *db = b && b->requires_grad ? dt__grad_acc(b) : NULL;
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->layernorm_backward(xv, wv, dy, stats, dx, dw, db, N, D);
    if (!gpu && dx) {
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D, *dyr = dy + (size_t)i * D;
            float mean = stats[i], rstd = stats[N + i];
            float acc_g[DT_LANES] = { 0 }, acc_gx[DT_LANES] = { 0 };  /* g = dy * w, the gradient of x-hat */
            if (wv) {
                DT__LANE_SUM(acc_g, D, j, dyr[j] * wv[j]);
                DT__LANE_SUM(acc_gx, D, j, dyr[j] * wv[j] * ((xr[j] - mean) * rstd));
            } else {
                DT__LANE_SUM(acc_g, D, j, dyr[j]);
                DT__LANE_SUM(acc_gx, D, j, dyr[j] * ((xr[j] - mean) * rstd));
            }
            float mg = dt__lanes_total(acc_g) / D, mgx = dt__lanes_total(acc_gx) / D;
            float *dxr = dx + (size_t)i * D;
            for (int j = 0; j < D; j++) {
                float g = dyr[j] * (wv ? wv[j] : 1.0f), xhat = (xr[j] - mean) * rstd;
                float d = rstd * (g - mg - xhat * mgx);
                dxr[j] = first ? d : dxr[j] + d;
            }
        }
    }
    if (!gpu && (dw || db)) dt__norm_weight_grads(xv, dy, stats, N, D, dw, db);
    if (dx) dt__grad_acc_done(x, dx);
    if (dw) dt__grad_acc_done(w, dw);
    if (db) dt__grad_acc_done(b, db);
}
/* Under mixed precision the statistics are computed in f32 from the 16-bit
   input, and the normalised output is stored in 16 bits. */
dt_tensor *dt_layernorm(dt_tensor *x, dt_tensor *weight, dt_tensor *bias, float eps) {
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *stats = (float *)dt__step_data(sizeof(float) * 2 * (size_t)N);
    const float *xv = dt__in(x), *wv = weight ? dt__in(weight) : NULL, *bv = bias ? dt__in(bias) : NULL;
    float *yv = dt__out(y);
    if (gpu) gpu->layernorm_forward(xv, wv, bv, yv, stats, N, D, eps);
    else {
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D;
            float *yr = yv + (size_t)i * D;
            float acc_x[DT_LANES] = { 0 }, acc_d2[DT_LANES] = { 0 };
            DT__LANE_SUM(acc_x, D, j, xr[j]);
            float mean = dt__lanes_total(acc_x) / D;
            DT__LANE_SUM(acc_d2, D, j, (xr[j] - mean) * (xr[j] - mean));
            float rstd = 1.0f / sqrtf(dt__lanes_total(acc_d2) / D + eps);   /* biased variance, as PyTorch */
            for (int j = 0; j < D; j++)
                yr[j] = (xr[j] - mean) * rstd * (wv ? wv[j] : 1.0f) + (bv ? bv[j] : 0.0f);
            stats[i] = mean;
            stats[N + i] = rstd;
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, weight, bias)) dt__tape_push(dt__layernorm_backward, y, x, weight, bias)->saved = stats;
    return y;
}

/* -- RMSNorm (Llama's): LayerNorm without taking out the mean and without a
      bias, y = x / sqrt(mean(x^2) + eps) * w. It saves 1/rms per row, after a
      row of zeros where LayerNorm keeps its means: x-hat = (x - 0) / rms, so
      the weight's gradient is LayerNorm's, the same code. -- */
static void dt__rmsnorm_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *y = e->out;
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const float *stats = (const float *)e->saved;      /* zeros[N], rstd[N] */
    const float *dy = dt__grad_in(y), *xv = dt__in(x), *wv = dt__in(w);
    float *dx = x->requires_grad ? dt__grad_acc(x) : NULL, *dw = w->requires_grad ? dt__grad_acc(w) : NULL;
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->rmsnorm_backward(xv, wv, dy, stats, dx, dw, N, D);
    if (!gpu && dx) {
        /* dx = rstd (g - x-hat mean(g x-hat)), g = dy w */
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D, *dyr = dy + (size_t)i * D;
            float rstd = stats[N + i], acc_gx[DT_LANES] = { 0 };
            DT__LANE_SUM(acc_gx, D, j, dyr[j] * wv[j] * (xr[j] * rstd));
            float mgx = dt__lanes_total(acc_gx) / D, *dxr = dx + (size_t)i * D;
            for (int j = 0; j < D; j++) dxr[j] += rstd * (dyr[j] * wv[j] - (xr[j] * rstd) * mgx);
        }
    }
    if (!gpu && dw) dt__norm_weight_grads(xv, dy, stats, N, D, dw, NULL);
    if (dx) dt__grad_acc_done(x, dx);
    if (dw) dt__grad_acc_done(w, dw);
}
dt_tensor *dt_rmsnorm(dt_tensor *x, dt_tensor *weight, float eps) {
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    if (weight->numel != D) dt_fail("rmsnorm: rows of %d need a weight of %d, %s has %lld", D, D,
                                    weight->name ? weight->name : "the weight", (long long)weight->numel);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *stats = (float *)dt__step_data(sizeof(float) * 2 * (size_t)N);
    const float *xv = dt__in(x), *wv = dt__in(weight);
    float *yv = dt__out(y);
    if (gpu) gpu->rmsnorm_forward(xv, wv, yv, stats, N, D, eps);
    else {
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D;
            float *yr = yv + (size_t)i * D, acc[DT_LANES] = { 0 };
            DT__LANE_SUM(acc, D, j, xr[j] * xr[j]);
            float rstd = 1.0f / sqrtf(dt__lanes_total(acc) / D + eps);
            for (int j = 0; j < D; j++) yr[j] = (xr[j] * rstd) * wv[j];   /* Hugging Face's order: normalise, then scale */
            stats[i] = 0.0f;
            stats[N + i] = rstd;
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, weight, NULL)) dt__tape_push(dt__rmsnorm_backward, y, x, weight, NULL)->saved = stats;
    return y;
}

/* -- SwiGLU (Llama's MLP): silu(gate) * up, element by element; gate and up
      are two linear layers of the same input. -- */
static void dt__swiglu_backward(dt__tape_entry *e) {
    dt_tensor *gate = e->in[0], *up = e->in[1];
    const float *dy = dt__grad_in(e->out), *gv = dt__in(gate), *uv = dt__in(up);
    float *dg = gate->requires_grad ? dt__grad_acc(gate) : NULL, *du = up->requires_grad ? dt__grad_acc(up) : NULL;
    int64_t n = gate->numel;
    const dt_backend *gpu = dt__backend_for(gate);
    if (gpu) gpu->swiglu_backward(gv, uv, dy, dg, du, n);
    else {
        if (dg) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dg[i] += dy[i] * uv[i] * dt_silu_derivative(gv[i]);
        }
        if (du) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) du[i] += dy[i] * dt_silu_value(gv[i]);
        }
    }
    if (dg) dt__grad_acc_done(gate, dg);
    if (du) dt__grad_acc_done(up, du);
}
dt_tensor *dt_swiglu(dt_tensor *gate, dt_tensor *up) {
    if (gate->numel != up->numel) dt_fail("swiglu: gate has %lld elements, up %lld", (long long)gate->numel, (long long)up->numel);
    const dt_backend *gpu = dt__backend_for(gate);
    dt__backend_for(up);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(gate->ndim, gate->shape);
    const float *gv = dt__in(gate), *uv = dt__in(up);
    float *yv = dt__out(y);
    int64_t n = gate->numel;
    if (gpu) gpu->swiglu_forward(gv, uv, yv, n);
    else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = dt_silu_value(gv[i]) * uv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(gate, up, NULL)) dt__tape_push(dt__swiglu_backward, y, gate, up, NULL);
    return y;
}

/* -- residual addition: each input's gradient is the output's, added in
      (the first time, copied); tensor parallelism's ops below add the same way -- */
static void dt__add_into_grad(dt_tensor *t, const float *v) {
    int first;
    float *g = dt__grad_acc_first(t, &first);
    const dt_backend *gpu = dt__backend_for(t);
    int64_t n = t->numel;
    if (gpu) gpu->accumulate(g, v, n);
    else if (first) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] = v[i];
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] += v[i];
    }
    dt__grad_acc_done(t, g);
}
static void dt__add_backward(dt__tape_entry *e) {
    const float *dy = dt__grad_in(e->out);
    for (int k = 0; k < 2; k++)
        if (e->in[k]->requires_grad) dt__add_into_grad(e->in[k], dy);
}
dt_tensor *dt_add(dt_tensor *a, dt_tensor *b) {
    if (a->numel != b->numel) dt_fail("add: %lld and %lld elements", (long long)a->numel, (long long)b->numel);
    const dt_backend *gpu = dt__backend_for(a);
    dt__backend_for(b);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(a->ndim, a->shape);
    const float *av = dt__in(a), *bv = dt__in(b);
    float *yv = dt__out(y);
    int64_t n = a->numel;
    if (gpu) gpu->add(av, bv, yv, n);
    else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = av[i] + bv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(a, b, NULL)) dt__tape_push(dt__add_backward, y, a, b, NULL);
    return y;
}

/* -- a constant factor (LoRA's alpha / rank): y = c x, dx += c dy -- */
static void dt__scale_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    float c = e->farg[0];
    int first;
    float *g = dt__grad_acc_first(x, &first);
    const float *dy = dt__grad_in(e->out);
    const dt_backend *gpu = dt__backend_for(x);
    int64_t n = x->numel;
    if (gpu) {
        float *scaled = (float *)dt__scratch_on(x->device, (size_t)n * sizeof(float));
        dt_convert(dy, DT_F32, scaled, DT_F32, n);
        gpu->scale(scaled, c, n);
        gpu->accumulate(g, scaled, n);
    } else if (first) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] = c * dy[i];
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] += c * dy[i];
    }
    dt__grad_acc_done(x, g);
}
dt_tensor *dt_scale(dt_tensor *x, float factor) {
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    int64_t n = x->numel;
    if (gpu) {
        dt_convert(xv, DT_F32, yv, DT_F32, n);
        gpu->scale(yv, factor, n);
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = factor * xv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__scale_backward, y, x, NULL, NULL)->farg[0] = factor;
    return y;
}

/* -- tensor parallelism's f and g (the tensor-parallel chapter cuts the layers); their
      gradients are added in as the residual's are (dt__add_into_grad). -- */
/* The rows of x [N, C] as f32 on the device: x's own values (06 has no
   16-bit activations). */
static float *dt__tp_rows_f32(const dt_tensor *x) { return (float *)dt__in(x); }
/* All of the group's rows, rank after rank: an all-gather of `mine` (n values). */
static float *dt__tp_all_rows(dt_parallel *par, const float *mine, int64_t n, dt_device device) {
    float *all = (float *)dt__scratch_on(device, (size_t)n * (size_t)par->tp_size * sizeof(float));
    par->sp_all_gather(par, mine, all, n);
    return all;
}

/* A column-parallel layer's input (Megatron-LM's f): the input itself, whose
   gradient is each rank's part, summed over the group. Between dt_sp_split
   and dt_sp_gather (iarg[0] 1) it is every rank's rows gathered, and the
   gradient is reduce-scattered: each rank keeps its rows' sum. */
static void dt__tp_copy_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    dt_parallel *par = (dt_parallel *)e->saved;
    int64_t n = e->out->numel;
    float *sum = (float *)dt__scratch_on(x->device, (size_t)n * sizeof(float));
    dt_convert(dt__grad_in(e->out), DT_F32, sum, DT_F32, n);
    if (!e->iarg[0]) {
        par->tp_sum(par, sum, n);
        dt__add_into_grad(x, sum);
        return;
    }
    float *mine = (float *)dt__scratch_on(x->device, (size_t)x->numel * sizeof(float));
    par->sp_reduce_scatter(par, sum, mine, x->numel);
    dt__add_into_grad(x, mine);
}
dt_tensor *dt_tp_copy(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->tp_sum) return x;
    dt_tensor *y;
    if (par->rows_split) {                                    /* the group's rows, gathered */
        dt__backend_for(x);
        dt__scratch_reset();
        int shape[4] = { (int)dt_tensor_rows(x) * par->tp_size, (int)dt_tensor_cols(x), 0, 0 };
        y = dt__tensor_out(2, shape);
        float *yv = dt__out(y);
        par->sp_all_gather(par, dt__tp_rows_f32(x), yv, x->numel);
        dt__out_done(y, yv);
    } else {
        y = (dt_tensor *)dt_step_alloc(sizeof *y);            /* the same values: a view with a gradient of its own */
        *y = *x;
        y->name = NULL;
        y->grad = NULL;
        y->requires_grad = 0;
        y->is_param = 0;
        y->parallel = NULL;
    }
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__tp_copy_backward, y, x, NULL, NULL);
        e->saved = par;
        e->iarg[0] = par->rows_split;
    }
    return y;
}
/* A row-parallel layer's output (Megatron-LM's g): every rank's partial
   output, added up; the gradient passes as it is. Between dt_sp_split and
   dt_sp_gather the sum is reduce-scattered (each rank keeps its rows of it),
   and the gradient all-gathered. */
static void dt__tp_sum_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    const float *dy = dt__grad_in(e->out);
    if (e->iarg[0]) dy = dt__tp_all_rows((dt_parallel *)e->saved, dy, e->out->numel, x->device);
    dt__add_into_grad(x, dy);
}
dt_tensor *dt_tp_sum(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->tp_sum) return x;
    dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y;
    if (par->rows_split) {                                    /* each rank its rows of the sum */
        int64_t rows = dt_tensor_rows(x);
        if (rows % par->tp_size) dt_fail("internal: %lld rows do not split over %d ranks", (long long)rows, par->tp_size);
        int shape[4] = { (int)(rows / par->tp_size), (int)dt_tensor_cols(x), 0, 0 };
        y = dt__tensor_out(2, shape);
        float *yv = dt__out(y);
        par->sp_reduce_scatter(par, dt__tp_rows_f32(x), yv, y->numel);
        dt__out_done(y, yv);
    } else {
        y = dt__tensor_out(x->ndim, x->shape);
        float *yv = dt__out(y);
        dt_convert(dt__in(x), DT_F32, yv, DT_F32, x->numel);
        par->tp_sum(par, yv, x->numel);
        dt__out_done(y, yv);
    }
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__tp_sum_backward, y, x, NULL, NULL);
        e->saved = par;
        e->iarg[0] = par->rows_split;
    }
    return y;
}

/* -- entering and leaving the rows-split region (sequence parallelism). Each
      backward also sets rows_split back to what it was there, so a block
      that --recompute runs again in backward sees the rows as its forward did. -- */
static void dt__sp_split_backward(dt__tape_entry *e) {
    dt_parallel *par = (dt_parallel *)e->saved;
    par->rows_split = 0;
    dt_tensor *x = e->in[0];
    if (x->requires_grad) dt__add_into_grad(x, dt__tp_all_rows(par, dt__grad_in(e->out), e->out->numel, x->device));
}
dt_tensor *dt_sp_split(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->sp_all_gather) return x;
    int64_t rows = dt_tensor_rows(x), cols = dt_tensor_cols(x);
    if (rows % par->tp_size) {
        if (!dt__ctx.grad_enabled) {                          /* evaluation's last batch, generation: whole rows */
            par->rows_split = 0;     /* whatever a backward that had no split entry to walk back left (the mlp's) */
            return x;
        }
        dt_fail("--sequence-parallel: a batch of %lld rows (sequences x tokens) does not split evenly over the %d ranks of a "
                "tensor-parallel group; choose --batch-size so that it does", (long long)rows, par->tp_size);
    }
    int64_t mine = rows / par->tp_size;
    int shape[4] = { (int)mine, (int)cols, 0, 0 };
    dt__backend_for(x);
    dt_tensor *y = dt__tensor_out(2, shape);
    size_t es = dt_dtype_size(x->dtype);
    dt_convert((const char *)x->data + (size_t)(par->tp_rank * mine * cols) * es, x->dtype, y->data, y->dtype, y->numel);
    par->rows_split = 1;
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__sp_split_backward, y, x, NULL, NULL)->saved = par;
    return y;
}
static void dt__sp_gather_backward(dt__tape_entry *e) {
    dt_parallel *par = (dt_parallel *)e->saved;
    par->rows_split = 1;
    dt_tensor *x = e->in[0];
    if (x->requires_grad)                      /* every rank holds the whole, equal gradient: its rows of it */
        dt__add_into_grad(x, dt__grad_in(e->out) + (size_t)par->tp_rank * (size_t)x->numel);
}
dt_tensor *dt_sp_gather(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->sp_all_gather || !par->rows_split) return x;
    dt__backend_for(x);
    dt__scratch_reset();
    int shape[4] = { (int)dt_tensor_rows(x) * par->tp_size, (int)dt_tensor_cols(x), 0, 0 };
    dt_tensor *y = dt__tensor_out(2, shape);
    float *yv = dt__out(y);
    par->sp_all_gather(par, dt__tp_rows_f32(x), yv, x->numel);
    dt__out_done(y, yv);
    par->rows_split = 0;
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__sp_gather_backward, y, x, NULL, NULL)->saved = par;
    return y;
}
/* [src/06-attention-and-loss.h] */
/* -- a bias on every row: y = x + b; dx = dy, db = the sum of dy over rows
      in row order, as linear's backward sums it (so the same bits) -- */
static void dt__add_bias_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *b = e->in[1], *y = e->out;
    const float *dy = dt__grad_in(y);
    int N = (int)dt_tensor_rows(y), C = (int)dt_tensor_cols(y);
    if (x->requires_grad) dt__add_into_grad(x, dy);
    if (b->requires_grad) {
        float *db = dt__grad_acc(b);
        const dt_backend *gpu = dt__backend_for(b);
        if (gpu) gpu->sum_rows(dy, db, N, C);
        else
            for (int i = 0; i < N; i++)
                for (int j = 0; j < C; j++) db[j] += dy[(size_t)i * C + j];
        dt__grad_acc_done(b, db);
    }
}
dt_tensor *dt_add_bias(dt_tensor *x, dt_tensor *bias) {
    int N = (int)dt_tensor_rows(x), C = (int)dt_tensor_cols(x);
    if (bias->numel != C) dt_fail("add_bias: %s has %lld values for %d columns", bias->name ? bias->name : "the bias",
                                  (long long)bias->numel, C);
    const dt_backend *gpu = dt__backend_for(x);
    dt__backend_for(bias);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *yv = dt__out(y);
    const float *bv = dt__in(bias);
    dt_convert(dt__in(x), DT_F32, yv, DT_F32, x->numel);
    if (gpu) gpu->add_bias(yv, bv, N, C);
    else
        for (int i = 0; i < N; i++)
            for (int j = 0; j < C; j++) yv[(size_t)i * C + j] += bv[j];
    dt__out_done(y, yv);
    if (dt__wants_grad(x, bias, NULL)) dt__tape_push(dt__add_bias_backward, y, x, bias, NULL);
    return y;
}

/* -- multi-head self-attention: softmax(Q K^T / sqrt(d)) V per (sequence, head).
      On the CPU, Q, K and V are read in place from the qkv projection (row
      stride 3D), so no reshuffling copies are needed, and the heads run in
      parallel. A GPU wants the opposite: one big batched matmul over every
      (sequence, head), so its body first copies Q, K and V into head-major
      order (see DT_ATTENTION_SAVED_FLOATS). -- */

/* The largest of r[0..n), n > 0, in lanes (a running max is a chain too). */
static float dt__row_max(const float *r, int n) {
    float top[DT_LANES], mx = r[0];
    for (int l = 0; l < DT_LANES; l++) top[l] = r[0];
    int j0 = 0;
    for (; j0 + DT_LANES <= n; j0 += DT_LANES)
        for (int l = 0; l < DT_LANES; l++) top[l] = r[j0 + l] > top[l] ? r[j0 + l] : top[l];
    for (int j = j0; j < n; j++) mx = r[j] > mx ? r[j] : mx;
    for (int l = 0; l < DT_LANES; l++) mx = top[l] > mx ? top[l] : mx;
    return mx;
}
/* One row of the softmax, in lanes as LayerNorm's sums; a causal row sees
   only its first `valid` keys and is 0 after them. */
static void dt__softmax_row(float *r, int valid, int T) {
    float acc[DT_LANES] = { 0 }, mx = dt__row_max(r, valid);
    for (int j = 0; j < valid; j++) r[j] = dt_exp_value(r[j] - mx);
    DT__LANE_SUM(acc, valid, j, r[j]);
    float sum = dt__lanes_total(acc);
    for (int j = 0; j < valid; j++) r[j] /= sum;
    for (int j = valid; j < T; j++) r[j] = 0.0f;
}
/* Back through a softmax row: ds = p (dp - <dp, p>) scale. */
static void dt__softmax_row_backward(float *dr, const float *pr, int T, float scale) {
    float lanes[DT_LANES] = { 0 };
    DT__LANE_SUM(lanes, T, j, dr[j] * pr[j]);
    float dot = dt__lanes_total(lanes);
    for (int j = 0; j < T; j++) dr[j] = pr[j] * (dr[j] - dot) * scale;
}

/* Tests set this to run the straightforward body wherever the fast one would. */
static int dt__attention_by_gemm;
/* --attention: set once, before any thread computes (DataParallel's replicas read it too). */
static dt_attention_body dt__attention_body;
void dt_set_attention_body(dt_attention_body body) {
    if (body != DT_ATTENTION_MATMUL && body != DT_ATTENTION_ONLINE) dt_fail("dt_set_attention_body: body %d is not one dtrain knows", (int)body);
    dt__attention_body = body;
}
static DT_THREAD_LOCAL dt_sequence_split dt__seq_split;        /* ring NULL: whole sequences */
void dt_set_sequence_split(const dt_sequence_split *split) {
    dt_sequence_split none = { NULL, NULL, 0 };
    if (split && (!split->ring || !split->positions || split->T < 1))
        dt_fail("dt_set_sequence_split: a split needs its ring, its positions and its tokens a sequence (T %d)", split->T);
    dt__seq_split = split ? *split : none;
}

/* The straightforward body: per (sequence, head), two matmuls forward and four
   backward, each through dt_gemm. The fast body below gives the same bits;
   this one runs where it cannot (a head width that is not a whole number of
   vectors) and is what the tests hold the fast one to. */
static void dt__attention_forward_gemm(const float *qkvv, float *outv, float *P, int B, int T, int H, int D,
                                       float scale, int causal) {
    int hd = D / H;
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *p = P + (size_t)bh * T * T;
        dt_gemm(0, 1, T, T, hd, scale, q, 3 * D, k, 3 * D, 0.0f, p, T);   /* S = Q K^T / sqrt(d) */
        for (int i = 0; i < T; i++) dt__softmax_row(p + (size_t)i * T, causal ? i + 1 : T, T);
        dt_gemm(0, 0, T, hd, T, 1.0f, p, T, v, 3 * D, 0.0f, outv + (size_t)b * T * D + h * hd, D);   /* O = P V */
    }
}
static void dt__attention_backward_gemm(const float *qkvv, const float *P, const float *dout, float *dqkv, float add,
                                        int B, int T, int H, int D, float scale) {
    int hd = D / H;
    float *dP_all = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)B * H * T * T);
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
        const float *p = P + (size_t)bh * T * T, *dO = dout + (size_t)b * T * D + h * hd;
        float *dp = dP_all + (size_t)bh * T * T;
        dt_gemm(0, 1, T, T, hd, 1.0f, dO, D, v, 3 * D, 0.0f, dp, T);    /* dP = dO V^T */
        dt_gemm(1, 0, T, hd, T, 1.0f, p, T, dO, D, add, dv, 3 * D);      /* dV += P^T dO */
        for (int i = 0; i < T; i++) dt__softmax_row_backward(dp + (size_t)i * T, p + (size_t)i * T, T, scale);
        dt_gemm(0, 0, T, hd, T, 1.0f, dp, T, k, 3 * D, add, dq, 3 * D);   /* dQ += dS K */
        dt_gemm(1, 0, T, hd, T, 1.0f, dp, T, q, 3 * D, add, dk, 3 * D);   /* dK += dS^T Q */
    }
}

/* The fast body. A head's matmuls are small (65 x 65 x 64 in vit-tiny), and
   through the general matmul a third of their time went to its fixed costs:
   packing, edge tiles (65 columns fill three 32-wide strips), a call per
   product. Here each (sequence, head) runs in tiles of DT__ATT_ROWS query
   rows: the tile's scores are made, softmaxed and multiplied into V while
   they are in the cache, with one register-blocked loop (dt__att_tile, in
   the matmul chapter) for all six products, whose operands are read in
   place but for K^T and V^T (copied once per head, rows padded to whole
   vectors). Causal rows skip the keys they cannot see. Each output is still one sum in the built-in
   matmul's order (one slab of DT_KC while T and the head width are at most
   256), so the bits are the same as the body above's -- with the built-in
   matmul; a system BLAS sums in an order of its own. */
/* The tiled body reads a head's rows as whole vectors. */
static int dt__attention_tiled(int head_width) { return head_width % DT_VL == 0 && !dt__attention_by_gemm; }
static void dt__attention_forward_tiles(const float *qkvv, float *outv, float *P, int B, int T, int H, int D,
                                        float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T), R = DT__ATT_ROWS;
    size_t per_thread = (size_t)hd * Tp + (size_t)R * Tp;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * per_thread * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *kt = space + per_thread * (size_t)dt__thread_num(), *tile = kt + (size_t)hd * Tp;
        float *p = P + (size_t)bh * T * T, *o = outv + (size_t)b * T * D + h * hd;
        dt__att_transpose(k, 3 * D, T, hd, kt, Tp);
        for (int i0 = 0; i0 < T; i0 += R) {
            int rows = T - i0 < R ? T - i0 : R, keys = causal && i0 + rows < T ? i0 + rows : T;
            dt__att_product((keys + DT_VL - 1) / DT_VL, hd, q + (size_t)i0 * 3 * D, 3 * D, 1, kt, Tp, scale, 0,
                            tile, Tp, rows);                                      /* S = Q K^T / sqrt(d) */
            for (int r = 0; r < rows; r++) {
                dt__softmax_row(tile + (size_t)r * Tp, causal ? i0 + r + 1 : T, T);
                memcpy(p + (size_t)(i0 + r) * T, tile + (size_t)r * Tp, sizeof(float) * (size_t)T);
            }
            dt__att_product(hd / DT_VL, keys, tile, Tp, 1, v, 3 * D, 1.0f, 0, o + (size_t)i0 * D, D, rows);  /* O = P V */
        }
    }
}
static void dt__attention_backward_tiles(const float *qkvv, const float *P, const float *dout, float *dqkv, int add,
                                         int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T), R = DT__ATT_ROWS;
    size_t per_thread = (size_t)hd * Tp + (size_t)T * Tp;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * per_thread * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
        const float *p = P + (size_t)bh * T * T, *dO = dout + (size_t)b * T * D + h * hd;
        float *vt = space + per_thread * (size_t)dt__thread_num(), *ds = vt + (size_t)hd * Tp;
        dt__att_transpose(v, 3 * D, T, hd, vt, Tp);
        for (int i0 = 0; i0 < T; i0 += R) {           /* by query rows: dS, then dQ */
            int rows = T - i0 < R ? T - i0 : R, keys = causal && i0 + rows < T ? i0 + rows : T;
            float *dsi = ds + (size_t)i0 * Tp;
            dt__att_product((keys + DT_VL - 1) / DT_VL, hd, dO + (size_t)i0 * D, D, 1, vt, Tp, 1.0f, 0, dsi, Tp,
                            rows);                                                /* dP = dO V^T */
            for (int r = 0; r < rows; r++) {
                float *dr = dsi + (size_t)r * Tp;
                for (int j = keys; j < T; j++) dr[j] = 0.0f;  /* unseen keys: p = 0 there */
                dt__softmax_row_backward(dr, p + (size_t)(i0 + r) * T, T, scale);
            }
            dt__att_product(hd / DT_VL, keys, dsi, Tp, 1, k, 3 * D, 1.0f, add, dq + (size_t)i0 * 3 * D, 3 * D,
                            rows);                                                /* dQ += dS K */
        }
        for (int j0 = 0; j0 < T; j0 += R) {           /* by key rows: dV and dK (causal: from query j0 on) */
            int rows = T - j0 < R ? T - j0 : R, from = causal ? j0 : 0;
            dt__att_product(hd / DT_VL, T - from, p + (size_t)from * T + j0, 1, T, dO + (size_t)from * D, D, 1.0f,
                            add, dv + (size_t)j0 * 3 * D, 3 * D, rows);          /* dV += P^T dO */
            dt__att_product(hd / DT_VL, T - from, ds + (size_t)from * Tp + j0, 1, Tp, q + (size_t)from * 3 * D,
                            3 * D, 1.0f, add, dk + (size_t)j0 * 3 * D, 3 * D, rows);   /* dK += dS^T Q */
        }
    }
}

/* -- the online body: per (sequence, head) and query row, its keys in blocks
      of DT__ONLINE_KEYS; the row's m, l and output accumulate as the
      recurrence says, and the output is divided by l at the end. -- */
#define DT__ONLINE_KEYS 64
#define DT__ONLINE_ROWS DT__ATT_ROWS     /* query rows that share each key block's loads: a tile's */
typedef float dt__online_block[DT__ONLINE_ROWS][DT__ONLINE_KEYS];
/* The block's products, through the tiled body's register-blocked loop
   (dt__att_product) when the head is a whole number of vectors wide, else
   plain loops. Scores: s[r][j] = x_r . k_j * scale for `rows` rows (row r at
   x + r * ld) and the keys j0 .. j0 + n, from K transposed (kt, rows of Tp). */
static void dt__online_scores(const float *x, ptrdiff_t ld, int rows, const float *kt, int Tp, int j0, int n, int hd,
                              float scale, dt__online_block s) {
    if (hd % DT_VL == 0) {
        dt__att_product((n + DT_VL - 1) / DT_VL, hd, x, ld, 1, kt + j0, Tp, scale, 0, &s[0][0], DT__ONLINE_KEYS, rows);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n; j++) {
            float dot = 0;
            for (int d = 0; d < hd; d++) dot += x[(size_t)r * ld + d] * kt[(size_t)d * Tp + j0 + j];
            s[r][j] = dot * scale;
        }
}
/* c_r += sum_j a[r][j] y_j (row r of c at c + r * ldc, y_j at y + j * ldy): P V, dS K */
static void dt__online_rows_times(const dt__online_block a, int rows, int n, const float *y, ptrdiff_t ldy, float *c,
                                  ptrdiff_t ldc, int hd) {
    if (hd % DT_VL == 0) { dt__att_product(hd / DT_VL, n, &a[0][0], DT__ONLINE_KEYS, 1, y, ldy, 1.0f, 1, c, ldc, rows); return; }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n; j++)
            for (int d = 0; d < hd; d++) c[(size_t)r * ldc + d] += a[r][j] * y[(size_t)j * ldy + d];
}
/* c_j += sum_r a[r][j] x_r for the block's keys j < n (x_r at x + r * ldx): dS^T Q, P^T dO */
static void dt__online_keys_times(const dt__online_block a, int rows, int n, const float *x, ptrdiff_t ldx, float *c,
                                  ptrdiff_t ldc, int hd) {
    for (int j0 = 0; j0 < n && hd % DT_VL == 0; j0 += DT__ATT_ROWS)
        dt__att_product(hd / DT_VL, rows, &a[0][j0], 1, DT__ONLINE_KEYS, x, ldx, 1.0f, 1, c + (size_t)j0 * ldc, ldc,
                        n - j0 < DT__ATT_ROWS ? n - j0 : DT__ATT_ROWS);
    if (hd % DT_VL == 0) return;
    for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++)
            for (int d = 0; d < hd; d++) c[(size_t)j * ldc + d] += a[r][j] * x[(size_t)r * ldx + d];
}
/* One head of one sequence, the unit every online body works on: Tq query
   rows (row i at q + i * ldq) against Tk keys (K transposed in kt, rows of
   Tp; V transposed in vt; key j's rows of K and V at k, v + j * ldkv). The
   tokens' positions ascend (qpos, kpos; NULL: 0, 1, 2, ...), and a causal
   row sees the keys at its position and before. On one device the queries
   and keys are the same tokens; under context parallelism the keys are the
   block the ring brought (dt_ring_attention): the same loops. */
typedef struct dt__online_head {
    const float *q, *kt, *vt, *k, *v, *qpos, *kpos;
    ptrdiff_t ldq, ldkv;
    int Tq, Tk, Tp, hd, causal;
    float scale;
} dt__online_head;
static int dt__online_visible(const dt__online_head *a, int i) {
    if (!a->causal) return a->Tk;
    float p = a->qpos ? a->qpos[i] : (float)i;
    int lo = 0, hi = a->Tk;
    if (!a->kpos) return p + 1 < 0 ? 0 : p + 1 < hi ? (int)p + 1 : hi;
    while (lo < hi) {                                    /* the keys at p and before */
        int mid = (lo + hi) / 2;
        if (a->kpos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
/* Each row's largest score m, sum l and unnormalised output acc (row i at
   acc + i * ldacc) move on by the keys it sees, a tile of rows against
   DT__ONLINE_KEYS keys at a time; a tile of keys none of its rows sees is
   skipped. Returns the score products made (the work, counted). */
static int64_t dt__online_forward(const dt__online_head *a, float *m, float *l, float *acc, ptrdiff_t ldacc) {
    int64_t work = 0;
    int hd = a->hd, vis[DT__ONLINE_ROWS];
    dt__online_block s;
    for (int i0 = 0; i0 < a->Tq; i0 += DT__ONLINE_ROWS) {
        int rows = a->Tq - i0 < DT__ONLINE_ROWS ? a->Tq - i0 : DT__ONLINE_ROWS, keys = 0;
        for (int r = 0; r < rows; r++) keys = (vis[r] = dt__online_visible(a, i0 + r)) > keys ? vis[r] : keys;
        for (int j0 = 0; j0 < keys; j0 += DT__ONLINE_KEYS) {
            int n = keys - j0 < DT__ONLINE_KEYS ? keys - j0 : DT__ONLINE_KEYS;
            dt__online_scores(a->q + (size_t)i0 * a->ldq, a->ldq, rows, a->kt, a->Tp, j0, n, hd, a->scale, s);
            for (int r = 0; r < rows; r++) {
                int i = i0 + r, valid = vis[r] - j0 < 0 ? 0 : vis[r] - j0 < n ? vis[r] - j0 : n;
                float block_max = -INFINITY, *ar = acc + (size_t)i * ldacc;
                for (int j = 0; j < valid; j++) block_max = s[r][j] > block_max ? s[r][j] : block_max;
                if (valid > 0) {
                    float c = dt_online_softmax_rescale(&m[i], block_max);   /* what came before, on the new scale */
                    l[i] *= c;
                    for (int d = 0; d < hd; d++) ar[d] *= c;
                }
                for (int j = 0; j < valid; j++) s[r][j] = dt_exp_value(s[r][j] - m[i]);   /* unnormalised */
                for (int j = valid; j < n; j++) s[r][j] = 0.0f;                           /* past the row */
                for (int j = 0; j < valid; j++) l[i] += s[r][j];
                work += valid;
            }
            dt__online_rows_times(s, rows, n, a->v + (size_t)j0 * a->ldkv, a->ldkv, acc + (size_t)i0 * ldacc, ldacc, hd);  /* acc += P V */
        }
    }
    return work;
}
/* When every key has been seen: the output (acc / l, into acc and out, row i
   at + i * ld) and m becomes the row's log-sum-exp, all backward keeps. */
static void dt__online_finish(int Tq, int hd, float *m, const float *l, float *acc, ptrdiff_t ldacc, float *out, ptrdiff_t ldout) {
    for (int i = 0; i < Tq; i++) {
        float *ai = acc + (size_t)i * ldacc, *o = out + (size_t)i * ldout;
        for (int d = 0; d < hd; d++) o[d] = ai[d] = ai[d] / l[i];
        m[i] += logf(l[i]);                                   /* p = exp(s - lse) */
    }
}
/* Backward against the keys: each probability made again, p = exp(s - lse);
   dS = p (dP - <dO, O>) scale as the softmax's backward (dP = dO . v_j, from
   V transposed as the scores from K's), and dQ += dS K (row i at dq + i *
   ldq), dK += dS^T Q, dV += P^T dO (key j at dk, dv + j * ldkv); dO and O
   row i at + i * ldo. Returns the score products made. */
static int64_t dt__online_backward(const dt__online_head *a, const float *dO, const float *O, ptrdiff_t ldo, const float *lse,
                                   float *dq, float *dk, float *dv) {
    int64_t work = 0;
    int hd = a->hd, vis[DT__ONLINE_ROWS];
    dt__online_block p, ds;
    float Di[DT__ONLINE_ROWS];
    for (int i0 = 0; i0 < a->Tq; i0 += DT__ONLINE_ROWS) {
        int rows = a->Tq - i0 < DT__ONLINE_ROWS ? a->Tq - i0 : DT__ONLINE_ROWS, keys = 0;
        const float *qi = a->q + (size_t)i0 * a->ldq, *dOi = dO + (size_t)i0 * ldo;   /* row r: + r * ld */
        for (int r = 0; r < rows; r++) {
            const float *Or = O + (size_t)(i0 + r) * ldo, *dOr = dOi + (size_t)r * ldo;
            keys = (vis[r] = dt__online_visible(a, i0 + r)) > keys ? vis[r] : keys;
            Di[r] = 0;
            for (int d = 0; d < hd; d++) Di[r] += dOr[d] * Or[d];
        }
        for (int j0 = 0; j0 < keys; j0 += DT__ONLINE_KEYS) {
            int n = keys - j0 < DT__ONLINE_KEYS ? keys - j0 : DT__ONLINE_KEYS;
            dt__online_scores(qi, a->ldq, rows, a->kt, a->Tp, j0, n, hd, a->scale, p);
            dt__online_scores(dOi, ldo, rows, a->vt, a->Tp, j0, n, hd, 1.0f, ds);          /* dP = dO . v_j */
            for (int r = 0; r < rows; r++) {
                int valid = vis[r] - j0 < 0 ? 0 : vis[r] - j0 < n ? vis[r] - j0 : n;
                float L = lse[i0 + r];
                for (int j = 0; j < valid; j++) p[r][j] = dt_exp_value(p[r][j] - L);
                for (int j = valid; j < n; j++) p[r][j] = 0.0f;
                for (int j = 0; j < n; j++) ds[r][j] = p[r][j] * (ds[r][j] - Di[r]) * a->scale;
                work += valid;
            }
            dt__online_rows_times(ds, rows, n, a->k + (size_t)j0 * a->ldkv, a->ldkv, dq + (size_t)i0 * a->ldq, a->ldq, hd);
            dt__online_keys_times(ds, rows, n, qi, a->ldq, dk + (size_t)j0 * a->ldkv, a->ldkv, hd);
            dt__online_keys_times(p, rows, n, dOi, ldo, dv + (size_t)j0 * a->ldkv, a->ldkv, hd);
        }
    }
    return work;
}
/* saved: each row's log-sum-exp [B*H*T], then the output in f32 [B*T, D],
   which backward needs for <dO, O> (the matmul body's <dP, P>). */
static void dt__attention_forward_online(const float *qkvv, float *outv, float *saved, int B, int T, int H, int D,
                                         float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    float *lse = saved, *O = saved + (size_t)B * H * T;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)(hd * Tp + T) * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd;
        float *kt = space + (size_t)(hd * Tp + T) * (size_t)dt__thread_num(), *l = kt + (size_t)hd * Tp;
        float *m = lse + (size_t)bh * T, *acc = O + (size_t)b * T * D + h * hd;   /* row i: + i * D */
        dt__online_head a = { q, kt, NULL, NULL, q + 2 * D, NULL, NULL, 3 * D, 3 * D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(q + D, 3 * D, T, hd, kt, Tp);
        for (int i = 0; i < T; i++) {
            m[i] = -INFINITY; l[i] = 0;
            for (int d = 0; d < hd; d++) acc[(size_t)i * D + d] = 0;
        }
        dt__online_forward(&a, m, l, acc, D);
        dt__online_finish(T, hd, m, l, acc, D, outv + (size_t)b * T * D + h * hd, D);
    }
}
static void dt__attention_backward_online(const float *qkvv, const float *saved, const float *dout, float *dqkv, int add,
                                          int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    const float *lse = saved, *O = saved + (size_t)B * H * T;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)hd * Tp * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;                /* this head's rows of [B*T, D] (+ i * D) */
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *kt = space + 2 * (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { q, kt, kt + (size_t)hd * Tp, q + D, q + 2 * D, NULL, NULL, 3 * D, 3 * D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(q + D, 3 * D, T, hd, kt, Tp);
        dt__att_transpose(q + 2 * D, 3 * D, T, hd, kt + (size_t)hd * Tp, Tp);
        for (int i = 0; i < T && !add; i++)               /* written first: this head's columns start at 0 */
            for (int d = 0; d < hd; d++) dq[(size_t)i * 3 * D + d] = dq[(size_t)i * 3 * D + D + d] = dq[(size_t)i * 3 * D + 2 * D + d] = 0;
        dt__online_backward(&a, dout + at, O + at, D, lse + (size_t)bh * T, dq, dq + D, dq + 2 * D);
    }
}
static void dt__attention_backward(dt__tape_entry *e) {
    dt_tensor *qkv = e->in[0];
    if (!qkv->requires_grad) return;
    int B = e->iarg[0], T = e->iarg[1], H = e->iarg[2], causal = e->iarg[3] & 1, online = e->iarg[3] >> 1;
    int D = (int)dt_tensor_cols(e->out);
    float scale = e->farg[0];
    const float *P = (const float *)e->saved, *dout = dt__grad_in(e->out), *qkvv = dt__in(qkv);
    int first;
    float *dqkv = dt__grad_acc_first(qkv, &first);
    const dt_backend *gpu = dt__backend_for(qkv);
    dt__ctx.flops += 8.0 * B * H * T * T * (D / H);
    if (gpu) {
        float *scratch = (float *)dt__scratch_on(qkv->device, sizeof(float) * (size_t)(online ? (int64_t)B * H * T
                                                                                   : DT_ATTENTION_SCRATCH_FLOATS(B, T, H, D)));
        if (online) gpu->attention_backward_online(qkvv, P, dout, dqkv, scratch, B, T, H, D, scale, causal);
        else gpu->attention_backward(P, dout, dqkv, scratch, B, T, H, D, scale);
    } else if (online)
        dt__attention_backward_online(qkvv, P, dout, dqkv, !first, B, T, H, D, scale, causal);
    else if (dt__attention_tiled(D / H))                           /* each element is one product's: */
        dt__attention_backward_tiles(qkvv, P, dout, dqkv, !first, B, T, H, D, scale, causal);   /* written first */
    else
        dt__attention_backward_gemm(qkvv, P, dout, dqkv, first ? 0.0f : 1.0f, B, T, H, D, scale);
    dt__grad_acc_done(qkv, dqkv);
}
dt_tensor *dt_attention(dt_tensor *qkv, int B, int T, int H, int causal) {
    int D = (int)dt_tensor_cols(qkv) / 3;
    if (dt_tensor_cols(qkv) != 3 * D || D % H != 0 || dt_tensor_rows(qkv) != (int64_t)B * T)
        dt_fail("attention: qkv is [%lld, %lld], expected [%d, 3*D] with D divisible by %d heads",
                (long long)dt_tensor_rows(qkv), (long long)dt_tensor_cols(qkv), B * T, H);
    if (dt__seq_split.ring) {                      /* this rank's tokens: the keys go around the ring */
        if (T != dt__seq_split.T) dt_fail("attention of %d tokens a sequence, where this rank holds %d of each", T, dt__seq_split.T);
        return dt_ring_attention(qkv, B, T, H, causal, dt__seq_split.positions, dt__seq_split.ring);
    }
    int hd = D / H;
    float scale = 1.0f / sqrtf((float)hd);
    const dt_backend *gpu = dt__backend_for(qkv);
    int online = dt__attention_body == DT_ATTENTION_ONLINE;
    if (gpu && online && hd > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_usage_error("--attention online: heads of %d columns; the GPU's online kernel takes at most %d (leave --attention out)",
                       hd, DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    dt__scratch_reset();
    dt_tensor *out = dt__tensor_out_2d(B * T, D);
    /* the probabilities stay f32 (softmax in f32 under mixed precision too); the online body keeps a row's log-sum-exp */
    float *P = (float *)dt__step_data(sizeof(float) * (size_t)(online ? (int64_t)B * H * T + (int64_t)B * T * D
                                                               : gpu ? DT_ATTENTION_SAVED_FLOATS(B, T, H, D)
                                                                     : (int64_t)B * H * T * T));
    const float *qkvv = dt__in(qkv);
    float *outv = dt__out(out);
    if (gpu && online) gpu->attention_forward_online(qkvv, outv, P, B, T, H, D, scale, causal);
    else if (gpu) gpu->attention_forward(qkvv, outv, P, B, T, H, D, scale, causal);
    else if (online) dt__attention_forward_online(qkvv, outv, P, B, T, H, D, scale, causal);
    else if (dt__attention_tiled(hd)) dt__attention_forward_tiles(qkvv, outv, P, B, T, H, D, scale, causal);
    else dt__attention_forward_gemm(qkvv, outv, P, B, T, H, D, scale, causal);
    dt__out_done(out, outv);
    dt__ctx.flops += 4.0 * B * H * T * T * hd;
    if (dt__wants_grad(qkv, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__attention_backward, out, qkv, NULL, NULL);
        e->iarg[0] = B; e->iarg[1] = T; e->iarg[2] = H; e->iarg[3] = (causal != 0) | online << 1; e->farg[0] = scale;
        e->saved = P;
    }
    return out;
}

/* -- rotary embeddings and grouped-query attention (Llama's): what q, k and v
      go through before dt_attention. A position is not added to the input,
      as GPT-2's table is; each (q, k) pair of a head is turned instead, pair
      (j, j + hd/2) by the angle t * theta^(-2j/hd), so that q_t . k_s depends
      on t - s only. The angles are Hugging Face's: the frequency and the
      product in float, as their float32 tensors make them. Grouped-query
      attention keeps KV < H key/value heads; each serves H/KV query heads
      (repeated here, as Hugging Face's eager attention does, so dt_attention
      is the GPT's, unchanged). Backward turns the gradient back and adds a
      group's heads into its key/value head, in head order. -- */
/* (cos, sin) per position and pair, made on the host once per step and shape
   (every layer reads the same) and kept in the step arena for backward. */
static int dt__rope_same(dt_rope a, dt_rope b) {
    return a.theta == b.theta && a.factor == b.factor && a.low_freq == b.low_freq && a.high_freq == b.high_freq &&
           a.original_context == b.original_context;
}
static float *dt__rope_table(int T, int hd, dt_rope rope, dt_device device) {
    const int32_t *at = dt__seq_split.positions;       /* a rank's share of the sequence: its tokens' angles, not kept */
    if (!at && dt__ctx.rope.cs && dt__ctx.rope.made_at == dt__ctx.arena_rewinds && dt__ctx.rope.T == T && dt__ctx.rope.hd == hd &&
        dt__rope_same(dt__ctx.rope.rope, rope) && dt__ctx.rope.device == device)
        return dt__ctx.rope.cs;
    int half = hd / 2;
    size_t bytes = sizeof(float) * (size_t)T * hd;
    float *host = (float *)dt__step_alloc_uninit(bytes), *inv = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)half);
    for (int j = 0; j < half; j++) {
        inv[j] = 1.0f / powf(rope.theta, (float)(2 * j) / (float)hd);
        if (rope.factor > 0) {                   /* Llama 3: a wavelength against the original context, in float */
            float wavelen = (float)(2 * 3.14159265358979323846) / inv[j], context = (float)rope.original_context;
            float low_wavelen = context / rope.low_freq, high_wavelen = context / rope.high_freq;
            if (wavelen > low_wavelen) inv[j] /= rope.factor;
            else if (!(wavelen < high_wavelen)) {
                float smooth = (context / wavelen - rope.low_freq) / (rope.high_freq - rope.low_freq);
                inv[j] = (1 - smooth) * inv[j] / rope.factor + smooth * inv[j];
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++) {
            float angle = (float)(at ? at[t] : t) * inv[j];
            host[(size_t)t * hd + 2 * j] = (float)cos((double)angle);
            host[(size_t)t * hd + 2 * j + 1] = (float)sin((double)angle);
        }
    float *cs = host;
    if (device != DT_CPU) {
        cs = (float *)dt__step_alloc_on(device, bytes);
        dt__upload_to(device, cs, host, bytes);
    }
    if (at) return cs;
    dt__ctx.rope.made_at = dt__ctx.arena_rewinds; dt__ctx.rope.T = T; dt__ctx.rope.hd = hd; dt__ctx.rope.rope = rope;
    dt__ctx.rope.device = device; dt__ctx.rope.cs = cs;
    return cs;
}
static void dt__rotary_qkv_backward(dt__tape_entry *e) {
    dt_tensor *q = e->in[0], *k = e->in[1], *v = e->in[2];
    int T = e->iarg[0], H = e->iarg[1], KV = e->iarg[2], BT = (int)dt_tensor_rows(q), hd = (int)dt_tensor_cols(q) / H;
    int half = hd / 2, D = H * hd, group = H / KV;
    const float *cs = (const float *)e->saved, *dy = dt__grad_in(e->out);
    float *dq = q->requires_grad ? dt__grad_acc(q) : NULL, *dk = k->requires_grad ? dt__grad_acc(k) : NULL;
    float *dv = v->requires_grad ? dt__grad_acc(v) : NULL;
    const dt_backend *gpu = dt__backend_for(q);
    if (gpu) gpu->rotary_qkv_backward(cs, dy, dq, dk, dv, BT, T, H, KV, hd);
    else {
        DT_OMP("omp parallel for if((int64_t)BT * D > 32768)")
        for (int r = 0; r < BT; r++) {
            const float *row = dy + (size_t)r * 3 * D, *c = cs + (size_t)(r % T) * hd;
            for (int h = 0; h < H; h++) {
                const float *gq = row + h * hd, *gk = row + D + h * hd, *gv = row + 2 * D + h * hd;
                float *oq = dq ? dq + (size_t)r * D + h * hd : NULL;
                float *ok = dk ? dk + ((size_t)r * KV + h / group) * hd : NULL, *ov = dv ? dv + ((size_t)r * KV + h / group) * hd : NULL;
                for (int j = 0; j < half; j++) {        /* the turn by -angle */
                    float co = c[2 * j], si = c[2 * j + 1];
                    if (oq) { oq[j] += gq[j] * co + gq[j + half] * si; oq[j + half] += gq[j + half] * co - gq[j] * si; }
                    if (ok) { ok[j] += gk[j] * co + gk[j + half] * si; ok[j + half] += gk[j + half] * co - gk[j] * si; }
                }
                if (ov) for (int j = 0; j < hd; j++) ov[j] += gv[j];
            }
        }
    }
    if (dq) dt__grad_acc_done(q, dq);
    if (dk) dt__grad_acc_done(k, dk);
    if (dv) dt__grad_acc_done(v, dv);
}
dt_tensor *dt_rotary_qkv(dt_tensor *q, dt_tensor *k, dt_tensor *v, int B, int T, int H, int KV, dt_rope rope) {
    int BT = B * T;
    if (H < 1 || KV < 1 || H % KV || dt_tensor_cols(q) % H || (dt_tensor_cols(q) / H) % 2)
        dt_fail("rotary_qkv: %d query heads of q's %lld columns in %d key/value groups (heads a multiple of groups, an even head width)",
                H, (long long)dt_tensor_cols(q), KV);
    int hd = (int)dt_tensor_cols(q) / H, half = hd / 2, D = H * hd;
    if (dt_tensor_rows(q) != BT || dt_tensor_rows(k) != BT || dt_tensor_rows(v) != BT || dt_tensor_cols(k) != (int64_t)KV * hd ||
        dt_tensor_cols(v) != (int64_t)KV * hd)
        dt_fail("rotary_qkv: q [%lld, %lld], k [%lld, %lld], v [%lld, %lld]; expected [%d, %d] and [%d, %d] twice", (long long)dt_tensor_rows(q),
                (long long)dt_tensor_cols(q), (long long)dt_tensor_rows(k), (long long)dt_tensor_cols(k), (long long)dt_tensor_rows(v),
                (long long)dt_tensor_cols(v), BT, D, BT, KV * hd);
    const dt_backend *gpu = dt__backend_for(q);
    dt__backend_for(k);
    dt__backend_for(v);
    if (!(rope.theta > 1) || (rope.factor != 0 && !(rope.factor > 0 && rope.low_freq > 0 && rope.high_freq > rope.low_freq &&
                                                     rope.original_context > 0)))
        dt_fail("rotary_qkv: base %g, rescaling factor %g, low %g, high %g, original context %d (a base above 1; a factor of 0, "
                "or positive with 0 < low < high and a positive context)", (double)rope.theta, (double)rope.factor,
                (double)rope.low_freq, (double)rope.high_freq, rope.original_context);
    float *cs = dt__rope_table(T, hd, rope, q->device);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(BT, 3 * D);
    const float *qv = dt__in(q), *kv = dt__in(k), *vv = dt__in(v);
    float *yv = dt__out(y);
    if (gpu) gpu->rotary_qkv_forward(qv, kv, vv, cs, yv, BT, T, H, KV, hd);
    else {
        int group = H / KV;
        DT_OMP("omp parallel for if((int64_t)BT * D > 32768)")
        for (int r = 0; r < BT; r++) {
            float *row = yv + (size_t)r * 3 * D;
            const float *c = cs + (size_t)(r % T) * hd;
            for (int h = 0; h < H; h++) {
                const float *sq = qv + (size_t)r * D + h * hd, *sk = kv + ((size_t)r * KV + h / group) * hd;
                const float *sv = vv + ((size_t)r * KV + h / group) * hd;
                float *oq = row + h * hd, *ok = row + D + h * hd, *ov = row + 2 * D + h * hd;
                for (int j = 0; j < half; j++) {        /* x cos + rotate_half(x) sin */
                    float co = c[2 * j], si = c[2 * j + 1];
                    oq[j] = sq[j] * co - sq[j + half] * si;
                    oq[j + half] = sq[j + half] * co + sq[j] * si;
                    ok[j] = sk[j] * co - sk[j + half] * si;
                    ok[j + half] = sk[j + half] * co + sk[j] * si;
                }
                memcpy(ov, sv, sizeof(float) * (size_t)hd);
            }
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(q, k, v)) {
        dt__tape_entry *e = dt__tape_push(dt__rotary_qkv_backward, y, q, k, v);
        e->iarg[0] = T; e->iarg[1] = H; e->iarg[2] = KV;
        e->saved = cs;
    }
    return y;
}

/* -- token embedding: a language model's input. A lookup, not a matmul: row
      (b, t) copies the token's row of wte and adds position t's row of wpe.
      Its backward adds each row's gradient back into the token's row, so a
      token seen twice collects both; it walks the rows in order, and each
      thread owns a band of columns, so sums never race and always run in the
      same order (the GPU's body too). The forward checked every id. -- */
static int dt__token_id(float v, int vocab) {
    int id = (int)v;
    if (!(v >= 0) || id >= vocab || (float)id != v) dt_fail("token id %g is outside the vocabulary [0, %d)", v, vocab);
    return id;
}
/* The GPU adds up a token's rows without atomics (which would sum in a
   different order every run): the host, which can read the ids, groups the
   rows by token with a counting sort -- stable, so each group keeps its rows in
   the CPU's order -- and the GPU gives a thread to each (token, column). The
   list goes to the device in the step arena (see the backend's comment). */
static const int32_t *dt__rows_by_token(const dt_tensor *tokens, int from, int vocab, int *groups) {
    int BT = (int)tokens->numel, G = 0;
    float *ids = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)BT);
    int32_t *first = (int32_t *)dt_step_alloc(sizeof(int32_t) * ((size_t)vocab + 1));
    int32_t *list = (int32_t *)dt_step_alloc(sizeof(int32_t) * (3 * (size_t)BT + 1));
    dt_tensor_to_host(tokens, ids);
    /* wte's rows are tokens from .. from + vocab - 1 (all of them, unless the
       vocabulary is split over ranks): the other rows add nothing here */
    for (int r = 0; r < BT; r++) {
        int id = (int)ids[r] - from;
        if (id >= 0 && id < vocab) first[id + 1]++;
    }
    for (int v = 0; v < vocab; v++) {
        if (first[v + 1]) G++;
        first[v + 1] += first[v];               /* where token v's rows begin */
    }
    int32_t *order = list, *start = list + BT, *token = start + G + 1;
    for (int v = 0, g = 0; v < vocab; v++)
        if (first[v + 1] > first[v]) { start[g] = first[v]; token[g++] = v; }
    start[G] = first[vocab];
    for (int r = 0; r < BT; r++) {
        int id = (int)ids[r] - from;
        if (id >= 0 && id < vocab) order[first[id]++] = r;
    }
    size_t bytes = sizeof(int32_t) * ((size_t)BT + 2 * (size_t)G + 1);
    int32_t *dev = (int32_t *)dt__step_alloc_on(tokens->device, bytes);
    dt__upload_to(tokens->device, dev, list, bytes);
    *groups = G;
    return dev;
}
static void dt__token_embedding_backward(dt__tape_entry *e) {
    const dt_tensor *tokens = (const dt_tensor *)e->saved;
    dt_tensor *wte = e->in[0], *wpe = e->in[1];
    int BT = (int)dt_tensor_rows(e->out), D = (int)dt_tensor_cols(e->out), T = e->iarg[0], from = e->iarg[1];
    int V = (int)dt_tensor_rows(wte);
    const float *dy = dt__grad_in(e->out);
    float *dwte = wte->requires_grad ? dt__grad_acc(wte) : NULL, *dwpe = wpe && wpe->requires_grad ? dt__grad_acc(wpe) : NULL;
    const dt_backend *gpu = dt__backend_for(e->out);
    if (gpu) {
        int groups = 0;
        const int32_t *by_token = dt__rows_by_token(tokens, from, V, &groups);
        gpu->token_embedding_backward(by_token, groups, dy, dwte, dwpe, BT, T, D);
    } else {
        DT_OMP("omp parallel for schedule(static) if(BT * D > 65536)")
        for (int j0 = 0; j0 < D; j0 += 16) {
            int j1 = j0 + 16 < D ? j0 + 16 : D;
            for (int r = 0; r < BT; r++) {
                const float *g = dy + (size_t)r * D;
                int id = (int)tokens->data[r] - from;
                if (dwte && id >= 0 && id < V) { float *w = dwte + (size_t)id * D; for (int j = j0; j < j1; j++) w[j] += g[j]; }
                if (dwpe) { float *p = dwpe + (size_t)(r % T) * D; for (int j = j0; j < j1; j++) p[j] += g[j]; }
            }
        }
    }
    if (dwte) dt__grad_acc_done(wte, dwte);
    if (dwpe) dt__grad_acc_done(wpe, dwpe);
}
/* wte holds the rows of tokens `from` .. from + rows - 1 of a vocabulary of
   `vocab`: all of them, or (stage 06) one rank's share, the other tokens'
   rows left zero, for the group's sum to fill. */
static dt_tensor *dt__token_embedding_rows(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe, int from, int vocab) {
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), D = (int)dt_tensor_cols(wte), V = (int)dt_tensor_rows(wte);
    if (tokens->dtype != DT_F32) dt_fail("token embedding: the token ids must be f32 whole numbers");
    if (wpe && (dt_tensor_cols(wpe) != D || dt_tensor_rows(wpe) < T))
        dt_fail("token embedding: %d positions of width %d need %s of at least [%d, %d], it is [%lld, %lld]", T, D,
                wpe->name ? wpe->name : "the position embedding", T, D, (long long)dt_tensor_rows(wpe),
                (long long)dt_tensor_cols(wpe));
    const dt_backend *gpu = dt__backend_for(wte);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * T, D);
    const float *wv = dt__in(wte), *pv = wpe ? dt__in(wpe) : NULL;
    float *yv = dt__out(y);
    if (gpu) gpu->token_embedding_forward(tokens->data, wv, pv, yv, B * T, T, D, from, V);
    else
        for (int r = 0; r < B * T; r++) {
            int id = dt__token_id(tokens->data[r], vocab) - from;
            if (id < 0 || id >= V) {                 /* another rank's token */
                if (pv) memcpy(yv + (size_t)r * D, pv + (size_t)(r % T) * D, sizeof(float) * (size_t)D);
                else memset(yv + (size_t)r * D, 0, sizeof(float) * (size_t)D);
                continue;
            }
            const float *w = wv + (size_t)id * D;
            if (pv) {
                const float *p = pv + (size_t)(r % T) * D;
                for (int j = 0; j < D; j++) yv[(size_t)r * D + j] = w[j] + p[j];
            } else memcpy(yv + (size_t)r * D, w, sizeof(float) * (size_t)D);
        }
    dt__out_done(y, yv);
    if (dt__wants_grad(wte, wpe, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__token_embedding_backward, y, wte, wpe, NULL);
        e->iarg[0] = T;
        e->iarg[1] = from;
        e->saved = (void *)tokens;
    }
    return y;
}
dt_tensor *dt_token_embedding(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe) {
    if (wpe && dt__seq_split.positions) {          /* a rank's share of each sequence: wpe's rows at its positions */
        int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), shape[2] = { B, T };
        float *at = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
        for (int r = 0; r < B * T; r++) at[r] = (float)dt__seq_split.positions[r % T];
        return dt_add(dt__token_embedding_rows(tokens, wte, NULL, 0, (int)dt_tensor_rows(wte)),
                      dt__token_embedding_rows(dt_tensor_from_host(2, shape, at), wpe, NULL, 0, (int)dt_tensor_rows(wpe)));
    }
    return dt__token_embedding_rows(tokens, wte, wpe, 0, (int)dt_tensor_rows(wte));
}

/* -- ViT token assembly: [class token; patch embeddings] + position embedding -- */
static void dt__vit_tokens_backward(dt__tape_entry *e) {
    dt_tensor *patches = e->in[0], *cls = e->in[1], *pos = e->in[2];
    int B = e->iarg[0], P = e->iarg[1], D = e->iarg[2], T = P + 1;
    const float *dy = dt__grad_in(e->out);
    float *dpatch = patches->requires_grad ? dt__grad_acc(patches) : NULL;
    float *dcls = cls->requires_grad ? dt__grad_acc(cls) : NULL, *dpos = pos->requires_grad ? dt__grad_acc(pos) : NULL;
    const dt_backend *gpu = dt__backend_for(patches);
    if (gpu) gpu->vit_tokens_backward(dy, dpatch, dcls, dpos, B, P, D);
    else
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *g = dy + ((size_t)b * T + t) * D;
                if (dpos) for (int j = 0; j < D; j++) dpos[(size_t)t * D + j] += g[j];
                if (t == 0) { if (dcls) for (int j = 0; j < D; j++) dcls[j] += g[j]; }
                else if (dpatch) for (int j = 0; j < D; j++) dpatch[((size_t)b * P + t - 1) * D + j] += g[j];
            }
    if (dpatch) dt__grad_acc_done(patches, dpatch);
    if (dcls) dt__grad_acc_done(cls, dcls);
    if (dpos) dt__grad_acc_done(pos, dpos);
}
dt_tensor *dt_vit_tokens(dt_tensor *patches, dt_tensor *cls, dt_tensor *pos, int B) {
    int D = (int)dt_tensor_cols(patches), P = (int)(dt_tensor_rows(patches) / B), T = P + 1;
    if (pos->numel != (int64_t)T * D || cls->numel != D)
        dt_fail("vit tokens: %d patches of %d need pos_embed of %d x %d", P, D, T, D);
    const dt_backend *gpu = dt__backend_for(patches);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * T, D);
    const float *pv = dt__in(patches), *cv = dt__in(cls), *posv = dt__in(pos);
    float *yv = dt__out(y);
    if (gpu) gpu->vit_tokens_forward(pv, cv, posv, yv, B, P, D);
    else
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                float *o = yv + ((size_t)b * T + t) * D;
                const float *src = t == 0 ? cv : pv + ((size_t)b * P + t - 1) * D;
                for (int j = 0; j < D; j++) o[j] = src[j] + posv[(size_t)t * D + j];
            }
    dt__out_done(y, yv);
    if (dt__wants_grad(patches, cls, pos)) {
        dt__tape_entry *e = dt__tape_push(dt__vit_tokens_backward, y, patches, cls, pos);
        e->iarg[0] = B; e->iarg[1] = P; e->iarg[2] = D;
    }
    return y;
}

/* -- pick one token per sequence (the class token feeds the head) -- */
static void dt__select_token_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    int B = e->iarg[0], T = e->iarg[1], idx = e->iarg[2], D = (int)dt_tensor_cols(x);
    float *dx = dt__grad_acc(x);
    const float *dy = dt__grad_in(e->out);
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->select_token_backward(dy, dx, B, T, idx, D);
    else
        for (int b = 0; b < B; b++)
            for (int j = 0; j < D; j++) dx[((size_t)b * T + idx) * D + j] += dy[(size_t)b * D + j];
    dt__grad_acc_done(x, dx);
}
dt_tensor *dt_select_token(dt_tensor *x, int B, int T, int index) {
    int D = (int)dt_tensor_cols(x);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B, D);
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    if (gpu) gpu->select_token_forward(xv, yv, B, T, index, D);
    else
        for (int b = 0; b < B; b++)
            memcpy(yv + (size_t)b * D, xv + ((size_t)b * T + index) * D, sizeof(float) * D);
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__select_token_backward, y, x, NULL, NULL);
        e->iarg[0] = B; e->iarg[1] = T; e->iarg[2] = index;
    }
    return y;
}

/* -- softmax cross-entropy, fused (llm.c's fused classifier is the model):
      forward reads the logits once for each row's largest value m and the
      sum l of exp(x - m), and keeps those two numbers a row, not the
      probabilities (at GPT-2's 50,257 words and 8,192 rows, 1.6 GB saved);
      backward reads the logits again and writes the gradient (p - onehot) / N
      in the pass that makes each probability again, p = exp(x - m) / l
      (dt_cross_entropy_grad, the GPU's arithmetic too). N is the labels that
      count (or the divisor the run set); a row whose label is ignored gets
      nothing. Labels arrive in host memory; the op checks them there, then
      copies them to the device beside the rows' two numbers. -- */
void dt_cross_entropy_set_divisor(const int32_t *labels, double divisor) {
    if (!(divisor > 0)) dt_fail("dt_cross_entropy_set_divisor: the divisor must be positive (it is %g)", divisor);
    dt__ctx.loss_divisor.step = dt__ctx.step_resets;
    dt__ctx.loss_divisor.labels = labels;
    dt__ctx.loss_divisor.divisor = divisor;
}
/* What the loss keeps for backward, in the step data: each row's 1 / l
   (double: p = exp(x - m) / l then rounds once, as the division would), each
   row's m, then the labels. */
typedef struct { double *inv_l; float *m; int32_t *labels; } dt__xent_rows;
static dt__xent_rows dt__xent_rows_at(void *saved, int B) {
    dt__xent_rows k = { (double *)saved, (float *)((double *)saved + B), NULL };
    k.labels = (int32_t *)(k.m + B);
    return k;
}
static void dt__cross_entropy_backward(dt__tape_entry *e) {
    dt_tensor *logits = e->in[0];
    if (!logits->requires_grad) return;
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits), first;
    dt__xent_rows k = dt__xent_rows_at(e->saved, B);
    const double *inv_l = k.inv_l;
    const float *m = k.m, *x = dt__in(logits);
    const int32_t *labels = k.labels;
    const dt_backend *gpu = dt__backend_for(logits);
    float *dl = dt__grad_acc_first(logits, &first);
    if (gpu) gpu->cross_entropy_backward(x, inv_l, m, labels, e->out->grad, dl, B, C, e->farg[0]);
    else {
        float scale = e->out->grad[0] / e->farg[0];
        DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
        for (int i = 0; i < B; i++) {
            float *d = dl + (size_t)i * C;
            const float *r = x + (size_t)i * C;
            int label = labels[i], mine = label >= 0 && label < C;    /* a split vocabulary: another rank's label is not */
            if (label == DT_IGNORE_INDEX) { if (first) memset(d, 0, sizeof(float) * (size_t)C); continue; }
            float at_label = mine ? (first ? 0.0f : d[label]) + dt_cross_entropy_grad(r[label], m[i], inv_l[i], 1.0f, scale) : 0;
            if (first) for (int j = 0; j < C; j++) d[j] = dt_cross_entropy_grad(r[j], m[i], inv_l[i], 0.0f, scale);
            else for (int j = 0; j < C; j++) d[j] += dt_cross_entropy_grad(r[j], m[i], inv_l[i], 0.0f, scale);  /* it vectorises */
            if (mine) d[label] = at_label;
        }
    }
    dt__grad_acc_done(logits, dl);
}
/* Logits whose columns tensor parallelism split (dt__vocab_head marks them
   with the wrapper): the ranks that hold the columns, or 1. */
static int dt__logits_split(const dt_tensor *logits) {
    return logits->parallel && !logits->is_param ? logits->parallel->tp_size : 1;
}
/* A row's largest value m, and its sum of exp(x - m) in DT_LANES partial sums
   of doubles (a vocabulary of 50,257 terms loses nothing), the exponentials
   made 256 at a time into a buffer so that they vectorise. */
static double dt__row_softmax(const float *r, int C, float *m) {
    double lanes[DT_LANES] = { 0 }, sum = 0;
    float e[256], mx = *m = dt__row_max(r, C);
    for (int j0 = 0; j0 < C; j0 += 256) {
        int n = C - j0 < 256 ? C - j0 : 256;
        for (int j = 0; j < n; j++) e[j] = dt_exp_value(r[j0 + j] - mx);
        DT__LANE_SUM(lanes, n, j, (double)e[j]);
    }
    for (int l = 0; l < DT_LANES; l++) sum += lanes[l];
    return sum;
}
/* The labels' check, and what the summed loss is divided by: the labels
   that count (or the divisor the run set). */
static double dt__loss_divisor(const int32_t *labels, int B, int C) {
    int counted = 0;
    for (int i = 0; i < B; i++) {
        if (labels[i] == DT_IGNORE_INDEX) continue;
        if (labels[i] < 0 || labels[i] >= C) dt_fail("cross entropy: label %d outside [0, %d)", labels[i], C);
        counted++;
    }
    double divisor = counted > 0 ? counted : 1;               /* nothing counted: the loss is 0 */
    if (dt__ctx.loss_divisor.labels == labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        divisor = dt__ctx.loss_divisor.divisor;
    return divisor;
}
static void *dt__cross_entropy_saved(int B) { return dt__step_data((sizeof(double) + sizeof(float) + sizeof(int32_t)) * (size_t)B); }
static dt_tensor *dt__cross_entropy_done(dt_tensor *logits, void *saved, double divisor, dt_tensor *loss) {
    if (dt__wants_grad(logits, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__cross_entropy_backward, loss, logits, NULL, NULL);
        e->saved = saved;
        e->farg[0] = (float)divisor;
    }
    return loss;
}
/* The tensor-parallel chapter's: logits whose vocabulary is split over its group. */
static dt_tensor *dt__cross_entropy_split(dt_tensor *logits, const int32_t *labels);
dt_tensor *dt_cross_entropy(dt_tensor *logits, const int32_t *labels) {
    if (dt__logits_split(logits) > 1) return dt__cross_entropy_split(logits, labels);
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits);
    double divisor = dt__loss_divisor(labels, B, C);
    const dt_backend *gpu = dt__backend_for(logits);
    dt__scratch_reset();
    void *saved = dt__cross_entropy_saved(B);
    dt__xent_rows k = dt__xent_rows_at(saved, B);
    double *inv_l = k.inv_l;
    float *m = k.m;
    int32_t *saved_labels = k.labels;
    int s1[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, s1, DT_F32);        /* the loss is f32, always */
    const float *lv = dt__in(logits);
    if (gpu) {
        gpu->upload(saved_labels, labels, sizeof(int32_t) * B);
        gpu->cross_entropy_forward(lv, saved_labels, inv_l, m, loss->data, B, C, divisor);
    } else {
        /* rows on every thread, the rows' losses added in row order after */
        double *row_loss = (double *)dt__scratch_on(DT_CPU, sizeof(double) * (size_t)B), total = 0;
        DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
        for (int i = 0; i < B; i++) {
            row_loss[i] = inv_l[i] = m[i] = 0;
            if (labels[i] == DT_IGNORE_INDEX) continue;      /* backward never reads its numbers */
            const float *r = lv + (size_t)i * C;
            double sum = dt__row_softmax(r, C, &m[i]);
            inv_l[i] = 1.0 / sum;
            row_loss[i] = -(r[labels[i]] - m[i] - log(sum));
        }
        for (int i = 0; i < B; i++) { total += row_loss[i]; saved_labels[i] = labels[i]; }
        loss->data[0] = (float)(total / divisor);
    }
    return dt__cross_entropy_done(logits, saved, divisor, loss);
}

/* Rows first .. first + rows - 1 of the logits on the host, each the whole
   vocabulary: a split vocabulary's columns of those rows all-gathered from
   the group (a collective of the group), then put side by side. */
static void dt__logits_rows_to_host(const dt_tensor *logits, int64_t first, int64_t rows, float *host) {
    dt_parallel *par = logits->parallel;
    int64_t C = dt_tensor_cols(logits);
    if (dt__logits_split(logits) == 1) {
        float *all = rows == dt_tensor_rows(logits) ? host : (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)logits->numel);
        dt_tensor_to_host(logits, all);
        if (all != host) memcpy(host, all + first * C, sizeof(float) * (size_t)(rows * C));
        return;
    }
    int64_t T = par->tp_size, n = rows * C;
    float *all = (float *)dt__scratch_on(logits->device, sizeof(float) * (size_t)(n * T));
    par->tp_all_gather(par, (const float *)dt__in(logits) + first * C, all, n);
    float *h = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)(n * T));
    dt__download_from(logits->device, h, all, sizeof(float) * (size_t)(n * T));
    for (int64_t r = 0; r < T; r++)
        for (int64_t i = 0; i < rows; i++) memcpy(host + (i * T + r) * C, h + (r * rows + i) * C, sizeof(float) * (size_t)C);
}
void dt_logits_to_host(const dt_tensor *logits, float *host) {
    dt__logits_rows_to_host(logits, 0, dt_tensor_rows(logits), host);
}

dt_tensor *dt_patchify(const dt_tensor *images, int patch) {
    int B = images->shape[0], C = images->shape[1], H = images->shape[2], W = images->shape[3];
    int ph = H / patch, pw = W / patch;
    const dt_backend *gpu = dt__backend_for(images);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * ph * pw, C * patch * patch);
    const float *iv = dt__in(images);
    float *yv = dt__out(y);
    if (gpu) gpu->patchify(iv, yv, B, C, H, W, patch);
    else
        for (int b = 0; b < B; b++)
            for (int py = 0; py < ph; py++)
                for (int px = 0; px < pw; px++) {
                    float *row = yv + ((size_t)(b * ph + py) * pw + px) * C * patch * patch;
                    for (int c = 0; c < C; c++)
                        for (int ky = 0; ky < patch; ky++)
                            memcpy(row + (c * patch + ky) * patch,
                                   iv + (((size_t)b * C + c) * H + py * patch + ky) * W + px * patch, sizeof(float) * patch);
                }
    dt__out_done(y, yv);
    return y;
}

/* [src/07-models.h] */
/* ==== layers and models ======================================================
   A model is a list of named parameters in forward order plus a forward
   function. All parameters sit in one flat buffer (and their gradients in
   another): the optimizer, gradient clipping, DDP's buckets and FSDP's shards
   are then loops over contiguous memory. Names and shapes are PyTorch's, so a
   checkpoint opens in PyTorch as a state_dict. */

typedef struct dt__rng { uint64_t s; } dt__rng;
/* splitmix64: tiny, and good enough for initialisation and shuffling */
static uint64_t dt__rng_u64(dt__rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double dt__rng_uniform(dt__rng *r) { return (dt__rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }
static double dt__rng_normal(dt__rng *r) {
    double u1 = dt__rng_uniform(r), u2 = dt__rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
static uint64_t dt__hash3(uint64_t a, uint64_t b, uint64_t c) {
    dt__rng r = { a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xD1B54A32D192ED03ull ^ c };
    dt__rng_u64(&r);
    return dt__rng_u64(&r);
}

typedef enum { DT_INIT_ZERO, DT_INIT_ONE, DT_INIT_UNIFORM, DT_INIT_NORMAL } dt__init_kind;

typedef struct dt__model_builder {
    dt_model *m;
    int cap;
    dt__init_kind *init;
    float *init_scale;
} dt__model_builder;

static void dt__unit_starts_here(dt__model_builder *mb) { mb->m->unit_first[mb->m->nunits++] = mb->m->nparams; }

static void dt__add_param(dt__model_builder *mb, const char *name, dt__init_kind init, float scale,
                         int ndim, int s0, int s1, int s2, int s3) {
    dt_model *m = mb->m;
    if (m->nparams == mb->cap) {
        mb->cap = mb->cap ? 2 * mb->cap : 64;
        m->params = (dt_tensor *)realloc(m->params, mb->cap * sizeof(dt_tensor));
        mb->init = (dt__init_kind *)realloc(mb->init, mb->cap * sizeof(dt__init_kind));
        mb->init_scale = (float *)realloc(mb->init_scale, mb->cap * sizeof(float));
        m->splits = (dt_split *)realloc(m->splits, mb->cap * sizeof(dt_split));
        if (!m->params || !mb->init || !mb->init_scale || !m->splits) dt_fail("out of memory (model)");
    }
    dt_tensor *t = &m->params[m->nparams];
    memset(t, 0, sizeof *t);
    size_t len = strlen(name) + 1;
    char *copy = (char *)malloc(len);
    if (!copy) dt_fail("out of memory (model)");
    memcpy(copy, name, len);
    t->name = copy;
    t->ndim = ndim;
    int s[4] = { s0, s1, s2, s3 };
    t->numel = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = s[i]; t->numel = dt__size_mul(t->numel, s[i], name); }
    t->requires_grad = 1;
    t->is_param = 1;
    mb->init[m->nparams] = init;
    mb->init_scale[m->nparams] = scale;
    m->splits[m->nparams] = (dt_split){ .dim = -1, .parts = 1, .align = 1 };   /* whole, unless marked below */
    m->nparams++;
}
/* Where tensor parallelism may cut the layer just added (weight, then bias):
   a column-parallel layer along its outputs, weight and bias, in `parts`
   groups of `align`-wide pieces; a row-parallel one along its inputs, its
   bias whole (added once, after the sum). in_out: GPT-2's [in, out] weight. */
static void dt__split_column(dt__model_builder *mb, int in_out, int parts, int align) {
    dt_model *m = mb->m;
    m->splits[m->nparams - 2] = (dt_split){ .dim = in_out ? 1 : 0, .parts = parts, .align = align };
    m->splits[m->nparams - 1] = (dt_split){ .dim = 0, .parts = parts, .align = align };
}
static void dt__split_row(dt__model_builder *mb, int in_out, int align) {
    mb->m->splits[mb->m->nparams - 2] = (dt_split){ .dim = in_out ? 0 : 1, .parts = 1, .align = align };
}
/* The parameters from `first` on are read between dt_sp_split and
   dt_sp_gather (the blocks; every layer of the MLP). */
static void dt__rows_split_from(dt__model_builder *mb, int first) {
    for (int i = first; i < mb->m->nparams; i++) mb->m->splits[i].rows = 1;
}

static void dt__add_linear(dt__model_builder *mb, const char *prefix, int in, int out, dt__init_kind init, float scale) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, init, scale, 2, out, in, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, init == DT_INIT_UNIFORM ? DT_INIT_UNIFORM : DT_INIT_ZERO, scale, 1, out, 0, 0, 0);
}
/* GPT-2's Conv1D: a linear layer whose weight is stored [in, out] */
static void dt__add_conv1d(dt__model_builder *mb, const char *prefix, int in, int out, float scale) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_NORMAL, scale, 2, in, out, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, out, 0, 0, 0);
}
static void dt__add_layernorm(dt__model_builder *mb, const char *prefix, int dim) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_ONE, 0, 1, dim, 0, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, dim, 0, 0, 0);
}

/* Each model family is a row of one table (dt__model_families, below): how
   it names and shapes its parameters, its forward, its one-line description.
   The rest of the library asks the table, so a new family is a new row. */

/* GPT-2 (Hugging Face's): normal(0.02) weights, zero biases, unit LayerNorms;
   the projections that feed the residual stream shrink by 1/sqrt(2 x depth),
   so the sum of 2 x depth of them keeps its size. The outer unit comes first:
   wte and wpe, and ln_f, whose head is wte. */
/* Attention splits the width into heads. */
static void dt__check_heads(const dt_model_config *cfg) {
    if (cfg->heads < 1 || cfg->dim % cfg->heads) dt_fail("--dim %d is not divisible by --heads %d", cfg->dim, cfg->heads);
}
static void dt__gpt_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int D = cfg->dim;
    dt__check_heads(cfg);
    char name[160];
    float proj = 0.02f / sqrtf(2.0f * (cfg->depth > 0 ? cfg->depth : 1));
    mb->m->outer_unit = 0;
    dt__unit_starts_here(mb);
    dt__add_param(mb, "wte.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
    mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1, .tied = 1 };   /* by tokens */
    dt__add_param(mb, "wpe.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->seq_len, D, 0, 0);
    dt__add_layernorm(mb, "ln_f", D);
    mb->m->splits[mb->m->nparams - 2].head = mb->m->splits[mb->m->nparams - 1].head = 1;
    int blocks = mb->m->nparams;
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "h.%d.ln_1", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "h.%d.attn.c_attn", l); dt__add_conv1d(mb, name, D, 3 * D, 0.02f);
        dt__split_column(mb, 1, 3, D / cfg->heads);                    /* by heads, of q, k and v alike */
        snprintf(name, sizeof name, "h.%d.attn.c_proj", l); dt__add_conv1d(mb, name, D, D, proj);
        dt__split_row(mb, 1, D / cfg->heads);
        snprintf(name, sizeof name, "h.%d.ln_2", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "h.%d.mlp.c_fc", l); dt__add_conv1d(mb, name, D, cfg->mlp_hidden, 0.02f);
        dt__split_column(mb, 1, 1, 1);
        snprintf(name, sizeof name, "h.%d.mlp.c_proj", l); dt__add_conv1d(mb, name, cfg->mlp_hidden, D, proj);
        dt__split_row(mb, 1, 1);
    }
    dt__rows_split_from(mb, blocks);
}
/* PyTorch's nn.Linear initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) */
static void dt__mlp_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int in = cfg->channels * cfg->image_size * cfg->image_size;
    char name[160];
    for (int l = 0; l <= cfg->depth; l++) {
        int out = l == cfg->depth ? cfg->classes : cfg->dim;
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "fc%d", l + 1);
        dt__add_linear(mb, name, in, out, DT_INIT_UNIFORM, 1.0f / sqrtf((float)in));
        /* tensor parallelism pairs the hidden layers: column-, then row-parallel
           (an unpaired last one, and the head, stay whole) */
        if (l % 2 == 0 && l + 1 < cfg->depth) dt__split_column(mb, 0, 1, 1);
        if (l % 2 == 1 && l < cfg->depth) dt__split_row(mb, 0, 1);
        in = out;
    }
    dt__rows_split_from(mb, 0);
}
/* timm's VisionTransformer: truncated-normal(0.02) linears, zero biases, unit
   LayerNorms, a near-zero class token, conv-style patch embedding */
static void dt__vit_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int C = cfg->channels, S = cfg->image_size, D = cfg->dim;
    int p = cfg->patch, P = (S / p) * (S / p), fan = C * p * p;
    char name[160];
    if (S % p) dt_fail("image size %d is not a multiple of the patch size %d", S, p);
    dt__check_heads(cfg);
    dt__unit_starts_here(mb);
    dt__add_param(mb, "cls_token", DT_INIT_NORMAL, 1e-6f, 3, 1, 1, D, 0);
    dt__add_param(mb, "pos_embed", DT_INIT_NORMAL, 0.02f, 3, 1, P + 1, D, 0);
    dt__add_param(mb, "patch_embed.proj.weight", DT_INIT_UNIFORM, 1.0f / sqrtf((float)fan), 4, D, C, p, p);
    dt__add_param(mb, "patch_embed.proj.bias", DT_INIT_UNIFORM, 1.0f / sqrtf((float)fan), 1, D, 0, 0, 0);
    int blocks = mb->m->nparams;
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "blocks.%d.norm1", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "blocks.%d.attn.qkv", l); dt__add_linear(mb, name, D, 3 * D, DT_INIT_NORMAL, 0.02f);
        dt__split_column(mb, 0, 3, D / cfg->heads);
        snprintf(name, sizeof name, "blocks.%d.attn.proj", l); dt__add_linear(mb, name, D, D, DT_INIT_NORMAL, 0.02f);
        dt__split_row(mb, 0, D / cfg->heads);
        snprintf(name, sizeof name, "blocks.%d.norm2", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "blocks.%d.mlp.fc1", l); dt__add_linear(mb, name, D, cfg->mlp_hidden, DT_INIT_NORMAL, 0.02f);
        dt__split_column(mb, 0, 1, 1);
        snprintf(name, sizeof name, "blocks.%d.mlp.fc2", l); dt__add_linear(mb, name, cfg->mlp_hidden, D, DT_INIT_NORMAL, 0.02f);
        dt__split_row(mb, 0, 1);
    }
    dt__rows_split_from(mb, blocks);
    dt__unit_starts_here(mb);
    dt__add_layernorm(mb, "norm", D);
    dt__add_linear(mb, "head", D, cfg->classes, DT_INIT_NORMAL, 0.02f);
}

/* A linear layer without bias, as every Llama projection is (Qwen2's q, k, v
   have one): nn.Linear's [out, in] weight. */
static void dt__add_projection(dt__model_builder *mb, const char *prefix, int in, int out, int bias) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_NORMAL, 0.02f, 2, out, in, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    if (bias) dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, out, 0, 0, 0);
}
/* The same marks for a projection just added, with or without its bias:
   column-parallel (its outputs, in `align`-wide pieces: a head's width) or
   row-parallel (its inputs; it has no bias). */
static void dt__split_projection(dt__model_builder *mb, int bias, int column, int align) {
    dt_model *m = mb->m;
    if (!column) { m->splits[m->nparams - 1] = (dt_split){ .dim = 1, .parts = 1, .align = align }; return; }
    m->splits[m->nparams - 1 - bias] = (dt_split){ .dim = 0, .parts = 1, .align = align };
    if (bias) m->splits[m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = align };
}
/* Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM: normal(0.02) weights,
   zero biases, unit RMSNorms. With a tied head the embedding and the final
   norm are the outer unit (as the GPT's); with a head of its own the
   embedding is the first unit and the norm and head the last. */
static void dt__llama_build(dt__model_builder *mb, const dt_model_config *cfg) {
    dt__check_heads(cfg);
    /* the config's zeros become the defaults here, in the model's own copy,
       so forward, the description and checkpoints all read the numbers used */
    dt_model_config *own = &mb->m->cfg;
    if (own->kv_heads <= 0) own->kv_heads = cfg->heads;
    if (!(own->rope_theta > 0)) own->rope_theta = 10000.0f;
    if (!(own->norm_eps > 0)) own->norm_eps = 1e-5f;
    int D = cfg->dim, H = cfg->heads, KV = own->kv_heads, hd = D / H;
    char name[160];
    if (H % KV) dt_fail("llama: --heads %d is not a multiple of --kv-heads %d (each key/value head serves a group)", H, KV);
    if (hd % 2) dt_fail("llama: the head width --dim / --heads = %d is odd; rotary embeddings turn pairs", hd);
    if (!cfg->untied_head) mb->m->outer_unit = 0;
    dt__unit_starts_here(mb);
    int qb = cfg->qkv_bias != 0;
    dt__add_param(mb, "model.embed_tokens.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
    mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1, .tied = !cfg->untied_head };
    if (!cfg->untied_head) {                                           /* by tokens, above; the head's norm */
        dt__add_param(mb, "model.norm.weight", DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        mb->m->splits[mb->m->nparams - 1].head = 1;
    }
    int blocks = mb->m->nparams;
    /* tensor parallelism: q, k and v by heads (k and v by their key/value
       heads), o_proj by its inputs; gate and up by the hidden units, down by
       its inputs */
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        dt__add_param(mb, name, DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.q_proj", l); dt__add_projection(mb, name, D, H * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.k_proj", l); dt__add_projection(mb, name, D, KV * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.v_proj", l); dt__add_projection(mb, name, D, KV * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.o_proj", l); dt__add_projection(mb, name, H * hd, D, 0);
        dt__split_projection(mb, 0, 0, hd);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        dt__add_param(mb, name, DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate_proj", l); dt__add_projection(mb, name, D, cfg->mlp_hidden, 0);
        dt__split_projection(mb, 0, 1, 1);
        snprintf(name, sizeof name, "model.layers.%d.mlp.up_proj", l); dt__add_projection(mb, name, D, cfg->mlp_hidden, 0);
        dt__split_projection(mb, 0, 1, 1);
        snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj", l); dt__add_projection(mb, name, cfg->mlp_hidden, D, 0);
        dt__split_projection(mb, 0, 0, 1);
    }
    dt__rows_split_from(mb, blocks);
    if (cfg->untied_head) {
        dt__unit_starts_here(mb);
        dt__add_param(mb, "model.norm.weight", DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        dt__add_param(mb, "lm_head.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
        mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1 };
    }
}

/* Where a unit's forward begins and ends: FSDP gathers its parameters there,
   and leaves marks on the tape for the same moments of backward. */
static void dt__unit_boundary(dt_model *m, int unit, int begin) {
    dt_parallel *par = m->parallel;
    if (par && begin && par->unit_begin) par->unit_begin(par, unit);
    if (par && !begin && par->unit_end) par->unit_end(par, unit);
}

/* -- activation recompute (--recompute). Most of a step's memory is the
      activations each block keeps for its backward, and backward needs a
      block's only when it reaches that block. So a block keeps what enters
      and what leaves it: its forward runs as always, then everything it made
      but its output goes back to the step arena, and one tape entry stands
      for its entries. When backward reaches that entry, the block's forward
      runs again from the same input -- the same ops in the same order, so
      the same bits -- its new entries are walked, and their memory goes back
      too. The price is one more forward of each block per step; what is
      saved is every block's activations but one block's at a time. Under
      FSDP the unit's marks stand on either side of that entry, so the unit
      is gathered again before its forward runs again. -- */
typedef dt_tensor *(*dt__block_fn)(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T);   /* P: its first parameter */
typedef struct { dt_model *m; dt__block_fn fn; dt_tensor *params; int B, T; } dt__block_call;

void dt_model_set_recompute(dt_model *m, int on) { m->recompute = on != 0; }

/* y's values, moved to the step arena's mark k: all else after k is given back. */
static dt_tensor *dt__keep_only(const dt__step_mark *k, const dt_tensor *y) {
    dt_tensor kept = *y;
    size_t bytes = (size_t)y->numel * dt_dtype_size(y->dtype);
    dt__scratch_reset();
    void *stash = dt__scratch_on(y->device, bytes);
    dt_convert(y->data, y->dtype, stash, y->dtype, y->numel);     /* a copy: the same dtype both sides */
    dt__step_back_to(k);
    dt_tensor *out = dt__tensor_alloc(kept.ndim, kept.shape, kept.dtype);
    dt_convert(stash, kept.dtype, out->data, kept.dtype, kept.numel);
    return out;
}
static void dt__recompute_backward(dt__tape_entry *e) {
    dt__block_call call = *(const dt__block_call *)e->saved;
    dt_tensor *x = e->in[0], *y = e->out;
    if (x->requires_grad) dt_grad(x);       /* before the mark: x's gradient outlives the block's */
    dt__step_mark k = dt__step_mark_now();
    int first = dt__ctx.tape_len;           /* e points into the tape, which grows: not used below */
    dt_tensor *again = call.fn(call.m, call.params, x, call.B, call.T);
    again->grad = y->grad;                  /* the gradient that reached the block's output */
    dt__tape_walk(first, dt__ctx.tape_len);
    dt__ctx.tape_len = first;
    dt__step_back_to(&k);
}
/* One block's forward, between its unit's boundaries (FSDP gathers there). */
static dt_tensor *dt__block(dt_model *m, int unit, dt__block_fn fn, dt_tensor *params, dt_tensor *x, int B, int T) {
    dt__unit_boundary(m, unit, 1);
    int recompute = m->recompute && dt__ctx.grad_enabled;
    dt__step_mark k = dt__step_mark_now();
    int first = dt__ctx.tape_len;
    dt_tensor *y = fn(m, params, x, B, T);
    if (recompute) {
        dt__ctx.tape_len = first;           /* its entries go, one stands for them */
        y = dt__keep_only(&k, y);
        dt__block_call *call = (dt__block_call *)dt_step_alloc(sizeof *call);
        *call = (dt__block_call){ m, fn, params, B, T };
        dt__tape_push(dt__recompute_backward, y, x, NULL, NULL)->saved = call;
    }
    dt__unit_boundary(m, unit, 0);
    return y;
}

/* The weights a forward reads: unit u's first one (the base's, under LoRA). */
static dt_tensor *dt__unit_weights(dt_model *m, int unit) {
    dt_model *w = m->base ? m->base : m;
    return &w->params[w->unit_first[unit]];
}
/* A linear layer's output y = x W^T + b, plus LoRA's (alpha/r) (x A^T) B^T
   when W has an adapter. The sum is PEFT's order: the base's output first. */
static int dt__adapter_of(const dt_model *m, const dt_tensor *w) { return m->base ? m->lora_of[w - m->base->params] : -1; }
static dt_tensor *dt__with_adapter(dt_model *m, dt_tensor *x, const dt_tensor *w, dt_tensor *y) {
    int a = dt__adapter_of(m, w);
    if (a < 0) return y;
    dt_tensor *low = dt_linear(x, &m->params[a], NULL);
    return dt_add(y, dt_scale(dt_linear(low, &m->params[a + 1], NULL), m->lora_scale));
}
/* Did tensor parallelism (the tensor-parallel chapter) cut w? Along its outputs: a
   column-parallel layer; along its inputs: a row-parallel one; or not (or no
   wrapper splits layers). */
typedef enum { DT__WHOLE, DT__COLUMN_PARALLEL, DT__ROW_PARALLEL } dt__cut;
static dt__cut dt__tp_cut(const dt_model *m, const dt_tensor *w, int in_out) {
    if (!dt_parallel_splitting(m->parallel) || w < m->params || w >= m->params + m->nparams) return DT__WHOLE;
    int dim = m->splits[w - m->params].dim;
    return dim < 0 ? DT__WHOLE : dim == (in_out ? 1 : 0) ? DT__COLUMN_PARALLEL : DT__ROW_PARALLEL;
}
/* A column-parallel layer's input: its gradient is summed over the group. */
static dt_tensor *dt__tp_input(dt_model *m, dt_tensor *x, const dt_tensor *w, int in_out) {
    return dt__tp_cut(m, w, in_out) == DT__COLUMN_PARALLEL ? dt_tp_copy(m->parallel, x) : x;
}
/* A linear layer, whole or cut: a row-parallel one sums its partial outputs
   over the group, then adds its bias once. */
static dt_tensor *dt__linear_cut(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out) {
    x = dt__tp_input(m, x, w, in_out);
    if (dt__tp_cut(m, w, in_out) != DT__ROW_PARALLEL) return in_out ? dt_linear_in_out(x, w, b) : dt_linear(x, w, b);
    dt_tensor *partial = in_out ? dt_linear_in_out(x, w, NULL) : dt_linear(x, w, NULL);
    dt_tensor *sum = dt_tp_sum(m->parallel, partial);
    return b ? dt_add_bias(sum, b) : sum;                   /* Llama's projections have none */
}
static dt_tensor *dt__lora_linear(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    return dt__with_adapter(m, x, w, dt__linear_cut(m, x, w, b, 0));
}
/* A language model's vocabulary (the GPT's wte, Llama's embed_tokens: the
   token embedding, and the head), cut over the group by its rows. Each rank looks up the tokens it holds, zeros
   for the others, and the group sums the rows (the one rank's row plus
   zeros: the same bits); the positions are added after, on every rank. */
static dt_tensor *dt__vocab_embedding(dt_model *m, const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe) {
    if (dt__tp_cut(m, wte, 0) != DT__COLUMN_PARALLEL) return dt_token_embedding(tokens, wte, wpe);
    dt_parallel *par = dt_parallel_splitting(m->parallel);
    int V = (int)dt_tensor_rows(wte), B = tokens->shape[0], T = (int)dt_tensor_cols(tokens);
    dt_tensor *x = dt_tp_sum(par, dt__token_embedding_rows(tokens, wte, NULL, par->tp_rank * V, V * par->tp_size));
    if (!wpe) return x;                                                   /* Llama: positions by rotation */
    float *at = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
    for (int r = 0; r < B * T; r++) at[r] = (float)(r % T);             /* each row's position, looked up in wpe */
    int shape[2] = { B, T };
    return dt_add(x, dt_token_embedding(dt_tensor_from_host(2, shape, at), wpe, NULL));
}
/* ... and its head, a column-parallel layer: each rank gives its columns of
   the logits, marked (their `parallel`) so that dt_cross_entropy and
   dt_logits_to_host work with the group on them. */
static dt_tensor *dt__vocab_head(dt_model *m, dt_tensor *x, dt_tensor *wte) {
    dt_tensor *logits = dt__linear_cut(m, x, wte, NULL, 0);
    if (dt__tp_cut(m, wte, 0) == DT__COLUMN_PARALLEL) logits->parallel = dt_parallel_splitting(m->parallel);
    return logits;
}
static dt_tensor *dt__lora_linear_in_out(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    return dt__with_adapter(m, x, w, dt__linear_cut(m, x, w, b, 1));
}
/* the fused forms: apart when the adapter's term or a row-parallel sum comes between */
static dt_tensor *dt__lora_linear_gelu(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    if (dt__adapter_of(m, w) >= 0 || dt__tp_cut(m, w, 0) == DT__ROW_PARALLEL) return dt_gelu(dt__lora_linear(m, x, w, b));
    return dt_linear_gelu(dt__tp_input(m, x, w, 0), w, b);
}
static dt_tensor *dt__lora_linear_in_out_gelu_tanh(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    if (dt__adapter_of(m, w) >= 0 || dt__tp_cut(m, w, 1) == DT__ROW_PARALLEL)
        return dt_gelu_tanh(dt__lora_linear_in_out(m, x, w, b));
    return dt_linear_in_out_gelu_tanh(dt__tp_input(m, x, w, 1), w, b);
}
/* The attention heads on this rank: all of them, or tensor parallelism's share
   (qkv holds 3 x heads x head width columns). */
static int dt__heads_here(const dt_model *m, const dt_tensor *qkv) {
    return (int)((int64_t)m->cfg.heads * dt_tensor_cols(qkv) / (3 * (int64_t)m->cfg.dim));
}

/* -- the blocks a forward runs: all of them (dt_model_forward), or a
      pipeline stage's share (dt_model_forward_blocks), from x when it does
      not begin with the embedding, to x when it does not end with the head -- */
typedef struct dt__span { int first, end; dt_tensor *x; } dt__span;
static dt_tensor *dt__span_blocks(dt_model *m, const dt__span *s, int first_unit, dt__block_fn fn, dt_tensor *x, int B,
                                  int T) {
    for (int l = s->first; l < s->end; l++) x = dt__block(m, first_unit + l, fn, dt__unit_weights(m, first_unit + l), x, B, T);
    return x;
}

/* The MLP: linear layers with GELU between them; a block is one layer and
   its GELU (none after the last). */
static dt_tensor *dt__mlp_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int last) {
    (void)B;
    x = dt__lora_linear(m, x, &P[0], &P[1]);
    return last ? x : dt_gelu(x);
}
static dt_tensor *dt__mlp_last_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { (void)T; return dt__mlp_block(m, P, x, B, 1); }
static dt_tensor *dt__mlp_hidden_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { (void)T; return dt__mlp_block(m, P, x, B, 0); }
static dt_tensor *dt__mlp_forward(dt_model *m, dt_tensor *images, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = images->shape[0];
    dt_tensor *x = s->x;
    if (s->first == 0) {
        x = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));
        *x = *images;                                                  /* flatten: a view */
        x->ndim = 2; x->shape[0] = B; x->shape[1] = (int)(images->numel / B);
        x = dt_sp_split(m->parallel, x);                               /* --sequence-parallel: this rank's images */
    }
    for (int l = s->first; l < s->end; l++)
        x = dt__block(m, l, l < c->depth ? dt__mlp_hidden_block : dt__mlp_last_block, dt__unit_weights(m, l), x, B, 0);
    return s->end == c->depth + 1 ? dt_sp_gather(m->parallel, x) : x;
}

/* A ViT block: pre-LN attention and MLP, each added to the residual stream. */
static dt_tensor *dt__vit_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    dt_tensor *n1w = &P[0], *n1b = &P[1], *qkvw = &P[2], *qkvb = &P[3], *pjw = &P[4], *pjb = &P[5];
    dt_tensor *n2w = &P[6], *n2b = &P[7], *f1w = &P[8], *f1b = &P[9], *f2w = &P[10], *f2b = &P[11];
    dt_tensor *h = dt__lora_linear(m, dt_layernorm(x, n1w, n1b, 1e-6f), qkvw, qkvb);
    h = dt__lora_linear(m, dt_attention(h, B, T, dt__heads_here(m, h), 0), pjw, pjb);
    x = dt_add(x, h);                                              /* pre-LN residual */
    h = dt__lora_linear_gelu(m, dt_layernorm(x, n2w, n2b, 1e-6f), f1w, f1b);
    return dt_add(x, dt__lora_linear(m, h, f2w, f2b));
}

/* The ViT: patches as tokens, pre-LN blocks, the class token's logits. */
static dt_tensor *dt__vit_forward(dt_model *m, dt_tensor *images, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = images->shape[0], pi = 0;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
#define DT_NEXT (&P[pi++])
    int T = (c->image_size / c->patch) * (c->image_size / c->patch) + 1;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);
        dt_tensor *cls = DT_NEXT, *pos = DT_NEXT, *pw = DT_NEXT, *pb = DT_NEXT;
        x = dt_linear(dt_patchify(images, c->patch), pw, pb);         /* the conv, as a matmul */
        x = dt_sp_split(m->parallel, dt_vit_tokens(x, cls, pos, B));  /* --sequence-parallel: this rank's rows */
        dt__unit_boundary(m, 0, 0);
    }
    x = dt__span_blocks(m, s, 1, dt__vit_block, x, B, T);
    if (s->end < c->depth) return x;
    x = dt_sp_gather(m->parallel, x);
    dt__unit_boundary(m, 1 + c->depth, 1);
    P = dt__unit_weights(m, 1 + c->depth);
    pi = 0;
    dt_tensor *nw = DT_NEXT, *nb = DT_NEXT, *hw = DT_NEXT, *hb = DT_NEXT;
    /* timm normalises every token, then pools the class token; normalising only
       the class token gives the same logits for less work. */
    x = dt_layernorm(dt_select_token(x, B, T, 0), nw, nb, 1e-6f);
    x = dt__lora_linear(m, x, hw, hb);
    dt__unit_boundary(m, 1 + c->depth, 0);
    return x;
#undef DT_NEXT
}

/* The context check of both language models. */
static void dt__check_context(const char *family, int T, int context) {
    if (T > context) dt_fail("%s: %d tokens do not fit a context of %d (--seq-len)", family, T, context);
}

/* A GPT-2 block: causal self-attention and an MLP, pre-LN, GPT-2's layout. */
static dt_tensor *dt__gpt_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    dt_tensor *n1w = &P[0], *n1b = &P[1], *aw = &P[2], *ab = &P[3], *pw = &P[4], *pb = &P[5];
    dt_tensor *n2w = &P[6], *n2b = &P[7], *fw = &P[8], *fb = &P[9], *mw = &P[10], *mb = &P[11];
    dt_tensor *h = dt__lora_linear_in_out(m, dt_layernorm(x, n1w, n1b, 1e-5f), aw, ab);
    h = dt__lora_linear_in_out(m, dt_attention(h, B, T, dt__heads_here(m, h), /*causal*/ 1), pw, pb);
    x = dt_add(x, h);
    h = dt__lora_linear_in_out_gelu_tanh(m, dt_layernorm(x, n2w, n2b, 1e-5f), fw, fb);
    return dt_add(x, dt__lora_linear_in_out(m, h, mw, mb));
}

/* GPT-2: pre-LN blocks of causal self-attention and an MLP; the head is the
   token embedding again (x wte^T), so input and output share one table. */
static dt_tensor *dt__gpt_forward(dt_model *m, dt_tensor *tokens, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), pi = 0;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
    dt__check_context("gpt", T, c->seq_len);
#define DT_NEXT (&P[pi++])
    dt_tensor *wte = DT_NEXT, *wpe = DT_NEXT, *nfw = DT_NEXT, *nfb = DT_NEXT;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);                                     /* the outer unit, until the head */
        x = dt_sp_split(m->parallel, dt__vocab_embedding(m, tokens, wte, wpe));   /* --sequence-parallel */
    }
    x = dt__span_blocks(m, s, 1, dt__gpt_block, x, B, T);
    if (s->end < c->depth) {                                            /* a pipeline stage before the head's */
        if (s->first == 0) dt__unit_boundary(m, 0, 0);
        return x;
    }
    if (s->first > 0) dt__unit_boundary(m, 0, 1);                       /* the head's stage: the outer unit again */
    x = dt_sp_gather(m->parallel, x);
    x = dt__vocab_head(m, dt_layernorm(x, nfw, nfb, 1e-5f), wte);     /* tied head: logits = x wte^T */
    dt__unit_boundary(m, 0, 0);
    return x;
#undef DT_NEXT
}

/* A Llama decoder layer (Qwen2's with biases on q, k and v). */
static dt_tensor *dt__llama_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    const dt_model_config *c = &m->cfg;
    dt_rope rope = { c->rope_theta, c->rope_factor, c->rope_low_freq, c->rope_high_freq, c->rope_original_context };
    int pi = 0;
#define DT_NEXT (&P[pi++])
#define DT_BIAS (c->qkv_bias ? DT_NEXT : NULL)
    dt_tensor *n1 = DT_NEXT, *qw = DT_NEXT, *qb = DT_BIAS, *kw = DT_NEXT, *kb = DT_BIAS, *vw = DT_NEXT, *vb = DT_BIAS;
    dt_tensor *ow = DT_NEXT, *n2 = DT_NEXT, *gw = DT_NEXT, *uw = DT_NEXT, *dw = DT_NEXT;
#undef DT_BIAS
#undef DT_NEXT
    dt_tensor *h = dt_rmsnorm(x, n1, c->norm_eps);
    dt_tensor *q = dt__lora_linear(m, h, qw, qb), *k = dt__lora_linear(m, h, kw, kb), *v = dt__lora_linear(m, h, vw, vb);
    int hd = c->dim / c->heads, H = (int)(dt_tensor_cols(q) / hd), KV = (int)(dt_tensor_cols(k) / hd);   /* this rank's heads */
    dt_tensor *qkv = dt_rotary_qkv(q, k, v, B, T, H, KV, rope);
    x = dt_add(x, dt__lora_linear(m, dt_attention(qkv, B, T, H, /*causal*/ 1), ow, NULL));
    h = dt_rmsnorm(x, n2, c->norm_eps);
    return dt_add(x, dt__lora_linear(m, dt_swiglu(dt__lora_linear(m, h, gw, NULL), dt__lora_linear(m, h, uw, NULL)), dw, NULL));
}

/* Llama: what changed since GPT-2, block by block. RMSNorm instead of
   LayerNorm; no position table, q and k rotated by position instead; fewer
   key/value heads than query heads; a gated MLP, down(silu(gate x) * up x);
   no biases (but Qwen2's q, k, v). */
static dt_tensor *dt__llama_forward(dt_model *m, dt_tensor *tokens, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), tied = !c->untied_head;
    float eps = c->norm_eps;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
    dt__check_context("llama", T, c->seq_len);
    dt_tensor *embed = &P[0], *norm = tied ? &P[1] : NULL;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);
        x = dt_sp_split(m->parallel, dt__vocab_embedding(m, tokens, embed, NULL));   /* --sequence-parallel */
        if (!tied) dt__unit_boundary(m, 0, 0);
    }
    x = dt__span_blocks(m, s, 1, dt__llama_block, x, B, T);
    if (s->end < c->depth) {
        if (s->first == 0 && tied) dt__unit_boundary(m, 0, 0);
        return x;
    }
    if (s->first > 0 && tied) dt__unit_boundary(m, 0, 1);
    x = dt_sp_gather(m->parallel, x);
    if (tied) {
        x = dt__vocab_head(m, dt_rmsnorm(x, norm, eps), embed);      /* logits = x embed^T */
        dt__unit_boundary(m, 0, 0);
    } else {
        dt__unit_boundary(m, 1 + c->depth, 1);
        dt_tensor *nw = dt__unit_weights(m, 1 + c->depth), *head = nw + 1;
        x = dt_rmsnorm(x, nw, eps);
        x = dt__tp_cut(m, head, 0) == DT__COLUMN_PARALLEL ? dt__vocab_head(m, x, head) : dt__lora_linear(m, x, head, NULL);
        dt__unit_boundary(m, 1 + c->depth, 0);
    }
    return x;
}

/* The parameters of the whole model: a wrapper that cuts it (tensor, pipeline
   parallelism) keeps its whole shapes (m->numel counts what this rank holds). */
static double dt__whole_params(const dt_model *m) {
    const dt_model *w = dt_model_whole(m);
    double n = 0;
    for (int i = 0; i < w->nparams; i++) n += (double)w->params[i].numel;
    return n;
}
static void dt__mlp_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "mlp %d -> %d x %d hidden -> %d (%.2fM params)", c->channels * c->image_size * c->image_size, c->depth,
             c->dim, c->classes, dt__whole_params(m) / 1e6);
}
static void dt__vit_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "vit dim=%d depth=%d heads=%d patch=%d mlp=%d on %dx%dx%d (%.2fM params)", c->dim, c->depth, c->heads,
             c->patch, c->mlp_hidden, c->channels, c->image_size, c->image_size, dt__whole_params(m) / 1e6);
}
static void dt__gpt_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "gpt dim=%d depth=%d heads=%d mlp=%d context=%d vocab=%d (%.2fM params)", c->dim, c->depth, c->heads,
             c->mlp_hidden, c->seq_len, c->classes, dt__whole_params(m) / 1e6);
}
static void dt__llama_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    char scaling[128] = "";
    if (c->rope_factor > 0)
        snprintf(scaling, sizeof scaling, " rope-llama3=%g,%g,%g,%d", (double)c->rope_factor, (double)c->rope_low_freq,
                 (double)c->rope_high_freq, c->rope_original_context);
    snprintf(out, n, "llama dim=%d depth=%d heads=%d kv-heads=%d ffn=%d context=%d vocab=%d rope-theta=%g%s norm-eps=%g%s%s "
             "(%.2fM params)", c->dim, c->depth, c->heads, c->kv_heads, c->mlp_hidden, c->seq_len, c->classes,
             (double)c->rope_theta, scaling, (double)c->norm_eps, c->untied_head ? " untied-head" : "",
             c->qkv_bias ? " qkv-bias" : "", dt__whole_params(m) / 1e6);
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
static void dt__gpt_config_json(FILE *f, const dt_model_config *c) {
    fprintf(f, "{\n  \"model_type\": \"gpt2\",\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"vocab_size\": %d,\n"
            "  \"n_positions\": %d,\n  \"n_embd\": %d,\n  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": %d,\n"
            "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n  \"tie_word_embeddings\": true,\n"
            "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"torch_dtype\": \"float32\"\n}\n",
            c->classes, c->seq_len, c->dim, c->depth, c->heads, c->mlp_hidden);
}
/* A float as JSON that reads back as a float (transformers checks the type): 8 is written 8.0. */
static const char *dt__json_float(char *out, size_t n, float v) {
    snprintf(out, n, "%.9g", (double)v);
    if (!strpbrk(out, ".eEn")) snprintf(out + strlen(out), n - strlen(out), ".0");
    return out;
}
static void dt__llama_config_json(FILE *f, const dt_model_config *c) {
    char scaling[256] = "null", a[32], b[32], d[32];
    if (c->rope_factor > 0)
        snprintf(scaling, sizeof scaling, "{\"rope_type\": \"llama3\", \"factor\": %s, \"low_freq_factor\": %s, "
                 "\"high_freq_factor\": %s, \"original_max_position_embeddings\": %d}", dt__json_float(a, sizeof a, c->rope_factor),
                 dt__json_float(b, sizeof b, c->rope_low_freq), dt__json_float(d, sizeof d, c->rope_high_freq),
                 c->rope_original_context);
    const char *type = c->qkv_bias ? "qwen2" : "llama", *arch = c->qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
    fprintf(f, "{\n  \"model_type\": \"%s\",\n  \"architectures\": [\"%s\"],\n  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n"
            "  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n"
            "  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n  \"max_position_embeddings\": %d,\n  \"rope_theta\": %.9g,\n"
            "  \"rope_scaling\": %s,\n  \"rms_norm_eps\": %.9g,\n  \"hidden_act\": \"silu\",\n  \"tie_word_embeddings\": %s,\n"
            "%s  \"attention_dropout\": 0.0,\n  \"torch_dtype\": \"float32\"\n}\n", type, arch, c->classes, c->dim, c->mlp_hidden,
            c->depth, c->heads, c->kv_heads, c->dim / c->heads, c->seq_len, (double)c->rope_theta, scaling, (double)c->norm_eps,
            c->untied_head ? "false" : "true",
            c->qkv_bias ? "  \"use_sliding_window\": false,\n" : "  \"attention_bias\": false,\n  \"mlp_bias\": false,\n");
}

/* The parameters a language model looks up rather than multiplies: GPT-2's
   position table, Llama's embedding when its head is a matrix of its own. */
static int64_t dt__no_params(const dt_model *m) { (void)m; return 0; }
static int64_t dt__gpt_lookups(const dt_model *m) { return (int64_t)m->cfg.seq_len * m->cfg.dim; }
static int64_t dt__llama_lookups(const dt_model *m) { return m->cfg.untied_head ? (int64_t)m->cfg.classes * m->cfg.dim : 0; }

/* A checkpoint's "model_config": the shape's numbers, comma-separated, in this
   order; a family writes the first `numbers` of them. */
typedef struct dt__config_number { const char *name; size_t offset; int is_float; } dt__config_number;
#define DT__CN(field, f) { #field, offsetof(dt_model_config, field), f }
static const dt__config_number dt__config_numbers[] = {
    DT__CN(channels, 0), DT__CN(image_size, 0), DT__CN(classes, 0), DT__CN(dim, 0), DT__CN(depth, 0), DT__CN(heads, 0),
    DT__CN(patch, 0), DT__CN(mlp_hidden, 0), DT__CN(seq_len, 0), DT__CN(kv_heads, 0), DT__CN(untied_head, 0),
    DT__CN(qkv_bias, 0), DT__CN(rope_theta, 1), DT__CN(norm_eps, 1), DT__CN(rope_factor, 1), DT__CN(rope_low_freq, 1),
    DT__CN(rope_high_freq, 1), DT__CN(rope_original_context, 0) };
#undef DT__CN

/* The rows a block passes the next, per sample: the mlp's one, the ViT's
   patches and class token, a language model's tokens. */
static int dt__one_row(const dt_model *m, const dt_tensor *inputs) { (void)m; (void)inputs; return 1; }
static int dt__vit_rows(const dt_model *m, const dt_tensor *inputs) {
    (void)inputs;
    return (m->cfg.image_size / m->cfg.patch) * (m->cfg.image_size / m->cfg.patch) + 1;
}
static int dt__token_rows(const dt_model *m, const dt_tensor *inputs) { (void)m; return (int)dt_tensor_cols(inputs); }

typedef struct dt__model_family dt__model_family;
static const dt__model_family *dt__family(dt_model_kind kind);
/* The names of a family's numbers, comma-separated: "channels,image_size,...". */
static void dt__config_names(dt_model_kind kind, char *out, size_t n);

struct dt__model_family {
    const char *name;                  /* --model NAME, and a checkpoint's "model" */
    int language;                      /* token ids in, next-token logits out */
    int numbers;                       /* how many of dt__config_numbers describe its shape */
    void (*build)(dt__model_builder *mb, const dt_model_config *cfg);
    int blocks_past_depth;             /* its blocks are --depth plus this many (the mlp's output layer: 1) */
    dt_tensor *(*forward)(dt_model *m, dt_tensor *inputs, const dt__span *span);
    int (*rows_per_sample)(const dt_model *m, const dt_tensor *inputs);   /* of what one block passes the next */
    void (*describe)(const dt_model *m, char *out, size_t n);
    int64_t (*lookups)(const dt_model *m);   /* parameters that never multiply */
    void (*config_json)(FILE *f, const dt_model_config *c);   /* a checkpoint's config.json */
    const char *lora_targets;          /* LoRA's default targets (PEFT's, where it has them); NULL: every linear layer */
    const char *hf_prefix;             /* what Hugging Face's module names have before dtrain's */
};
/* in dt_model_kind's order */
static const dt__model_family dt__model_families[] = {
    { "mlp", 0, 8, dt__mlp_build, 1, dt__mlp_forward, dt__one_row, dt__mlp_describe, dt__no_params, dt__mlp_config_json, NULL, "" },
    { "vit", 0, 8, dt__vit_build, 0, dt__vit_forward, dt__vit_rows, dt__vit_describe, dt__no_params, dt__vit_config_json, "qkv", "" },
    { "gpt", 1, 9, dt__gpt_build, 0, dt__gpt_forward, dt__token_rows, dt__gpt_describe, dt__gpt_lookups, dt__gpt_config_json, "c_attn", "transformer." },
    { "llama", 1, 18, dt__llama_build, 0, dt__llama_forward, dt__token_rows, dt__llama_describe, dt__llama_lookups, dt__llama_config_json,
      "q_proj,v_proj", "" },
};
#define DT__NFAMILIES ((int)(sizeof dt__model_families / sizeof dt__model_families[0]))
static const dt__model_family *dt__family(dt_model_kind kind) {
    if ((int)kind < 0 || (int)kind >= DT__NFAMILIES) dt_fail("model kind %d is not one dtrain knows", (int)kind);
    return &dt__model_families[kind];
}
int dt_model_is_language(dt_model_kind kind) { return dt__family(kind)->language; }
static void dt__config_names(dt_model_kind kind, char *out, size_t n) {
    size_t used = 0;
    out[0] = 0;
    for (int k = 0; k < dt__family(kind)->numbers && used < n; k++) {
        int w = snprintf(out + used, n - used, "%s%s", k ? "," : "", dt__config_numbers[k].name);
        used += w > 0 ? (size_t)w : 0;
    }
}

/* The flat buffers of the parameters the builder listed, and their first values. */
static void dt__model_allocate(dt_model *m, dt__model_builder *mb, uint64_t seed, int frozen) {
    m->unit_first[m->nunits] = m->nparams;
    m->offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m->nparams + 1));
    if (!m->offsets) dt_fail("out of memory (model)");
    for (int i = 0; i < m->nparams; i++) { m->offsets[i] = m->numel; m->numel = dt__size_add(m->numel, m->params[i].numel, "the model"); }
    /* A model that cannot fit is refused with its size before its weights are allocated (the system may
       promise more than it has, and the first write would then kill the run). */
    double weights = (double)m->numel * sizeof(float), have = dt__host_memory_bytes();
    if (dt__ctx.device == DT_CPU && have > 0 && weights * (frozen ? 1 : 2) > have)
        dt_fail("the model has %lld parameters: %.3g GB of weights%s, more than this machine's %.3g GB of memory (smaller "
                "--dim, --depth or vocabulary?)", (long long)m->numel, weights / 1e9,
                frozen ? "" : " and as much again of gradients", have / 1e9);
    size_t bytes = (size_t)dt__size_mul(m->numel, (int64_t)sizeof(float), "the model");
    m->device = dt__ctx.device;
    m->flat_data = (float *)dt_alloc_on(m->device, DT_ARENA_PARAMS, bytes);
    m->flat_grad = frozen ? NULL : (float *)dt_alloc_on(m->device, DT_ARENA_GRADS, bytes);
    /* Draw the weights on the host (the same numbers on every device), then upload. */
    float *init = m->device == DT_CPU ? m->flat_data : (float *)malloc(bytes ? bytes : 1);
    if (!init) dt_fail("out of memory (model initialisation)");
    dt__rng rng = { seed };
    int64_t off = 0;
    for (int i = 0; i < m->nparams; i++) {
        dt_tensor *t = &m->params[i];
        t->data = m->flat_data + off;
        t->grad = frozen ? NULL : m->flat_grad + off;
        t->requires_grad = !frozen;
        t->device = m->device;
        float sc = mb->init_scale[i], *dst = init + off;
        off += t->numel;
        for (int64_t j = 0; j < t->numel; j++) {
            switch (mb->init[i]) {
            case DT_INIT_ZERO: dst[j] = 0; break;
            case DT_INIT_ONE: dst[j] = 1; break;
            case DT_INIT_UNIFORM: dst[j] = (float)((2 * dt__rng_uniform(&rng) - 1) * sc); break;
            case DT_INIT_NORMAL: {       /* truncated at two standard deviations */
                double z;
                do z = dt__rng_normal(&rng); while (z < -2 || z > 2);
                dst[j] = (float)(z * sc);
                break;
            }
            }
        }
    }
    if (init != m->flat_data) { dt_upload(m->flat_data, init, bytes); free(init); }
    free(mb->init);
    free(mb->init_scale);
}

/* -- LoRA (Hu et al., 2021): fine-tuning changes a weight matrix by
      something of low rank, so learn that change as B A, with A [r, in] and
      B [out, r] for a small r, and leave W as it was. The model with LoRA is
      two models: the frozen one (m->base: its weights, no gradients, no
      optimizer state) and the adapters, which are the model's parameters --
      so the optimizer, DDP's all-reduce, FSDP's shards and the checkpoint see
      the adapters and nothing else, with no change of their own. The
      adapters' units are the base's, so FSDP gathers a block's adapters where
      it would have gathered the block. B starts at zero: training starts
      from the base model's outputs exactly. Names are PEFT's, so PEFT loads
      the saved adapters. -- */

/* A target names a module, or the last parts of its name, as PEFT's do:
   "q_proj" is every layer's self_attn.q_proj. Embeddings are no targets. */
static int dt__lora_target_matches(const char *module, const char *target, size_t tlen) {
    size_t ml = strlen(module);
    if (tlen == 0 || tlen > ml || strncmp(module + ml - tlen, target, tlen)) return 0;
    return ml == tlen || module[ml - tlen - 1] == '.';
}
static int dt__lora_module(const dt_tensor *p, char *module, size_t n) {
    size_t len = strlen(p->name);
    if (p->ndim != 2 || len < 8 || strcmp(p->name + len - 7, ".weight") || len - 7 >= n) return 0;
    memcpy(module, p->name, len - 7);
    module[len - 7] = 0;
    const char *last = strrchr(module, '.');
    last = last ? last + 1 : module;
    return strcmp(last, "wte") && strcmp(last, "wpe") && strcmp(last, "embed_tokens");
}
/* The targets of cfg, or the family's default. */
static void dt__lora_targets_of(const dt_model_config *cfg, char *out, size_t n) {
    const char *def = dt__family(cfg->kind)->lora_targets;
    if (cfg->lora_targets[0]) dt__copy_str(out, n, cfg->lora_targets);
    else if (def) dt__copy_str(out, n, def);
    else {                                     /* the MLP: every layer */
        size_t used = 0;
        out[0] = 0;
        for (int l = 0; l <= cfg->depth && used < n; l++) {
            int w = snprintf(out + used, n - used, "%sfc%d", l ? "," : "", l + 1);
            used += w > 0 ? (size_t)w : 0;
        }
    }
}
static void dt__lora_build(dt__model_builder *mb, dt_model *base, const dt_model_config *cfg) {
    dt_model *m = mb->m;
    char targets[256], module[200], name[320];
    dt__lora_targets_of(cfg, targets, sizeof targets);
    const char *prefix = dt__family(cfg->kind)->hf_prefix;
    int r = cfg->lora_rank;
    m->lora_of = (int *)malloc(sizeof(int) * (size_t)(base->nparams ? base->nparams : 1));
    if (!m->lora_of) dt_fail("out of memory (LoRA)");
    m->outer_unit = base->outer_unit;
    /* every target must name something: a typo would otherwise train nothing */
    for (const char *t = targets; *t;) {
        size_t len = strcspn(t, ",");
        int hits = 0;
        for (int i = 0; i < base->nparams; i++)
            hits += dt__lora_module(&base->params[i], module, sizeof module) && dt__lora_target_matches(module, t, len);
        if (!hits) {
            char have[1024] = "";
            size_t used = 0;
            for (int i = 0; i < base->nparams && used + 1 < sizeof have; i++) {
                if (!dt__lora_module(&base->params[i], module, sizeof module)) continue;
                const char *last = strrchr(module, '.');
                last = last ? last + 1 : module;
                int seen = 0;
                for (const char *h = have; *h && !seen; h += strcspn(h, ",") + (h[strcspn(h, ",")] == ','))
                    seen = strcspn(h, ",") == strlen(last) && !strncmp(h, last, strlen(last));
                int w = seen ? 0 : snprintf(have + used, sizeof have - used, "%s%s", used ? "," : "", last);
                used += w > 0 ? (size_t)w : 0;
            }
            dt_fail("LoRA target '%.*s' names no linear layer of this %s (its layers: %s)", (int)len, t,
                    dt__family(cfg->kind)->name, have);
        }
        t += len + (t[len] == ',');
    }
    for (int u = 0; u < base->nunits; u++) {
        dt__unit_starts_here(mb);
        for (int i = base->unit_first[u]; i < base->unit_first[u + 1]; i++) {
            const dt_tensor *w = &base->params[i];
            int hit = 0;
            m->lora_of[i] = -1;
            if (!dt__lora_module(w, module, sizeof module)) continue;
            for (const char *t = targets; *t && !hit;) {
                size_t len = strcspn(t, ",");
                hit = dt__lora_target_matches(module, t, len);
                t += len + (t[len] == ',');
            }
            if (!hit) continue;
            int gpt = cfg->kind == DT_MODEL_GPT;     /* Conv1D: [in, out] */
            int in = w->shape[gpt ? 0 : 1], out = w->shape[gpt ? 1 : 0];
            if (r > in || r > out)
                dt_fail("--lora-rank %d: '%s' is %d x %d; the rank must not exceed either side", r, w->name, w->shape[0], w->shape[1]);
            m->lora_of[i] = m->nparams;
            snprintf(name, sizeof name, "base_model.model.%s%s.lora_A.weight", prefix, module);
            dt__add_param(mb, name, DT_INIT_UNIFORM, 1.0f / sqrtf((float)in), 2, r, in, 0, 0);   /* PEFT's kaiming_uniform(a=sqrt 5) */
            snprintf(name, sizeof name, "base_model.model.%s%s.lora_B.weight", prefix, module);
            dt__add_param(mb, name, DT_INIT_ZERO, 0, 2, out, r, 0, 0);
        }
    }
    m->lora_scale = cfg->lora_alpha / (float)r;
}

static dt_model *dt__model_create(const dt_model_config *cfg, uint64_t seed, int frozen) {
    const dt__model_family *fam = dt__family(cfg->kind);
    dt_model *m = (dt_model *)calloc(1, sizeof(dt_model));
    if (!m) dt_fail("out of memory (model)");
    m->cfg = *cfg;
    m->unit_first = (int *)calloc((size_t)cfg->depth + 3, sizeof(int));
    if (!m->unit_first) dt_fail("out of memory (model)");
    dt__model_builder mb = { m, 0, NULL, NULL };
    m->outer_unit = -1;
    if (cfg->lora_rank > 0) {
        if (!(cfg->lora_alpha > 0)) dt_fail("LoRA: alpha must be positive, got %g", (double)cfg->lora_alpha);
        dt_model_config plain = *cfg;
        plain.lora_rank = 0;
        m->base = dt__model_create(&plain, seed, /*frozen*/ 1);
        m->base_seed = seed;
        m->cfg = m->base->cfg;               /* with the defaults the family filled in */
        m->cfg.lora_rank = cfg->lora_rank; m->cfg.lora_alpha = cfg->lora_alpha;
        dt__lora_targets_of(cfg, m->cfg.lora_targets, sizeof m->cfg.lora_targets);
        dt__lora_build(&mb, m->base, &m->cfg);
        seed ^= 0x4C6F5241ull;               /* the adapters' own draws ("LoRA") */
    } else
        fam->build(&mb, cfg);
    /* which block reads each parameter (pipeline parallelism): its unit's,
       the first unit being the embedding when there are more units than
       blocks (all but the mlp) */
    int blocks = dt_model_blocks(m), embedding = m->nunits > blocks;
    for (int u = 0; u < m->nunits; u++)
        for (int i = m->unit_first[u]; i < (u + 1 < m->nunits ? m->unit_first[u + 1] : m->nparams); i++)
            m->splits[i].block = m->splits[i].head ? blocks : u - embedding;
    dt__model_allocate(m, &mb, seed, frozen);
    return m;
}
dt_model *dt_model_create(const dt_model_config *cfg, uint64_t seed) { return dt__model_create(cfg, seed, 0); }

void dt_model_free(dt_model *m) {
    if (!m) return;
    if (m->optimizers) dt_fail("dt_model_free: its optimizer still steps this model; call dt_optimizer_free first");
    if (m->parallel)
        dt_fail("dt_model_free: %s still wraps this model; call %s first", m->parallel->create_fn, m->parallel->free_fn);
    for (int i = 0; i < m->nparams; i++) free((void *)m->params[i].name);
    free(m->params);
    free(m->offsets);
    free(m->splits);
    free(m->unit_first);
    dt_free_on(m->device, DT_ARENA_PARAMS, m->flat_data, (size_t)m->numel * sizeof(float));
    dt_free_on(m->device, DT_ARENA_GRADS, m->flat_grad, (size_t)m->numel * sizeof(float));
    free(m->lora_of);
    free(m->base_source);
    dt_model_free(m->base);
    free(m);
}

const dt_model *dt_model_whole(const dt_model *m) {
    for (const dt_parallel *q = m->parallel; q; q = q->inner) if (q->whole) return q->whole;
    return m;
}
void dt_model_set_parallel(dt_model *m, dt_parallel *par) {
    if (par && m->left_cut_by)
        dt_fail("%s: %s has cut this model (each rank kept its pieces); create the model again for another wrapper",
                par->create_fn ? par->create_fn : "dt_model_set_parallel", m->left_cut_by);
    dt_parallel *now = par ? par : m->parallel;
    if (!now) return;
    if (par && (!par->create_fn || !par->sync_fn || !par->free_fn))
        dt_fail("dt_model_set_parallel: a dt_parallel must name its create, sync and free functions (for the errors)");
    if (par && m->parallel && par->inner != m->parallel)
        dt_fail("%s: this model is already wrapped (%s); one wrapper per model (or one that wraps it), or call %s first",
                par->create_fn, m->parallel->create_fn, m->parallel->free_fn);
    if (par && par->inner && par->inner != m->parallel)
        dt_fail("%s: the wrapper it wraps (%s) does not hold this model", par->create_fn, par->inner->create_fn);
    if (par && m->optimizers)
        dt_fail("%s: this model already has an optimizer; create the optimizer after %s, which decides what it steps",
                par->create_fn, par->create_fn);
    if (!par && m->optimizers)
        dt_fail("%s: the optimizer still steps what this wrapper gave it; call dt_optimizer_free first", now->free_fn);
    m->parallel = par ? par : now->inner;                /* unwrapped: the one it wrapped holds the model again */
    for (int i = 0; i < m->nparams; i++) m->params[i].parallel = m->parallel;
    dt__ctx.wrappers += par ? 1 : -1;
}

dt_tensor *dt_model_param(dt_model *m, const char *name) {
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

void dt_model_zero_grad(dt_model *m) { dt__zero_on(m->device, m->flat_grad, (size_t)m->numel * sizeof(float)); }

void dt_model_describe(const dt_model *m, char *out, size_t n) {
    dt__family(m->cfg.kind)->describe(m->base ? m->base : m, out, n);
    size_t used = strlen(out);
    if (m->base && used < n)
        snprintf(out + used, n - used, " + LoRA rank=%d alpha=%g on %s (%lld trainable)", m->cfg.lora_rank,
                 (double)m->cfg.lora_alpha, m->cfg.lora_targets, (long long)m->numel);
}

/* How checkpoints name a model and its shape (their "model" and "model_config"). */
static const char *dt__model_kind_name(dt_model_kind k) { return dt__family(k)->name; }
static void dt__model_config_string(const dt_model_config *mc, char *out, size_t n) {
    size_t used = 0;
    out[0] = 0;
    for (int k = 0; k < dt__family(mc->kind)->numbers && used < n; k++) {
        const char *field = (const char *)mc + dt__config_numbers[k].offset;
        int w = dt__config_numbers[k].is_float ? snprintf(out + used, n - used, "%s%.9g", k ? "," : "", (double)*(const float *)field)
                                               : snprintf(out + used, n - used, "%s%d", k ? "," : "", *(const int *)field);
        used += w > 0 ? (size_t)w : 0;
    }
}

double dt_model_flops_per_token(const dt_model *m) {
    const dt_model_config *c = &m->cfg;
    const dt__model_family *fam = dt__family(c->kind);
    if (!fam->language) return 0;
    const dt_model *w = m->base ? m->base : m;
    double multiplying = (double)w->numel - (double)fam->lookups(m);
    /* a frozen weight costs its forward and the input's gradient, 4 per
       parameter, not the weight's gradient; LoRA's adapters cost 6 */
    return (m->base ? 4.0 * multiplying + 6.0 * (double)m->numel : 6.0 * multiplying) + 12.0 * c->depth * c->dim * c->seq_len;
}

dt_tensor *dt_model_forward(dt_model *m, dt_tensor *inputs) {
    if (!m->flat_data && !m->parallel)
        dt_fail("dt_model_forward: this model's parameters went with dt_fsdp_free (each rank kept only its shard); "
                "call dt_fsdp_free after the last forward");
    if (m->left_cut_by && !m->parallel)
        dt_fail("dt_model_forward: %s has run, and this rank holds only its pieces of the model's split layers; call %s "
                "after the last forward", m->left_cut_by, m->left_cut_by);
    for (dt_parallel *q = m->parallel; q; q = q->inner) if (q->forward) return q->forward(q, inputs);   /* a pipeline runs it */
    return dt_model_forward_blocks(m, inputs, NULL, 0, dt_model_blocks(m));
}
int dt_model_blocks(const dt_model *m) { return m->cfg.depth + dt__family(m->cfg.kind)->blocks_past_depth; }
dt_tensor *dt_model_forward_blocks(dt_model *m, dt_tensor *inputs, dt_tensor *x, int first, int end) {
    int n = dt_model_blocks(m);
    if (m->left_cut_by && !m->parallel)
        dt_fail("dt_model_forward_blocks: %s has run, and this rank holds only its pieces of the model; call %s after the last "
                "forward", m->left_cut_by, m->left_cut_by);
    if (first < 0 || end > n || first > end || (first == 0 && end == 0 && n > 0))
        dt_fail("dt_model_forward_blocks: blocks [%d, %d) of a model of %d", first, end, n);
    if ((first > 0) != (x != NULL))
        dt_fail("dt_model_forward_blocks: %s", first > 0 ? "a run of blocks after the first starts from x, the activation "
                                                           "the blocks before made: give it"
                                                         : "the first block starts from the embedding of the inputs: x must be NULL");
    const dt_model *w = m->base ? m->base : m;      /* the weights the blocks read must be here: only a */
    for (int i = 0; i < (dt_model_whole(m) != m ? w->nparams : 0); i++) {   /* cut model lacks any */
        int b = w->splits[i].block;
        int read = (b >= first && b < end) || (b < 0 && first == 0) || (b >= n && end == n) || (w->splits[i].tied && (first == 0 || end == n));
        if (read && w->params[i].numel == 0)
            dt_fail("dt_model_forward_blocks: blocks [%d, %d) read %s, which this rank does not hold (a pipeline stage keeps "
                    "only its own blocks' parameters)", first, end, w->params[i].name);
    }
    if (x) {
        int64_t rows = (int64_t)inputs->shape[0] * dt__family(m->cfg.kind)->rows_per_sample(m, inputs);
        if (x->numel != rows * m->cfg.dim)
            dt_fail("dt_model_forward_blocks: x has %lld values; blocks after the first take %lld rows of %d (the inputs' "
                    "samples x their rows)", (long long)x->numel, (long long)rows, m->cfg.dim);
    }
    dt__span span = { first, end, x };
    return dt__family(m->cfg.kind)->forward(m, inputs, &span);
}
/* [src/08-optimizer.h] */
/* ==== optimizer ==============================================================
   The update rules are PyTorch's, element for element, so a step here matches a
   step there. Biases and norm weights (1-D parameters) get no weight decay. */

/* The optimizer steps the model's flat buffers, one slice per parameter
   (decayed when it is a matrix): without a wrapper, or as a wrapper's view
   begins (tensor parallelism then marks the replicated ones). */
static void dt__optimizer_view_all(dt_optimizer *o, const dt_model *m) {
    o->params = m->flat_data; o->grads = m->flat_grad; o->numel = m->numel;
    o->nslices = m->nparams;
    o->slices = (struct dt_param_slice *)calloc((size_t)m->nparams, sizeof *o->slices);
    if (!o->slices) dt_fail("out of memory (optimizer)");
    for (int i = 0; i < m->nparams; i++)
        o->slices[i] = (struct dt_param_slice){ m->offsets[i], m->params[i].numel, m->params[i].ndim >= 2, 0 };
}
dt_optimizer *dt_optimizer_create(dt_model *model, dt_optimizer_kind kind, float weight_decay,
                                  float momentum, float clip_norm) {
    dt_optimizer *o = (dt_optimizer *)calloc(1, sizeof(dt_optimizer));
    if (!o) dt_fail("out of memory (optimizer)");
    o->kind = kind;
    o->beta1 = 0.9f; o->beta2 = 0.999f; o->eps = 1e-8f;
    o->weight_decay = weight_decay; o->momentum = momentum; o->clip_norm = clip_norm;
    o->model = model;
    o->device = model->device;
    model->optimizers++;
    dt_parallel *view = model->parallel;              /* in a stack, the outermost wrapper that has a view */
    while (view && !view->optimizer_view) view = view->inner;
    if (view) {
        view->optimizer_view(view, o);
        if (o->sharded_by && !o->sharded_by->sum_over_ranks)
            dt_fail("%s: its optimizer view shards the optimizer but gives no sum_over_ranks for the gradient norm",
                    o->sharded_by->create_fn);
    } else dt__optimizer_view_all(o, model);
    size_t bytes = (size_t)o->numel * sizeof(float);
    o->m = (float *)(o->offloaded ? dt_alloc_host(DT_ARENA_OPTIM, bytes) : dt_alloc_on(o->device, DT_ARENA_OPTIM, bytes));
    if (kind == DT_ADAMW)
        o->v = (float *)(o->offloaded ? dt_alloc_host(DT_ARENA_OPTIM, bytes) : dt_alloc_on(o->device, DT_ARENA_OPTIM, bytes));
    return o;
}
void dt_optimizer_free(dt_optimizer *opt) {
    if (!opt) return;
    size_t bytes = (size_t)opt->numel * sizeof(float);
    if (opt->offloaded) { dt_free_host(DT_ARENA_OPTIM, opt->m, bytes); dt_free_host(DT_ARENA_OPTIM, opt->v, bytes); }
    else { dt_free_on(opt->device, DT_ARENA_OPTIM, opt->m, bytes); dt_free_on(opt->device, DT_ARENA_OPTIM, opt->v, bytes); }
    free(opt->slices);
    opt->model->optimizers--;
    free(opt);
}

/* The optimizer needs the average gradient: a backward whose gradients the
   wrapper has not synchronised yet is an order mistake, named. */
static void dt__optimizer_check_synced(const dt_optimizer *o, const char *caller) {
    const dt_parallel *par = o->model->parallel;
    if (par && par->grads_pending)
        dt_fail("%s: the gradients of the last backward are not synchronised across the ranks yet; call %s first",
                caller, par->sync_fn);
}

/* The squared norm of every gradient the optimizer steps -- of the whole
   model: a sharded optimizer sums its ranks' parts. */
static double dt__sum_squares_on(dt_device device, const float *g, int64_t n) {
    const dt_backend *gpu = dt__backend_of(device);
    if (gpu) return gpu->sum_squares(g, n);
    double lane[8] = { 0 }, sq = 0;     /* 8 fixed lanes: vectorizes, and sums in the same order every run */
    int64_t i8 = n - n % 8;
    for (int64_t i = 0; i < i8; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)g[i + l] * g[i + l];
    for (int64_t i = i8; i < n; i++) lane[i % 8] += (double)g[i] * g[i];
    for (int l = 0; l < 8; l++) sq += lane[l];
    return sq;
}
static double dt__optimizer_grad_sum_squares(dt_optimizer *o) {
    int copies = 0;
    for (int si = 0; si < o->nslices; si++) copies += o->slices[si].copy;
    double sq = 0;
    if (!copies) sq = dt__sum_squares_on(o->device, o->grads, o->numel);
    else                                 /* what another rank counts, left out */
        for (int si = 0; si < o->nslices; si++)
            if (!o->slices[si].copy) sq += dt__sum_squares_on(o->device, o->grads + o->slices[si].offset, o->slices[si].length);
    if (o->sharded_by) {                 /* each rank holds a part: the norm is of the whole */
        float part = (float)sq;
        o->sharded_by->sum_over_ranks(o->sharded_by, &part, 1);
        sq = part;
    }
    return sq;
}
void dt_optimizer_step(dt_optimizer *opt, float lr) {
    dt__optimizer_check_synced(opt, "dt_optimizer_step");
    if (dt__ctx.grads_scaled)
        dt_fail("dt_optimizer_step: the gradients are still multiplied by the loss scale; call dt_loss_scaler_unscale first");
    int64_t n = opt->numel;
    float *g = opt->grads;
    const dt_backend *gpu = dt__backend_of(opt->device);
    opt->last_grad_norm = (float)sqrt(dt__optimizer_grad_sum_squares(opt));
    if (opt->clip_norm > 0 && opt->last_grad_norm > opt->clip_norm) {   /* torch.nn.utils.clip_grad_norm_ */
        float c = opt->clip_norm / (opt->last_grad_norm + 1e-6f);
        if (gpu) gpu->scale(g, c, n);
        else
            for (int64_t i = 0; i < n; i++) g[i] *= c;
    }
    opt->step++;
    float bc1 = 1.0f - powf(opt->beta1, (float)opt->step), bc2 = 1.0f - powf(opt->beta2, (float)opt->step);
    for (int si = 0; si < opt->nslices; si++) {
        int64_t off = opt->slices[si].offset, len = opt->slices[si].length;
        float wd = opt->slices[si].decay ? opt->weight_decay : 0.0f;
        float *p = opt->params + off, *mm = opt->m + off, *gg = g + off;
        if (gpu && opt->kind == DT_ADAMW)
            gpu->adamw(p, mm, opt->v + off, gg, len, lr, opt->beta1, opt->beta2, opt->eps, wd, bc1, bc2);
        else if (gpu)
            gpu->sgd(p, mm, gg, len, lr, opt->momentum, wd);
        else if (opt->kind == DT_ADAMW) {
            float *vv = opt->v + off;
            DT_OMP("omp parallel for if(len > 65536)")
            for (int64_t i = 0; i < len; i++)
                dt_adamw_update(&p[i], &mm[i], &vv[i], gg[i], lr, opt->beta1, opt->beta2, opt->eps, wd, bc1, bc2);
        } else {
            DT_OMP("omp parallel for if(len > 65536)")
            for (int64_t i = 0; i < len; i++) dt_sgd_update(&p[i], &mm[i], gg[i], lr, opt->momentum, wd);
        }
    }
    dt__zero_on(opt->device, g, (size_t)n * sizeof(float));
    for (dt_parallel *par = opt->model->parallel; par; par = par->inner)   /* each wrapper of a stack, outer first */
        if (par->step_done) par->step_done(par);
}

float dt_schedule_lr(float base_lr, int64_t step, int64_t warmup, int64_t total) {
    if (warmup > 0 && step < warmup) return base_lr * (float)(step + 1) / (float)warmup;
    int64_t span = total - warmup;
    if (span <= 0) return base_lr;
    double progress = (double)(step - warmup) / (double)span;
    if (progress > 1) progress = 1;
    return (float)(base_lr * 0.5 * (1.0 + cos(3.14159265358979323846 * progress)));
}

/* [src/09-mixed-precision.h] */
/* ==== mixed precision =======================================================
   Half the bytes: activations, the matmuls' operands and what the collectives
   carry in 16 bits, while everything that adds up many small numbers stays in
   f32 -- the master weights and the optimizer (an update of 1e-4 on a weight
   of 1 vanishes in bf16, whose 8 significant bits move it in steps of 1/128),
   the sums inside matmuls, the layernorm statistics, the softmax, the loss.
   The ops do it through the views of the autograd chapter; this chapter sets the dtype
   and scales the loss for fp16, whose range (6e-8 to 65504) is too narrow for
   gradients. */

void dt_set_compute_dtype(dt_dtype dtype) {
    if (dtype != dt__ctx.compute_dtype && dt__ctx.wrappers)
        dt_fail("dt_set_compute_dtype: a parallel wrapper already exists and gathers in %s; call dt_set_compute_dtype "
                "before dt_dp_create, dt_ddp_create or dt_fsdp_create", dt_dtype_name(dt__ctx.compute_dtype));
    dt__ctx.compute_dtype = dtype;
}
dt_dtype dt_compute_dtype(void) { return dt__ctx.compute_dtype; }

dt_loss_scaler dt_loss_scaler_create(dt_dtype dtype) {
    dt_loss_scaler s;
    memset(&s, 0, sizeof s);
    s.scale = 1.0f;
    s.growth_interval = 2000;
    if (dtype == DT_F16) { s.enabled = 1; s.scale = 65536.0f; }
    return s;
}

void dt_backward_scaled(dt_tensor *loss, const dt_loss_scaler *scaler, int accum_steps) {
    dt__backward_seeded(loss, scaler->scale / (float)(accum_steps > 0 ? accum_steps : 1));
    if (scaler->enabled) dt__ctx.grads_scaled = 1;    /* the optimizer must not see them so */
}

int dt_loss_scaler_unscale(dt_loss_scaler *scaler, dt_optimizer *opt) {
    dt__optimizer_check_synced(opt, "dt_loss_scaler_unscale");
    scaler->last_skipped = 0;
    dt__ctx.grads_scaled = 0;          /* divided below, or zeroed and the step skipped */
    if (!scaler->enabled) return 1;
    size_t bytes = (size_t)opt->numel * sizeof(float);
    /* one number says it all: a sum with an inf or a NaN in it is not finite;
       a sharded optimizer sums over the ranks, so they all see the same */
    if (!isfinite(dt__optimizer_grad_sum_squares(opt))) {
        dt__zero_on(opt->device, opt->grads, bytes);
        scaler->scale *= 0.5f;
        scaler->good_steps = 0;
        scaler->skipped++;
        scaler->last_skipped = 1;
        return 0;
    }
    float inv = 1.0f / scaler->scale;                /* a power of two: exact */
    const dt_backend *gpu = dt__backend_of(opt->device);
    if (gpu) gpu->scale(opt->grads, inv, opt->numel);
    else
        for (int64_t i = 0; i < opt->numel; i++) opt->grads[i] *= inv;
    if (++scaler->good_steps >= scaler->growth_interval) { scaler->scale *= 2.0f; scaler->good_steps = 0; }
    return 1;
}

/* [src/10-collectives.h] */
/* ==== collectives ===========================================================
   Data parallel training needs a handful of collective operations: every rank
   contributes a buffer and gets back the sum (all-reduce), its share of the sum
   (reduce-scatter), everybody's pieces (all-gather), or rank root's buffer
   (broadcast). On GPUs NCCL does them (the cuda chapter); between CPU machines, MPI
   (below the shared-memory code). On one machine's CPU they go through
   shared memory: each rank copies its piece into its own slot, waits at a
   barrier, then each rank sums one stripe of every slot IN RANK ORDER and
   writes the result where all can read it. Summing in a fixed order is what
   makes runs repeat bit for bit: float addition is not associative, and a
   timing-dependent order would give different bits every run.

   Tensor and pipeline parallelism (stage 06 and after) need two more things.
   Groups: a communicator of some of the ranks (dt_comm_split), with shared
   memory and a communication thread of its own, so that the pairs of a mesh
   all-reduce side by side. And messages between two ranks (dt_send, dt_recv),
   which pass through the sender's slot a piece at a time.

   Barriers are where a dead rank would make the others wait forever, so every
   wait looks, now and then, at the other ranks: one that failed (it wrote its
   rank into the job's shared header, which every group watches), one whose
   process is gone, or one that has not arrived within --timeout, stops the
   waiting rank with a message naming it by its rank in the job. */

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define DT_MAX_RANKS 64
#define DT_SLOT_BYTES ((size_t)2 << 20)     /* each rank's staging slot: collectives go in 2 MiB pieces */

/* Point-to-point from rank s to rank d: the sender publishes pieces (`sent`),
   the receiver counts those it has copied out (`taken`); the size of the
   message rides along so that the receiver can check it expects the same. */
typedef struct dt__shm_pair {
    uint64_t sent, taken;
    int64_t count;
    int32_t dtype, unused;
} dt__shm_pair;
typedef struct dt__shm_header {
    uint64_t magic;
    int world, abort_rank;                  /* abort_rank: 1 + a rank that failed, else 0 */
    int pid[DT_MAX_RANKS];
    uint64_t arrived[DT_MAX_RANKS];         /* barriers each rank has reached */
    /* then world x world dt__shm_pair, [sender][receiver] */
} dt__shm_header;
#define DT_SHM_MAGIC 0x647472616e316d73ull
static size_t dt__shm_header_bytes(int world) {
    return (sizeof(dt__shm_header) + (size_t)world * (size_t)world * sizeof(dt__shm_pair) + 4095) & ~(size_t)4095;
}
static size_t dt__shm_bytes(int world) { return dt__shm_header_bytes(world) + (size_t)(world + 1) * DT_SLOT_BYTES; }

static const char *dt__coll_names[] = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier",
                                       "send", "recv", "ring_shift" };

struct dt_comm_group { dt__shm_header *hdr; int world; double timeout_s; int members; /* joined, not yet freed */ };

struct dt_comm {
    const dt_comm_backend *backend;
    int rank, world;
    /* A group (dt_comm_split) answers to the job's communicator, `top`: a
       failure is recorded there, and messages name ranks as the job does. */
    dt_comm *top, *parent;
    int children;                           /* groups split from it and not yet freed */
    dt_comm_group *joined;                  /* thread ranks: the group it joined */
    int users;                              /* parallel wrappers that use it (dt__comm_hold) */
    const char *user_free_fn;               /* and what frees the last of them */
    int in_mesh;                            /* a mesh's: dt_mesh_free frees it */
    int job_rank[DT_MAX_RANKS];             /* rank in top of each of our ranks */
#ifdef DT_TESTING
    int die_in_all_reduce;                  /* test hook, see dt__comm_start: die in this all-reduce (from 1) */
#endif
    double timeout_s;
    dt__shm_header *hdr;                     /* shared memory: header, world slots, a result area */
    char *slots, *result;
    size_t map_bytes;                       /* > 0: a mapping of our own to undo */
    uint64_t barriers;
    dt_nccl *nccl;                          /* NCCL's state (the cuda chapter) */
#ifdef DT_HAVE_MPI
    MPI_Comm mpi;                           /* MPI's: the communicator, the call in flight, a buffer it needs */
    MPI_Request mpi_request, mpi_request_recv;   /* the second: a ring shift's receive */
    float *mpi_temp, *mpi_result;
#endif
    void *private_hdr;                      /* a header of our own (MPI: no memory is shared), freed with it */
    pthread_t worker;                       /* the communication thread and its queue */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    dt_comm_op queue[DT_COMM_QUEUE];
    double started_ms[DT_COMM_QUEUE], finished_ms[DT_COMM_QUEUE];   /* when the thread ran each call */
    int64_t submitted, started, completed;  /* calls queued, started by the thread, finished */
    int stop;
};

static dt_comm *dt__active_comm;             /* for dt_fail: tell the other ranks we are going */

/* The test suite's hooks (a rank that dies on cue) exist only in its own
   builds, made with -DDT_TESTING; in any other build they are nothing. */
#ifdef DT_TESTING
#define DT_TEST_DIE_IN(c, o) \
    do { if ((o)->kind == DT_COLL_ALL_REDUCE && (c)->die_in_all_reduce > 0 && --(c)->die_in_all_reduce == 0) raise(SIGKILL); } while (0)
#define DT_TEST_DIE_IN_SEND(c) \
    do { if (__atomic_load_n(&dt__test_die_in_send, __ATOMIC_RELAXED) > 0 && \
             __atomic_sub_fetch(&dt__test_die_in_send, 1, __ATOMIC_RELAXED) == 0) raise(SIGKILL); } while (0)
static int dt__test_die_in_send;             /* DT_TEST_DIE_SEND: this rank's sends on any communicator, counted */
/* DT_TEST_BARRIER_LATE="r ms look_ms": rank r of the job reaches each barrier
   (dt_barrier) ms late, and a rank waiting in one sleeps look_ms before its
   first look at whether its peer is alive -- so a peer can arrive, pass the
   job's last barrier and exit between the waiter's two looks. */
static void dt__test_barrier_late(const dt_comm *c, const char *what, int arriving) {
    const char *v = getenv("DT_TEST_BARRIER_LATE");
    int r = -1, ms = 0, look_ms = 0;
    if (!v || strcmp(what, "barrier") != 0 || sscanf(v, "%d %d %d", &r, &ms, &look_ms) != 3) return;
    int wait = arriving ? (c->job_rank[c->rank] == r ? ms : 0) : look_ms;
    struct timespec ts = { wait / 1000, (long)(wait % 1000) * 1000000L };
    if (wait > 0) nanosleep(&ts, NULL);
}
#define DT_TEST_BARRIER_LATE(c, what, arriving) dt__test_barrier_late(c, what, arriving)
#else
#define DT_TEST_DIE_IN(c, o) ((void)0)
#define DT_TEST_DIE_IN_SEND(c) ((void)0)
#define DT_TEST_BARRIER_LATE(c, what, arriving) ((void)0)
#endif


/* Is process `pid` gone (or a zombie nobody has reaped yet)? */
static int dt__process_gone(int pid) {
    if (pid <= 0 || pid == getpid()) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')');
    return close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z';
}

/* Tell every rank that `culprit` (a rank of c) ended the job; the first cause
   recorded wins. It goes to the job's header, which every group watches. */
static void dt__comm_abort_others_because(dt_comm *c, int culprit) {
    int none = 0;
    if (c && c->top->hdr)
        __atomic_compare_exchange_n(&c->top->hdr->abort_rank, &none, c->job_rank[culprit] + 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
}
static void dt__comm_abort_others(dt_comm *c) { if (c) dt__comm_abort_others_because(c, c->rank); }
static void dt__comm_on_fail(void) { dt__comm_abort_others(dt__active_comm); }

/* Why the job cannot go on, if it cannot: a rank failed (it wrote its rank
   into the shared header), a peer's process is gone, or we have waited past
   --timeout for rank j (j < 0: for any peer). Fills `why` and returns 1; the
   shared-memory barrier and the NCCL watchdog both ask this. */
static int dt__job_trouble(dt_comm *c, int j, double waited_ms, const char *what, char *why, size_t n) {
    int failed = __atomic_load_n(&c->top->hdr->abort_rank, __ATOMIC_ACQUIRE);
    if (failed) {
        dt__active_comm = NULL;              /* it told us; no need to tell it back */
        snprintf(why, n, "rank %d failed or died (see above), so %s cannot finish; stopping", failed - 1, what);
        return 1;
    }
    for (int r = j < 0 ? 0 : j; r < (j < 0 ? c->world : j + 1); r++) {
        int pid = __atomic_load_n(&c->hdr->pid[r], __ATOMIC_ACQUIRE);
        if (r != c->rank && dt__process_gone(pid)) {
            dt__comm_abort_others_because(c, r);
            snprintf(why, n, "rank %d (pid %d) died during %s; stopping", c->job_rank[r], pid, what);
            return 1;
        }
    }
    if (waited_ms <= c->timeout_s * 1e3) return 0;
    if (j >= 0)
        snprintf(why, n, "rank %d has not reached %s after %.0f s (--timeout): it hangs or died; stopping", c->job_rank[j],
                 what, c->timeout_s);
    else snprintf(why, n, "%s has not finished after %.0f s (--timeout): a rank hangs or died; stopping", what, c->timeout_s);
    return 1;
}
static void dt__check_peer(dt_comm *c, int j, double waited_ms, const char *what) {
    char why[320];
    if (dt__job_trouble(c, j, waited_ms, what, why, sizeof why)) dt_fail("%s", why);
}

/* Wait until rank j has moved `*counter` to `target`. Spin a little, then
   yield, then sleep: ranks may outnumber cores. *t0 is when the waiting began
   (0: not yet), kept across the peers of one barrier. */
static void dt__shm_wait_for(dt_comm *c, const uint64_t *counter, uint64_t target, int j, const char *what, double *t0) {
    for (long spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < target; spins++) {
        if (spins < 100) continue;
        if (spins < 1000) { sched_yield(); continue; }
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
        if (spins % 256 == 0) {
            if (*t0 == 0) { *t0 = dt_now_ms(); DT_TEST_BARRIER_LATE(c, what, 0); }
            /* A peer may arrive and then end (its last barrier passed, it
               exits) between our look at the counter and our look at it:
               gone, with the counter reached, it is done, not dead. */
            if (dt__process_gone(__atomic_load_n(&c->hdr->pid[j], __ATOMIC_ACQUIRE)) &&
                __atomic_load_n(counter, __ATOMIC_ACQUIRE) >= target)
                break;
            dt__check_peer(c, j, dt_now_ms() - *t0, what);
        }
    }
}
/* Every rank counts its barriers; a barrier is done when every count has caught up. */
static void dt__shm_barrier(dt_comm *c, const char *what) {
    uint64_t target = ++c->barriers;
    DT_TEST_BARRIER_LATE(c, what, 1);
    __atomic_store_n(&c->hdr->arrived[c->rank], target, __ATOMIC_RELEASE);
    double t0 = 0;
    for (int j = 0; j < c->world; j++) dt__shm_wait_for(c, &c->hdr->arrived[j], target, j, what, &t0);
}

/* Point-to-point through the sender's slot, a piece at a time: the sender
   copies a piece in and publishes it, the receiver copies it out and says so.
   So a send finishes when its peer has received it. A zero-length message
   still makes one exchange, so that its size is checked too. */
static dt__shm_pair *dt__shm_pair_of(const dt_comm *c, int from, int to) {
    return (dt__shm_pair *)(c->hdr + 1) + (size_t)from * (size_t)c->world + (size_t)to;
}
static void dt__shm_send(dt_comm *c, const dt_comm_op *o) {
    dt__shm_pair *p = dt__shm_pair_of(c, c->rank, o->root);
    size_t es = dt_dtype_size(o->dtype);
    int64_t per_slot = (int64_t)(DT_SLOT_BYTES / es), off = 0;
    char *mine = c->slots + (size_t)c->rank * DT_SLOT_BYTES, what[64];
    snprintf(what, sizeof what, "the recv matching rank %d's send", c->job_rank[c->rank]);
    p->count = o->count;                    /* published with the first piece */
    p->dtype = (int32_t)o->dtype;
    double t0 = 0;
    do {
        int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
        memcpy(mine, (const char *)o->send + off * (int64_t)es, (size_t)n * es);
        uint64_t target = p->sent + 1;      /* only this rank writes `sent` */
        __atomic_store_n(&p->sent, target, __ATOMIC_RELEASE);
        DT_TEST_DIE_IN_SEND(c);
        dt__shm_wait_for(c, &p->taken, target, o->root, what, &t0);
        off += n;
    } while (off < o->count);
}
static void dt__shm_recv(dt_comm *c, const dt_comm_op *o) {
    dt__shm_pair *p = dt__shm_pair_of(c, o->root, c->rank);
    size_t es = dt_dtype_size(o->dtype);
    int64_t per_slot = (int64_t)(DT_SLOT_BYTES / es), off = 0;
    const char *theirs = c->slots + (size_t)o->root * DT_SLOT_BYTES;
    char what[64];
    snprintf(what, sizeof what, "the send matching rank %d's recv", c->job_rank[c->rank]);
    double t0 = 0;
    do {
        uint64_t target = p->taken + 1;     /* only this rank writes `taken` */
        dt__shm_wait_for(c, &p->sent, target, o->root, what, &t0);
        if (off == 0 && (p->count != o->count || p->dtype != (int32_t)o->dtype))
            dt_fail("rank %d sends %lld elements of %s, but rank %d receives %lld of %s: a send and its recv must "
                    "agree on count and dtype", c->job_rank[o->root], (long long)p->count, dt_dtype_name((dt_dtype)p->dtype),
                    c->job_rank[c->rank], (long long)o->count, dt_dtype_name(o->dtype));
        int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
        memcpy((char *)o->recv + off * (int64_t)es, theirs, (size_t)n * es);
        __atomic_store_n(&p->taken, target, __ATOMIC_RELEASE);
        off += n;
    } while (off < o->count);
}

/* out[i] = in_0[i] + in_1[i] + ... in rank order (or their largest, DT_MAX), for i in [lo, hi) of the slots. */
static void dt__sum_slots(const dt_comm *c, int64_t slot_off, int64_t lo, int64_t hi, dt_dtype t, dt_reduce_op op,
                         void *out, int64_t out_off) {
    for (int64_t i = lo; i < hi; i++) {
        float acc = dt_load_f32(c->slots, slot_off + i, t);
        for (int r = 1; r < c->world; r++) {
            float v = dt_load_f32(c->slots + (size_t)r * DT_SLOT_BYTES, slot_off + i, t);
            acc = op == DT_MAX ? (v > acc ? v : acc) : acc + v;
        }
        if (op == DT_AVG) acc /= (float)c->world;
        dt_store_f32(out, out_off + i, t, acc);
    }
}

static void dt__shm_run(dt_comm *c, const dt_comm_op *o) {
    size_t es = dt_dtype_size(o->dtype);
    int64_t per_slot = (int64_t)(DT_SLOT_BYTES / es), W = c->world, me = c->rank;
    char *mine = c->slots + (size_t)me * DT_SLOT_BYTES;
    const char *send = (const char *)o->send;
    char *recv = (char *)o->recv;
    const char *what = dt__coll_names[o->kind];
    if (W == 1) {                         /* alone: every collective is a copy (or nothing); no peer to send to */
        if (o->kind != DT_COLL_BARRIER && recv != send) memmove(recv, send, (size_t)o->count * es);
        return;
    }
    switch (o->kind) {
    case DT_COLL_BARRIER: dt__shm_barrier(c, what); break;
    case DT_COLL_SEND: dt__shm_send(c, o); break;
    case DT_COLL_RECV: dt__shm_recv(c, o); break;
    case DT_COLL_RING_SHIFT:              /* each rank's piece into its slot; the previous rank's slot out */
        for (int64_t off = 0; off < o->count; off += per_slot) {
            int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
            memcpy(mine, send + off * es, (size_t)n * es);
            dt__shm_barrier(c, what);
            memcpy(recv + off * es, c->slots + (size_t)o->from * DT_SLOT_BYTES, (size_t)n * es);
            dt__shm_barrier(c, what);
        }
        break;
    case DT_COLL_ALL_REDUCE:
    case DT_COLL_REDUCE:
        for (int64_t off = 0; off < o->count; off += per_slot) {
            int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
            memcpy(mine, send + off * es, (size_t)n * es);
            dt__shm_barrier(c, what);
            DT_TEST_DIE_IN(c, o);
            dt__sum_slots(c, 0, n * me / W, n * (me + 1) / W, o->dtype, o->op, c->result, 0);   /* my stripe */
            dt__shm_barrier(c, what);
            if (o->kind == DT_COLL_ALL_REDUCE || me == o->root) memcpy(recv + off * es, c->result, (size_t)n * es);
            dt__shm_barrier(c, what);
        }
        break;
    case DT_COLL_REDUCE_SCATTER:          /* slot layout: W pieces of n, piece d for rank d */
        for (int64_t off = 0; off < o->count; off += per_slot / W) {
            int64_t n = o->count - off < per_slot / W ? o->count - off : per_slot / W;
            for (int64_t d = 0; d < W; d++) memcpy(mine + d * n * es, send + (d * o->count + off) * es, (size_t)n * es);
            dt__shm_barrier(c, what);
            dt__sum_slots(c, me * n, 0, n, o->dtype, o->op, recv + off * es, 0);
            dt__shm_barrier(c, what);
        }
        break;
    case DT_COLL_ALL_GATHER:
        for (int64_t off = 0; off < o->count; off += per_slot) {
            int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
            memcpy(mine, send + off * es, (size_t)n * es);
            dt__shm_barrier(c, what);
            for (int64_t r = 0; r < W; r++)
                memcpy(recv + (r * o->count + off) * es, c->slots + (size_t)r * DT_SLOT_BYTES, (size_t)n * es);
            dt__shm_barrier(c, what);
        }
        break;
    case DT_COLL_BROADCAST:
        for (int64_t off = 0; off < o->count; off += per_slot) {
            int64_t n = o->count - off < per_slot ? o->count - off : per_slot;
            char *root_slot = c->slots + (size_t)o->root * DT_SLOT_BYTES;
            if (me == o->root) memcpy(root_slot, recv + off * es, (size_t)n * es);
            dt__shm_barrier(c, what);
            if (me != o->root) memcpy(recv + off * es, root_slot, (size_t)n * es);
            dt__shm_barrier(c, what);
        }
        break;
    }
}

/* Where call h keeps its state in the ring of DT_COMM_QUEUE (h counts from 1). */
static int dt__comm_slot(int64_t h) { return (int)((h - 1) % DT_COMM_QUEUE); }

/* Shared memory: the communication thread does the whole collective in
   start(); the caller waits on the host until it is done. A group's shared
   memory is made by dt_comm_split for every backend (the watchdog reads it),
   so there is nothing more to split or close. */
static void dt__shm_submitted(dt_comm *c, int64_t h) { (void)c; (void)h; }
static void dt__shm_start(dt_comm *c, int64_t h, const dt_comm_op *o) { (void)h; dt__shm_run(c, o); }
static void dt__shm_finish(dt_comm *c, int64_t h) { (void)c; (void)h; }
static void dt__host_wait(dt_comm *c, int64_t h) {
    while (c->completed < h) pthread_cond_wait(&c->done, &c->mu);
}
static void dt__shm_split(dt_comm *parent, dt_comm *child, int color, int key) { (void)parent; (void)child; (void)color; (void)key; }
static void dt__shm_close(dt_comm *c) { (void)c; }
static const dt_comm_backend dt__comm_shm_backend = { "shared memory", DT_CPU, dt__shm_submitted, dt__shm_start, dt__shm_finish,
                                                     dt__host_wait, dt__shm_split, dt__shm_close, 1, 1 };

#ifdef DT_HAVE_CUDA
/* NCCL: wait until the communicator is ready for its next call (slot < 0) or
   collective `slot` has finished on the GPU, watching the job as the
   shared-memory barrier does -- a failed or vanished rank, or --timeout. It
   runs on the thread that issues the communicator's calls, the only one that
   may abort it. */
static void dt__nccl_watch(dt_comm *c, int slot, const char *what) {
    char why[320];
    double t0 = dt_now_ms();
    for (long spins = 0;; spins++) {
        int ready = dt_nccl_progress(c->nccl, why, sizeof why);
        if (ready > 0 && (slot < 0 || dt_nccl_finished(c->nccl, slot))) return;
        if (ready < 0) {
            dt_nccl_abort(c->nccl);
            dt_fail("NCCL failed during %s: %s (a rank may have died); communicator aborted", what, why);
        }
        if (spins < 200) continue;
        if (spins % 64 == 0 && dt__job_trouble(c, -1, dt_now_ms() - t0, what, why, sizeof why)) {
            dt_nccl_abort(c->nccl);
            dt_fail("%s (NCCL communicator aborted)", why);
        }
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
}
static void dt__nccl_submitted(dt_comm *c, int64_t h) { dt_nccl_mark_inputs(c->nccl, dt__comm_slot(h)); }
static void dt__nccl_start(dt_comm *c, int64_t h, const dt_comm_op *o) {
    int slot = dt__comm_slot(h);
    dt_nccl_issue(c->nccl, slot, o);
    dt__nccl_watch(c, -1, dt__coll_names[o->kind]);         /* a non-blocking call may still be in progress */
    dt_nccl_mark_done(c->nccl, slot);
    DT_TEST_DIE_IN(c, o);
}
static void dt__nccl_finish(dt_comm *c, int64_t h) {
    dt__nccl_watch(c, dt__comm_slot(h), dt__coll_names[c->queue[dt__comm_slot(h)].kind]);
}
static void dt__nccl_wait_on_gpu(dt_comm *c, int64_t h) { dt_nccl_stream_wait(c->nccl, dt__comm_slot(h)); }
/* The parent's thread is idle (dt_comm_split waited for it), so this thread
   may make calls on the parent's NCCL communicator. Untested: no GPU in CI. */
static void dt__nccl_split_comm(dt_comm *parent, dt_comm *child, int color, int key) {
    child->nccl = dt_nccl_split(parent->nccl, color, key);
    dt__nccl_watch(parent, -1, "NCCL's split");
    dt__nccl_watch(child, -1, "NCCL's split");
}
/* The thread is gone: this one owns the communicator now. */
static void dt__nccl_close(dt_comm *c) {
    dt_nccl_finalize(c->nccl);
    dt__nccl_watch(c, -1, "closing NCCL");
    dt_nccl_free(c->nccl);
}
static const dt_comm_backend dt__comm_nccl_backend = { "NCCL", DT_CUDA, dt__nccl_submitted, dt__nccl_start, dt__nccl_finish,
                                                      dt__nccl_wait_on_gpu, dt__nccl_split_comm, dt__nccl_close, 1, 0 };
#endif

#ifdef DT_HAVE_MPI
/* MPI: the transport of CPU clusters, for ranks on several hosts. The thread
   issues the call non-blocking (MPI_I...) in start() and tests it in finish(),
   watching --timeout as the shared-memory barrier does; the caller waits on
   the host. MPI has no average and no bf16 or fp16 arithmetic: a sum of 16-bit
   values travels as f32 and is divided (an average) and rounded once at the
   end, as shared memory does -- rounding at each of MPI's pairwise additions
   would lose bits, and overflow fp16 where f32 does not. MPI picks its own
   reduction order (a tree, a ring), so with more than two ranks a sum may
   differ from shared memory's rank order in the last bits; with two, a + b is
   a + b. A dead rank is the launcher's to notice: mpirun and srun end the job
   when a rank exits without MPI_Finalize. */
static void dt__mpi_check(int err, const char *what) {
    if (err == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(err, text, &len);
    dt_fail("MPI failed during %s: %.*s", what, len, text);
}
static int dt__mpi_initialized_here;         /* dtrain called MPI_Init, so it calls MPI_Finalize */

/* Once per process, on the first communicator that needs MPI. Groups have a
   communication thread each, so MPI must take calls from several threads. */
static void dt__mpi_init(void) {
    int ready = 0, done = 0, level = 0;
    MPI_Finalized(&done);
    if (done) dt_fail("MPI was already finalized in this process (its job's communicator was freed): MPI starts once per process");
    MPI_Initialized(&ready);
    if (!ready) {
        dt__mpi_check(MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level), "MPI_Init_thread");
        dt__mpi_initialized_here = 1;
    } else MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
        dt_fail("this MPI gives thread level %d, and dtrain's communication threads need MPI_THREAD_MULTIPLE (%d)", level,
                MPI_THREAD_MULTIPLE);
}
static void dt__mpi_finalize_if_ours(void) {
    if (dt__mpi_initialized_here) MPI_Finalize();
    dt__mpi_initialized_here = 0;
}

/* An all-reduce, reduce or reduce-scatter. In place where MPI allows it;
   through an f32 copy (c->mpi_temp) for 16-bit values, and for a
   reduce-scatter whose output lies in its input (MPI's in-place form would
   leave this rank's piece at the front). The result is then in c->mpi_result,
   for finish() to divide, round and store. */
static int dt__mpi_start_reduction(dt_comm *c, const dt_comm_op *o) {
    int n = (int)o->count, W = c->world, root = o->kind != DT_COLL_REDUCE || c->rank == o->root;
    int scatter = o->kind == DT_COLL_REDUCE_SCATTER;
    int64_t n_in = scatter ? o->count * W : o->count;
    size_t es = dt_dtype_size(o->dtype);
    MPI_Op op = o->op == DT_MAX ? MPI_MAX : MPI_SUM;
    const char *send = (const char *)o->send;
    char *recv = (char *)o->recv;
    int overlap = scatter && recv + (size_t)o->count * es > send && recv < send + (size_t)n_in * es;
    if (o->dtype == DT_F32 && !overlap) {
        const void *in = send == recv ? MPI_IN_PLACE : send;
        if (o->kind == DT_COLL_ALL_REDUCE) return MPI_Iallreduce(in, recv, n, MPI_FLOAT, op, c->mpi, &c->mpi_request);
        if (scatter) return MPI_Ireduce_scatter_block(send, recv, n, MPI_FLOAT, op, c->mpi, &c->mpi_request);
        return MPI_Ireduce(root ? in : send, root ? recv : NULL, n, MPI_FLOAT, op, o->root, c->mpi, &c->mpi_request);
    }
    float *f = (float *)malloc(sizeof(float) * (size_t)(n_in + (scatter ? o->count : 0)) + 1);
    if (!f) dt_fail("out of memory (MPI %s of %lld elements)", dt__coll_names[o->kind], (long long)n_in);
    for (int64_t i = 0; i < n_in; i++) f[i] = dt_load_f32(send, i, o->dtype);
    c->mpi_temp = f;
    c->mpi_result = scatter ? f + n_in : root ? f : NULL;
    if (o->kind == DT_COLL_ALL_REDUCE) return MPI_Iallreduce(MPI_IN_PLACE, f, n, MPI_FLOAT, op, c->mpi, &c->mpi_request);
    if (scatter) return MPI_Ireduce_scatter_block(f, f + n_in, n, MPI_FLOAT, op, c->mpi, &c->mpi_request);
    return MPI_Ireduce(root ? MPI_IN_PLACE : f, root ? f : NULL, n, MPI_FLOAT, op, o->root, c->mpi, &c->mpi_request);
}

static void dt__mpi_submitted(dt_comm *c, int64_t h) { (void)c; (void)h; }
static void dt__mpi_start(dt_comm *c, int64_t h, const dt_comm_op *o) {
    (void)h;
    const char *what = dt__coll_names[o->kind];
    if (o->count > INT_MAX)
        dt_fail("%s of %lld elements over MPI: at most %d in one call (MPI counts are int)", what, (long long)o->count, INT_MAX);
    int n = (int)o->count;
    size_t bytes = (size_t)o->count * dt_dtype_size(o->dtype);
    MPI_Datatype type = o->dtype == DT_F32 ? MPI_FLOAT : MPI_UINT16_T;   /* moved, not added: bits are bits */
    char *recv = (char *)o->recv;
    c->mpi_temp = NULL;
    c->mpi_result = NULL;
    int err = MPI_SUCCESS;
    switch (o->kind) {
    case DT_COLL_BARRIER: err = MPI_Ibarrier(c->mpi, &c->mpi_request); break;
    case DT_COLL_ALL_REDUCE:
    case DT_COLL_REDUCE:
    case DT_COLL_REDUCE_SCATTER: err = dt__mpi_start_reduction(c, o); break;
    case DT_COLL_ALL_GATHER: {       /* in place when our piece is already where it goes */
        const char *s = (const char *)o->send;
        if (s + bytes > recv && s < recv + bytes * (size_t)c->world) {
            memmove(recv + (size_t)c->rank * bytes, s, bytes);
            s = (const char *)MPI_IN_PLACE;
        }
        err = MPI_Iallgather(s, n, type, recv, n, type, c->mpi, &c->mpi_request);
        break;
    }
    case DT_COLL_BROADCAST: err = MPI_Ibcast(recv, n, type, o->root, c->mpi, &c->mpi_request); break;
    /* A synchronous send finishes when its peer has received it, as shared
       memory's does; the tag carries the dtype, for the check in finish. */
    case DT_COLL_SEND: err = MPI_Issend(o->send, n, type, o->root, (int)o->dtype, c->mpi, &c->mpi_request); break;
    case DT_COLL_RECV: err = MPI_Irecv(recv, n, type, o->root, MPI_ANY_TAG, c->mpi, &c->mpi_request); break;
    case DT_COLL_RING_SHIFT:              /* both at once (MPI_Isendrecv is MPI 4's), told apart by their tag */
        err = MPI_Irecv(recv, n, type, o->from, DT_COLL_RING_SHIFT, c->mpi, &c->mpi_request_recv);
        if (err == MPI_SUCCESS) err = MPI_Isend(o->send, n, type, o->root, DT_COLL_RING_SHIFT, c->mpi, &c->mpi_request);
        break;
    }
    dt__mpi_check(err, what);
    DT_TEST_DIE_IN(c, o);
}
static void dt__mpi_finish(dt_comm *c, int64_t h) {
    const dt_comm_op *o = &c->queue[dt__comm_slot(h)];
    const char *what = dt__coll_names[o->kind];
    MPI_Status status;
    char why[320];
    double t0 = dt_now_ms();
    for (long spins = 0;; spins++) {
        int done = 0, err = MPI_Test(&c->mpi_request, &done, &status), type = 0;
        if (err == MPI_SUCCESS && done && o->kind == DT_COLL_RING_SHIFT) err = MPI_Test(&c->mpi_request_recv, &done, &status);
        MPI_Error_class(err, &type);
        if (o->kind == DT_COLL_RECV && type == MPI_ERR_TRUNCATE)
            dt_fail("rank %d sent more than the %lld elements of %s rank %d receives: a send and its recv must agree on count and "
                    "dtype", c->job_rank[o->root], (long long)o->count, dt_dtype_name(o->dtype), c->job_rank[c->rank]);
        dt__mpi_check(err, what);
        if (done) break;
        if (spins < 200) continue;
        if (spins % 64 == 0 && dt__job_trouble(c, -1, dt_now_ms() - t0, what, why, sizeof why)) dt_fail("%s (over MPI)", why);
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
    if (o->kind == DT_COLL_RECV) {
        int got = 0;
        MPI_Get_count(&status, o->dtype == DT_F32 ? MPI_FLOAT : MPI_UINT16_T, &got);
        if (status.MPI_TAG != (int)o->dtype || got != o->count)
            dt_fail("rank %d sent %d elements of %s, but rank %d receives %lld of %s: a send and its recv must agree on count "
                    "and dtype", c->job_rank[o->root], got, dt_dtype_name((dt_dtype)status.MPI_TAG), c->job_rank[c->rank],
                    (long long)o->count, dt_dtype_name(o->dtype));
    }
    int reduced = o->kind == DT_COLL_ALL_REDUCE || o->kind == DT_COLL_REDUCE_SCATTER || (o->kind == DT_COLL_REDUCE && c->rank == o->root);
    float divisor = reduced && o->op == DT_AVG ? (float)c->world : 1.0f;
    if (c->mpi_result)                       /* from f32: divided, then rounded once */
        for (int64_t i = 0; i < o->count; i++) dt_store_f32(o->recv, i, o->dtype, c->mpi_result[i] / divisor);
    else if (divisor != 1.0f)
        for (int64_t i = 0; i < o->count; i++) ((float *)o->recv)[i] /= divisor;
    free(c->mpi_temp);
    c->mpi_temp = NULL;
    c->mpi_result = NULL;
}
/* The parent's thread is idle (dt_comm_split waited for it). */
static void dt__mpi_split(dt_comm *parent, dt_comm *child, int color, int key) {
    dt__mpi_check(MPI_Comm_split(parent->mpi, color, key, &child->mpi), "MPI_Comm_split");
    MPI_Comm_set_errhandler(child->mpi, MPI_ERRORS_RETURN);
}
static void dt__mpi_close(dt_comm *c) {
    MPI_Comm_free(&c->mpi);
    if (!c->parent) dt__mpi_finalize_if_ours();
}
static const dt_comm_backend dt__comm_mpi_backend = { "MPI", DT_CPU, dt__mpi_submitted, dt__mpi_start, dt__mpi_finish,
                                                     dt__host_wait, dt__mpi_split, dt__mpi_close, 0, 0 };
#endif

/* The communication thread: runs queued collectives one after another, so the
   caller can go on computing (DDP overlaps the all-reduce with backward). */
static void *dt__comm_worker(void *arg) {
    dt_comm *c = (dt_comm *)arg;
    dt__flush_subnormals_here();             /* no OpenMP team of its own: it only copies and adds */
    dt__ctx.rank = c->job_rank[c->rank];     /* its error lines name the rank too, as the job does */
    dt__ctx.world_size = c->top->world;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && c->completed == c->submitted) pthread_cond_wait(&c->wake, &c->mu);
        if (c->completed == c->submitted) break;
        int64_t h = c->completed + 1;
        int slot = dt__comm_slot(h);
        dt_comm_op o = c->queue[slot];
        pthread_mutex_unlock(&c->mu);
        c->started_ms[slot] = dt_now_ms();
        c->backend->start(c, h, &o);
        pthread_mutex_lock(&c->mu);
        c->started = h;                      /* a caller may now wait for it (on the GPU: behind it) */
        pthread_cond_broadcast(&c->done);
        pthread_mutex_unlock(&c->mu);
        c->backend->finish(c, h);
        pthread_mutex_lock(&c->mu);
        c->finished_ms[slot] = dt_now_ms();
        c->completed = h;
        pthread_cond_broadcast(&c->done);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* A buffer of the wrong kind is caught here, before any transport sees it:
   NCCL takes device memory only, shared memory host memory only. */
static void dt__comm_check_buffer(const dt_comm *c, const dt_comm_op *o, const void *p) {
    if (!p || o->count == 0) return;
    int on_gpu = dt__ctx.gpu && dt__ctx.gpu->owns(p);
    if (on_gpu != (c->backend->memory == DT_CUDA))
        dt_fail("%s over %s: a buffer is %s memory, but %s takes %s memory only", dt__coll_names[o->kind], c->backend->name,
                on_gpu ? "GPU" : "host", c->backend->name, c->backend->memory == DT_CUDA ? "GPU" : "host");
}

static dt_comm_handle dt__comm_submit(dt_comm *c, dt_comm_op o) {
    int p2p = o.kind == DT_COLL_SEND || o.kind == DT_COLL_RECV;
    if (o.count < 0) dt_fail("%s of %lld elements", dt__coll_names[o.kind], (long long)o.count);
    if (o.root < 0 || o.root >= c->world)
        dt_fail("%s: %s %d is not a rank (the communicator has %d)", dt__coll_names[o.kind], p2p ? "peer" : "root", o.root,
                c->world);
    if (p2p && o.root == c->rank)
        dt_fail("%s: the peer is this rank (%d); a message goes to another rank of the communicator", dt__coll_names[o.kind],
                o.root);
    dt__comm_check_buffer(c, &o, o.send);
    dt__comm_check_buffer(c, &o, o.recv);
    pthread_mutex_lock(&c->mu);
    while (c->submitted - c->completed >= DT_COMM_QUEUE) pthread_cond_wait(&c->done, &c->mu);
    dt_comm_handle h = ++c->submitted;
    c->queue[dt__comm_slot(h)] = o;
    c->backend->submitted(c, h);
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mu);
    return h;
}
/* Under the lock, so that call h's slot cannot be reused while we look at it. */
void dt_comm_wait(dt_comm *c, dt_comm_handle h) {
    pthread_mutex_lock(&c->mu);
    while (c->started < h) pthread_cond_wait(&c->done, &c->mu);
    if (c->completed < h) c->backend->wait(c, h);
    pthread_mutex_unlock(&c->mu);
}

dt_comm_handle dt_all_reduce_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op) {
    dt_comm_op o = { DT_COLL_ALL_REDUCE, send, recv, count, dtype, op, 0, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_reduce_scatter_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op) {
    dt_comm_op o = { DT_COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_all_gather_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    dt_comm_op o = { DT_COLL_ALL_GATHER, send, recv, count, dtype, DT_SUM, 0, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_broadcast_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int root) {
    dt_comm_op o = { DT_COLL_BROADCAST, buf, buf, count, dtype, DT_SUM, root, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_reduce_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op, int root) {
    dt_comm_op o = { DT_COLL_REDUCE, send, recv, count, dtype, op, root, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_send_async(dt_comm *c, const void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_op o = { DT_COLL_SEND, buf, NULL, count, dtype, DT_SUM, peer, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_recv_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_op o = { DT_COLL_RECV, NULL, buf, count, dtype, DT_SUM, peer, 0 };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_ring_shift_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    size_t bytes = count > 0 ? (size_t)count * dt_dtype_size(dtype) : 0;
    if (bytes && (const char *)send < (const char *)recv + bytes && (const char *)recv < (const char *)send + bytes)
        dt_fail("ring_shift: send and recv overlap; the sent buffer must stay whole while the received one arrives");
    dt_comm_op o = { DT_COLL_RING_SHIFT, send, recv, count, dtype, DT_SUM, (c->rank + 1) % c->world,
                     (c->rank + c->world - 1) % c->world };
    return dt__comm_submit(c, o);
}
void dt_all_reduce(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op) {
    dt_comm_wait(c, dt_all_reduce_async(c, send, recv, count, dtype, op));
}
void dt_reduce_scatter(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op) {
    dt_comm_wait(c, dt_reduce_scatter_async(c, send, recv, count, dtype, op));
}
void dt_all_gather(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    dt_comm_wait(c, dt_all_gather_async(c, send, recv, count, dtype));
}
void dt_broadcast(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int root) {
    dt_comm_wait(c, dt_broadcast_async(c, buf, count, dtype, root));
}
void dt_reduce(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op, int root) {
    dt_comm_wait(c, dt_reduce_async(c, send, recv, count, dtype, op, root));
}
void dt_send(dt_comm *c, const void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_wait(c, dt_send_async(c, buf, count, dtype, peer));
}
void dt_recv(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_wait(c, dt_recv_async(c, buf, count, dtype, peer));
}
void dt_ring_shift(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    dt_comm_wait(c, dt_ring_shift_async(c, send, recv, count, dtype));
}
/* A barrier holds the host, on a GPU too (whose dt_comm_wait would only hold
   the GPU): what follows it -- reading a file another rank wrote -- happens on
   the host. Its finishing means every rank has reached it. */
void dt_barrier(dt_comm *c) {
    dt_comm_op o = { DT_COLL_BARRIER, NULL, NULL, 0, DT_F32, DT_SUM, 0, 0 };
    dt_comm_handle h = dt__comm_submit(c, o);
    pthread_mutex_lock(&c->mu);
    dt__host_wait(c, h);
    pthread_mutex_unlock(&c->mu);
}
int dt_comm_rank(const dt_comm *c) { return c->rank; }
/* When the communication thread started and finished the call behind h (after
   dt_comm_wait; kept for the last DT_COMM_QUEUE calls). On a GPU the wait
   returns before the call has finished: then "finished" is "now". */
static void dt__comm_interval(dt_comm *c, dt_comm_handle h, double *t0, double *t1) {
    pthread_mutex_lock(&c->mu);
    *t0 = c->started_ms[dt__comm_slot(h)];
    *t1 = c->completed >= h ? c->finished_ms[dt__comm_slot(h)] : dt_now_ms();   /* a GPU may still be on it */
    pthread_mutex_unlock(&c->mu);
}
int dt_comm_size(const dt_comm *c) { return c->world; }
const char *dt_comm_backend_name(const dt_comm *c) { return c->backend->name; }
int dt_comm_sums_in_rank_order(const dt_comm *c) { return c->backend->sums_in_rank_order; }

/* Host values into and out of a collective: they travel through memory of
   the kind the communicator takes (NCCL reads device memory only), in the
   step arena. */
static void *dt__comm_stage(dt_comm *c, const void *host, size_t bytes) {
    void *buf = dt__step_alloc_on(c->backend->memory, bytes);
    if (host) dt__upload_to(c->backend->memory, buf, host, bytes);
    return buf;
}
static void dt__comm_all_reduce_host(dt_comm *c, float *values, int n, dt_reduce_op op) {
    size_t bytes = sizeof(float) * (size_t)n;
    float *buf = (float *)dt__comm_stage(c, values, bytes);
    dt_all_reduce(c, buf, buf, n, DT_F32, op);
    dt__download_from(c->backend->memory, values, buf, bytes);
}
/* Every rank's `bytes` (a multiple of 4) into all, rank after rank. */
static void dt__comm_all_gather_host(dt_comm *c, const void *mine, void *all, size_t bytes) {
    void *send = dt__comm_stage(c, mine, bytes), *recv = dt__comm_stage(c, NULL, bytes * (size_t)c->world);
    dt_all_gather(c, send, recv, (int64_t)(bytes / 4), DT_F32);     /* bytes travel as they are */
    dt__download_from(c->backend->memory, all, recv, bytes * (size_t)c->world);
}

void dt_comm_check_agree(dt_comm *c, const char *what, const char *value) {
    enum { LEN = 64 };
    char mine[LEN] = { 0 };
    char *all = (char *)calloc((size_t)c->world, LEN);
    if (!all) dt_fail("out of memory (start-up check)");
    size_t len = strlen(value);
    if (len < LEN) dt__copy_str(mine, LEN, value);
    else {                                   /* a long one (a path): a hash of it all, and its end */
        uint32_t h = 2166136261u;
        for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)value[i]) * 16777619u;
        snprintf(mine, LEN, "#%08x ...%s", (unsigned)h, value + len - (LEN - 15));
    }
    dt__comm_all_gather_host(c, mine, all, LEN);
    for (int r = 1; r < c->world; r++)
        if (strncmp(all, all + (size_t)r * LEN, LEN) != 0)
            dt_fail("the ranks disagree on %s: rank 0 has '%s', rank %d has '%s' (every rank needs the same flags)",
                    what, all, r, all + (size_t)r * LEN);
    free(all);
}

static dt_comm *dt__comm_new(int rank, int world, double timeout_s) {
    dt_comm *c = (dt_comm *)calloc(1, sizeof(dt_comm));
    if (!c) dt_fail("out of memory (communicator)");
    c->rank = rank; c->world = world; c->timeout_s = timeout_s > 0 ? timeout_s : 60;
    c->backend = &dt__comm_shm_backend;
    c->top = c;
    for (int r = 0; r < world; r++) c->job_rank[r] = r;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->wake, NULL);
    pthread_cond_init(&c->done, NULL);
    return c;
}
static void dt__comm_start(dt_comm *c, dt__shm_header *hdr) {
    c->hdr = hdr;
    if (c->backend->shares_memory) {         /* the slots follow a shared header */
        c->slots = (char *)hdr + dt__shm_header_bytes(c->world);
        c->result = c->slots + (size_t)c->world * DT_SLOT_BYTES;
    }
    __atomic_store_n(&hdr->pid[c->rank], (int)getpid(), __ATOMIC_RELEASE);
#ifdef DT_TESTING
    /* Fault tests: DT_TEST_DIE_RANK=r makes rank r of the job kill itself in the
       middle of its first all-reduce (or its DT_TEST_DIE_CALL-th) on a
       communicator, after the others have started it. */
    const char *die = getenv("DT_TEST_DIE_RANK"), *call = getenv("DT_TEST_DIE_CALL");
    const char *send = getenv("DT_TEST_DIE_SEND");    /* ... or in its N-th send, on any communicator */
    c->die_in_all_reduce = die && atoi(die) == c->job_rank[c->rank] && c->world > 1 && !send ? (call ? atoi(call) : 1) : 0;
    if (!c->parent && die && atoi(die) == c->job_rank[c->rank] && send) dt__test_die_in_send = atoi(send);
#endif
    if (pthread_create(&c->worker, NULL, dt__comm_worker, c) != 0) dt_fail("cannot start the communication thread");
    dt_comm *none = NULL;                   /* the first communicator speaks for the job when we fail */
    if (!c->parent) __atomic_compare_exchange_n(&dt__active_comm, &none, c, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    __atomic_store_n(&dt__on_fail, dt__comm_on_fail, __ATOMIC_RELEASE);
}

/* A named shared-memory segment of `bytes`, made (create: its name goes on
   the list of files dt_fail removes, slot in *cleanup) or opened, and mapped. */
static int dt__shm_serial;                   /* names this process's segments apart */
/* Is `name` one dtrain makes for this user: /dtrain-<uid>-<pid>-<n>? */
static void dt__shm_name_check(const char *name) {
    char want[32];
    int uid = -1, pid = -1, serial = -1, used = 0;
    snprintf(want, sizeof want, "/dtrain-%d-", (int)getuid());
    if (strncmp(name, want, strlen(want)) || sscanf(name, "/dtrain-%d-%d-%d%n", &uid, &pid, &serial, &used) != 3 ||
        used != (int)strlen(name) || pid <= 0 || serial < 0)
        dt_fail("rendezvous: rank 0 named the shared memory '%.80s', not one dtrain makes for this user (%s<pid>-<n>): is it "
                "a dtrain rank 0 of this job?", name, want);
}
static dt__shm_header *dt__shm_map(const char *name, size_t bytes, int create, int *cleanup) {
    int fd;
    if (create) {
        char file[128];
        snprintf(file, sizeof file, "/dev/shm%s", name);
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0) *cleanup = dt__cleanup_add(file);
        if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
            dt_fail("cannot create shared memory %s of %.1f MB: %s (is /dev/shm full?)", name, bytes / 1e6, strerror(errno));
#ifdef DT_TESTING
        if (getenv("DT_TEST_DIE_MADE_SEGMENT")) raise(SIGKILL);   /* fault tests: rank 0 dies with the segment made */
#endif
    } else {
        /* The name came over the network: only a segment this user's rank 0 made for this job is mapped -- named
           as dtrain names them for this user, owned by this user, no one else may touch it, of the size asked
           (a rank once wrote its gradients into another user's segment of mode 0666, named by a fake rank 0). */
        dt__shm_name_check(name);
        struct stat st;
        fd = shm_open(name, O_RDWR, 0600);
        if (fd < 0) dt_fail("cannot open the shared memory %s another rank made: %s (are all ranks on one machine?)", name,
                            strerror(errno));
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) ||
            (uint64_t)st.st_size != (uint64_t)bytes)
            dt_fail("rendezvous: the shared memory %s is not this job's: owner %d, mode %03o, %lld bytes (this rank's "
                    "user is %d: a segment of its own, mode 600, of %zu bytes)", name, (int)st.st_uid,
                    (unsigned)(st.st_mode & 0777), (long long)st.st_size, (int)geteuid(), bytes);
    }
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) dt_fail("cannot map shared memory %s: %s", name, strerror(errno));
    close(fd);
    dt__mem_count(DT_ARENA_COMM, bytes, +1);
    return (dt__shm_header *)map;
}

/* The watchdog's header for ranks that share no memory (MPI): this rank's own
   pid, abort flag and counts; the others' stay 0, which the watchdog reads as
   "nothing known", so only --timeout applies -- and the launcher, which ends
   the job when a rank dies. */
static dt__shm_header *dt__private_header(dt_comm *c) {
    c->private_hdr = calloc(1, dt__shm_header_bytes(c->world));
    if (!c->private_hdr) dt_fail("out of memory (communicator header)");
    dt__shm_header *hdr = (dt__shm_header *)c->private_hdr;
    hdr->magic = DT_SHM_MAGIC;
    hdr->world = c->world;
    return hdr;
}

dt_comm_group *dt_comm_group_create(int world, double timeout_s) {
    if (world < 1 || world > DT_MAX_RANKS) dt_fail("a group of %d ranks (1 to %d)", world, DT_MAX_RANKS);
    dt_comm_group *g = (dt_comm_group *)calloc(1, sizeof *g);
    void *mem = NULL;
    if (!g || posix_memalign(&mem, 4096, dt__shm_bytes(world)) != 0) dt_fail("out of memory (thread group)");
    memset(mem, 0, dt__shm_header_bytes(world));
    g->hdr = (dt__shm_header *)mem;
    g->hdr->magic = DT_SHM_MAGIC;
    g->hdr->world = g->world = world;
    g->timeout_s = timeout_s;
    dt__mem_count(DT_ARENA_COMM, dt__shm_bytes(world), +1);
    return g;
}
dt_comm *dt_comm_join(dt_comm_group *g, int rank) {
    if (rank < 0 || rank >= g->world) dt_fail("rank %d outside a group of %d", rank, g->world);
    dt_comm *c = dt__comm_new(rank, g->world, g->timeout_s);
    dt__comm_start(c, g->hdr);
    c->joined = g;
    __atomic_add_fetch(&g->members, 1, __ATOMIC_ACQ_REL);
    return c;
}
void dt_comm_group_free(dt_comm_group *group) {
    if (!group) return;
    int open = __atomic_load_n(&group->members, __ATOMIC_ACQUIRE);
    if (open) dt_fail("dt_comm_group_free: %d rank(s) that joined it are still open; call dt_comm_free on each first", open);
    dt__mem_count(DT_ARENA_COMM, dt__shm_bytes(group->world), -1);
    free(group->hdr);
    free(group);
}

/* Groups: what each rank tells the others when a communicator splits. The
   first rank of each group makes its shared memory; the name follows from the
   maker's pid and serial, so one exchange is enough. */
typedef struct { int32_t color, key, pid, serial; } dt__split_entry;
/* Every rank's entry, through memory of the kind the transport takes, given
   back at once: not the step arena, which a thread rank that splits and then
   ends would leave behind. */
static void dt__split_gather(dt_comm *comm, const dt__split_entry *mine, dt__split_entry *all) {
    dt_device memory = comm->backend->memory;
    size_t one = sizeof *mine, bytes = one * (size_t)(comm->world + 1);
    char *buf = (char *)dt_alloc_on(memory, DT_ARENA_COMM, bytes);
    dt__upload_to(memory, buf, mine, one);
    dt_all_gather(comm, buf, buf + one, (int64_t)(one / 4), DT_F32);      /* bytes travel as they are */
    dt__download_from(memory, all, buf + one, bytes - one);
    dt_free_on(memory, DT_ARENA_COMM, buf, bytes);
}
static int dt__split_before(const dt__split_entry *all, int a, int b) {
    return all[a].key != all[b].key ? all[a].key < all[b].key : a < b;
}
dt_comm *dt_comm_split(dt_comm *comm, int color, int key) {
    if (color < 0) dt_fail("dt_comm_split: color %d; a color is a number >= 0 naming the group to join", color);
    dt__split_entry mine = { color, key, (int32_t)getpid(), __atomic_fetch_add(&dt__shm_serial, 1, __ATOMIC_RELAXED) };
    dt__split_entry *all = (dt__split_entry *)calloc((size_t)comm->world, sizeof *all);
    if (!all) dt_fail("out of memory (dt_comm_split)");
    dt__split_gather(comm, &mine, all);
    int members[DT_MAX_RANKS], n = 0, rank = 0;
    for (int r = 0; r < comm->world; r++) {           /* insertion sort by (key, rank) */
        if (all[r].color != color) continue;
        int i = n++;
        for (; i > 0 && dt__split_before(all, r, members[i - 1]); i--) members[i] = members[i - 1];
        members[i] = r;
    }
    dt_comm *child = dt__comm_new(0, n, comm->timeout_s);
    for (int i = 0; i < n; i++) {
        if (members[i] == comm->rank) rank = i;
        child->job_rank[i] = comm->job_rank[members[i]];
    }
    child->rank = rank; child->backend = comm->backend; child->top = comm->top; child->parent = comm;
    if (!comm->backend->shares_memory) {     /* ranks that share no memory make groups that share none */
        free(all);
        comm->backend->split(comm, child, color, key);
        comm->children++;
        dt__comm_start(child, dt__private_header(child));
        return child;
    }
    char name[96];
    dt__path(name, sizeof name, "/dtrain-%d-%d-%d", (int)getuid(), all[members[0]].pid, all[members[0]].serial);
    child->map_bytes = dt__shm_bytes(n);
    int cleanup = -1;
    if (rank == 0) {
        child->hdr = dt__shm_map(name, child->map_bytes, 1, &cleanup);
        child->hdr->magic = DT_SHM_MAGIC;
        child->hdr->world = n;
    }
    dt_barrier(comm);                        /* every group's memory is made: open it */
    if (rank != 0) child->hdr = dt__shm_map(name, child->map_bytes, 0, NULL);
    dt_barrier(comm);                        /* every rank has mapped it: its name can go */
    if (rank == 0) { shm_unlink(name); dt__cleanup_done(cleanup); }
    free(all);
    comm->backend->split(comm, child, color, key);
    comm->children++;
    dt__comm_start(child, child->hdr);
    return child;
}

/* A parallel wrapper holds its communicator until it is freed, so that
   freeing the communicator first is an error naming the wrapper's free. */
static void dt__comm_hold(dt_comm *c, const char *free_fn) { c->users++; c->user_free_fn = free_fn; }
static void dt__comm_release(dt_comm *c) { if (c) c->users--; }

void dt_comm_free(dt_comm *c) {
    if (!c) return;
    /* a wrapper first: its free function frees the groups it split (tensor parallelism's mesh) */
    if (c->users) dt_fail("dt_comm_free: a parallel wrapper still uses this communicator; call %s first", c->user_free_fn);
    if (c->children)
        dt_fail("dt_comm_free: %d group(s) split from this communicator are still open; free them first "
                "(dt_comm_free or dt_mesh_free)", c->children);
    if (c->in_mesh) dt_fail("dt_comm_free: this communicator belongs to a mesh (dt_mesh_comm); dt_mesh_free frees it");
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->worker, NULL);
    c->backend->close(c);
    dt_comm *self = c;                      /* until here it still tells the others when we fail */
    __atomic_compare_exchange_n(&dt__active_comm, &self, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    if (dt__ctx.job == c) dt__ctx.job = NULL;
    if (c->parent) c->parent->children--;
    if (c->map_bytes) { munmap(c->hdr, c->map_bytes); dt__mem_count(DT_ARENA_COMM, c->map_bytes, -1); }
    free(c->private_hdr);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->wake);
    pthread_cond_destroy(&c->done);
    dt_comm_group *joined = c->joined;
    free(c);
    if (joined) __atomic_sub_fetch(&joined->members, 1, __ATOMIC_ACQ_REL);   /* last: the group may go now */
}


/* ---- a mesh: ranks as a grid of named dimensions ---- */
struct dt_mesh {
    int ndims, size[DT_MESH_MAX_DIMS], coord[DT_MESH_MAX_DIMS];
    char name[DT_MESH_MAX_DIMS][16];
    dt_comm *comm[DT_MESH_MAX_DIMS];
};
/* "dp=2 x tp=2", for messages. */
static void dt__mesh_describe(const dt_mesh *m, char *out, size_t n) {
    out[0] = 0;
    for (int d = 0; d < m->ndims; d++)
        snprintf(out + strlen(out), n - strlen(out), "%s%s=%d", d ? " x " : "", m->name[d], m->size[d]);
}
dt_mesh *dt_mesh_create(dt_comm *comm, int ndims, const int *sizes, const char *const *names) {
    if (ndims < 1 || ndims > DT_MESH_MAX_DIMS) dt_fail("dt_mesh_create: %d dimensions (1 to %d)", ndims, DT_MESH_MAX_DIMS);
    dt_mesh *m = (dt_mesh *)calloc(1, sizeof *m);
    if (!m) dt_fail("out of memory (mesh)");
    int64_t ranks = 1;
    for (int d = 0; d < ndims; d++) {
        if (sizes[d] < 1 || !names[d] || !names[d][0] || strlen(names[d]) >= sizeof m->name[d])
            dt_fail("dt_mesh_create: dimension %d has size %d and name '%s'; it needs a size >= 1 and a name of 1 to %zu "
                    "characters", d, sizes[d], names[d] ? names[d] : "(null)", sizeof m->name[d] - 1);
        for (int e = 0; e < d; e++)
            if (!strcmp(m->name[e], names[d])) dt_fail("dt_mesh_create: two dimensions are named '%s'", names[d]);
        dt__copy_str(m->name[d], sizeof m->name[d], names[d]);
        m->size[d] = sizes[d];
        m->ndims = d + 1;
        ranks *= sizes[d];
        if (ranks > DT_MAX_RANKS) break;
    }
    char shape[128];
    dt__mesh_describe(m, shape, sizeof shape);
    if (ranks != comm->world)
        dt_fail("dt_mesh_create: a %s mesh has %lld%s ranks, but the communicator has %d: the sizes must multiply to "
                "its size", shape, (long long)ranks, ranks > DT_MAX_RANKS ? " or more" : "", comm->world);
    int stride[DT_MESH_MAX_DIMS];
    for (int d = ndims - 1; d >= 0; d--) {
        stride[d] = d == ndims - 1 ? 1 : stride[d + 1] * m->size[d + 1];
        m->coord[d] = comm->rank / stride[d] % m->size[d];
    }
    /* Along d, the ranks that share every other coordinate: the same rank
       once its own coordinate is set to 0. The same order on every rank, as
       each split is collective. */
    for (int d = 0; d < ndims; d++) {
        m->comm[d] = dt_comm_split(comm, comm->rank - m->coord[d] * stride[d], m->coord[d]);
        m->comm[d]->in_mesh = 1;
    }
    return m;
}
static int dt__mesh_dim(const dt_mesh *m, const char *name) {
    for (int d = 0; d < m->ndims; d++)
        if (!strcmp(m->name[d], name)) return d;
    char shape[128];
    dt__mesh_describe(m, shape, sizeof shape);
    dt_fail("dt_mesh: no dimension named '%s' in this %s mesh", name, shape);
}
dt_comm *dt_mesh_comm(const dt_mesh *mesh, const char *name) { return mesh->comm[dt__mesh_dim(mesh, name)]; }
int dt_mesh_coord(const dt_mesh *mesh, const char *name) { return mesh->coord[dt__mesh_dim(mesh, name)]; }
void dt_mesh_free(dt_mesh *mesh) {
    if (!mesh) return;
    for (int d = mesh->ndims - 1; d >= 0; d--) {
        mesh->comm[d]->in_mesh = 0;
        dt_comm_free(mesh->comm[d]);
    }
    free(mesh);
}

/* [src/11-data-parallel.h] */
/* ==== parallel wrappers =====================================================
   Data parallel training in three shapes. DataParallel (stage 02): one
   process, N devices, device 0 in charge -- replicate, scatter, forward,
   gather, loss, backward, reduce, step, all through device 0.
   DistributedDataParallel (stage 03): N processes, each a full replica with its
   own optimizer; the only traffic is the average of the gradients, and it
   overlaps with backward. Fully sharded (stage 04): N processes that each keep
   1/N of the model and of its optimizer state; a unit is gathered whole only
   while it computes, the next one's gather already on its way, and each rank
   receives the average gradient of its own part only. The model, autograd and
   the optimizer are the ones stage 01 uses: the wrappers only decide where
   copies (or pieces) of them live and what crosses between them. */

/* What the wrappers communicated, for this step's log line and trace. `hidden`
   is the part of [t0, t1] that ran while backward was still computing. */
static void dt__record_span(const char *name, double t0, double t1, int pipeline) {
    if (dt__ctx.ncomm_events < (int)(sizeof dt__ctx.comm_events / sizeof dt__ctx.comm_events[0])) {
        int k = dt__ctx.ncomm_events++;
        dt__copy_str(dt__ctx.comm_events[k].name, sizeof dt__ctx.comm_events[k].name, name);
        dt__ctx.comm_events[k].t0 = t0;
        dt__ctx.comm_events[k].t1 = t1;
        dt__ctx.comm_events[k].pipeline = pipeline;
    }
}
static void dt__record_comm(const char *name, double t0, double t1, double hidden) {
    dt__ctx.comm_ms += t1 - t0;
    dt__ctx.comm_hidden_ms += hidden;
    dt__record_span(name, t0, t1, 0);
}
/* Pipeline parallelism's forwards, backwards and waits: a track of their own. */
static void dt__record_event(const char *name, double t0, double t1) { dt__record_span(name, t0, t1, 1); }

/* A data-parallel engine (DDP, FSDP) around another wrapper (a stack): a
   wrapper that cut the model (its `whole`: tensor parallelism, a pipeline's
   stages), over the ranks that hold the same pieces -- the engine averages
   or shards each piece over them. */
static void dt__data_parallel_can_wrap(const dt_parallel *outer, dt_comm *comm, int shards) {
    const dt_parallel *in = outer->inner;
    if (!in) return;
    if (!in->whole && !in->grad_ranks)   /* DDP around DDP, FSDP around DDP, ...: a model has one data-parallel wrapper */
        dt_fail("%s: this model is already wrapped (%s); one data-parallel wrapper per model, or call %s first",
                outer->create_fn, in->create_fn, in->free_fn);
    int want = in->grad_ranks > 0 ? in->grad_ranks : in->data_ranks;
    if (want > 0 && dt_comm_size(comm) != want)
        dt_fail("%s: its communicator has %d ranks, but %d ranks hold parts of the same gradients: give it the ranks that "
                "hold this rank's pieces (dt_tp_data_group, dt_pp_data_group, dt_cp_data_group)", outer->create_fn,
                dt_comm_size(comm), want);
    for (const dt_parallel *q = in; q && shards; q = q->inner)
        if (q->sp_all_gather)
            dt_usage_error("--sequence-parallel with --shard: the norms' gradients are summed over the tensor group after "
                           "backward, but a sharded engine has already reduce-scattered them by then; use one or the other");
}
/* What the wrappers inside hold in common with ranks outside the engine's
   group (a tied vocabulary at a pipeline's two ends): added up, once its
   gradients are whole and final. */
static void dt__data_parallel_sum_shared(dt_parallel *outer) {
    for (dt_parallel *q = outer->inner; q; q = q->inner)
        if (q->sum_shared_grads) q->sum_shared_grads(q);
}

/* A data-parallel wrapper lets go of its model; freed while another wraps it
   in turn, that one would point at freed memory: an error naming it. */
static void dt__data_parallel_unwrap(dt_model *m, dt_parallel *par) {
    if (m->parallel && m->parallel != par)
        dt_fail("%s: %s still wraps the model around it; call %s first", par->free_fn, m->parallel->create_fn,
                m->parallel->free_fn);
    dt_model_set_parallel(m, NULL);
}

/* A thread that ran ops gives back what its context holds before it ends. */
static void dt__context_release(void) {
    dt_step_arena_reset();                  /* the tape emptied */
    dt__step_arena_free(dt__ctx.step);      /* spill blocks and blocks back */
    dt__step_arena_free(dt__ctx.scratch);
    free(dt__ctx.tape);
    dt__ctx.tape = NULL;
    dt__ctx.tape_cap = 0;
    DT_OMP("omp parallel")
    {
        free(dt__pack_buffer);               /* each thread of this device's team frees its own */
        dt__pack_buffer = NULL;
        dt__pack_floats = 0;
    }
}

/* -- DataParallel -- */
typedef enum { DT_DP_FORWARD = 1, DT_DP_BACKWARD, DT_DP_REDUCE, DT_DP_QUIT } dt__dp_job;

typedef struct dt__dp_device {
    struct dt_dp *dp;
    int index;
    pthread_t thread;
    dt_model *model;            /* device 0: the model itself; the others: replicas */
    dt_comm *comm;
    dt_tensor *logits;          /* this device's output, in its own step arena */
    const float *dlogits;       /* its slice of the gradient of the gathered logits */
    double flops;               /* counted by its thread this step */
    size_t mem_peak;
    dt__dp_job job;
    int64_t posted, finished;
    int has_base;               /* LoRA: the frozen model came from device 0 (once: it never changes) */
} dt__dp_device;

struct dt_dp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_dp */
    dt_model *model;
    int devices, threads_per_device;
    dt_tensor *inputs;          /* the batch being scattered, and its rows per device */
    int rows;
    int out_rows;               /* rows of each device's output (a language model's: rows x tokens) */
    dt_comm_group *group;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dt__dp_device dev[DT_MAX_RANKS];
};

/* Replicate, scatter, forward: the same on every device, device 0 included.
   Returns when the replicate started and ended. */
static void dt__dp_device_forward(dt_dp *dp, dt__dp_device *d, double *t0, double *t1) {
    dt_model *m = d->model;
    dt_model_set_recompute(m, dp->model->recompute);                   /* as device 0's model does */
    *t0 = dt_now_ms();
    if (m->base && !d->has_base) dt_broadcast(d->comm, m->base->flat_data, m->base->numel, DT_F32, 0);
    d->has_base = 1;
    dt_broadcast(d->comm, m->flat_data, m->numel, DT_F32, 0);          /* device 0's weights, every step */
    *t1 = dt_now_ms();
    const dt_tensor *all = dp->inputs;
    int shape[4] = { dp->rows, all->shape[1], all->shape[2], all->shape[3] };
    size_t per_image = (size_t)(all->numel / all->shape[0]);
    dt_tensor *mine = dt__tensor_alloc(all->ndim, shape, DT_F32);
    memcpy(mine->data, all->data + (size_t)d->index * dp->rows * per_image,      /* scatter: a copy to this device */
           (size_t)dp->rows * per_image * sizeof(float));
    d->logits = dt_model_forward(m, mine);
}

static void dt__dp_post(dt_dp *dp, dt__dp_job job) {
    pthread_mutex_lock(&dp->mu);
    for (int i = 1; i < dp->devices; i++) { dp->dev[i].job = job; dp->dev[i].posted++; }
    pthread_cond_broadcast(&dp->cv);
    pthread_mutex_unlock(&dp->mu);
}
static void dt__dp_wait(dt_dp *dp) {
    pthread_mutex_lock(&dp->mu);
    for (int i = 1; i < dp->devices; i++)
        while (dp->dev[i].finished != dp->dev[i].posted) pthread_cond_wait(&dp->cv, &dp->mu);
    pthread_mutex_unlock(&dp->mu);
}

/* A replica's thread: a context of its own (tape, step arena, memory counts),
   a share of the cores, and a loop doing what device 0 asks. */
static void *dt__dp_worker(void *arg) {
    dt__dp_device *d = (dt__dp_device *)arg;
    dt_dp *dp = d->dp;
    dt__flush_subnormals();
#ifdef _OPENMP
    omp_set_num_threads(dp->threads_per_device);
#endif
    d->model = dt_model_create(&dp->model->cfg, 0);     /* its weights arrive with the first broadcast */
    d->comm = dt_comm_join(dp->group, d->index);
    for (;;) {
        pthread_mutex_lock(&dp->mu);
        while (d->posted == d->finished) pthread_cond_wait(&dp->cv, &dp->mu);
        dt__dp_job job = d->job;
        pthread_mutex_unlock(&dp->mu);
        if (job == DT_DP_QUIT) break;
        if (job == DT_DP_FORWARD) {
            double t0, t1;
            dt_step_arena_reset();
            dt_flops_reset();
            dt__dp_device_forward(dp, d, &t0, &t1);
        }
        if (job == DT_DP_BACKWARD) dt_backward_from(d->logits, d->dlogits);
        if (job == DT_DP_REDUCE) {
            dt_model *m = d->model;
            dt_reduce(d->comm, m->flat_grad, m->flat_grad, m->numel, DT_F32, DT_SUM, 0);
            dt_model_zero_grad(m);
            d->flops = dt_flops_counted();
        }
        d->mem_peak = dt_mem_total_peak();
        pthread_mutex_lock(&dp->mu);
        d->finished = d->posted;
        pthread_cond_broadcast(&dp->cv);
        pthread_mutex_unlock(&dp->mu);
    }
    dt_comm_free(d->comm);
    dt_model_free(d->model);
    dt__context_release();
    return NULL;
}

static void dt__dp_backward_done(dt_parallel *par) {
    dt_dp *dp = (dt_dp *)par;
    if (dp->devices == 1) return;
    dt__dp_wait(dp);                                    /* every device's backward has finished */
    double t0 = dt_now_ms();
    dt__dp_post(dp, DT_DP_REDUCE);
    dt_model *m = dp->model;
    dt_reduce(dp->dev[0].comm, m->flat_grad, m->flat_grad, m->numel, DT_F32, DT_SUM, 0);
    dt__dp_wait(dp);
    dt__record_comm("reduce gradients", t0, dt_now_ms(), 0);
    for (int i = 1; i < dp->devices; i++) dt__ctx.flops += dp->dev[i].flops;   /* the work of every device */
}
void dt_dp_reduce_grads(dt_dp *dp) { dt_parallel_backward_done(&dp->par); }

dt_dp *dt_dp_create(dt_model *model, int devices, double timeout_s) {
    if (devices < 1 || devices > DT_MAX_RANKS) dt_fail("DataParallel over %d devices (1 to %d)", devices, DT_MAX_RANKS);
    if (devices > 1 && model->device != DT_CPU)
        dt_fail("02-dp on %d GPUs: driving several GPUs from one process needs a CUDA stream, a cuBLAS handle and an "
                "NCCL communicator per GPU, and this version keeps one per process. Use --nproc 1 here, or 03-ddp "
                "(one process per GPU)", devices);
    if (dt__ctx.compute_dtype != DT_F32)
        dt_fail("DataParallel (stage 02) runs in fp32 only; mixed precision comes with DDP and FSDP (stage 05)");
    dt_dp *dp = (dt_dp *)calloc(1, sizeof *dp);
    if (!dp) dt_fail("out of memory (DataParallel)");
    dp->par = (dt_parallel){ .create_fn = "dt_dp_create", .sync_fn = "dt_dp_reduce_grads", .free_fn = "dt_dp_free",
                             .backward_done = dt__dp_backward_done };
    dt_model_set_parallel(model, &dp->par);
    dp->model = model;
    dp->devices = devices;
    dp->threads_per_device = dt_threads() / devices > 1 ? dt_threads() / devices : 1;
    dt__ctx.devices = devices;
    if (devices == 1) return dp;
    pthread_mutex_init(&dp->mu, NULL);
    pthread_cond_init(&dp->cv, NULL);
    dp->group = dt_comm_group_create(devices, timeout_s);
#ifdef _OPENMP
    omp_set_num_threads(dp->threads_per_device);      /* the cores shared out among the devices */
#endif
    dp->dev[0].dp = dp;
    dp->dev[0].model = model;
    dp->dev[0].comm = dt_comm_join(dp->group, 0);
    for (int i = 1; i < devices; i++) {
        dp->dev[i].dp = dp;
        dp->dev[i].index = i;
        if (pthread_create(&dp->dev[i].thread, NULL, dt__dp_worker, &dp->dev[i]) != 0)
            dt_fail("cannot start the thread of device %d", i);
    }
    return dp;
}
int dt_dp_devices(const dt_dp *dp) { return dp->devices; }

/* The gather's backward: each device gets its slice of d(loss)/d(logits) and
   starts its own backward; device 0's slice flows on through device 0's tape. */
static void dt__dp_gather_backward(dt__tape_entry *e) {
    dt_dp *dp = (dt_dp *)e->saved;
    int64_t per = (int64_t)dp->out_rows * dt_tensor_cols(e->out);
    for (int i = 1; i < dp->devices; i++) dp->dev[i].dlogits = e->out->grad + i * per;
    dt__dp_post(dp, DT_DP_BACKWARD);
    float *g = dt_grad(e->in[0]);
    for (int64_t k = 0; k < per; k++) g[k] += e->out->grad[k];
}

dt_tensor *dt_dp_forward(dt_dp *dp, dt_tensor *inputs) {
    if (dp->devices == 1) return dt_model_forward(dp->model, inputs);
    int N = dp->devices, B = inputs->shape[0];
    if (B % N) dt_fail("DataParallel: a batch of %d samples does not split evenly over %d devices", B, N);
    dp->inputs = inputs;
    dp->rows = B / N;
    double t0, t1;
    dt__dp_post(dp, DT_DP_FORWARD);
    dt__dp_device_forward(dp, &dp->dev[0], &t0, &t1);
    dt__dp_wait(dp);
    dt__record_comm("broadcast parameters", t0, t1, 0);
    /* gather: every device's logits, in device order, on device 0 */
    dt_tensor *mine = dp->dev[0].logits;
    int C = (int)dt_tensor_cols(mine), R = dp->out_rows = (int)dt_tensor_rows(mine);
    dt_tensor *out = dt__tensor_out_2d(N * R, C);
    for (int i = 0; i < N; i++)
        memcpy(out->data + (size_t)i * R * C, dp->dev[i].logits->data, sizeof(float) * (size_t)R * C);
    if (dt__wants_grad(mine, NULL, NULL)) dt__tape_push(dt__dp_gather_backward, out, mine, NULL, NULL)->saved = dp;
    return out;
}

void dt_dp_free(dt_dp *dp, int quiet) {
    if (!dp) return;
    dt_model_set_parallel(dp->model, NULL);
    if (dp->devices > 1) {
        dt__dp_post(dp, DT_DP_QUIT);
        for (int i = 1; i < dp->devices; i++) pthread_join(dp->dev[i].thread, NULL);
        if (!quiet) {
            printf("peak memory per device: 0: %.1f MB (model, optimizer, gathered logits)", dt_mem_total_peak() / 1e6);
            for (int i = 1; i < dp->devices; i++) printf(", %d: %.1f MB", i, dp->dev[i].mem_peak / 1e6);
            printf("\n");
            fflush(stdout);
        }
        dt_comm_free(dp->dev[0].comm);
        dt_comm_group_free(dp->group);
        pthread_mutex_destroy(&dp->mu);
        pthread_cond_destroy(&dp->cv);
    }
    free(dp);
}
/* [src/12-ddp.h] */
/* -- DistributedDataParallel -- */
typedef struct dt__ddp_bucket {
    int first, last;            /* parameters first..last: one run of the flat gradient */
    int64_t offset, count;
    int held;                   /* its parameters this rank holds (a pipeline stage holds only its own) */
    int pending;                /* of those, the gradients not final yet in this backward */
    dt_comm_handle handle;
} dt__ddp_bucket;

struct dt_ddp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_ddp */
    dt_model *model;
    dt_comm *comm;
    int nbuckets, launched;     /* buckets start in order: 0, 1, ... */
    dt__ddp_bucket *buckets;
    int *bucket_of;             /* parameter -> bucket */
    int sync;                   /* 0: accumulate locally (no-sync), communicate nothing */
};

/* Start every bucket that is complete and whose predecessors have started:
   all ranks must issue the collectives in the same order. */
static void dt__ddp_launch(dt_ddp *d, int all) {
    while (d->launched < d->nbuckets && (all || d->buckets[d->launched].pending == 0)) {
        dt__ddp_bucket *b = &d->buckets[d->launched++];
        float *g = d->model->flat_grad + b->offset;
        if (!b->count) continue;                      /* another stage's parameters: nothing here (nor on its peers) */
        b->handle = dt_all_reduce_async(d->comm, g, g, b->count, DT_F32, DT_AVG);
        dt__ctx.grad_collectives++;
    }
}
static void dt__ddp_grad_ready(dt_parallel *par, dt_tensor *p) {
    dt_ddp *d = (dt_ddp *)par;
    if (!d->sync) return;                             /* no-sync: the gradient stays here */
    int64_t i = p - d->model->params;
    dt__ddp_bucket *b = &d->buckets[d->bucket_of[i]];
    if (b->pending > 0) b->pending--;
    dt__ddp_launch(d, 0);
}

/* After backward: start what has not started, wait for every bucket. */
static void dt__ddp_backward_done(dt_parallel *par) {
    dt_ddp *d = (dt_ddp *)par;
    if (!d->sync) return;                             /* accumulating: nothing leaves this rank */
    double backward_end = dt__ctx.backward_end_ms;
    dt__ddp_launch(d, 1);
    for (int k = 0; k < d->nbuckets; k++) {
        dt__ddp_bucket *b = &d->buckets[k];
        double t0, t1;
        char name[32];
        b->pending = b->held;
        if (!b->count) continue;
        dt_comm_wait(d->comm, b->handle);
        dt__comm_interval(d->comm, b->handle, &t0, &t1);
        snprintf(name, sizeof name, "all_reduce bucket %d", k);
        dt__record_comm(name, t0, t1, t0 < backward_end ? (t1 < backward_end ? t1 : backward_end) - t0 : 0);
    }
    d->launched = 0;
    dt__data_parallel_sum_shared(&d->par);            /* a tied vocabulary's two ends, averaged: added up */
}
static void dt__ddp_set_sync(dt_parallel *par, int sync) { ((dt_ddp *)par)->sync = sync; }
void dt_ddp_sync_grads(dt_ddp *ddp) { dt_parallel_backward_done(&ddp->par); }

dt_ddp *dt_ddp_create(dt_model *model, dt_comm *comm, double bucket_mb) {
    dt_ddp *d = (dt_ddp *)calloc(1, sizeof *d);
    int n = model->nparams;
    if (!d || !(d->buckets = (dt__ddp_bucket *)calloc((size_t)n, sizeof(dt__ddp_bucket))) ||
        !(d->bucket_of = (int *)calloc((size_t)n, sizeof(int))))
        dt_fail("out of memory (DDP)");
    d->par = (dt_parallel){ .create_fn = "dt_ddp_create", .sync_fn = "dt_ddp_sync_grads", .free_fn = "dt_ddp_free",
                            .grad_ready = bucket_mb > 0 ? dt__ddp_grad_ready : NULL,
                            .backward_done = dt__ddp_backward_done, .set_sync = dt__ddp_set_sync,
                            .inner = model->parallel };          /* around tensor parallelism: its pieces */
    dt__data_parallel_can_wrap(&d->par, comm, 0);
    dt_model_set_parallel(model, &d->par);
    dt__comm_hold(comm, "dt_ddp_free");
    d->model = model;
    d->comm = comm;
    d->sync = 1;
    dt_broadcast(comm, model->flat_data, model->numel, DT_F32, 0);   /* every replica starts from rank 0's */
    /* Buckets, from the last parameter back: ~bucket_mb each, the first 1 MB. */
    double cap = bucket_mb > 0 ? bucket_mb * 1048576.0 : 1e300, first_cap = cap < 1048576.0 ? cap : 1048576.0;
    double bytes = 0;
    for (int i = n - 1; i >= 0; i--) {
        dt__ddp_bucket *b = &d->buckets[d->nbuckets];
        if (bytes == 0) b->last = i;
        bytes += 4.0 * model->params[i].numel;
        d->bucket_of[i] = d->nbuckets;
        if (bytes >= (d->nbuckets == 0 ? first_cap : cap) || i == 0) {
            b->first = i;
            b->offset = model->params[i].data - model->flat_data;
            b->count = model->params[b->last].data + model->params[b->last].numel - model->params[i].data;
            for (int j = i; j <= b->last; j++) b->held += model->params[j].numel > 0;
            b->pending = b->held;
            d->nbuckets++;
            bytes = 0;
        }
    }
    return d;
}
/* The engine (dt_data_parallel_create) is what a stage calls: the order
   mistakes name its functions. */
static dt_parallel *dt__ddp_as_engine(dt_ddp *d, const char *sync_fn, const char *free_fn) {
    d->par.sync_fn = sync_fn;
    d->par.free_fn = free_fn;
    return &d->par;
}
int dt_ddp_buckets(const dt_ddp *ddp) { return ddp->nbuckets; }
void dt_ddp_set_sync(dt_ddp *ddp, int sync) { ddp->sync = sync; }

void dt_ddp_free(dt_ddp *ddp) {
    if (!ddp) return;
    dt__data_parallel_unwrap(ddp->model, &ddp->par);
    dt__comm_release(ddp->comm);
    free(ddp->buckets);
    free(ddp->bucket_of);
    free(ddp);
}
/* [src/13-fsdp.h] */

/* -- Fully sharded data parallel -- */
typedef struct dt__fsdp_unit {
    int first, end;             /* its parameters: first .. end - 1 */
    int64_t offset, numel;      /* where it sits in the model's parameter order */
    int64_t shard;              /* elements per rank: numel rounded up to a multiple of world, / world */
    int64_t shard_offset;       /* where its shard starts in this rank's flat shard buffers */
    int64_t accum_offset;       /* where its whole gradient adds up while accumulating (no-sync) */
    void *full;                 /* [shard * world] gathered parameters, in the compute dtype */
    float *full_grad;           /* [shard * world] their gradients, f32 */
    dt_comm_handle gathering;   /* an all-gather in flight (a prefetch), or 0 */
} dt__fsdp_unit;

struct dt_fsdp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_fsdp */
    dt_model *model;
    dt_comm *comm;
    dt_shard_mode mode;
    int offload;                /* shards and optimizer state in host memory */
    int pipelined;              /* a pipeline inside runs M forwards and backwards a step */
    int rank, world, nunits;
    dt__fsdp_unit *units;
    float *shard_params, *shard_grads;   /* this rank's slice of every unit, one after another */
    int64_t shard_numel;
    /* Buffers made once and reused by every unit: a malloc per unit per step
       costs page faults on a CPU, and a cudaFree synchronises the whole GPU.
       At most two neighbouring units are gathered at once, so two parameter
       buffers serve all of them (unit k takes buffer k % 2), and one gradient
       buffer, as backward does one unit at a time. Offloaded shards are
       uploaded into staging buffers, by the same rule. The model's outer unit
       (dt_model.outer_unit), gathered from the start of forward to the end of
       backward, has buffers of its own: slot 2, and outer_grad. */
    void *gathered[3];
    float *gathered_grad, *outer_grad, *staged[3], *scattered;
    int holder[3];                       /* the unit in each parameter buffer, or -1 */
    size_t largest, largest_shard;       /* f32 bytes: the largest unit, gathered, and its shard */
    int64_t prefetched;                  /* units that were already on their way when needed */
    /* Stage 05. Mixed precision: parameters are gathered in param_dtype (the
       compute dtype), each rank first narrowing its f32 shard into send16;
       gradients are reduce-scattered in reduce_dtype through grad16 and
       scattered16. Accumulation: with sync 0 nothing is reduce-scattered and
       the units' whole gradients add up in `accum`. */
    dt_dtype param_dtype, reduce_dtype;
    void *send16[3], *grad16, *scattered16;
    int sync;
    float *accum;
    int64_t accum_numel;
};

static size_t dt__fsdp_full_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) { return (size_t)(u->shard * f->world) * sizeof(float); }
static size_t dt__fsdp_param_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) {
    return (size_t)(u->shard * f->world) * dt_dtype_size(f->param_dtype);
}
static size_t dt__fsdp_largest_params(const dt_fsdp *f) { return f->largest / sizeof(float) * dt_dtype_size(f->param_dtype); }
/* Which of the reused buffers unit k takes: neighbours alternate, the outer unit has its own. */
static int dt__fsdp_slot(const dt_fsdp *f, int k) { return k == f->model->outer_unit ? 2 : k % 2; }

/* Unit k's slice of a shard buffer where the collectives can read it: the
   buffer itself, or, offloaded, a copy uploaded into the staging buffer of its slot. */
static float *dt__fsdp_shard_on_device(dt_fsdp *f, const float *shards, int k) {
    const dt__fsdp_unit *u = &f->units[k];
    if (!f->offload) return (float *)shards + u->shard_offset;
    dt_upload(f->staged[dt__fsdp_slot(f, k)], shards + u->shard_offset, (size_t)u->shard * sizeof(float));
    return f->staged[dt__fsdp_slot(f, k)];
}
/* Unit k's shard as the all-gather sends it: in the compute dtype, which under
   mixed precision is a 16-bit copy (send16, one per neighbouring unit). */
static const void *dt__fsdp_send_buffer(dt_fsdp *f, int k) {
    float *mine = dt__fsdp_shard_on_device(f, f->shard_params, k);
    if (f->param_dtype == DT_F32) return mine;
    dt_convert(mine, DT_F32, f->send16[dt__fsdp_slot(f, k)], f->param_dtype, f->units[k].shard);
    return f->send16[dt__fsdp_slot(f, k)];
}
/* A unit's whole parameters from f32 host values, in the compute dtype. */
static void dt__fsdp_fill_params(dt_fsdp *f, dt__fsdp_unit *u, const float *host) {
    if (f->param_dtype == DT_F32) { dt_upload(u->full, host, (size_t)u->numel * sizeof(float)); return; }
    uint16_t *h = (uint16_t *)malloc((size_t)u->numel * 2 + 1);
    if (!h) dt_fail("out of memory");
    dt__f32_to_half_cpu(host, h, f->param_dtype, u->numel);
    dt_upload(u->full, h, (size_t)u->numel * 2);
    free(h);
}
/* Host values into a shard buffer: a copy when offloaded, else an upload. */
static void dt__fsdp_put(dt_fsdp *f, float *dst, const float *host, int64_t n) {
    if (n <= 0) return;
    if (f->offload) memcpy(dst, host, (size_t)n * sizeof(float));
    else dt_upload(dst, host, (size_t)n * sizeof(float));
}

/* Point the unit's parameters (or their f32 gradients) into a gathered buffer,
   or nowhere. Gathered parameters are in the compute dtype. */
static void dt__fsdp_point(dt_fsdp *f, dt__fsdp_unit *u, int grads, void *buf) {
    for (int i = u->first; i < u->end; i++) {
        dt_tensor *p = &f->model->params[i];
        int64_t at = f->model->offsets[i] - u->offset;
        if (grads) p->grad = buf ? (float *)buf + at : NULL;
        else {
            p->dtype = f->param_dtype;
            p->data = buf ? (float *)((char *)buf + at * dt_dtype_size(f->param_dtype)) : NULL;
        }
    }
}

/* All-gather: every rank's shard of the unit, side by side, is the unit. It is
   started ahead of need -- the next unit's while this one computes -- and
   finished when the unit is about to run. Every rank starts and finishes them
   in the same order, so the collectives pair up. */
static void dt__fsdp_gather_start(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL || u->full || u->gathering || !u->numel) return;   /* there already, on its way, or */
                                                                                    /* another pipeline stage's */
    int slot = dt__fsdp_slot(f, k);
    if (f->holder[slot] >= 0)
        dt_fail("internal: FSDP gathers unit %d while unit %d still holds its buffer", k, f->holder[slot]);
    f->holder[slot] = k;
    u->full = f->gathered[slot];
    u->gathering = dt_all_gather_async(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
}
static void dt__fsdp_gather_unit(dt_fsdp *f, int k, int next) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    double wait_from = dt_now_ms(), t0, t1;
    f->prefetched += u->gathering != 0;
    dt__fsdp_gather_start(f, k);
    if (next >= 0 && next < f->nunits) dt__fsdp_gather_start(f, next);      /* prefetch */
    if (!u->gathering) return;
    dt_comm_wait(f->comm, u->gathering);
    dt__comm_interval(f->comm, u->gathering, &t0, &t1);
    double hidden = (t1 < wait_from ? t1 : wait_from) - t0;
    dt__record_comm("all_gather unit", t0, t1, hidden > 0 ? hidden : 0);
    u->gathering = 0;
    dt__fsdp_point(f, u, 0, u->full);
}
static void dt__fsdp_release_unit(dt_fsdp *f, int k) {     /* reshard: keep only our slice */
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    if (u->full) f->holder[dt__fsdp_slot(f, k)] = -1;
    u->full = NULL;
    dt__fsdp_point(f, u, 0, NULL);
}
/* Reduce-scatter: the average of every rank's gradient of the unit, of which
   this rank keeps its slice (added to what it holds: accumulation needs it). */
static void dt__fsdp_reduce_scatter_unit(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    dt_device dev = f->model->device;
    if (!u->numel) return;                          /* another pipeline stage's: nothing here, nor on the peers */
    float *mine = f->scattered, *dst = f->shard_grads + u->shard_offset;
    double t0 = dt_now_ms();
    if (f->reduce_dtype == DT_F32) dt_reduce_scatter(f->comm, u->full_grad, mine, u->shard, DT_F32, DT_AVG);
    else {                                          /* 16-bit copies travel */
        dt_convert(u->full_grad, DT_F32, f->grad16, f->reduce_dtype, u->shard * f->world);
        dt_reduce_scatter(f->comm, f->grad16, f->scattered16, u->shard, f->reduce_dtype, DT_AVG);
        dt_convert(f->scattered16, f->reduce_dtype, mine, DT_F32, u->shard);
    }
    dt__ctx.grad_collectives++;
    dt__record_comm("reduce_scatter unit", t0, dt_now_ms(), 0);
    const dt_backend *gpu = f->offload ? NULL : dt__backend_of(dev);
    if (gpu) gpu->accumulate(dst, mine, u->shard);
    else {                                          /* offloaded: to the host, added there */
        float *host = dt__host_view(dev, mine, u->shard);
        for (int64_t i = 0; i < u->shard; i++) dst[i] += host[i];
        dt__host_view_close(dev, host, mine, u->shard, 0);
    }
}

/* The two marks a unit leaves on the tape; backward meets them in reverse. */
static void dt__fsdp_before_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    if (!u->numel) return;                          /* nothing of it here (frozen under LoRA, another stage's) */
    dt__fsdp_gather_unit(f, e->iarg[0], e->iarg[0] - 1);             /* gathered again; the one before on its way */
    if (f->mode != DT_SHARD_OPTIMIZER && !u->full_grad) {           /* (the outer unit's stays all step) */
        if (f->accum) u->full_grad = f->accum + u->accum_offset;     /* adds to the micro-batches before */
        else {                                                       /* backward adds into it: zeroed */
            u->full_grad = e->iarg[0] == f->model->outer_unit ? f->outer_grad : f->gathered_grad;
            dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
        }
        dt__fsdp_point(f, u, 1, u->full_grad);
    }
}
static void dt__fsdp_after_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    if (!u->numel) return;
    if (f->mode == DT_SHARD_OPTIMIZER) return;                                  /* all at once, after backward */
    if (e->iarg[0] == f->model->outer_unit) {   /* whole until the step's backward is done: a pipeline's */
        dt__fsdp_release_unit(f, e->iarg[0]);   /* micro-batches add into it, and a tied vocabulary's */
        return;                                 /* two ends are added up before it is sharded */
    }
    if (f->sync) {                                                              /* no-sync: it stays in accum */
        dt__fsdp_reduce_scatter_unit(f, e->iarg[0]);
        if (f->accum) dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
    }
    u->full_grad = NULL;
    dt__fsdp_point(f, u, 1, NULL);
    dt__fsdp_release_unit(f, e->iarg[0]);
}

static void dt__fsdp_unit_begin(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt__fsdp_gather_unit(f, unit, unit + 1);                               /* and the next one on its way */
    if (dt__ctx.grad_enabled) dt__tape_mark(dt__fsdp_after_unit_backward, f, unit);
}
static void dt__fsdp_unit_end(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    int training = dt__ctx.grad_enabled;
    /* reshard after forward -- but the last unit is the first that backward
       needs, so in training it stays gathered (one all-gather saved), unless
       a pipeline runs more forwards first (its buffer is a neighbour's); so
       does the outer unit, whose backward ends the step */
    int kept = unit == f->model->outer_unit || (unit == f->nunits - 1 && !f->pipelined);
    if (!(training && kept)) dt__fsdp_release_unit(f, unit);
    if (training) dt__tape_mark(dt__fsdp_before_unit_backward, f, unit);
}
static void dt__fsdp_backward_done(dt_parallel *par);
static void dt__fsdp_step_done(dt_parallel *par);
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o);
static void dt__fsdp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_fsdp *)par)->comm, values, n, DT_SUM);
    if (par->inner && par->inner->sum_over_ranks) par->inner->sum_over_ranks(par->inner, values, n);   /* the tensor group's parts */
}

dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload) {
    dt_fsdp *f = (dt_fsdp *)calloc(1, sizeof *f);
    if (!f || !(f->units = (dt__fsdp_unit *)calloc((size_t)model->nunits, sizeof(dt__fsdp_unit))))
        dt_fail("out of memory (FSDP)");
    f->par = (dt_parallel){ .create_fn = "dt_fsdp_create", .sync_fn = "dt_fsdp_sync_grads", .free_fn = "dt_fsdp_free",
                            .unit_begin = dt__fsdp_unit_begin, .unit_end = dt__fsdp_unit_end,
                            .backward_done = dt__fsdp_backward_done, .step_done = dt__fsdp_step_done,
                            .optimizer_view = dt__fsdp_optimizer_view, .sum_over_ranks = dt__fsdp_sum_over_ranks,
                            .inner = model->parallel };          /* around tensor parallelism: its pieces */
    dt__data_parallel_can_wrap(&f->par, comm, 1);
    for (dt_parallel *q = f->par.inner; q; q = q->inner) f->pipelined |= q->forward != NULL;
    dt_model_set_parallel(model, &f->par);
    dt__comm_hold(comm, "dt_fsdp_free");
    f->model = model; f->comm = comm; f->mode = mode; f->offload = cpu_offload;
    f->param_dtype = dt__ctx.compute_dtype; f->reduce_dtype = DT_F32; f->sync = 1;
    f->rank = dt_comm_rank(comm); f->world = dt_comm_size(comm); f->nunits = model->nunits;
    dt_device dev = model->device;
    dt_broadcast(comm, model->flat_data, model->numel, DT_F32, 0);     /* every rank starts from rank 0's */
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        u->first = model->unit_first[k];
        u->end = model->unit_first[k + 1];
        u->offset = model->offsets[u->first];
        u->numel = (u->end < model->nparams ? model->offsets[u->end] : model->numel) - u->offset;
        u->shard = (u->numel + f->world - 1) / f->world;
        u->shard_offset = f->shard_numel;
        f->shard_numel += u->shard;
        u->accum_offset = f->accum_numel;
        f->accum_numel += u->shard * f->world;
        if (dt__fsdp_full_bytes(f, u) > f->largest) f->largest = dt__fsdp_full_bytes(f, u);
    }
    f->largest_shard = f->largest / (size_t)f->world;
    int outer = model->outer_unit >= 0 && f->units[model->outer_unit].numel ? model->outer_unit : -1;
    int used[3] = { 0, 0, 0 };              /* the slots some unit here takes (a pipeline stage's units only) */
    for (int k = 0; k < f->nunits; k++) used[dt__fsdp_slot(f, k)] |= f->units[k].numel > 0;
    f->holder[0] = f->holder[1] = f->holder[2] = -1;
    for (int b = 0; b < 3; b++) {
        if (!used[b]) continue;
        if (mode == DT_SHARD_FULL) f->gathered[b] = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_largest_params(f));
        if (f->param_dtype != DT_F32) f->send16[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard / 2);
        if (cpu_offload) f->staged[b] = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    }
    if (mode != DT_SHARD_OPTIMIZER) f->gathered_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    if (mode != DT_SHARD_OPTIMIZER && outer >= 0) f->outer_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    f->scattered = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    size_t shard_bytes = (size_t)f->shard_numel * sizeof(float);
    f->shard_params = (float *)(f->offload ? dt_alloc_host(DT_ARENA_PARAMS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_PARAMS, shard_bytes));
    f->shard_grads = (float *)(f->offload ? dt_alloc_host(DT_ARENA_GRADS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_GRADS, shard_bytes));
    /* Cut the model into shards: this rank keeps elements [rank * shard, (rank + 1) * shard) of each unit. */
    float *host = dt__host_view(dev, model->flat_data, model->numel);
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, f->shard_params + u->shard_offset, host + u->offset + lo, hi - lo);
        if (mode != DT_SHARD_FULL) {             /* ZeRO-1 and -2 keep every parameter, in per-unit buffers */
            u->full = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_param_bytes(f, u));
            dt__fsdp_fill_params(f, u, host + u->offset);
            dt__fsdp_point(f, u, 0, u->full);
        }
        if (mode == DT_SHARD_OPTIMIZER) {        /* ZeRO-1 keeps every gradient too */
            u->full_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, dt__fsdp_full_bytes(f, u));
            dt__fsdp_point(f, u, 1, u->full_grad);
        }
        if (mode == DT_SHARD_FULL) dt__fsdp_point(f, u, 0, NULL);
        if (mode != DT_SHARD_OPTIMIZER) dt__fsdp_point(f, u, 1, NULL);
    }
    dt__host_view_close(dev, host, model->flat_data, model->numel, 0);
    dt_free_on(dev, DT_ARENA_PARAMS, model->flat_data, (size_t)model->numel * sizeof(float));
    dt_free_on(dev, DT_ARENA_GRADS, model->flat_grad, (size_t)model->numel * sizeof(float));
    model->flat_data = model->flat_grad = NULL;
    return f;
}

/* The optimizer of a sharded model steps this rank's shard: one slice per
   part of a parameter inside it (the padding belongs to no parameter). */
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_model *m = f->model;
    /* Around tensor parallelism: which parameters another rank of the tensor
       group also holds (the replicated ones), from the inner wrapper's view. */
    int *copy = (int *)calloc((size_t)m->nparams + 1, sizeof(int));
    if (!copy) dt_fail("out of memory (optimizer)");
    if (par->inner && par->inner->optimizer_view) {
        par->inner->optimizer_view(par->inner, o);
        for (int i = 0; i < o->nslices && i < m->nparams; i++) copy[i] = o->slices[i].copy;
        free(o->slices);
        o->slices = NULL;
        o->nslices = 0;
    }
    o->params = f->shard_params; o->grads = f->shard_grads; o->numel = f->shard_numel;
    o->sharded_by = par;
    if (f->offload) { o->device = DT_CPU; o->offloaded = 1; }     /* the optimizer steps on the CPU */
    o->slices = (struct dt_param_slice *)calloc((size_t)m->nparams, sizeof *o->slices);
    if (!o->slices) dt_fail("out of memory (optimizer)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard;
        for (int i = u->first; i < u->end; i++) {
            int64_t a = m->offsets[i] - u->offset, b = a + m->params[i].numel;
            if (a < lo) a = lo;
            if (b > hi) b = hi;
            if (b <= a) continue;
            struct dt_param_slice *s = &o->slices[o->nslices++];
            s->offset = u->shard_offset + (a - lo);
            s->length = b - a;
            s->decay = m->params[i].ndim >= 2;
            s->copy = copy[i];
        }
    }
    free(copy);
}

void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync) {
    int outer = fsdp->model->outer_unit;
    if (!sync && !fsdp->accum && fsdp->mode != DT_SHARD_OPTIMIZER && outer >= 0 && fsdp->units[outer].full_grad)
        dt_fail("dt_fsdp_set_sync: the last backward's gradients are not synchronised yet (its outer unit's is whole, "
                "waiting); call %s first", fsdp->par.sync_fn);
    fsdp->sync = sync;
    if (!sync && !fsdp->accum && fsdp->mode != DT_SHARD_OPTIMIZER) {     /* ZeRO-1 keeps whole gradients anyway */
        fsdp->accum = (float *)dt_alloc_on(fsdp->model->device, DT_ARENA_GRADS, (size_t)fsdp->accum_numel * sizeof(float));
        dt__zero_on(fsdp->model->device, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);   /* each unit has its slice now */
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
        fsdp->gathered_grad = fsdp->outer_grad = NULL;
    }
}
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype) {
    dt_device dev = fsdp->model->device;
    dt_free_on(dev, DT_ARENA_COMM, fsdp->grad16, fsdp->largest / 2);
    dt_free_on(dev, DT_ARENA_COMM, fsdp->scattered16, fsdp->largest_shard / 2);
    fsdp->grad16 = fsdp->scattered16 = NULL;
    fsdp->reduce_dtype = dtype;
    if (dtype == DT_F32) return;
    fsdp->grad16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest / 2);
    fsdp->scattered16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest_shard / 2);
}

/* After backward: ZeRO-1 reduce-scatters every unit now; ZeRO-2 and -3 the
   outer unit (the others went during backward). First, what the wrappers
   inside add up across their own groups (a tied vocabulary's two ends). */
static void dt__fsdp_backward_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (!f->sync) return;                                    /* accumulating */
    dt__data_parallel_sum_shared(par);
    for (int k = f->nunits - 1; k >= 0; k--) {
        dt__fsdp_unit *u = &f->units[k];
        if (!u->numel || !u->full_grad || (f->mode != DT_SHARD_OPTIMIZER && k != f->model->outer_unit)) continue;
        dt__fsdp_reduce_scatter_unit(f, k);
        dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
        if (f->mode == DT_SHARD_OPTIMIZER) continue;         /* ZeRO-1 keeps its whole gradients */
        u->full_grad = NULL;
        dt__fsdp_point(f, u, 1, NULL);
    }
}

void dt_fsdp_sync_grads(dt_fsdp *fsdp) { dt_parallel_backward_done(&fsdp->par); }

/* After the optimizer: DT_SHARD_OPTIMIZER and _GRADS all-gather the updated
   parameters (DT_SHARD_FULL gathers each unit when it is next used). */
static void dt__fsdp_step_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (f->mode == DT_SHARD_FULL) return;              /* gathered when next needed */
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        double t0 = dt_now_ms();
        if (!u->numel) continue;
        dt_all_gather(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
        dt__record_comm("all_gather parameters", t0, dt_now_ms(), 0);
    }
}

void dt_fsdp_free(dt_fsdp *fsdp) {
    if (!fsdp) return;
    dt_model *m = fsdp->model;
    dt__data_parallel_unwrap(m, &fsdp->par);
    for (int k = 0; k < fsdp->nunits; k++) {
        dt__fsdp_unit *u = &fsdp->units[k];
        if (u->gathering) dt__fsdp_gather_unit(fsdp, k, -1);      /* a prefetch nobody used: let it land */
        if (fsdp->mode != DT_SHARD_FULL) dt_free_on(m->device, DT_ARENA_PARAMS, u->full, dt__fsdp_param_bytes(fsdp, u));
        if (fsdp->mode == DT_SHARD_OPTIMIZER) dt_free_on(m->device, DT_ARENA_GRADS, u->full_grad, dt__fsdp_full_bytes(fsdp, u));
        dt__fsdp_point(fsdp, u, 0, NULL);
        dt__fsdp_point(fsdp, u, 1, NULL);
    }
    for (int b = 0; b < 3; b++) {
        dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->gathered[b], dt__fsdp_largest_params(fsdp));
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->staged[b], fsdp->largest_shard);
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->send16[b], fsdp->largest_shard / 2);
    }
    dt__comm_release(fsdp->comm);            /* after the last prefetch has landed */
    dt_fsdp_set_reduce_dtype(fsdp, DT_F32);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
    for (int i = 0; i < m->nparams; i++) m->params[i].dtype = DT_F32;
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_COMM, fsdp->scattered, fsdp->largest_shard);
    size_t shard_bytes = (size_t)fsdp->shard_numel * sizeof(float);
    if (fsdp->offload) { dt_free_host(DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_host(DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    else { dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_on(m->device, DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    free(fsdp->units);
    free(fsdp);
}

/* -- the data-parallel engine: DDP or FSDP, chosen once -- */
struct dt_data_parallel {
    dt_model *model;
    dt_ddp *ddp;                /* one of the two */
    dt_fsdp *fsdp;
    dt_parallel *par;           /* its dt_parallel */
};
dt_data_parallel *dt_data_parallel_create(dt_model *model, dt_comm *comm, dt_shard_mode shard, int cpu_offload,
                                          double bucket_mb) {
    if (cpu_offload && shard == DT_SHARD_NONE)
        dt_usage_error("--cpu-offload keeps the shards in host memory: it needs --shard optimizer, grads or full");
    if (model->optimizers)
        dt_fail("dt_data_parallel_create: this model already has an optimizer; create the optimizer after "
                "dt_data_parallel_create, which decides what it steps");
    dt_data_parallel *dp = (dt_data_parallel *)calloc(1, sizeof *dp);
    if (!dp) dt_fail("out of memory (data parallelism)");
    dp->model = model;
    if (shard != DT_SHARD_NONE) dp->fsdp = dt_fsdp_create(model, comm, shard, cpu_offload);
    else dp->ddp = dt_ddp_create(model, comm, bucket_mb);          /* over one rank too: the same calls, in the same order */
    if (dp->fsdp) {                                                 /* what the order mistakes name */
        dp->fsdp->par.sync_fn = "dt_data_parallel_sync_grads";
        dp->fsdp->par.free_fn = "dt_data_parallel_free";
        dp->par = &dp->fsdp->par;
    } else dp->par = dt__ddp_as_engine(dp->ddp, "dt_data_parallel_sync_grads", "dt_data_parallel_free");
    return dp;
}
void dt_data_parallel_sync_grads(dt_data_parallel *dp) {
    dt_parallel_backward_done(dp->par);                             /* this engine's, then what it wraps */
}
void dt_data_parallel_free(dt_data_parallel *dp) {
    if (!dp) return;
    dt_fsdp_free(dp->fsdp);
    dt_ddp_free(dp->ddp);
    free(dp);
}

/* [src/14-tensor-parallel.h] */
/* -- tensor parallelism (Megatron-LM, Shoeybi et al., 2019) --
   The model marks where each parameter may be cut (dt_split, the models chapter), and
   its layers call dt_tp_copy and dt_tp_sum (the autograd chapter) wherever a layer is
   cut; this wrapper cuts the parameters and gives the sum. Every rank draws
   the whole model from the seed, as stage 01 does, and keeps its piece: the
   r-th of T along the cut dimension, of each of its `parts` groups (rank r
   gets its heads of q, of k and of v). Replicated parameters (norms,
   embeddings, the head) compute the same values on every rank of a group and
   get the same gradient bits, as the sums they read are the same bits on
   every rank; so they need no communication of their own, and the gradient
   norm counts them once (on the group's first rank). -- */
struct dt_tp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_tp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *group, *across;    /* the ranks that split the layers ("tp"), and the data-parallel groups ("dp") */
    int size, rank;             /* T, and this rank's piece */
    int sequence_parallel;
    /* (the group's share of the data is par's data_rank of data_ranks, where dt_evaluate reads it) */
    double step_sums, step_sum_bytes, step_sum_ms;   /* the last step's sums (par's: this step's so far) */
    /* The model as it was before the cut: its parameters' whole shapes and
       offsets, no buffers. Checkpoints are laid out by it (the checkpoints chapter). */
    dt_model whole;
};
/* Each sum of the step (an all-gather or a reduce-scatter: half of one, as
   many bytes, half the hops), for the cost model; evaluation's are not a
   training step's. */
static void dt__tp_count(dt_tp *t, const char *what, double t0, double sums, double bytes) {
    double t1 = dt_now_ms();
    dt__record_comm(what, t0, t1, 0);
    if (!dt__ctx.grad_enabled) return;
    t->par.tp_sum_ms += t1 - t0;
    t->par.tp_sums += sums;
    t->par.tp_sum_bytes += bytes;
}
static void dt__tp_sum(dt_parallel *par, float *values, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_reduce(t->group, values, values, n, DT_F32, DT_SUM);
    dt__tp_count(t, "all_reduce tp", t0, 1, 4.0 * (double)n);
}
static void dt__tp_max(dt_parallel *par, float *values, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_reduce(t->group, values, values, n, DT_F32, DT_MAX);
    dt__tp_count(t, "all_reduce max tp", t0, 1, 4.0 * (double)n);
}
static void dt__sp_all_gather(dt_parallel *par, const float *mine, float *all, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_gather(t->group, mine, all, n, DT_F32);
    dt__tp_count(t, "all_gather tp", t0, 0.5, 0.5 * 4.0 * (double)n * t->size);
}
static void dt__sp_reduce_scatter(dt_parallel *par, const float *all, float *mine, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_reduce_scatter(t->group, all, mine, n, DT_F32, DT_SUM);
    dt__tp_count(t, "reduce_scatter tp", t0, 0.5, 0.5 * 4.0 * (double)n * t->size);
}
static void dt__tp_step_done(dt_parallel *par) {
    dt_tp *t = (dt_tp *)par;
    t->step_sums = t->par.tp_sums;
    t->step_sum_bytes = t->par.tp_sum_bytes;
    t->step_sum_ms = t->par.tp_sum_ms;
    t->par.tp_sums = t->par.tp_sum_bytes = t->par.tp_sum_ms = 0;
}
static void dt__tp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_tp *)par)->group, values, n, DT_SUM);
}
/* The optimizer steps this rank's pieces and the replicated parameters;
   only the group's first rank counts the replicated ones in the norm. */
static void dt__tp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_tp *t = (dt_tp *)par;
    dt_model *m = t->model;
    dt__optimizer_view_all(o, m);
    for (int i = 0; i < m->nparams; i++) o->slices[i].copy = t->rank > 0 && m->splits[i].dim < 0;
    o->sharded_by = par;
}
/* --sequence-parallel: each rank's part of the whole parameters read where
   the rows are split, summed over the group. (Averaging over the groups is
   the data-parallel engine's, which runs first when it wraps this.) */
static void dt__tp_backward_done(dt_parallel *par) {
    dt_tp *t = (dt_tp *)par;
    dt_model *m = t->model;
    if (t->sequence_parallel) {            /* the whole parameters read where the rows are split: summed */
        double t0 = dt_now_ms();
        for (int i = 0; i < m->nparams; i++)
            if (m->splits[i].dim < 0 && m->splits[i].rows)
                dt_all_reduce(t->group, m->params[i].grad, m->params[i].grad, m->params[i].numel, DT_F32, DT_SUM);
        dt__record_comm("all_reduce tp grads", t0, dt_now_ms(), 0);
    }
}
void dt_tp_sync_grads(dt_tp *tp) {
    if (tp->model->parallel != &tp->par)
        dt_fail("dt_tp_sync_grads: %s wraps this model; call %s, which syncs this one too", tp->model->parallel->create_fn,
                tp->model->parallel->sync_fn);
    if (tp->par.data_ranks > 1)
        dt_fail("dt_tp_sync_grads: %d groups of %d ranks each hold the same pieces, and nothing averages their gradients; "
                "wrap the model in a data-parallel engine over dt_tp_data_group (dt_data_parallel_create) and sync that",
                tp->par.data_ranks, tp->size);
    dt_parallel_backward_done(&tp->par);
}
dt_comm *dt_tp_data_group(const dt_tp *tp) { return tp->across; }
int dt_tp_data_rank(const dt_tp *tp) { return tp->par.data_rank; }
int dt_tp_data_ranks(const dt_tp *tp) { return tp->par.data_ranks; }

/* Piece r of T of a parameter (host values in its whole shape, whole_shape):
   out of the whole (to_whole 0) or back into it (1). */
static void dt__tp_piece(float *whole, float *piece, const int *whole_shape, int ndim, dt_split s, int T, int r,
                         int to_whole) {
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < s.dim; d++) outer *= whole_shape[d];
    for (int d = s.dim + 1; d < ndim; d++) inner *= whole_shape[d];
    int64_t group = whole_shape[s.dim] / s.parts, len = group / T;
    size_t bytes = (size_t)(len * inner) * sizeof(float);
    for (int64_t o = 0; o < outer; o++)
        for (int g = 0; g < s.parts; g++) {
            float *w = whole + (o * whole_shape[s.dim] + g * group + r * len) * inner, *p = piece + ((o * s.parts + g) * len) * inner;
            if (to_whole) memcpy(w, p, bytes);
            else memcpy(p, w, bytes);
        }
}
/* This rank's pieces of a whole state (host) into `local`, laid out by m: how the
   model is cut at the start, and a whole checkpoint loaded (dt__tp_state_gather,
   at the chapter's end, goes the other way). */
static void dt__tp_state_scatter(dt_tp *t, const dt_model *m, float *whole, float *local) {
    const dt_model *W = &t->whole;
    float *mine = (float *)malloc((size_t)m->numel * sizeof(float) + 1);
    if (!mine) dt_fail("out of memory (tensor parallelism)");
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].dim < 0) memcpy(mine + m->offsets[i], whole + W->offsets[i], (size_t)m->params[i].numel * sizeof(float));
        else dt__tp_piece(whole + W->offsets[i], mine + m->offsets[i], W->params[i].shape, m->params[i].ndim, m->splits[i],
                          t->size, t->rank, 0);
    }
    dt_upload(local, mine, (size_t)m->numel * sizeof(float));
    free(mine);
}

/* Cutting a model (tensor and pipeline parallelism): the whole model's
   layout kept in `whole`, a shell without buffers that checkpoints are laid
   out by; each parameter's shape made this rank's by cut_shape (a piece of
   it, or nothing); this rank's values moved into new flat buffers by
   scatter (the whole model's on the host -> this rank's on the device). */
static void dt__model_cut(dt_model *model, dt_model *whole, void (*cut_shape)(void *wrapper, int i, dt_tensor *p),
                          void (*scatter)(void *wrapper, float *whole, float *local), void *wrapper) {
    *whole = *model;
    whole->parallel = NULL;
    whole->flat_data = whole->flat_grad = NULL;
    whole->params = (dt_tensor *)malloc(sizeof(dt_tensor) * (size_t)model->nparams);
    whole->offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(model->nparams + 1));
    if (!whole->params || !whole->offsets) dt_fail("out of memory (cutting the model)");
    memcpy(whole->params, model->params, sizeof(dt_tensor) * (size_t)model->nparams);
    memcpy(whole->offsets, model->offsets, sizeof(int64_t) * (size_t)model->nparams);
    whole->offsets[model->nparams] = model->numel;
    for (int i = 0; i < model->nparams; i++) whole->params[i].data = whole->params[i].grad = NULL;
    model->numel = 0;
    for (int i = 0; i < model->nparams; i++) {
        cut_shape(wrapper, i, &model->params[i]);
        model->offsets[i] = model->numel;
        model->numel += model->params[i].numel;
    }
    model->offsets[model->nparams] = model->numel;
    float *host = dt__host_view(model->device, model->flat_data, whole->numel);
    size_t bytes = (size_t)model->numel * sizeof(float), whole_bytes = (size_t)whole->numel * sizeof(float);
    float *mine = (float *)dt_alloc_on(model->device, DT_ARENA_PARAMS, bytes);
    scatter(wrapper, host, mine);
    dt__host_view_close(model->device, host, model->flat_data, whole->numel, 0);
    dt_free_on(model->device, DT_ARENA_PARAMS, model->flat_data, whole_bytes);
    dt_free_on(model->device, DT_ARENA_GRADS, model->flat_grad, whole_bytes);
    model->flat_data = mine;
    model->flat_grad = (float *)dt_alloc_on(model->device, DT_ARENA_GRADS, bytes);
    for (int i = 0; i < model->nparams; i++) {
        model->params[i].data = model->flat_data + model->offsets[i];
        model->params[i].grad = model->flat_grad + model->offsets[i];
    }
}
static void dt__tp_cut_shape(void *wrapper, int i, dt_tensor *p) {
    dt_tp *t = (dt_tp *)wrapper;
    dt_split sp = t->model->splits[i];
    if (sp.dim < 0) return;
    p->shape[sp.dim] /= t->size;
    p->numel /= t->size;
}
static void dt__tp_scatter(void *wrapper, float *whole, float *local) {
    dt_tp *t = (dt_tp *)wrapper;
    dt__tp_state_scatter(t, t->model, whole, local);
}

dt_tp *dt_tp_create(dt_model *model, dt_comm *comm, int tp, int sequence_parallel) {
    int world = dt_comm_size(comm);
    char v[64];
    snprintf(v, sizeof v, "%d %d", tp, sequence_parallel != 0);
    dt_comm_check_agree(comm, "--tp --sequence-parallel", v);
    if (tp <= 0) tp = world;
    if (world % tp)
        dt_usage_error("--tp %d does not divide the job's %d ranks (the ranks form groups of --tp, data parallel across them)",
                       tp, world);
    if (model->base) dt_usage_error("--lora-rank: LoRA's adapters are not split by tensor parallelism; train them with 03-05");
    int cuts = 0;
    for (int i = 0; i < model->nparams; i++) {
        dt_split sp = model->splits[i];
        if (sp.dim < 0) continue;
        if (sp.vocab && model->params[i].shape[sp.dim] % tp) {    /* the table at start-up says so */
            model->splits[i].dim = -1;
            continue;
        }
        cuts++;
        int64_t group = model->params[i].shape[sp.dim] / sp.parts;
        if (group % ((int64_t)tp * sp.align))
            dt_usage_error("--tp %d: %s's %lld %s do not split into %d equal shares (%s)", tp, model->params[i].name,
                           (long long)(group / sp.align), sp.align > 1 ? "attention heads" : "features", tp,
                           sp.align > 1 ? "--heads (and llama's --kv-heads) must be a multiple of --tp"
                                        : "--dim and the MLP's width must be multiples of --tp");
    }
    if (!cuts && tp > 1)
        dt_usage_error("--model %s: no layer of this model is split by tensor parallelism (the mlp needs --depth 2 or more)",
                       dt__model_kind_name(model->cfg.kind));
    dt_tp *t = (dt_tp *)calloc(1, sizeof *t);
    if (!t) dt_fail("out of memory (tensor parallelism)");
    t->par = (dt_parallel){ .create_fn = "dt_tp_create", .sync_fn = "dt_tp_sync_grads", .free_fn = "dt_tp_free",
                            .backward_done = dt__tp_backward_done, .step_done = dt__tp_step_done,
                            .optimizer_view = dt__tp_optimizer_view,
                            .sum_over_ranks = dt__tp_sum_over_ranks,
                            .tp_sum = tp > 1 ? dt__tp_sum : NULL,     /* a group of one: the layers as in stage 01 */
                            .tp_max = tp > 1 ? dt__tp_max : NULL, .tp_all_gather = tp > 1 ? dt__sp_all_gather : NULL,
                            .sp_all_gather = tp > 1 && sequence_parallel ? dt__sp_all_gather : NULL,
                            .sp_reduce_scatter = tp > 1 && sequence_parallel ? dt__sp_reduce_scatter : NULL };
    dt_model_set_parallel(model, &t->par);
    dt__comm_hold(comm, "dt_tp_free");
    t->model = model;
    t->comm = comm;
    int sizes[2] = { world / tp, tp };
    const char *names[2] = { "dp", "tp" };
    t->mesh = dt_mesh_create(comm, 2, sizes, names);
    t->group = dt_mesh_comm(t->mesh, "tp");
    t->across = dt_mesh_comm(t->mesh, "dp");
    t->size = tp;
    t->rank = dt_mesh_coord(t->mesh, "tp");
    t->par.tp_rank = t->rank;
    t->par.tp_size = tp;
    t->sequence_parallel = tp > 1 && sequence_parallel;
    t->par.data_rank = dt_mesh_coord(t->mesh, "dp");
    t->par.data_ranks = world / tp;

    t->par.whole = &t->whole;
    dt__model_cut(model, &t->whole, dt__tp_cut_shape, dt__tp_scatter, t);
    if (t->par.data_ranks > 1) dt_broadcast(t->across, model->flat_data, model->numel, DT_F32, 0);   /* every group starts alike */
    return t;
}

void dt_tp_free(dt_tp *tp) {
    if (!tp) return;
    if (tp->model->parallel && tp->model->parallel != &tp->par)   /* (a pipeline has let go of the model already) */
        dt_fail("dt_tp_free: another wrapper still wraps the model it cut; call %s first", tp->model->parallel->free_fn);
    dt_model_set_parallel(tp->model, NULL);
    tp->model->left_cut_by = "dt_tp_free";     /* the pieces stay: the model can only be freed now */
    dt_mesh_free(tp->mesh);
    dt__comm_release(tp->comm);
    free(tp->whole.params);
    free(tp->whole.offsets);
    free(tp);
}

/* -- the cross-entropy of logits whose columns, the vocabulary, are split
      over a tensor-parallel group (stage 06's GPT and Llama), so that the
      whole rows never exist on one rank. Each rank takes each row's m and l
      over its columns, and the label's logit where it holds that column; the
      group takes the largest m (an all-reduce), each rank moves its l onto
      that scale by the online softmax's step (as FlashAttention merges two
      blocks of keys), and the group sums the l's and the label's logits.
      Every rank then has each row's loss, log l + m - x[label], and the
      two numbers the backward above needs (m and 1 / l), the labels this
      rank does not hold out of its columns' range. -- */
static dt_tensor *dt__cross_entropy_split(dt_tensor *logits, const int32_t *labels) {
    dt_parallel *par = logits->parallel;
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits), first = par->tp_rank * C;
    double divisor = dt__loss_divisor(labels, B, C * par->tp_size);
    const dt_backend *gpu = dt__backend_for(logits);
    dt_device dev = logits->device;
    dt__scratch_reset();
    void *saved = dt__cross_entropy_saved(B);
    dt__xent_rows k = dt__xent_rows_at(saved, B);
    int32_t *mine = k.labels;
    int32_t *host = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)B);
    for (int i = 0; i < B; i++)            /* this rank's columns: the label's, or -1 (another rank's) */
        host[i] = labels[i] == DT_IGNORE_INDEX ? DT_IGNORE_INDEX
                : labels[i] >= first && labels[i] < first + C ? labels[i] - first : -1;
    float *stats = (float *)dt__scratch_on(dev, sizeof(float) * 3 * (size_t)B);   /* m | l | x[label] */
    const float *lv = dt__in(logits);
    if (gpu) {
        gpu->upload(mine, host, sizeof(int32_t) * (size_t)B);
        gpu->softmax_row_stats(lv, mine, stats, B, C);
    } else {
        memcpy(mine, host, sizeof(int32_t) * (size_t)B);
        DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
        for (int i = 0; i < B; i++) {
            const float *r = lv + (size_t)i * C;
            stats[B + i] = (float)dt__row_softmax(r, C, &stats[i]);
            stats[2 * B + i] = mine[i] >= 0 ? r[mine[i]] : 0.0f;
        }
    }
    float *h = (float *)dt__step_alloc_uninit(sizeof(float) * 4 * (size_t)B), *top = h + 3 * (size_t)B;
    dt__download_from(dev, h, stats, sizeof(float) * 3 * (size_t)B);
    par->tp_max(par, stats, B);
    dt__download_from(dev, top, stats, sizeof(float) * (size_t)B);
    for (int i = 0; i < B; i++) {
        float m = h[i];
        h[B + i] *= dt_online_softmax_rescale(&m, top[i]);       /* this rank's l, on the group's scale */
    }
    dt__upload_to(dev, stats + B, h + B, sizeof(float) * 2 * (size_t)B);
    par->tp_sum(par, stats + B, 2 * (int64_t)B);
    dt__download_from(dev, h + B, stats + B, sizeof(float) * 2 * (size_t)B);
    /* each row's loss, added in row order on the host, as the whole-row op does */
    double total = 0, *inv = (double *)dt__step_alloc_uninit(sizeof(double) * (size_t)B);
    for (int i = 0; i < B; i++) {
        if (labels[i] != DT_IGNORE_INDEX) total += log((double)h[B + i]) + top[i] - h[2 * B + i];
        inv[i] = 1.0 / (double)h[B + i];
    }
    dt__upload_to(dev, k.inv_l, inv, sizeof(double) * (size_t)B);
    dt__upload_to(dev, k.m, top, sizeof(float) * (size_t)B);
    int s1[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, s1, DT_F32);
    float value = (float)(total / divisor);
    dt__upload_to(dev, loss->data, &value, sizeof value);
    return dt__cross_entropy_done(logits, saved, divisor, loss);
}

/* [src/15-pipeline-parallel.h] */
/* -- pipeline parallelism (GPipe: Huang et al., 2019; 1F1B: PipeDream-Flush,
      Narayanan et al., 2021) --
   The blocks are cut into P runs, one per rank of a pipeline: its stage. A
   micro-batch enters at the first stage; each stage runs its blocks and
   sends the activation on; the last one computes the loss. Backward goes
   back the same way, each stage sending the gradient of what it received to
   the stage before. A whole batch at once would keep all stages but one
   waiting, so it is cut into M micro-batches that follow each other down
   the pipeline: while stage 1 works on micro-batch 0, stage 0 starts
   micro-batch 1. What waiting is left -- the bubble, P - 1 micro-batches'
   time as the pipeline fills and as it drains -- is (P - 1) / (M + P - 1)
   of a step when every stage takes as long. The schedule orders a stage's
   forwards and backwards: GPipe runs every forward, then every backward, so
   a stage keeps the activations of all M micro-batches; 1F1B runs a
   micro-batch's backward as soon as it can, so it keeps at most P (the
   first stage P, the last one), for the same bubble. Each micro-batch has a
   step arena of its own, given back when its backward is done, so memory
   follows the schedule. Activations travel one way on one pair of ranks and
   gradients the other way on another, each pair with its own communication
   thread (or stream) and in micro-batch order on both sides, so the two
   directions never wait for each other; a stage posts its next receive as
   soon as it has taken the last one, into an inbox, so that the next
   message arrives while it computes. Every rank of a pipeline reads the
   same batch (the first stage its inputs, the last its labels). -- */
typedef struct { int backward, micro; } dt__pp_action;
/* A schedule is the order of one stage's 2M actions. */
static int dt__gpipe_order(int stage, int stages, int M, dt__pp_action *a) {
    (void)stage; (void)stages;
    int n = 0;
    for (int i = 0; i < M; i++) a[n++] = (dt__pp_action){ 0, i };
    for (int i = 0; i < M; i++) a[n++] = (dt__pp_action){ 1, i };
    return n;
}
/* 1F1B: as many forwards as the stages after this one (warm-up), then one
   forward and one backward in turn, then the backwards left (cool-down). */
static int dt__1f1b_order(int stage, int stages, int M, dt__pp_action *a) {
    int warm = stages - 1 - stage < M ? stages - 1 - stage : M, n = 0, f = 0, b = 0;
    while (f < warm) a[n++] = (dt__pp_action){ 0, f++ };
    while (f < M) { a[n++] = (dt__pp_action){ 0, f++ }; a[n++] = (dt__pp_action){ 1, b++ }; }
    while (b < M) a[n++] = (dt__pp_action){ 1, b++ };
    return n;
}
static const struct { const char *name; int (*order)(int stage, int stages, int M, dt__pp_action *a); } dt__pp_schedules[] = {
    { "gpipe", dt__gpipe_order }, { "1f1b", dt__1f1b_order } };   /* in dt_pp_schedule's order */

struct dt_pp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_pp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *pipe, *across;     /* the stages of one pipeline ("pp"), and the data-parallel pipelines ("dp") */
    dt_comm *ends;              /* the first and the last stage (a tied vocabulary), or NULL */
    dt_comm *to_next, *from_next, *to_prev, *from_prev;   /* one way each: activations on, gradients back */
    int stages, stage, micro_batches;
    dt_pp_schedule schedule;
    int *first_block;           /* stage s runs blocks [first_block[s], first_block[s + 1]) */
    dt_model whole;             /* the model before the cut into stages (around --tp: its pieces of every stage) */
    /* Per micro-batch slot: an arena pair, taken by a forward, given back
       after its backward (slots: as many as were ever alive at once). */
    dt__step_arena (*arenas)[2];
    int nslots;
    /* The inboxes the next receive lands in, and their handles (0: none posted). */
    void *inbox_x, *inbox_g;
    size_t inbox_bytes;
    dt_comm_handle recv_x, recv_g;
    /* The last step, for the log and the tests: this rank's time computing
       and waiting, and the activation bytes kept at once (at most, and per
       micro-batch); the pipeline's: its stages' times added up, and the
       busiest stage's (which sets the pace). */
    double busy_ms, idle_ms, step_ms;
    double pipe_busy_ms, pipe_idle_ms, pipe_step_ms, pipe_busiest_ms;
    double pipe_tp_sums, pipe_tp_sum_ms, pipe_tp_sum_bytes;   /* around --tp: the stages' layer sums, their time and bytes */
    double act_bytes;           /* one micro-batch's activation, sent on */
    double kept_peak, kept_micro;
    int kept_micro_batches;     /* the most micro-batches alive at once */
};

static int dt__pp_holds(const dt_pp *p, int stage, int i) {
    const dt_split *sp = &p->model->splits[i];
    int n = dt_model_blocks(p->model), last = stage == p->stages - 1;
    if (sp->tied && (stage == 0 || last)) return 1;
    if (sp->block < 0) return stage == 0;
    if (sp->block >= n) return last;
    return sp->block >= p->first_block[stage] && sp->block < p->first_block[stage + 1];
}
/* Stage s runs blocks [first[s], first[s + 1]): the cut whose largest stage
   holds the fewest parameters (the embedding's counted with the first stage,
   the head's with the last), found by dynamic programming over the cuts. */
static void dt__pp_balance(const dt_model *m, int P, int *first) {
    int n = dt_model_blocks(m);
    double *w = (double *)calloc((size_t)n + 3, sizeof(double)), *cum = (double *)calloc((size_t)n + 1, sizeof(double));
    double *best = (double *)malloc(sizeof(double) * (size_t)(P + 1) * (size_t)(n + 1));
    int *cut = (int *)malloc(sizeof(int) * (size_t)(P + 1) * (size_t)(n + 1));
    if (!w || !cum || !best || !cut) dt_fail("out of memory (pipeline stages)");
    for (int i = 0; i < m->nparams; i++) {
        int b = m->splits[i].block;
        w[(b < 0 ? -1 : b > n ? n : b) + 1] += (double)m->params[i].numel;
        if (m->splits[i].tied) w[n + 1] += (double)m->params[i].numel;
    }
    for (int b = 0; b < n; b++) cum[b + 1] = cum[b] + w[b + 1];
#define DT_BEST(k, j) best[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
#define DT_CUT(k, j) cut[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
    /* DT_BEST(k, j): the smallest largest stage of blocks [0, j) in k stages */
    for (int j = 1; j <= n; j++) DT_BEST(1, j) = w[0] + cum[j] + (P == 1 ? w[n + 1] : 0);
    for (int k = 2; k <= P; k++)
        for (int j = k; j <= n; j++) {
            DT_BEST(k, j) = HUGE_VAL;
            for (int c = k - 1; c < j; c++) {
                double here = cum[j] - cum[c] + (k == P && j == n ? w[n + 1] : 0);
                double worst = fmax(DT_BEST(k - 1, c), here);
                if (worst < DT_BEST(k, j)) { DT_BEST(k, j) = worst; DT_CUT(k, j) = c; }
            }
        }
    first[P] = n;
    for (int k = P, j = n; k > 1; k--) j = first[k - 1] = DT_CUT(k, j);
    first[0] = 0;
#undef DT_BEST
#undef DT_CUT
    free(w); free(cum); free(best); free(cut);
}

static void dt__pp_cut_shape(void *wrapper, int i, dt_tensor *p) {
    dt_pp *pp = (dt_pp *)wrapper;
    if (dt__pp_holds(pp, pp->stage, i)) return;
    p->shape[0] = 0;                        /* not this stage's: nothing here */
    p->numel = 0;
}
static void dt__pp_scatter(void *wrapper, float *whole, float *local) {
    dt_pp *p = (dt_pp *)wrapper;
    dt_model *m = p->model;
    for (int i = 0; i < m->nparams; i++)
        dt__upload_to(m->device, local + m->offsets[i], whole + p->whole.offsets[i], (size_t)m->params[i].numel * sizeof(float));
}

/* The shape of what stage s passes stage s + 1, for a micro-batch of these inputs. */
static void dt__pp_activation_shape(const dt_pp *p, const dt_tensor *inputs, int shape[2]) {
    shape[0] = inputs->shape[0] * dt__family(p->model->cfg.kind)->rows_per_sample(p->model, inputs);
    shape[1] = p->model->cfg.dim;
}
/* The inbox's next message from `from`, waited for (the time counts as
   idle), copied into dst, and the receive after it posted when `more`. */
static void dt__pp_take(dt_pp *p, dt_comm *from, int peer, void *inbox, dt_comm_handle *h, void *dst, int64_t n, dt_dtype t,
                        int more) {
    double t0 = dt_now_ms(), a, b;
    if (!*h) *h = dt_recv_async(from, inbox, n, t, peer);
    dt_comm_wait(from, *h);
    dt_synchronize();
    double t1 = dt_now_ms();
    p->idle_ms += t1 - t0;
    dt__record_event("waiting", t0, t1);
    /* the receive on the trace's communication row; not in the step's
       communication time, as it was posted early and its span holds the
       sender's compute (the send's, counted by the sender, is the message) */
    dt__comm_interval(from, *h, &a, &b);
    dt__record_span(from == p->from_prev ? "recv activation" : "recv gradient", a, b, 0);
    dt_convert(inbox, t, dst, t, n);                   /* a copy on the device */
    *h = more ? dt_recv_async(from, inbox, n, t, peer) : 0;
}
static void dt__pp_inboxes(dt_pp *p, size_t bytes) {
    if (bytes <= p->inbox_bytes) return;    /* grown between steps, when no receive is posted into them */
    dt_free_on(p->model->device, DT_ARENA_COMM, p->inbox_x, p->inbox_bytes);
    dt_free_on(p->model->device, DT_ARENA_COMM, p->inbox_g, p->inbox_bytes);
    p->inbox_x = dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    p->inbox_g = dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    p->inbox_bytes = bytes;
}

/* What one micro-batch leaves between its forward and its backward. */
typedef struct {
    int slot;                   /* its arena pair */
    int tape_lo, tape_hi;       /* its forward's entries on the tape */
    dt_tensor *in, *out;        /* what it received (NULL at the first stage), what it sent on or its loss */
    dt_comm_handle sent;        /* out, sent on (0: the last stage) */
    double kept;                /* the bytes its forward left in its arena */
} dt__pp_micro;
/* ... and what the step's actions share. */
typedef struct {
    const dt_batch *batch;
    int M, b, first, end, labels_per;   /* micro-batches, each b samples; this stage's blocks [first, end) */
    int act[2];                 /* what a stage passes the next: rows x width */
    int64_t act_n, in_per;      /* its values; an input sample's */
    dt_dtype t;
    double divisor;             /* masked data: the step's count of targets (0: none) */
    double loss_sum, kept;      /* the last stage's losses; the activation bytes kept now */
    int forwards, backwards, alive;
    int *free_slots, nfree;
    dt__pp_micro *mb;
} dt__pp_step;

/* The time since t0 was spent computing micro-batch i: counted, and on the trace. */
static void dt__pp_busy(dt_pp *p, const char *what, int i, double t0) {
    dt_synchronize();
    double t1 = dt_now_ms();
    char name[32];
    p->busy_ms += t1 - t0;
    snprintf(name, sizeof name, "%s %d", what, i);
    dt__record_event(name, t0, t1);
}
/* Wait until a send is taken; on the trace, the part before `since` hidden. */
static void dt__pp_sent(dt_comm *c, dt_comm_handle h, const char *name, double since) {
    if (!h) return;
    double a, z;
    dt_comm_wait(c, h);
    dt__comm_interval(c, h, &a, &z);
    dt__record_comm(name, a, z, fmax(0, fmin(z, since) - a));
}

/* Micro-batch i's forward: its slot's arena in place, its rows of the batch,
   what the stage before sent (from the inbox), this stage's blocks, then
   the activation sent on, or the loss. */
static void dt__pp_forward_one(dt_pp *pp, dt__pp_step *st, int i) {
    dt__pp_micro *u = &st->mb[i];
    int last = pp->stage == pp->stages - 1;
    u->slot = st->free_slots[--st->nfree];
    dt__step_arena_swap(pp->arenas[u->slot]);
    size_t before = dt__ctx.step[DT_CPU].high + dt__ctx.step[DT_CUDA].high;
    dt_tensor *inputs = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));   /* rows [i b, (i + 1) b) of the batch */
    *inputs = *st->batch->inputs;
    inputs->shape[0] = st->b;
    inputs->numel = st->in_per * st->b;
    inputs->data = (float *)((char *)inputs->data + (size_t)(st->in_per * st->b * i) * dt_dtype_size(inputs->dtype));
    u->in = NULL;
    if (pp->stage > 0) {
        u->in = dt__tensor_alloc(2, st->act, st->t);
        u->in->requires_grad = 1;           /* its gradient goes back to the stage before */
        dt__pp_take(pp, pp->from_prev, 0, pp->inbox_x, &pp->recv_x, u->in->data, st->act_n, st->t, st->forwards + 1 < st->M);
    }
    double t0 = dt_now_ms();
    u->tape_lo = dt__ctx.tape_len;
    dt_tensor *y = dt_model_forward_blocks(pp->model, inputs, u->in, st->first, st->end);
    u->sent = 0;
    if (last) {
        const int32_t *labels = st->batch->labels + (size_t)i * st->b * st->labels_per;
        if (st->divisor > 0) dt_cross_entropy_set_divisor(labels, st->divisor / st->M);
        y = dt_cross_entropy(y, labels);
        st->loss_sum += dt_tensor_item(y);
    } else {
        if (y->numel != st->act_n)
            dt_fail("pipeline: stage %d's blocks gave %lld values, %lld expected", pp->stage, (long long)y->numel,
                    (long long)st->act_n);
        u->sent = dt_send_async(pp->to_next, y->data, st->act_n, st->t, 1);
    }
    u->out = y;
    u->tape_hi = dt__ctx.tape_len;
    dt__pp_busy(pp, "forward", i, t0);
    u->kept = (double)(dt__ctx.step[DT_CPU].high + dt__ctx.step[DT_CUDA].high - before);
    st->kept += u->kept;
    st->alive++;
    pp->kept_peak = fmax(pp->kept_peak, st->kept);
    pp->kept_micro = fmax(pp->kept_micro, u->kept);
    if (st->alive > pp->kept_micro_batches) pp->kept_micro_batches = st->alive;
    dt__step_arena_swap(pp->arenas[u->slot]);
    st->forwards++;
}

/* Micro-batch i's backward: from 1/M at the last stage (the batch's loss
   is the micro-batches' mean), else from the gradient the next stage sent;
   its input's gradient sent back; then its arena given back, once what it
   sent is taken (by then the next stage has long had `out`). */
static void dt__pp_backward_one(dt_pp *pp, dt__pp_step *st, int i) {
    dt__pp_micro *u = &st->mb[i];
    dt__step_arena_swap(pp->arenas[u->slot]);
    if (pp->stage == pp->stages - 1) {
        float seed = 1.0f / (float)st->M;
        dt_upload(dt_grad(u->out), &seed, sizeof seed);
    } else
        dt__pp_take(pp, pp->from_next, 1, pp->inbox_g, &pp->recv_g, dt_grad(u->out), st->act_n, st->t, st->backwards + 1 < st->M);
    for (dt_parallel *q = pp->model->parallel; q != &pp->par; q = q->inner)   /* an engine around: the last one syncs */
        if (q->set_sync) q->set_sync(q, st->backwards == st->M - 1);
    double t0 = dt_now_ms();
    dt__backward_span(u->out, u->tape_lo, u->tape_hi);
    dt_comm_handle sent_back = pp->stage > 0 ? dt_send_async(pp->to_prev, dt_grad(u->in), st->act_n, st->t, 0) : 0;
    dt__pp_busy(pp, "backward", i, t0);
    if (sent_back || u->sent) {             /* idle is only ever time spent on a peer: a lone stage has none */
        double t1 = dt_now_ms();
        dt__pp_sent(pp->to_prev, sent_back, "send gradient", t1);
        dt__pp_sent(pp->to_next, u->sent, "send activation", t1);
        dt_synchronize();
        double t2 = dt_now_ms();
        pp->idle_ms += t2 - t1;
        if (t2 - t1 > 0.01) dt__record_event("waiting", t1, t2);
    }
    st->kept -= u->kept;
    st->alive--;
    dt__step_arena_swap(pp->arenas[u->slot]);
    dt__step_arena_release(pp->arenas[u->slot]);
    st->free_slots[st->nfree++] = u->slot;
    st->backwards++;
}

dt_tensor *dt_pp_forward_backward(dt_pp *pp, const dt_batch *batch) {
    int M = pp->micro_batches, B = batch->size, last = pp->stage == pp->stages - 1;
    if (B % M)
        dt_usage_error("--micro-batches %d does not divide --batch-size %d (each micro-batch takes an equal share)", M, B);
    if (pp->model->parallel->grads_pending)         /* the outermost wrapper's: what syncs them */
        dt_fail("dt_pp_forward_backward: the gradients of the last step were not synchronised; call %s before the next step",
                pp->model->parallel->sync_fn);
    if (!dt__ctx.grad_enabled) dt_fail("dt_pp_forward_backward: gradients are off (dt_set_grad_enabled(0)); it trains a step");
    dt__pp_step st = { .batch = batch, .M = M, .b = B / M, .first = pp->first_block[pp->stage],
                       .end = pp->first_block[pp->stage + 1], .t = dt__ctx.compute_dtype,
                       .in_per = batch->inputs->numel / B };
    st.labels_per = dt_model_is_language(pp->model->cfg.kind) ? (int)dt_tensor_cols(batch->inputs) : 1;
    if (dt__ctx.loss_divisor.labels == batch->labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        st.divisor = dt__ctx.loss_divisor.divisor;   /* set for the whole batch: each micro-batch takes 1/M of it */
    dt_tensor micro_inputs = *batch->inputs;
    micro_inputs.shape[0] = st.b;
    micro_inputs.numel = st.in_per * st.b;
    dt__pp_activation_shape(pp, &micro_inputs, st.act);
    st.act_n = (int64_t)st.act[0] * st.act[1];
    pp->act_bytes = (double)st.act_n * (double)dt_dtype_size(st.t);
    /* the order of this stage's actions, and an arena for each micro-batch
       (those never taken at once cost nothing) */
    dt__pp_action *order = (dt__pp_action *)dt_step_alloc(sizeof(dt__pp_action) * 2 * (size_t)M);
    int nactions = dt__pp_schedules[pp->schedule].order(pp->stage, pp->stages, M, order);
    st.mb = (dt__pp_micro *)dt_step_alloc(sizeof(dt__pp_micro) * (size_t)M);
    st.free_slots = (int *)dt_step_alloc(sizeof(int) * (size_t)M);
    if (pp->nslots < M) {
        pp->arenas = (dt__step_arena (*)[2])realloc(pp->arenas, sizeof *pp->arenas * (size_t)M);
        if (!pp->arenas) dt_fail("out of memory (pipeline)");
        memset(pp->arenas + pp->nslots, 0, sizeof *pp->arenas * (size_t)(M - pp->nslots));
        pp->nslots = M;
    }
    for (int k = M - 1; k >= 0; k--) st.free_slots[st.nfree++] = k;
    dt__pp_inboxes(pp, (size_t)st.act_n * dt_dtype_size(st.t));
    if (pp->stage > 0) pp->recv_x = dt_recv_async(pp->from_prev, pp->inbox_x, st.act_n, st.t, 0);   /* posted early */
    if (!last) pp->recv_g = dt_recv_async(pp->from_next, pp->inbox_g, st.act_n, st.t, 1);
    double t_start = dt_now_ms();
    pp->busy_ms = pp->idle_ms = 0;
    pp->kept_peak = pp->kept_micro = 0;
    pp->kept_micro_batches = 0;
    for (int k = 0; k < nactions; k++) {
        if (order[k].backward) dt__pp_backward_one(pp, &st, order[k].micro);
        else dt__pp_forward_one(pp, &st, order[k].micro);
    }
    dt__ctx.tape_len = 0;                   /* every micro-batch's entries are walked */
    /* the batch's loss from the last stage, on every rank: the step's end
       for every stage, so a stage done early waits here -- the drain's part
       of the bubble */
    double t_done = dt_now_ms();
    float mean = last ? (float)(st.loss_sum / M) : 0;
    dt__comm_all_reduce_host(pp->pipe, &mean, 1, DT_SUM);
    double t_end = dt_now_ms();
    if (pp->stages > 1) {
        pp->idle_ms += t_end - t_done;
        if (t_end - t_done > 0.01) dt__record_event("waiting", t_done, t_end);
    }
    pp->step_ms = t_end - t_start;
    /* the stages' times, and the sums their split layers waited for (the
       tensor-parallel wrapper counts a step's, from its step's start) */
    dt_parallel *split = dt_parallel_splitting(pp->par.inner);
    float sums[6] = { (float)pp->busy_ms, (float)pp->idle_ms, (float)pp->step_ms, 0, 0, 0 }, busiest = (float)pp->busy_ms;
    if (split) { sums[3] = (float)split->tp_sums; sums[4] = (float)split->tp_sum_ms; sums[5] = (float)split->tp_sum_bytes; }
    dt__comm_all_reduce_host(pp->pipe, sums, 6, DT_SUM);
    dt__comm_all_reduce_host(pp->pipe, &busiest, 1, DT_MAX);
    pp->pipe_busy_ms = sums[0]; pp->pipe_idle_ms = sums[1]; pp->pipe_step_ms = sums[2]; pp->pipe_busiest_ms = busiest;
    pp->pipe_tp_sums = sums[3]; pp->pipe_tp_sum_ms = sums[4]; pp->pipe_tp_sum_bytes = sums[5];
    int one[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, one, DT_F32);
    dt_upload(loss->data, &mean, sizeof mean);
    return loss;
}

/* The batch's loss is the last stage's; the gradients of a tied vocabulary
   are the first stage's (the embedding) plus the last's (the head). */
static void dt__pp_sum_tied(dt_parallel *par) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    if (!p->ends) return;
    double t0 = dt_now_ms();
    for (int i = 0; i < m->nparams; i++)
        if (m->splits[i].tied) dt_all_reduce(p->ends, m->params[i].grad, m->params[i].grad, m->params[i].numel, DT_F32, DT_SUM);
    dt__record_comm("all_reduce tied", t0, dt_now_ms(), 0);
}
/* Unwrapped, there is one pipeline and nothing to average; wrapped, the
   engine has summed the tied gradients (sum_shared_grads) when they were whole. */
static void dt__pp_backward_done(dt_parallel *par) {
    if (((dt_pp *)par)->model->parallel == par) dt__pp_sum_tied(par);
}
void dt_pp_sync_grads(dt_pp *pp) {
    if (pp->model->parallel != &pp->par)
        dt_fail("dt_pp_sync_grads: %s wraps this model; call %s, which syncs this one too", pp->model->parallel->create_fn,
                pp->model->parallel->sync_fn);
    if (pp->par.data_ranks > 1)
        dt_fail("dt_pp_sync_grads: %d pipelines each hold the same stages, and nothing averages their gradients; wrap the "
                "model in a data-parallel engine over dt_pp_data_group (dt_data_parallel_create) and sync that",
                pp->par.data_ranks);
    dt_parallel_backward_done(&pp->par);
}
dt_comm *dt_pp_data_group(const dt_pp *pp) { return pp->across; }
int dt_pp_data_rank(const dt_pp *pp) { return pp->par.data_rank; }
int dt_pp_data_ranks(const dt_pp *pp) { return pp->par.data_ranks; }

/* Each stage steps what it holds; the gradient norm adds up the stages'
   parts, the tied vocabulary counted once (at the first stage), and around
   tensor parallelism a whole parameter once per group (the view inside). */
static void dt__pp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    if (par->inner && par->inner->optimizer_view) par->inner->optimizer_view(par->inner, o);   /* a slice per parameter */
    else dt__optimizer_view_all(o, m);
    for (int i = 0; i < m->nparams; i++) o->slices[i].copy |= p->stage > 0 && m->splits[i].tied;
    o->sharded_by = par;
}
static void dt__pp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_pp *)par)->pipe, values, n, DT_SUM);
    if (par->inner && par->inner->sum_over_ranks) par->inner->sum_over_ranks(par->inner, values, n);   /* the tensor group's parts */
}

/* Evaluation and generation: the batch down the pipeline at once (no
   micro-batches: there is no backward to overlap), and the last stage's
   logits to every rank. */
static dt_tensor *dt__pp_forward(dt_parallel *par, dt_tensor *inputs) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    int last = p->stage == p->stages - 1, act[2];
    dt_dtype t = dt__ctx.compute_dtype;
    if (dt__ctx.grad_enabled)
        dt_fail("dt_model_forward: under pipeline parallelism a training step is dt_pp_forward_backward (the stages take "
                "turns); dt_model_forward runs without gradients only (evaluation, generation)");
    dt__pp_activation_shape(p, inputs, act);
    dt_tensor *x = NULL;
    if (p->stage > 0) {
        x = dt__tensor_alloc(2, act, t);
        dt_recv(p->from_prev, x->data, x->numel, t, 0);
    }
    dt_tensor *y = dt_model_forward_blocks(m, inputs, x, p->first_block[p->stage], p->first_block[p->stage + 1]);
    if (!last) dt_send(p->to_next, y->data, y->numel, t, 1);
    /* the logits' columns: the vocabulary's share of this rank when --tp split it */
    float cols = last ? (float)dt_tensor_cols(y) : 0;
    dt__comm_all_reduce_host(p->pipe, &cols, 1, DT_SUM);
    if (!last) {
        int shape[2] = { inputs->shape[0] * (dt_model_is_language(m->cfg.kind) ? (int)dt_tensor_cols(inputs) : 1), (int)cols };
        y = dt__tensor_alloc(2, shape, t);
        if ((int)cols != m->cfg.classes) y->parallel = dt_parallel_splitting(par);   /* dt_logits_to_host gathers them */
    }
    dt_broadcast(p->pipe, y->data, y->numel, t, p->stages - 1);
    return y;
}

/* A one-way pair for each neighbour: `round` 0 pairs stages (0, 1), (2, 3)
   ..., round 1 pairs (1, 2), (3, 4) ...; a rank in no pair of a round is a
   group of its own, freed at once. */
static void dt__pp_pair(dt_pp *p, int round, dt_comm **with_next, dt_comm **with_prev) {
    int s = p->stage, P = p->stages;
    int j = (s % 2 == round) ? s : s - 1;       /* the boundary (j, j + 1) this rank is on this round */
    int paired = j >= 0 && j + 1 < P;
    dt_comm *c = dt_comm_split(p->pipe, paired ? j : P + s, s);
    if (!paired) { dt_comm_free(c); return; }
    if (j == s) *with_next = c;
    else *with_prev = c;
}

dt_pp *dt_pp_create(dt_model *model, dt_comm *comm, int pp, int micro_batches, dt_pp_schedule schedule) {
    int world = dt_comm_size(comm);
    char v[64];
    snprintf(v, sizeof v, "%d %d %d", pp, micro_batches, (int)schedule);
    dt_comm_check_agree(comm, "--pp --micro-batches --schedule", v);
    if (model->parallel && (!model->parallel->whole || model->parallel->forward))   /* DDP, FSDP, a pipeline: outside it */
        dt_fail("dt_pp_create: %s already wraps this model; a pipeline cuts the model first (or after tensor parallelism), "
                "and a data-parallel engine wraps it after", model->parallel->create_fn);
    if (model->parallel && model->parallel->data_ranks > 0 && world != model->parallel->data_ranks)
        dt_fail("dt_pp_create: its communicator has %d ranks, but %d groups of %s hold the same pieces: give it the ranks "
                "that hold this rank's pieces (dt_tp_data_group)", world, model->parallel->data_ranks,
                model->parallel->create_fn);
    const dt_parallel *split = dt_parallel_splitting(model->parallel);      /* comm: one rank of each tensor group */
    const char *over = split ? " over --tp" : "";
    if (pp <= 0) pp = world;
    if (world % pp)
        dt_usage_error("--pp %d does not divide the job's %d ranks%s (the ranks form pipelines of --pp stages%s, data parallel "
                       "across them)", pp, world * (split ? split->tp_size : 1), over, split ? " of --tp ranks each" : "");
    if (micro_batches < 1) dt_usage_error("--micro-batches %d: a step needs at least one", micro_batches);
    if ((int)schedule < 0 || (int)schedule >= (int)(sizeof dt__pp_schedules / sizeof dt__pp_schedules[0]))
        dt_fail("dt_pp_create: schedule %d is not one dtrain knows", (int)schedule);
    if (model->base) dt_usage_error("--lora-rank: LoRA's adapters are not split into pipeline stages; train them with 03-05");
    int n = dt_model_blocks(model);
    if (n < pp)
        dt_usage_error("--pp %d: the model has %d block%s (--depth), fewer than the stages, and each stage runs at least one",
                       pp, n, n == 1 ? "" : "s");
    dt_pp *p = (dt_pp *)calloc(1, sizeof *p);
    if (!p) dt_fail("out of memory (pipeline parallelism)");
    p->par = (dt_parallel){ .create_fn = "dt_pp_create", .sync_fn = "dt_pp_sync_grads", .free_fn = "dt_pp_free",
                            .backward_done = dt__pp_backward_done, .sum_shared_grads = dt__pp_sum_tied,
                            .optimizer_view = dt__pp_optimizer_view, .sum_over_ranks = dt__pp_sum_over_ranks,
                            .forward = dt__pp_forward,
                            .inner = model->parallel };       /* around tensor parallelism: its pieces, cut into stages */
    dt_model_set_parallel(model, &p->par);
    dt__comm_hold(comm, "dt_pp_free");
    p->model = model;
    p->comm = comm;
    int sizes[2] = { world / pp, pp };
    const char *names[2] = { "dp", "pp" };
    p->mesh = dt_mesh_create(comm, 2, sizes, names);
    p->pipe = dt_mesh_comm(p->mesh, "pp");
    p->across = dt_mesh_comm(p->mesh, "dp");
    p->stages = pp;
    p->stage = dt_mesh_coord(p->mesh, "pp");
    p->micro_batches = micro_batches;
    p->schedule = schedule;
    p->par.data_rank = dt_mesh_coord(p->mesh, "dp");
    p->par.data_ranks = world / pp;
    p->first_block = (int *)malloc(sizeof(int) * (size_t)(pp + 1));
    if (!p->first_block) dt_fail("out of memory (pipeline parallelism)");
    dt__pp_balance(model, pp, p->first_block);
    dt__model_cut(model, &p->whole, dt__pp_cut_shape, dt__pp_scatter, p);
    p->par.whole = p->par.inner ? p->par.inner->whole : &p->whole;   /* what checkpoints hold: the model whole */
    for (int round = 0; round < 2 && pp > 1; round++) {      /* activations on, then gradients back */
        dt__pp_pair(p, round, &p->to_next, &p->from_prev);
        dt__pp_pair(p, round, &p->from_next, &p->to_prev);
    }
    int tied = 0;
    for (int i = 0; i < model->nparams; i++) tied |= model->splits[i].tied;
    if (tied && pp > 1) {
        int end = p->stage == 0 || p->stage == pp - 1;
        p->ends = dt_comm_split(p->pipe, end ? 0 : 1 + p->stage, p->stage);
        if (!end) { dt_comm_free(p->ends); p->ends = NULL; }
    }
    return p;
}

void dt_pp_free(dt_pp *pp) {
    if (!pp) return;
    dt__data_parallel_unwrap(pp->model, &pp->par);        /* the wrapper inside, if any, holds the model again */
    dt_comm *mine[5] = { pp->ends, pp->to_next, pp->from_next, pp->to_prev, pp->from_prev };
    for (int k = 0; k < 5; k++) if (mine[k]) dt_comm_free(mine[k]);
    pp->model->left_cut_by = "dt_pp_free";   /* each rank keeps its stage: the model can only be freed now */
    for (int k = 0; k < pp->nslots; k++) dt__step_arena_free(pp->arenas[k]);
    free(pp->arenas);
    dt_free_on(pp->model->device, DT_ARENA_COMM, pp->inbox_x, pp->inbox_bytes);
    dt_free_on(pp->model->device, DT_ARENA_COMM, pp->inbox_g, pp->inbox_bytes);
    dt_mesh_free(pp->mesh);
    dt__comm_release(pp->comm);
    free(pp->first_block);
    free(pp->whole.params);
    free(pp->whole.offsets);
    free(pp);
}

/* [src/16-context-parallel.h] */
void dt_cp_positions(dt_cp_layout layout, int T, int C, int rank, int32_t *positions) {
    if (C < 1 || rank < 0 || rank >= C) dt_fail("dt_cp_positions: rank %d of %d", rank, C);
    int chunks = layout == DT_CP_ZIGZAG ? 2 * C : C, n = T / chunks, k = 0;
    if (T % chunks)
        dt_fail("context parallelism: a sequence of %d tokens does not cut into %d equal chunks (%d ranks, %s layout)", T,
                chunks, C, layout == DT_CP_ZIGZAG ? "zig-zag" : "contiguous");
    for (int j = 0; j < n; j++) positions[k++] = rank * n + j;
    if (layout == DT_CP_ZIGZAG)
        for (int j = 0; j < n; j++) positions[k++] = (2 * C - 1 - rank) * n + j;
}

static DT_THREAD_LOCAL int64_t dt__ring_scores;
int64_t dt_ring_attention_scores(void) { return dt__ring_scores; }
/* Training's time waiting for the ring on this thread, since the wrapper's
   last step (its step_done takes it): what the cost model takes out of the
   measured compute. On a GPU a wait only queues the wait on the device's
   stream, so this is the host's part alone (about 0). */
static DT_THREAD_LOCAL double dt__ring_wait_ms;
static void dt__ring_wait(dt_comm *ring, dt_comm_handle h) {
    double t0 = dt_now_ms();
    dt_comm_wait(ring, h);
    if (dt__ctx.grad_enabled) dt__ring_wait_ms += dt_now_ms() - t0;      /* training's: evaluation goes around too */
}

/* What travels the ring: a rank's block, its T positions (as floats: exact
   below 2^24) then its keys and values, [B*T, D] each (in backward, each
   block's gradient sum too, apart, a step behind it). All of it on the
   device that holds qkv. */
typedef struct dt__ring {
    dt_comm *comm;
    int B, T, H, D, causal;
    float scale, *qpos, *lse, *O;   /* on the device: this rank's positions, each row's log-sum-exp [B*H*T], output [B*T, D] */
} dt__ring;

/* The CPU's bodies of the backend table's ring entries (ring_attention_step,
   ring_attention_backward_step, copy_columns: the backend-tables chapter
   says what each does), with the same parameters. A step is this rank's
   queries against the block it holds, through the online body
   (dt__online_forward, the attention chapter's) at the tokens' true
   positions, each row's (m, l) and output carried from block to block: the
   same loops as one device's; the ring only brings the keys. */
static void dt__ring_attention_step(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                    float *out, int first, int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    int64_t rows = (int64_t)B * H * T, BTD = (int64_t)B * T * D, work = 0;
    const float *K = blk + T, *V = K + BTD;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)hd * Tp * (size_t)dt_threads());
    for (int64_t i = 0; i < rows && first; i++) { lse[i] = -INFINITY; l[i] = 0; }   /* lse holds m until the last block */
    if (first) memset(O, 0, sizeof(float) * (size_t)BTD);
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;          /* this head's rows in [B*T, D] arrays (+ i * D) */
        float *kt = space + (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { qkv + (size_t)b * T * 3 * D + h * hd, kt, NULL, NULL, V + at, qpos, blk, 3 * D, D,
                              T, T, Tp, hd, causal, scale };
        dt__att_transpose(K + at, D, T, hd, kt, Tp);
        work += dt__online_forward(&a, lse + (size_t)bh * T, l + (size_t)bh * T, O + at, D);
        if (out) dt__online_finish(T, hd, lse + (size_t)bh * T, l + (size_t)bh * T, O + at, D, out + at, D);
    }
    dt__ring_scores += work;
}
/* Backward against the block held (dt__online_backward): dQ into this
   rank's rows, dK and dV into dkv, this rank's share of the block's. */
static void dt__ring_attention_backward_step(const float *qkv, const float *blk, const float *qpos, const float *lse,
                                             const float *O, const float *dout, float *dots, float *dqkv, float *dkv, int B, int T,
                                             int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    int64_t BTD = (int64_t)B * T * D, work = 0;
    const float *K = blk + T, *V = K + BTD;
    float *dK = dkv, *dV = dkv + BTD;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)hd * Tp * (size_t)dt_threads());
    (void)dots;                                          /* the GPU's scratch: here each tile of rows makes its own */
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {                 /* a head's columns: no two threads write the same */
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;
        float *kt = space + 2 * (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { qkv + (size_t)b * T * 3 * D + h * hd, kt, kt + (size_t)hd * Tp, K + at, V + at, qpos, blk,
                              3 * D, D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(K + at, D, T, hd, kt, Tp);
        dt__att_transpose(V + at, D, T, hd, kt + (size_t)hd * Tp, Tp);
        work += dt__online_backward(&a, dout + at, O + at, D, lse + (size_t)bh * T, dqkv + (size_t)b * T * 3 * D + h * hd,
                                    dK + at, dV + at);
    }
    dt__ring_scores += work;
}
static void dt__copy_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add) {
    for (int64_t i = 0; i < rows; i++)
        if (!add) memcpy(dst + i * ld_dst, src + i * ld_src, sizeof(float) * (size_t)cols);
        else for (int c = 0; c < cols; c++) dst[i * ld_dst + c] += src[i * ld_src + c];
}
/* The ring's bodies on the device of its tensors: the GPU's table's, or the CPU's above. */
typedef struct dt__ring_bodies {
    void (*step)(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O, float *out, int first,
                 int B, int T, int H, int D, float scale, int causal);
    void (*backward_step)(const float *qkv, const float *blk, const float *qpos, const float *lse, const float *O,
                          const float *dout, float *dots, float *dqkv, float *dkv, int B, int T, int H, int D, float scale,
                          int causal);
    void (*copy_columns)(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add);
} dt__ring_bodies;
static dt__ring_bodies dt__ring_bodies_on(dt_device device) {
    const dt_backend *gpu = dt__backend_of(device);
    if (gpu) return (dt__ring_bodies){ gpu->ring_attention_step, gpu->ring_attention_backward_step, gpu->copy_columns };
    return (dt__ring_bodies){ dt__ring_attention_step, dt__ring_attention_backward_step, dt__copy_columns };
}
/* A rank's block: its positions, then its keys and values out of qkv. */
static void dt__ring_pack(const dt__ring *r, const dt__ring_bodies *f, const float *qkvv, float *blk) {
    int64_t BT = (int64_t)r->B * r->T, D = r->D;
    f->copy_columns(blk, r->T, r->qpos, r->T, 1, r->T, 0);
    f->copy_columns(blk + r->T, D, qkvv + D, 3 * D, BT, r->D, 0);
    f->copy_columns(blk + r->T + BT * D, D, qkvv + 2 * D, 3 * D, BT, r->D, 0);
}

/* Backward goes around the ring again, and each block's dK and dV are summed
   over the ranks its queries sit on. The keys and values travel as in
   forward, sent on while the block is used; each block's gradients travel
   one step behind it: a rank adds its share into the sum that comes from
   the rank before (which made it while this rank computed) and sends it on,
   so that transfer too overlaps the next step's compute. After C steps the
   sum of each block reaches the rank that owns it. */
static void dt__ring_attention_backward(dt__tape_entry *e) {
    dt_tensor *qkv = e->in[0];
    if (!qkv->requires_grad) return;
    const dt__ring *r = (const dt__ring *)e->saved;
    int B = r->B, T = r->T, H = r->H, D = r->D, C = dt_comm_size(r->comm), first;
    int64_t BTD = (int64_t)B * T * D, nkv = T + 2 * BTD;
    dt__ring_bodies f = dt__ring_bodies_on(qkv->device);
    const float *qkvv = dt__in(qkv), *dout = dt__grad_in(e->out);
    float *dqkv = dt__grad_acc_first(qkv, &first);
    if (first) dt__zero_on(qkv->device, dqkv, sizeof(float) * (size_t)qkv->numel);
    float *dots = (float *)dt__scratch_on(qkv->device, sizeof(float) * (size_t)B * H * T);
    float *kv[2] = { (float *)dt__scratch_on(qkv->device, sizeof(float) * 2 * (size_t)nkv) };
    float *g[2] = { (float *)dt__scratch_on(qkv->device, sizeof(float) * 6 * (size_t)BTD) };   /* two sums, a share */
    float *share = g[0] + 4 * BTD;
    kv[1] = kv[0] + nkv;
    g[1] = g[0] + 2 * BTD;
    dt__ring_pack(r, &f, qkvv, kv[0]);
    dt_comm_handle next = 0, sum = 0;
    for (int s = 0; s < C; s++) {                         /* holding the block of the rank s before this one */
        if (s < C - 1) next = dt_ring_shift_async(r->comm, kv[s & 1], kv[(s + 1) & 1], nkv, DT_F32);
        float *mine = s == 0 ? g[0] : share;              /* the owner's share starts the block's sum */
        dt__zero_on(qkv->device, mine, sizeof(float) * 2 * (size_t)BTD);
        f.backward_step(qkvv, kv[s & 1], r->qpos, r->lse, r->O, dout, dots, dqkv, mine, B, T, H, D, r->scale, r->causal);
        if (s > 0) {                                      /* the sum so far, from the rank before, plus this rank's share */
            dt__ring_wait(r->comm, sum);
            f.copy_columns(g[s & 1], D, share, D, 2 * (int64_t)B * T, D, 1);
        }
        if (C > 1) sum = dt_ring_shift_async(r->comm, g[s & 1], g[(s + 1) & 1], 2 * BTD, DT_F32);   /* the last: home */
        if (s < C - 1) dt__ring_wait(r->comm, next);
    }
    if (C > 1) dt__ring_wait(r->comm, sum);
    dt__ctx.flops += 8.0 * B * H * T * (double)T * C * (D / H);         /* as dt_attention's backward counts */
    const float *dK = g[C > 1 ? C & 1 : 0], *dV = dK + BTD;
    f.copy_columns(dqkv + D, 3 * D, dK, D, (int64_t)B * T, D, 1);
    f.copy_columns(dqkv + 2 * D, 3 * D, dV, D, (int64_t)B * T, D, 1);
    dt__grad_acc_done(qkv, dqkv);
}

dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring) {
    int D = (int)dt_tensor_cols(qkv) / 3, C = dt_comm_size(ring);
    if (dt_tensor_cols(qkv) != 3 * D || D % H != 0 || dt_tensor_rows(qkv) != (int64_t)B * T)
        dt_fail("ring attention: qkv is [%lld, %lld], expected [%d, 3*D] with D divisible by %d heads",
                (long long)dt_tensor_rows(qkv), (long long)dt_tensor_cols(qkv), B * T, H);
    if (dt__backend_for(qkv) && D / H > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_fail("ring attention on the GPU: heads of %d columns; its kernel takes at most %d", D / H,
                DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    for (int i = 1; i < T; i++)
        if (positions[i] <= positions[i - 1]) dt_fail("ring attention: positions must ascend (%d after %d)", positions[i], positions[i - 1]);
    int64_t BTD = (int64_t)B * T * D, nblk = T + 2 * BTD, rows = (int64_t)B * H * T;
    dt_device dev = qkv->device;
    dt__ring_bodies f = dt__ring_bodies_on(dev);
    dt__scratch_reset();
    dt__ring *r = (dt__ring *)dt__step_alloc_uninit(sizeof(dt__ring) + sizeof(float) * (size_t)T);
    float *host = (float *)(r + 1);                       /* the positions, as they travel */
    *r = (dt__ring){ ring, B, T, H, D, causal != 0, 1.0f / sqrtf((float)(D / H)), NULL, NULL, NULL };
    r->qpos = (float *)dt__step_alloc_on(dev, sizeof(float) * (size_t)(T + rows + BTD));
    r->lse = r->qpos + T;
    r->O = r->lse + rows;
    for (int i = 0; i < T; i++) host[i] = (float)positions[i];
    dt__upload_to(dev, r->qpos, host, sizeof(float) * (size_t)T);
    const float *qkvv = dt__in(qkv);
    float *l = (float *)dt__scratch_on(dev, sizeof(float) * (size_t)rows);
    float *blk[2] = { (float *)dt__scratch_on(dev, sizeof(float) * 2 * (size_t)nblk) };
    blk[1] = blk[0] + nblk;
    dt_tensor *out = dt__tensor_out_2d(B * T, D);
    float *outv = dt__out(out);
    dt__ring_pack(r, &f, qkvv, blk[0]);
    for (int s = 0; s < C; s++) {                         /* the next block travels while this one is used */
        dt_comm_handle next = s < C - 1 ? dt_ring_shift_async(ring, blk[s & 1], blk[(s + 1) & 1], nblk, DT_F32) : 0;
        f.step(qkvv, blk[s & 1], r->qpos, r->lse, l, r->O, s == C - 1 ? outv : NULL, s == 0, B, T, H, D, r->scale, r->causal);
        if (next) dt__ring_wait(ring, next);
    }
    dt__out_done(out, outv);
    dt__ctx.flops += 4.0 * B * H * T * (double)T * C * (D / H);         /* as dt_attention counts the whole square */
    if (dt__wants_grad(qkv, NULL, NULL)) dt__tape_push(dt__ring_attention_backward, out, qkv, NULL, NULL)->saved = r;
    return out;
}

/* -- the wrapper -- */
struct dt_cp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_cp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *ring;              /* the group's ranks ("cp"), around which attention goes */
    int size, rank, T;          /* C, this rank's place, the tokens of a sequence it keeps */
    int B;                      /* sequences in the last batch it split */
    double ring_ms, step_ring_ms;   /* waiting for the ring: this step's so far, the last step's */
    dt_cp_layout layout;
    int32_t *positions;         /* of those tokens, in the whole sequence */
};
/* This rank's tokens of each sequence of `inputs` [B, T] (in the step arena). */
static dt_tensor *dt__cp_tokens(const dt_cp *cp, const dt_tensor *inputs) {
    int B = inputs->shape[0], T = (int)dt_tensor_cols(inputs), t = cp->T, shape[2] = { B, t };
    float *all = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
    float *mine = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * t);
    dt_tensor_to_host(inputs, all);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < t; i++) mine[b * t + i] = all[b * T + cp->positions[i]];
    return dt_tensor_from_host(2, shape, mine);
}
/* Training: a rank's tokens (dt_cp_split_batch's), attention around the
   ring. Evaluation (no gradients, whole sequences): each rank its tokens
   around the ring too, then the group's logits all-gathered into the whole
   sequences' rows, so that every rank scores every token, in 1/C of the
   activations. Generation's shorter windows run whole on every rank. */
static dt_tensor *dt__cp_forward(dt_parallel *par, dt_tensor *inputs) {
    dt_cp *cp = (dt_cp *)par;
    int n = dt_model_blocks(cp->model), B = inputs->shape[0], T = (int)dt_tensor_cols(inputs), C = cp->size, t = cp->T;
    if (dt__ctx.grad_enabled) {
        if (T != t)
            dt_fail("dt_model_forward under context parallelism: sequences of %d tokens, where this rank keeps %d of each "
                    "(give it dt_cp_split_batch's inputs)", T, t);
        return dt_model_forward_blocks(cp->model, inputs, NULL, 0, n);
    }
    if (T != t * C) {
        dt_set_sequence_split(NULL);
        dt_tensor *y = dt_model_forward_blocks(cp->model, inputs, NULL, 0, n);
        dt_sequence_split split = { cp->ring, cp->positions, t };
        dt_set_sequence_split(&split);
        return y;
    }
    dt_tensor *mine = dt_model_forward_blocks(cp->model, dt__cp_tokens(cp, inputs), NULL, 0, n);
    int64_t V = dt_tensor_cols(mine), each = (int64_t)B * t * V;
    float *all = (float *)dt__step_alloc_on(mine->device, sizeof(float) * (size_t)(each * C));
    int32_t *at = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)t);
    dt__ring_bodies f = dt__ring_bodies_on(mine->device);
    dt_all_gather(cp->ring, dt__in(mine), all, each, DT_F32);     /* as f32: under --dtype bf16 the head's are bf16 */
    dt_tensor *y = dt_tensor_2d(B * T, (int)V);
    for (int q = 0; q < C; q++) {             /* rank q's rows, a run of consecutive positions at a time */
        dt_cp_positions(cp->layout, T, C, q, at);
        for (int b = 0; b < B; b++)
            for (int i = 0, run; i < t; i += run) {
                for (run = 1; i + run < t && at[i + run] == at[i] + run; run++) {}
                f.copy_columns(y->data + ((size_t)b * T + at[i]) * V, V, all + q * each + ((size_t)b * t + i) * V, V, run, (int)V, 0);
            }
    }
    return y;
}
static void dt__cp_step_done(dt_parallel *par) {
    dt_cp *cp = (dt_cp *)par;
    cp->step_ring_ms = dt__ring_wait_ms;
    dt__ring_wait_ms = 0;
}
dt_cp *dt_cp_create(dt_model *model, dt_comm *comm, int cp, dt_cp_layout layout) {
    int world = dt_comm_size(comm), T = model->cfg.seq_len;
    char v[64];
    snprintf(v, sizeof v, "%d %d", cp, (int)layout);
    dt_comm_check_agree(comm, "--cp --cp-layout", v);
    if (cp <= 0) cp = world;
    if (world % cp)
        dt_usage_error("--cp %d does not divide the job's %d ranks (the ranks form groups of --cp, data parallel across them)",
                       cp, world);
    if (!dt_model_is_language(model->cfg.kind))
        dt_usage_error("--model %s: context parallelism splits sequences of tokens; it takes --model gpt or llama",
                       dt__model_kind_name(model->cfg.kind));
    if (model->device != DT_CPU && model->cfg.dim / model->cfg.heads > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_usage_error("--cp on a GPU: heads of %d columns (--dim %d / --heads %d); the ring's kernel takes at most %d",
                       model->cfg.dim / model->cfg.heads, model->cfg.dim, model->cfg.heads, DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    int chunks = layout == DT_CP_ZIGZAG ? 2 * cp : cp;
    if (T % chunks)
        dt_usage_error("--cp %d --cp-layout %s: --seq-len %d must be a multiple of %d (%s)", cp,
                       layout == DT_CP_ZIGZAG ? "zigzag" : "contiguous", T, chunks,
                       layout == DT_CP_ZIGZAG ? "2 x --cp chunks, two to a rank" : "a chunk to each rank");
    if (model->parallel) dt_fail("dt_cp_create: this model is already wrapped (%s); context parallelism goes first",
                                 model->parallel->create_fn);
    dt_cp *c = (dt_cp *)calloc(1, sizeof *c);
    if (!c || !(c->positions = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T / cp)))) dt_fail("out of memory (context parallelism)");
    c->par = (dt_parallel){ .create_fn = "dt_cp_create", .sync_fn = "dt_data_parallel_sync_grads", .free_fn = "dt_cp_free",
                            .forward = dt__cp_forward, .step_done = dt__cp_step_done, .grad_ranks = world };
    dt__comm_hold(comm, "dt_cp_free");
    c->model = model;
    c->comm = comm;
    int sizes[2] = { world / cp, cp };
    const char *names[2] = { "dp", "cp" };
    c->mesh = dt_mesh_create(comm, 2, sizes, names);
    c->ring = dt_mesh_comm(c->mesh, "cp");
    c->size = cp;
    c->rank = dt_mesh_coord(c->mesh, "cp");
    c->T = T / cp;
    c->layout = layout;
    c->par.data_rank = dt_mesh_coord(c->mesh, "dp");
    c->par.data_ranks = world / cp;
    dt_cp_positions(layout, T, cp, c->rank, c->positions);
    dt_model_set_parallel(model, &c->par);
    dt_sequence_split split = { c->ring, c->positions, c->T };
    dt_set_sequence_split(&split);
    return c;
}
void dt_cp_split_batch(dt_cp *cp, dt_batch *batch) {
    int B = batch->inputs->shape[0], T = (int)dt_tensor_cols(batch->inputs), t = cp->T;
    if (T != t * cp->size)
        dt_fail("dt_cp_split_batch: sequences of %d tokens, where the model's context is %d (split once)", T, t * cp->size);
    int32_t *labels = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)B * t);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < t; i++) labels[b * t + i] = batch->labels[b * T + cp->positions[i]];
    /* masked data: the run's divisor (its targets per data-parallel group)
       spread over the group's C ranks, whose mean the engine takes too */
    if (dt__ctx.loss_divisor.labels == batch->labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        dt_cross_entropy_set_divisor(labels, dt__ctx.loss_divisor.divisor / cp->size);
    batch->inputs = dt__cp_tokens(cp, batch->inputs);
    cp->B = B;
    batch->labels = labels;
}
dt_comm *dt_cp_data_group(const dt_cp *cp) { return cp->comm; }
int dt_cp_data_rank(const dt_cp *cp) { return cp->par.data_rank; }
int dt_cp_data_ranks(const dt_cp *cp) { return cp->par.data_ranks; }
void dt_cp_free(dt_cp *cp) {
    if (!cp) return;
    if (cp->model->parallel && cp->model->parallel != &cp->par)
        dt_fail("dt_cp_free: another wrapper still wraps the model; call %s first", cp->model->parallel->free_fn);
    dt_set_sequence_split(NULL);
    dt_model_set_parallel(cp->model, NULL);
    dt_mesh_free(cp->mesh);
    dt__comm_release(cp->comm);
    free(cp->positions);
    free(cp);
}

/* [src/17-backend-tables.h] */
/* Without CUDA there is no NCCL: the CUDA chapter defines these when there is. */
#ifndef DT_HAVE_CUDA
int dt_nccl_available(char *why, size_t n) {
    dt__copy_str(why, n, "this build has no CUDA, so no NCCL (install the CUDA toolkit and NCCL, then make)");
    return 0;
}
int dt_nccl_version(void) { return 0; }
#endif
/* [src/18-data.h] */
/* ==== data ===================================================================
   Images are decoded once, resized, and kept in memory as bytes (a 50,000-image
   32x32 set is 150 MB). Each epoch the sampler deals out a fresh permutation,
   the same one on every rank, and each rank takes every world-th index: that
   is all "sharding the data" means. Augmentation draws its randomness from a
   hash of (seed, epoch, image index), so a resumed run crops and flips exactly
   as the uninterrupted one would have. */

static int dt__name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Sorted entries of a folder (no hidden files); want_dirs picks folders or files. */
static char **dt__list_dir(const char *path, int want_dirs, int *count) {
    DIR *d = opendir(path);
    if (!d) dt_fail("cannot open folder '%s': %s", path, strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.') continue;
        char full[4096];
        struct stat st;
        dt__path(full, sizeof full, "%s/%s", path, ent->d_name);
        if (stat(full, &st) != 0) continue;
        if (want_dirs != S_ISDIR(st.st_mode)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = (char **)realloc(names, cap * sizeof(char *));
            if (!names) dt_fail("out of memory listing '%s'", path);
        }
        names[n] = (char *)malloc(strlen(ent->d_name) + 1);
        if (!names[n]) dt_fail("out of memory listing '%s'", path);
        strcpy(names[n++], ent->d_name);
    }
    closedir(d);
    if (n > 1) qsort(names, n, sizeof(char *), dt__name_cmp);
    *count = n;
    return names;
}
static void dt__free_names(char **names, int n) { for (int i = 0; i < n; i++) free(names[i]); free(names); }

/* A whole file into memory, or NULL with errno set (dt__read_failure says
   why). Regular files only: a FIFO would block the run until something wrote
   to it (one in an image folder hung a run), a device such as /dev/zero never
   ends. Opened without blocking, then looked at, before anything is read. */
static DT_THREAD_LOCAL int dt__read_not_regular;
static const char *dt__read_failure(void) {
    return dt__read_not_regular ? "not a regular file (a FIFO, a device or a socket): dtrain reads files" : strerror(errno);
}
static unsigned char *dt__read_file(const char *path, size_t *len) {
    struct stat st;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    dt__read_not_regular = 0;
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        dt__read_not_regular = e == EINVAL;
        close(fd);
        errno = e;
        return NULL;
    }
    fcntl(fd, F_SETFL, 0);
    FILE *f = fdopen(fd, "rb");
    if (!f) { close(fd); return NULL; }
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = (unsigned char *)malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        unsigned char *bigger = (unsigned char *)realloc(buf, cap * 2);
        if (!bigger) { free(buf); buf = NULL; break; }
        buf = bigger;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); return NULL; }
    *len = n;
    return buf;
}

/* A JSON reader just big enough for what dtrain reads: JSON-lines token data
   (below), safetensors headers and config.json (the checkpoints and hugging-face chapters). */
typedef struct { const char *s; size_t pos, len; int ok; } dt__json;
static void dt__json_ws(dt__json *j) { while (j->pos < j->len && isspace((unsigned char)j->s[j->pos])) j->pos++; }
static int dt__json_peek(dt__json *j) { dt__json_ws(j); return j->pos < j->len ? j->s[j->pos] : -1; }
static int dt__json_eat(dt__json *j, char c) {
    if (dt__json_peek(j) == c) { j->pos++; return 1; }
    j->ok = 0;
    return 0;
}
/* A string, decoded; NULL (and j->ok 0) when it is not one. Its buffer is
   as long as the string, not the rest of the text (a header of 120,000 names
   once took 538 MB and 9 s). \u0000 is refused: every string dtrain reads is
   a name or a value that a NUL would cut short. */
static char *dt__json_str(dt__json *j) {
    if (!dt__json_eat(j, '"')) return NULL;
    size_t end = j->pos;
    while (end < j->len && j->s[end] != '"') end += j->s[end] == '\\' ? 2 : 1;
    if (end >= j->len) { j->ok = 0; return NULL; }
    char *out = (char *)malloc(end - j->pos + 1);
    if (!out) dt_fail("out of memory reading a JSON string (%zu bytes)", end - j->pos);
    size_t n = 0;
    while (j->pos < j->len && j->s[j->pos] != '"') {
        char c = j->s[j->pos++];
        if (c == '\\' && j->pos < j->len) {
            char e = j->s[j->pos++];
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int k = 0; k < 4; k++) {
                    char hx = j->pos < j->len ? j->s[j->pos++] : 0;
                    if (!isxdigit((unsigned char)hx)) v = 0, k = 4;       /* not four hex digits: refused below */
                    else v = v * 16 + (unsigned)(isdigit((unsigned char)hx) ? hx - '0' : (tolower((unsigned char)hx) - 'a' + 10));
                }
                if (v == 0) { free(out); j->ok = 0; return NULL; }
                c = v < 128 ? (char)v : '?';
                break;
            }
            default: c = e;
            }
        }
        out[n++] = c;
    }
    out[n] = 0;
    if (!dt__json_eat(j, '"')) { free(out); return NULL; }
    return out;
}
static int64_t dt__json_int(dt__json *j) {
    dt__json_ws(j);
    int neg = 0;
    int64_t v = 0;
    if (j->pos < j->len && j->s[j->pos] == '-') { neg = 1; j->pos++; }
    if (j->pos >= j->len || !isdigit((unsigned char)j->s[j->pos])) { j->ok = 0; return 0; }
    while (j->pos < j->len && isdigit((unsigned char)j->s[j->pos])) {
        if (v > (INT64_MAX - 9) / 10) { j->ok = 0; return 0; }
        v = v * 10 + (j->s[j->pos++] - '0');
    }
    return neg ? -v : v;
}
static void dt__json_skip(dt__json *j, int depth) {       /* any value we do not need */
    int c = dt__json_peek(j);
    if (depth > 64) { j->ok = 0; return; }
    if (c == '"') free(dt__json_str(j));
    else if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->pos++;
        if (dt__json_peek(j) == close) { j->pos++; return; }
        while (j->ok) {
            if (c == '{') { free(dt__json_str(j)); dt__json_eat(j, ':'); }
            dt__json_skip(j, depth + 1);
            if (dt__json_peek(j) == ',') { j->pos++; continue; }
            dt__json_eat(j, close);
            return;
        }
    } else {                                              /* a number, true, false or null: something */
        size_t from = j->pos;
        while (j->pos < j->len && j->s[j->pos] && (isalnum((unsigned char)j->s[j->pos]) || strchr("+-.", j->s[j->pos]))) j->pos++;
        if (j->pos == from) j->ok = 0;
    }
}
static int dt__json_int_array(dt__json *j, int64_t *out, int max) {
    int n = 0;
    if (!dt__json_eat(j, '[')) return 0;
    if (dt__json_peek(j) == ']') { j->pos++; return 0; }
    while (j->ok) {
        int64_t v = dt__json_int(j);
        if (n < max) out[n] = v; else j->ok = 0;
        n++;
        if (dt__json_peek(j) == ',') { j->pos++; continue; }
        dt__json_eat(j, ']');
        break;
    }
    return n;
}

void dt_image_resize(const uint8_t *src, int channels, int w, int h, uint8_t *dst, int dw, int dh) {
    /* bilinear with pixel centres aligned (PyTorch's align_corners=False) */
    float sx = (float)w / dw, sy = (float)h / dh;
    for (int c = 0; c < channels; c++)
        for (int y = 0; y < dh; y++) {
            float fy = (y + 0.5f) * sy - 0.5f;
            if (fy < 0) fy = 0;
            int y0 = (int)fy, y1 = y0 + 1 < h ? y0 + 1 : h - 1;
            float wy = fy - y0;
            for (int x = 0; x < dw; x++) {
                float fx = (x + 0.5f) * sx - 0.5f;
                if (fx < 0) fx = 0;
                int x0 = (int)fx, x1 = x0 + 1 < w ? x0 + 1 : w - 1;
                float wx = fx - x0;
                const uint8_t *p = src + (size_t)c * w * h;
                float v = (1 - wy) * ((1 - wx) * p[y0 * w + x0] + wx * p[y0 * w + x1]) +
                          wy * ((1 - wx) * p[y1 * w + x0] + wx * p[y1 * w + x1]);
                dst[((size_t)c * dh + y) * dw + x] = (uint8_t)(v + 0.5f);
            }
        }
}

/* PPM (P3, P6) and PGM (P2, P5), read without any library. */
static uint8_t *dt__decode_pnm(const unsigned char *buf, size_t len, int *w, int *h, char *err, size_t errlen) {
    size_t pos = 2;
    if (len < 2 || buf[0] != 'P' || (buf[1] != '2' && buf[1] != '3' && buf[1] != '5' && buf[1] != '6')) {
#ifdef DT_HAVE_STB
        snprintf(err, errlen, "not an image");
#else
        snprintf(err, errlen, "not a PPM/PGM image (this build reads only PPM/PGM; install libstb-dev "
                              "and rebuild for PNG, JPEG and BMP)");
#endif
        return NULL;
    }
    int binary = buf[1] == '5' || buf[1] == '6', chans = (buf[1] == '3' || buf[1] == '6') ? 3 : 1;
    long vals[3];
    for (int i = 0; i < 3; i++) {
        for (;;) {                                     /* whitespace and # comments */
            while (pos < len && isspace(buf[pos])) pos++;
            if (pos < len && buf[pos] == '#') { while (pos < len && buf[pos] != '\n') pos++; continue; }
            break;
        }
        if (pos >= len || !isdigit(buf[pos])) { snprintf(err, errlen, "corrupt PPM/PGM header"); return NULL; }
        long v = 0;                                    /* every digit is the number's (past 10^9: too large, said so) */
        while (pos < len && isdigit(buf[pos])) { v = v < 1000000000 ? v * 10 + (buf[pos] - '0') : v; pos++; }
        vals[i] = v;
    }
    if (vals[0] <= 0 || vals[1] <= 0 || vals[0] > 32768 || vals[1] > 32768 || vals[2] <= 0 || vals[2] > 65535) {
        char size[64];
        if (vals[0] >= 1000000000 || vals[1] >= 1000000000) snprintf(size, sizeof size, "a size of over 10^9 pixels a side");
        else snprintf(size, sizeof size, "%ldx%ld", vals[0], vals[1]);
        snprintf(err, errlen, "corrupt PPM/PGM header (%s, max value %ld; sides of 1 to 32768, values up to 65535)", size, vals[2]);
        return NULL;
    }
    *w = (int)vals[0]; *h = (int)vals[1];
    int maxv = (int)vals[2], bps = maxv > 255 ? 2 : 1;
    size_t count = (size_t)*w * *h * chans;
    uint8_t *rgb = (uint8_t *)malloc((size_t)*w * *h * 3);
    if (!rgb) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (binary) pos++;                                /* the single whitespace after maxval */
    if (binary && len - (pos < len ? pos : len) < count * bps) {
        snprintf(err, errlen, "truncated: %zu bytes of pixels expected, %zu found", count * bps, len > pos ? len - pos : 0);
        free(rgb);
        return NULL;
    }
    for (size_t i = 0; i < count; i++) {
        long v = 0;
        if (binary) {
            v = bps == 2 ? (buf[pos] << 8 | buf[pos + 1]) : buf[pos];
            pos += bps;
        } else {
            while (pos < len && isspace(buf[pos])) pos++;
            if (pos >= len || !isdigit(buf[pos])) { snprintf(err, errlen, "truncated or corrupt pixel data"); free(rgb); return NULL; }
            while (pos < len && isdigit(buf[pos])) { v = v <= 65535 ? v * 10 + (buf[pos] - '0') : v; pos++; }   /* no overflow */
        }
        uint8_t b = (uint8_t)((v > maxv ? maxv : v) * 255 / maxv);
        if (chans == 3) rgb[i] = b;
        else rgb[3 * i] = rgb[3 * i + 1] = rgb[3 * i + 2] = b;     /* grey becomes RGB */
    }
    return rgb;
}

#ifdef DT_HAVE_STB
/* stb_image decodes what it can of a damaged file and fills the rest with
   zeros. A training set should not silently hold half-black images, so the
   containers are checked first: every PNG chunk must fit and the file must
   end with IEND; a JPEG must end with its end-of-image marker. */
static int dt__check_container(const unsigned char *b, size_t len, char *err, size_t errlen) {
    static const unsigned char png_sig[8] = { 137, 80, 78, 71, 13, 10, 26, 10 };
    if (len >= 8 && memcmp(b, png_sig, 8) == 0) {
        size_t pos = 8;
        while (pos + 8 <= len) {
            size_t clen = (size_t)b[pos] << 24 | (size_t)b[pos + 1] << 16 | (size_t)b[pos + 2] << 8 | b[pos + 3];
            if (memcmp(b + pos + 4, "IEND", 4) == 0) return 1;
            if (clen > len || pos + 12 + clen > len) break;
            pos += 12 + clen;
        }
        snprintf(err, errlen, "truncated PNG (the file ends before its IEND chunk)");
        return 0;
    }
    if (len >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
        size_t end = len;
        while (end > 2 && (b[end - 1] == 0 || b[end - 1] == '\n' || b[end - 1] == '\r')) end--;
        if (end < 4 || b[end - 2] != 0xFF || b[end - 1] != 0xD9) {
            snprintf(err, errlen, "truncated JPEG (no end-of-image marker)");
            return 0;
        }
    }
    return 1;
}
#endif

uint8_t *dt_image_load_rgb(const char *path, int size, char *err, size_t errlen) {
    size_t len = 0;
    unsigned char *buf = dt__read_file(path, &len);
    if (!buf) { snprintf(err, errlen, "cannot read: %s", dt__read_failure()); return NULL; }
    int w = 0, h = 0;
    uint8_t *rgb = NULL;
    if (len == 0) snprintf(err, errlen, "empty file");
    else if (len >= 2 && buf[0] == 'P' && buf[1] >= '1' && buf[1] <= '7') rgb = dt__decode_pnm(buf, len, &w, &h, err, errlen);
    else {
#ifdef DT_HAVE_STB
        int comp = 0;
        if (dt__check_container(buf, len, err, errlen)) {
            rgb = stbi_load_from_memory(buf, (int)len, &w, &h, &comp, 3);  /* 3: grey and alpha -> RGB */
            const char *why = rgb ? NULL : stbi_failure_reason();
            if (why && !strcmp(why, "unknown image type"))
                snprintf(err, errlen, "not an image (no format stb_image reads: PNG, JPEG, BMP, GIF, TGA, PNM, ...)");
            else if (why) snprintf(err, errlen, "corrupt image (stb_image: %s)", why);
        }
#else
        rgb = dt__decode_pnm(buf, len, &w, &h, err, errlen);
#endif
    }
    free(buf);
    if (!rgb) return NULL;
    uint8_t *planes = (uint8_t *)malloc((size_t)w * h * 3), *out = (uint8_t *)malloc((size_t)size * size * 3);
    if (!planes || !out) dt_fail("out of memory decoding '%s'", path);
    for (int i = 0; i < w * h; i++)                            /* interleaved -> channels first */
        for (int c = 0; c < 3; c++) planes[(size_t)c * w * h + i] = rgb[3 * i + c];
    free(rgb);
    if (w == size && h == size) memcpy(out, planes, (size_t)size * size * 3);
    else dt_image_resize(planes, 3, w, h, out, size, size);
    free(planes);
    return out;
}

/* The one constructor of an image set (dt__text_split is text's): every field
   starts at zero, so one that no loader writes (tokens, for images) reads as
   empty, never as whatever the caller's stack held. */
static void dt__dataset_alloc(dt_dataset *ds, int64_t n, int size, int classes) {
    memset(ds, 0, sizeof *ds);
    ds->n = n; ds->capacity = n; ds->channels = 3; ds->size = size; ds->num_classes = classes;
    ds->pixels = (uint8_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * 3 * size * size);
    ds->labels = (int32_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * sizeof(int32_t));
    ds->class_names = (char **)calloc((size_t)(classes > 0 ? classes : 1), sizeof(char *));
}

static int dt__is_cifar_dir(const char *dir, char *batches, size_t n) {
    struct stat st;
    char p[4096];
    dt__path(p, sizeof p, "%s/data_batch_1.bin", dir);
    if (stat(p, &st) == 0) { dt__path(batches, n, "%s", dir); return 1; }
    dt__path(p, sizeof p, "%s/cifar-10-batches-bin/data_batch_1.bin", dir);
    if (stat(p, &st) == 0) { dt__path(batches, n, "%s/cifar-10-batches-bin", dir); return 1; }
    return 0;
}

/* CIFAR-10 binary: records of 1 label byte + 3072 pixel bytes (R, G, B planes). */
static void dt__load_cifar(const char *dir, const char *split, int size, dt_dataset *ds) {
    static const char *names[10] = { "airplane", "automobile", "bird", "cat", "deer",
                                     "dog", "frog", "horse", "ship", "truck" };
    const char *files[5] = { "data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                             "data_batch_4.bin", "data_batch_5.bin" };
    const char *test[1] = { "test_batch.bin" };
    int nfiles = strcmp(split, "train") == 0 ? 5 : 1;
    const char **list = nfiles == 5 ? files : test;
    unsigned char *bufs[5] = { 0 };
    size_t lens[5] = { 0 };
    int64_t total = 0;
    for (int i = 0; i < nfiles; i++) {
        char p[4096];
        dt__path(p, sizeof p, "%s/%s", dir, list[i]);
        bufs[i] = dt__read_file(p, &lens[i]);
        if (!bufs[i]) dt_fail("CIFAR-10: cannot read '%s': %s", p, dt__read_failure());
        if (lens[i] == 0 || lens[i] % 3073 != 0)
            dt_fail("CIFAR-10: '%s' is truncated or not a CIFAR-10 batch (%zu bytes, not a multiple of 3073)", p, lens[i]);
        total += lens[i] / 3073;
    }
    dt__dataset_alloc(ds, total, size, 10);
    for (int c = 0; c < 10; c++) { ds->class_names[c] = (char *)malloc(16); strcpy(ds->class_names[c], names[c]); }
    int64_t k = 0;
    size_t img = (size_t)3 * size * size;
    for (int i = 0; i < nfiles; i++) {
        for (size_t r = 0; r < lens[i] / 3073; r++, k++) {
            const unsigned char *rec = bufs[i] + r * 3073;
            if (rec[0] > 9) dt_fail("CIFAR-10: '%s/%s' record %zu has label %d (not 0-9)", dir, list[i], r, rec[0]);
            ds->labels[k] = rec[0];
            if (size == 32) memcpy(ds->pixels + k * img, rec + 1, 3072);
            else dt_image_resize(rec + 1, 3, 32, 32, ds->pixels + k * img, size, size);
        }
        free(bufs[i]);
    }
    dt__copy_str(ds->source, sizeof ds->source, dir);
}

void dt_dataset_load(const char *dir, const char *split, int size, const dt_dataset *classes_from, dt_dataset *ds) {
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        dt_fail("data folder '%s' does not exist (give --data DIR holding train/ and val/ class folders, "
                "or a CIFAR-10 binary folder; leave --data out to use the synthetic set)", dir);
    char cifar[4096];
    if (dt__is_cifar_dir(dir, cifar, sizeof cifar)) { dt__load_cifar(cifar, split, size, ds); return; }
    char split_dir[4096];
    dt__path(split_dir, sizeof split_dir, "%s/%s", dir, split);
    if (stat(split_dir, &st) != 0 || !S_ISDIR(st.st_mode))
        dt_fail("data folder '%s' has no %s/ folder (expected %s/%s/<class>/<image>)", dir, split, dir, split);
    int nclass = 0;
    char **classes = dt__list_dir(split_dir, 1, &nclass);
    if (nclass == 0) dt_fail("'%s' holds no class folders (expected %s/<class>/<image>)", split_dir, split_dir);
    if (classes_from) {
        int same = classes_from->num_classes == nclass;
        for (int c = 0; same && c < nclass; c++) same = strcmp(classes[c], classes_from->class_names[c]) == 0;
        if (!same) dt_fail("the class folders of '%s' differ from those of the training set", split_dir);
    }
    /* list every file first, so the images can be decoded in parallel */
    int64_t n = 0, cap = 1024;
    char **paths = (char **)malloc(cap * sizeof(char *));
    int32_t *labels = (int32_t *)malloc(cap * sizeof(int32_t));
    for (int c = 0; c < nclass; c++) {
        char cdir[4096];
        int nf = 0;
        dt__path(cdir, sizeof cdir, "%s/%s", split_dir, classes[c]);
        char **files = dt__list_dir(cdir, 0, &nf);
        if (nf == 0) dt_fail("class folder '%s' is empty (every class needs at least one image)", cdir);
        for (int i = 0; i < nf; i++) {
            if (n == cap) {
                cap *= 2;
                paths = (char **)realloc(paths, cap * sizeof(char *));
                labels = (int32_t *)realloc(labels, cap * sizeof(int32_t));
                if (!paths || !labels) dt_fail("out of memory listing '%s'", cdir);
            }
            size_t plen = strlen(cdir) + strlen(files[i]) + 2;
            paths[n] = (char *)malloc(plen);
            snprintf(paths[n], plen, "%s/%s", cdir, files[i]);
            labels[n++] = c;
        }
        dt__free_names(files, nf);
    }
    dt__dataset_alloc(ds, n, size, nclass);
    for (int c = 0; c < nclass; c++) ds->class_names[c] = classes[c];
    free(classes);
    size_t img = (size_t)3 * size * size;
    int64_t first_bad = -1;
    char bad_reason[256] = "";
    DT_OMP("omp parallel for schedule(dynamic, 64)")
    for (int64_t i = 0; i < n; i++) {
        char err[256];
        uint8_t *px = dt_image_load_rgb(paths[i], size, err, sizeof err);
        if (px) { memcpy(ds->pixels + i * img, px, img); free(px); }
        else {
            DT_OMP("omp critical(dt__bad_image)")
            if (first_bad < 0 || i < first_bad) { first_bad = i; snprintf(bad_reason, sizeof bad_reason, "%s", err); }
        }
        ds->labels[i] = labels[i];
    }
    if (first_bad >= 0) dt_fail("cannot load image '%s': %s", paths[first_bad], bad_reason);
    for (int64_t i = 0; i < n; i++) free(paths[i]);
    free(paths);
    free(labels);
    dt__copy_str(ds->source, sizeof ds->source, split_dir);
}

void dt_dataset_free(dt_dataset *ds) {
    size_t img = (size_t)ds->channels * ds->size * ds->size;
    dt_free(DT_ARENA_DATA, ds->pixels, (size_t)ds->capacity * img);
    dt_free(DT_ARENA_DATA, ds->labels, (size_t)ds->capacity * sizeof(int32_t));
    dt_free(DT_ARENA_DATA, ds->tokens, (size_t)ds->tokens_capacity * sizeof(int32_t));
    dt_free(DT_ARENA_DATA, ds->targets, ds->targets ? (size_t)ds->tokens_capacity * sizeof(int32_t) : 0);
    for (int c = 0; ds->class_names && c < ds->num_classes; c++) free(ds->class_names[c]);
    free(ds->class_names);
    memset(ds, 0, sizeof *ds);
}

void dt_dataset_slice(dt_dataset *ds, int64_t start, int64_t end) {
    if (end < 0 || end > ds->n) end = ds->n;
    if (start < 0 || start >= end)
        dt_usage_error("--start-idx %lld / --end-idx %lld select no %s of the %lld in %s", (long long)start,
                       (long long)end, ds->tokens ? "sequences" : "images", (long long)ds->n, ds->source);
    if (ds->tokens) {                      /* sequences [start, end): their tokens and the one after */
        int64_t T = ds->seq_len, after = ds->targets ? 0 : 1;
        memmove(ds->tokens, ds->tokens + start * T, (size_t)((end - start) * T + after) * sizeof(int32_t));
        if (ds->targets) memmove(ds->targets, ds->targets + start * T, (size_t)((end - start) * T) * sizeof(int32_t));
        ds->ntokens = (end - start) * T + after;
        ds->n = end - start;
        return;
    }
    size_t img = (size_t)ds->channels * ds->size * ds->size;
    memmove(ds->pixels, ds->pixels + start * img, (size_t)(end - start) * img);
    memmove(ds->labels, ds->labels + start, (size_t)(end - start) * sizeof(int32_t));
    ds->n = end - start;
}

int64_t dt_sampler_indices(int64_t n, uint64_t seed, int epoch, int shuffle, int rank, int world, int64_t *out) {
    int64_t *perm = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!perm) dt_fail("out of memory (sampler)");
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    if (shuffle) {                                     /* Fisher-Yates, seeded by (seed, epoch) */
        dt__rng r = { dt__hash3(seed, (uint64_t)epoch, 0x5A4D50u) };
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(dt__rng_u64(&r) % (uint64_t)(i + 1));
            int64_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        }
    }
    int64_t per_rank = n == 0 ? 0 : (n + world - 1) / world;
    for (int64_t i = 0; i < per_rank; i++) out[i] = perm[(rank + i * world) % n];  /* pad by wrapping */
    free(perm);
    return per_rank;
}

dt_loader dt_loader_create(const dt_dataset *ds, int batch_size, uint64_t seed, int shuffle, int augment,
                           int drop_last, int rank, int world) {
    dt_loader l;
    memset(&l, 0, sizeof l);
    l.ds = ds; l.batch_size = batch_size; l.seed = seed; l.shuffle = shuffle; l.augment = augment;
    l.drop_last = drop_last; l.rank = rank; l.world = world;
    l.order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(ds->n / world + 2));
    if (!l.order) dt_fail("out of memory (loader)");
    return l;
}
void dt_loader_free(dt_loader *l) { free(l->order); free(l->counted); l->order = l->counted = NULL; }

int64_t dt_loader_batches_per_epoch(const dt_loader *l) {
    int64_t per_rank = (l->ds->n + l->world - 1) / l->world;
    return l->drop_last ? per_rank / l->batch_size : (per_rank + l->batch_size - 1) / l->batch_size;
}

void dt_loader_start_epoch(dt_loader *l, int epoch, int64_t skip_batches) {
    const dt_dataset *ds = l->ds;
    l->epoch = epoch;
    l->count = dt_sampler_indices(ds->n, l->seed, epoch, l->shuffle, l->rank, l->world, l->order);
    l->pos = skip_batches * l->batch_size;
    if (!ds->targets) return;
    /* Every rank deals itself the same permutation, so each can count what
       the others' batches hold without asking them. */
    int64_t batches = l->count / l->batch_size + 1, *theirs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(l->count + 1));
    free(l->counted);
    l->counted = (int64_t *)calloc((size_t)batches, sizeof(int64_t));
    if (!theirs || !l->counted) dt_fail("out of memory (loader)");
    for (int r = 0; r < l->world; r++) {
        int64_t n = dt_sampler_indices(ds->n, l->seed, epoch, l->shuffle, r, l->world, theirs);
        for (int64_t i = 0; i < n; i++) {
            const int32_t *t = ds->targets + theirs[i] * ds->seq_len;
            for (int k = 0; k < ds->seq_len; k++) l->counted[i / l->batch_size] += t[k] != DT_IGNORE_INDEX;
        }
    }
    free(theirs);
}
int64_t dt_loader_counted_targets(const dt_loader *l, int batches) {
    if (!l->counted) dt_fail("dt_loader_counted_targets: the loader's data has no masked targets (or no epoch has begun)");
    int64_t sum = 0, first = l->pos / l->batch_size, last = dt_loader_batches_per_epoch(l) - 1;
    for (int64_t b = first; b < first + batches && b <= last; b++) sum += l->counted[b];
    return sum;
}

/* A batch of text: B sequences of T token ids, and the T tokens that follow
   each (or, for instruction data, each sequence's own targets). */
static void dt__loader_text(dt_loader *l, dt_batch *b, int B) {
    const dt_dataset *ds = l->ds;
    int T = ds->seq_len, shape[2] = { B, T };
    b->inputs = dt__tensor_alloc(2, shape, DT_F32);
    b->labels = (int32_t *)dt_step_alloc(sizeof(int32_t) * (size_t)B * T);
    size_t bytes = (size_t)B * T * sizeof(float);
    float *host = b->inputs->device == DT_CPU ? b->inputs->data : (float *)dt__step_alloc_uninit(bytes);
    for (int i = 0; i < B; i++) {
        const int32_t *src = ds->tokens + l->order[l->pos + i] * T;
        const int32_t *next = ds->targets ? ds->targets + l->order[l->pos + i] * T : src + 1;
        for (int t = 0; t < T; t++) {
            host[(size_t)i * T + t] = (float)src[t];
            b->labels[(size_t)i * T + t] = next[t];
        }
    }
    if (host != b->inputs->data) dt_upload(b->inputs->data, host, bytes);
}

int dt_loader_next(dt_loader *l, dt_batch *b) {
    int64_t left = l->count - l->pos;
    if (left <= 0 || (l->drop_last && left < l->batch_size)) return 0;
    int B = (int)(left < l->batch_size ? left : l->batch_size);
    const dt_dataset *ds = l->ds;
    memset(b, 0, sizeof *b);
    b->size = B;
    if (ds->tokens) {
        dt__loader_text(l, b, B);
        l->pos += B;
        return 1;
    }
    int C = ds->channels, S = ds->size, pad = S / 8;
    int shape[4] = { B, C, S, S };
    b->inputs = dt__tensor_alloc(4, shape, DT_F32);
    b->labels = (int32_t *)dt_step_alloc(sizeof(int32_t) * B);
    /* The batch is assembled on the host; a GPU gets it in one upload. */
    size_t bytes = (size_t)b->inputs->numel * sizeof(float);
    float *host = b->inputs->device == DT_CPU ? b->inputs->data : (float *)dt__step_alloc_uninit(bytes);
    for (int i = 0; i < B; i++) {
        int64_t idx = l->order[l->pos + i];
        const uint8_t *src = ds->pixels + (size_t)idx * C * S * S;
        float *dst = host + (size_t)i * C * S * S;
        int flip = 0, dx = 0, dy = 0;
        if (l->augment) {                   /* random crop (zero padding S/8) + horizontal flip */
            uint64_t h = dt__hash3(l->seed, (uint64_t)l->epoch, (uint64_t)idx);
            flip = (int)(h & 1);
            dx = (int)((h >> 8) % (uint64_t)(2 * pad + 1)) - pad;
            dy = (int)((h >> 24) % (uint64_t)(2 * pad + 1)) - pad;
        }
        for (int c = 0; c < C; c++)
            for (int y = 0; y < S; y++)
                for (int x = 0; x < S; x++) {
                    int sx = (flip ? S - 1 - x : x) + dx, sy = y + dy;
                    uint8_t v = (sx >= 0 && sx < S && sy >= 0 && sy < S) ? src[((size_t)c * S + sy) * S + sx] : 0;
                    dst[((size_t)c * S + y) * S + x] = v / 127.5f - 1.0f;
                }
        b->labels[i] = ds->labels[idx];
    }
    if (host != b->inputs->data) dt_upload(b->inputs->data, host, bytes);
    l->pos += B;
    return 1;
}

/* -- text. A language model learns to predict each token from the ones before
      it, so a text is one long run of tokens: every position is a training
      example. Bytes are the simplest tokens (256 of them, nothing to
      download); a tokenizer's ids come pre-made in a file. -- */
static void dt__text_split(const int32_t *tok, int64_t n, int vocab, int seq_len, const char *source, dt_dataset *ds) {
    memset(ds, 0, sizeof *ds);
    ds->tokens = (int32_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * sizeof(int32_t));
    memcpy(ds->tokens, tok, (size_t)n * sizeof(int32_t));
    ds->ntokens = ds->tokens_capacity = n;
    ds->seq_len = seq_len;
    ds->n = (n - 1) / seq_len;
    ds->num_classes = vocab;
    dt__copy_str(ds->source, sizeof ds->source, source);
}

/* Token ids are held as floats in the input tensor: whole numbers up to 2^24
   are exact there. */
#define DT_MAX_VOCAB (1 << 24)
/* A NumPy .npy file of token ids (numpy.save): the magic, a version, and a
   Python dict that says the element type, the order and the shape. One
   dimension of uint16, uint32, int32 or int64, little-endian; anything else
   is an error naming what it found. */
static void dt__npy_ids(const char *path, const unsigned char *b, size_t len, size_t *width, int *is_signed, size_t *start) {
    if (len < 10 || b[6] < 1 || b[6] > 3) dt_fail("'%s': a .npy file of version %d; NumPy writes 1, 2 or 3", path, len > 6 ? b[6] : 0);
    size_t hlen = b[6] == 1 ? (size_t)(b[8] | b[9] << 8) : len >= 12 ? (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24 : len;
    size_t at = b[6] == 1 ? 10 : 12;
    if (hlen > len - at) dt_fail("'%s' is truncated: its .npy header claims %zu bytes", path, hlen);
    char header[1024];
    dt__copy_str(header, sizeof header < hlen + 1 ? sizeof header : hlen + 1, (const char *)b + at);
    const char *d = strstr(header, "'descr'"), *f = strstr(header, "'fortran_order'"), *sh = strstr(header, "'shape'");
    char descr[16] = "";
    if (d && (d = strchr(d + 7, '\'')) != NULL) {
        size_t k = 0;
        for (d++; *d && *d != '\'' && k + 1 < sizeof descr; d++) descr[k++] = *d;
        descr[k] = 0;
    }
    static const struct { const char *descr; size_t width; int is_signed; } types[] = {
        { "<u2", 2, 0 }, { "<u4", 4, 0 }, { "<i4", 4, 1 }, { "<i8", 8, 1 } };
    int type = -1;
    for (int k = 0; k < 4; k++) if (!strcmp(descr, types[k].descr)) type = k;
    if (type < 0)
        dt_fail("'%s': a .npy array of '%s'; token ids must be uint16, uint32, int32 or int64 ('<u2', '<u4', '<i4', '<i8')",
                path, descr[0] ? descr : "(no descr)");
    if (!f || !strstr(f, "False")) dt_fail("'%s': a .npy array in Fortran order; save a one-dimensional array", path);
    long long n = -1;
    char close = 0;                                  /* "(n,)": one dimension */
    if (!sh || sscanf(strchr(sh, '(') ? strchr(sh, '(') : sh, "(%lld , %c", &n, &close) != 2 || n < 0 || close != ')')
        dt_fail("'%s': a .npy array of shape %.40s; token ids are one dimension, (n,)", path, sh ? sh + 8 : "(none)");
    *width = types[type].width;
    *is_signed = types[type].is_signed;
    *start = at + hlen;
    size_t want;
    if (__builtin_mul_overflow((size_t)n, *width, &want) || len - *start != want)
        dt_fail("'%s': the .npy header says %lld ids of %zu bytes, the file holds %zu bytes after it (truncated?)", path, n,
                *width, len - *start);
}

/* -- instruction data. An example for fine-tuning is a prompt and its answer,
      and only the answer is to be learned: the prompt's positions are left
      out of the loss. The file is JSON lines, one example per line, which a
      tokenized Hugging Face dataset writes with one line of Python,
          ds.to_json("train.jsonl")
      "input_ids" are the example's tokens; "labels" (optional) are Hugging
      Face's: the token each position is to produce, -100 where the loss
      ignores it, shifted by one here as the model does; an "attention_mask"
      of 0s at the end is right padding, dropped; other keys are ignored.
      Each example is a sequence of its own, inputs ids[0, L-1) and targets
      labels[1, L), padded to --seq-len with ignored targets: causal attention
      never lets a real token see the padding, so nothing leaks between
      examples. -- */

/* One JSON array of whole numbers into a growing buffer; its length, or -1
   when it is not one. */
static int64_t dt__json_ids(dt__json *j, int64_t **buf, int64_t *cap) {
    int64_t n = 0;
    if (!dt__json_eat(j, '[')) return -1;
    if (dt__json_peek(j) == ']') { j->pos++; return 0; }
    while (j->ok) {
        if (n == *cap) {
            *cap = *cap ? 2 * *cap : 1024;
            *buf = (int64_t *)realloc(*buf, sizeof(int64_t) * (size_t)*cap);
            if (!*buf) dt_fail("out of memory (JSON lines)");
        }
        (*buf)[n++] = dt__json_int(j);
        if (dt__json_peek(j) == ',') { j->pos++; continue; }
        dt__json_eat(j, ']');
        break;
    }
    return j->ok ? n : -1;
}

static void dt__records_load(const char *path, const unsigned char *bytes, size_t len, int vocab, int seq_len,
                             double val_fraction, dt_dataset *train, dt_dataset *val) {
    int64_t lines = 0, n = 0, T = seq_len;
    for (size_t i = 0; i < len; i++) lines += bytes[i] == '\n';
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)(lines + 1) * T);
    int32_t *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)(lines + 1) * T);
    int64_t *field[3] = { NULL, NULL, NULL }, cap[3] = { 0, 0, 0 }, counted = 0;
    static const char *keys[3] = { "input_ids", "labels", "attention_mask" };
    if (!tok || !tgt) dt_fail("out of memory reading '%s'", path);
    int largest = 0;
    size_t at = 0;
    for (int64_t line = 1; at < len; line++) {
        size_t end = at;
        while (end < len && bytes[end] != '\n') end++;
        dt__json j = { (const char *)bytes + at, 0, end - at, 1 };
        at = end + 1;
        if (dt__json_peek(&j) < 0) continue;                  /* a blank line */
        int64_t count[3] = { -2, -2, -2 };                    /* -2: absent */
        if (!dt__json_eat(&j, '{')) dt_fail("'%s' line %lld: not a JSON object (JSON lines hold one example per line)", path, (long long)line);
        if (dt__json_peek(&j) == '}') j.pos++;
        else while (j.ok) {
            char *key = dt__json_str(&j);
            int k = 0;
            while (key && k < 3 && strcmp(key, keys[k])) k++;
            if (!key || !dt__json_eat(&j, ':')) { free(key); j.ok = 0; break; }
            if (k < 3 && (count[k] = dt__json_ids(&j, &field[k], &cap[k])) < 0)
                dt_fail("'%s' line %lld: \"%s\" is not a list of whole numbers", path, (long long)line, key);
            if (k == 3) dt__json_skip(&j, 0);
            free(key);
            if (dt__json_peek(&j) == ',') { j.pos++; continue; }
            dt__json_eat(&j, '}');
            break;
        }
        if (!j.ok || dt__json_peek(&j) >= 0)
            dt_fail("'%s' line %lld: not valid JSON near byte %zu of the line", path, (long long)line, j.pos + 1);
        int64_t L = count[0];
        if (L == -2) dt_fail("'%s' line %lld: no \"input_ids\" (a tokenized dataset has them: tokenizer(...)[\"input_ids\"])", path, (long long)line);
        for (int k = 1; k < 3; k++)
            if (count[k] != -2 && count[k] != L)
                dt_fail("'%s' line %lld: %lld \"%s\" for %lld \"input_ids\"; they pair up one to one", path, (long long)line,
                        (long long)count[k], keys[k], (long long)L);
        if (count[2] != -2) {                                 /* right padding ends the example */
            int64_t real = 0;
            while (real < L && field[2][real] == 1) real++;
            for (int64_t t = real; t < L; t++)
                if (field[2][t] != 0)
                    dt_fail("'%s' line %lld: attention_mask %lld at position %lld after a 0; only right padding "
                            "(1s, then 0s) is read", path, (long long)line, (long long)field[2][t], (long long)t);
            L = real;
        }
        if (L < 2) dt_fail("'%s' line %lld: %lld tokens; an example needs two at least (one to read, one to predict)", path, (long long)line, (long long)L);
        if (L - 1 > T)
            dt_fail("'%s' line %lld: %lld tokens; --seq-len %lld holds examples of up to %lld (raise --seq-len, or cut "
                    "or drop long examples when you tokenize)", path, (long long)line, (long long)L, (long long)T, (long long)T + 1);
        const int64_t *labels = count[1] != -2 ? field[1] : field[0];
        for (int64_t t = 0; t < L; t++) {
            if (field[0][t] < 0 || field[0][t] >= DT_MAX_VOCAB || (vocab > 0 && field[0][t] >= vocab))
                dt_fail("'%s' line %lld: input_ids[%lld] is %lld; ids run from 0 to %d", path, (long long)line, (long long)t,
                        (long long)field[0][t], (vocab > 0 ? vocab : DT_MAX_VOCAB) - 1);
            if (labels[t] != DT_IGNORE_INDEX && (labels[t] < 0 || labels[t] >= DT_MAX_VOCAB || (vocab > 0 && labels[t] >= vocab)))
                dt_fail("'%s' line %lld: labels[%lld] is %lld; a label is a token id from 0 to %d, or -100 (ignored)", path,
                        (long long)line, (long long)t, (long long)labels[t], (vocab > 0 ? vocab : DT_MAX_VOCAB) - 1);
            if (field[0][t] > largest) largest = (int)field[0][t];
            if (labels[t] > largest) largest = (int)labels[t];
        }
        int32_t *x = tok + n * T, *y = tgt + n * T;
        for (int64_t t = 0; t < T; t++) {
            x[t] = t < L - 1 ? (int32_t)field[0][t] : 0;
            y[t] = t < L - 1 ? (int32_t)labels[t + 1] : DT_IGNORE_INDEX;
            counted += y[t] != DT_IGNORE_INDEX;
        }
        n++;
    }
    for (int k = 0; k < 3; k++) free(field[k]);
    int64_t nval = (int64_t)((double)n * val_fraction), ntrain = n - nval;
    if (ntrain < 1 || (val_fraction > 0 && nval < 1))
        dt_fail("'%s' has %lld examples: too few (training and validation need one each; the last %.0f%% is validation)",
                path, (long long)n, 100 * val_fraction);
    if (!counted) dt_fail("'%s': every label is -100; there is nothing to learn", path);
    if (vocab <= 0) vocab = largest + 1;
    char source[512];
    snprintf(source, sizeof source, "%s (instruction examples, JSON lines)", path);
    for (int part = 0; part < 2; part++) {
        dt_dataset *ds = part ? val : train;
        int64_t first = part ? ntrain : 0, count = part ? nval : ntrain;
        if (!ds) continue;
        memset(ds, 0, sizeof *ds);
        ds->n = count;
        ds->ntokens = ds->tokens_capacity = count * T;
        ds->tokens = (int32_t *)dt_alloc(DT_ARENA_DATA, sizeof(int32_t) * (size_t)(count * T));
        ds->targets = (int32_t *)dt_alloc(DT_ARENA_DATA, sizeof(int32_t) * (size_t)(count * T));
        memcpy(ds->tokens, tok + first * T, sizeof(int32_t) * (size_t)(count * T));
        memcpy(ds->targets, tgt + first * T, sizeof(int32_t) * (size_t)(count * T));
        ds->seq_len = seq_len;
        ds->num_classes = vocab;
        dt__copy_str(ds->source, sizeof ds->source, source);
    }
    free(tok);
    free(tgt);
}

void dt_text_load(const char *path, int is_tokens, int vocab, int seq_len, double val_fraction, dt_dataset *train,
                  dt_dataset *val) {
    struct stat st;
    if (stat(path, &st) != 0) dt_fail("cannot open '%s': %s", path, strerror(errno));
    unsigned char *bytes = NULL;
    size_t len = 0;
    if (S_ISDIR(st.st_mode)) {                       /* every .txt file, in name order, one after another */
        if (is_tokens) dt_fail("--tokens '%s' is a folder; it takes one file of token ids (.npy, JSON lines, or raw uint16)", path);
        int count = 0, used = 0;
        char **names = dt__list_dir(path, 0, &count);
        for (int i = 0; i < count; i++) {
            size_t l = strlen(names[i]), flen = 0;
            if (l < 4 || strcmp(names[i] + l - 4, ".txt")) continue;
            char full[4096];
            dt__path(full, sizeof full, "%s/%s", path, names[i]);
            unsigned char *part = dt__read_file(full, &flen);
            if (!part) dt_fail("cannot read '%s': %s", full, dt__read_failure());
            unsigned char *grown = (unsigned char *)realloc(bytes, len + flen + 1);
            if (!grown) dt_fail("out of memory reading '%s'", full);
            bytes = grown;
            memcpy(bytes + len, part, flen);
            len += flen;
            free(part);
            used++;
        }
        dt__free_names(names, count);
        if (!used) dt_fail("'%s' holds no .txt file", path);
    } else if (!(bytes = dt__read_file(path, &len))) dt_fail("cannot read '%s': %s", path, dt__read_failure());
    size_t first = len >= 3 && !memcmp(bytes, "\xEF\xBB\xBF", 3) ? 3 : 0;     /* past a UTF-8 byte-order mark */
    while (first < len && isspace(bytes[first])) first++;
    if (is_tokens && first < len && bytes[first] == '{') {                       /* JSON lines */
        dt__records_load(path, bytes + first, len - first, vocab, seq_len, val_fraction, train, val);
        free(bytes);
        return;
    }
    if (is_tokens && first + 1 < len && bytes[first] == '[' && (bytes[first + 1] == '{' || isspace(bytes[first + 1])))
        dt_fail("'%s' is one JSON array; --tokens reads JSON lines, one example per line: ds.to_json(path), whose "
                "default is lines=True", path);
    int npy = is_tokens && len >= 6 && !memcmp(bytes, "\x93NUMPY", 6);
    size_t path_len = strlen(path);
    if (is_tokens && !npy && path_len > 4 && !strcmp(path + path_len - 4, ".npy"))   /* not read as raw uint16 */
        dt_fail("'%s' is named .npy but is not a NumPy file (it does not begin with \\x93NUMPY): numpy.save writes one; "
                "a file of raw uint16 ids takes another name (.bin)", path);
    size_t width = 2, at = 0;                        /* bytes per id, where the ids start */
    int is_signed = 0;
    if (npy) dt__npy_ids(path, bytes, len, &width, &is_signed, &at);
    else if (is_tokens && len % 2)
        dt_fail("'%s' has %zu bytes, an odd number: a file of uint16 token ids has 2 bytes per token (truncated?)", path, len);
    int64_t n = is_tokens ? (int64_t)((len - at) / width) : (int64_t)len;
    int32_t *tok = (int32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!tok) dt_fail("out of memory reading '%s'", path);
    int largest = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!is_tokens) tok[i] = bytes[i];
        else {                                       /* little-endian, as NumPy writes on every common machine */
            const unsigned char *b = bytes + at + (size_t)i * width;
            uint64_t u = 0;
            for (size_t k = 0; k < width; k++) u |= (uint64_t)b[k] << (8 * k);
            int64_t v = (int64_t)u;
            if (is_signed && width < 8 && (u >> (8 * width - 1)) & 1) v = (int64_t)(u | ~0ULL << (8 * width));   /* sign */
            if (v < 0 || v >= DT_MAX_VOCAB) {
                free(tok);                           /* nothing of the load outlives the error (LeakSanitizer) */
                free(bytes);
                dt_fail("'%s': token %lld is id %lld; ids run from 0 to %d (whole numbers a float holds exactly)", path,
                        (long long)i, (long long)v, DT_MAX_VOCAB - 1);
            }
            tok[i] = (int32_t)v;
        }
        if (tok[i] > largest) largest = tok[i];
    }
    free(bytes);
    if (!is_tokens && vocab <= 0) vocab = 256;
    if (!is_tokens && vocab < 256) dt_usage_error("--vocab %d: text read as bytes needs a vocabulary of at least 256", vocab);
    if (vocab <= 0) vocab = largest + 1;
    if (largest >= vocab) {
        int64_t at = 0;
        while (tok[at] < vocab) at++;
        dt_fail("'%s': token %lld is id %d, outside --vocab %d", path, (long long)at, tok[at], vocab);
    }
    int64_t nval = (int64_t)(n * val_fraction), ntrain = n - nval;
    if (ntrain < seq_len + 1 || (val_fraction > 0 && nval < seq_len + 1))
        dt_fail("'%s' has %lld tokens: too few for sequences of --seq-len %d (training and validation need %d each; "
                "the last %.0f%% is validation)", path, (long long)n, seq_len, seq_len + 1, 100 * val_fraction);
    char source[512];
    snprintf(source, sizeof source, "%s (%s)", path, !is_tokens ? "bytes" : npy ? "token ids, .npy" : "uint16 token ids");
    dt__text_split(tok, ntrain, vocab, seq_len, source, train);
    if (val) dt__text_split(tok + ntrain, nval, vocab, seq_len, source, val);
    free(tok);
}

/* The tokens a data set asks to be predicted: every one after the first, or
   the targets of instruction data (DT_IGNORE_INDEX where none is asked). */
static int64_t dt__predicted_count(const dt_dataset *ds) { return ds->targets ? ds->ntokens : ds->ntokens - 1; }
static int32_t dt__predicted(const dt_dataset *ds, int64_t i) { return ds->targets ? ds->targets[i] : ds->tokens[i + 1]; }
/* The targets its sequences' losses count: n x seq_len, less the ignored ones. */
static int64_t dt__counted_targets(const dt_dataset *ds) {
    int64_t n = ds->n * ds->seq_len;
    for (int64_t i = 0; ds->targets && i < ds->ntokens; i++) n -= ds->targets[i] == DT_IGNORE_INDEX;
    return n;
}
double dt_unigram_loss(const dt_dataset *train, const dt_dataset *eval) {
    int V = train->num_classes;
    double *count = (double *)calloc((size_t)V, sizeof(double)), loss = 0, total = V, scored = 0;
    if (!count) dt_fail("out of memory");
    for (int64_t i = 0; i < dt__predicted_count(train); i++) {
        int32_t t = dt__predicted(train, i);
        if (t != DT_IGNORE_INDEX) { count[t] += 1; total += 1; }     /* add-one smoothing */
    }
    for (int64_t i = 0; i < dt__predicted_count(eval); i++) {
        int32_t t = dt__predicted(eval, i);
        if (t != DT_IGNORE_INDEX) { loss -= log((count[t] + 1) / total); scored += 1; }
    }
    free(count);
    return scored > 0 ? loss / scored : 0;
}

/* -- the built-in text: sentences from a small grammar. Enough structure to
      learn in minutes on a laptop (spelling, word order, punctuation), enough
      variety that a model must generalise rather than memorise. -- */
static const char *dt__pick(dt__rng *r, const char *const *words, int n) { return words[dt__rng_u64(r) % (uint64_t)n]; }
#define DT_PICK(r, list) dt__pick(r, list, (int)(sizeof list / sizeof list[0]))

void dt_synthetic_text_write(const char *path, int64_t bytes, uint64_t seed) {
    static const char *const people[] = { "the farmer", "the old woman", "a young sailor", "the miller", "my brother",
        "the teacher", "a tired soldier", "the baker", "her father", "the little girl", "the doctor", "a stranger",
        "the king", "the shepherd", "his mother", "the captain", "a merchant", "the children", "our neighbour", "the cook" };
    static const char *const animals[] = { "the grey cat", "a brown dog", "the old horse", "a small bird", "the fox",
        "the white goose", "a black crow", "the lazy pig", "the goat", "a field mouse" };
    static const char *const things[] = { "the bread", "a letter", "the lamp", "an apple", "the basket", "a red coat",
        "the key", "the boat", "a loaf of bread", "the garden gate", "a cup of tea", "the map", "an old book",
        "the candle", "a bag of flour", "the wooden box", "the bell", "a pair of boots" };
    static const char *const places[] = { "the market", "the river", "the village", "the forest", "the mill",
        "the harbour", "the church", "the hill", "the kitchen", "the barn", "the town square", "the bridge",
        "the school", "the road to the sea", "the orchard" };
    static const char *const carry[] = { "carried", "found", "lost", "opened", "mended", "sold", "bought", "hid",
        "painted", "washed", "cleaned", "dropped", "brought", "borrowed", "wanted" };
    static const char *const move[] = { "walked to", "ran to", "went down to", "came back from", "hurried to",
        "looked at", "waited by", "slept near", "sang near", "played by" };
    static const char *const when[] = { "in the morning", "at night", "after dinner", "before the rain",
        "on Sunday", "every day", "in the spring", "at noon", "late in the evening", "once again" };
    static const char *const feel[] = { "happy", "tired", "hungry", "afraid", "angry", "quiet", "sad", "glad",
        "cold", "proud" };
    static const char *const said[] = { "said", "asked", "cried", "whispered", "answered", "shouted" };
    static const char *const lines[] = { "where is the key", "the bread is warm", "it is going to rain",
        "we must go home now", "who has seen my dog", "the boat is ready", "I am not afraid",
        "the market is closed today", "bring me the lamp", "look at the sky" };
    FILE *f = fopen(path, "wb");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    dt__rng r = { seed };
    char sentence[512];
    int64_t written = 0;
    int in_paragraph = 0;
    while (written < bytes) {
        const char *who = dt__rng_uniform(&r) < 0.75 ? DT_PICK(&r, people) : DT_PICK(&r, animals);
        switch ((int)(dt__rng_u64(&r) % 6)) {
        case 0: snprintf(sentence, sizeof sentence, "%s %s %s %s.", who, DT_PICK(&r, carry), DT_PICK(&r, things), DT_PICK(&r, when)); break;
        case 1: snprintf(sentence, sizeof sentence, "%s %s %s.", who, DT_PICK(&r, move), DT_PICK(&r, places)); break;
        case 2: snprintf(sentence, sizeof sentence, "%s was %s, so %s %s %s.", who, DT_PICK(&r, feel), DT_PICK(&r, people),
                         DT_PICK(&r, move), DT_PICK(&r, places)); break;
        case 3: {
            const char *line = DT_PICK(&r, lines);
            snprintf(sentence, sizeof sentence, "\"%c%s,\" %s %s.", line[0] == 'I' ? 'I' : line[0] - 'a' + 'A', line + 1,
                     DT_PICK(&r, said), who);
            break;
        }
        case 4: snprintf(sentence, sizeof sentence, "%s %s %s in %s, but %s %s it %s.", who, DT_PICK(&r, carry),
                         DT_PICK(&r, things), DT_PICK(&r, places), DT_PICK(&r, people), DT_PICK(&r, carry), DT_PICK(&r, when)); break;
        default: snprintf(sentence, sizeof sentence, "%s %s %s, and %s %s %s.", who, DT_PICK(&r, move), DT_PICK(&r, places),
                          DT_PICK(&r, animals), DT_PICK(&r, move), DT_PICK(&r, places)); break;
        }
        int64_t len = (int64_t)strlen(sentence);
        if (len > 0 && sentence[0] >= 'a' && sentence[0] <= 'z') sentence[0] = (char)(sentence[0] - 'a' + 'A');
        in_paragraph++;
        const char *sep = in_paragraph >= 3 + (int)(dt__rng_u64(&r) % 4) ? (in_paragraph = 0, "\n\n") : " ";
        if (fputs(sentence, f) < 0 || fputs(sep, f) < 0) dt__write_failed(NULL, path, errno);
        written += len + (int64_t)strlen(sep);
    }
    dt__file_close(f, NULL, path);
}
#undef DT_PICK

/* -- the synthetic set: ten classes = five shapes x two colour families, drawn
      at random positions and sizes on noisy backgrounds. Learnable, but not by
      looking at one pixel: the shape has to be recognised. -- */
static void dt__hsv_to_rgb(float h, float s, float v, float *rgb) {
    float c = v * s, hp = fmodf(h, 360.0f) / 60.0f, x = c * (1 - fabsf(fmodf(hp, 2.0f) - 1)), m = v - c;
    float r = 0, g = 0, b = 0;
    if (hp < 1) { r = c; g = x; } else if (hp < 2) { r = x; g = c; } else if (hp < 3) { g = c; b = x; }
    else if (hp < 4) { g = x; b = c; } else if (hp < 5) { r = x; b = c; } else { r = c; b = x; }
    rgb[0] = r + m; rgb[1] = g + m; rgb[2] = b + m;
}

static void dt__synthetic_image(int cls, int S, dt__rng *r, uint8_t *hwc) {
    static const float hue_base[2] = { 10.0f, 200.0f };       /* warm, cool */
    int shape = cls % 5, family = cls / 5;
    float bg = 60 + 130 * (float)dt__rng_uniform(r), gx = (float)dt__rng_uniform(r) * 40 - 20;
    float fg[3];
    dt__hsv_to_rgb(hue_base[family] + 50 * (float)dt__rng_uniform(r), 0.55f + 0.45f * (float)dt__rng_uniform(r),
                  0.5f + 0.5f * (float)dt__rng_uniform(r), fg);
    float cx = S * (0.5f + 0.2f * ((float)dt__rng_uniform(r) - 0.5f)), cy = S * (0.5f + 0.2f * ((float)dt__rng_uniform(r) - 0.5f));
    float rad = S * (0.22f + 0.12f * (float)dt__rng_uniform(r));
    for (int y = 0; y < S; y++)
        for (int x = 0; x < S; x++) {
            float u = (x + 0.5f - cx) / rad, v = (y + 0.5f - cy) / rad, d2 = u * u + v * v;
            int in = 0;
            switch (shape) {
            case 0: in = d2 <= 1.0f; break;                                       /* disk */
            case 1: in = fabsf(u) <= 0.8f && fabsf(v) <= 0.8f; break;             /* square */
            case 2: in = v <= 0.8f && v >= -1.0f && fabsf(u) <= (v + 1.0f) * 0.55f; break;  /* triangle */
            case 3: in = (fabsf(u) <= 0.3f && fabsf(v) <= 1.0f) || (fabsf(v) <= 0.3f && fabsf(u) <= 1.0f); break;
            case 4: in = d2 <= 1.0f && d2 >= 0.4f; break;                         /* ring */
            }
            for (int c = 0; c < 3; c++) {
                float noise = 24.0f * ((float)dt__rng_uniform(r) - 0.5f);
                float val = in ? fg[c] * 255.0f + noise : bg + gx * (x - S / 2.0f) / S + noise;
                hwc[((size_t)y * S + x) * 3 + c] = (uint8_t)(val < 0 ? 0 : val > 255 ? 255 : val);
            }
        }
}

static void dt__mkdir(const char *path) {
    if (mkdir(path, 0755) != 0 && errno != EEXIST) dt_fail("cannot create folder '%s': %s", path, strerror(errno));
}

#ifdef DT_HAVE_STB
/* stbi_write_png ignores what its fwrite returns, so a full disk would leave a
   cut-off PNG; through this callback the writes land in a FILE we check. */
static void dt__png_to_file(void *f, void *data, int size) { fwrite(data, 1, (size_t)size, (FILE *)f); }
#endif

static void dt__write_image(const char *path_noext, const uint8_t *hwc, int S) {
    char path[4096];
#ifdef DT_HAVE_STB
    dt__path(path, sizeof path, "%s.png", path_noext);
#else
    dt__path(path, sizeof path, "%s.ppm", path_noext);
#endif
    FILE *f = fopen(path, "wb");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
#ifdef DT_HAVE_STB
    if (!stbi_write_png_to_func(dt__png_to_file, f, S, S, 3, hwc, S * 3)) dt_fail("cannot encode '%s' as PNG", path);
#else
    fprintf(f, "P6\n%d %d\n255\n", S, S);             /* a failure stays in f for dt__file_close */
    fwrite(hwc, 1, (size_t)S * S * 3, f);
#endif
    dt__file_close(f, NULL, path);
}

void dt_synthetic_write(const char *dir, int n_train, int n_val, int size, uint64_t seed) {
    static const char *names[10] = { "disk-warm", "square-warm", "triangle-warm", "cross-warm", "ring-warm",
                                     "disk-cool", "square-cool", "triangle-cool", "cross-cool", "ring-cool" };
    /* Written beside the target and renamed at the end, so an interrupted run
       never leaves a half-made set that the next run would trust. */
    char tmp[4096], path[4096];
    dt__path(tmp, sizeof tmp, "%s.partial", dir);
    dt__mkdir(tmp);
    uint8_t *hwc = (uint8_t *)malloc((size_t)size * size * 3);
    if (!hwc) dt_fail("out of memory (an image of %d x %d)", size, size);
    for (int split = 0; split < 2; split++) {
        const char *sname = split == 0 ? "train" : "val";
        int n = split == 0 ? n_train : n_val;
        dt__path(path, sizeof path, "%s/%s", tmp, sname);
        dt__mkdir(path);
        for (int c = 0; c < 10; c++) { dt__path(path, sizeof path, "%s/%s/%s", tmp, sname, names[c]); dt__mkdir(path); }
        for (int i = 0; i < n; i++) {
            int cls = i % 10;
            dt__rng r = { dt__hash3(seed, (uint64_t)split, (uint64_t)i) };
            dt__synthetic_image(cls, size, &r, hwc);
            dt__path(path, sizeof path, "%s/%s/%s/%05d", tmp, sname, names[cls], i / 10);
            dt__write_image(path, hwc, size);
        }
    }
    free(hwc);
    if (rename(tmp, dir) != 0) dt_fail("cannot rename '%s' to '%s': %s", tmp, dir, strerror(errno));
}

/* [src/19-launching.h] */
/* ==== launching ranks and the rendezvous ====================================
   A job is N copies of one program. Something starts them -- `--nproc N` here,
   or torchrun, srun, mpirun -- and tells each its rank through environment
   variables. The ranks then meet: rank 0 listens on MASTER_PORT, the others
   connect to MASTER_ADDR:MASTER_PORT and prove they belong to the job, and
   rank 0, once it has checked that every rank shares its host's memory,
   hands out what they must share: the name of the shared-memory segment, and
   NCCL's unique id. The segment is made once all have joined and its name
   removed once all have mapped it, so nothing is left in /dev/shm
   however the job ends -- even when a rank is killed. A job ends well when it
   is told to: SIGTERM and Ctrl-C stop it after a step, saved. */

static int dt__env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < 0 || x > 1000000) dt_fail("environment variable %s='%s' is not a rank or a count", name, v);
    return (int)x;
}

void dt_rank_from_env(int *rank, int *world, int *local_rank) {
    static const char *vars[4][3] = { { "RANK", "WORLD_SIZE", "LOCAL_RANK" },
                                      { "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID" },
                                      { "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK" },
                                      { "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID" } };            /* MPICH's mpiexec */
    *rank = 0; *world = 1; *local_rank = 0;
    for (int k = 0; k < 4; k++) {
        if (!getenv(vars[k][0]) || !getenv(vars[k][1])) continue;
        *rank = dt__env_int(vars[k][0], 0);
        *world = dt__env_int(vars[k][1], 1);
        *local_rank = dt__env_int(vars[k][2], *rank);
        if (*world < 1 || *rank >= *world)
            dt_fail("%s=%d but %s=%d: the rank must be below the world size", vars[k][0], *rank, vars[k][1], *world);
        if (*world > DT_MAX_RANKS) dt_fail("%s=%d: at most %d ranks", vars[k][1], *world, DT_MAX_RANKS);
        return;
    }
}

int dt_local_ranks_from_env(void) {
    static const char *vars[4] = { "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "MPI_LOCALNRANKS" };
    for (int k = 0; k < 4; k++) {
        const char *v = getenv(vars[k]);
        if (v && *v) return atoi(v) > 0 ? atoi(v) : 0;     /* SLURM may say "2(x3)": the first number */
    }
    return 0;
}

int dt_gpu_for_rank(int local_rank, int local_ranks, int gpus, int ranks_per_gpu, char *why, size_t n) {
    if (gpus < 1) { snprintf(why, n, "no GPU is visible"); return -1; }
    if (local_ranks <= local_rank) local_ranks = local_rank + 1;    /* unknown: at least this many */
    if (ranks_per_gpu < 1) ranks_per_gpu = 1;
    if (local_ranks > (int64_t)gpus * ranks_per_gpu) {
        snprintf(why, n, "%d ranks on this machine but %d GPU%s visible: give each rank a GPU (fewer ranks, or more "
                 "GPUs in CUDA_VISIBLE_DEVICES), or let ranks share one with --ranks-per-gpu %d", local_ranks, gpus,
                 gpus == 1 ? "" : "s", (local_ranks + gpus - 1) / gpus);
        return -1;
    }
    return local_rank % gpus;
}

/* Two ranks on one GPU (--ranks-per-gpu): NCCL 2.30 and later allow it when
   asked (NCCL_MULTI_RANK_GPU_ENABLE=1); older NCCL refuses a GPU twice in one
   communicator, unless each rank says it is a host of its own (NCCL_HOSTID),
   which sends the traffic through sockets over the loopback interface. Set
   before NCCL starts; a variable the user set is kept. Says which, once. */
#ifdef DT_HAVE_CUDA
static void dt__share_gpus(int rank, int local_ranks, int gpus) {
    int v = dt_nccl_version(), major = v >= 10000 ? v / 10000 : v / 1000, minor = v >= 10000 ? v / 100 % 100 : v / 100 % 10;
    char how[256];
    if (v >= 23000) {
        setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
        snprintf(how, sizeof how, "NCCL %d.%d.%d with NCCL_MULTI_RANK_GPU_ENABLE=1", major, minor, v % 100);
    } else {
        char id[48];
        snprintf(id, sizeof id, "dtrain-rank-%d", rank);
        setenv("NCCL_HOSTID", id, 0);
        setenv("NCCL_SOCKET_IFNAME", "lo", 0);
        setenv("NCCL_IB_DISABLE", "1", 0);
        snprintf(how, sizeof how, "NCCL %d.%d.%d (before 2.30): a NCCL_HOSTID per rank, sockets over the loopback "
                 "interface -- a workaround NCCL does not support, for tests only", major, minor, v % 100);
    }
    if (rank == 0) printf("dtrain: sharing %d GPU%s among %d ranks on this machine: %s\n", gpus, gpus == 1 ? "" : "s",
                          local_ranks, how);
}
#endif

/* A listening TCP socket on every interface (MASTER_ADDR may be the host's
   name, not loopback), or on the loopback alone (--nproc: every rank is on
   this machine, and no other machine needs to reach it); port 0 lets the
   kernel choose. Close-on-exec: a program a rank starts does not hold the
   job's port. -1 with errno set on failure. */
static int dt__tcp_listen_on(int port, int loopback) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
    a.sin_port = htons((uint16_t)port);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd < 0) return -1;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, DT_MAX_RANKS) == 0) return fd;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}
static int dt__tcp_listen(int port) { return dt__tcp_listen_on(port, 0); }
static int dt__tcp_port_of(int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    return getsockname(fd, (struct sockaddr *)&a, &len) == 0 && a.sin_family == AF_INET ? ntohs(a.sin_port) : -1;
}

/* -- stopping on a signal --
   Ctrl-C (SIGINT), SIGTERM (what SLURM and Kubernetes send before they kill a
   job) and SIGUSR1 (srun --signal=USR1@60) ask the run to stop: every rank
   finishes the step it is in, the ranks agree on it, save a checkpoint together
   and exit -- 75 after SIGTERM or SIGUSR1 (EX_TEMPFAIL: preempted, run it
   again with --resume auto), 130 after Ctrl-C. A second SIGINT or SIGTERM,
   two seconds or more after the first, stops at once, removing what
   dt__cleanup_add registered. */
static volatile sig_atomic_t dt__stop_signal, dt__stop_catching;
static struct timespec dt__stop_first;
static void dt__on_stop_signal(int sig) {
    /* One signal often arrives twice: SLURM or systemd signal every process of the job, and a launcher passes
       on the one it got. A second one counts only when it comes later, from someone who means it. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (dt__stop_signal && sig != SIGUSR1 && now.tv_sec - dt__stop_first.tv_sec >= 2) {
        static const char msg[] = "dtrain: a second signal: stopping at once\n";
        dt__cleanup_run();
        ssize_t ignored = write(2, msg, sizeof msg - 1);
        (void)ignored;
        _exit(128 + sig);
    }
    if (!dt__stop_signal) dt__stop_first = now;
    dt__stop_signal = sig;
}
static void dt__set_stop_handler(void (*handler)(int), int restart) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sa.sa_flags = restart ? SA_RESTART : 0;  /* a rank's reads and writes go on; a waiting launcher wakes */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
}
static void dt__catch_stop_signals(void) { dt__set_stop_handler(dt__on_stop_signal, 1); dt__stop_catching = 1; }
static const char *dt__signal_name(int sig) {
    return sig == SIGINT ? "SIGINT (Ctrl-C)" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : "a signal";
}
static void dt__check_stop(const char *during) {
    if (dt__stop_signal) dt_fail("stopped by %s %s", dt__signal_name(dt__stop_signal), during);
}

/* -- the launcher (--nproc N) --
   It forks the ranks, gives each its own process group (so a Ctrl-C at the
   terminal reaches the launcher alone, which passes it on once), and waits.
   A rank whose launcher dies gets SIGTERM from the kernel (PR_SET_PDEATHSIG):
   it saves and stops as if preempted, never trains on alone. */
static volatile sig_atomic_t dt__launcher_signal;
static void dt__on_launcher_signal(int sig) { dt__launcher_signal = sig; }

/* Is this process a rank that --nproc's launcher started? Its variables say
   so, and its parent is the launcher they name: a DT_LAUNCHED_RANK left in an
   environment (a shell started from a rank) once made --nproc 2 one process. */
static int dt__launched_here(void) {
    const char *rank = getenv("DT_LAUNCHED_RANK"), *launcher = getenv("DT_LAUNCHER_PID");
    return rank && launcher && atol(launcher) == (long)getppid();
}

/* -- the job's secret --
   Whoever reaches rank 0's port could otherwise join a job as a rank (and be
   handed its shared memory's name, or NCCL's id), and a fake rank 0 could
   hand a rank the name of any segment. So a job has a secret that every rank
   knows and none ever sends: DT_JOB_SECRET, which --nproc's launcher makes
   (128 random bits) and hands to its ranks; under torchrun, srun or mpirun the
   user sets it for every rank. Each side proves it knows it by a keyed hash
   (SipHash-2-4, a PRF made for short messages) of the other side's fresh
   random nonce. Without one the job still runs, as before: anyone on the
   network who can reach the port can join it (the README says so). */
#define DT__SECRET_BYTES 16
static int dt__random_bytes(void *out, size_t n) {
    FILE *r = fopen("/dev/urandom", "rb");
    size_t got = r ? fread(out, 1, n, r) : 0;
    if (r) fclose(r);
    return got == n;
}
static void dt__new_secret(char hex[2 * DT__SECRET_BYTES + 1]) {
    unsigned char b[DT__SECRET_BYTES];
    if (!dt__random_bytes(b, sizeof b)) dt_fail("--nproc: cannot read /dev/urandom for the job's secret: %s", strerror(errno));
    for (int i = 0; i < DT__SECRET_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", b[i]);
}
static uint64_t dt__rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }
#define DT__SIPROUND                                                                                      \
    do {                                                                                                  \
        v0 += v1; v1 = dt__rotl(v1, 13); v1 ^= v0; v0 = dt__rotl(v0, 32);                                 \
        v2 += v3; v3 = dt__rotl(v3, 16); v3 ^= v2;                                                        \
        v0 += v3; v3 = dt__rotl(v3, 21); v3 ^= v0;                                                        \
        v2 += v1; v1 = dt__rotl(v1, 17); v1 ^= v2; v2 = dt__rotl(v2, 32);                                 \
    } while (0)
/* SipHash-2-4 of n bytes under a 128-bit key (its two halves little-endian). */
static uint64_t dt__siphash(const uint64_t key[2], const void *data, size_t n) {
    const unsigned char *m = (const unsigned char *)data;
    uint64_t v0 = key[0] ^ 0x736f6d6570736575ull, v1 = key[1] ^ 0x646f72616e646f6dull;
    uint64_t v2 = key[0] ^ 0x6c7967656e657261ull, v3 = key[1] ^ 0x7465646279746573ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = 0;
        for (int k = 0; k < 8; k++) w |= (uint64_t)m[i + k] << (8 * k);
        v3 ^= w; DT__SIPROUND; DT__SIPROUND; v0 ^= w;
    }
    uint64_t last = (uint64_t)n << 56;
    for (int k = 0; i + k < n; k++) last |= (uint64_t)m[i + k] << (8 * k);
    v3 ^= last; DT__SIPROUND; DT__SIPROUND; v0 ^= last;
    v2 ^= 0xff;
    DT__SIPROUND; DT__SIPROUND; DT__SIPROUND; DT__SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}
/* The job's key from DT_JOB_SECRET (any string: hashed to 128 bits), or 0 when there is none. */
static int dt__job_key(uint64_t key[2]) {
    const char *s = getenv("DT_JOB_SECRET");
    static const uint64_t k0[2] = { 0x64747261696e2d6bull, 0x65792d6f662d6a6full }, k1[2] = { 0x1ull, 0x2ull };
    if (!s || !*s) { key[0] = key[1] = 0; return 0; }
    key[0] = dt__siphash(k0, s, strlen(s));
    key[1] = dt__siphash(k1, s, strlen(s));
    return 1;
}
/* A proof: the keyed hash of what it is for (a word), the other side's nonce and the message's own fields. */
static uint64_t dt__proof(const uint64_t key[2], const char *what, const unsigned char nonce[16], const void *fields, size_t n) {
    unsigned char buf[16 + 16 + 1400];
    size_t len = strlen(what) < 16 ? strlen(what) : 16;
    memset(buf, 0, 32);
    memcpy(buf, what, len);
    memcpy(buf + 16, nonce, 16);
    if (n > sizeof buf - 32) n = sizeof buf - 32;
    memcpy(buf + 32, fields, n);
    return dt__siphash(key, buf, 32 + n);
}

/* A rank killed after it made the job's segment, before every rank had mapped
   it and its name was removed, leaves it in /dev/shm: the launcher removes
   what a rank's pid names once that rank has ended. */
static void dt__shm_remove_of(pid_t pid) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "dtrain-%d-%d-", (int)getuid(), (int)pid);
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char name[300];
        if (strncmp(e->d_name, prefix, strlen(prefix))) continue;
        snprintf(name, sizeof name, "/%s", e->d_name);
        shm_unlink(name);
    }
    if (d) closedir(d);
}

void dt_launch(int nproc, double timeout_s) {
    if (nproc <= 1 || dt__launched_here()) return;
    if (nproc > DT_MAX_RANKS) dt_usage_error("--nproc %d: at most %d ranks", nproc, DT_MAX_RANKS);
    if (dt__cuda_touched) dt_fail("dt_launch: the GPU was used before the ranks were started (a CUDA context does not "
                                 "survive fork); call dt_launch (dt_parse_args does) before dt_set_device");
    if (__atomic_load_n(&dt__active_comm, __ATOMIC_ACQUIRE))
        dt_fail("dt_launch: a communicator and its thread already run (threads do not survive fork); call dt_launch "
                "(dt_parse_args does) before dt_comm_init or dt_comm_group_create");
    /* Rank 0's listening socket is made here, before the fork, and handed down
       (DT_RENDEZVOUS_FD). A port picked here and bound by rank 0 later would be
       free for any program to take in between: a connection's own port comes
       from the same range. */
    char port[16], cores[24], job[96], listener[16], secret[2 * DT__SECRET_BYTES + 1];
    int lfd = dt__tcp_listen_on(0, 1);
    if (lfd < 0) dt_fail("--nproc %d: cannot listen for the ranks' rendezvous: %s", nproc, strerror(errno));
    snprintf(port, sizeof port, "%d", dt__tcp_port_of(lfd));
    snprintf(listener, sizeof listener, "%d", lfd);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(cores, sizeof cores, "%ld", ncpu / nproc > 1 ? ncpu / nproc : 1);   /* the cores shared out */
    snprintf(job, sizeof job, "nproc-%ld-%.0f", (long)getpid(), dt_now_ms());  /* which job, in messages */
    dt__new_secret(secret);                          /* and the ranks' proof that they belong to it */
    pid_t pids[DT_MAX_RANKS], launcher = getpid();
    sigset_t stops, before;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT); sigaddset(&stops, SIGTERM); sigaddset(&stops, SIGUSR1);
    sigprocmask(SIG_BLOCK, &stops, &before);         /* held until each side has its own handlers */
    dt__set_stop_handler(dt__on_launcher_signal, 0);
    signal(SIGCHLD, SIG_DFL);                        /* an inherited SIG_IGN would hide the ranks' exits */
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < nproc; r++) {
        pids[r] = fork();
        if (pids[r] < 0) dt_fail("cannot start rank %d: %s", r, strerror(errno));
        if (pids[r] > 0) setpgid(pids[r], pids[r]);  /* from both sides: whichever runs first */
        if (pids[r] == 0) {
            char v[16];
            setpgid(0, 0);
#ifdef __linux__
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            if (getppid() != launcher) dt_fail("rank %d: the launcher exited before this rank started", r);
#endif
            signal(SIGINT, SIG_DFL); signal(SIGTERM, SIG_DFL); signal(SIGUSR1, SIG_DFL);
            sigprocmask(SIG_SETMASK, &before, NULL);
            unsetenv("DT_MASTER_PORT");              /* the launcher's port is the job's */
            if (r == 0) setenv("DT_RENDEZVOUS_FD", listener, 1);
            else { close(lfd); unsetenv("DT_RENDEZVOUS_FD"); }
            snprintf(v, sizeof v, "%d", r);
            setenv("RANK", v, 1); setenv("LOCAL_RANK", v, 1); setenv("DT_LAUNCHED_RANK", v, 1);
            snprintf(v, sizeof v, "%ld", (long)launcher);
            setenv("DT_LAUNCHER_PID", v, 1);
            snprintf(v, sizeof v, "%d", nproc);
            setenv("WORLD_SIZE", v, 1); setenv("LOCAL_WORLD_SIZE", v, 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", port, 1);
            setenv("DT_JOB_ID", job, 1);
            setenv("DT_JOB_SECRET", secret, 1);
            if (!getenv("OMP_NUM_THREADS")) {
                setenv("OMP_NUM_THREADS", cores, 1);
#ifdef _OPENMP
                omp_set_num_threads(atoi(cores));   /* the runtime read the variable at start-up, before the fork */
#endif
            }
            return;
        }
    }
    /* The parent: pass signals on and wait for every rank. After the first
       failure the others get the timeout to notice and stop on their own, then
       they are killed. Ranks stopped by a signal (75, 130) are not a failure:
       the others are saving. The job's status says the cause, whatever order
       the ranks are reaped in: the lowest rank killed by a signal (128 + it;
       not one this launcher killed, past the deadline, for hanging on), else
       the lowest rank that failed, else 75 or 130 for a stop, else 0 (a killed
       rank's job once ended 137 or 1 by which rank was reaped first). */
    close(lfd);              /* rank 0's alone now: when it exits, the port closes with it */
    sigprocmask(SIG_SETMASK, &before, NULL);
    int codes[DT_MAX_RANKS], killed[DT_MAX_RANKS] = { 0 }, ours[DT_MAX_RANKS] = { 0 }, left = nproc;   /* ours: we killed it */
    for (int r = 0; r < nproc; r++) codes[r] = 0;
    double deadline = 0;
    while (left > 0) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            left--;
            int r = 0;
            while (r < nproc && pids[r] != p) r++;
            if (r < nproc) pids[r] = 0;
            dt__shm_remove_of(p);
            int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
            int stopped = code == 75 || code == 130, failed = code != 0 && !stopped;
            if (failed && WIFSIGNALED(st)) fprintf(stderr, "dtrain: rank %d was killed by signal %d\n", r, WTERMSIG(st));
            if (failed && !deadline) deadline = dt_now_ms() + (timeout_s > 0 ? timeout_s : 60) * 1e3 + 10e3;
            if (r < nproc) { codes[r] = code; killed[r] = failed && WIFSIGNALED(st) && !ours[r]; }
        } else if (p == 0 || errno == EINTR) {
            int sig = dt__launcher_signal;
            if (sig) {
                dt__launcher_signal = 0;
                for (int r = 0; r < nproc; r++) if (pids[r] > 0) kill(pids[r], sig);
            }
            if (deadline > 0 && dt_now_ms() > deadline) {
                fprintf(stderr, "dtrain: ranks still running %.0f s after a rank failed; killing them\n",
                        (timeout_s > 0 ? timeout_s : 60) + 10);
                for (int r = 0; r < nproc; r++) if (pids[r] > 0) { kill(pids[r], SIGKILL); ours[r] = 1; }
                deadline = dt_now_ms() + 1e9;
            }
            struct timespec ts = { 0, 20000000 };
            nanosleep(&ts, NULL);
        } else break;
    }
    int status = 0;
    for (int r = 0; r < nproc && !status; r++) if (killed[r]) status = codes[r];
    for (int r = 0; r < nproc && !status; r++) if (codes[r] != 0 && codes[r] != 75 && codes[r] != 130) status = codes[r];
    for (int r = 0; r < nproc && !status; r++) if (codes[r] == 75) status = 75;
    for (int r = 0; r < nproc && !status; r++) if (codes[r] == 130) status = 130;
    exit(status);
}

/* -- which job a rank belongs to --
   The launcher's own id: torchrun's run id and attempt, SLURM's job and step,
   Open MPI's job, or the one --nproc makes. Ranks started by hand with none of
   these have none, and meet only each other. */
static void dt__job_id(char *out, size_t n) {
    static const char *vars[] = { "DT_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID",
                                  "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE" };
    out[0] = 0;
    for (size_t k = 0; k < sizeof vars / sizeof vars[0]; k++) {
        const char *v = getenv(vars[k]);
        size_t used = strlen(out);
        if (v && *v) snprintf(out + used, n - used, "%s%s=%s", used ? " " : "", vars[k], v);
    }
}

/* Where rank 0 listens. Under torchrun's default (static) rendezvous, and
   under any launcher that says TORCHELASTIC_USE_AGENT_STORE=True, torchrun's
   own key-value store already holds MASTER_PORT; dtrain does not speak that
   store's protocol (it changes between PyTorch versions) and takes the next
   port. DT_MASTER_PORT overrides both. */
static int dt__rendezvous_port(char *why, size_t n) {
    const char *own = getenv("DT_MASTER_PORT"), *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    int port = dt__env_int(own ? "DT_MASTER_PORT" : "MASTER_PORT", 29500);
    if (port < 1 || port > 65535) dt_fail("%s=%d is not a TCP port (1-65535)", own ? "DT_MASTER_PORT" : "MASTER_PORT", port);
    snprintf(why, n, own ? "DT_MASTER_PORT" : "MASTER_PORT");
    if (!own && agent && (!strcmp(agent, "True") || !strcmp(agent, "true") || !strcmp(agent, "1")) && port < 65535) {
        snprintf(why, n, "MASTER_PORT + 1: torchrun's store holds MASTER_PORT");
        port++;
    }
    return port;
}

/* The socket --nproc's launcher made for rank 0, listening on the job's port
   already (dt_launch says why), or -1. Kept open for a second rendezvous in
   the same process; checked, since the variable could outlive its socket. */
static int dt__launcher_listener(int port) {
    static int fd = -2;
    if (fd == -2) {
        const char *v = getenv("DT_RENDEZVOUS_FD");
        int type = 0;
        socklen_t len = sizeof type;
        fd = v && *v ? atoi(v) : -1;
        if (fd >= 0 && (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)) fd = -1;
        unsetenv("DT_RENDEZVOUS_FD");
    }
    /* listen() again is harmless on a listening socket, and says whether it is one (SO_ACCEPTCONN would, but
       not on every system) */
    return fd >= 0 && dt__tcp_port_of(fd) == port && listen(fd, DT_MAX_RANKS) == 0 ? fd : -1;
}

/* -- the TCP rendezvous: small fixed-size messages, every wait bounded --
   Rank 0 greets each connection with a challenge (a fresh random nonce, and
   whether the job has a secret); a rank answers with a hello: a magic
   string, the job's id, its rank and a proof that it knows the job's secret
   (a keyed hash of rank 0's nonce and of its hello), and a nonce of its own,
   against which rank 0's welcome proves itself in turn. So a port scan, a
   rank of another job on the same port, a leftover rank of an earlier
   attempt or a stranger who learnt the job's id is turned away -- and logged
   -- instead of joining this job or killing it; and a rank maps only shared
   memory that this job's rank 0 named. Rank 0 serves every connection at
   once, each with 5 s to say hello, so idle connections cannot starve it; and
   keeps listening until the process ends, so a second job started by hand on
   the same port is refused at once rather than meeting this one's ranks. */
#define DT_RDZV_MAGIC "dtrain-4"
#define DT_HOST_NAME 256                 /* Linux's host names are at most 64 bytes; others' longer */
/* Where a rank runs, as far as meeting goes. Ranks meet in shared memory
   (the collectives chapter's segment: the CPU collectives, and on GPUs the watchdog's view
   of every rank), so two ranks are together when they see one /dev/shm of
   one running kernel: its boot id, and the folder's device and inode. A host
   name says neither -- containers on one machine may differ in name yet
   share /dev/shm, and cloned machines may share a name -- so it only names
   the host in messages. */
typedef struct dt__host { char name[DT_HOST_NAME]; char memory[96]; } dt__host;
typedef struct dt__challenge { char magic[8]; unsigned char nonce[16]; int32_t secret, unused; } dt__challenge;
typedef struct dt__hello {
    char magic[8]; char job[192]; int32_t rank, world, pid, unused; dt__host where; unsigned char nonce[16]; uint64_t proof;
} dt__hello;
typedef struct dt__welcome {
    char magic[8]; char refused[1024]; char shm_name[64]; unsigned char nccl_id[128]; uint64_t proof;
} dt__welcome;
static uint64_t dt__hello_proof(const uint64_t key[2], const unsigned char nonce[16], dt__hello h) {
    h.proof = 0;
    return dt__proof(key, "hello", nonce, &h, offsetof(dt__hello, proof));
}
static uint64_t dt__welcome_proof(const uint64_t key[2], const unsigned char nonce[16], const dt__welcome *w) {
    return dt__proof(key, "welcome", nonce, w, offsetof(dt__welcome, proof));
}

/* 1 when all n bytes moved before the deadline; 0 when the peer went away or was silent. */
static int dt__io_try(int fd, void *buf, size_t n, int writing, double deadline, const char *what) {
    char *p = (char *)buf;
    while (n > 0) {
        struct pollfd pfd = { fd, (short)(writing ? POLLOUT : POLLIN), 0 };
        int wait = (int)(deadline - dt_now_ms());
        if (wait <= 0) return 0;
        dt__check_stop(what);
        if (poll(&pfd, 1, wait < 200 ? wait : 200) <= 0) continue;     /* a slice, then look at the signals */
        ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0) return 0;
        p += k;
        n -= (size_t)k;
    }
    return 1;
}
static void dt__io_all(int fd, void *buf, size_t n, int writing, double deadline, const char *what) {
    if (!dt__io_try(fd, buf, n, writing, deadline, what))
        dt_fail("rendezvous: %s %s", dt_now_ms() >= deadline ? "timed out" : "connection lost", what);
}

/* A rank other than 0: connect to rank 0, trying again until the deadline
   (rank 0 may still be starting). */
static int dt__tcp_connect(const char *host, int port, const char *port_from, double deadline) {
    char ports[16];
    struct addrinfo hints, *res = NULL;
    snprintf(ports, sizeof ports, "%d", port);
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int err = getaddrinfo(host, ports, &hints, &res);
    if (err) dt_fail("rendezvous: cannot resolve MASTER_ADDR '%s': %s", host, gai_strerror(err));
    int fd = -1;
    for (;;) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) dt_fail("rendezvous: socket: %s", strerror(errno));
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  /* our port never stops another job's rank 0 */
        if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) break;
        close(fd);
        if (dt_now_ms() > deadline)
            dt_fail("rendezvous: rank 0 did not answer at %s:%d (%s) within the timeout (is it running? is MASTER_ADDR "
                    "right?)", host, port, port_from);
        dt__check_stop("while waiting for rank 0");
        struct timespec ts = { 0, 50000000 };
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(res);
    return fd;
}

static void dt__host_of_this_rank(dt__host *h) {
    memset(h, 0, sizeof *h);
    if (gethostname(h->name, sizeof h->name - 1) != 0) dt__copy_str(h->name, sizeof h->name, "(unnamed)");
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f || !fgets(boot, sizeof boot, f)) dt__copy_str(boot, sizeof boot, "no-boot-id");  /* no /proc: /dev/shm must do */
    if (f) fclose(f);
    boot[strcspn(boot, "\r\n")] = 0;
    struct stat st;
    memset(&st, 0, sizeof st);
    stat("/dev/shm", &st);
    snprintf(h->memory, sizeof h->memory, "%.48s/%llu/%llu", boot, (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

/* Appends to a message of at most `room` characters; once full, it stays full. */
static void dt__append(char *buf, int *len, int room, const char *fmt, ...) {
    if (*len >= room) return;
    va_list ap;
    va_start(ap, fmt);
    *len += vsnprintf(buf + *len, (size_t)(room - *len + 1), fmt, ap);
    va_end(ap);
}

/* Rank 0, once all have joined: 1 when every rank shares its memory, else 0
   with why saying so, what to do, and which ranks are where -- ending in
   " ..." when that does not fit in n. */
static int dt__rendezvous_one_host(const dt__host *hosts, int world, int on_gpus, char *why, size_t n) {
    int same = 1;
    for (int r = 1; r < world; r++) same &= !strcmp(hosts[r].memory, hosts[0].memory);
    if (same) return 1;
    int room = (int)n - 5, len = 0;
    dt__append(why, &len, room, "the ranks are not all on rank 0's host, and they meet in one host's shared memory -- run "
               "every rank there%s; hosts:", on_gpus ? " (GPU ranks on several machines are not supported yet)"
#ifdef DT_HAVE_MPI
               : ", or join the hosts over MPI: --comm mpi (or auto) under mpirun or srun --mpi=pmix"
#else
               : ", or join the hosts over MPI: --comm mpi (or auto) under mpirun or srun --mpi=pmix, in a build with MPI "
                 "(this one has none: install libopenmpi-dev and build again)"
#endif
    );
    size_t boot0 = strcspn(hosts[0].memory, "/");
    for (int r = 0; r < world; r++) {
        int seen = 0, named = 0;
        for (int q = 0; q < r; q++) {
            seen |= !strcmp(hosts[q].memory, hosts[r].memory);
            named |= !strcmp(hosts[q].name, hosts[r].name);
        }
        if (seen) continue;
        int here = 0, machine0 = r > 0 && !strncmp(hosts[r].memory, hosts[0].memory, boot0 + 1);   /* rank 0's kernel */
        for (int q = r; q < world; q++) here += !strcmp(hosts[q].memory, hosts[r].memory);
        dt__append(why, &len, room, "%s '%s'%s (rank%s", r ? ";" : "", hosts[r].name,
                   machine0 ? ", rank 0's machine but another /dev/shm (a container? give it the host's: docker --ipc=host)"
                   : named ? ", another machine of that name" : "", here > 1 ? "s" : "");
        for (int q = r, k = 0; q < world; q++)
            if (!strcmp(hosts[q].memory, hosts[r].memory)) dt__append(why, &len, room, "%s %d", k++ ? "," : "", q);
        dt__append(why, &len, room, ")");
    }
    if (len >= room) snprintf(why + room, 5, " ...");
    return 0;
}

/* A rank: rank 0's welcome, every field of it checked before it is used
   (what came over the network is bounded: the refusal and the name end
   within their fields). key: the job's, when it has a secret. */
static void dt__welcome_check(dt__welcome *w, const uint64_t *key, const unsigned char nonce[16], const char *host, int port,
                              const char *port_from) {
    if (memcmp(w->magic, DT_RDZV_MAGIC, 8))
        dt_fail("rendezvous: %s:%d (%s) answered, but not as a dtrain rank 0 (another program holds that port?)", host, port,
                port_from);
    w->refused[sizeof w->refused - 1] = 0;
    if (w->refused[0]) dt_fail("rendezvous: rank 0 at %s:%d turned this rank away: %s", host, port, w->refused);
    if (key && w->proof != dt__welcome_proof(key, nonce, w))
        dt_fail("rendezvous: the rank 0 at %s:%d (%s) does not prove that it knows this job's secret (DT_JOB_SECRET): not "
                "this job's rank 0", host, port, port_from);
    if (!memchr(w->shm_name, 0, sizeof w->shm_name))
        dt_fail("rendezvous: %s:%d (%s) sent a shared-memory name without an end: not a dtrain rank 0", host, port, port_from);
    dt__shm_name_check(w->shm_name);
}

/* Rank 0: the connections that have not said hello yet, each with its own
   deadline and the nonce it was challenged with. */
typedef struct dt__pending {
    int fd;
    size_t got;                              /* bytes of the hello so far */
    double until;
    char who[64];
    unsigned char nonce[16];
    dt__hello h;
} dt__pending;
#define DT__PENDING_MAX 64

/* Rank 0: a connection accepted. The challenge goes at once (a few bytes a
   new socket always takes); the hello may come in pieces. 0 when it could not
   be greeted (the caller closes it). */
static int dt__rendezvous_greet(dt__pending *p, int fd, const struct sockaddr_in *from, int secret, double deadline) {
    dt__challenge ch;
    memset(p, 0, sizeof *p);
    memset(&ch, 0, sizeof ch);
    p->fd = fd;
    snprintf(p->who, sizeof p->who, "%s:%d", inet_ntoa(from->sin_addr), ntohs(from->sin_port));
    p->until = dt_now_ms() + 5e3 < deadline ? dt_now_ms() + 5e3 : deadline;   /* a silent peer waits 5 s at most */
    if (!dt__random_bytes(p->nonce, sizeof p->nonce)) dt_fail("rendezvous: cannot read /dev/urandom: %s", strerror(errno));
    memcpy(ch.magic, DT_RDZV_MAGIC, 8);
    memcpy(ch.nonce, p->nonce, sizeof ch.nonce);
    ch.secret = secret;
    return send(fd, &ch, sizeof ch, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof ch;
}

/* Rank 0: a whole hello. Returns the rank it brings, or -1 when it was turned
   away, told why (the caller closes it either way). A refusal names what the
   stranger sent, never this job's id or secret. */
static int dt__rendezvous_admit(dt__pending *p, const char *job, const uint64_t *key, int world, const int *joined,
                               dt__host *hosts) {
    dt__hello *h = &p->h;
    dt__welcome no;
    char why[256] = "";
    memset(&no, 0, sizeof no);
    h->job[sizeof h->job - 1] = 0;
    if (strcmp(h->job, job))
        snprintf(why, sizeof why, "it belongs to another job ('%.80s')", h->job[0] ? h->job : "no job id");
    else if (key && h->proof != dt__hello_proof(key, p->nonce, *h))
        snprintf(why, sizeof why, "it does not prove that it knows this job's secret (DT_JOB_SECRET)");
    else if (h->world != world) snprintf(why, sizeof why, "it says the job has %d ranks; this job has %d", h->world, world);
    else if (h->rank <= 0 || h->rank >= world) snprintf(why, sizeof why, "rank %d is not one of 1..%d", h->rank, world - 1);
    else if (joined[h->rank]) snprintf(why, sizeof why, "rank %d has joined already", h->rank);
    if (!why[0]) {
        h->where.name[sizeof h->where.name - 1] = h->where.memory[sizeof h->where.memory - 1] = 0;
        hosts[h->rank] = h->where;
        return h->rank;
    }
    dt_warn("rendezvous: turned away rank %d (pid %d) from %s: %s", h->rank, h->pid, p->who, why);
    memcpy(no.magic, DT_RDZV_MAGIC, 8);
    dt__copy_str(no.refused, sizeof no.refused, why);
    ssize_t sent = send(p->fd, &no, sizeof no, MSG_DONTWAIT | MSG_NOSIGNAL);     /* the socket takes it, or the stranger goes untold */
    (void)sent;
    return -1;
}

/* Who listens on TCP port `port` of this machine, for a message: "process 1234
   (train)", or why that cannot be said. */
static void dt__port_holder(int port, char *out, size_t n) {
    unsigned long inode = 0;
    static const char *const tables[2] = { "/proc/net/tcp", "/proc/net/tcp6" };
    for (int t = 0; t < 2 && !inode; t++) {
        FILE *f = fopen(tables[t], "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            unsigned lport = 0, state = 0;
            unsigned long ino = 0;
            if (sscanf(line, " %*d: %*[0-9A-Fa-f]:%X %*[0-9A-Fa-f]:%*X %X %*s %*s %*s %*d %*d %lu", &lport, &state, &ino) == 3 &&
                (int)lport == port && state == 0x0A && ino) { inode = ino; break; }
        }
        if (f) fclose(f);
    }
    snprintf(out, n, "a process this user cannot see (another user's, or outside this container)");
    if (!inode) return;
    char want[64];
    snprintf(want, sizeof want, "socket:[%lu]", inode);
    DIR *procs = opendir("/proc");
    struct dirent *e;
    while (procs && (e = readdir(procs))) {
        if (!isdigit((unsigned char)e->d_name[0])) continue;
        char dir[300];
        snprintf(dir, sizeof dir, "/proc/%s/fd", e->d_name);
        DIR *fds = opendir(dir);
        struct dirent *f;
        int found = 0;
        while (fds && !found && (f = readdir(fds))) {
            char link[600], target[128];
            snprintf(link, sizeof link, "%s/%s", dir, f->d_name);
            ssize_t k = readlink(link, target, sizeof target - 1);
            if (k > 0) { target[k] = 0; found = !strcmp(target, want); }
        }
        if (fds) closedir(fds);
        if (found) {
            char comm[64] = "", path[300];
            snprintf(path, sizeof path, "/proc/%s/comm", e->d_name);
            FILE *c = fopen(path, "r");
            if (c && fgets(comm, sizeof comm, c)) comm[strcspn(comm, "\n")] = 0;
            if (c) fclose(c);
            snprintf(out, n, "process %.24s (%.60s)", e->d_name, comm[0] ? comm : "?");
            break;
        }
    }
    if (procs) closedir(procs);
}

/* Rank 0's listening socket on `port`: --nproc's launcher's, or one of its own,
   kept for the life of the process (a second communicator of this process
   takes it again). The port taken is an error naming who holds it. */
static int dt__rank0_listener(int port, const char *port_from) {
    static int fd = -1, fd_port = -1;
    int inherited = dt__launcher_listener(port);
    if (inherited >= 0) return inherited;
    if (fd >= 0 && fd_port == port) return fd;
    if (fd >= 0) close(fd);
    fd = dt__tcp_listen(port);
    fd_port = port;
    if (fd < 0) {
        int e = errno;
        char holder[160] = "";
        if (e == EADDRINUSE) dt__port_holder(port, holder, sizeof holder);
        dt_fail("rendezvous: rank 0 cannot listen on port %d (%s): %s%s%s -- another job or program holds it; give this "
                "job a port of its own (MASTER_PORT, or DT_MASTER_PORT under torchrun)", port, port_from, strerror(e),
                holder[0] ? ": it is held by " : "", holder);
    }
    return fd;
}

/* --comm auto on the host: shared memory, unless an MPI launcher (mpirun, or
   srun --mpi=pmix) started ranks on several hosts -- which the launcher's
   variables may say (all ranks local, one node), and else one MPI_Allgather of
   each rank's host tells. */
static dt_comm_kind dt__comm_auto(int world) {
#ifdef DT_HAVE_MPI
    int mpi_launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK") || getenv("PMI_SIZE");
    const char *nodes = getenv("SLURM_STEP_NUM_NODES") ? getenv("SLURM_STEP_NUM_NODES") : getenv("SLURM_NNODES");
    int one_node = dt_local_ranks_from_env() == world || (nodes && atoi(nodes) == 1);
    if (world > 1 && mpi_launched && !one_node) {
        dt__mpi_init();
        int mpi_world = 1;
        MPI_Comm_size(MPI_COMM_WORLD, &mpi_world);
        if (mpi_world == world) {
            dt__host me, *all = (dt__host *)calloc((size_t)world, sizeof *all);
            char why[1024];
            if (!all) dt_fail("out of memory (--comm auto)");
            dt__host_of_this_rank(&me);
            dt__mpi_check(MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE, MPI_COMM_WORLD),
                          "--comm auto's look at the hosts");
            int one = dt__rendezvous_one_host(all, world, 0, why, sizeof why);
            free(all);
            if (!one) return DT_COMM_MPI;
        }
        dt__mpi_finalize_if_ours();         /* one host: shared memory, and no MPI left running */
    }
#endif
    (void)world;
    return DT_COMM_SHM;
}

#ifdef DT_HAVE_MPI
/* --comm mpi: the ranks are MPI's. No TCP rendezvous and no shared memory:
   a duplicate of MPI_COMM_WORLD, and a header of our own for the watchdog. */
static dt_comm *dt__comm_init_mpi(int rank, int world, double timeout_s) {
    dt__mpi_init();
    int mpi_rank = 0, mpi_world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_world);
    if (mpi_world != world || mpi_rank != rank)
        dt_fail("--comm mpi: MPI has this process as rank %d of %d, but the environment says rank %d of %d: start the ranks "
                "with mpirun or srun --mpi=pmix (not --nproc or torchrun)", mpi_rank, mpi_world, rank, world);
    dt_comm *c = dt__comm_new(rank, world, timeout_s);
    c->backend = &dt__comm_mpi_backend;
    dt__mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);
    dt__comm_start(c, dt__private_header(c));
    dt_barrier(c);
    dt__ctx.job = c;
    return c;
}
#endif

dt_comm *dt_comm_init(dt_comm_kind kind, double timeout_s) {
    int rank, world, local;
    dt_rank_from_env(&rank, &world, &local);
    dt__ctx.rank = rank;
    dt__ctx.world_size = world;
    if (kind == DT_COMM_AUTO) kind = dt__comm_auto(world);
#ifdef DT_HAVE_MPI
    if (kind == DT_COMM_MPI) return dt__comm_init_mpi(rank, world, timeout_s);
#else
    if (kind == DT_COMM_MPI)
        dt_fail("--comm mpi: " DT__NO_MPI);
#endif
    dt_comm *c = dt__comm_new(rank, world, timeout_s);
    int catching = dt__stop_catching;         /* a run catches them for good; a tool only while the ranks meet */
    if (!catching) dt__set_stop_handler(dt__on_stop_signal, 1);
    const char *host = getenv("MASTER_ADDR") ? getenv("MASTER_ADDR") : "127.0.0.1";
    char port_from[96], job[192];
    int port = world > 1 ? dt__rendezvous_port(port_from, sizeof port_from) : 0;
    dt__job_id(job, sizeof job);
    double deadline = dt_now_ms() + c->timeout_s * 1e3;
    dt__welcome w;
    memset(&w, 0, sizeof w);
    memcpy(w.magic, DT_RDZV_MAGIC, 8);
    dt__path(w.shm_name, sizeof w.shm_name, "/dtrain-%d-%d-%d", (int)getuid(), (int)getpid(),
            __atomic_fetch_add(&dt__shm_serial, 1, __ATOMIC_RELAXED));
    char why[256];
    if (kind == DT_COMM_NCCL && !dt_nccl_available(why, sizeof why)) dt_fail("a job on GPUs needs NCCL: %s", why);
#ifdef DT_HAVE_CUDA
    if (kind == DT_COMM_NCCL && rank == 0 && !dt_nccl_unique_id(w.nccl_id, sizeof w.nccl_id))
        dt_fail("NCCL could not make its unique id");
#endif
    int fds[DT_MAX_RANKS], cleanup = -1;
    size_t bytes = dt__shm_bytes(world);
    dt__shm_header *hdr = NULL;
    uint64_t key[2];
    int secret = dt__job_key(key);
    unsigned char nonces[DT_MAX_RANKS][16];   /* rank 0: each rank's, for the welcome's proof */
    if (world > 1 && rank == 0) {
        int lfd = dt__rank0_listener(port, port_from), joined[DT_MAX_RANKS] = { 0 }, njoined = 0, away = 0, npend = 0;
        static dt__pending pend[DT__PENDING_MAX];
        dt__host hosts[DT_MAX_RANKS];
        dt__host_of_this_rank(&hosts[0]);
        while (njoined < world - 1) {
            int wait = (int)(deadline - dt_now_ms());
            if (wait <= 0) {
                char missing[256] = "";
                for (int r = 1; r < world; r++)
                    if (!joined[r]) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %d", r);
                for (int k = 0; k < npend; k++) close(pend[k].fd);
                dt_fail("rendezvous: rank(s)%s did not join within %.0f s (--timeout)%s", missing, c->timeout_s,
                        away ? "; connections that were not of this job were turned away (see above)" : "");
            }
            dt__check_stop("while waiting for the ranks to join");
            struct pollfd pfd[1 + DT__PENDING_MAX];
            pfd[0].fd = lfd; pfd[0].events = POLLIN; pfd[0].revents = 0;
            for (int k = 0; k < npend; k++) { pfd[1 + k].fd = pend[k].fd; pfd[1 + k].events = POLLIN; pfd[1 + k].revents = 0; }
            if (poll(pfd, (nfds_t)(1 + npend), wait < 200 ? wait : 200) < 0) continue;
            double now = dt_now_ms();
            for (int k = npend - 1; k >= 0; k--) {           /* what each connection sent; a removed one's place takes the last */
                dt__pending *p = &pend[k];
                int bad = 0, whole = 0;
                if (pfd[1 + k].revents) {
                    ssize_t got = recv(p->fd, (char *)&p->h + p->got, sizeof p->h - p->got, MSG_DONTWAIT);
                    if (got > 0) p->got += (size_t)got;
                    else if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) bad = 1;
                }
                if (p->got >= 8 && memcmp(p->h.magic, DT_RDZV_MAGIC, 8)) bad = 1;
                whole = !bad && p->got == sizeof p->h;
                if (!bad && !whole && now > p->until) bad = 1;
                if (!bad && !whole) continue;
                int r = bad ? -1 : dt__rendezvous_admit(p, job, secret ? key : NULL, world, joined, hosts);
                if (bad) dt_warn("rendezvous: turned away a connection from %s: it did not say hello as a dtrain rank", p->who);
                if (r < 0) { close(p->fd); away++; }
                else {
                    joined[r] = 1;
                    fds[r] = p->fd;
                    memcpy(nonces[r], p->h.nonce, 16);
                    njoined++;
                }
                pend[k] = pend[--npend];
            }
            if (pfd[0].revents & POLLIN) {
                struct sockaddr_in from;
                socklen_t from_len = sizeof from;
                int fd = accept(lfd, (struct sockaddr *)&from, &from_len);
                if (fd >= 0) fcntl(fd, F_SETFD, FD_CLOEXEC);
                if (fd >= 0 && npend == DT__PENDING_MAX) {   /* full: the longest waiting goes, not the newcomer */
                    int old = 0;
                    for (int k = 1; k < npend; k++) if (pend[k].until < pend[old].until) old = k;
                    dt_warn("rendezvous: turned away a connection from %s: %d connections were waiting to say hello, and it "
                            "had waited longest", pend[old].who, DT__PENDING_MAX);
                    close(pend[old].fd);
                    pend[old] = pend[--npend];
                    away++;
                }
                if (fd >= 0 && !dt__rendezvous_greet(&pend[npend], fd, &from, secret, deadline)) {
                    close(fd);
                    away++;
                } else if (fd >= 0) npend++;
            }
        }
        for (int k = 0; k < npend; k++) close(pend[k].fd);   /* latecomers: the job is whole */
        char apart[sizeof w.refused];
        if (!dt__rendezvous_one_host(hosts, world, kind == DT_COMM_NCCL, apart, sizeof apart)) {
            dt__copy_str(w.refused, sizeof w.refused, apart);
            for (int r = 1; r < world; r++) dt__io_try(fds[r], &w, sizeof w, 1, deadline, "telling the ranks why not");
            dt_fail("rendezvous: %s", apart);
        }
    }
    if (rank == 0) {       /* made once every rank is here: a failed rendezvous leaves nothing in /dev/shm */
        hdr = dt__shm_map(w.shm_name, bytes, 1, &cleanup);
        for (int r = 1; r < world; r++) {
            w.proof = secret ? dt__welcome_proof(key, nonces[r], &w) : 0;
            dt__io_all(fds[r], &w, sizeof w, 1, deadline, "sending the welcome");
        }
    } else if (world > 1) {
        int fd;
        dt__challenge ch;
        for (;;) {          /* closed before its challenge (rank 0 had more connections waiting than it keeps): again */
            fd = dt__tcp_connect(host, port, port_from, deadline);
            if (dt__io_try(fd, &ch, sizeof ch, 0, deadline, "while waiting for rank 0 to answer")) break;
            close(fd);
            if (dt_now_ms() >= deadline)
                dt_fail("rendezvous: %s:%d (%s) took this rank's connection but said nothing within the timeout (is it a "
                        "dtrain rank 0 of this version? another job's, whose ranks have all joined?)", host, port, port_from);
            struct timespec ts = { 0, 50000000 };
            nanosleep(&ts, NULL);
        }
        if (memcmp(ch.magic, DT_RDZV_MAGIC, 8))
            dt_fail("rendezvous: %s:%d (%s) answered, but not as a dtrain rank 0 of this version (another program holds "
                    "that port?)", host, port, port_from);
        if (secret && !ch.secret)
            dt_fail("rendezvous: rank 0 at %s:%d has no job secret, and this rank has one (DT_JOB_SECRET): is it this job's "
                    "rank 0? (give every rank the same DT_JOB_SECRET, or none)", host, port);
        if (!secret && ch.secret)
            dt_fail("rendezvous: rank 0 at %s:%d has a job secret (DT_JOB_SECRET), and this rank has none: give every rank "
                    "the same one", host, port);
        dt__hello h;
        memset(&h, 0, sizeof h);
        memcpy(h.magic, DT_RDZV_MAGIC, 8);
        dt__copy_str(h.job, sizeof h.job, job);
        h.rank = rank; h.world = world; h.pid = (int32_t)getpid();
        dt__host_of_this_rank(&h.where);
        if (!dt__random_bytes(h.nonce, sizeof h.nonce)) dt_fail("rendezvous: cannot read /dev/urandom: %s", strerror(errno));
        if (secret) h.proof = dt__hello_proof(key, ch.nonce, h);
        dt__io_all(fd, &h, sizeof h, 1, deadline, "saying hello to rank 0");
        if (!dt__io_try(fd, &w, sizeof w, 0, deadline, "while waiting for rank 0's welcome"))
            dt_fail("rendezvous: no welcome from %s:%d (%s) %s (did rank 0 fail? is it a dtrain rank 0 of this job?)", host,
                    port, port_from, dt_now_ms() >= deadline ? "within the timeout" : "before it closed the connection");
        dt__welcome_check(&w, secret ? key : NULL, h.nonce, host, port, port_from);
        hdr = dt__shm_map(w.shm_name, bytes, 0, NULL);
        /* Until every rank has mapped it and rank 0 has removed its name, the segment is this rank's to remove too,
           should the job fail: rank 0 may have died (SIGKILL) after making it, and left it in /dev/shm. */
        char file[128];
        snprintf(file, sizeof file, "/dev/shm%s", w.shm_name);
        cleanup = dt__cleanup_add(file);
        fds[0] = fd;
    }
    c->map_bytes = bytes;
    if (rank == 0) { hdr->magic = DT_SHM_MAGIC; hdr->world = world; }
    __atomic_store_n(&hdr->pid[rank], (int)getpid(), __ATOMIC_RELEASE);
    /* Every rank has mapped the segment when it has answered: then its name can go. */
    char ack = 1;
    if (world > 1 && rank == 0) {
        for (int r = 1; r < world; r++) dt__io_all(fds[r], &ack, 1, 0, deadline, "waiting for the ranks to map");
    } else if (world > 1) {
        dt__io_all(fds[0], &ack, 1, 1, deadline, "telling rank 0 the memory is mapped");
        char gone;                   /* rank 0 closes the connection once it has removed the name: then it is not ours */
        dt__io_try(fds[0], &gone, 1, 0, deadline, "waiting for rank 0 to remove the segment's name");
        close(fds[0]);
        dt__cleanup_done(cleanup);
    }
    if (rank == 0) {
        shm_unlink(w.shm_name);
        dt__cleanup_done(cleanup);
        for (int r = 1; r < world; r++) close(fds[r]);      /* the name is gone: the others let go of it */
    }
    if (!catching) { signal(SIGINT, SIG_DFL); signal(SIGTERM, SIG_DFL); signal(SIGUSR1, SIG_DFL); }
#ifdef DT_HAVE_CUDA
    if (kind == DT_COMM_NCCL) {             /* joined here, then handed to the communication thread */
        c->hdr = hdr;                       /* the watchdog looks at the ranks through it */
        c->backend = &dt__comm_nccl_backend;
        c->nccl = dt_nccl_create(w.nccl_id, rank, world);
        dt__nccl_watch(c, -1, "NCCL's start-up");
    }
#endif
    (void)local;
    dt__comm_start(c, hdr);
    dt_barrier(c);                          /* everyone is in, and the header is set */
    dt__ctx.job = c;                         /* the run's logs, evaluation and checks use it */
    return c;
}

/* [src/20-checkpoints.h] */
/* ==== checkpoints ===========================================================
   Tensors go to disk as safetensors files: an 8-byte little-endian header
   length, a JSON header {"name": {"dtype", "shape", "data_offsets"},
   "__metadata__": {...}} and the raw tensors. A training checkpoint is a
   folder laid out as Hugging Face lays out a model, so that the tools people
   already use open it:
     model.safetensors      the weights under their PyTorch names, metadata
                            "format": "pt" and the run's position (epoch,
                            step, seed, data range);
     optimizer.safetensors  the optimizer's moments ("exp_avg.<name>", ...),
                            a file of their own: a strict load_state_dict of
                            the weights would refuse them;
     config.json            the model's shape (the models chapter writes it), so that
                            AutoModelForCausalLM.from_pretrained(folder) works.
   With LoRA the weights are the adapters, and the folder is the one PEFT
   saves: adapter_model.safetensors (PEFT's names, the same metadata) and
   adapter_config.json (rank, alpha, targets, the base model's folder), beside
   optimizer.safetensors; PeftModel.from_pretrained(base, folder) loads it.
   The folder is written as NAME.tmp, each file flushed to disk, and renamed to
   NAME only when complete: a crash or a full disk can lose the new
   checkpoint, never the previous one.
   A sharded model (FSDP) saves without gathering anything: each rank writes the
   shard it holds, and an index ties the shards together. Loading at the same
   world size reads one file per rank; at another, or into an unsharded model,
   the shards are put back together first -- and tools/consolidate does that
   once, into a whole checkpoint folder. */

static void dt__json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

void dt_safetensors_write(const char *path, const dt_named_tensor *tensors, int count, const char *const *meta_kv, int meta_count) {
    /* the header is built in memory first: its length comes before it */
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *h = open_memstream(&hdr, &hlen);
    if (!h) dt_fail("out of memory writing '%s'", path);
    fputc('{', h);
    if (meta_count > 0) {
        fputs("\"__metadata__\":{", h);
        for (int i = 0; i < meta_count; i++) {
            if (i) fputc(',', h);
            dt__json_string(h, meta_kv[2 * i]); fputc(':', h); dt__json_string(h, meta_kv[2 * i + 1]);
        }
        fputc('}', h);
    }
    uint64_t off = 0;
    for (int i = 0; i < count; i++) {
        int64_t numel = 1;
        if (meta_count > 0 || i) fputc(',', h);
        dt__json_string(h, tensors[i].name);
        fputs(":{\"dtype\":\"F32\",\"shape\":[", h);
        for (int d = 0; d < tensors[i].ndim; d++) { fprintf(h, d ? ",%lld" : "%lld", (long long)tensors[i].shape[d]); numel *= tensors[i].shape[d]; }
        fprintf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + 4 * numel));
        off += 4 * (uint64_t)numel;
    }
    fputc('}', h);
    while ((ftell(h) % 8) != 0) fputc(' ', h);       /* the data starts 8-byte aligned */
    int hdr_failed = ferror(h);                        /* a memory stream fails only when memory runs out */
    if (fclose(h) != 0 || hdr_failed || !hdr) dt_fail("out of memory writing '%s'", path);

    char tmp[4096];
    dt__path(tmp, sizeof tmp, "%s.tmp", path);
    signal(SIGXFSZ, SIG_IGN);    /* over a file-size limit: an error to report, not a kill */
    int cleanup = dt__cleanup_add(tmp);       /* removed if the program is stopped while writing */
    FILE *f = fopen(tmp, "wb");
    if (!f) { free(hdr); dt_fail("cannot write checkpoint '%s': %s", tmp, strerror(errno)); }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(hdr, 1, hlen, f) == hlen;
#ifdef DT_TESTING
    /* Fault tests: DT_TEST_DIE_WRITING=PART kills the process once it has begun a file whose name holds PART. */
    if (getenv("DT_TEST_DIE_WRITING") && *getenv("DT_TEST_DIE_WRITING") && strstr(path, getenv("DT_TEST_DIE_WRITING"))) {
        fflush(f);
        raise(SIGKILL);
    }
#endif
    for (int i = 0; ok && i < count; i++) {
        int64_t numel = 1;
        for (int d = 0; d < tensors[i].ndim; d++) numel *= tensors[i].shape[d];
        ok = fwrite(tensors[i].data, sizeof(float), (size_t)numel, f) == (size_t)numel;   /* little-endian hosts */
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int saved_errno = errno;
    if (fclose(f) != 0 && ok) { ok = 0; saved_errno = errno; }   /* the last of the data may fail only here */
    free(hdr);
    if (!ok) {
        unlink(tmp);
        dt_fail("could not write checkpoint '%s': %s (nothing was replaced; the previous file, if any, is intact)",
                path, strerror(saved_errno ? saved_errno : EIO));
    }
    if (rename(tmp, path) != 0) {
        saved_errno = errno;
        unlink(tmp);
        dt_fail("could not rename '%s' to '%s': %s", tmp, path, strerror(saved_errno));
    }
    dt__cleanup_done(cleanup);
}

typedef struct dt__st_tensor { char *name; char dtype[8]; int ndim; int64_t shape[8]; uint64_t begin, end; } dt__st_tensor;
struct dt_safetensors {
    char path[1024];
    unsigned char *buf;
    size_t len, data_start;
    dt__st_tensor *t;
    int n, cap;
    char **meta;                 /* key, value, key, value, ... */
    int nmeta;
};

static int dt__safetensors_dtype_size(const char *d) {
    if (!strcmp(d, "F32")) return 4;
    if (!strcmp(d, "F16") || !strcmp(d, "BF16")) return 2;
    if (!strcmp(d, "F64")) return 8;
    return 0;
}

/* buf holds the file's first `have` bytes (all of it, or its header alone);
   `len` is the file's length, which every tensor's byte range must fit. */
static int dt__st_by_name(const void *a, const void *b) {
    return strcmp((*(dt__st_tensor *const *)a)->name, (*(dt__st_tensor *const *)b)->name);
}
static int dt__st_by_offset(const void *a, const void *b) {
    const dt__st_tensor *x = *(dt__st_tensor *const *)a, *y = *(dt__st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}
/* Parse a safetensors file held in buf (have bytes of it read, len its size;
   the data may be left unread). What is wrong is an error naming the file --
   or, given `why`, said there, and NULL (buf freed): --resume auto looks over
   a folder of checkpoints and passes a damaged one by. */
#define DT__ST_REFUSE(...)                                          \
    do {                                                            \
        if (!why) dt_fail(__VA_ARGS__);                             \
        snprintf(why, why_n, __VA_ARGS__);                          \
        if (st) dt_safetensors_close(st);                           \
        else free(buf);                                             \
        free(by);                                                   \
        return NULL;                                                \
    } while (0)
static dt_safetensors *dt__safetensors_parse(const char *path, unsigned char *buf, size_t have, size_t len, char *why,
                                             size_t why_n) {
    dt_safetensors *st = NULL;
    dt__st_tensor **by = NULL;
    if (have < 8) DT__ST_REFUSE("'%s' is truncated or not a safetensors file (%zu bytes)", path, len);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    if (hlen > have - 8)
        DT__ST_REFUSE("'%s' is truncated or not a safetensors file (its header claims %llu bytes, the file has %zu)",
                path, (unsigned long long)hlen, len);
    st = (dt_safetensors *)calloc(1, sizeof *st);
    if (!st) dt_fail("out of memory reading '%s'", path);
    dt__copy_str(st->path, sizeof st->path, path);
    st->buf = buf; st->len = len; st->data_start = 8 + hlen;
    dt__json j = { (const char *)buf + 8, 0, hlen, 1 };
    dt__json_eat(&j, '{');
    while (j.ok && dt__json_peek(&j) != '}') {
        char *key = dt__json_str(&j);
        dt__json_eat(&j, ':');
        if (!j.ok) { free(key); break; }
        if (!strcmp(key, "__metadata__")) {
            dt__json_eat(&j, '{');
            while (j.ok && dt__json_peek(&j) != '}') {
                char *k = dt__json_str(&j);
                dt__json_eat(&j, ':');
                char *v = dt__json_peek(&j) == '"' ? dt__json_str(&j) : NULL;
                if (!v) { free(k); j.ok = 0; break; }
                st->meta = (char **)realloc(st->meta, sizeof(char *) * 2 * (st->nmeta + 1));
                st->meta[2 * st->nmeta] = k; st->meta[2 * st->nmeta + 1] = v; st->nmeta++;
                if (dt__json_peek(&j) == ',') j.pos++;
            }
            dt__json_eat(&j, '}');
            free(key);
        } else {
            if (st->n == st->cap) {
                st->cap = st->cap ? 2 * st->cap : 64;
                st->t = (dt__st_tensor *)realloc(st->t, sizeof(dt__st_tensor) * st->cap);
            }
            dt__st_tensor *t = &st->t[st->n++];
            memset(t, 0, sizeof *t);
            t->name = key;
            int64_t offs[2] = { -1, -1 };
            int have_dtype = 0, have_offsets = 0;
            dt__json_eat(&j, '{');
            while (j.ok && dt__json_peek(&j) != '}') {
                char *f = dt__json_str(&j);
                dt__json_eat(&j, ':');
                if (f && !strcmp(f, "dtype")) {
                    char *d = dt__json_str(&j);
                    if (d) { snprintf(t->dtype, sizeof t->dtype, "%s", d); have_dtype = 1; }
                    free(d);
                } else if (f && !strcmp(f, "shape")) t->ndim = dt__json_int_array(&j, t->shape, 8);
                else if (f && !strcmp(f, "data_offsets")) have_offsets = dt__json_int_array(&j, offs, 2) == 2;
                else dt__json_skip(&j, 0);
                free(f);
                if (dt__json_peek(&j) == ',') j.pos++;
            }
            dt__json_eat(&j, '}');
            if (j.ok && (!have_dtype || !have_offsets || offs[0] < 0 || offs[1] < offs[0]))
                DT__ST_REFUSE("'%s': tensor '%s' has a malformed entry in the safetensors header", path, key);
            t->begin = (uint64_t)offs[0]; t->end = (uint64_t)offs[1];
        }
        if (dt__json_peek(&j) == ',') j.pos++;
    }
    dt__json_eat(&j, '}');
    if (!j.ok) DT__ST_REFUSE("'%s' is not a valid safetensors file (corrupt JSON header near byte %zu)", path, 8 + j.pos);
    for (int i = 0; i < st->n; i++) {
        dt__st_tensor *t = &st->t[i];
        uint64_t numel = 1, bytes = 0;
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel))
                DT__ST_REFUSE("'%s': tensor '%s' has a shape out of range (dimension %d is %lld)", path, t->name, d,
                        (long long)t->shape[d]);
        int es = dt__safetensors_dtype_size(t->dtype);
        if (es && (__builtin_mul_overflow(numel, (uint64_t)es, &bytes) || t->end - t->begin != bytes))
            DT__ST_REFUSE("'%s': tensor '%s' claims %llu bytes for %llu %s elements", path, t->name,
                    (unsigned long long)(t->end - t->begin), (unsigned long long)numel, t->dtype);
        if (t->end > len - st->data_start)
            DT__ST_REFUSE("'%s' is truncated: tensor '%s' needs %llu bytes of data, the file has %zu", path, t->name,
                    (unsigned long long)t->end, len - st->data_start);
    }
    /* Each name once, and the tensors' bytes one after another from the start of the data, none shared and none
       left between (as the safetensors format says, and its own library checks): a name twice or bytes that two
       tensors share are a corrupt or crafted file. */
    by = (dt__st_tensor **)malloc(sizeof *by * (size_t)(st->n + 1));
    if (!by) dt_fail("out of memory reading '%s'", path);
    for (int i = 0; i < st->n; i++) by[i] = &st->t[i];
    qsort(by, (size_t)st->n, sizeof *by, dt__st_by_name);
    for (int i = 1; i < st->n; i++)
        if (!strcmp(by[i - 1]->name, by[i]->name)) DT__ST_REFUSE("'%s' names tensor '%s' twice", path, by[i]->name);
    qsort(by, (size_t)st->n, sizeof *by, dt__st_by_offset);
    uint64_t at = 0;
    for (int i = 0; i < st->n; i++) {
        if (by[i]->begin < at)
            DT__ST_REFUSE("'%s': tensor '%s' (bytes %llu to %llu of the data) overlaps another tensor's bytes", path, by[i]->name,
                    (unsigned long long)by[i]->begin, (unsigned long long)by[i]->end);
        if (by[i]->begin > at)
            DT__ST_REFUSE("'%s': tensor '%s' begins at byte %llu of the data, leaving bytes %llu to %llu to no tensor", path,
                    by[i]->name, (unsigned long long)by[i]->begin, (unsigned long long)at, (unsigned long long)by[i]->begin);
        at = by[i]->end;
    }
    free(by);
    return st;
}
#undef DT__ST_REFUSE

dt_safetensors *dt_safetensors_read(const char *path) {
    size_t len = 0;
    unsigned char *buf = dt__read_file(path, &len);
    if (!buf) dt_fail("cannot read '%s': %s", path, dt__read_failure());
    return dt__safetensors_parse(path, buf, len, len, NULL, 0);
}

/* The header alone (metadata and the tensor list, no data): what a look over a
   folder of checkpoints needs, without reading gigabytes. The file's size is
   checked against what the header says, so a file cut short is found. Given
   `why`, a file that cannot be read is said there and NULL returned. */
static dt_safetensors *dt__safetensors_read_header_or_why(const char *path, char *why, size_t why_n) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);  /* a FIFO does not block the look (dt__read_file) */
    FILE *f = NULL;
    unsigned char len8[8];
    struct stat s;
    if (fd >= 0 && fstat(fd, &s) == 0 && !S_ISREG(s.st_mode)) {
        close(fd);
        if (!why) dt_fail("cannot read '%s': not a regular file", path);
        snprintf(why, why_n, "cannot read '%s': not a regular file", path);
        return NULL;
    }
    if (fd >= 0) { fcntl(fd, F_SETFL, 0); f = fdopen(fd, "rb"); }
    if (!f || fstat(fileno(f), &s) != 0) {
        int e = errno;
        if (!f && fd >= 0) close(fd);
        if (f) fclose(f);
        if (!why) dt_fail("cannot read '%s': %s", path, strerror(e));
        snprintf(why, why_n, "cannot read '%s': %s", path, strerror(e));
        return NULL;
    }
    size_t have = fread(len8, 1, 8, f);
    uint64_t hlen = 0;
    for (size_t i = 0; i < have; i++) hlen |= (uint64_t)len8[i] << (8 * i);
    if (have == 8 && hlen > (uint64_t)s.st_size - 8) hlen = 0;      /* the parser names the lie */
    unsigned char *buf = (unsigned char *)malloc(8 + (size_t)hlen + 1);
    if (!buf) dt_fail("out of memory reading '%s'", path);
    memcpy(buf, len8, have);
    if (have == 8) have += fread(buf + 8, 1, (size_t)hlen, f);
    fclose(f);
    return dt__safetensors_parse(path, buf, have, (size_t)s.st_size, why, why_n);
}
static dt_safetensors *dt__safetensors_read_header(const char *path) { return dt__safetensors_read_header_or_why(path, NULL, 0); }

void dt_safetensors_close(dt_safetensors *st) {
    if (!st) return;
    for (int i = 0; i < st->n; i++) free(st->t[i].name);
    for (int i = 0; i < 2 * st->nmeta; i++) free(st->meta[i]);
    free(st->t); free(st->meta); free(st->buf); free(st);
}

const char *dt_safetensors_meta(dt_safetensors *st, const char *key) {
    for (int i = 0; i < st->nmeta; i++) if (!strcmp(st->meta[2 * i], key)) return st->meta[2 * i + 1];
    return NULL;
}

static void dt__shape_str(char *out, size_t n, int ndim, const int64_t *shape) {
    size_t p = (size_t)snprintf(out, n, "[");
    for (int d = 0; d < ndim && p < n; d++) p += (size_t)snprintf(out + p, n - p, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (p < n) snprintf(out + p, n - p, "]");
}

/* more_rows: a file's tensor may have more rows than wanted, and the first
   ones are read (a GPT-2 position table longer than --seq-len). */
static int dt__safetensors_get_rows(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape, int more_rows) {
    for (int i = 0; i < st->n; i++) {
        dt__st_tensor *t = &st->t[i];
        if (strcmp(t->name, name)) continue;
        int same = t->ndim == ndim;
        int64_t want[8];
        for (int d = 0; d < ndim; d++) {
            want[d] = shape[d];
            if (same && t->shape[d] != shape[d] && !(d == 0 && more_rows && t->shape[0] > shape[0])) same = 0;
        }
        if (!same) {
            char a[128], b[128];
            dt__shape_str(a, sizeof a, t->ndim, t->shape);
            dt__shape_str(b, sizeof b, ndim, want);
            dt_fail("'%s': tensor '%s' has shape %s but the model expects %s (a checkpoint of another model?)",
                    st->path, name, a, b);
        }
        const unsigned char *src = st->buf + st->data_start + t->begin;
        uint64_t numel = (t->end - t->begin) / (uint64_t)(dt__safetensors_dtype_size(t->dtype) ? dt__safetensors_dtype_size(t->dtype) : 1);
        if (ndim > 0 && t->shape[0] > shape[0]) numel = numel / (uint64_t)t->shape[0] * (uint64_t)shape[0];   /* the first rows */
        if (!strcmp(t->dtype, "F32")) memcpy(dst, src, numel * 4);
        else if (!strcmp(t->dtype, "F64")) for (uint64_t k = 0; k < numel; k++) { double v; memcpy(&v, src + 8 * k, 8); dst[k] = (float)v; }
        else if (!strcmp(t->dtype, "F16")) for (uint64_t k = 0; k < numel; k++) dst[k] = dt_f16_to_f32((uint16_t)(src[2 * k] | src[2 * k + 1] << 8));
        else if (!strcmp(t->dtype, "BF16")) for (uint64_t k = 0; k < numel; k++) dst[k] = dt_bf16_to_f32((uint16_t)(src[2 * k] | src[2 * k + 1] << 8));
        else dt_fail("'%s': tensor '%s' has dtype %s; dtrain reads F32, F16, BF16 and F64", st->path, name, t->dtype);
        return 1;
    }
    return 0;
}
int dt_safetensors_get(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape) {
    return dt__safetensors_get_rows(st, name, dst, ndim, shape, 0);
}

/* The whole training state as host arrays in parameter order (m->offsets):
   the parameters (which 0) or the optimizer's moments (1, 2). A view of the
   flat buffers, or what the model's wrapper gives (dt_parallel's
   state_open): FSDP gathers every rank's shards for every rank; tensor and
   pipeline parallelism gather for the rank that writes (NULL elsewhere). To
   load (for_load 1) a model that a wrapper cut, every rank gets an array of
   the whole to fill, and cuts its part from it when it is closed. Gathers
   are collectives: every rank opens and closes alike. */
/* The state a checkpoint saves: 0 the parameters, 1 and 2 the optimizer's
   moments, each laid out as the model's flat buffer. */
static float *dt__state_buffer(dt_model *m, dt_optimizer *o, int which) {
    return which == 0 ? m->flat_data : which == 1 ? o->m : o->v;
}
static float *dt__state_open(dt_model *m, dt_optimizer *o, int which, int for_load) {
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    const dt_model *whole = dt_model_whole(m);
    if (for_load && whole != m) {
        float *host = (float *)calloc((size_t)whole->numel + 1, sizeof(float));
        if (!host) dt_fail("out of memory (reading a whole checkpoint to cut: %.1f MB)", whole->numel * 4e-6);
        return host;
    }
    if (rep && rep->state_open) return rep->state_open(who, o, which);
    /* a wrapper that cut the model: the whole from its pieces, written by the
       first of the data-parallel copies (which hold the same) */
    if (rep && rep->whole_from_local) return who->data_rank == 0 ? rep->whole_from_local(who, m, dt__state_buffer(m, o, which)) : NULL;
    return dt__host_view(m->device, dt__state_buffer(m, o, which), m->numel);
}
static void dt__state_close(dt_model *m, dt_optimizer *o, int which, float *host, int written) {
    if (!host) return;
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    if (rep && rep->state_close) rep->state_close(who, o, which, host, written);
    else if (rep && rep->local_from_whole) {
        if (written) rep->local_from_whole(who, m, host, dt__state_buffer(m, o, which));
        free(host);
    } else dt__host_view_close(m->device, host, dt__state_buffer(m, o, which), m->numel, written);
}
/* The parameters the state arrays above are laid out by: the model's own, or,
   cut by tensor parallelism, the whole model's (a checkpoint holds the whole,
   which any stage and any --tp reads). */
static dt_model *dt__state_layout(dt_model *m) { return (dt_model *)dt_model_whole(m); }

/* -- the names in a whole checkpoint --
   The weights under their own names in model.safetensors, the optimizer's
   moments in optimizer.safetensors under "<moment>.<name>": what PyTorch's
   state_dict and optimizer call them. state[0..2] are host arrays in
   parameter order: weights, first moment (AdamW's exp_avg, SGD's
   momentum_buffer), AdamW's exp_avg_sq (or NULL). */
static const char *dt__moment_name(int adamw, int k) {
    return k == 1 ? (adamw ? "exp_avg" : "momentum_buffer") : "exp_avg_sq";
}
/* The tensor name of parameter p in state k: "<name>", "exp_avg.<name>", ... */
static void dt__state_tensor_name(char *out, size_t n, int adamw, int k, const dt_tensor *p) {
    if (k == 0) dt__path(out, n, "%s", p->name);
    else dt__path(out, n, "%s.%s", dt__moment_name(adamw, k), p->name);
}
/* The parameters of state k as named tensors (names[] owned by the caller). */
static void dt__state_named(const dt_model *m, int adamw, int k, const float *state, dt_named_tensor *t, char **names) {
    for (int i = 0; i < m->nparams; i++) {
        const dt_tensor *p = &m->params[i];
        size_t len = strlen(p->name) + 32;
        if (!(names[i] = (char *)malloc(len))) dt_fail("out of memory (checkpoint names)");
        dt__state_tensor_name(names[i], len, adamw, k, p);
        t[i].name = names[i];
        t[i].data = state + m->offsets[i];
        t[i].ndim = p->ndim;
        for (int d = 0; d < p->ndim; d++) t[i].shape[d] = p->shape[d];
    }
}

/* Metadata as it is built: key, value, key, value, ... for dt_safetensors_write. */
typedef struct { char **kv; int n; } dt__meta_list;
static void dt__meta_add(dt__meta_list *l, const char *key, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void dt__meta_add(dt__meta_list *l, const char *key, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    l->kv = (char **)realloc(l->kv, sizeof(char *) * 2 * (size_t)(l->n + 1));
    char *v = (char *)malloc((size_t)len + 1);
    if (!l->kv || !v) dt_fail("out of memory (checkpoint metadata)");
    va_start(ap, fmt);
    vsnprintf(v, (size_t)len + 1, fmt, ap);
    va_end(ap);
    l->kv[2 * l->n] = strdup(key);
    l->kv[2 * l->n + 1] = v;
    l->n++;
}
static void dt__meta_free(dt__meta_list *l) {
    for (int i = 0; i < 2 * l->n; i++) free(l->kv[i]);
    free(l->kv);
    l->kv = NULL; l->n = 0;
}

/* -- reading the metadata back --
   Every number is read whole and checked against the values it can take: atoi
   would read "-5" as -5 and "abc" as 0, and a run would resume at a position no
   run ever reached. */
static const char *dt__meta_required(dt_safetensors *st, const char *path, const char *key) {
    const char *v = dt_safetensors_meta(st, key);
    if (!v) dt_fail("'%s' is not a dtrain checkpoint (no '%s' in its metadata; for plain weights use --init)", path, key);
    return v;
}
/* Digits only (no sign, no space, nothing after), lo <= value <= hi. */
static int dt__whole_number(const char *s, uint64_t lo, uint64_t hi, uint64_t *v) {
    char *end;
    if (!isdigit((unsigned char)*s)) return 0;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 10);
    if (*end || errno || x < lo || x > hi) return 0;
    *v = x;
    return 1;
}
/* "a,b,c" into v[0..max): how many, or -1 when it is anything else. */
static int dt__whole_numbers(const char *s, uint64_t *v, int max) {
    for (int n = 0;; n++) {
        char part[32];
        size_t len = strcspn(s, ",");
        if (n == max || len >= sizeof part) return -1;
        memcpy(part, s, len);
        part[len] = 0;
        if (!dt__whole_number(part, 0, UINT64_MAX, &v[n])) return -1;
        if (!s[len]) return n + 1;
        s += len + 1;
    }
}
static uint64_t dt__meta_whole(dt_safetensors *st, const char *path, const char *key, uint64_t lo, uint64_t hi) {
    const char *s = dt__meta_required(st, path, key);
    uint64_t v = 0;
    if (!dt__whole_number(s, lo, hi, &v)) {
        char range[64];
        if (hi >= (uint64_t)INT64_MAX) snprintf(range, sizeof range, ">= %llu", (unsigned long long)lo);
        else snprintf(range, sizeof range, "from %llu to %llu", (unsigned long long)lo, (unsigned long long)hi);
        dt_fail("'%s': metadata '%s' is '%s', not a whole number %s", path, key, s, range);
    }
    return v;
}
static float dt__meta_positive(dt_safetensors *st, const char *path, const char *key) {
    const char *s = dt__meta_required(st, path, key);
    char *end;
    float v = strtof(s, &end);
    if (end == s || *end || !isfinite(v) || !(v > 0)) dt_fail("'%s': metadata '%s' is '%s', not a positive number", path, key, s);
    return v;
}

/* -- writing a checkpoint folder --
   Its files go into NAME.tmp, and the folder is renamed NAME once all of them
   are on disk. An older NAME is moved aside (NAME.old) for that moment and
   removed after, so NAME is always a whole checkpoint or absent. Until the
   rename every file written is on the list that dt_fail and a second Ctrl-C
   remove. */
typedef struct dt__folder { char path[4096], tmp[4096]; int slots[DT_CLEANUP_SLOTS], nslots; } dt__folder;

/* The names dtrain writes into a checkpoint folder (and their .tmp while written):
   the only files it ever removes from one. */
static int dt__checkpoint_name(const char *name) {
    static const char *const names[] = { "config.json", "model.safetensors", "optimizer.safetensors", "shards.safetensors",
                                         "adapter_config.json", "adapter_model.safetensors" };
    char stem[256];
    size_t len = strlen(name);
    if (len >= sizeof stem) return 0;
    dt__copy_str(stem, sizeof stem, name);
    if (len > 4 && !strcmp(stem + len - 4, ".tmp")) stem[len - 4] = 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) if (!strcmp(stem, names[k])) return 1;
    int r, n, used = 0;
    return sscanf(stem, "shard%d-of-%d.safetensors%n", &r, &n, &used) == 2 && used == (int)strlen(stem);
}
/* Does `path` hold a dtrain checkpoint (one that may be replaced)? */
static int dt__checkpoint_file(const char *dir, const char *name, char *out, size_t n);
/* A whole checkpoint's weights: model.safetensors, or with LoRA adapter_model.safetensors. */
static int dt__checkpoint_weights(const char *dir, char *out, size_t n) {
    return dt__checkpoint_file(dir, "model.safetensors", out, n) || dt__checkpoint_file(dir, "adapter_model.safetensors", out, n);
}
static int dt__is_checkpoint_folder(const char *path) {
    char file[4200];
    struct stat s;
    if (lstat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return 0;
    if (dt__checkpoint_weights(path, file, sizeof file)) return 1;
    dt__path(file, sizeof file, "%s/shards.safetensors", path);
    return access(file, F_OK) == 0;
}
/* What a crashed or replaced save left: dtrain's files in the folder, then the
   folder when that empties it. Anything else stays. */
static void dt__folder_remove(const char *path) {
    struct stat s;
    if (lstat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return;
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char file[8300];
        dt__path(file, sizeof file, "%s/%s", path, e->d_name);
        if (dt__checkpoint_name(e->d_name) && lstat(file, &s) == 0 && S_ISREG(s.st_mode)) unlink(file);
    }
    if (d) closedir(d);
    rmdir(path);
}
/* A name taken by something that is not a checkpoint is refused, never
   replaced; an empty folder is taken over. */
static void dt__folder_check_free(const char *path) {
    struct stat s;
    if (lstat(path, &s) == 0 && !dt__is_checkpoint_folder(path) && !(S_ISDIR(s.st_mode) && rmdir(path) == 0))
        dt_fail("'%s' exists and is not a dtrain checkpoint: not replaced (remove it, or write elsewhere)", path);
}
/* create: this process makes NAME.tmp (the only writer, or FSDP's rank 0); the
   others only name their files in it. Each registers the folder, so that the
   last process to clean up after a failure removes it. */
static void dt__folder_open(dt__folder *w, const char *path, int create) {
    memset(w, 0, sizeof *w);
    dt__copy_str(w->path, sizeof w->path, path);
    dt__path(w->tmp, sizeof w->tmp, "%s.tmp", path);
    if (create) {
        struct stat s;
        dt__folder_check_free(path);
        dt__folder_remove(w->tmp);
        if (lstat(w->tmp, &s) == 0 && !S_ISDIR(s.st_mode))
            dt_fail("'%s' exists and is not a folder dtrain writes: not replaced (remove it, or write elsewhere)", w->tmp);
        if (mkdir(w->tmp, 0755) != 0 && errno != EEXIST)
            dt_fail("cannot create checkpoint folder '%s': %s", w->tmp, strerror(errno));
    }
    dt__cleanup_empty_folder = dt__folder_remove;    /* what a failure does with a NAME.tmp it cannot rmdir */
    w->slots[w->nslots++] = dt__cleanup_add(w->tmp);
}
static void dt__folder_file(const dt__folder *w, const char *name, char *out, size_t n) {
    dt__path(out, n, "%s/%s", w->tmp, name);
}
static void dt__folder_wrote(dt__folder *w, const char *file) {
    if (w->nslots < DT_CLEANUP_SLOTS) w->slots[w->nslots++] = dt__cleanup_add(file);
}
static void dt__folder_forget(dt__folder *w) {
    for (int k = 0; k < w->nslots; k++) dt__cleanup_done(w->slots[k]);
    w->nslots = 0;
}
/* Files of the user's in an older NAME (a tokenizer, notes) go on with the
   new one: moved into NAME.tmp before the swap, so that what is moved aside
   holds dtrain's files alone and goes whole. */
static void dt__folder_carry_over(const char *from, const char *to) {
    DIR *d = opendir(from);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char src[8300], dst[8300];
        struct stat s;
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || dt__checkpoint_name(e->d_name)) continue;
        dt__path(src, sizeof src, "%s/%s", from, e->d_name);
        dt__path(dst, sizeof dst, "%s/%s", to, e->d_name);
        if (lstat(dst, &s) == 0) continue;
        if (rename(src, dst) != 0) dt_fail("cannot move '%s' into the new checkpoint '%s': %s", src, to, strerror(errno));
    }
    if (d) closedir(d);
}
/* NAME.tmp becomes NAME. An older NAME is moved to NAME.old first and removed
   after; a save cut off between the two renames leaves it there, whole, and
   --resume auto takes it when NAME is missing. */
static void dt__folder_commit(dt__folder *w) {
    char old[4200];
    struct stat s;
    int fd = open(w->tmp, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) { fsync(fd); close(fd); }               /* the files' names on disk before the folder's */
    dt__folder_check_free(w->path);
    dt__folder_forget(w);                                 /* from here on every file is a whole checkpoint's */
    dt__path(old, sizeof old, "%s.old", w->path);
    dt__folder_carry_over(w->path, w->tmp);               /* the newer copy of a file first */
    dt__folder_carry_over(old, w->tmp);
    if (lstat(w->path, &s) == 0) {
        dt__folder_remove(old);
        if (rename(w->path, old) != 0)
            dt_fail("cannot move the older checkpoint '%s' aside to '%s': %s", w->path, old, strerror(errno));
    }
    if (rename(w->tmp, w->path) != 0) {
        int e = errno;
        rename(old, w->path);
        dt_fail("could not rename '%s' to '%s': %s (the checkpoint written is in '%s')", w->tmp, w->path, strerror(e), w->tmp);
    }
    dt__folder_remove(old);
}

/* config.json, in the words of the library that has the same model (the models chapter). */
static void dt__adapter_config_json(FILE *f, const dt_model *m);
/* config.json, or a LoRA model's adapter_config.json */
static void dt__folder_write_config(dt__folder *w, const dt_model *m) {
    char file[4200];
    dt__folder_file(w, m->base ? "adapter_config.json" : "config.json", file, sizeof file);
    FILE *f = fopen(file, "w");
    if (!f) dt_fail("cannot write '%s': %s", file, strerror(errno));
    dt__folder_wrote(w, file);
    if (m->base) dt__adapter_config_json(f, m);
    else dt__family(m->cfg.kind)->config_json(f, &m->cfg);
    int ok = !ferror(f) && fflush(f) == 0 && fsync(fileno(f)) == 0, e = errno;
    if (fclose(f) != 0 && ok) { ok = 0; e = errno; }
    if (!ok) dt_fail("could not write '%s': %s", file, strerror(e ? e : EIO));
}

/* A whole checkpoint's files: config.json, the moments (tagged with the step,
   so that a file from another save is found out) and the weights, whose
   metadata is the run's. */
static void dt__folder_write_whole(dt__folder *w, const dt_model *m, int adamw, float *const state[3], dt__meta_list *meta,
                                   int64_t step) {
    char file[4200];
    dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)m->nparams * 2 + 1, sizeof *t);
    char **names = (char **)calloc((size_t)m->nparams * 2 + 1, sizeof(char *));
    if (!t || !names) dt_fail("out of memory (writing checkpoint '%s')", w->path);
    dt__folder_write_config(w, m);
    int n = 0;
    for (int k = 1; k < 3; k++)
        if (state[k]) { dt__state_named(m, adamw, k, state[k], t + n, names + n); n += m->nparams; }
    dt__meta_list om = { NULL, 0 };
    dt__meta_add(&om, "dtrain_format", "optimizer-2");
    dt__meta_add(&om, "optimizer", "%s", adamw ? "adamw" : "sgd");
    dt__meta_add(&om, "step", "%lld", (long long)step);
    dt__folder_file(w, "optimizer.safetensors", file, sizeof file);
    dt_safetensors_write(file, t, n, (const char *const *)om.kv, om.n);
    dt__folder_wrote(w, file);
    dt__meta_free(&om);
    for (int i = 0; i < n; i++) free(names[i]);
    dt__state_named(m, adamw, 0, state[0], t, names);
    dt__folder_file(w, m->base ? "adapter_model.safetensors" : "model.safetensors", file, sizeof file);
    dt_safetensors_write(file, t, m->nparams, (const char *const *)meta->kv, meta->n);
    dt__folder_wrote(w, file);
    for (int i = 0; i < m->nparams; i++) free(names[i]);
    free(names);
    free(t);
}

/* -- reading a checkpoint folder --
   The file that describes it: shards.safetensors, the index of a sharded
   checkpoint, or model.safetensors. A file given instead of a folder, an
   older dtrain's one-file checkpoint among them, is refused by name. */
static int dt__is_sharded(dt_safetensors *st);
static int dt__checkpoint_file(const char *dir, const char *name, char *out, size_t n) {
    dt__path(out, n, "%s/%s", dir, name);
    return access(out, F_OK) == 0;
}
static dt_safetensors *dt__checkpoint_open(const char *path) {
    struct stat s;
    char file[4200];
    if (stat(path, &s) != 0) {
        int e = errno;
        dt__path(file, sizeof file, "%s.old", path);
        if (access(file, F_OK) == 0)
            dt_fail("cannot read checkpoint '%s': %s (a save of it was cut off; the one before is in '%s')", path, strerror(e), file);
        dt_fail("cannot read checkpoint '%s': %s", path, strerror(e));
    }
    if (!S_ISDIR(s.st_mode)) {
        dt_safetensors *st = dt__safetensors_read_header(path);
        const char *old = dt_safetensors_meta(st, "format");
        dt__is_sharded(st);                    /* one rank's shard is named as such */
        if (old && !strncmp(old, "dtrain-", 7))
            dt_fail("'%s' is a one-file checkpoint of an earlier dtrain (%s): checkpoints are folders now (model.safetensors, "
                    "optimizer.safetensors, config.json); --init takes this file's weights", path, old);
        dt_fail("'%s' is a file, not a checkpoint folder (one holds model.safetensors, optimizer.safetensors and "
                "config.json); --init takes the weights of a file", path);
    }
    if (dt__checkpoint_file(path, "shards.safetensors", file, sizeof file)) return dt_safetensors_read(file);
    if (!dt__checkpoint_weights(path, file, sizeof file))
        dt_fail("'%s' is not a dtrain checkpoint: it holds neither model.safetensors nor shards.safetensors (nor, from a "
                "LoRA run, adapter_model.safetensors)", path);
    dt_safetensors *st = dt_safetensors_read(file);
    if (!dt_safetensors_meta(st, "dtrain_format"))
        dt_fail("'%s' is not a dtrain checkpoint (no 'dtrain_format' in its metadata; for weights alone use --init)", file);
    return st;
}

/* -- sharded checkpoints --
   FSDP saves without gathering: each rank writes what it holds, its slice of
   every unit of the weights and of the optimizer's moments (1-D tensors
   "params", "optimizer.exp_avg", ..., the padding included), to its own file
   in the checkpoint's folder, shard<r>-of-<N>.safetensors. When every shard is
   on disk, rank 0 writes the index, shards.safetensors: a safetensors file with
   no tensors, whose metadata is a whole checkpoint's plus the layout (the
   ranks, each unit's size) and each shard file's size; and config.json. The
   folder is renamed into place last, so it never names a shard that is not
   complete. `path` below is the checkpoint's folder. */
static void dt__shard_path(char *out, size_t n, const char *path, int rank, int world) {
    dt__path(out, n, "%s/shard%d-of-%d.safetensors", path, rank, world);
}
/* Is this the index of a sharded checkpoint? (One of its shards is refused: it is not the whole.) */
static int dt__is_sharded(dt_safetensors *st) {
    const char *old = dt_safetensors_meta(st, "format");
    if (old && (!strcmp(old, "dtrain-shard-1") || !strcmp(old, "dtrain-sharded-checkpoint-1")))
        dt_fail("'%s' is part of a sharded checkpoint of an earlier dtrain (%s): put it together with that dtrain's "
                "tools/consolidate", st->path, old);
    const char *format = dt_safetensors_meta(st, "dtrain_format");
    if (format && !strcmp(format, "shard-2"))
        dt_fail("'%s' is one rank's shard of a sharded checkpoint: give the checkpoint's folder instead", st->path);
    return dt_safetensors_meta(st, "shards") != NULL;
}

/* Each unit's size, as the index recorded it, checked against the model's. */
static int dt__sharded_layout(dt_safetensors *index, const char *path, const dt_model *m, int64_t *unit_numel) {
    int world = (int)dt__meta_whole(index, index->path, "shards", 1, DT_MAX_RANKS);
    const char *s = dt__meta_required(index, index->path, "unit_numel");
    uint64_t *v = (uint64_t *)malloc(sizeof(uint64_t) * ((size_t)m->nunits + 1));
    if (!v) dt_fail("out of memory (reading '%s')", path);
    int n = dt__whole_numbers(s, v, m->nunits + 1);
    if (n < 0) dt_fail("'%s': metadata 'unit_numel' is '%s', not whole numbers separated by commas", index->path, s);
    for (int k = 0; k < n && k < m->nunits; k++) unit_numel[k] = v[k] > (uint64_t)INT64_MAX ? -1 : (int64_t)v[k];
    free(v);
    int same = n == m->nunits;
    for (int k = 0; same && k < n; k++) {
        int64_t end = m->unit_first[k + 1] < m->nparams ? m->offsets[m->unit_first[k + 1]] : m->numel;
        same = unit_numel[k] == end - m->offsets[m->unit_first[k]];
    }
    if (!same) dt_fail("'%s' was sharded by units that are not this model's (a checkpoint of another model?)", path);
    return world;
}

static int dt__sharded_layout_is(dt_safetensors *index, const char *path, const dt_model *m, int world) {
    int64_t *unit_numel = (int64_t *)calloc((size_t)m->nunits + 1, sizeof(int64_t));
    int shards = dt__sharded_layout(index, path, m, unit_numel);
    free(unit_numel);
    return shards == world;
}

/* Is rank r's shard file there, and as long as the index says? Every rank
   checks every file before reading any, so all of them name the one at fault. */
static void dt__shard_check(dt_safetensors *index, const char *path, int rank, int world, char *file, size_t n) {
    char key[32];
    struct stat s;
    dt__shard_path(file, n, path, rank, world);
    snprintf(key, sizeof key, "shard.%d.bytes", rank);
    if (!dt_safetensors_meta(index, key)) dt_fail("'%s': the index has no entry for shard %d of %d", path, rank, world);
    uint64_t bytes = dt__meta_whole(index, index->path, key, 0, INT64_MAX);
    if (stat(file, &s) != 0)
        dt_fail("sharded checkpoint '%s': shard %d of %d, '%s', is missing: %s", path, rank, world, file, strerror(errno));
    if ((uint64_t)s.st_size != bytes)
        dt_fail("sharded checkpoint '%s': shard %d of %d, '%s', has %lld bytes but the index recorded %llu "
                "(truncated, or written by another save)", path, rank, world, file, (long long)s.st_size,
                (unsigned long long)bytes);
}

/* Rank r's shard file, after checking it is there, whole, and of this save. */
static dt_safetensors *dt__shard_open(dt_safetensors *index, const char *path, int rank, int world) {
    char file[4096];
    dt__shard_check(index, path, rank, world, file, sizeof file);
    dt_safetensors *sh = dt_safetensors_read(file);
    const char *step = dt_safetensors_meta(sh, "step"), *want = dt_safetensors_meta(index, "step");
    const char *who = dt_safetensors_meta(sh, "rank");
    if (!step || !want || strcmp(step, want) || !who || dt__meta_whole(sh, file, "rank", 0, DT_MAX_RANKS - 1) != (uint64_t)rank)
        dt_fail("'%s' is not shard %d of checkpoint '%s' at step %s (it says rank %s, step %s)", file, rank, path,
                want ? want : "?", who ? who : "?", step ? step : "?");
    return sh;
}

/* One tensor of a shard file into dst (shard_numel floats), or an error naming the file. */
static void dt__shard_get(dt_safetensors *sh, int adamw, int k, float *dst, int64_t shard_numel) {
    char name[64];
    int len = (int)shard_numel;
    if (k == 0) snprintf(name, sizeof name, "params");
    else snprintf(name, sizeof name, "optimizer.%s", dt__moment_name(adamw, k));
    if (shard_numel > INT_MAX || !dt_safetensors_get(sh, name, dst, 1, &len))
        dt_fail("'%s' has no tensor '%s' of %lld elements", sh->path, name, (long long)shard_numel);
}

/* Every rank's shard put back together in parameter order, whatever the world
   size reading it: rank r held elements [r * s, (r + 1) * s) of each unit, s =
   the unit's size / N rounded up; what lies past the unit's end is padding. */
static void dt__sharded_assemble(dt_safetensors *index, const char *path, const dt_model *m, int adamw, float *state[3]) {
    int64_t *unit_numel = (int64_t *)calloc((size_t)m->nunits + 1, sizeof(int64_t)), shard_numel = 0;
    int world = dt__sharded_layout(index, path, m, unit_numel);
    char file[4096];
    for (int r = 0; r < world; r++) dt__shard_check(index, path, r, world, file, sizeof file);
    for (int k = 0; k < m->nunits; k++) shard_numel += (unit_numel[k] + world - 1) / world;
    float *buf = (float *)malloc((size_t)shard_numel * sizeof(float) + 1);
    if (!buf) dt_fail("out of memory (reading '%s')", path);
    for (int r = 0; r < world; r++) {
        dt_safetensors *sh = dt__shard_open(index, path, r, world);
        for (int k = 0; k < 3; k++) {
            if (!state[k]) continue;
            dt__shard_get(sh, adamw, k, buf, shard_numel);
            int64_t at = 0;
            for (int u = 0; u < m->nunits; u++) {
                int64_t s = (unit_numel[u] + world - 1) / world, lo = r * s, hi = lo + s < unit_numel[u] ? lo + s : unit_numel[u];
                if (hi > lo) memcpy(state[k] + m->offsets[m->unit_first[u]] + lo, buf + at, (size_t)(hi - lo) * sizeof(float));
                at += s;
            }
        }
        dt_safetensors_close(sh);
    }
    free(buf);
    free(unit_numel);
}

/* [src/21-hugging-face.h] */
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
        { "partial_rotary_factor", offsetof(dt__hf_config, partial_rotary) } };
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

static int dt__model_config_parse(dt_safetensors *st, const char *path, dt_model_config *mc) {
    const char *kind = dt_safetensors_meta(st, "model"), *shape = dt_safetensors_meta(st, "model_config");
    memset(mc, 0, sizeof *mc);
    if (!kind || !shape) return 0;
    int found = -1;
    for (int f = 0; f < DT__NFAMILIES; f++)
        if (!strcmp(kind, dt__model_families[f].name)) found = f;
    if (found < 0) return 0;
    mc->kind = (dt_model_kind)found;
    int want = dt__model_families[found].numbers, got = 0, ok = 1;
    char names[400];
    dt__config_names(mc->kind, names, sizeof names);
    for (const char *p = shape; ok && *p; got++) {
        char *end = NULL;
        errno = 0;
        double v = strtod(p, &end);
        ok = end != p && !errno && isfinite(v) && v >= 0 && got < want && (*end == ',' || !*end);
        if (!ok) break;
        char *field = (char *)mc + dt__config_numbers[got].offset;
        if (dt__config_numbers[got].is_float) ok = v <= FLT_MAX, *(float *)field = (float)v;
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
        if (dt__model_config_parse(st, st->path, &theirs)) dt__config_names(theirs.kind, names, sizeof names);  /* its own kind's */
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

/* --resume auto: the checkpoint of the most steps in --save-dir, or NULL to
   start fresh -- what a requeued job runs, unchanged, after preemption. Every
   folder there should be whole: a checkpoint is renamed into place once
   written (NAME.tmp, being written, is passed over; NAME.old, being replaced,
   counts only when a save was cut off before NAME took its place). One that
   is not -- a file cut short or damaged since, a shard missing -- is passed
   over for the newest whole one, saying so: its files' headers and sizes are
   read, not their data. Ties go to the later name, so every rank picks the
   same folder. A one-file checkpoint of an earlier dtrain that would have been
   the newest is an error, not a silent fresh start. */
typedef struct { long long step; char path[4096]; } dt__candidate;
static int dt__candidate_newer(const void *a, const void *b) {
    const dt__candidate *x = (const dt__candidate *)a, *y = (const dt__candidate *)b;
    return x->step != y->step ? (x->step > y->step ? -1 : 1) : -strcmp(x->path, y->path);
}
/* Are the files of checkpoint folder `path` whole, as far as their headers and sizes tell? */
static int dt__checkpoint_whole(const char *path, dt_safetensors *meta, char *why, size_t n) {
    char file[4200];
    if (dt_safetensors_meta(meta, "shards")) {
        const char *shards = dt_safetensors_meta(meta, "shards");
        int world = atoi(shards);
        if (world < 1 || world > DT_MAX_RANKS) { snprintf(why, n, "its index says %.20s shards", shards); return 0; }
        for (int r = 0; r < world; r++) {
            char key[32];
            struct stat s;
            dt__shard_path(file, sizeof file, path, r, world);
            snprintf(key, sizeof key, "shard.%d.bytes", r);
            const char *bytes = dt_safetensors_meta(meta, key);
            if (stat(file, &s) != 0) { snprintf(why, n, "shard %d of %d is missing", r, world); return 0; }
            if (!bytes || strtoull(bytes, NULL, 10) != (unsigned long long)s.st_size) {
                snprintf(why, n, "shard %d of %d has %lld bytes, the index recorded %.20s", r, world, (long long)s.st_size,
                         bytes ? bytes : "none");
                return 0;
            }
        }
        return 1;
    }
    dt__path(file, sizeof file, "%s/optimizer.safetensors", path);
    dt_safetensors *st = dt__safetensors_read_header_or_why(file, why, n);
    dt_safetensors_close(st);
    return st != NULL;
}
static const char *dt__newest_checkpoint(const char *dir, char *out, size_t n) {
    DIR *d = opendir(dir);
    struct dirent *e;
    long long best = -1, best_old_format = -1;
    char old_format[4096] = "", why[600];
    dt__candidate *c = NULL;
    int nc = 0, cap = 0, unreadable = 0, talk = dt__ctx.rank == 0;
    out[0] = 0;
    while (d && (e = readdir(d))) {
        size_t len = strlen(e->d_name);
        char path[4096], file[4200];
        struct stat s;
        if (e->d_name[0] == '.' || (len > 4 && !strcmp(e->d_name + len - 4, ".tmp"))) continue;
        dt__path(path, sizeof path, "%s/%s", dir, e->d_name);
        if (len > 4 && !strcmp(e->d_name + len - 4, ".old")) {
            dt__path(file, sizeof file, "%.*s", (int)strlen(path) - 4, path);
            if (access(file, F_OK) == 0) continue;            /* replaced, and its successor is there */
        }
        if (stat(path, &s) == 0 && S_ISREG(s.st_mode) && len > 12 && !strcmp(e->d_name + len - 12, ".safetensors")) {
            dt_safetensors *st = dt__safetensors_read_header_or_why(path, why, sizeof why);
            const char *format = dt_safetensors_meta(st, "format"), *step = dt_safetensors_meta(st, "step");
            if (format && !strncmp(format, "dtrain-", 7) && strstr(format, "checkpoint") && step && atoll(step) > best_old_format) {
                best_old_format = atoll(step);
                dt__copy_str(old_format, sizeof old_format, path);
            }
            dt_safetensors_close(st);
            continue;
        }
        if (stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) continue;
        if (!dt__checkpoint_file(path, "shards.safetensors", file, sizeof file) && !dt__checkpoint_weights(path, file, sizeof file))
            continue;
        dt_safetensors *st = dt__safetensors_read_header_or_why(file, why, sizeof why);
        if (!st) {
            if (talk) dt_warn("--resume auto: passing over '%s', which cannot be read: %s", path, why);
            unreadable++;
            continue;
        }
        const char *format = dt_safetensors_meta(st, "dtrain_format"), *step = dt_safetensors_meta(st, "step");
        if (format && strstr(format, "checkpoint") && step) {
            if (nc == cap && !(c = (dt__candidate *)realloc(c, sizeof *c * (size_t)(cap = cap ? 2 * cap : 16))))
                dt_fail("out of memory (--resume auto)");
            c[nc].step = atoll(step);
            dt__copy_str(c[nc++].path, sizeof c->path, path);
        }
        dt_safetensors_close(st);
    }
    if (d) closedir(d);
    if (nc > 1) qsort(c, (size_t)nc, sizeof *c, dt__candidate_newer);
    for (int k = 0; k < nc && !out[0]; k++) {
        char file[4200];
        if (!dt__checkpoint_file(c[k].path, "shards.safetensors", file, sizeof file)) dt__checkpoint_weights(c[k].path, file, sizeof file);
        dt_safetensors *meta = dt__safetensors_read_header(file);
        if (dt__checkpoint_whole(c[k].path, meta, why, sizeof why)) {
            best = c[k].step;
            dt__copy_str(out, n, c[k].path);
            if (talk && (k > 0 || unreadable))       /* something newer was passed over: say what is taken instead */
                printf("--resume auto: resuming '%s' (step %lld), the newest whole checkpoint in '%s'\n", out, best, dir);
        } else if (talk)
            dt_warn("--resume auto: passing over '%s' (step %lld), which is not whole: %s", c[k].path, c[k].step, why);
        dt_safetensors_close(meta);
    }
    free(c);
    if ((nc > 0 || unreadable > 0) && !out[0])        /* not a fresh start: that would train over them */
        dt_fail("--resume auto: no checkpoint in '%s' is whole (see above): resume one by name with --resume, or move "
                "them out of --save-dir to start afresh", dir);
    if (best_old_format >= 0 && best_old_format >= best)
        dt_fail("--resume auto: '%s' (step %lld) is a one-file checkpoint of an earlier dtrain, newer than any checkpoint "
                "folder in '%s': resume it with that dtrain, or move it out of --save-dir", old_format, best_old_format, dir);
    return out[0] ? out : NULL;
}

/* [src/22-evaluation.h] */
/* ==== evaluation ============================================================
   The validation set is measured without the tape: no gradients, no
   activations kept. Every rank evaluates its share and the sums meet in one
   all-reduce, so the numbers are those of the whole set on every rank. */

/* Sum n host floats over the ranks of the job. */
static void dt__job_sum(float *host, int n) {
    if (!dt__ctx.job || dt__ctx.world_size == 1) return;
    dt__comm_all_reduce_host(dt__ctx.job, host, n, DT_SUM);
}
/* The largest of every rank's value. */
static float dt__job_max(float mine) {
    if (!dt__ctx.job || dt__ctx.world_size == 1) return mine;
    int W = dt__ctx.world_size;
    float *all = (float *)malloc(sizeof(float) * (size_t)W);
    if (!all) dt_fail("out of memory");
    dt__comm_all_gather_host(dt__ctx.job, &mine, all, sizeof mine);
    for (int r = 0; r < W; r++) if (all[r] > mine) mine = all[r];
    free(all);
    return mine;
}

/* Share `rank` of `world`: the run driver gives its loader's, as the ranks of
   a tensor-parallel group evaluate the same share together. */
static void dt__evaluate_share(dt_model *m, const dt_dataset *ds, int batch_size, int rank, int world, double *loss,
                               double *acc) {
    dt_loader l = dt_loader_create(ds, batch_size, 0, 0, 0, 0, rank, world);
    dt_loader_start_epoch(&l, 0, 0);
    dt_batch b;
    double total = 0;
    int64_t correct = 0, seen = 0;
    dt_set_grad_enabled(0);
    for (;;) {
        dt_step_arena_reset();
        int64_t first = l.pos;
        if (!dt_loader_next(&l, &b)) break;
        dt_tensor *logits = dt_model_forward(m, b.inputs);
        int C = (int)dt_tensor_cols(logits), R = (int)(dt_tensor_rows(logits) / b.size);   /* rows per sample: gpt's T */
        int split = dt__logits_split(logits);                   /* a split vocabulary: the group's columns */
        float *host = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)logits->numel * (size_t)split);
        dt_logits_to_host(logits, host);
        C *= split;
        for (int i = 0; i < b.size; i++) {
            if (rank + (first + i) * world >= ds->n) continue;   /* the sampler's padding: counted by its owner */
            for (int k = i * R; k < (i + 1) * R; k++) {
                if (b.labels[k] == DT_IGNORE_INDEX) continue;   /* a prompt's or the padding's */
                const float *row = host + (size_t)k * C;
                int best = 0;
                float mx = row[0], sum = 0;
                for (int j = 1; j < C; j++) if (row[j] > row[best]) best = j;
                mx = row[best];
                for (int j = 0; j < C; j++) sum += expf(row[j] - mx);
                total += (double)(logf(sum) + mx - row[b.labels[k]]);
                correct += best == b.labels[k];
                seen++;
            }
        }
    }
    dt_set_grad_enabled(1);
    dt_loader_free(&l);
    /* The sampler pads by wrapping, so every rank runs the same number of
       batches; the padding is not counted, so each sample is scored here, row
       by row, rather than through the batch mean dt_cross_entropy gives. */
    float sums[3] = { (float)total, (float)correct, (float)seen };
    dt_step_arena_reset();
    dt__job_sum(sums, 3);
    *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
    *acc = sums[2] > 0 ? sums[1] / sums[2] : 0;
}
void dt_evaluate(dt_model *m, const dt_dataset *ds, int batch_size, double *loss, double *acc) {
    const dt_parallel *par = m->parallel;
    while (par && par->data_ranks == 0) par = par->inner;       /* in a stack, the wrapper that says how the data splits */
    if (par && par->data_ranks > 0) dt__evaluate_share(m, ds, batch_size, par->data_rank, par->data_ranks, loss, acc);
    else dt__evaluate_share(m, ds, batch_size, dt__ctx.job ? dt__ctx.rank : 0, dt__ctx.job ? dt__ctx.world_size : 1, loss, acc);
}

/* Sampling, one token at a time: the whole window runs again for each new
   token (no key/value cache -- slower, but nothing new to learn). */
void dt_generate(dt_model *m, const int32_t *prompt, int n_prompt, int n_new, float temperature, uint64_t seed,
                 int32_t *out) {
    int T = m->cfg.seq_len, V = m->cfg.classes, len = n_prompt;
    if (!dt_model_is_language(m->cfg.kind)) dt_fail("generation needs a language model (--model gpt or llama)");
    if (n_prompt < 1) dt_fail("generation needs a prompt of at least one token");
    int32_t *seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_prompt + n_new));
    float *window = (float *)malloc(sizeof(float) * (size_t)T), *logits = (float *)malloc(sizeof(float) * (size_t)V);
    if (!seq || !window || !logits) dt_fail("out of memory (generation)");
    memcpy(seq, prompt, sizeof(int32_t) * (size_t)n_prompt);
    int grad = dt__ctx.grad_enabled;
    dt_set_grad_enabled(0);
    dt__rng rng = { dt__hash3(seed, 0x47454Eu, 0) };
    for (int i = 0; i < n_new; i++, len++) {
        int from = len > T ? len - T : 0, L = len - from;
        for (int t = 0; t < L; t++) window[t] = (float)seq[from + t];
        dt_step_arena_reset();
        int shape[2] = { 1, L };
        dt_tensor *y = dt_model_forward(m, dt_tensor_from_host(2, shape, window));
        dt__logits_rows_to_host(y, L - 1, 1, logits);                   /* the last position's */
        float *weight = logits, mx = weight[0];
        for (int j = 1; j < V; j++) mx = weight[j] > mx ? weight[j] : mx;
        double total = 0;
        for (int j = 0; j < V; j++) total += weight[j] = expf((weight[j] - mx) / temperature);
        double u = dt__rng_uniform(&rng) * total;
        float pick = (float)(V - 1);
        for (int j = 0; j < V; j++)
            if ((u -= weight[j]) <= 0) { pick = (float)j; break; }
        if (dt__ctx.rank != 0) pick = 0;                  /* rank 0 decides for every rank */
        dt__job_sum(&pick, 1);
        seq[len] = (int32_t)pick;
    }
    dt_set_grad_enabled(grad);
    dt_step_arena_reset();
    memcpy(out, seq + n_prompt, sizeof(int32_t) * (size_t)n_new);
    free(seq); free(window); free(logits);
}

/* [src/23-metrics.h] */
/* ==== metrics, traces and the benchmark line ================================
   Time is charged to phases (data, forward, backward, waiting for
   communication, optimizer), drawn in a Chrome trace, turned into a progress
   line with an ETA, and, with --bench, into one "bench:" line that tools read. */

/* The trace has one track per phase, so that forward, backward, waiting for
   communication and the optimizer line up in rows, and one for the
   communication thread (or stream), where each collective -- each DDP bucket --
   shows when it really ran: overlap with backward is visible at a glance.
   Under pipeline parallelism a last track shows each micro-batch's forward
   and backward and the waits between them: the bubble. The tracks' numbers
   are declared above (DT_TRACK_COMM, DT_TRACK_PIPELINE). */
static const char *dt__phase_names[DT_PHASE_COUNT] = { "data", "forward", "backward", "comm wait", "optimizer", "eval", "checkpoint" };

static void dt__trace_event(dt_run *r, const char *name, int track, double t0, double t1) {
    if (!r->trace) return;
    /* the file opens with metadata events, so every event follows a comma */
    fprintf(r->trace, ",{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f}\n",
            name, dt__ctx.rank, track, (t0 - r->start_ms) * 1e3, (t1 - t0) * 1e3);
    dt__file_check(r->trace, "--trace", r->trace_path);
}

static void dt__trace_open(dt_run *r, const char *path) {
    char *mine = r->trace_path;
    size_t size = sizeof r->trace_path;
    const char *dot = strrchr(path, '.');
    if (dt__ctx.world_size == 1) dt__path(mine, size, "%s", path);
    else if (dot && !strcmp(dot, ".json"))          /* one file per rank: run.json -> run.rank1.json */
        dt__path(mine, size, "%.*s.rank%d.json", (int)(dot - path), path, dt__ctx.rank);
    else dt__path(mine, size, "%s.rank%d", path, dt__ctx.rank);
    if (!(r->trace = fopen(mine, "w"))) dt_fail("cannot open --trace '%s': %s", mine, strerror(errno));
    fprintf(r->trace, "[{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}\n",
            dt__ctx.rank, dt__ctx.rank);
    for (int t = 0; t <= DT_TRACK_PIPELINE; t++)
        fprintf(r->trace, ",{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}\n",
                dt__ctx.rank, t, t == DT_TRACK_COMM ? "communication" : t == DT_TRACK_PIPELINE ? "pipeline" : dt__phase_names[t]);
    dt__file_check(r->trace, "--trace", mine);
}

void dt_phase(dt_run *run, dt_phase_kind phase) {
    /* A GPU runs its queue of kernels behind the host's back: wait for it, or
       the time of this phase would show up in a later one. */
    dt_synchronize();
    double now = dt_now_ms();
    run->phase_ms[phase] += now - run->mark_ms;
    if (phase == DT_PHASE_BWD) dt__ctx.backward_end_ms = now;
    dt__trace_event(run, dt__phase_names[phase], phase == DT_PHASE_CKPT ? DT_PHASE_EVAL : phase, run->mark_ms, now);
    run->mark_ms = now;
}

static void dt__format_duration(double s, char *out, size_t n) {
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, n, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60) snprintf(out, n, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, n, "%lds", t);
}

/* The time of a step, as the ETA and the progress line's rate assume it: a
   moving average that forgets old steps (weight 0.1: about the last 20), so
   that it follows a run that speeds up or slows down. The first step is not
   kept -- the second replaces it -- as it is warm-up (arenas allocated, cold
   caches, on a GPU cuBLAS's set-up), often several times slower than the
   rest. `step` counts this process's steps, 1 for the first. */
#define DT_ETA_WEIGHT 0.1
static double dt__eta_update(double avg_ms, double step_ms, int64_t step) {
    if (step <= 2) return step_ms;
    return avg_ms + DT_ETA_WEIGHT * (step_ms - avg_ms);
}

/* Whether step `step` prints a progress line. --log-every N: every N-th step
   (and the first). Otherwise by the clock, so a slow run is not silent for a
   minute and a fast one does not flood the terminal: the first step, then
   whenever DT_PROGRESS_MS have passed since the last line, and the last step
   of each epoch, so every epoch ends with its loss. */
#define DT_PROGRESS_MS 3000.0
static int dt__progress_due(int64_t step, int log_every, int last_of_epoch, double now_ms, double last_line_ms) {
    if (log_every > 0) return step % log_every == 0 || step == 1;
    return step == 1 || last_of_epoch || now_ms - last_line_ms >= DT_PROGRESS_MS;
}

/* A language model's rates are in tokens: a sequence is seq_len of them. */
static int dt__tokens_per_sample(const dt_run *r) { return dt_model_is_language(r->model->cfg.kind) ? r->model->cfg.seq_len : 0; }

/* The fp32 peak (no tensor cores: TF32 stays off) of GPUs a course may meet,
   from their data sheets, in TFLOP/s; --peak-tflops gives any other. */
static double dt__gpu_peak_tflops(const char *name) {
    static const struct { const char *match; double tflops; } peaks[] = {
        { "H200", 66.9 }, { "H100 PCIe", 51.2 }, { "H100 NVL", 60.0 }, { "H100", 66.9 }, { "A100", 19.5 },
        { "L40S", 91.6 }, { "L40", 90.5 }, { "L4", 30.3 }, { "A10G", 31.2 }, { "A10", 31.2 }, { "T4", 8.1 },
        { "RTX 4090", 82.6 }, { "RTX 4080", 48.7 }, { "RTX 3090", 35.6 }, { "RTX 3080", 29.8 }, { "A6000", 38.7 },
    };
    for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
        if (strstr(name, peaks[i].match)) return peaks[i].tflops;
    return 0;
}

/* The "bench:" line: what the timed steps of this stage did, in key=value
   pairs (tools and the Makefile read them). Throughput leaves out the data
   phase, so that it compares with a framework fed from a tensor in memory;
   data_ms says what loading cost. Rates and FLOP/s are for the whole job. */
static void dt__bench_report(dt_run *r) {
    const dt_config *cfg = &r->cfg;
    const dt_model_config *mc = &r->model->cfg;
    int64_t steps = r->step - r->bench_first;
    dt_synchronize();
    double wall = dt_now_ms() - r->bench_t0;
    double ms = wall - r->bench_phase_ms[DT_PHASE_DATA];
    if (steps <= 0 || ms <= 0) dt_fail("--bench: no step was timed");
    int devices = dt__ctx.devices > 1 ? dt__ctx.devices : 1;              /* stage 02: devices of one process */
    int world = dt__ctx.world_size, per_rank = r->loader->batch_size / devices * cfg->accum_steps, S = mc->image_size;
    int replicas = r->loader->world;                                     /* a tensor-parallel group shares a batch */
    const dt_model *whole = dt__state_layout(r->model);                  /* and its rank holds a piece of the model */
    double flops = dt_flops_counted() * world, gflops = flops / (ms / 1e3) / 1e9;
    float peak_mem = dt__job_max((float)dt_mem_total_peak());    /* the largest rank's peak */
    size_t host_bytes = 0;                                       /* and of offloaded (host) memory */
    for (int a = 0; a < DT_ARENA_COUNT; a++) host_bytes += dt_mem_host_peak((dt_arena)a);
    float peak_host = dt__job_max((float)host_bytes);
    /* what FSDP shards: parameters, gradients and optimizer state (the sum of their peaks) */
    float peak_state = dt__job_max((float)(dt_mem_peak(DT_ARENA_PARAMS) + dt_mem_peak(DT_ARENA_GRADS) + dt_mem_peak(DT_ARENA_OPTIM)));
    if (dt__ctx.rank != 0) return;
    /* a language model's MFU counts the model's FLOPs per token (6N + attention), as papers do */
    double tokens_per_s = steps * (double)per_rank * devices * replicas * mc->seq_len * 1e3 / ms;
    int language = dt_model_is_language(mc->kind);
    if (language) gflops = tokens_per_s * dt_model_flops_per_token(whole) / 1e9;
    /* GPT-2 small's shape at another context is named by it: gpt2-124m-ctx256 */
    char gpt2_name[32];
    if (mc->seq_len == 1024) snprintf(gpt2_name, sizeof gpt2_name, "gpt2-124m");
    else snprintf(gpt2_name, sizeof gpt2_name, "gpt2-124m-ctx%d", mc->seq_len);
    const char *workload = mc->kind == DT_MODEL_GPT
                         ? (mc->dim == 128 && mc->depth == 4 && mc->heads == 4 && mc->seq_len == 64 && mc->classes == 256 ? "gpt-char"
                         : (mc->dim == 768 && mc->depth == 12 && mc->heads == 12 && mc->classes == 50257 ? gpt2_name : "gpt-custom"))
                         : mc->kind == DT_MODEL_LLAMA ? (mc->dim == 128 && mc->depth == 4 && mc->heads == 4 && mc->seq_len == 64 &&
                                                         mc->classes == 256 ? "llama-char" : "llama-custom")
                         : mc->kind == DT_MODEL_MLP ? (mc->dim == 1024 && mc->depth == 2 && S == 32 ? "mlp" : "mlp-custom")
                         : (mc->dim == 192 && mc->depth == 6 && mc->heads == 3 && mc->patch == 4 && S == 32 ? "vit-tiny"
                         : (mc->dim == 768 && mc->depth == 12 && mc->heads == 12 && mc->patch == 16 && S == 224 ? "vit-base" : "vit-custom"));
    char where[256];
    if (r->model->device == DT_CUDA) {
        char gpu[128];
        size_t k = 0;
        for (const char *c = dt__ctx.gpu->name; *c && k + 1 < sizeof gpu; c++) gpu[k++] = *c == ' ' ? '_' : *c;
        gpu[k] = 0;
        /* the table holds fp32 peaks: a 16-bit run's peak must be given */
        double peak = cfg->peak_tflops > 0 ? cfg->peak_tflops : cfg->dtype == DT_F32 ? dt__gpu_peak_tflops(dt__ctx.gpu->name) : 0;
        if (peak > 0) snprintf(where, sizeof where, "device=cuda gpu=%s tflops=%.2f peak_tflops=%.1f mfu=%.3f", gpu,
                               gflops / 1e3, peak, gflops / 1e3 / world / peak);
        else snprintf(where, sizeof where, "device=cuda gpu=%s tflops=%.2f mfu=unknown(use --peak-tflops)", gpu, gflops / 1e3);
    } else snprintf(where, sizeof where, "device=cpu threads=%d", dt_threads());
    const double *p = r->bench_phase_ms;
    char stage[128];                     /* 04: which --shard, and whether offloaded (the wrapper's label) */
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(r->model->parallel, &who);
    snprintf(stage, sizeof stage, "%s", cfg->stage);
    if (rep && rep->label) rep->label(who, stage + strlen(stage), sizeof stage - strlen(stage));
    if (cfg->dtype != DT_F32 || cfg->reduce_dtype != DT_F32 || cfg->accum_steps > 1)   /* 05: precision, micro-batches */
        snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "/%s%s%s%s", dt_dtype_name((dt_dtype)cfg->dtype),
                 cfg->reduce_dtype != DT_F32 ? "+reduce-" : "", cfg->reduce_dtype != DT_F32 ? dt_dtype_name((dt_dtype)cfg->reduce_dtype) : "",
                 cfg->accum_steps > 1 ? "+accum" : "");
    if (cfg->recompute) snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "+recompute");
    if (r->model->base)                  /* LoRA: params= counts the adapters, what trains */
        snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "+lora-rank%d", r->model->cfg.lora_rank);
    printf("bench: workload=%s stage=%s %s ranks=%d batch=%d params=%lld steps=%lld step_ms=%.2f samples_per_s=%.1f "
           "gflops=%.2f data_ms=%.2f fwd_ms=%.2f bwd_ms=%.2f comm_ms=%.2f comm_hidden_ms=%.2f comm_wait_ms=%.2f "
           "opt_ms=%.2f peak_mem_mb=%.1f peak_state_mb=%.2f peak_host_mb=%.2f",
           workload, stage, where, world * devices, per_rank, (long long)whole->numel, (long long)steps, ms / steps,
           steps * (double)per_rank * devices * replicas * 1e3 / ms, gflops, p[DT_PHASE_DATA] / steps, p[DT_PHASE_FWD] / steps,
           p[DT_PHASE_BWD] / steps, r->bench_comm_ms / steps, r->bench_hidden_ms / steps, p[DT_PHASE_COMM] / steps,
           p[DT_PHASE_OPT] / steps, peak_mem / 1e6, peak_state / 1e6, peak_host / 1e6);
    if (language)                       /* gflops is then tokens/s x flops per token */
        printf(" tokens_per_s=%.1f flops_per_token=%.4g", tokens_per_s, dt_model_flops_per_token(whole));
    if (rep && rep->bench_fields) rep->bench_fields(who, stdout, cfg->accum_steps);   /* what the cost model needs of it */
    printf("\n");
    fflush(stdout);
}

/* ---- TensorBoard's event files ----------------------------------------------
   The protocol buffer is written by hand: an Event is field 1 (wall_time, a
   double: wire type 1), field 2 (step, a varint: wire type 0), field 3
   (file_version, bytes: wire type 2) or field 5 (summary, a message: wire
   type 2); a Summary holds Values (field 1), each a tag (field 1) and a
   simple_value (field 2, a float: wire type 5). A key byte is
   field << 3 | wire type. */
static int dt__mkdir_ok(const char *path) { return mkdir(path, 0777) == 0 || errno == EEXIST; }
/* A folder and the folders above it (mkdir -p); 0 with errno on failure. */
static int dt__mkdirs(const char *path) {
    char p[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof p) { errno = ENAMETOOLONG; return 0; }
    memcpy(p, path, n + 1);
    for (size_t i = 1; i < n; i++)
        if (p[i] == '/') {
            p[i] = 0;
            if (!dt__mkdir_ok(p)) return 0;
            p[i] = '/';
        }
    return dt__mkdir_ok(p);
}
/* A string as a YAML scalar, single-quoted (a quote doubled), as MLflow
   writes one that needs it: names and paths may hold ': ', '#' or quotes. */
static void dt__yaml_quote(char *out, size_t n, const char *s) {
    size_t k = 0;
    if (n < 3) { if (n) out[0] = 0; return; }
    out[k++] = '\'';
    for (; *s && k + 3 < n; s++) {
        if (*s == '\'') out[k++] = '\'';
        if (*s == '\n' || *s == '\r') continue;
        out[k++] = *s;
    }
    out[k++] = '\'';
    out[k] = 0;
}
struct dt_tensorboard {
    FILE *f;
    char path[4096];
};
uint32_t dt_crc32c(const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {          /* bit by bit: the records are a few dozen bytes */
        crc ^= p[i];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}
uint32_t dt_crc32c_masked(const void *data, size_t n) {
    uint32_t c = dt_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}
static void dt__le_put(uint8_t *out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) out[i] = (uint8_t)(v >> (8 * i));
}
static size_t dt__pb_varint(uint8_t *out, uint64_t v) {
    size_t n = 0;
    do {
        out[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}
/* A length-delimited field: key, length, the bytes. */
static size_t dt__pb_bytes(uint8_t *out, int field, const void *bytes, size_t n) {
    size_t k = 0;
    out[k++] = (uint8_t)(field << 3 | 2);
    k += dt__pb_varint(out + k, n);
    memcpy(out + k, bytes, n);
    return k + n;
}
static size_t dt__tb_event_head(uint8_t *out, double wall_time, int64_t step) {
    uint64_t bits;
    memcpy(&bits, &wall_time, sizeof bits);
    out[0] = 1 << 3 | 1;
    dt__le_put(out + 1, bits, 8);
    out[9] = 2 << 3 | 0;
    return 10 + dt__pb_varint(out + 10, (uint64_t)step);
}
static int dt__tb_record(dt_tensorboard *tb, const uint8_t *data, size_t n) {
    uint8_t head[12], tail[4];
    dt__le_put(head, n, 8);
    dt__le_put(head + 8, dt_crc32c_masked(head, 8), 4);
    dt__le_put(tail, dt_crc32c_masked(data, n), 4);
    return fwrite(head, 1, 12, tb->f) == 12 && fwrite(data, 1, n, tb->f) == n && fwrite(tail, 1, 4, tb->f) == 4 &&
           fflush(tb->f) == 0;
}
dt_tensorboard *dt_tensorboard_open(const char *dir) {
    if (!dt__mkdirs(dir)) return NULL;
    dt_tensorboard *tb = (dt_tensorboard *)calloc(1, sizeof *tb);
    if (!tb) return NULL;
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    double now = (double)time(NULL);
    dt__path(tb->path, sizeof tb->path, "%s/events.out.tfevents.%.0f.%s.%d", dir, now, host, (int)getpid());
    if (!(tb->f = fopen(tb->path, "wb"))) { free(tb); return NULL; }
    uint8_t ev[64];
    size_t n = dt__tb_event_head(ev, now, 0);
    n += dt__pb_bytes(ev + n, 3, "brain.Event:2", 13);
    if (!dt__tb_record(tb, ev, n)) { int err = errno; fclose(tb->f); free(tb); errno = err; return NULL; }
    return tb;
}
int dt_tensorboard_scalar(dt_tensorboard *tb, const char *tag, float value, int64_t step, double wall_time) {
    size_t len = strlen(tag);
    if (len > 200) { errno = EINVAL; return 0; }
    uint8_t v[220], summary[230], ev[260];
    size_t nv = dt__pb_bytes(v, 1, tag, len);
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    v[nv++] = 2 << 3 | 5;
    dt__le_put(v + nv, bits, 4);
    nv += 4;
    size_t ns = dt__pb_bytes(summary, 1, v, nv);
    size_t n = dt__tb_event_head(ev, wall_time, step);
    n += dt__pb_bytes(ev + n, 5, summary, ns);
    return dt__tb_record(tb, ev, n);
}
int dt_tensorboard_restart(dt_tensorboard *tb, int64_t step, double wall_time) {
    uint8_t ev[40], session_log[2] = { 1 << 3 | 0, 1 };    /* SessionLog { status: START } */
    size_t n = dt__tb_event_head(ev, wall_time, step);
    n += dt__pb_bytes(ev + n, 6, session_log, 2);
    return dt__tb_record(tb, ev, n);
}
int dt_tensorboard_close(dt_tensorboard *tb) {
    if (!tb) return 1;
    int ok = fflush(tb->f) == 0 && !ferror(tb->f), err = errno;
    if (fclose(tb->f) != 0 && ok) { ok = 0; err = errno; }
    free(tb);
    errno = err;
    return ok;
}
const char *dt_tensorboard_path(const dt_tensorboard *tb) { return tb->path; }

/* ---- MLflow's file store ------------------------------------------------------
   Plain files, so C writes them as MLflow's FileStore would: the YAML is
   flat (key: value), ids are digits (experiments) and 32 hex digits (runs),
   times are milliseconds since 1970. */
struct dt_mlflow {
    char exp_dir[4096], run_dir[4096], run_id[40], exp_id[24], name[256];
    int64_t start_ms;
};
static int64_t dt__unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
/* A whole small file, written and checked; 0 with errno on failure. */
static int dt__write_small(const char *path, const char *mode, const char *text) {
    FILE *f = fopen(path, mode);
    if (!f) return 0;
    int ok = fputs(text, f) >= 0 && fflush(f) == 0 && !ferror(f), err = errno;
    if (fclose(f) != 0 && ok) { ok = 0; err = errno; }
    errno = err;
    return ok;
}
/* The value of `key: ` in a flat YAML file, quotes dropped; 0 when absent. */
static int dt__yaml_value(const char *path, const char *key, char *out, size_t n) {
    FILE *f = fopen(path, "r");
    char line[1024];
    size_t k = strlen(key);
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f))
        if (!strncmp(line, key, k) && line[k] == ':' && line[k + 1] == ' ') {
            char *v = line + k + 2;
            v[strcspn(v, "\r\n")] = 0;
            size_t len = strlen(v);
            if (len >= 2 && v[0] == '\'' && v[len - 1] == '\'') {     /* quoted: '' is a quote */
                v[len - 1] = 0;
                char *w = v;
                for (char *r = v + 1; *r; r++) {
                    *w++ = *r;
                    if (r[0] == '\'' && r[1] == '\'') r++;
                }
                *w = 0;
            }
            dt__copy_str(out, n, v);
            found = 1;
        }
    if (f) fclose(f);
    return found;
}
static int dt__mlflow_meta(dt_mlflow *ml, dt_mlflow_status status, int64_t end_ms) {
    char path[4200], text[12288], end[32], uri[4300], q_uri[8700], q_name[520], q_user[200];
    if (end_ms > 0) snprintf(end, sizeof end, "%lld", (long long)end_ms);
    else snprintf(end, sizeof end, "null");
    const char *user = getenv("USER");
    dt__path(uri, sizeof uri, "file://%s/artifacts", ml->run_dir);
    dt__yaml_quote(q_uri, sizeof q_uri, uri);
    dt__yaml_quote(q_name, sizeof q_name, ml->name);
    dt__yaml_quote(q_user, sizeof q_user, user && *user ? user : "dtrain");
    dt__path(text, sizeof text,
             "artifact_uri: %s\nend_time: %s\nentry_point_name: ''\nexperiment_id: '%s'\n"
             "lifecycle_stage: active\nrun_id: '%s'\nrun_name: %s\nsource_name: ''\nsource_type: 4\nsource_version: ''\n"
             "start_time: %lld\nstatus: %d\ntags: []\nuser_id: %s\n",
             q_uri, end, ml->exp_id, ml->run_id, q_name, (long long)ml->start_ms, (int)status, q_user);
    dt__path(path, sizeof path, "%s/meta.yaml", ml->run_dir);
    return dt__write_small(path, "w", text);
}
static int dt__mlflow_experiment(const char *dir, const char *id, const char *name) {
    char path[4200], text[12288], uri[4300], q_uri[8700], q_name[520];
    int64_t now = dt__unix_ms();
    dt__path(path, sizeof path, "%s/%s", dir, id);
    if (!dt__mkdir_ok(path)) return 0;
    dt__path(uri, sizeof uri, "file://%s/%s", dir, id);
    dt__yaml_quote(q_uri, sizeof q_uri, uri);
    dt__yaml_quote(q_name, sizeof q_name, name);
    dt__path(text, sizeof text, "artifact_location: %s\ncreation_time: %lld\nexperiment_id: '%s'\n"
             "last_update_time: %lld\nlifecycle_stage: active\nname: %s\n", q_uri, (long long)now, id, (long long)now, q_name);
    dt__path(path, sizeof path, "%s/%s/meta.yaml", dir, id);
    return dt__write_small(path, "w", text);
}
static int dt__all_digits(const char *s) { return *s && strspn(s, "0123456789") == strlen(s); }
int dt_mlflow_run_id_valid(const char *id) { return id && strlen(id) == 32 && strspn(id, "0123456789abcdef") == 32; }
dt_mlflow *dt_mlflow_open(const char *dir, const char *experiment, const char *run_name, const char *run_id) {
    char abs[4096], cwd[4096] = "", path[4200], value[256];
    if (!dt__mkdirs(dir) || (dir[0] != '/' && !getcwd(cwd, sizeof cwd))) return NULL;
    dt__path(abs, sizeof abs, "%s%s%s", cwd, cwd[0] ? "/" : "", dir);    /* MLflow's URIs are absolute */
    dt_mlflow *ml = (dt_mlflow *)calloc(1, sizeof *ml);
    if (!ml) return NULL;
    dt__copy_str(ml->name, sizeof ml->name, run_name);
    dt__path(path, sizeof path, "%s/0/meta.yaml", abs);        /* MLflow's Default experiment, as it makes it */
    if (access(path, F_OK) != 0 && !dt__mlflow_experiment(abs, "0", "Default")) { free(ml); return NULL; }
    /* the experiment of this name (MLflow's own ids are 18 random digits),
       or a new one, numbered after the largest id there */
    unsigned long long largest = 0;
    DIR *d = opendir(abs);
    for (struct dirent *e; d && !ml->exp_id[0] && (e = readdir(d));) {
        if (!dt__all_digits(e->d_name) || strlen(e->d_name) >= sizeof ml->exp_id) continue;
        unsigned long long id = strtoull(e->d_name, NULL, 10);
        if (id > largest) largest = id;
        dt__path(path, sizeof path, "%s/%s/meta.yaml", abs, e->d_name);
        if (dt__yaml_value(path, "name", value, sizeof value) && !strcmp(value, experiment))
            dt__copy_str(ml->exp_id, sizeof ml->exp_id, e->d_name);
    }
    if (d) closedir(d);
    if (!ml->exp_id[0]) {
        snprintf(ml->exp_id, sizeof ml->exp_id, "%llu", largest + 1);
        if (!dt__mlflow_experiment(abs, ml->exp_id, experiment)) { free(ml); return NULL; }
    }
    dt__path(ml->exp_dir, sizeof ml->exp_dir, "%s/%s", abs, ml->exp_id);
    if (run_id && *run_id) {                                   /* continue it: its start and name stay */
        if (!dt_mlflow_run_id_valid(run_id)) { free(ml); errno = EINVAL; return NULL; }
        dt__copy_str(ml->run_id, sizeof ml->run_id, run_id);
        dt__path(ml->run_dir, sizeof ml->run_dir, "%s/%s", ml->exp_dir, run_id);
        dt__path(path, sizeof path, "%s/meta.yaml", ml->run_dir);
        if (!dt__yaml_value(path, "start_time", value, sizeof value)) { free(ml); errno = ENOENT; return NULL; }
        ml->start_ms = strtoll(value, NULL, 10);
        if (dt__yaml_value(path, "run_name", value, sizeof value)) dt__copy_str(ml->name, sizeof ml->name, value);
    } else {                                                   /* a new run: 128 random bits, as a uuid4's hex */
        uint8_t bits[16];
        FILE *r = fopen("/dev/urandom", "rb");
        size_t got = r ? fread(bits, 1, sizeof bits, r) : 0;
        if (r) fclose(r);
        uint64_t mix = (uint64_t)dt__unix_ms() * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
        for (size_t i = got; i < sizeof bits; i++) { mix = mix * 6364136223846793005ull + 1442695040888963407ull; bits[i] = (uint8_t)(mix >> 56); }
        for (int i = 0; i < 16; i++) snprintf(ml->run_id + 2 * i, 3, "%02x", bits[i]);
        dt__path(ml->run_dir, sizeof ml->run_dir, "%s/%s", ml->exp_dir, ml->run_id);
        ml->start_ms = dt__unix_ms();
    }
    static const char *const parts[4] = { "metrics", "params", "tags", "artifacts" };
    int ok = dt__mkdir_ok(ml->run_dir);
    for (int i = 0; i < 4 && ok; i++) {
        dt__path(path, sizeof path, "%s/%s", ml->run_dir, parts[i]);
        ok = dt__mkdir_ok(path);
    }
    if (!ok || !dt__mlflow_meta(ml, DT_MLFLOW_RUNNING, 0) || !dt_mlflow_tag(ml, "mlflow.runName", ml->name)) {
        int err = errno;
        free(ml);
        errno = err;
        return NULL;
    }
    return ml;
}
static int dt__mlflow_key_file(dt_mlflow *ml, const char *part, const char *key, const char *mode, const char *text) {
    char path[4400];
    if (!*key || strstr(key, "..") || key[0] == '/') { errno = EINVAL; return 0; }   /* a key is a file name (a/b: a folder) */
    dt__path(path, sizeof path, "%s/%s/%s", ml->run_dir, part, key);
    return dt__write_small(path, mode, text);
}
int dt_mlflow_param(dt_mlflow *ml, const char *key, const char *value) { return dt__mlflow_key_file(ml, "params", key, "w", value); }
int dt_mlflow_tag(dt_mlflow *ml, const char *key, const char *value) { return dt__mlflow_key_file(ml, "tags", key, "w", value); }
int dt_mlflow_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms) {
    char line[128];
    snprintf(line, sizeof line, "%lld %.9g %lld\n", (long long)timestamp_ms, value, (long long)step);
    return dt__mlflow_key_file(ml, "metrics", key, "a", line);
}
int dt_mlflow_close(dt_mlflow *ml, dt_mlflow_status status) {
    if (!ml) return 1;
    int ok = dt__mlflow_meta(ml, status, dt__unix_ms()), err = errno;
    free(ml);
    errno = err;
    return ok;
}
const char *dt_mlflow_path(const dt_mlflow *ml) { return ml->run_dir; }
const char *dt_mlflow_run_id(const dt_mlflow *ml) { return ml->run_id; }

/* [src/24-cost-model.h] */
/* ==== the cost model ========================================================
   Why a stage scales as it does. It is deliberately small -- a link of two
   numbers, ring collectives, and what each wrapper sends and can hide -- so
   that a student can check it by hand (tests/24-cost-model.c does) and see
   which lever moves the answer. --explain prints it for a run. */

/* Rough figures, to be replaced by measured ones (tools/collectives --bench
   measures "shm"; nccl-tests measures a GPU link). Bus bandwidth per rank:
   - shm: this project's shared-memory ring on a 2-core machine (2 ranks, 2026-11-21);
   - pcie: GPUs talking through PCIe 4.0 x16 and the host, no NVLink;
   - nvlink: 8 H100 SXM GPUs on NVLink 4 and NVSwitch, as nccl-tests all-reduce reaches;
   - infiniband: one HDR 200 Gb/s NIC per GPU, between machines. */
int dt_link_preset(const char *name, dt_link *out) {
    static const struct { const char *name; double us, gbs; } presets[] = {
        { "shm", 15, 5 }, { "pcie", 10, 16 }, { "nvlink", 10, 400 }, { "infiniband", 8, 24 } };
    size_t len = strlen(name);
    memset(out, 0, sizeof *out);         /* an unknown name leaves an empty link, not the caller's garbage */
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (strlen(presets[i].name) == len && !memcmp(name, presets[i].name, len)) {
            dt__copy_str(out->name, sizeof out->name, name);
            out->latency_us = presets[i].us;
            out->bandwidth_gbs = presets[i].gbs;
            return 1;
        }
    return 0;
}

/* A ring all-reduce is a reduce-scatter then an all-gather: 2(N-1) hops, each
   moving 1/N of the buffer. */
double dt_cost_all_reduce_ms(const dt_link *link, int n, double bytes) {
    if (n <= 1) return 0;
    return 2.0 * (n - 1) * link->latency_us / 1e3 + 2.0 * (n - 1) / n * bytes / (link->bandwidth_gbs * 1e9) * 1e3;
}
double dt_cost_all_gather_ms(const dt_link *link, int n, double bytes) {
    if (n <= 1) return 0;
    return (double)(n - 1) * link->latency_us / 1e3 + (double)(n - 1) / n * bytes / (link->bandwidth_gbs * 1e9) * 1e3;
}

int dt_cost_ddp_buckets(double params, double bucket_mb) {
    if (bucket_mb <= 0) return 1;
    return 1 + (int)ceil(fmax(0, 4 * params - 1048576) / (bucket_mb * 1048576.0));
}

dt_cost_prediction dt_cost_predict(const dt_cost_input *in, const dt_link *l, int n) {
    dt_cost_prediction p;
    memset(&p, 0, sizeof p);
    int K = in->accum_steps > 0 ? in->accum_steps : 1, msgs = in->messages > 0 ? in->messages : 1;
    /* every rank of the job shares the device(s), not only the n of one
       group or pipeline: a layout of one stage or one group still has D x T */
    int groups = (in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP) && in->dp_groups > 1 ? in->dp_groups : 1;
    int everyone = n * groups * (in->kind == DT_PAR_PP && in->tp_ranks > 1 ? in->tp_ranks : 1);
    double slow = everyone > 1 && in->contention > 0 ? in->contention : 1.0;
    double c = in->compute_ms * slow;                                      /* one micro-batch */
    int sharded = in->kind == DT_PAR_ZERO1 || in->kind == DT_PAR_ZERO2 || in->kind == DT_PAR_ZERO3;
    double G = in->params * in->reduce_bytes, W = in->params * in->gather_bytes, lat = l->latency_us / 1e3;
    double share = n > 1 ? (double)(n - 1) / n : 0;
    p.ranks = n;
    p.compute_ms = K * c + in->optimizer_ms * slow / (sharded ? n : 1);
    if (n > 1 || in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP) switch (in->kind) {   /* --tp 1: groups */
    case DT_PAR_NONE: break;
    case DT_PAR_DDP:            /* one all-reduce per bucket, once per step, behind the last backward */
        p.comm_ms = dt_cost_all_reduce_ms(l, n, G) + (msgs - 1) * 2.0 * (n - 1) * lat;
        p.exposed_ms = fmax(0, p.comm_ms - in->backward_share * c);
        p.bytes = 2 * share * G;
        break;
    case DT_PAR_DP:             /* parameters out to every device, gradients back: device 0 waits for both */
        p.comm_ms = dt_cost_all_reduce_ms(l, n, 4 * in->params);
        p.exposed_ms = p.comm_ms;
        p.bytes = 2 * share * 4 * in->params;
        break;
    case DT_PAR_ZERO1: case DT_PAR_ZERO2:   /* reduce-scatter the gradients, all-gather the new parameters */
        p.comm_ms = dt_cost_all_gather_ms(l, n, G) + dt_cost_all_gather_ms(l, n, W) + (msgs - 1) * 2.0 * (n - 1) * lat;
        p.exposed_ms = p.comm_ms;
        p.bytes = share * (G + W);
        break;
    case DT_PAR_TP: {           /* the split layers' compute divided; each sum waited for where it stands */
        double kept = in->tp_share / n + (1 - in->tp_share);
        int D = in->dp_groups > 1 ? in->dp_groups : 1;
        double grads = in->params * kept * in->reduce_bytes;              /* this rank's, averaged over the groups */
        double zero = in->dp_shard == 3 ? 1.5 : 1;                        /* sharded over the groups: ZeRO-3 gathers twice */
        p.compute_ms = K * c * kept + in->optimizer_ms * slow * kept / (in->dp_shard ? D : 1);
        p.comm_ms = K * in->tp_sums * dt_cost_all_reduce_ms(l, n, in->tp_bytes) + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.exposed_ms = p.comm_ms;
        p.bytes = K * in->tp_sums * 2 * share * in->tp_bytes + zero * 2.0 * (D - 1) / D * grads;
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * D);
        return p;
    }
    case DT_PAR_PP: {           /* M micro-batches through n stages: M + n - 1 turns of the slowest stage */
        int M = in->pp_micro_batches > 0 ? in->pp_micro_batches : 1, D = in->dp_groups > 1 ? in->dp_groups : 1;
        int T = in->tp_ranks > 1 ? in->tp_ranks : 1;
        double stage = fmin(1, (in->pp_balance > 0 ? in->pp_balance : 1.0) / n);
        double kept = T > 1 ? in->tp_share / T + (1 - in->tp_share) : 1;    /* each of a stage's T ranks: its share */
        double turn = K * c * stage * kept / M;                           /* one micro-batch's forward + backward */
        double sums = T > 1 ? K * in->tp_sums * stage * dt_cost_all_reduce_ms(l, T, in->tp_bytes) : 0;   /* ... its sums */
        double hop = n > 1 ? lat + in->pp_bytes / (l->bandwidth_gbs * 1e9) * 1e3 : 0;
        double grads = in->params * stage * kept * in->reduce_bytes;
        double zero = in->dp_shard == 3 ? 1.5 * M : in->dp_shard == 2 ? (M + 1) / 2.0 : 1;   /* times DDP's average */
        /* the turns of the bubble, with their sums, count with compute, as
           the turns of the fill and the drain always have */
        p.compute_ms = (M + n - 1) * turn + (n - 1) * sums + in->optimizer_ms * slow * stage * kept / (in->dp_shard ? D : 1);
        /* every message but those of the fill and the drain arrives while
           the stage computes (its receive is posted early); the layers'
           sums stand in each turn, where nothing hides them */
        p.comm_ms = M * sums + 2 * M * hop + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.exposed_ms = M * sums + 2 * (n - 1) * hop + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.bytes = (n > 1 ? 2 * M * in->pp_bytes * (n - 1) / n : 0) + 2.0 * (T - 1) / T * M * K * in->tp_sums * stage * in->tp_bytes +
                  zero * 2.0 * (D - 1) / D * grads;
        p.bubble = (double)(n - 1) / (M + n - 1);
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * T * D);
        return p;
    }
    case DT_PAR_CP: {           /* 1/n of every sequence's tokens a rank; the keys and values go around a ring */
        int D = in->dp_groups > 1 ? in->dp_groups : 1, L = in->cp_layers > 0 ? in->cp_layers : 1;
        double a = in->cp_attention_share, bal = in->cp_contiguous ? (2.0 * n - 1) / n : 1;
        double busiest = c * ((1 - a) + a * bal) / n;                       /* the slowest rank's micro-batch */
        double kv = in->cp_kv_bytes / n, per_ms = l->bandwidth_gbs * 1e6;  /* a block; bytes a millisecond */
        double hop = lat + kv / per_ms;
        double block = c * a / ((double)L * n * n);      /* one block's attention, forward and backward */
        double fwd = (n - 1) * fmax(0, hop - block * (1 - in->backward_share));
        double bwd = n > 1 ? (n - 1) * fmax(0, 2 * hop - block * in->backward_share) + hop : 0;   /* + the sums home */
        double grads = in->params * in->reduce_bytes, zero = in->dp_shard == 3 ? 1.5 : 1;
        double sync = zero * dt_cost_all_reduce_ms(l, n * D, grads);
        p.compute_ms = K * busiest + in->optimizer_ms * slow / (in->dp_shard ? n * D : 1);
        p.comm_ms = K * L * (n > 1 ? (3.0 * n - 2) * hop : 0) + sync;
        p.exposed_ms = K * L * (fwd + bwd) + (in->dp_shard ? sync : fmax(0, sync - in->backward_share * busiest));
        p.bytes = (n > 1 ? K * L * kv * (3.0 * (n - 1) + 1) : 0) + zero * 2.0 * (n * D - 1) / (n * D) * grads;
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * D);
        return p;
    }
    case DT_PAR_ZERO3: {        /* every micro-batch gathers twice, prefetched behind compute; one reduce-scatter */
        double gathers = 2 * (dt_cost_all_gather_ms(l, n, W) + (msgs - 1) * (n - 1) * lat);
        double scatter = dt_cost_all_gather_ms(l, n, G) + (msgs - 1) * (n - 1) * lat;
        p.comm_ms = K * gathers + scatter;
        p.exposed_ms = K * fmax(0, gathers - c * (msgs - 1) / msgs) + scatter;
        p.bytes = share * (2 * K * W + G);
        break;
    }
    }
    p.step_ms = p.compute_ms + p.exposed_ms;
    p.speedup = p.step_ms > 0 ? n * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
    p.efficiency = p.speedup / n;
    return p;
}

void dt_cost_explain(FILE *out, const dt_cost_input *in, const dt_link *l, int n) {
    static const char *kinds[] = { "one rank", "DataParallel", "DDP", "FSDP ZeRO-1", "FSDP ZeRO-2", "FSDP ZeRO-3",
                                   "tensor parallel", "pipeline parallel", "context parallel" };
    dt_cost_prediction p = dt_cost_predict(in, l, n);
    int T = in->kind == DT_PAR_PP && in->tp_ranks > 1 ? in->tp_ranks : 1;     /* a pipeline's stages split too */
    fprintf(out, "cost model: %s on %d %s%s over %s (%.0f GB/s, %.0f us), %.2fM parameters\n", kinds[in->kind], n,
            in->kind == DT_PAR_PP ? "stage" : "rank", n == 1 ? "" : "s", l->name, l->bandwidth_gbs, l->latency_us, in->params / 1e6);
    if (T > 1)
        fprintf(out, "  x %d ranks splitting each stage's layers (--tp %d): %.0f%% of the compute split, %.1f sums of %.0f KB "
                "per micro-batch in all, none hidden\n", T, T, 100 * in->tp_share, in->tp_sums, in->tp_bytes / 1e3);
    static const char *const sharded[2][4] = {      /* by dt_cost_input's dp_shard, for groups and for pipelines */
        { "", "; the optimizer state sharded over them", "; the optimizer state and the gradients sharded over them",
          "; the pieces sharded over them (ZeRO-3: the parameters gathered twice)" },
        { "", "; the optimizer state sharded over them", "; the optimizer state and the gradients sharded over them "
          "(each micro-batch's reduce-scattered)", "; the pieces sharded over them (ZeRO-3: each micro-batch gathers the "
          "parameters twice, reduce-scatters its gradients)" } };
    if (in->kind == DT_PAR_CP)
        fprintf(out, "  each sequence split over the %d ranks (%s): attention is %.0f%% of the compute, the busiest rank's "
                "%.2fx the mean's;\n  in each of %d layers the ring sends %.0f KB blocks %d time%s forward and %d back, and "
                "their gradient sums %d time%s (all but the last behind attention)\n", n, in->cp_contiguous ? "contiguous" : "every rank the same work",
                100 * in->cp_attention_share, in->cp_contiguous ? (2.0 * n - 1) / n : 1.0, in->cp_layers,
                in->cp_kv_bytes / n / 1e3, n - 1, n == 2 ? "" : "s", n - 1, n > 1 ? n : 0, n == 1 ? "" : "s");
    if ((in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP) && in->dp_groups > 1)
        fprintf(out, "  x %d data-parallel %s of %d ranks: %d ranks in all, each its own batch%s\n", in->dp_groups,
                in->kind != DT_PAR_PP ? "groups" : "pipelines", n * T, in->dp_groups * n * T,
                sharded[in->kind == DT_PAR_PP][in->dp_shard >= 0 && in->dp_shard <= 3 ? in->dp_shard : 0]);
    if (in->kind == DT_PAR_PP && n > 1)
        fprintf(out, "  %d micro-batches through %d stages: the bubble is (P - 1) / (M + P - 1) = %.0f%% of the step "
                "(measured on this rank: %.0f%%)\n", in->pp_micro_batches > 0 ? in->pp_micro_batches : 1, n, 100 * p.bubble,
                100 * in->pp_measured_bubble);
    fprintf(out, "  compute %.2f ms a step per rank; communication %.2f ms (%.1f MB sent per rank), %.2f ms of it not "
            "hidden\n", p.compute_ms, p.comm_ms, p.bytes / 1e6, p.exposed_ms);
    if (p.comm_ms > 0) fprintf(out, "  compute : communication = %.1f : 1", p.compute_ms / p.comm_ms);
    else fprintf(out, "  no communication");
    fprintf(out, "  ->  predicted speedup %.2fx over one rank, efficiency %.0f%%\n", p.speedup, 100 * p.efficiency);
    if (n <= 1 || in->kind == DT_PAR_NONE) return;
    /* what would change it: each lever alone */
    dt_cost_input big = *in, acc = *in, half = *in;
    big.compute_ms *= 2;
    big.tp_bytes *= 2;                   /* tensor parallelism sums activations: they double too */
    big.cp_kv_bytes *= 2;                /* ... and context parallelism's ring blocks */
    acc.accum_steps = (in->accum_steps > 0 ? in->accum_steps : 1) * 4;
    half.reduce_bytes = half.gather_bytes = 2;
    half.tp_bytes /= 2;
    dt_cost_prediction pb = dt_cost_predict(&big, l, n), pa = dt_cost_predict(&acc, l, n), ph = dt_cost_predict(&half, l, n);
    dt_cost_prediction pf = dt_cost_predict(in, l, n / 2 > 1 ? n / 2 : 1);
    fprintf(out, "  what would change it (efficiency now %.0f%%):\n", 100 * p.efficiency);
    if (in->kind == DT_PAR_PP) {
        dt_cost_input more = *in;
        more.pp_micro_batches = (in->pp_micro_batches > 0 ? in->pp_micro_batches : 1) * 4;
        more.pp_bytes /= 4;
        more.tp_bytes /= 4;
        fprintf(out, "    4x --micro-batches:              %.0f%% (the bubble shrinks; each micro-batch is smaller)\n",
                100 * dt_cost_predict(&more, l, n).efficiency);
    } else if (in->kind == DT_PAR_CP) {
        dt_cost_input even = *in;
        even.cp_contiguous = 0;
        fprintf(out, "    twice the batch per group:       %.0f%% (compute and the ring's blocks both double)\n", 100 * pb.efficiency);
        if (in->cp_contiguous)
            fprintf(out, "    --cp-layout zigzag:              %.0f%% (every rank the same attention work)\n",
                    100 * dt_cost_predict(&even, l, n).efficiency);
    } else if (in->kind == DT_PAR_TP) {
        fprintf(out, "    twice the batch per group:       %.0f%% (compute and the activations summed both double)\n",
                100 * pb.efficiency);
        fprintf(out, "    bf16 activations:                %.0f%% (half the bytes of every sum; 06 has no --dtype yet)\n",
                100 * ph.efficiency);
    } else {
        fprintf(out, "    twice the batch per rank:        %.0f%% (compute doubles, communication does not)\n", 100 * pb.efficiency);
        fprintf(out, "    4x --accum-steps:                %.0f%% (gradients travel once per 4 micro-batches)\n", 100 * pa.efficiency);
    }
    if (in->kind != DT_PAR_TP && in->kind != DT_PAR_PP && in->kind != DT_PAR_CP && (in->reduce_bytes > 2 || (in->kind == DT_PAR_ZERO3 && in->gather_bytes > 2)))
        fprintf(out, "    bf16 communication:              %.0f%% (half the bytes)\n", 100 * ph.efficiency);
    char fewer[64];
    if (in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP)
        snprintf(fewer, sizeof fewer, "--%s %d instead of %d:", in->kind == DT_PAR_TP ? "tp" : in->kind == DT_PAR_PP ? "pp" : "cp",
                 pf.ranks, n);
    else snprintf(fewer, sizeof fewer, "%d rank%s instead of %d:", pf.ranks, pf.ranks > 1 ? "s" : "", n);
    fprintf(out, "    %-33s%.0f%% (%.2fx speedup)\n", fewer, 100 * pf.efficiency, pf.speedup);
}

/* [src/25-command-line.h] */
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
                                                "06-tensor-parallel", "07-pipeline-parallel", "08-context-parallel" };
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
    { "--data", "12345678", "DIR", "image folder (DIR/train/<class>/*, DIR/val/<class>/*) or CIFAR-10 binary folder; gpt: a .txt\n"
      "                          file or a folder of them, read as bytes (default: the synthetic set in data/synthetic,\n"
      "                          gpt: the text data/synthetic.txt, made on first use)", DT_ARG_STR, DT_CFG(data), NULL, DT_NOT_A_NUMBER },
    { "--tokens", "12345678", "FILE", "gpt, llama: train on token ids instead of bytes: a NumPy .npy array (uint16, uint32,\n"
      "                          int32 or int64), or raw little-endian uint16", DT_ARG_STR,
      DT_CFG(tokens), NULL, DT_NOT_A_NUMBER },
    { "--image-size", "12345678", "N", "images are resized to N x N (default 32)", DT_ARG_INT, DT_CFG(image_size), NULL, DT_RANGE(1, 4096) },
    { "--model", "12345678", "mlp|vit|gpt|llama", "the model (default mlp); gpt, llama: causal language models on text\n"
      "                          (GPT-2's layout, and Llama's: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)",
      DT_ARG_CHOICE, DT_CFG(model), "mlp|vit|gpt|llama", DT_NOT_A_NUMBER },
    { "--dim", "12345678", "N", "mlp: hidden width (1024); vit: embedding width (192); gpt, llama: (128)", DT_ARG_INT, DT_CFG(dim), NULL, DT_MIN(1) },
    { "--depth", "12345678", "N", "mlp: hidden layers (2); vit: transformer blocks (6); gpt, llama: (4)", DT_ARG_INT, DT_CFG(depth), NULL, DT_MIN(0) },
    { "--heads", "12345678", "N", "vit: attention heads (3); gpt, llama: (4)", DT_ARG_INT, DT_CFG(heads), NULL, DT_MIN(1) },
    { "--patch", "12345678", "N", "vit: patch size (4)", DT_ARG_INT, DT_CFG(patch), NULL, DT_MIN(1) },
    { "--seq-len", "12345678", "N", "gpt, llama: tokens per sequence, the context (default 64)", DT_ARG_INT, DT_CFG(seq_len), NULL, DT_RANGE(1, 65536) },
    { "--vocab", "12345678", "N", "gpt, llama: vocabulary (default: 256 for bytes, the largest id + 1 for --tokens)", DT_ARG_INT,
      DT_CFG(vocab), NULL, DT_RANGE(1, 16777216) },             /* ids are held as floats: exact to 2^24 */
    { "--sample", "12345678", "N", "gpt, llama: print N generated tokens (bytes) after each evaluation (default 0)", DT_ARG_INT,
      DT_CFG(sample), NULL, DT_MIN(0) },
    { "--kv-heads", "12345678", "N", "llama: key/value heads, each serving --heads / N query heads (default: half the heads\n"
      "                          when their number is even, else all of them)", DT_ARG_INT, DT_CFG(kv_heads), NULL, DT_MIN(1) },
    { "--ffn-dim", "12345678", "N", "llama: the SwiGLU MLP's width (default 8/3 x --dim, rounded up to a multiple of 32)",
      DT_ARG_INT, DT_CFG(ffn_dim), NULL, DT_MIN(1) },
    { "--rope-theta", "12345678", "X", "llama: the rotary embeddings' base (default 10000)", DT_ARG_FLOAT, DT_CFG(rope_theta), NULL,
      DT_ABOVE(1) },
    { "--norm-eps", "12345678", "X", "llama: RMSNorm's epsilon (default 1e-5)", DT_ARG_FLOAT, DT_CFG(norm_eps), NULL, DT_ABOVE(0) },
    { "--rope-factor", "12345678", "X", "llama: Llama 3's rescaled rotary frequencies (rope_type llama3, with the three below;\n"
      "                          default: none, or --init DIR's config.json): slow ones divided by X", DT_ARG_FLOAT,
      DT_CFG(rope_factor), NULL, DT_ABOVE(0) },
    { "--rope-low-freq", "12345678", "X", "llama 3: wavelengths over ORIGINAL / X are divided by --rope-factor", DT_ARG_FLOAT,
      DT_CFG(rope_low_freq), NULL, DT_ABOVE(0) },
    { "--rope-high-freq", "12345678", "X", "llama 3: wavelengths under ORIGINAL / X are kept (between: blended)", DT_ARG_FLOAT,
      DT_CFG(rope_high_freq), NULL, DT_ABOVE(0) },
    { "--rope-original-context", "12345678", "ORIGINAL", "llama 3: the context the frequencies were made for", DT_ARG_INT,
      DT_CFG(rope_original_context), NULL, DT_MIN(1) },
    { "--untied-head", "12345678", NULL, "llama: an lm_head.weight of its own (default: the head is the token embedding)",
      DT_ARG_SWITCH, DT_CFG(untied_head), NULL, DT_NOT_A_NUMBER },
    { "--qkv-bias", "12345678", NULL, "llama: biases on the q, k and v projections, as Qwen2 has", DT_ARG_SWITCH, DT_CFG(qkv_bias),
      NULL, DT_NOT_A_NUMBER },
    { "--batch-size", "12345678", "N", "images (gpt, llama: sequences) per step (default 128; gpt, llama 32)", DT_ARG_INT, DT_CFG(batch_size), NULL, DT_MIN(1) },
    { "--epochs", "12345678", "N", "passes over the training set (default 10; gpt, llama 2)", DT_ARG_INT, DT_CFG(epochs), NULL, DT_MIN(1) },
    { "--steps", "12345678", "N", "stop after N steps in all (default: run every epoch)", DT_ARG_I64, DT_CFG(steps), NULL, DT_MIN(0) },
    { "--lr", "12345678", "X", "peak learning rate (default 1e-3; gpt, llama 3e-3)", DT_ARG_FLOAT, DT_CFG(lr), NULL, DT_ABOVE(0) },
    { "--optimizer", "12345678", "adamw|sgd", "the optimizer (default adamw)", DT_ARG_CHOICE, DT_CFG(optimizer), "adamw|sgd", DT_NOT_A_NUMBER },
    { "--weight-decay", "12345678", "X", "decoupled weight decay of 2-D weights (default 0.05)", DT_ARG_FLOAT, DT_CFG(weight_decay),
      NULL, DT_MIN(0) },
    { "--momentum", "12345678", "X", "sgd momentum (default 0.9)", DT_ARG_FLOAT, DT_CFG(momentum), NULL, 0, 1, DT_HI_OPEN },
    { "--clip", "12345678", "X", "clip the gradient norm to X, 0 for none (default 1.0)", DT_ARG_FLOAT, DT_CFG(clip), NULL, DT_MIN(0) },
    { "--warmup", "12345678", "N", "linear warmup steps before the cosine decay (default 5% of the steps)", DT_ARG_I64, DT_CFG(warmup),
      NULL, DT_MIN(0) },
    { "--augment", "12345678", "0|1", "random crop + horizontal flip (default 1)", DT_ARG_INT, DT_CFG(augment), NULL, DT_RANGE(0, 1) },
    { "--seed", "12345678", "N", "seed for initialisation, shuffling and augmentation (default 1)", DT_ARG_I64, DT_CFG(seed), NULL, DT_MIN(0) },
    { "--device", "12345678", "cpu|cuda|auto", "where to train (default auto: cuda when a GPU is visible)", DT_ARG_CHOICE, DT_CFG(device),
      "cpu|cuda|auto", DT_NOT_A_NUMBER },
    { "--log", "12345678", "FILE", "write one JSON object per step, evaluation and summary", DT_ARG_STR, DT_CFG(log_path), NULL, DT_NOT_A_NUMBER },
    { "--tensorboard", "12345678", "DIR", "write the loss, learning rate, speed, memory and evaluation as TensorBoard event files in\n"
      "                          DIR (tensorboard --logdir DIR shows them; a resumed run adds a file)", DT_ARG_STR, DT_CFG(tensorboard),
      NULL, DT_NOT_A_NUMBER },
    { "--mlflow", "12345678", "DIR", "record the run in MLflow's file store in DIR, experiment \"dtrain\": flags as params, the\n"
      "                          figures of --log as metrics (MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri DIR;\n"
      "                          a resumed run continues its MLflow run)", DT_ARG_STR, DT_CFG(mlflow), NULL, DT_NOT_A_NUMBER },
    { "--trace", "12345678", "FILE", "write a Chrome/Perfetto trace of the step phases", DT_ARG_STR, DT_CFG(trace_path), NULL, DT_NOT_A_NUMBER },
    { "--save-dir", "12345678", "DIR", "write a checkpoint at the end of every epoch", DT_ARG_STR, DT_CFG(save_dir), NULL, DT_NOT_A_NUMBER },
    { "--resume", "12345678", "DIR|auto", "continue exactly where a checkpoint (a folder) stopped; auto: the newest in --save-dir (none: start\n"
      "                          fresh), what a requeued job runs after preemption", DT_ARG_STR, DT_CFG(resume), NULL, DT_NOT_A_NUMBER },
    { "--init", "12345678", "FILE|DIR", "start from these weights (safetensors, PyTorch/timm/Hugging Face names), a dtrain\n"
      "                          checkpoint, or a Hugging Face model folder (config.json gives the model and its shape)", DT_ARG_STR, DT_CFG(init),
      NULL, DT_NOT_A_NUMBER },
    { "--eval-every", "12345678", "N", "evaluate every N steps as well as after each epoch (default 0: epochs only)", DT_ARG_INT,
      DT_CFG(eval_every), NULL, DT_MIN(0) },
    { "--log-every", "12345678", "N", "print a progress line every N steps (default: about every 3 s, and each epoch's last step)",
      DT_ARG_INT, DT_CFG(log_every), NULL, DT_MIN(1) },
    { "--start-idx", "12345678", "N", "train on images [N, end) of the training set (default 0)", DT_ARG_I64, DT_CFG(start_idx), NULL, DT_MIN(0) },
    { "--end-idx", "12345678", "N", "... up to image N (default: all)", DT_ARG_I64, DT_CFG(end_idx), NULL, DT_MIN(1) },
    { "--bench", "12345678", NULL, "time this stage's training steps on random in-memory data, print one line, exit", DT_ARG_SWITCH,
      DT_CFG(bench), NULL, DT_NOT_A_NUMBER },
    { "--quiet", "12345678", NULL, "print only errors and the summary", DT_ARG_SWITCH, DT_CFG(quiet), NULL, DT_NOT_A_NUMBER },
    { "--peak-tflops", "12345678", "X", "--bench on a GPU: its peak for MFU (default: the fp32 peak, looked up by name; 05 with --dtype:\n"
      "                          give the 16-bit one)", DT_ARG_FLOAT, DT_CFG(peak_tflops), NULL, DT_ABOVE(0) },
    { "--nproc", "2345678", "N", "02: devices driven by this one process; 03-08: ranks started on this machine (default 1)", DT_ARG_INT,
      DT_CFG(nproc), NULL, DT_RANGE(1, DT_MAX_RANKS) },
    { "--shard", "45678", "optimizer|grads|full", "FSDP: shard optimizer state (ZeRO-1), + gradients (ZeRO-2), + parameters (ZeRO-3, default);\n"
      "                          06, 07: FSDP over the data-parallel groups, around the split layers or the pipelines\n"
      "                          (default: none, DDP)",
      DT_ARG_CHOICE, DT_CFG(shard), "optimizer|grads|full", DT_NOT_A_NUMBER },
    { "--cpu-offload", "45678", NULL, "FSDP: keep shards and optimizer state in host memory, step on the CPU", DT_ARG_SWITCH,
      DT_CFG(cpu_offload), NULL, DT_NOT_A_NUMBER },
    { "--recompute", "12345678", NULL, "activation checkpointing: keep each block's input and output only, run its forward again in\n"
      "                          backward (the same bits; less memory, one more forward per step)", DT_ARG_SWITCH, DT_CFG(recompute), NULL,
      DT_NOT_A_NUMBER },
    { "--attention", "1234567", "matmul|online", "attention: keep each head's T x T probabilities (matmul, the default), or\n"
      "                          FlashAttention's online softmax, which keeps T numbers a head and makes them again in\n"
      "                          backward (online: the same values within rounding; heads of at most 128 on a GPU)", DT_ARG_CHOICE,
      DT_CFG(attention), "matmul|online", DT_NOT_A_NUMBER },
    { "--lora-rank", "12345678", "R", "LoRA: freeze the model, train adapters of rank R beside the --lora-targets layers (saved\n"
      "                          in PEFT's layout; tools/merge-lora folds them in)", DT_ARG_INT, DT_CFG(lora_rank), NULL, DT_MIN(1) },
    { "--lora-alpha", "12345678", "A", "LoRA: the adapters' output is scaled by A / R (default 8)", DT_ARG_FLOAT, DT_CFG(lora_alpha),
      NULL, DT_ABOVE(0) },
    { "--lora-targets", "12345678", "NAMES", "LoRA: comma-separated layer names (default: gpt c_attn; llama q_proj,v_proj; vit qkv;\n"
      "                          mlp every layer; vit also proj, fc1, fc2, head; llama k_proj, o_proj, gate_proj, ...)",
      DT_ARG_STR, DT_CFG(lora_targets), NULL, DT_NOT_A_NUMBER },
    { "--accum-steps", "57", "N", "micro-batches of --batch-size per optimizer step; gradients add up locally (default 1;\n"
      "                          07: a pipeline's micro-batches are its accumulation: K x --micro-batches of a K x\n"
      "                          --batch-size step)", DT_ARG_INT, DT_CFG(accum_steps), NULL, DT_MIN(1) },
    { "--dtype", "578", "fp32|bf16|fp16", "activations and matmuls in this type, f32 master weights (default fp32; 07: the\n"
      "                          activations and gradients stages send too, and no fp16; 08: bf16 or fp32)",
      DT_ARG_CHOICE, DT_CFG(dtype), "fp32|bf16|fp16", DT_NOT_A_NUMBER },
    { "--reduce-dtype", "5", "fp32|bf16|fp16", "the type gradients are reduce-scattered in (default fp32)",
      DT_ARG_CHOICE, DT_CFG(reduce_dtype), "fp32|bf16|fp16", DT_NOT_A_NUMBER },
    { "--explain", "12345678", NULL, "after 3 steps, print the cost model's prediction for this run: speedup, compute : "
      "communication,\n                          and what would change it", DT_ARG_SWITCH, DT_CFG(explain), NULL, DT_NOT_A_NUMBER },
    { "--link", "1234567", "shm|pcie|nvlink|infiniband", "--explain: the link between ranks (default: shm on a CPU, nvlink on GPUs)",
      DT_ARG_CHOICE, DT_CFG(link), "shm|pcie|nvlink|infiniband", DT_NOT_A_NUMBER },
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
    { "--bucket-mb", "3678", "X", "DDP: all-reduce gradients in buckets of X MB during backward; 0: all at once after it (default 25)",
      DT_ARG_FLOAT, DT_CFG(bucket_mb), NULL, DT_MIN(0) },
    { "--comm", "345678", "shm|nccl|mpi|auto", "the ranks' transport: shared memory (one machine), NCCL (GPUs), MPI (CPUs on\n"
      "                          several machines, under mpirun or srun --mpi=pmix); default auto: NCCL on GPUs, else shm,\n"
      "                          or MPI when an MPI launcher started ranks on several machines", DT_ARG_CHOICE, DT_CFG(comm),
      "shm|nccl|mpi|auto", DT_NOT_A_NUMBER },
    { "--timeout", "2345678", "S", "stop when a rank (02: a device) has not answered for S seconds (default 60)", DT_ARG_FLOAT,
      DT_CFG(timeout), NULL, DT_ABOVE(0) },
    { "--ranks-per-gpu", "345678", "N", "let N ranks share one GPU (default 1: a GPU per rank; NCCL 2.30+ does it best)", DT_ARG_INT,
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
    printf("%s: train a model with dtrain\n\nusage: train [flags]\n\n", stage);
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
static void dt__apply_hf_model(dt_config *c, const dt__hf_config *hc, const unsigned char *given) {
    int llama = !strcmp(hc->model_type, "llama"), qwen2 = !strcmp(hc->model_type, "qwen2"), gpt2 = !strcmp(hc->model_type, "gpt2");
    if (!llama && !qwen2 && !gpt2)
        dt_usage_error("%s: model_type \"%s\" is not one dtrain trains (llama, qwen2, gpt2)", hc->path, hc->model_type);
    dt_model_kind kind = gpt2 ? DT_MODEL_GPT : DT_MODEL_LLAMA;
    if (dt__given(given, "--model") && c->model != kind)
        dt_usage_error("--model %s contradicts \"model_type\": \"%s\" in %s", dt__family((dt_model_kind)c->model)->name,
                       hc->model_type, hc->path);
    c->model = kind;
}
/* The shape: over the defaults. */
static void dt__apply_hf_shape(dt_config *c, dt__hf_config hc, const unsigned char *given) {
    int llama = !strcmp(hc.model_type, "llama"), qwen2 = !strcmp(hc.model_type, "qwen2"), gpt2 = !strcmp(hc.model_type, "gpt2");
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
    if (hc.use_sliding_window > 0 && hc.sliding_window != -1 && hc.sliding_window < c->seq_len)
        dt_usage_error("%s: sliding-window attention of %g tokens, shorter than --seq-len %d: dtrain attends to the whole "
                       "context", hc.path, hc.sliding_window, c->seq_len);
    if (hc.hidden_act[0] && strcmp(hc.hidden_act, "silu"))
        dt_usage_error("%s: hidden_act \"%s\"; dtrain's SwiGLU uses silu", hc.path, hc.hidden_act);
    if (llama && hc.qkv_bias > 0)
        dt_usage_error("%s: attention_bias true (biases on o_proj too) is not supported; Qwen2's q/k/v biases are", hc.path);
    /* Hugging Face's defaults where the file says nothing */
    if (hc.kv_heads == -1) hc.kv_heads = hc.heads;
    if (hc.rope_theta == -1) hc.rope_theta = 10000;
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
    c.nproc = 1; c.timeout = 60; c.ranks_per_gpu = 1; c.bucket_mb = 25; c.shard = 2; c.accum_steps = 1; c.link = -1;
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
    if ((dt__stage_takes(stage, "--tp") || dt__stage_takes(stage, "--cp")) && !dt__given(given, "--shard"))
        c.shard = DT_SHARD_NONE;                                            /* 06-08: DDP's */
    if (dt__stage_takes(stage, "--pp") && !dt__given(given, "--tp")) c.tp = 1;      /* 07: whole layers in each stage */
    if (dt__stage_takes(stage, "--cp") && c.dtype == DT_F16)
        dt_usage_error("--dtype fp16: fp16 needs its loss scaled (stage 05), which 08 does not do; use --dtype bf16, whose "
                       "range is f32's");
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

/* [src/26-run-driver.h] */
/* ==== the run driver ========================================================
   The loop every stage shares around its lesson: start (--init, --resume),
   fetch batches, end each step (the job's mean loss, progress, the log),
   evaluate and save at each epoch's end, stop every rank alike on a signal,
   and finish with the summary. It calls every chapter above and none calls it. */

/* The wrappers' reports, each defined at its chapter's end (after this). */
extern const dt_parallel_report dt__fsdp_report, dt__tp_report, dt__pp_report, dt__cp_report;
const dt_parallel_report *dt_parallel_report_of(dt_parallel *par, dt_parallel **owner) {
    static const dt_parallel_report *const reports[] = { &dt__fsdp_report, &dt__tp_report, &dt__pp_report, &dt__cp_report };
    for (; par; par = par->inner)
        for (size_t i = 0; i < sizeof reports / sizeof reports[0]; i++)
            if (!strcmp(reports[i]->create_fn, par->create_fn)) {
                *owner = par;
                return reports[i];
            }
    *owner = NULL;
    return NULL;
}

/* The stop signal this rank caught, if any. */
static int dt__local_stop_signal(void) {
#ifdef DT_TESTING
    if (getenv("DT_TEST_STOP_AT_STEP") && dt__ctx.rank == 0 && !dt__stop_signal) {
        /* Preemption tests: at step N rank 0 sends SIGTERM to its launcher (or to itself) and waits until the
           signal comes back to it, so the job stops at that step however busy the machine is. */
        static int64_t calls;
        if (++calls == atoll(getenv("DT_TEST_STOP_AT_STEP"))) {
            kill(dt__launched_here() ? getppid() : getpid(), SIGTERM);
            for (int i = 0; i < 5000 && !dt__stop_signal; i++) { struct timespec ts = { 0, 1000000 }; nanosleep(&ts, NULL); }
        }
    }
#endif
    return dt__stop_signal;
}

/* The loss of the whole job's batch -- the mean of the ranks' means -- and
   the stop signals the ranks caught, in one all-reduce: they ride beside the
   loss, so every rank stops after the same step and agreeing costs no
   collective of its own. Each kind of signal is counted in its own digit of
   base W + 1, which the mean keeps exact, so every rank reads back the same
   answer: preempted (SIGTERM, then SIGUSR1) before Ctrl-C, and a rank that
   caught nothing yet stops on that one too. */
static int dt__job_mean_loss(dt_tensor *loss, int stop) {
    if (!dt__ctx.job || dt__ctx.world_size == 1) return stop;
    int W = dt__ctx.world_size;
    long base = W + 1;
    float host[2], *both = (float *)dt__step_alloc_on(dt__ctx.device, sizeof host);
    dt_download(host, loss->data, sizeof(float));
    host[1] = (float)(stop == SIGINT ? 1 : stop == SIGUSR1 ? base : stop == SIGTERM ? base * base : 0);
    dt_upload(both, host, sizeof host);
    dt_all_reduce(dt__ctx.job, both, both, 2, DT_F32, DT_AVG);
    dt_download(host, both, sizeof host);
    dt_upload(loss->data, host, sizeof(float));
    long caught = lround((double)host[1] * W);
    return caught / (base * base) ? SIGTERM : caught / base % base ? SIGUSR1 : caught % base ? SIGINT : 0;
}

/* One scalar of this step for --tensorboard (rank 0's file); a failed write
   stops the run, naming the folder, as a failed --log write does. */
static void dt__tensorboard_scalar(dt_run *r, const char *tag, double value) {
    if (!r->tb) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (!dt_tensorboard_scalar(r->tb, tag, (float)value, r->step, (double)ts.tv_sec + ts.tv_nsec * 1e-9))
        dt__write_failed("--tensorboard", dt_tensorboard_path(r->tb), errno);
}

/* --mlflow: the run in the file store (rank 0), its flags as params and
   what it is as tags; resumed from a checkpoint of an MLflow run, that run
   goes on (its metrics continue at the next step). */
/* --tensorboard: a folder of this run's own in DIR (TensorBoard takes each
   folder for a run, and would join two runs' files in one into a single
   zig-zag curve), named by stage, model and start time; resumed, the
   checkpoint names it, and a START record at the next step tells TensorBoard
   to drop what the run logged after that checkpoint. */
static void dt__tensorboard_start(dt_run *r) {
    const dt_config *c = &r->cfg;
    char dir[4400];
    int resumed = r->tensorboard_run[0] != 0;
    if (!resumed) {
        time_t now = time(NULL);
        struct tm t;
        localtime_r(&now, &t);
        snprintf(r->tensorboard_run, sizeof r->tensorboard_run, "%s-%s-%04d%02d%02d-%02d%02d%02d-%ld", c->stage,   /* the pid: */
                 dt__model_kind_name(r->model->cfg.kind), t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min,
                 t.tm_sec, (long)getpid());                        /* runs started in one second each have their own */
    }
    dt__path(dir, sizeof dir, "%s/%s", c->tensorboard, r->tensorboard_run);
    if (!(r->tb = dt_tensorboard_open(dir))) dt_fail("cannot write --tensorboard '%s': %s", dir, strerror(errno));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (resumed && !dt_tensorboard_restart(r->tb, r->step + 1, (double)ts.tv_sec + ts.tv_nsec * 1e-9))
        dt__write_failed("--tensorboard", dt_tensorboard_path(r->tb), errno);
}
static dt_mlflow *dt__mlflow_running;
static void dt__mlflow_failed(void) { dt_mlflow_close(dt__mlflow_running, DT_MLFLOW_FAILED); }
static void dt__mlflow_start(dt_run *r) {
    const dt_config *c = &r->cfg;
    char name[256], v[64];
    const char *kind = dt__model_kind_name(r->model->cfg.kind);
    snprintf(name, sizeof name, "%s %s", c->stage, kind);
    if (r->mlflow_run_id[0] && !(r->mlflow = dt_mlflow_open(c->mlflow, "dtrain", name, r->mlflow_run_id)))
        dt_warn("--mlflow: the checkpoint's run %s is not in %s (%s): this is a new run", r->mlflow_run_id, c->mlflow,
                strerror(errno));
    if (!r->mlflow && !(r->mlflow = dt_mlflow_open(c->mlflow, "dtrain", name, NULL)))
        dt_fail("cannot write --mlflow '%s': %s", c->mlflow, strerror(errno));
    dt__copy_str(r->mlflow_run_id, sizeof r->mlflow_run_id, dt_mlflow_run_id(r->mlflow));   /* the checkpoints carry it */
    dt__mlflow_running = r->mlflow;
    dt__on_fail_tracking = dt__mlflow_failed;         /* a run that fails is marked so, not left RUNNING */
    const dt_model_config *mc = &r->model->cfg;
    struct { const char *key; const char *fmt; double value; } params[] = {
        { "dim", "%.0f", mc->dim }, { "depth", "%.0f", mc->depth }, { "heads", "%.0f", mc->heads },
        { "batch_size", "%.0f", c->batch_size }, { "lr", "%g", c->lr }, { "epochs", "%.0f", c->epochs },
        { "steps", "%.0f", (double)c->steps }, { "weight_decay", "%g", c->weight_decay },
        { "clip", "%g", c->clip }, { "accum_steps", "%.0f", c->accum_steps }, { "world_size", "%.0f", dt__ctx.world_size },
        { "params", "%.0f", (double)dt__state_layout(r->model)->numel } };
    int ok = dt_mlflow_param(r->mlflow, "model", kind) && dt_mlflow_param(r->mlflow, "optimizer", c->optimizer == DT_ADAMW ? "adamw" : "sgd") &&
             dt_mlflow_param(r->mlflow, "dtype", dt_dtype_name((dt_dtype)c->dtype));
    for (size_t i = 0; ok && i < sizeof params / sizeof params[0]; i++) {
        snprintf(v, sizeof v, params[i].fmt, params[i].value);
        ok = dt_mlflow_param(r->mlflow, params[i].key, v);
    }
    snprintf(v, sizeof v, "%llu", (unsigned long long)c->seed);     /* all 64 bits */
    ok = ok && dt_mlflow_param(r->mlflow, "seed", v);
    snprintf(v, sizeof v, "%d", dt__ctx.world_size);
    ok = ok && dt_mlflow_tag(r->mlflow, "stage", c->stage) && dt_mlflow_tag(r->mlflow, "model", kind) &&
         dt_mlflow_tag(r->mlflow, "world_size", v) && dt_mlflow_tag(r->mlflow, "device", r->model->device == DT_CUDA ? "cuda" : "cpu") &&
         dt_mlflow_tag(r->mlflow, "mlflow.source.name", c->stage) && dt_mlflow_tag(r->mlflow, "mlflow.source.type", "LOCAL");
    if (!ok) dt__write_failed("--mlflow", dt_mlflow_path(r->mlflow), errno);
}
static void dt__mlflow_metric(dt_run *r, const char *key, double value) {
    if (r->mlflow && !dt_mlflow_metric(r->mlflow, key, value, r->step, dt__unix_ms()))
        dt__write_failed("--mlflow", dt_mlflow_path(r->mlflow), errno);
}

/* A fingerprint of a data set's contents -- all of it up to 1 MB, else 256
   pieces of 4 KB spread over it, and its size: ranks handed different data of
   one size (a.txt and b.txt) would otherwise train as one job, each on its own. */
static uint64_t dt__dataset_fingerprint(const dt_dataset *ds) {
    static const uint64_t key[2] = { 0x64617461ull, 0x66696e676572ull };
    const unsigned char *parts[2] = { ds->tokens ? (const unsigned char *)ds->tokens : ds->pixels,
                                      ds->tokens ? (const unsigned char *)ds->targets : (const unsigned char *)ds->labels };
    size_t sizes[2] = { ds->tokens ? (size_t)ds->ntokens * 4 : (size_t)ds->n * (size_t)(ds->channels * ds->size * ds->size),
                        ds->tokens ? (ds->targets ? (size_t)ds->ntokens * 4 : 0) : (size_t)ds->n * 4 };
    uint64_t h = dt__siphash(key, &ds->n, sizeof ds->n);
    for (int k = 0; k < 2; k++) {
        if (!parts[k] || !sizes[k]) continue;
        size_t piece = 4096, pieces = sizes[k] <= ((size_t)1 << 20) ? 1 : 256;
        for (size_t i = 0; i < pieces; i++) {
            size_t at = pieces == 1 ? 0 : (sizes[k] - piece) / (pieces - 1) * i, len = pieces == 1 ? sizes[k] : piece;
            uint64_t part[2] = { h, dt__siphash(key, parts[k] + at, len) };
            h = dt__siphash(key, part, sizeof part);
        }
    }
    return h;
}

/* One run at a time in a --save-dir: two would interleave their checkpoints
   (one's weights beside the other's optimizer state) and tear each other's
   files. Rank 0 holds a lock on DIR/.dtrain.lock for as long as it lives --
   the system lets go of it when the process ends, however it ends -- and the
   file says which process holds it. */
static void dt__save_dir_lock(const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0) dt__mkdir(dir);
    else if (!S_ISDIR(st.st_mode)) dt_fail("--save-dir '%s' exists and is not a folder", dir);
    char path[4200], holder[32] = "";
    dt__path(path, sizeof path, "%s/.dtrain.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) dt_fail("--save-dir '%s': cannot create '%s': %s", dir, path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        ssize_t got = pread(fd, holder, sizeof holder - 1, 0);
        holder[got > 0 ? got : 0] = 0;
        holder[strcspn(holder, "\n")] = 0;
        dt_fail("--save-dir '%s' is in use by another run (process %s): give this run a folder of its own, or wait for that "
                "one to end", dir, holder[0] ? holder : "unknown");
    }
    char me[32];
    int len = snprintf(me, sizeof me, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, me, (size_t)len, 0) != len) dt__write_failed("--save-dir", path, errno);
    /* the descriptor stays open, and so the lock held, until this process ends */
}

void dt_run_start(dt_run *run, const dt_config *cfg, dt_model *model, dt_optimizer *opt, dt_loader *loader,
                  const dt_dataset *val) {
    memset(run, 0, sizeof *run);
    run->cfg = *cfg; run->model = model; run->opt = opt; run->loader = loader; run->val = val;
    dt_model_set_recompute(model, cfg->recompute);
    dt_set_attention_body((dt_attention_body)cfg->attention);
    if (cfg->save_dir && !cfg->bench && dt__ctx.rank == 0) dt__save_dir_lock(cfg->save_dir);
    if (cfg->resume && !strcmp(cfg->resume, "auto")) {
        if (!cfg->save_dir) dt_usage_error("--resume auto resumes from the newest checkpoint in --save-dir: give --save-dir");
        run->cfg.resume = dt__newest_checkpoint(cfg->save_dir, run->resume_path, sizeof run->resume_path);
        if (run->cfg.resume) {
            if (!model->base) run->cfg.init = NULL;   /* the checkpoint holds the weights since (LoRA's: the adapters alone) */
        } else if (!cfg->quiet && dt__ctx.rank == 0)
            printf("--resume auto: no checkpoint in %s yet, starting %s\n", cfg->save_dir, cfg->init ? "from --init" : "fresh");
        cfg = &run->cfg;
    }
    if (cfg->bench) {               /* time steps, nothing else: no header, no evaluation, no checkpoints */
        run->cfg.quiet = 1; run->cfg.epochs = 1 << 30; run->cfg.warmup = 0; run->cfg.save_dir = NULL;
        run->cfg.eval_every = 0; run->cfg.sample = 0; run->val = NULL;
        cfg = &run->cfg;
    }
    if (dt__ctx.job && dt__ctx.world_size > 1) {      /* flags that must be equal on every rank */
        char v[256];
        dt_model_describe(model, v, sizeof v);
        dt_comm_check_agree(dt__ctx.job, "the model", v);
        snprintf(v, sizeof v, "%d %d %lld %g %d %llu", cfg->batch_size, cfg->epochs, (long long)cfg->steps, cfg->lr,
                 (int)cfg->optimizer, (unsigned long long)cfg->seed);
        dt_comm_check_agree(dt__ctx.job, "--batch-size --epochs --steps --lr --optimizer --seed", v);
        snprintf(v, sizeof v, "%lld %lld %lld %g %d %d", (long long)loader->ds->n, (long long)cfg->start_idx,
                 (long long)cfg->warmup, cfg->bucket_mb, cfg->shard * 2 + cfg->cpu_offload, cfg->bench);
        dt_comm_check_agree(dt__ctx.job, "the training set, --start-idx --warmup --bucket-mb --shard --cpu-offload --bench", v);
        snprintf(v, sizeof v, "%016llx", (unsigned long long)dt__dataset_fingerprint(loader->ds));
        dt_comm_check_agree(dt__ctx.job, "the training set's contents (a fingerprint: --data, --tokens)", v);
        snprintf(v, sizeof v, "%d %d %d", cfg->accum_steps, cfg->dtype, cfg->reduce_dtype);
        dt_comm_check_agree(dt__ctx.job, "--accum-steps --dtype --reduce-dtype", v);
        dt_comm_check_agree(dt__ctx.job, "--resume", cfg->resume ? cfg->resume : "(none)");
    }
    run->scaler = dt_loss_scaler_create((dt_dtype)cfg->dtype);
    if (loader->ds->tokens && run->val && run->val->tokens) run->unigram_loss = dt_unigram_loss(loader->ds, run->val);
    run->batches_per_epoch = dt_loader_batches_per_epoch(loader) / cfg->accum_steps;   /* optimizer steps */
    if (run->batches_per_epoch == 0)
        dt_fail("the training set has %lld images per rank, fewer than one step of %d x %d (lower --batch-size%s)",
                (long long)((loader->ds->n + loader->world - 1) / loader->world), cfg->accum_steps, cfg->batch_size,
                cfg->accum_steps > 1 ? " or --accum-steps" : "");
    /* --steps stops early; the schedule still spans every epoch, so a run cut
       short and resumed follows the same learning rates as one that was not. */
    run->total_steps = (int64_t)cfg->epochs * run->batches_per_epoch;
    run->stop_step = cfg->steps > 0 && cfg->steps < run->total_steps ? cfg->steps : run->total_steps;
    run->warmup = cfg->warmup >= 0 ? cfg->warmup : run->total_steps / 20;
    if (cfg->init) dt_model_load_weights(model, cfg->init);
    if (cfg->resume) dt_checkpoint_load(run, cfg->resume);
    dt_mem_reset_peaks();                  /* from here on, the peaks are those of training */
    if (cfg->save_dir) {
        struct stat st;
        if (stat(cfg->save_dir, &st) != 0) dt__mkdir(cfg->save_dir);
        else if (!S_ISDIR(st.st_mode)) dt_fail("--save-dir '%s' exists and is not a folder", cfg->save_dir);
    }
    if (cfg->log_path && dt__ctx.rank == 0 && !(run->log = fopen(cfg->log_path, cfg->resume ? "a" : "w")))
        dt_fail("cannot open --log '%s': %s", cfg->log_path, strerror(errno));
    if (cfg->tensorboard && dt__ctx.rank == 0) dt__tensorboard_start(run);
    if (cfg->mlflow && dt__ctx.rank == 0) dt__mlflow_start(run);
    if (cfg->trace_path) dt__trace_open(run, cfg->trace_path);
    run->start_ms = run->mark_ms = dt_now_ms();
    if (!cfg->quiet && dt__ctx.rank == 0) {
        char desc[256];
        dt_model_describe(model, desc, sizeof desc);
        printf("%s: %s\n", cfg->stage, desc);
        if (loader->ds->targets)
            printf("data: %lld training examples of up to %d tokens from %s, %lld validation; vocabulary %d; the loss "
                   "counts %lld of the training set's %lld positions (the rest are prompts and padding)\n",
                   (long long)loader->ds->n, loader->ds->seq_len + 1, loader->ds->source, val ? (long long)val->n : 0LL,
                   loader->ds->num_classes, (long long)dt__counted_targets(loader->ds), (long long)loader->ds->ntokens);
        if (loader->ds->tokens) {
            if (!loader->ds->targets)
                printf("data: %lld training sequences of %d tokens from %s, %lld validation; vocabulary %d\n",
                       (long long)loader->ds->n, loader->ds->seq_len, loader->ds->source, val ? (long long)val->n : 0LL,
                       loader->ds->num_classes);
            if (val && val->tokens)
                printf("baseline: a model that ignores context (token frequencies alone) scores validation loss %.4f\n",
                       run->unigram_loss);
        } else
            printf("data: %lld training images from %s, %lld validation, %dx%d, %d classes\n",
                   (long long)loader->ds->n, loader->ds->source, val ? (long long)val->n : 0LL, loader->ds->size,
                   loader->ds->size, loader->ds->num_classes);
        char where[300];
        if (model->device == DT_CUDA) snprintf(where, sizeof where, "cuda (%s)", dt__ctx.gpu->name);
        else snprintf(where, sizeof where, "cpu, %d threads", dt_threads());
        if (dt__ctx.world_size > 1)
            snprintf(where + strlen(where), sizeof where - strlen(where), " per rank, %d ranks", dt__ctx.world_size);
        char images[64], precision[96] = "";
        const char *unit = loader->ds->tokens ? "sequences" : "images";
        if (cfg->accum_steps > 1) snprintf(images, sizeof images, "%d micro-batches of %d %s", cfg->accum_steps, loader->batch_size, unit);
        else snprintf(images, sizeof images, "%d %s", loader->batch_size, unit);
        if (cfg->dtype != DT_F32)
            snprintf(precision, sizeof precision, "; %s compute, f32 master weights, gradients reduced in %s%s",
                     dt_dtype_name((dt_dtype)cfg->dtype), dt_dtype_name((dt_dtype)cfg->reduce_dtype),
                     run->scaler.enabled ? ", dynamic loss scaling" : "");
        printf("plan: %d epochs x %lld steps of %s = %lld steps%s; %s lr %g, warmup %lld; %s%s\n",
               cfg->epochs, (long long)run->batches_per_epoch, images, (long long)run->total_steps,
               run->stop_step < run->total_steps ? " (stopping early, see --steps)" : "",
               opt->kind == DT_ADAMW ? "adamw" : "sgd", cfg->lr, (long long)run->warmup, where, precision);
        if (cfg->resume) printf("resumed from %s at epoch %d, step %lld\n", cfg->resume, run->epoch + 1, (long long)run->step);
        dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(model->parallel, &who);
        if (rep && rep->memory_table) rep->memory_table(who, opt);
        fflush(stdout);
    }
    if (cfg->bench) run->stop_step = run->step + 2 + (cfg->steps > 0 ? cfg->steps : 3);   /* refined after a timed step */
    run->bench_first = run->step + 2;
    if (run->step >= run->stop_step) run->stop = 1;
}

int dt_next_epoch(dt_run *run) {
    if (run->stop || run->epoch >= run->cfg.epochs) return 0;
    dt_loader_start_epoch(run->loader, run->epoch, run->batch_in_epoch * run->cfg.accum_steps);
    return 1;
}

int dt_next_batch(dt_run *run, dt_batch *batch) {
    dt_loader *l = run->loader;
    if (run->micro == 0) {
        if (run->batch_in_epoch >= run->batches_per_epoch) return 0;   /* the rest is less than a step */
        dt_step_begin(run);
        if (l->ds->targets) {          /* masked data: the mean over the whole step's targets */
            int64_t counted = dt_loader_counted_targets(l, run->cfg.accum_steps);
            run->loss_divisor = counted ? (double)counted / ((double)l->world * run->cfg.accum_steps) : 1;
        }
    } else dt_step_arena_reset();     /* the gradients so far are in the parameters' buffers */
    if (!dt_loader_next(l, batch)) return 0;
    if (l->ds->targets) dt_cross_entropy_set_divisor(batch->labels, run->loss_divisor);
    dt_phase(run, DT_PHASE_DATA);
    return 1;
}
int dt_last_micro_batch(const dt_run *run) { return run->micro == run->cfg.accum_steps - 1; }
void dt_micro_batch_end(dt_run *run, dt_tensor *loss) {
    if (dt_last_micro_batch(run))
        dt_fail("dt_micro_batch_end: this is the step's last micro-batch, whose gradients must be synchronised and "
                "stepped; call dt_step_end after the optimizer instead");
    run->micro_loss += dt_tensor_item(loss);
    run->micro++;
}

float dt_run_lr(const dt_run *run) { return dt_schedule_lr(run->cfg.lr, run->step, run->warmup, run->total_steps); }

void dt_step_begin(dt_run *run) {
    dt_step_arena_reset();
    for (int i = 0; i < DT_PHASE_COUNT; i++) run->phase_ms[i] = 0;
    dt__ctx.comm_ms = dt__ctx.comm_hidden_ms = 0;
    dt__ctx.ncomm_events = 0;
    dt__ctx.grad_collectives = 0;
    if (run->cfg.bench && run->step == run->bench_first) {     /* the warm-up is over: the clock starts */
        dt_synchronize();
        dt_flops_reset();
        run->bench_t0 = dt_now_ms();
    }
    run->step_start_ms = run->mark_ms = dt_now_ms();
}

/* --explain: the cost model on this run, with the compute it just measured. */
static void dt__run_explain(dt_run *r) {
    static const char *links[] = { "shm", "pcie", "nvlink", "infiniband" };
    const dt_config *c = &r->cfg;
    dt_link link;
    dt_link_preset(c->link >= 0 ? links[c->link] : r->model->device == DT_CUDA ? "nvlink" : "shm", &link);
    dt_cost_input in;
    memset(&in, 0, sizeof in);
    int n = dt__data_parallel_width(r), alone = !strncmp(c->stage, "01", 2);
    in.kind = !strncmp(c->stage, "02", 2) ? DT_PAR_DP : DT_PAR_DDP;     /* a wrapper that shards or splits says otherwise */
    in.compute_ms = (r->phase_ms[DT_PHASE_FWD] + r->phase_ms[DT_PHASE_BWD]) / c->accum_steps;
    in.accum_steps = c->accum_steps;
    in.optimizer_ms = r->phase_ms[DT_PHASE_OPT];      /* this rank's: a wrapper makes it the whole model's */
    double measured = in.compute_ms * c->accum_steps + in.optimizer_ms;     /* this rank's, as it ran */
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(r->model->parallel, &who);   /* a wrapper that splits the model says how */
    int layout = rep && rep->cost_input && (n = rep->cost_input(who, &in)) &&
                 (in.kind == DT_PAR_TP || in.kind == DT_PAR_PP || in.kind == DT_PAR_CP);
    in.params = (double)dt__state_layout(r->model)->numel;
    in.contention = 1;                /* the compute above was measured as this run shares its device(s) */
    in.backward_share = in.compute_ms > 0 ? r->phase_ms[DT_PHASE_BWD] / c->accum_steps / in.compute_ms : 0.66;
    in.gather_bytes = (double)dt_dtype_size((dt_dtype)c->dtype);
    in.reduce_bytes = (double)dt_dtype_size((dt_dtype)c->reduce_dtype);
    in.messages = in.kind == DT_PAR_DDP ? dt_cost_ddp_buckets(in.params, c->bucket_mb) : r->model->nunits;
    printf("--explain, measured on step %lld: compute %.1f ms, communication %.1f ms (%.1f hidden)\n",
           (long long)r->step, measured, dt__ctx.comm_ms, dt__ctx.comm_hidden_ms);
    if (alone) printf("(stage 01 trains alone: here is what DDP, stage 03, would do with it)\n");
    /* one rank alone: what two would do; a layout (--tp, --pp) as it is, a stage or a group of one included */
    dt_cost_explain(stdout, &in, &link, layout || n > 1 ? n : 2);
    printf("  predicted speedup at");
    for (int k = 2; k <= 8; k *= 2)
        printf(" %s%d%s: %.2fx%s", layout ? in.kind == DT_PAR_TP ? "--tp " : in.kind == DT_PAR_PP ? "--pp " : "--cp " : "", k,
               layout ? "" : " ranks",
               dt_cost_predict(&in, &link, k).speedup, k < 8 ? "," : "\n");
    if (r->model->device == DT_CPU)
        printf("  (on a CPU the ranks share its cores: each rank's compute above already carries that; the speedups\n"
               "   assume more ranks would each bring cores of their own, which one machine cannot)\n");
    fflush(stdout);
}

/* --sample N: the model continues the first tokens of the validation text. */
static void dt__run_sample(dt_run *r) {
    const dt_dataset *src = r->val && r->val->tokens ? r->val : r->loader->ds;
    int n = r->cfg.sample, np = src->seq_len / 2 < 16 ? src->seq_len / 2 : 16;
    if (np < 1) np = 1;
    int32_t prompt[16], *out = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    if (!out) dt_fail("out of memory (--sample)");
    int from = 0;
    if (src->targets) {                   /* instruction data: the end of the first example's prompt */
        int answer = 0;
        while (answer < src->seq_len - 1 && src->targets[answer] == DT_IGNORE_INDEX) answer++;
        np = answer + 1 < 16 ? answer + 1 : 16;
        from = answer + 1 - np;
    }
    for (int i = 0; i < np; i++) prompt[i] = src->tokens[from + i];
    dt_generate(r->model, prompt, np, n, 0.8f, r->cfg.seed + (uint64_t)r->step, out);
    if (!r->cfg.quiet && dt__ctx.rank == 0) {
        int bytes = !r->cfg.tokens;
        printf("sample step %lld (temperature 0.8, after the prompt in [ ]):\n  [", (long long)r->step);
        for (int i = 0; i < np + n; i++) {
            int t = i < np ? prompt[i] : out[i - np];
            if (!bytes) printf("%s%d", i ? " " : "", t);
            else if (t == '\n') printf("\n  ");
            else putchar(t >= 32 && t < 127 ? t : '?');
            if (i == np - 1) putchar(']');
        }
        printf("\n");
        fflush(stdout);
    }
    free(out);
}

static void dt__run_eval(dt_run *r) {
    int sample = r->cfg.sample > 0 && dt_model_is_language(r->model->cfg.kind);
    double t0 = dt_now_ms();
    r->mark_ms = t0;
    if (!r->val || r->val->n == 0) {
        if (sample) { dt__run_sample(r); dt_phase(r, DT_PHASE_EVAL); }
        return;
    }
    if (!r->cfg.quiet && dt__ctx.rank == 0) {     /* said before the wait, which on a big set is long */
        if (r->val->tokens) printf("eval  step %lld: evaluating %lld tokens ...\n", (long long)r->step,
                                   (long long)dt__counted_targets(r->val));
        else printf("eval  step %lld: evaluating %lld images ...\n", (long long)r->step, (long long)r->val->n);
        fflush(stdout);
    }
    dt__evaluate_share(r->model, r->val, r->cfg.batch_size, r->loader->rank, r->loader->world, &r->eval_loss, &r->eval_acc);
    dt_phase(r, DT_PHASE_EVAL);
    if (r->log) {
        fprintf(r->log, "{\"step\":%lld,\"epoch\":%d,\"eval_loss\":%.6f,\"eval_acc\":%.6f}\n", (long long)r->step,
                r->epoch + 1, r->eval_loss, r->eval_acc);
        fflush(r->log);
        dt__file_check(r->log, "--log", r->cfg.log_path);
    }
    dt__tensorboard_scalar(r, "eval/loss", r->eval_loss);
    dt__tensorboard_scalar(r, "eval/accuracy", r->eval_acc);
    dt__mlflow_metric(r, "eval_loss", r->eval_loss);
    dt__mlflow_metric(r, "eval_accuracy", r->eval_acc);
    if (!r->cfg.quiet && dt__ctx.rank == 0) {
        if (r->val->tokens)
            printf("eval  step %lld: loss %.4f (context-free baseline %.4f), next-token accuracy %.2f%% (%lld tokens, %.1f s)\n",
                   (long long)r->step, r->eval_loss, r->unigram_loss, 100 * r->eval_acc, (long long)dt__counted_targets(r->val),
                   (dt_now_ms() - t0) / 1e3);
        else
            printf("eval  step %lld: loss %.4f, accuracy %.2f%% (%lld images, %.1f s)\n", (long long)r->step, r->eval_loss,
                   100 * r->eval_acc, (long long)r->val->n, (dt_now_ms() - t0) / 1e3);
        fflush(stdout);
    }
    if (sample) { dt__run_sample(r); dt_phase(r, DT_PHASE_EVAL); }
}

int dt_step_end(dt_run *run, dt_tensor *loss, int batch_size) {
    if (run->micro > 0) {            /* the mean of the step's micro-batches */
        float mean = (float)((run->micro_loss + dt_tensor_item(loss)) / (run->micro + 1));
        dt_upload(loss->data, &mean, sizeof mean);
    }
    run->micro = 0;
    run->micro_loss = 0;
    /* the loss of the whole job's batch: the mean of the ranks' means */
    int stop = dt__job_mean_loss(loss, run->cfg.bench || run->step + 1 >= run->stop_step ? 0 : dt__local_stop_signal());
    double now = dt_now_ms(), step_ms = now - run->step_start_ms;
    float lr = dt_run_lr(run);
    batch_size *= run->cfg.accum_steps;                     /* the samples of one step, per rank */
    run->step++;
    run->steps_run++;
    run->batch_in_epoch++;
    run->samples += (double)batch_size * run->loader->world;     /* the ranks of a tensor-parallel group share a batch */
    run->train_ms += step_ms;
    run->last_loss = dt_tensor_item(loss);
    run->has_loss = 1;
    run->loss_sum += run->last_loss;
    run->loss_count++;
    if (!isfinite(run->last_loss))
        dt_fail("the loss became %f at step %lld (try a lower --lr, or --clip)", run->last_loss, (long long)run->step);
    for (int k = 0; k < dt__ctx.ncomm_events; k++)
        dt__trace_event(run, dt__ctx.comm_events[k].name, dt__ctx.comm_events[k].pipeline ? DT_TRACK_PIPELINE : DT_TRACK_COMM,
                        dt__ctx.comm_events[k].t0, dt__ctx.comm_events[k].t1);
    if (run->log) {
        fprintf(run->log, "{\"step\":%lld,\"epoch\":%d,\"loss\":%.8g,\"lr\":%.6g,\"samples_per_s\":%.1f,\"step_ms\":%.3f,"
                        "\"data_ms\":%.3f,\"fwd_ms\":%.3f,\"bwd_ms\":%.3f,\"comm_ms\":%.3f,\"comm_hidden_ms\":%.3f,"
                        "\"comm_wait_ms\":%.3f,\"opt_ms\":%.3f,\"grad_norm\":%.5g,\"mem_bytes\":%zu,"
                        "\"grad_collectives\":%lld",
                (long long)run->step, run->epoch + 1, run->last_loss, lr, batch_size * run->loader->world * 1e3 / step_ms, step_ms,
                run->phase_ms[DT_PHASE_DATA], run->phase_ms[DT_PHASE_FWD], run->phase_ms[DT_PHASE_BWD], dt__ctx.comm_ms,
                dt__ctx.comm_hidden_ms, run->phase_ms[DT_PHASE_COMM], run->phase_ms[DT_PHASE_OPT], run->opt->last_grad_norm,
                dt_mem_total_now(), (long long)dt__ctx.grad_collectives);
        if (run->scaler.enabled)
            fprintf(run->log, ",\"loss_scale\":%g,\"skipped\":%d,\"skipped_steps\":%lld", run->scaler.scale,
                    run->scaler.last_skipped, (long long)run->scaler.skipped);
        dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(run->model->parallel, &who);
        if (rep && rep->log_fields) rep->log_fields(who, run->log);
        if (dt__tokens_per_sample(run))
            fprintf(run->log, ",\"tokens_per_s\":%.1f", (double)batch_size * run->loader->world * dt__tokens_per_sample(run) * 1e3 / step_ms);
        fprintf(run->log, "}\n");
        dt__file_check(run->log, "--log", run->cfg.log_path);
    }
    if (run->tb || run->mlflow) {           /* the same figures, for TensorBoard and for MLflow, each by its names */
        double rate = batch_size * run->loader->world * 1e3 / step_ms, tokens = dt__tokens_per_sample(run);
        const struct { const char *tb, *mlflow; double value; } figures[] = {
            { "train/loss", "loss", run->last_loss }, { "train/lr", "lr", lr },
            { "train/grad_norm", "grad_norm", run->opt->last_grad_norm },
            { tokens ? "speed/tokens_per_s" : "speed/samples_per_s", tokens ? "tokens_per_s" : "samples_per_s", tokens ? rate * tokens : rate },
            { "speed/step_ms", "step_ms", step_ms }, { "memory/mb", "memory_mb", dt_mem_total_now() / 1e6 } };
        for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++) {
            dt__tensorboard_scalar(run, figures[i].tb, figures[i].value);
            dt__mlflow_metric(run, figures[i].mlflow, figures[i].value);
        }
    }
    if (run->cfg.bench && run->step > run->bench_first) {
        for (int i = 0; i < DT_PHASE_COUNT; i++) run->bench_phase_ms[i] += run->phase_ms[i];
        run->bench_comm_ms += dt__ctx.comm_ms;
        run->bench_hidden_ms += dt__ctx.comm_hidden_ms;
        if (run->step == run->bench_first + 1 && run->cfg.steps == 0) {
            /* about three seconds of steps (3 to 200); rank 0 decides for every rank */
            float n = (float)(3000.0 / (step_ms > 1e-3 ? step_ms : 1e-3));
            n = n < 3 ? 3 : n > 200 ? 200 : (float)(int)n;
            if (dt__ctx.rank != 0) n = 0;
            dt__job_sum(&n, 1);
            run->stop_step = run->bench_first + (int64_t)n;
        }
    }
    run->step_ms_avg = dt__eta_update(run->step_ms_avg, step_ms, run->steps_run);
    int last_of_epoch = run->batch_in_epoch == run->batches_per_epoch || run->step == run->stop_step;
    if (!run->cfg.quiet && dt__ctx.rank == 0 && dt__progress_due(run->step, run->cfg.log_every, last_of_epoch, now, run->line_ms)) {
        char eta[32];
        double rate = run->step_ms_avg > 0 ? batch_size * run->loader->world * 1e3 / run->step_ms_avg : 0;
        dt__format_duration((run->stop_step - run->step) * run->step_ms_avg / 1e3, eta, sizeof eta);
        run->line_ms = now;
        char scale[64] = "";
        if (run->scaler.enabled)
            snprintf(scale, sizeof scale, "  scale %g (%lld skipped)", run->scaler.scale, (long long)run->scaler.skipped);
        int tok = dt__tokens_per_sample(run);
        printf("step %6lld/%lld  epoch %d/%d  loss %.4f  lr %.2e  %.0f %s/s  eta %s%s\n", (long long)run->step,
               (long long)run->stop_step, run->epoch + 1, run->cfg.epochs, run->loss_sum / run->loss_count, lr,
               tok ? rate * tok : rate, tok ? "tokens" : "samples", eta, scale);
        fflush(stdout);
        run->loss_sum = 0;
        run->loss_count = 0;
    }
    if (run->cfg.explain && run->steps_run == 3 && dt__ctx.rank == 0) dt__run_explain(run);
    if (stop) { run->stopped_by = stop; run->stop = 1; }
    if (run->cfg.eval_every > 0 && run->step % run->cfg.eval_every == 0 && !run->stopped_by) dt__run_eval(run);
    if (run->step >= run->stop_step) run->stop = 1;
    return run->stop;
}

void dt_epoch_end(dt_run *run) {
    int finished = run->batch_in_epoch >= run->batches_per_epoch;
    if (finished) { run->epoch++; run->batch_in_epoch = 0; }
    if (!run->stopped_by && !(run->cfg.eval_every > 0 && run->step % run->cfg.eval_every == 0)) dt__run_eval(run);
    if (run->stopped_by && !run->cfg.save_dir && dt__ctx.rank == 0)
        dt_warn("stopped by %s with no --save-dir: the %lld steps trained are not saved", dt__signal_name(run->stopped_by),
                (long long)run->steps_run);
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(run->model->parallel, &who);
    if (run->cfg.save_dir && (dt__ctx.rank == 0 || (rep && (rep->state_open || rep->whole_from_local || rep->shards)))) {
        /* sharded or cut: every rank takes part */
        char path[4096], what[64];
        if (finished) snprintf(what, sizeof what, "epoch%d", run->epoch);
        else snprintf(what, sizeof what, "step%lld", (long long)run->step);
        dt__describe_position(run, path, sizeof path, what);
        run->mark_ms = dt_now_ms();
        dt_checkpoint_save(run, path);
        dt_phase(run, DT_PHASE_CKPT);
        if (!run->cfg.quiet && dt__ctx.rank == 0) { printf("saved %s\n", path); fflush(stdout); }
    }
}

int dt_run_finish(dt_run *run) {
    if (run->cfg.bench) dt__bench_report(run);
    else if (run->steps_run == 0 && run->val) {        /* --resume of a finished run: evaluate it */
        if (!run->cfg.quiet && dt__ctx.rank == 0) printf("nothing left to train (epoch %d of %d): evaluating\n", run->epoch, run->cfg.epochs);
        dt__run_eval(run);
    }
    double rate = run->train_ms > 0 ? run->samples / (run->train_ms / 1e3) : 0;
    /* The final loss is the last step's (the job's mean over its ranks): it depends on the steps alone, so a run
       stopped and resumed reports what the same run uninterrupted does (a mean since the last progress line
       depended on the clock). A checkpoint keeps it; NaN (printed n/a, null in the log) before any step. */
    double final_loss = run->has_loss ? run->last_loss : NAN;
    if (dt__ctx.rank == 0 && !run->cfg.bench) {
        int tok = dt__tokens_per_sample(run);
        char fl[32];
        if (isfinite(final_loss)) snprintf(fl, sizeof fl, "%.4f", final_loss);
        else snprintf(fl, sizeof fl, "n/a");
        printf("done: %lld steps, %.0f %s/s, final loss %s, eval loss %.4f, eval accuracy %.2f%%, %.1f s\n",
               (long long)run->step, tok ? rate * tok : rate, tok ? "tokens" : "samples", fl, run->eval_loss,
               100 * run->eval_acc, (dt_now_ms() - run->start_ms) / 1e3);
        if (run->unigram_loss > 0 && run->steps_run > 0)
            printf("eval loss %.4f against %.4f for token frequencies alone: %s\n", run->eval_loss, run->unigram_loss,
                   run->eval_loss < run->unigram_loss ? "the model uses the context" : "not yet better than ignoring the context");
        printf("peak memory:");
        for (int a = 0; a < DT_ARENA_COUNT; a++) printf(" %s %.1f MB,", dt_arena_name((dt_arena)a), dt_mem_peak((dt_arena)a) / 1e6);
        printf(" total %.1f MB\n", dt_mem_total_peak() / 1e6);
        if (run->scaler.enabled)
            printf("fp16 loss scale: %g at the end, %lld of %lld steps skipped\n", run->scaler.scale,
                   (long long)run->scaler.skipped, (long long)run->steps_run);
        size_t host = 0;
        for (int a = 0; a < DT_ARENA_COUNT; a++) host += dt_mem_host_peak((dt_arena)a);
        if (host) {
            printf("peak host memory (offloaded):");
            for (int a = 0; a < DT_ARENA_COUNT; a++)
                if (dt_mem_host_peak((dt_arena)a)) printf(" %s %.1f MB", dt_arena_name((dt_arena)a), dt_mem_host_peak((dt_arena)a) / 1e6);
            printf("\n");
        }
        fflush(stdout);
    }
    if (run->log) {
        char fl[32];
        if (isfinite(final_loss)) snprintf(fl, sizeof fl, "%.6f", final_loss);
        else snprintf(fl, sizeof fl, "null");
        fprintf(run->log, "{\"summary\":true,\"steps\":%lld,\"final_loss\":%s,\"eval_loss\":%.6f,\"eval_acc\":%.6f,"
                        "\"samples_per_s\":%.1f,\"peak_mem_bytes\":%zu,\"world_size\":%d",
                (long long)run->step, fl, run->eval_loss, run->eval_acc, rate, dt_mem_total_peak(), dt__ctx.world_size);
        if (dt__tokens_per_sample(run))
            fprintf(run->log, ",\"tokens_per_s\":%.1f,\"unigram_loss\":%.6f", rate * dt__tokens_per_sample(run), run->unigram_loss);
        if (run->scaler.enabled) fprintf(run->log, ",\"loss_scale\":%g,\"skipped_steps\":%lld", run->scaler.scale, (long long)run->scaler.skipped);
        for (int a = 0; a < DT_ARENA_COUNT; a++) fprintf(run->log, ",\"peak_%s_bytes\":%zu", dt_arena_name((dt_arena)a), dt_mem_peak((dt_arena)a));
        for (int a = 0; a < DT_ARENA_COUNT; a++)
            fprintf(run->log, ",\"peak_host_%s_bytes\":%zu", dt_arena_name((dt_arena)a), dt_mem_host_peak((dt_arena)a));
        if (run->stopped_by) fprintf(run->log, ",\"stopped_by\":\"%s\"", run->stopped_by == SIGINT ? "SIGINT" : run->stopped_by == SIGTERM ? "SIGTERM" : "SIGUSR1");
        fprintf(run->log, "}\n");
        FILE *log = run->log;
        run->log = NULL;
        dt__file_close(log, "--log", run->cfg.log_path);
    }
    if (run->tb) {
        dt_tensorboard *tb = run->tb;
        run->tb = NULL;
        if (!dt_tensorboard_close(tb)) dt__write_failed("--tensorboard", run->cfg.tensorboard, errno);
    }
    if (run->mlflow) {                      /* stopped by a signal: KILLED, as MLflow marks an interrupted run */
        dt_mlflow *ml = run->mlflow;
        run->mlflow = NULL;
        dt__on_fail_tracking = NULL;
        dt__mlflow_running = NULL;
        if (!dt_mlflow_close(ml, run->stopped_by ? DT_MLFLOW_KILLED : DT_MLFLOW_FINISHED))
            dt__write_failed("--mlflow", run->cfg.mlflow, errno);
    }
    if (run->trace) {
        FILE *trace = run->trace;
        run->trace = NULL;
        fprintf(trace, "]\n");
        dt__file_close(trace, "--trace", run->trace_path);
    }
    if (!run->stopped_by) return 0;
    if (dt__ctx.rank == 0) {
        printf("stopped by %s after step %lld of %lld%s\n", dt__signal_name(run->stopped_by), (long long)run->step,
               (long long)run->stop_step, run->cfg.save_dir ? ": the same command with --resume auto continues from here" : "");
        fflush(stdout);
    }
    return run->stopped_by == SIGINT ? 130 : 75;       /* 75, EX_TEMPFAIL: preempted, to be run again */
}

/* [src/13-fsdp.h] */
/* ---- what the machinery asks of FSDP (the run driver's dt_parallel_report) ----
   A checkpoint sees the sharded model whole, or writes each rank's shards as
   they are; the memory table compares what a rank holds with DDP; the cost
   model and --bench learn which ZeRO stage this is. */
/* The cost model's view (the cost-model chapter): which ZeRO, and the optimizer step
   of the whole model, N times the shard's this rank measured. */
static int dt__fsdp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *inner = dt_parallel_report_of(par->inner, &who);
    if (inner && inner->cost_input) {     /* around tensor parallelism: its pieces, sharded over the groups (2-D) */
        in->optimizer_ms *= f->world;     /* the pieces' step, which the tensor-parallel view makes the whole model's */
        int n = inner->cost_input(who, in);
        in->dp_shard = f->mode + 1;
        return n;
    }
    static const dt_parallelism zero[3] = { DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3 };   /* by dt_shard_mode */
    in->kind = zero[f->mode];
    in->optimizer_ms *= f->world;
    return f->world;
}

/* Checkpoints see a sharded model whole: every rank's shards gathered into one
   host array in parameter order (a collective), or written back into them. */
static float *dt__fsdp_state_gather(dt_fsdp *f, const float *shards) {
    dt_device dev = f->model->device;
    float *host = (float *)malloc((size_t)f->model->numel * sizeof(float) + 1);
    if (!host) dt_fail("out of memory (gathering a sharded checkpoint)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        if (!u->numel) continue;
        float *full = (float *)dt_alloc_on(dev, DT_ARENA_COMM, dt__fsdp_full_bytes(f, u));
        dt_all_gather(f->comm, dt__fsdp_shard_on_device(f, shards, k), full, u->shard, DT_F32);
        dt__download_from(dev, host + u->offset, full, (size_t)u->numel * sizeof(float));
        dt_free_on(dev, DT_ARENA_COMM, full, dt__fsdp_full_bytes(f, u));
    }
    return host;
}

static void dt__fsdp_state_scatter(dt_fsdp *f, const float *host, float *shards, int parameters) {
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, shards + u->shard_offset, host + u->offset + lo, hi - lo);
        if (parameters && u->full) dt__fsdp_fill_params(f, u, host + u->offset);
    }
}

/* Around tensor parallelism the shards make this rank's pieces, not the
   whole: the inner wrapper's report turns those into the whole and back
   (they pass through the device, where it keeps its pieces). That report,
   when the inner wrapper cut the model (tensor, pipeline parallelism); NULL
   when it keeps the model whole (context parallelism) or there is none. */
static const dt_parallel_report *dt__fsdp_inner_cut(const dt_parallel *par, dt_parallel **who) {
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, who);
    return in && in->whole_from_local ? in : NULL;
}
static float *dt__fsdp_to_whole(dt_fsdp *f, const dt_parallel_report *in, dt_parallel *who, float *pieces) {
    dt_device dev = f->model->device;
    size_t bytes = (size_t)f->model->numel * sizeof(float);
    float *local = (float *)dt_alloc_on(dev, DT_ARENA_COMM, bytes);
    dt__upload_to(dev, local, pieces, bytes);
    free(pieces);
    float *whole = in->whole_from_local(who, f->model, local);
    dt_free_on(dev, DT_ARENA_COMM, local, bytes);
    return whole;
}
static float *dt__fsdp_from_whole(dt_fsdp *f, const dt_parallel_report *in, dt_parallel *who, float *whole) {
    dt_device dev = f->model->device;
    size_t bytes = (size_t)f->model->numel * sizeof(float);
    float *local = (float *)dt_alloc_on(dev, DT_ARENA_COMM, bytes), *pieces = (float *)malloc(bytes + 1);
    if (!pieces) dt_fail("out of memory (a checkpoint's pieces)");
    in->local_from_whole(who, f->model, whole, local);
    dt__download_from(dev, pieces, local, bytes);
    dt_free_on(dev, DT_ARENA_COMM, local, bytes);
    return pieces;
}
static float *dt__fsdp_state_open(dt_parallel *par, dt_optimizer *o, int which) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *in = dt__fsdp_inner_cut(par, &who);
    /* every rank gets the whole of its shards, gathered (for a load, too: the file overwrites it) */
    float *gathered = dt__fsdp_state_gather(f, which == 0 ? f->shard_params : which == 1 ? o->m : o->v);
    return in ? dt__fsdp_to_whole(f, in, who, gathered) : gathered;
}

static void dt__fsdp_state_close(dt_parallel *par, dt_optimizer *o, int which, float *host, int written) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *in = dt__fsdp_inner_cut(par, &who);
    if (written && in) {
        float *pieces = dt__fsdp_from_whole(f, in, who, host);
        dt__fsdp_state_scatter(f, pieces, which == 0 ? f->shard_params : which == 1 ? o->m : o->v, which == 0);
        free(pieces);
    } else if (written) dt__fsdp_state_scatter(f, host, which == 0 ? f->shard_params : which == 1 ? o->m : o->v, which == 0);
    free(host);
}

/* What each rank holds, against what DDP would hold: the ZeRO paper's
   formulas with P, G, O the bytes of parameters, gradients and optimizer state
   (O = 2P for AdamW, P for SGD's momentum), N ranks. The buffers that a unit
   is gathered into are shown apart: they are the price of sharding. */
static void dt__fsdp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    /* ZeRO-1 and -2 here keep the shards the optimizer steps apart from the
       whole copies: P/N (and for ZeRO-1 G/N) more than the paper, which steps
       a slice of the copy in place */
    static const char *formulas[3][3] = { { "P + P/N", "G + G/N", "O/N" }, { "P + P/N", "G/N", "O/N" }, { "P/N", "G/N", "O/N" } };
    static const char *names[3] = { "optimizer (ZeRO-1)", "grads (ZeRO-2)", "full (ZeRO-3)" };
    double P = 4.0 * f->model->numel, ddp[3] = { P, P, o->v ? 2 * P : P };
    dt_arena arenas[3] = { DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM };
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    double buffers[3] = { ((f->gathered[0] ? 1.0 : 0.0) + (f->gathered[1] ? 1.0 : 0.0) + (f->gathered[2] ? 1.0 : 0.0)) *
                          dt__fsdp_largest_params(f),
                          ((f->gathered_grad ? 1.0 : 0.0) + (f->outer_grad ? 1.0 : 0.0)) * (double)f->largest, 0 };
    double frozen = f->model->base ? 4.0 * (double)f->model->base->numel : 0;   /* LoRA's: in the parameters' arena */
    buffers[0] += frozen;
    printf("memory per rank, --shard %s%s, %d ranks (MB):\n", names[f->mode], f->offload ? " --cpu-offload" : "", f->world);
    printf("  %-16s %8s %8s %8s   %s\n", "", "device", "host", "DDP", "formula");
    for (int i = 0; i < 3; i++)
        printf("  %-16s %8.2f %8.2f %8.2f   %s\n", rows[i], (dt_mem_now(arenas[i]) - buffers[i]) / 1e6,
               dt_mem_host_now(arenas[i]) / 1e6, ddp[i] / 1e6, formulas[f->mode][i]);
    if (frozen > 0)
        printf("  %-16s %8.2f %8s %8.2f   %s\n", "frozen (LoRA)", frozen / 1e6, "", frozen / 1e6,
               "F: whole on every rank and device, read only: no gradient, no state, never sent");
    if (f->param_dtype != DT_F32)
        printf("  (f32 shards and optimizer; parameters gathered in %s, 2 bytes each)\n", dt_dtype_name(f->param_dtype));
    if (buffers[0] + buffers[1] - frozen > 0)
        printf("  %-16s %8.2f %8s %8s   %s\n", "gather buffers", (buffers[0] + buffers[1] - frozen) / 1e6, "", "",
               f->mode == DT_SHARD_FULL ? "2 units of parameters (one computes, the next arrives) + 1 of gradients"
                                        : "1 unit of gradients (whole during its backward)");
    if ((f->gathered[2] || f->outer_grad) && buffers[0] + buffers[1] - frozen > 0)
        printf("  %-16s %8s %8s %8s   %s\n", "", "", "", "", "+ the outer unit's (embeddings, shared with the head), whole all step");
    fflush(stdout);
}

/* The shards as they are, for a sharded checkpoint: each rank writes its own. */
static int dt__fsdp_shards(dt_parallel *par, dt_optimizer *o, dt_shard_view *view) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;                     /* shards of pieces (an inner wrapper that cut the model): saved whole, */
    if (dt__fsdp_inner_cut(par, &who)) return 0;                  /* through that wrapper */
    *view = (dt_shard_view){ .state = { f->shard_params, o->m, o->v }, .numel = f->shard_numel,
                             .where = f->offload ? DT_CPU : f->model->device, .rank = f->rank, .world = f->world, .comm = f->comm };
    return 1;
}
/* --bench's stage=: which --shard, and whether offloaded. */
static void dt__fsdp_label(const dt_parallel *par, char *out, size_t n) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    static const char *modes[3] = { "optimizer", "grads", "full" };
    snprintf(out, n, "/%s%s", modes[f->mode], f->offload ? "+offload" : "");
}
/* Around tensor or pipeline parallelism, what it reports too. */
static void dt__fsdp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->bench_fields) in->bench_fields(who, out, accum_steps);
}
static void dt__fsdp_log_fields(const dt_parallel *par, FILE *log) {
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->log_fields) in->log_fields(who, log);
}
static void dt__fsdp_memory_tables(const dt_parallel *par, const dt_optimizer *o) {
    dt__fsdp_memory_table(par, o);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->memory_table) in->memory_table(who, o);
}
const dt_parallel_report dt__fsdp_report = {
    .create_fn = "dt_fsdp_create", .state_open = dt__fsdp_state_open, .state_close = dt__fsdp_state_close,
    .shards = dt__fsdp_shards, .memory_table = dt__fsdp_memory_tables, .label = dt__fsdp_label, .cost_input = dt__fsdp_cost_input,
    .bench_fields = dt__fsdp_bench_fields, .log_fields = dt__fsdp_log_fields,
};
/* [src/14-tensor-parallel.h] */
/* ---- what the machinery asks of tensor parallelism (the run driver's dt_parallel_report) ----
   A checkpoint holds the model whole: each split parameter's pieces gathered
   from the group (and cut again when one is loaded); the memory table shows
   which parameters are split and how; the cost model and --bench learn the
   share of the work that is split and the sums it cost. */
/* The share of the parameters the split layers hold: of the compute too,
   near enough (each parameter multiplies once per token either way). */
static double dt__tp_split_share(const dt_tp *t) {
    double split = 0;
    for (int i = 0; i < t->whole.nparams; i++)
        if (t->model->splits[i].dim >= 0) split += (double)t->whole.params[i].numel;
    return t->whole.numel > 0 ? split / (double)t->whole.numel : 0;
}

/* The cost model's view of the last step: the whole model's compute on one
   rank, from this rank's share of it and its sums' time. */
static int dt__tp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_tp *t = (const dt_tp *)par;
    int K = in->accum_steps > 0 ? in->accum_steps : 1;
    in->kind = DT_PAR_TP;
    in->tp_share = dt__tp_split_share(t);
    in->tp_sums = t->step_sums / K;
    in->tp_bytes = t->step_sums > 0 ? t->step_sum_bytes / t->step_sums : 0;
    double kept = in->tp_share / t->size + (1 - in->tp_share);
    in->compute_ms = fmax(0, in->compute_ms - t->step_sum_ms / K) / kept;
    in->optimizer_ms *= t->model->numel > 0 ? (double)t->whole.numel / (double)t->model->numel : 1;   /* it stepped its pieces */
    in->dp_groups = t->par.data_ranks;
    return t->size;
}

static void dt__tp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_tp *t = (const dt_tp *)par;
    fprintf(out, " tp=%d tp_share=%.4f tp_sums=%.1f tp_bytes=%.0f", t->size, dt__tp_split_share(t), t->step_sums / accum_steps,
            t->step_sums > 0 ? t->step_sum_bytes / t->step_sums : 0.0);
}

/* The state of a tensor-parallel model (parameters or a moment, `local` on
   the device) in the whole model's layout, on the host of the group's first
   rank, which writes it: one split tensor at a time, its pieces all-gathered
   on the device and put where they sit in the whole. So no rank holds more
   than the largest tensor beside its own pieces, and the writer the whole
   state once. The other ranks of the group take part and get NULL. `m`
   lays out `local`: the model, or (a pipeline's stages composed, the
   pipeline-parallel chapter) every stage's pieces. */
static float *dt__tp_state_gather(dt_tp *t, const dt_model *m, float *local) {
    const dt_model *W = &t->whole;
    float *whole = NULL;
    if (t->rank == 0 && !(whole = (float *)malloc((size_t)W->numel * sizeof(float) + 1)))
        dt_fail("out of memory (gathering the tensor-parallel pieces for a checkpoint: %.1f MB)", W->numel * 4e-6);
    for (int i = 0; i < m->nparams; i++) {
        const dt_tensor *p = &m->params[i];
        size_t bytes = (size_t)p->numel * sizeof(float);
        if (m->splits[i].dim < 0) {
            if (whole) dt__download_from(m->device, whole + W->offsets[i], local + m->offsets[i], bytes);
            continue;
        }
        float *all = (float *)dt_alloc_on(m->device, DT_ARENA_COMM, bytes * (size_t)t->size);
        dt_all_gather(t->group, local + m->offsets[i], all, p->numel, DT_F32);
        if (whole) {
            float *host = dt__host_view(m->device, all, p->numel * t->size);
            for (int r = 0; r < t->size; r++)
                dt__tp_piece(whole + W->offsets[i], host + (size_t)r * (size_t)p->numel, W->params[i].shape, p->ndim,
                             m->splits[i], t->size, r, 1);
            dt__host_view_close(m->device, host, all, p->numel * t->size, 0);
        }
        dt_free_on(m->device, DT_ARENA_COMM, all, bytes * (size_t)t->size);
    }
    return whole;
}


/* A parameter's name with its block number as "*": what every block shares. */
static void dt__block_pattern(const char *name, char *out, size_t n) {
    size_t k = 0;
    for (const char *c = name; *c && k + 1 < n; ) {
        const char *e = c;
        while (*e >= '0' && *e <= '9') e++;
        if (e > c && (c == name || c[-1] == '.') && (*e == '.' || !*e)) { out[k++] = '*'; c = e; }
        else out[k++] = *c++;
    }
    out[k] = 0;
}

static void dt__shape_string(const int *shape, int ndim, char *out, size_t n) {
    size_t k = 0;
    out[0] = 0;
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(out + k, n - k, d ? "x%d" : "%d", shape[d]);
}

/* At start-up: each rank's bytes against the whole model's, and which
   tensors are cut, whole and here (rows alike in every block printed once). */
static void dt__tp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_tp *t = (const dt_tp *)par;
    const dt_model *m = t->model, *W = &t->whole;
    double split = 0, whole = 0, moments = o->v ? 2 : 1;
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].dim >= 0) split += 4.0 * W->params[i].numel;
        else whole += 4.0 * W->params[i].numel;
    }
    /* wrapped by a data-parallel engine (2-D), this rank keeps what the
       engine's table above says: the pieces here are what it shards */
    int wrapped = t->model->parallel != &t->par;
    printf("memory per rank, --tp %d: every block's layers split over %d ranks, %d data-parallel group%s (MB):\n", t->size,
           t->size, t->par.data_ranks, t->par.data_ranks > 1 ? "s" : "");
    printf("  %-16s %9s %9s   %s\n", "", wrapped ? "pieces" : "this rank", "whole", "formula (S: the split tensors, R: the rest)");
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    dt_arena arenas[3] = { DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM };
    for (int r = 0; r < 3; r++)
        printf("  %-16s %9.3f %9.3f   %s(S/%d + R)%s\n", rows[r],
               wrapped ? (r == 2 ? moments : 1) * (split / t->size + whole) / 1e6 : dt_mem_now(arenas[r]) / 1e6,
               (r == 2 ? moments : 1) * (split + whole) / 1e6, r == 2 && moments == 2 ? "2 x " : "", t->size,
               wrapped ? ", which the engine above shards or keeps" : "");
    printf("  S = %.3f MB whole, %.3f here; R = %.3f MB (norms, biases after a sum, what does not divide) on every rank\n",
           split / 1e6, split / t->size / 1e6, whole / 1e6);
    char seen[64][96];
    int nseen = 0;
    int width = 30;                             /* the names' column: Llama's are long */
    for (int i = 0; i < m->nparams; i++) {
        char pattern[96];
        dt__block_pattern(m->params[i].name, pattern, sizeof pattern);
        if (m->splits[i].dim >= 0 && (int)strlen(pattern) > width) width = (int)strlen(pattern);
    }
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].vocab && m->splits[i].dim < 0)
            printf("    %-*s %12d rows stay whole: the vocabulary does not divide by %d\n", width, m->params[i].name,
                   m->params[i].shape[0], t->size);
        if (m->splits[i].dim < 0) continue;
        char pattern[96], a[48], b[48];
        int count = 0, dup = 0;
        dt__block_pattern(m->params[i].name, pattern, sizeof pattern);
        for (int k = 0; k < nseen; k++) dup |= !strcmp(seen[k], pattern);
        if (dup) continue;
        if (nseen < 64) dt__copy_str(seen[nseen++], sizeof seen[0], pattern);
        for (int j = i; j < m->nparams; j++) {
            char other[96];
            dt__block_pattern(m->params[j].name, other, sizeof other);
            count += !strcmp(other, pattern);
        }
        dt__shape_string(W->params[i].shape, W->params[i].ndim, a, sizeof a);
        dt__shape_string(m->params[i].shape, m->params[i].ndim, b, sizeof b);
        printf("    %-*s %12s -> %-12s%s", width, pattern, a, b, m->splits[i].parts > 1 ? " q, k and v each by heads"
                                                                   : m->splits[i].vocab ? " the vocabulary, by tokens" : "");
        if (count > 1) printf("%s x%d blocks", m->splits[i].parts > 1 ? "," : "", count);
        printf("\n");
    }
    fflush(stdout);
}

/* A checkpoint's view (the checkpoints chapter, or a wrapper around this
   one): the whole state from a state laid out as this rank's pieces
   (`layout`: the model, or a pipeline's stages composed), gathered over the
   group for its first rank -- the first group's only, as the groups hold
   the same; and back, each rank cutting its pieces from the whole file. */
static float *dt__tp_whole_from_local(dt_parallel *par, const dt_model *layout, float *local) {
    dt_tp *t = (dt_tp *)par;
    return t->par.data_rank == 0 ? dt__tp_state_gather(t, layout, local) : NULL;
}
static void dt__tp_local_from_whole(dt_parallel *par, const dt_model *layout, float *whole, float *local) {
    dt__tp_state_scatter((dt_tp *)par, layout, whole, local);
}

const dt_parallel_report dt__tp_report = {
    .create_fn = "dt_tp_create",
    .memory_table = dt__tp_memory_table, .cost_input = dt__tp_cost_input, .bench_fields = dt__tp_bench_fields,
    .whole_from_local = dt__tp_whole_from_local, .local_from_whole = dt__tp_local_from_whole,
};
/* [src/15-pipeline-parallel.h] */
/* ---- what the machinery asks of pipeline parallelism (the run driver's dt_parallel_report) ----
   A checkpoint holds the model whole: the stages' parameters (and, with
   --tp, their pieces) gathered to the job's rank 0; the memory table shows
   each stage's share; the log, --bench and the cost model get the step's
   bubble and balance, measured. */
static double dt__pp_stage_params(const dt_pp *p, int stage) {
    double held = 0;
    for (int i = 0; i < p->model->nparams; i++) if (dt__pp_holds(p, stage, i)) held += (double)p->whole.params[i].numel;
    return held;
}

static int dt__pp_owner(const dt_pp *p, int i) {     /* the first stage that holds parameter i */
    for (int s = 0; s < p->stages; s++) if (dt__pp_holds(p, s, i)) return s;
    return 0;
}

/* Checkpoints are whole (the checkpoints chapter): to save, the first pipeline's stages
   send what they hold to its first rank, one tensor at a time, and that
   rank -- the job's rank 0 -- writes; to load, every rank reads the whole
   and keeps its stage's. */
static float *dt__pp_state_gather(dt_pp *p, float *local) {
    dt_model *m = p->model;
    const dt_model *W = &p->whole;
    float *whole = NULL;
    if (p->stage == 0 && !(whole = (float *)malloc((size_t)W->numel * sizeof(float) + 1)))
        dt_fail("out of memory (gathering the pipeline's stages for a checkpoint: %.1f MB)", W->numel * 4e-6);
    for (int i = 0; i < m->nparams; i++) {
        int owner = dt__pp_owner(p, i);
        int64_t n = W->params[i].numel;
        size_t bytes = (size_t)n * sizeof(float);
        if (owner == 0) {
            if (whole) dt__download_from(m->device, whole + W->offsets[i], local + m->offsets[i], bytes);
        } else if (p->stage == owner) dt_send(p->pipe, local + m->offsets[i], n, DT_F32, 0);
        else if (whole) {
            float *buf = (float *)dt_alloc_on(m->device, DT_ARENA_COMM, bytes);
            dt_recv(p->pipe, buf, n, DT_F32, owner);
            dt__download_from(m->device, whole + W->offsets[i], buf, bytes);
            dt_free_on(m->device, DT_ARENA_COMM, buf, bytes);
        }
    }
    return whole;
}

/* The whole state from this rank's stage (`local`, laid out as the cut
   model): the stages' gathered at the first, and around tensor parallelism
   their pieces then gathered over its group by the report inside (and, to
   load, cut the other way). For an engine around this one too (FSDP). */
static float *dt__pp_whole_from_local(dt_parallel *par, const dt_model *layout, float *local) {
    dt_pp *p = (dt_pp *)par;
    (void)layout;                           /* this stage's: the model as cut */
    if (p->par.data_rank != 0) return NULL; /* the pipelines hold the same: the first one writes */
    float *staged = dt__pp_state_gather(p, local);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (!in || !in->whole_from_local || p->stage != 0) return staged;
    size_t bytes = (size_t)p->whole.numel * sizeof(float);
    float *pieces = (float *)dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    dt__upload_to(p->model->device, pieces, staged, bytes);
    free(staged);
    float *whole = in->whole_from_local(who, &p->whole, pieces);
    dt_free_on(p->model->device, DT_ARENA_COMM, pieces, bytes);
    return whole;
}
static void dt__pp_local_from_whole(dt_parallel *par, const dt_model *layout, float *whole, float *local) {
    dt_pp *p = (dt_pp *)par;
    (void)layout;
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (!in || !in->local_from_whole) { dt__pp_scatter(p, whole, local); return; }
    size_t bytes = (size_t)p->whole.numel * sizeof(float);
    float *pieces = (float *)dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    in->local_from_whole(who, &p->whole, whole, pieces);
    float *view = dt__host_view(p->model->device, pieces, p->whole.numel);
    dt__pp_scatter(p, view, local);
    dt__host_view_close(p->model->device, view, pieces, p->whole.numel, 0);
    dt_free_on(p->model->device, DT_ARENA_COMM, pieces, bytes);
}
/* At start-up: which blocks each stage runs, and what it holds. */
static void dt__pp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_pp *p = (const dt_pp *)par;
    const dt_model *m = p->model;
    int n = dt_model_blocks(m);
    printf("pipeline, --pp %d: %d stages, %d micro-batch%s per step, schedule %s (bubble (P - 1) / (M + P - 1) = %.0f%%); "
           "%d data-parallel pipeline%s\n", p->stages, p->stages, p->micro_batches, p->micro_batches > 1 ? "es" : "",
           dt__pp_schedules[p->schedule].name, 100.0 * (p->stages - 1) / (p->micro_batches + p->stages - 1),
           p->par.data_ranks, p->par.data_ranks > 1 ? "s" : "");
    int embedding = 0;                      /* the mlp has none: its first layer is a block */
    for (int i = 0; i < m->nparams; i++) embedding |= m->splits[i].block < 0;
    for (int s = 0; s < p->stages; s++) {
        double held = dt__pp_stage_params(p, s);
        int a = p->first_block[s], b = p->first_block[s + 1];
        char blocks[48];
        if (b - a > 1) snprintf(blocks, sizeof blocks, "blocks %d-%d", a, b - 1);
        else snprintf(blocks, sizeof blocks, "block %d", a);
        printf("  stage %d: %s%s%s  %.3f MB of parameters (%.3f MB with gradients and %s state)\n", s,
               s == 0 && embedding ? "the embedding, " : "", blocks, s == p->stages - 1 ? ", the head" : "", 4e-6 * held,
               4e-6 * held * (o->v ? 4 : 3), o->v ? "adamw's" : "sgd's");
    }
    const dt_parallel *split = dt_parallel_splitting(par->inner);
    if (split)
        printf("  each stage's blocks split over --tp %d ranks as in stage 06: the sizes above are one rank's pieces\n",
               split->tp_size);
    dt_parallel *who;
    if (m->parallel != par && p->par.data_ranks > 1)        /* DDP has no table; FSDP's is above */
        printf("  the %d pipelines' copies of each stage: %s\n", p->par.data_ranks,
               dt_parallel_report_of(m->parallel, &who) && who != par ? "sharded as FSDP's table above says"
                                                                       : "each whole, their gradients averaged (DDP)");
    printf("  the whole model: %.3f MB of parameters, %d blocks\n", 4e-6 * (double)par->whole->numel, n);
    fflush(stdout);
}

/* The last step's figures: the pipeline's bubble, its stages' idle time
   over their time in the pipeline (each stage waits its own share: the
   first more, when the last, with the head, computes more); how uneven the
   stages are, the busiest one's compute over the mean (1: even). */
static double dt__pp_bubble(const dt_pp *p) { return p->pipe_step_ms > 0 ? p->pipe_idle_ms / p->pipe_step_ms : 0; }
static double dt__pp_balance_of(const dt_pp *p) {
    return p->pipe_busy_ms > 0 ? p->pipe_busiest_ms * p->stages / p->pipe_busy_ms : 1;
}

/* The cost model's view of it: the whole model's compute on one rank is
   what the stages computed together -- with --tp, less the time their
   layers' sums took, and times the T ranks that shared each stage's split
   layers. */
/* Around tensor parallelism: its group's size (0: none) and the share of the
   parameters it splits, from the report inside. */
static int dt__pp_tp_share(const dt_parallel *par, double *share) {
    const dt_parallel *split = dt_parallel_splitting(par->inner);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    dt_cost_input mine = { 0 };
    *share = 0;
    if (!split || !in || !in->cost_input) return 0;
    in->cost_input(who, &mine);
    *share = mine.tp_share;
    return split->tp_size;
}
static int dt__pp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_pp *p = (const dt_pp *)par;
    in->kind = DT_PAR_PP;
    in->pp_micro_batches = p->micro_batches;
    in->pp_balance = dt__pp_balance_of(p);
    in->pp_bytes = p->act_bytes;
    in->pp_measured_bubble = dt__pp_bubble(p);
    in->compute_ms = p->pipe_busy_ms;
    in->dp_groups = p->par.data_ranks;
    int64_t stepped = p->model->numel;      /* the optimizer's share of the whole model (an engine around: times its ranks) */
    in->optimizer_ms *= stepped > 0 ? (double)par->whole->numel / (double)stepped : 1;
    double share;
    int T = dt__pp_tp_share(par, &share);
    if (T) {
        in->tp_ranks = T;
        in->tp_share = share;
        in->tp_sums = p->pipe_tp_sums / p->micro_batches;
        in->tp_bytes = p->pipe_tp_sums > 0 ? p->pipe_tp_sum_bytes / p->pipe_tp_sums : 0;
        double kept = share / T + (1 - share);
        in->compute_ms = fmax(0, p->pipe_busy_ms - p->pipe_tp_sum_ms) / kept;
    }
    return p->stages;
}

static void dt__pp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_pp *p = (const dt_pp *)par;
    (void)accum_steps;
    fprintf(out, " pp=%d pp_micro_batches=%d pp_balance=%.4f pp_bytes=%.0f bubble=%.4f bubble_predicted=%.4f", p->stages,
            p->micro_batches, dt__pp_balance_of(p), p->act_bytes, dt__pp_bubble(p),
            (p->stages - 1.0) / (p->micro_batches + p->stages - 1.0));
    double share;
    int T = dt__pp_tp_share(par, &share);
    if (T)            /* the whole pipeline's layer sums per micro-batch, as the cost model counts them */
        fprintf(out, " tp=%d tp_share=%.4f tp_sums=%.1f tp_bytes=%.0f", T, share, p->pipe_tp_sums / p->micro_batches,
                p->pipe_tp_sums > 0 ? p->pipe_tp_sum_bytes / p->pipe_tp_sums : 0.0);
    fprintf(out, " dp=%d", p->par.data_ranks);
}

/* The step's pipeline figures, in its --log record. */
static void dt__pp_log_fields(const dt_parallel *par, FILE *log) {
    const dt_pp *p = (const dt_pp *)par;
    double P = p->stages, M = p->micro_batches;
    fprintf(log, ",\"pp_busy_ms\":%.3f,\"pp_idle_ms\":%.3f,\"pp_step_ms\":%.3f,\"bubble\":%.4f,\"bubble_predicted\":%.4f,"
                 "\"pp_balance\":%.4f,\"pp_kept_bytes\":%.0f,\"pp_micro_bytes\":%.0f,\"pp_kept_micro_batches\":%d",
            p->busy_ms, p->idle_ms, p->step_ms, dt__pp_bubble(p), (P - 1) / (M + P - 1), dt__pp_balance_of(p), p->kept_peak,
            p->kept_micro, p->kept_micro_batches);
}

const dt_parallel_report dt__pp_report = {
    .create_fn = "dt_pp_create",
    .memory_table = dt__pp_memory_table, .log_fields = dt__pp_log_fields, .cost_input = dt__pp_cost_input,
    .bench_fields = dt__pp_bench_fields, .whole_from_local = dt__pp_whole_from_local,
    .local_from_whole = dt__pp_local_from_whole,
};
/* [src/16-context-parallel.h] */
/* ---- what the machinery asks of context parallelism (the run driver's
   dt_parallel_report) ----
   Every rank holds the whole model, so checkpoints and the memory table
   need nothing of it; the cost model and --bench learn its ring. */
/* A causal model's attention work of rank q, in query-key pairs: each of
   its tokens sees the keys at its position and before. */
static double dt__cp_attention_pairs(const dt_cp *cp, int q) {
    int32_t *at = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)cp->T);
    double pairs = 0;
    dt_cp_positions(cp->layout, cp->T * cp->size, cp->size, q, at);
    for (int i = 0; i < cp->T; i++) pairs += at[i] + 1.0;
    return pairs;
}
/* What the cost model needs of the ring, from the model's shape: attention's
   share of the compute, the keys and values a layer sends, the layers. */
static void dt__cp_ring_shape(const dt_cp *cp, dt_cost_input *in) {
    const dt_model *m = cp->model;
    int T = cp->T * cp->size;
    double square = 12.0 * m->cfg.depth * m->cfg.dim * T;    /* dt_model_flops_per_token's attention: the whole square */
    double attention = square * (T + 1.0) / (2.0 * T);       /* the causal half a token sees, on average */
    in->cp_attention_share = attention / (dt_model_flops_per_token(m) - square + attention);
    in->cp_kv_bytes = (double)cp->B * T * 2 * m->cfg.dim * 4;
    in->cp_layers = m->cfg.depth;
    in->cp_contiguous = cp->layout == DT_CP_CONTIGUOUS && cp->size > 1;
}
/* The cost model's view of the last step: the whole sequences' compute on
   one rank, from this rank's share of it (its tokens' per-token work, its
   attention pairs' share of attention) and the time it waited for the ring. */
static int dt__cp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_cp *cp = (const dt_cp *)par;
    int K = in->accum_steps > 0 ? in->accum_steps : 1, C = cp->size, T = cp->T * C;
    double mean = (double)T * (T + 1.0) / 2 / C, mine = dt__cp_attention_pairs(cp, cp->rank);
    in->kind = DT_PAR_CP;
    dt__cp_ring_shape(cp, in);
    double a = in->cp_attention_share, share = ((1 - a) + a * mine / mean) / C;   /* this rank's part of the work */
    in->compute_ms = fmax(0, in->compute_ms - cp->step_ring_ms / K) / share;
    in->dp_groups = cp->par.data_ranks;
    return C;
}
static void dt__cp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_cp *cp = (const dt_cp *)par;
    dt_cost_input in = { 0 };
    dt__cp_ring_shape(cp, &in);
    fprintf(out, " cp=%d cp_layout=%s cp_ring_ms=%.3f cp_attention_share=%.4f cp_kv_bytes=%.0f cp_layers=%d cp_contiguous=%d",
            cp->size, cp->layout == DT_CP_ZIGZAG ? "zigzag" : "contiguous", cp->step_ring_ms / accum_steps,
            in.cp_attention_share, in.cp_kv_bytes, in.cp_layers, in.cp_contiguous);
}
const dt_parallel_report dt__cp_report = {
    .create_fn = "dt_cp_create", .cost_input = dt__cp_cost_input, .bench_fields = dt__cp_bench_fields,
};
#endif /* DTRAIN_IMPLEMENTATION */

/* [src/27-cuda.h] */
/* ================================================================================
   THE CUDA BACKEND
   Compiled by nvcc from this same file:
       nvcc -x cu -DDTRAIN_CUDA_IMPLEMENTATION -c dtrain.h -o dtrain_cuda.o
   and linked beside a C file built with -DDT_HAVE_CUDA (the Makefile does both).

   What it teaches: a GPU body differs from the CPU loop in three things only --
   indexing (one thread per element, or one warp per row), reductions (threads
   cooperate through warp shuffles and shared memory, in a fixed order so that
   every run gives the same bits), and launch shape. The arithmetic per element
   is the same DT_HD function the CPU calls. Matmuls go to cuBLAS in fp32 (no
   TF32), attention's per-head matmuls to one strided-batched call.
   Every CUDA and cuBLAS call is checked: a failure names the call, the file and
   line, and CUDA's own description, then exits like any other dtrain error.
   ================================================================================ */
#if defined(DTRAIN_CUDA_IMPLEMENTATION) && defined(__CUDACC__) && !defined(DTRAIN_CUDA_DONE)
#define DTRAIN_CUDA_DONE
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

/* cuBLAS is opened when a GPU is first used, not when the program starts:
   linked, its libraries (600 MB with cuBLASLt) cost every start about 70 ms
   of relocations, which every CPU run, every tool and every rank paid (the
   test suite starts well over a thousand). The calls dtrain makes are looked
   up once, by the names cublas_v2.h gives them; a library or call that is
   missing is an error that names it. */
/* cublasGemmEx is overloaded in C++ (an inline wrapper takes the old
   cudaDataType compute type): the library's own, by its type. */
typedef cublasStatus_t (*dt__cublas_gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                             const void *, const void *, cudaDataType, int, const void *, cudaDataType,
                                             int, const void *, void *, cudaDataType, int, cublasComputeType_t,
                                             cublasGemmAlgo_t);
static struct {
    decltype(&cublasCreate) create;
    decltype(&cublasSetStream) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasGetStatusString) status_string;
    decltype(&cublasSgemm) sgemm;
    dt__cublas_gemm_ex gemm_ex;
    decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
} dt__cublas;
#define DT__NAME_OF(f) #f
#define DT__STRING(f) DT__NAME_OF(f)                 /* cublasCreate -> "cublasCreate_v2", as cublas_v2.h names it */
#define DT__CUBLAS_LOOKUP(field, f)                                                                          \
    if (!(dt__cublas.field = (decltype(dt__cublas.field))dlsym(lib, DT__STRING(f))))                         \
        dt_fail("%s has no %s (older than the cuBLAS %d this build was compiled with?)", name, DT__STRING(f), \
                CUBLAS_VER_MAJOR)
static void dt__cublas_load(void) {
    const char *name = "libcublas.so." DT__STRING(CUBLAS_VER_MAJOR);
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) dt_fail("cannot load cuBLAS for --device cuda: %s (the CUDA toolkit's lib64, or LD_LIBRARY_PATH)", dlerror());
    DT__CUBLAS_LOOKUP(create, cublasCreate);
    DT__CUBLAS_LOOKUP(set_stream, cublasSetStream);
    DT__CUBLAS_LOOKUP(set_math_mode, cublasSetMathMode);
    DT__CUBLAS_LOOKUP(status_string, cublasGetStatusString);
    DT__CUBLAS_LOOKUP(sgemm, cublasSgemm);
    DT__CUBLAS_LOOKUP(gemm_ex, cublasGemmEx);
    DT__CUBLAS_LOOKUP(sgemm_strided_batched, cublasSgemmStridedBatched);
}
static void dt__cublas_open(void) {                 /* once, whichever thread comes first (stage 02's devices) */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, dt__cublas_load);
}

static struct {
    int index;
    cudaStream_t stream;                 /* every kernel, copy and matmul, in order */
    cublasHandle_t blas;
    double *partials;                    /* sum_squares: one double per block, then the total */
    float *scratch;                      /* column sums: partial sums per slab of rows */
    size_t scratch_floats;
    void *row_loss;                      /* cross-entropy: each row's loss, summed in order after */
    size_t row_loss_bytes;
    dt_backend table;
} dt__cuda;

static void dt__cuda_check(cudaError_t err, const char *call, const char *file, int line) {
    if (err != cudaSuccess)
        dt_fail("%s failed at %s:%d: %s (%s)", call, file, line, cudaGetErrorString(err), cudaGetErrorName(err));
}
static void dt__cublas_check(cublasStatus_t st, const char *call, const char *file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) dt_fail("%s failed at %s:%d: %s", call, file, line, dt__cublas.status_string(st));
}
#define DT_CUDA_CHECK(call) dt__cuda_check((call), #call, __FILE__, __LINE__)
#define DT_CUBLAS_CHECK(call) dt__cublas_check((call), #call, __FILE__, __LINE__)
/* A launch returns no status; cudaGetLastError() holds a bad launch shape. */
#define DT_LAUNCH(kernel, blocks, threads, ...)                                          \
    do {                                                                                 \
        kernel<<<(blocks), (threads), 0, dt__cuda.stream>>>(__VA_ARGS__);                \
        dt__cuda_check(cudaGetLastError(), "launching " #kernel, __FILE__, __LINE__);    \
    } while (0)

static unsigned dt__blocks_for_warps(int64_t rows) {      /* one warp (32 threads) per row */
    return dt_blocks_for(rows * 32);
}
#define DT_FOR_EACH(i, n)                                                                          \
    for (int64_t i = dt_grid_first(blockIdx.x, blockDim.x, threadIdx.x); i < (n);                  \
         i += dt_grid_stride(gridDim.x, blockDim.x))
/* One warp per row; `lane` is the thread's place in it. Whole warps move on
   together, so the shuffles inside see all 32 lanes. */
#define DT_FOR_EACH_ROW(row, rows)                                                                 \
    for (int64_t row = dt_grid_first(blockIdx.x, blockDim.x, threadIdx.x) / 32; row < (rows);      \
         row += dt_grid_stride(gridDim.x, blockDim.x) / 32)

__device__ static inline float dt__warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ static inline float dt__warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* ---- memory and copies ---- */
static void *dt__cuda_alloc(size_t bytes) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        dt_fail("cudaMalloc of %.1f MB failed: %s (%.1f MB of %.1f MB free on the GPU; try a smaller --batch-size)",
                bytes / 1e6, cudaGetErrorString(err), free_b / 1e6, total_b / 1e6);
    }
    return p;
}
/* Only the first steps free GPU memory (the step arena growing): let queued
   kernels that may still read it finish first. */
static void dt__cuda_release(void *p) {
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
    DT_CUDA_CHECK(cudaFree(p));
}
static void dt__cuda_zero(void *p, size_t bytes) { DT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, dt__cuda.stream)); }
/* Host buffers are ordinary (pageable) memory: wait, so the caller may reuse them at once. */
static void dt__cuda_upload(void *dst, const void *src, size_t bytes) {
    DT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
}
static void dt__cuda_download(void *dst, const void *src, size_t bytes) {
    DT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
}
static void dt__cuda_synchronize(void) { DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream)); }
/* Is p memory of a GPU (or managed)? Host memory, and pointers CUDA has never
   seen, are not. */
static int dt__cuda_owns(const void *p) {
    cudaPointerAttributes a;
    cudaError_t err = cudaPointerGetAttributes(&a, p);
    if (err == cudaErrorInvalidValue) { cudaGetLastError(); return 0; }    /* a pointer CUDA does not know */
    DT_CUDA_CHECK(err);                                                    /* anything else is a real error */
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* ---- matmul: cuBLAS is column-major. A row-major matrix is its column-major
        transpose, so C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T:
        swap the operands and M with N, keep every leading dimension. ---- */
static void dt__cuda_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                         const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    DT_CUBLAS_CHECK(dt__cublas.sgemm(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                &alpha, B, ldb, A, lda, &beta, C, ldc));
}
/* Mixed precision: 16-bit operands on the tensor cores, products summed in f32
   (CUBLAS_COMPUTE_32F), an f32 result. This is where bf16 earns its speed. */
static void dt__cuda_gemm_half(dt_dtype dtype, int ta, int tb, int M, int N, int K, const void *A, int lda,
                              const void *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    float alpha = 1.0f;
    cudaDataType_t t = dtype == DT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    DT_CUBLAS_CHECK(dt__cublas.gemm_ex(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                 &alpha, B, t, ldb, A, t, lda, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
}
static void dt__cuda_gemm_batched(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                                 long long sa, const float *B, int ldb, long long sb, float beta, float *C, int ldc,
                                 long long sc, int batch) {
    DT_CUBLAS_CHECK(dt__cublas.sgemm_strided_batched(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                              N, M, K, &alpha, B, ldb, sb, A, lda, sa, &beta, C, ldc, sc, batch));
}

/* ---- column sums in a fixed order: out[j] += sum over rows of x[i, j] (times
        LayerNorm's x-hat for its weight gradient). Blocks of 32 columns x 8 row
        lanes sum one slab of rows each; a second kernel adds the slabs in order.
        No atomics, so the result is the same every run. ---- */
__global__ static void dt__k_colsum_partial(const float *dy, const float *x, const float *stats, int rows, int cols,
                                           int ld, int slab_rows, float *part_db, float *part_dw) {
    __shared__ float sh_db[8][33], sh_dw[8][33];
    int tx = threadIdx.x, ty = threadIdx.y, j = blockIdx.x * 32 + tx, slab = blockIdx.y;
    int r0 = slab * slab_rows, r1 = min(rows, r0 + slab_rows);
    float db = 0, dw = 0;
    if (j < cols)
        for (int i = r0 + ty; i < r1; i += 8) {
            float g = dy[(size_t)i * ld + j];
            db += g;
            if (part_dw) dw += g * (x[(size_t)i * ld + j] - stats[i]) * stats[rows + i];
        }
    sh_db[ty][tx] = db;
    sh_dw[ty][tx] = dw;
    __syncthreads();
    if (ty == 0 && j < cols) {
        float a = 0, b = 0;
        for (int k = 0; k < 8; k++) { a += sh_db[k][tx]; b += sh_dw[k][tx]; }
        part_db[(size_t)slab * cols + j] = a;
        if (part_dw) part_dw[(size_t)slab * cols + j] = b;
    }
}
__global__ static void dt__k_colsum_finish(const float *part, int slabs, int cols, float *out) {
    DT_FOR_EACH(j, cols) {
        float s = 0;
        for (int k = 0; k < slabs; k++) s += part[(size_t)k * cols + j];
        out[j] += s;
    }
}
/* A buffer that grows to the largest size asked (in the first step only). */
static void *dt__cuda_grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        if (*buf) dt__cuda_release(*buf);
        *buf = dt__cuda_alloc(bytes);
        *cap = bytes;
    }
    return *buf;
}
static float *dt__cuda_scratch(size_t floats) {
    if (floats > dt__cuda.scratch_floats) {        /* grows in the first step only */
        if (dt__cuda.scratch) dt__cuda_release(dt__cuda.scratch);
        dt__cuda.scratch = (float *)dt__cuda_alloc(floats * sizeof(float));
        dt__cuda.scratch_floats = floats;
    }
    return dt__cuda.scratch;
}
/* db[j] += sum_i dy[i*ld + j]; with x and stats also dw[j] += sum_i dy * x-hat. */
static void dt__cuda_column_sums(const float *dy, const float *x, const float *stats, int rows, int cols, int ld,
                                float *db, float *dw) {
    if (rows <= 0 || cols <= 0 || (!db && !dw)) return;
    int slabs = (rows + 63) / 64;
    if (slabs > 128) slabs = 128;
    int slab_rows = (rows + slabs - 1) / slabs;
    float *part = dt__cuda_scratch((size_t)2 * slabs * cols);
    dim3 grid((unsigned)((cols + 31) / 32), (unsigned)slabs), block(32, 8);
    DT_LAUNCH(dt__k_colsum_partial, grid, block, dy, x, stats, rows, cols, ld, slab_rows, part,
              dw ? part + (size_t)slabs * cols : (float *)NULL);
    if (db) DT_LAUNCH(dt__k_colsum_finish, dt_blocks_for(cols), DT_THREADS, part, slabs, cols, db);
    if (dw) DT_LAUNCH(dt__k_colsum_finish, dt_blocks_for(cols), DT_THREADS, part + (size_t)slabs * cols, slabs, cols, dw);
}
static void dt__cuda_sum_rows(const float *x, float *out, int rows, int cols) {
    dt__cuda_column_sums(x, NULL, NULL, rows, cols, cols, out, NULL);
}

/* ---- element-wise ops: one thread per element, the DT_HD arithmetic ---- */
__global__ static void dt__k_add_bias(float *y, const float *b, int64_t n, int cols) {
    DT_FOR_EACH(i, n) y[i] += b[i % cols];
}
static void dt__cuda_add_bias(float *y, const float *b, int rows, int cols) {
    int64_t n = (int64_t)rows * cols;
    DT_LAUNCH(dt__k_add_bias, dt_blocks_for(n), DT_THREADS, y, b, n, cols);
}
__global__ static void dt__k_gelu_forward(const float *x, float *y, int64_t n, int tanh_form) {
    DT_FOR_EACH(i, n) y[i] = tanh_form ? dt_gelu_tanh_value(x[i]) : dt_gelu_value(x[i]);
}
static void dt__cuda_gelu_forward(const float *x, float *y, int64_t n, int tanh_form) {
    DT_LAUNCH(dt__k_gelu_forward, dt_blocks_for(n), DT_THREADS, x, y, n, tanh_form);
}
__global__ static void dt__k_gelu_backward(const float *x, const float *dy, float *dx, int64_t n, int tanh_form) {
    DT_FOR_EACH(i, n) dx[i] += dy[i] * (tanh_form ? dt_gelu_tanh_derivative(x[i]) : dt_gelu_derivative(x[i]));
}
static void dt__cuda_gelu_backward(const float *x, const float *dy, float *dx, int64_t n, int tanh_form) {
    DT_LAUNCH(dt__k_gelu_backward, dt_blocks_for(n), DT_THREADS, x, dy, dx, n, tanh_form);
}
__global__ static void dt__k_add(const float *a, const float *b, float *y, int64_t n) {
    DT_FOR_EACH(i, n) y[i] = a[i] + b[i];
}
static void dt__cuda_add(const float *a, const float *b, float *y, int64_t n) {
    DT_LAUNCH(dt__k_add, dt_blocks_for(n), DT_THREADS, a, b, y, n);
}
__global__ static void dt__k_accumulate(float *dst, const float *src, int64_t n) {
    DT_FOR_EACH(i, n) dst[i] += src[i];
}
static void dt__cuda_accumulate(float *dst, const float *src, int64_t n) {
    DT_LAUNCH(dt__k_accumulate, dt_blocks_for(n), DT_THREADS, dst, src, n);
}
__global__ static void dt__k_scale(float *x, float c, int64_t n) {
    DT_FOR_EACH(i, n) x[i] *= c;
}
static void dt__cuda_scale(float *x, float c, int64_t n) { DT_LAUNCH(dt__k_scale, dt_blocks_for(n), DT_THREADS, x, c, n); }

/* ---- LayerNorm: one warp per row; the 32 lanes split the row and meet in
        warp shuffles. Two passes (mean, then variance), as on the CPU. ---- */
__global__ static void dt__k_layernorm_forward(const float *x, const float *w, const float *b, float *y, float *stats,
                                              int rows, int D, float eps) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D;
        float *yr = y + row * D;
        float sum = 0, var = 0;
        for (int j = lane; j < D; j += 32) sum += xr[j];
        float mean = dt__warp_sum(sum) / D;
        for (int j = lane; j < D; j += 32) { float d = xr[j] - mean; var += d * d; }
        float rstd = 1.0f / sqrtf(dt__warp_sum(var) / D + eps);
        for (int j = lane; j < D; j += 32) yr[j] = (xr[j] - mean) * rstd * (w ? w[j] : 1.0f) + (b ? b[j] : 0.0f);
        if (lane == 0) { stats[row] = mean; stats[rows + row] = rstd; }
    }
}
static void dt__cuda_layernorm_forward(const float *x, const float *w, const float *b, float *y, float *stats, int rows,
                                      int cols, float eps) {
    DT_LAUNCH(dt__k_layernorm_forward, dt__blocks_for_warps(rows), DT_THREADS, x, w, b, y, stats, rows, cols, eps);
}
__global__ static void dt__k_layernorm_backward_dx(const float *x, const float *w, const float *dy, const float *stats,
                                                  float *dx, int rows, int D) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D, *dyr = dy + row * D;
        float mean = stats[row], rstd = stats[rows + row], sum_g = 0, sum_gx = 0;
        for (int j = lane; j < D; j += 32) {
            float g = dyr[j] * (w ? w[j] : 1.0f);
            sum_g += g;
            sum_gx += g * (xr[j] - mean) * rstd;
        }
        float mg = dt__warp_sum(sum_g) / D, mgx = dt__warp_sum(sum_gx) / D;
        for (int j = lane; j < D; j += 32) {
            float g = dyr[j] * (w ? w[j] : 1.0f), xhat = (xr[j] - mean) * rstd;
            dx[row * D + j] += rstd * (g - mg - xhat * mgx);
        }
    }
}
static void dt__cuda_layernorm_backward(const float *x, const float *w, const float *dy, const float *stats, float *dx,
                                       float *dw, float *db, int rows, int cols) {
    if (dx) DT_LAUNCH(dt__k_layernorm_backward_dx, dt__blocks_for_warps(rows), DT_THREADS, x, w, dy, stats, dx, rows, cols);
    dt__cuda_column_sums(dy, x, stats, rows, cols, cols, db, dw);
}

/* ---- Llama's RMSNorm (a warp per row, as LayerNorm), SwiGLU and rotary
        embeddings (a thread per element; a key/value head's thread adds its
        group's query heads in order, as the CPU does) ---- */
__global__ static void dt__k_rmsnorm_forward(const float *x, const float *w, float *y, float *stats, int rows, int D, float eps) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D;
        float *yr = y + row * D, sq = 0;
        for (int j = lane; j < D; j += 32) sq += xr[j] * xr[j];
        float rstd = 1.0f / sqrtf(dt__warp_sum(sq) / D + eps);
        for (int j = lane; j < D; j += 32) yr[j] = (xr[j] * rstd) * w[j];
        if (lane == 0) { stats[row] = 0.0f; stats[rows + row] = rstd; }
    }
}
static void dt__cuda_rmsnorm_forward(const float *x, const float *w, float *y, float *stats, int rows, int cols, float eps) {
    DT_LAUNCH(dt__k_rmsnorm_forward, dt__blocks_for_warps(rows), DT_THREADS, x, w, y, stats, rows, cols, eps);
}
__global__ static void dt__k_rmsnorm_backward_dx(const float *x, const float *w, const float *dy, const float *stats, float *dx,
                                                int rows, int D) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D, *dyr = dy + row * D;
        float rstd = stats[rows + row], sum_gx = 0;
        for (int j = lane; j < D; j += 32) sum_gx += dyr[j] * w[j] * (xr[j] * rstd);
        float mgx = dt__warp_sum(sum_gx) / D;
        for (int j = lane; j < D; j += 32) dx[row * D + j] += rstd * (dyr[j] * w[j] - (xr[j] * rstd) * mgx);
    }
}
static void dt__cuda_rmsnorm_backward(const float *x, const float *w, const float *dy, const float *stats, float *dx, float *dw,
                                     int rows, int cols) {
    if (dx) DT_LAUNCH(dt__k_rmsnorm_backward_dx, dt__blocks_for_warps(rows), DT_THREADS, x, w, dy, stats, dx, rows, cols);
    dt__cuda_column_sums(dy, x, stats, rows, cols, cols, NULL, dw);
}
__global__ static void dt__k_swiglu_forward(const float *g, const float *u, float *y, int64_t n) {
    DT_FOR_EACH(i, n) y[i] = dt_silu_value(g[i]) * u[i];
}
static void dt__cuda_swiglu_forward(const float *gate, const float *up, float *y, int64_t n) {
    DT_LAUNCH(dt__k_swiglu_forward, dt_blocks_for(n), DT_THREADS, gate, up, y, n);
}
__global__ static void dt__k_swiglu_backward(const float *g, const float *u, const float *dy, float *dg, float *du, int64_t n) {
    DT_FOR_EACH(i, n) {
        if (dg) dg[i] += dy[i] * u[i] * dt_silu_derivative(g[i]);
        if (du) du[i] += dy[i] * dt_silu_value(g[i]);
    }
}
static void dt__cuda_swiglu_backward(const float *gate, const float *up, const float *dy, float *dgate, float *dup, int64_t n) {
    DT_LAUNCH(dt__k_swiglu_backward, dt_blocks_for(n), DT_THREADS, gate, up, dy, dgate, dup, n);
}
/* element i of a row's q (or k) part: its pair's value turned by (co, si) */
__device__ static float dt__rotated(const float *x, int j, int half, float co, float si, int sign) {
    return j < half ? x[j] * co - sign * x[j + half] * si : x[j] * co + sign * x[j - half] * si;
}
__global__ static void dt__k_rotary_qkv_forward(const float *q, const float *k, const float *v, const float *cs, float *y,
                                               int BT, int T, int H, int KV, int hd) {
    int D = H * hd, half = hd / 2, group = H / KV;
    DT_FOR_EACH(i, (int64_t)BT * 3 * D) {
        int64_t r = i / (3 * D);
        int c = (int)(i % (3 * D)), part = c / D, h = (c % D) / hd, j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        if (part == 0) y[i] = dt__rotated(q + r * D + h * hd, j, half, pair[0], pair[1], 1);
        else if (part == 1) y[i] = dt__rotated(k + (r * KV + h / group) * hd, j, half, pair[0], pair[1], 1);
        else y[i] = v[(r * KV + h / group) * hd + j];
    }
}
static void dt__cuda_rotary_qkv_forward(const float *q, const float *k, const float *v, const float *cs, float *qkv, int BT,
                                       int T, int H, int KV, int hd) {
    DT_LAUNCH(dt__k_rotary_qkv_forward, dt_blocks_for((int64_t)BT * 3 * H * hd), DT_THREADS, q, k, v, cs, qkv, BT, T, H, KV, hd);
}
/* dq: one thread per element; dk, dv: one per element of a key/value head,
   adding its group's query heads in order */
__global__ static void dt__k_rotary_qkv_backward_q(const float *cs, const float *dy, float *dq, int BT, int T, int H, int hd) {
    int D = H * hd, half = hd / 2;
    DT_FOR_EACH(i, (int64_t)BT * D) {
        int64_t r = i / D;
        int c = (int)(i % D), j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        dq[i] += dt__rotated(dy + r * 3 * D + (c - j), j, half, pair[0], pair[1], -1);
    }
}
__global__ static void dt__k_rotary_qkv_backward_kv(const float *cs, const float *dy, float *dk, float *dv, int BT, int T, int H,
                                                   int KV, int hd) {
    int D = H * hd, half = hd / 2, group = H / KV;
    DT_FOR_EACH(i, (int64_t)BT * KV * hd) {
        int64_t r = i / (KV * hd);
        int c = (int)(i % (KV * hd)), g = c / hd, j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        float ak = 0, av = 0;
        for (int h = g * group; h < (g + 1) * group; h++) {
            ak += dt__rotated(dy + r * 3 * D + D + h * hd, j, half, pair[0], pair[1], -1);
            av += dy[r * 3 * D + 2 * D + h * hd + j];
        }
        if (dk) dk[i] += ak;
        if (dv) dv[i] += av;
    }
}
static void dt__cuda_rotary_qkv_backward(const float *cs, const float *dqkv, float *dq, float *dk, float *dv, int BT, int T, int H,
                                        int KV, int hd) {
    if (dq) DT_LAUNCH(dt__k_rotary_qkv_backward_q, dt_blocks_for((int64_t)BT * H * hd), DT_THREADS, cs, dqkv, dq, BT, T, H, hd);
    if (dk || dv)
        DT_LAUNCH(dt__k_rotary_qkv_backward_kv, dt_blocks_for((int64_t)BT * KV * hd), DT_THREADS, cs, dqkv, dk, dv, BT, T, H, KV, hd);
}

/* ---- attention: reorder Q, K, V to head-major, two strided-batched matmuls
        around a row softmax, reorder the output back. ---- */
/* rows [B, T, nsplit, H, hd] <-> heads [nsplit][B, H, T, hd] (nsplit 3: q, k, v):
   where element i of the rows sits among the heads. */
__device__ static inline int64_t dt__head_index(int64_t i, int B, int T, int H, int hd, int nsplit) {
    int64_t r = i;
    int d = (int)(r % hd); r /= hd;
    int h = (int)(r % H); r /= H;
    int which = (int)(r % nsplit); r /= nsplit;
    int t = (int)(r % T), b = (int)(r / T);
    return which * ((int64_t)B * T * H * hd) + (((int64_t)b * H + h) * T + t) * hd + d;
}
__global__ static void dt__k_split_heads(const float *rows, float *heads, int B, int T, int H, int hd, int nsplit) {
    DT_FOR_EACH(i, (int64_t)B * T * nsplit * H * hd) heads[dt__head_index(i, B, T, H, hd, nsplit)] = rows[i];
}
__global__ static void dt__k_merge_heads(const float *heads, float *rows, int B, int T, int H, int hd, int nsplit,
                                        int accumulate) {
    DT_FOR_EACH(i, (int64_t)B * T * nsplit * H * hd) {
        float v = heads[dt__head_index(i, B, T, H, hd, nsplit)];
        rows[i] = accumulate ? rows[i] + v : v;
    }
}
/* A row's online softmax by one warp: its largest value m and the sum l of
   exp(x - m) over r[0..n), in one pass -- each lane its own (m, l) over its
   columns, then the lanes' pairs merged by the same recurrence. Every lane
   ends with the row's pair. */
__device__ static void dt__warp_online_softmax(const float *r, int n, float *m_out, float *l_out) {
    float m = -INFINITY, l = 0;
    for (int j = threadIdx.x % 32; j < n; j += 32) {
        l *= dt_online_softmax_rescale(&m, r[j]);
        l += dt_exp_value(r[j] - m);
    }
    for (int o = 16; o > 0; o /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        l *= dt_online_softmax_rescale(&m, m2);
        l += m2 == -INFINITY ? 0.0f : l2 * dt_exp_value(m2 - m);
    }
    *m_out = m;
    *l_out = l;
}
__global__ static void dt__k_softmax_rows(float *P, int64_t rows, int T, int causal) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        float *r = P + row * T, m, l;
        int valid = causal ? (int)(row % T) + 1 : T;   /* causal: query i sees keys 0..i */
        dt__warp_online_softmax(r, valid, &m, &l);     /* one pass for m and l, one to write */
        for (int j = lane; j < T; j += 32) r[j] = j < valid ? dt_exp_value(r[j] - m) / l : 0.0f;
    }
}
__global__ static void dt__k_softmax_backward_rows(const float *P, float *dP, int64_t rows, int T, float scale) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *p = P + row * T;
        float *d = dP + row * T, dot = 0;
        for (int j = lane; j < T; j += 32) dot += d[j] * p[j];
        dot = dt__warp_sum(dot);
        for (int j = lane; j < T; j += 32) d[j] = p[j] * (d[j] - dot) * scale;
    }
}
static void dt__cuda_attention_forward(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                                      float scale, int causal) {
    int hd = D / H, BH = B * H;
    int64_t btd = (int64_t)B * T * D, tt = (int64_t)T * T, th = (int64_t)T * hd;
    float *P = saved, *q = saved + (int64_t)BH * tt, *k = q + btd, *v = k + btd, *o = v + btd;
    DT_LAUNCH(dt__k_split_heads, dt_blocks_for(3 * btd), DT_THREADS, qkv, q, B, T, H, hd, 3);
    dt__cuda_gemm_batched(0, 1, T, T, hd, scale, q, hd, th, k, hd, th, 0.0f, P, T, tt, BH);   /* S = Q K^T / sqrt(d) */
    DT_LAUNCH(dt__k_softmax_rows, dt__blocks_for_warps((int64_t)BH * T), DT_THREADS, P, (int64_t)BH * T, T, causal);
    dt__cuda_gemm_batched(0, 0, T, hd, T, 1.0f, P, T, tt, v, hd, th, 0.0f, o, hd, th, BH);    /* O = P V */
    DT_LAUNCH(dt__k_merge_heads, dt_blocks_for(btd), DT_THREADS, o, out, B, T, H, hd, 1, 0);
}
static void dt__cuda_attention_backward(const float *saved, const float *dout, float *dqkv, float *scratch, int B,
                                       int T, int H, int D, float scale) {
    int hd = D / H, BH = B * H;
    int64_t btd = (int64_t)B * T * D, tt = (int64_t)T * T, th = (int64_t)T * hd;
    const float *P = saved, *q = saved + (int64_t)BH * tt, *k = q + btd, *v = k + btd;
    float *dP = scratch, *dO = scratch + (int64_t)BH * tt, *dq = dO + btd, *dk = dq + btd, *dv = dk + btd;
    DT_LAUNCH(dt__k_split_heads, dt_blocks_for(btd), DT_THREADS, dout, dO, B, T, H, hd, 1);
    dt__cuda_gemm_batched(0, 1, T, T, hd, 1.0f, dO, hd, th, v, hd, th, 0.0f, dP, T, tt, BH);   /* dP = dO V^T */
    dt__cuda_gemm_batched(1, 0, T, hd, T, 1.0f, P, T, tt, dO, hd, th, 0.0f, dv, hd, th, BH);   /* dV = P^T dO */
    DT_LAUNCH(dt__k_softmax_backward_rows, dt__blocks_for_warps((int64_t)BH * T), DT_THREADS, P, dP, (int64_t)BH * T, T,
              scale);
    dt__cuda_gemm_batched(0, 0, T, hd, T, 1.0f, dP, T, tt, k, hd, th, 0.0f, dq, hd, th, BH);   /* dQ = dS K */
    dt__cuda_gemm_batched(1, 0, T, hd, T, 1.0f, dP, T, tt, q, hd, th, 0.0f, dk, hd, th, BH);   /* dK = dS^T Q */
    DT_LAUNCH(dt__k_merge_heads, dt_blocks_for(3 * btd), DT_THREADS, dq, dqkv, B, T, H, hd, 3, 1);
}

/* ---- attention without its T x T matrix (--attention online): FlashAttention's
        algorithm (Dao et al., 2022), the online softmax of
        dt_online_softmax_rescale, in f32 on the CUDA cores. A block stages a
        tile of DT__FA_TILE rows of keys and values (in backward, also of
        queries and output gradients) in shared memory; each of its warps
        carries DT__FA_ROWS rows of the other side through the tiles, a lane
        to each staged row for the scores and a lane to each 32nd column for
        the products. Backward makes the scores twice, once by query rows (dQ)
        and once by key rows (dK, dV), so that every sum has one owner and a
        fixed order: the same bits every run, which atomic adds would not give.
        Saved: each row's log-sum-exp [B*H, T] and the output [B*T, D], as on
        the CPU. Not tuned (no tensor cores yet): the memory is the lesson. ---- */
#define DT__FA_TILE 32                        /* one lane per staged row */
#define DT__FA_WARPS 8
#define DT__FA_ROWS 4                         /* rows a warp carries */
#define DT__FA_BLOCK_ROWS (DT__FA_WARPS * DT__FA_ROWS)
#define DT__FA_COLS (DT_ATTENTION_ONLINE_MAX_HEAD_DIM / 32)   /* columns a lane holds */
typedef float dt__fa_tile[DT__FA_TILE][DT_ATTENTION_ONLINE_MAX_HEAD_DIM + 1];   /* + 1: lanes read rows in distinct banks */

/* rows j0 .. j0 + DT__FA_TILE - 1 of a head's column block (row stride ld) into a tile, zeros past T */
__device__ static void dt__fa_stage(const float *src, int64_t ld, int j0, int T, int hd, dt__fa_tile tile) {
    for (int e = threadIdx.x; e < DT__FA_TILE * hd; e += blockDim.x) {
        int k = e / hd, d = e % hd;
        tile[k][d] = j0 + k < T ? src[(int64_t)(j0 + k) * ld + d] : 0.0f;
    }
}
__device__ static float dt__fa_dot(const float *row, const float *staged, int hd) {
    float s = 0;
    for (int d = 0; d < hd; d++) s += row[d] * staged[d];
    return s;
}
/* The block's rows and a warp's: row r of warp w is the block's r * warps + w
   (interleaved, so that a causal block's warps see alike many keys). */
__device__ static int dt__fa_row(int first, int r) { return first + r * DT__FA_WARPS + (int)threadIdx.x / 32; }

/* The heads one launch covers -- the CPU's dt__online_head, B x H of them:
   query rows of qkv [B*Tq, 3*D]; keys and values at k and v (row t of
   sequence b at + (b * Tk + t) * ldkv, head h's columns at + h * hd), their
   positions ascending (qpos, kpos on the device; NULL: 0, 1, 2, ...). On
   one device k and v are qkv's own columns; under context parallelism
   they are the block the ring brought, at the tokens' true positions. */
typedef struct dt__fa_heads {
    const float *qkv, *k, *v, *qpos, *kpos;
    int64_t ldkv;
    int B, Tq, Tk, H, D, causal;
    float scale;
} dt__fa_heads;
__device__ static float dt__fa_qpos(const dt__fa_heads &a, int i) { return a.qpos ? a.qpos[i] : (float)i; }
__device__ static float dt__fa_kpos(const dt__fa_heads &a, int j) { return a.kpos ? a.kpos[j] : (float)j; }
/* Whether query i sees key j (positions compared as whole numbers when they are the indices). */
__device__ static int dt__fa_sees(const dt__fa_heads &a, int i, int j) {
    if (i >= a.Tq || j >= a.Tk || !a.causal) return i < a.Tq && j < a.Tk;
    return !a.qpos && !a.kpos ? j <= i : dt__fa_kpos(a, j) <= dt__fa_qpos(a, i);
}
/* How many keys sit at position p or before; the first query at p or after. */
__device__ static int dt__fa_keys_upto(const dt__fa_heads &a, float p) {
    int lo = 0, hi = a.Tk;
    while (lo < hi) { int mid = (lo + hi) / 2; if (dt__fa_kpos(a, mid) <= p) lo = mid + 1; else hi = mid; }
    return lo;
}
__device__ static int dt__fa_first_query(const dt__fa_heads &a, float p) {
    int lo = 0, hi = a.Tq;
    while (lo < hi) { int mid = (lo + hi) / 2; if (dt__fa_qpos(a, mid) < p) lo = mid + 1; else hi = mid; }
    return lo;
}

/* A block of query rows against the keys: each row's m, l and output move on
   by the online softmax. carry: start from the rows' m, l and unnormalised
   output in m_g [B*H, Tq], l_g, acc_g [B*Tq, D] (else from nothing); out
   non-NULL: finish -- out and O the output, lse the log-sum-exp (which may
   be m_g, acc_g) -- else keep m, l, acc
   in m_g, l_g, acc_g for the next block. A row is one warp's: its lanes read
   m_g[row] and l_g[row] at the start, lane 0 writes them at the end. */
__global__ static void dt__k_attention_online_forward(dt__fa_heads a, int carry, float *m_g, float *l_g, float *acc_g,
                                                     float *out, float *lse, float *O) {
    __shared__ dt__fa_tile ks, vs;
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (Tq + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, i0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;                          /* row t: + t * 3D */
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    float m[DT__FA_ROWS], l[DT__FA_ROWS], acc[DT__FA_ROWS][DT__FA_COLS];
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        int64_t row = (int64_t)bh * Tq + i, at = ((int64_t)b * Tq + i) * D + h * hd;
        m[r] = carry && i < Tq ? m_g[row] : -INFINITY;
        l[r] = carry && i < Tq ? l_g[row] : 0;
        for (int c = 0; c < DT__FA_COLS; c++) acc[r][c] = carry && i < Tq && lane + 32 * c < hd ? acc_g[at + lane + 32 * c] : 0;
    }
    int last = min(Tq, i0 + DT__FA_BLOCK_ROWS) - 1;                   /* the block's latest query: none sees further */
    int keys = a.causal ? dt__fa_keys_upto(a, dt__fa_qpos(a, last)) : a.Tk;
    for (int j0 = 0; j0 < keys; j0 += DT__FA_TILE) {
        __syncthreads();                                  /* every warp done with the last tile */
        dt__fa_stage(k, a.ldkv, j0, a.Tk, hd, ks);
        dt__fa_stage(v, a.ldkv, j0, a.Tk, hd, vs);
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int i = dt__fa_row(i0, r), j = j0 + lane, ok = dt__fa_sees(a, i, j);
            if (!dt__fa_sees(a, i, j0)) continue;          /* the whole warp alike: a tile past the row */
            float s = ok ? a.scale * dt__fa_dot(q + (int64_t)i * 3 * D, ks[lane], hd) : -INFINITY;
            float c = dt_online_softmax_rescale(&m[r], dt__warp_max(s));   /* what came before, on the new scale */
            float p = ok ? dt_exp_value(s - m[r]) : 0.0f;
            l[r] = l[r] * c + dt__warp_sum(p);
            for (int t = 0; t < DT__FA_COLS; t++) acc[r][t] *= c;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float pk = __shfl_sync(0xffffffffu, p, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) acc[r][t] += pk * vs[kk][lane + 32 * t];
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        if (i >= Tq) continue;
        int64_t row = (int64_t)bh * Tq + i, at = ((int64_t)b * Tq + i) * D + h * hd;
        if (!out) {                                        /* more blocks to come */
            if (lane == 0) { m_g[row] = m[r]; l_g[row] = l[r]; }
            for (int t = 0; t < DT__FA_COLS; t++)
                if (lane + 32 * t < hd) acc_g[at + lane + 32 * t] = acc[r][t];
            continue;
        }
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) out[at + lane + 32 * t] = O[at + lane + 32 * t] = acc[r][t] / l[r];
        if (lane == 0) lse[row] = m[r] + logf(l[r]);
    }
}
/* Each row's dO . O, the softmax backward's subtrahend: [B*H, T], a warp a row. */
__global__ static void dt__k_attention_online_row_dots(const float *dout, const float *O, float *dots, int B, int T, int H,
                                                      int D) {
    int hd = D / H;
    DT_FOR_EACH_ROW(row, (int64_t)B * H * T) {
        int64_t bh = row / T, at = ((bh / H) * T + row % T) * D + (bh % H) * hd;
        float s = 0;
        for (int d = threadIdx.x % 32; d < hd; d += 32) s += dout[at + d] * O[at + d];
        s = dt__warp_sum(s);
        if (threadIdx.x % 32 == 0) dots[row] = s;
    }
}
/* dQ (added into dqkv's q columns): a warp's query rows against tiles of keys
   and values. dS = p (dP - dO.O) scale. */
__global__ static void dt__k_attention_online_dq(dt__fa_heads a, const float *lse, const float *dots, const float *dout,
                                                float *dqkv) {
    __shared__ dt__fa_tile ks, vs;
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (Tq + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, i0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    const float *dO = dout + (int64_t)b * Tq * D + h * hd;                              /* row t: + t * D */
    float dq[DT__FA_ROWS][DT__FA_COLS] = { { 0 } };
    int last = min(Tq, i0 + DT__FA_BLOCK_ROWS) - 1;
    int keys = a.causal ? dt__fa_keys_upto(a, dt__fa_qpos(a, last)) : a.Tk;
    for (int j0 = 0; j0 < keys; j0 += DT__FA_TILE) {
        __syncthreads();
        dt__fa_stage(k, a.ldkv, j0, a.Tk, hd, ks);
        dt__fa_stage(v, a.ldkv, j0, a.Tk, hd, vs);
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int i = dt__fa_row(i0, r), j = j0 + lane, ok = dt__fa_sees(a, i, j);
            if (!dt__fa_sees(a, i, j0)) continue;
            float p = ok ? dt_exp_value(a.scale * dt__fa_dot(q + (int64_t)i * 3 * D, ks[lane], hd) - lse[(int64_t)bh * Tq + i]) : 0.0f;
            float dp = ok ? dt__fa_dot(dO + (int64_t)i * D, vs[lane], hd) : 0.0f;
            float ds = p * (dp - dots[(int64_t)bh * Tq + i]) * a.scale;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float dsk = __shfl_sync(0xffffffffu, ds, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) dq[r][t] += dsk * ks[kk][lane + 32 * t];
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        if (i >= Tq) continue;
        float *to = dqkv + ((int64_t)b * Tq + i) * 3 * D + h * hd;
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) to[lane + 32 * t] += dq[r][t];
    }
}
/* dK and dV (added into dk, dv: key j of sequence b at + (b * Tk + j) * ldkv):
   a warp's key rows against tiles of queries and output gradients (with
   their rows' log-sum-exps and dO . O). */
__global__ static void dt__k_attention_online_dkv(dt__fa_heads a, const float *lse, const float *dots, const float *dout,
                                                 float *dk, float *dv, int64_t ldkv) {
    __shared__ dt__fa_tile qs, dos;
    __shared__ float lse_s[DT__FA_TILE], dots_s[DT__FA_TILE];
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (a.Tk + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, j0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    const float *dO = dout + (int64_t)b * Tq * D + h * hd;
    float gk[DT__FA_ROWS][DT__FA_COLS] = { { 0 } }, gv[DT__FA_ROWS][DT__FA_COLS] = { { 0 } };
    int first = a.causal ? dt__fa_first_query(a, dt__fa_kpos(a, j0)) / DT__FA_TILE * DT__FA_TILE : 0;   /* none before sees j0 */
    for (int i0 = first; i0 < Tq; i0 += DT__FA_TILE) {
        __syncthreads();
        dt__fa_stage(q, 3 * D, i0, Tq, hd, qs);
        dt__fa_stage(dO, D, i0, Tq, hd, dos);
        if ((int)threadIdx.x < DT__FA_TILE) {
            int i = i0 + threadIdx.x;
            lse_s[threadIdx.x] = i < Tq ? lse[(int64_t)bh * Tq + i] : 0.0f;
            dots_s[threadIdx.x] = i < Tq ? dots[(int64_t)bh * Tq + i] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int j = dt__fa_row(j0, r), i = i0 + lane, ok = dt__fa_sees(a, i, j);
            if (j >= a.Tk || !dt__fa_sees(a, min(Tq, i0 + DT__FA_TILE) - 1, j)) continue;   /* the tile's last query sees none */
            float p = ok ? dt_exp_value(a.scale * dt__fa_dot(qs[lane], k + (int64_t)j * a.ldkv, hd) - lse_s[lane]) : 0.0f;
            float dp = ok ? dt__fa_dot(dos[lane], v + (int64_t)j * a.ldkv, hd) : 0.0f;
            float ds = p * (dp - dots_s[lane]) * a.scale;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float pk = __shfl_sync(0xffffffffu, p, kk), dsk = __shfl_sync(0xffffffffu, ds, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) {
                        gv[r][t] += pk * dos[kk][lane + 32 * t];
                        gk[r][t] += dsk * qs[kk][lane + 32 * t];
                    }
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int j = dt__fa_row(j0, r);
        if (j >= a.Tk) continue;
        int64_t at = ((int64_t)b * a.Tk + j) * ldkv + h * hd;
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) {
                dk[at + lane + 32 * t] += gk[r][t];
                dv[at + lane + 32 * t] += gv[r][t];
            }
    }
}
static unsigned dt__fa_blocks(int B, int T, int H) {
    int64_t n = (int64_t)B * H * ((T + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS);
    if (n > 2147483647) dt_fail("online attention: %lld blocks of attention exceed the GPU's grid", (long long)n);
    return (unsigned)n;
}
/* Backward of the heads against their keys: the rows' dO . O, then dQ by query rows and dK, dV by key rows. */
static void dt__fa_backward(const dt__fa_heads *a, const float *lse, const float *O, const float *dout, float *dots, float *dqkv,
                            float *dk, float *dv, int64_t ld_dkv) {
    DT_LAUNCH(dt__k_attention_online_row_dots, dt__blocks_for_warps((int64_t)a->B * a->H * a->Tq), DT_THREADS, dout, O, dots, a->B,
              a->Tq, a->H, a->D);
    DT_LAUNCH(dt__k_attention_online_dq, dt__fa_blocks(a->B, a->Tq, a->H), 32 * DT__FA_WARPS, *a, lse, dots, dout, dqkv);
    DT_LAUNCH(dt__k_attention_online_dkv, dt__fa_blocks(a->B, a->Tk, a->H), 32 * DT__FA_WARPS, *a, lse, dots, dout, dk, dv, ld_dkv);
}
static void dt__cuda_attention_forward_online(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                                             float scale, int causal) {
    float *lse = saved, *O = saved + (int64_t)B * H * T;
    dt__fa_heads a = { qkv, qkv + D, qkv + 2 * D, NULL, NULL, 3 * D, B, T, T, H, D, causal, scale };
    DT_LAUNCH(dt__k_attention_online_forward, dt__fa_blocks(B, T, H), 32 * DT__FA_WARPS, a, 0, (float *)NULL, (float *)NULL,
              (float *)NULL, out, lse, O);
}
static void dt__cuda_attention_backward_online(const float *qkv, const float *saved, const float *dout, float *dqkv,
                                              float *scratch, int B, int T, int H, int D, float scale, int causal) {
    dt__fa_heads a = { qkv, qkv + D, qkv + 2 * D, NULL, NULL, 3 * D, B, T, T, H, D, causal, scale };
    dt__fa_backward(&a, saved, saved + (int64_t)B * H * T, dout, scratch, dqkv, dqkv + D, dqkv + 2 * D, 3 * D);
}
/* Context parallelism's ring (the context-parallel chapter): this rank's
   queries against the block held (its positions, then K and V [B*T, D]),
   the rows' m (in lse), l and output (in O) carried from block to block;
   the last block finishes them into out. Backward: dQ into dqkv, dK and
   dV into dkv (dK [B*T, D], then dV). */
static void dt__cuda_ring_attention_step(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                         float *out, int first, int B, int T, int H, int D, float scale, int causal) {
    int64_t BTD = (int64_t)B * T * D;
    dt__fa_heads a = { qkv, blk + T, blk + T + BTD, qpos, blk, D, B, T, T, H, D, causal, scale };
    DT_LAUNCH(dt__k_attention_online_forward, dt__fa_blocks(B, T, H), 32 * DT__FA_WARPS, a, !first, lse, l, O, out, lse, O);
}
static void dt__cuda_ring_attention_backward_step(const float *qkv, const float *blk, const float *qpos, const float *lse,
                                                  const float *O, const float *dout, float *dots, float *dqkv, float *dkv, int B,
                                                  int T, int H, int D, float scale, int causal) {
    int64_t BTD = (int64_t)B * T * D;
    dt__fa_heads a = { qkv, blk + T, blk + T + BTD, qpos, blk, D, B, T, T, H, D, causal, scale };
    dt__fa_backward(&a, lse, O, dout, dots, dqkv, dkv, dkv + BTD, D);
}
/* rows x cols floats from src (row stride ld_src) to dst (ld_dst), or added into it */
__global__ static void dt__k_add_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols) {
    DT_FOR_EACH(e, rows * cols) dst[e / cols * ld_dst + e % cols] += src[e / cols * ld_src + e % cols];
}
static void dt__cuda_copy_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add) {
    if (add) { DT_LAUNCH(dt__k_add_columns, dt_blocks_for(rows * cols), DT_THREADS, dst, ld_dst, src, ld_src, rows, cols); return; }
    DT_CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)ld_dst * sizeof(float), src, (size_t)ld_src * sizeof(float),
                                    (size_t)cols * sizeof(float), (size_t)rows, cudaMemcpyDeviceToDevice, dt__cuda.stream));
}

/* ---- the ViT's token assembly, the class-token pick, patchify ---- */
__global__ static void dt__k_vit_tokens(const float *patches, const float *cls, const float *pos, float *y, int B, int P,
                                       int D) {
    int T = P + 1;
    DT_FOR_EACH(i, (int64_t)B * T * D) {
        int j = (int)(i % D), t = (int)((i / D) % T);
        int64_t b = i / ((int64_t)T * D);
        float src = t == 0 ? cls[j] : patches[(b * P + t - 1) * D + j];
        y[i] = src + pos[(int64_t)t * D + j];
    }
}
/* Token embedding: ids arrive as f32 (validated on the host when the data
   was read). */
__global__ static void dt__k_token_embedding(const float *tok, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                            int first, int V) {
    DT_FOR_EACH(i, (int64_t)BT * D) {
        int64_t r = i / D, j = i % D;
        int id = (int)tok[r] - first;
        y[i] = (id >= 0 && id < V ? wte[(int64_t)id * D + j] : 0.0f) + (wpe ? wpe[(r % T) * D + j] : 0.0f);
    }
}
static void dt__cuda_token_embedding_forward(const float *tok, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                             int first, int V) {
    DT_LAUNCH(dt__k_token_embedding, dt_blocks_for((int64_t)BT * D), DT_THREADS, tok, wte, wpe, y, BT, T, D, first, V);
}
/* One thread per (token, column) walks that token's rows in order, and one
   per (position, column) walks the batch: the CPU's order, no atomics. */
__global__ static void dt__k_token_embedding_backward_wte(const int32_t *order, const int32_t *start, const int32_t *token,
                                                         int groups, const float *dy, float *dwte, int D) {
    DT_FOR_EACH(i, (int64_t)groups * D) {
        int64_t g = i / D, j = i % D;
        float acc = dwte[(int64_t)token[g] * D + j];
        for (int k = start[g]; k < start[g + 1]; k++) acc += dy[(int64_t)order[k] * D + j];
        dwte[(int64_t)token[g] * D + j] = acc;
    }
}
__global__ static void dt__k_token_embedding_backward_wpe(const float *dy, float *dwpe, int BT, int T, int D) {
    DT_FOR_EACH(i, (int64_t)T * D) {
        int64_t t = i / D, j = i % D;
        float acc = dwpe[i];
        for (int64_t r = t; r < BT; r += T) acc += dy[r * D + j];
        dwpe[i] = acc;
    }
}
static void dt__cuda_token_embedding_backward(const int32_t *by_token, int groups, const float *dy, float *dwte, float *dwpe,
                                             int BT, int T, int D) {
    const int32_t *start = by_token + BT, *token = start + groups + 1;
    if (dwte) DT_LAUNCH(dt__k_token_embedding_backward_wte, dt_blocks_for((int64_t)groups * D), DT_THREADS, by_token, start,
                        token, groups, dy, dwte, D);
    if (dwpe) DT_LAUNCH(dt__k_token_embedding_backward_wpe, dt_blocks_for((int64_t)T * D), DT_THREADS, dy, dwpe, BT, T, D);
}
static void dt__cuda_vit_tokens_forward(const float *patches, const float *cls, const float *pos, float *y, int B, int P,
                                       int D) {
    DT_LAUNCH(dt__k_vit_tokens, dt_blocks_for((int64_t)B * (P + 1) * D), DT_THREADS, patches, cls, pos, y, B, P, D);
}
__global__ static void dt__k_vit_tokens_dpatch(const float *dy, float *dpatch, int B, int P, int D) {
    DT_FOR_EACH(i, (int64_t)B * P * D) {
        int j = (int)(i % D), t = (int)((i / D) % P);
        int64_t b = i / ((int64_t)P * D);
        dpatch[i] += dy[(b * (P + 1) + t + 1) * D + j];
    }
}
static void dt__cuda_vit_tokens_backward(const float *dy, float *dpatch, float *dcls, float *dpos, int B, int P, int D) {
    int T = P + 1;
    if (dpatch) DT_LAUNCH(dt__k_vit_tokens_dpatch, dt_blocks_for((int64_t)B * P * D), DT_THREADS, dy, dpatch, B, P, D);
    dt__cuda_column_sums(dy, NULL, NULL, B, T * D, T * D, dpos, NULL);   /* sum over the batch */
    dt__cuda_column_sums(dy, NULL, NULL, B, D, T * D, dcls, NULL);       /* token 0 of each sequence */
}
__global__ static void dt__k_select_token(const float *x, float *y, int B, int T, int idx, int D, int backward) {
    DT_FOR_EACH(i, (int64_t)B * D) {
        int64_t b = i / D, j = i % D, src = (b * T + idx) * D + j;
        if (backward) y[src] += x[i];             /* here x is dy [B, D] and y is dx */
        else y[i] = x[src];
    }
}
static void dt__cuda_select_token_forward(const float *x, float *y, int B, int T, int idx, int D) {
    DT_LAUNCH(dt__k_select_token, dt_blocks_for((int64_t)B * D), DT_THREADS, x, y, B, T, idx, D, 0);
}
static void dt__cuda_select_token_backward(const float *dy, float *dx, int B, int T, int idx, int D) {
    DT_LAUNCH(dt__k_select_token, dt_blocks_for((int64_t)B * D), DT_THREADS, dy, dx, B, T, idx, D, 1);
}
__global__ static void dt__k_patchify(const float *img, float *out, int B, int C, int H, int W, int p) {
    int ph = H / p, pw = W / p, row_len = C * p * p;
    DT_FOR_EACH(i, (int64_t)B * ph * pw * row_len) {
        int64_t r = i / row_len;
        int e = (int)(i % row_len), c = e / (p * p), ky = (e / p) % p, kx = e % p;
        int px = (int)(r % pw), py = (int)((r / pw) % ph);
        int64_t b = r / ((int64_t)ph * pw);
        out[i] = img[((b * C + c) * H + py * p + ky) * W + px * p + kx];
    }
}
static void dt__cuda_patchify(const float *img, float *out, int B, int C, int H, int W, int p) {
    DT_LAUNCH(dt__k_patchify, dt_blocks_for((int64_t)B * (H / p) * (W / p) * C * p * p), DT_THREADS, img, out, B, C, H,
              W, p);
}

/* ---- the fused classifier: one warp per row, as many blocks as the rows
        need, each row's m and l by the online softmax (one pass over the
        logits, dt__warp_online_softmax); each row's loss goes to a buffer,
        and one block then adds the rows in a fixed order (thread t takes
        rows t, t + 256, ..., then a fixed tree), so the mean is the same
        every run. Backward makes each probability again as it writes. ---- */
__global__ static void dt__k_cross_entropy_rows(const float *logits, const int32_t *labels, double *inv_l, float *row_m,
                                               double *row_loss, int B, int C) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(i, B) {
        if (labels[i] == DT_IGNORE_INDEX) {
            if (lane == 0) row_loss[i] = inv_l[i] = row_m[i] = 0;
            continue;
        }
        const float *r = logits + i * C;
        float m, l;
        dt__warp_online_softmax(r, C, &m, &l);
        if (lane == 0) {
            row_m[i] = m;
            inv_l[i] = 1.0 / (double)l;
            row_loss[i] = -((double)r[labels[i]] - m - log((double)l));
        }
    }
}
__global__ static void dt__k_mean_of_rows(const double *row_loss, int B, double divisor, float *loss) {
    __shared__ double sh[DT_THREADS];
    double s = 0;
    for (int i = threadIdx.x; i < B; i += DT_THREADS) s += row_loss[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = DT_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) loss[0] = (float)(sh[0] / divisor);
}
static void dt__cuda_cross_entropy_forward(const float *logits, const int32_t *labels, double *inv_l, float *m, float *loss,
                                          int B, int C, double divisor) {
    double *row_loss = (double *)dt__cuda_grow(&dt__cuda.row_loss, &dt__cuda.row_loss_bytes, sizeof(double) * (size_t)B);
    DT_LAUNCH(dt__k_cross_entropy_rows, dt__blocks_for_warps(B), DT_THREADS, logits, labels, inv_l, m, row_loss, B, C);
    DT_LAUNCH(dt__k_mean_of_rows, 1, DT_THREADS, row_loss, B, divisor, loss);
}
__global__ static void dt__k_cross_entropy_backward(const float *x, const double *inv_l, const float *m, const int32_t *labels,
                                                   const float *dloss, float *dl, int B, int C, float divisor) {
    float scale = dloss[0] / divisor;
    DT_FOR_EACH(i, (int64_t)B * C) {
        int64_t row = i / C;
        int j = (int)(i % C);
        if (labels[row] != DT_IGNORE_INDEX)
            dl[i] += dt_cross_entropy_grad(x[i], m[row], inv_l[row], j == labels[row] ? 1.0f : 0.0f, scale);
    }
}
static void dt__cuda_cross_entropy_backward(const float *logits, const double *inv_l, const float *m, const int32_t *labels,
                                           const float *dloss, float *dlogits, int B, int C, float divisor) {
    DT_LAUNCH(dt__k_cross_entropy_backward, dt_blocks_for((int64_t)B * C), DT_THREADS, logits, inv_l, m, labels, dloss,
              dlogits, B, C, divisor);
}

/* The cross-entropy of a split vocabulary: each row's m, l and x[label] over
   this rank's columns, one warp per row, as above. */
__global__ static void dt__k_softmax_row_stats(const float *x, const int32_t *labels, float *stats, int B, int C) {
    DT_FOR_EACH_ROW(i, B) {
        const float *r = x + i * C;
        float m, l;
        dt__warp_online_softmax(r, C, &m, &l);
        if (threadIdx.x % 32 == 0) {
            stats[i] = m;
            stats[B + i] = l;
            stats[2 * B + i] = labels[i] >= 0 && labels[i] < C ? r[labels[i]] : 0.0f;
        }
    }
}
static void dt__cuda_softmax_row_stats(const float *x, const int32_t *labels, float *stats, int B, int C) {
    DT_LAUNCH(dt__k_softmax_row_stats, dt__blocks_for_warps(B), DT_THREADS, x, labels, stats, B, C);
}

/* ---- the optimizer: a fixed-shape reduction for the gradient norm, then the
        same per-element updates as the CPU ---- */
#define DT_SUMSQ_BLOCKS 256
__global__ static void dt__k_sum_squares(const float *x, int64_t n, double *partials) {
    __shared__ double sh[DT_THREADS];
    double s = 0;
    DT_FOR_EACH(i, n) s += (double)x[i] * x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = DT_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}
__global__ static void dt__k_sum_partials(double *partials, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += partials[i];
    partials[n] = s;
}
static double dt__cuda_sum_squares(const float *x, int64_t n) {
    double total = 0;
    DT_LAUNCH(dt__k_sum_squares, DT_SUMSQ_BLOCKS, DT_THREADS, x, n, dt__cuda.partials);
    DT_LAUNCH(dt__k_sum_partials, 1, 1, dt__cuda.partials, DT_SUMSQ_BLOCKS);
    dt__cuda_download(&total, dt__cuda.partials + DT_SUMSQ_BLOCKS, sizeof total);
    return total;
}
__global__ static void dt__k_adamw(float *p, float *m, float *v, const float *g, int64_t n, float lr, float b1, float b2,
                                  float eps, float wd, float bc1, float bc2) {
    DT_FOR_EACH(i, n) dt_adamw_update(&p[i], &m[i], &v[i], g[i], lr, b1, b2, eps, wd, bc1, bc2);
}
static void dt__cuda_adamw(float *p, float *m, float *v, const float *g, int64_t n, float lr, float b1, float b2,
                          float eps, float wd, float bc1, float bc2) {
    DT_LAUNCH(dt__k_adamw, dt_blocks_for(n), DT_THREADS, p, m, v, g, n, lr, b1, b2, eps, wd, bc1, bc2);
}
__global__ static void dt__k_sgd(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd) {
    DT_FOR_EACH(i, n) dt_sgd_update(&p[i], &buf[i], g[i], lr, momentum, wd);
}
static void dt__cuda_sgd(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd) {
    DT_LAUNCH(dt__k_sgd, dt_blocks_for(n), DT_THREADS, p, buf, g, n, lr, momentum, wd);
}
__global__ static void dt__k_convert(const void *src, int from, void *dst, int to, int64_t n) {
    DT_FOR_EACH(i, n) {
        const uint16_t *h = (const uint16_t *)src;
        float v = from == DT_F32 ? ((const float *)src)[i] : from == DT_BF16 ? dt_bf16_to_f32(h[i]) : dt_f16_to_f32(h[i]);
        if (to == DT_F32) ((float *)dst)[i] = v;
        else ((uint16_t *)dst)[i] = to == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
    }
}
static void dt__cuda_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n) {
    DT_LAUNCH(dt__k_convert, dt_blocks_for(n), DT_THREADS, src, (int)from, dst, (int)to, n);
}
/* [src/28-cuda-start-up-and-nccl.h] */
/* ---- start-up ---- */
extern "C" int dt_cuda_device_count(char *why, size_t n) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        int driver = 0, runtime = 0;
        cudaGetLastError();
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        if (driver == 0) snprintf(why, n, "no NVIDIA driver is installed");
        else snprintf(why, n, "%s (the driver supports CUDA %d.%d, this build needs %d.%d)", cudaGetErrorString(err),
                      driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
        return 0;
    }
    if (count == 0) snprintf(why, n, "no GPU is visible");
    return count;
}

extern "C" const dt_backend *dt_cuda_backend(int local_rank, char *why, size_t n) {
    int count = dt_cuda_device_count(why, n);
    if (count == 0) return NULL;
    if (dt__cuda.stream) return &dt__cuda.table;
    dt__cuda.index = local_rank % count;          /* one GPU per rank on this machine */
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));
    DT_CUDA_CHECK(cudaStreamCreateWithFlags(&dt__cuda.stream, cudaStreamNonBlocking));
    dt__cublas_open();
    DT_CUBLAS_CHECK(dt__cublas.create(&dt__cuda.blas));
    DT_CUBLAS_CHECK(dt__cublas.set_stream(dt__cuda.blas, dt__cuda.stream));
    DT_CUBLAS_CHECK(dt__cublas.set_math_mode(dt__cuda.blas, CUBLAS_DEFAULT_MATH));   /* fp32, no TF32 */
    dt__cuda.partials = (double *)dt__cuda_alloc((DT_SUMSQ_BLOCKS + 1) * sizeof(double));
    cudaDeviceProp prop;
    DT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dt__cuda.index));
    dt_backend *t = &dt__cuda.table;
    snprintf(t->name, sizeof t->name, "%s", prop.name);
    t->alloc = dt__cuda_alloc; t->release = dt__cuda_release; t->zero = dt__cuda_zero;
    t->upload = dt__cuda_upload; t->download = dt__cuda_download; t->synchronize = dt__cuda_synchronize;
    t->gemm = dt__cuda_gemm; t->gemm_half = dt__cuda_gemm_half; t->add_bias = dt__cuda_add_bias; t->sum_rows = dt__cuda_sum_rows;
    t->gelu_forward = dt__cuda_gelu_forward; t->gelu_backward = dt__cuda_gelu_backward;
    t->layernorm_forward = dt__cuda_layernorm_forward; t->layernorm_backward = dt__cuda_layernorm_backward;
    t->rmsnorm_forward = dt__cuda_rmsnorm_forward; t->rmsnorm_backward = dt__cuda_rmsnorm_backward;
    t->swiglu_forward = dt__cuda_swiglu_forward; t->swiglu_backward = dt__cuda_swiglu_backward;
    t->rotary_qkv_forward = dt__cuda_rotary_qkv_forward; t->rotary_qkv_backward = dt__cuda_rotary_qkv_backward;
    t->add = dt__cuda_add; t->accumulate = dt__cuda_accumulate;
    t->attention_forward = dt__cuda_attention_forward; t->attention_backward = dt__cuda_attention_backward;
    t->attention_forward_online = dt__cuda_attention_forward_online;
    t->ring_attention_step = dt__cuda_ring_attention_step;
    t->ring_attention_backward_step = dt__cuda_ring_attention_backward_step;
    t->copy_columns = dt__cuda_copy_columns;
    t->attention_backward_online = dt__cuda_attention_backward_online;
    t->vit_tokens_forward = dt__cuda_vit_tokens_forward; t->vit_tokens_backward = dt__cuda_vit_tokens_backward;
    t->token_embedding_forward = dt__cuda_token_embedding_forward;
    t->token_embedding_backward = dt__cuda_token_embedding_backward;
    t->select_token_forward = dt__cuda_select_token_forward; t->select_token_backward = dt__cuda_select_token_backward;
    t->cross_entropy_forward = dt__cuda_cross_entropy_forward; t->cross_entropy_backward = dt__cuda_cross_entropy_backward;
    t->softmax_row_stats = dt__cuda_softmax_row_stats;
    t->patchify = dt__cuda_patchify; t->sum_squares = dt__cuda_sum_squares; t->scale = dt__cuda_scale;
    t->adamw = dt__cuda_adamw; t->sgd = dt__cuda_sgd; t->convert = dt__cuda_convert; t->owns = dt__cuda_owns;
    return t;
}
/* ---- NCCL: the collectives chapter's operations on GPU buffers (the contract
        is in the backend-tables chapter). The communicator is non-blocking, so no
        call can hang the thread that makes it: the collectives chapter's watchdog polls
        dt_nccl_progress, and aborts when a rank dies or --timeout passes. Each
        collective has two events: `inputs`, recorded on the compute stream
        when it is queued (its input is the output of the kernels before it),
        and `done`, recorded on NCCL's stream after it; the compute stream
        waits for `done` -- for that collective only, so the next one (FSDP's
        prefetch) still overlaps the compute. ---- */
#ifdef DT_HAVE_NCCL
#include <nccl.h>
struct dt_nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t inputs[DT_COMM_QUEUE], done[DT_COMM_QUEUE];
    float *one;                          /* a 1-element buffer: a barrier is an all-reduce of it */
};
static void dt__nccl_check(ncclResult_t r, const char *call, const char *file, int line) {
    if (r != ncclSuccess && r != ncclInProgress) dt_fail("%s failed at %s:%d: %s", call, file, line, ncclGetErrorString(r));
}
#define DT_NCCL_CHECK(call) dt__nccl_check((call), #call, __FILE__, __LINE__)

extern "C" int dt_nccl_available(char *why, size_t n) { (void)why; (void)n; return 1; }
extern "C" int dt_nccl_version(void) {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}
extern "C" int dt_nccl_unique_id(unsigned char *out, size_t n) {
    ncclUniqueId id;
    if (n < sizeof id) return 0;
    DT_NCCL_CHECK(ncclGetUniqueId(&id));
    memcpy(out, &id, sizeof id);
    return 1;
}
/* A communicator's stream, events and barrier word; its ncclComm_t comes next. */
static dt_nccl *dt__nccl_new(void) {
    if (!dt__cuda.stream) dt_fail("internal error: NCCL started before the GPU was chosen (dt_set_device)");
    dt_nccl *s = (dt_nccl *)calloc(1, sizeof *s);
    if (!s) dt_fail("out of memory (NCCL)");
    DT_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    for (int k = 0; k < DT_COMM_QUEUE; k++) {
        DT_CUDA_CHECK(cudaEventCreateWithFlags(&s->inputs[k], cudaEventDisableTiming));
        DT_CUDA_CHECK(cudaEventCreateWithFlags(&s->done[k], cudaEventDisableTiming));
    }
    s->one = (float *)dt__cuda_alloc(sizeof(float));
    DT_CUDA_CHECK(cudaMemsetAsync(s->one, 0, sizeof(float), dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
    return s;
}
extern "C" dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world) {
    dt_nccl *s = dt__nccl_new();
    ncclUniqueId id;
    memcpy(&id, id_bytes, sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;                 /* every call returns at once; the collectives chapter polls */
    DT_NCCL_CHECK(ncclCommInitRankConfig(&s->comm, world, id, rank, &config));
    return s;
}
extern "C" dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key) {
    dt_nccl *s = dt__nccl_new();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));
    DT_NCCL_CHECK(ncclCommSplit(parent->comm, color, key, &s->comm, &config));
    return s;
}
extern "C" int dt_nccl_progress(dt_nccl *s, char *why, size_t n) {
    ncclResult_t state = ncclSuccess, r = ncclCommGetAsyncError(s->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return 1;
    if (state == ncclInProgress) return 0;
    snprintf(why, n, "%s (%s)", ncclGetErrorString(state), ncclGetLastError(s->comm));
    return -1;
}
extern "C" void dt_nccl_mark_inputs(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaEventRecord(s->inputs[slot], dt__cuda.stream)); }
extern "C" void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o) {
    ncclDataType_t t = o->dtype == DT_F32 ? ncclFloat32 : o->dtype == DT_BF16 ? ncclBfloat16 : ncclFloat16;
    ncclRedOp_t red = o->op == DT_AVG ? ncclAvg : o->op == DT_MAX ? ncclMax : ncclSum;
    size_t n = (size_t)o->count;
    const void *send = o->send;
    void *recv = o->recv;
    ncclComm_t comm = s->comm;
    cudaStream_t st = s->stream;
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));           /* the current GPU is per thread */
    DT_CUDA_CHECK(cudaStreamWaitEvent(st, s->inputs[slot], 0));
    switch (o->kind) {
    case DT_COLL_ALL_REDUCE: DT_NCCL_CHECK(ncclAllReduce(send, recv, n, t, red, comm, st)); break;
    case DT_COLL_REDUCE_SCATTER: DT_NCCL_CHECK(ncclReduceScatter(send, recv, n, t, red, comm, st)); break;
    case DT_COLL_ALL_GATHER: DT_NCCL_CHECK(ncclAllGather(send, recv, n, t, comm, st)); break;
    case DT_COLL_BROADCAST: DT_NCCL_CHECK(ncclBroadcast(send, recv, n, t, o->root, comm, st)); break;
    case DT_COLL_REDUCE: DT_NCCL_CHECK(ncclReduce(send, recv, n, t, red, o->root, comm, st)); break;
    case DT_COLL_BARRIER: DT_NCCL_CHECK(ncclAllReduce(s->one, s->one, 1, ncclFloat32, ncclSum, comm, st)); break;
    case DT_COLL_SEND: DT_NCCL_CHECK(ncclSend(send, n, t, o->root, comm, st)); break;
    case DT_COLL_RECV: DT_NCCL_CHECK(ncclRecv(recv, n, t, o->root, comm, st)); break;
    case DT_COLL_RING_SHIFT:                 /* grouped: every rank's send and receive at once */
        DT_NCCL_CHECK(ncclGroupStart());
        DT_NCCL_CHECK(ncclSend(send, n, t, o->root, comm, st));
        DT_NCCL_CHECK(ncclRecv(recv, n, t, o->from, comm, st));
        DT_NCCL_CHECK(ncclGroupEnd());
        break;
    }
}
extern "C" void dt_nccl_mark_done(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaEventRecord(s->done[slot], s->stream)); }
extern "C" int dt_nccl_finished(dt_nccl *s, int slot) {
    cudaError_t q = cudaEventQuery(s->done[slot]);
    if (q == cudaErrorNotReady) { cudaGetLastError(); return 0; }     /* not an error: leave none behind */
    DT_CUDA_CHECK(q);
    return 1;
}
extern "C" void dt_nccl_stream_wait(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaStreamWaitEvent(dt__cuda.stream, s->done[slot], 0)); }
extern "C" void dt_nccl_abort(dt_nccl *s) { ncclCommAbort(s->comm); s->comm = NULL; }
extern "C" void dt_nccl_finalize(dt_nccl *s) { if (s->comm) DT_NCCL_CHECK(ncclCommFinalize(s->comm)); }
extern "C" void dt_nccl_free(dt_nccl *s) {
    if (s->comm) DT_NCCL_CHECK(ncclCommDestroy(s->comm));
    for (int k = 0; k < DT_COMM_QUEUE; k++) {
        DT_CUDA_CHECK(cudaEventDestroy(s->inputs[k]));
        DT_CUDA_CHECK(cudaEventDestroy(s->done[k]));
    }
    DT_CUDA_CHECK(cudaStreamDestroy(s->stream));
    dt__cuda_release(s->one);
    free(s);
}
#else
/* A CUDA build without NCCL: one GPU per job works; a job of several ranks
   on GPUs is refused at start (dt_parse_args asks dt_nccl_available). */
extern "C" int dt_nccl_available(char *why, size_t n) {
    snprintf(why, n, "this build has no NCCL: install it (Debian: libnccl-dev; or pip install nvidia-nccl-cu13, "
             "found by the Makefile; or NCCL_HOME=DIR), then make clean all");
    return 0;
}
extern "C" int dt_nccl_version(void) { return 0; }
static void dt__no_nccl(void) { dt_fail("internal error: NCCL used in a build without it"); }
extern "C" int dt_nccl_unique_id(unsigned char *out, size_t n) { (void)out; (void)n; dt__no_nccl(); return 0; }
extern "C" dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world) {
    (void)id_bytes; (void)rank; (void)world; dt__no_nccl(); return NULL;
}
extern "C" int dt_nccl_progress(dt_nccl *s, char *why, size_t n) { (void)s; (void)why; (void)n; dt__no_nccl(); return -1; }
extern "C" void dt_nccl_mark_inputs(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key) {
    (void)parent; (void)color; (void)key; dt__no_nccl(); return NULL;
}
extern "C" void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o) { (void)s; (void)slot; (void)o; dt__no_nccl(); }
extern "C" void dt_nccl_mark_done(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" int dt_nccl_finished(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); return 0; }
extern "C" void dt_nccl_stream_wait(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" void dt_nccl_abort(dt_nccl *s) { (void)s; }
extern "C" void dt_nccl_finalize(dt_nccl *s) { (void)s; }
extern "C" void dt_nccl_free(dt_nccl *s) { (void)s; }
#endif
#endif /* DTRAIN_CUDA_IMPLEMENTATION */

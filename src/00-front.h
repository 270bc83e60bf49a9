//@ preface: what dtrain.h is, how to build with it, what each chapter teaches; the context every chapter shares
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
       For speed, as the Makefile does: -O3 -march=native
       -mprefer-vector-width=512 -fno-math-errno -fno-trapping-math. Only
       -march=native changes results, in their last bits: on a processor with
       fused multiply-adds the matmul, exp, erf and tanh use them (DT__MADD,
       DT__FMA). Without -fno-trapping-math, gcc on a processor with AVX2 and
       no AVX-512 (most laptops) leaves exp, erf, tanh and the GELUs scalar (it
       will not turn a float choice, x < a ? a : x, into a vector blend);
       without -mprefer-vector-width=512, on one with AVX-512 it makes the
       element-wise loops half as wide as its vectors.

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
                        the residual; tensor parallelism's f and g, sequence
                        parallelism's split and gather
       06 attention     attention in three bodies (two matmuls; tiles; the online
          and loss      softmax, whose loop context parallelism's ring runs too),
                        rotary embeddings, embeddings, the cross-entropy
       07 mixture of    a router sends each token to k of E expert MLPs: top k,
          experts       capacity and dropped tokens, the balancing loss; the
                        route, dispatch and combine as ops on the tape
       08 models        an MLP and a Vision Transformer with PyTorch/timm names, and two
                        causal language models with Hugging Face's names: GPT-2, and
                        Llama (RMSNorm, rotary embeddings, grouped-query attention,
                        SwiGLU; Qwen2's q/k/v biases; Mixtral's experts), one table
                        row per family; activation recompute, block by block; LoRA;
                        where tensor parallelism may cut each parameter and which
                        block reads it (dt_split); any run of blocks on its own, for
                        a pipeline stage (dt_model_forward_blocks)
       09 optimizer     AdamW, SGD with momentum, gradient clipping, warmup + cosine
       10 mixed         bf16/fp16 activations and matmul operands, f32 master
          precision     weights and sums, dynamic loss scaling for fp16
       11 collectives   all-reduce, reduce-scatter, all-gather, broadcast, send and
                        recv over shared memory (threads or processes, sums in
                        rank order), NCCL or MPI (CPU ranks on several
                        machines), and all-to-all, behind one table
                        (dt_comm_backend)
       12 groups and    communicators of some of the ranks (dt_comm_split), and the
          the mesh      ranks as a grid of named dimensions, a group along each
       13 data          DataParallel: one process, N devices, device 0 in charge
          parallel      (scatter, gather, reduce; its bottleneck); what every
                        data-parallel wrapper records of its communication
       14 DDP           DistributedDataParallel: a replica per process, gradients
                        averaged in buckets while backward runs; no-sync for
                        gradient accumulation
       15 FSDP          Fully Sharded Data Parallel: each rank keeps 1/N of every
                        unit, gathered to compute, gradients reduce-scattered;
                        ZeRO-1/2/3 side by side; CPU offload; no-sync; the
                        data-parallel engine a stage applies last (DDP or FSDP)
       16 tensor        each rank computes 1/T of every block: Megatron-LM's
          parallel      column- and row-parallel layers, the vocabulary split with
                        its cross-entropy, sequence parallelism; the engine
                        around it over the groups: DDP, or FSDP (2-D)
       17 pipeline      each rank a stage of consecutive blocks, micro-batches in
          parallel      GPipe's or 1F1B's order, each with its arena; with tensor
                        parallelism inside the stages and data parallel pipelines:
                        all three on a mesh
       18 context       each rank a share of every sequence's tokens: ring
          parallel      attention, the zig-zag layout
       19 expert        each rank E/P of a mixture's experts: tokens sent to their
          parallel      experts' ranks and back by two all-to-alls on the tape;
                        the engine averages the experts over the ranks that hold
                        them, the rest over all. Each wrapper (13-19) is one
                        dt_parallel; calls in the wrong order are errors that say
                        what to call first
       20 backend       the per-element arithmetic (DT_HD) that the CPU loops and
          tables        the GPU kernels share, and what a device (dt_backend) and a
                        transport (dt_comm_backend) must provide
       Then the machinery that runs a training, which no lesson calls (the
       lessons compile without it: tools/assemble --lessons):
       21 data          image folders, CIFAR-10 binaries, text (bytes or token ids),
                        instruction examples whose prompts the loss ignores,
                        shuffling, rank sharding, augmentation, and synthetic
                        images and text made on first use
       22 launching     --nproc, torchrun/SLURM/Open MPI variables, a TCP rendezvous
                        that turns strangers away, a job that stops, naming the
                        rank, when one rank dies, and signals (SIGTERM: preempted)
                        that stop every rank after the same step, saved
       23 checkpoints   safetensors files written atomically; exact resume; sharded
                        (a file per rank and an index), consolidated, resharded
       24 hugging face  Hugging Face and PEFT model folders (--init; config.json in
                        each library's words), and a training run's checkpoint:
                        weights, optimizer, the run
       25 evaluation    validation loss and accuracy over every rank's share, and
                        text generated by a language model
       26 metrics       time charged to phases, Chrome traces, progress lines with
                        an ETA, TensorBoard and MLflow, and the one-line benchmark
                        report (--bench)
       27 cost model    predicts how a stage scales, and why (--explain): the
                        communication each wrapper sends and hides, a pipeline's
                        bubble
       28 command line  one table of flags for every stage, and the data they name
       29 run driver    the loop every stage shares: --init/--resume, batches, the
                        job's mean loss, JSON-lines logs, evaluation and checkpoints
                        at each epoch's end, stopping every rank alike on a signal; what
                        the machinery asks of a wrapper (dt_parallel_report)
       And the backend:
       30 CUDA          the GPU bodies of the ops, behind one table (dt_backend):
                        indexing, reductions and launch shape are all that differ.
                        Earlier chapters reach it only through what the backend
                        tables chapter declares: the tables (dt_backend,
                        dt_comm_backend), dt_cuda_backend, dt_cuda_device_count
                        and the dt_nccl_* calls a NCCL communicator is made of
       31 CUDA start-up and NCCL: finding the GPU, filling the table, and the
                        collectives on GPU buffers

   HOW THIS FILE IS MADE
       It is assembled from chapter files, src/NN-name.h in the project, by
       tools/assemble: make runs it when a chapter changes, and CI checks that
       the committed dtrain.h is the assembly. A chapter holds its declarations
       and its implementation together (the CUDA chapters implement the tables
       20 declares); this file puts every chapter's declarations first, then every
       implementation, then what the wrapper chapters (13-19) answer to the
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

//@ implementation
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
#include <sys/resource.h>
/* malloc_trim (the step arena): glibc's heap, not a sanitizer's allocator, which keeps freed memory
   itself (and under MemorySanitizer glibc's trim broke a thread's exit) */
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
#if defined(__has_feature)
#if !__has_feature(address_sanitizer) && !__has_feature(memory_sanitizer)
#define DT__TRIM_HEAP 1
#endif
#else
#define DT__TRIM_HEAP 1
#endif
#endif
#ifdef DT__TRIM_HEAP
#include <malloc.h>
#endif
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
#ifdef DT_HAVE_CURL
#include <curl/curl.h>
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

/* The two buffers blocks' input gradients take turns in (dt__grad_region, the
   autograd chapter), made in backward number `generation`. */
typedef struct { void *buf[2]; size_t bytes; dt_device device; int generation, turn; } dt__block_grads;

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
    /* The gradient the last dt_backward_from gave its scalar loss (1, or fp16's scale / K): what a
       term added to the loss in backward alone is scaled by (the experts' balancing loss) */
    float loss_seed;
    int recomputing;                   /* a block's forward runs again in backward (--recompute) */
    /* Logits that wait to be read (dt_vocab_head, dt_set_lazy_logits): the one that waits now, made
       from x w^T in step `step`; stale once the optimizer has moved w. */
    int64_t lazy_from;                 /* logits of at least this many bytes wait; < 0: none */
    struct { dt_tensor *logits, *x, *w; uint64_t step; int stale; } lazy;
    dt__block_grads block_grads;
} dt__context;

static DT_THREAD_LOCAL dt__context dt__ctx = { .world_size = 1, .grad_enabled = 1, .loss_seed = 1.0f, .lazy_from = -1 };


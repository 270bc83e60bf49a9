//@ lesson: collectives -- all-reduce, reduce-scatter, all-gather, broadcast, send and recv, ring shift and all-to-all, behind one table
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
               DT_COLL_BARRIER, DT_COLL_SEND, DT_COLL_RECV, DT_COLL_RING_SHIFT, DT_COLL_ALL_TO_ALL } dt_coll;

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
/* All-to-all with uneven counts, collective: send holds send_counts[0]
   elements for rank 0, then send_counts[1] for rank 1, ...; recv gets rank
   0's piece for this rank, then rank 1's, ... (recv_counts[p] from rank p).
   What p sends r must be what r expects of p (shared memory checks it).
   Mixture of experts sends each token to its experts' ranks so (stage 09). */
dt_comm_handle dt_all_to_all_async(dt_comm *c, const void *send, const int64_t *send_counts, void *recv,
                                   const int64_t *recv_counts, dt_dtype dtype);
void dt_all_to_all(dt_comm *c, const void *send, const int64_t *send_counts, void *recv, const int64_t *recv_counts,
                   dt_dtype dtype);
/* The most ranks a group may have (a job on shared memory, or one group of a
   mesh): the per-rank tables are this long. */
#define DT_MAX_RANKS 64


//@ implementation
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

   Tensor, pipeline and context parallelism (stage 06 and after) need messages
   between two ranks (dt_send, dt_recv, a ring shift), which pass through the
   sender's slot a piece at a time, and expert parallelism an all-to-all,
   pieces of uneven sizes from every rank to every rank. They run within
   groups of the ranks: the next chapter.

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
                                       "send", "recv", "ring_shift", "all_to_all" };

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
    int machine[DT_MAX_RANKS];              /* top's: the machine of each job rank (0, 1, ... by first rank) */
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
    int *mpi_counts;                        /* an all-to-all's counts and displacements, as MPI's ints */
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
   (dt_barrier) ms late, and a rank waiting in one sleeps look_ms between its
   first look at whether its peer is alive and its look at the counter -- so
   a peer can arrive, pass the job's last barrier and exit between the two. */
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
   into the shared header), a peer's process is gone (looked at only when
   look_at_peers: the barrier looks itself, before its counter), or we have
   waited past --timeout for rank j (j < 0: for any peer). Fills `why` and
   returns 1; the shared-memory barrier and the NCCL watchdog both ask this. */
static int dt__job_trouble(dt_comm *c, int j, int look_at_peers, double waited_ms, const char *what, char *why, size_t n) {
    int failed = __atomic_load_n(&c->top->hdr->abort_rank, __ATOMIC_ACQUIRE);
    if (failed) {
        dt__active_comm = NULL;              /* it told us; no need to tell it back */
        snprintf(why, n, "rank %d failed or died (see above), so %s cannot finish; stopping", failed - 1, what);
        return 1;
    }
    for (int r = j < 0 ? 0 : j; look_at_peers && r < (j < 0 ? c->world : j + 1); r++) {
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
            int first_look = *t0 == 0;
            if (first_look) *t0 = dt_now_ms();
            /* A peer may arrive and then end (its last barrier passed, it
               exits) at any moment, so look at the process first and the
               counter second: gone before a counter still short, it is dead;
               alive then, only a failure it reported or --timeout stops us. */
            int gone = dt__process_gone(__atomic_load_n(&c->hdr->pid[j], __ATOMIC_ACQUIRE));
            if (first_look) DT_TEST_BARRIER_LATE(c, what, 0);
            if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= target) break;
            char why[320];
            if (dt__job_trouble(c, j, gone, dt_now_ms() - *t0, what, why, sizeof why)) dt_fail("%s", why);
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

/* All-to-all: in step s each rank sends its piece for rank + s and receives
   rank - s's, a slot's worth at a time through its own slot; chunk k of a
   send waits only for chunk k - 1 to be taken, so every rank moves on. */
static void dt__shm_all_to_all(dt_comm *c, const dt_comm_op *o) {
    size_t es = dt_dtype_size(o->dtype);
    int64_t per_slot = (int64_t)(DT_SLOT_BYTES / es), W = c->world, me = c->rank, send_at[DT_MAX_RANKS], recv_at[DT_MAX_RANKS];
    char *mine = c->slots + (size_t)me * DT_SLOT_BYTES, what[80];
    for (int64_t r = 0, a = 0, b = 0; r < W; a += o->counts[r], b += o->counts[W + r], r++) { send_at[r] = a; recv_at[r] = b; }
    if (o->counts[me])             /* (an empty piece may have no memory at all) */
        memcpy((char *)o->recv + recv_at[me] * es, (const char *)o->send + send_at[me] * es, (size_t)o->counts[me] * es);
    double t0 = 0;
    for (int64_t s = 1; s < W; s++) {
        int64_t to = (me + s) % W, from = (me - s + W) % W, ns = o->counts[to], nr = o->counts[W + from];
        dt__shm_pair *out = dt__shm_pair_of(c, (int)me, (int)to), *in = dt__shm_pair_of(c, (int)from, (int)me);
        dt__shm_pair *before = dt__shm_pair_of(c, (int)me, (int)((me + s - 1) % W));
        snprintf(what, sizeof what, "all_to_all (rank %d's piece for rank %d)", c->job_rank[from], c->job_rank[me]);
        if (s > 1) dt__shm_wait_for(c, &before->taken, before->sent, (int)((me + s - 1) % W), what, &t0);   /* my slot is free */
        out->count = ns;
        out->dtype = (int32_t)o->dtype;
        uint64_t sent0 = out->sent, taken0 = in->taken;     /* each counter has one writer: read, not raced */
        int64_t chunks = ns ? (ns + per_slot - 1) / per_slot : 1, rchunks = nr ? (nr + per_slot - 1) / per_slot : 1;
        for (int64_t k = 0; k < (chunks > rchunks ? chunks : rchunks); k++) {      /* an empty piece: one empty chunk */
            if (k < chunks) {
                if (k) dt__shm_wait_for(c, &out->taken, sent0 + (uint64_t)k, (int)to, what, &t0);
                int64_t n = ns - k * per_slot < per_slot ? ns - k * per_slot : per_slot;
                if (n > 0) memcpy(mine, (const char *)o->send + (send_at[to] + k * per_slot) * (int64_t)es, (size_t)n * es);
                __atomic_store_n(&out->sent, sent0 + (uint64_t)k + 1, __ATOMIC_RELEASE);
            }
            if (k < rchunks) {
                dt__shm_wait_for(c, &in->sent, taken0 + (uint64_t)k + 1, (int)from, what, &t0);
                if (k == 0 && (in->count != nr || in->dtype != (int32_t)o->dtype))
                    dt_fail("all_to_all: rank %d sends rank %d %lld elements of %s, which expects %lld of %s", c->job_rank[from],
                            c->job_rank[me], (long long)in->count, dt_dtype_name((dt_dtype)in->dtype), (long long)nr,
                            dt_dtype_name(o->dtype));
                int64_t n = nr - k * per_slot < per_slot ? nr - k * per_slot : per_slot;
                const char *theirs = c->slots + (size_t)from * DT_SLOT_BYTES;
                if (n > 0) memcpy((char *)o->recv + (recv_at[from] + k * per_slot) * (int64_t)es, theirs, (size_t)n * es);
                __atomic_store_n(&in->taken, taken0 + (uint64_t)k + 1, __ATOMIC_RELEASE);
            }
        }
    }
    if (W > 1) {                          /* the last piece taken: the slot is free for the next call */
        dt__shm_pair *last = dt__shm_pair_of(c, (int)me, (int)((me + W - 1) % W));
        dt__shm_wait_for(c, &last->taken, last->sent, (int)((me + W - 1) % W), "all_to_all", &t0);
    }
}

static void dt__shm_run(dt_comm *c, const dt_comm_op *o) {
    size_t es = dt_dtype_size(o->dtype);
    int64_t per_slot = (int64_t)(DT_SLOT_BYTES / es), W = c->world, me = c->rank;
    char *mine = c->slots + (size_t)me * DT_SLOT_BYTES;
    const char *send = (const char *)o->send;
    char *recv = (char *)o->recv;
    const char *what = dt__coll_names[o->kind];
    if (o->kind == DT_COLL_ALL_TO_ALL) { dt__shm_all_to_all(c, o); return; }
    if (W == 1) {                         /* alone: every collective is a copy (or nothing); no peer to send to */
        if (o->kind != DT_COLL_BARRIER && recv != send) memmove(recv, send, (size_t)o->count * es);
        return;
    }
    switch (o->kind) {
    case DT_COLL_ALL_TO_ALL: break;       /* above */
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
        if (spins % 64 == 0 && dt__job_trouble(c, -1, 1, dt_now_ms() - t0, what, why, sizeof why)) {
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
    case DT_COLL_ALL_TO_ALL: {        /* counts, then displacements: sent, then received */
        int W = c->world, *k = c->mpi_counts = (int *)malloc(sizeof(int) * 4 * (size_t)W);
        if (!k) dt_fail("out of memory (MPI all_to_all)");
        for (int side = 0, r; side < 2; side++)
            for (r = 0; r < W; r++) {
                int64_t at = r ? (int64_t)k[(2 * side + 1) * W + r - 1] + o->counts[side * W + r - 1] : 0;
                if (o->counts[side * W + r] > INT_MAX || at > INT_MAX)
                    dt_fail("all_to_all over MPI: %lld elements %s rank %d, %lld before them: at most %d (MPI counts are int)",
                            (long long)o->counts[side * W + r], side ? "from" : "for", r, (long long)at, INT_MAX);
                k[2 * side * W + r] = (int)o->counts[side * W + r];
                k[(2 * side + 1) * W + r] = (int)at;
            }
        err = MPI_Ialltoallv(o->send, k, k + W, type, recv, k + 2 * W, k + 3 * W, type, c->mpi, &c->mpi_request);
        break;
    }
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
        if (spins % 64 == 0 && dt__job_trouble(c, -1, 1, dt_now_ms() - t0, what, why, sizeof why)) dt_fail("%s (over MPI)", why);
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
    free(c->mpi_counts);
    c->mpi_temp = NULL;
    c->mpi_counts = NULL;
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
        free(o.counts);
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
    dt_comm_op o = { DT_COLL_ALL_REDUCE, send, recv, count, dtype, op, 0, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_reduce_scatter_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op) {
    dt_comm_op o = { DT_COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_all_gather_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    dt_comm_op o = { DT_COLL_ALL_GATHER, send, recv, count, dtype, DT_SUM, 0, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_broadcast_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int root) {
    dt_comm_op o = { DT_COLL_BROADCAST, buf, buf, count, dtype, DT_SUM, root, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_reduce_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype, dt_reduce_op op, int root) {
    dt_comm_op o = { DT_COLL_REDUCE, send, recv, count, dtype, op, root, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_send_async(dt_comm *c, const void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_op o = { DT_COLL_SEND, buf, NULL, count, dtype, DT_SUM, peer, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_recv_async(dt_comm *c, void *buf, int64_t count, dt_dtype dtype, int peer) {
    dt_comm_op o = { DT_COLL_RECV, NULL, buf, count, dtype, DT_SUM, peer, 0, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_ring_shift_async(dt_comm *c, const void *send, void *recv, int64_t count, dt_dtype dtype) {
    size_t bytes = count > 0 ? (size_t)count * dt_dtype_size(dtype) : 0;
    if (bytes && (const char *)send < (const char *)recv + bytes && (const char *)recv < (const char *)send + bytes)
        dt_fail("ring_shift: send and recv overlap; the sent buffer must stay whole while the received one arrives");
    dt_comm_op o = { DT_COLL_RING_SHIFT, send, recv, count, dtype, DT_SUM, (c->rank + 1) % c->world,
                     (c->rank + c->world - 1) % c->world, NULL };
    return dt__comm_submit(c, o);
}
dt_comm_handle dt_all_to_all_async(dt_comm *c, const void *send, const int64_t *send_counts, void *recv,
                                   const int64_t *recv_counts, dt_dtype dtype) {
    int64_t W = c->world, sent = 0, got = 0, *counts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * W));
    if (!counts) dt_fail("out of memory (all_to_all)");
    for (int64_t r = 0; r < W; r++) {
        if (send_counts[r] < 0 || recv_counts[r] < 0 || send_counts[r] > INT64_MAX / 8 - sent || recv_counts[r] > INT64_MAX / 8 - got)
            dt_fail("all_to_all: %lld elements for rank %d and %lld from it", (long long)send_counts[r], (int)r,
                    (long long)recv_counts[r]);
        if (r == c->rank && send_counts[r] != recv_counts[r])
            dt_fail("all_to_all: rank %d sends itself %lld elements but expects %lld of itself", c->job_rank[c->rank],
                    (long long)send_counts[r], (long long)recv_counts[r]);
        counts[r] = send_counts[r]; counts[W + r] = recv_counts[r];
        sent += send_counts[r]; got += recv_counts[r];
    }
    size_t es = dt_dtype_size(dtype);
    if (sent && got && (const char *)send < (const char *)recv + (size_t)got * es && (const char *)recv < (const char *)send + (size_t)sent * es)
        dt_fail("all_to_all: send and recv overlap; the pieces sent must stay whole while others arrive");
    dt_comm_op o = { DT_COLL_ALL_TO_ALL, send, recv, sent, dtype, DT_SUM, 0, 0, counts };
    dt__comm_check_buffer(c, &o, recv);
    return dt__comm_submit(c, o);
}
void dt_all_to_all(dt_comm *c, const void *send, const int64_t *send_counts, void *recv, const int64_t *recv_counts,
                   dt_dtype dtype) {
    dt_comm_wait(c, dt_all_to_all_async(c, send, send_counts, recv, recv_counts, dtype));
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
    dt_comm_op o = { DT_COLL_BARRIER, NULL, NULL, 0, DT_F32, DT_SUM, 0, 0, NULL };
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

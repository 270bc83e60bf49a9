/* tools/collectives -- check and time dtrain's collectives.

   usage: tools/collectives [--nproc N | --threads N] [--comm shm|mpi|auto] [--timeout S] [--check | --bench]
                            [--agree VALUE] [--mesh AxB]

   Ranks are processes (--nproc N, or started by torchrun / srun / mpirun through
   their environment variables) or threads of this process (--threads N).
     --comm    the transport of a job of processes (default auto: shared memory on
               one machine; MPI, under mpirun or srun --mpi=pmix, across machines)
     --check   every collective, send/recv (a ring) and the ring shift, f32/bf16/f16, lengths 0, 1,
               7 and 1,000,003: each rank's result must equal a serial reference
               bit for bit -- except sums over MPI with more than two ranks, which
               MPI adds in an order of its own: within a rounding per addition
               (and a 16-bit result within one unit in its last place)
     --mesh    with --check: the same on each group of an A x B ("dp" x "tp") mesh
               of the ranks (A * B of them), the groups side by side (the longest
               length 600,001)
     --bench   all-reduce bus bandwidth from 1 KB to 256 MB (nccl-tests' busbw)
     --agree   every rank must pass the same VALUE (the start-up mismatch check) */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <pthread.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The longest crosses a shared-memory slot (2 MiB) in every dtype; on the
   groups of a mesh (--mesh) a shorter one, still longer than a slot in f32. */
static int64_t lengths[] = { 0, 1, 7, 1000003 };
static const char *dtype_names[] = { "f32", "bf16", "f16" };

/* 64 well-mixed bits from three numbers (SplitMix64's finaliser). */
static uint64_t hash3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xD1B54A32D192ED03ull ^ c;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Rank r's input: values already rounded to the dtype, the same on every rank. */
static void fill(void *buf, int64_t n, dt_dtype t, int r, int64_t salt) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = hash3((uint64_t)r, (uint64_t)i, (uint64_t)salt);
        dt_store_f32(buf, i, t, (float)((h >> 11) * (1.0 / 9007199254740992.0) * 4 - 2));
    }
}
/* The serial reference: element i of each rank's buffer at `off`, summed in
   rank order. Rank r of the communicator is rank ids[r] of the job, whose
   input it holds: a group made of the wrong ranks sums the wrong inputs. */
static void reference_sum(void *out, int64_t n, dt_dtype t, const int *ids, int world, int64_t per_rank, int64_t off,
                          int avg, int64_t salt) {
    size_t es = dt_dtype_size(t);
    char *in = (char *)malloc((size_t)per_rank * es + 1);
    float *acc = (float *)calloc((size_t)n + 1, sizeof(float));
    for (int r = 0; r < world; r++) {
        fill(in, per_rank, t, ids[r], salt);
        for (int64_t i = 0; i < n; i++) acc[i] = r == 0 ? dt_load_f32(in, off + i, t) : acc[i] + dt_load_f32(in, off + i, t);
    }
    for (int64_t i = 0; i < n; i++) dt_store_f32(out, i, t, avg ? acc[i] / (float)world : acc[i]);
    free(in);
    free(acc);
}

/* Sums in rank order are compared bit for bit. MPI adds in an order of its
   own (a tree, a ring): with two ranks a + b is still exact; with more, the f32
   sum may differ by a rounding per addition of values up to 2 * W, and a 16-bit
   result (rounded once, from f32) by one unit in its last place besides. */
static int own_order;                 /* a transport that sums in an order of its own */
static int same_sum(const void *got, const void *want, int64_t n, dt_dtype t, int W) {
    if (!own_order || W <= 2) return !memcmp(got, want, (size_t)n * dt_dtype_size(t));
    for (int64_t i = 0; i < n; i++) {
        double w = dt_load_f32(want, i, t), ulp = t == DT_BF16 ? fabs(w) / 128 : t == DT_F16 ? fabs(w) / 1024 + 6e-8 : 0;
        if (fabs(dt_load_f32(got, i, t) - w) > 6e-8 * W * 2.0 * W + ulp) return 0;
    }
    return 1;
}

/* Send to the next rank, receive from the one before, around the ring. A
   send finishes when it is received, so rank 0 sends first and the others
   receive first (with the asynchronous calls, to test them too). */
static void ring(dt_comm *c, const void *send, void *recv, int64_t n, dt_dtype dt) {
    int me = dt_comm_rank(c), W = dt_comm_size(c), next = (me + 1) % W, prev = (me + W - 1) % W;
    if (me == 0) {
        dt_send(c, send, n, dt, next);
        dt_recv(c, recv, n, dt, prev);
        return;
    }
    dt_comm_handle r = dt_recv_async(c, recv, n, dt, prev), s = dt_send_async(c, send, n, dt, next);
    dt_comm_wait(c, r);
    dt_comm_wait(c, s);
}

/* What rank s sends rank d in the all-to-all check: n down to n / 4, and nothing for a third of the pairs. */
static int64_t a2a_count(int s, int d, int64_t n) { return (s + d) % 3 == 2 ? 0 : n - ((s * 3 + d * 5) % 4) * (n / 4); }
static int check(dt_comm *c, const int *ids, const char *label) {
    int me = dt_comm_rank(c), W = dt_comm_size(c), bad = 0, cases = 0;
    for (int t = 0; t < 3; t++)
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            dt_dtype dt = (dt_dtype)t;
            int64_t n = lengths[li], salt = 1000 * t + (int64_t)li;
            size_t es = dt_dtype_size(dt), bytes = (size_t)n * es;
            char *send = (char *)malloc((size_t)W * bytes + 2), *recv = (char *)malloc((size_t)W * bytes + 2);
            char *want = (char *)malloc((size_t)W * bytes + 2);
            for (int op = 0; op < 2; op++) {
                fill(send, n, dt, ids[me], salt);
                dt_all_reduce(c, send, recv, n, dt, (dt_reduce_op)op);
                reference_sum(want, n, dt, ids, W, n, 0, op, salt);
                if (!same_sum(recv, want, n, dt, W)) { bad++; printf("rank %d: all_reduce %s %s n=%lld differs\n", me, op ? "avg" : "sum", dtype_names[t], (long long)n); }
                fill(send, n, dt, ids[me], salt);                  /* in place */
                dt_all_reduce(c, send, send, n, dt, (dt_reduce_op)op);
                if (!same_sum(send, want, n, dt, W)) { bad++; printf("rank %d: in-place all_reduce %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
                fill(send, W * n, dt, ids[me], salt);
                dt_reduce_scatter(c, send, recv, n, dt, (dt_reduce_op)op);
                reference_sum(want, n, dt, ids, W, W * n, me * n, op, salt);
                if (!same_sum(recv, want, n, dt, W)) { bad++; printf("rank %d: reduce_scatter %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
                fill(send, n, dt, ids[me], salt);
                memset(recv, 0x55, bytes);
                dt_reduce(c, send, recv, n, dt, (dt_reduce_op)op, 0);
                reference_sum(want, n, dt, ids, W, n, 0, op, salt);
                if (me == 0 && !same_sum(recv, want, n, dt, W)) { bad++; printf("rank 0: reduce %s n=%lld differs\n", dtype_names[t], (long long)n); }
                cases += 4;
            }
            fill(send, n, dt, ids[me], salt);
            dt_all_gather(c, send, recv, n, dt);
            for (int r = 0; r < W; r++) fill(want + (size_t)r * bytes, n, dt, ids[r], salt);
            if (memcmp(recv, want, (size_t)W * bytes)) { bad++; printf("rank %d: all_gather %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
            fill(recv, n, dt, ids[me], salt);
            dt_broadcast(c, recv, n, dt, W - 1);
            fill(want, n, dt, ids[W - 1], salt);
            if (memcmp(recv, want, bytes)) { bad++; printf("rank %d: broadcast %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
            if (W > 1) {
                fill(send, n, dt, ids[me], salt);
                memset(recv, 0x55, bytes);
                ring(c, send, recv, n, dt);
                fill(want, n, dt, ids[(me + W - 1) % W], salt);
                if (memcmp(recv, want, bytes)) { bad++; printf("rank %d: send/recv %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
                cases++;
            }
            fill(send, n, dt, ids[me], salt);               /* a ring shift: the previous rank's, all at once */
            memset(recv, 0x55, bytes);
            dt_ring_shift(c, send, recv, n, dt);
            fill(want, n, dt, ids[(me + W - 1) % W], salt);
            if (memcmp(recv, want, bytes)) { bad++; printf("rank %d: ring_shift %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
            cases++;
            /* all-to-all, uneven: rank s gives rank d a piece of its own length (some empty), made of (s, d) */
            int64_t sc[64], rc[64], at = 0;
            for (int d = 0; d < W; d++) sc[d] = a2a_count(me, d, n), rc[d] = a2a_count(d, me, n);
            for (int d = 0; d < W; at += sc[d], d++) fill(send + (size_t)at * es, sc[d], dt, ids[me] * 64 + d, salt);
            memset(recv, 0x55, (size_t)W * bytes);
            dt_all_to_all(c, send, sc, recv, rc, dt);
            at = 0;
            for (int r = 0; r < W; at += rc[r], r++) fill(want + (size_t)at * es, rc[r], dt, ids[r] * 64 + me, salt);
            int past = (size_t)at * es < (size_t)W * bytes && ((unsigned char *)recv)[(size_t)at * es] != 0x55;   /* nothing past its pieces */
            if (memcmp(recv, want, (size_t)at * es) || past) { bad++; printf("rank %d: all_to_all %s n=%lld differs\n", me, dtype_names[t], (long long)n); }
            cases++;
            dt_barrier(c);
            cases += 3;
            free(send); free(recv); free(want);
        }
    printf("rank %d of %d%s: %d collectives %s\n", me, W, label, cases,
           bad ? "FAILED" : !own_order || W <= 2 ? "match the serial reference bit for bit"
                                       : "match the serial reference (sums within MPI's rounding, the rest bit for bit)");
    fflush(stdout);
    return bad ? 1 : 0;
}

static int bench(dt_comm *c) {
    int me = dt_comm_rank(c), W = dt_comm_size(c);
    size_t max_bytes = (size_t)256 << 20;
    float *buf = (float *)dt_alloc(DT_ARENA_COMM, max_bytes);
    if (me == 0) printf("all_reduce, f32, %d ranks (%s); busbw = algbw * 2(n-1)/n as nccl-tests\n%12s %10s %12s %12s\n",
                        W, dt_comm_backend_name(c), "bytes", "time_us", "algbw_GB/s", "busbw_GB/s");
    for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
        int64_t n = (int64_t)(bytes / 4);
        int iters = bytes <= ((size_t)1 << 20) ? 50 : bytes <= ((size_t)16 << 20) ? 10 : 3;
        dt_all_reduce(c, buf, buf, n, DT_F32, DT_SUM);          /* warm-up */
        dt_barrier(c);
        double t0 = dt_now_ms();
        for (int i = 0; i < iters; i++) dt_all_reduce(c, buf, buf, n, DT_F32, DT_SUM);
        double us = (dt_now_ms() - t0) * 1e3 / iters, algbw = bytes / us / 1e3;
        if (me == 0) printf("%12zu %10.1f %12.3f %12.3f\n", bytes, us, algbw, algbw * 2.0 * (W - 1) / W);
        fflush(stdout);
    }
    dt_free(DT_ARENA_COMM, buf, max_bytes);
    return 0;
}

/* Each group of an A x B mesh, against a reference that knows, without asking
   the library, which ranks of the job a group holds: along "tp" the ranks
   that share rank / B, along "dp" those that share rank % B. */
static int check_mesh(dt_comm *c, const int *mesh) {
    static const char *names[] = { "dp", "tp" };
    int me = dt_comm_rank(c), coord[2] = { me / mesh[1], me % mesh[1] }, stride[2] = { mesh[1], 1 }, status = 0;
    dt_mesh *m = dt_mesh_create(c, 2, mesh, names);
    for (int d = 0; d < 2; d++) {
        dt_comm *g = dt_mesh_comm(m, names[d]);
        int ids[64];
        char label[96];
        for (int i = 0; i < mesh[d]; i++) ids[i] = me + (i - coord[d]) * stride[d];
        snprintf(label, sizeof label, " in the %s group (job rank %d)", names[d], me);
        if (dt_comm_size(g) != mesh[d] || dt_comm_rank(g) != coord[d] || dt_mesh_coord(m, names[d]) != coord[d]) {
            printf("rank %d: the %s group has %d ranks, this one is %d (coordinate %d); expected %d, %d\n", me, names[d],
                   dt_comm_size(g), dt_comm_rank(g), dt_mesh_coord(m, names[d]), mesh[d], coord[d]);
            status = 1;
        }
        status |= check(g, ids, label);
    }
    dt_mesh_free(m);
    return status;
}
static int run_check(dt_comm *c, const int *mesh) {
    if (mesh[0]) return check_mesh(c, mesh);
    int ids[64];
    for (int r = 0; r < 64; r++) ids[r] = r;
    return check(c, ids, "");
}

typedef struct { dt_comm_group *g; int rank, status, do_bench; const int *mesh; } thread_arg;
static void *thread_main(void *p) {
    thread_arg *a = (thread_arg *)p;
    dt_comm *c = dt_comm_join(a->g, a->rank);
    a->status = a->do_bench ? bench(c) : run_check(c, a->mesh);
    dt_comm_free(c);
    return NULL;
}

int main(int argc, char **argv) {
    int nproc = 1, threads = 0, do_check = 0, do_bench = 0, mesh[2] = { 0, 0 };
    double timeout = 60;
    const char *agree = NULL;
    dt_comm_kind comm = DT_COMM_AUTO;
    int comm_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--check")) do_check = 1;
        else if (!strcmp(a, "--bench")) do_bench = 1;
        else if (!strcmp(a, "--nproc") && v) { nproc = (int)dt_flag_number("--nproc", v, 1, DT_MAX_RANKS, 1); i++; }
        else if (!strcmp(a, "--threads") && v) { threads = (int)dt_flag_number("--threads", v, 0, DT_MAX_RANKS, 1); i++; }
        else if (!strcmp(a, "--timeout") && v) { timeout = dt_flag_number("--timeout", v, 0.001, 86400, 0); i++; }
        else if (!strcmp(a, "--agree") && v) { agree = v; i++; }
        else if (!strcmp(a, "--comm") && v) {
            if (strcmp(v, "shm") && strcmp(v, "mpi") && strcmp(v, "auto"))
                dt_usage_error("--comm %s: shm, mpi or auto (this tool checks host buffers; NCCL's are checked by make gpu-check)", v);
            comm = !strcmp(v, "shm") ? DT_COMM_SHM : !strcmp(v, "mpi") ? DT_COMM_MPI : DT_COMM_AUTO;
            comm_given = 1;
            i++;
        }
        else if (!strcmp(a, "--mesh") && v && sscanf(v, "%dx%d", &mesh[0], &mesh[1]) == 2 && mesh[0] > 0 && mesh[1] > 0) i++;
        else dt_usage_error("unknown flag or missing value: %s (see the top of tools/collectives.c)", a);
    }
    if (mesh[0]) lengths[3] = 600001;
    if (threads > 0 && comm_given) dt_usage_error("--comm with --threads: thread ranks always meet in this process's memory");
#ifndef DT_HAVE_MPI
    if (comm == DT_COMM_MPI) dt_usage_error("--comm mpi: " DT__NO_MPI);
#endif
    if (threads > 0) {
        dt_comm_group *g = dt_comm_group_create(threads, timeout);
        pthread_t th[64];
        thread_arg args[64];
        int status = 0;
        for (int r = 0; r < threads; r++) {
            args[r] = (thread_arg){ g, r, 0, do_bench, mesh };
            pthread_create(&th[r], NULL, thread_main, &args[r]);
        }
        for (int r = 0; r < threads; r++) { pthread_join(th[r], NULL); status |= args[r].status; }
        dt_comm_group_free(g);
        return status;
    }
    if (comm == DT_COMM_MPI && nproc > 1) dt_usage_error("--comm mpi --nproc %d: mpirun or srun starts MPI's ranks", nproc);
    dt_launch(nproc, timeout);
    dt_comm *c = dt_comm_init(comm, timeout);
    own_order = !dt_comm_sums_in_rank_order(c);
    int status = 0;
    if (agree) dt_comm_check_agree(c, "--agree", agree);
    if (do_check) status = run_check(c, mesh);
    if (do_bench) status |= bench(c);
    dt_comm_free(c);
    return status;
}

/* tests/11-collectives.c -- tests of dtrain.h's chapter 11-collectives:
   every op, dtype and group against a serial reference; a dead rank; the
   test hooks. (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- collectives: every op, dtype and group against a serial reference; a dead rank ---- */

/* tools/collectives beside the stage binary under test (build/asan/... for ASan). */
static const char *collectives_bin(void) { return build_path("tools/collectives"); }
static int count_shm_segments(void) {
    int n = 0;
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    while (d && (e = readdir(d))) n += strncmp(e->d_name, "dtrain-", 7) == 0;
    if (d) closedir(d);
    return n;
}

static void collectives_match(const char *mode) {
    char out[16384];
    for (int w = 1; w <= 4; w++) {
        int st = run_cmd(out, sizeof out, "%s --%s %d --check --timeout 30", collectives_bin(), mode, w);
        CHECKF(st == 0 && count_lines_with(out, "match the serial reference bit for bit") == w,
               "%s %d: exit %d\n%s", mode, w, st, out);
    }
}
TEST(collectives_over_threads_match_a_serial_reference, QUICK) { collectives_match("threads"); }
TEST(collectives_over_processes_match_a_serial_reference, QUICK) { collectives_match("nproc"); }

/* The same check on each group of a mesh of four ranks: 2 x 2 (pairs side by
   side) and 1 x 4 (a group of one and a group of all), every collective and
   send/recv against a reference that knows which ranks a group must hold. */
static void mesh_collectives_match(const char *mode) {
    static const char *meshes[] = { "2x2", "1x4" };
    char out[16384];
    for (int i = 0; i < 2; i++) {
        int st = run_cmd(out, sizeof out, "%s --%s 4 --check --mesh %s --timeout 30", collectives_bin(), mode, meshes[i]);
        CHECKF(st == 0 && count_lines_with(out, "match the serial reference bit for bit") == 8 &&
               count_lines_with(out, " in the dp group (job rank ") == 4 && count_lines_with(out, " in the tp group (job rank ") == 4,
               "%s 4, mesh %s: exit %d\n%s", mode, meshes[i], st, out);
    }
}
TEST(groups_of_a_mesh_over_threads_match_a_serial_reference, QUICK) { mesh_collectives_match("threads"); }
TEST(groups_of_a_mesh_over_processes_match_a_serial_reference, QUICK) { mesh_collectives_match("nproc"); }

/* `test_dtrain --selftest-comm-misuse N`: one mistake with groups, meshes or
   messages, which must stop the program with its message. */
typedef struct { dt_comm_group *group; int rank; } misuse_arg;
static void *mismatched_message_thread(void *arg) {
    misuse_arg *a = (misuse_arg *)arg;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    float buf[4] = { 0 };
    if (a->rank == 0) dt_send(c, buf, 3, DT_F32, 1);
    else dt_recv(c, buf, 4, DT_F32, 0);
    return NULL;
}
static void *mismatched_all_to_all_thread(void *arg) {    /* rank 0 sends rank 1 two, rank 1 expects three */
    misuse_arg *a = (misuse_arg *)arg;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    float send[8] = { 0 }, recv[8];
    int64_t sc[2] = { 1, a->rank ? 1 : 2 }, rc[2] = { a->rank ? 3 : 1, 1 };
    dt_all_to_all(c, send, sc, recv, rc, DT_F32);
    return NULL;
}
static int selftest_comm_misuse(int which) {
    static const int sizes[2] = { 1, 1 }, too_many[2] = { 3, 2 };
    static const char *names[2] = { "dp", "tp" };
    float v = 0;
    dt_comm_group *group = dt_comm_group_create(which == 0 ? 4 : which == 3 ? 2 : 1, 10);
    dt_comm *c = dt_comm_join(group, 0);
    if (which == 0) dt_mesh_create(c, 2, too_many, names);
    if (which == 1) dt_mesh_comm(dt_mesh_create(c, 2, sizes, names), "pp");
    if (which == 2) { dt_comm_split(c, 0, 0); dt_comm_free(c); }
    if (which == 3) dt_send(c, &v, 1, DT_F32, 0);
    if (which == 4) dt_comm_split(c, -1, 0);
    if (which == 6) {                     /* the mesh frees its own communicators */
        dt_mesh *m = dt_mesh_create(c, 2, sizes, names);
        dt_comm_free(dt_mesh_comm(m, "tp"));
    }
    if (which == 7) dt_comm_group_free(group);             /* while c, its member, is open */
    if (which == 8) {                     /* a ring shift whose buffers overlap */
        float two[3] = { 0 };
        dt_ring_shift(c, two, two + 1, 2, DT_F32);
    }
    if (which == 9) {                     /* an all-to-all whose buffers overlap */
        float both[4] = { 0 };
        int64_t one[1] = { 2 };
        dt_all_to_all(c, both, one, both + 1, one, DT_F32);
    }
    if (which == 11) {                    /* a piece for itself of another size than it expects of itself */
        float send[2] = { 0 }, recv[2];
        int64_t two[1] = { 2 }, one[1] = { 1 };
        dt_all_to_all(c, send, two, recv, one, DT_F32);
    }
    if (which == 5 || which == 10) {
        dt_comm_group *g = dt_comm_group_create(2, 10);
        pthread_t th[2];
        misuse_arg args[2] = { { g, 0 }, { g, 1 } };
        for (int r = 0; r < 2; r++)
            pthread_create(&th[r], NULL, which == 5 ? mismatched_message_thread : mismatched_all_to_all_thread, &args[r]);
        for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    }
    return 0;
}
TEST(mesh_split_and_message_mistakes_are_clear_errors, QUICK) {
    static const char *want[] = {
        "dt_mesh_create: a dp=3 x tp=2 mesh has 6 ranks, but the communicator has 4: the sizes must multiply to its size",
        "dt_mesh: no dimension named 'pp' in this dp=1 x tp=1 mesh",
        "dt_comm_free: 1 group(s) split from this communicator are still open; free them first",
        "send: the peer is this rank (0); a message goes to another rank of the communicator",
        "dt_comm_split: color -1; a color is a number >= 0",
        "rank 0 sends 3 elements of fp32, but rank 1 receives 4 of fp32: a send and its recv must agree",
        "dt_comm_free: this communicator belongs to a mesh (dt_mesh_comm); dt_mesh_free frees it",
        "dt_comm_group_free: 1 rank(s) that joined it are still open; call dt_comm_free on each first",
        "ring_shift: send and recv overlap; the sent buffer must stay whole while the received one arrives",
        "all_to_all: send and recv overlap; the pieces sent must stay whole while others arrive",
        "all_to_all: rank 0 sends rank 1 2 elements of fp32, which expects 3 of fp32",
        "all_to_all: rank 0 sends itself 2 elements but expects 1 of itself",
    };
    char out[4096];
    for (int i = 0; i < (int)(sizeof want / sizeof want[0]); i++) {
        int st = run_cmd(out, sizeof out, "%s --selftest-comm-misuse %d", self_bin, i);
        CHECKF(st == 1 && strstr(out, "dtrain") && strstr(out, "error: ") && strstr(out, want[i]),
               "mistake %d: exit %d, expected \"%s\":\n%s", i, st, want[i], out);
    }
}

/* A rank that dies inside a group stops the job: its group partner names it
   (by its rank in the job, not in the group), and the other group hears of it. */
/* tools/collectives with rank 1 killed in its first all-reduce: the job fails
   within the timeout, the others name rank 1, and /dev/shm stays clean. */
static void run_with_rank_1_killed(const char *flags, char *out, size_t n) {
    int before = count_shm_segments();
    double t0 = dt_now_ms();
    int st = run_cmd(out, n, "env DT_TEST_DIE_RANK=1 %s %s --check --timeout 10", collectives_bin(), flags);
    double s = (dt_now_ms() - t0) / 1e3;
    CHECKF(st != 0, "the job exited 0 although rank 1 was killed:\n%s", out);
    CHECKF(s < 10, "the others took %.1f s to stop (timeout 10 s)", s);
    CHECKF(strstr(out, "rank 1 (pid") && strstr(out, "died during all_reduce"), "no rank named the dead rank 1:\n%s", out);
    CHECKF(count_lines_with(out, "dtrain[rank ") >= 2, "not every surviving rank reported:\n%s", out);
    CHECKF(count_shm_segments() == before, "a /dev/shm/dtrain-* segment was left behind");
}
TEST(a_rank_killed_in_a_group_stops_the_others_with_its_name, QUICK | ALONE) {
    char out[16384];
    run_with_rank_1_killed("--nproc 4 --mesh 2x2", out, sizeof out);
    for (int r = 0; r < 4; r++) {            /* the first cause, recorded for the whole job, is the only one named */
        char died[64], failed[64];
        snprintf(died, sizeof died, "rank %d (pid", r);
        snprintf(failed, sizeof failed, "rank %d failed", r);
        CHECKF(r == 1 || (!strstr(out, died) && !strstr(out, failed)), "a rank blamed rank %d, not the dead rank 1:\n%s", r, out);
    }
}

TEST(a_killed_rank_stops_the_others_with_its_name, QUICK | ALONE) {
    char out[16384];
    run_with_rank_1_killed("--nproc 3", out, sizeof out);
}

/* A rank that passes the job's last barrier and exits at once is done, not
   dead: the others, still looking at the barrier, must not take it for a
   rank that died in it. The hook DT_TEST_BARRIER_LATE="0 150 600" has rank 0
   reach each barrier 150 ms late while the others wait 600 ms between their
   first look at whether it lives and their look at the barrier's counter --
   so rank 0 arrives, ends and exits in between, after the sharded save's last
   barrier. (CI failed this way twice: "rank 0 died during barrier" at the end
   of a 04 --shard full run at -O2, and of 04 --shard grads under MSan.) */
TEST(a_rank_that_ends_after_the_last_barrier_is_not_taken_for_dead, QUICK) {
    char out[16384], dir[700];
    snprintf(dir, sizeof dir, "%s/saves", tmpdir);
    int st = run_cmd(out, sizeof out, "env DT_TEST_BARRIER_LATE='0 150 600' %s --data %s " PAR_FLAGS " --model mlp --depth 1 "
                     "--batch-size 16 --nproc 2 --shard full --epochs 1 --steps 2 --save-dir %s --timeout 60",
                     stage_bin("04-fsdp"), small_data(), dir);
    CHECKF(st == 0 && !strstr(out, "died during"), "04 --nproc 2 with rank 0 ending between the others' looks: exit %d\n%.3000s",
           st, out);
}

/* The hooks the tests above use are compiled in only with -DDT_TESTING (the
   suite's own builds): the tools/collectives `make` builds ignores them. */
static const char *plain_collectives_bin(void) {
    static char path[800];
    snprintf(path, sizeof path, "%s/tools/collectives", repo_root());
    return path;
}
TEST(test_hooks_exist_only_in_testing_builds, QUICK) {
    char out[16384];
    const char *plain = plain_collectives_bin();
    struct stat sb;
    if (stat(plain, &sb) != 0) SKIP("no tools/collectives at the root (make all builds it)");
    if (!strcmp(plain, collectives_bin())) SKIP("the suite runs the plain build itself");
    int st = run_cmd(out, sizeof out, "env DT_TEST_DIE_RANK=1 %s --nproc 2 --check --timeout 30", plain);
    CHECKF(st == 0, "the build without DT_TESTING obeyed DT_TEST_DIE_RANK (exit %d):\n%s", st, out);
    st = run_cmd(out, sizeof out, "grep -c DT_TEST_DIE_RANK %s", plain);
    CHECKF(st != 0, "the build without DT_TESTING holds the hook's name");
    st = run_cmd(out, sizeof out, "grep -c DT_TEST_DIE_RANK %s", collectives_bin());
    CHECKF(st == 0, "the suite's build %s has no DT_TEST_DIE_RANK hook", collectives_bin());
}

/* A device made of host memory that knows its own allocations: enough for a
   communicator to believe it has a GPU, so that a CPU test can see which kind
   of memory a collective is handed. */
static struct { pthread_mutex_t mu; void *p[4096]; size_t n[4096]; int count; } fake_mem = { PTHREAD_MUTEX_INITIALIZER, { 0 }, { 0 }, 0 };
static void *fake_alloc(size_t bytes) {
    void *p = calloc(1, bytes);
    pthread_mutex_lock(&fake_mem.mu);
    if (fake_mem.count < 4096) { fake_mem.p[fake_mem.count] = p; fake_mem.n[fake_mem.count++] = bytes; }
    pthread_mutex_unlock(&fake_mem.mu);
    return p;
}
static int fake_owns(const void *q) {
    int yes = 0;
    pthread_mutex_lock(&fake_mem.mu);
    for (int i = 0; i < fake_mem.count; i++)
        if ((const char *)q >= (char *)fake_mem.p[i] && (const char *)q < (char *)fake_mem.p[i] + fake_mem.n[i]) yes = 1;
    pthread_mutex_unlock(&fake_mem.mu);
    return yes;
}
static void fake_release(void *p) { (void)p; }                     /* kept, so that owns() stays true */
static void fake_zero(void *p, size_t n) { memset(p, 0, n); }
static void fake_copy(void *d, const void *s_, size_t n) { memcpy(d, s_, n); }
static dt_backend fake_gpu;
/* Shared memory moving the bytes, but taking "device" memory only, as NCCL does. */
static dt_comm_backend fake_nccl;
typedef struct { dt_comm_group *group; int rank; } agree_arg;
static void *agree_thread(void *arg) {
    agree_arg *a = (agree_arg *)arg;
    dt__ctx.gpu = &fake_gpu;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    c->backend = &fake_nccl;
    dt_comm_check_agree(c, "the test value", "same on every rank");
    float v[3] = { 1.0f + a->rank, 2, 3 };
    dt__comm_all_reduce_host(c, v, 3, DT_SUM);
    if (v[0] != 3.0f || v[2] != 6.0f) dt_fail("the staged all-reduce gave %g and %g", v[0], v[2]);
    float mine = (float)a->rank, all[2];
    dt__comm_all_gather_host(c, &mine, all, sizeof mine);
    if (all[0] != 0.0f || all[1] != 1.0f) dt_fail("the staged all-gather gave %g, %g", all[0], all[1]);
    dt_comm_free(c);
    return NULL;
}
static void fake_devices_on(void) {
    fake_gpu.alloc = fake_alloc; fake_gpu.release = fake_release; fake_gpu.zero = fake_zero;
    fake_gpu.upload = fake_copy; fake_gpu.download = fake_copy; fake_gpu.owns = fake_owns;
    fake_nccl = dt__comm_shm_backend;
    fake_nccl.name = "a GPU-only transport (test)";
    fake_nccl.memory = DT_CUDA;
}
/* `test_dtrain --selftest-wrong-memory`: hand host memory to the GPU-only transport. */
static int selftest_wrong_memory(void) {
    fake_devices_on();
    dt__ctx.gpu = &fake_gpu;
    dt_comm *c = dt_comm_join(dt_comm_group_create(1, 10), 0);
    c->backend = &fake_nccl;
    float v = 1;
    dt_all_reduce(c, &v, &v, 1, DT_F32, DT_SUM);          /* must stop here */
    return 0;
}
TEST(start_up_checks_hand_collectives_only_the_memory_they_take, QUICK) {
    fake_devices_on();
    fflush(stdout);
    pid_t pid = fork();                  /* a wrong buffer is a dt_fail: let it end a child, not the suite */
    if (pid == 0) {
        dt_comm_group *g = dt_comm_group_create(2, 10);
        pthread_t th[2];
        agree_arg args[2] = { { g, 0 }, { g, 1 } };
        for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, agree_thread, &args[r]);
        for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the agreement check or a staged collective handed host memory to a "
           "transport that takes device memory (see the error above), status %d", st);
    /* and the guard itself: host memory handed to it is refused, naming both kinds */
    char out[4096];
    int code = run_cmd(out, sizeof out, "%s --selftest-wrong-memory", self_bin);
    CHECKF(code == 1 && strstr(out, "is host memory") && strstr(out, "takes GPU memory only"),
           "host memory given to a GPU-only transport: exit %d\n%s", code, out);
}

/* tests/22-launching.c -- tests of dtrain.h's chapter 22-launching: --nproc,
   torchrun, mpirun, signals, strangers at the rendezvous, nothing left
   behind. (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- launching: --nproc, torchrun, mpirun, signals, strangers, nothing left behind ---- */

TEST(ranks_launch_from_torchrun_variables_and_check_their_flags, QUICK) {
    char out[16384];
    int port = free_port();
    const char *bin = collectives_bin();
    /* two processes started as torchrun starts them: nothing but environment variables */
    int st = run_cmd(out, sizeof out, "sh -c 'RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d %s --check & p=$!; "
                     "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d %s --check; a=$?; wait $p; exit $((a | $?))'",
                     port, bin, port, bin);
    CHECKF(st == 0 && count_lines_with(out, "match the serial reference") == 2, "env launch: exit %d\n%s", st, out);
    /* Open MPI's variables, with the local size an mpirun on one host sets: without it --comm auto asks MPI for
       the hosts, and Open MPI's singleton init, which starts a daemon, failed once under load in CI (2026-11-28) */
    port = free_port();
    st = run_cmd(out, sizeof out, "sh -c 'export OMPI_COMM_WORLD_LOCAL_SIZE=2; "
                 "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 MASTER_PORT=%d %s --agree b & p=$!; "
                 "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 MASTER_PORT=%d %s --agree a; a=$?; wait $p; b=$?; "
                 "[ $a -ne 0 ] && [ $b -ne 0 ]'", port, bin, port, bin);
    CHECKF(st == 0 && count_lines_with(out, "disagree on --agree: rank 0 has 'a', rank 1 has 'b'") == 2,
           "a flag mismatch must stop both ranks with a message:\n%s", out);
    st = run_cmd(out, sizeof out, "env SLURM_PROCID=1 SLURM_NTASKS=2 MASTER_PORT=%d %s --check --timeout 1", free_port(), bin);
    expect_error(out, st, 1, "rank 0 did not answer");
    st = run_cmd(out, sizeof out, "env RANK=3 WORLD_SIZE=2 %s --check", bin);
    expect_error(out, st, 1, "RANK=3 but WORLD_SIZE=2");
}

/* The /dev/shm segments a process made (their names carry its pid). */
static int shm_segments_of(long pid) {
    char prefix[64];
    int n = 0;
    snprintf(prefix, sizeof prefix, "dtrain-%d-%ld-", (int)getuid(), pid);
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    while (d && (e = readdir(d))) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d) closedir(d);
    return n;
}
/* The pids a shell script printed as "pid=N". */
static int pids_in(const char *out, long *pids, int max) {
    int n = 0;
    for (const char *p = out; n < max && (p = strstr(p, "pid=")); p += 4) pids[n++] = atol(p + 4);
    return n;
}

/* torchrun, as found: Debian 12's (PyTorch 1.13 on Python 3.11) fails to start
   anything unless its output is redirected (a PyTorch bug fixed in 2.0:
   Std.from_str misses values under Python 3.11), so there it gets
   --redirects 1 --tee 1. Empty when there is no torchrun. */
static const char *torchrun_cmd(char *why, size_t n) {
    static char cmd[700], reason[300];
    static int probed;
    char out[16384];
    if (!probed) {
        probed = 1;
        if (run_cmd(out, sizeof out, "sh -c 'command -v torchrun'") != 0)
            snprintf(reason, sizeof reason, "torchrun is not installed (Debian: python3-torch)");
        else if (run_cmd(out, sizeof out, "torchrun --standalone --nproc_per_node 1 --no_python true") == 0)
            snprintf(cmd, sizeof cmd, "torchrun");
        else if (strstr(out, "'NoneType' object has no attribute 'get'"))
            snprintf(cmd, sizeof cmd, "torchrun --redirects 1 --tee 1 --log_dir %s/torchrun-logs", tmpdir);
        else snprintf(reason, sizeof reason, "torchrun does not start a program here:\n%.200s", out);
    }
    snprintf(why, n, "%s", reason);
    return cmd;
}

/* The README's torchrun lines, in torchrun's three rendezvous modes: the
   default (static: torchrun's own store listens on MASTER_PORT), --standalone
   and a c10d endpoint. Each trains as --nproc 2 does, bit for bit. */
TEST(torchrun_launches_stages_in_every_rendezvous_mode, FULL) {
    char out[16384], why[300] = "", ref[600], dir[600], p[700], q[700];
    const char *tr = torchrun_cmd(why, sizeof why);
    if (!tr[0]) SKIP("%s", why);
    const char *stages[2] = { "03-ddp", "04-fsdp" };
    for (int s = 0; s < 2; s++) {
        const char *bin = stage_bin(stages[s]);
        snprintf(ref, sizeof ref, "%s/torchrun-ref-%d", tmpdir, s);
        int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 16 --nproc 2 --save-dir %s", bin, small_data(), ref);
        CHECKF(st == 0, "%s --nproc 2: exit %d\n%s", stages[s], st, out);
        snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2%s", ref, s ? "/shard1-of-2.safetensors" : "");
        for (int mode = 0; mode < (s ? 1 : 3); mode++) {
            char how[128];
            int port = free_port();
            if (mode == 0) snprintf(how, sizeof how, "--master_port %d", port);
            else if (mode == 1) snprintf(how, sizeof how, "--standalone");
            else snprintf(how, sizeof how, "--rdzv_backend c10d --rdzv_endpoint 127.0.0.1:%d", port);
            snprintf(dir, sizeof dir, "%s/torchrun-%d-%d", tmpdir, s, mode);
            st = run_cmd(out, sizeof out, "%s %s --nproc_per_node 2 --no_python %s --data %s " PAR_FLAGS " --batch-size 16 --save-dir %s",
                         tr, how, bin, small_data(), dir);
            CHECKF(st == 0, "torchrun %s %s: exit %d\n%s", how, stages[s], st, out);
            snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2%s", dir, s ? "/shard1-of-2.safetensors" : "");
            CHECKF(st != 0 || files_equal_tensors(p, q), "torchrun %s %s: weights differ from --nproc 2's", how, stages[s]);
        }
    }
}

/* What comes before mpirun in a test: Open MPI keeps what MPI_Init allocated
   until the process ends, which LeakSanitizer would report in the ASan build.
   tests/lsan-mpi.supp names Open MPI's libraries; for its frames to carry
   those names, its components stay loaded (an Open MPI setting, harmless in
   any build) and stacks are unwound in full (read by the sanitizers only). */
static const char *mpi_env(void) {
    static char env[1400];
    char root[600];
    if (!getcwd(root, sizeof root)) root[0] = 0;
    snprintf(env, sizeof env, "env OMPI_MCA_mca_base_component_disable_dlclose=1 LSAN_OPTIONS=suppressions=%s/tests/lsan-mpi.supp:"
             "fast_unwind_on_malloc=0 ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:fast_unwind_on_malloc=0", root);
    return env;
}

/* mpirun (Open MPI) starts the ranks; MASTER_PORT is the only thing to add. */
TEST(mpirun_launches_a_stage_like_nproc, QUICK) {
    char out[16384], ref[600], dir[600], p[700], q[700];
    if (run_cmd(out, sizeof out, "sh -c 'command -v mpirun'") != 0) SKIP("mpirun is not installed (Debian: openmpi-bin)");
    const char *bin = stage_bin("03-ddp");
    snprintf(ref, sizeof ref, "%s/mpirun-ref", tmpdir);
    snprintf(dir, sizeof dir, "%s/mpirun", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 16 --nproc 2 --save-dir %s", bin, small_data(), ref);
    CHECKF(st == 0, "--nproc 2: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s mpirun %s--oversubscribe -np 2 -x MASTER_PORT=%d %s --data %s " PAR_FLAGS " --batch-size 16 "
                 "--save-dir %s", mpi_env(), geteuid() == 0 ? "--allow-run-as-root " : "", free_port(), bin, small_data(), dir);
    CHECKF(st == 0, "mpirun: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2", ref);
    snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", dir);
    CHECKF(st != 0 || files_equal_tensors(p, q), "mpirun and --nproc 2 give different weights");
}

#ifdef DT_HAVE_MPI
/* Two checkpoints of a 2-rank job hold the same tensors: whole, or in FSDP's
   two shards. */
static int same_two_rank_weights(const char *a, const char *b) {
    char sa[900], sb[900];
    if (access(a, F_OK) != 0 || access(b, F_OK) != 0) return 0;
    snprintf(sa, sizeof sa, "%s/shards.safetensors", a);
    if (access(sa, F_OK) != 0) return files_equal_tensors(a, b);
    int same = 1;
    for (int r = 0; same && r < 2; r++) {
        snprintf(sa, sizeof sa, "%s/shard%d-of-2.safetensors", a, r);
        snprintf(sb, sizeof sb, "%s/shard%d-of-2.safetensors", b, r);
        same = access(sb, F_OK) == 0 && file_equal_tensors(sa, sb);
    }
    return same;
}
#endif

/* --comm mpi: the collectives and the stages over MPI, with Open MPI kept to
   TCP (--mca btl tcp,self), as between two machines. tools/collectives --check
   at 2 ranks is bit for bit (a + b is a + b in any order); on a 2 x 2 mesh of
   4 ranks too within each pair, while the 4-rank sums are within MPI's
   roundings: it adds in an order of its own. Stages 03, 04 (full, and
   --shard grads), 05 (bf16, 2 micro-batches; fp16 with fp16 gradients, which
   MPI sums in f32 as shared memory does), 06 (--tp 2), 07 (--pp 2) and 09
   (--ep 2, its all-to-alls) save, after two epochs over MPI, the weights
   of the same run over shared memory, bit for bit. A rank killed mid-job ends
   it through mpirun, named, well within --timeout. Misuse is refused: --comm
   mpi with --nproc, --comm nccl on the CPU, --comm mpi in a build without MPI. */
TEST(collectives_and_stages_over_mpi_equal_shared_memory, FULL) {
    char out[16384];
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --comm mpi --nproc 2", stage_bin("03-ddp"), small_data());
    CHECKF(st == 2 && strstr(out, "--comm mpi --nproc 2: MPI's ranks are started by mpirun"), "--comm mpi --nproc 2: exit %d\n%s",
           st, out);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --comm nccl --device cpu --epochs 1 --steps 1", stage_bin("04-fsdp"),
                 small_data());
    CHECKF(st == 1 && strstr(out, "--comm nccl carries GPU memory, and this run trains on the CPU"), "--comm nccl on the CPU: exit %d\n%s",
           st, out);
#ifndef DT_HAVE_MPI
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --comm mpi", stage_bin("03-ddp"), small_data());
    CHECKF(st == 2 && strstr(out, "this build has no MPI"), "--comm mpi without MPI: exit %d\n%s", st, out);
    SKIP(NO_MPI_BUILD);
#else
    char mpirun[1800], ref[600], dir[600], p[700], q[700];
    if (run_cmd(out, sizeof out, "sh -c 'command -v mpirun'") != 0) SKIP("mpirun is not installed (Debian: openmpi-bin)");
    snprintf(mpirun, sizeof mpirun, "%s mpirun %s--oversubscribe --mca btl tcp,self -np", mpi_env(),
             geteuid() == 0 ? "--allow-run-as-root " : "");
    st = run_cmd(out, sizeof out, "%s 2 %s --comm mpi --check --timeout 60", mpirun, collectives_bin());
    CHECKF(st == 0 && count_lines_with(out, "match the serial reference bit for bit") == 2, "2 ranks over MPI: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s 4 %s --comm mpi --check --mesh 2x2 --timeout 60", mpirun, collectives_bin());
    CHECKF(st == 0 && count_lines_with(out, "match the serial reference bit for bit") == 8, "a 2 x 2 mesh over MPI: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s 4 %s --comm mpi --check --timeout 60", mpirun, collectives_bin());
    CHECKF(st == 0 && count_lines_with(out, "sums within MPI's rounding, the rest bit for bit") == 4, "4 ranks over MPI: exit %d\n%s",
           st, out);
    static const char *runs[][2] = { { "03-ddp", "" }, { "04-fsdp", "--shard full" }, { "04-fsdp", "--shard grads" },
                                     { "05-accum-mixed-precision", "--dtype bf16 --accum-steps 2" },
                                     { "05-accum-mixed-precision", "--dtype fp16 --reduce-dtype fp16" }, { "06-tensor-parallel", "--tp 2" },
                                     { "07-pipeline-parallel", "--pp 2 --micro-batches 2" } };
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        snprintf(ref, sizeof ref, "%s/mpi-ref%zu", tmpdir, k);
        snprintf(dir, sizeof dir, "%s/mpi%zu", tmpdir, k);
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 16 %s --nproc 2 --save-dir %s", stage_bin(runs[k][0]),
                     small_data(), runs[k][1], ref);
        CHECKF(st == 0, "%s %s --nproc 2: exit %d\n%s", runs[k][0], runs[k][1], st, out);
        st = run_cmd(out, sizeof out, "%s 2 %s --comm mpi --data %s " PAR_FLAGS " --batch-size 16 %s --save-dir %s", mpirun,
                     stage_bin(runs[k][0]), small_data(), runs[k][1], dir);
        CHECKF(st == 0, "%s %s over MPI: exit %d\n%s", runs[k][0], runs[k][1], st, out);
        snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2", ref);
        snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", dir);
        CHECKF(st == 0 && same_two_rank_weights(p, q), "%s %s: MPI and shared memory give different weights", runs[k][0], runs[k][1]);
    }
    /* 09: the experts' rows by MPI_Ialltoallv, uneven pieces (and empty ones, with the capacity) */
    const char *moe = "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 4 --moe-top-k 2 --moe-capacity 0.5";
    snprintf(ref, sizeof ref, "%s/mpi-ref-ep", tmpdir);
    snprintf(dir, sizeof dir, "%s/mpi-ep", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 16 %s --nproc 2 --save-dir %s", stage_bin("09-expert-parallel"),
                 gpt_text(), moe, ref);
    CHECKF(st == 0, "09 --nproc 2: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s 2 %s --comm mpi --data %s " PAR_FLAGS " --batch-size 16 %s --save-dir %s", mpirun,
                 stage_bin("09-expert-parallel"), gpt_text(), moe, dir);
    CHECKF(st == 0, "09 over MPI: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/gpt_data0-320_epoch2", ref);
    snprintf(q, sizeof q, "%s/gpt_data0-320_epoch2", dir);
    CHECKF(st == 0 && same_two_rank_weights(p, q), "09 --ep 2: MPI and shared memory give different weights");
    /* a rank killed in its first all-reduce: mpirun ends the job, naming it, long before --timeout */
    double t0 = dt_now_ms();
    st = run_cmd(out, sizeof out, "%s 2 -x DT_TEST_DIE_RANK=1 %s --comm mpi --data %s " PAR_FLAGS " --batch-size 16 --timeout 60", mpirun,
                 stage_bin("03-ddp"), small_data());
    CHECKF(st != 0 && strstr(out, "rank 1") && strstr(out, "signal 9") && dt_now_ms() - t0 < 30e3, "a killed rank over MPI: exit %d after %.0f s\n%s", st,
           (dt_now_ms() - t0) / 1e3, out);
#endif
}

#ifdef DT_HAVE_MPI             /* the two-host helpers: only the tests that use MPI need them */
/* Two hosts, as far as the network and the ranks can tell: two network
   namespaces joined by a veth pair (10.77.x.1 and .2), mpirun in the first,
   its agent (in place of ssh) starting the ranks of the second in the other,
   under another host name and with a /dev/shm of its own. Fills `mpirun`
   with the command that starts `per_host` ranks on each (the program and its
   flags follow) and returns NULL, or why the two hosts cannot be made here
   (it needs root for ip netns, mpirun and unshare). two_hosts_down undoes it. */
static const char *two_hosts_up(char ns[2][32], char *mpirun, size_t n, int per_host) {
    static char why[512];
    char out[4096], setup[2048], agent[600];
    if (run_cmd(out, sizeof out, "sh -c 'command -v mpirun && command -v ip && command -v unshare'") != 0)
        return "mpirun, ip or unshare is not installed (Debian: openmpi-bin, iproute2, util-linux)";
    /* mpirun hands its agent "HOST COMMAND...", as it would ssh */
    snprintf(agent, sizeof agent, "%s/netns-agent.sh", tmpdir);
    FILE *f = fopen(agent, "w");
    if (!f) return "cannot write the agent script into the test's folder";
    snprintf(ns[0], sizeof ns[0], "dtrain-%d-a", (int)getpid());
    snprintf(ns[1], sizeof ns[1], "dtrain-%d-b", (int)getpid());
    fprintf(f, "#!/bin/sh\nshift\nexec ip netns exec %s unshare --uts --mount sh -c \"mount -t tmpfs tmpfs /dev/shm && "
               "hostname dtrain-host-b && exec $*\"\n", ns[1]);
    fclose(f);
    chmod(agent, 0755);
    if (run_cmd(out, sizeof out, "unshare --uts --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && hostname x'") != 0) {
        snprintf(why, sizeof why, "unshare --uts --mount is not allowed here (root only, for the second host's name and "
                 "/dev/shm): %.80s", out);
        return why;
    }
    /* the pair is made inside the namespaces: nothing of it is ever in this one */
    snprintf(setup, sizeof setup, "sh -c 'set -e; ip netns add %s; ip netns add %s; "
             "ip link add dtva netns %s type veth peer name dtvb netns %s; "
             "ip -n %s addr add 10.77.0.1/24 dev dtva; ip -n %s link set dtva up; ip -n %s link set lo up; "
             "ip -n %s addr add 10.77.0.2/24 dev dtvb; ip -n %s link set dtvb up; ip -n %s link set lo up; "
             "ip netns exec %s true'", ns[0], ns[1], ns[0], ns[1], ns[0], ns[0], ns[0], ns[1], ns[1], ns[1], ns[1]);
    if (run_cmd(out, sizeof out, "%s", setup) != 0) {
        run_cmd(out + strlen(out), sizeof out - strlen(out), "sh -c 'ip netns del %s; ip netns del %s'", ns[0], ns[1]);
        snprintf(why, sizeof why, "network namespaces cannot be made here (ip netns needs root): %.120s", out);
        return why;
    }
    snprintf(mpirun, n, "%s ip netns exec %s mpirun %s--mca btl tcp,self --mca plm_rsh_agent %s "
             "--mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 --host 10.77.0.1:%d,10.77.0.2:%d "
             "-np %d -x MASTER_ADDR=10.77.0.1 -x MASTER_PORT=%d", mpi_env(), ns[0], geteuid() == 0 ? "--allow-run-as-root " : "",
             agent, per_host, per_host, 2 * per_host, free_port());
    return NULL;
}
static void two_hosts_down(char ns[2][32]) {
    char out[1024];
    run_cmd(out, sizeof out, "sh -c 'ip netns del %s; ip netns del %s'", ns[0], ns[1]);
}
/* The bytes that have crossed between the two hosts so far: both ways through the first's end of the pair. */
static double two_hosts_bytes(char ns[2][32]) {
    char out[4096];
    long long tx = -1, rx = -1;
    if (run_cmd(out, sizeof out, "ip netns exec %s cat /proc/net/dev", ns[0]) != 0) return -1;
    const char *p = strstr(out, "dtva:");
    if (!p || sscanf(p + 5, "%lld %*d %*d %*d %*d %*d %*d %*d %lld", &rx, &tx) != 2) return -1;
    return (double)rx + (double)tx;
}
#endif

/* Stage 03 with --comm auto (which must see two hosts and take MPI: shared
   memory would be refused at the rendezvous) and stage 04 with --comm mpi,
   on two hosts (two_hosts_up), save the weights of the same job run on one
   host with --nproc 2; --comm shm across them is refused, naming the hosts
   and the way out. Needs root (ip netns), mpirun and a build with MPI;
   skipped, saying which is missing, elsewhere. */
TEST(two_hosts_joined_by_mpi_train_like_one, FULL) {
#ifndef DT_HAVE_MPI
    SKIP(NO_MPI_BUILD);
#else
    char ns[2][32], mpirun[2400], ref[600], dir[600], p[700], q[700];
    const char *skip = two_hosts_up(ns, mpirun, sizeof mpirun, 1);
    if (skip) SKIP("%.300s", skip);
    static const char *runs[][3] = { { "03-ddp", "--comm auto", "" }, { "04-fsdp", "--comm mpi", "--shard full" } };
    int st_ref[2], st_mpi[2], same[2], st_shm;
    char why[2][4096], shm_out[8192];
    for (int k = 0; k < 2; k++) {
        snprintf(ref, sizeof ref, "%s/hosts-ref%d", tmpdir, k);
        snprintf(dir, sizeof dir, "%s/hosts%d", tmpdir, k);
        st_ref[k] = run_cmd(why[k], sizeof why[k], "%s --data %s " PAR_FLAGS " --batch-size 16 %s --nproc 2 --save-dir %s",
                            stage_bin(runs[k][0]), small_data(), runs[k][2], ref);
        st_mpi[k] = run_cmd(why[k], sizeof why[k], "%s %s %s %s --data %s " PAR_FLAGS " --batch-size 16 --save-dir %s", mpirun,
                            stage_bin(runs[k][0]), runs[k][1], runs[k][2], small_data(), dir);
        snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2", ref);
        snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", dir);
        same[k] = st_ref[k] == 0 && st_mpi[k] == 0 && same_two_rank_weights(p, q);
    }
    st_shm = run_cmd(shm_out, sizeof shm_out, "%s %s --comm shm --data %s " SMALL_FLAGS " --timeout 20", mpirun, stage_bin("03-ddp"),
                     small_data());
    two_hosts_down(ns);
    for (int k = 0; k < 2; k++)
        CHECKF(same[k], "%s %s on two hosts: exit %d (one host: %d), or other weights than on one host\n%s", runs[k][0], runs[k][1],
               st_mpi[k], st_ref[k], why[k]);
    CHECKF(st_shm != 0 && strstr(shm_out, "the ranks are not all on rank 0's host") && strstr(shm_out, "'dtrain-host-b'") &&
           strstr(shm_out, "join the hosts over MPI: --comm mpi (or auto)"),
           "--comm shm on two hosts must be refused, naming them and the way out: exit %d\n%s", st_shm, shm_out);
#endif
}

/* ZeRO++ between two hosts (two_hosts_up, 2 ranks on each; the machines are
   what MPI's ranks report, not a flag): the bytes that cross between them in
   a step of 04 --shard full -- measured on the wire, the pair's counters, as
   the difference between a run of 6 steps and one of 2, whose start-up and
   evaluation are the same -- are with all three levers at most a quarter of
   ZeRO-3's (measured: 1/12.8), the log counts them within 5%, and the cost
   model (--explain) predicts them within 10%. */
TEST(zeropp_across_two_hosts_sends_under_a_quarter_of_zero3s_bytes, FULL) {
#ifndef DT_HAVE_MPI
    SKIP(NO_MPI_BUILD);
#else
    char ns[2][32], mpirun[2400], log[600], out[2][16384];
    const char *skip = two_hosts_up(ns, mpirun, sizeof mpirun, 2);
    if (skip) SKIP("%.300s", skip);
    const char *levers[2] = { "", "--quantize-weights int8 --quantize-grads int4 --hierarchical" };
    double wire[2] = { 0, 0 }, counted[2] = { 0, 0 }, predicted[2] = { -1, -1 };
    int st[2][2];
    for (int k = 0; k < 2; k++)
        for (int longer = 0; longer < 2; longer++) {
            snprintf(log, sizeof log, "%s/zpp-%d-%d.jsonl", tmpdir, k, longer);
            double before = two_hosts_bytes(ns);
            st[k][longer] = run_cmd(out[k], sizeof out[k], "%s %s --comm mpi --data %s --model gpt --batch-size 2 --shard full --epochs 1 "
                                    "--steps %d --log-every 1000 --log %s %s %s", mpirun, stage_bin("04-fsdp"), gpt_text(),
                                    longer ? 6 : 2, log,
                                    longer ? "--explain" : "", levers[k]);
            double bytes = two_hosts_bytes(ns) - before;
            wire[k] += longer ? bytes / 4 : -bytes / 4;
            double series[8];
            int n = log_series(log, "bytes_across_machines", series, 8);
            if (longer && n > 0) counted[k] = series[n - 1];
            const char *m = longer ? strstr(out[k], "2 machines of 2 ranks") : NULL, *a = m ? strstr(m, "a step moves ") : NULL;
            if (a) predicted[k] = atof(a + strlen("a step moves ")) * 1e6;
        }
    two_hosts_down(ns);
    for (int k = 0; k < 2; k++)
        CHECKF(st[k][0] == 0 && st[k][1] == 0 && wire[k] > 0, "04 %s on two hosts: exit %d, %d; %.0f bytes a step\n%s", levers[k],
               st[k][0], st[k][1], wire[k], out[k]);
    printf("    bytes across the hosts a step: ZeRO-3 %.0f (counted %.0f, predicted %.0f), ZeRO++ %.0f (counted %.0f, predicted "
           "%.0f): %.4f of ZeRO-3's\n", wire[0], counted[0], predicted[0], wire[1], counted[1], predicted[1], wire[1] / wire[0]);
    CHECKF(wire[1] <= wire[0] / 4, "ZeRO++ sent %.0f bytes a step across, ZeRO-3 %.0f: more than a quarter", wire[1], wire[0]);
    CHECKF(fabs(counted[1] - wire[1]) <= 0.05 * wire[1], "the log counts %.0f bytes across a step, the wire %.0f", counted[1], wire[1]);
    CHECKF(fabs(predicted[1] - wire[1]) <= 0.10 * wire[1], "the cost model predicts %.0f bytes across a step, the wire %.0f\n%s",
           predicted[1], wire[1], out[1]);
#endif
}

/* A job of --nproc 2 is stopped through its launcher, as a user would: SIGTERM,
   SIGUSR1 and Ctrl-C reach the ranks, which save and stop (75, 75, 130); a
   SIGTERM sent to the launcher and to the ranks at once (SLURM signals every
   process of a job) is one request, not two; a launcher killed outright takes
   its ranks with it (they are sent SIGTERM, so they save too). No rank trains
   on, nothing is written after, nothing is left in /dev/shm. */
TEST(stopping_the_launcher_stops_its_ranks, QUICK) {
    static const struct { const char *sig, *to; int status; const char *says; } cases[6] = {
        { "TERM", "$p", 75, "stopped by SIGTERM" }, { "USR1", "$p", 75, "stopped by SIGUSR1" },
        { "INT", "$p", 130, "stopped by SIGINT" }, { "TERM", "$p $kids", 75, "stopped by SIGTERM" }, { "KILL", "$p", 137, NULL },
        { "INT", "${kids##*[!0-9]}", 130, "stopped by SIGINT" } };   /* one rank alone: the others stop on its signal */
    const char *bin = stage_bin("03-ddp");
    for (int k = 0; k < 6; k++) {
        char out[16384], dir[600], log[600], files[2][4096];
        snprintf(dir, sizeof dir, "%s/stop-%d", tmpdir, k);
        snprintf(log, sizeof log, "%s/stop-%d.jsonl", tmpdir, k);
        /* 20,000 steps, far longer than the test waits; the signal goes once steps are logged */
        int st = run_cmd(out, sizeof out, "sh -c '%s --data %s --image-size 16 --dim 32 --quiet --epochs 2000 --batch-size 16 "
                         "--nproc 2 --save-dir %s --log %s & p=$!; i=0; while [ $i -lt 600 ] && ! grep -q step %s 2>/dev/null; "
                         "do sleep 0.05; i=$((i+1)); done; kids=$(pgrep -P $p); for k in $kids; do echo pid=$k; done; "
                         "kill -%s %s; wait $p; echo launcher-exit=$?'", bin, small_data(), dir, log, log, cases[k].sig, cases[k].to);
        long pids[8];
        int n = pids_in(out, pids, 8);
        CHECKF(st == 0 && n == 2, "expected two ranks under the launcher:\n%s", out);
        char want[64];
        snprintf(want, sizeof want, "launcher-exit=%d", cases[k].status);
        CHECKF(strstr(out, want), "SIG%s to %s: expected %s:\n%s", cases[k].sig, cases[k].to, want, out);
        if (cases[k].says) CHECKF(strstr(out, cases[k].says), "SIG%s to %s: no '%s' line:\n%s", cases[k].sig, cases[k].to, cases[k].says, out);
        CHECKF(!strstr(out, "stopping at once"), "SIG%s to %s was taken as a second signal:\n%s", cases[k].sig, cases[k].to, out);
        int alive = 1;
        for (int t = 0; t < 200 && alive; t++) {       /* a killed launcher: its ranks save and go within seconds */
            alive = 0;
            for (int i = 0; i < n; i++) alive |= kill((pid_t)pids[i], 0) == 0;
            if (alive) { struct timespec ts = { 0, 50000000 }; nanosleep(&ts, NULL); }
        }
        CHECKF(!alive, "SIG%s to %s: the ranks are still running 10 s later", cases[k].sig, cases[k].to);
        /* nothing more is written once the ranks are gone; the log says why they stopped */
        for (int t = 0; t < 2; t++) {
            run_cmd(files[t], sizeof files[t], "sh -c 'ls %s; grep -o stopped_by...SIG[A-Z0-9]* %s'", dir, log);
            if (!t) { struct timespec ts = { 0, 500000000 }; nanosleep(&ts, NULL); }
        }
        CHECKF(!strcmp(files[0], files[1]), "files appeared after the job stopped:\n%s\nthen\n%s", files[0], files[1]);
        CHECKF(strstr(files[1], "_step") || strstr(files[1], "_epoch"), "no checkpoint saved on SIG%s:\n%s", cases[k].sig, files[1]);
        CHECKF(strstr(files[1], k == 1 ? "stopped_by\":\"SIGUSR1" : k == 2 || k == 5 ? "stopped_by\":\"SIGINT" : "stopped_by\":\"SIGTERM"),
               "SIG%s to %s: the log's summary does not say what stopped the run:\n%s", cases[k].sig, cases[k].to, files[1]);
        CHECKF(!strstr(files[1], ".tmp"), "a .tmp file was left: %s", files[1]);
        for (int i = 0; i < n; i++) CHECKF(shm_segments_of(pids[i]) == 0, "rank pid %ld left a /dev/shm segment", pids[i]);
    }
}

/* Waits (in a shell script) until something listens on TCP port $P, without connecting to it. */
#define WAIT_LISTEN "i=0; until grep -qi \":$(printf %%04X $P) 00000000:0000 0A\" /proc/net/tcp || [ $i -ge 200 ]; do sleep 0.05; i=$((i+1)); done; "

/* Two jobs on one port: a stray connection (a port scan, a browser) and a rank
   of another job reach job A's rank 0 while it waits. Both are turned away and
   logged; the stranger is told why and stops; job A goes on and completes --
   its rank 1 reaching rank 0 by another of the host's addresses than 127.0.0.1,
   as a host name does. */
TEST(a_stranger_at_the_rendezvous_is_turned_away_not_fatal, QUICK) {
    char out[16384];
    int port = free_port();
    const char *bin = collectives_bin();
    int st = run_cmd(out, sizeof out, "bash -c 'P=%d; export MASTER_PORT=$P WORLD_SIZE=2; SLURM_JOB_ID=111 RANK=0 %s --check --timeout 30 & a=$!; "
                     WAIT_LISTEN "exec 3<>/dev/tcp/127.0.0.1/$P && echo junk >&3; exec 3>&-; exec 3<>/dev/tcp/127.0.0.1/$P; exec 3>&-; "
                     "SLURM_JOB_ID=222 RANK=1 %s --check --timeout 10; echo stranger-exit=$?; "
                     "SLURM_JOB_ID=111 RANK=1 MASTER_ADDR=127.0.1.1 %s --check; echo member-exit=$?; wait $a; echo rank0-exit=$?'",
                     port, bin, bin, bin);
    CHECKF(st == 0 && strstr(out, "rank0-exit=0") && strstr(out, "member-exit=0"), "job A did not complete:\n%s", out);
    CHECKF(count_lines_with(out, "match the serial reference") == 2, "job A's collectives:\n%s", out);
    CHECKF(strstr(out, "stranger-exit=1") && strstr(out, "turned this rank away: it belongs to another job ('SLURM_JOB_ID=222'"),
           "the other job's rank must be told why and stop:\n%s", out);
    CHECKF(count_lines_with(out, "did not say hello as a dtrain rank") == 2, "the stray connections must be logged:\n%s", out);
}

/* `test_dtrain --selftest-nproc-port`: --nproc's launcher listens on the
   job's port before it forks, and rank 0 takes that socket over. A program
   binding the port while rank 0 is still starting -- here rank 1, on
   purpose, while rank 0 is held back -- is refused, and the job runs. When
   the launcher picked a port, let it go and rank 0 bound it again later,
   this was rank 0's "cannot listen on port N (MASTER_PORT): Address already
   in use" (CI, at -O3). */
static int selftest_nproc_port(void) {
    dt_launch(2, 10);                          /* the launcher exits here with the worst rank's status */
    int rank = atoi(getenv("RANK")), port = atoi(getenv("MASTER_PORT")), thief = -1;
    if (rank == 1) {
        thief = dt__tcp_listen(port);
        if (thief >= 0) fprintf(stderr, "rank 1 took the job's port %d before rank 0 listened\n", port);
    } else {
        struct timespec ts = { 0, 300000000 };
        nanosleep(&ts, NULL);
    }
    dt_comm *c = dt_comm_init(DT_COMM_SHM, 10);
    float v = (float)(rank + 1);
    dt_all_reduce(c, &v, &v, 1, DT_F32, DT_SUM);
    dt_comm_free(c);
    if (thief >= 0) close(thief);
    return v == 3.0f ? 0 : 4;
}
TEST(nproc_holds_its_port_from_the_start, QUICK) {
    char out[8192];
    int st = run_cmd(out, sizeof out, "%s --selftest-nproc-port", self_bin);
    CHECKF(st == 0, "a job whose port another program tried to take while rank 0 started: exit %d\n%s", st, out);
}

/* `test_dtrain --selftest-nproc-loopback`: under --nproc every rank is on
   this machine, so rank 0 listens on the loopback alone (it listened on every
   interface: anyone on the network could knock). Rank 1 tries the job's port
   on each of this machine's other IPv4 addresses: refused on each. Exit 3
   with no other address to try. */
static int selftest_nproc_loopback(void) {
    dt_launch(2, 10);
    int rank = atoi(getenv("RANK")), port = atoi(getenv("MASTER_PORT")), tried = 0, reached = 0;
    if (rank == 1) {
        struct ifaddrs *ifs = NULL;
        if (getifaddrs(&ifs) == 0)
            for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
                if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
                struct sockaddr_in a = *(struct sockaddr_in *)i->ifa_addr;
                if ((ntohl(a.sin_addr.s_addr) >> 24) == 127) continue;
                a.sin_port = htons((uint16_t)port);
                int fd = socket(AF_INET, SOCK_STREAM, 0);
                tried++;
                if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
                    fprintf(stderr, "rank 0 answered on %s:%d\n", inet_ntoa(a.sin_addr), port);
                    reached++;
                }
                if (fd >= 0) close(fd);
            }
        if (ifs) freeifaddrs(ifs);
    }
    dt_comm *c = dt_comm_init(DT_COMM_SHM, 10);
    float v[2] = { (float)tried, (float)reached };
    dt_all_reduce(c, v, v, 2, DT_F32, DT_SUM);
    dt_comm_free(c);
    return v[1] > 0 ? 4 : v[0] == 0 ? 3 : 0;
}
TEST(nproc_listens_on_the_loopback_alone, QUICK) {
    char out[8192];
    int st = run_cmd(out, sizeof out, "%s --selftest-nproc-loopback", self_bin);
    if (st == 3) SKIP("this machine has no IPv4 address but the loopback's to try");
    CHECKF(st == 0, "--nproc's rank 0 answered on an address of the network: exit %d\n%s", st, out);
}

/* The proofs are SipHash-2-4: its authors' test vectors (key 00 01 .. 0f,
   messages 00 01 .. of lengths 0, 1, 2, 3 and 15). */
TEST(the_rendezvous_proofs_are_siphash_2_4, QUICK) {
    const uint64_t key[2] = { 0x0706050403020100ull, 0x0f0e0d0c0b0a0908ull };
    unsigned char m[16];
    for (int i = 0; i < 16; i++) m[i] = (unsigned char)i;
    static const struct { size_t n; uint64_t want; } v[] = {
        { 0, 0x726fdb47dd0e0e31ull }, { 1, 0x74f839c593dc67fdull }, { 2, 0x0d6c8009d9a94f5aull },
        { 3, 0x85676696d7fb7e2dull }, { 15, 0xa129ca6149be45e5ull },
    };
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
        CHECKF(dt__siphash(key, m, v[k].n) == v[k].want, "%zu bytes: %016llx, the vector %016llx", v[k].n,
               (unsigned long long)dt__siphash(key, m, v[k].n), (unsigned long long)v[k].want);
}

/* The job's secret (DT_JOB_SECRET): every rank proves it knows it, and so
   does rank 0, and no message carries it. A stranger who knows the job's id
   (a refusal once sent it back) but not the secret is turned away; so is a
   rank with the wrong secret, and one with none; a refusal names what the
   stranger sent, never this job's id or secret. Seventy idle connections at
   rank 0 do not keep the job's ranks out (rank 0 heard one connection at a
   time, 5 s each: four failed a --timeout 15 job; it keeps 64 waiting, and
   lets the one that waited longest go for a newcomer). */
TEST(a_stranger_without_the_jobs_secret_is_turned_away_and_idlers_starve_nothing, QUICK) {
    char out[16384];
    int port = free_port();
    const char *bin = collectives_bin(), *secret = "s3cret-of-job-A";
    int st = run_cmd(out, sizeof out, "bash -c 'P=%d; export MASTER_PORT=$P WORLD_SIZE=2 SLURM_JOB_ID=111; "
                     "DT_JOB_SECRET=%s RANK=0 %s --check --timeout 15 & a=$!; " WAIT_LISTEN
                     "for i in $(seq 70); do exec {fd}<>/dev/tcp/127.0.0.1/$P; done; "
                     "DT_JOB_SECRET=guess RANK=1 %s --check --timeout 5; echo wrong-exit=$?; "
                     "RANK=1 %s --check --timeout 5; echo none-exit=$?; "
                     "SLURM_JOB_ID=999 DT_JOB_SECRET=%s RANK=1 %s --check --timeout 5; echo other-exit=$?; "
                     "DT_JOB_SECRET=%s RANK=1 %s --check --timeout 15; echo member-exit=$?; wait $a; echo rank0-exit=$?'",
                     port, secret, bin, bin, bin, secret, bin, secret, bin);
    CHECKF(st == 0 && strstr(out, "rank0-exit=0") && strstr(out, "member-exit=0"), "the job did not complete:\n%s", out);
    CHECKF(count_lines_with(out, "match the serial reference") == 2, "the job's collectives:\n%s", out);
    CHECKF(strstr(out, "wrong-exit=1") && strstr(out, "does not prove that it knows this job's secret"),
           "a rank with the wrong secret must be turned away, told why:\n%s", out);
    CHECKF(strstr(out, "none-exit=1") && strstr(out, "has a job secret (DT_JOB_SECRET), and this rank has none"),
           "a rank without the secret must stop, told why:\n%s", out);
    CHECKF(strstr(out, "other-exit=1") && strstr(out, "it belongs to another job ('SLURM_JOB_ID=999')"),
           "another job's rank must be turned away:\n%s", out);
    CHECKF(!strstr(out, secret) && !strstr(out, "SLURM_JOB_ID=111'") && !strstr(out, "this job is"),
           "a message gave away the job's secret or id:\n%s", out);
}

/* A fake rank 0 (this test, on a port of its own) welcomes a rank with the
   name of a segment that is not the job's: another user's of mode 0666, one
   of its own user's that others may write, one of the wrong size, a name of
   64 bytes without an end, one that is not dtrain's -- and, to a rank with a
   secret, a welcome it cannot prove. The rank maps none of them and says why
   (it once wrote its gradients into another user's segment). */
static void fake_rank0(int lfd, const char *shm_name, size_t name_len, int secret) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) _exit(1);
    dt__challenge ch;
    dt__hello h;
    dt__welcome w;
    memset(&ch, 0, sizeof ch);
    memcpy(ch.magic, DT_RDZV_MAGIC, 8);
    ch.secret = secret;                                      /* it says it has one, and cannot prove it */
    if (write(fd, &ch, sizeof ch) != (ssize_t)sizeof ch) _exit(1);
    size_t got = 0;
    while (got < sizeof h) { ssize_t k = read(fd, (char *)&h + got, sizeof h - got); if (k <= 0) _exit(1); got += (size_t)k; }
    memset(&w, 0, sizeof w);
    memcpy(w.magic, DT_RDZV_MAGIC, 8);
    memcpy(w.shm_name, shm_name, name_len);
    w.proof = 0x1234;
    if (write(fd, &w, sizeof w) != (ssize_t)sizeof w) _exit(1);
    char sink[64];
    while (read(fd, sink, sizeof sink) > 0) {}
    _exit(0);
}
TEST(a_fake_rank_0_cannot_hand_a_rank_someone_elses_segment, QUICK) {
    char out[16384], name[64], bad[80];
    size_t bytes = dt__shm_bytes(2);
    static const struct { int owner_other, mode; const char *says; } cases[] = {
        { 1, 0666, "is not this job's: owner 65534" }, { 0, 0666, "mode 666" }, { 0, 0600, NULL },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0] + 3; c++) {
        size_t len;
        const char *says;
        int made = -1, secret = c == 5;
        if (c < 3) {
            snprintf(name, sizeof name, "/dtrain-%d-%d-%d", (int)getuid(), (int)getpid(), 90 + (int)c);
            len = strlen(name) + 1;
            made = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
            CHECK(made >= 0 && ftruncate(made, (off_t)(c == 2 ? bytes / 2 : bytes)) == 0 && fchmod(made, (mode_t)cases[c].mode) == 0);
            if (cases[c].owner_other && fchown(made, 65534, 65534) != 0) {
                printf("    (not root: another user's segment was not tried)\n");
                shm_unlink(name);
                close(made);
                continue;
            }
            says = cases[c].says ? cases[c].says : "bytes (this rank's user";     /* the wrong size */
        } else if (c == 3) {
            memset(bad, 'x', sizeof bad);
            memcpy(bad, "/dtrain-0-1-", 12);
            len = 64;
            says = "a shared-memory name without an end";
        } else if (c == 4) {
            snprintf(bad, sizeof bad, "/not-dtrain");
            len = strlen(bad) + 1;
            says = "not one dtrain makes for this user";
        } else {                                             /* a rank 0 that cannot prove the job's secret */
            snprintf(bad, sizeof bad, "/dtrain-%d-%d-1", (int)getuid(), (int)getpid());
            len = strlen(bad) + 1;
            says = "does not prove that it knows this job's secret";
        }
        int lfd = dt__tcp_listen_on(0, 1), port = dt__tcp_port_of(lfd);
        fflush(NULL);
        pid_t fake = fork();
        if (fake == 0) fake_rank0(lfd, c < 3 ? name : bad, len, secret);
        close(lfd);
        int st = run_cmd(out, sizeof out, "env %s MASTER_PORT=%d WORLD_SIZE=2 RANK=1 %s --check --timeout 10",
                         secret ? "DT_JOB_SECRET=ours" : "", port, collectives_bin());
        kill(fake, SIGKILL);
        waitpid(fake, NULL, 0);
        expect_error_in(says, out, st, 1, says);
        if (made >= 0) { shm_unlink(name); close(made); }
    }
}

/* Two jobs started by hand on one port: the second's rank 0 is refused, naming
   the port and the process that holds it, and its rank 1 never reaches the
   first job (rank 0 let go of the port after its rendezvous, and the second
   job's ranks then trained with the first's, data mixed, exit 0). */
TEST(a_second_job_on_a_port_in_use_is_refused_naming_its_holder, QUICK) {
    char out[32768], want[160], log[700];
    int port = free_port();
    const char *bin = stage_bin("03-ddp");
    snprintf(log, sizeof log, "%s/first.jsonl", tmpdir);
    /* the first job trains (its log has steps: both ranks have met) while the second one's ranks start, and goes
       on until it is stopped (SIGTERM: it saves nothing, and exits 75 as preempted) */
    int st = run_cmd(out, sizeof out, "bash -c 'P=%d; G=\"--data %s " SMALL_FLAGS " --epochs 100000 --batch-size 16\"; "
                     "export MASTER_PORT=$P WORLD_SIZE=2; RANK=0 %s $G --log %s & a=$!; echo first-rank0=$a; RANK=1 %s $G & b=$!; "
                     "i=0; while [ $i -lt 600 ] && ! grep -q step %s 2>/dev/null; do sleep 0.05; i=$((i+1)); done; "
                     "RANK=0 %s $G --timeout 5; echo second-rank0-exit=$?; RANK=1 %s $G --timeout 3; echo second-rank1-exit=$?; "
                     "kill -TERM $a $b; wait $a; echo first-rank0-exit=$?; wait $b; echo first-rank1-exit=$?'", port, small_data(),
                     bin, log, bin, log, bin, bin);
    long first = 0;
    const char *p = strstr(out, "first-rank0=");
    if (p) first = atol(p + 12);
    CHECKF(st == 0 && strstr(out, "first-rank0-exit=75") && strstr(out, "first-rank1-exit=75"),
           "the first job was not running on, untouched, until stopped:\n%s", out);
    snprintf(want, sizeof want, "cannot listen on port %d (MASTER_PORT): Address already in use: it is held by process %ld", port, first);
    CHECKF(strstr(out, "second-rank0-exit=1") && strstr(out, want), "the second job's rank 0 must be refused, naming %ld:\n%s",
           first, out);
    CHECKF(strstr(out, "second-rank1-exit=1") && strstr(out, "said nothing"), "the second job's rank 1 must stop:\n%s", out);
}

/* The ranks of one job given different data of one size (a.txt, b.txt):
   they compared sizes only, and trained as one job, each on its own text. */
TEST(ranks_given_different_data_of_one_size_are_refused, QUICK) {
    char out[16384], a[700], b[700];
    size_t n = 0;
    unsigned char *text = read_bytes(gpt_text(), &n);
    CHECK(text && n > 100);
    if (!text) return;
    snprintf(a, sizeof a, "%s/a.txt", tmpdir);
    snprintf(b, sizeof b, "%s/b.txt", tmpdir);
    write_bytes(a, text, n);
    text[n / 2] ^= 1;                                        /* one bit apart */
    write_bytes(b, text, n);
    free(text);
    int port = free_port();
    const char *bin = stage_bin("03-ddp");
    int st = run_cmd(out, sizeof out, "bash -c 'export MASTER_PORT=%d WORLD_SIZE=2; G=\"" GPT_FLAGS " --steps 3 --timeout 20\"; "
                     "RANK=0 %s $G --data %s & a=$!; RANK=1 %s $G --data %s; echo rank1-exit=$?; wait $a; echo rank0-exit=$?'",
                     port, bin, a, bin, b);
    CHECKF(strstr(out, "rank0-exit=1") && strstr(out, "rank1-exit=1") && strstr(out, "the ranks disagree on the training set's contents"),
           "two ranks, two texts: exit %d\n%s", st, out);
}

/* Segments in /dev/shm of this user made since `since` whose maker (the pid
   in the name) is gone: what a job left behind. Other jobs' live segments,
   and older leftovers, do not count. */
static int orphan_segments_since(time_t since, char *names, size_t n) {
    char prefix[64];
    int count = 0;
    names[0] = 0;
    snprintf(prefix, sizeof prefix, "dtrain-%d-", (int)getuid());
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        long pid = 0;
        char path[400];
        struct stat st;
        if (strncmp(e->d_name, prefix, strlen(prefix)) || sscanf(e->d_name + strlen(prefix), "%ld-", &pid) != 1) continue;
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        if (stat(path, &st) != 0 || st.st_ctime < since || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        count++;
        snprintf(names + strlen(names), n - strlen(names), " %s", e->d_name);
    }
    if (d) closedir(d);
    return count;
}
/* Rank 0 killed (SIGKILL) once it has made the job's segment, before the
   others have mapped it and it has removed the name: the segment once stayed
   in /dev/shm (6.3 MB, after the README promised nothing is left). The
   launcher removes what a rank it reaped had made, and a rank that mapped the
   segment removes it when the job fails before its name is gone. The job's
   status names the killed rank's signal, whichever rank is reaped first. */
TEST(a_rank_0_killed_with_the_segment_made_leaves_nothing_in_dev_shm, QUICK) {
    char out[16384], left[1024];
    time_t t0 = time(NULL) - 1;
    for (int k = 0; k < 3; k++) {
        int st = run_cmd(out, sizeof out, "env DT_TEST_DIE_MADE_SEGMENT=1 %s --data %s " SMALL_FLAGS " --epochs 1 --nproc 2 --timeout 10",
                         stage_bin("03-ddp"), small_data());
        CHECKF(st == 128 + SIGKILL, "try %d: the job exited %d, not %d (rank 0 killed by SIGKILL)\n%s", k + 1, st, 128 + SIGKILL, out);
        CHECKF(orphan_segments_since(t0, left, sizeof left) == 0, "try %d left in /dev/shm:%s", k + 1, left);
    }
}

/* A rendezvous that fails -- port taken, or Ctrl-C while rank 0 waits -- leaves
   no shared-memory segment (it is made only once every rank has joined). */
TEST(a_failed_rendezvous_leaves_nothing_in_dev_shm, QUICK) {
    char out[16384];
    int port = free_port();
    const char *bin = collectives_bin();
    int st = run_cmd(out, sizeof out, "bash -c 'P=%d; export MASTER_PORT=$P WORLD_SIZE=2 RANK=0; %s --check --timeout 20 & a=$!; echo pid=$a; "
                     WAIT_LISTEN "%s --check --timeout 5 & b=$!; echo pid=$b; wait $b; echo second-exit=$?; "
                     "kill -INT $a; wait $a; echo first-exit=$?'", port, bin, bin);
    long pids[2] = { 0, 0 };
    CHECKF(st == 0 && pids_in(out, pids, 2) == 2, "%s", out);
    CHECKF(strstr(out, "second-exit=1") && strstr(out, "cannot listen on port"), "the port was taken:\n%s", out);
    CHECKF(strstr(out, "first-exit=1") && strstr(out, "stopped by SIGINT (Ctrl-C) while waiting for the ranks to join"),
           "Ctrl-C on a waiting rank 0:\n%s", out);
    for (int i = 0; i < 2; i++) CHECKF(shm_segments_of(pids[i]) == 0, "pid %ld left a /dev/shm segment", pids[i]);
}

/* Ranks on two hosts: rank 1 runs as on another machine, under another host
   name and with a /dev/shm of its own (unshare --uts --mount, as root or in
   a user namespace of its own). Rank 0 sees at the rendezvous that rank 1
   does not share its memory and stops the job there, naming each host and
   its ranks (rank 1's as rank 0's machine -- one kernel -- but another
   /dev/shm, as a container would be); rank 1 is told why; no segment is
   left behind. A rank under another host name that shares the /dev/shm
   (containers on one machine) is not refused: the job runs. */
TEST(ranks_on_two_hosts_are_refused_at_the_rendezvous, QUICK) {
    char out[16384], rank1[900];
    /* the message, cut to fit the welcome, says so; ranks that share memory pass */
    static dt__host hosts[8];
    char why[1024];
    for (int r = 0; r < 8; r++) {
        memset(hosts[r].name, 'a' + r, DT_HOST_NAME - 1);
        snprintf(hosts[r].memory, sizeof hosts[r].memory, "boot%d/1/1", r);
    }
    CHECK(dt__rendezvous_one_host(hosts, 8, 0, why, sizeof why) == 0);
    CHECKF(strlen(why) == sizeof why - 1 && !strcmp(why + sizeof why - 5, " ..."), "a long refusal: %zu bytes, ending '%s'",
           strlen(why), why + (strlen(why) > 8 ? strlen(why) - 8 : 0));
    for (int r = 0; r < 8; r++) snprintf(hosts[r].memory, sizeof hosts[r].memory, "boot/1/1");
    CHECK(dt__rendezvous_one_host(hosts, 8, 0, why, sizeof why) == 1);
    const char *user_ns = "";                 /* root; anyone else, where user namespaces are allowed */
    if (run_cmd(out, sizeof out, "unshare --uts --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && hostname x'") != 0) {
        user_ns = "-r ";
        if (run_cmd(out, sizeof out, "unshare -r --uts --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && hostname x'") != 0)
            SKIP("unshare --uts --mount is not allowed here (it needs root or user namespaces): %.80s", out);
    }
    for (int own_shm = 1; own_shm >= 0; own_shm--) {
        int port = free_port();
        snprintf(rank1, sizeof rank1, "unshare %s--uts --mount sh -c \"%shostname dtrain-other-host && exec %s --check --timeout 20\"",
                 user_ns, own_shm ? "mount -t tmpfs tmpfs /dev/shm && " : "", collectives_bin());
        int st = run_cmd(out, sizeof out, "bash -c 'P=%d; export MASTER_PORT=$P WORLD_SIZE=2; RANK=0 %s --check --timeout 20 & a=$!; "
                         "echo pid=$a; " WAIT_LISTEN "RANK=1 %s; echo other-exit=$?; wait $a; echo rank0-exit=$?'", port,
                         collectives_bin(), rank1);
        long pid[1] = { 0 };
        CHECKF(st == 0 && pids_in(out, pid, 1) == 1, "%s", out);
        if (!own_shm) {
            CHECKF(strstr(out, "rank0-exit=0") && strstr(out, "other-exit=0") && count_lines_with(out, "match the serial reference") == 2,
                   "a rank under another host name that shares /dev/shm must be let in:\n%s", out);
            CHECKF(shm_segments_of(pid[0]) == 0, "rank 0 left a /dev/shm segment");
            continue;
        }
        CHECKF(strstr(out, "rank0-exit=1") && strstr(out, "other-exit=1"), "both ranks must stop:\n%s", out);
        CHECKF(count_lines_with(out, "the ranks are not all on rank 0's host") == 2 &&
               strstr(out, " 'dtrain-other-host', rank 0's machine but another /dev/shm (a container? give it the host's: docker --ipc=host) (rank 1)") &&
               strstr(out, "turned this rank away: the ranks are not all on rank 0's host") && strstr(out, "run every rank there"),
               "the refusal must name the hosts, on both ranks:\n%s", out);
#ifdef DT_HAVE_MPI
        const char *way_out = "or join the hosts over MPI: --comm mpi (or auto) under mpirun or srun --mpi=pmix; hosts:";
#else
        const char *way_out = "in a build with MPI (this one has none: install libopenmpi-dev and build again); hosts:";
#endif
        CHECKF(count_lines_with(out, way_out) == 2, "the refusal must say the way out, '%s', on both ranks:\n%s", way_out, out);
        CHECKF(shm_segments_of(pid[0]) == 0, "rank 0 left a /dev/shm segment");
    }
}

/* --device auto asks CUDA what it has; a CUDA context does not survive fork(),
   so the question must come in each rank, after dt_launch forks (the launcher
   refuses to fork once CUDA has been asked). CUDA_VISIBLE_DEVICES= hides any
   GPU, so every rank then trains on the CPU, on any machine. */
TEST(device_is_chosen_in_each_rank_after_the_fork, QUICK) {
#ifndef DT_HAVE_CUDA
    SKIP("this build has no CUDA: nothing to ask before the fork");
#else
    char out[16384];
    int st = run_cmd(out, sizeof out, "env CUDA_VISIBLE_DEVICES= %s --data %s " SMALL_FLAGS " --nproc 2 --steps 2 --epochs 1",
                     stage_on("03-ddp", "auto"), small_data());
    CHECKF(st == 0 && !strstr(out, "error"), "--device auto --nproc 2: exit %d\n%s", st, out);
#endif
}

/* A rank per GPU unless --ranks-per-gpu lets them share; the refusal names
   both counts and the way out. */
TEST(more_ranks_than_gpus_is_refused_naming_both_counts, QUICK) {
    char why[256] = "";
    CHECK(dt_gpu_for_rank(0, 1, 1, 1, why, sizeof why) == 0);
    CHECK(dt_gpu_for_rank(3, 4, 4, 1, why, sizeof why) == 3);
    CHECK(dt_gpu_for_rank(1, 2, 1, 2, why, sizeof why) == 0);          /* two ranks share GPU 0 */
    CHECK(dt_gpu_for_rank(3, 4, 2, 2, why, sizeof why) == 1);
    why[0] = 0;
    CHECK(dt_gpu_for_rank(0, 2, 1, 1, why, sizeof why) == -1);
    CHECKF(strstr(why, "2 ranks on this machine but 1 GPU visible") && strstr(why, "--ranks-per-gpu 2"), "%s", why);
    why[0] = 0;
    CHECK(dt_gpu_for_rank(4, 0, 2, 2, why, sizeof why) == -1);         /* count unknown: rank 4 alone is one too many */
    CHECKF(strstr(why, "5 ranks on this machine but 2 GPUs visible") && strstr(why, "--ranks-per-gpu 3"), "%s", why);
    CHECK(dt_gpu_for_rank(0, 1, 0, 1, why, sizeof why) == -1 && strstr(why, "no GPU"));
    setenv("LOCAL_WORLD_SIZE", "3", 1);
    CHECK(dt_local_ranks_from_env() == 3);
    unsetenv("LOCAL_WORLD_SIZE");
    setenv("SLURM_NTASKS_PER_NODE", "2(x3)", 1);
    CHECK(dt_local_ranks_from_env() == 2);
    unsetenv("SLURM_NTASKS_PER_NODE");
    CHECK(dt_local_ranks_from_env() == 0);
    char out[16384];
    int st;
    /* a job on GPUs that cannot run stops at start, whatever is missing here:
       CUDA in this build (exit 1), NCCL in this build (exit 2), a GPU (exit 1),
       or a GPU per rank (exit 1) */
    int gpus = 0;
#ifdef DT_HAVE_CUDA
    gpus = dt_cuda_device_count(why, sizeof why);
#endif
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --nproc %d --steps 1 --timeout 20", stage_on("03-ddp", "cuda"),
                 small_data(), gpus + 1);
#ifndef DT_HAVE_CUDA
    expect_error(out, st, 1, "this build has no CUDA");
    return;
#endif
    if (!dt_nccl_available(why, sizeof why)) expect_error(out, st, 2, "NCCL");
    else if (gpus == 0) expect_error(out, st, 1, "cannot use the GPU");
    else expect_error(out, st, 1, "GPU");
    CHECKF(gpus == 0 || strstr(out, "ranks on this machine but"), "%s", out);
}

/* Smaller things a user tried that went wrong: a DT_LAUNCHED_RANK left in
   the environment made --nproc 2 one process; "n_layer": -1 was reported as
   a config.json without num_hidden_layers; a PPM 2147483647 wide was
   reported as 2147483x647; GPT-2's layer_norm_epsilon was read past (1e-5
   used whatever it said); two runs started in one second shared a
   TensorBoard folder. */
TEST(a_stale_variable_a_negative_size_and_a_foreign_epsilon_are_not_misread, QUICK) {
    char out[16384], dir[700], path[800], log[700], tb[700];
    snprintf(log, sizeof log, "%s/two.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "env DT_LAUNCHED_RANK=0 DT_LAUNCHER_PID=1 %s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 "
                     "--nproc 2 --timeout 30 --log %s", stage_bin("03-ddp"), small_data(), log);
    CHECKF(st == 0 && log_lines_with_value(log, "world_size", 2) == 1, "--nproc 2 with a stale DT_LAUNCHED_RANK: exit %d, "
           "not two ranks\n%s", st, out);
    snprintf(dir, sizeof dir, "%s/hf", tmpdir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    static const struct { const char *config, *says; } cases[] = {
        { "{\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_embd\": 32, \"n_layer\": -1, \"n_head\": 2}",
          "\"n_layer\": -1 is not a valid value" },
        { "{\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_embd\": 32, \"n_layer\": 1, \"n_head\": 2, "
          "\"layer_norm_epsilon\": 1e-6}", "layer_norm_epsilon 1e-06" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        write_bytes(path, cases[c].config, strlen(cases[c].config));
        st = run_cmd(out, sizeof out, "%s --init %s --data %s --seq-len 16 --steps 1", train_cpu, dir, gpt_text());
        expect_error_in(cases[c].says, out, st, 2, cases[c].says);
    }
    snprintf(dir, sizeof dir, "%s/ppm", tmpdir);
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%s/c%d", dir, k ? "val" : "train", 0);
        CHECK(run_cmd(out, sizeof out, "mkdir -p %s", path) == 0);
        snprintf(path, sizeof path, "%s/%s/c0/wide.ppm", dir, k ? "val" : "train");
        write_bytes(path, "P6\n2147483647 2\n255\n", 20);
    }
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --steps 1", train_cpu, dir);
    expect_error(out, st, 1, "wide.ppm");
    CHECKF(strstr(out, "over 10^9 pixels a side") && !strstr(out, "2147483x647"), "the size is misread:\n%s", out);
    /* two runs started at once: two TensorBoard folders */
    snprintf(tb, sizeof tb, "%s/tb", tmpdir);
    st = run_cmd(out, sizeof out, "sh -c '%s --data %s " SMALL_FLAGS " --steps 2 --tensorboard %s & %s --data %s " SMALL_FLAGS
                 " --steps 2 --tensorboard %s & wait'", train_cpu, small_data(), tb, train_cpu, small_data(), tb);
    st = run_cmd(out, sizeof out, "ls %s", tb);
    CHECKF(st == 0 && count_lines_with(out, "\n") == 2, "two runs, not two TensorBoard folders:\n%s", out);
}

TEST(ddp_by_nproc_and_by_torchrun_variables_agree, QUICK) {
    char out[16384], a[600], b[600], p[700], q[700];
    snprintf(a, sizeof a, "%s/launch-nproc", tmpdir);
    snprintf(b, sizeof b, "%s/launch-env", tmpdir);
    const char *bin = stage_bin("03-ddp");
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 16 --nproc 2 --save-dir %s", bin, small_data(), a);
    CHECKF(st == 0, "--nproc 2: exit %d\n%s", st, out);
    int port = free_port();
    st = run_cmd(out, sizeof out, "sh -c 'export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d; "
                 "RANK=1 LOCAL_RANK=1 %s --data %s " PAR_FLAGS " --batch-size 16 --save-dir %s & p=$!; "
                 "RANK=0 LOCAL_RANK=0 %s --data %s " PAR_FLAGS " --batch-size 16 --save-dir %s; a=$?; wait $p; exit $((a | $?))'",
                 port, bin, small_data(), b, bin, small_data(), b);
    CHECKF(st == 0, "torchrun-style launch: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2", a);
    snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", b);
    CHECKF(files_equal_tensors(p, q), "--nproc 2 and a torchrun-style launch give different weights");
    /* a rank with another --lr: both stop, naming the flag */
    port = free_port();
    st = run_cmd(out, sizeof out, "sh -c 'export WORLD_SIZE=2 MASTER_PORT=%d; RANK=1 %s --data %s " PAR_FLAGS " --lr 0.1 & p=$!; "
                 "RANK=0 %s --data %s " PAR_FLAGS "; a=$?; wait $p; b=$?; [ $a -ne 0 ] && [ $b -ne 0 ]'",
                 port, bin, small_data(), bin, small_data());
    CHECKF(st == 0 && count_lines_with(out, "disagree on --batch-size --epochs --steps --lr") == 2,
           "ranks with different --lr must both stop with a message:\n%s", out);
}

/* On first use every rank needs the synthetic set; one writes it, the others wait. */
TEST(ddp_ranks_share_the_first_use_of_the_synthetic_set, QUICK) {
    char out[16384], dir[600], cwd[2048], bin[3000];
    snprintf(dir, sizeof dir, "%s/first-use", tmpdir);
    dt__mkdir(dir);
    const char *rel = stage_bin("03-ddp");
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    snprintf(bin, sizeof bin, "%s%s%s", rel[0] == '/' ? "" : cwd, rel[0] == '/' ? "" : "/", rel);
    int st = run_cmd(out, sizeof out, "sh -c 'cd %s && %s --nproc 3 --steps 1 --epochs 1 --log-every 1000'", dir, bin);
    CHECKF(st == 0 && count_lines_with(out, "first use: writing the synthetic data set") == 1,
           "exit %d; expected one rank to write the data set:\n%s", st, out);
}

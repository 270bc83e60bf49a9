//@ machinery: launching -- --nproc, torchrun/SLURM/Open MPI variables, the TCP rendezvous, signals
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

//@ implementation
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
    /* which ranks share a machine (its kernel and /dev/shm): numbered by their first rank */
    dt__host me, *all = (dt__host *)calloc((size_t)world, sizeof *all);
    if (!all) dt_fail("out of memory (--comm mpi)");
    dt__host_of_this_rank(&me);
    dt__mpi_check(MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE, MPI_COMM_WORLD),
                  "the look at each rank's machine");
    for (int r = 0, machines = 0; r < world; r++) {
        int q = 0;
        while (q < r && strcmp(all[q].memory, all[r].memory) != 0) q++;
        c->machine[r] = q < r ? c->machine[q] : machines++;
    }
    free(all);
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


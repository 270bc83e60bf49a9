//@ machinery: the run driver -- the loop every stage shares
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
    int has_best;              /* an evaluation so far: the lowest loss, its step, the evaluations since (--early-stop, --save-best) */
    double best_eval_loss;
    int64_t best_step;
    int evals_since_best;
    int early_stopped;         /* --early-stop ended the run */
    int eval_pending;          /* a signal stopped the run where an evaluation was due: the resumed run makes it first */
    int evals_run;             /* evaluations made by this process */
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
     bytes_moved  the bytes the last step's collectives moved, the whole
         job's, within machines and across them (--log, --trace, --bench).
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
    void (*bytes_moved)(const dt_parallel *par, double *within, double *across);
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

//@ implementation
/* ==== the run driver ========================================================
   The loop every stage shares around its lesson: start (--init, --resume),
   fetch batches, end each step (the job's mean loss, progress, the log),
   evaluate and save at each epoch's end, stop every rank alike on a signal,
   and finish with the summary. It calls every chapter above and none calls it. */

/* The wrappers' reports, each defined at its chapter's end (after this). */
extern const dt_parallel_report dt__fsdp_report, dt__tp_report, dt__pp_report, dt__cp_report, dt__ep_report;
const dt_parallel_report *dt_parallel_report_of(dt_parallel *par, dt_parallel **owner) {
    static const dt_parallel_report *const reports[] = { &dt__fsdp_report, &dt__tp_report, &dt__pp_report, &dt__cp_report,
                                                                  &dt__ep_report };
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
/* --mlflow: the run in the file store or on a tracking server (rank 0), its
   flags as params and what it is as tags; resumed from a checkpoint of an
   MLflow run, that run goes on (its metrics continue at the next step). */
static dt_mlflow *dt__mlflow_running;
static void dt__mlflow_failed(void) { dt_mlflow_close(dt__mlflow_running, DT_MLFLOW_FAILED); }
static void dt__mlflow_start(dt_run *r) {
    const dt_config *c = &r->cfg;
    char name[256], v[64];
    const char *kind = dt__model_kind_name(r->model->cfg.kind);
    snprintf(name, sizeof name, "%s %s", c->stage, kind);
    int server = dt_mlflow_is_server(c->mlflow);
    if (r->mlflow_run_id[0] && !(r->mlflow = dt_mlflow_open(c->mlflow, "dtrain", name, r->mlflow_run_id))) {
        if (errno != ENOENT) dt_fail("cannot %s --mlflow '%s' to continue run %s: %s", server ? "reach" : "write", c->mlflow,
                                     r->mlflow_run_id, dt_mlflow_error());
        dt_warn("--mlflow: the checkpoint's run %s is not in %s: this is a new run", r->mlflow_run_id, c->mlflow);
    }
    if (!r->mlflow && !(r->mlflow = dt_mlflow_open(c->mlflow, "dtrain", name, NULL)))
        dt_fail("cannot %s --mlflow '%s': %s", server ? "reach" : "write", c->mlflow, dt_mlflow_error());
    if (!c->quiet) printf("mlflow: run %s, %s\n", dt_mlflow_run_id(r->mlflow), dt_mlflow_path(r->mlflow));
    dt__copy_str(r->mlflow_run_id, sizeof r->mlflow_run_id, dt_mlflow_run_id(r->mlflow));   /* the checkpoints carry it */
    dt__mlflow_running = r->mlflow;
    __atomic_store_n(&dt__on_fail_tracking, dt__mlflow_failed, __ATOMIC_RELEASE);   /* a run that fails is marked so, not left RUNNING */
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
    dt_set_lazy_logits(DT_LAZY_LOGITS_BYTES);   /* a step's logits go to the loss alone, a block at a time */
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
    if ((cfg->early_stop || cfg->save_best) && !cfg->bench) {
        if (!run->val || run->val->n == 0)
            dt_usage_error("--early-stop and --save-best go by the evaluation loss, and this data has no validation set");
        if (cfg->save_best && !cfg->save_dir) dt_usage_error("--save-best keeps a checkpoint in --save-dir: give --save-dir");
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
    if (cfg->early_stop > 0 && run->has_best && run->evals_since_best >= cfg->early_stop && run->step < run->stop_step)
        run->stop = run->early_stopped = 1;            /* an early-stopped run resumed: it has ended */
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

static void dt__run_eval(dt_run *r, int scheduled);       /* below, with the evaluation's reports */
int dt_next_epoch(dt_run *run) {
    if (run->eval_pending) {            /* the evaluation a signal put off, before training goes on */
        run->eval_pending = 0;
        dt__run_eval(run, 1);
    }
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
                 (in.kind == DT_PAR_TP || in.kind == DT_PAR_PP || in.kind == DT_PAR_CP || in.kind == DT_PAR_EP);
    in.params = (double)dt__state_layout(r->model)->numel;
    in.contention = 1;                /* the compute above was measured as this run shares its device(s) */
    in.backward_share = in.compute_ms > 0 ? r->phase_ms[DT_PHASE_BWD] / c->accum_steps / in.compute_ms : 0.66;
    in.gather_bytes = (double)dt_dtype_size((dt_dtype)c->dtype);
    in.reduce_bytes = (double)dt_dtype_size((dt_dtype)c->reduce_dtype);
    in.messages = in.kind == DT_PAR_DDP ? dt_cost_ddp_buckets(in.params, c->bucket_mb) : r->model->nunits;
    static const char *across[] = { "infiniband", "ethernet", "pcie", "nvlink", "shm" };     /* --link-across's order */
    dt_link_preset(across[c->link_across >= 0 ? c->link_across : 0], &in.across);
    printf("--explain, measured on step %lld: compute %.1f ms, communication %.1f ms (%.1f hidden)\n",
           (long long)r->step, measured, dt__ctx.comm_ms, dt__ctx.comm_hidden_ms);
    if (alone) printf("(stage 01 trains alone: here is what DDP, stage 03, would do with it)\n");
    /* one rank alone: what two would do; a layout (--tp, --pp) as it is, a stage or a group of one included */
    dt_cost_explain(stdout, &in, &link, layout || n > 1 ? n : 2);
    printf("  predicted speedup at");
    for (int k = 2; k <= 8; k *= 2)
        printf(" %s%d%s: %.2fx%s", layout ? in.kind == DT_PAR_TP ? "--tp " : in.kind == DT_PAR_PP ? "--pp " : in.kind == DT_PAR_CP ? "--cp "
               : "--ep " : "", k,
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

/* A checkpoint of the run as it is, into `what` (epoch2, step40, best) in
   --save-dir. Sharded or cut, every rank takes part. A checkpoint at an
   epoch's last step is the next epoch's start, as dt_epoch_end counts it. */
static void dt__run_save(dt_run *r, const char *what) {
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(r->model->parallel, &who);
    if (!(dt__ctx.rank == 0 || (rep && (rep->state_open || rep->whole_from_local || rep->shards)))) return;
    int epoch = r->epoch;
    int64_t batch_in_epoch = r->batch_in_epoch;
    if (r->batch_in_epoch >= r->batches_per_epoch) { r->epoch++; r->batch_in_epoch = 0; }
    char path[4096];
    dt__describe_position(r, path, sizeof path, what);
    r->mark_ms = dt_now_ms();
    dt_checkpoint_save(r, path);
    dt_phase(r, DT_PHASE_CKPT);
    r->epoch = epoch;
    r->batch_in_epoch = batch_in_epoch;
    if (!r->cfg.quiet && dt__ctx.rank == 0) { printf("saved %s\n", path); fflush(stdout); }
}

/* After each scheduled evaluation (every --eval-every steps, each epoch's
   end): the best so far (kept as a checkpoint with --save-best), and
   --early-stop's count of evaluations that did not beat it; a loss that is
   not a number never does. Only scheduled ones count, so that a run stopped
   anywhere and resumed counts what the run straight through counts. The
   loss is the job's, so every rank decides alike. */
static void dt__run_track_best(dt_run *r) {
    if (isfinite(r->eval_loss) && (!r->has_best || r->eval_loss < r->best_eval_loss)) {
        r->has_best = 1;
        r->best_eval_loss = r->eval_loss;
        r->best_step = r->step;
        r->evals_since_best = 0;
        if (r->cfg.save_best) dt__run_save(r, "best");
        return;
    }
    r->evals_since_best++;
    if (r->cfg.early_stop > 0 && r->evals_since_best >= r->cfg.early_stop && r->step < r->stop_step)
        r->stop = r->early_stopped = 1;       /* said by dt_run_finish */
}

/* Evaluate; `scheduled`: one the run straight through makes too (not one
   only --steps asked for mid-epoch, nor a finished run's look at itself). */
static void dt__run_eval(dt_run *r, int scheduled) {
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
    r->evals_run++;
    if (scheduled) dt__run_track_best(r);
}

/* A mixture's figures of the step, each rank's counted over its own tokens:
   the whole job's (the choices each expert was given, those dropped), and
   the mean of the balancing terms, as stage 01 counts its one batch. */
static void dt__job_moe_stats(dt_moe_stats *moe) {
    if (!moe->experts || !dt__ctx.job || dt__ctx.world_size == 1) return;
    int E = moe->experts, W = dt__ctx.world_size, n = E + 3;
    int64_t *mine = (int64_t *)dt_step_alloc(sizeof(int64_t) * (size_t)n), *all = (int64_t *)dt_step_alloc(sizeof(int64_t) * (size_t)n * W);
    memcpy(mine, moe->routed, sizeof(int64_t) * (size_t)E);        /* every rank's counts, added here: exact at any size */
    mine[E] = moe->choices; mine[E + 1] = moe->dropped;
    memcpy(&mine[E + 2], &moe->balance_sum, sizeof(double));
    dt__comm_all_gather_host(dt__ctx.job, mine, all, sizeof(int64_t) * (size_t)n);
    memset(moe->routed, 0, sizeof(int64_t) * (size_t)E);
    moe->choices = moe->dropped = 0;
    moe->balance_sum = 0;
    for (int r = 0; r < W; r++) {
        const int64_t *v = all + (size_t)r * n;
        for (int e = 0; e < E; e++) moe->routed[e] += v[e];
        moe->choices += v[E]; moe->dropped += v[E + 1];
        double b;
        memcpy(&b, &v[E + 2], sizeof b);
        moe->balance_sum += b / W;                  /* the mean of the ranks' (each the same when taken over the batch) */
    }
}
int dt_step_end(dt_run *run, dt_tensor *loss, int batch_size) {
#ifdef DT_TESTING
    if (getenv("DT_TEST_STEP_SLEEP_MS")) {     /* slow steps, for the tests that act while a run goes on */
        long ms = atol(getenv("DT_TEST_STEP_SLEEP_MS"));
        struct timespec ts = { ms / 1000, ms % 1000 * 1000000L };
        nanosleep(&ts, NULL);
    }
#endif
    if (run->micro > 0) {            /* the mean of the step's micro-batches */
        float mean = (float)((run->micro_loss + dt_tensor_item(loss)) / (run->micro + 1));
        dt_upload(loss->data, &mean, sizeof mean);
    }
    run->micro = 0;
    run->micro_loss = 0;
    /* the loss of the whole job's batch: the mean of the ranks' means */
    int stop = dt__job_mean_loss(loss, run->cfg.bench || run->step + 1 >= run->stop_step ? 0 : dt__local_stop_signal());
    dt__job_moe_stats(&run->model->moe);
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
    /* A progress line is due (by time, --log-every, or an epoch's end): printed unless --quiet, and the
       hardware's own figures go into --log, TensorBoard and MLflow with it (rank 0's). */
    int last_of_epoch = run->batch_in_epoch == run->batches_per_epoch || run->step == run->stop_step;
    int line_due = dt__ctx.rank == 0 && dt__progress_due(run->step, run->cfg.log_every, last_of_epoch, now, run->line_ms);
    dt_hardware hw;
    memset(&hw, 0, sizeof hw);
    if (line_due) dt_hardware_read(run->model->device, &hw);
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(run->model->parallel, &who);
    double within = 0, across = 0;
    if (rep && rep->bytes_moved) {
        rep->bytes_moved(who, &within, &across);
        dt__trace_counter(run, "bytes a step (the job's)", run->step_start_ms, "in machines", within, "across machines", across);
    }
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
        if (rep && rep->log_fields) rep->log_fields(who, run->log);
        if (rep && rep->bytes_moved)
            fprintf(run->log, ",\"bytes_in_machines\":%.0f,\"bytes_across_machines\":%.0f", within, across);
        const dt_moe_stats *moe = &run->model->moe;
        if (moe->experts && moe->layers) {       /* the MoE layers, this step, every rank's tokens */
            fprintf(run->log, ",\"moe_balance\":%.6g,\"moe_dropped\":%lld,\"moe_choices\":%lld,\"moe_routed\":[",
                    moe->balance_sum / (double)moe->layers, (long long)moe->dropped, (long long)moe->choices);
            for (int e = 0; e < moe->experts; e++) fprintf(run->log, "%s%lld", e ? "," : "", (long long)moe->routed[e]);
            fprintf(run->log, "]");
        }
        if (dt__tokens_per_sample(run))
            fprintf(run->log, ",\"tokens_per_s\":%.1f", (double)batch_size * run->loader->world * dt__tokens_per_sample(run) * 1e3 / step_ms);
        if (line_due) {
            if (hw.rss_bytes >= 0) fprintf(run->log, ",\"rss_bytes\":%.0f", hw.rss_bytes);
            if (hw.cpu_seconds >= 0) fprintf(run->log, ",\"cpu_s\":%.3f", hw.cpu_seconds);
            if (hw.gpu) fprintf(run->log, ",\"gpu_mem_in_use_bytes\":%zu,\"gpu_mem_reserved_bytes\":%.0f", dt_mem_total_now(), hw.gpu_reserved_bytes);
            if (hw.gpu && hw.gpu_util_percent >= 0) fprintf(run->log, ",\"gpu_util_percent\":%.0f", hw.gpu_util_percent);
            if (hw.gpu && hw.gpu_temp_c >= 0) fprintf(run->log, ",\"gpu_temp_c\":%.0f", hw.gpu_temp_c);
        }
        fprintf(run->log, "}\n");
        dt__file_check(run->log, "--log", run->cfg.log_path);
    }
    if (run->tb || run->mlflow) {           /* the same figures, for TensorBoard and for MLflow, each by its names */
        double rate = batch_size * run->loader->world * 1e3 / step_ms, tokens = dt__tokens_per_sample(run);
        const struct { const char *tb, *mlflow; double value; } figures[] = {
            { "train/loss", "loss", run->last_loss }, { "train/lr", "lr", lr },
            { "train/grad_norm", "grad_norm", run->opt->last_grad_norm },
            { tokens ? "speed/tokens_per_s" : "speed/samples_per_s", tokens ? "tokens_per_s" : "samples_per_s", tokens ? rate * tokens : rate },
            { "speed/step_ms", "step_ms", step_ms }, { "memory/mb", "memory_mb", dt_mem_total_now() / 1e6 },
            { "moe/balance", "moe_balance", run->model->moe.layers ? run->model->moe.balance_sum / (double)run->model->moe.layers : 0 },
            { "moe/dropped", "moe_dropped", (double)run->model->moe.dropped } };
        for (size_t i = 0; i < sizeof figures / sizeof figures[0] - (run->model->moe.layers ? 0 : 2); i++) {
            dt__tensorboard_scalar(run, figures[i].tb, figures[i].value);
            dt__mlflow_metric(run, figures[i].mlflow, figures[i].value);
        }
        /* the hardware's, under one name in both (MLflow shows system/ in its "System metrics" tab) */
        const struct { const char *name; double value; int shown; } system[] = {
            { "system/rss_mb", hw.rss_bytes / 1e6, line_due && hw.rss_bytes >= 0 },
            { "system/cpu_s", hw.cpu_seconds, line_due && hw.cpu_seconds >= 0 },
            { "system/gpu_memory_in_use_mb", dt_mem_total_now() / 1e6, line_due && hw.gpu },
            { "system/gpu_memory_reserved_mb", hw.gpu_reserved_bytes / 1e6, line_due && hw.gpu },
            { "system/gpu_utilization_percent", hw.gpu_util_percent, line_due && hw.gpu && hw.gpu_util_percent >= 0 },
            { "system/gpu_temperature_c", hw.gpu_temp_c, line_due && hw.gpu && hw.gpu_temp_c >= 0 } };
        for (size_t i = 0; i < sizeof system / sizeof system[0]; i++)
            if (system[i].shown) {
                dt__tensorboard_scalar(run, system[i].name, system[i].value);
                dt__mlflow_metric(run, system[i].name, system[i].value);
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
    if (line_due) run->line_ms = now;
    if (line_due && !run->cfg.quiet) {
        char eta[32];
        double rate = run->step_ms_avg > 0 ? batch_size * run->loader->world * 1e3 / run->step_ms_avg : 0;
        dt__format_duration((run->stop_step - run->step) * run->step_ms_avg / 1e3, eta, sizeof eta);
        char scale[128] = "";
        if (run->scaler.enabled)
            snprintf(scale, sizeof scale, "  scale %g (%lld skipped)", run->scaler.scale, (long long)run->scaler.skipped);
        int tok = dt__tokens_per_sample(run);
        const dt_moe_stats *moe = &run->model->moe;
        if (moe->layers)                /* the last step's: how even the experts' loads are, what was dropped */
            snprintf(scale + strlen(scale), sizeof scale - strlen(scale), "  balance %.3f dropped %.1f%%",
                     moe->balance_sum / (double)moe->layers, 100.0 * (double)moe->dropped / (double)(moe->choices ? moe->choices : 1));
        printf("step %6lld/%lld  epoch %d/%d  loss %.4f  lr %.2e  %.0f %s/s  eta %s%s\n", (long long)run->step,
               (long long)run->stop_step, run->epoch + 1, run->cfg.epochs, run->loss_sum / run->loss_count, lr,
               tok ? rate * tok : rate, tok ? "tokens" : "samples", eta, scale);
        fflush(stdout);
        run->loss_sum = 0;
        run->loss_count = 0;
    }
    dt_moe_stats *moe = &run->model->moe;           /* counted afresh each step */
    if (moe->experts) {
        memset(moe->routed, 0, sizeof *moe->routed * (size_t)moe->experts);
        moe->choices = moe->dropped = moe->layers = 0;
        moe->balance_sum = 0;
    }
    if (run->cfg.explain && run->steps_run == 3 && dt__ctx.rank == 0) dt__run_explain(run);
    if (stop) { run->stopped_by = stop; run->stop = 1; }
    if (run->cfg.eval_every > 0 && run->step % run->cfg.eval_every == 0) {
        if (!run->stopped_by) dt__run_eval(run, 1);
        else run->eval_pending = 1;         /* stopping now: the checkpoint says so, and the resumed run evaluates first */
    }
    if (run->step >= run->stop_step) run->stop = 1;
    return run->stop;
}

void dt_epoch_end(dt_run *run) {
    int finished = run->batch_in_epoch >= run->batches_per_epoch;
    if (finished) { run->epoch++; run->batch_in_epoch = 0; }
    if (!(run->cfg.eval_every > 0 && run->step % run->cfg.eval_every == 0)) {
        if (!run->stopped_by) dt__run_eval(run, finished);    /* --steps mid-epoch: reported, not counted */
        else if (finished) run->eval_pending = 1;
    }
    if (run->stopped_by && !run->cfg.save_dir && dt__ctx.rank == 0)
        dt_warn("stopped by %s with no --save-dir: the %lld steps trained are not saved", dt__signal_name(run->stopped_by),
                (long long)run->steps_run);
    if (run->cfg.save_dir) {
        char what[64];
        if (finished) snprintf(what, sizeof what, "epoch%d", run->epoch);
        else snprintf(what, sizeof what, "step%lld", (long long)run->step);
        dt__run_save(run, what);
    }
}

int dt_run_finish(dt_run *run) {
    dt_set_lazy_logits(-1);                 /* what the program does after the run reads its logits whole */
    if (run->cfg.bench) dt__bench_report(run);
    else if (run->steps_run == 0 && run->val && !run->evals_run) {        /* --resume of a finished run: evaluate it */
        if (!run->cfg.quiet && dt__ctx.rank == 0) printf("nothing left to train (epoch %d of %d): evaluating\n", run->epoch, run->cfg.epochs);
        dt__run_eval(run, 0);
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
        if (run->early_stopped)
            printf("early stop at step %lld: the evaluation loss has not improved for %d evaluations (the best, %.4f, at step %lld)\n",
                   (long long)run->step, run->evals_since_best, run->best_eval_loss, (long long)run->best_step);
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
        if (run->has_best) fprintf(run->log, ",\"best_eval_loss\":%.6f,\"best_step\":%lld", run->best_eval_loss, (long long)run->best_step);
        if (run->early_stopped) fprintf(run->log, ",\"early_stopped\":true");
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
        /* taken back from the failure path first: a thread that fails meanwhile (stage 02's) closes it otherwise */
        if (__atomic_exchange_n(&dt__on_fail_tracking, (void (*)(void))NULL, __ATOMIC_ACQ_REL)) {
            dt__mlflow_running = NULL;
            if (!dt_mlflow_close(ml, run->stopped_by ? DT_MLFLOW_KILLED : DT_MLFLOW_FINISHED))
                dt__write_failed("--mlflow", run->cfg.mlflow, errno);
        }
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


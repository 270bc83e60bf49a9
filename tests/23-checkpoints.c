/* tests/23-checkpoints.c -- tests of dtrain.h's chapter 23-checkpoints:
   safetensors, exact resume, sharded checkpoints, refused when broken.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- checkpoints: safetensors, exact resume, sharded, refused when broken ---- */

/* A file written byte by byte, the way the format's spec describes it. */
static size_t handmade_safetensors(const char *path, const char *dtype_w, int with_extra) {
    /* fc1.weight [2, 3] (F32 or BF16), fc1.bias [2] F32, and with_extra a scalar the model does not have */
    int half = !strcmp(dtype_w, "BF16");
    size_t wbytes = half ? 12 : 24;
    char hdr[512], extra_entry[128] = "";
    if (with_extra)
        snprintf(extra_entry, sizeof extra_entry, ",\"extra\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[%zu,%zu]}",
                 wbytes + 8, wbytes + 12);
    int hl = snprintf(hdr, sizeof hdr,
                      "{\"__metadata__\":{\"format\":\"pt\"},\"fc1.weight\":{\"dtype\":\"%s\",\"shape\":[2,3],"
                      "\"data_offsets\":[0,%zu]},\"fc1.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[%zu,%zu]}%s}",
                      dtype_w, wbytes, wbytes, wbytes + 8, extra_entry);
    while (hl % 8) hdr[hl++] = ' ';
    unsigned char buf[1024];
    uint64_t L = (uint64_t)hl;
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(L >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    size_t p = 8 + hl;
    float w[6] = { 0.5f, -1.0f, 2.0f, 0.25f, -0.125f, 3.0f }, b[2] = { 1.5f, -2.5f }, extra = 42;
    for (int i = 0; i < 6; i++) {
        if (half) { uint16_t h = dt_f32_to_bf16(w[i]); buf[p++] = (unsigned char)h; buf[p++] = (unsigned char)(h >> 8); }
        else { memcpy(buf + p, &w[i], 4); p += 4; }
    }
    memcpy(buf + p, b, 8); p += 8;
    if (with_extra) { memcpy(buf + p, &extra, 4); p += 4; }
    write_bytes(path, buf, p);
    return p;
}

/* A safetensors file of `header` (its JSON) and `data` bytes of zeros. */
static void write_safetensors_raw(const char *path, const char *header, size_t data) {
    size_t h = strlen(header), n = 8 + h + data;
    unsigned char *b = (unsigned char *)calloc(n, 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    write_bytes(path, b, n);
    free(b);
}
/* safetensors files that lie are refused, naming the file and the tensor:
   a shape whose element count wrapped around 2^64 (to 512, and 2048 bytes
   passed), tensors sharing bytes, a name twice or cut by \u0000, and a
   tensor the model does not have -- all once taken by --init FILE. A header
   of 120,000 entries is read in memory of its own size (each name's buffer
   once took the rest of the header: 538 MB). */
TEST(safetensors_files_that_lie_are_refused_naming_the_tensor, QUICK) {
    char out[16384], path[700];
    snprintf(path, sizeof path, "%s/lie.safetensors", tmpdir);
    static const struct { const char *header; size_t data; const char *says; } cases[] = {
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387920,32],\"data_offsets\":[0,2048]}}", 2048,
          "tensor 'a' has a shape out of range" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},\"b\":{\"dtype\":\"F32\",\"shape\":[4],"
          "\"data_offsets\":[8,24]}}", 24, "overlaps another tensor's bytes" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},\"a\":{\"dtype\":\"F32\",\"shape\":[4],"
          "\"data_offsets\":[16,32]}}", 32, "names tensor 'a' twice" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24, "leaving bytes 0 to 8 to no tensor" },
        { "{\"fc1.weight\\u0000x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, "not a valid safetensors file" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        write_safetensors_raw(path, cases[c].header, cases[c].data);
        int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --steps 1 --init %s", train_cpu, small_data(), path);
        expect_error_in(cases[c].says, out, st, 1, cases[c].says);
        CHECKF(strstr(out, "lie.safetensors"), "the error does not name the file:\n%s", out);
    }
    /* a tensor the model does not have, beside all it has */
    char weights[800];
    snprintf(weights, sizeof weights, "%s/model.safetensors", short_checkpoint());
    dt_safetensors *w = dt_safetensors_read(weights);
    dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)w->n + 1, sizeof *t);
    float extra[4] = { 1, 2, 3, 4 };
    for (int i = 0; i < w->n; i++) {
        t[i].name = w->t[i].name; t[i].data = (float *)(w->buf + w->data_start + w->t[i].begin); t[i].ndim = w->t[i].ndim;
        for (int d = 0; d < w->t[i].ndim; d++) t[i].shape[d] = (int)w->t[i].shape[d];
    }
    t[w->n].name = "fc9.weight"; t[w->n].data = extra; t[w->n].ndim = 1; t[w->n].shape[0] = 4;
    dt_safetensors_write(path, t, w->n + 1, NULL, 0);
    free(t);
    dt_safetensors_close(w);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --steps 1 --init %s", train_cpu, small_data(), path);
    expect_error(out, st, 1, "holds tensor 'fc9.weight', which this model does not have");
    /* 120,000 entries: refused, in memory of the header's own size */
    size_t cap = 120000 * 80 + 16, len = 0;
    char *h = (char *)malloc(cap);
    len += (size_t)snprintf(h + len, cap - len, "{");
    for (int i = 0; i < 120000; i++)
        len += (size_t)snprintf(h + len, cap - len, "%s\"t%d\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                                i ? "," : "", i, 4 * i, 4 * i + 4);
    snprintf(h + len, cap - len, "}");
    write_safetensors_raw(path, h, 4 * 120000);
    free(h);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --steps 1 --init %s", train_cpu, small_data(), path);
    expect_error(out, st, 1, "has no tensor 'fc1.weight' (it holds 120000 tensors");
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    CHECKF(ru.ru_maxrss < 150 * 1024, "reading a 9 MB header took %ld MB", ru.ru_maxrss / 1024);
}

TEST(safetensors_weights_load_and_write_back, QUICK) {
    char path[600], out[600];
    dt_model_config c = { DT_MODEL_MLP, 3, 1, 2, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };     /* depth 0: fc1 [2, 3] only */
    float w[6] = { 0.5f, -1.0f, 2.0f, 0.25f, -0.125f, 3.0f };
    for (int v = 0; v < 2; v++) {
        snprintf(path, sizeof path, "%s/hand%d.safetensors", tmpdir, v);
        handmade_safetensors(path, v ? "BF16" : "F32", 1);
        dt_safetensors *parsed = dt_safetensors_read(path);     /* a scalar (shape []) among them */
        CHECK(parsed->n == 3 && !strcmp(parsed->t[2].name, "extra") && parsed->t[2].ndim == 0 &&
              parsed->t[2].end - parsed->t[2].begin == 4);
        dt_safetensors_close(parsed);
        handmade_safetensors(path, v ? "BF16" : "F32", 0);     /* what --init takes: the model's tensors, no others */
        dt_model *m = dt_model_create(&c, 1);
        dt_model_load_weights(m, path);
        CHECK(memcmp(m->params[0].data, w, sizeof w) == 0);        /* these values are exact in bf16 */
        CHECK(m->params[1].data[0] == 1.5f && m->params[1].data[1] == -2.5f);
        /* write the model out and read the bytes back by hand */
        dt_named_tensor t[2] = { { "fc1.weight", m->params[0].data, 2, { 2, 3 } }, { "fc1.bias", m->params[1].data, 1, { 2 } } };
        const char *meta[2] = { "note", "a \"quoted\" value" };
        snprintf(out, sizeof out, "%s/out%d.safetensors", tmpdir, v);
        dt_safetensors_write(out, t, 2, meta, 1);
        size_t n = 0;
        unsigned char *bytes = read_bytes(out, &n);
        uint64_t hl = 0;
        for (int i = 0; i < 8; i++) hl |= (uint64_t)bytes[i] << (8 * i);
        CHECK(hl % 8 == 0 && 8 + hl + 32 == n);
        char *hdr = (char *)calloc(hl + 1, 1);
        memcpy(hdr, bytes + 8, hl);
        CHECK(strstr(hdr, "\"fc1.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}") != NULL);
        CHECK(strstr(hdr, "\"fc1.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[24,32]}") != NULL);
        CHECK(strstr(hdr, "\"note\":\"a \\\"quoted\\\" value\"") != NULL);
        CHECK(memcmp(bytes + 8 + hl, w, 24) == 0);
        dt_safetensors *st = dt_safetensors_read(out);
        CHECK(st && !strcmp(dt_safetensors_meta(st, "note"), "a \"quoted\" value"));
        dt_safetensors_close(st);
        free(hdr);
        free(bytes);
        dt_model_free(m);
    }
}

/* --init takes a checkpoint folder back: a llama one as the Hugging Face folder
   it is (config.json gives the shape: no shape flag), a vit one and a sharded
   one (stage 04) by name. A step at a learning rate of 1e-9 leaves the weights
   as they were loaded. */
TEST(checkpoint_folders_start_runs_with_init, QUICK) {
    static const struct { const char *name, *stage, *flags, *init_flags; int text; } cases[] = {
        { "llama", "01-single-gpu", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 4", "", 1 },
        { "vit", "01-single-gpu", "--model vit --image-size 16 --patch 4 --dim 32 --depth 2 --heads 2 --batch-size 16",
          "--model vit --image-size 16 --patch 4 --dim 32 --depth 2 --heads 2 --batch-size 16", 0 },
        { "fsdp", "04-fsdp", "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 2 --nproc 2",
          "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4", 1 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char out[16384], dir[600], again[600], ck[700], a[800], b[800];
        snprintf(dir, sizeof dir, "%s/init-from-%s", tmpdir, cases[c].name);
        snprintf(again, sizeof again, "%s/init-from-%s-again", tmpdir, cases[c].name);
        const char *data = cases[c].text ? gpt_text() : small_data();
        int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --steps 2 --lr 2e-2 --save-dir %s --quiet",
                         stage_bin(cases[c].stage), data, cases[c].flags, dir);
        CHECKF(st == 0, "%s: training: exit %d\n%s", cases[c].name, st, out);
        st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step2'", dir);
        CHECKF(st == 0, "%s: no checkpoint of step 2 in %s", cases[c].name, dir);
        if (st) continue;
        out[strcspn(out, "\n")] = 0;
        dt__copy_str(ck, sizeof ck, out);
        st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --steps 1 --lr 1e-9 --warmup 0 --init %s --save-dir %s",
                     train_cpu, data, cases[c].init_flags, ck, again);
        CHECKF(st == 0, "%s: --init %s: exit %d\n%s", cases[c].name, ck, st, out);
        if (st) continue;
        if (!cases[c].init_flags[0]) CHECKF(strstr(out, "llama dim=32 depth=2 heads=4 kv-heads=2"), "config.json's shape not taken:\n%s", out);
        st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step1'", again);
        out[strcspn(out, "\n")] = 0;
        snprintf(b, sizeof b, "%.700s/model.safetensors", out);
        /* the sharded checkpoint, put together: its weights */
        if (!strcmp(cases[c].stage, "04-fsdp")) {
            snprintf(a, sizeof a, "%s/whole", dir);
            st = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/consolidate"), ck, a);
            CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
            snprintf(a, sizeof a, "%s/whole/model.safetensors", dir);
        } else snprintf(a, sizeof a, "%s/model.safetensors", ck);
        double d = max_tensor_diff(a, b);
        CHECKF(d >= 0 && d < 1e-6, "%s: the weights after one step at lr 1e-9 from --init %s differ by %g", cases[c].name, ck, d);
    }
}

/* Resume from `from` for the rest of a 2-epoch run, saving into `dir`; the
   final checkpoint must equal the straight run's in every tensor, bit for bit. */
static void resume_matches_straight_run(const char *from, const char *dir, const char *straight_dir, const char *what) {
    char out[16384], p[700], q[700];
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --resume %s --save-dir %s", train_cpu,
                     small_data(), from, dir);
    CHECKF(st == 0, "resumed run (%s): exit %d\n%s", what, st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2", straight_dir);
    snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", dir);
    CHECKF(files_equal_tensors(p, q), "weights or optimizer state differ after resuming %s", what);
}

TEST(resume_continues_exactly, QUICK) {
    char out[16384], a[600], b[600], c[600], p[700];
    snprintf(a, sizeof a, "%s/ckA", tmpdir);
    snprintf(b, sizeof b, "%s/ckB", tmpdir);
    snprintf(c, sizeof c, "%s/ckC", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --save-dir %s", train_cpu, small_data(), a);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch1", a);     /* 1 epoch, saved */
    resume_matches_straight_run(p, b, a, "at an epoch boundary");
    /* stopped in mid-epoch (--steps 13 of 20), resumed */
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --steps 13 --save-dir %s", train_cpu,
                 small_data(), c);
    CHECKF(st == 0, "stopped run: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_step13", c);
    resume_matches_straight_run(p, c, a, "in mid-epoch");
}

TEST(init_starts_from_given_weights, QUICK) {
    char out[16384], path[600], dir[600];
    snprintf(path, sizeof path, "%s/hand0.safetensors", tmpdir);
    handmade_safetensors(path, "F32", 0);
    snprintf(dir, sizeof dir, "%s/init", tmpdir);
    /* a model with exactly fc1 [2, 3]: 1x1 RGB images, 2 classes */
    char data[600];
    snprintf(data, sizeof data, "%s/tiny", tmpdir);
    for (int s = 0; s < 2; s++)
        for (int c = 0; c < 2; c++) {
            char p[700];
            snprintf(p, sizeof p, "%s/%s", data, s ? "val" : "train");
            mkdir(data, 0755); mkdir(p, 0755);
            snprintf(p, sizeof p, "%s/%s/c%d", data, s ? "val" : "train", c);
            mkdir(p, 0755);
            snprintf(p, sizeof p, "%s/%s/c%d/a.ppm", data, s ? "val" : "train", c);
            write_bytes(p, c ? "P6 1 1 255\n\xff\x00\x00" : "P6 1 1 255\n\x00\x00\xff", 14);
        }
    int st = run_cmd(out, sizeof out, "%s --data %s --image-size 1 --depth 0 --batch-size 2 --epochs 1 --augment 0 "
                                      "--lr 1e-9 --init %s --save-dir %s --quiet", train_cpu, data, path, dir);
    CHECKF(st == 0, "exit %d:\n%s", st, out);
    char ck[700];
    snprintf(ck, sizeof ck, "%s/mlp_data0-2_epoch1", dir);
    dt_model_config c = { DT_MODEL_MLP, 3, 1, 2, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 1);
    dt_model_load_weights(m, ck);
    CHECK(fabs(m->params[0].data[2] - 2.0f) < 1e-5 && fabs(m->params[1].data[1] + 2.5f) < 1e-5);
    dt_model_free(m);
}

/* Checkpoints of stage 05: 4 micro-batches at fp16, stopped after epoch 1 and
   resumed, end bit for bit where a straight run ends, with the same loss
   scale at every step; a step of 2 x 4 x 4 samples resumes as 2 x 16 x 1 and
   not as 2 x 4 x 2, which the error explains. */
TEST(accumulation_and_fp16_resume_exactly, QUICK) {
    char out[16384], dir[2][600], log[2][700], f[2][700], ck[700], rescaled[700];
    for (int k = 0; k < 2; k++) {
        snprintf(dir[k], sizeof dir[k], "%s/acc16-%d", tmpdir, k);
        snprintf(log[k], sizeof log[k], "%s/acc16-%d.jsonl", tmpdir, k);
    }
    const char *flags = "--image-size 16 --dim 32 --log-every 1000 --quiet --model vit --depth 2 --heads 2 --nproc 2 "
                        "--batch-size 4 --accum-steps 4 --dtype fp16";
    const char *bin = stage_bin("05-accum-mixed-precision");
    int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --save-dir %s --log %s", bin, small_data(), flags, dir[0], log[0]);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --steps 10 --save-dir %s --log %s", bin, small_data(), flags,
                 dir[1], log[1]);
    CHECKF(st == 0, "first epoch: exit %d\n%s", st, out);
    snprintf(ck, sizeof ck, "%s/vit_data0-320_epoch1", dir[1]);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --save-dir %s --log %s --resume %s", bin, small_data(), flags,
                 dir[1], log[1], ck);
    CHECKF(st == 0, "resumed: exit %d\n%s", st, out);
    for (int k = 0; k < 2; k++) {
        snprintf(f[k], sizeof f[k], "%s/full-%d", tmpdir, k);
        st = run_cmd(out, sizeof out, "%s %s/vit_data0-320_epoch2 %s", build_path("tools/consolidate"), dir[k], f[k]);
        CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
    }
    CHECKF(files_equal_tensors(f[0], f[1]), "fp16 with 4 micro-batches: the resumed run does not end bit for bit as the straight one");
    double a[40], b[40];
    int na = log_series(log[0], "loss_scale", a, 40), nb = log_series(log[1], "loss_scale", b, 40);
    CHECKF(na == 20 && nb == 20, "loss scales logged: %d and %d, expected 20 steps each", na, nb);
    for (int i = 0; i < 20 && na == nb; i++) CHECKF(a[i] == b[i], "step %d: loss scale %g straight, %g resumed", i + 1, a[i], b[i]);
    /* No step overflowed above, so the scale never moved: give the index another
       scale (its metadata rewritten) and see the resumed run go on from it. */
    char ckm[800];
    dt_safetensors *idx = dt_safetensors_read(meta_file(ck, ckm, sizeof ckm));
    const char *meta[64];
    int nm = 0;
    for (int i = 0; i < idx->nmeta && nm < 64; i++) {
        meta[nm++] = idx->meta[2 * i];
        meta[nm++] = strcmp(idx->meta[2 * i], "loss_scale") ? idx->meta[2 * i + 1] : "1024";
    }
    CHECK(dt_safetensors_meta(idx, "loss_scale") && dt_safetensors_meta(idx, "skipped_steps"));
    dt_safetensors_write(ckm, NULL, 0, meta, nm / 2);
    dt_safetensors_close(idx);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --steps 11 --log %s/rescaled.jsonl --resume %s", bin,
                 small_data(), flags, tmpdir, ck);

    snprintf(rescaled, sizeof rescaled, "%s/rescaled.jsonl", tmpdir);
    CHECKF(st == 0 && log_series(rescaled, "loss_scale", a, 40) == 1 && a[0] == 1024,
           "resumed from a checkpoint at scale 1024: exit %d, first scale %g\n%s", st, a[0], out);
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 32 --quiet --model vit --depth 2 --heads 2 --nproc 2 "
                 "--batch-size 16 --dtype fp16 --epochs 2 --resume %s", bin, small_data(), ck);
    CHECKF(st == 0, "2 x 16 x 1 from a 2 x 4 x 4 checkpoint: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --accum-steps 2 --epochs 2 --resume %s", bin, small_data(), flags, ck);
    expect_error(out, st, 1, "--accum-steps 4");
}

/* Sharded checkpoints. Saved at N=4 after one epoch, resumed at N=4: the final
   shards are bit for bit those of a straight run. Consolidated into one file,
   stage 01 evaluates it to the loss 04 measured (within 1e-5: the per-sample
   losses are summed in another order). Resumed at N=2 with twice the batch --
   the same samples each step -- it ends within 2e-5 of the straight run.
   Refused at N=2 with the same per-rank batch; a missing or a truncated shard
   is an error naming the file. */
TEST(fsdp_sharded_checkpoints_resume_consolidate_and_reshard, QUICK) {
    char out[16384], a[600], b[600], c[600], p[800], q[800], full[700], log4[700], log1[700], moved[810];
    const char *bin = stage_bin("04-fsdp"), *consolidate = build_path("tools/consolidate");
    const char *flags = "--image-size 16 --dim 32 --log-every 1000 --quiet --model vit --depth 2 --heads 2";
    snprintf(a, sizeof a, "%s/shardA", tmpdir);
    snprintf(b, sizeof b, "%s/shardB", tmpdir);
    snprintf(c, sizeof c, "%s/shardC", tmpdir);
    snprintf(log4, sizeof log4, "%s/shardA.jsonl", tmpdir);
    snprintf(log1, sizeof log1, "%s/shard01.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 8 --nproc 4 --save-dir %s", bin, small_data(), flags, b);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --steps 10 --batch-size 8 --nproc 4 --save-dir %s --log %s", bin,
                 small_data(), flags, a, log4);
    CHECKF(st == 0, "first epoch: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/vit_data0-320_epoch1", a);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 8 --nproc 4 --resume %s --save-dir %s", bin,
                 small_data(), flags, p, a);
    CHECKF(st == 0, "resume at N=4: exit %d\n%s", st, out);
    for (int r = 0; r < 4; r++) {
        snprintf(p, sizeof p, "%s/vit_data0-320_epoch2/shard%d-of-4.safetensors", a, r);
        snprintf(q, sizeof q, "%s/vit_data0-320_epoch2/shard%d-of-4.safetensors", b, r);
        CHECKF(files_equal_tensors(p, q), "shard %d after resuming at N=4 differs from the straight run's", r);
    }

    snprintf(p, sizeof p, "%s/vit_data0-320_epoch1", a);
    snprintf(full, sizeof full, "%s/shardA-full", tmpdir);
    st = run_cmd(out, sizeof out, "%s %s %s", consolidate, p, full);
    CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --batch-size 32 --resume %s --log %s", train_cpu, small_data(),
                 flags, full, log1);
    CHECKF(st == 0, "01 --resume of the consolidated checkpoint: exit %d\n%s", st, out);
    double e4 = summary_value(log4, "eval_loss"), e1 = summary_value(log1, "eval_loss");
    CHECKF(e4 > 0 && fabs(e4 - e1) <= 1e-5, "eval loss: 04 measured %.6f, 01 on the consolidated file %.6f", e4, e1);

    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 16 --nproc 2 --resume %s --save-dir %s", bin,
                 small_data(), flags, p, c);
    CHECKF(st == 0, "resume at N=2: exit %d\n%s", st, out);
    char fb[800], fc[800];
    snprintf(fb, sizeof fb, "%s/b-full", tmpdir);
    snprintf(fc, sizeof fc, "%s/c-full", tmpdir);
    st = run_cmd(out, sizeof out, "%s %s/vit_data0-320_epoch2 %s && %s %s/vit_data0-320_epoch2 %s",
                 consolidate, b, fb, consolidate, c, fc);
    CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
    double d = max_tensor_diff(fb, fc);
    CHECKF(d >= 0 && d <= 2e-5, "resumed at N=2: differs from the straight N=4 run by %.3g", d);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 8 --nproc 2 --resume %s", bin, small_data(), flags, p);
    expect_error(out, st, 1, "written by 4 ranks, this run has 2");
    snprintf(q, sizeof q, "%s/vit_data0-320_epoch1/shard0-of-4.safetensors", a);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 32 --resume %s", train_cpu, small_data(), flags, q);
    expect_error(out, st, 1, "one rank's shard of a sharded checkpoint");

    snprintf(q, sizeof q, "%s/vit_data0-320_epoch1/shard3-of-4.safetensors", a);
    snprintf(moved, sizeof moved, "%s.away", q);
    CHECK(rename(q, moved) == 0);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 8 --nproc 4 --resume %s", bin, small_data(), flags, p);
    expect_error(out, st, 1, "shard3-of-4.safetensors', is missing");
    CHECK(rename(moved, q) == 0);
    size_t n = 0;
    snprintf(q, sizeof q, "%s/vit_data0-320_epoch1/shard1-of-4.safetensors", a);
    unsigned char *bytes = read_bytes(q, &n);
    CHECK(bytes && n > 100);
    if (bytes) write_bytes(q, bytes, n / 2);
    free(bytes);
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 2 --batch-size 16 --nproc 2 --resume %s", bin, small_data(), flags, p);
    expect_error(out, st, 1, "shard1-of-4.safetensors', has");
    st = run_cmd(out, sizeof out, "%s %s %s/never", consolidate, p, tmpdir);
    expect_error(out, st, 1, "shard1-of-4.safetensors', has");
    /* a folder that is not a checkpoint is never replaced (nor a file) */
    snprintf(q, sizeof q, "%s/mine", tmpdir);
    dt__mkdir(q);
    snprintf(moved, sizeof moved, "%s/notes.txt", q);
    write_bytes(moved, "keep", 4);
    st = run_cmd(out, sizeof out, "%s %s/vit_data0-320_epoch2 %s", consolidate, b, q);
    expect_error(out, st, 1, "mine' exists and is not a dtrain checkpoint: not replaced");
    CHECKF(access(moved, F_OK) == 0, "consolidate removed %s", moved);
}

/* A rank killed (SIGKILL) while it writes its shard of a sharded save: rank
   0 stops, and nothing of the save is left -- its half-written
   shard1-of-2.safetensors.tmp once kept the folder epoch1.tmp from going. */
TEST(a_rank_killed_during_a_sharded_save_leaves_no_part_of_it, QUICK) {
    char out[16384], dir[700];
    snprintf(dir, sizeof dir, "%s/saves", tmpdir);
    int st = run_cmd(out, sizeof out, "env DT_TEST_DIE_WRITING=shard1-of-2 %s --data %s " SMALL_FLAGS " --epochs 1 --nproc 2 "
                     "--shard full --timeout 10 --save-dir %s", stage_bin("04-fsdp"), small_data(), dir);
    CHECKF(st == 128 + SIGKILL, "the job exited %d, not %d (rank 1 killed by SIGKILL)\n%s", st, 128 + SIGKILL, out);
    st = run_cmd(out, sizeof out, "find %s -mindepth 1", dir);
    CHECKF(st == 0 && !strstr(out, ".tmp"), "the save left:\n%s", out);
}

/* Rank 1 is killed in the middle of epoch 2 of 3 (its 30th all-reduce: two per
   step -- one bucket, the logged loss -- and one per evaluation). Rank 0 stops
   within the timeout naming it; the epoch-1 checkpoint is intact, and resuming
   from it with 2 ranks ends bit for bit where an uninterrupted run ends. */
TEST(a_killed_ddp_rank_leaves_a_checkpoint_that_resumes_exactly, QUICK) {
    char out[16384], straight[600], killed[600], p[700], q[700];
    const char *bin = stage_bin("03-ddp");
    snprintf(straight, sizeof straight, "%s/kill-straight", tmpdir);
    snprintf(killed, sizeof killed, "%s/kill-dead", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --epochs 3 --batch-size 16 --nproc 2 --save-dir %s", bin,
                     small_data(), straight);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    double t0 = dt_now_ms();
    st = run_cmd(out, sizeof out, "env DT_TEST_DIE_RANK=1 DT_TEST_DIE_CALL=30 %s --data %s " PAR_FLAGS " --epochs 3 "
                 "--batch-size 16 --nproc 2 --timeout 10 --save-dir %s", bin, small_data(), killed);
    double s = (dt_now_ms() - t0) / 1e3;
    CHECKF(st != 0 && s < 10, "exit %d after %.1f s (timeout 10 s):\n%s", st, s, out);
    CHECKF(strstr(out, "rank 1 (pid") && strstr(out, "died during all_reduce"), "rank 0 did not name rank 1:\n%s", out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch1", killed);
    snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2", killed);
    struct stat sb;
    CHECKF(stat(p, &sb) == 0 && stat(q, &sb) != 0, "expected the epoch-1 checkpoint and no epoch-2 one");
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --epochs 3 --batch-size 16 --nproc 2 --resume %s --save-dir %s",
                 bin, small_data(), p, killed);
    CHECKF(st == 0, "resume: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch3", straight);
    snprintf(q, sizeof q, "%s/mlp_data0-320_epoch3", killed);
    CHECKF(files_equal_tensors(p, q), "the resumed run does not end where the uninterrupted run ends");
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --epochs 3 --batch-size 16 --nproc 4 --resume %s", bin,
                 small_data(), p);                        /* 64 samples a step where it took 32 */
    expect_error(out, st, 1, "written by 2 ranks, this run has 4");
}

static int rewrite_checkpoint(const char *src, const char *dst, const char *key, const char *value, const char *nan_in);
TEST(bad_checkpoints_are_refused, QUICK) {
    char out[8192], src[700], bad[700], dir[600];
    snprintf(dir, sizeof dir, "%s/ckA", tmpdir);               /* written by the resume test */
    snprintf(src, sizeof src, "%s/mlp_data0-320_epoch1", dir);
    struct stat sb;
    if (stat(src, &sb) != 0) {
        int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --save-dir %s", train_cpu, small_data(), dir);
        CHECKF(st == 0, "%s", out);
    }
    /* a copy of the folder whose weights file is cut short, cut to 5 bytes, garbled */
    char weights[800], moments[800], cut[800];
    size_t n = 0, nm = 0;
    snprintf(weights, sizeof weights, "%s/model.safetensors", src);
    snprintf(moments, sizeof moments, "%s/optimizer.safetensors", src);
    unsigned char *bytes = read_bytes(weights, &n), *mbytes = read_bytes(moments, &nm);
    CHECK(bytes != NULL && mbytes != NULL);
    if (!bytes || !mbytes) { free(bytes); free(mbytes); return; }
    snprintf(bad, sizeof bad, "%s/cut", tmpdir);
    int st = run_cmd(out, sizeof out, "sh -c 'rm -rf %s && cp -r %s %s'", bad, src, bad);
    CHECKF(st == 0, "%s", out);
    snprintf(cut, sizeof cut, "%s/model.safetensors", bad);
    write_bytes(cut, bytes, n / 2);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/model.safetensors");
    CHECK(strstr(out, "truncated") != NULL);
    write_bytes(cut, bytes, 5);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/model.safetensors");
    memset(bytes + 8, '#', 16);                                       /* garble the JSON header */
    write_bytes(cut, bytes, n);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/model.safetensors");
    /* the optimizer state cut short, or of another save (its step rewritten), or gone */
    free(bytes);
    bytes = read_bytes(weights, &n);                                  /* the weights whole again */
    write_bytes(cut, bytes, n);
    snprintf(cut, sizeof cut, "%s/optimizer.safetensors", bad);
    write_bytes(cut, mbytes, nm / 2);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/optimizer.safetensors");
    CHECK(rewrite_checkpoint(moments, cut, "step", "7", NULL));
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/optimizer.safetensors' is not the optimizer state of '");
    unlink(cut);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), bad);
    expect_error(out, st, 1, "cut/optimizer.safetensors");
    /* a folder that is no checkpoint; a file, and an older dtrain's one-file checkpoint */
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), tmpdir);
    expect_error(out, st, 1, "holds neither model.safetensors nor shards.safetensors");
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), weights);
    expect_error(out, st, 1, "is a file, not a checkpoint folder");
    snprintf(cut, sizeof cut, "%s/old-dtrain.safetensors", tmpdir);
    CHECK(rewrite_checkpoint(weights, cut, "format", "dtrain-checkpoint-1", NULL));
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s", train_cpu, small_data(), cut);
    expect_error(out, st, 1, "a one-file checkpoint of an earlier dtrain (dtrain-checkpoint-1)");
    /* --resume auto: such a file, newer than every folder, is named rather than passed over for a fresh start */
    char autodir[700];
    snprintf(autodir, sizeof autodir, "%s/auto-old", tmpdir);
    st = run_cmd(out, sizeof out, "sh -c 'mkdir -p %s && cp %s %s/mlp_data0-320_epoch1.safetensors'", autodir, cut, autodir);
    CHECKF(st == 0, "%s", out);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume auto --save-dir %s", train_cpu, small_data(), autodir);
    expect_error(out, st, 1, "is a one-file checkpoint of an earlier dtrain, newer than any checkpoint folder");
    /* a save cut off between moving NAME aside and renaming NAME.tmp: --resume auto takes NAME.old */
    snprintf(autodir, sizeof autodir, "%s/auto-cut", tmpdir);
    st = run_cmd(out, sizeof out, "sh -c 'mkdir -p %s && cp -r %s %s/mlp_data0-320_epoch1.old'", autodir, src, autodir);
    CHECKF(st == 0, "%s", out);
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 32 --batch-size 32 --log-every 1000 --epochs 2 "
                 "--resume auto --save-dir %s", train_cpu, small_data(), autodir);
    CHECKF(st == 0 && strstr(out, "resumed from ") && strstr(out, "_epoch1.old at epoch 2, step 10"),
           "--resume auto beside NAME.old alone: exit %d\n%s", st, out);
    free(bytes);
    free(mbytes);
    /* another model shape: --dim 48 instead of 32 */
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 48 --batch-size 32 --quiet --resume %s", train_cpu,
                 small_data(), src);
    expect_error(out, st, 1, "mlp_data0-320_epoch1");
    CHECK(strstr(out, "model") != NULL);
    /* --init with weights of another shape names the tensor */
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 48 --batch-size 32 --quiet --init %s", train_cpu,
                 small_data(), src);
    expect_error(out, st, 1, "fc1.weight");
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --resume %s/missing", train_cpu, small_data(), tmpdir);
    expect_error(out, st, 1, "cannot read checkpoint '");
}

/* One run at a time in a --save-dir: a second is refused before it trains,
   naming the folder and the process that holds it (two runs of one folder
   once left checkpoints with one run's weights and the other's optimizer
   state, and torn files that --resume took). The lock goes with the
   process: runs one after the other both save. */
TEST(a_second_run_in_a_save_dir_in_use_is_refused_naming_the_holder, QUICK) {
    char out[16384], dir[700], lock[800], want[128];
    snprintf(dir, sizeof dir, "%s/busy", tmpdir);
    for (int k = 0; k < 2; k++) {
        int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --save-dir %s", train_cpu, small_data(), dir);
        CHECKF(st == 0, "run %d of two, one after the other, in one --save-dir: exit %d\n%s", k + 1, st, out);
    }
    /* a run holds it (this test, as a run does: the lock, and its pid in the file) */
    snprintf(lock, sizeof lock, "%s/.dtrain.lock", dir);
    int fd = open(lock, O_RDWR | O_CREAT, 0644);
    CHECK(fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0);
    snprintf(want, sizeof want, "%d\n", (int)getpid());
    CHECK(ftruncate(fd, 0) == 0 && pwrite(fd, want, strlen(want), 0) == (ssize_t)strlen(want));
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --save-dir %s", train_cpu, small_data(), dir);
    expect_error(out, st, 1, "is in use by another run");
    snprintf(want, sizeof want, "(process %d)", (int)getpid());
    CHECKF(strstr(out, dir) && strstr(out, want), "the refusal names neither the folder nor process %d:\n%s", (int)getpid(), out);
    CHECKF(!strstr(out, "step "), "the refused run trained first:\n%s", out);
    /* and so is a whole job's rank 0 */
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --nproc 2 --timeout 30 --save-dir %s",
                 stage_bin("03-ddp"), small_data(), dir);
    expect_error(out, st, 1, "is in use by another run");
    close(fd);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --save-dir %s", train_cpu, small_data(), dir);
    CHECKF(st == 0, "the folder let go: exit %d\n%s", st, out);
}

/* A file of the user's in a checkpoint folder (a tokenizer, notes) goes on
   with the newest checkpoint of that name: it once went to NAME.old with the
   first save after it, and the second failed after training ('Directory not
   empty'), leaving NAME.tmp. */
TEST(a_file_of_the_users_in_a_checkpoint_folder_stays_with_it, QUICK) {
    char out[16384], dir[700], notes[800], path[800];
    snprintf(dir, sizeof dir, "%s/kept", tmpdir);
    const char *run = "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 3 --save-dir %s";
    int st = run_cmd(out, sizeof out, run, train_cpu, small_data(), dir);
    CHECKF(st == 0, "the first run: exit %d\n%s", st, out);
    snprintf(notes, sizeof notes, "%s/mlp_data0-320_step3/notes.txt", dir);
    write_bytes(notes, "x\n", 2);
    for (int k = 0; k < 2; k++) {
        st = run_cmd(out, sizeof out, run, train_cpu, small_data(), dir);
        CHECKF(st == 0, "save %d after the user's file went in: exit %d\n%s", k + 1, st, out);
        char *text = read_text(notes);
        CHECKF(text && !strcmp(text, "x\n"), "after save %d the user's file is %s", k + 1, text ? "changed" : "gone from the checkpoint");
        free(text);
        snprintf(path, sizeof path, "%s/mlp_data0-320_step3/model.safetensors", dir);
        CHECKF(access(path, F_OK) == 0, "after save %d the checkpoint has no weights", k + 1);
        snprintf(path, sizeof path, "%s/mlp_data0-320_step3.old", dir);
        CHECKF(access(path, F_OK) != 0, "after save %d %s is left", k + 1, path);
        snprintf(path, sizeof path, "%s/mlp_data0-320_step3.tmp", dir);
        CHECKF(access(path, F_OK) != 0, "after save %d %s is left", k + 1, path);
    }
}

/* --resume auto passes over a newest checkpoint that is not whole (a file
   cut short, a header garbled) for the newest one that is, saying which and
   why: it once stopped at the damaged one, and offered nothing. When none is
   whole it stops rather than start afresh over them. */
TEST(resume_auto_passes_over_a_damaged_newest_checkpoint_saying_so, QUICK) {
    char out[16384], dir[700], file[800], cmd[4000];
    snprintf(dir, sizeof dir, "%s/saves", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 3 --save-dir %s", train_cpu, small_data(), dir);
    CHECKF(st == 0, "the run: exit %d\n%s", st, out);
    size_t n = 0;
    snprintf(file, sizeof file, "%s/mlp_data0-320_epoch3/model.safetensors", dir);
    unsigned char *bytes = read_bytes(file, &n);
    CHECK(bytes != NULL);
    if (!bytes) return;
    write_bytes(file, bytes, n / 2);                          /* cut short */
    snprintf(cmd, sizeof cmd, "%s --data %s " SMALL_FLAGS " --epochs 4 --save-dir %s --resume auto", train_cpu, small_data(), dir);
    st = run_cmd(out, sizeof out, "%s", cmd);
    CHECKF(st == 0, "resumed past the cut checkpoint: exit %d\n%s", st, out);
    CHECKF(strstr(out, "passing over '") && strstr(out, "epoch3'") && strstr(out, "truncated"),
           "no word of the checkpoint passed over, and why:\n%s", out);
    CHECKF(strstr(out, "resuming '") && strstr(out, "epoch2' (step 20), the newest whole checkpoint"),
           "no word of the checkpoint taken instead:\n%s", out);
    /* every checkpoint damaged (headers garbled): an error, not a fresh start */
    for (int e = 1; e <= 4; e++) {
        snprintf(file, sizeof file, "%s/mlp_data0-320_epoch%d/model.safetensors", dir, e);
        size_t m = 0;
        unsigned char *b = read_bytes(file, &m);
        if (!b) continue;
        memset(b + 8, '#', 16);
        write_bytes(file, b, m);
        free(b);
    }
    st = run_cmd(out, sizeof out, "%s", cmd);
    expect_error(out, st, 1, "no checkpoint in '");
    CHECKF(strstr(out, "is whole"), "the refusal does not say why:\n%s", out);
    free(bytes);
}

TEST(failed_save_keeps_the_previous_checkpoint, QUICK) {
    char out[16384], dir[600], ck[700], p[800];
    snprintf(dir, sizeof dir, "%s/keep", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --save-dir %s", train_cpu, small_data(), dir);
    CHECKF(st == 0, "%s", out);
    snprintf(ck, sizeof ck, "%s/mlp_data0-320_epoch1/model.safetensors", dir);
    size_t n0 = 0, n1 = 0;
    unsigned char *before = read_bytes(ck, &n0);
    CHECK(before != NULL && n0 > 100000);
    /* the same run with another seed, under a 100 KB file-size limit: the new
       checkpoint cannot be written whole */
    st = run_cmd(out, sizeof out, "sh -c 'ulimit -f 200; exec %s --data %s " SMALL_FLAGS " --epochs 1 --seed 9 --save-dir %s'",
                 train_cpu, small_data(), dir);
    expect_error(out, st, 1, "mlp_data0-320_epoch1");
    unsigned char *after = read_bytes(ck, &n1);
    CHECK(after && n0 == n1 && memcmp(before, after, n0) == 0);
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch1.tmp", dir);
    struct stat sb;
    CHECKF(stat(p, &sb) != 0, "the partial folder %s was left behind", p);
    free(before);
    free(after);
}

/* A copy of safetensors file src at dst (src may be dst), its metadata `key`
   set to `value` (key NULL: as it was) and, when nan_in names a tensor, a NaN
   (or `x`, with rewrite_value) at its element 12; of a checkpoint folder, the
   folder copied and its weights file so rewritten. Returns whether the key was
   there. */
static int rewrite_value(const char *src, const char *dst, const char *key, const char *value, const char *nan_in, float x);
static int rewrite_checkpoint(const char *src, const char *dst, const char *key, const char *value, const char *nan_in) {
    return rewrite_value(src, dst, key, value, nan_in, NAN);
}
static int rewrite_value(const char *src, const char *dst, const char *key, const char *value, const char *nan_in, float x) {
    struct stat sb;
    if (stat(src, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        char out[4096], a[800], b[800];
        int st = run_cmd(out, sizeof out, "sh -c 'rm -rf %s && cp -r %s %s'", dst, src, dst);
        CHECKF(st == 0, "copying %s: %s", src, out);
        snprintf(a, sizeof a, "%s/model.safetensors", src);
        snprintf(b, sizeof b, "%s/model.safetensors", dst);
        return rewrite_value(a, b, key, value, nan_in, x);
    }
    dt_safetensors *st = dt_safetensors_read(src);
    const char **meta = (const char **)calloc(2 * (size_t)st->nmeta + 1, sizeof *meta);
    int found = 0;
    for (int i = 0; i < st->nmeta; i++) {
        int hit = key && !strcmp(st->meta[2 * i], key);
        found |= hit;
        meta[2 * i] = st->meta[2 * i];
        meta[2 * i + 1] = hit ? value : st->meta[2 * i + 1];
    }
    dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)st->n + 1, sizeof *t);
    float **data = (float **)calloc((size_t)st->n + 1, sizeof *data);
    for (int i = 0; i < st->n; i++) {
        dt__st_tensor *s = &st->t[i];
        size_t n = (size_t)(s->end - s->begin) / 4;
        data[i] = (float *)malloc(n * 4 + 64);
        memcpy(data[i], st->buf + st->data_start + s->begin, n * 4);
        if (nan_in && !strcmp(s->name, nan_in) && n > 12) data[i][12] = x;
        t[i].name = s->name; t[i].data = data[i]; t[i].ndim = s->ndim;
        for (int d = 0; d < s->ndim && d < 4; d++) t[i].shape[d] = s->shape[d];
    }
    dt_safetensors_write(dst, t, st->n, meta, st->nmeta);
    for (int i = 0; i < st->n; i++) free(data[i]);
    free(data); free(t); free(meta);
    dt_safetensors_close(st);
    return found;
}

/* A checkpoint 3 steps into a 2-epoch run of stage 01 (10 steps an epoch), made once. */
static int make_short_checkpoint(const char *dir) {
    char out[8192];
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --steps 3 --save-dir %s", train_cpu,
                     small_data(), dir);
    CHECKF(st == 0, "the short run: exit %d\n%s", st, out);
    return st == 0;
}
static const char *short_checkpoint(void) {
    static char dir[600], path[700];
    snprintf(path, sizeof path, "%s/mlp_data0-320_step3", shared(dir, sizeof dir, "short", make_short_checkpoint));
    return path;
}

/* Every number in a checkpoint's metadata is read whole and in range, or the
   resume stops naming the file and the field: atoi took "-5" and "abc" (as 0)
   and resumed from a position that never was. */
TEST(corrupt_checkpoint_metadata_is_refused_naming_the_field, QUICK) {
    char out[16384], bad[700], want[1024], which[128];
    const char *ck = short_checkpoint();
    char bad_weights[800];
    snprintf(bad, sizeof bad, "%s/meta", tmpdir);
    snprintf(bad_weights, sizeof bad_weights, "%s/model.safetensors", bad);
    CHECK(rewrite_checkpoint(ck, bad, NULL, NULL, NULL) == 0);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --resume %s", train_cpu, small_data(), bad);
    CHECKF(st == 0, "the checkpoint as it was, rewritten: exit %d\n%s", st, out);
    static const struct { const char *key, *value; } cases[] = {
        { "epoch", "-5" }, { "epoch", "4" }, { "epoch", "" }, { "step", "abc" }, { "step", "3.5" }, { "step", " 3" },
        { "step", "99999999999999999999" }, { "optimizer_step", "-1" }, { "optimizer_step", "99" },
        { "batch_in_epoch", "10" }, { "batch_in_epoch", "x" }, { "world_size", "0" }, { "batch_size", "-32" },
        { "batch_size", "32abc" }, { "accum_steps", "0" }, { "seed", "-1" }, { "seed", "1e3" },
        { "data_range", "0,abc" }, { "data_range", "320" }, { "data_range", "320,0" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECKF(rewrite_checkpoint(ck, bad, cases[i].key, cases[i].value, NULL), "no '%s' in %s", cases[i].key, ck);
        st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --resume %s", train_cpu, small_data(), bad);
        snprintf(want, sizeof want, "'%s': metadata '%s' is '%s', not ", bad_weights, cases[i].key, cases[i].value);
        snprintf(which, sizeof which, "%s '%s'", cases[i].key, cases[i].value);
        expect_error_in(which, out, st, 1, want);
    }
    /* fp16's loss scale and a sharded checkpoint's layout: stage 05, one rank */
    char dir[600], ck05[700], index[760], shard[760];
    const char *flags05 = "--image-size 16 --dim 32 --batch-size 32 --log-every 1000 --quiet --dtype fp16 --epochs 2";
    snprintf(dir, sizeof dir, "%s/short05", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s %s --steps 2 --save-dir %s", stage_bin("05-accum-mixed-precision"),
                 small_data(), flags05, dir);
    CHECKF(st == 0, "05 --dtype fp16: exit %d\n%s", st, out);
    snprintf(ck05, sizeof ck05, "%s/mlp_data0-320_step2", dir);
    snprintf(index, sizeof index, "%s/shards.safetensors", ck05);
    snprintf(shard, sizeof shard, "%s/shard0-of-1.safetensors", ck05);
    static const struct { const char *key, *value; int in_shard; } sharded[] = {
        { "loss_scale", "-1", 0 }, { "loss_scale", "nan", 0 }, { "loss_scale", "big", 0 },
        { "loss_scale_good_steps", "-2", 0 }, { "skipped_steps", "x", 0 }, { "skipped_steps", "3", 0 },
        { "shards", "abc", 0 }, { "shards", "0", 0 }, { "shard.0.bytes", "12abc", 0 }, { "rank", "x", 1 },
    };
    for (size_t i = 0; i < sizeof sharded / sizeof sharded[0]; i++) {
        const char *file = sharded[i].in_shard ? shard : index;
        char keep[800];
        snprintf(keep, sizeof keep, "%s.keep", file);
        CHECK(rename(file, keep) == 0);
        CHECKF(rewrite_checkpoint(keep, file, sharded[i].key, sharded[i].value, NULL), "no '%s' in %s", sharded[i].key, file);
        st = run_cmd(out, sizeof out, "%s --data %s %s --resume %s", stage_bin("05-accum-mixed-precision"), small_data(),
                     flags05, ck05);
        snprintf(want, sizeof want, "'%s': metadata '%s' is '%s', not ", file, sharded[i].key, sharded[i].value);
        snprintf(which, sizeof which, "%s '%s'", sharded[i].key, sharded[i].value);
        expect_error_in(which, out, st, 1, want);
        CHECK(rename(keep, file) == 0);
    }
    /* tools/consolidate builds the model the index describes */
    char keep[800];
    snprintf(keep, sizeof keep, "%s.keep", index);
    CHECK(rename(index, keep) == 0);
    CHECK(rewrite_checkpoint(keep, index, "model_config", "3,16,x,32,2,3,4,128", NULL));
    st = run_cmd(out, sizeof out, "%s %s %s/never", build_path("tools/consolidate"), ck05, tmpdir);
    expect_error(out, st, 1, "metadata 'model_config' is '3,16,x,32,2,3,4,128', not mlp's 8 numbers");
    CHECK(rename(keep, index) == 0);
}

/* A NaN in the --init weights is named where it is, not left to surface as a
   NaN loss that blames --lr. */
TEST(init_weights_holding_nan_are_refused_naming_the_tensor, QUICK) {
    char out[16384], w[700];
    snprintf(w, sizeof w, "%s/nan", tmpdir);
    CHECK(rewrite_checkpoint(short_checkpoint(), w, NULL, NULL, "fc3.weight") == 0);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --init %s", train_cpu, small_data(), w);
    expect_error(out, st, 1, "tensor 'fc3.weight' holds NaN/Inf at index 12");
    CHECKF(strstr(out, w) != NULL, "the error does not name the file:\n%s", out);
}
/* --resume looks at what it read as --init does: NaN or Inf in the weights
   or the moments, and a negative AdamW second moment, are refused naming the
   tensor (they were taken, and the run then failed blaming --lr). */
TEST(resumed_state_holding_nan_inf_or_a_negative_second_moment_is_refused, QUICK) {
    char out[16384], dir[700], file[800];
    static const struct { const char *file, *tensor; float x; const char *says; } cases[] = {
        { "model.safetensors", "fc3.weight", NAN, "tensor 'fc3.weight' holds NaN at index 12" },
        { "optimizer.safetensors", "exp_avg.fc1.weight", INFINITY, "tensor 'exp_avg.fc1.weight' holds Inf at index 12" },
        { "optimizer.safetensors", "exp_avg_sq.fc2.bias", -1.0f, "tensor 'exp_avg_sq.fc2.bias' is -1 at index 12, but AdamW's second moment" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        snprintf(dir, sizeof dir, "%s/bad%zu", tmpdir, c);
        int st = run_cmd(out, sizeof out, "sh -c 'rm -rf %s && cp -r %s %s'", dir, short_checkpoint(), dir);
        CHECKF(st == 0, "copying the checkpoint: %s", out);
        snprintf(file, sizeof file, "%s/%s", dir, cases[c].file);
        rewrite_value(file, file, NULL, NULL, cases[c].tensor, cases[c].x);
        st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --resume %s", train_cpu, small_data(), dir);
        expect_error_in(cases[c].tensor, out, st, 1, cases[c].says);
    }
    /* the checkpoint as saved resumes */
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --resume %s", train_cpu, small_data(), short_checkpoint());
    CHECKF(st == 0, "the checkpoint as saved: exit %d\n%s", st, out);
}

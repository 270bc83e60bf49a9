/* tests/21-data.c -- tests of dtrain.h's chapter 21-data: images, CIFAR-10,
   text, instruction data, bad data. (tests/helpers.h: how the suite's files
   make one program.) */
#include "helpers.h"

/* ---- data ---------------------------------------------------------------- */

TEST(sampler_shuffles_shards_and_pads_like_distributed_sampler, QUICK) {
    int64_t a[16], b[16], c[16];
    int64_t n = dt_sampler_indices(10, 7, 0, 1, 0, 1, a);
    int seen[10] = { 0 }, perm_ok = n == 10;
    for (int i = 0; i < 10; i++) if (a[i] >= 0 && a[i] < 10) seen[a[i]]++;
    for (int i = 0; i < 10; i++) perm_ok &= seen[i] == 1;
    CHECK(perm_ok);
    dt_sampler_indices(10, 7, 0, 1, 0, 1, b);
    CHECK(memcmp(a, b, sizeof(int64_t) * 10) == 0);              /* same seed and epoch: same order */
    dt_sampler_indices(10, 7, 1, 1, 0, 1, c);
    CHECK(memcmp(a, c, sizeof(int64_t) * 10) != 0);              /* next epoch: another order */
    /* unshuffled, 3 ranks: [0..9] padded with [0 1], rank r takes r, r+3, ... */
    int64_t want[3][4] = { { 0, 3, 6, 9 }, { 1, 4, 7, 0 }, { 2, 5, 8, 1 } };
    for (int r = 0; r < 3; r++) {
        CHECK(dt_sampler_indices(10, 7, 0, 0, r, 3, a) == 4);
        CHECK(memcmp(a, want[r], sizeof want[r]) == 0);
    }
    /* shuffled, 4 ranks: the ranks' shards are the epoch's permutation dealt out */
    int64_t full[12], shard[3];
    dt_sampler_indices(12, 3, 2, 1, 0, 1, full);
    int dealt = 1;
    for (int r = 0; r < 4; r++) {
        dt_sampler_indices(12, 3, 2, 1, r, 4, shard);
        for (int i = 0; i < 3; i++) dealt &= shard[i] == full[r + 4 * i];
    }
    CHECK(dealt);
}

TEST(dataset_slice_and_loader_batches, QUICK) {
    dt_dataset ds;
    memset(&ds, 0, sizeof ds);
    dt__dataset_alloc(&ds, 10, 4, 2);
    for (int i = 0; i < 10; i++) { ds.labels[i] = i; memset(ds.pixels + i * 48, i * 20, 48); }
    ds.class_names[0] = strdup("a"); ds.class_names[1] = strdup("b");
    dt_dataset_slice(&ds, 3, 8);
    CHECK(ds.n == 5 && ds.labels[0] == 3 && ds.labels[4] == 7 && ds.pixels[0] == 60);
    dt_loader l = dt_loader_create(&ds, 2, 1, 0, 0, 1, 0, 1);
    CHECK(dt_loader_batches_per_epoch(&l) == 2);                  /* drop_last: 5 -> 2 batches of 2 */
    dt_loader_start_epoch(&l, 0, 1);                              /* resume: skip the first batch */
    dt_batch b;
    dt_step_arena_reset();
    CHECK(dt_loader_next(&l, &b) && b.size == 2 && b.labels[0] == 5 && b.labels[1] == 6);
    CHECK(CLOSE(b.inputs->data[0], 100 / 127.5 - 1, 1e-6));       /* pixels scaled to [-1, 1] */
    CHECK(!dt_loader_next(&l, &b));
    dt_loader_free(&l);
    /* augmentation depends on (seed, epoch, image), not on the position in the batch */
    dt_loader a1 = dt_loader_create(&ds, 5, 9, 1, 1, 0, 0, 1), a2 = dt_loader_create(&ds, 1, 9, 1, 1, 0, 0, 1);
    dt_loader_start_epoch(&a1, 3, 0);
    dt_loader_start_epoch(&a2, 3, 2);
    dt_batch big, one;
    dt_loader_next(&a1, &big);
    dt_loader_next(&a2, &one);
    CHECK(one.labels[0] == big.labels[2] && memcmp(one.inputs->data, big.inputs->data + 2 * 48, 48 * sizeof(float)) == 0);
    dt_loader_free(&a1);
    dt_loader_free(&a2);
    dt_dataset_free(&ds);
}

/* What the header fills in for a caller starts empty, whatever the caller's
   memory held. --bench built its images in a dt_dataset that main() declared
   and never initialised, then read its tokens field: at -O2 a stale value
   sent the images to the text loader ("input has 0 features"). Each struct
   here is first filled with 0xA5, as a used stack might be. */
static void poison(void *p, size_t n) { memset(p, 0xA5, n); }
TEST(filled_structs_start_empty_whatever_the_caller_held, QUICK) {
    const char *models[2] = { "mlp", "gpt" };
    for (int k = 0; k < 2; k++) {
        char *argv[] = { "train", "--bench", "--model", (char *)models[k], "--device", "cpu", "--batch-size", "4", "--quiet" };
        dt_config cfg = dt_parse_args((int)(sizeof argv / sizeof argv[0]), argv, "01-single-gpu");
        dt_dataset train, val;
        poison(&train, sizeof train);
        poison(&val, sizeof val);
        dt_load_data(&cfg, &train, &val);
        int filled = k ? train.pixels == NULL && train.tokens && train.n == 16 && train.num_classes == 256
                       : train.tokens == NULL && train.pixels && train.n == 16 && train.channels == 3 && train.size == 32;
        CHECKF(filled, "--bench --model %s: n %lld, tokens %p, pixels %p", models[k], (long long)train.n,
               (void *)train.tokens, (void *)train.pixels);
        CHECKF(val.n == 0 && !val.pixels && !val.labels && !val.tokens && !val.class_names && !val.source[0],
               "--bench --model %s: the validation set is not empty", models[k]);
        if (!filled) continue;               /* its stale pointers cannot be freed or read */
        dt_loader l;
        poison(&l, sizeof l);
        l = dt_loader_create(&train, 4, 1, 1, 0, 1, 0, 1);
        dt_loader_start_epoch(&l, 0, 0);
        dt_batch b;
        poison(&b, sizeof b);
        dt_step_arena_reset();
        CHECK(dt_loader_next(&l, &b) && b.size == 4 && b.inputs->shape[0] == 4);
        /* what the model is given: 3 x 32 x 32 = 3072 features an image, or 64 tokens a row */
        CHECKF(b.inputs->numel == (k ? 4 * 64 : 4 * 3072), "--model %s: a batch of %lld numbers", models[k],
               (long long)b.inputs->numel);
        dt_loader_free(&l);
        dt_dataset_free(&train);
        dt_dataset_free(&val);
    }
    dt_link link;
    poison(&link, sizeof link);
    CHECK(!dt_link_preset("carrier-pigeon", &link) && !link.name[0] && link.bandwidth_gbs == 0 && link.latency_us == 0);
}

TEST(images_decode_convert_and_resize, QUICK) {
    char path[600], err[256];
    /* PPM, 2x2: red, blue / green, white -> channels first */
    snprintf(path, sizeof path, "%s/four.ppm", tmpdir);
    const char ppm[] = "P6\n# a comment\n2 2\n255\n\xff\x00\x00\x00\x00\xff\x00\xff\x00\xff\xff\xff";
    write_bytes(path, ppm, sizeof ppm - 1);
    uint8_t *px = dt_image_load_rgb(path, 2, err, sizeof err);
    uint8_t want_ppm[12] = { 255, 0, 0, 255, /* R */ 0, 0, 255, 255, /* G */ 0, 255, 0, 255 /* B */ };
    CHECKF(px != NULL, "%s", err);
    if (px) { CHECK(memcmp(px, want_ppm, 12) == 0); free(px); }
    /* PGM grey becomes three equal channels; 16-bit values are scaled */
    snprintf(path, sizeof path, "%s/grey.pgm", tmpdir);
    const char pgm[] = "P5 1 1 65535\n\x80\x00";
    write_bytes(path, pgm, sizeof pgm - 1);
    px = dt_image_load_rgb(path, 1, err, sizeof err);
    CHECKF(px != NULL, "%s", err);
    if (px) { CHECK(px[0] == 127 && px[1] == 127 && px[2] == 127); free(px); }
    /* ASCII PPM */
    snprintf(path, sizeof path, "%s/ascii.ppm", tmpdir);
    const char p3[] = "P3 1 1 15 15 0 5";
    write_bytes(path, p3, sizeof p3 - 1);
    px = dt_image_load_rgb(path, 1, err, sizeof err);
    CHECKF(px != NULL, "%s", err);
    if (px) { CHECK(px[0] == 255 && px[1] == 0 && px[2] == 85); free(px); }
    /* bilinear, pixel centres aligned: [0 255] -> [0 64 191 255] (PyTorch: 0, 63.75, 191.25, 255) */
    uint8_t src[2] = { 0, 255 }, dst[4];
    dt_image_resize(src, 1, 2, 1, dst, 4, 1);
    CHECK(dst[0] == 0 && dst[1] == 64 && dst[2] == 191 && dst[3] == 255);
    uint8_t flat[3 * 5 * 7], small[3 * 3 * 3];
    memset(flat, 77, sizeof flat);
    dt_image_resize(flat, 3, 7, 5, small, 3, 3);
    int same = 1;
    for (size_t i = 0; i < sizeof small; i++) same &= small[i] == 77;
    CHECK(same);
}

TEST(broken_images_are_refused_with_a_reason, QUICK) {
    char path[600], err[256];
    snprintf(path, sizeof path, "%s/short.ppm", tmpdir);
    const char ppm[] = "P6\n4 4\n255\n\x01\x02\x03";
    write_bytes(path, ppm, sizeof ppm - 1);
    CHECK(dt_image_load_rgb(path, 4, err, sizeof err) == NULL && strstr(err, "truncated"));
    snprintf(path, sizeof path, "%s/bad-header.ppm", tmpdir);
    write_bytes(path, "P6 0 0 255\n", 11);
    CHECK(dt_image_load_rgb(path, 4, err, sizeof err) == NULL && strstr(err, "corrupt"));
    snprintf(path, sizeof path, "%s/notes.txt", tmpdir);
    write_bytes(path, "just some text\n", 15);
    CHECK(dt_image_load_rgb(path, 4, err, sizeof err) == NULL && strstr(err, "not a"));
    snprintf(path, sizeof path, "%s/empty.png", tmpdir);
    write_bytes(path, "", 0);
    CHECK(dt_image_load_rgb(path, 4, err, sizeof err) == NULL && strstr(err, "empty"));
}

TEST(png_alpha_and_grey_become_rgb, QUICK) {
#ifndef DT_HAVE_STB
    SKIP("built without stb_image (libstb-dev): PPM/PGM only");
#else
    char path[600], err[256];
    uint8_t *px;
    /* PNG with alpha becomes RGB (alpha dropped); a 4x4 grey PNG is resized to 2x2 */
    uint8_t rgba[4 * 4] = { 10, 20, 30, 40, 50, 60, 70, 0, 1, 2, 3, 255, 4, 5, 6, 128 };
    snprintf(path, sizeof path, "%s/rgba.png", tmpdir);
    stbi_write_png(path, 2, 2, 4, rgba, 8);
    px = dt_image_load_rgb(path, 2, err, sizeof err);
    uint8_t want_rgba[12] = { 10, 50, 1, 4, 20, 60, 2, 5, 30, 70, 3, 6 };
    CHECKF(px != NULL, "%s", err);
    if (px) { CHECK(memcmp(px, want_rgba, 12) == 0); free(px); }
    uint8_t grey[16];
    memset(grey, 200, sizeof grey);
    snprintf(path, sizeof path, "%s/grey.png", tmpdir);
    stbi_write_png(path, 4, 4, 1, grey, 4);
    px = dt_image_load_rgb(path, 2, err, sizeof err);
    CHECKF(px != NULL, "%s", err);
    if (px) { CHECK(px[0] == 200 && px[4] == 200 && px[11] == 200); free(px); }
#endif
}

TEST(truncated_or_garbled_png_and_jpeg_are_refused, QUICK) {
#ifndef DT_HAVE_STB
    SKIP("built without stb_image (libstb-dev): PPM/PGM only");
#else
    char path[600], err[256];
    uint8_t rgb[3 * 8 * 8];
    for (size_t i = 0; i < sizeof rgb; i++) rgb[i] = (uint8_t)(i * 37);
    snprintf(path, sizeof path, "%s/whole.png", tmpdir);
    stbi_write_png(path, 8, 8, 3, rgb, 24);
    size_t n = 0;
    unsigned char *png = read_bytes(path, &n);
    snprintf(path, sizeof path, "%s/cut.png", tmpdir);
    write_bytes(path, png, n - 20);                                /* cut inside the data */
    CHECKF(dt_image_load_rgb(path, 8, err, sizeof err) == NULL, "a truncated PNG was accepted");
    write_bytes(path, png, n - 12);                                /* only the IEND chunk lost */
    CHECKF(dt_image_load_rgb(path, 8, err, sizeof err) == NULL && strstr(err, "truncated"), "a PNG without IEND was accepted");
    snprintf(path, sizeof path, "%s/whole.jpg", tmpdir);
    stbi_write_jpg(path, 8, 8, 3, rgb, 90);
    size_t jn = 0;
    unsigned char *jpg = read_bytes(path, &jn);
    uint8_t *whole = dt_image_load_rgb(path, 8, err, sizeof err);
    CHECKF(jpg && whole, "a whole JPEG was refused: %s", err);
    free(whole);
    snprintf(path, sizeof path, "%s/cut.jpg", tmpdir);
    write_bytes(path, jpg, jn * 2 / 3);                            /* stb would fill the rest with grey */
    CHECKF(dt_image_load_rgb(path, 8, err, sizeof err) == NULL && strstr(err, "truncated"), "a truncated JPEG was accepted");
    free(jpg);
    for (size_t i = 40; i < n - 16; i++) png[i] ^= 0x5A;           /* scramble the compressed data */
    snprintf(path, sizeof path, "%s/garbled.png", tmpdir);
    write_bytes(path, png, n);
    CHECKF(dt_image_load_rgb(path, 8, err, sizeof err) == NULL, "a corrupt PNG was accepted");
    free(png);
#endif
}

TEST(cifar10_binary_batches_load, QUICK) {
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s/cifar", tmpdir);
    mkdir(dir, 0755);
    /* five training batches of 2 records and a test batch of 1: label byte, then R, G, B planes */
    unsigned char rec[2 * 3073];
    for (int f = 0; f <= 5; f++) {
        int n = f < 5 ? 2 : 1;
        for (int r = 0; r < n; r++) {
            rec[r * 3073] = (unsigned char)((f * 2 + r) % 10);
            for (int i = 0; i < 3072; i++) rec[r * 3073 + 1 + i] = (unsigned char)(i / 1024 * 100 + f);
        }
        if (f < 5) snprintf(p, sizeof p, "%s/data_batch_%d.bin", dir, f + 1);
        else snprintf(p, sizeof p, "%s/test_batch.bin", dir);
        write_bytes(p, rec, (size_t)n * 3073);
    }
    dt_dataset train, val;
    dt_dataset_load(dir, "train", 32, NULL, &train);
    dt_dataset_load(dir, "val", 16, &train, &val);
    CHECK(train.n == 10 && train.num_classes == 10 && !strcmp(train.class_names[3], "cat"));
    CHECK(train.labels[0] == 0 && train.labels[3] == 3 && train.labels[9] == 9);
    /* image 4 is file 3 (f = 2): R plane 2, G plane 102, B plane 202 */
    CHECK(train.pixels[4 * 3072] == 2 && train.pixels[4 * 3072 + 1024] == 102 && train.pixels[4 * 3072 + 2047] == 102 &&
          train.pixels[4 * 3072 + 3071] == 202);
    CHECK(val.n == 1 && val.size == 16 && val.pixels[0] == 5 && val.pixels[256] == 105);  /* resized to 16x16 */
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    /* a truncated batch is named */
    snprintf(p, sizeof p, "%s/data_batch_3.bin", dir);
    write_bytes(p, rec, 3000);
    char out[4096];
    int st = run_cmd(out, sizeof out, "%s --data %s --quiet --batch-size 2", train_cpu, dir);
    expect_error(out, st, 1, "data_batch_3.bin");
}

/* A small generated text: 5,700 bytes, of which the first 5,130 are training
   (320 sequences of 16) and the rest validation. */
#define GPT_FLAGS "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --log-every 1000 --quiet"
static int make_gpt_text(const char *path) {
    dt_synthetic_text_write(path, 5700, 11);
    FILE *f = fopen(path, "r+b");                /* exactly 5,700 bytes: the generator stops after a sentence */
    int ok = f && ftruncate(fileno(f), 5700) == 0;
    if (f) fclose(f);
    return ok;
}
static const char *gpt_text(void) { static char path[600]; return shared(path, sizeof path, "small.txt", make_gpt_text); }

TEST(text_data_splits_by_position_and_refuses_bad_files, QUICK) {
    char path[700], dir[600], out[16384];
    /* bytes: 100 tokens, the last 10 are validation; sequences of 8 overlap by one token */
    unsigned char text[100];
    for (int i = 0; i < 100; i++) text[i] = (unsigned char)('a' + i % 26);
    snprintf(path, sizeof path, "%s/t.txt", tmpdir);
    write_bytes(path, text, 100);
    dt_dataset tr, va;
    dt_text_load(path, 0, 0, 8, 0.1, &tr, &va);
    CHECK(tr.ntokens == 90 && va.ntokens == 10 && tr.n == 11 && va.n == 1 && tr.num_classes == 256);
    CHECK(tr.tokens[0] == 'a' && va.tokens[0] == text[90]);
    dt_loader l = dt_loader_create(&tr, 2, 0, 0, 0, 1, 1, 2);         /* rank 1 of 2: sequences 1, 3, ... */
    dt_loader_start_epoch(&l, 0, 0);
    dt_batch b;
    dt_step_arena_reset();
    CHECK(dt_loader_next(&l, &b) && b.inputs->shape[0] == 2 && b.inputs->shape[1] == 8);
    CHECK(b.inputs->data[0] == text[8] && b.labels[0] == text[9] && b.labels[7] == text[16] && b.inputs->data[8] == text[24]);
    dt_loader_free(&l);
    dt_dataset_slice(&tr, 2, 5);                                       /* --start-idx 2 --end-idx 5 */
    CHECK(tr.n == 3 && tr.ntokens == 25 && tr.tokens[0] == text[16] && tr.tokens[24] == text[40]);
    /* the unigram baseline: train predicts "ab" -> p(a) = (1+1)/(2+2), p(b) = 2/4; eval "xab" scores -ln(1/2) */
    dt_dataset u1, u2;
    memset(&u1, 0, sizeof u1); memset(&u2, 0, sizeof u2);
    int32_t t1[3] = { 2, 0, 1 }, t2[3] = { 1, 0, 1 };
    u1.tokens = t1; u1.ntokens = 3; u1.num_classes = 2;
    u2.tokens = t2; u2.ntokens = 3; u2.num_classes = 2;
    CHECK(CLOSE(dt_unigram_loss(&u1, &u2), log(2.0), 1e-12));
    dt_dataset_free(&tr); dt_dataset_free(&va);
    /* a folder of .txt files joins them in name order; other files are left out */
    snprintf(dir, sizeof dir, "%s/texts", tmpdir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/b.txt", dir); write_bytes(path, text + 50, 50);
    snprintf(path, sizeof path, "%s/a.txt", dir); write_bytes(path, text, 50);
    snprintf(path, sizeof path, "%s/notes.md", dir); write_bytes(path, "zzzz", 4);
    dt_text_load(dir, 0, 0, 8, 0.1, &tr, &va);
    CHECK(tr.ntokens == 90 && tr.tokens[49] == text[49] && tr.tokens[50] == text[50] && va.tokens[9] == text[99]);
    dt_dataset_free(&tr); dt_dataset_free(&va);
    /* token ids: uint16 little-endian; the vocabulary is the largest + 1 unless given */
    uint16_t ids[300];
    for (int i = 0; i < 300; i++) ids[i] = (uint16_t)(i * 37 % 1000);
    snprintf(path, sizeof path, "%s/ids.bin", tmpdir);
    write_bytes(path, ids, sizeof ids);
    dt_text_load(path, 1, 0, 16, 0.1, &tr, &va);
    CHECK(tr.num_classes == 999 + 1 && tr.ntokens == 270 && tr.tokens[1] == 37 && va.tokens[0] == ids[270]);
    dt_dataset_free(&tr); dt_dataset_free(&va);
    /* token ids in a NumPy .npy array (numpy.save): ids past 65,535, as Qwen's and Llama 3's vocabularies have */
    uint32_t big[300], largest = 0;
    for (int i = 0; i < 300; i++) big[i] = (uint32_t)((uint64_t)i * 7919 % 151000);
    for (int i = 0; i < 300; i++) largest = big[i] > largest ? big[i] : largest;
    char npy[700];
    snprintf(npy, sizeof npy, "%s/ids.npy", tmpdir);
    write_npy(npy, "<u4", "(300,)", big, sizeof big, 0);
    dt_text_load(npy, 1, 0, 16, 0.1, &tr, &va);
    CHECKF(tr.num_classes == (int)largest + 1 && largest > 65535 && tr.ntokens == 270 && tr.tokens[1] == 7919 && va.tokens[0] == (int32_t)big[270],
           "uint32 .npy: vocabulary %d, %lld training tokens", tr.num_classes, (long long)tr.ntokens);
    dt_dataset_free(&tr); dt_dataset_free(&va);
    int64_t wide[300];
    for (int i = 0; i < 300; i++) wide[i] = big[i];
    write_npy(npy, "<i8", "(300,)", wide, sizeof wide, 0);
    dt_text_load(npy, 1, 0, 16, 0.1, &tr, &va);
    CHECK(tr.num_classes == (int)largest + 1 && tr.tokens[299 - 30] == (int32_t)big[269] && va.tokens[29] == (int32_t)big[299]);
    dt_dataset_free(&tr); dt_dataset_free(&va);
    int st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --quiet --tokens %s --batch-size 4 "
                     "--steps 2", train_cpu, npy);
    CHECKF(st == 0 && strstr(out, "done: 2 steps"), "--tokens .npy: exit %d\n%s", st, out);
    /* and every malformed one is named */
    static const struct { const char *descr, *shape; int fortran, cut; const char *names; } bad[] = {
        { "<f4", "(300,)", 0, 0, "'<f4'" }, { "<u4", "(300,)", 1, 0, "Fortran" }, { "<u4", "(2, 150)", 0, 0, "one dimension" },
        { "<u4", "(300,)", 0, 3, "truncated" }, { "<u4", "(301,)", 0, 0, "truncated" } };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        write_npy(npy, bad[k].descr, bad[k].shape, big, sizeof big - (size_t)bad[k].cut, bad[k].fortran);
        st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s", train_cpu, npy);
        expect_error(out, st, 1, bad[k].names);
    }
    int32_t neg[300];
    for (int i = 0; i < 300; i++) neg[i] = i == 17 ? -5 : i;
    write_npy(npy, "<i4", "(300,)", neg, sizeof neg, 0);
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s", train_cpu, npy);
    expect_error(out, st, 1, "token 17 is id -5");
    big[3] = 1u << 24;                                                 /* a float holds ids below 2^24 exactly */
    write_npy(npy, "<u4", "(300,)", big, sizeof big, 0);
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s", train_cpu, npy);
    expect_error(out, st, 1, "token 3 is id 16777216");
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s --vocab 1200 --batch-size 4 --steps 2", train_cpu, path);
    CHECKF(st == 0 && strstr(out, "done: 2 steps"), "--tokens: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s --vocab 500 --batch-size 4 --steps 2", train_cpu, path);
    expect_error(out, st, 1, "outside --vocab 500");
    write_bytes(path, ids, 7);                                         /* half a token at the end */
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --tokens %s", train_cpu, path);
    expect_error(out, st, 1, "odd number");
    snprintf(path, sizeof path, "%s/short.txt", tmpdir);
    write_bytes(path, "too short", 9);
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --data %s", train_cpu, path);
    expect_error(out, st, 1, "too few for sequences of --seq-len 16");
    st = run_cmd(out, sizeof out, "%s --model vit --seq-len 16", train_cpu);
    expect_error(out, st, 2, "--seq-len");
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --data %s --tokens %s", train_cpu, gpt_text(), path);
    expect_error(out, st, 2, "--tokens");
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --data %s --vocab 100", train_cpu, gpt_text());
    expect_error(out, st, 2, "--vocab 100");
    st = run_cmd(out, sizeof out, "%s " GPT_FLAGS " --dim 30 --heads 4", train_cpu);
    expect_error(out, st, 2, "--heads 4");
}

/* Instruction examples as a tokenized Hugging Face dataset writes them
   (ds.to_json): 355 of them, so 320 train and 35 validate. A prompt of 1 to
   12 tokens, a separator (1), then the prompt backwards as the answer; labels
   -100 over the prompt and separator; every fifth example right-padded with
   id 2 under attention_mask 0; a text key to pass over. The prompts' lengths
   vary, so batches differ widely in the targets they count. */
static int make_instruction_data(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) { printf("cannot write %s\n", path); exit(1); }
    for (int e = 0; e < 355; e++) {
        int P = 1 + (e * 7) % 12, A = 1 + (e * 5) % (16 - P), pad = e % 5 == 0 ? 3 : 0, ids[40], lab[40], n = 0;
        if (A > P) A = P;
        for (int t = 0; t < P; t++) { ids[n] = 3 + (e * 13 + t * 29) % 37; lab[n++] = DT_IGNORE_INDEX; }
        ids[n] = 1; lab[n++] = DT_IGNORE_INDEX;
        for (int t = 0; t < A; t++) { ids[n] = ids[P - 1 - t]; lab[n] = ids[n]; n++; }
        fprintf(f, "{\"text\":\"example \\\"%d\\\", {not: [json]}\",\"input_ids\":[", e);
        for (int t = 0; t < n + pad; t++) fprintf(f, "%s%d", t ? "," : "", t < n ? ids[t] : 2);
        fprintf(f, "],\"attention_mask\":[");
        for (int t = 0; t < n + pad; t++) fprintf(f, "%s%d", t ? "," : "", t < n);
        fprintf(f, "],\"labels\":[");
        for (int t = 0; t < n + pad; t++) fprintf(f, "%s%d", t ? "," : "", t < n ? lab[t] : DT_IGNORE_INDEX);
        fprintf(f, "]}\n");
    }
    return fclose(f) == 0;
}
static const char *instruction_data(void) {
    static char path[600];
    return shared(path, sizeof path, "instructions.jsonl", make_instruction_data);
}

/* Data that is not what it says: a file named .npy that is not NumPy's was
   read as raw uint16 ids (vocabularies of 32033 and 65513 from random bytes);
   --tokens /dev/zero read until memory ran out; a FIFO among the images hung
   the run forever. Each is refused, naming the file, and nothing blocks. */
TEST(data_files_that_are_not_what_they_claim_are_refused_not_read, QUICK) {
    char out[16384], path[700], set[700], fifo[1100];
    snprintf(path, sizeof path, "%s/random.npy", tmpdir);
    unsigned char noise[100];
    for (int i = 0; i < 100; i++) noise[i] = (unsigned char)(i * 73 + 11);
    write_bytes(path, noise, sizeof noise);
    int st = run_cmd(out, sizeof out, "timeout -k 5 60 %s --model gpt --tokens %s --seq-len 8 --steps 1", train_cpu, path);
    expect_error(out, st, 1, "random.npy' is named .npy but is not a NumPy file");
    st = run_cmd(out, sizeof out, "timeout -k 5 60 %s --model gpt --tokens /dev/zero --seq-len 8 --steps 1", train_cpu);
    expect_error(out, st, 1, "'/dev/zero': not a regular file");
    snprintf(path, sizeof path, "%s/text.fifo", tmpdir);
    CHECK(mkfifo(path, 0644) == 0);
    st = run_cmd(out, sizeof out, "timeout -k 5 60 %s --model gpt --data %s --seq-len 8 --steps 1", train_cpu, path);
    expect_error(out, st, 1, "text.fifo': not a regular file");
    snprintf(set, sizeof set, "%s/images", tmpdir);
    dt_synthetic_write(set, 40, 10, 16, 3);
    snprintf(fifo, sizeof fifo, "%s/train", set);
    DIR *d = opendir(fifo);                      /* a FIFO in the first class's folder */
    struct dirent *e;
    while (d && (e = readdir(d)) && e->d_name[0] == '.') {}
    CHECK(d && e);
    if (!d || !e) { if (d) closedir(d); return; }
    snprintf(fifo, sizeof fifo, "%s/train/%s/zz.png", set, e->d_name);
    closedir(d);
    CHECK(mkfifo(fifo, 0644) == 0);
    st = run_cmd(out, sizeof out, "timeout -k 5 60 %s --data %s --image-size 16 --steps 1 --quiet", train_cpu, set);
    expect_error(out, st, 1, "zz.png': cannot read: not a regular file");
}

TEST(instruction_data_masks_prompts_and_names_every_bad_record, QUICK) {
    char path[700], out[16384];
    dt_dataset tr, va;
    dt_text_load(instruction_data(), 1, 0, 16, 0.1, &tr, &va);
    CHECKF(tr.n == 320 && va.n == 35 && tr.targets && va.targets && tr.seq_len == 16 && tr.num_classes == 40,
           "%lld training and %lld validation examples, vocabulary %d", (long long)tr.n, (long long)va.n, tr.num_classes);
    /* example 1: a prompt of 8 (ids 16, 8, 0+3...), the separator, an answer of 6; inputs all but the last token,
       targets all but the first, -100 up to the separator's prediction */
    const int32_t *x = tr.tokens + 16, *y = tr.targets + 16;
    int P = 8, A = 6;
    CHECK(x[0] == 3 + 13 % 37 && x[P] == 1 && y[P - 1] == DT_IGNORE_INDEX && y[P - 2] == DT_IGNORE_INDEX);
    CHECKF(y[P] == x[P - 1] && y[P + A - 1] == x[P - A] && y[P + A] == DT_IGNORE_INDEX && x[P + A] == 0,
           "example 1: targets %d %d %d", y[P], y[P + A - 1], y[P + A]);
    /* example 0 was padded: the pad ids (2) are neither inputs nor targets */
    CHECK(tr.tokens[1] == 1 && tr.targets[1] == tr.tokens[0] && tr.tokens[2] == 0 && tr.targets[2] == DT_IGNORE_INDEX);
    /* the loader hands out each example's own targets */
    dt_loader l = dt_loader_create(&tr, 2, 0, 0, 0, 1, 0, 1);
    dt_loader_start_epoch(&l, 0, 0);
    dt_batch b;
    dt_step_arena_reset();
    CHECK(dt_loader_next(&l, &b) && b.labels[16 + P] == x[P - 1] && b.labels[16 + P - 1] == DT_IGNORE_INDEX &&
          b.inputs->data[16] == (float)x[0]);
    int64_t counted = 0;
    for (int i = 0; i < 32; i++) counted += b.labels[i] != DT_IGNORE_INDEX;
    dt_loader_free(&l);
    /* what every rank's batches count, without asking the other ranks: rank 1 of 2 sees rank 0's batch too */
    l = dt_loader_create(&tr, 1, 0, 0, 0, 1, 1, 2);
    dt_loader_start_epoch(&l, 0, 0);
    CHECKF(dt_loader_counted_targets(&l, 1) == counted, "batch 0 of ranks 0 and 1 counts %lld targets; expected %lld",
           (long long)dt_loader_counted_targets(&l, 1), (long long)counted);
    dt_loader_free(&l);
    int32_t first = x[0], answer = x[P - 1];           /* x points into what the slice moves */
    dt_dataset_slice(&tr, 1, 3);
    CHECK(tr.n == 2 && tr.ntokens == 32 && tr.tokens[0] == first && tr.targets[P] == answer);
    /* the context-free baseline scores only the answers: add-one smoothed frequencies of the training answers' tokens */
    double count[40] = { 0 }, total = 40, want = 0, scored = 0;
    for (int64_t i = 0; i < tr.ntokens; i++)
        if (tr.targets[i] != DT_IGNORE_INDEX) { count[tr.targets[i]] += 1; total += 1; }
    for (int64_t i = 0; i < va.ntokens; i++)
        if (va.targets[i] != DT_IGNORE_INDEX) { want -= log((count[va.targets[i]] + 1) / total); scored += 1; }
    CHECKF(scored > 0 && fabs(dt_unigram_loss(&tr, &va) - want / scored) <= 1e-12, "baseline %.9f, expected %.9f",
           dt_unigram_loss(&tr, &va), want / scored);
    dt_dataset_free(&tr);
    dt_dataset_free(&va);
    int st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --batch-size 8 "
                     "--steps 3 --log-every 1", train_cpu, instruction_data());
    CHECKF(st == 0 && strstr(out, "320 training examples of up to 17 tokens") && strstr(out, "the loss counts") &&
           strstr(out, "done: 3 steps"), "stage 01 on JSON lines: exit %d\n%s", st, out);
    /* every malformed record is named by file and line */
    static const struct { const char *line, *names; } bad[] = {
        { "[1, 2, 3]", "line 2: not a JSON object" },
        { "{\"input_ids\": [1, 2, 3]", "line 2: not valid JSON" },
        { "{\"input_ids\": [1, 2, 3]} x", "line 2: not valid JSON" },
        { "{\"input_ids\": [1, 2, 3], \"text\": }", "line 2: not valid JSON" },
        { "{\"labels\": [1, 2, 3]}", "line 2: no \"input_ids\"" },
        { "{\"input_ids\": [1, 2.5, 3]}", "\"input_ids\" is not a list of whole numbers" },
        { "{\"input_ids\": \"1 2 3\"}", "\"input_ids\" is not a list of whole numbers" },
        { "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}", "2 \"labels\" for 3 \"input_ids\"" },
        { "{\"input_ids\": [1, 2, 3], \"attention_mask\": [0, 1, 1]}", "only right padding" },
        { "{\"input_ids\": [7]}", "line 2: 1 tokens" },
        { "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]}", "--seq-len 16 holds examples of up to 17" },
        { "{\"input_ids\": [1, -4, 3]}", "input_ids[1] is -4" },
        { "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -5, 3]}", "labels[1] is -5" },
        { "{\"input_ids\": [1, 2, 16777216]}", "input_ids[2] is 16777216" },
    };
    snprintf(path, sizeof path, "%s/bad.jsonl", tmpdir);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        FILE *f = fopen(path, "w");
        fprintf(f, "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n%s\n", bad[k].line);
        for (int i = 0; i < 20; i++) fprintf(f, "{\"input_ids\": [1, 2, 3]}\n");
        fclose(f);
        st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --steps 1", train_cpu, path);
        expect_error_in(bad[k].line, out, st, 1, bad[k].names);
        CHECKF(strstr(out, path) != NULL, "the error does not name the file:\n%s", out);
    }
    /* Windows' line ends and a byte-order mark, and a space after the brace, are still JSON lines */
    FILE *f = fopen(path, "w");
    fprintf(f, "\xEF\xBB\xBF\r\n");
    for (int i = 0; i < 20; i++) fprintf(f, "{ \"input_ids\": [1, 2, 3], \"labels\": [-100, 5, %d]}\r\n", i);
    fclose(f);
    dt_text_load(path, 1, 0, 16, 0.1, &tr, &va);
    CHECKF(tr.n == 18 && va.n == 2 && tr.targets && tr.targets[0] == 5 && tr.targets[16 + 1] == 1 && tr.num_classes == 20,
           "BOM and CRLF: %lld examples, vocabulary %d", (long long)tr.n, tr.num_classes);
    dt_dataset_free(&tr);
    dt_dataset_free(&va);
    f = fopen(path, "w");
    for (int i = 0; i < 20; i++) fprintf(f, "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -100, -100]}\n");
    fclose(f);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --steps 1", train_cpu, path);
    expect_error(out, st, 1, "every label is -100");
    f = fopen(path, "w");
    for (int i = 0; i < 5; i++) fprintf(f, "{\"input_ids\": [1, 2, 3]}\n");
    fclose(f);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --steps 1", train_cpu, path);
    expect_error(out, st, 1, "5 examples: too few");
    f = fopen(path, "w");                                  /* ds.to_json(path, lines=False) */
    fprintf(f, "[{\"input_ids\": [1, 2, 3]}, {\"input_ids\": [4, 5, 6]}]");
    fclose(f);
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --steps 1", train_cpu, path);
    expect_error(out, st, 1, "one JSON array; --tokens reads JSON lines");
    st = run_cmd(out, sizeof out, "%s --model llama --dim 16 --depth 1 --heads 2 --seq-len 16 --tokens %s --vocab 30 --steps 1",
                 train_cpu, instruction_data());
    expect_error(out, st, 1, "ids run from 0 to 29");
}

TEST(bad_data_is_reported_by_name, QUICK) {
    char out[8192], dir[600], p[2048];
    int st = run_cmd(out, sizeof out, "%s --data %s/nowhere --quiet", train_cpu, tmpdir);
    expect_error(out, st, 1, "nowhere");
    /* an empty class folder */
    snprintf(dir, sizeof dir, "%s/emptyclass", tmpdir);
    snprintf(p, sizeof p, "cp -r %s %s && rm %s/train/disk-cool/*", small_data(), dir, dir);
    CHECK(system(p) == 0);
    st = run_cmd(out, sizeof out, "%s --data %s --quiet", train_cpu, dir);
    expect_error(out, st, 1, "disk-cool");
    /* a corrupt image, a truncated one, and a file that is no image at all */
    const char *cases[3] = { "corrupt", "truncated", "text" };
    for (int k = 0; k < 3; k++) {
        snprintf(dir, sizeof dir, "%s/bad-%s", tmpdir, cases[k]);
        snprintf(p, sizeof p, "cp -r %s %s", small_data(), dir);
        CHECK(system(p) == 0);
        char victim[900];
        snprintf(victim, sizeof victim, "%s/train/ring-warm/bad-%s.ppm", dir, cases[k]);
        if (k == 0) write_bytes(victim, "P6 99999999 -3 255\n", 19);
        if (k == 1) write_bytes(victim, "P6 16 16 255\n\x01\x02\x03\x04", 17);
        if (k == 2) { snprintf(victim, sizeof victim, "%s/train/ring-warm/README.txt", dir); write_bytes(victim, "hello\n", 6); }
        st = run_cmd(out, sizeof out, "%s --data %s --quiet", train_cpu, dir);
        expect_error(out, st, 1, k == 2 ? "README.txt" : cases[k]);
    }
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --start-idx 500", train_cpu, small_data());
    expect_error(out, st, 2, "--start-idx");
}

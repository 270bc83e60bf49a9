/* tests/02-devices-and-memory.c -- tests of dtrain.h's chapter
   02-devices-and-memory: the step arena. (tests/helpers.h: how the suite's
   files make one program.) */
#include "helpers.h"

/* ---- memory -------------------------------------------------------------- */

TEST(step_arena_stops_allocating_after_the_first_step, QUICK) {
    dt_model_config c = { DT_MODEL_VIT, 3, 8, 4, 16, 2, 2, 4, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 3);
    dt_optimizer *o = dt_optimizer_create(m, DT_ADAMW, 0.0f, 0.0f, 0.0f);
    size_t acts[4];
    for (int s = 0; s < 4; s++) {
        dt_step_arena_reset();
        int shape[4] = { 4, 3, 8, 8 };
        dt_tensor *img = dt_tensor_new(4, shape);
        int32_t labels[4] = { 0, 1, 2, 3 };
        dt_backward(dt_cross_entropy(dt_model_forward(m, img), labels));
        dt_optimizer_step(o, 1e-3f);
        acts[s] = dt_mem_now(DT_ARENA_ACTS);
    }
    CHECKF(acts[1] == acts[2] && acts[2] == acts[3], "activation bytes %zu %zu %zu", acts[1], acts[2], acts[3]);
    CHECK(dt_mem_now(DT_ARENA_PARAMS) >= (size_t)m->numel * 4 && dt_mem_now(DT_ARENA_OPTIM) >= (size_t)m->numel * 8);
    dt_optimizer_free(o);
    dt_model_free(m);
}

/* What the arenas count is what the process holds: the first step's spill
   blocks, freed when the arena grows to one block, go back to the system
   (glibc keeps freed blocks under its growing mapping threshold in the
   heap, resident, unless trimmed: 97 MB more than counted here, 2.4 GB on
   Qwen2-0.5B's shape). The bench line's peak_rss_mb against its
   peak_mem_mb, which counts every tensor; the rest of the process (code,
   libraries, stacks) is about 15 MB. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_MEMORY__)
#define T_OWN_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
#define T_OWN_ALLOCATOR 1
#endif
#endif
TEST(resident_memory_is_what_the_arenas_count, FULL) {      /* FULL: seconds at -O3, a minute at -O0 */
#ifdef T_OWN_ALLOCATOR
    SKIP("a sanitizer's allocator keeps freed memory itself (quarantine, shadow)");
#endif
    char out[8192];
    int st = run_cmd(out, sizeof out, "env OMP_NUM_THREADS=2 %s --bench --device cpu --model gpt --dim 256 --depth 4 --heads 4 "
                     "--seq-len 256 --batch-size 16 --steps 2", stage_bin("01-single-gpu"));
    CHECKF(st == 0, "--bench: exit %d\n%s", st, out);
    const char *mem = strstr(out, " peak_mem_mb="), *rss = strstr(out, " peak_rss_mb=");
    CHECKF(mem && rss, "no peak_mem_mb or peak_rss_mb in the bench line:\n%s", out);
    if (!mem || !rss) return;
    double counted = atof(mem + 13), resident = atof(rss + 13);
    printf("    counted %.1f MB, resident %.1f MB\n", counted, resident);
    CHECKF(counted > 400 && resident <= counted + 50, "resident %.1f MB, counted %.1f MB: more than 50 MB that no arena counts",
           resident, counted);
}

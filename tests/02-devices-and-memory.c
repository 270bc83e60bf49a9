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

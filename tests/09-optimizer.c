/* tests/09-optimizer.c -- tests of dtrain.h's chapter 09-optimizer:
   closed-form steps, clipping, the schedule. (tests/helpers.h: how the
   suite's files make one program.) */
#include "helpers.h"

/* ---- optimizer against closed-form steps --------------------------------- */

TEST(adamw_and_sgd_match_hand_computed_steps, QUICK) {
    dt_model_config c = { DT_MODEL_MLP, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };   /* fc1: weight [1,1], bias [1] */
    for (int kind = 0; kind < 2; kind++) {
        dt_model *m = dt_model_create(&c, 1);
        dt_optimizer *o = dt_optimizer_create(m, kind == 0 ? DT_ADAMW : DT_SGD, 0.1f, 0.9f, 0.0f);
        m->params[0].data[0] = 1.0f;        /* weight: decayed */
        m->params[1].data[0] = 1.0f;        /* bias: not decayed */
        for (int step = 0; step < 2; step++) {
            m->params[0].grad[0] = 0.5f;
            m->params[1].grad[0] = 0.5f;
            dt_optimizer_step(o, 0.1f);
        }
        if (kind == 0) {
            /* step 1: p = 0.99 - 0.1 * (0.05/0.1) / (sqrt(0.00025/0.001) + 1e-8) = 0.89
               step 2: p = 0.89 * 0.99 - 0.1 * (0.095/0.19) / (sqrt(0.00049975/0.001999) + 1e-8) */
            double w1 = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8);
            double m2 = 0.9 * 0.05 + 0.1 * 0.5, v2 = 0.999 * 0.00025 + 0.001 * 0.25;
            double w2 = w1 * 0.99 - 0.1 * (m2 / 0.19) / (sqrt(v2 / (1 - 0.999 * 0.999)) + 1e-8);
            double b1 = 1.0 - 0.1 * 0.5 / (0.5 + 1e-8);
            double b2 = b1 - 0.1 * (m2 / 0.19) / (sqrt(v2 / (1 - 0.999 * 0.999)) + 1e-8);
            CHECKF(CLOSE(m->params[0].data[0], w2, 1e-6), "adamw weight %.8f, expected %.8f", m->params[0].data[0], w2);
            CHECKF(CLOSE(m->params[1].data[0], b2, 1e-6), "adamw bias %.8f, expected %.8f", m->params[1].data[0], b2);
        } else {
            /* weight: g' = 0.5 + 0.1*1 = 0.6, buf 0.6, p 0.94; g' = 0.5 + 0.094, buf 0.54 + 0.594, p 0.94 - 0.1134 */
            CHECKF(CLOSE(m->params[0].data[0], 0.8266, 1e-6), "sgd weight %.8f", m->params[0].data[0]);
            /* bias: buf 0.5, p 0.95; buf 0.95, p 0.855 */
            CHECKF(CLOSE(m->params[1].data[0], 0.855, 1e-6), "sgd bias %.8f", m->params[1].data[0]);
        }
        CHECK(m->params[0].grad[0] == 0.0f);                       /* the step zeroes the gradients */
        dt_optimizer_free(o);
        dt_model_free(m);
    }
}

TEST(gradient_clipping_scales_to_the_max_norm, QUICK) {
    dt_model_config c = { DT_MODEL_MLP, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 1);
    dt_optimizer *o = dt_optimizer_create(m, DT_SGD, 0.0f, 0.0f, 1.0f);
    m->params[0].data[0] = 0; m->params[1].data[0] = 0;
    m->params[0].grad[0] = 6; m->params[1].grad[0] = 8;        /* norm 10 */
    dt_optimizer_step(o, 1.0f);
    CHECK(CLOSE(o->last_grad_norm, 10.0, 1e-6));
    CHECKF(CLOSE(m->params[0].data[0], -0.6, 1e-5) && CLOSE(m->params[1].data[0], -0.8, 1e-5), "%g %g",
           m->params[0].data[0], m->params[1].data[0]);
    dt_optimizer_free(o);
    dt_model_free(m);
}

TEST(schedule_warms_up_then_follows_a_cosine, QUICK) {
    CHECK(CLOSE(dt_schedule_lr(1.0f, 0, 10, 110), 0.1, 1e-6));
    CHECK(CLOSE(dt_schedule_lr(1.0f, 9, 10, 110), 1.0, 1e-6));
    CHECK(CLOSE(dt_schedule_lr(1.0f, 10, 10, 110), 1.0, 1e-6));
    CHECK(CLOSE(dt_schedule_lr(1.0f, 60, 10, 110), 0.5, 1e-6));
    CHECK(dt_schedule_lr(1.0f, 110, 10, 110) < 1e-6);
    CHECK(CLOSE(dt_schedule_lr(2.0f, 5, 0, 0), 2.0, 1e-6));
}

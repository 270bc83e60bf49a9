/* 01-single-gpu: the whole training loop on one device.

   Read this first. Every later stage is this file plus the few lines that
   teach its lesson: `make diff` shows them.

   One step: fetch a batch, run the model forward (the tape records each op),
   walk the tape backward (every parameter gets its gradient), let the
   optimizer move the parameters. Everything else -- flags, logs, evaluation,
   checkpoints -- lives in dtrain.h so that the loop stays this short. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "01-single-gpu");   /* --bench: times this loop */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, /*rank*/ 0, /*world*/ 1);
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* every parameter's .grad */
            dt_phase(&run, DT_PHASE_BWD);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* p -= lr * update; grads zeroed */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    return status;
}

/* 02-dp: data parallel in one process -- PyTorch's DataParallel.

   One process drives N devices (--nproc N; on the CPU each "device" is a
   thread with its own share of the cores). Device 0 holds the model and the
   optimizer. Every step it copies its weights to the other devices, hands
   each its slice of the batch, gathers their outputs, computes the loss,
   and, after backward on every device, sums their gradients back onto itself
   and steps alone. Everything passes through device 0: that is the lesson,
   and the reason stage 03 exists. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "02-dp");   /* --bench: times this loop */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_dp *dp = dt_dp_create(model, cfg.nproc, cfg.timeout);  /* a replica and a thread per extra device */
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_loader loader = dt_loader_create(&train, cfg.batch_size * cfg.nproc, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, /*rank*/ 0, /*world*/ 1);  /* one batch for all devices */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *logits = dt_dp_forward(dp, batch.inputs); /* replicate, scatter, forward, gather */
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);   /* on device 0 */
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* every device's backward */
            dt_phase(&run, DT_PHASE_BWD);
            dt_dp_reduce_grads(dp);                           /* every device's gradients summed on device 0 */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* device 0 alone: p -= lr * update */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_dp_free(dp, cfg.quiet || cfg.bench);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    return status;
}

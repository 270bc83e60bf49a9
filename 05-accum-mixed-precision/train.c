/* 05-accum-mixed-precision: gradient accumulation and bf16/fp16 training.

   Stage 04, with two ways to do more with the same memory. --accum-steps K
   runs K micro-batches of --batch-size per optimizer step: the gradients of
   the first K-1 add up locally and nothing is communicated (no-sync); the
   last one reduce-scatters the sum, once. The loss of each is divided by K,
   so K micro-batches of B step exactly as one batch of K*B would.
   --dtype bf16|fp16 stores activations and gathers parameters in 16 bits and
   multiplies 16-bit operands, summing in f32; the weights the optimizer
   updates stay f32 (master weights). fp16 also scales the loss, skipping any
   step whose gradients overflow. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "05-accum-mixed-precision");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */
    dt_set_compute_dtype((dt_dtype)cfg.dtype);               /* activations and matmuls in --dtype */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);         /* f32: the master weights */
    dt_fsdp *fsdp = dt_fsdp_create(model, comm, cfg.shard, cfg.cpu_offload);  /* gathers in --dtype */
    dt_fsdp_set_reduce_dtype(fsdp, (dt_dtype)cfg.reduce_dtype);  /* gradients travel in --reduce-dtype */
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_fsdp_set_zeropp(fsdp, cfg.zeropp);                 /* ZeRO++: fewer bytes between machines */
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, cfg.rank, cfg.world_size);  /* this rank's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* one micro-batch of --batch-size */
            int sync = dt_last_micro_batch(&run);             /* the K-th: communicate */
            dt_fsdp_set_sync(fsdp, sync);                     /* the others: no-sync, add up here */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward_scaled(loss, &run.scaler, cfg.accum_steps);  /* of loss * scale / K */
            dt_phase(&run, DT_PHASE_BWD);
            if (!sync) { dt_micro_batch_end(&run, loss); continue; }
            dt_fsdp_sync_grads(fsdp);                         /* this rank's shard of the mean gradient */
            dt_phase(&run, DT_PHASE_COMM);
            if (dt_loss_scaler_unscale(&run.scaler, opt))     /* fp16: inf anywhere skips the step */
                dt_optimizer_step(opt, dt_run_lr(&run));      /* each rank its own f32 shard; ZeRO-1, -2 gather */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_fsdp_free(fsdp);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

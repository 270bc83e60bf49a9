/* 03-ddp: distributed data parallel -- PyTorch's DistributedDataParallel.

   N processes (--nproc N here, or torchrun, srun, mpirun), one device each.
   Every rank holds the whole model and its own optimizer, and reads its own
   share of each epoch's shuffled data. The only traffic is the gradients:
   averaged by all-reduce in buckets, each sent as soon as backward has
   finished it, while backward goes on with the rest. Every rank then takes
   the same step. Rank 0 writes the logs and the checkpoints. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "03-ddp");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_ddp *ddp = dt_ddp_create(model, comm, cfg.bucket_mb);  /* rank 0's weights everywhere; buckets */
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, cfg.rank, cfg.world_size);  /* this rank's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* buckets all-reduce as they fill */
            dt_phase(&run, DT_PHASE_BWD);
            dt_ddp_sync_grads(ddp);                           /* wait for the last buckets: the mean gradient */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* every rank the same step */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_ddp_free(ddp);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

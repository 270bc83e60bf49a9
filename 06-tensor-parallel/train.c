/* 06-tensor-parallel: split every block's layers across ranks -- Megatron-LM.

   DDP and FSDP still compute every layer whole on every rank. Here the T
   ranks of a group each hold 1/T of every block's weights and compute 1/T of
   each layer: the first MLP layer and q, k, v by their outputs (hidden units,
   heads), the second MLP layer and attention's projection by their inputs,
   whose partial outputs are summed over the group -- two sums of the
   activations per block in forward, two of their gradients in backward, all
   on the tape. Every rank of a group reads the same batch; with --tp T below
   the job's size, the groups are data parallel: DDP, or FSDP with --shard (2-D).
   Builds on 03-ddp. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "06-tensor-parallel");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_tp *tp = dt_tp_create(model, comm, cfg.tp, cfg.sequence_parallel);  /* keep 1/T of every block's weights */
    dt_data_parallel *dp = dt_data_parallel_create(model, dt_tp_data_group(tp), cfg.shard, cfg.cpu_offload, cfg.bucket_mb);
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_data_parallel_set_zeropp(dp, cfg.zeropp);          /* with --shard: ZeRO++'s levers, if any */
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, dt_tp_data_rank(tp), dt_tp_data_ranks(tp));  /* the group's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);   /* sums inside each block */
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* and their conjugates, backward */
            dt_phase(&run, DT_PHASE_BWD);
            dt_data_parallel_sync_grads(dp);                  /* across the groups: the mean gradient */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* each rank its pieces */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_data_parallel_free(dp);
    dt_tp_free(tp);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

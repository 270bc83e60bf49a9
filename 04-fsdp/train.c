/* 04-fsdp: fully sharded data parallel -- PyTorch's FullyShardedDataParallel.

   As in 03, N ranks each train on their share of the data. But no rank keeps
   the whole model: each unit (a layer, a block) is cut into N shards, and a
   rank keeps one shard of the parameters, of the gradients and of the
   optimizer state. A unit is gathered whole just before it computes and freed
   just after; its gradients are reduce-scattered, each rank receiving the
   average for its own shard, which its optimizer steps. --shard picks how much
   is sharded: the optimizer state (ZeRO-1), also the gradients (ZeRO-2), or
   also the parameters (ZeRO-3, the default). */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "04-fsdp");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_fsdp *fsdp = dt_fsdp_create(model, comm, cfg.shard, cfg.cpu_offload);  /* keep 1/N of every unit */
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_fsdp_set_zeropp(fsdp, cfg.zeropp);                 /* ZeRO++: fewer bytes between machines */
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
            dt_backward(loss);                                /* per unit: gather, backward, reduce-scatter */
            dt_phase(&run, DT_PHASE_BWD);
            dt_fsdp_sync_grads(fsdp);                         /* this rank's shard of the mean gradient */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* each rank its own shard; ZeRO-1, -2 gather */
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

/* 09-expert-parallel: spread a mixture's experts over ranks -- all-to-all.

   A mixture-of-experts model (--moe-experts E --moe-top-k K) holds E expert
   MLPs a layer and runs K of them a token: most of its parameters, little of
   its work. Here each of the P ranks of a group keeps E/P of every layer's
   experts and reads its own batch, as in DDP. In each MoE layer a rank
   routes its tokens, sends each to the rank that holds its expert (an
   all-to-all), computes what it received for its experts, and sends the
   results back (a second all-to-all); backward runs both the other way. The
   experts' gradients are averaged over the ranks that hold the same experts,
   everything else over the whole job: DDP, or FSDP with --shard, over the
   data-parallel groups, and the group's sum inside. Builds on 03-ddp. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "09-expert-parallel");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */
    dt_set_compute_dtype((dt_dtype)cfg.dtype);               /* activations and matmuls in --dtype (fp32, bf16) */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_ep *ep = dt_ep_create(model, comm, cfg.ep);           /* keep E/P of every layer's experts */
    dt_data_parallel *dp = dt_data_parallel_create(model, dt_ep_data_group(ep), cfg.shard, cfg.cpu_offload, cfg.bucket_mb);
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_data_parallel_set_zeropp(dp, cfg.zeropp);          /* with --shard: ZeRO++'s levers, if any */
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, cfg.rank, cfg.world_size);  /* this rank's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);   /* tokens to their experts and back */
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* the all-to-alls again, reversed */
            dt_phase(&run, DT_PHASE_BWD);
            dt_data_parallel_sync_grads(dp);                  /* experts over "dp", the rest over every rank */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));          /* each rank its experts and the rest */
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_data_parallel_free(dp);
    dt_ep_free(ep);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

/* 08-context-parallel: split every sequence along its length -- ring attention.

   Tensor parallelism splits the weights; here each of the C ranks of a group
   keeps T/C of every sequence's tokens, so activations shrink by C and a
   context no single device could hold fits. Everything but attention works
   on each token alone; attention needs every key, so the keys and values go
   around the ring of the group while each rank attends its queries to the
   block it holds, merging the partial results by the online softmax. The
   zig-zag layout gives each rank an early and a late chunk of the sequence,
   so a causal model's work is the same on every rank. Every rank of a group
   reads the same batch; every rank holds a part of every gradient (its
   tokens'), so the data-parallel engine averages over the whole job: DDP, or
   FSDP with --shard. Builds on 03-ddp. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "08-context-parallel");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */
    dt_set_compute_dtype((dt_dtype)cfg.dtype);               /* activations and matmuls in --dtype (fp32, bf16) */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_cp *cp = dt_cp_create(model, comm, cfg.cp, (dt_cp_layout)cfg.cp_layout);  /* attention around a ring of C ranks */
    dt_data_parallel *dp = dt_data_parallel_create(model, dt_cp_data_group(cp), cfg.shard, cfg.cpu_offload, cfg.bucket_mb);
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_data_parallel_set_zeropp(dp, cfg.zeropp);          /* with --shard: ZeRO++'s levers, if any */
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, dt_cp_data_rank(cp), dt_cp_data_ranks(cp));  /* the group's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_cp_split_batch(cp, &batch);                    /* this rank's T/C tokens of each sequence */
            dt_tensor *logits = dt_model_forward(model, batch.inputs);   /* attention goes around the ring */
            dt_tensor *loss = dt_cross_entropy(logits, batch.labels);
            dt_phase(&run, DT_PHASE_FWD);
            dt_backward(loss);                                /* the ring again, gradients travelling home */
            dt_phase(&run, DT_PHASE_BWD);
            dt_data_parallel_sync_grads(dp);                  /* over every rank: the mean gradient */
            dt_phase(&run, DT_PHASE_COMM);
            dt_optimizer_step(opt, dt_run_lr(&run));
            dt_phase(&run, DT_PHASE_OPT);
            if (dt_step_end(&run, loss, batch.size)) break;   /* log, progress; --steps reached */
        }
        dt_epoch_end(&run);                                   /* evaluate, checkpoint */
    }

    int status = dt_run_finish(&run);
    dt_loader_free(&loader);
    dt_optimizer_free(opt);
    dt_data_parallel_free(dp);
    dt_cp_free(cp);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

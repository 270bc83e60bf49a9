/* 07-pipeline-parallel: split the model's blocks into stages -- GPipe, 1F1B.

   Stage 06 cut every layer across the ranks. Here each rank of a pipeline
   keeps whole layers, a run of consecutive blocks (its stage; the first has
   the embedding, the last the head and loss), and a batch goes down the
   pipeline in --micro-batches M pieces: activations sent on, gradients sent
   back. While stage 1 works on one micro-batch, stage 0 starts the next; the
   idle rest, the bubble, is (P - 1) / (M + P - 1) of a step. --schedule
   gpipe: every forward, then every backward; 1f1b: each backward as soon as
   it can run, so a stage keeps at most P micro-batches' activations, not M.
   The wrappers stack as in 06: tensor parallelism cuts each layer (--tp T),
   the pipeline cuts the blocks into stages, and the data-parallel engine
   averages -- or with --shard, shards -- what each rank then holds over the
   pipelines left over: D x P x T ranks in all. --dtype bf16 as in 05,
   --accum-steps K: K times the micro-batches. Builds on 06-tensor-parallel. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"

int main(int argc, char **argv) {
    dt_config cfg = dt_parse_args(argc, argv, "07-pipeline-parallel");  /* --nproc N: N ranks start here */
    dt_comm *comm = dt_comm_init(cfg.comm, cfg.timeout);  /* meet */
    dt_set_compute_dtype((dt_dtype)cfg.dtype);               /* activations, and what stages send, in --dtype */

    dt_dataset train, val;
    dt_load_data(&cfg, &train, &val);
    dt_model_config mc = dt_model_config_from(&cfg, train.channels, train.size, train.num_classes);
    dt_model *model = dt_model_create(&mc, cfg.seed);
    dt_tp *tp = dt_tp_create(model, comm, cfg.tp, cfg.sequence_parallel);  /* keep 1/T of every block's weights */
    dt_pp *pp = dt_pp_create(model, dt_tp_data_group(tp), cfg.pp, cfg.micro_batches, cfg.schedule);  /* my stage */
    dt_data_parallel *dp = dt_data_parallel_create(model, dt_pp_data_group(pp), cfg.shard, cfg.cpu_offload, cfg.bucket_mb);
    dt_optimizer *opt = dt_optimizer_create(model, cfg.optimizer, cfg.weight_decay, cfg.momentum, cfg.clip);
    dt_data_parallel_set_zeropp(dp, cfg.zeropp);          /* with --shard: ZeRO++'s levers, if any */
    dt_loader loader = dt_loader_create(&train, cfg.batch_size, cfg.seed, /*shuffle*/ 1, cfg.augment,
                                        /*drop_last*/ 1, dt_pp_data_rank(pp), dt_pp_data_ranks(pp));  /* the pipeline's share */
    dt_run run;
    dt_run_start(&run, &cfg, model, opt, &loader, &val);    /* --init, --resume, logs */

    while (dt_next_epoch(&run)) {
        dt_batch batch;
        while (dt_next_batch(&run, &batch)) {                 /* data: a shuffled, augmented batch */
            dt_tensor *loss = dt_pp_forward_backward(pp, &batch);   /* M micro-batches through the stages */
            dt_phase(&run, DT_PHASE_BWD);
            dt_data_parallel_sync_grads(dp);                  /* across the pipelines; a tied vocabulary's ends */
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
    dt_pp_free(pp);
    dt_tp_free(tp);
    dt_model_free(model);
    dt_dataset_free(&train);
    dt_dataset_free(&val);
    dt_comm_free(comm);
    return status;
}

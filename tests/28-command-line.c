/* tests/28-command-line.c -- tests of dtrain.h's chapter 28-command-line:
   each mistake a one-line error naming the flag. (tests/helpers.h: how the
   suite's files make one program.) */
#include "helpers.h"

/* ---- the command line: each mistake a one-line error naming the flag ---- */

static const char *stage_bin(const char *stage);
TEST(bad_flags_exit_2_naming_the_flag, QUICK) {
    static const struct { const char *stage, *args, *named; } bad[] = {
        { "01-single-gpu", "--no-such-flag 3", "--no-such-flag" },
        { "01-single-gpu", "--lr fast", "--lr" },
        { "01-single-gpu", "--batch-size 12x", "--batch-size" },
        { "01-single-gpu", "--model resnet", "--model" },
        { "01-single-gpu", "--epochs", "--epochs" },
        { "01-single-gpu", "--model vit --dim 100 --heads 3", "--heads" },
        { "01-single-gpu", "--nproc 2", "--nproc is a flag of 02-dp" },
        { "03-ddp", "--bucket-mb -1", "--bucket-mb" },
        { "01-single-gpu", "--dtype bf16", "05-accum-mixed-precision, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, not 01" },
        { "04-fsdp", "--accum-steps 4", "05-accum-mixed-precision and 07-pipeline-parallel, not 04" },
        { "05-accum-mixed-precision", "--accum-steps 0", "--accum-steps" },
        { "05-accum-mixed-precision", "--dtype fp8", "--dtype" },
        { "05-accum-mixed-precision", "--reduce-dtype int8", "--reduce-dtype" },
        { "03-ddp", "--explain --link carrier-pigeon", "--link" },
        { "03-ddp", "--tp 2", "--tp is a flag of 06-tensor-parallel" },
        { "06-tensor-parallel", "--tp -1", "--tp" },
        { "06-tensor-parallel", "--nproc 4 --tp 3", "--tp 3 does not divide the job's 4 ranks" },
        { "06-tensor-parallel", "--nproc 4 --model vit --heads 2", "--heads (and llama's --kv-heads) must be a multiple of --tp" },
        { "06-tensor-parallel", "--nproc 2 --depth 1", "the mlp needs --depth 2 or more" },
        { "06-tensor-parallel", "--nproc 4 --model llama --dim 32 --heads 4 --kv-heads 2",
          "--heads (and llama's --kv-heads) must be a multiple of --tp" },
        { "01-single-gpu", "--sequence-parallel", "--sequence-parallel is a flag of 06-tensor-parallel" },
        { "03-ddp", "--pp 2", "--pp is a flag of 07-pipeline-parallel" },
        { "07-pipeline-parallel", "--nproc 4 --pp 3", "--pp 3 does not divide the job's 4 ranks" },
        { "07-pipeline-parallel", "--nproc 4 --tp 3", "--tp 3 does not divide the job's 4 ranks" },
        { "07-pipeline-parallel", "--nproc 4 --tp 2 --pp 4", "--pp 4 does not divide the job's 4 ranks over --tp" },
        { "07-pipeline-parallel", "--nproc 2 --cpu-offload", "--cpu-offload keeps the shards in host memory: it needs --shard" },
        { "07-pipeline-parallel", "--nproc 4 --depth 2", "--pp 4: the model has 3 blocks (--depth), fewer than the stages" },
        { "07-pipeline-parallel", "--nproc 2 --batch-size 30 --micro-batches 4", "--micro-batches 4 does not divide --batch-size 30" },
        { "07-pipeline-parallel", "--schedule zigzag", "--schedule" },
        { "07-pipeline-parallel", "--micro-batches 0", "--micro-batches" },
    };
    char out[8192];
    int st;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        /* 06 and 07 check --tp and --pp against the model, which needs the data first: data this build reads
           (the default folder may hold PNG, which a build without stb does not) */
        int data = !strncmp(bad[i].stage, "06", 2) || !strncmp(bad[i].stage, "07", 2), text = strstr(bad[i].args, "llama") != NULL;
        st = run_cmd(out, sizeof out, "%s %s%s%s", stage_bin(bad[i].stage), bad[i].args, data ? " --data " : "",
                     !data ? "" : text ? gpt_text() : small_data());
        expect_error(out, st, 2, bad[i].named);
    }
    st = run_cmd(out, sizeof out, "%s --help", train_cpu);
    CHECK(st == 0 && strstr(out, "--batch-size") && strstr(out, "--resume"));
}

/* The tools' numbers go through dt_flag_number too: a value that is not one,
   or is out of range, exits 2 naming the flag, where atoi read "--nproc x"
   as 0 ranks and "--repeats 2x" as 2. Each would start real work if taken. */
TEST(tools_refuse_numbers_that_are_not_numbers, QUICK) {
    CHECK(dt_flag_number("--x", "3", 1, 5, 1) == 3.0 && dt_flag_number("--x", "0.25", 0, 1, 0) == 0.25);
    static const struct { const char *tool, *args, *named; } bad[] = {
        { "tools/collectives", "--nproc x --check", "--nproc" }, { "tools/collectives", "--threads 2.5 --check", "--threads" }, { "tools/collectives", "--threads 65 --check", "--threads" },
        { "tools/collectives", "--threads 2 --timeout 0 --check", "--timeout" },
        { "tools/collectives", "--threads 2 --timeout 1e999 --check", "--timeout" },
        { "tools/bench", "--layouts 4 --repeats 2x --out /nonexistent/b", "--repeats" },
        { "tools/bench", "--max-ranks '' --out /nonexistent/b", "--max-ranks" },
        { "tools/gen_synthetic", "/nonexistent/s 10 10 32x", "size" },
    };
    char out[8192];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = run_cmd(out, sizeof out, "%s %s", build_path(bad[i].tool), bad[i].args);
        expect_error(out, st, 2, bad[i].named);
        /* a stage's usage line ("usage: train ... --help") is not the tool's */
        CHECKF(!strstr(out, "usage: train"), "%s %s printed a stage's usage line:\n%s", bad[i].tool, bad[i].args, out);
    }
}

/* Every number a flag takes has a range, and a value outside it exits 2 naming
   the flag. -1 used to mean "not given" for some of them, so --batch-size -1 or
   --warmup -1 trained with the default in silence. Each run would start on
   random data (--bench) if the value were taken, so a miss fails fast. */
TEST(out_of_range_values_exit_2_naming_the_flag, QUICK) {
    static const struct { const char *stage, *args, *named; } bad[] = {
        { "01-single-gpu", "--batch-size -1", "--batch-size" }, { "01-single-gpu", "--epochs -1", "--epochs" },
        { "01-single-gpu", "--epochs 0", "--epochs" }, { "01-single-gpu", "--dim -1", "--dim" },
        { "01-single-gpu", "--depth -1", "--depth" }, { "01-single-gpu", "--model vit --heads -1", "--heads" },
        { "01-single-gpu", "--model vit --heads 2 --patch -1", "--patch" },
        { "01-single-gpu", "--model vit --heads 2 --depth 0", "--depth" },
        { "01-single-gpu", "--model gpt --seq-len -1", "--seq-len" }, { "01-single-gpu", "--model gpt --vocab -1", "--vocab" },
        { "01-single-gpu", "--model gpt --vocab 16777217", "--vocab" }, { "01-single-gpu", "--model llama --kv-heads 0", "--kv-heads" },
        { "01-single-gpu", "--model llama --rope-theta 1", "--rope-theta" }, { "01-single-gpu", "--model llama --norm-eps 0", "--norm-eps" },
        { "01-single-gpu", "--model llama --heads 4 --kv-heads 3", "--kv-heads 3" }, { "01-single-gpu", "--model gpt --kv-heads 2", "--kv-heads" }, { "01-single-gpu", "--model gpt --sample -1", "--sample" },
        { "01-single-gpu", "--image-size 0", "--image-size" }, { "01-single-gpu", "--steps -1", "--steps" },
        { "01-single-gpu", "--lr 0", "--lr" }, { "01-single-gpu", "--lr -1e-3", "--lr" },
        { "01-single-gpu", "--weight-decay -1", "--weight-decay" }, { "01-single-gpu", "--momentum 1", "--momentum" },
        { "01-single-gpu", "--clip -1", "--clip" }, { "01-single-gpu", "--warmup -1", "--warmup" },
        { "01-single-gpu", "--augment 2", "--augment" }, { "01-single-gpu", "--seed -1", "--seed" },
        { "01-single-gpu", "--eval-every -1", "--eval-every" }, { "01-single-gpu", "--log-every 0", "--log-every" },
        { "01-single-gpu", "--start-idx -1", "--start-idx" }, { "01-single-gpu", "--end-idx -1", "--end-idx" },
        { "01-single-gpu", "--end-idx 0", "--end-idx" }, { "01-single-gpu", "--peak-tflops -1", "--peak-tflops" },
        { "02-dp", "--nproc 0", "--nproc" }, { "02-dp", "--nproc 65", "--nproc" }, { "02-dp", "--timeout 0", "--timeout" },
        { "03-ddp", "--bucket-mb -1", "--bucket-mb" }, { "03-ddp", "--ranks-per-gpu 0", "--ranks-per-gpu" },
        { "05-accum-mixed-precision", "--accum-steps 0", "--accum-steps" },
    };
    char out[8192];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = run_cmd(out, sizeof out, "%s --bench --steps 1 --image-size 16 --dim 32 --batch-size 4 --quiet %s",
                         stage_bin(bad[i].stage), bad[i].args);
        expect_error_in(bad[i].args, out, st, 2, bad[i].named);
        char usage[200];           /* the usage line names the program as it was run, not "train" */
        snprintf(usage, sizeof usage, "/%s/train [--flag value", bad[i].stage);
        CHECKF(strstr(out, "usage: ") && strstr(out, usage), "%s: no usage line naming %s/train:\n%s", bad[i].args, bad[i].stage, out);
    }
}

/* One flag table says which stages take each flag: a flag of another stage is
   an error naming the stages that have it, and --help lists a stage's own. */
TEST(a_flag_of_another_stage_exits_2_naming_its_stages, QUICK) {
    static const struct { const char *stage, *args, *named; } bad[] = {
        { "01-single-gpu", "--shard full", "--shard is a flag of 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 01-single-gpu" },
        { "02-dp", "--cpu-offload", "--cpu-offload is a flag of 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, "
          "07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, not 02-dp" },
        { "03-ddp", "--shard grads", "--shard is a flag of 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 03-ddp" },
        { "01-single-gpu", "--bucket-mb 25", "--bucket-mb is a flag of 03-ddp, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 01-single-gpu" },
        { "04-fsdp", "--bucket-mb 0", "--bucket-mb is a flag of 03-ddp, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 04-fsdp" },
        { "05-accum-mixed-precision", "--bucket-mb 1", "--bucket-mb is a flag of 03-ddp, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 05-accum-mixed-precision" },
        { "01-single-gpu", "--nproc 1",
          "--nproc is a flag of 02-dp, 03-ddp, 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, "
          "not 01-single-gpu" },
        { "01-single-gpu", "--timeout 10",
          "--timeout is a flag of 02-dp, 03-ddp, 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, 07-pipeline-parallel, "
          "08-context-parallel and 09-expert-parallel" },
        { "04-fsdp", "--accum-steps 1", "--accum-steps is a flag of 05-accum-mixed-precision and 07-pipeline-parallel, not 04-fsdp" },
        { "03-ddp", "--dtype fp32", "--dtype is a flag of 05-accum-mixed-precision, 07-pipeline-parallel, 08-context-parallel and 09-expert-parallel, not 03-ddp" },
        { "02-dp", "--reduce-dtype fp32", "--reduce-dtype is a flag of 05-accum-mixed-precision, not 02-dp" },
        { "02-dp", "--ranks-per-gpu 1",
          "--ranks-per-gpu is a flag of 03-ddp, 04-fsdp, 05-accum-mixed-precision, 06-tensor-parallel, 07-pipeline-parallel, "
          "08-context-parallel and 09-expert-parallel, not 02-dp" },
        { "06-tensor-parallel", "--micro-batches 2", "--micro-batches is a flag of 07-pipeline-parallel, not 06-tensor-parallel" },
    };
    char out[16384];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = run_cmd(out, sizeof out, "%s --bench --steps 1 --image-size 16 --dim 32 --batch-size 4 --quiet %s",
                         stage_bin(bad[i].stage), bad[i].args);
        expect_error_in(bad[i].args, out, st, 2, bad[i].named);
    }
    /* --help: a line "  --flag" for each of the stage's own flags, none for the others' */
    static const struct { const char *stage, *has, *lacks; } help[] = {
        { "01-single-gpu", "--batch-size --explain --link --peak-tflops",
          "--nproc --timeout --bucket-mb --shard --cpu-offload --accum-steps --dtype --reduce-dtype --ranks-per-gpu" },
        { "02-dp", "--nproc --timeout --explain", "--bucket-mb --shard --cpu-offload --accum-steps --dtype --ranks-per-gpu" },
        { "03-ddp", "--nproc --timeout --bucket-mb --ranks-per-gpu", "--shard --cpu-offload --accum-steps --dtype" },
        { "04-fsdp", "--nproc --shard --cpu-offload --ranks-per-gpu", "--bucket-mb --accum-steps --dtype --reduce-dtype" },
        { "05-accum-mixed-precision", "--shard --cpu-offload --accum-steps --dtype --reduce-dtype", "--bucket-mb" },
        { "06-tensor-parallel", "--nproc --timeout --tp --sequence-parallel --ranks-per-gpu --bucket-mb --shard --cpu-offload",
          "--accum-steps --dtype --micro-batches" },
        { "07-pipeline-parallel",
          "--nproc --timeout --pp --tp --micro-batches --schedule --shard --cpu-offload --bucket-mb --accum-steps --dtype",
          "--sequence-parallel --reduce-dtype" },
    };
    for (size_t i = 0; i < sizeof help / sizeof help[0]; i++) {
        int st = run_cmd(out, sizeof out, "%s --help", stage_bin(help[i].stage));
        CHECKF(st == 0, "%s --help: exit %d\n%s", help[i].stage, st, out);
        char usage[200];           /* the program as it was run, not "train" */
        snprintf(usage, sizeof usage, "/%s/train [flags]\n", help[i].stage);
        CHECKF(strstr(out, "\nusage: ") && strstr(out, usage), "%s --help: no usage line naming %s/train\n%.500s", help[i].stage,
               help[i].stage, out);
        for (int want = 1; want >= 0; want--) {
            char list[256], line[64];
            dt__copy_str(list, sizeof list, want ? help[i].has : help[i].lacks);
            for (char *f = strtok(list, " "); f; f = strtok(NULL, " ")) {
                snprintf(line, sizeof line, "\n  %s ", f);
                CHECKF(!strstr(out, line) == !want, "%s --help %s %s", help[i].stage, want ? "does not list" : "lists", f);
            }
        }
    }
}

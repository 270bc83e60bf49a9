#!/usr/bin/env python3
"""The Qwen2-0.5B shape on the CPU, PyTorch + transformers' side of tools/bench_qwen2.sh.

  bench_qwen2.py make DIR     write a Hugging Face folder of that shape (494M parameters,
                              vocabulary 151,936, tied head) with random weights, in bf16
                              as Qwen2-0.5B ships: the weights both sides load
  bench_qwen2.py tokens DIR   write DIR/tokens.npy: 1,400 random token ids (uint32), of which
                              dtrain's stage 01 trains on the first 1,260 (the last 10% is
                              validation): 9 sequences of 128, one step's batch
  bench_qwen2.py loss DIR     transformers' loss on those 9 sequences with DIR/model's weights
                              in fp32: dtrain's first loss on the same file must equal it; print
                              one `torch-loss:` line
  bench_qwen2.py torch DIR    fine-tune it in fp32 with AdamW on random token ids, steps of
                              --batch sequences of --seq-len tokens, after --warmup steps;
                              print one `torch-bench:` line (tokens_per_s, step_ms and the
                              process's peak resident memory, peak_rss_mb, in MB of 10^6
                              bytes), as dtrain's `bench:` line has them

Threads: OMP_NUM_THREADS (torch.set_num_threads follows it).
"""
import argparse
import os
import resource
import sys
import time

import torch


def qwen2_config():
    from transformers import Qwen2Config
    # Qwen2-0.5B's config.json, as published (the numbers are facts about the model)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                       torch_dtype="bfloat16")


def make(folder):
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config()).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"bench_qwen2.py: wrote {folder} ({n / 1e6:.1f}M parameters, bf16)")


SEQUENCES, SEQ_LEN, TOKENS = 9, 128, 1400


def tokens(folder):
    import numpy as np
    ids = torch.randint(0, qwen2_config().vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(2))
    np.save(os.path.join(folder, "tokens.npy"), ids.numpy().astype(np.uint32))
    print(f"bench_qwen2.py: wrote {folder}/tokens.npy ({TOKENS} token ids)")


def first_loss(folder):
    import numpy as np
    from transformers import Qwen2ForCausalLM
    ids = torch.from_numpy(np.load(os.path.join(folder, "tokens.npy")).astype(np.int64))
    # stage 01's sequence i: tokens i*128 .. i*128+128 in, each one's next out; transformers shifts the labels
    batch = torch.stack([ids[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1] for i in range(SEQUENCES)])
    model = Qwen2ForCausalLM.from_pretrained(os.path.join(folder, "model"), torch_dtype=torch.float32)
    model.config.use_cache = False
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss
    print(f"torch-loss: first_loss={loss.item():.7f} sequences={SEQUENCES} seq_len={SEQ_LEN}")


def bench_torch(folder, batch, seq_len, steps, warmup):
    from transformers import Qwen2ForCausalLM
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    model = Qwen2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    print(f"torch-bench: workload=qwen2-0.5b threads={torch.get_num_threads()} batch={batch} seq_len={seq_len} "
          f"steps={steps} step_ms={ms:.1f} tokens_per_s={batch * seq_len * 1e3 / ms:.1f} peak_rss_mb={rss:.1f} "
          f"torch={torch.__version__}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["make", "tokens", "loss", "torch"])
    ap.add_argument("folder")
    ap.add_argument("--batch", type=int, default=9)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    if a.what == "make":
        make(a.folder)
    elif a.what == "tokens":
        tokens(a.folder)
    elif a.what == "loss":
        first_loss(a.folder)
    else:
        if not os.path.isfile(os.path.join(a.folder, "config.json")):
            sys.exit(f"bench_qwen2.py: {a.folder}: no config.json (make it first: bench_qwen2.py make {a.folder})")
        bench_torch(a.folder, a.batch, a.seq_len, a.steps, a.warmup)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The reference workloads of DESIGN.md in PyTorch, timed the way `train --bench`
times dtrain: a full training step (forward, backward, AdamW) on in-memory data,
fp32, after two warm-up steps. Prints one `torch-bench:` line per run, in the
same key=value form as dtrain's `bench:` lines, so the two can be compared.

On a GPU (--device cuda) it times vit-tiny and vit-base in fp32 with TF32 off,
as dtrain runs them. --workloads picks others: vit-base-tf32 (TF32 on),
vit-base-bf16 (autocast to bf16) and gpt2-124m-bf16 (GPT-2 small at context
1024, vocabulary 50257, tied head, bf16 autocast, PyTorch's fused attention);
--compile runs each through torch.compile as well. Every line carries the
peak GPU memory PyTorch allocated.

usage: python3 tools/bench_torch.py [--threads 1,2] [--seconds 3] [--device cpu|cuda]
                                    [--workloads vit-tiny,vit-base,...] [--batch N] [--compile]
"""
import argparse
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 10))


class Block(nn.Module):
    """A pre-LN transformer block with timm's layout (qkv, proj, fc1, fc2)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, size=32, patch=4, dim=192, depth=6, heads=3, classes=10):
        super().__init__()
        n = (size // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class GPTBlock(nn.Module):
    """GPT-2's block: pre-LN, causal attention (PyTorch's fused kernel where it has one), tanh GELU."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):      # PyTorch 2: the fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:                                               # PyTorch 1.13 (Debian's): by hand
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = att.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50257, ctx=1024, dim=768, depth=12, heads=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[GPTBlock(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(self.blocks(x)) @ self.wte.weight.t()      # the tied head


def bench(name, model, batch, threads, seconds, size=32, device="cpu", dtype=None, tokens=None, compile_=False):
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = model.to(device)
    if tokens:                      # a language model: ids in, next ids as labels
        x = torch.randint(0, tokens[1], (batch, tokens[0]), device=device)
        y = torch.randint(0, tokens[1], (batch * tokens[0],), device=device)
    else:
        x = torch.rand(batch, 3, size, size, device=device) * 2 - 1
        y = torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    fwd = torch.compile(model) if compile_ else model
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps, t0 = 0, 0.0
    for i in range(1000):
        if i == 2:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            out = fwd(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 2:
            steps = i - 1
            if steps >= 3 and time.perf_counter() - t0 > seconds:
                break
    sync()
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    where = f"device=cuda gpu={torch.cuda.get_device_name().replace(' ', '_')}" if device == "cuda" else f"threads={threads}"
    # MB of 10^6 bytes, as dtrain's bench line counts them
    extra = f" peak_mem_mb={torch.cuda.max_memory_allocated() / 1e6:.1f}" if device == "cuda" else ""
    if tokens:
        extra += f" tokens_per_s={steps * batch * tokens[0] / dt:.1f}"
    print(f"torch-bench: workload={name} torch={torch.__version__}{' compiled=1' if compile_ else ''} {where} "
          f"batch={batch} params={params} steps={steps} step_ms={dt / steps * 1e3:.2f} "
          f"samples_per_s={steps * batch / dt:.1f}{extra}", flush=True)
    del model, opt, fwd
    if device == "cuda":
        torch.cuda.empty_cache()


# The GPU workloads: (model, default batch, image size, autocast dtype, TF32, (context, vocabulary) for a language model)
GPU_WORKLOADS = {
    "vit-tiny": (lambda: ViT(), 64, 32, None, False, None),
    "vit-base": (lambda: ViT(224, 16, 768, 12, 12), 64, 224, None, False, None),
    "vit-base-tf32": (lambda: ViT(224, 16, 768, 12, 12), 64, 224, None, True, None),
    "vit-base-bf16": (lambda: ViT(224, 16, 768, 12, 12), 64, 224, torch.bfloat16, False, None),
    "gpt2-124m-bf16": (lambda: GPT(), 8, 0, torch.bfloat16, False, (1024, 50257)),
}
# The CPU workloads: (model, batch, image size, (context, vocabulary) for a language model).
# gpt-char is dtrain's --model gpt default; gpt2-124m-ctx256 is GPT-2 small's shape at context 256.
CPU_WORKLOADS = {
    "mlp": (lambda: mlp(), 128, 32, None),
    "vit-tiny": (lambda: ViT(), 64, 32, None),
    "gpt-char": (lambda: GPT(256, 64, 128, 4, 4), 32, 0, (64, 256)),
    "gpt2-124m-ctx256": (lambda: GPT(50257, 256), 4, 0, (256, 50257)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workloads", help="GPU (default vit-tiny,vit-base): " + ",".join(GPU_WORKLOADS)
                    + "; CPU (default mlp,vit-tiny): " + ",".join(CPU_WORKLOADS))
    ap.add_argument("--batch", type=int, help="GPU: the batch of every workload (default: each its own)")
    ap.add_argument("--compile", action="store_true", help="GPU: each workload eager, then through torch.compile")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    known = GPU_WORKLOADS if a.device == "cuda" else CPU_WORKLOADS
    a.workloads = a.workloads or ("vit-tiny,vit-base" if a.device == "cuda" else "mlp,vit-tiny")
    for name in a.workloads.split(","):
        if name not in known:
            sys.exit(f"bench_torch.py: --workloads: no {a.device} workload '{name}' (known: {', '.join(known)})")
    if a.device == "cuda":
        for name in a.workloads.split(","):
            make, batch, size, dtype, tf32, tokens = GPU_WORKLOADS[name]
            # dtrain multiplies in plain fp32 on the GPU unless told otherwise; so must the comparison.
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            for c in ([False, True] if a.compile else [False]):
                bench(name, make(), a.batch or batch, 1, a.seconds, size, "cuda", dtype, tokens, c)
        return
    if a.one is None:
        # One process per thread count: a BLAS reads its thread count once, when
        # it loads, and OpenBLAS's own threads ignore torch.set_num_threads.
        # OMP_WAIT_POLICY=PASSIVE: PyTorch's two thread pools otherwise spin
        # against each other, and on 2 cores that halves its speed at 2 threads;
        # the comparison is with PyTorch at its best.
        for t in [int(s) for s in a.threads.split(",")]:
            env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t))
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            subprocess.run([sys.executable, __file__, "--one", str(t), "--seconds", str(a.seconds),
                            "--workloads", a.workloads], env=env, check=True)
        return
    torch.set_flush_denormal(True)   # as dtrain does: subnormals cost x86 cores dearly
    for name in a.workloads.split(","):
        make, batch, size, tokens = CPU_WORKLOADS[name]
        bench(name, make(), batch, a.one, a.seconds, size, tokens=tokens)


if __name__ == "__main__":
    main()

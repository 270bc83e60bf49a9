#!/usr/bin/env python3
"""The reference workloads of DESIGN.md in PyTorch, timed the way `train --bench`
times dtrain: a full training step (forward, backward, AdamW) on in-memory data,
fp32, after two warm-up steps. Prints one `torch-bench:` line per run, in the
same key=value form as dtrain's `bench:` lines, so the two can be compared.

On a GPU (--device cuda) it times vit-tiny and vit-base in fp32 with TF32 off,
as dtrain runs them, and prints achieved TFLOP/s from the same FLOP count.

usage: python3 tools/bench_torch.py [--threads 1,2] [--seconds 3] [--device cpu|cuda]
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


def bench(name, model, batch, threads, seconds, size=32, device="cpu"):
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = model.to(device)
    x = torch.rand(batch, 3, size, size, device=device) * 2 - 1
    y = torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    steps, t0 = 0, 0.0
    for i in range(1000):
        if i == 2:
            sync()
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
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
    print(f"torch-bench: workload={name} torch={torch.__version__} {where} batch={batch} params={params} "
          f"steps={steps} step_ms={dt / steps * 1e3:.2f} samples_per_s={steps * batch / dt:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.device == "cuda":
        # dtrain multiplies in plain fp32 on the GPU; so must the comparison.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        bench("vit-tiny", ViT(), 64, 1, a.seconds, 32, "cuda")
        bench("vit-base", ViT(224, 16, 768, 12, 12), 64, 1, a.seconds, 224, "cuda")
        return
    if a.one is None:
        # One process per thread count: a BLAS reads its thread count once, when
        # it loads, and OpenBLAS's own threads ignore torch.set_num_threads.
        for t in [int(s) for s in a.threads.split(",")]:
            env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t))
            subprocess.run([sys.executable, __file__, "--one", str(t), "--seconds", str(a.seconds)], env=env, check=True)
        return
    torch.set_flush_denormal(True)   # as dtrain does: subnormals cost x86 cores dearly
    bench("mlp", mlp(), 128, a.one, a.seconds)
    bench("vit-tiny", ViT(), 64, a.one, a.seconds)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compare two safetensors files tensor by tensor: for each name in both, the
largest |a - b| relative to the largest |a|, largest first. F32 tensors only;
the standard library only, so it runs wherever python3 does.

usage: python3 tools/tensor_diff.py A.safetensors B.safetensors [--top N] [--above X] [--only PREFIX]
Prints "NAME  max|a-b|/max|a|  max|a-b|  max|a|" for the N tensors (default 10)
that differ most, of those whose relative difference is above X (default 0)
and whose name starts with PREFIX (default: every name). A NaN in one file and
not the other counts as an infinite difference. Exits 1 when a file cannot be read.
"""
import argparse
import json
import math
import struct
import sys
from array import array


def read(path):
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError, struct.error) as e:
        sys.exit(f"tensor_diff.py: {path}: not a safetensors file ({e})")
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t.get("dtype") != "F32":
            continue
        a, b = t["data_offsets"]
        v = array("f")
        v.frombytes(data[a:b])
        if sys.byteorder != "little":
            v.byteswap()
        out[name] = v
    return out


def gap(x, y):
    """|x - y|, where a NaN on one side only is infinitely far and NaN on both is equal."""
    if math.isnan(x) or math.isnan(y):
        return 0.0 if math.isnan(x) and math.isnan(y) else float("inf")
    return abs(x - y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--above", type=float, default=0.0)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    a, b = read(args.a), read(args.b)
    rows = []
    names = [n for n in a if n.startswith(args.only)]
    for name in names:
        if name not in b or len(a[name]) != len(b[name]):
            rows.append((float("inf"), 0.0, 0.0, name + " (missing or another size)"))
            continue
        d = max((gap(x, y) for x, y in zip(a[name], b[name])), default=0.0)
        m = max((abs(x) for x in a[name] if not math.isnan(x)), default=0.0)
        rel = d / m if m > 0 else (0.0 if d == 0 else float("inf"))
        if rel > args.above:
            rows.append((rel, d, m, name))
    rows.sort(reverse=True)
    print(f"{len(rows)} of {len(names)} tensors differ by more than {args.above:g} of their largest value")
    for rel, d, m, name in rows[:args.top]:
        print(f"  {name:44s} {rel:10.3g} {d:10.3g} {m:10.3g}")


if __name__ == "__main__":
    main()

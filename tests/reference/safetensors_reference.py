#!/usr/bin/env python3
"""Reference safetensors file for tests/io/safetensors_test.cpp, written by the Python
`safetensors` package: one small tensor of every dtype mixprec::io reads, exact values.

    python3 tests/reference/safetensors_reference.py tests/reference/data/reference.safetensors
    python3 tests/reference/safetensors_reference.py --check tests/reference/data/reference.safetensors
    python3 tests/reference/safetensors_reference.py --verify FILE   # FILE holds exactly these tensors

--check compares the stored file with the tensors defined here; --verify is what the C++ test runs on a file
that mixprec::io::save_safetensors wrote, to show that Python reads it back identically.
"""
import argparse
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

METADATA = {"format": "pt", "source": "mixprec"}


def reference_tensors():
    grid = torch.arange(12, dtype=torch.float64).reshape(3, 4) * 0.5 - 1.0  # exact in 16 bits
    return {
        "f32": grid.to(torch.float32),
        "f16": grid.to(torch.float16),
        "bf16": grid.to(torch.bfloat16),
        "f64": torch.arange(5, dtype=torch.float64) / 3.0,
        "i64": torch.tensor([-3, 0, 2**40], dtype=torch.int64),
        "i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.zeros((0, 3), dtype=torch.float32),
    }


def verify(path):
    expected = reference_tensors()
    got = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    problems = []
    if sorted(got) != sorted(expected):
        problems.append(f"keys {sorted(got)} != {sorted(expected)}")
    for name, t in expected.items():
        g = got.get(name)
        if g is None:
            continue
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            problems.append(f"{name}: got {g.dtype} {tuple(g.shape)} {g.tolist()}, "
                            f"expected {t.dtype} {tuple(t.shape)} {t.tolist()}")
    if metadata != METADATA:
        problems.append(f"metadata {metadata} != {METADATA}")
    for p in problems:
        print(f"{path}: {p}")
    if not problems:
        print(f"{path}: Python safetensors reads the reference tensors")
    return 1 if problems else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path", nargs="?", help="where to write the reference file")
    parser.add_argument("--check", help="compare with this file instead of writing")
    parser.add_argument("--verify", help="check that this file holds the reference tensors")
    args = parser.parse_args()
    if args.verify:
        return verify(args.verify)
    if args.path:
        save_file(reference_tensors(), args.path, metadata=METADATA)
        return 0
    if not args.check:
        parser.error("give a path, --check or --verify")
    # The writer's byte layout is not deterministic (tensors of one alignment come in any
    # order), so the check compares content: the stored file must hold today's tensors.
    if verify(args.check) != 0:
        print(f"{args.check} is stale: regenerate it with {sys.argv[0]} {args.check}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""GFLOP/s of LibTorch's bf16 GEMMs on the large GPT-2's shapes (2048 tokens) against a 2048^3
product: how close the linear layers' products run to this CPU's peak.

    python3 bench/gpt2_gemm_shapes.py [--reps 15] [--threads 2]

Per layer: the forward (addmm with bias; the tied LM head: linear), the input gradient
(g W^T) and the weight gradient (x^T g), each the median of --reps after 3 warm-up calls.
"""
import argparse
import statistics
import time

import torch


def median_seconds(f, reps):
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bf16, M = torch.bfloat16, 2048
    a, b = torch.randn(M, M, dtype=bf16), torch.randn(M, M, dtype=bf16)
    peak = 2 * M**3 / median_seconds(lambda: torch.mm(a, b), args.reps) / 1e9
    print(f"bf16 2048^3 mm: {peak:.0f} GFLOP/s\n")
    print("| layer (in -> out) | forward | input gradient | weight gradient |")
    print("|---|---|---|---|")
    for name, K, N in [("c_attn", 512, 1536), ("attn c_proj", 512, 512), ("c_fc", 512, 2048),
                       ("mlp c_proj", 2048, 512), ("LM head", 512, 4096)]:
        x, g = torch.randn(M, K, dtype=bf16), torch.randn(M, N, dtype=bf16)
        if name == "LM head":  # the tied embedding, stored (out, in)
            w = torch.randn(N, K, dtype=bf16)
            forward = lambda: torch.nn.functional.linear(x, w)
            input_grad = lambda: torch.mm(g, w)
            weight_grad = lambda: torch.mm(g.t(), x)
        else:  # HF's Conv1D, stored (in, out)
            w, bias = torch.randn(K, N, dtype=bf16), torch.randn(N, dtype=bf16)
            forward = lambda: torch.addmm(bias, x, w)
            input_grad = lambda: torch.mm(g, w.t())
            weight_grad = lambda: torch.mm(x.t(), g)
        rates = [2 * M * K * N / median_seconds(f, args.reps) / 1e9
                 for f in (forward, input_grad, weight_grad)]
        print(f"| {name} ({K} -> {N}) | " + " | ".join(f"{r:.0f} GFLOP/s" for r in rates) + " |")


if __name__ == "__main__":
    main()

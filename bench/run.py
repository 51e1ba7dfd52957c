#!/usr/bin/env python3
"""The benchmark driver: runs the level-1 loop in C++ (mixprec) and in Python
(PyTorch) side by side, interleaved, several times, and prints Markdown tables
of medians.

    python3 bench/run.py [--reps 5] [--steps 300] [--build build] [--json out.json]

Tables: steps/s per precision (fused AdamW; GradScaler for fp16), ratio of
mixprec to PyTorch, and whether both reach the same final loss; and the
GradScaler's own cost in fp16, as a share of step time: 1 - (steps/s with the
scaler) / (steps/s without it), for the fused and the unfused AdamW.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (precision, optimizer, scaler)
CONFIGS = [
    ("fp32", "fused", False),
    ("bf16", "fused", False),
    ("fp16", "fused", True),
    ("fp16", "fused", False),
    ("fp16", "unfused", True),
    ("fp16", "unfused", False),
]


def run_one(impl, config, args):
    precision, optimizer, scaler = config
    flags = ["--precision", precision, "--optimizer", optimizer, "--steps", str(args.steps),
             "--data", args.data]
    if scaler:
        flags.append("--scaler")
    if impl == "mixprec":
        cmd = [os.path.join(args.build, "bench", "amp_loop_bench")] + flags
    else:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "amp_loop_bench.py")] + flags
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "digits.csv"))
    p.add_argument("--json", help="also write every run here")
    args = p.parse_args()

    runs = {}
    for rep in range(args.reps):
        for config in CONFIGS:
            for impl in ("mixprec", "pytorch"):
                r = run_one(impl, config, args)
                runs.setdefault((impl,) + config, []).append(r)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    def median(impl, config):
        return statistics.median(r["steps_per_s"] for r in runs[(impl,) + config])

    def loss(impl, config):
        return runs[(impl,) + config][0]["final_loss"]

    import torch
    print(f"Level-1 loop, digits MLP (64-256-256-10, batch 64), {args.steps} timed steps after 30 "
          f"warm-up, median of {args.reps} interleaved runs; {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, 2 threads.\n")
    print("| precision | mixprec steps/s | PyTorch steps/s | mixprec / PyTorch | same final loss |")
    print("|---|---|---|---|---|")
    for config in CONFIGS[:3]:
        m, t = median("mixprec", config), median("pytorch", config)
        name = config[0] + (" + GradScaler" if config[2] else "")
        same = "yes" if loss("mixprec", config) == loss("pytorch", config) else (
            f"{loss('mixprec', config):.6f} vs {loss('pytorch', config):.6f}")
        print(f"| {name} | {m:.0f} | {t:.0f} | {m / t:.2f}x | {same} |")
    print("\nGradScaler cost in fp16 (share of step time):\n")
    print("| AdamW | mixprec | PyTorch |")
    print("|---|---|---|")
    for optimizer in ("fused", "unfused"):
        cells = []
        for impl in ("mixprec", "pytorch"):
            on = median(impl, ("fp16", optimizer, True))
            off = median(impl, ("fp16", optimizer, False))
            cells.append(f"{100 * (1 - on / off):.1f}%")
        print(f"| {optimizer} | {cells[0]} | {cells[1]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for rs in runs.values() for r in rs], f, indent=1)


if __name__ == "__main__":
    main()

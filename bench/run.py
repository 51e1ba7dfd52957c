#!/usr/bin/env python3
"""The benchmark driver: runs the level-1 loop and the Accelerator loop in C++
(mixprec) and in Python (PyTorch, HF Accelerate) side by side, interleaved,
several times, and prints Markdown tables of medians.

    python3 bench/run.py [--reps 5] [--steps 300] [--build build] [--json out.json]

Tables: steps/s per precision (fused AdamW; GradScaler for fp16) of each loop,
ratio of mixprec to its Python twin, the Accelerator's overhead over the plain
loop, and the final losses; and the GradScaler's own cost in fp16, as a share
of step time: 1 - (steps/s with the scaler) / (steps/s without it), for the
fused and the unfused AdamW.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (loop, precision, optimizer, scaler)
CONFIGS = [
    ("plain", "fp32", "fused", False),
    ("plain", "bf16", "fused", False),
    ("plain", "fp16", "fused", True),
    ("accelerator", "fp32", "fused", False),
    ("accelerator", "bf16", "fused", False),
    ("accelerator", "fp16", "fused", True),
    ("plain", "fp16", "fused", False),
    ("plain", "fp16", "unfused", True),
    ("plain", "fp16", "unfused", False),
]


def run_one(impl, config, args):
    loop, precision, optimizer, scaler = config
    flags = ["--loop", loop, "--precision", precision, "--optimizer", optimizer, "--steps", str(args.steps),
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
    print(f"Level-1 loop and Accelerator loop, digits MLP (64-256-256-10, batch 64), {args.steps} timed steps after 30 "
          f"warm-up, median of {args.reps} interleaved runs; {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, 2 threads.\n")
    print("| precision | loop: mixprec | PyTorch | ratio | Accelerator: mixprec | Accelerate | ratio "
          "| Accelerator overhead (mixprec) | final loss: loop / Accelerator / Accelerate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision, scaler in (("fp32", False), ("bf16", False), ("fp16", True)):
        plain, acc = ("plain", precision, "fused", scaler), ("accelerator", precision, "fused", scaler)
        m, t = median("mixprec", plain), median("pytorch", plain)
        ma, ta = median("mixprec", acc), median("pytorch", acc)
        name = precision + (" + GradScaler" if scaler else "")
        # The loop's loss is the same in C++ and Python (checked below), so one column serves.
        assert loss("mixprec", plain) == loss("pytorch", plain), (plain, runs)
        losses = f"{loss('mixprec', plain):.6f} / {loss('mixprec', acc):.6f} / {loss('pytorch', acc):.6f}"
        print(f"| {name} | {m:.0f} | {t:.0f} | {m / t:.2f}x | {ma:.0f} | {ta:.0f} | {ma / ta:.2f}x "
              f"| {100 * (1 - ma / m):.1f}% | {losses} |")
    print("\nGradScaler cost in fp16 (share of step time):\n")
    print("| AdamW | mixprec | PyTorch |")
    print("|---|---|---|")
    for optimizer in ("fused", "unfused"):
        cells = []
        for impl in ("mixprec", "pytorch"):
            on = median(impl, ("plain", "fp16", optimizer, True))
            off = median(impl, ("plain", "fp16", optimizer, False))
            cells.append(f"{100 * (1 - on / off):.1f}%")
        print(f"| {optimizer} | {cells[0]} | {cells[1]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for rs in runs.values() for r in rs], f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peak RSS and tokens/s of the large GPT-2 loop with mixprec's memory savings, beside PyTorch's
twin doing the same, under two allocators; interleaved reps, Markdown tables of medians.

    python3 bench/memory.py [--reps 3] [--steps 10] [--allocators glibc,tcmalloc] [--json runs.jsonl]
    python3 bench/memory.py --from-json docs/bench/gpt2-large-memory.jsonl  # the tables only

Savings: activation checkpointing (--activation-checkpointing: HF's activation_checkpointing_enable()
in the twin) and the optimizer in the backward (--optimizer-in-backward: optim::OptimizerInBackward;
PyTorch's post-accumulate-grad-hook recipe in the twin). Allocators: glibc with run.py's malloc reuse
settings (what mixprec's Accelerator and Trainer set), or tcmalloc (LD_PRELOAD; Debian's
libtcmalloc-minimal4), for C++ and Python alike. Each ratio to fp32 is taken within one rep, same
implementation and allocator, then the median. PyTorch's fp16 is not run: its fp16 GEMMs are scalar
loops on this CPU (its large loop did not finish in run.py's 60 s timeout).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from run import MALLOC_REUSE, ROOT

CHECKPOINTING = ["--activation-checkpointing"]
BOTH = CHECKPOINTING + ["--optimizer-in-backward"]
CONFIGS = [  # (precision, flags); the first is the reference of the ratios
    ("fp32", []),
    ("fp32", BOTH),
    ("bf16", []),
    ("bf16", CHECKPOINTING),
    ("bf16", BOTH),
    ("fp16", []),
    ("fp16", CHECKPOINTING),
]
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def environment(allocator):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if allocator == "glibc":
        return dict(env, **MALLOC_REUSE)
    if not os.path.exists(TCMALLOC):
        sys.exit(f"{TCMALLOC} not found: apt-get install libtcmalloc-minimal4")
    return dict(env, LD_PRELOAD=TCMALLOC)


def run(impl, precision, flags, allocator, args):
    common = ["--size", "large", "--precision", precision, "--steps", str(args.steps)] + flags
    cmd = ([os.path.join(args.build, "bench", "gpt2_bench")] if impl == "mixprec"
           else [sys.executable, os.path.join(ROOT, "bench", "gpt2_bench.py")]) + common
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=environment(allocator)).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r.update(allocator=allocator, flags=" ".join(flags), steps=args.steps)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--allocators", default="glibc,tcmalloc")
    p.add_argument("--impls", default="mixprec,pytorch")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--json", help="also write every run here, one JSON line each")
    p.add_argument("--from-json", help="print the tables of a file --json wrote, run nothing")
    args = p.parse_args()
    allocators, impls = args.allocators.split(","), args.impls.split(",")
    runs = []
    if args.from_json:
        with open(args.from_json) as f:
            runs = [json.loads(line) for line in f]
        args.reps, args.steps = len({r["rep"] for r in runs}), runs[0]["steps"]
    elif args.json:
        open(args.json, "w").close()  # this run's lines only
    for rep in range(0 if args.from_json else args.reps):
        for allocator in allocators:
            for precision, flags in CONFIGS:
                for impl in impls:
                    if impl == "pytorch" and precision == "fp16":
                        continue
                    r = run(impl, precision, flags, allocator, args)
                    r["rep"] = rep
                    runs.append(r)
                    print(json.dumps(r), file=sys.stderr)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(r) + "\n")

    def of(impl, allocator, precision, flags):
        return [r for r in runs if (r["impl"], r["allocator"], r["precision"], r["flags"])
                == (impl, allocator, precision, " ".join(flags))]

    def median(rs, key):
        return statistics.median(r[key] for r in rs) if rs else None

    def rss_ratio(impl, allocator, precision, flags):  # to plain fp32, within each rep
        base = {r["rep"]: r["peak_rss_mb"] for r in of(impl, allocator, *CONFIGS[0])}
        return statistics.median(r["peak_rss_mb"] / base[r["rep"]] for r in of(impl, allocator, precision, flags))

    def cell(v, fmt):
        return "-" if v is None else fmt.format(v)

    for allocator in allocators:
        print(f"\n{allocator}: tokens/s, peak RSS MB (x plain fp32's), activations MB; "
              f"medians of {args.reps} reps, {args.steps} steps\n")
        print("| precision | savings | " + " | ".join(f"{i} tokens/s | {i} peak RSS | {i} activations"
                                                     for i in impls) + " |")
        print("|---|---|" + "---|---|---|" * len(impls))
        for precision, flags in CONFIGS:
            cells = []
            for impl in impls:
                rs = of(impl, allocator, precision, flags)
                rss = cell(median(rs, "peak_rss_mb"), "{:.0f}")
                if rs:
                    rss += " ({:.2f}x)".format(rss_ratio(impl, allocator, precision, flags))
                cells += [cell(median(rs, "tokens_per_s"), "{:.0f}"), rss,
                          cell(median(rs, "activation_mb"), "{:.0f}")]
            print(f"| {precision} | {' + '.join(f.lstrip('-') for f in flags) or 'none'} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

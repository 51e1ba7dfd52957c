#!/usr/bin/env python3
"""Reference learning rates of transformers.get_scheduler, for
tests/optim/lr_scheduler_test.cpp.

    python3 tests/reference/lr_schedules.py > tests/reference/data/lr_schedules.json
    python3 tests/reference/lr_schedules.py --check tests/reference/data/lr_schedules.json
"""
import argparse
import json
import sys

import torch
import transformers
from transformers import get_scheduler

STEPS = 40  # past num_training_steps, to cover what comes after the schedule ends

CASES = [
    {"name": name, "num_warmup_steps": warmup, "num_training_steps": 30, "kwargs": kwargs}
    for name in ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                 "constant_with_warmup", "inverse_sqrt"]
    for warmup in (0, 5)
    for kwargs in ([{}] + ([{"num_cycles": 3}] if name == "cosine_with_restarts" else [])
                   + ([{"lr_end": 1e-4, "power": 2.0}] if name == "polynomial" else [])
                   + ([{"timescale": 7}] if name == "inverse_sqrt" else []))
]


def trace(case):
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    # Two param groups with their own lr: the schedule scales each.
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    scheduler = get_scheduler(case["name"], optimizer, num_warmup_steps=case["num_warmup_steps"],
                              num_training_steps=case["num_training_steps"],
                              scheduler_specific_kwargs=case["kwargs"] or None)
    lrs = []
    for _ in range(STEPS):
        lrs.append(scheduler.get_last_lr())
        optimizer.step()
        scheduler.step()
    return dict(case, lrs=lrs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", help="compare with this file instead of printing")
    args = p.parse_args()
    out = {"transformers": transformers.__version__, "cases": [trace(c) for c in CASES]}
    if args.check:
        stored = json.load(open(args.check))
        if stored["cases"] != out["cases"]:
            sys.exit(f"{args.check} is stale: regenerate it with {sys.argv[0]} > {args.check}")
        print(f"{args.check}: up to date ({len(out['cases'])} schedules)")
    else:
        json.dump(out, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()

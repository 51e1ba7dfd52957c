#!/usr/bin/env python3
"""Reference learning rates of transformers.get_scheduler, for
tests/optim/lr_scheduler_test.cpp.

    python3 tests/reference/lr_schedules.py > tests/reference/data/lr_schedules.json
    python3 tests/reference/lr_schedules.py --check tests/reference/data/lr_schedules.json
"""
import torch
import transformers
from transformers import get_scheduler

from common import emit_or_check

STEPS = 40  # past num_training_steps, to cover what comes after the schedule ends

CASES = [
    {"name": name, "num_warmup_steps": warmup, "num_training_steps": 30, "kwargs": kwargs}
    for name in ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                 "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr",
                 "cosine_warmup_with_min_lr"]
    for warmup in (0, 5)
    for kwargs in (
        # cosine_with_min_lr needs one of min_lr (over the optimizer's default lr) or min_lr_rate,
        [{"min_lr": 1e-3}, {"min_lr_rate": 0.1, "num_cycles": 1.0}] if name == "cosine_with_min_lr"
        # ... and its twin whose warmup starts above 0, from warmup_lr_rate when given.
        else [{"min_lr": 1e-3}, {"min_lr_rate": 0.1, "warmup_lr_rate": 0.2, "num_cycles": 1.0}]
        if name == "cosine_warmup_with_min_lr"
        else [{}] + ([{"num_cycles": 3}] if name == "cosine_with_restarts" else [])
        + ([{"lr_end": 1e-4, "power": 2.0}] if name == "polynomial" else [])
        + ([{"timescale": 7}] if name == "inverse_sqrt" else []))
] + [
    # warmup_stable_decay: each warmup and decay curve, min_lr_ratio, num_cycles, and a stable
    # phase given (which HF takes over num_training_steps, with a warning).
    {"name": "warmup_stable_decay", "num_warmup_steps": warmup, "num_training_steps": 30,
     "kwargs": kwargs}
    for warmup in (0, 5)
    for kwargs in (
        {"num_decay_steps": 10},
        {"num_decay_steps": 8, "warmup_type": "cosine", "decay_type": "linear",
         "min_lr_ratio": 0.1},
        {"num_decay_steps": 8, "num_stable_steps": 6, "warmup_type": "1-sqrt",
         "decay_type": "1-sqrt", "min_lr_ratio": 0.05},
        {"num_decay_steps": 12, "num_cycles": 1.0})
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


if __name__ == "__main__":
    emit_or_check(lambda: {"transformers": transformers.__version__,
                           "cases": [trace(c) for c in CASES]})

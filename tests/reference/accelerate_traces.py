#!/usr/bin/env python3
"""Reference traces of HF Accelerate 1.16 (Accelerator.prepare / accumulate /
backward / clip_grad_norm_ + AdamW + a linear warm-up schedule), for
tests/accelerate/accelerator_reference_test.cpp.

"no" and "bf16" run Accelerate itself. Accelerate asked for "fp16" on a CPU
trains in fp32 without a word, so the fp16 cases run, by hand, the loop that
Accelerate runs on a GPU: autocast fp16, loss / accumulation steps,
GradScaler.scale(loss).backward(), unscale_ before clipping, scaler.step +
update on sync steps, and a scheduler that does not advance on a skipped step.

    python3 tests/reference/accelerate_traces.py > tests/reference/data/accelerate_traces.json
    python3 tests/reference/accelerate_traces.py --check tests/reference/data/accelerate_traces.json
"""
import math

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import get_scheduler

from common import emit_or_check

N, BATCH, FEATURES, HIDDEN, CLASSES = 64, 8, 16, 32, 4
MICRO_STEPS = 16

CASES = [
    {"name": "fp32", "mixed_precision": "no", "accumulation": 1, "inject": []},
    {"name": "fp32_accumulate", "mixed_precision": "no", "accumulation": 2, "inject": []},
    {"name": "bf16", "mixed_precision": "bf16", "accumulation": 1, "inject": []},
    {"name": "bf16_accumulate", "mixed_precision": "bf16", "accumulation": 4, "inject": []},
    {"name": "fp16", "mixed_precision": "fp16", "accumulation": 1, "inject": [3, 4]},
    {"name": "fp16_accumulate", "mixed_precision": "fp16", "accumulation": 2, "inject": [5]},
]


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def num(x):
    """JSON has no inf/NaN: write them as strings."""
    return x if math.isfinite(x) else str(x)


def flat(t):
    return t.detach().float().reshape(-1).tolist()


def run(case):
    torch.manual_seed(0)
    x_all, y_all = torch.randn(N, FEATURES), torch.randint(0, CLASSES, (N,))
    model = make_model()
    init = {k: flat(v) for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    optimizer_steps = MICRO_STEPS // case["accumulation"]
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2,
                              num_training_steps=optimizer_steps)
    fp16 = case["mixed_precision"] == "fp16"
    if not fp16:
        # Accelerate keeps its state in process-wide singletons: start each case afresh.
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(mixed_precision=case["mixed_precision"], cpu=True,
                                  gradient_accumulation_steps=case["accumulation"])
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    losses, syncs, lrs, skipped, norms = [], [], [], [], []
    micro = 0
    for i in range(MICRO_STEPS):
        b = i % (N // BATCH)
        x, y = x_all[b * BATCH:(b + 1) * BATCH], y_all[b * BATCH:(b + 1) * BATCH]
        if not fp16:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                sync = accelerator.sync_gradients
                if sync:
                    norms.append(num(float(accelerator.clip_grad_norm_(model.parameters(), 1.0))))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if sync:
                    skipped.append(accelerator.optimizer_step_was_skipped)
        else:
            micro += 1
            sync = micro % case["accumulation"] == 0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
                if i in case["inject"]:
                    loss = loss * math.inf
            scaler.scale(loss / case["accumulation"]).backward()
            if sync:
                scaler.unscale_(optimizer)
                norms.append(num(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))))
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                was_skipped = scaler.get_scale() < scale_before
                if not was_skipped:
                    scheduler.step()
                optimizer.zero_grad()
                skipped.append(was_skipped)
        losses.append(num(loss.item()))
        syncs.append(sync)
        if sync:
            lrs.append(scheduler.get_last_lr()[0])
    params = {k: flat(v) for k, v in
              (accelerator.unwrap_model(model) if not fp16 else model).state_dict().items()}
    return dict(case, data={"x": flat(x_all), "y": y_all.tolist()}, init=init, losses=losses,
                syncs=syncs, lrs=lrs, skipped=skipped, grad_norms=norms, params=params)


def compute():
    torch.set_num_threads(1)
    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "cases": [run(c) for c in CASES]}


if __name__ == "__main__":
    emit_or_check(compute)

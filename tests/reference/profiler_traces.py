#!/usr/bin/env python3
"""Reference schedules and traces of torch.profiler.profile, for
tests/accelerate/profiler_test.cpp: the action of each step under torch.profiler.schedule,
and for a few runs of known ops, when on_trace_ready runs and what key_averages() holds then.

    python3 tests/reference/profiler_traces.py > tests/reference/data/profiler_traces.json
    python3 tests/reference/profiler_traces.py --check tests/reference/data/profiler_traces.json
"""
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from common import emit_or_check

SCHEDULES = [
    {"wait": 1, "warmup": 1, "active": 2},
    {"wait": 0, "warmup": 0, "active": 1},
    {"wait": 2, "warmup": 1, "active": 3, "repeat": 2},
    {"wait": 1, "warmup": 2, "active": 2, "repeat": 1, "skip_first": 3},
    {"wait": 3, "warmup": 1, "active": 1, "skip_first": 2, "skip_first_wait": 1},
    {"wait": 0, "warmup": 1, "active": 2},
]
STEPS = 14


def work(step, a, b):
    """Step s: (s % 3 + 1) matmuls and an add, so that which steps were recorded shows."""
    for _ in range(step % 3 + 1):
        torch.mm(a, b)
    a.add(b)


def run(schedule_option, profile_memory, steps):
    a = torch.ones(16, 16)
    b = torch.ones(16, 16)
    traces = []

    def ready(prof):
        rows = prof.key_averages()
        traces.append({
            "step_num": prof.step_num,
            "count": {r.key: r.count for r in rows},
            "cpu_memory_usage": {r.key: r.cpu_memory_usage for r in rows},
            "self_cpu_memory_usage": {r.key: r.self_cpu_memory_usage for r in rows},
        })

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU],
                     schedule=schedule(**schedule_option) if schedule_option else None,
                     on_trace_ready=ready, profile_memory=profile_memory) as prof:
            for step in range(steps):
                work(step, a, b)
                prof.step()
    return {"schedule": schedule_option, "profile_memory": profile_memory, "steps": steps,
            "traces": traces}


def compute():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actions = [{"schedule": s, "actions": [schedule(**s)(step).name for step in range(STEPS)]}
                   for s in SCHEDULES]
    runs = [run(None, False, 3), run(None, True, 3), run(SCHEDULES[0], False, 9),
            run(SCHEDULES[2], True, STEPS), run(SCHEDULES[3], False, STEPS),
            run(SCHEDULES[4], False, STEPS), run(SCHEDULES[0], False, 3),
            # Cycles back to back: a trace saved, the next started in the same step.
            run(SCHEDULES[1], False, 4), run(SCHEDULES[5], True, 8)]
    return {"torch": torch.__version__, "schedules": actions, "runs": runs}


if __name__ == "__main__":
    emit_or_check(compute)

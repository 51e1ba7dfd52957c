#!/usr/bin/env python3
"""Reference traces of torch.amp.GradScaler + torch.autocast + torch.optim, for
tests/amp/grad_scaler_reference_test.cpp (the way PyTorch's optim_baseline.py
feeds its C++ optimizer tests).

Each scenario trains a small MLP on CPU under fp16 autocast with a GradScaler,
injects inf/NaN gradients at chosen steps and records, per step, the loss, the
scale used, whether each optimizer stepped, the scale and growth tracker after
update(), and the final parameters. The C++ test replays the same scenario from
the same initial tensors and data.

    python3 tests/reference/grad_scaler_traces.py > tests/reference/data/grad_scaler_traces.json
    python3 tests/reference/grad_scaler_traces.py --check tests/reference/data/grad_scaler_traces.json
"""
import json
import math
import sys

import torch
from common import emit_or_check

SHAPES = {"w1": (16, 8), "b1": (16,), "w2": (4, 16), "b2": (4,)}
BATCH = 8

SCENARIOS = [
    {"name": "sgd_momentum", "steps": 12,
     "scaler": {"init_scale": 65536.0, "growth_interval": 3},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1", "w2", "b2"], "lr": 0.1, "momentum": 0.9}],
     "inject": [{"step": 2, "param": "w1", "value": "inf"}, {"step": 6, "param": "b2", "value": "nan"}]},
    {"name": "natural_overflow", "steps": 10,
     "scaler": {"init_scale": 2.0**24, "growth_interval": 2},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1", "w2", "b2"], "lr": 0.1}],
     "inject": []},
    {"name": "adamw", "steps": 12,
     "scaler": {"init_scale": 1024.0, "growth_interval": 4},
     "optimizers": [{"type": "adamw", "params": ["w1", "b1", "w2", "b2"], "lr": 0.01, "weight_decay": 0.01}],
     "inject": [{"step": 3, "param": "w2", "value": "inf"}, {"step": 7, "param": "w1", "value": "nan"}]},
    {"name": "adamw_fused", "steps": 12,
     "scaler": {"init_scale": 1024.0, "growth_interval": 4},
     "optimizers": [{"type": "adamw", "fused": True, "params": ["w1", "b1", "w2", "b2"], "lr": 0.01,
                     "weight_decay": 0.01}],
     "inject": [{"step": 3, "param": "w2", "value": "inf"}, {"step": 7, "param": "w1", "value": "nan"}]},
    {"name": "two_optimizers", "steps": 10,
     "scaler": {"init_scale": 256.0, "growth_interval": 2, "growth_factor": 4.0, "backoff_factor": 0.25},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1"], "lr": 0.05},
                    {"type": "adamw", "params": ["w2", "b2"], "lr": 0.01, "weight_decay": 0.0}],
     "inject": [{"step": 4, "param": "w2", "value": "inf"}, {"step": 5, "param": "b1", "value": "-inf"}]},
    {"name": "clip_after_unscale", "steps": 10,
     "scaler": {"init_scale": 4096.0, "growth_interval": 3},
     "optimizers": [{"type": "adamw", "params": ["w1", "b1", "w2", "b2"], "lr": 0.01, "weight_decay": 0.01}],
     "clip_max_norm": 0.5,
     "inject": [{"step": 5, "param": "w1", "value": "nan"}]},
    {"name": "fused_after_unscale", "steps": 8,
     "scaler": {"init_scale": 4096.0, "growth_interval": 3},
     "optimizers": [{"type": "adamw", "fused": True, "params": ["w1", "b1", "w2", "b2"], "lr": 0.01}],
     "clip_max_norm": 0.5,
     "inject": [{"step": 2, "param": "b1", "value": "inf"}]},
    {"name": "state_dict_roundtrip", "steps": 10,
     "scaler": {"init_scale": 512.0, "growth_interval": 3},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1", "w2", "b2"], "lr": 0.1}],
     "roundtrip_after": 4,
     "inject": [{"step": 2, "param": "w1", "value": "inf"}]},
    {"name": "new_scale", "steps": 8,
     "scaler": {"init_scale": 65536.0, "growth_interval": 2000},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1", "w2", "b2"], "lr": 0.1}],
     "new_scale": {"step": 3, "value": 8.0},
     "inject": []},
    # The setters after step 3, where the tracker (4) is past the new interval (2): no growth
    # until the backoff at step 6 resets it, then x3 after 2 clean steps.
    {"name": "setters", "steps": 10,
     "scaler": {"init_scale": 64.0, "growth_interval": 5},
     "optimizers": [{"type": "sgd", "params": ["w1", "b1", "w2", "b2"], "lr": 0.1}],
     "set_after": {"step": 3, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 2},
     "inject": [{"step": 6, "param": "w1", "value": "inf"}]},
]

INJECT = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def scaler_kwargs(cfg):
    return {k: cfg[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval") if k in cfg}


def make_optimizer(cfg, params):
    group = [params[n] for n in cfg["params"]]
    if cfg["type"] == "sgd":
        return torch.optim.SGD(group, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0))
    return torch.optim.AdamW(group, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.01),
                             fused=cfg.get("fused", False))


def run(scenario, seed):
    gen = torch.Generator().manual_seed(seed)
    init = {n: (torch.randn(s, generator=gen) * 0.5) for n, s in SHAPES.items()}
    data = [(torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen))
            for _ in range(scenario["steps"])]
    params = {n: t.clone().requires_grad_(True) for n, t in init.items()}
    optimizers = [make_optimizer(c, params) for c in scenario["optimizers"]]
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs(scenario["scaler"]))
    trace = []
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            h = torch.tanh(torch.nn.functional.linear(x, params["w1"], params["b1"]))
            out = torch.nn.functional.linear(h, params["w2"], params["b2"])
            loss = torch.nn.functional.mse_loss(out, y)
        scaler.scale(loss).backward()
        for inj in scenario["inject"]:
            if inj["step"] == step:
                params[inj["param"]].grad.view(-1)[0] = INJECT[inj["value"]]
        scale_used = scaler.get_scale()
        if "clip_max_norm" in scenario:
            for opt in optimizers:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(list(params.values()), scenario["clip_max_norm"])
        for opt in optimizers:
            scaler.step(opt)
        stepped = [sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()) == 0
                   for opt in optimizers]
        ns = scenario.get("new_scale")
        scaler.update(ns["value"] if ns and ns["step"] == step else None)
        for opt in optimizers:
            opt.zero_grad()
        trace.append({"loss": loss.item(), "scale_used": scale_used, "stepped": stepped,
                      "scale": scaler.get_scale(), "growth_tracker": scaler._get_growth_tracker()})
        setters = scenario.get("set_after")
        if setters and setters["step"] == step:
            scaler.set_growth_factor(setters["growth_factor"])
            scaler.set_backoff_factor(setters["backoff_factor"])
            scaler.set_growth_interval(setters["growth_interval"])
        if scenario.get("roundtrip_after") == step:
            state = scaler.state_dict()
            scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=7)
            scaler.load_state_dict(state)
    return {
        **scenario,
        "seed": seed,
        "init": {n: t.flatten().tolist() for n, t in init.items()},
        "data": [{"x": x.flatten().tolist(), "y": y.flatten().tolist()} for x, y in data],
        "trace": trace,
        "final": {n: p.detach().flatten().tolist() for n, p in params.items()},
        "final_state_dict": scaler.state_dict(),
    }


def compute():
    torch.set_num_threads(1)
    return {"torch": torch.__version__.split("+")[0], "shapes": SHAPES, "batch": BATCH,
            "scenarios": [run(s, seed) for seed, s in enumerate(SCENARIOS)]}


if __name__ == "__main__":
    emit_or_check(compute)

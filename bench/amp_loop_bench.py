#!/usr/bin/env python3
"""Python twin of bench/amp_loop_bench.cpp: the same loop with torch.autocast,
torch.amp.GradScaler and torch.optim.AdamW (or, with --loop accelerator, HF
Accelerate's Accelerator, or with --loop trainer, transformers' Trainer), on the same
data, model and sizes. Prints one JSON line. Run through bench/run.py."""
import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from timing import time_steps, time_trainer


def load_digits_csv(path):
    raw = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32)
    return torch.from_numpy(raw[:, :64] / 16.0), torch.from_numpy(raw[:, 64]).long()


class MLP(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--optimizer", choices=["fused", "unfused"], default="fused")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--loop", choices=["plain", "accelerator", "trainer"], default="plain")
    p.add_argument("--data", default="data/digits.csv")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's clipping (0: none)")
    p.add_argument("--sampling", choices=["random", "sequential"], default="random",
                   help="the Trainer's train_sampling_strategy")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    images, labels = load_digits_csv(a.data)
    # The same 80/20 split as digits::split (same generator, same seed).
    torch.manual_seed(0)
    perm = torch.randperm(images.shape[0])[: images.shape[0] * 8 // 10]
    images, labels = images[perm], labels[perm]
    torch.manual_seed(0)
    model = MLP(a.hidden)
    fused = a.optimizer == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused, foreach=False if not fused else None)
    scaler = torch.amp.GradScaler("cpu", enabled=a.scaler)
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16
    n_batches = images.shape[0] // a.batch_size

    def step(i):
        b = i % n_batches
        x = images[b * a.batch_size:(b + 1) * a.batch_size]
        y = labels[b * a.batch_size:(b + 1) * a.batch_size]
        with torch.autocast("cpu", dtype=dtype, enabled=a.precision != "fp32"):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    if a.loop == "accelerator":
        from accelerate import Accelerator
        # Asked for fp16 on a CPU, Accelerate trains in fp32 without a word.
        accelerator = Accelerator(mixed_precision="no" if a.precision == "fp32" else a.precision,
                                  cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)

        def step(i):  # noqa: F811 (the accelerated twin of the loop above)
            b = i % n_batches
            x = images[b * a.batch_size:(b + 1) * a.batch_size]
            y = labels[b * a.batch_size:(b + 1) * a.batch_size]
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss

    if a.loop == "trainer":
        class Classifier(torch.nn.Module):  # the Trainer's contract: a batch in, the loss out
            def __init__(self, mlp):
                super().__init__()
                self.mlp = mlp

            def forward(self, pixels, labels):
                logits = self.mlp(pixels)
                return {"loss": F.cross_entropy(logits, labels), "logits": logits}

        final_loss, seconds = time_trainer(
            Classifier(model), [{"pixels": x, "labels": y} for x, y in zip(images, labels)], a.warmup, a.steps,
            fp16=a.precision == "fp16", bf16=a.precision == "bf16", per_device_train_batch_size=a.batch_size,
            dataloader_drop_last=True, learning_rate=3e-3, lr_scheduler_type="constant",
            optim="adamw_torch_fused" if fused else "adamw_torch", max_grad_norm=a.max_grad_norm,
            **({} if a.sampling == "random" else {"train_sampling_strategy": a.sampling}))
    else:
        for i in range(a.warmup):
            step(i)
        final_loss, seconds = time_steps(step, a.warmup, a.steps)
    print(json.dumps({"impl": "pytorch", "loop": a.loop, "precision": a.precision, "optimizer": a.optimizer,
                      "scaler": a.scaler, "steps_per_s": round(a.steps / seconds, 2),
                      "final_loss": round(final_loss, 6)}))


if __name__ == "__main__":
    main()

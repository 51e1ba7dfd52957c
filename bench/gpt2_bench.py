#!/usr/bin/env python3
"""Python twin of bench/gpt2_bench.cpp: the level-1 loop on transformers'
GPT2LMHeadModel (same config, fresh init, synthetic tokens) with torch.autocast,
torch.amp.GradScaler (fp16) and fused torch.optim.AdamW, dropout off, 2 threads;
or (--level accelerator) the same through HF Accelerate's Accelerator, or
(--level trainer) transformers' Trainer (its defaults: clipping at 1, shuffling).
Prints one JSON line. Run through bench/run.py --workload gpt2-small|gpt2-large."""
import argparse
import json
import resource

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from timing import time_steps, time_trainer


def activation_mb(forward):
    """What the forward leaves allocated for the backward, in MB: the net bytes of the
    profiler's memory events over one forward (as gpt2_bench.cpp measures it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()  # noqa: F841 (alive, with its graph, until the profiler stops)
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]") / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=["small", "large"], default="small")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16", "bf16-pure"], default="fp32",
                   help="bf16-pure: the model in bf16, no autocast, fused AdamW (round to nearest: "
                   "PyTorch has no stochastic rounding); loop only")
    p.add_argument("--level", choices=["loop", "accelerator", "trainer"], default="loop")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="transformers' activation_checkpointing_enable() (torch.utils.checkpoint per block)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="PyTorch's recipe: one fused AdamW per parameter, stepped and zeroed by a "
                   "post-accumulate-grad hook (loop only, not fp16)")
    a = p.parse_args()
    if a.optimizer_in_backward and (a.level != "loop" or a.precision == "fp16"):
        p.error("--optimizer-in-backward runs at --level loop, without fp16's GradScaler")
    if a.precision == "bf16-pure" and a.level != "loop":
        p.error("--precision bf16-pure runs at --level loop only")

    torch.set_num_threads(a.threads)
    large = a.size == "large"
    batch, seq = 8, 256 if large else 128
    config = GPT2Config(vocab_size=4096, n_positions=seq, n_embd=512 if large else 128,
                        n_layer=6 if large else 2, n_head=8 if large else 4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    if a.activation_checkpointing:
        model.activation_checkpointing_enable()
    if a.precision == "bf16-pure":
        model.to(torch.bfloat16)
    data = torch.randint(config.vocab_size, (4, batch, seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=a.precision == "fp16")
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16

    def forward(i):
        ids = data[i % data.shape[0]]
        with torch.autocast("cpu", dtype=dtype, enabled=a.precision in ("bf16", "fp16")):
            return model(input_ids=ids, labels=ids).loss

    def step(i):
        loss = forward(i)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    if a.optimizer_in_backward:  # pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial
        optimizers = {p: torch.optim.AdamW([p], lr=3e-4, fused=True) for p in model.parameters()}

        def step_and_free(p):
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_and_free)

        def step(i):  # noqa: F811 (the loop's step, the updates inside the backward)
            loss = forward(i)
            loss.backward()
            return loss

    if a.level == "accelerator":
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="no" if a.precision == "fp32" else a.precision, cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)

        def step(i):  # noqa: F811 (the loop's step, through the Accelerator)
            ids = data[i % data.shape[0]]
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss

    if a.level == "trainer":
        ids = data.reshape(-1, data.shape[-1])
        final_loss, seconds = time_trainer(
            model, [{"input_ids": row, "labels": row} for row in ids], a.warmup, a.steps,
            fp16=a.precision == "fp16", bf16=a.precision == "bf16", per_device_train_batch_size=data.shape[1],
            learning_rate=3e-4, lr_scheduler_type="constant", optim="adamw_torch_fused")
    else:
        for i in range(a.warmup):
            step(i)
        final_loss, seconds = time_steps(step, a.warmup, a.steps)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the extra forward
    print(json.dumps({"impl": "pytorch", "level": a.level, "size": a.size, "precision": a.precision,
                      "activation_checkpointing": a.activation_checkpointing,
                      "optimizer_in_backward": a.optimizer_in_backward,
                      "tokens_per_s": round(a.steps * batch * seq / seconds, 1),
                      "final_loss": round(final_loss, 6), "peak_rss_mb": round(peak_rss_mb, 1),
                      "activation_mb": round(activation_mb(lambda: forward(0)), 1) if a.level == "loop" else 0}))


if __name__ == "__main__":
    main()

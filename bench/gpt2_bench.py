#!/usr/bin/env python3
"""Python twin of bench/gpt2_bench.cpp: the level-1 loop on transformers'
GPT2LMHeadModel (same config, fresh init, synthetic tokens) with torch.autocast,
torch.amp.GradScaler (fp16) and fused torch.optim.AdamW, dropout off, 2 threads.
Prints one JSON line. Run through bench/run.py --workload gpt2-small|gpt2-large."""
import argparse
import json
import resource

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from timing import time_steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=["small", "large"], default="small")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    large = a.size == "large"
    batch, seq = 8, 256 if large else 128
    config = GPT2Config(vocab_size=4096, n_positions=seq, n_embd=512 if large else 128,
                        n_layer=6 if large else 2, n_head=8 if large else 4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    data = torch.randint(config.vocab_size, (4, batch, seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=a.precision == "fp16")
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16

    def step(i):
        ids = data[i % data.shape[0]]
        with torch.autocast("cpu", dtype=dtype, enabled=a.precision != "fp32"):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    for i in range(a.warmup):
        step(i)
    final_loss, seconds = time_steps(step, a.warmup, a.steps)
    print(json.dumps({"impl": "pytorch", "size": a.size, "precision": a.precision,
                      "tokens_per_s": round(a.steps * batch * seq / seconds, 1),
                      "final_loss": round(final_loss, 6),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()

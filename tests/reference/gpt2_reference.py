#!/usr/bin/env python3
"""Reference GPT-2 for tests/models/gpt2_test.cpp: a tiny transformers GPT2LMHeadModel (random
init, fixed seed) saved with save_pretrained, and its logits, losses and greedy generation for
fixed input ids in fp32 and under torch.autocast('cpu', bfloat16 / float16), and in training mode
(dropout off) with transformers' NEFTune hook on the input embeddings from a seeded generator.

    python3 tests/reference/gpt2_reference.py tests/reference/data/gpt2_tiny          # write
    python3 tests/reference/gpt2_reference.py --check tests/reference/data/gpt2_tiny  # compare
    python3 tests/reference/gpt2_reference.py --verify-saved DIR REF_DIR

--verify-saved is what the C++ test runs on a folder that GPT2LMHeadModel::save_pretrained
wrote: transformers must load it and give the stored fp32 logits.
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.integrations.neftune import activate_neftune, deactivate_neftune

from common import mismatch

SEED = 1234
VOCAB = 256
LOGIT_SLICE = 64  # logits[:, :, :64] are stored, enough to catch any wrong layer
GENERATE_PROMPT_LEN = 5
GENERATE_NEW_TOKENS = 8
NEFTUNE = {"alpha": 5.0, "seed": 99}
FP32_TOL = 1e-5
# Under autocast a CPU without FP16 arithmetic runs another fp16 GEMM than one with it, and one
# without AVX-512 BF16 another bf16 GEMM: their rounded logits differ by up to one ulp of the
# 16-bit type (2.4e-4 seen in fp16 on values below 1; 2^-9 in bf16 at 0.25).
HALF_TOLERANCE = {"fp16": {"rtol": 2**-9, "atol": 2**-10}, "bf16": {"rtol": 2**-7, "atol": 2**-9}}


def inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = input_ids.clone()
    labels[0, 4] = -100  # ignored positions, as HF's collators produce
    labels[1, -3:] = -100
    return input_ids, labels


def make_model():
    torch.manual_seed(SEED)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    return GPT2LMHeadModel(config).eval()


def load(path):
    model = GPT2LMHeadModel.from_pretrained(path, attn_implementation="sdpa").eval()
    return model


def run(model, dtype):
    input_ids, labels = inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(input_ids, labels=labels)
    return {"logits": out.logits.float()[:, :, :LOGIT_SLICE].tolist(), "loss": out.loss.item(),
            "logits_dtype": str(out.logits.dtype).replace("torch.", "")}


def run_neftune(model):
    """The fp32 forward in training mode, dropout off, with the Trainer's NEFTune hook."""
    input_ids, labels = inputs()
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    handle = activate_neftune(model, NEFTUNE["alpha"])
    torch.manual_seed(NEFTUNE["seed"])
    with torch.no_grad():
        out = model(input_ids, labels=labels)
    deactivate_neftune(model, handle)
    model.eval()
    return dict(NEFTUNE, logits=out.logits[:, :, :LOGIT_SLICE].tolist(), loss=out.loss.item())


def reference(path):
    model = load(path)
    input_ids, labels = inputs()
    prompt = input_ids[:, :GENERATE_PROMPT_LEN]
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=GENERATE_NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        # Stopping at an end token: the first row's first new token taken as EOS (its prompt
        # ends with it too, which ends nothing); the batch pads the finished row with
        # pad_token_id, and one row alone stops early.
        eos = greedy[0, GENERATE_PROMPT_LEN].item()
        with_eos = model.generate(prompt, max_new_tokens=GENERATE_NEW_TOKENS, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0)
        one_row = model.generate(prompt[:1], max_new_tokens=GENERATE_NEW_TOKENS, do_sample=False,
                                 eos_token_id=eos)
    return {
        "versions": {"torch": torch.__version__.split("+")[0],
                     "transformers": transformers.__version__},
        "input_ids": input_ids.tolist(),
        "labels": labels.tolist(),
        "logit_slice": LOGIT_SLICE,
        "fp32": run(model, torch.float32),
        "bf16": run(model, torch.bfloat16),
        "fp16": run(model, torch.float16),
        "generate": {"prompt_len": GENERATE_PROMPT_LEN, "max_new_tokens": GENERATE_NEW_TOKENS,
                     "greedy": greedy.tolist(), "eos_token_id": eos, "with_eos": with_eos.tolist(),
                     "one_row_with_eos": one_row.tolist()},
        "neftune": run_neftune(load(path)),
    }


def write(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    make_model().save_pretrained(out_dir)
    text = json.dumps(reference(out_dir), indent=1, sort_keys=True) + "\n"
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write(text)


def check(stored_dir):
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        problems = []
        fresh, stored = load_file(f"{tmp}/model.safetensors"), load_file(
            f"{stored_dir}/model.safetensors")
        if sorted(fresh) != sorted(stored) or any(not torch.equal(fresh[k], stored[k])
                                                  for k in fresh):
            problems.append("model.safetensors differs")
        for name in ("config.json", "generation_config.json"):
            fresh, stored = (json.load(open(os.path.join(d, name))) for d in (tmp, stored_dir))
            if fresh != stored:
                problems.append(f"{name} differs")
        fresh, stored = (json.load(open(os.path.join(d, "reference.json")))
                         for d in (tmp, stored_dir))
        found = [mismatch(fresh.pop(key), stored.pop(key), path=f"/{key}", **HALF_TOLERANCE[key])
                 for key in ("bf16", "fp16")] + [mismatch(fresh, stored)]
        problems += [f"reference.json differs ({m})" for m in found if m]
    for p in problems:
        print(f"{stored_dir}: {p}; regenerate it with {sys.argv[0]} {stored_dir}")
    if not problems:
        print(f"{stored_dir} matches torch {torch.__version__}, "
              f"transformers {transformers.__version__}")
    return 1 if problems else 0


def verify_saved(saved_dir, ref_dir):
    ref = json.load(open(os.path.join(ref_dir, "reference.json")))
    got = run(load(saved_dir), torch.float32)
    diff = (torch.tensor(got["logits"]) - torch.tensor(ref["fp32"]["logits"])).abs().max().item()
    loss_diff = abs(got["loss"] - ref["fp32"]["loss"])
    print(f"{saved_dir}: transformers loads it; max |logits - reference| = {diff:.3g}, "
          f"|loss - reference| = {loss_diff:.3g} (tolerance {FP32_TOL})")
    return 0 if diff <= FP32_TOL and loss_diff <= FP32_TOL else 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", nargs="?", help="where to write the model and reference.json")
    parser.add_argument("--check", help="compare with this folder instead of writing")
    parser.add_argument("--verify-saved", nargs=2, metavar=("DIR", "REF_DIR"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.verify_saved:
        return verify_saved(*args.verify_saved)
    if args.check:
        return check(args.check)
    if not args.dir:
        parser.error("give a folder, --check or --verify-saved")
    write(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

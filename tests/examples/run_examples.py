#!/usr/bin/env python3
"""Runs the three example programs as the README tells users to, in a fresh
folder with the data scripts/prepare_data.py writes, and checks what they
claim: each precision learns the digits (>= 90% validation accuracy), fp16
keeps a loss scale, the logs are readable by TensorBoard and as JSONL, and the
Trainer ends on its best checkpoint.

    python3 tests/examples/run_examples.py build/examples
"""
import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import safetensors.torch
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIN_ACCURACY = 0.90  # every example reaches ~96% (README); chance is 10%


def run(cmd, cwd):
    print("$", " ".join(str(c) for c in cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    print(done.stdout, done.stderr, sep="", end="", flush=True)
    if done.returncode != 0:
        sys.exit(f"FAILED: {cmd[0]} exited with {done.returncode}")
    return done.stdout


def check(condition, message):
    if not condition:
        sys.exit(f"FAILED: {message}")


def amp_loop(examples, work):
    out = run([examples / "amp_loop"], work)
    rows = dict(re.findall(r"^\| (fp32|bf16|fp16) \| (.*) \|$", out, re.M))
    check(sorted(rows) == ["bf16", "fp16", "fp32"],
          f"amp_loop: expected a row per precision, got {sorted(rows)}")
    for precision, row in rows.items():
        loss, accuracy, _, scale, skipped = (c.strip() for c in row.split("|"))
        check(float(accuracy.rstrip("%")) / 100 >= MIN_ACCURACY,
              f"amp_loop {precision}: val accuracy {accuracy}")
        if precision == "fp16":  # a live scaler: a power of two, not backed off to nothing
            check(float(scale) >= 1 and float(scale).is_integer(),
                  f"amp_loop fp16: final scale {scale}")
        else:
            check(float(scale) == 1 and skipped == "0",
                  f"amp_loop {precision}: scale {scale}, skipped {skipped}")


def last_accuracy(out, program):
    found = re.findall(r"val_acc\s+([\d.]+)%", out)
    check(found, f"{program}: no val_acc line")
    return float(found[-1]) / 100


def accelerate_loop(examples, work):
    out = run([examples / "accelerate_loop", "--mixed-precision", "fp16", "--log-dir", "runs"],
              work)
    check(last_accuracy(out, "accelerate_loop") >= MIN_ACCURACY,
          "accelerate_loop fp16: val accuracy")
    logs = work / "runs" / "accelerate_loop"
    records = [json.loads(line) for line in (logs / "log.jsonl").read_text().splitlines()]
    scales = [r["train/loss_scale"] for r in records if "train/loss_scale" in r]
    check(scales and all(s >= 1 for s in scales), f"accelerate_loop: loss scales {scales[:3]}...")
    tensorboard = EventAccumulator(str(logs))
    tensorboard.Reload()
    tags = tensorboard.Tags()["scalars"]
    for tag in ("train/loss", "train/loss_scale", "eval/accuracy"):
        check(tag in tags, f"accelerate_loop: TensorBoard log has no {tag} (has {tags})")
    check(tensorboard.Scalars("eval/accuracy")[-1].value >= MIN_ACCURACY,
          "accelerate_loop: logged accuracy")
    weights = safetensors.torch.load_file(logs / "model" / "model.safetensors")
    check(weights and all(t.dtype == torch.float32 for t in weights.values()),
          f"accelerate_loop: saved weights {sorted(weights)}")

    # Data parallel, as the README launches it: only the main process prints.
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--no-python", examples / "accelerate_loop", "--mixed-precision", "bf16",
               "--log-dir", "runs_dp"], work)
    epochs = re.findall(r"^bf16 epoch\s+(\d+)/10", out, re.M)
    check(epochs == [str(e) for e in range(1, 11)],
          f"accelerate_loop under torchrun: epoch lines {epochs}")
    check(last_accuracy(out, "accelerate_loop under torchrun") >= MIN_ACCURACY,
          "accelerate_loop under torchrun: val accuracy")


def trainer_digits(examples, work):
    out = run([examples / "trainer_digits"], work)
    evals = [float(a) / 100 for a in re.findall(r"eval_accuracy ([\d.]+)%\n", out)]
    final = re.search(r"best checkpoint (\S+)\s+final eval_accuracy ([\d.]+)%", out)
    check(evals and final, "trainer_digits: no per-epoch or final eval_accuracy")
    check(max(evals) >= MIN_ACCURACY, f"trainer_digits: eval accuracies {evals}")
    # load_best_model_at_end: the final evaluation is the best epoch's model.
    check(abs(float(final.group(2)) / 100 - max(evals)) < 1e-3,
          f"trainer_digits: final {final.group(2)}% vs best {max(evals)}")
    best = work / final.group(1)
    check((best / "model.safetensors").is_file(), f"trainer_digits: no model in {best}")
    state = json.loads((best / "trainer_state.json").read_text())
    check(state["best_model_checkpoint"] == final.group(1),
          f"trainer_digits: trainer_state names {state['best_model_checkpoint']}")
    checkpoints = sorted(p.name for p in (work / "results").glob("checkpoint-*"))
    check(len(checkpoints) <= 2, f"trainer_digits: save_total_limit 2, found {checkpoints}")
    # The header's other commands: --bf16 in place of the example's fp16, and a --config file in
    # place of its values (the file's output_dir and epochs, not results/ and 5).
    run([examples / "trainer_digits", "--bf16", "--num_train_epochs", "1", "--output_dir",
         "results_bf16", "--report_to", "jsonl"], work)
    state = json.loads(next((work / "results_bf16").glob("checkpoint-*/trainer_state.json"))
                       .read_text())
    check(state["epoch"] == 1.0, f"trainer_digits --bf16: epoch {state['epoch']}")
    (work / "args.yaml").write_text(
        "output_dir: from_config\nnum_train_epochs: 1\neval_strategy: epoch\n"
        "save_strategy: epoch\nload_best_model_at_end: true\nmetric_for_best_model: accuracy\n")
    out = run([examples / "trainer_digits", "--config", "args.yaml", "--num_train_epochs", "2"],
              work)
    check(len(re.findall(r"^epoch \d+ ", out, re.M)) == 2,
          "trainer_digits --config: not 2 evaluations (the flag over the file's 1 epoch)")
    check((work / "from_config").is_dir(), "trainer_digits --config: no from_config/")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("examples", type=pathlib.Path, help="the folder of the built examples")
    args = parser.parse_args()
    examples = args.examples.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="mixprec_examples_"))
    try:
        subprocess.run([sys.executable, ROOT / "scripts" / "prepare_data.py", work / "data"],
                       check=True)
        amp_loop(examples, work)
        accelerate_loop(examples, work)
        trainer_digits(examples, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("examples: all checks passed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Kills `mixprec train` at random moments and resumes it, and checks that
nothing is lost: the final parameters equal an uninterrupted run's, bit for bit.

Each trial kills the run with SIGKILL 1-3 times at a random moment (during
start-up, a step or a checkpoint write: a folder left half-written shows the
last), resumes with --resume_from_checkpoint last, and finally lets it finish.
Every fifth trial also damages the newest checkpoint after a kill: the resumed
run must warn, naming it, and fall back to the one before. Two more trials
stop the run with SIGINT and SIGTERM: exit code 128 + signal, a message that
says how to resume, and the same result after resuming.

    python3 tests/reliability/crash_resume.py build/mixprec --trials 20
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cli", help="the mixprec command")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.cli = os.path.abspath(args.cli)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="mixprec_crash_")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one summation order in every run

    # A 4-class task of 8 features.
    data = np.random.default_rng(args.seed)
    centers = data.normal(size=(4, 8))
    labels = data.integers(0, 4, size=600)
    features = centers[labels] + data.normal(size=(600, 8))
    with open(os.path.join(work, "train.csv"), "w") as f:
        f.write(",".join([f"f{i}" for i in range(8)] + ["label"]) + "\n")
        for x, y in zip(features, labels):
            f.write(",".join(f"{v:.6f}" for v in x) + f",{y}\n")

    def command(out):
        return [args.cli, "train", "--model_type", "mlp_classifier", "--train_file", "train.csv",
                "--validation_split_percentage", "10", "--hidden_size", "64", "--use_cpu",
                "--fp16", "--per_device_train_batch_size", "8", "--num_train_epochs", "3",
                "--learning_rate", "3e-3", "--save_strategy", "steps", "--save_steps", "3",
                "--save_total_limit", "2", "--logging_steps", "10", "--disable_tqdm",
                "--output_dir", out, "--resume_from_checkpoint", "last"]

    def start(out):
        return subprocess.Popen(command(out), cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(out):
        p = start(out)
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            sys.exit(f"{out}: exit code {p.returncode}\n{stdout}\n{stderr}")
        return stderr

    def params(out):
        return load_file(os.path.join(work, out, "model.safetensors"))

    def leftovers(out):
        path = os.path.join(work, out)
        return [n for n in os.listdir(path) if ".tmp-" in n or ".old-" in n] \
            if os.path.isdir(path) else []

    begin = time.time()
    finish("reference")
    duration = time.time() - begin
    reference = params("reference")

    figures = {"trials": 0, "sigkills": 0, "killed_during_checkpoint_write": 0,
               "damaged_checkpoints": 0, "signal_stops": 0, "runs_equal_to_reference": 0}
    failures = []

    def check(out):
        got = params(out)
        same = got.keys() == reference.keys() and all(
            np.array_equal(got[k], reference[k]) for k in reference)
        if same:
            figures["runs_equal_to_reference"] += 1
        else:
            failures.append(f"{out}: final parameters differ from the uninterrupted run")

    for trial in range(args.trials):
        out = f"trial{trial}"
        damaged = None
        for _ in range(rng.randint(1, 3)):
            p = start(out)
            time.sleep(rng.uniform(0.2, duration))
            if p.poll() is not None:
                break
            p.send_signal(signal.SIGKILL)
            p.communicate()
            figures["sigkills"] += 1
            if leftovers(out):
                figures["killed_during_checkpoint_write"] += 1
        if trial % 5 == 4 and os.path.isdir(os.path.join(work, out)):
            checkpoints = sorted((n for n in os.listdir(os.path.join(work, out))
                                  if n.startswith("checkpoint-") and n[11:].isdigit()),
                                 key=lambda n: int(n[11:]))
            if checkpoints:
                damaged = os.path.join(out, checkpoints[-1])
                with open(os.path.join(work, damaged, "model.safetensors"), "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last[0] ^ 0xFF]))
                figures["damaged_checkpoints"] += 1
        stderr = finish(out)
        if damaged and f"checkpoint {damaged} is damaged" not in stderr:
            failures.append(f"{out}: no warning naming the damaged {damaged}:\n{stderr}")
        figures["trials"] += 1
        check(out)

    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        out = f"signal{int(sig)}"
        p = start(out)
        # Once training runs (its first checkpoint is there): before, the
        # process has not installed its handlers yet.
        path = os.path.join(work, out)
        while p.poll() is None and not (
                os.path.isdir(path) and any(n.startswith("checkpoint-") for n in os.listdir(path))):
            time.sleep(0.01)
        p.send_signal(sig)
        _, stderr = p.communicate()
        if p.returncode != code or "Resume with --resume_from_checkpoint" not in stderr:
            failures.append(f"{out}: exit code {p.returncode} (expected {code}):\n{stderr}")
        figures["signal_stops"] += 1
        finish(out)
        figures["trials"] += 1
        check(out)

    figures["seconds"] = round(time.time() - begin, 1)
    print(json.dumps(figures))
    if failures:
        sys.exit("\n".join(failures))
    if figures["killed_during_checkpoint_write"] == 0:
        sys.exit("no kill landed during a checkpoint write; rerun with another --seed")
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (one folder per target) from the
repository's test data, and safetensors files from Python's reference writer.

    python3 fuzz/make_seeds.py build-fuzz/seeds
"""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF = ROOT / "tests" / "reference" / "data"


def write(folder, name, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors_seeds(out):
    import torch
    from safetensors.torch import save

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    tensors = {f"t{i}": (torch.arange(6) % 2).to(d).reshape(2, 3) for i, d in enumerate(dtypes)}
    write(out, "every_dtype.safetensors", save(tensors, metadata={"format": "pt"}))
    write(out, "scalar_and_empty.safetensors",
          save({"s": torch.tensor(1.5), "e": torch.zeros(0, 4)}))
    # The first tensors of the GPT-2 reference model, re-saved small.
    from safetensors.torch import load_file
    model = load_file(REF / "gpt2_tiny" / "model.safetensors")
    small = {k: v.flatten()[:8].clone() for k, v in sorted(model.items())[:4]}
    write(out, "gpt2_slice.safetensors", save(small))


def main():
    out = pathlib.Path(sys.argv[1])
    safetensors_seeds(out / "fuzz_safetensors")

    defaults = (REF / "training_args_defaults.json").read_text()
    args = out / "fuzz_training_args_json"
    write(args, "defaults.json", defaults)
    write(args, "run.json", json.dumps({
        "output_dir": "results", "fp16": True, "eval_strategy": "steps", "eval_steps": 50,
        "save_steps": 100, "load_best_model_at_end": True, "report_to": ["tensorboard"],
        "label_names": ["labels"], "save_total_limit": 2, "warmup_ratio": 0.1}))
    yaml = out / "fuzz_training_args_yaml"
    write(yaml, "run.yaml", "output_dir: results\nbf16: true\nlearning_rate: 3.0e-4\n"
          "num_train_epochs: 2\nreport_to: [jsonl, tensorboard]\nseed: 7\n"
          "metric_for_best_model: accuracy\nrun_name: 'quoted'\ndata_seed: ~\n")
    write(yaml, "flow.yaml", "{fp16: True, save_strategy: epoch, eval_strategy: epoch, "
          "load_best_model_at_end: yes, label_names: [a, b]}\n")
    cli = out / "fuzz_training_args_cli"  # one word per line
    write(cli, "flags.txt", "\n".join([
        "--output-dir", "results", "--fp16", "--learning_rate=3e-4", "--report_to", "jsonl",
        "tensorboard", "--no_logging_nan_inf_filter", "--data_seed", "None",
        "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
        '{"min_lr_rate": 0.1}', "--eval_strategy", "epoch", "--evaluation_strategy", "steps"]))

    state = {
        "best_global_step": 20, "best_metric": 0.25,
        "best_model_checkpoint": "results/checkpoint-20", "epoch": 2.0, "eval_steps": 10,
        "global_step": 40, "is_hyper_param_search": False, "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": [{"epoch": 0.5, "grad_norm": 1.25, "learning_rate": 5e-05, "loss": 2.3,
                         "step": 10},
                        {"epoch": 1.0, "eval_loss": "NaN", "eval_accuracy": 0.5, "step": 20},
                        {"epoch": 2.0, "step": 40, "total_flos": 12345, "train_loss": 1.1,
                         "train_runtime": 3.5}],
        "logging_steps": 10, "max_steps": 40, "num_input_tokens_seen": 0,
        "num_train_epochs": 2, "save_steps": 20, "stateful_callbacks": {
            "TrainerControl": {"args": {"should_training_stop": False, "should_epoch_stop": False,
                                        "should_save": True, "should_evaluate": False,
                                        "should_log": False}, "attributes": {}},
            "EarlyStoppingCallback": [
                {"args": {"early_stopping_patience": 3, "early_stopping_threshold": 0.0},
                 "attributes": {"early_stopping_patience_counter": 1}}]},
        "total_flos": 12345,
        "train_batch_size": 8, "trial_name": None, "trial_params": None}
    write(out / "fuzz_trainer_state", "trainer_state.json", json.dumps(state, indent=2))

    data = out / "fuzz_dataset"  # first byte: odd = CSV, even = JSONL
    digits = (ROOT / "data" / "digits.csv")
    rows = digits.read_text().splitlines()[:4] if digits.exists() else []
    write(data, "csv_quoted", "\x01text,label\n\"a, \"\"quoted\"\" one\",pos\nplain,neg\n\n"
          "\"multi\nline\",pos\r\n")
    write(data, "csv_ints", "\x01\xef\xbb\xbftext,label\nhello,0\nworld,2")
    if rows:
        header = rows[0].replace("p0,", "text,", 1)
        write(data, "csv_digits", "\x01" + "\n".join([header] + rows[1:]) + "\n")
    write(data, "jsonl_ints", "\x00" + "\n".join(json.dumps(r) for r in [
        {"text": "good", "label": 1}, {"text": "bad", "label": 0}, {"text": "", "label": 1}]))
    write(data, "jsonl_names", "\x00" + "\n".join(json.dumps(r) for r in [
        {"text": "caf\u00e9", "label": "pos", "extra": [1, 2]}, {"text": "x", "label": "neg"}]))

    tok = out / "fuzz_tokenizer"
    write(tok, "reference_tokenizer.json", (REF / "tokenizer.json").read_bytes())
    write(tok, "tiny_tokenizer.json", json.dumps({
        "version": "1.0", "normalizer": None,
        "added_tokens": [{"id": 6, "content": "<|endoftext|>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "ll": 5},
                  "merges": ["h e", ["l", "l"]]}}))

    write(out / "fuzz_gpt2_config", "config.json",
          (REF / "gpt2_tiny" / "config.json").read_bytes())

    ckpt = out / "fuzz_checkpoint"
    # first byte: odd = checksums.json; even = optimizer.json, for SGD, or with bit 2 AdamW
    write(ckpt, "checksums", "\x01" + json.dumps({"model.safetensors": "364b3fb7"}))
    write(ckpt, "checksums_bad", "\x01" + json.dumps({"model.safetensors": "00000000",
                                                      "missing.json": "1"}))
    write(ckpt, "optimizer", "\x00" + json.dumps({"param_groups": [
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True,
         "params": 2}]}))
    write(ckpt, "optimizer_adamw", "\x02" + json.dumps({"param_groups": [
        {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
         "maximize": False, "params": 2}]}))


if __name__ == "__main__":
    main()

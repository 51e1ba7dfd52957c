#!/usr/bin/env python3
"""The defaults of transformers.TrainingArguments (after __post_init__) for the
fields mixprec's TrainingArguments has, for tests/train/training_args_test.cpp.

    python3 tests/reference/training_args_defaults.py > tests/reference/data/training_args_defaults.json
    python3 tests/reference/training_args_defaults.py --check tests/reference/data/training_args_defaults.json
"""
import dataclasses
import enum
import tempfile

import transformers
from transformers import TrainingArguments

from common import emit_or_check

FIELDS = """output_dir eval_strategy eval_steps fp16 bf16 fp16_full_eval bf16_full_eval activation_checkpointing
activation_checkpointing_kwargs per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps accelerator_config
learning_rate
weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm num_train_epochs max_steps
lr_scheduler_type warmup_steps logging_strategy logging_steps logging_first_step logging_nan_inf_filter save_strategy
save_steps save_total_limit load_best_model_at_end metric_for_best_model greater_is_better seed
data_seed dataloader_num_workers dataloader_drop_last dataloader_prefetch_factor
dataloader_persistent_workers dataloader_pin_memory optim report_to resume_from_checkpoint
use_cpu label_names run_name average_tokens_across_devices include_num_input_tokens_seen
eval_delay eval_on_start lr_scheduler_kwargs label_smoothing_factor prediction_loss_only
restore_callback_states_from_checkpoint save_only_model ignore_data_skip full_determinism
include_for_metrics batch_eval_metrics skip_memory_metrics
train_sampling_strategy length_column_name log_level log_level_replica log_on_each_node
ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_backend ddp_timeout
neftune_noise_alpha auto_find_batch_size eval_accumulation_steps eval_do_concat_batches
eval_use_gather_object torch_empty_cache_steps save_on_each_node ddp_static_graph tf32 optim_args
remove_unused_columns dataloader_in_order dataloader_multiprocessing_context do_train do_eval
do_predict use_cache enable_jit_checkpoint debug""".split()


def plain(v):
    if dataclasses.is_dataclass(v):  # accelerator_config
        return dataclasses.asdict(v)
    return v.value if isinstance(v, enum.Enum) else v


def compute():
    with tempfile.TemporaryDirectory():
        ta = TrainingArguments()
    return {"transformers": transformers.__version__,
            "defaults": {f: plain(getattr(ta, f)) for f in FIELDS}}


if __name__ == "__main__":
    emit_or_check(compute)

#!/usr/bin/env python3
"""Loads a trainer_state.json with transformers' own TrainerState.load_from_json
and prints what tests/train/trainer_test.cpp checks, as JSON."""
import json
import sys

from transformers import TrainerState

state = TrainerState.load_from_json(sys.argv[1])
print(json.dumps({"global_step": state.global_step, "epoch": state.epoch,
                  "log_history": state.log_history, "best_metric": state.best_metric,
                  "best_model_checkpoint": state.best_model_checkpoint}))

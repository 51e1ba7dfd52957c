#!/usr/bin/env python3
"""Loads a trainer_state.json with transformers' own TrainerState.load_from_json
(and its stateful callbacks with ExportableState.from_state) and prints what
tests/train/trainer_test.cpp checks, as JSON."""
import json
import sys

from transformers import EarlyStoppingCallback, TrainerControl, TrainerState

state = TrainerState.load_from_json(sys.argv[1])
# The stateful callbacks as HF's ExportableState.from_state makes them again, saved anew.
restored = {name: cls.from_state(state.stateful_callbacks[name]).state()
            for name, cls in (("EarlyStoppingCallback", EarlyStoppingCallback),
                              ("TrainerControl", TrainerControl))
            if name in state.stateful_callbacks}
print(json.dumps({"global_step": state.global_step, "epoch": state.epoch,
                  "log_history": state.log_history, "best_metric": state.best_metric,
                  "best_model_checkpoint": state.best_model_checkpoint,
                  "restored_callbacks": restored}))

#!/usr/bin/env python3
"""Reads a TensorBoard log folder with tensorboard's own EventAccumulator and
prints its scalars as JSON: {"tag": [[step, value], ...]}. Used by
tests/log/tracker_test.cpp to check the event files mixprec writes."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)]
                  for tag in acc.Tags()["scalars"]}))

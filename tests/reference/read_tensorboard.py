#!/usr/bin/env python3
"""Reads a TensorBoard log folder with tensorboard's own EventAccumulator and
prints what it holds as JSON. Used by tests/log/tracker_test.cpp to check the
event files mixprec writes.

    read_tensorboard.py DIR            scalars: {"tag": [[step, value], ...]}
    read_tensorboard.py DIR --texts    the text plugin's: {"tag": [[step, text], ...]}
    read_tensorboard.py DIR --hparams  the hparams plugin's, as tensorboard parses them, and
                                       DIR/hparams.yml's text: {"hparam_infos": {name: type},
                                       "hparams": {name: value}, "status": ..., "yml": text}
    read_tensorboard.py --torch-hparams CONFIG_JSON
                                       the same for what Accelerate's TensorBoardTracker writes
                                       for that config (torch's add_hparams, yaml.dump)
"""
import glob
import json
import os
import sys
import tempfile

from google.protobuf import json_format
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, TENSORS
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.util import tensor_util


def accumulator(folder):
    acc = EventAccumulator(folder, size_guidance={TENSORS: 0})
    acc.Reload()
    return acc


def hparams(folder):
    out = {}
    for tag, content in accumulator(folder).PluginTagToContent("hparams").items():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("experiment"):
            out["hparam_infos"] = {i.name: api_pb2.DataType.Name(i.type)
                                   for i in data.experiment.hparam_infos}
        if data.HasField("session_start_info"):
            out["hparams"] = {k: json_format.MessageToDict(v)
                              for k, v in data.session_start_info.hparams.items()}
        if data.HasField("session_end_info"):
            out["status"] = api_pb2.Status.Name(data.session_end_info.status)
    yml = os.path.join(folder, "hparams.yml")
    if os.path.exists(yml):
        with open(yml) as f:
            out["yml"] = f.read()
    return out


def torch_hparams(config):
    """Accelerate's TensorBoardTracker.store_init_configuration, into one folder."""
    import yaml
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as logdir:
        with SummaryWriter(logdir) as writer:
            writer.add_hparams(config, metric_dict={})
        run = [d for d in glob.glob(os.path.join(logdir, "*")) if os.path.isdir(d)][0]
        with open(os.path.join(run, "hparams.yml"), "w") as f:
            yaml.dump(config, f)
        return hparams(run)


if sys.argv[1] == "--torch-hparams":
    print(json.dumps(torch_hparams(json.loads(sys.argv[2]))))
    sys.exit(0)
mode = sys.argv[2] if len(sys.argv) > 2 else "--scalars"
if mode == "--scalars":
    acc = accumulator(sys.argv[1])
    print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)]
                      for tag in acc.Tags()["scalars"]}))
elif mode == "--texts":
    acc = accumulator(sys.argv[1])
    print(json.dumps({tag: [[e.step, tensor_util.make_ndarray(e.tensor_proto).tolist()[0].decode()]
                            for e in acc.Tensors(tag)]
                      for tag in acc.PluginTagToContent("text")}))
else:
    print(json.dumps(hparams(sys.argv[1])))

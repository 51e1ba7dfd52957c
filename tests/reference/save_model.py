#!/usr/bin/env python3
"""For tests/accelerate/accelerator_utils_test.cpp:

    python3 tests/reference/save_model.py DIR MAX_SHARD_SIZE

Writes into DIR what HF Accelerate's `Accelerator().save_model(model, DIR, max_shard_size)`
writes for TiedNet below, which the C++ test builds alike: an embedding, a linear layer,
a buffer, and a head whose weight is the embedding's (tied). Parameter i (state_dict order)
holds arange(numel) * 0.01 + i, so the test knows the values without a second file.
"""
import sys

import torch
from accelerate import Accelerator


class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(3))
        self.head = torch.nn.Module()
        self.head.weight = self.embed.weight


def main(directory, max_shard_size):
    model = TiedNet()
    with torch.no_grad():
        for i, tensor in enumerate(model.state_dict(keep_vars=True).values()):
            tensor.copy_((torch.arange(tensor.numel()) * 0.01 + i).reshape(tensor.shape))
    Accelerator(cpu=True).save_model(model, directory, max_shard_size=max_shard_size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

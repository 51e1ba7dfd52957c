#!/usr/bin/env python3
"""Reference batch orders of torch.utils.data.DataLoader with a DistributedSampler,
and the indices of torch.utils.data.random_split, for tests/data/dataloader_test.cpp.

Each case is one rank of one epoch: the indices of every batch, in order. The
dataset is range(n), so a batch's values are its sample indices.

    python3 tests/reference/data_loader_order.py > tests/reference/data/data_loader_order.json
    python3 tests/reference/data_loader_order.py --check tests/reference/data/data_loader_order.json
"""
import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, random_split

LOADER_CASES = [
    # n, batch_size, shuffle, seed, epoch, drop_last, num_replicas
    (10, 3, False, 0, 0, False, 1),
    (10, 3, True, 0, 0, False, 1),
    (10, 3, True, 0, 1, False, 1),
    (10, 3, True, 0, 0, True, 1),
    (23, 4, True, 42, 3, False, 2),
    (23, 4, True, 42, 3, True, 2),
    (23, 5, False, 0, 0, False, 3),
    (5, 2, True, 7, 0, False, 4),
    (2, 1, True, 1, 0, False, 3),
    (100, 16, True, 1234, 2, False, 2),
    (1797, 64, True, 0, 5, False, 1),
]

SPLIT_CASES = [
    # n, lengths, seed
    (10, [3, 7], 0),
    (10, [0.8, 0.2], 42),
    (11, [0.3, 0.3, 0.4], 5),
    (1797, [1437, 360], 0),
]


def loader_case(n, batch_size, shuffle, seed, epoch, drop_last, num_replicas):
    ranks = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(list(range(n)), num_replicas=num_replicas, rank=rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        loader = DataLoader(list(range(n)), batch_size=batch_size, sampler=sampler,
                            drop_last=drop_last)
        ranks.append([batch.tolist() for batch in loader])
    return {"n": n, "batch_size": batch_size, "shuffle": shuffle, "seed": seed, "epoch": epoch,
            "drop_last": drop_last, "num_replicas": num_replicas, "batches_per_rank": ranks}


def split_case(n, lengths, seed):
    parts = random_split(list(range(n)), lengths, generator=torch.Generator().manual_seed(seed))
    return {"n": n, "lengths": lengths, "seed": seed, "indices": [list(p.indices) for p in parts]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", help="compare with this file instead of printing")
    args = parser.parse_args()
    out = {"torch": torch.__version__.split("+")[0],
           "loader": [loader_case(*c) for c in LOADER_CASES],
           "random_split": [split_case(*c) for c in SPLIT_CASES]}
    text = json.dumps(out, indent=1, sort_keys=True) + "\n"
    if not args.check:
        sys.stdout.write(text)
        return 0
    with open(args.check) as f:
        stored = f.read()
    if stored != text:
        print(f"{args.check} is stale: regenerate it with {sys.argv[0]} > {args.check}")
        return 1
    print(f"{args.check} matches torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

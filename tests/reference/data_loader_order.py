#!/usr/bin/env python3
"""Reference batch orders of torch.utils.data.DataLoader with a DistributedSampler, of
HF Accelerate's prepared data loaders (BatchSamplerShard; with its default RandomSampler over
several passes, and what torch's generator draws between them), and the indices of
torch.utils.data.random_split, and transformers' LengthGroupedSampler orders (the HF Trainer's
train_sampling_strategy "group_by_length") with a generator seeded by seed + epoch, alone and
through Accelerate's prepared loaders, for tests/data/dataloader_test.cpp.

Each case is one rank of one epoch: the indices of every batch, in order. The
dataset is range(n), so a batch's values are its sample indices.

    python3 tests/reference/data_loader_order.py > tests/reference/data/data_loader_order.json
    python3 tests/reference/data_loader_order.py --check tests/reference/data/data_loader_order.json
"""
import argparse
import json
import sys

import warnings

import accelerate
import torch
import transformers
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, DistributedSampler, random_split
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

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

ACCELERATE_CASES = [
    # n, batch_size (per process), shuffle, seed, epoch, drop_last, num_processes, split_batches
    (9, 2, False, 0, 0, False, 2, False),
    (9, 2, False, 0, 0, False, 2, True),
    (3, 2, False, 0, 0, False, 2, False),
    (7, 2, True, 5, 1, False, 2, False),
    (6, 2, False, 0, 0, False, 2, False),
    (23, 4, True, 42, 3, False, 3, False),
    (23, 4, True, 42, 3, True, 3, False),
    (23, 3, True, 42, 2, True, 2, True),
    (10, 3, True, 5, 1, False, 1, False),
    (100, 16, True, 1234, 2, False, 2, True),
] + [
    # Every small shape, unshuffled (shuffling only permutes the positions these cover).
    (n, batch_size, False, 0, 0, drop_last, processes, split)
    for n in (0, 1, 3, 4, 5, 7, 8, 9, 13)
    for batch_size in (1, 2, 3)
    for processes in (2, 3)
    for drop_last in (False, True)
    for split in (False, True)
]

RANDOM_SAMPLER_CASES = [
    # n, batch_size (per process), shuffle, drop_last, num_processes, split_batches, seed,
    # num_workers: Accelerate's default (use_seedable_sampler=False), over several passes, some
    # left early
    (10, 3, True, False, 1, False, 0),  # a short last batch
    (12, 3, True, False, 1, False, 1),
    (10, 3, True, True, 1, False, 2),
    (10, 3, False, False, 1, False, 3),
    (9, 2, True, False, 2, False, 4),  # a padded last round
    (8, 2, True, False, 2, False, 5),
    (9, 2, True, True, 2, False, 6),
    (23, 4, True, False, 3, False, 7),
    (10, 2, True, False, 2, True, 8),
    (3, 2, True, False, 2, False, 9),  # one batch, padded
    (16, 2, True, False, 2, False, 10, 2),  # workers read ahead
    (26, 2, True, False, 2, False, 11, 1),
    (14, 3, True, False, 1, False, 12, 1),
]

LENGTH_GROUPED_CASES = [
    # n, max length, batch_size (the sampler's), seed, mega_batch_mult (None: HF's default)
    (1, 5, 1, 0, None),
    (10, 4, 2, 1, None),  # many equal lengths: ties keep the permutation's order
    (10, 20, 3, 2, 2),
    (37, 30, 4, 3, None),  # a short last megabatch
    (200, 50, 2, 4, None),  # 25 megabatches of 8
    (1700, 100, 2, 5, None),  # the multiplier's cap of 50
    (64, 16, 4, 6, 1),
]

LENGTH_GROUPED_LOADER_CASES = [
    # n, max length, batch_size (per process), group batch size (the sampler's), seed, epoch,
    # drop_last, num_processes
    (30, 12, 2, 4, 42, 0, False, 1),
    (30, 12, 2, 4, 42, 3, False, 1),
    (31, 20, 3, 6, 7, 1, True, 1),
    (45, 25, 4, 8, 1, 2, False, 2),
    (45, 25, 4, 8, 1, 2, True, 2),
    (50, 9, 3, 3, 9, 0, False, 3),
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


def accelerate_case(n, batch_size, shuffle, seed, epoch, drop_last, num_processes, split):
    ranks = []
    for rank in range(num_processes):
        # With split_batches, the loader's batch is all processes' together.
        loader = DataLoader(list(range(n)), batch_size=batch_size * (num_processes if split else 1),
                            shuffle=shuffle, drop_last=drop_last)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare_data_loader(loader, num_processes=num_processes, process_index=rank,
                                           split_batches=split, put_on_device=False,
                                           use_seedable_sampler=True, data_seed=seed)
        prepared.set_epoch(epoch)
        ranks.append([batch.tolist() for batch in prepared])
    return {"n": n, "batch_size": batch_size, "shuffle": shuffle, "seed": seed, "epoch": epoch,
            "drop_last": drop_last, "num_replicas": num_processes, "split_batches": split,
            "batches_per_rank": ranks}


def random_sampler_case(n, batch_size, shuffle, drop_last, num_processes, split, seed,
                        num_workers=0):
    """Each rank as its own process would run it: torch.manual_seed(seed), prepare, then passes
    of `takes` batches (None: the whole pass), each followed by a draw from torch's generator
    (what a training step's dropout would draw)."""
    accelerate.Accelerator(cpu=True)  # the state that synchronizing the generator reads
    ranks = []
    for rank in range(num_processes):
        torch.manual_seed(seed)
        loader = DataLoader(list(range(n)), batch_size=batch_size * (num_processes if split else 1),
                            shuffle=shuffle, drop_last=drop_last, num_workers=num_workers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare_data_loader(loader, num_processes=num_processes, process_index=rank,
                                           split_batches=split, put_on_device=False,
                                           rng_types=["generator"], use_seedable_sampler=False)
        size = len(prepared)
        takes = [None, 1, max(size - 1, 1), size, None, None]
        passes, draws = [], []
        for take in takes:
            batches = []
            for batch in prepared:
                batches.append(batch.tolist())
                if take is not None and len(batches) == take:
                    break
            passes.append(batches)
            draws.append(torch.randint(0, 2**62, (1,)).item())
        ranks.append({"passes": passes, "draws": draws})
    return {"n": n, "batch_size": batch_size, "shuffle": shuffle, "drop_last": drop_last,
            "num_replicas": num_processes, "split_batches": split, "seed": seed,
            "num_workers": num_workers, "ranks": ranks}


def lengths_of(n, max_length, seed):
    return torch.randint(1, max_length + 1, (n,), generator=torch.Generator().manual_seed(seed))


def length_grouped_case(n, max_length, batch_size, seed, mega_batch_mult):
    lengths = lengths_of(n, max_length, seed).tolist()
    indices = get_length_grouped_indices(lengths, batch_size, mega_batch_mult,
                                         generator=torch.Generator().manual_seed(seed))
    return {"lengths": lengths, "batch_size": batch_size, "seed": seed,
            "mega_batch_mult": mega_batch_mult, "indices": indices}


def length_grouped_loader_case(n, max_length, batch_size, group_batch_size, seed, epoch,
                               drop_last, num_processes):
    lengths = lengths_of(n, max_length, seed + 100).tolist()
    ranks = []
    for rank in range(num_processes):
        sampler = LengthGroupedSampler(group_batch_size, lengths=lengths,
                                       generator=torch.Generator().manual_seed(seed + epoch))
        loader = DataLoader(list(range(n)), batch_size=batch_size, sampler=sampler,
                            drop_last=drop_last)
        prepared = prepare_data_loader(loader, num_processes=num_processes, process_index=rank,
                                       put_on_device=False, use_seedable_sampler=True)
        ranks.append([batch.tolist() for batch in prepared])
    return {"lengths": lengths, "batch_size": batch_size, "group_batch_size": group_batch_size,
            "seed": seed, "epoch": epoch, "drop_last": drop_last, "num_replicas": num_processes,
            "batches_per_rank": ranks}


def split_case(n, lengths, seed):
    parts = random_split(list(range(n)), lengths, generator=torch.Generator().manual_seed(seed))
    return {"n": n, "lengths": lengths, "seed": seed, "indices": [list(p.indices) for p in parts]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", help="compare with this file instead of printing")
    args = parser.parse_args()
    out = {"torch": torch.__version__.split("+")[0], "accelerate": accelerate.__version__,
           "loader": [loader_case(*c) for c in LOADER_CASES],
           "accelerate_loader": [accelerate_case(*c) for c in ACCELERATE_CASES],
           "accelerate_random_sampler": [random_sampler_case(*c) for c in RANDOM_SAMPLER_CASES],
           "random_split": [split_case(*c) for c in SPLIT_CASES],
           "transformers": transformers.__version__,
           "length_grouped_indices": [length_grouped_case(*c) for c in LENGTH_GROUPED_CASES],
           "length_grouped_loader": [length_grouped_loader_case(*c)
                                     for c in LENGTH_GROUPED_LOADER_CASES]}
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

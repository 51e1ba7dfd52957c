#!/usr/bin/env python3
"""Reference progress lines of tqdm's format_meter, for tests/log/progress_test.cpp
(mixprec's ProgressBar draws the line tqdm draws, without unit scaling).

    python3 tests/reference/tqdm_format.py > tests/reference/data/tqdm_format.json
    python3 tests/reference/tqdm_format.py --check tests/reference/data/tqdm_format.json
"""
import tqdm

from common import emit_or_check

# (description, done, total, elapsed seconds, postfix)
CASES = [
    ("train", 42, 100, 10.0, "loss=0.512"),
    ("", 100, 100, 3725.0, ""),  # hours, s/it
    ("eval", 0, 8, 0.0, ""),  # no rate yet
    ("eval", 0, 8, 3.0, ""),  # a rate of 0
    ("eval", 3, 8, 0.0, ""),
    ("", 1, 100, 400.0, ""),  # 11 hours left
    ("", 12345, 100000, 10.0, "lr=1e-4"),
    ("", 100, 100, 0.5, ""),
    ("train", 7, 10, 129600.0, ""),  # 36 hours
    ("train", 1, 3, 1.0, ""),  # 1.00it/s, the boundary of s/it
    ("train", 999, 1000, 0.0999, ""),
]


def line(description, done, total, elapsed, postfix):
    return tqdm.tqdm.format_meter(done, total, elapsed, prefix=description, postfix=postfix or None)


if __name__ == "__main__":
    emit_or_check(lambda: {"tqdm": tqdm.__version__,
                           "cases": [{"description": d, "done": n, "total": t, "elapsed": e,
                                      "postfix": p, "line": line(d, n, t, e, p)}
                                     for d, n, t, e, p in CASES]})

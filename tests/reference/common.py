"""What every reference script does with what it computed: print it as JSON, or
with --check FILE, compare it with the stored file and fail when it is stale."""
import argparse
import json
import math
import sys

# The pinned torch's fp32 results differ in their last bits from one CPU to another (its GEMM
# and vector kernels sum in other orders: up to 1.1e-5 relative seen between an Intel Xeon and
# an AMD EPYC). A stored file is stale when a float differs by more than this, or anything else
# differs at all.
FP32_RTOL = 1e-4
FP32_ATOL = 1e-7


def _close(a, b, rtol, atol):
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def mismatch(fresh, stored, rtol=FP32_RTOL, atol=FP32_ATOL, path="", looser=None):
    """Where fresh and stored (parsed JSON) first differ, as a message, or None: floats within
    atol + rtol * max(|fresh|, |stored|), everything else exactly. `looser` maps a path prefix
    ("/cases/bf16") to the (rtol, atol) of everything under it."""
    for prefix, tolerance in (looser or {}).items():
        if path == prefix:
            rtol, atol = tolerance
    if isinstance(fresh, dict) and isinstance(stored, dict):
        if fresh.keys() != stored.keys():
            return f"{path or '/'}: keys {sorted(fresh)} vs stored {sorted(stored)}"
        for key in fresh:
            found = mismatch(fresh[key], stored[key], rtol, atol, f"{path}/{key}", looser)
            if found:
                return found
        return None
    if isinstance(fresh, list) and isinstance(stored, list):
        if len(fresh) != len(stored):
            return f"{path}: {len(fresh)} entries vs stored {len(stored)}"
        for i, (a, b) in enumerate(zip(fresh, stored)):
            found = mismatch(a, b, rtol, atol, f"{path}[{i}]", looser)
            if found:
                return found
        return None
    if isinstance(fresh, float) or isinstance(stored, float):
        if _close(fresh, stored, rtol, atol):
            return None
    elif fresh == stored and type(fresh) is type(stored):
        return None
    return f"{path}: {fresh!r} vs stored {stored!r}"


def emit_or_check(compute, looser=None):
    """compute() returns the JSON-able reference data; `looser` as mismatch's."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", help="compare with this file instead of printing")
    args = parser.parse_args()
    text = json.dumps(compute(), indent=1, sort_keys=True) + "\n"
    if not args.check:
        sys.stdout.write(text)
        return
    with open(args.check) as f:
        found = mismatch(json.loads(text), json.load(f), looser=looser)
    if found:
        sys.exit(f"{args.check} is stale ({found}): regenerate it with {sys.argv[0]} > "
                 f"{args.check}")
    print(f"{args.check}: up to date")

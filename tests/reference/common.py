"""What every reference script does with what it computed: print it as JSON, or
with --check FILE, compare it with the stored file and fail when it is stale."""
import argparse
import json
import sys


def emit_or_check(compute):
    """compute() returns the JSON-able reference data."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", help="compare with this file instead of printing")
    args = parser.parse_args()
    text = json.dumps(compute(), indent=1, sort_keys=True) + "\n"
    if not args.check:
        sys.stdout.write(text)
        return
    with open(args.check) as f:
        if f.read() != text:
            sys.exit(f"{args.check} is stale: regenerate it with {sys.argv[0]} > {args.check}")
    print(f"{args.check}: up to date")

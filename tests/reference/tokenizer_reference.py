#!/usr/bin/env python3
"""Reference ids of a GPT-2 style byte-level BPE tokenizer, for
tests/data/tokenizer_test.cpp.

Trains a small byte-level BPE (vocab 1000) with Hugging Face `tokenizers` on
text from Debian's `fortunes` package, the way GPT-2's tokenizer is built
(BPE model, ByteLevel pre-tokenizer and decoder, <|endoftext|> as a special
token), saves it as tokenizer.json and records the ids `tokenizers` gives for
held-out text (accents, CJK, emoji, digits, runs of spaces, newlines, the
special token), with add_prefix_space off and on.

    python3 tests/reference/tokenizer_reference.py tests/reference/data
    python3 tests/reference/tokenizer_reference.py --check tests/reference/data
"""
import argparse
import glob
import json
import os
import sys

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 1000
SPECIAL = "<|endoftext|>"
# A few of the package's files: ~1 MB of plain English.
CORPUS_FILES = ["fortunes", "computers", "science", "wisdom"]
FORTUNES_DIR = "/usr/share/games/fortunes"

HELD_OUT = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's what they'd've done; we'll see, I'm sure you're right.",
    "I'M SHOUTING 'S 'T",
    "Numbers: 3.14159, 2026-12-03, 1,000,000 and 42nd.",
    "  leading spaces, trailing spaces   ",
    "multiple     spaces\tand\ttabs\n\nand newlines\r\n",
    "line one\nline two\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00e0 la cr\u00e8me br\u00fbl\u00e9e",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4",
    "emoji \U0001f600\U0001f680 and \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439, \u043c\u0438\u0440! "
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0639\u0631\u0628\u064a",
    "Roman \u2167 and \u00bd \u00b2 superscripts, \u0663\u0664 Arabic digits",
    "punctuation!!! ?!? ... --- (parens) [brackets] {braces} @#$%^&*",
    "first document" + SPECIAL + "second document",
    SPECIAL + " starts with it, ends with it " + SPECIAL,
    "no\u00a0break\u3000ideographic space",
    "",
    " ",
    "\n",
]


def corpus():
    texts = []
    for name in CORPUS_FILES:
        path = os.path.join(FORTUNES_DIR, name)
        if not os.path.exists(path):
            sys.exit(f"{path} not found: install Debian's fortunes package (scripts/setup does)")
        with open(path, encoding="utf-8", errors="replace") as f:
            entries = f.read().split("\n%\n")
        texts += [e.strip("\n") for e in entries if e.strip()]
    return texts


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def cases(tok):
    out = []
    for text in HELD_OUT:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text, text
        out.append({"text": text, "ids": ids})
    return out


# unk_token, ignore_merges and use_regex on a vocab small enough to follow by hand.
SMALL_VOCAB_CASES = [(False, True, "ca abc ab dd"), (True, True, "ca abc ab dd"),
                     (False, False, "abc ab")]


def small_vocab_json(ignore_merges=False, use_regex=True):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": use_regex}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": dict(byte_level, use_regex=True),
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                      "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "\u0120": 6,
                                "<unk>": 7, "ca": 8},
                      "merges": [["b", "c"], ["a", "bc"], ["a", "b"]]}}


def small_vocab():
    cases = [{"ignore_merges": im, "use_regex": ur, "text": text,
              "ids": Tokenizer.from_str(json.dumps(small_vocab_json(im, ur))).encode(text).ids}
             for im, ur, text in SMALL_VOCAB_CASES]
    decoded = Tokenizer.from_str(json.dumps(small_vocab_json())).decode(
        [6, 7, 8], skip_special_tokens=False)
    return {"tokenizer": small_vocab_json(), "cases": cases,
            "decode": {"ids": [6, 7, 8], "text": decoded}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", nargs="?", default=os.path.join(os.path.dirname(__file__), "data"))
    parser.add_argument("--check", action="store_true", help="compare with the files in dir")
    args = parser.parse_args()
    tok = train()
    files = {"tokenizer.json": tok.to_str(pretty=True) + "\n"}
    result = {"tokenizers": tokenizers.__version__, "special": SPECIAL, "cases": cases(tok)}
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    result["cases_add_prefix_space"] = [
        {"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in HELD_OUT]
    result["small_vocab"] = small_vocab()
    files["tokenizer_cases.json"] = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    stale = False
    for name, text in files.items():
        path = os.path.join(args.dir, name)
        if not args.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            continue
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{path} is stale: regenerate it with {sys.argv[0]} {args.dir}")
                stale = True
    if args.check and not stale:
        print(f"{args.dir}: tokenizer files match tokenizers {tokenizers.__version__}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Writes the example data into a folder, from what installed packages ship
(nothing is downloaded):

  digits.csv    scikit-learn's handwritten digits (1,797 8x8 images, pixel values
                0-16, 10 classes): 64 pixel columns, then the label.
  fortunes.txt  the first 3,000,000 bytes of Debian's fortunes (its *.u8 files,
                in name order): text for the GPT-2 examples.
"""
import pathlib
import sys

from sklearn.datasets import load_digits


def write_fortunes(target):
    if target.exists():
        return
    text = b"".join(p.read_bytes() for p in sorted(pathlib.Path("/usr/share/games/fortunes").glob("*.u8")))
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(text[:3_000_000])
    tmp.rename(target)


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "data")
    out.mkdir(parents=True, exist_ok=True)
    write_fortunes(out / "fortunes.txt")
    target = out / "digits.csv"
    if target.exists():
        return
    digits = load_digits()
    tmp = target.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(",".join([f"p{i}" for i in range(64)] + ["label"]) + "\n")
        for image, label in zip(digits.data, digits.target):
            f.write(",".join(str(int(v)) for v in image) + f",{int(label)}\n")
    tmp.rename(target)  # never a half-written file under the real name


if __name__ == "__main__":
    main()

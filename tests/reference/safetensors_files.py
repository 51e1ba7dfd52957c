#!/usr/bin/env python3
"""Two uses, for tests/io/safetensors_test.cpp:

    python3 tests/reference/safetensors_files.py write FILE   # a file made by Python safetensors
    python3 tests/reference/safetensors_files.py read FILE    # what Python reads in FILE, as JSON

The written tensors are exact small integers in every dtype, so the C++ test
knows them without a second file: t_DTYPE = arange(6).reshape(2, 3).to(dtype)
(bool: arange(6) % 2; the float8 types round some of them), plus a 0-dim f32
7.5 and an empty (0, 4) f32, and metadata {"made_by": "python"} (one key: the
writer orders several as it likes, and the C++ test compares bytes).
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file, safe_open

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
          "U64": torch.uint64, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
          "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu}


def write(path):
    tensors = {f"t_{name}": torch.arange(6).reshape(2, 3).to(dtype) for name, dtype in DTYPES.items()}
    tensors["t_BOOL"] = (torch.arange(6) % 2).bool().reshape(2, 3)
    tensors["scalar"] = torch.tensor(7.5)
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, path, metadata={"made_by": "python"})


def read(path):
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    print(json.dumps({"metadata": metadata,
                      "tensors": {name: {"dtype": str(t.dtype), "shape": list(t.shape),
                                         "values": t.double().reshape(-1).tolist()
                                         if not t.is_complex() else None}
                                  for name, t in tensors.items()}}))


if __name__ == "__main__":
    {"write": write, "read": read}[sys.argv[1]](sys.argv[2])

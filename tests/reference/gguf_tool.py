#!/usr/bin/env python3
"""The `gguf` Python package's view of things, for tests/test_quantize.cpp to compare against.

    gguf_tool.py dump FILE [--no-data]
        JSON on stdout: {"alignment", "fields": {key: {"types": [...], "value": ...}},
        "tensors": [{"name", "type", "shape", "n_bytes", "data_hex"}]} as gguf.GGUFReader reads
        FILE (GGUF.* pseudo-fields left out; shape in GGML order; data_hex omitted with --no-data).

    gguf_tool.py quantize TYPE IN.f32 COLS OUT.bin
        Reads rows of COLS float32 values from IN.f32 and writes
        gguf.quants.quantize(rows, GGMLQuantizationType[TYPE]) to OUT.bin: the reference bytes.

    gguf_tool.py dequantize FILE OUT_DIR
        Writes every tensor of FILE, as gguf.GGUFReader reads it and gguf.quants.dequantize
        dequantizes it, to OUT_DIR/<tensor name>.f32 (float32, row after row).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import gguf

from gguf_fast import GGUFReader  # gguf's own reader, without np.memmap's per-read cost


def plain(value):
    """numpy scalars and arrays to JSON-able Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def dump(path: str, with_data: bool) -> None:
    r = GGUFReader(path)
    fields = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        fields[key] = {"types": [t.name for t in f.types], "value": plain(f.contents())}
    tensors = []
    for t in r.tensors:
        entry = {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                 "n_bytes": int(t.n_bytes)}
        if with_data:
            entry["data_hex"] = np.ascontiguousarray(t.data).view(np.uint8).tobytes().hex()
        tensors.append(entry)
    json.dump({"alignment": int(r.alignment), "fields": fields, "tensors": tensors}, sys.stdout)


def quantize(type_name: str, src: str, cols: int, out: str) -> None:
    rows = np.fromfile(src, dtype=np.float32).reshape(-1, cols)
    gguf.quants.quantize(rows, gguf.GGMLQuantizationType[type_name]).tofile(out)


def dequantize(path: str, out_dir: str) -> None:
    for t in GGUFReader(path).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        np.ascontiguousarray(values, dtype=np.float32).tofile(f"{out_dir}/{t.name}.f32")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "dump":
        dump(argv[1], "--no-data" not in argv[2:])
    elif len(argv) == 5 and argv[0] == "quantize":
        quantize(argv[1], argv[2], int(argv[3]), argv[4])
    elif len(argv) == 3 and argv[0] == "dequantize":
        dequantize(argv[1], argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

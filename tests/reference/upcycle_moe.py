#!/usr/bin/env python3
"""Turn a dense GGUF into a mixture-of-experts one whose every expert is the dense FFN.

    upcycle_moe.py DENSE.gguf OUT.gguf --n-expert E --n-expert-used K [--seed S] [--permute]

Each layer's ffn_gate / ffn_up / ffn_down becomes E copies of itself stacked along a third
dimension, in llama.cpp's expert layout and the same type, the raw (quantized) bytes copied:
blk.N.ffn_gate_exps.weight and ffn_up_exps.weight (GGML [n_embd, n_ff, E]), ffn_down_exps.weight
(GGML [n_ff, n_embd, E]); and it gets a random F32 router blk.N.ffn_gate_inp.weight (GGML
[n_embd, E], logits spread by about --router-scale on a unit-RMS input, so that tokens choose
different experts). Every other tensor is copied byte for byte, and every metadata key (the
tokenizer included) with its type, plus <arch>.expert_count = E and <arch>.expert_used_count = K.

  llama -> llama (Mixtral style: the experts are feed_forward_length wide)
  qwen3 -> qwen3moe (every "qwen3." key renamed "qwen3moe.", plus
           qwen3moe.expert_feed_forward_length = feed_forward_length)

The K chosen weights sum to 1 and every expert computes the dense FFN, so the MoE model computes
the dense model's function: its logits equal the dense ones up to float rounding (the weighted
sum of K equal vectors), whatever the router chooses.

--permute gives each expert but the first its own permutation of the FFN's hidden units, moved in
whole groups (of the down matrix's quantization block, at least 32 values): gate's and up's rows
and down's columns (its blocks within each row, bytes moved intact) permuted alike. Each expert
is then other bytes computing the same function, and the int8 path quantizes the same groups of
the hidden vector (in another order): the logits still equal the dense ones up to rounding, but
a decoder that mixes one expert's gate/up with another's down no longer does.

Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_fast import GGUFReader  # noqa: E402

ARCH_MAP = {"llama": "llama", "qwen3": "qwen3moe"}


def raw_array(t) -> np.ndarray:
    """A tensor's data as GGUFReader maps it: [..., rows, bytes of a row] (uint8) for a quantized
    type, [..., rows, cols] of its dtype for F32/F16 (ggml dims reversed)."""
    return np.ascontiguousarray(t.data)


def raw_dtype_of(t):
    """GGUFWriter's raw_dtype for a tensor's data: None for F32/F16 (typed arrays), else its type."""
    return t.tensor_type if t.tensor_type not in (QT.F32, QT.F16) else None


def hidden_group(t) -> int:
    """Values of the hidden dimension moved together by --permute: the down matrix's block (its
    rows run over the hidden units), at least 32 (the int8 path's activation group)."""
    block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
    return max(block, 32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("dense")
    ap.add_argument("out")
    ap.add_argument("--n-expert", type=int, required=True, help="experts per layer, E")
    ap.add_argument("--n-expert-used", type=int, required=True, help="experts chosen per token, K (1..E)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the router (and --permute)")
    ap.add_argument("--router-scale", type=float, default=2.0,
                    help="standard deviation of the router logits for a unit-RMS input (default 2.0)")
    ap.add_argument("--permute", action="store_true",
                    help="each expert after the first: its own permutation of the hidden units")
    args = ap.parse_args(argv)
    upcycle(GGUFReader(args.dense), args.out, args.n_expert, args.n_expert_used, args.seed, args.router_scale,
            args.permute, args.dense)
    return 0


def upcycle(r, out, E, K, seed=0, router_scale=2.0, permute=False, dense_name="DENSE"):
    """Writes `out` from the dense file open in `r` (a GGUFReader); see the module docstring."""
    if E < 1 or not 1 <= K <= E:
        raise SystemExit("need --n-expert E >= 1 and 1 <= --n-expert-used K <= E")
    arch = r.fields["general.architecture"].contents()
    if arch not in ARCH_MAP:
        raise SystemExit(f"{dense_name}: architecture {arch!r}: only {', '.join(ARCH_MAP)} are upcycled")
    new_arch = ARCH_MAP[arch]
    if f"{arch}.expert_count" in r.fields:
        raise SystemExit(f"{dense_name}: already has {arch}.expert_count")
    d = int(r.fields[f"{arch}.embedding_length"].contents())
    n_ff = int(r.fields[f"{arch}.feed_forward_length"].contents())
    n_layer = int(r.fields[f"{arch}.block_count"].contents())

    w = gguf.GGUFWriter(out, new_arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.alignment":
            w.data_alignment = int(f.contents())   # the writer pads by it; written below as a key too
        out_key = new_arch + key[len(arch):] if key.startswith(arch + ".") else key
        if f.types[0] == VT.ARRAY:
            if len(f.types) > 2:
                raise SystemExit(f"{dense_name}: key {key}: nested arrays are not copied")
            w.add_key_value(out_key, f.contents(), VT.ARRAY, sub_type=f.types[-1])
        else:
            w.add_key_value(out_key, f.contents(), f.types[0])
    p = new_arch + "."
    w.add_uint32(p + "expert_count", E)
    w.add_uint32(p + "expert_used_count", K)
    if new_arch == "qwen3moe":
        w.add_uint32(p + "expert_feed_forward_length", n_ff)

    rng = np.random.default_rng(seed)
    tensors = {t.name: t for t in r.tensors}
    for i in range(n_layer):
        for part in ("gate", "up", "down"):
            if f"blk.{i}.ffn_{part}.weight" not in tensors:
                raise SystemExit(f"{dense_name}: no blk.{i}.ffn_{part}.weight (a dense FFN is needed)")
    n_copied = 0
    for t in r.tensors:
        name = t.name
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind not in ("ffn_gate", "ffn_up", "ffn_down"):
            w.add_tensor(name, raw_array(t), raw_dtype=raw_dtype_of(t))
            n_copied += 1
            continue
        if kind != "ffn_gate":
            continue                                  # up and down: written with the layer's gate
        layer = name.split(".")[1]
        blk = f"blk.{layer}."
        gate, up, down = (tensors[blk + f"ffn_{part}.weight"] for part in ("gate", "up", "down"))
        g, u, dn = raw_array(gate), raw_array(up), raw_array(down)
        # numpy order: gate/up [n_ff, row of n_embd], down [n_embd, row of n_ff (bytes if quantized)]
        if g.shape[0] != n_ff or u.shape[0] != n_ff or dn.shape[0] != d:
            raise SystemExit(f"{blk}ffn_*: unexpected shapes {g.shape}, {u.shape}, {dn.shape}")
        # The router: logits ~ router_scale apart for an input of unit RMS (the FFN's RMS-normed one).
        router = rng.normal(0.0, router_scale * d ** -0.5, (E, d)).astype(np.float32)
        gs, us, ds = [g], [u], [dn]
        group = hidden_group(down)
        n_groups = n_ff // group if n_ff % group == 0 else 0
        for e in range(1, E):
            if permute and n_groups > 1:
                perm = rng.permutation(n_groups)
                while np.array_equal(perm, np.arange(n_groups)):   # another order than expert 0's
                    perm = rng.permutation(n_groups)
                rows = (perm[:, None] * group + np.arange(group)[None, :]).ravel()   # hidden units
                gs.append(g[rows])
                us.append(u[rows])
                # down's row holds the hidden units in n_groups equal runs of values or bytes
                runs = dn.reshape(d, n_groups, dn.shape[1] // n_groups)
                ds.append(np.ascontiguousarray(runs[:, perm, :]).reshape(dn.shape))
            else:
                gs.append(g)
                us.append(u)
                ds.append(dn)
        w.add_tensor(blk + "ffn_gate_inp.weight", router)
        w.add_tensor(blk + "ffn_gate_exps.weight", np.stack(gs), raw_dtype=raw_dtype_of(gate))
        w.add_tensor(blk + "ffn_up_exps.weight", np.stack(us), raw_dtype=raw_dtype_of(up))
        w.add_tensor(blk + "ffn_down_exps.weight", np.stack(ds), raw_dtype=raw_dtype_of(down))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {arch} -> {new_arch}, {n_layer} layers, {K} of {E} experts of hidden size {n_ff}"
          f"{' (permuted)' if permute else ' (identical)'}, {n_copied} other tensors copied")


if __name__ == "__main__":
    sys.exit(main())

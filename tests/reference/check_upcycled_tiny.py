#!/usr/bin/env python3
"""The reference's MoE path against its dense path: an upcycled model computes the dense function.

    check_upcycled_tiny.py WORKDIR DENSE.gguf[:permuted] [...]

For each dense llama or qwen3 file, upcycle_moe.py writes a MoE file of 4 experts, 2 chosen
(llama -> Mixtral-style llama, qwen3 -> qwen3moe), once with identical experts and once with
--permute (every expert its own permutation of the hidden units); only the latter for a
DENSE.gguf:permuted argument (a file takes about a second to write, parse and load). Each is
checked:

  * the file: every key of the dense file is there with its type and value (qwen3. keys renamed
    qwen3moe.), plus the expert keys; every tensor but the FFN's is byte-identical; expert 0 of
    ffn_{gate,up,down}_exps is the dense ffn_{gate,up,down} byte for byte (all experts with
    identical experts);
  * llama_ref (float64) on a prompt: the logits of every position agree with the dense model's to
    1e-9 of their range (float rounding: ~1e-15), the greedy continuation is the same;
  * the routing is not trivial: in every layer more than K experts were chosen over the tokens
    (different tokens took different experts);
  * with --permute, a decoder that takes expert e's down matrix from expert e+1 (the stand-in's
    down-next fault) misses the dense logits by more than 1e-3 of their range: the permutation
    makes the experts differ where a mixed-up decoder would show it.

Exit 0 when all hold, 1 otherwise. Python only (numpy, gguf), a few seconds.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_ref  # noqa: E402  (first: it sets the BLAS thread count before numpy loads)
import numpy as np  # noqa: E402
import upcycle_moe  # noqa: E402
import standin_ringlm_logits  # noqa: E402  (its faulty MoE FFNs)
from gguf_fast import GGUFReader  # noqa: E402

E, K = 4, 2
N_GEN = 8
PROMPT_LEN = 24


def raw_bytes(t) -> np.ndarray:
    """A tensor's data as flat bytes."""
    return np.ascontiguousarray(t.data).view(np.uint8).ravel()


def check_file(dr, mr, permuted):
    """The upcycled file's keys and bytes (dense and MoE GGUFReaders). Returns a list of problems."""
    problems = []
    arch = dr.fields["general.architecture"].contents()
    new_arch = upcycle_moe.ARCH_MAP[arch]
    if mr.fields["general.architecture"].contents() != new_arch:
        problems.append(f"general.architecture {mr.fields['general.architecture'].contents()!r} != {new_arch!r}")
    for key, f in dr.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        mkey = new_arch + key[len(arch):] if key.startswith(arch + ".") else key
        g = mr.fields.get(mkey)
        if g is None:
            problems.append(f"key {mkey} missing")
        elif [t.name for t in g.types] != [t.name for t in f.types] or g.contents() != f.contents():
            problems.append(f"key {mkey} differs")
    extra = {f"{new_arch}.expert_count": E, f"{new_arch}.expert_used_count": K}
    if new_arch == "qwen3moe":
        extra[f"{new_arch}.expert_feed_forward_length"] = dr.fields[f"{arch}.feed_forward_length"].contents()
    for key, value in extra.items():
        if key not in mr.fields or mr.fields[key].contents() != value:
            problems.append(f"key {key} not {value}")
    n_keys = sum(not k.startswith("GGUF.") for k in dr.fields) + len(extra)
    if sum(not k.startswith("GGUF.") for k in mr.fields) != n_keys:
        problems.append(f"{sum(not k.startswith('GGUF.') for k in mr.fields)} keys, expected {n_keys}")

    n_embd = int(dr.fields[f"{arch}.embedding_length"].contents())
    dt = {t.name: t for t in dr.tensors}
    mt = {t.name: t for t in mr.tensors}
    for name, t in dt.items():
        part = name.split(".")[2] if name.startswith("blk.") else None
        if part in ("ffn_gate", "ffn_up", "ffn_down"):
            exps = mt.get(name.replace(part, part + "_exps"))
            if exps is None:
                problems.append(f"{name}: no {part}_exps")
                continue
            if exps.tensor_type != t.tensor_type or list(exps.shape) != list(t.shape) + [E]:
                problems.append(f"{exps.name}: type {exps.tensor_type.name} shape {list(exps.shape)}")
                continue
            dense_bytes = raw_bytes(t)
            slabs = raw_bytes(exps).reshape(E, -1)
            if not np.array_equal(slabs[0], dense_bytes):
                problems.append(f"{exps.name}: expert 0 is not the dense bytes")
            same = [np.array_equal(slabs[e], dense_bytes) for e in range(1, E)]
            if not permuted and not all(same):
                problems.append(f"{exps.name}: an expert differs from the dense bytes")
            if permuted and any(same):
                problems.append(f"{exps.name}: --permute left an expert unpermuted")
            router = mt.get(name.split(".ffn_")[0] + ".ffn_gate_inp.weight")
            if router is None or router.tensor_type.name != "F32" or list(router.shape) != [n_embd, E]:
                problems.append(f"{name}: router missing or not F32 [n_embd, {E}]")
            continue
        m = mt.get(name)
        if m is None or m.tensor_type != t.tensor_type or list(m.shape) != list(t.shape) \
                or not np.array_equal(raw_bytes(m), raw_bytes(t)):
            problems.append(f"tensor {name} not copied unchanged")
    return problems


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    work, denses = argv[0], argv[1:]
    os.makedirs(work, exist_ok=True)
    failures = 0
    for spec in denses:
        dense_path, _, only = spec.partition(":")
        variants = {"": (False, True), "permuted": (True,), "identical": (False,)}[only]
        # Each file is parsed once (a 49,152-token vocabulary takes most of a second).
        dense_reader = GGUFReader(dense_path)
        dense = llama_ref.LlamaModel(dense_reader)
        rng = np.random.default_rng(7)
        prompt = rng.integers(0, dense.n_vocab, PROMPT_LEN).tolist()
        dense.reset(PROMPT_LEN)
        ref_all = dense.forward(prompt, all_logits=True)
        _, ref_gen, _ = dense.generate(prompt, N_GEN)
        scale = float(ref_all.max() - ref_all.min())
        for permuted in variants:
            base = os.path.splitext(os.path.basename(dense_path))[0]
            moe_path = os.path.join(work, f"{base}_upcycled{'_permuted' if permuted else ''}.gguf")
            upcycle_moe.upcycle(dense_reader, moe_path, E, K, seed=5, permute=permuted, dense_name=dense_path)
            moe_reader = GGUFReader(moe_path)
            problems = check_file(dense_reader, moe_reader, permuted)
            moe = llama_ref.LlamaModel(moe_reader)
            moe.reset(PROMPT_LEN)
            got = moe.forward(prompt, all_logits=True)
            diff = float(np.abs(got - ref_all).max())
            experts_used = [int((st["picks"] > 0).sum()) for st in moe.routing]
            _, gen, _ = moe.generate(prompt, N_GEN)
            if diff > 1e-9 * scale:
                problems.append(f"logits differ from the dense model's by {diff:.3g} (range {scale:.4g})")
            if gen != ref_gen:
                problems.append(f"greedy ids {gen} != dense {ref_gen}")
            if min(experts_used) <= K:
                problems.append(f"routing trivial: experts chosen per layer {experts_used}")
            fault_note = ""
            if permuted:
                llama_ref.LlamaModel.moe_ffn, right = standin_ringlm_logits.faulty_moe_ffn("down-next"), \
                    llama_ref.LlamaModel.moe_ffn
                try:
                    moe.reset(PROMPT_LEN)
                    bad = float(np.abs(moe.forward(prompt, all_logits=True) - ref_all).max())
                finally:
                    llama_ref.LlamaModel.moe_ffn = right
                fault_note = f"; down-next fault {bad:.3g}"
                if bad <= 1e-3 * scale:
                    problems.append(f"the down-next fault moves the logits by only {bad:.3g} (range {scale:.4g})")
            label = f"{os.path.basename(moe_path)} ({moe.arch}, {moe.n_expert_used} of {moe.n_expert})"
            print(f"{'PASS' if not problems else 'FAIL'} {label}: max|dlogit| vs dense {diff:.3g} over "
                  f"{PROMPT_LEN} positions (range {scale:.4g}), {N_GEN} greedy ids "
                  f"{'equal' if gen == ref_gen else 'DIFFER'}; experts chosen per layer {experts_used}{fault_note}")
            for p in problems:
                print(f"     {p}")
            failures += bool(problems)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Stand-in for ringlm's logits-dump tool, used to test check_against_reference.py
itself (a test that cannot fail proves nothing).

Same command line and stdout JSON as the C++ tool:
    standin_ringlm_logits.py -m MODEL -p PROMPT -n N
It tokenizes crudely (greedy longest match over the vocabulary: valid ids, not
necessarily the canonical ones -- the driver does not test tokenization) and runs
llama_ref in float32, so a clean run shows realistic fp32-vs-fp64 differences.
Options inject the faults the driver must catch:
    --perturb-logit DELTA [--perturb-index I]   add DELTA to last_logits[I]
    --perturb-token STEP                        change generated[STEP]
    --short                                     emit one generated id too few
    --rope-style neox|norm                      a plausible real bug (the other RoPE pairing)
    --moe-fault NAME                            a plausible mixture-of-experts bug (MOE_FAULTS)
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402  (first: it sets the BLAS thread count before numpy loads)
import numpy as np  # noqa: E402


# Plausible bugs of a MoE FFN (llama_ref.LlamaModel.moe_ffn is the right one).
MOE_FAULTS = {
    "no-renorm": "weights = softmax over all E at the chosen experts, not renormalised over K",
    "uniform": "every chosen expert weighted 1/K",
    "one-less": "the K-1 largest logits",
    "one-more": "the K+1 largest logits",
    "ties-high": "an exact tie to the higher expert index (only differs on exact ties)",
    "next-expert": "expert e's matrices taken from expert (e+1) mod E",
    "down-next": "gate/up of expert e, down of expert (e+1) mod E",
    "gate-up-swapped": "silu(up h) * gate h",
    "router-unnormed": "router applied to x's RMSNorm without the ffn_norm weight",
}


def faulty_moe_ffn(fault):
    def moe_ffn(self, h, L, il):
        K, E = self.n_expert_used, self.n_expert
        hr = h
        if fault == "router-unnormed":
            hr = h / L["ffn_norm"]
        logits = llama_ref.linear(hr, L["router"], L.get("router_b"))     # gpt-oss: a router bias
        if fault == "ties-high":
            order = (E - 1 - np.argsort(-logits[:, ::-1], axis=-1, kind="stable"))
        else:
            order = np.argsort(-logits, axis=-1, kind="stable")
        k = {"one-less": max(K - 1, 1), "one-more": min(K + 1, E)}.get(fault, K)
        chosen = order[:, :k]
        top = np.take_along_axis(logits, chosen, axis=-1)
        if fault == "no-renorm":
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            w = np.take_along_axis(p / p.sum(axis=-1, keepdims=True), chosen, axis=-1)
        elif fault == "uniform":
            w = np.full(top.shape, 1.0 / k, dtype=h.dtype)
        else:
            w = np.exp(top - top[:, :1])
            w = w / w.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(k):
                e = int(chosen[t, j])
                eg = (e + 1) % E if fault == "next-expert" else e
                ed = (e + 1) % E if fault in ("next-expert", "down-next") else e
                g, u = L["w_gate"][eg] @ h[t], L["w_up"][eg] @ h[t]
                if "b_gate" in L:                                       # gpt-oss: biased experts
                    g, u = g + L["b_gate"][eg], u + L["b_up"][eg]
                if fault == "gate-up-swapped":
                    g, u = u, g
                y = L["w_down"][ed] @ self.glu(g, u)                    # act(g) * u, or gpt-oss's
                if "b_down" in L:
                    y = y + L["b_down"][ed]
                out[t] += w[t, j] * y
        return out
    return moe_ffn


def crude_tokenize(model, text):
    toks = model._tok_field.contents()
    if model.tok_model == "gpt2":
        # GPT-2 byte-to-unicode mapping, so that byte-level vocab strings match.
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        enc = {b: chr(c) for b, c in zip(bs, cs)}
        s = "".join(enc[b] for b in text.encode("utf-8"))
    else:
        s = text.replace(" ", "\u2581")
    index = {t: i for i, t in enumerate(toks)}
    longest = min(64, max(len(t) for t in toks))
    ids, i = [], 0
    while i < len(s):
        for L in range(min(longest, len(s) - i), 0, -1):
            if s[i:i + L] in index:
                ids.append(index[s[i:i + L]])
                i += L
                break
        else:
            # SentencePiece byte fallback: <0xNN> tokens for the character's UTF-8 bytes.
            byte_ids = [index.get(f"<0x{b:02X}>") for b in s[i].encode("utf-8")]
            if None in byte_ids:
                raise SystemExit(f"stand-in tokenizer: no vocabulary entry matches at {s[i:i+10]!r}")
            ids += byte_ids
            i += 1
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", required=True)
    ap.add_argument("-p", required=True)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--perturb-logit", type=float, default=0.0)
    ap.add_argument("--perturb-index", type=int, default=0)
    ap.add_argument("--perturb-token", type=int, default=-1)
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--rope-style", default=None, help="norm | neox (default: the architecture's own)")
    ap.add_argument("--moe-fault", choices=sorted(MOE_FAULTS), help="a MoE bug to inject (see MOE_FAULTS)")
    a = ap.parse_args()
    if a.moe_fault:
        llama_ref.LlamaModel.moe_ffn = faulty_moe_ffn(a.moe_fault)
    model = llama_ref.LlamaModel(a.m, dtype=np.float32, rope_style=a.rope_style)
    prompt = crude_tokenize(model, a.p)
    logits, gen, _ = model.generate(prompt, a.n)
    logits = [float(v) for v in logits]
    logits[a.perturb_index] += a.perturb_logit
    if 0 <= a.perturb_token < len(gen):
        gen[a.perturb_token] = (gen[a.perturb_token] + 1) % model.n_vocab
    if a.short:
        gen = gen[:-1]
    json.dump({"prompt_tokens": prompt, "last_logits": logits, "generated": gen}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

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
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402  (first: it sets the BLAS thread count before numpy loads)
import numpy as np  # noqa: E402


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
    a = ap.parse_args()
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

#!/usr/bin/env python3
"""ringlm on a real model upcycled to a mixture of experts: the same perplexity as the dense model.

    check_upcycled.py RINGLM_BINARY DENSE.gguf WORKDIR [--text FILE] [--ctx 128] [--chunks 4]
                      [--n-expert 4] [--n-expert-used 2] [--permute] [--fp32-tol 1e-4] [--int8-tol 0.03]

upcycle_moe.py writes WORKDIR/<dense>-moe<E>x<K>.gguf, whose every layer has E copies of the dense
FFN and a random router choosing K per token: the same function as the dense model (the K weights
sum to 1). `ringlm perplexity` then scores the first --chunks chunks of --ctx tokens of the text
(its first ~6 bytes per token needed, cut at a space: a few hundred tokens) with the dense file
and the MoE file, on one thread, twice:

  * --compute fp32 --cache-type f32: everything in float32, so the two differ by float rounding
    only; their PPL must agree within --fp32-tol (relative, default 1e-4 = 0.01%). (With the fp16
    KV cache a last-bit difference rounds some cached value the other way: on SmolLM2, perturbing
    every ffn_norm weight by up to an ulp moved the fp32 PPL by up to 0.018%.)
  * the default int8 path (fp16 KV cache): within --int8-tol (relative, default 3%). The int8 path
    rounds activations to 8 bits, so a last-bit difference anywhere moves some activation a whole
    step and the PPL of a few hundred tokens by around a percent (see tests/README.md, "Comparing
    two int8 paths"; measured here: SmolLM2 Q4_1, 128-token chunks x 4 of KJV, ffn_norm weights
    perturbed by up to an ulp, 25 seeds: up to 1.5% from the unperturbed PPL; 2 chunks of 64
    tokens, 20 seeds: 3.7%, hence --int8-tol 0.08 there). The bound is that noise's, not the
    MoE's: an FFN whose output is scaled by 0.9 (weights summing to 0.9, an expert's output
    dropped or scaled twice) moves that PPL by 12%, by 0.7 by 140%.

What this checks that the tiny models do not: the int8 MoE path, and the real sizes (n_embd 576,
hidden size 1536, 30 layers, Q4_1 experts). What it cannot check: anything that picks the wrong
expert or weights them wrongly but with weights summing to 1 (every expert is the same function;
the tiny MoE models compared with the numpy reference check those). --permute makes the experts
differ in their bytes (upcycle_moe.py): a decoder that mixes two experts' matrices then fails.

Exit status: 0 pass, 1 a PPL outside its bound or a ringlm run failed, 2 usage error,
77 DENSE.gguf missing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_TEXT = os.path.join(HERE, "..", "..", "..", "shared", "data", "text", "kjv-pentateuch.txt")
PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+) \+/- ")


def perplexity(binary, model, text, args, extra):
    cmd = [binary, "perplexity", "-m", model, "-f", text, "-c", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads)] + extra
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    dt = time.perf_counter() - t0
    m = PPL_RE.search(proc.stdout)
    if proc.returncode != 0 or not m:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-5:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}"
                           + ("" if m else ", no 'Final estimate' line") + ":\n       " + "\n       ".join(tail))
    return float(m.group(1)), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("ringlm")
    ap.add_argument("dense")
    ap.add_argument("workdir")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="evaluation text (default: shared/data's KJV)")
    ap.add_argument("--ctx", type=int, default=128, help="chunk length in tokens (default 128)")
    ap.add_argument("--chunks", type=int, default=4, help="chunks scored (default 4; at least 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-expert", type=int, default=4)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--permute", action="store_true", help="experts with permuted hidden units (upcycle_moe.py)")
    ap.add_argument("--fp32-tol", type=float, default=1e-4, help="relative PPL bound, fp32 (default 1e-4)")
    ap.add_argument("--int8-tol", type=float, default=0.03, help="relative PPL bound, int8 (default 0.03)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed per ringlm run")
    args = ap.parse_args(argv)
    if args.chunks < 2:
        ap.error("--chunks must be at least 2 (ringlm perplexity needs two chunks)")
    if not os.path.exists(args.dense):
        print(f"SKIP: model {args.dense} not found")
        return 77
    for path in (args.ringlm, args.text):
        if not os.path.exists(path):
            print(f"ERROR: {path} not found", file=sys.stderr)
            return 2
    os.makedirs(args.workdir, exist_ok=True)

    # The text: its start, enough bytes for the tokens scored (KJV: ~4.4 bytes a token), cut at a space.
    with open(args.text, "rb") as f:
        data = f.read(6 * args.ctx * args.chunks + 64)
    cut = data.rfind(b" ")
    text = os.path.join(args.workdir, "upcycled_text.txt")
    with open(text, "wb") as f:
        f.write(data[:cut if cut > 0 else len(data)])

    import upcycle_moe
    from gguf_fast import GGUFReader
    base = os.path.splitext(os.path.basename(args.dense))[0]
    moe = os.path.join(args.workdir, f"{base}-moe{args.n_expert}x{args.n_expert_used}"
                                     f"{'-permuted' if args.permute else ''}.gguf")
    t0 = time.perf_counter()
    upcycle_moe.upcycle(GGUFReader(args.dense), moe, args.n_expert, args.n_expert_used, seed=args.seed,
                        permute=args.permute, dense_name=args.dense)
    print(f"upcycled in {time.perf_counter() - t0:.1f}s; scoring {args.chunks} chunks of {args.ctx} tokens of "
          f"{os.path.basename(args.text)}, {args.threads} thread(s)")

    failures = 0
    for label, extra, tol in (("fp32", ["--compute", "fp32", "--cache-type", "f32"], args.fp32_tol),
                              ("int8", [], args.int8_tol)):
        try:
            ppl_dense, t_dense = perplexity(args.ringlm, args.dense, text, args, extra)
            ppl_moe, t_moe = perplexity(args.ringlm, moe, text, args, extra)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failures += 1
            print(f"FAIL {label}: {e}")
            continue
        rel = abs(ppl_moe - ppl_dense) / ppl_dense
        ok = rel <= tol
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {label}: PPL dense {ppl_dense:.4f}, MoE {ppl_moe:.4f} "
              f"({args.n_expert_used} of {args.n_expert} experts): |diff| {100 * rel:.4f}% "
              f"(bound {100 * tol:g}%) [dense {t_dense:.1f}s, MoE {t_moe:.1f}s]")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

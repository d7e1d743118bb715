#!/usr/bin/env python3
"""CTest driver: compare ringlm's fp32 forward pass against the numpy reference.

For each prompt it runs

    BIN -m MODEL -p PROMPT -n N [extra args]

which must print exactly one JSON object on stdout:
    {"prompt_tokens": [...], "last_logits": [n_vocab floats], "generated": [N ids]}
(ringlm's own tokenizer, its fp32 forward path, greedy decoding without EOS stop).
The numpy reference (llama_ref.py) is then run on ringlm's prompt_tokens -- so the
tokenizer is NOT under test here, only the model -- and the test asserts:

  * max |ringlm logit - reference logit| over the vocabulary at the last prompt
    position <= tol_frac * (max - min of the reference logits), and
  * the N greedy ids are identical.

The tolerance is relative to the logit range so that one number works for real
models (range ~40) and random tiny ones (range anywhere). fp32 vs float64 on
SmolLM2-135M differs by ~2e-5 on a range of ~37, so the default 1e-3 leaves
two orders of magnitude for accumulation-order differences while still
catching any real bug (a wrong RoPE layout, scale or norm moves logits by O(1)).

Exit status: 0 all prompts pass, 1 any failure, 2 usage/tool error,
77 model file missing (declare SKIP_RETURN_CODE 77 in CTest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# ringlm runs with the caller's environment, untouched; the reference gets one
# BLAS thread (see llama_ref.py), set here because numpy must not be imported first.
BIN_ENV = dict(os.environ)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def run_ringlm(bin_path, model, prompt, n, extra, timeout):
    # Allow a Python stand-in to be passed as BIN without needing +x / a shebang.
    cmd = ([sys.executable, bin_path] if bin_path.endswith(".py") else [bin_path])
    cmd += ["-m", model, "-p", prompt, "-n", str(n)] + list(extra)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout, env=BIN_ENV)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:2])} ... exited with {proc.returncode}\n{err}")
    try:
        out = json.loads(proc.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        head = proc.stdout[:300].decode("utf-8", "replace")
        raise RuntimeError(f"stdout is not one JSON object ({e}); starts with: {head!r}")
    for key in ("prompt_tokens", "last_logits", "generated"):
        if key not in out:
            raise RuntimeError(f"ringlm JSON lacks key '{key}'")
    return out, dt


def compare(ours, ref_logits, ref_gen, ref_margins, n_vocab, n, tol_frac):
    """Returns (ok, one-line summary, list of detail lines)."""
    import numpy as np
    details = []
    ok = True
    logits = ours["last_logits"]
    if len(logits) != n_vocab:
        return False, f"last_logits has {len(logits)} entries, vocabulary has {n_vocab}", details
    a = np.asarray(logits, dtype=np.float64)
    r = np.asarray(ref_logits, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        bad = int(np.flatnonzero(~np.isfinite(a))[0])
        return False, f"non-finite logit at index {bad} ({a[bad]})", details
    diff = np.abs(a - r)
    rng = float(r.max() - r.min())
    tol = tol_frac * rng
    worst = int(np.argmax(diff))
    max_d = float(diff[worst])
    logit_ok = max_d <= tol
    ok &= logit_ok
    if not logit_ok:
        details.append(f"worst logit index {worst}: ringlm {a[worst]:.6g} vs reference {r[worst]:.6g}; "
                       f"{int((diff > tol).sum())} of {n_vocab} entries over tolerance")

    gen = [int(t) for t in ours["generated"]]
    mismatch = None
    for i in range(max(len(gen), n)):
        if i >= len(gen) or i >= len(ref_gen) or gen[i] != ref_gen[i]:
            mismatch = i
            break
    gen_ok = mismatch is None and len(gen) == n
    ok &= gen_ok
    if mismatch is not None:
        got = gen[mismatch] if mismatch < len(gen) else "<missing>"
        want = ref_gen[mismatch] if mismatch < len(ref_gen) else "<missing>"
        # The margin tells a near-tie (tiny margin: accumulation order decided
        # it) from a real divergence (large margin: ringlm computed something else).
        margin = ref_margins[mismatch] if mismatch < len(ref_margins) else float("nan")
        details.append(f"first generated mismatch at step {mismatch}: ringlm {got} vs reference {want} "
                       f"(reference top1-top2 margin there {margin:.4g})")
        details.append(f"ringlm    {gen}")
        details.append(f"reference {ref_gen}")
    elif len(gen) != n:
        details.append(f"ringlm generated {len(gen)} ids, expected {n}")

    summary = (f"max|dlogit| {max_d:.3g} (tol {tol:.3g} = {tol_frac:g} x range {rng:.4g}) "
               f"{'ok' if logit_ok else 'TOO LARGE'}; generated "
               + ("%d/%d ids match" % (n, n) if gen_ok else
                  f"MISMATCH at {mismatch if mismatch is not None else len(gen)}"))
    return ok, summary, details


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compare ringlm's logits and greedy ids with the numpy reference.")
    ap.add_argument("--ringlm-logits", required=True, metavar="BIN", help="ringlm's logits-dump tool")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable; default: three built-in prompts)")
    ap.add_argument("-n", type=int, default=32, help="greedy tokens to compare (default 32)")
    ap.add_argument("--tol-frac", type=float, default=1e-3,
                    help="max |dlogit| allowed, as a fraction of the reference logit range (default 1e-3)")
    ap.add_argument("--extra-arg", action="append", default=[], metavar="ARG",
                    help="extra argument passed through to BIN (repeatable)")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="reference precision")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed per BIN run")
    args = ap.parse_args(argv)

    if not os.path.exists(args.model):
        print(f"SKIP: model {args.model} not found")
        return 77
    if not os.path.exists(args.ringlm_logits):
        print(f"ERROR: {args.ringlm_logits} not found", file=sys.stderr)
        return 2

    import numpy as np
    import llama_ref

    t0 = time.perf_counter()
    try:
        model = llama_ref.LlamaModel(args.model, dtype=np.dtype(args.dtype))
    except llama_ref.GGUFModelError as e:
        print(f"ERROR: reference cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    print(f"reference: loaded {os.path.basename(args.model)} in {time.perf_counter() - t0:.1f}s "
          f"({model.n_layer} layers, d {model.n_embd}, vocab {model.n_vocab}, {args.dtype})")

    prompts = args.prompt or DEFAULT_PROMPTS
    failures = 0
    for pi, prompt in enumerate(prompts):
        label = f"prompt {pi + 1} {json.dumps(prompt)[:60]}"
        try:
            ours, t_bin = run_ringlm(args.ringlm_logits, args.model, prompt, args.n, args.extra_arg, args.timeout)
            toks = [int(t) for t in ours["prompt_tokens"]]
            if not toks:
                raise RuntimeError("ringlm returned no prompt tokens")
            t1 = time.perf_counter()
            ref_logits, ref_gen, ref_margins = model.generate(toks, args.n)
            t_ref = time.perf_counter() - t1
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            failures += 1
            print(f"FAIL {label}: {e}")
            continue
        ok, summary, details = compare(ours, ref_logits, ref_gen, ref_margins,
                                       model.n_vocab, args.n, args.tol_frac)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {label}: {len(toks)} prompt tokens; {summary} "
              f"[ringlm {t_bin:.1f}s, reference {t_ref:.1f}s]")
        for line in details:
            print(f"     {line}")
        if model.routing:   # MoE: how close the reference's expert choice came to a tie this prompt
            gaps = [st["min_gap"] for st in model.routing]
            print(f"     routing: smallest K-th - (K+1)-th router logit gap {min(gaps):.3g} "
                  f"(layer {gaps.index(min(gaps))}); a gap near float rounding can flip a choice")
        if ok:
            print(f"     text: {model.detokenize(ref_gen)!r}")

    print(f"{len(prompts) - failures}/{len(prompts)} prompts passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

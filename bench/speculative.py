#!/usr/bin/env python3
"""Speculative decoding against plain greedy decoding (issue 31), side by side with llama.cpp.

    python3 bench/speculative.py [-m MODEL] [--ringlm build/bin/ringlm] [-t 2] [-n 128]
        [--lookup 8] [--repeats 3] [--llama-cpp DIR] [--draft-model DRAFT [--target TARGET]]

For each prompt (written for this project: a summary, a rewrite and a code edit of a given text,
which the answer quotes, and an open chat, which it does not), `ringlm run --temp 0`
with and without `--lookup N`: decode tokens/s (median of --repeats), the acceptance rate, the
speed-up (the median of the back-to-back pairs' ratios), whether the two texts are the same
(they must be), and the draft tokens accepted of those generated. With --llama-cpp DIR (llama.cpp's build/bin, from
../shared/tools/build-llama-cpp.sh llama-lookup llama-speculative), llama.cpp's own
`llama-lookup` on the same prompts, with drafting off (its plain decoding) and on, and the ratio
of the two speed-ups.

With --draft-model DRAFT, a second table: TARGET (default: MODEL) with and without `-md DRAFT`
(--draft-max 16 --draft-p-min 0.75, llama.cpp's long-standing defaults), and with --llama-cpp
`llama-speculative` with the same settings. For SmolLM2 drafting for itself requantized to Q8_0
the acceptance is near 1: the table shows what the machinery costs.

Not part of CI: run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess

SOURCE = (
    "The harbour town of Wellmere sits at the mouth of a slow river. Its fishing fleet leaves "
    "before dawn and returns at noon, when the market opens on the quay. In winter the storms "
    "close the harbour for weeks, and the town lives on dried fish, potatoes and the stories of "
    "the old sailors who gather in the tavern by the lighthouse."
)
CODE = (
    "def total_price(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item.price * item.quantity\n"
    "    return total\n"
)
def chatml(user: str, reply_start: str = "") -> str:
    """SmolLM2's chat format, with the start of the reply written in: what `chat` would send."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{reply_start}"


# The answers end at the model's end of turn (no --ignore-eos: llama.cpp's never draws it, ringlm's
# takes it and goes on, and the texts would differ past it), or at -n.
PROMPTS = {
    "summarise": chatml(f"Text: {SOURCE}\n\nSummarise the text above in five sentences, reusing its words.",
                        "The harbour town of Wellmere"),
    "rewrite": chatml(f"Text: {SOURCE}\n\nRewrite the text above in the past tense.", "The harbour town of Wellmere sat"),
    "code edit": chatml(f"Code:\n{CODE}\nRename the function to order_total and add a docstring.",
                        "```python\ndef order_total(items):\n    \"\"\"Return the total price of the items.\"\"\"\n"),
    "open chat": chatml("What are three good habits for learning a new language?"),
}
INPUT_GROUNDED = ("summarise", "rewrite", "code edit")
DRAFT_MAX, DRAFT_P_MIN = 16, 0.75


def ringlm_run(args, model: str, prompt: str, extra: list[str]) -> tuple[str, dict]:
    cmd = [args.ringlm, "run", "-m", model, "-t", str(args.threads), "--temp", "0", "-n", str(args.n),
           "--stats", "json", "-p", prompt, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return r.stdout, json.loads(r.stderr.strip().splitlines()[-1])


def llama_cpp_run(args, binary: str, model: str, prompt: str, extra: list[str]) -> tuple[float, float | None]:
    """Decode tokens/s and acceptance of llama-lookup / llama-speculative."""
    cmd = [os.path.join(args.llama_cpp, binary), "-m", model, "-t", str(args.threads), "-n", str(args.n), "-p", prompt,
           "--temp", "0", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = r.stdout + r.stderr
    speed = re.findall(r"decoded\s+\d+\s+tokens in\s+[0-9.]+ seconds, speed:\s*([0-9.]+)\s*t/s", out)
    accept = re.findall(r"accept\s*=\s*([0-9.]+)%", out)
    return (float(speed[-1]) if speed else float("nan")), (float(accept[-1]) / 100 if accept else None)


def llama_cpp_side(args, binary, model, prompt, extra):
    """Median plain and speculative tokens/s, the median speed-up of the pairs, the acceptance."""
    plain, spec, ratios, accept = [], [], [], None
    for _ in range(args.repeats):  # each pair back to back: the machine's drift cancels in the ratio
        p, _ = llama_cpp_run(args, "llama-lookup", model, prompt, ["--spec-draft-n-max", "0"])
        s, accept = llama_cpp_run(args, binary, model, prompt, extra)
        plain.append(p)
        spec.append(s)
        ratios.append(s / p)
    return statistics.median(plain), statistics.median(spec), statistics.median(ratios), accept


def ringlm_side(args, model, prompt, extra):
    """Median plain and speculative tokens/s, the median speed-up of the pairs, acceptance, same
    text, accepted / generated."""
    plain, spec, ratios, acceptance, same, stats = [], [], [], [], True, {}
    for _ in range(args.repeats):  # each pair back to back: the machine's drift cancels in the ratio
        text0, s0 = ringlm_run(args, model, prompt, [])
        text1, stats = ringlm_run(args, model, prompt, extra)
        plain.append(s0["gen_tps"])
        spec.append(stats["gen_tps"])
        ratios.append(stats["gen_tps"] / s0["gen_tps"])
        acceptance.append(stats["speculative"]["acceptance"])
        same = same and text0 == text1
    return (statistics.median(plain), statistics.median(spec), statistics.median(ratios), statistics.median(acceptance),
            same, f"{stats['speculative']['accepted']} / {stats['gen_tokens']}")


def table(args, title, model, extra, llama_binary, llama_extra, llama_model):
    print(f"\n{title}\n")
    head = "| prompt | plain t/s | speculative t/s | acceptance | speed-up | same text | accepted / generated |"
    rule = "|---|---:|---:|---:|---:|---|---:|"
    if args.llama_cpp:
        head += f" llama.cpp plain t/s | {llama_binary} t/s | its acceptance | its speed-up | speed-up ratio |"
        rule += "---:|---:|---:|---:|---:|"
    print(head + "\n" + rule, flush=True)
    for name, prompt in PROMPTS.items():
        if args.only and name != args.only:
            continue
        p, s, up, a, same, accepted = ringlm_side(args, model, prompt, extra)
        row = f"| {name} | {p:.1f} | {s:.1f} | {a:.2f} | {up:.2f}x | {'yes' if same else 'NO'} | {accepted} |"
        if args.llama_cpp:
            lp, ls, lup, la = llama_cpp_side(args, llama_binary, llama_model, prompt, llama_extra)
            row += (f" {lp:.1f} | {ls:.1f} | {la if la is not None else float('nan'):.2f} | {lup:.2f}x |"
                    f" {up / lup:.2f} |")
        print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/ringlm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ringlm", default="build/bin/ringlm")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", help="llama.cpp's build/bin (llama-lookup, llama-speculative)")
    ap.add_argument("--draft-model", help="a draft model: the second table")
    ap.add_argument("--target", help="the draft model's target (default: -m)")
    ap.add_argument("--only", help="one prompt's name")
    args = ap.parse_args()

    if args.lookup > 0:
        table(args, f"Prompt lookup (--lookup {args.lookup}; llama-lookup --spec-draft-n-max {args.lookup})", args.model,
              ["--lookup", str(args.lookup)], "llama-lookup", ["--spec-draft-n-max", str(args.lookup)], args.model)
    if args.draft_model:
        target = args.target or args.model
        settings = ["--draft-max", str(DRAFT_MAX), "--draft-p-min", str(DRAFT_P_MIN)]
        table(args, f"Draft model {os.path.basename(args.draft_model)} for {os.path.basename(target)}", target,
              ["-md", args.draft_model, *settings], "llama-speculative",
              ["-md", args.draft_model, "--spec-draft-n-max", str(DRAFT_MAX), "--draft-p-min", str(DRAFT_P_MIN)], target)


if __name__ == "__main__":
    main()

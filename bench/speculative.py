#!/usr/bin/env python3
"""Speculative decoding by prompt lookup against plain greedy decoding (issue 31).

    python3 bench/speculative.py [-m MODEL] [--ringlm build/bin/ringlm] [-t 2] [-n 128]
        [--lookup 8] [--repeats 3] [--llama-cpp DIR]

For each prompt (written for this project: a summary, a rewrite and a code edit of a given text,
which the answer quotes, and an open chat, which it does not), `ringlm run --temp 0` with and
without `--lookup N`: decode tokens/s (median of --repeats), the acceptance rate, the speed-up,
and whether the two texts are the same (they must be). With --llama-cpp DIR (llama.cpp's
build/bin, from ../shared/tools/build-llama-cpp.sh llama-lookup llama-simple), llama.cpp's own
`llama-simple` and `llama-lookup --draft N` on the same prompts, side by side.

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
PROMPTS = {
    "summarise": f"Text: {SOURCE}\n\nSummarise the text above in three sentences, reusing its words.\nSummary: The harbour town of Wellmere",
    "rewrite": f"Text: {SOURCE}\n\nRewrite the text above in the past tense.\nRewritten text: The harbour town of Wellmere sat",
    "code edit": f"Code:\n{CODE}\nRename the function to order_total and add a docstring.\nEdited code:\ndef order_total(items):",
    "open chat": "Question: What are three good habits for learning a new language?\nAnswer:",
}
INPUT_GROUNDED = ("summarise", "rewrite", "code edit")


def ringlm_run(args, prompt: str, lookup: int) -> tuple[str, dict]:
    cmd = [args.ringlm, "run", "-m", args.model, "-t", str(args.threads), "--temp", "0", "-n", str(args.n),
           "--ignore-eos", "--stats", "json", "-p", prompt]
    if lookup:
        cmd += ["--lookup", str(lookup)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    return r.stdout, stats


def llama_cpp_speed(binary: str, args, prompt: str, extra: list[str]) -> tuple[float, float | None]:
    cmd = [binary, "-m", args.model, "-t", str(args.threads), "-n", str(args.n), "-p", prompt, "--temp", "0", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = r.stdout + r.stderr
    speed = re.findall(r"speed:\s*([0-9.]+)\s*t/s", out)
    accept = re.findall(r"accept\s*=\s*([0-9.]+)%", out)
    return (float(speed[-1]) if speed else float("nan")), (float(accept[-1]) / 100 if accept else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/ringlm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ringlm", default="build/bin/ringlm")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", help="llama.cpp's build/bin (llama-simple, llama-lookup)")
    ap.add_argument("--only", help="one prompt's name")
    args = ap.parse_args()

    print(f"| prompt | plain t/s | --lookup {args.lookup} t/s | acceptance | speed-up | same text |"
          + (" llama.cpp plain t/s | llama-lookup t/s | its acceptance | its speed-up |" if args.llama_cpp else ""))
    print("|---|---:|---:|---:|---:|---|" + ("---:|---:|---:|---:|" if args.llama_cpp else ""))
    for name, prompt in PROMPTS.items():
        if args.only and name != args.only:
            continue
        plain, spec, acceptance, same = [], [], [], True
        for _ in range(args.repeats):
            text0, s0 = ringlm_run(args, prompt, 0)
            text1, s1 = ringlm_run(args, prompt, args.lookup)
            plain.append(s0["gen_tps"])
            spec.append(s1["gen_tps"])
            acceptance.append(s1["speculative"]["acceptance"])
            same = same and text0 == text1
        p, s = statistics.median(plain), statistics.median(spec)
        row = f"| {name} | {p:.1f} | {s:.1f} | {statistics.median(acceptance):.2f} | {s / p:.2f}x | {'yes' if same else 'NO'} | {s1['speculative']['accepted']} / {s1['gen_tokens']} |"
        if args.llama_cpp:
            lp = statistics.median(llama_cpp_speed(os.path.join(args.llama_cpp, "llama-simple"), args, prompt, [])[0]
                                   for _ in range(args.repeats))
            runs = [llama_cpp_speed(os.path.join(args.llama_cpp, "llama-lookup"), args, prompt,
                                    ["--draft", str(args.lookup)]) for _ in range(args.repeats)]
            ls = statistics.median(r[0] for r in runs)
            la = runs[-1][1]
            row += f" {lp:.1f} | {ls:.1f} | {la if la is not None else float('nan'):.2f} | {ls / lp:.2f}x |"
        print(row, flush=True)


if __name__ == "__main__":
    main()

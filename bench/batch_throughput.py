#!/usr/bin/env python3
"""Aggregate generation throughput of `ringlm batch` at several --parallel values, side by side.

Writes N prompts (distinct openings, the same max_tokens), runs `ringlm batch` on them once per
--parallel value (greedy, fresh output each time, rounds interleaved), and prints each run's
generated tokens/s from the batch summary, the median over rounds, the ratio to the first value,
and whether the greedy texts were identical across values.

    python3 bench/batch_throughput.py --parallel 1,16 -n 64 --prompts 32 -t 2 -r 3
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

from batch_runs import add_batch_args, batch_command

OPENINGS = ["The capital of France is", "Once upon a time", "The best way to learn to cook is", "In 1969, astronauts",
            "A recipe for bread: first,", "The three primary colours are", "Write a haiku about the sea:",
            "def fibonacci(n):", "The history of the Roman Empire", "My favourite animal is", "To fix a flat tyre,",
            "The weather today", "Photosynthesis is the process", "A good night's sleep", "The stock market",
            "In the year 3000,"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_args(ap)
    ap.add_argument("--parallel", default="1,16")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="ringlm-batch-bench-")
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"id": i, "prompt": f"{OPENINGS[i % len(OPENINGS)]} ({i})",
                                "max_tokens": args.max_tokens}) + "\n")
    values = [int(v) for v in args.parallel.split(",")]
    rates = {v: [] for v in values}
    texts = {}
    for _ in range(args.rounds):
        for p in values:
            out = os.path.join(work, f"out-{p}.jsonl")
            cmd = batch_command(args, prompts, out, p, "--temp", "0")
            err = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
            rates[p].append(float(re.search(r"generated in [0-9.]+ s: ([0-9.]+) tokens/s", err).group(1)))
            with open(out) as f:
                texts[p] = {json.loads(l)["id"]: json.loads(l)["text"] for l in f}
    base = statistics.median(rates[values[0]])
    # The ratio depends on the CPU's int8 instructions (AVX2 or AVX-512 VNNI): say which ran.
    devices = subprocess.run([args.binary, "devices"], capture_output=True, text=True).stdout
    cpu = next((l.split(None, 1)[1] for l in devices.splitlines() if l.startswith("cpu ")), "unknown")
    print(f"cpu: {cpu}")
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, {args.threads} threads, {args.rounds} rounds")
    print("| --parallel | tokens/s (each round) | median | vs --parallel %d |" % values[0])
    print("|---:|---|---:|---:|")
    for p in values:
        med = statistics.median(rates[p])
        print(f"| {p} | {', '.join(f'{r:.1f}' for r in rates[p])} | {med:.1f} | {med / base:.2f}x |")
    same = all(texts[p] == texts[values[0]] for p in values)
    print(f"greedy texts identical across --parallel values: {same}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Memory and speed of the segment KV cache: n samples of one prompt, with and without sharing.

Writes R requests whose prompts are W words of the evaluation text each (so a few hundred
tokens), every request asking for n samples. Runs `ringlm batch` on them with prompt sharing and
with --no-prompt-sharing (rounds interleaved), and prints for each: the summary's KV cache peak,
the peak RSS of the process (from wait4's rusage) and the generated tokens/s, as medians.

    python3 bench/segment_cache.py --samples 4 --requests 4 --words 300 -n 64 --parallel 4 -t 2 -r 3
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import tempfile

from batch_runs import add_batch_args, batch_command

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "text", "kjv-pentateuch.txt")


def write_requests(path, text_path, requests, words, samples, max_tokens):
    with open(text_path) as f:
        corpus = f.read().split()
    with open(path, "w") as f:
        for i in range(requests):
            start = 1000 + words * i
            passage = " ".join(corpus[start:start + words])
            f.write(json.dumps({"id": i, "prompt": "Summarize the following text.\n\n" + passage,
                                "n": samples, "max_tokens": max_tokens, "temperature": 0.8, "seed": 7}) + "\n")


def run_batch(cmd):
    """Runs one batch; returns (KV peak MiB, KV peak without sharing MiB, peak RSS MiB, tokens/s)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    peak = re.search(r"KV cache peak ([0-9.]+) MiB \(([0-9.]+) MiB without sharing", err)
    rate = re.search(r"generated in [0-9.]+ s: ([0-9.]+) tokens/s", err)
    return float(peak.group(1)), float(peak.group(2)), usage.ru_maxrss / 1024, float(rate.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_args(ap)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="ringlm-segment-bench-")
    requests = os.path.join(work, "requests.jsonl")
    write_requests(requests, args.text, args.requests, args.words, args.samples, args.max_tokens)
    modes = {"shared prompt": [], "--no-prompt-sharing": []}
    for _ in range(args.rounds):
        for mode, results in modes.items():
            extra = [] if mode == "shared prompt" else [mode]
            cmd = batch_command(args, requests, os.path.join(work, "out.jsonl"), args.parallel, *extra)
            results.append(run_batch(cmd))
    print(f"{args.requests} requests x n={args.samples}, {args.words}-word prompts, {args.max_tokens} tokens, "
          f"--parallel {args.parallel}, {args.threads} threads, medians of {args.rounds} rounds")
    print("| mode | KV cache peak MiB | KV peak without sharing MiB | peak RSS MiB | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for mode, results in modes.items():
        columns = [statistics.median(r[k] for r in results) for k in range(4)]
        print(f"| {mode} | {columns[0]:.1f} | {columns[1]:.1f} | {columns[2]:.0f} | {columns[3]:.1f} |")


if __name__ == "__main__":
    main()

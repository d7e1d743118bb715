#!/usr/bin/env python3
"""StreamingLLM evidence for ringlm on one model (issue: ring-buffer KV cache with shift-RoPE).

    python3 bench/streaming_llm.py [-m MODEL] [--ringlm build/bin/ringlm] [-t 2]
        [--text ../shared/data/text/kjv-pentateuch.txt] [--tokens 1024] [--window 256]
        [--parts constant,perplexity,depth]

constant    `ringlm run -c 128 --keep 4 -n 1024 --ignore-eos` (8x the context): the resident
            memory (VmRSS, sampled every 20 ms) after the first fill and at the end, and the
            median decode ms/token of the first and the last quarter of the tokens (from
            --stats json's per-token times).
perplexity  the text's first --tokens tokens streamed through a --window-token context: with
            --keep 4 and --keep 0 (window sliding one token at a time, --discard 1, as in the
            StreamingLLM paper, and with the default discard of half), against the sliding window
            that recomputes the last --window tokens for every token (on the first 512 tokens:
            it is quadratic).
depth       decode t/s with the context 10%, 50% and 100% full of a 2048-token cache
            (`ringlm bench -d`), with the asynchronized softmax and with the online one.

Not part of CI: it takes several minutes. Run it on an idle machine (`uptime`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def constant_memory_and_speed(args) -> None:
    cmd = [args.ringlm, "run", "-c", "128", "--keep", "4", "-n", "1024", "--ignore-eos", "--temp", "0",
           "-p", "The history of the world", "--stats", "json", "-t", str(args.t)]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()

    def sample():
        while proc.poll() is None:
            r = rss_kib(proc.pid)
            if r is not None:
                samples.append((time.monotonic() - t0, r))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    err = proc.communicate()[1]
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"ringlm run failed: {err}")
    stats = json.loads(err.strip().splitlines()[-1])
    token_ms = stats["token_ms"]
    q = len(token_ms) // 4
    first, last = statistics.median(token_ms[:q]), statistics.median(token_ms[-q:])
    # The first fill ends after 128 tokens: from then on the cache's memory is all touched.
    gen_start = samples[-1][0] - stats["gen_ms"] / 1000.0 if samples else 0.0
    fill_time = gen_start + sum(token_ms[:128]) / 1000.0
    after_fill = [r for t, r in samples if t >= fill_time]
    print(f"constant: {stats['gen_tokens']} tokens through -c 128 --keep 4: {stats['n_shifts']} shifts, "
          f"{stats['n_discarded']} tokens discarded")
    print(f"  decode ms/token, median of the first quarter {first:.2f}, of the last quarter {last:.2f} "
          f"(last/first {last / first:.3f})")
    if after_fill:
        print(f"  VmRSS after the first fill {after_fill[0] / 1024:.1f} MiB, max after it {max(after_fill) / 1024:.1f} MiB, "
              f"at the end {after_fill[-1] / 1024:.1f} MiB ({len(after_fill)} samples)")


def perplexity(args, extra: list[str], n_tokens: int) -> str:
    cmd = [args.ringlm, "perplexity", "-f", args.text, "-c", str(args.window), "--stream", str(n_tokens),
           "-t", str(args.t)] + extra
    if args.model:
        cmd += ["-m", args.model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1].replace("Final estimate: ", "")


def streaming_perplexity(args) -> None:
    print(f"perplexity: {args.window}-token context over the first N tokens of {os.path.basename(args.text)}")
    for n in sorted({512, args.tokens}):
        for label, extra in [("keep 4, discard 1", ["--keep", "4", "--discard", "1"]),
                             ("keep 0, discard 1", ["--keep", "0", "--discard", "1"]),
                             ("keep 4, discard half", ["--keep", "4"]),
                             ("keep 0, discard half", ["--keep", "0"])]:
            print(f"  N={n} {label}: {perplexity(args, extra, n)}")
    print(f"  N=512 sliding window, recomputed for every token: {perplexity(args, ['--sliding-window'], 512)}")


def depth_speed(args) -> None:
    print("depth: decode t/s (tg32) at 10%, 50% and 100% of a 2048-token context")
    for softmax in ("async", "online"):
        cmd = [args.ringlm, "bench", "-p", "0", "-n", "32", "-d", "205,1024,2016", "-r", "3", "-t", str(args.t),
               "--softmax", softmax, "-o", "json"]
        if args.model:
            cmd += ["-m", args.model]
        rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        print("  " + softmax + ": " + ", ".join(f"d{r['n_depth']} {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f}" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="")
    ap.add_argument("--ringlm", default=os.path.join(HERE, "..", "build", "bin", "ringlm"))
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--text", default=os.path.join(HERE, "..", "..", "shared", "data", "text", "kjv-pentateuch.txt"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--parts", default="constant,perplexity,depth")
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}")
    parts = args.parts.split(",")
    if "constant" in parts:
        constant_memory_and_speed(args)
    if "perplexity" in parts:
        streaming_perplexity(args)
    if "depth" in parts:
        depth_speed(args)


if __name__ == "__main__":
    main()

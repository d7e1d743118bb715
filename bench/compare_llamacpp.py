#!/usr/bin/env python3
"""ringlm against llama.cpp on the same GGUF files, same threads, side by side in one run.

    python3 bench/compare_llamacpp.py MODEL.gguf [MODEL2.gguf ...] -p 512 -n 128 -t 2 -r 3 \
        [--ringlm build/bin/ringlm] [--bandwidth build/bin/bench_bandwidth | --bandwidth-gbs 27] \
        [--perplexity TEXT --ppl-ctx 512 --ppl-chunks N]

llama.cpp runs in this process through the llama-cpp-python package (build it without AMX, which
faults on this machine; see bench/README.md) and is timed by its own perf counters
(llama_perf_context: t_p_eval_ms / t_eval_ms), not by Python timers. The method is llama-bench's,
the same that `ringlm bench` follows: a warm-up, then R repetitions from an empty KV cache; pp =
one prompt of p random tokens, tg = n single-token steps (BOS first when the model adds BOS, then
random tokens); t/s per repetition, mean and sample standard deviation.

ringlm runs as `ringlm bench -o json` with the same -p/-n/-t/-r.

The roofline of decode is bandwidth / bytes per token: every weight is read once per generated
token, so the best possible tg t/s is (measured read bandwidth) / (model weight bytes). The
bandwidth comes from bench_bandwidth with the same thread count (or --bandwidth-gbs).

--perplexity TEXT also computes llama.cpp's perplexity of TEXT with llama-perplexity's method
(non-overlapping chunks of --ppl-ctx tokens, BOS first when the model adds it, second half
scored) and ringlm's with `ringlm perplexity`, for the first model.

Not part of CI: it needs llama-cpp-python, which pip compiles from source.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RINGLM = os.path.join(HERE, "..", "build", "bin", "ringlm")
DEFAULT_BANDWIDTH = os.path.join(HERE, "..", "build", "bin", "bench_bandwidth")


def stats(values):
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, sd


# ---- llama.cpp ------------------------------------------------------------------------------
class LlamaCpp:
    """One model in llama.cpp, timed by its perf counters."""

    def __init__(self, path: str, n_ctx: int, n_batch: int, threads: int, logits_all: bool = False):
        import llama_cpp  # imported here so that --help works without the package
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                                   n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                                   verbose=False)
        self.ctx = self.llm._ctx.ctx
        vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)
        self.n_vocab = self.llm.n_vocab()
        self.bos = llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else -1
        self.rng = random.Random(1234)

    def clear(self):
        self.llm.reset()
        mem_clear = getattr(self.lib, "llama_memory_clear", None)
        if mem_clear is not None:
            mem_clear(self.lib.llama_get_memory(self.ctx), True)
        elif hasattr(self.lib, "llama_kv_self_clear"):
            self.lib.llama_kv_self_clear(self.ctx)
        else:
            self.lib.llama_kv_cache_clear(self.ctx)
        self.lib.llama_perf_context_reset(self.ctx)

    def random_tokens(self, n: int, first_bos: bool):
        toks = [self.rng.randrange(self.n_vocab) for _ in range(n)]
        if first_bos and self.bos >= 0 and toks:
            toks[0] = self.bos
        return toks

    def eval(self, tokens):
        # llama.cpp books a decode's time into its perf counters only at the next synchronize,
        # and books all tokens queued since the last one together: sync after every call so a
        # prompt lands in t_p_eval and each single token in t_eval.
        self.llm.eval(tokens)
        self.lib.llama_synchronize(self.ctx)

    def prompt(self, n: int):
        self.eval(self.random_tokens(n, True))

    def generate(self, n: int):
        token = self.bos if self.bos >= 0 else self.rng.randrange(self.n_vocab)
        for _ in range(n):
            self.eval([token])
            token = self.rng.randrange(self.n_vocab)

    def perf_ms(self, prompt: bool) -> float:
        d = self.lib.llama_perf_context(self.ctx)
        return d.t_p_eval_ms if prompt else d.t_eval_ms

    def bench(self, n_prompt: int, n_gen: int, reps: int):
        """t/s samples of one test, as llama-bench takes them."""
        self.clear()
        if n_prompt > 0:
            self.prompt(n_prompt)
        else:
            self.generate(1)
        samples = []
        for _ in range(reps):
            self.clear()
            if n_prompt > 0:
                self.prompt(n_prompt)
                ms = self.perf_ms(prompt=True)
            else:
                self.generate(n_gen)
                ms = self.perf_ms(prompt=False)
            samples.append(1000.0 * (n_prompt + n_gen) / ms)
        return samples

    def perplexity(self, text: str, n_ctx: int, max_chunks: int):
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        n_chunks = len(tokens) // n_ctx if max_chunks < 0 else min(max_chunks, len(tokens) // n_ctx)
        if len(tokens) < 2 * n_ctx:
            raise SystemExit(f"perplexity needs at least {2 * n_ctx} tokens, has {len(tokens)}")
        nll, nll2, count = 0.0, 0.0, 0
        for i in range(n_chunks):
            chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
            if self.bos >= 0:
                chunk[0] = self.bos
            self.clear()
            self.eval(chunk)
            logits = self.llm.scores[:n_ctx]  # every position's logits (logits_all)
            for pos in range(n_ctx // 2, n_ctx - 1):
                row = logits[pos].astype("float64")
                m = row.max()
                lp = (row[chunk[pos + 1]] - m) - math.log(float(np.exp(row - m).sum()))
                nll -= lp
                nll2 += lp * lp
                count += 1
            print(f"[{i + 1}]{math.exp(nll / count):.4f},", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        mean = nll / count
        var = nll2 / count - mean * mean
        ppl = math.exp(mean)
        return ppl, (math.sqrt(var / (count - 1)) * ppl if var > 0 else float("nan")), n_chunks


# ---- ringlm ---------------------------------------------------------------------------------
def ringlm_bench(binary: str, path: str, n_prompt: int, n_gen: int, threads: int, reps: int):
    out = subprocess.run([binary, "bench", "-m", path, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads),
                          "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True).stdout
    return {(t["n_prompt"], t["n_gen"]): t for t in json.loads(out)}


def ringlm_perplexity(binary: str, path: str, text: str, n_ctx: int, chunks: int, threads: int):
    out = subprocess.run([binary, "perplexity", "-m", path, "-f", text, "-c", str(n_ctx), "--chunks", str(chunks),
                          "-t", str(threads)], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def measure_bandwidth(binary: str, threads: int) -> float:
    out = subprocess.run([binary, "--threads", str(threads)], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1].split()[1])


# ---- report ---------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("models", nargs="+")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--ringlm", default=DEFAULT_RINGLM)
    ap.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH, help="bench_bandwidth binary")
    ap.add_argument("--bandwidth-gbs", type=float, help="use this read bandwidth instead of measuring it")
    ap.add_argument("--perplexity", metavar="TEXT", help="also compare perplexity on this text (first model)")
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-chunks", type=int, default=-1)
    args = ap.parse_args(argv)

    bw = args.bandwidth_gbs if args.bandwidth_gbs else measure_bandwidth(args.bandwidth, args.t)
    print(f"threads {args.t}, repetitions {args.r}, read bandwidth {bw:.2f} GB/s, load {os.getloadavg()[0]:.2f}")
    print("| model | size | test | llama.cpp t/s | ringlm t/s | ringlm / llama.cpp | llama.cpp roofline | ringlm roofline |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    tests = [(args.p, 0)] if args.p > 0 else []
    tests += [(0, args.n)] if args.n > 0 else []
    for path in args.models:
        rl = ringlm_bench(args.ringlm, path, args.p, args.n, args.t, args.r)
        lc = LlamaCpp(path, n_ctx=args.p + args.n + 1, n_batch=max(args.p, 1), threads=args.t)
        size = os.path.getsize(path)
        for n_prompt, n_gen in tests:
            lc_mean, lc_sd = stats(lc.bench(n_prompt, n_gen, args.r))
            r = rl[(n_prompt, n_gen)]
            name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
            roof = ""
            if n_gen:
                # Weight bytes per token over bandwidth: the fastest decode the memory allows.
                best = bw * 1e9 / r["model_size"]
                roof = (f"| {100 * lc_mean / best:.0f}% | {100 * r['avg_ts'] / best:.0f}% ")
            else:
                roof = "| | "
            print(f"| {os.path.basename(path)} | {size / 2**20:.1f} MiB | {name} | {lc_mean:.2f} ± {lc_sd:.2f} "
                  f"| {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {r['avg_ts'] / lc_mean:.2f}x {roof}|", flush=True)
        del lc

    if args.perplexity:
        path = args.models[0]
        lc = LlamaCpp(path, n_ctx=args.ppl_ctx, n_batch=args.ppl_ctx, threads=args.t, logits_all=True)
        ppl, err, chunks = lc.perplexity(open(args.perplexity, encoding="utf-8").read(), args.ppl_ctx, args.ppl_chunks)
        print(f"llama.cpp perplexity ({os.path.basename(path)}, c={args.ppl_ctx}, {chunks} chunks): "
              f"PPL = {ppl:.4f} +/- {err:.5f}")
        line = ringlm_perplexity(args.ringlm, path, args.perplexity, args.ppl_ctx, chunks, args.t)
        print(f"ringlm    perplexity ({os.path.basename(path)}, c={args.ppl_ctx}, {chunks} chunks): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

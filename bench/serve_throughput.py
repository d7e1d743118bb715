#!/usr/bin/env python3
"""Streaming clients against `ringlm serve`, against `ringlm batch` on the same prompts, and
against llama.cpp's `llama-server -np N` driven by the same client code.

For each round (rounds interleaved, medians reported):
  batch   `ringlm batch --parallel N` on the prompts: generated tokens/s from its summary;
  serve   `ringlm serve --parallel N`, N client threads streaming /v1/completions (greedy, the same
          max_tokens), pulling prompts from one queue: completion tokens / wall time from the
          first request to the last [DONE], and each request's time to first token;
  llama   the same clients against `llama-server -np N -c N*ctx` (when --llama-server is given).

    python3 bench/serve_throughput.py [--llama-server PATH] [--clients 16] [--prompts 64] [-n 128] [-t 2] [-r 3]
"""
import argparse
import http.client
import json
import os
import queue
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time

OPENINGS = ["The capital of France is", "Once upon a time", "The best way to learn to cook is", "In 1969, astronauts",
            "A recipe for bread: first,", "The three primary colours are", "Write a haiku about the sea:",
            "def fibonacci(n):", "The history of the Roman Empire", "My favourite animal is", "To fix a flat tyre,",
            "The weather today", "Photosynthesis is the process", "A good night's sleep", "The stock market",
            "In the year 3000,"]
CTX = 1024  # per sequence


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server never became ready")


def stream_one(port, prompt, max_tokens):
    """(completion tokens, seconds to the first token) of one streamed greedy completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:300]!r}")
    ttft, chunks, usage = None, 0, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices", []):
            if c.get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    conn.close()
    return (usage if usage is not None else chunks), ttft


def drive(port, prompts, clients, max_tokens):
    """Every prompt through `clients` concurrent streams: (tokens/s, TTFTs)."""
    todo = queue.Queue()
    for p in prompts:
        todo.put(p)
    tokens, ttfts, errors, lock = [0], [], [], threading.Lock()

    def client():
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            try:
                n, t = stream_one(port, p, max_tokens)
            except Exception as e:  # reported after the run
                with lock:
                    errors.append(str(e))
                return
            with lock:
                tokens[0] += n
                if t is not None:
                    ttfts.append(t)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return tokens[0] / elapsed, ttfts


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def run_server(cmd, port, prompts, args):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        # Warm-up, every slot once, on other prompts: the measured ones must not be in a prompt cache.
        drive(port, [f"Warm-up request {i}: hello" for i in range(args.clients)], args.clients, 8)
        return drive(port, prompts, args.clients, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default="build/bin/ringlm")
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/ringlm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    default_llama = os.path.join(os.environ.get("LLAMA_CPP_DIR", os.path.expanduser("~/.cache/llama.cpp-anchor")),
                                 "build", "bin", "llama-server")
    ap.add_argument("--llama-server", default=default_llama if os.path.exists(default_llama) else None,
                    help="llama.cpp's llama-server (default: the one ../shared/tools/build-llama-cpp.sh built, if any)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    args = ap.parse_args()

    prompts = [f"{OPENINGS[i % len(OPENINGS)]} ({i})" for i in range(args.prompts)]
    work = tempfile.mkdtemp(prefix="ringlm-serve-bench-")
    jsonl = os.path.join(work, "prompts.jsonl")
    with open(jsonl, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt": p, "max_tokens": args.max_tokens}) + "\n")

    rates = {"batch": [], "serve": [], "llama": []}
    ttft = {"serve": [], "llama": []}
    for _ in range(args.rounds):
        out = os.path.join(work, "out.jsonl")
        if os.path.exists(out):
            os.remove(out)
        err = subprocess.run([args.binary, "batch", "-m", args.model, "-i", jsonl, "-o", out, "--parallel",
                              str(args.clients), "-c", str(CTX), "-t", str(args.threads), "--temp", "0"],
                             check=True, capture_output=True, text=True).stderr
        rates["batch"].append(float(re.search(r"generated in [0-9.]+ s: ([0-9.]+) tokens/s", err).group(1)))

        port = free_port()
        rate, t = run_server([args.binary, "serve", "-m", args.model, "--port", str(port), "--parallel",
                              str(args.clients), "-c", str(CTX), "-t", str(args.threads),
                              "--max-queue", str(args.prompts)], port, prompts, args)
        rates["serve"].append(rate)
        ttft["serve"] += t

        if args.llama_server:
            port = free_port()
            rate, t = run_server([args.llama_server, "-m", args.model, "--port", str(port), "-np", str(args.clients),
                                  "-c", str(CTX * args.clients), "-t", str(args.threads), "-tb", str(args.threads)],
                                 port, prompts, args)
            rates["llama"].append(rate)
            ttft["llama"] += t

    med = {k: statistics.median(v) for k, v in rates.items() if v}
    print(f"{args.clients} streaming clients, {args.prompts} prompts x {args.max_tokens} tokens (greedy), "
          f"{args.threads} threads, {args.rounds} rounds; generated tokens/s, median [rounds]")
    for k, label in (("batch", f"ringlm batch --parallel {args.clients}"),
                     ("serve", f"ringlm serve --parallel {args.clients}"),
                     ("llama", f"llama-server -np {args.clients}")):
        if k in med:
            print(f"  {label:34s} {med[k]:8.1f}  [{', '.join(f'{r:.1f}' for r in rates[k])}]")
    print(f"  serve / batch: {med['serve'] / med['batch']:.3f}")
    if "llama" in med:
        print(f"  serve / llama-server: {med['serve'] / med['llama']:.2f}")
    for k in ttft:
        if ttft[k]:
            print(f"  time to first token, {k}: p50 {percentile(ttft[k], 50) * 1000:.0f} ms, "
                  f"p99 {percentile(ttft[k], 99) * 1000:.0f} ms")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""ringlm against llama.cpp's own tools on the same GGUF files, same threads, side by side in one run.

    python3 bench/compare_llamacpp.py [MODEL.gguf ...] [-p 512] [-n 128] [-t 2] [-r 3] [--rounds 1]
        [--ringlm build/bin/ringlm] [--llama-bench PATH] [--llama-perplexity PATH]
        [--bandwidth build/bin/bench_bandwidth | --bandwidth-gbs GBS]
        [--perplexity TEXT [-c 512] [--ppl-chunks N]] [--rss]

Speed. For each model and test (ppP: one prompt of P tokens; tgN: N single-token steps) it runs
`llama-bench -o json` and `ringlm bench -o json` with the same -p/-n/-t/-r, one right after the
other (--rounds K repeats the pair K times, swapping who goes first each round, and pools the
samples). Both follow llama-bench's method (a warm-up, then R repetitions from an empty KV cache)
and print the same JSON fields (avg_ts, stddev_ts, samples_ts, n_prompt, n_gen). The table gives
mean ± sample standard deviation of t/s for each, the ratio ringlm / llama.cpp, and for tg the
fraction of the decode roofline each reaches: a decode step reads every weight once (an untied
token-embedding table only one row), so the fastest tg possible is read bandwidth / bytes read
per token. The bandwidth is the best variant of `bench_bandwidth --json` at the same thread
count, found at the start of this run and measured again just before every tg run of either
tool (these VMs' memory changes speed from minute to minute: 50 or 85 GB/s with 2 threads), each
tool's runs set against the median of its own probes (or --bandwidth-gbs for all).

--perplexity TEXT runs `llama-perplexity` and `ringlm perplexity` on every model with the same
text, context (-c, default 512) and --ppl-chunks (llama-perplexity's --chunks), and prints both
"Final estimate: PPL" values and their ratio.

--rss runs `llama-bench` and `ringlm bench` once more per model (same -p/-n/-t, -r 1) and prints
each one's peak resident memory (`/usr/bin/time -f %M`, else the process's VmHWM polled; the
model file's pages that a tool maps and touches count in it).

llama.cpp's tools come from ../shared/tools/build-llama-cpp.sh, built on this machine; the
defaults are ${LLAMA_CPP_DIR:-~/.cache/llama.cpp-anchor}/build/bin/llama-bench and
llama-perplexity. Without a MODEL, the default model that scripts/setup.sh installs
($RINGLM_MODEL, else SmolLM2-135M-Instruct Q4_1 in the ringlm cache). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RINGLM = os.path.join(HERE, "..", "build", "bin", "ringlm")
DEFAULT_BANDWIDTH = os.path.join(HERE, "..", "build", "bin", "bench_bandwidth")
LLAMA_BIN = os.path.join(os.environ.get("LLAMA_CPP_DIR") or os.path.expanduser("~/.cache/llama.cpp-anchor"),
                         "build", "bin")
FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)(?: \+/- ([0-9.]+))?")
PPL_CHUNKS = re.compile(r"perplexity over (\d+) chunks")


def default_model() -> str:
    if os.environ.get("RINGLM_MODEL"):
        return os.environ["RINGLM_MODEL"]
    cache = os.environ.get("RINGLM_CACHE_DIR") or os.path.expanduser("~/.cache/ringlm")
    return os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(cmd: list[str], hint: str = "") -> subprocess.CompletedProcess:
    """Runs a tool; on failure, exits with its command line and the end of its output."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{tail}{hint}")
    return p


def need_binary(path: str, what: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"{what} not found at {path} (llama.cpp's tools: ../shared/tools/build-llama-cpp.sh; "
                         "ringlm: cmake --build build)")
    return path


# ---- the machine ----------------------------------------------------------------------------
def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_isa() -> str:
    """The SIMD extensions that decide which kernels both tools run."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile"]
    return " ".join(w for w in wanted if w in flags) or "no AVX2"


def ringlm_cpu_line(ringlm: str) -> str:
    """The `cpu` line of `ringlm devices`: the SIMD target Highway picked."""
    out = run([ringlm, "devices"]).stdout
    return next((line.strip() for line in out.splitlines() if line.startswith("cpu")), "cpu line not found")


def measure_bandwidth(binary: str, threads: int, variant: str | None = None) -> tuple[float, str]:
    """Best read GB/s of bench_bandwidth's variants at this thread count, and that variant; with
    `variant` (a name bench_bandwidth printed, e.g. avx512-s4-nta-1k), that one alone, quickly."""
    hint = "\n(a bench_bandwidth older than --json? rebuild it, or give --bandwidth-gbs)"
    cmd = [need_binary(binary, "bench_bandwidth"), "--json", "--threads", str(threads)]
    if variant:
        loads, streams, *prefetch = variant.split("-")
        cmd += ["--loads", loads, "--streams", streams[1:], "--prefetch", "-".join(prefetch) or "none",
                "--runs", "3", "--size-mib", "512"]
    rows = json.loads(run(cmd, hint).stdout)
    row = next(r for r in rows if r["threads"] == threads)
    return row["best_gbs"], row["best_variant"]


# ---- the models -----------------------------------------------------------------------------
def bytes_per_token(path: str, model_size: int) -> int:
    """Weight bytes one decode step reads: all of them, except that a token-embedding table not
    tied to the output is read one row per token. Needs the gguf package; else all weights."""
    try:
        import gguf  # optional: only refines the roofline
    except ImportError:
        return model_size
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


# ---- speed ----------------------------------------------------------------------------------
def bench_args(n_prompt: int, n_gen: int, threads: int, reps: int) -> list[str]:
    return ["-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", str(reps), "-o", "json"]


def llama_bench(binary: str, model: str, n_prompt: int, n_gen: int, threads: int, reps: int) -> dict:
    return json.loads(run([binary, "-m", model] + bench_args(n_prompt, n_gen, threads, reps)).stdout)[0]


def ringlm_bench(binary: str, model: str, n_prompt: int, n_gen: int, threads: int, reps: int) -> dict:
    return json.loads(run([binary, "bench", "-m", model] + bench_args(n_prompt, n_gen, threads, reps)).stdout)[0]


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_test(args, model: str, n_prompt: int, n_gen: int, probe=None):
    """Both tools on one test, alternating for --rounds rounds; returns llama.cpp's last JSON
    row (for model_size), the pooled t/s samples of each, and per tool the read bandwidth that
    `probe()` (when given) measured right before each of its runs."""
    tools = [("llama", llama_bench, args.llama_bench), ("ringlm", ringlm_bench, args.ringlm)]
    samples = {"llama": [], "ringlm": []}
    probes = {"llama": [], "ringlm": []}
    row = {}
    for k in range(args.rounds):
        for name, fn, binary in (tools if k % 2 == 0 else tools[::-1]):
            if probe:
                probes[name].append(probe())
            r = fn(binary, model, n_prompt, n_gen, args.t, args.r)
            samples[name] += r["samples_ts"]
            if name == "llama":
                row = r
    return row, samples["llama"], samples["ringlm"], probes


def speed_table(args, bw: float | None, variant: str | None) -> None:
    # The memory of these VMs changes speed from one minute to the next (two vCPUs on one CCD or
    # on two: 50 or 85 GB/s), so with a measured probe each tool's runs are set against the
    # bandwidth measured just before them.
    probe = (lambda: measure_bandwidth(args.bandwidth, args.t, variant)[0]) if variant else None
    print("| model | weights MiB | test | llama.cpp t/s | ringlm t/s | ringlm / llama.cpp "
          "| roofline t/s | llama.cpp % roofline | ringlm % roofline |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    tests = ([(args.p, 0)] if args.p > 0 else []) + ([(0, args.n)] if args.n > 0 else [])
    notes = []
    for model in args.models:
        for n_prompt, n_gen in tests:
            row, lc, rl, probes = run_test(args, model, n_prompt, n_gen, probe if n_gen else None)
            (lc_mean, lc_sd), (rl_mean, rl_sd) = mean_sd(lc), mean_sd(rl)
            size = row["model_size"]
            roof = " | | "  # pp: the roofline is decode's
            if n_gen and bw:
                per_token = bytes_per_token(model, size)
                bw_lc = statistics.median(probes["llama"]) if probes["llama"] else bw
                bw_rl = statistics.median(probes["ringlm"]) if probes["ringlm"] else bw
                best = bw_rl * 1e9 / per_token  # tokens/s if a step did nothing but stream its weights
                roof = (f"{best:.1f} ({bw_rl:.1f} GB/s) | {100 * lc_mean * per_token / (bw_lc * 1e9):.0f}% "
                        f"| {100 * rl_mean / best:.0f}%")
                if per_token != size:
                    notes.append(f"{os.path.basename(model)}: {per_token / 2**20:.1f} MiB read per token "
                                 "(the untied token-embedding table is read one row per token)")
            test = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
            print(f"| {os.path.basename(model)} | {size / 2**20:.1f} | {test} | {lc_mean:.2f} ± {lc_sd:.2f} "
                  f"| {rl_mean:.2f} ± {rl_sd:.2f} | {rl_mean / lc_mean:.2f}x | {roof} |", flush=True)
    for note in notes:
        print(note)


# ---- perplexity -----------------------------------------------------------------------------
def final_ppl(text: str, tool: str) -> tuple[float, str, str]:
    """PPL, its ± (as printed) and the chunk count from a tool's 'Final estimate' output."""
    m = FINAL_PPL.search(text)
    if m is None:
        raise SystemExit(f"{tool}: no 'Final estimate: PPL' line in its output")
    chunks = PPL_CHUNKS.search(text)
    return float(m.group(1)), m.group(2) or "?", chunks.group(1) if chunks else "?"


def perplexity(args, model: str) -> None:
    common = ["-m", model, "-f", args.perplexity, "-c", str(args.c), "-t", str(args.t)]
    chunks = ["--chunks", str(args.ppl_chunks)] if args.ppl_chunks >= 0 else []
    results = {}
    for name, cmd in (("llama.cpp", [args.llama_perplexity] + common + chunks),
                      ("ringlm", [args.ringlm, "perplexity"] + common + chunks)):
        t0 = time.monotonic()
        p = run(cmd)  # llama-perplexity logs its final line on stderr, ringlm prints it on stdout
        results[name] = final_ppl(p.stdout + p.stderr, name) + (time.monotonic() - t0,)
    print(f"\nperplexity of {os.path.basename(args.perplexity)}, {os.path.basename(model)}, -c {args.c}, "
          f"-t {args.t}:")
    for name, (ppl, err, n, secs) in results.items():
        print(f"  {name:<10} PPL = {ppl:.4f} +/- {err}  ({n} chunks, {secs:.1f} s)")
    print(f"  ringlm / llama.cpp = {results['ringlm'][0] / results['llama.cpp'][0]:.4f}")


# ---- memory ---------------------------------------------------------------------------------
def peak_rss_mib(cmd: list[str]) -> float:
    """Peak resident memory of one run of cmd, in MiB.

    Not ru_maxrss from wait4 on our own child: the child starts in this process's memory (a
    fork's copy or vfork's share) and Linux carries that high-water RSS across exec into the
    child's ru_maxrss (this script's 650 MiB, after reading the GGUFs, showed up as both tools'
    peak). /usr/bin/time forks from its own small process; without it, the child's VmHWM (which
    starts afresh at exec) is polled instead."""
    if os.access("/usr/bin/time", os.X_OK):
        with tempfile.NamedTemporaryFile(mode="r") as f:
            run(["/usr/bin/time", "-f", "%M", "-o", f.name] + cmd)
            return int(f.read().split()[-1]) / 1024  # KiB
    return polled_hwm_mib(cmd)


def polled_hwm_mib(cmd: list[str]) -> float:
    """VmHWM of the child from /proc, read every 10 ms until it exits (a peak reached in its
    last 10 ms can be missed)."""
    hwm_kib = 0
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as p:
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status", encoding="utf-8") as f:
                    hwm_kib = max([hwm_kib] + [int(l.split()[1]) for l in f if l.startswith("VmHWM:")])
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    return hwm_kib / 1024


def rss_table(args) -> None:
    flags = bench_args(args.p, args.n, args.t, 1)
    print(f"\npeak RSS, one run each of -p {args.p} -n {args.n} -t {args.t} -r 1:")
    print("| model | llama-bench MiB | ringlm bench MiB | ringlm / llama.cpp |")
    print("|---|---:|---:|---:|")
    for model in args.models:
        lc = peak_rss_mib([args.llama_bench, "-m", model] + flags)
        rl = peak_rss_mib([args.ringlm, "bench", "-m", model] + flags)
        print(f"| {os.path.basename(model)} | {lc:.1f} | {rl:.1f} | {rl / lc:.2f}x |", flush=True)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("models", nargs="*", help="GGUF files (default: the default model)")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens of the pp test (0: none)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens of the tg test (0: none)")
    ap.add_argument("-t", type=int, default=2, help="threads, for every tool")
    ap.add_argument("-r", type=int, default=3, help="repetitions per tool run")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the two tools per test")
    ap.add_argument("--ringlm", default=DEFAULT_RINGLM)
    ap.add_argument("--llama-bench", default=os.path.join(LLAMA_BIN, "llama-bench"))
    ap.add_argument("--llama-perplexity", default=os.path.join(LLAMA_BIN, "llama-perplexity"))
    ap.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH, help="bench_bandwidth binary")
    ap.add_argument("--bandwidth-gbs", type=float, help="read bandwidth to use instead of measuring it")
    ap.add_argument("--perplexity", metavar="TEXT", help="also compare perplexity on this text file")
    ap.add_argument("-c", type=int, default=512, help="perplexity context (chunk) length")
    ap.add_argument("--ppl-chunks", type=int, default=-1, help="score at most N chunks (-1: all)")
    ap.add_argument("--rss", action="store_true", help="also compare peak resident memory")
    args = ap.parse_args(argv)
    args.models = args.models or [default_model()]
    args.rounds = max(1, args.rounds)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    need_binary(args.ringlm, "ringlm")
    need_binary(args.llama_bench, "llama-bench")
    if args.perplexity:
        need_binary(args.llama_perplexity, "llama-perplexity")
    for model in args.models:
        if not os.path.isfile(model):
            raise SystemExit(f"no such model file: {model}")

    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs; {cpu_isa()})")
    print(f"ringlm devices: {ringlm_cpu_line(args.ringlm)}")
    print(f"threads {args.t}, repetitions {args.r}, rounds {args.rounds}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    bw, variant = None, None
    if args.n > 0:
        if args.bandwidth_gbs:
            bw = args.bandwidth_gbs
            print(f"read bandwidth {bw:.2f} GB/s (--bandwidth-gbs)")
        else:
            bw, variant = measure_bandwidth(args.bandwidth, args.t)
            print(f"read bandwidth {bw:.2f} GB/s (bench_bandwidth --json, best of {args.t} threads: {variant}); "
                  "each tg run is set against that variant measured just before it")
    print(flush=True)
    if args.p > 0 or args.n > 0:
        speed_table(args, bw, None if args.bandwidth_gbs else variant)
    if args.perplexity:
        for model in args.models:
            perplexity(args, model)
    if args.rss:
        rss_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

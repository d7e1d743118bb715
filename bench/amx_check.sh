#!/usr/bin/env bash
# Issue 32's measurements on a CPU with Intel AMX, in one run (a few minutes at 2 threads):
# whether the tiles run here, the real-tile tests, the tile unit's peak, the 1B shape's products
# per shape and its pp512 with and without the tiles, the same for SmolLM2's shape in Q4_1 and
# `batch --parallel 16`, llama.cpp's llama-bench beside them, and whether the tiles change the
# greedy text or any digit of a perplexity (the int8 path; ringlm_logits runs fp32).
#
#   bash bench/amx_check.sh [BIN_DIR] [LLAMA_CPP_BIN_DIR]     (defaults: build/bin, none)
#
# BIN_DIR holds ringlm, test_amx, bench_matmul and bench_amx_peak (a Release
# build). Models are made here (bench/make_synthetic_models.py, `ringlm quantize`) in $WORK
# (default /tmp/amx-check); text for perplexity from ../shared/data (or $TEXT).
set -u
cd "$(dirname "$0")/.."
B=${1:-build/bin}
LLAMA=${2:-}
W=${WORK:-/tmp/amx-check}
TEXT=${TEXT:-../shared/data/text/kjv-pentateuch.txt}
VOCAB=${VOCAB:-../shared/data/vocab}
T=${THREADS:-2}
mkdir -p "$W"
echo "== cpu"; lscpu | grep -E 'Model name|^CPU\(s\)|MHz'; grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
"$B/ringlm" devices 2>&1 | grep -E '^(cpu|amx)'
grep -qw amx_int8 /proc/cpuinfo || { echo "no AMX on this CPU: nothing to measure"; exit 0; }
echo "== the tile unit's peak"; "$B/bench_amx_peak" "$T"
echo "== test_amx (the real tiles against the emulation and the AVX-512 kernels)"; "$B/test_amx" 2>&1 | tail -n 3
echo "== products of the 1B shape, $T threads, without and with the tiles"
for a in off on; do
  RINGLM_AMX=$a RINGLM_BENCH_THREADS=$T "$B/bench_matmul" --benchmark_filter='1B/' --benchmark_min_time=0.1 2>&1 |
    awk -v a="$a" '/^BM_/ {print a, $1, $2, $3, $NF}'
done
[ -f "$W/1b.gguf" ] || python3 bench/make_synthetic_models.py --shape llama-3.2-1b --out "$W/1b.gguf" --vocab-dir "$VOCAB" | tail -n 1
[ -f "$W/smol.gguf" ] || python3 bench/make_synthetic_models.py --shape smollm2-135m --out "$W/smol.gguf" --vocab-dir "$VOCAB" | tail -n 1
[ -f "$W/1b-q4km.gguf" ] || "$B/ringlm" quantize --type Q4_K_M "$W/1b.gguf" "$W/1b-q4km.gguf" >/dev/null
[ -f "$W/smol-q41.gguf" ] || "$B/ringlm" quantize --type Q4_1 "$W/smol.gguf" "$W/smol-q41.gguf" >/dev/null
echo "== ringlm bench, $T threads (RINGLM_AMX=off, then on)"
for m in 1b 1b-q4km smol-q41; do
  for a in off on; do echo "$m AMX=$a: $(RINGLM_AMX=$a "$B/ringlm" bench -m "$W/$m.gguf" -t "$T" -p 512 -n 64 -r 3 2>&1 | grep -E 'pp512|tg64' | tr -s ' ' | tr '\n' ' ')"; done
done
if [ -n "$LLAMA" ]; then
  echo "== llama-bench, $T threads"
  for m in 1b 1b-q4km smol-q41; do "$LLAMA/llama-bench" -m "$W/$m.gguf" -t "$T" -p 512 -n 64 -r 2 2>&1 | grep -E 'pp512|tg64'; done
fi
echo "== batch --parallel 16 (off, on)"
for a in off on; do echo "AMX=$a"; RINGLM_AMX=$a python3 bench/batch_throughput.py --binary "$B/ringlm" -m "$W/smol-q41.gguf" --parallel 16 -n 64 --prompts 32 -t "$T" -r 1 2>&1 | tail -n 3; done
echo "== the same bits: greedy text after a 300-token prompt, and perplexity, without and with the tiles"
PROMPT=$(python3 -c "print('The quick brown fox jumps over the lazy dog by the river bank. ' * 24)")
for m in 1b 1b-q4km smol-q41; do
  RINGLM_AMX=off "$B/ringlm" run -m "$W/$m.gguf" -p "$PROMPT" -n 32 --temp 0 -t "$T" > "$W/off.txt" 2>/dev/null
  RINGLM_AMX=on "$B/ringlm" run -m "$W/$m.gguf" -p "$PROMPT" -n 32 --temp 0 -t "$T" > "$W/on.txt" 2>/dev/null
  cmp -s "$W/off.txt" "$W/on.txt" && echo "$m: greedy text identical" || echo "$m: greedy text DIFFERS"
  for a in off on; do echo "$m AMX=$a $(RINGLM_AMX=$a "$B/ringlm" perplexity -m "$W/$m.gguf" -f "$TEXT" -c 512 --chunks 3 -t "$T" 2>&1 | grep 'Final estimate')"; done
done

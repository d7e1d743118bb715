#!/usr/bin/env bash
# Pipeline parallelism against one process on this machine: batch's aggregate tokens/s with
# --parallel 16 (one process with 2 threads, then mpirun -np 2 with 1 thread each; the results
# must be the same texts), and one sequence's decode tokens/s (1 process -t 2 and -t 1, then
# -np 2 -t 1). Run it alone on the machine: the figures are bench/README.md's.
#   bench/pipeline_bench.sh MODEL.gguf [RINGLM] [REPEATS]
set -euo pipefail
model=${1:?usage: pipeline_bench.sh MODEL.gguf [RINGLM] [REPEATS]}
ringlm=${2:-build/bin/ringlm}
repeats=${3:-2}
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && mpirun+=(--allow-run-as-root)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for i in $(seq 0 15); do
  printf '{"id": "%d", "prompt": "Story number %d: once upon a time", "max_tokens": 16}\n' "$i" "$i"
done >"$work/in.jsonl"
batch=(batch -m "$model" --parallel 16 --temp 0 -i "$work/in.jsonl")
texts() { python3 -c 'import json,sys; print(sorted((j["id"], j["text"]) for j in map(json.loads, open(sys.argv[1]))))' "$1"; }
summary() { tr '\r' '\n' | grep -o '[0-9.]* tokens/s ([^)]*)' || true; }
run=(run -m "$model" --temp 0 --ignore-eos -n 32 -p 'Once upon a time' --stats json)
gen_tps() { grep -o '"gen_tps":[0-9.]*' | cut -d: -f2; }

for r in $(seq 1 "$repeats"); do
  rm -f "$work"/*.out
  echo "batch, 1 process -t 2:        $("$ringlm" "${batch[@]}" -t 2 -o "$work/alone.out" 2>&1 | summary)"
  echo "batch, mpirun -np 2, -t 1:    $("${mpirun[@]}" -np 2 "$ringlm" "${batch[@]}" -t 1 -o "$work/split.out" 2>&1 | summary)"
  if [ "$(texts "$work/alone.out")" = "$(texts "$work/split.out")" ]; then echo "batch results: the same"; else echo "batch results: DIFFER"; fi
  echo "decode t/s, 1 process -t 2:   $("$ringlm" "${run[@]}" -t 2 2>&1 >/dev/null | gen_tps)"
  echo "decode t/s, 1 process -t 1:   $("$ringlm" "${run[@]}" -t 1 2>&1 >/dev/null | gen_tps)"
  echo "decode t/s, mpirun -np 2 -t 1: $("${mpirun[@]}" -np 2 "$ringlm" "${run[@]}" -t 1 2>&1 >/dev/null | gen_tps)"
done

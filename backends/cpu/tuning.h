// Per-machine kernel selection: for each quantized weight shape, the number of tokens M from
// which the CPU backend's dequantize + sgemm path beats its int8 kernels, and (on a CPU with
// AMX) the number from which the int8 products on the tiles beat the AVX-512 kernels.
//
// Which path wins depends on the shape (a 576-wide matrix keeps its tiles in L2, a 49152-row
// vocabulary projection does not), the format, the instruction set and the thread count, so one
// constant cannot be right everywhere: `ringlm tune` measures both paths on the model's own
// shapes and writes the crossovers here, as a small JSON file the backend reads at construction.
//
// File format (version 1):
//   {"ringlm_tuning": 1,
//    "machine": {"cpu": "AMD EPYC", "target": "AVX2", "threads": 2, "date": "...", "ringlm": "0.1.0"},
//    "entries": [{"type_id": 3, "type": "Q4_1", "n": 576, "k": 576, "crossover": 64, "tiles_from": 96}, ...],
//    "checking_passes": [{"model": "x.gguf", "bytes": 123, "threads": 2, "cost": [1.1, 1.2, ...]}]}
// ("checking_passes" is optional: see PassCostEntry.)
// `type_id` is the GGML / ringlm type id (`type` is its name, for people; not read back). A
// `crossover` of null means the int8 kernels won at every measured M. Entries may carry the
// measured times too ("m", "int8_ms", "sgemm_ms", "tiles_ms"); they are kept for reading, not
// loaded. `tiles_from` (optional): the smallest M taking the AMX tiles (null: never); absent where
// tune did not measure the tiles (a CPU without AMX).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "quant/formats.h"

namespace ringlm {

// The machine a table was measured on. Only `threads` could matter to the backend; the rest
// says whether a table found in a shared cache belongs to this machine.
struct TuningMachine {
  std::string cpu;     // /proc/cpuinfo "model name"
  std::string target;  // the best Highway target this CPU runs (the int8 kernels' dispatch)
  int threads = 0;
  std::string date;     // UTC, ISO 8601
  std::string version;  // ringlm version that measured it
};

// One measured weight shape: rows N, columns K, in a weight type.
struct KernelEntry {
  TensorType type = TensorType::Q4_0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t crossover = 0;  // smallest M taking sgemm; KernelTable::kNever if int8 always wins
  // Smallest M taking the AMX tiles (KernelTable::kNever: the AVX-512 kernels always win), or
  // kTilesNotMeasured.
  int64_t tiles_from = 0;
  static constexpr int64_t kTilesNotMeasured = 0;
  // What tune measured (optional; saved for people reading the file, never loaded).
  std::vector<int64_t> m;
  std::vector<double> int8_ms, sgemm_ms, tiles_ms;
};

// A speculative draft's checking passes on one model, as `ringlm tune` measured them: cost[k - 1]
// is what a pass of the evaluated token and k drafted ones takes against a decode step
// (core/speculative/draft_length.h's PassCost).
struct PassCostEntry {
  std::string model;  // the GGUF file's name, without its directory
  int64_t bytes = 0;  // and its size: a file of the same name and another size is another model
  int threads = 0;
  std::vector<double> cost;
};

class KernelTable {
 public:
  // "int8 always wins": a crossover no call reaches.
  static constexpr int64_t kNever = int64_t{1} << 40;
  // The crossover for shapes a table does not cover. With the packed int8 kernels, `ringlm tune
  // -t 2` on the AVX2 Zen 3 CI machine found int8 about twice as fast as sgemm at every M up to
  // 512 for all five SmolLM2 shapes, so by default the int8 kernels take every call; a machine
  // with a faster sgemm (AMX, AVX-512) gets its own crossovers from ringlm tune.
  static constexpr int64_t kDefaultCrossover = kNever;

  // Where a weight's products start to run on the AMX tiles (amx.h) when no entry of its type
  // measured it: prompt chunks from 128 tokens. Below that, the work the cores do around the
  // tiles (widening the codes, scaling every 16 x 16 x 32 result into the float sums) alone takes
  // longer than the AVX-512 VNNI kernels' whole product: bench_tile_overhead on a Xeon (AVX3_DL)
  // ran it at 56-96 GMAC/s a core at 16 tokens against VNNI's 86-152 (bench/README.md, "Intel
  // AMX: the work around the tiles").
  static constexpr int64_t kDefaultTilesFrom = 128;

  TuningMachine machine;
  // The tiles' start for shapes without a measured entry (tune's contenders set it to kNever or 1).
  int64_t default_tiles_from = kDefaultTilesFrom;

  // Adds the entry, or replaces the one with the same (type, n, k).
  void set(KernelEntry entry);
  const std::vector<KernelEntry>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }

  // The crossover for a weight: its own entry if measured, else the entry of the same type
  // nearest in K and then in N (crossovers move with K more than with N: K is the length of
  // every dot product and the size of every dequantized row), else kDefaultCrossover.
  int64_t crossover(TensorType type, int64_t n, int64_t k) const;
  // The same for the tiles' start: the nearest entry of the type that measured it, else
  // default_tiles_from.
  int64_t tiles_from(TensorType type, int64_t n, int64_t k) const;

  // Measured checking passes, per model (ringlm tune); the entry for a model file (its name
  // and size) run with `threads` threads, or null.
  std::vector<PassCostEntry> passes;
  const PassCostEntry* pass_cost(const std::string& model_path, int threads) const;

  std::string to_json() const;
  // Parses a table; throws std::runtime_error saying what is wrong (with the JSON path).
  static KernelTable from_json(const std::string& text);

 private:
  // The entry of the type nearest in K and then in N (with_tiles: among those that measured the
  // tiles), or null.
  const KernelEntry* nearest(TensorType type, int64_t n, int64_t k, bool with_tiles) const;

  std::vector<KernelEntry> entries_;
};

// Reads a table. A missing file gives an empty table, silently when `missing_ok`; a file that
// cannot be read or parsed gives an empty table (the defaults) and one warning line on stderr
// naming the file and the problem (none when not `warn`). Never throws.
KernelTable load_kernel_table(const std::string& path, bool missing_ok = false, bool warn = true);
// Writes the table (parent directories created, replaced atomically). Throws std::runtime_error.
void save_kernel_table(const KernelTable& table, const std::string& path);

// ${RINGLM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ringlm}/tuning.json
std::string default_kernel_table_path();
// The table the backend uses by default: $RINGLM_TUNING names a file ("off": none), else the
// default path (absent is fine: the built-in crossover). Empty when off, absent or malformed.
KernelTable load_configured_kernel_table(bool warn = true);

// /proc/cpuinfo's first "model name" ("unknown CPU" where it has none): a table's machine, and
// `ringlm bench`'s cpu_info.
std::string cpu_model_name();
// Now in UTC, ISO 8601 to the second ("2025-01-31T12:00:00Z").
std::string utc_now();
// This machine, as a table header: CPU name, Highway target, `threads`, now, ringlm version.
TuningMachine this_machine(int threads);

// RINGLM_SIMD_TARGET=NAME (a Highway target name: AVX3_DL, AVX3, AVX2, SSE4, SSSE3, ...) makes
// every kernel run that target's code (a kernel compiled without it: its best code below it),
// for measuring one target's kernels on a CPU that has a better one. Unset or empty: the best target the CPU runs. Throws std::runtime_error naming
// the targets this CPU runs when NAME is not one of them.
void apply_simd_target_override();

// One measured M of one shape (tiles_ms: negative where the tiles were not measured).
struct TuningPoint {
  int64_t m = 0;
  double int8_ms = 0, sgemm_ms = 0, tiles_ms = -1;
};
// The crossover from measurements in increasing M: the smallest M from which sgemm is faster at
// every larger measured M too, so that one noisy small-M sample cannot send decode-sized calls
// to sgemm. kNever when int8 wins at the largest M (or there are no points).
int64_t crossover_from_timings(std::span<const TuningPoint> points);
// The same for the tiles against the int8 kernels: the smallest M from which the tiles are
// faster at every larger measured M too; kNever when they lose at the largest.
int64_t tiles_from_timings(std::span<const TuningPoint> points);

}  // namespace ringlm

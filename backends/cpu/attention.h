// Causal multi-head attention with grouped KV heads over a cache of keys and values, tiled so
// that the full score matrix never exists: per KV head, a tile of query rows (every query head
// of the group, for a block of tokens) meets the keys a block at a time, with the online
// (rescaling) softmax of FlashAttention, in Highway kernels: a prefill tile holds its query rows
// in vector lanes (each key element a broadcast against whole vectors of rows, the softmax down
// the lanes); a few rows (decode) are met a row at a time. Decode (one token) also splits the
// keys across threads and merges the partial results (flash-decoding), so two threads share even
// a single KV head.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "backends/backend.h"

namespace ringlm::cpu {

using ringlm::AttentionShape;  // the backend interface's (backends/backend.h)

// The keys and values of one layer, in the slots of a ring cache: slot j's KV head g starts at
// element j * row_stride + g * head_dim of keys (values), fp32, fp16 or q8_0 (kv_bytes_of gives
// an element's byte offset: q8_0's blocks of 32 never straddle two heads). positions[j] is the
// position of slot j's token, -1 for an empty slot. Slots may be in any order: a query at
// position p sees exactly the slots with 0 <= position <= p.
//
// `prefix` (optional) is a second run of slots read before these ones: a prompt segment that
// several sequences share (the segment KV cache of batch sampling), with its own memory. The
// queries see both runs by the same rule; its type must match.
struct KvLayer {
  const void* keys = nullptr;
  const void* values = nullptr;
  int64_t row_stride = 0;  // elements
  KvType key_type = KvType::kF32;
  KvType value_type = KvType::kF32;
  const int64_t* positions = nullptr;
  int n_slots = 0;
  const KvLayer* prefix = nullptr;
  // A KIVI cache (key_type and value_type kKivi2): keys holds the slots' key codes, values their
  // value rows; the groups, this layer's key parameters ([n_groups][2][row_stride] fp16: scales, mins) and its
  // staging buffers (KvView::kivi_staged's layout) say how to read them.
  const KvKiviGroups* kivi = nullptr;
  const uint16_t* kivi_params = nullptr;
  const uint16_t* kivi_staging = nullptr;
  // Whole groups a prompt wrote, which this pass reads in fp32 before they are quantized
  // (LayerOps::store_kv defers them past the layer's attention, as KIVI's prefill attends in
  // full precision): slots [first_slot, first_slot + n), keys and turned values row_stride apart.
  struct KiviPending {
    int first_slot = 0, n = 0;
    const float* k = nullptr;
    const float* v = nullptr;
  };
  std::span<const KiviPending> kivi_pending = {};
};

// How attention_batch cuts one job into units of work: tiles of tokens per KV head and, for
// decode, splits of the keys.
struct AttentionPlan {
  int token_tiles = 1;
  int splits = 1;
  int n_keys = 0;
  bool async = false;        // the asynchronized softmax, every head's phi being known
  bool whole_heads = false;  // decode: a unit is a split of the keys with every KV head
  int first_unit = 0;        // in the batch's numbering
  size_t first_partial = 0;  // split jobs: index of its first unit among all split units
};

// Buffers reused across calls (grown, never shrunk: no allocation once warm).
class AttentionScratch {
 public:
  float* thread_buffer(int thread, size_t floats);
  float* partials(size_t floats);
  float* steps(size_t floats);  // attention_steps' keys, values, scores and maxima

  // attention_batch's lists: each job's plan, the job of every unit, the (job, KV head) pairs
  // whose split parts are merged.
  std::vector<AttentionPlan> plans;
  std::vector<int> job_of_unit;
  std::vector<std::pair<int, int>> merges;
  // attention_steps': the keys' positions in the unit numbering, and which rows run the
  // asynchronized softmax.
  std::vector<int64_t> step_positions;
  std::vector<char> step_async;

 private:
  std::vector<std::vector<float>> per_thread_;
  std::vector<float> partials_;
  std::vector<float> steps_;
};

// out[i][h] = softmax(q[i][h] · K_visibleᵀ / sqrt(d)) · V_visible for the n_tokens queries of
// the chunk, query i at position q_pos0 + i seeing the slots at positions 0 .. q_pos0 + i.
// q and out are [n_tokens][n_head * head_dim].
//
// softmax_phi (optional, [n_head], decode only) selects FlashDecoding++'s asynchronized softmax:
// on entry the unified max of each query head's scores (NaN: not known yet, e.g. from the
// previous decode step of the same layer), used by every block and split part instead of a
// running max, so nothing is rescaled and the parts merge by plain sums; a part whose scores
// leave the safe range around it is redone exactly. On exit it holds this step's maxima.
void attention_causal(const AttentionShape& shape, const float* q, const KvLayer& kv, int64_t q_pos0, int n_tokens,
                      float* out, AttentionScratch& scratch, int n_threads, float* softmax_phi = nullptr);

// Whether decode (the row path, and a checking pass's scores) meets q8_0 and q4_0 keys with the
// query rows quantized to q8_0: each block of 32 of q[i][h] / sqrt(d) rounded as GGML rounds a
// row (quantize_row), the products summed in int8, as llama.cpp's flash attention does. On
// AVX-512 VNNI (vpdpbusd) and AVX2 (vpmaddubsw), for heads of a multiple of 64; elsewhere
// (AVX-512 without VNNI, SSE4) the keys are widened to float. Prefill tiles always widen them.
bool scores_block_keys_in_int8(int head_dim);


// One sequence's attention in a batch: the arguments of attention_causal.
struct AttentionJob {
  const float* q = nullptr;
  KvLayer kv;
  int64_t q_pos0 = 0;
  int n_tokens = 0;
  float* out = nullptr;
  float* softmax_phi = nullptr;
  // attention_steps only (a checking pass): where each row's maxima go, step_phi[i] ([n_head])
  // for row i; nullptr: not wanted.
  float* const* step_phi = nullptr;
};

// attention_causal for several sequences (each with its own cache) in one parallel region: the
// units of work of all of them are shared out together, so a decode batch of many short
// sequences keeps every thread busy and pays one fork and join per layer instead of one per
// sequence. Each job's result is exactly what attention_causal gives it alone.
void attention_batch(const AttentionShape& shape, std::span<const AttentionJob> jobs, AttentionScratch& scratch,
                     int n_threads);

// A speculative draft's checking pass: each of the job's rows attends exactly (bit for bit) as
// the decode step of its token would, one row after another: attention_causal of row i alone
// (one token at position q_pos0 + i, over the same cache), its softmax_phi the maxima row i - 1
// left. softmax_phi ends as the last row leaves it; step_phi[i] gets row i's maxima. In one
// parallel region: the keys and values are converted once for all the rows, and every row's
// scores are taken in one pass, which gives each row's maxima, hence the next row's phi, up
// front; the rows then run at once.
void attention_steps(const AttentionShape& shape, const AttentionJob& job, AttentionScratch& scratch, int n_threads);

}  // namespace ringlm::cpu

// Causal multi-head attention with grouped KV heads over a cache of keys and values, tiled so
// that the full score matrix never exists: per KV head, a tile of query rows (every query head
// of the group, for a block of tokens) meets the keys a block at a time, with the online
// (rescaling) softmax of FlashAttention. Q·Kᵀ and P·V of a tile are OpenBLAS sgemm calls; the
// softmax uses vectorized exp (Highway). Decode (one token) also splits the keys across threads
// and merges the partial results (flash-decoding), so two threads share even a single KV head.
#pragma once

#include <cstdint>
#include <vector>

namespace ringlm::cpu {

struct AttentionShape {
  int n_head = 0;     // query heads
  int n_head_kv = 0;  // key/value heads; query head h reads KV head h / (n_head / n_head_kv)
  int head_dim = 0;
};

// The keys and values of one layer: token j's KV head g starts at keys + j * row_stride + g * head_dim.
struct KvLayer {
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t row_stride = 0;
};

// Buffers reused across calls (grown, never shrunk: no allocation once warm).
class AttentionScratch {
 public:
  float* thread_buffer(int thread, size_t floats);
  float* partials(size_t floats);

 private:
  std::vector<std::vector<float>> per_thread_;
  std::vector<float> partials_;
};

// out[i][h] = softmax(q[i][h] · K[0 .. n_past + i]ᵀ / sqrt(d)) · V[0 .. n_past + i] for the
// n_tokens queries of the chunk, which sit at cache indices n_past .. n_past + n_tokens - 1.
// q and out are [n_tokens][n_head * head_dim].
void attention_causal(const AttentionShape& shape, const float* q, const KvLayer& kv, int n_past, int n_tokens,
                      float* out, AttentionScratch& scratch, int n_threads);

}  // namespace ringlm::cpu

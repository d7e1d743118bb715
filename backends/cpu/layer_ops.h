// The CPU's ops of a layer's attention block (Backend::rope, store_kv, attention, shift_keys)
// and the residual add, over KV caches in host memory: what the CPU backend runs, and what a
// plugin backend runs for the caches and geometries its device does not take.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/attention.h"

namespace ringlm::cpu {

class LayerOps {
 public:
  explicit LayerOps(int n_threads) : n_threads_(n_threads) {}

  void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles);
  void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v);
  void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls);
  void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const RopeAngles& angles,
                  int n_head_kv, int head_dim);
  void scale(float* x, int64_t n, float factor);
  void add(float* x, const float* delta, int64_t n);
  void add_row(float* x, const float* row, int64_t n_rows, int64_t width);
  void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps);

 private:
  int n_threads_;
  AttentionScratch scratch_;
  std::vector<AttentionJob> jobs_;  // attention()'s lists, reused
  std::vector<KvLayer> prefixes_;
  std::vector<float> turned_;                        // store_kv's row turned (per thread: the key's, then the value's)
  std::vector<std::vector<float>> turned_queries_;   // attention()'s queries turned, per call
  std::vector<float> rope_tables_;  // per thread, one row's expanded angles (cos_x, sin_x)
  // KIVI groups a prompt wrote whole, in fp32 until the layer's attention has read them
  // (store_kv, then attention quantizes them: seal_pending_kivi).
  struct PendingKivi {
    KvView view;
    int layer = 0;
    KvLayer::KiviPending rows;
    std::vector<float> k, v;
  };
  std::vector<PendingKivi> pending_kivi_;
  std::vector<KvLayer::KiviPending> pending_of_call_;  // attention()'s, per call: [2 * call, 2 * call + 2)
  void store_kivi(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v);
  void seal_pending_kivi();
};

}  // namespace ringlm::cpu

// The backend seam: every op a layer runs, for the CPU and a plugin's device alike.
//
// Activations (the hidden state, q, k, v, the attention output, the logits; also the model's
// norm weights and biases) live in memory the backend allocates (alloc_activations): host memory
// for the CPU, a device's memory for a device backend, reached through the host address range of
// the allocation. Ops take addresses inside such allocations; the host writes into them only
// through write() and reads what the ops wrote only through read(), so a device backend keeps
// the whole forward pass where its ops run and moves only what the host asks for (token ids and
// RoPE angles in, logits out). Host pointers that are no allocation's still work as inputs and
// outputs of every op (tests, a CPU-only caller): a device backend then runs the op on the CPU.
//
// The model hands every weight matrix to the backend once, at load (prepare), and from then on
// only asks for products with it (matmul). What "prepare" does is the backend's business:
// reference the mmap in place, repack into a kernel layout, or upload to a device. The other
// ops of a layer (RoPE, the KV store, attention, the StreamingLLM shift, the residual; the
// RMSNorm and the activation fused into the products) are calls here too, over KV caches that
// core/kv keeps on the host: where a backend keeps a copy of a cache (a device's memory), it
// keeps it in step itself (KvView::state), and the model never knows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "backends/expert_routing.h"
#include "backends/top_k.h"
#include "quant/formats.h"
#include "quant/kivi.h"

namespace ringlm {

// A weight matrix as stored in the model file: `rows` output features (N), each a contiguous
// row of `cols` input features (K) in `type`'s block layout.
struct WeightView {
  std::string name;
  TensorType type = TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
  // `data` lies in a read-only file mapping: a backend that keeps its own copy may give the
  // mapping's pages back (they are re-read from the file if touched again).
  bool mapped = false;
  // The layer whose ops use the weight, as the model numbers them for plan_layers / begin_layer:
  // 0 .. n_layer - 1 a layer, n_layer the output; -1 (the default) none: a backend that places
  // layers on different devices puts it with the output.
  int layer = -1;
  // One expert's matrix of a mixture of experts (a backend may keep experts apart: --cpu-moe).
  bool expert = false;
};

// A weight after the backend prepared it. Opaque to the model except for its shape.
class PreparedWeight {
 public:
  PreparedWeight(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) {}
  virtual ~PreparedWeight() = default;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

 private:
  int64_t rows_;
  int64_t cols_;
};

// An input to a product: `n_tokens` rows of `cols` fp32 values. With `rms_weight` set, each row
// is RMS-normalised and scaled by it on the way in, x / sqrt(mean(x^2) + rms_eps) * rms_weight,
// so the normalisation is fused with whatever the backend does to its inputs (the CPU backend's
// int8 quantization) and never written out as a separate activation array.
struct MatmulInput {
  const float* x = nullptr;
  int64_t n_tokens = 0;
  const float* rms_weight = nullptr;  // [cols], or nullptr for no normalisation
  float rms_eps = 0.0f;
};

// Row m of `in` as the products see it: RMS-normalised and scaled into `out` ([cols]) when the
// input asks for it (returns out), else the row itself (returns in.x + m * cols, out untouched).
// Every backend normalises through this one function, so they agree on the rounding.
const float* normalized_input_row(const MatmulInput& in, int64_t m, int64_t cols, float* out);

// --- KV caches and the attention block, as the backend sees them ------------------------------

// What a backend keeps of its own for one KV cache (its copy in a device's memory): made by the
// backend when its ops first meet the cache, kept in step with the cache's rows by those ops,
// and dropped with the cache. Opaque outside the backend.
class BackendKvState {
 public:
  virtual ~BackendKvState() = default;
};

// How a KV cache stores its rows' elements (--cache-type): fp16, fp32, llama.cpp's q8_0 and
// q4_0 blocks (an fp16 scale and 32 codes of 8 or 4 bits: 34 or 18 bytes per 32 elements, 53% or
// 28% of fp16's), or KIVI's 2 bits (quant/kivi.h: keys per channel over groups of tokens, values
// per token, the newest tokens in fp16 until their group is sealed; keys and values together).
enum class KvType { kF16, kF32, kQ8_0, kQ4_0, kKivi2 };

// Whether a type stores blocks of 32 elements (a head's size must then be a multiple of 32).
constexpr bool kv_type_has_blocks(KvType type) { return type == KvType::kQ8_0 || type == KvType::kQ4_0; }

// The name --cache-type gives a type ("f16", "f32", "q8_0").
const char* kv_type_name(KvType type);

// The element types of a cache's keys and of its values: llama.cpp's -ctk and -ctv, which may
// differ (keys q8_0 and values q4_0 is a common choice: attention is more sensitive to the keys).
// One type stands for both.
struct KvTypes {
  KvType keys = KvType::kF16;
  KvType values = KvType::kF16;
  constexpr KvTypes() = default;
  constexpr KvTypes(KvType both) : keys(both), values(both) {}  // NOLINT: one type is both
  constexpr KvTypes(KvType k, KvType v) : keys(k), values(v) {}
  constexpr bool operator==(const KvTypes&) const = default;
  constexpr bool same() const { return keys == values; }
};

// "q8_0", or "q8_0/q4_0" (keys/values) when they differ.
std::string kv_types_name(KvTypes types);

// The tensor type whose rows a cache of `type` stores (quantize_row and dequantize_row write and
// read them; KIVI's have none: quant/kivi.h).
constexpr TensorType kv_stored_type(KvType type) {
  switch (type) {
    case KvType::kQ8_0: return TensorType::Q8_0;
    case KvType::kQ4_0: return TensorType::Q4_0;
    case KvType::kF16: return TensorType::F16;
    case KvType::kF32:
    case KvType::kKivi2: break;
  }
  return TensorType::F32;
}

// Whether a cache keeps its heads turned by the Walsh-Hadamard matrix (the CPU backend's
// hadamard_heads) before quantizing them: the block types, for head sizes that are powers of two
// from 64 on (as llama.cpp does). The backend turns the keys and values it stores, the queries
// it scores and the outputs back; the rows in the cache are the turned ones.
// KIVI's keys are not turned: their scales follow the channels, which a turn would mix.
constexpr bool kv_turns_heads(KvType type, int head_dim) {
  return kv_type_has_blocks(type) && head_dim >= 64 && (head_dim & (head_dim - 1)) == 0;
}
constexpr bool kv_turns_values(KvType type, int head_dim) {
  return (kv_type_has_blocks(type) || type == KvType::kKivi2) && head_dim >= 64 && (head_dim & (head_dim - 1)) == 0;
}

// Bytes of `elements` consecutive elements of a key row (blocks: a multiple of 32; KIVI: the
// codes, its channels' scales are the group's).
constexpr size_t kv_bytes_of(KvType type, int64_t elements) {
  const auto n = static_cast<size_t>(elements);
  switch (type) {
    case KvType::kQ8_0: return n / 32 * 34;
    case KvType::kQ4_0: return n / 32 * 18;
    case KvType::kKivi2: return kivi_key_row_bytes(elements);
    case KvType::kF16: return n * 2;
    case KvType::kF32: break;
  }
  return n * 4;
}
// The same for a value row (KIVI's carry their own scales).
constexpr size_t kv_value_bytes_of(KvType type, int64_t elements) {
  return type == KvType::kKivi2 ? kivi_value_row_bytes(elements) : kv_bytes_of(type, elements);
}

// A KIVI ring's groups (KvType::kKivi2): the slots whose keys share their channels' scales, and
// which groups are open, their rows waiting in fp16 in a staging buffer (the newest tokens, and
// a group being written) rather than sealed in 2 bits. The full ring's first slots, [0, sinks),
// are groups of their own that are never sealed: the attention sinks (the --keep tokens, or the
// first token), whose keys lie far outside every other token's range and would spoil a group's
// scales, and which every query attends to. Each layer of the ring has, after its slots' key
// codes and value rows, its groups' key parameters ([n_groups][2][row_width] fp16: scales, mins) and its
// staging buffers (each kKiviGroup fp16 key rows, then as many value rows).
struct KvKiviGroups {
  int sinks = 0;  // slots of the sink groups (pinned: never sealed)
  int slots = 0;
  int n_groups = 0;
  const int16_t* staged = nullptr;  // [n_groups]: the staging buffer of an open group, -1: sealed
  size_t params_at = 0;             // from a layer's start
  size_t staging_at = 0;
  size_t layer_bytes = 0;

  int sink_groups() const { return (sinks + kKiviGroup - 1) / kKiviGroup; }
  bool pinned(int g) const { return g < sink_groups(); }
  int group_of(int slot) const {
    return slot < sinks ? slot / kKiviGroup : sink_groups() + (slot - sinks) / kKiviGroup;
  }
  int first_slot(int g) const { return g < sink_groups() ? g * kKiviGroup : sinks + (g - sink_groups()) * kKiviGroup; }
  int group_size(int g) const {
    return std::min(kKiviGroup, (g < sink_groups() ? sinks : slots) - first_slot(g));
  }
  static int groups_for(int slots, int sinks) {
    return (sinks + kKiviGroup - 1) / kKiviGroup + (slots - sinks + kKiviGroup - 1) / kKiviGroup;
  }
};

// One sequence's KV cache (core/kv's KvCache) as the backend's ops see it: its rows in host
// memory (slot s of layer l at key(l, s) and value(l, s): row_width values of `type`), the
// position of every slot that ever held a token (-1: empty), the shared segment read before it
// (the prompt that batch samples share; read-only, no state), and the cache's place for the
// backend's own state.
struct KvView {
  uint8_t* rows = nullptr;  // [n_layer][keys [capacity], values [capacity]], each slot row_width elements
  int n_layer = 0;
  int capacity = 0;
  int row_width = 0;
  int head_dim = 0;  // (row_width is the KV heads' of this size)
  KvType key_type = KvType::kF32;
  KvType value_type = KvType::kF32;
  KvTypes cache_types;  // what the cache was asked for (--cache-type): a ring may hold others (kivi2's window ring)
  std::span<const int64_t> positions;
  uint64_t cache_id = 0;  // the viewed cache's KvCache::id(): what names a prefix (its rows' address may be reused)
  const KvView* prefix = nullptr;
  std::unique_ptr<BackendKvState>* state = nullptr;
  // A read-only view (a prefix) has no state of its own to keep, but the cache it reads may have
  // one (a device copy holding rows newer than these): the backend brings `rows` up to date
  // from it before the host reads them.
  std::unique_ptr<BackendKvState>* source_state = nullptr;
  const KvKiviGroups* kivi = nullptr;  // a KIVI cache's groups (both sides kKivi2)
  // Key channel scales, [n_layer][row_width] (core/model/key_scales.h), or none. Where the keys
  // are turned (kv_turns_heads), the backend keeps layer l's keys divided by row l, channel by
  // channel, and scores queries multiplied by it (query head h by its key head's channels): the
  // same scores, a smaller quantization error. They are the model's, set before any row of such
  // a cache is stored and never changed after; a prefix's rows were stored with the same.
  const float* key_scales = nullptr;

  KvTypes types() const { return {key_type, value_type}; }
  size_t key_row_bytes() const { return kv_bytes_of(key_type, row_width); }
  size_t value_row_bytes() const { return kv_value_bytes_of(value_type, row_width); }
  // A KIVI group's key parameters (its channels' scales, then their mins: row_width apart), and
  // row i of staging buffer b (keys, or values).
  uint16_t* kivi_params(int layer, int group) const {
    return reinterpret_cast<uint16_t*>(rows + layer_start(layer) + kivi->params_at) +
           static_cast<size_t>(group) * row_width * 2;
  }
  uint16_t* kivi_staged(int layer, int buffer, int i, bool value) const {
    const size_t rows_per_buffer = 2 * static_cast<size_t>(kKiviGroup);
    return reinterpret_cast<uint16_t*>(rows + layer_start(layer) + kivi->staging_at) +
           (rows_per_buffer * buffer + (value ? kKiviGroup : 0) + i) * static_cast<size_t>(row_width);
  }
  uint8_t* key(int layer, int slot) const { return rows + layer_start(layer) + static_cast<size_t>(slot) * key_row_bytes(); }
  uint8_t* value(int layer, int slot) const {
    return rows + layer_start(layer) + static_cast<size_t>(capacity) * key_row_bytes() +
           static_cast<size_t>(slot) * value_row_bytes();
  }

 private:
  size_t layer_start(int layer) const {
    if (kivi != nullptr) return static_cast<size_t>(layer) * kivi->layer_bytes;
    return static_cast<size_t>(layer) * static_cast<size_t>(capacity) * (key_row_bytes() + value_row_bytes());
  }
};

// RoPE angles of a few rows: the cosine and sine of each rotary pair's angle, [rows][n_rot / 2],
// and how a head's elements pair up: 2i with 2i + 1 (GGML's "normal" RoPE, which Llama GGUFs
// are converted for) or i with i + n_rot / 2 (NeoX).
struct RopeAngles {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int n_rot = 0;
  bool adjacent_pairs = true;
};

// The activation of a gated feed-forward block, act(g, u): silu(g) * u with silu(x) = x / (1 +
// exp(-x)) (SwiGLU: Llama, Qwen); gelu(g) * u, GELU in its tanh form, x / 2 * (1 + tanh(sqrt(2 /
// pi) * (x + 0.044715 x^3))) (GeGLU: Gemma); or gpt-oss's clamped SwiGLU, a * sigmoid(1.702 a) *
// (b + 1) with a = min(g, 7) and b = clamp(u, -7, 7) (ggml's swiglu_oai as llama.cpp calls it).
enum class Activation { kSilu, kGeluTanh, kSwigluOai };

struct AttentionShape {
  int n_head = 0;     // query heads
  int n_head_kv = 0;  // key/value heads; query head h reads KV head h / (n_head / n_head_kv)
  int head_dim = 0;
  // Sliding-window attention: a query at position p sees only the keys at positions
  // p - window + 1 .. p (0: every earlier key).
  int window = 0;
  // Scores are q·k times this (0: the usual 1/sqrt(head_dim); Gemma 3 27B has its own).
  float scale = 0.0f;
  // Attention sinks (gpt-oss): per query head a learned logit in the softmax's denominator with
  // no value, p_j = exp(s_j) / (sum_i exp(s_i) + exp(sinks[h])). [n_head] in activation memory;
  // nullptr: none.
  const float* sinks = nullptr;
  float score_scale() const { return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim)); }
};

// One sequence's queries in Backend::attention: n_tokens rows of q ([n_tokens][n_head *
// head_dim]) at positions pos0.. over its cache; the result goes to out (same shape).
// softmax_phi ([n_head] of this layer, optional, decode only) is the sequence's
// FlashDecoding++ state (backends/cpu/attention.h): the unified max of each head's scores, NaN
// until a step has learned it; nullptr: the exact online softmax.
struct AttentionCall {
  const float* q = nullptr;
  int n_tokens = 0;
  int64_t pos0 = 0;
  float* out = nullptr;
  const KvView* kv = nullptr;
  float* softmax_phi = nullptr;
  // A speculative draft's checking pass (only to a backend that attends_stepwise()): each row
  // attends exactly as the decode step of its token would, one after the other (row i's maxima
  // are row i + 1's softmax_phi); step_phi[i] ([n_head], optional) gets the maxima row i leaves.
  bool steps = false;
  float* const* step_phi = nullptr;
};

// Activation memory from Backend::alloc_activations: `size()` floats at `data()`, an address
// range the backend's ops understand (host memory for the CPU backend; for a device backend, a
// host range standing for the device memory behind it, not to be read or written directly).
class ActivationBuffer {
 public:
  ActivationBuffer(float* data, size_t size) : data_(data), size_(size) {}
  virtual ~ActivationBuffer() = default;
  ActivationBuffer(const ActivationBuffer&) = delete;
  ActivationBuffer& operator=(const ActivationBuffer&) = delete;
  float* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  float* data_;
  size_t size_;
};

// What a device backend did, counted since it was made: kernels launched, bytes moved each way
// between host and device, and how often the host waited for the device.
struct DeviceCounters {
  uint64_t launches = 0;
  uint64_t upload_bytes = 0;
  uint64_t download_bytes = 0;
  uint64_t waits = 0;
};

// The ops of the seam, as Backend::supports names them.
enum class BackendOp {
  kMatmul, kMatmulAdd, kMatmulMany, kMatmulGlu, kRows,  // products and embedding rows: the weights' types
  kMoeFfn, kRoute,                                      // a mixture of experts: the experts' / router's types
  kRope, kAdd, kAddRow, kScale, kRmsNorm, kCopy, kGlu,  // row-wise ops on fp32 activations: no types
  kStoreKv, kAttention, kShiftKeys,                     // the KV cache's element type (F16 or F32)
  kTopK,                                                // no types
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // --- Activation memory --------------------------------------------------------------------
  // n floats of activation memory (zeroed). The host memory of this default serves every
  // backend whose ops run on the host.
  virtual std::unique_ptr<ActivationBuffer> alloc_activations(size_t n);
  // dst[0..n) = src[0..n): host values into activation memory.
  virtual void write(float* dst, const float* src, size_t n);
  // dst[0..n) = src[0..n): activation values (after every op issued before) to the host.
  virtual void read(const float* src, float* dst, size_t n);
  // dst[0..n) = src[0..n) within activation memory (the ranges do not overlap).
  virtual void copy(float* dst, const float* src, size_t n);
  // Counters of a device backend (all zero for the CPU).
  virtual DeviceCounters counters() const { return {}; }
  // The k largest of each of n_rows rows of n values at x (activation memory, rows contiguous: a
  // step's logits), in select_top_k's order, into top ([n_rows][k]) on the host: what a sampler
  // that keeps only the top k needs. A device picks them itself and sends back only those, one
  // wait for every row. This default reads host memory.
  virtual void top_k(const float* x, int64_t n_rows, int64_t n, int k, std::span<TopLogit> top);

  // Called once per weight at load. Throws std::runtime_error naming the weight if its
  // type or shape cannot be run.
  virtual std::unique_ptr<PreparedWeight> prepare(const WeightView& weight) = 0;

  // out[i] = row ids[i] of the weight in fp32 ([ids.size()][cols]): the embedding lookup of a
  // model whose output projection is its embedding table, read from the backend's own copy
  // (the file's pages may be gone, see WeightView::mapped). ids must be valid rows.
  virtual void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out) = 0;

  // y[m][n] = sum_k x[m][k] * W[n][k] for m < n_tokens: x is [n_tokens][cols], y is [n_tokens][rows].
  virtual void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) = 0;

  // y += x · weight^T (x is [n_tokens][cols], y is [n_tokens][rows]): a product added to what y
  // holds, the residual connection after a block's output projection. This default multiplies
  // into a scratch array and adds; a backend fuses the two where it can.
  virtual void matmul_add(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y);

  // ys[i] = input x weights[i]^T for every i, with the input prepared (normalised, quantized)
  // once and one pass over all the weights' rows: a fused QKV projection without copying the
  // three matrices into one. Every weight has the input's number of columns.
  virtual void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                           std::span<float* const> ys) = 0;

  // out = act(input x gate^T) * (input x up^T), the gated feed-forward input (SwiGLU, GeGLU),
  // with the activation applied as each output tile is produced. out is [n_tokens][gate.rows()].
  virtual void matmul_glu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input,
                          Activation act, float* out) = 0;

  // A mixture of experts' routing, in one op: the router's logits of every row of the input
  // (normalised on the way in) plus `bias` ([n_expert], nullptr: none), into `logits`
  // ([n_tokens][router.rows()], activation memory), then each row's k largest (select_top_k's
  // order) and their softmax weights over those k (weigh_chosen), to the host ([n_tokens][k]
  // each). This default runs matmul_many, add_row and top_k: a device picks the k itself and
  // sends back k pairs a row instead of every logit.
  virtual void route(const PreparedWeight& router, const float* bias, const MatmulInput& input, float* logits, int k,
                     std::span<int32_t> experts, std::span<float> weights);

  // A mixture of experts' feed-forward block: out[r] = sum over j of routes.weights[r][j] *
  // (down_e(act(gate_e · x_r + gb_e, up_e · x_r + ub_e)) + db_e), e = routes.experts[r][j], for
  // every row r of the input (normalised on the way in, as matmul_glu's), the biases those of
  // the block (zero where it has none). out is [n_tokens][n_embd], overwritten. This default runs
  // each chosen expert once, over the rows routed to it gathered together (matmul_glu, then
  // matmul; with biases, matmul_many, add_row and glu), and sums each row's experts in ascending
  // order of expert.
  virtual void moe_ffn(const ExpertBlock& experts, const ExpertRoutes& routes, const MatmulInput& input,
                       Activation act, float* out);
  // moe_ffn's default for expert e of a block with biases: hidden = act(gate_e · x + gb_e,
  // up_e · x + ub_e) (`up`: room for the up products), product = down_e · hidden + db_e, over
  // the m = rows.n_tokens gathered rows.
  void expert_with_biases(const ExpertBlock& experts, int e, const MatmulInput& rows, Activation act, float* hidden,
                          float* up, float* product);

  // --- The attention block: RoPE, the KV cache, attention, the StreamingLLM shift -----------

  // Rotates the first angles.n_rot elements of each of the n_heads heads (head_dim apart) of
  // n_rows rows (n_heads * head_dim apart) by the row's angles.
  virtual void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) = 0;

  // Writes n rows of keys and values (fp32, kv.row_width each) into slots first_slot.. of
  // `layer`, in the cache's type, wherever the backend keeps the cache.
  virtual void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) = 0;

  // Causal attention of every call's queries over its own cache, all in one pass (a batch of
  // sequences shares the threads): query i of a call, at position pos0 + i, sees exactly the
  // slots of its prefix and its cache at positions 0 .. pos0 + i (the last shape.window of them).
  virtual void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) = 0;
  // Whether attention() runs a checking pass's calls (AttentionCall::steps) itself; otherwise
  // the model hands it their rows one at a time, as decode calls.
  virtual bool attends_stepwise() const { return false; }

  // Whether the backend applies a view's key scales (KvView::key_scales); the model hands them
  // only to one that does, and a backend that does not runs every cache unscaled (the same
  // scores, a larger quantization error).
  virtual bool keeps_key_scales() const { return false; }

  // StreamingLLM's shift-RoPE: rotates the keys of `slots` in `layers` by one set of angles
  // (angles.cos / sin: one row), in place, wherever the backend keeps the cache.
  virtual void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots,
                          const RopeAngles& angles, int n_head_kv, int head_dim) = 0;

  // x[i] += delta[i] for i < n: a residual connection.
  virtual void add(float* x, const float* delta, int64_t n) = 0;
  // x[i] *= factor for i < n (Gemma's embedding scale).
  virtual void scale(float* x, int64_t n, float factor) = 0;
  // x[r][c] += row[c] for n_rows rows of `width`: a bias.
  virtual void add_row(float* x, const float* row, int64_t n_rows, int64_t width) = 0;
  // gate[i] = act(gate[i], up[i]) for i < n: a gated block's activation on its own (matmul_glu
  // fuses it), for products that take a bias first.
  virtual void glu(Activation act, float* gate, const float* up, int64_t n) = 0;
  // Each of n_rows rows of `width` RMS-normalised and scaled by weight, in place (as
  // normalized_input_row): the per-head norm of q and k (QK-norm).
  virtual void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) = 0;

  // Whether this backend runs `op` itself on operands of these types (see BackendOp), as ggml's
  // backends answer supports_op. Every op runs whatever the answer: a device backend runs what its
  // device does not take on the CPU it wraps, slower. This default (a backend on the host) says
  // yes for every type ringlm reads.
  virtual bool supports(BackendOp op, std::span<const TensorType> types) const;

  // Whether some ops run on a device of their own (a plugin's GPU), for reports.
  virtual bool offloads() const { return false; }
  // For a backend with a device: which weights stay on the CPU and why, one line (empty when
  // none does). Ops that fall back as they run (attention of some caches) say so once, on stderr.
  virtual std::string cpu_fallback_report() const { return {}; }
  // Where the products run, for reports: "cpu", "opencl:0 (NVIDIA ...)".
  virtual std::string device_description() const { return std::string(name()); }

  // --- Layers on a device and on the CPU (partial offload: llama.cpp's -ngl) -----------------
  // The model says how many layers it has before it prepares a weight, and which layer the ops
  // it issues next belong to (-1: the embedding, n_layer: the final norm and the output). A
  // backend that keeps only some layers on its device places each weight by its layer
  // (WeightView::layer) and runs each layer's ops where its weights are. The defaults run
  // everything here.
  virtual void plan_layers(int /*n_layer*/) {}
  virtual void begin_layer(int /*layer*/) {}
  // Where layer `layer` (n_layer: the output) runs, for --stats: "cpu", "opencl:0".
  virtual std::string layer_device(int /*layer*/) const { return offloads() ? std::string(name()) : "cpu"; }
};

// How the CPU backend multiplies weights:
//  - kInt8: the packed kernels (backends/cpu/kernel_packed.h): activations quantized to int8 per
//    block of 32 (per 256 for the K-quants and IQ4_XS) on the fly, integer dot products, one
//    float multiply-add per block (fast; activations carry a rounding error of at most max|x|/254
//    of their block); F32/F16/BF16 weights multiply the fp32 activations.
//  - kFp32: weights dequantized to fp32 and multiplied with the fp32 activations (reference).
enum class ComputeType { kInt8, kFp32 };

}  // namespace ringlm

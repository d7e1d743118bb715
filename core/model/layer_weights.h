// A model's weights as the decoder reads them from a GGUF file: the tensor schema of a layer
// (names, shapes, which tensors are optional, how a fused matrix splits) as a table, and the
// loading that checks every tensor against it before anything is packed. A family with new
// tensors adds rows to the table (layer_weights.cpp), not code to the forward pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/gguf/gguf.h"
#include "core/model/hparams.h"

namespace ringlm {

// One layer's weights. The norm weights and biases live in the backend's activation memory,
// where its ops read them; nullptr: the layer has none.
struct LayerWeights {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_bias = nullptr;  // qkv_bias families, or any file that has them
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* q_norm = nullptr;  // qk_norm families: [head_dim]
  const float* k_norm = nullptr;
  const float* post_attn_norm = nullptr;  // post_norms families
  const float* post_ffn_norm = nullptr;
  const float* o_bias = nullptr;      // attn_output.bias
  const float* attn_sinks = nullptr;  // attn_sinks families: [n_head]
  int window = 0;    // sliding window of its attention (0: none)
  int rope_set = 0;  // its RoPE frequencies (RopeTables' set)
  std::unique_ptr<PreparedWeight> wq, wk, wv, wo, gate, up, down;
  // A mixture of experts, in place of gate, up and down: the router ([n_expert][n_embd]) and
  // every expert's three matrices (expert e's are element e).
  std::unique_ptr<PreparedWeight> router;
  std::vector<std::unique_ptr<PreparedWeight>> gate_exps, up_exps, down_exps;
  // The same as the seam takes them (ExpertBlock), once placed (index_experts).
  std::vector<const PreparedWeight*> gate_experts, up_experts, down_experts;
  // expert_biases families: the router's ([n_expert]) and the experts' products' biases
  // ([n_expert][n_ff_exp] for gate and up, [n_expert][n_embd] for down).
  const float* router_bias = nullptr;
  const float* gate_exps_bias = nullptr;
  const float* up_exps_bias = nullptr;
  const float* down_exps_bias = nullptr;
  void index_experts();
};

// The file's tensors as the decoder reads them. Each one read is marked, so that what is left at
// the end (a bias, a fused matrix, a frequency table that llama.cpp would apply and this decoder
// would not) is refused by name instead of silently ignored.
class ModelTensors {
 public:
  explicit ModelTensors(const GgufFile& gguf) : gguf_(gguf) {}
  const GgufFile& file() const { return gguf_; }
  bool has(const std::string& name) const { return gguf_.find_tensor(name) != nullptr; }
  // The tensor `name` with exactly `shape` (GGML order) and a readable type, or a GgufError.
  const GgufTensorInfo& get(const std::string& name, std::vector<int64_t> shape);
  // A 1-D tensor of n values, dequantized; with n_expert, a 2-D one of n_expert such rows.
  std::vector<float> vector(const std::string& name, int64_t n, int64_t n_expert = 0);
  // Every tensor whose name starts with `prefix` counts as read: another pipeline stage reads it.
  std::vector<const GgufTensorInfo*> leave_to_another_stage(const std::string& prefix);
  void refuse_unused(const std::string& arch) const;

 private:
  const GgufFile& gguf_;
  std::unordered_set<std::string> used_;
};

// What a model loads onto its backend, gathered while the file is checked and placed only once
// every tensor is known to be used, so that a file the decoder refuses fails before anything is
// packed: the matrices (where each goes, its rows in the file) and the norm weights and biases.
class WeightPlan {
 public:
  // A matrix of the file [rows][cols], counted in the model's size.
  const GgufTensorInfo& matrix(ModelTensors& tensors, const std::string& name, int64_t cols, int64_t rows);
  // ... or n_expert of them, one after the other ([n_expert][rows][cols]: GGML's 3-D expert tensors).
  const GgufTensorInfo& experts(ModelTensors& tensors, const std::string& name, int64_t cols, int64_t rows,
                                int64_t n_expert);
  // ... prepared as one weight into `slot`, for `layer` (-1: the embedding; n_layer: the output).
  void prepare(std::unique_ptr<PreparedWeight>& slot, const GgufTensorInfo& t, int layer);
  // Rows [row0, row0 + n) of matrix t as a weight of its own (a fused matrix's part).
  // `expert`: the part is one expert's matrix (WeightView::expert).
  void prepare_rows(std::unique_ptr<PreparedWeight>& slot, const GgufFile& gguf, const GgufTensorInfo& t,
                    int64_t row0, int64_t n, const std::string& part, int layer, bool expert = false);
  void constant(const float*& slot, std::vector<float> values) { constants_.emplace_back(&slot, std::move(values)); }
  // Matrices another pipeline stage loads: part of the model's size all the same.
  void count_elsewhere(const std::vector<const GgufTensorInfo*>& tensors);

  // Prepares the matrices on `backend` (`first`, the output, before the others: a backend that
  // fills its device layer by layer then knows, when a layer does not fit, that the output does)
  // and writes the constants to its memory, which it returns.
  std::unique_ptr<ActivationBuffer> place(Backend& backend, const std::unique_ptr<PreparedWeight>* first);

  size_t weight_bytes() const { return weight_bytes_; }
  size_t bytes_here() const { return weight_bytes_ - bytes_elsewhere_; }  // this stage's matrices
  int64_t n_params() const { return n_params_; }

 private:
  struct PendingWeight {
    std::unique_ptr<PreparedWeight>* slot;
    WeightView view;
  };
  std::vector<PendingWeight> pending_;
  std::vector<std::pair<const float**, std::vector<float>>> constants_;
  size_t weight_bytes_ = 0;
  size_t bytes_elsewhere_ = 0;
  int64_t n_params_ = 0;
};

// Reads layer `il`'s tensors ("blk.<il>.") as the layer schema says, for the family of `hp`,
// into `layer` (through `plan`). GgufError naming the tensor when one is missing or misshapen.
void read_layer_weights(ModelTensors& tensors, WeightPlan& plan, const LlamaHparams& hp, int il, LayerWeights& layer);

}  // namespace ringlm

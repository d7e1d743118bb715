#include "core/model/layer_weights.h"

#include <algorithm>
#include <variant>

namespace ringlm {

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// --- The layer schema ------------------------------------------------------------------------

// The lengths a layer tensor's shape is given in.
enum class Dim { kNone, kEmbd, kQ, kKv, kQkv, kFf, kGateUp, kHeadDim, kHead, kExpert, kFfExp };

int64_t length(Dim dim, const LlamaHparams& hp) {
  const int64_t q = static_cast<int64_t>(hp.n_head) * hp.head_dim;
  const int64_t kv = static_cast<int64_t>(hp.n_head_kv) * hp.head_dim;
  switch (dim) {
    case Dim::kNone: return 0;
    case Dim::kEmbd: return hp.n_embd;
    case Dim::kQ: return q;
    case Dim::kKv: return kv;
    case Dim::kQkv: return q + 2 * kv;
    case Dim::kFf: return hp.n_ff;
    case Dim::kGateUp: return 2 * static_cast<int64_t>(hp.n_ff);
    case Dim::kHeadDim: return hp.head_dim;
    case Dim::kHead: return hp.n_head;
    case Dim::kExpert: return hp.n_expert;
    case Dim::kFfExp: return hp.n_ff_exp;
  }
  return 0;
}

// When a layer has a tensor.
enum class When {
  kAlways,        // every layer of every family
  kInFile,        // wherever the file has it (a file's layout, not a family's: fused q|k|v)
  kFamily,        // where the family's flag says so
  kFamilyOrFile,  // where the family's flag says so, and read wherever a file has it (biases, as llama.cpp)
  kDense,         // the feed-forward block of a model without experts
  kExperts,       // ... of a mixture of experts
};

using MatrixSlot = std::unique_ptr<PreparedWeight> LayerWeights::*;
using VectorSlot = const float* LayerWeights::*;
using ExpertsSlot = std::vector<std::unique_ptr<PreparedWeight>> LayerWeights::*;
using Slot = std::variant<MatrixSlot, VectorSlot, ExpertsSlot>;

// Where a tensor's rows go: all of them into one slot, or a fused tensor's consecutive row
// ranges into one slot each (llama.cpp's views of a fused matrix).
struct Part {
  Slot slot;
  Dim rows;
  const char* label = nullptr;  // the part's name, after the tensor's: "attn_qkv.weight (q)"
};

struct LayerTensor {
  const char* name;  // after "blk.N."
  Dim cols;          // a vector's length, a matrix's columns (its input)
  Dim rows;          // a matrix's rows (its output); kNone: a vector
  When when;
  bool LlamaHparams::* family_flag = nullptr;  // kFamily, kFamilyOrFile
  std::vector<Part> parts;
  // One matrix per expert, [n_expert][rows][cols], into an ExpertsSlot; a vector's: one per
  // expert, [n_expert][cols], into one VectorSlot.
  bool per_expert = false;
};

// A layer's tensors, in the order they are read. A tensor is read only while no tensor read before
// it fills any of its slots: the fused forms come first, and the separate tensors after them are
// read only when the file had no fused one. Every tensor read is marked used; whatever a file holds
// beyond this table is refused by name (ModelTensors::refuse_unused).
const std::vector<LayerTensor>& layer_schema() {
  using L = LayerWeights;
  using H = LlamaHparams;
  static const std::vector<LayerTensor> schema = {
      {"attn_norm.weight", Dim::kEmbd, Dim::kNone, When::kAlways, nullptr, {{&L::attn_norm, Dim::kEmbd}}},
      // gpt-oss's FFN input norm has the name of Gemma's post-attention norm (the converter's).
      {"post_attention_norm.weight", Dim::kEmbd, Dim::kNone, When::kFamily, &H::ffn_norm_post_attention,
       {{&L::ffn_norm, Dim::kEmbd}}},
      {"ffn_norm.weight", Dim::kEmbd, Dim::kNone, When::kAlways, nullptr, {{&L::ffn_norm, Dim::kEmbd}}},
      // q, k and v: one fused matrix of their rows in that order (any family's file may hold
      // it, as llama.cpp's build_qkv views), or three.
      {"attn_qkv.weight", Dim::kEmbd, Dim::kQkv, When::kInFile, nullptr,
       {{&L::wq, Dim::kQ, "q"}, {&L::wk, Dim::kKv, "k"}, {&L::wv, Dim::kKv, "v"}}},
      {"attn_q.weight", Dim::kEmbd, Dim::kQ, When::kAlways, nullptr, {{&L::wq, Dim::kQ}}},
      {"attn_k.weight", Dim::kEmbd, Dim::kKv, When::kAlways, nullptr, {{&L::wk, Dim::kKv}}},
      {"attn_v.weight", Dim::kEmbd, Dim::kKv, When::kAlways, nullptr, {{&L::wv, Dim::kKv}}},
      {"attn_qkv.bias", Dim::kQkv, Dim::kNone, When::kInFile, nullptr,
       {{&L::q_bias, Dim::kQ}, {&L::k_bias, Dim::kKv}, {&L::v_bias, Dim::kKv}}},
      {"attn_q.bias", Dim::kQ, Dim::kNone, When::kFamilyOrFile, &H::qkv_bias, {{&L::q_bias, Dim::kQ}}},
      {"attn_k.bias", Dim::kKv, Dim::kNone, When::kFamilyOrFile, &H::qkv_bias, {{&L::k_bias, Dim::kKv}}},
      {"attn_v.bias", Dim::kKv, Dim::kNone, When::kFamilyOrFile, &H::qkv_bias, {{&L::v_bias, Dim::kKv}}},
      {"attn_q_norm.weight", Dim::kHeadDim, Dim::kNone, When::kFamily, &H::qk_norm, {{&L::q_norm, Dim::kHeadDim}}},
      {"attn_k_norm.weight", Dim::kHeadDim, Dim::kNone, When::kFamily, &H::qk_norm, {{&L::k_norm, Dim::kHeadDim}}},
      {"post_attention_norm.weight", Dim::kEmbd, Dim::kNone, When::kFamily, &H::post_norms,
       {{&L::post_attn_norm, Dim::kEmbd}}},
      {"post_ffw_norm.weight", Dim::kEmbd, Dim::kNone, When::kFamily, &H::post_norms, {{&L::post_ffn_norm, Dim::kEmbd}}},
      {"attn_output.weight", Dim::kQ, Dim::kEmbd, When::kAlways, nullptr, {{&L::wo, Dim::kEmbd}}},
      {"attn_output.bias", Dim::kEmbd, Dim::kNone, When::kFamilyOrFile, &H::attn_out_bias, {{&L::o_bias, Dim::kEmbd}}},
      {"attn_sinks.weight", Dim::kHead, Dim::kNone, When::kFamily, &H::attn_sinks, {{&L::attn_sinks, Dim::kHead}}},
      // gate and up: one matrix of the gate's rows, then up's (Phi-3), or two.
      {"ffn_up.weight", Dim::kEmbd, Dim::kGateUp, When::kFamily, &H::fused_gate_up,
       {{&L::gate, Dim::kFf, "gate"}, {&L::up, Dim::kFf, "up"}}},
      {"ffn_gate.weight", Dim::kEmbd, Dim::kFf, When::kDense, nullptr, {{&L::gate, Dim::kFf}}},
      {"ffn_up.weight", Dim::kEmbd, Dim::kFf, When::kDense, nullptr, {{&L::up, Dim::kFf}}},
      {"ffn_down.weight", Dim::kFf, Dim::kEmbd, When::kDense, nullptr, {{&L::down, Dim::kEmbd}}},
      // A mixture of experts: the router, then each of the three matrices of every expert.
      {"ffn_gate_inp.weight", Dim::kEmbd, Dim::kExpert, When::kExperts, nullptr, {{&L::router, Dim::kExpert}}},
      {"ffn_gate_exps.weight", Dim::kEmbd, Dim::kFfExp, When::kExperts, nullptr, {{&L::gate_exps, Dim::kFfExp}}, true},
      {"ffn_up_exps.weight", Dim::kEmbd, Dim::kFfExp, When::kExperts, nullptr, {{&L::up_exps, Dim::kFfExp}}, true},
      {"ffn_down_exps.weight", Dim::kFfExp, Dim::kEmbd, When::kExperts, nullptr, {{&L::down_exps, Dim::kEmbd}}, true},
      // ... and their biases (gpt-oss).
      {"ffn_gate_inp.bias", Dim::kExpert, Dim::kNone, When::kFamily, &H::expert_biases, {{&L::router_bias, Dim::kExpert}}},
      {"ffn_gate_exps.bias", Dim::kFfExp, Dim::kNone, When::kFamily, &H::expert_biases,
       {{&L::gate_exps_bias, Dim::kFfExp}}, true},
      {"ffn_up_exps.bias", Dim::kFfExp, Dim::kNone, When::kFamily, &H::expert_biases, {{&L::up_exps_bias, Dim::kFfExp}}, true},
      {"ffn_down_exps.bias", Dim::kEmbd, Dim::kNone, When::kFamily, &H::expert_biases,
       {{&L::down_exps_bias, Dim::kEmbd}}, true},
  };
  return schema;
}

bool wanted(const LayerTensor& t, const LlamaHparams& hp, const ModelTensors& tensors, const std::string& name) {
  switch (t.when) {
    case When::kAlways: return true;
    case When::kInFile: return tensors.has(name);
    case When::kFamily: return hp.*t.family_flag;
    case When::kFamilyOrFile: return hp.*t.family_flag || tensors.has(name);
    case When::kDense: return !hp.moe();
    case When::kExperts: return hp.moe();
  }
  return false;
}

void read_matrix(const LayerTensor& t, const std::string& name, ModelTensors& tensors, WeightPlan& plan,
                 const LlamaHparams& hp, int il, LayerWeights& layer) {
  const GgufTensorInfo& info = plan.matrix(tensors, name, length(t.cols, hp), length(t.rows, hp));
  if (t.parts.size() == 1) return plan.prepare(layer.*std::get<MatrixSlot>(t.parts[0].slot), info, il);
  int64_t row0 = 0;
  for (const Part& part : t.parts) {
    const int64_t n = length(part.rows, hp);
    plan.prepare_rows(layer.*std::get<MatrixSlot>(part.slot), tensors.file(), info, row0, n, part.label, il);
    row0 += n;
  }
}

// Expert e's matrix is rows [e * rows, (e + 1) * rows) of the file's tensor: a view, as a fused
// matrix's part is.
void read_experts(const LayerTensor& t, const std::string& name, ModelTensors& tensors, WeightPlan& plan,
                  const LlamaHparams& hp, int il, LayerWeights& layer) {
  const std::string per_expert_name = "blk." + std::to_string(il) + ".ffn_gate.0.weight";
  if (!tensors.has(name) && tensors.has(per_expert_name)) {
    tensors.file().fail("tensor '" + per_expert_name + "': experts stored one tensor each (an older conversion); "
                        "convert the model again with a current llama.cpp, which stacks them in '" + name + "'");
  }
  const int64_t rows = length(t.rows, hp);
  const GgufTensorInfo& info = plan.experts(tensors, name, length(t.cols, hp), rows, hp.n_expert);
  std::vector<std::unique_ptr<PreparedWeight>>& experts = layer.*std::get<ExpertsSlot>(t.parts[0].slot);
  experts.resize(static_cast<size_t>(hp.n_expert));
  for (int e = 0; e < hp.n_expert; ++e) {
    plan.prepare_rows(experts[static_cast<size_t>(e)], tensors.file(), info, e * rows, rows,
                      "expert " + std::to_string(e), il, /*expert=*/true);
  }
}

void read_vector(const LayerTensor& t, const std::string& name, ModelTensors& tensors, WeightPlan& plan,
                 const LlamaHparams& hp, LayerWeights& layer) {
  if (t.per_expert) {  // [n_expert][cols], one slot
    return plan.constant(layer.*std::get<VectorSlot>(t.parts[0].slot), tensors.vector(name, length(t.cols, hp), hp.n_expert));
  }
  const std::vector<float> values = tensors.vector(name, length(t.cols, hp));
  auto at = values.begin();
  for (const Part& part : t.parts) {
    const auto n = static_cast<std::ptrdiff_t>(length(part.rows, hp));
    plan.constant(layer.*std::get<VectorSlot>(part.slot), {at, at + n});
    at += n;
  }
}

}  // namespace

// --- The file's tensors ----------------------------------------------------------------------

const GgufTensorInfo& ModelTensors::get(const std::string& name, std::vector<int64_t> shape) {
  used_.insert(name);
  const GgufTensorInfo* t = gguf_.find_tensor(name);
  if (t == nullptr) gguf_.fail("missing tensor '" + name + "'");
  // Trailing dimensions of 1 are equivalent (some writers keep them).
  std::vector<int64_t> got = t->shape;
  while (got.size() > shape.size() && got.back() == 1) got.pop_back();
  if (got != shape) {
    gguf_.fail("tensor '" + name + "': shape " + shape_string(t->shape) + ", expected " + shape_string(shape));
  }
  const auto traits = type_traits(static_cast<uint32_t>(t->type));
  if (!traits->readable) {
    gguf_.fail("tensor '" + name + "': type " + std::string(traits->name) + " is not supported");
  }
  return *t;
}

std::vector<float> ModelTensors::vector(const std::string& name, int64_t n, int64_t n_expert) {
  const GgufTensorInfo& t = n_expert > 0 ? get(name, {n, n_expert}) : get(name, {n});
  const int64_t rows = std::max<int64_t>(n_expert, 1);
  std::vector<float> v(static_cast<size_t>(n * rows));
  const size_t stride = row_bytes(t.type, n);
  for (int64_t r = 0; r < rows; ++r) dequantize_row(t.type, t.data + static_cast<size_t>(r) * stride, v.data() + r * n, n);
  return v;
}

std::vector<const GgufTensorInfo*> ModelTensors::leave_to_another_stage(const std::string& prefix) {
  std::vector<const GgufTensorInfo*> left;
  for (const GgufTensorInfo& t : gguf_.tensors()) {
    if (!t.name.starts_with(prefix)) continue;
    used_.insert(t.name);
    left.push_back(&t);
  }
  return left;
}

void ModelTensors::refuse_unused(const std::string& arch) const {
  for (const GgufTensorInfo& t : gguf_.tensors()) {
    if (!used_.contains(t.name)) gguf_.fail("tensor '" + t.name + "' is not part of the '" + arch + "' decoder");
  }
}

// --- The plan of what goes onto the backend --------------------------------------------------

const GgufTensorInfo& WeightPlan::matrix(ModelTensors& tensors, const std::string& name, int64_t cols, int64_t rows) {
  const GgufTensorInfo& t = tensors.get(name, {cols, rows});
  weight_bytes_ += t.n_bytes;
  n_params_ += t.n_elements();
  return t;
}

const GgufTensorInfo& WeightPlan::experts(ModelTensors& tensors, const std::string& name, int64_t cols, int64_t rows,
                                          int64_t n_expert) {
  const GgufTensorInfo& t = tensors.get(name, {cols, rows, n_expert});
  weight_bytes_ += t.n_bytes;
  n_params_ += t.n_elements();
  return t;
}

void WeightPlan::prepare(std::unique_ptr<PreparedWeight>& slot, const GgufTensorInfo& t, int layer) {
  pending_.push_back({&slot, WeightView{t.name, t.type, t.rows(), t.cols(), t.data, true, layer}});
}

// A row is a whole number of blocks, contiguous in the file, so a range of rows of a fused
// matrix is a view of its bytes: nothing is copied, and the backend prepares it as any other weight.
void WeightPlan::prepare_rows(std::unique_ptr<PreparedWeight>& slot, const GgufFile& gguf, const GgufTensorInfo& t,
                              int64_t row0, int64_t n, const std::string& part, int layer, bool expert) {
  const int64_t block = type_traits(static_cast<uint32_t>(t.type))->block_elems;
  if (t.cols() % block != 0) gguf.fail("tensor '" + t.name + "': rows are not whole blocks, cannot be split");
  const size_t stride = row_bytes(t.type, t.cols());
  const uint8_t* data = t.data + static_cast<size_t>(row0) * stride;
  pending_.push_back({&slot, WeightView{t.name + " (" + part + ")", t.type, n, t.cols(), data, true, layer, expert}});
}

void WeightPlan::count_elsewhere(const std::vector<const GgufTensorInfo*>& tensors) {
  for (const GgufTensorInfo* t : tensors) {
    if (t->shape.size() < 2) continue;  // norms and biases: not counted here either
    weight_bytes_ += t->n_bytes;
    bytes_elsewhere_ += t->n_bytes;
    n_params_ += t->n_elements();
  }
}

std::unique_ptr<ActivationBuffer> WeightPlan::place(Backend& backend, const std::unique_ptr<PreparedWeight>* first) {
  std::stable_partition(pending_.begin(), pending_.end(), [&](const PendingWeight& w) { return w.slot == first; });
  for (PendingWeight& w : pending_) *w.slot = backend.prepare(w.view);
  size_t n_constants = 0;
  for (const auto& c : constants_) n_constants += c.second.size();
  std::unique_ptr<ActivationBuffer> memory = backend.alloc_activations(n_constants);
  float* at = memory->data();
  for (auto& [slot, values] : constants_) {
    backend.write(at, values.data(), values.size());
    *slot = at;
    at += values.size();
  }
  return memory;
}

// --- One layer -------------------------------------------------------------------------------

void LayerWeights::index_experts() {
  const auto index = [](const std::vector<std::unique_ptr<PreparedWeight>>& owned, std::vector<const PreparedWeight*>& view) {
    view.clear();
    for (const auto& w : owned) view.push_back(w.get());
  };
  index(gate_exps, gate_experts);
  index(up_exps, up_experts);
  index(down_exps, down_experts);
}

void read_layer_weights(ModelTensors& tensors, WeightPlan& plan, const LlamaHparams& hp, int il, LayerWeights& layer) {
  const std::string prefix = "blk." + std::to_string(il) + ".";
  std::vector<Slot> taken;  // the slots a tensor read so far fills (they are filled when placed)
  for (const LayerTensor& t : layer_schema()) {
    const bool any_taken = std::any_of(t.parts.begin(), t.parts.end(), [&](const Part& p) {
      return std::find(taken.begin(), taken.end(), p.slot) != taken.end();
    });
    const std::string name = prefix + t.name;
    if (any_taken || !wanted(t, hp, tensors, name)) continue;
    for (const Part& p : t.parts) taken.push_back(p.slot);
    if (t.rows == Dim::kNone) {
      read_vector(t, name, tensors, plan, hp, layer);
    } else if (t.per_expert) {
      read_experts(t, name, tensors, plan, hp, il, layer);
    } else {
      read_matrix(t, name, tensors, plan, hp, il, layer);
    }
  }
}

}  // namespace ringlm

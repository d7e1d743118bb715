#include "backends/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace ringlm {

const char* kv_type_name(KvType type) {
  switch (type) {
    case KvType::kF16: return "f16";
    case KvType::kF32: return "f32";
    case KvType::kQ8_0: return "q8_0";
    case KvType::kQ4_0: return "q4_0";
    case KvType::kKivi2: return "kivi2";
  }
  return "?";
}

std::string kv_types_name(KvTypes types) {
  if (types.same()) return kv_type_name(types.keys);
  return std::string(kv_type_name(types.keys)) + "/" + kv_type_name(types.values);
}

const float* normalized_input_row(const MatmulInput& in, int64_t m, int64_t cols, float* out) {
  const float* x = in.x + m * cols;
  if (in.rms_weight == nullptr) return x;
  // 1 / RMS in double: a long row of large activations would lose digits in a float sum. Four
  // partial sums in a fixed order: one chain of dependent additions would be the slowest part
  // of the row, and the compiler may not reorder it on its own.
  double part[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= cols; i += 4) {
    for (int j = 0; j < 4; ++j) part[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (; i < cols; ++i) part[0] += static_cast<double>(x[i]) * x[i];
  const double sum_sq = (part[0] + part[1]) + (part[2] + part[3]);
  const auto scale = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + in.rms_eps));
  for (i = 0; i < cols; ++i) out[i] = x[i] * scale * in.rms_weight[i];
  return out;
}

namespace {

// Host activation memory: a zeroed array of floats.
class HostActivations final : public ActivationBuffer {
 public:
  HostActivations(std::unique_ptr<float[]> storage, size_t n) : ActivationBuffer(storage.get(), n), storage_(std::move(storage)) {}

 private:
  std::unique_ptr<float[]> storage_;
};

}  // namespace

void Backend::top_k(const float* x, int64_t n_rows, int64_t n, int k, std::span<TopLogit> top) {
  const auto width = static_cast<size_t>(n), picks = static_cast<size_t>(k);
  for (size_t r = 0; r < static_cast<size_t>(n_rows); ++r) {
    select_top_k(std::span<const float>(x + r * width, width), top.subspan(r * picks, picks));
  }
}

std::unique_ptr<ActivationBuffer> Backend::alloc_activations(size_t n) {
  auto storage = std::make_unique<float[]>(n > 0 ? n : 1);  // zeroed
  return std::make_unique<HostActivations>(std::move(storage), n);
}

void Backend::matmul_add(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) {
  const auto n = static_cast<size_t>(n_tokens * weight.rows());
  std::unique_ptr<ActivationBuffer> product = alloc_activations(n);
  matmul(weight, x, n_tokens, product->data());
  add(y, product->data(), static_cast<int64_t>(n));
}

void Backend::route(const PreparedWeight& router, const float* bias, const MatmulInput& input, float* logits, int k,
                    std::span<int32_t> experts, std::span<float> weights) {
  const int64_t n_expert = router.rows();
  const PreparedWeight* const weight[] = {&router};
  float* const out[] = {logits};
  matmul_many(weight, input, out);
  if (bias != nullptr) add_row(logits, bias, input.n_tokens, n_expert);
  // (Kept from call to call: a decode step allocates nothing.)
  thread_local std::vector<TopLogit> picks;
  const auto K = static_cast<size_t>(k);
  picks.resize(static_cast<size_t>(input.n_tokens) * K);
  top_k(logits, input.n_tokens, n_expert, k, picks);
  for (size_t r = 0; r < static_cast<size_t>(input.n_tokens); ++r) {
    weigh_chosen(std::span<const TopLogit>(picks).subspan(r * K, K), experts.subspan(r * K, K), weights.subspan(r * K, K));
  }
}

void Backend::moe_ffn(const ExpertBlock& experts, const ExpertRoutes& routes, const MatmulInput& input,
                      Activation act, float* out) {
  const auto n_expert = static_cast<int>(experts.gate.size());
  const ExpertGroups groups = group_by_expert(routes, n_expert);
  int64_t most = 0;
  for (int e = 0; e < n_expert; ++e) most = std::max(most, groups.count(e));
  if (most == 0) return;
  const int64_t d = experts.down[0]->rows(), n_ff = experts.gate[0]->rows();
  const auto d_size = static_cast<size_t>(d);
  // The model's scratch when it has room for the largest group, else buffers of this call's own.
  std::unique_ptr<ActivationBuffer> own_rows, own_hidden, own_products;
  const bool room = experts.scratch_rows != nullptr && most <= experts.scratch_routes;
  const auto buffer = [&](float* given, std::unique_ptr<ActivationBuffer>& own, size_t n) {
    if (room) return given;
    own = alloc_activations(n);
    return own->data();
  };
  float* const gathered = buffer(experts.scratch_rows, own_rows, static_cast<size_t>(most) * d_size);
  float* const hidden = buffer(experts.scratch_hidden, own_hidden, static_cast<size_t>(most * n_ff));
  float* const product = buffer(experts.scratch_products, own_products, static_cast<size_t>(most) * d_size);
  std::unique_ptr<ActivationBuffer> own_up;
  float* const up_products = experts.has_biases() ? buffer(experts.scratch_up, own_up, static_cast<size_t>(most * n_ff)) : nullptr;
  std::vector<bool> written(static_cast<size_t>(input.n_tokens), false);
  for (int e = 0; e < n_expert; ++e) {
    const int64_t m = groups.count(e), first = groups.start[static_cast<size_t>(e)];
    if (m == 0) continue;
    for (int64_t i = 0; i < m; ++i) {
      const auto row = static_cast<size_t>(groups.row[static_cast<size_t>(first + i)]);
      copy(gathered + static_cast<size_t>(i) * d_size, input.x + row * d_size, d_size);
    }
    const size_t ex = static_cast<size_t>(e);
    const MatmulInput rows{gathered, m, input.rms_weight, input.rms_eps};
    if (experts.has_biases()) {
      expert_with_biases(experts, e, rows, act, hidden, up_products, product);
    } else {
      matmul_glu(*experts.gate[ex], *experts.up[ex], rows, act, hidden);
      matmul(*experts.down[ex], hidden, m, product);
    }
    // Each row's share goes to its place in `out`: the first expert of a row writes it.
    for (int64_t i = 0; i < m; ++i) {
      const size_t entry = static_cast<size_t>(first + i), row = static_cast<size_t>(groups.row[entry]);
      float* const share = product + static_cast<size_t>(i) * d_size;
      scale(share, d, groups.weight[entry]);
      if (written[row]) {
        add(out + row * d_size, share, d);
      } else {
        copy(out + row * d_size, share, d_size);
        written[row] = true;
      }
    }
  }
}

// Expert e over its gathered rows with the biases of its products: gate and up in one pass, each
// with its bias, the activation, then down and its bias.
void Backend::expert_with_biases(const ExpertBlock& experts, int e, const MatmulInput& rows, Activation act,
                                 float* hidden, float* up, float* product) {
  const auto ex = static_cast<size_t>(e);
  const int64_t n_ff = experts.gate[ex]->rows(), d = experts.down[ex]->rows();
  const PreparedWeight* const gate_up[] = {experts.gate[ex], experts.up[ex]};
  float* const outs[] = {hidden, up};
  matmul_many(gate_up, rows, outs);
  if (experts.gate_bias != nullptr) add_row(hidden, experts.gate_bias + ex * static_cast<size_t>(n_ff), rows.n_tokens, n_ff);
  if (experts.up_bias != nullptr) add_row(up, experts.up_bias + ex * static_cast<size_t>(n_ff), rows.n_tokens, n_ff);
  glu(act, hidden, up, rows.n_tokens * n_ff);
  matmul(*experts.down[ex], hidden, rows.n_tokens, product);
  if (experts.down_bias != nullptr) add_row(product, experts.down_bias + ex * static_cast<size_t>(d), rows.n_tokens, d);
}

bool Backend::supports(BackendOp /*op*/, std::span<const TensorType> types) const {
  return std::all_of(types.begin(), types.end(), [](TensorType type) {
    const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(type));
    return traits && traits->readable;
  });
}

void Backend::write(float* dst, const float* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n * sizeof(float));
}
void Backend::read(const float* src, float* dst, size_t n) {
  if (n > 0) std::memcpy(dst, src, n * sizeof(float));
}
void Backend::copy(float* dst, const float* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n * sizeof(float));
}

}  // namespace ringlm

// A mixture of experts' routing and its feed-forward block, against their definitions:
//  - route_experts: the k largest router logits (ties to the lower expert, NaNs never), weighted
//    by the softmax over the chosen ones or over all; k = every expert;
//  - group_by_expert: an expert no row picks, an expert every row picks;
//  - Backend::moe_ffn on the CPU backend: against sum_j w_j * down(silu(gate x) * up x) in
//    float64 (fp32 compute), a row's result the same bits whatever other rows share its pass and
//    whatever the thread count (both compute types), int8 near the fp32 path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/expert_routing.h"

namespace ringlm {
namespace {

struct Routed {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};

Routed route(const std::vector<float>& logits, int n_expert, int k, bool normalize) {
  const size_t n = logits.size() / static_cast<size_t>(n_expert) * static_cast<size_t>(k);
  Routed r{std::vector<int32_t>(n), std::vector<float>(n)};
  route_experts(logits, n_expert, k, normalize, r.experts, r.weights);
  return r;
}

TEST(ExpertRouting, TheLargestLogitsWinAndATieGoesToTheLowerExpert) {
  const Routed r = route({1.0f, 3.0f, 3.0f, 0.5f, /*row 2*/ 2.0f, 2.0f, 2.0f, 2.0f}, 4, 2, true);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 2, 0, 1}));
  // Equal logits: equal weights, summing to 1 (normalised over the chosen two).
  for (const float w : r.weights) EXPECT_FLOAT_EQ(w, 0.5f);
}

TEST(ExpertRouting, WeightsAreTheSoftmaxOverTheChosenOrOverAll) {
  const std::vector<float> logits = {0.3f, -1.2f, 2.5f, 0.9f, 1.7f};
  double all = 0;
  for (const float l : logits) all += std::exp(static_cast<double>(l));
  const double chosen = std::exp(2.5) + std::exp(1.7);
  const Routed normalized = route(logits, 5, 2, true);
  const Routed full = route(logits, 5, 2, false);
  EXPECT_EQ(normalized.experts, (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(full.experts, normalized.experts);
  EXPECT_NEAR(normalized.weights[0], std::exp(2.5) / chosen, 1e-6);
  EXPECT_NEAR(normalized.weights[1], std::exp(1.7) / chosen, 1e-6);
  EXPECT_NEAR(full.weights[0], std::exp(2.5) / all, 1e-6);
  EXPECT_NEAR(full.weights[1], std::exp(1.7) / all, 1e-6);
}

TEST(ExpertRouting, EveryExpertChosenIsTheWholeSoftmaxInOrder) {
  const std::vector<float> logits = {0.1f, 0.4f, -0.2f};
  const Routed r = route(logits, 3, 3, true);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 0, 2}));
  const double sum = std::exp(0.1) + std::exp(0.4) + std::exp(-0.2);
  EXPECT_NEAR(r.weights[0], std::exp(0.4) / sum, 1e-6);
  EXPECT_NEAR(r.weights[0] + r.weights[1] + r.weights[2], 1.0, 1e-6);
}

TEST(ExpertRouting, ANanLogitIsNeverChosen) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Routed r = route({nan, 0.0f, nan, -1.0f}, 4, 2, true);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 3}));
  for (const float w : r.weights) EXPECT_TRUE(std::isfinite(w));
}

TEST(ExpertRouting, BadShapesAreRefused) {
  std::vector<int32_t> e(2);
  std::vector<float> w(2);
  const std::vector<float> logits(4, 0.0f);
  EXPECT_THROW(route_experts(logits, 4, 5, true, e, w), std::invalid_argument);
  EXPECT_THROW(route_experts(logits, 3, 1, true, e, w), std::invalid_argument);
  EXPECT_THROW(route_experts(logits, 4, 1, true, std::span<int32_t>(e).first(0), w), std::invalid_argument);
}

TEST(ExpertRouting, GroupsListEachExpertsRowsInOrder) {
  // Three rows, two experts each, of four: expert 0 serves every row, expert 2 none.
  const std::vector<int32_t> experts = {0, 1, 3, 0, 0, 1};
  const std::vector<float> weights = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f};
  const ExpertGroups g = group_by_expert(ExpertRoutes{2, experts, weights}, 4);
  EXPECT_EQ(g.count(0), 3);
  EXPECT_EQ(g.count(1), 2);
  EXPECT_EQ(g.count(2), 0);
  EXPECT_EQ(g.count(3), 1);
  EXPECT_EQ(std::vector<int64_t>(g.row.begin(), g.row.begin() + 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<float>(g.weight.begin(), g.weight.begin() + 3), (std::vector<float>{0.6f, 0.3f, 0.5f}));
  const std::vector<int32_t> outside = {0, 4};
  EXPECT_THROW(group_by_expert(ExpertRoutes{2, outside, std::span<const float>(weights).first(2)}, 4), std::out_of_range);
}

// --- The block on the CPU backend ------------------------------------------------------------

constexpr int kEmbd = 64, kFf = 96, kExperts = 4, kUsed = 2;
constexpr float kEps = 1e-5f;

struct Matrix {
  int64_t rows, cols;
  std::vector<uint8_t> bytes;   // Q8_0
  std::vector<double> values;   // dequantized, row-major
};

Matrix random_q8_0(int64_t rows, int64_t cols, std::mt19937& rng) {
  Matrix m{rows, cols, std::vector<uint8_t>(row_bytes(TensorType::Q8_0, cols) * static_cast<size_t>(rows)), {}};
  std::uniform_real_distribution<float> scale(0.001f, 0.01f);
  const size_t block = type_traits(static_cast<uint32_t>(TensorType::Q8_0))->block_bytes;
  for (auto& b : m.bytes) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < m.bytes.size(); off += block) {
    const f16_bits d = fp32_to_fp16(scale(rng));
    std::memcpy(&m.bytes[off], &d, 2);
  }
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(TensorType::Q8_0, m.bytes.data() + static_cast<size_t>(r) * row_bytes(TensorType::Q8_0, cols),
                   row.data(), cols);
    m.values.insert(m.values.end(), row.begin(), row.end());
  }
  return m;
}

struct Experts {
  std::vector<Matrix> gate, up, down;
};

Experts random_experts(std::mt19937& rng) {
  Experts e;
  for (int i = 0; i < kExperts; ++i) {
    e.gate.push_back(random_q8_0(kFf, kEmbd, rng));
    e.up.push_back(random_q8_0(kFf, kEmbd, rng));
    e.down.push_back(random_q8_0(kEmbd, kFf, rng));
  }
  return e;
}

// gpt-oss's: every expert's products have biases, and the activation is the clamped SwiGLU.
struct Biases {
  std::vector<float> gate, up, down;  // [kExperts][kFf], [kExperts][kFf], [kExperts][kEmbd]
};

// The block over rows [first_row, first_row + n_rows); `seam_default`: the Backend's own
// moe_ffn (each expert through matmul_glu and matmul) instead of the CPU backend's fused one.
std::vector<float> run_moe(Backend& backend, const Experts& e, const std::vector<float>& x, const std::vector<float>& norm,
                           const Routed& routes, int64_t first_row, int64_t n_rows, bool seam_default = false,
                           const Biases* biases = nullptr, Activation act = Activation::kSilu) {
  std::vector<std::unique_ptr<PreparedWeight>> gate, up, down;
  for (int i = 0; i < kExperts; ++i) {
    const auto view = [](const Matrix& m) { return WeightView{"w", TensorType::Q8_0, m.rows, m.cols, m.bytes.data()}; };
    gate.push_back(backend.prepare(view(e.gate[static_cast<size_t>(i)])));
    up.push_back(backend.prepare(view(e.up[static_cast<size_t>(i)])));
    down.push_back(backend.prepare(view(e.down[static_cast<size_t>(i)])));
  }
  const auto K = static_cast<size_t>(kUsed), first = static_cast<size_t>(first_row);
  const ExpertRoutes r{kUsed, std::span<const int32_t>(routes.experts).subspan(first * K, static_cast<size_t>(n_rows) * K),
                       std::span<const float>(routes.weights).subspan(first * K, static_cast<size_t>(n_rows) * K)};
  std::vector<float> out(static_cast<size_t>(n_rows * kEmbd), NAN);
  const MatmulInput in{x.data() + first * kEmbd, n_rows, norm.data(), kEps};
  std::vector<const PreparedWeight*> g, u, dn;
  for (int i = 0; i < kExperts; ++i) {
    g.push_back(gate[static_cast<size_t>(i)].get());
    u.push_back(up[static_cast<size_t>(i)].get());
    dn.push_back(down[static_cast<size_t>(i)].get());
  }
  ExpertBlock block{g, u, dn};
  if (biases != nullptr) {
    block.gate_bias = biases->gate.data();
    block.up_bias = biases->up.data();
    block.down_bias = biases->down.data();
  }
  if (seam_default) {
    backend.Backend::moe_ffn(block, r, in, act, out.data());
  } else {
    backend.moe_ffn(block, r, in, act, out.data());
  }
  return out;
}

// act(g, u) in float64, as backend.h defines it (the elements' counts of the clamps reached, for
// a test to see that it reaches them).
struct Glu {
  Activation act;
  int gates_clamped = 0, ups_clamped = 0;
  double operator()(double g, double u) {
    if (act != Activation::kSwigluOai) return g / (1.0 + std::exp(-g)) * u;
    gates_clamped += g > 7.0;
    ups_clamped += std::fabs(u) > 7.0;
    const double a = std::min(g, 7.0), b = std::clamp(u, -7.0, 7.0);
    return a / (1.0 + std::exp(-1.702 * a)) * (b + 1.0);
  }
};

// The block from its definition, in float64.
std::vector<double> moe_definition(const Experts& e, const std::vector<float>& x, const std::vector<float>& norm,
                                   const Routed& routes, int64_t n_rows, const Biases* biases = nullptr,
                                   Glu* glu_out = nullptr) {
  Glu own{Activation::kSilu};
  Glu& glu = glu_out != nullptr ? *glu_out : own;
  const auto bias = [&](const std::vector<float> Biases::*which, size_t ex, int width, int i) {
    return biases != nullptr ? static_cast<double>((biases->*which)[ex * static_cast<size_t>(width) + static_cast<size_t>(i)]) : 0.0;
  };
  std::vector<double> out(static_cast<size_t>(n_rows * kEmbd), 0.0);
  for (int64_t r = 0; r < n_rows; ++r) {
    std::vector<double> xn(kEmbd);
    double sum_sq = 0;
    for (int i = 0; i < kEmbd; ++i) sum_sq += static_cast<double>(x[static_cast<size_t>(r * kEmbd + i)]) * x[static_cast<size_t>(r * kEmbd + i)];
    const double inv = 1.0 / std::sqrt(sum_sq / kEmbd + kEps);
    for (int i = 0; i < kEmbd; ++i) xn[static_cast<size_t>(i)] = x[static_cast<size_t>(r * kEmbd + i)] * inv * norm[static_cast<size_t>(i)];
    for (int j = 0; j < kUsed; ++j) {
      const auto ex = static_cast<size_t>(routes.experts[static_cast<size_t>(r * kUsed + j)]);
      const double w = routes.weights[static_cast<size_t>(r * kUsed + j)];
      std::vector<double> h(kFf);
      for (int f = 0; f < kFf; ++f) {
        double g = 0, u = 0;
        for (int i = 0; i < kEmbd; ++i) {
          g += e.gate[ex].values[static_cast<size_t>(f * kEmbd + i)] * xn[static_cast<size_t>(i)];
          u += e.up[ex].values[static_cast<size_t>(f * kEmbd + i)] * xn[static_cast<size_t>(i)];
        }
        h[static_cast<size_t>(f)] = glu(g + bias(&Biases::gate, ex, kFf, f), u + bias(&Biases::up, ex, kFf, f));
      }
      for (int o = 0; o < kEmbd; ++o) {
        double y = bias(&Biases::down, ex, kEmbd, o);
        for (int f = 0; f < kFf; ++f) y += e.down[ex].values[static_cast<size_t>(o * kFf + f)] * h[static_cast<size_t>(f)];
        out[static_cast<size_t>(r * kEmbd + o)] += w * y;
      }
    }
  }
  return out;
}

struct Block {
  Experts experts;
  std::vector<float> x, norm;
  Routed routes;
};

// Seven rows whose router logits make expert 0 every row's first choice and leave expert 3 to no
// row, the second choice spread over experts 1 and 2.
Block random_block(unsigned seed) {
  std::mt19937 rng(seed);
  Block b{random_experts(rng), {}, {}, {}};
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int n = 7;
  for (int i = 0; i < n * kEmbd; ++i) b.x.push_back(normal(rng));
  for (int i = 0; i < kEmbd; ++i) b.norm.push_back(1.0f + 0.2f * normal(rng));
  std::vector<float> logits;
  for (int r = 0; r < n; ++r) {
    const float second = normal(rng);
    logits.insert(logits.end(), {9.0f, 1.0f + second, 1.0f - second, -9.0f});
  }
  b.routes = route(logits, kExperts, kUsed, true);
  return b;
}

TEST(ExpertBlock, MatchesItsDefinitionOnTheFp32Path) {
  const Block b = random_block(3);
  auto backend = make_cpu_backend(2, ComputeType::kFp32);
  const int64_t n = 7;
  const std::vector<float> got = run_moe(*backend, b.experts, b.x, b.norm, b.routes, 0, n);
  const std::vector<double> want = moe_definition(b.experts, b.x, b.norm, b.routes, n);
  double scale = 0;
  for (const double v : want) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.0);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * scale) << "element " << i;
}

// gpt-oss's block: biases on every product, the clamped SwiGLU; large enough biases that both
// clamps are reached.
Biases random_biases(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 6.0f);
  Biases b;
  for (int i = 0; i < kExperts * kFf; ++i) b.gate.push_back(normal(rng));
  for (int i = 0; i < kExperts * kFf; ++i) b.up.push_back(normal(rng));
  for (int i = 0; i < kExperts * kEmbd; ++i) b.down.push_back(normal(rng) / 6.0f);
  return b;
}

TEST(ExpertBlock, WithBiasesAndTheClampedSwigluItMatchesItsDefinitionOnTheFp32Path) {
  const Block b = random_block(11);
  const Biases biases = random_biases(12);
  auto backend = make_cpu_backend(2, ComputeType::kFp32);
  const int64_t n = 7;
  for (const bool seam_default : {false, true}) {
    const std::vector<float> got =
        run_moe(*backend, b.experts, b.x, b.norm, b.routes, 0, n, seam_default, &biases, Activation::kSwigluOai);
    Glu glu{Activation::kSwigluOai};
    const std::vector<double> want = moe_definition(b.experts, b.x, b.norm, b.routes, n, &biases, &glu);
    EXPECT_GT(glu.gates_clamped, 0);
    EXPECT_GT(glu.ups_clamped, 0);
    double scale = 0;
    for (const double v : want) scale = std::max(scale, std::fabs(v));
    ASSERT_GT(scale, 0.0);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * scale) << "element " << i;
  }
}

// Backend::route: the router's product plus its bias, then each row's top k and their weights:
// the logits are the definition's, and the routes are what route_experts picks from them.
TEST(ExpertRoute, TheOpRoutesAsRouteExpertsDoesFromItsOwnLogits) {
  const Block b = random_block(13);
  std::mt19937 rng(14);
  const Matrix router = random_q8_0(kExperts, kEmbd, rng);
  std::vector<float> bias = {0.5f, -0.25f, 0.0f, 1.0f};
  const int64_t n = 7;
  for (const ComputeType compute : {ComputeType::kFp32, ComputeType::kInt8}) {
    auto backend = make_cpu_backend(2, compute);
    const auto weight = backend->prepare(WeightView{"router", TensorType::Q8_0, router.rows, router.cols, router.bytes.data()});
    std::vector<float> logits(static_cast<size_t>(n * kExperts), NAN), weights(static_cast<size_t>(n * kUsed));
    std::vector<int32_t> experts(static_cast<size_t>(n * kUsed), -1);
    backend->route(*weight, bias.data(), MatmulInput{b.x.data(), n, b.norm.data(), kEps}, logits.data(), kUsed, experts,
                   weights);
    const Routed want = route(logits, kExperts, kUsed, true);
    EXPECT_EQ(experts, want.experts);
    EXPECT_EQ(std::memcmp(weights.data(), want.weights.data(), weights.size() * sizeof(float)), 0);
    for (int64_t r = 0; r < n; ++r) {
      double sum_sq = 0;
      for (int i = 0; i < kEmbd; ++i) sum_sq += static_cast<double>(b.x[static_cast<size_t>(r * kEmbd + i)]) * b.x[static_cast<size_t>(r * kEmbd + i)];
      const double inv = 1.0 / std::sqrt(sum_sq / kEmbd + kEps);
      for (int e = 0; e < kExperts; ++e) {
        double dot = bias[static_cast<size_t>(e)];
        for (int i = 0; i < kEmbd; ++i) {
          dot += router.values[static_cast<size_t>(e * kEmbd + i)] * b.x[static_cast<size_t>(r * kEmbd + i)] * inv * b.norm[static_cast<size_t>(i)];
        }
        EXPECT_NEAR(logits[static_cast<size_t>(r * kExperts + e)], dot, 0.02 * (1.0 + std::fabs(dot))) << "row " << r << " expert " << e;
      }
    }
  }
}

TEST(ExpertBlock, ARowGetsTheSameBitsAloneOrWithOthersOnEitherPath) {
  const Block b = random_block(5);
  for (const ComputeType compute : {ComputeType::kFp32, ComputeType::kInt8}) {
    auto two = make_cpu_backend(2, compute);
    auto one = make_cpu_backend(1, compute);
    const std::vector<float> all = run_moe(*two, b.experts, b.x, b.norm, b.routes, 0, 7);
    EXPECT_EQ(std::memcmp(all.data(), run_moe(*one, b.experts, b.x, b.norm, b.routes, 0, 7).data(), all.size() * 4), 0);
    for (int64_t r = 0; r < 7; ++r) {
      const std::vector<float> alone = run_moe(*two, b.experts, b.x, b.norm, b.routes, r, 1);
      EXPECT_EQ(std::memcmp(alone.data(), all.data() + r * kEmbd, kEmbd * sizeof(float)), 0)
          << "row " << r << (compute == ComputeType::kInt8 ? " (int8)" : " (fp32)");
    }
  }
}

// The CPU backend's one-region block gives the bits of the seam's default, expert by expert.
TEST(ExpertBlock, TheFusedBlockGivesTheBitsOfOneExpertAtATime) {
  const Block b = random_block(9);
  auto backend = make_cpu_backend(2, ComputeType::kInt8);
  for (const int64_t n : {1, 7}) {
    const std::vector<float> fused = run_moe(*backend, b.experts, b.x, b.norm, b.routes, 0, n);
    const std::vector<float> apart = run_moe(*backend, b.experts, b.x, b.norm, b.routes, 0, n, /*seam_default=*/true);
    EXPECT_EQ(std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float)), 0) << n << " rows";
  }
  const Biases biases = random_biases(10);
  for (const int64_t n : {1, 7}) {
    const auto run = [&](bool seam_default) {
      return run_moe(*backend, b.experts, b.x, b.norm, b.routes, 0, n, seam_default, &biases, Activation::kSwigluOai);
    };
    const std::vector<float> fused = run(false), apart = run(true);
    EXPECT_EQ(std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float)), 0) << n << " rows, with biases";
  }
}

TEST(ExpertBlock, TheInt8PathStaysNearTheFp32Path) {
  const Block b = random_block(7);
  auto fp32 = make_cpu_backend(2, ComputeType::kFp32);
  auto int8 = make_cpu_backend(2, ComputeType::kInt8);
  const std::vector<float> exact = run_moe(*fp32, b.experts, b.x, b.norm, b.routes, 0, 7);
  const std::vector<float> quantized = run_moe(*int8, b.experts, b.x, b.norm, b.routes, 0, 7);
  double err = 0, ref = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    err += (quantized[i] - exact[i]) * (quantized[i] - exact[i]);
    ref += exact[i] * exact[i];
  }
  // Two int8 roundings (the input, then the hidden units) of 1/254 of a block's range each.
  EXPECT_LT(std::sqrt(err / ref), 0.03);
}

}  // namespace
}  // namespace ringlm

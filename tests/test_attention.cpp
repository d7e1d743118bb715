// The CPU attention kernel against attention computed from its definition in float64:
// out[i][h] = sum_j softmax_j(q[i][h] · k[j][g] / sqrt(d)) v[j][g] over j <= n_past + i, g = h / group.
// Shapes cover MHA, GQA and MQA, prefill chunks that span several query tiles and key blocks,
// decode with the keys split across threads, and 1 or 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include "backends/cpu/attention.h"

namespace ringlm::cpu {
namespace {

struct Case {
  int n_head, n_head_kv, head_dim, n_past, n_tokens;
};

std::vector<double> reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v) {
  const int group = c.n_head / c.n_head_kv, hd = c.head_dim, kv_w = c.n_head_kv * hd, q_w = c.n_head * hd;
  std::vector<double> out(static_cast<size_t>(c.n_tokens) * q_w);
  for (int i = 0; i < c.n_tokens; ++i) {
    for (int h = 0; h < c.n_head; ++h) {
      const int g = h / group, n_vis = c.n_past + i + 1;
      std::vector<double> s(static_cast<size_t>(n_vis));
      double mx = -INFINITY;
      for (int j = 0; j < n_vis; ++j) {
        double dot = 0;
        for (int e = 0; e < hd; ++e) dot += static_cast<double>(q[static_cast<size_t>(i * q_w + h * hd + e)]) * k[static_cast<size_t>(j * kv_w + g * hd + e)];
        s[static_cast<size_t>(j)] = dot / std::sqrt(static_cast<double>(hd));
        mx = std::max(mx, s[static_cast<size_t>(j)]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int e = 0; e < hd; ++e) {
        double acc = 0;
        for (int j = 0; j < n_vis; ++j) acc += s[static_cast<size_t>(j)] * v[static_cast<size_t>(j * kv_w + g * hd + e)];
        out[static_cast<size_t>(i * q_w + h * hd + e)] = acc / sum;
      }
    }
  }
  return out;
}

class Attention : public ::testing::TestWithParam<Case> {};

TEST_P(Attention, MatchesFloat64DefinitionWithOneAndTwoThreads) {
  const Case c = GetParam();
  std::mt19937 rng(static_cast<unsigned>(c.n_past * 31 + c.n_tokens));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n_keys = c.n_past + c.n_tokens;
  std::vector<float> q(static_cast<size_t>(c.n_tokens) * c.n_head * c.head_dim);
  std::vector<float> k(static_cast<size_t>(n_keys) * c.n_head_kv * c.head_dim), v(k.size());
  // Scores of a few units: the softmax is neither flat nor one-hot.
  for (float& x : q) x = normal(rng) * 0.8f;
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  const std::vector<double> expected = reference(c, q, k, v);
  for (int threads : {1, 2}) {
    AttentionScratch scratch;
    std::vector<float> out(q.size(), NAN);
    attention_causal({c.n_head, c.n_head_kv, c.head_dim}, q.data(),
                     {k.data(), v.data(), static_cast<int64_t>(c.n_head_kv) * c.head_dim}, c.n_past, c.n_tokens,
                     out.data(), scratch, threads);
    for (size_t i = 0; i < out.size(); ++i) {
      // Outputs are convex combinations of values of magnitude ~1: fp32 softmax and sums over
      // a few hundred keys stay well within 1e-5.
      ASSERT_NEAR(out[i], expected[i], 1e-5) << "threads " << threads << " index " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(Case{4, 4, 16, 0, 1}, Case{4, 4, 16, 0, 9}, Case{9, 3, 64, 0, 130},
                                           Case{9, 3, 64, 200, 33}, Case{8, 1, 32, 1000, 1}, Case{8, 2, 32, 700, 1},
                                           Case{9, 3, 64, 600, 1}, Case{6, 3, 8, 129, 70}, Case{2, 2, 64, 255, 2},
                                           Case{4, 2, 36, 50, 3}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           std::ostringstream name;  // (not operator+: GCC 12 reports a false -Wrestrict on it)
                           name << "H" << c.n_head << "_KV" << c.n_head_kv << "_D" << c.head_dim << "_past" << c.n_past
                                << "_n" << c.n_tokens;
                           return name.str();
                         });

}  // namespace
}  // namespace ringlm::cpu

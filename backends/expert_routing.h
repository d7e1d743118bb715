// A mixture of experts' routing: which experts each row of a feed-forward block goes to, and how
// much each one's output weighs in the row's sum (Backend::moe_ffn runs the experts).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backends/top_k.h"

namespace ringlm {

class PreparedWeight;

// A mixture-of-experts feed-forward block's experts: expert e's gate[e] and up[e]
// ([n_ff_exp][n_embd]) and down[e] ([n_embd][n_ff_exp]), prepared as any weight.
struct ExpertBlock {
  std::span<const PreparedWeight* const> gate, up, down;
  // Biases of every expert's products (gpt-oss), in activation memory: [n_expert][n_ff_exp] for
  // gate and up, [n_expert][n_embd] for down. nullptr: none.
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
  bool has_biases() const { return gate_bias != nullptr || up_bias != nullptr || down_bias != nullptr; }
  // Activation memory for Backend::moe_ffn's default, room for `scratch_routes` routed rows: the
  // gathered input rows and the products ([routes][n_embd]), the hidden units ([routes][n_ff_exp]).
  // Null: it allocates its own per call (the CPU backend keeps buffers of its own).
  float* scratch_rows = nullptr;
  float* scratch_hidden = nullptr;
  float* scratch_products = nullptr;
  float* scratch_up = nullptr;  // (a block with biases: the up products, [routes][n_ff_exp])
  int64_t scratch_routes = 0;
};

// Each row's k experts and their weights, [rows][k] each, on the host.
struct ExpertRoutes {
  int k = 0;
  std::span<const int32_t> experts;
  std::span<const float> weights;
  int64_t rows() const { return k > 0 ? static_cast<int64_t>(experts.size()) / k : 0; }
};

// The routes of the rows of `logits` ([rows][n_expert], the router's product): each row's k
// largest logits (the lower expert first among equals; a NaN never chosen while there are other
// experts), weighted by the softmax over the chosen k (`normalize`: Mixtral, Qwen3-MoE), or by
// the softmax over all n_expert (not renormalised: their weights then sum to less than 1).
// `experts` and `weights` are [rows][k].
void route_experts(std::span<const float> logits, int n_expert, int k, bool normalize, std::span<int32_t> experts,
                   std::span<float> weights);

// One row's route from its chosen experts (select_top_k's order, {-1, -inf} where none was left):
// each weighted by the softmax over the chosen logits, the largest subtracted first. A pick
// that is none stands in as expert 0 with weight 0 (the block adds nothing for it).
void weigh_chosen(std::span<const TopLogit> top, std::span<int32_t> experts, std::span<float> weights);

// The rows each expert serves: what a product grouped by expert runs, with each row's weight.
struct ExpertGroups {
  std::vector<int64_t> start;   // [n_expert + 1]: expert e's entries are [start[e], start[e + 1])
  std::vector<int64_t> row;     // the routed rows, grouped by expert, ascending within an expert
  std::vector<float> weight;    // ... and the weight of that expert's output in each
  std::vector<int64_t> next;    // (filling them)
  int64_t count(int e) const { return start[static_cast<size_t>(e) + 1] - start[static_cast<size_t>(e)]; }
};
ExpertGroups group_by_expert(const ExpertRoutes& routes, int n_expert);
// The same into `groups`, reusing its memory.
void group_by_expert(const ExpertRoutes& routes, int n_expert, ExpertGroups& groups);

// For each row, its entries in `groups` ([rows][k]), in ascending order of expert.
void entries_by_row(const ExpertGroups& groups, int64_t n_rows, int k, std::vector<int64_t>& entries);

// out[r] = sum over j of groups.weight[e_j] * products[e_j] ([width] each), e_j = entries[r][j]
// in order, for the rows [r0, r1): each weighted product rounded to a float and then added (no
// fused multiply-add: the bits of Backend::moe_ffn's scale-then-add).
void sum_weighted_rows(const ExpertGroups& groups, std::span<const int64_t> entries, int k, const float* products,
                       int64_t width, int64_t r0, int64_t r1, float* out);

}  // namespace ringlm

// The most likely next tokens of a step: what a sampler that keeps only the top k (or the one
// best, when greedy) needs from the logits. A device picks them itself and sends back k pairs
// instead of the whole vocabulary (Backend::top_k).
#pragma once

#include <cstdint>
#include <span>

namespace ringlm {

// A token and its logit.
struct TopLogit {
  int32_t id;
  float logit;
};

// The largest value's index (the lowest index among equals; NaNs are never it, but a NaN first
// value gives 0, as std::max_element would).
int32_t argmax(std::span<const float> values);

// The top.size() largest values, largest first and the lowest index first among equals, NaNs
// never picked; past the values there are, {-1, -inf}. The order a device's top-k gives too.
void select_top_k(std::span<const float> values, std::span<TopLogit> top);

}  // namespace ringlm

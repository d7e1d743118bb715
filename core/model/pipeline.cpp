#include "core/model/pipeline.h"

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/gguf/gguf.h"

namespace ringlm {

std::vector<int> split_layers_by_bytes(std::span<const size_t> layer_bytes, int stages) {
  const int n_layer = static_cast<int>(layer_bytes.size());
  if (stages < 1 || n_layer < stages) {
    throw std::invalid_argument("cannot split " + std::to_string(n_layer) + " layers into " + std::to_string(stages) +
                                " pipeline stages (one layer at least each)");
  }
  const double total = std::accumulate(layer_bytes.begin(), layer_bytes.end(), 0.0);
  std::vector<int> counts;
  int begin = 0;
  double before = 0;  // bytes of the layers of the stages so far
  for (int s = 0; s < stages - 1; ++s) {
    // The cut nearest to s + 1 equal shares, leaving a layer for each stage after this one.
    const double target = total * (s + 1) / stages;
    int end = begin + 1;
    double upto = before + static_cast<double>(layer_bytes[static_cast<size_t>(begin)]);
    while (end < n_layer - (stages - 1 - s)) {
      const double next = upto + static_cast<double>(layer_bytes[static_cast<size_t>(end)]);
      if (std::fabs(next - target) >= std::fabs(upto - target)) break;
      upto = next;
      ++end;
    }
    counts.push_back(end - begin);
    begin = end;
    before = upto;
  }
  counts.push_back(n_layer - begin);
  return counts;
}

PipelineStage stage_of_split(std::span<const int> layers_per_stage, int n_layer, int index) {
  int total = 0;
  for (const int n : layers_per_stage) {
    if (n < 1) throw std::invalid_argument("a pipeline stage needs at least one layer (got " + std::to_string(n) + ")");
    total += n;
  }
  if (total != n_layer) {
    throw std::invalid_argument("the layer split gives " + std::to_string(total) + " layers; the model has " +
                                std::to_string(n_layer));
  }
  const int count = static_cast<int>(layers_per_stage.size());
  if (index < 0 || index >= count) {
    throw std::invalid_argument("pipeline stage " + std::to_string(index) + " of a split into " + std::to_string(count));
  }
  PipelineStage stage{index, count, 0, 0};
  for (int s = 0; s < index; ++s) stage.first_layer += layers_per_stage[static_cast<size_t>(s)];
  stage.end_layer = stage.first_layer + layers_per_stage[static_cast<size_t>(index)];
  return stage;
}

std::vector<int> parse_layer_split(const std::string& text) {
  std::vector<int> counts;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long n = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || n < 1 || n > (1 << 16)) {
      throw std::invalid_argument("--layer-split '" + text + "': '" + item + "' is not a positive layer count");
    }
    counts.push_back(static_cast<int>(n));
    at = comma + 1;
  }
  return counts;
}

std::vector<size_t> layer_weight_bytes(const GgufFile& gguf, int n_layer) {
  std::vector<size_t> bytes(static_cast<size_t>(n_layer), 0);
  for (const GgufTensorInfo& t : gguf.tensors()) {
    if (!t.name.starts_with("blk.")) continue;
    const int layer = std::atoi(t.name.c_str() + 4);
    if (layer >= 0 && layer < n_layer) bytes[static_cast<size_t>(layer)] += t.n_bytes;
  }
  return bytes;
}

}  // namespace ringlm

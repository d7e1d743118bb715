// Weights on the device and the products over them: which weights the device takes (and how many
// rows of input per call), their upload, and the launches of matmul / matmul2 (one weight, or up
// to three on one input: q, k and v, or gate and up with the activation).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "backends/backend.h"
#include "backends/plugin/device_link.h"
#include "backends/plugin/residency.h"

namespace ringlm {

// A weight in device memory, or (on_device == false) one the CPU backend prepared.
class PluginWeight final : public PreparedWeight {
 public:
  PluginWeight(int64_t rows, int64_t cols) : PreparedWeight(rows, cols) {}
  bool on_device = false;
  TensorType type = TensorType::F32;
  const uint8_t* source = nullptr;  // the weight as the model file holds it (rows())
  DeviceBuffer data;
  int64_t max_rows = 1;  // largest M one device call takes
  std::unique_ptr<PreparedWeight> cpu;
};

inline const PluginWeight& as_plugin_weight(const PreparedWeight& w) { return static_cast<const PluginWeight&>(w); }

// The weight formats the ABI can name (plugin_api.h's ringlm_format = the GGUF type id).
bool nameable_format(TensorType type);
// Whether the device's plugin ABI names the activation (gpt-oss's clamped SwiGLU from ABI 4;
// with an older plugin it runs on the CPU), and its code there (plugin_api.h's ringlm_activation).
bool device_activation(Activation act, const DeviceLink& link);
uint32_t activation_code(Activation act);

// The RMSNorm fused into a product's input: its weight on the device, and epsilon.
struct DeviceNorm {
  DeviceSpan weight;
  float eps = 0.0f;
};

class DeviceProducts {
 public:
  DeviceProducts(const DeviceLink& link, Residency& residency) : link_(link), residency_(residency) {}

  // The largest M the device multiplies a weight of this type and shape by in one call; 0: the
  // device does not take it at all.
  int64_t device_rows_for(TensorType type, int64_t rows, int64_t cols) const;
  // The weight's bytes into device memory; a device out of memory says what did not fit and how
  // many layers did (`fitted`: the device's layers placed before this one).
  void upload(PluginWeight& prepared, const WeightView& w, int fitted);

  // y = x · wᵀ for n_tokens rows at `in`, in chunks of the device's flat-GEMM rows, into y on
  // the device (an allocation) or downloaded to it (any other pointer). With ABI v2 the product
  // can take the norm of its input and add itself to y (accumulate, y on the device).
  void product(const PluginWeight& w, DeviceSpan in, int64_t n_tokens, float* y, const DeviceNorm* norm = nullptr,
               bool accumulate = false);
  // Whether the device's weights can multiply one input in one launch (matmul2's parts): ABI v2,
  // two or three weights of one format, every output in device memory.
  bool can_fuse(const std::vector<const PluginWeight*>& weights, const std::vector<float*>& ys, int64_t n_tokens) const;
  // ys[i] = in · weights[i]ᵀ for every weight in one launch per chunk of rows, or with `glu` (two
  // weights, one output) ys[0] = act(in · gateᵀ) * (in · upᵀ).
  void fused(const std::vector<const PluginWeight*>& weights, DeviceSpan in, int64_t n_tokens,
             const std::vector<float*>& ys, const DeviceNorm* norm, std::optional<Activation> glu = std::nullopt);

  size_t weight_bytes() const { return weight_bytes_; }

 private:
  const DeviceLink& link_;
  Residency& residency_;
  size_t weight_bytes_ = 0;  // uploaded so far
  DeviceBuffer y_buffer_;    // staging of products into host memory
};

}  // namespace ringlm

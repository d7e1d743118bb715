#include "backends/plugin/device_products.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ringlm {
namespace {

// Rows the device's flat GEMM takes per call (FlashDecoding++'s flat GEMM: M = 1..16); larger
// inputs are cut into such chunks, unless the plugin multiplies up to kMaxGemmRows at once
// (ABI v3, RINGLM_OP_GEMM: a prompt chunk of the model's largest batch in one launch).
constexpr int64_t kMaxDeviceRows = 16;
constexpr int64_t kMaxGemmRows = 512;

}  // namespace

bool nameable_format(TensorType type) {
  switch (type) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::Q4_0:
    case TensorType::Q4_1:
    case TensorType::Q8_0:
    case TensorType::Q5_0:
    case TensorType::Q5_1:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
    case TensorType::IQ4_NL:
    case TensorType::IQ4_XS:
    case TensorType::MXFP4:
      return true;
    default:
      return false;
  }
}

bool device_activation(Activation act, const DeviceLink& link) { return act != Activation::kSwigluOai || link.v4(); }

uint32_t activation_code(Activation act) {
  switch (act) {
    case Activation::kGeluTanh: return RINGLM_ACT_GELU_TANH;
    case Activation::kSwigluOai: return RINGLM_ACT_SWIGLU_OAI;
    default: return RINGLM_ACT_SILU;
  }
}

int64_t DeviceProducts::device_rows_for(TensorType type, int64_t rows, int64_t cols) const {
  if (!nameable_format(type)) return 0;
  ringlm_op_desc desc{};
  desc.op = RINGLM_OP_MATMUL;
  desc.weight_format = static_cast<uint32_t>(type);
  desc.n = rows;
  desc.k = cols;
  if (link_.v3()) {
    ringlm_op_desc gemm = desc;
    gemm.op = RINGLM_OP_GEMM;
    gemm.m = kMaxGemmRows;
    if (link_.supports(gemm)) return kMaxGemmRows;
  }
  for (int64_t m = kMaxDeviceRows; m >= 1; m /= 2) {
    desc.m = m;
    if (link_.supports(desc)) return m;
  }
  return 0;
}

void DeviceProducts::upload(PluginWeight& prepared, const WeightView& w, int fitted) {
  const size_t bytes = row_bytes(w.type, w.cols) * static_cast<size_t>(w.rows);
  try {
    prepared.data = link_.alloc(bytes);
    prepared.data.upload(0, w.data, bytes);
  } catch (const std::exception& e) {
    const auto mib = [](size_t b) { return std::to_string((b + (1 << 20) - 1) >> 20) + " MiB"; };
    // One layer fewer than fitted leaves room for the KV cache and activations.
    const std::string advice = fitted > 1 ? "; " + std::to_string(fitted) + " layers fitted before it: try --gpu-layers " +
                                                std::to_string(fitted - 1)
                                          : "; try --gpu-layers 0";
    throw std::runtime_error(link_.label() + ": " + w.name + " (" + mib(bytes) + ") does not fit in device memory after " +
                             mib(weight_bytes_) + " of weights" + advice + "\n  (" + e.what() + ")");
  }
  weight_bytes_ += bytes;
}

void DeviceProducts::product(const PluginWeight& w, DeviceSpan in, int64_t n_tokens, float* y, const DeviceNorm* norm,
                             bool accumulate) {
  const size_t ny = static_cast<size_t>(n_tokens * w.rows());
  const bool direct = residency_.on_device(y, ny);
  DeviceSpan out;
  if (direct) {
    out = accumulate ? residency_.device_write(y, ny) : residency_.device_overwrite(y, ny);
  } else {
    link_.ensure(y_buffer_, ny * sizeof(float));
    out = {y_buffer_.get(), 0};
  }
  for (int64_t m0 = 0; m0 < n_tokens; m0 += w.max_rows) {
    ringlm_matmul_args args{};
    args.weight = w.data.get();
    args.weight_format = static_cast<uint32_t>(w.type);
    args.n = w.rows();
    args.k = w.cols();
    args.x = in.buffer;
    args.x_offset = in.offset + static_cast<size_t>(m0 * w.cols()) * sizeof(float);
    args.y = out.buffer;
    args.y_offset = out.offset + static_cast<size_t>(m0 * w.rows()) * sizeof(float);
    args.m = std::min(w.max_rows, n_tokens - m0);
    if (!link_.v2()) {
      link_.check(link_.api().matmul(link_.context(), &args), "matmul");
      continue;
    }
    ringlm_matmul2_args fused{};
    fused.base = args;
    if (norm != nullptr) {
      fused.rms_weight = norm->weight.buffer;
      fused.rms_weight_offset = norm->weight.offset;
      fused.rms_eps = norm->eps;
    }
    fused.accumulate = accumulate ? 1 : 0;
    link_.check(link_.api().matmul2(link_.context(), &fused), "matmul2");
  }
  if (!direct) y_buffer_.download(0, residency_.host_write(y, ny), ny * sizeof(float));
}

bool DeviceProducts::can_fuse(const std::vector<const PluginWeight*>& weights, const std::vector<float*>& ys,
                              int64_t n_tokens) const {
  if (!link_.v2() || weights.size() < 2 || weights.size() > 3) return false;
  for (const PluginWeight* w : weights) {
    if (!w->on_device || w->type != weights[0]->type || w->cols() != weights[0]->cols()) return false;
  }
  for (size_t i = 0; i < ys.size(); ++i) {
    if (!residency_.on_device(ys[i], static_cast<size_t>(n_tokens * weights[i]->rows()))) return false;
  }
  return true;
}

void DeviceProducts::fused(const std::vector<const PluginWeight*>& weights, DeviceSpan in, int64_t n_tokens,
                           const std::vector<float*>& ys, const DeviceNorm* norm, std::optional<Activation> glu) {
  std::vector<DeviceSpan> outs;
  for (size_t i = 0; i < ys.size(); ++i) {
    outs.push_back(residency_.device_overwrite(ys[i], static_cast<size_t>(n_tokens * weights[i]->rows())));
  }
  int64_t max_rows = kMaxGemmRows;
  for (const PluginWeight* w : weights) max_rows = std::min(max_rows, w->max_rows);
  const int64_t cols = weights[0]->cols();
  for (int64_t m0 = 0; m0 < n_tokens; m0 += max_rows) {
    ringlm_matmul2_args args{};
    const auto part_y = [&](size_t i) { return outs[i].offset + static_cast<size_t>(m0 * weights[i]->rows()) * sizeof(float); };
    args.base.weight = weights[0]->data.get();
    args.base.weight_format = static_cast<uint32_t>(weights[0]->type);
    args.base.n = weights[0]->rows();
    args.base.k = cols;
    args.base.x = in.buffer;
    args.base.x_offset = in.offset + static_cast<size_t>(m0 * cols) * sizeof(float);
    args.base.y = outs[0].buffer;
    args.base.y_offset = part_y(0);
    args.base.m = std::min(max_rows, n_tokens - m0);
    if (norm != nullptr) {
      args.rms_weight = norm->weight.buffer;
      args.rms_weight_offset = norm->weight.offset;
      args.rms_eps = norm->eps;
    }
    args.n_more = static_cast<int32_t>(weights.size() - 1);
    for (size_t i = 1; i < weights.size(); ++i) {
      ringlm_matmul_part& part = args.more[i - 1];
      part.weight = weights[i]->data.get();
      part.n = weights[i]->rows();
      if (i < outs.size()) {
        part.y = outs[i].buffer;
        part.y_offset = part_y(i);
      }
    }
    if (glu) {
      args.glu = 1;
      args.activation = activation_code(*glu);
    }
    link_.check(link_.api().matmul2(link_.context(), &args), "matmul2");
  }
}

}  // namespace ringlm

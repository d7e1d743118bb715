// PluginBackend: the Backend of a plugin's device (backends/plugin_backend.h), put together from
// its units: DeviceLink (the device), Residency (which copy of an activation is newest),
// DeviceProducts (weights and products), DeviceKv (the KV caches' device copies), and here the
// dispatcher that runs each op of the seam on the device or on the CPU it wraps.
#include "backends/plugin_backend.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/activation.h"
#include "backends/plugin/device_kv.h"
#include "backends/plugin/device_link.h"
#include "backends/plugin/device_products.h"
#include "backends/plugin/residency.h"

namespace ringlm {
namespace {

Operand in(const float* p, size_t n) { return {p, n, Access::kRead}; }
Operand inout(const float* p, size_t n) { return {p, n, Access::kUpdate}; }
Operand out(const float* p, size_t n) { return {p, n, Access::kOverwrite}; }

// A RoPE the device has not run yet (rope()).
struct HeldRope {
  float* x;
  int64_t n_rows;
  int n_heads, head_dim;
  RopeAngles angles;
  size_t size() const { return static_cast<size_t>(n_rows) * n_heads * head_dim; }
  size_t n_angles() const { return static_cast<size_t>(n_rows) * static_cast<size_t>(angles.n_rot / 2); }
  // The device call, given where the angles and x are.
  ringlm_rope_args args(DeviceSpan cos, DeviceSpan sin, DeviceSpan io) const {
    ringlm_rope_args a{};
    a.x = io.buffer;
    a.x_offset = io.offset;
    a.n_rows = n_rows;
    a.n_heads = n_heads;
    a.head_dim = head_dim;
    a.n_rot = angles.n_rot;
    a.adjacent_pairs = angles.adjacent_pairs ? 1 : 0;
    a.cos = cos.buffer;
    a.cos_offset = cos.offset;
    a.sin = sin.buffer;
    a.sin_offset = sin.offset;
    return a;
  }
};

class PluginBackend final : public Backend {
 public:
  PluginBackend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu, const DevicePlacement& placement)
      : link_(std::move(device)),
        residency_(link_),
        products_(link_, residency_),
        kv_(link_, residency_),
        cpu_(std::move(cpu)),
        gpu_layers_(placement.gpu_layers),
        cpu_moe_layers_(placement.cpu_moe_layers),
        name_(link_.opened()->plugin->name()) {}

  std::string_view name() const override { return name_; }
  std::string device_description() const override { return link_.label(); }
  bool offloads() const override { return true; }
  std::string cpu_fallback_report() const override {
    std::string layers;
    if (first_device_layer_ > 0 || !output_on_device_) {
      layers = link_.label() + ": " +
               (first_device_layer_ >= n_layer_
                    ? "every layer and the output run on the CPU"
                    : "layers 0-" + std::to_string(first_device_layer_ - 1) + " of " + std::to_string(n_layer_) +
                          " run on the CPU, " + std::to_string(first_device_layer_) + "-" + std::to_string(n_layer_ - 1) +
                          " and the output on the device") +
               " (--gpu-layers " + std::to_string(gpu_layers_) + ")";
    }
    if (cpu_moe_layers_ != 0) {
      if (!layers.empty()) layers += "\nringlm: ";
      layers += link_.label() + ": the experts of " +
                (cpu_moe_layers_ < 0 ? "every layer" : "layers 0-" + std::to_string(cpu_moe_layers_ - 1)) +
                " run on the CPU (" + (cpu_moe_layers_ < 0 ? "--cpu-moe" : "--n-cpu-moe " + std::to_string(cpu_moe_layers_)) + ")";
    }
    if (cpu_weight_types_.empty()) return layers;
    if (!layers.empty()) layers += "\nringlm: ";
    int n_cpu = 0;
    std::string types;
    for (const auto& [type, count] : cpu_weight_types_) {
      n_cpu += count;
      types += (types.empty() ? "" : ", ") + type + " x" + std::to_string(count);
    }
    return layers + link_.label() + ": " + std::to_string(n_cpu) + " of " + std::to_string(n_weights_) +
           " weights run on the CPU (" + types + "; the plugin does not take them)";
  }

  // The device runs a product when it takes every weight format at some shape (a row of 256
  // columns: every format's blocks fit it); the row-wise ops and the fused products need ABI v2,
  // the top k v3; attention and the shift of an F16 or F32 cache run on the device whenever its
  // geometry does (asked at the first call: see DeviceKv::why_not_on_device).
  bool supports(BackendOp op, std::span<const TensorType> types) const override {
    const auto device_multiplies = [&] {
      return std::all_of(types.begin(), types.end(),
                         [&](TensorType t) { return products_.device_rows_for(t, 32, 256) > 0; });
    };
    const auto kv_type = [&] {
      return std::all_of(types.begin(), types.end(), [](TensorType t) { return t == TensorType::F16 || t == TensorType::F32; });
    };
    switch (op) {
      case BackendOp::kMatmul:
      case BackendOp::kMatmulMany:
        return device_multiplies();
      case BackendOp::kMatmulAdd:
      case BackendOp::kMatmulGlu:
      case BackendOp::kRows:
      case BackendOp::kMoeFfn:  // Backend's: the fused product, copies and row-wise ops, each on the device
        return link_.v2() && device_multiplies();
      case BackendOp::kRoute:  // Backend's: the product, the bias and the device's top k
        return link_.v3() && device_multiplies();
      case BackendOp::kAttention:
      case BackendOp::kShiftKeys:
        return kv_type();
      case BackendOp::kStoreKv:
        return link_.v2() && kv_type();
      case BackendOp::kTopK:
        return link_.v3();
      case BackendOp::kRope:
      case BackendOp::kAdd:
      case BackendOp::kAddRow:
      case BackendOp::kScale:
      case BackendOp::kRmsNorm:
      case BackendOp::kCopy:
      case BackendOp::kGlu:
        return link_.v2();
    }
    return false;
  }

  // --- Layers on the device and on the CPU ------------------------------------------------
  // With --gpu-layers N the last N layers and the output run on the device, the first ones on
  // the CPU: their weights stay there (prepare places each by WeightView::layer), and their ops
  // (begin_layer) run on the host mirrors, the KV rows of their layers on the host, so the
  // hidden state crosses once, where the device's layers begin.

  void plan_layers(int n_layer) override {
    n_layer_ = n_layer;
    first_device_layer_ = gpu_layers_ < 0 ? 0 : std::max(0, n_layer - gpu_layers_);
    output_on_device_ = gpu_layers_ != 0;
    kv_.set_first_device_layer(first_device_layer_);
  }

  void begin_layer(int layer) override {
    run([&] {
      // The embedding runs where the first layer does.
      on_cpu_ = !layer_on_device(std::max(layer, 0));
    });
  }

  std::string layer_device(int layer) const override { return layer_on_device(layer) ? link_.short_name() : "cpu"; }

  DeviceCounters counters() const override {
    DeviceCounters c;
    if (!link_.v2()) return c;
    ringlm_counters raw{};
    link_.check(link_.api().counters(link_.context(), &raw), "counters");
    c.launches = raw.launches;
    c.upload_bytes = raw.upload_bytes;
    c.download_bytes = raw.download_bytes;
    c.waits = raw.waits;
    return c;
  }

  // --- Activation memory ------------------------------------------------------------------
  // With ABI v2 every allocation has a device buffer and a host mirror (Residency); a version-1
  // plugin runs no op on activations in device memory, so its are host memory.

  std::unique_ptr<ActivationBuffer> alloc_activations(size_t n) override {
    return link_.v2() ? residency_.alloc(n) : Backend::alloc_activations(n);
  }

  void write(float* dst, const float* src, size_t n) override {
    run([&] {
      if (n > 0) std::memcpy(residency_.host_write(dst, n), src, n * sizeof(float));
    });
  }

  void read(const float* src, float* dst, size_t n) override {
    run([&] {
      if (n > 0) std::memcpy(dst, residency_.host_read(src, n), n * sizeof(float));
    });
  }

  void copy(float* dst, const float* src, size_t n) override {
    run([&] {
      if (n == 0) return;
      if (residency_.on_device(dst, n) && residency_.on_device(src, n)) {
        const DeviceSpan from = residency_.device_read(src, n);
        const DeviceSpan to = residency_.device_write(dst, n);
        link_.check(link_.api().copy(link_.context(), to.buffer, to.offset, from.buffer, from.offset, n * sizeof(float)),
                    "copy");
        return;
      }
      const float* from = residency_.host_read(src, n);
      std::memcpy(residency_.host_write(dst, n), from, n * sizeof(float));
    });
  }

  // --cpu-moe / --n-cpu-moe: a block whose experts all stay on the CPU runs there whole (its one
  // parallel region), the rest of the layer on the device: the hidden rows cross to the host and
  // the block's sum comes back, once each way. Otherwise the seam's default, op by op.
  void moe_ffn(const ExpertBlock& experts, const ExpertRoutes& routes, const MatmulInput& in, Activation act,
               float* out) override {
    const auto on_cpu = [](const PreparedWeight* w) { return !as_plugin_weight(*w).on_device; };
    const bool all_on_cpu = std::all_of(experts.gate.begin(), experts.gate.end(), on_cpu) &&
                            std::all_of(experts.up.begin(), experts.up.end(), on_cpu) &&
                            std::all_of(experts.down.begin(), experts.down.end(), on_cpu);
    if (!all_on_cpu) return Backend::moe_ffn(experts, routes, in, act, out);
    run([&] {
      const auto cpu_weights = [](std::span<const PreparedWeight* const> from, std::vector<const PreparedWeight*>& to) {
        to.clear();
        for (const PreparedWeight* w : from) to.push_back(as_plugin_weight(*w).cpu.get());
      };
      cpu_weights(experts.gate, cpu_gate_);
      cpu_weights(experts.up, cpu_up_);
      cpu_weights(experts.down, cpu_down_);
      const int64_t d = experts.down[0]->rows();
      const auto n = static_cast<size_t>(in.n_tokens * d);
      const float* x = residency_.host_read(in.x, n);
      const float* norm = in.rms_weight != nullptr ? residency_.host_read(in.rms_weight, static_cast<size_t>(d)) : nullptr;
      float* const sum = residency_.host_overwrite(out, n);
      ExpertBlock block{cpu_gate_, cpu_up_, cpu_down_};
      const auto n_expert = experts.gate.size(), ff = static_cast<size_t>(experts.gate[0]->rows());
      const auto bias = [&](const float* b, size_t width) { return b != nullptr ? residency_.host_read(b, n_expert * width) : nullptr; };
      block.gate_bias = bias(experts.gate_bias, ff);
      block.up_bias = bias(experts.up_bias, ff);
      block.down_bias = bias(experts.down_bias, static_cast<size_t>(d));
      cpu_->moe_ffn(block, routes, MatmulInput{x, in.n_tokens, norm, in.rms_eps}, act, sum);
    });
  }

  // The device picks the top k of values it computed (a step's logits) and sends back k pairs
  // instead of the n values; values the host holds the newest of are picked on the host.
  void top_k(const float* x, int64_t n_rows, int64_t n, int k, std::span<TopLogit> top) override {
    run([&] {
      const size_t count = static_cast<size_t>(n_rows * n);
      if (!link_.v3() || !residency_.device_newest(x, count) || k < 1 || k > RINGLM_TOP_K_MAX || k > n) {
        return Backend::top_k(residency_.host_read(x, count), n_rows, n, k, top);
      }
      static_assert(sizeof(TopLogit) == sizeof(ringlm_top_entry) && offsetof(TopLogit, logit) == offsetof(ringlm_top_entry, value));
      const DeviceSpan values = residency_.device_read(x, count);
      const size_t bytes = static_cast<size_t>(n_rows) * static_cast<size_t>(k) * sizeof(TopLogit);
      link_.ensure(top_buffer_, bytes);
      ringlm_top_k_args args{};
      args.x = values.buffer;
      args.x_offset = values.offset;
      args.n_rows = n_rows;
      args.n = n;
      args.k = k;
      args.out = top_buffer_.get();
      link_.check(link_.api().top_k(link_.context(), &args), "top_k");
      top_buffer_.download(0, top.data(), bytes);
    });
  }

  // --- Weights and products ---------------------------------------------------------------
  // A weight goes where its layer runs (WeightView::layer; the output and unplaced weights with
  // the output), and to the CPU where the device does not take its format or shape.
  std::unique_ptr<PreparedWeight> prepare(const WeightView& w) override {
    auto prepared = std::make_unique<PluginWeight>(w.rows, w.cols);
    prepared->type = w.type;
    prepared->source = w.data;
    ++n_weights_;
    const bool in_a_layer = w.layer >= 0 && w.layer < n_layer_;
    const bool experts_on_cpu = w.expert && in_a_layer && (cpu_moe_layers_ < 0 || w.layer < cpu_moe_layers_);
    const bool placed_on_device = in_a_layer ? w.layer >= first_device_layer_ && !experts_on_cpu : output_on_device_;
    prepared->max_rows = placed_on_device ? products_.device_rows_for(w.type, w.rows, w.cols) : 0;
    if (prepared->max_rows > 0) {
      prepared->on_device = true;
      // The model places the output first, then the layers in order: the layers placed before
      // this one fitted beside the output.
      products_.upload(*prepared, w, in_a_layer ? w.layer - first_device_layer_ : 0);
    } else {
      prepared->cpu = cpu_->prepare(w);
      if (placed_on_device) ++cpu_weight_types_[std::string(type_traits(static_cast<uint32_t>(w.type))->name)];
    }
    return prepared;
  }

  void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out_rows) override {
    const PluginWeight& w = as_plugin_weight(weight);
    const size_t n = ids.size() * static_cast<size_t>(w.cols());
    const auto on_device = [&](const std::array<DeviceSpan, 1>& to) {
      link_.ensure(ids_buffer_, ids.size_bytes());
      link_.upload_staged(ids_buffer_, ids.data(), ids.size_bytes());
      ringlm_get_rows_args args{};
      args.weight = w.data.get();
      args.weight_format = static_cast<uint32_t>(w.type);
      args.n_weight_rows = w.rows();
      args.cols = w.cols();
      args.ids = ids_buffer_.get();
      args.n_ids = static_cast<int64_t>(ids.size());
      args.out = to[0].buffer;
      args.out_offset = to[0].offset;
      link_.check(link_.api().get_rows(link_.context(), &args), "get_rows");
    };
    const auto on_cpu = [&](const std::array<float*, 1>& host) {
      if (!w.on_device) return cpu_->rows(*w.cpu, ids, host[0]);
      // The device copy was uploaded whole; the file's pages are still mapped (only the CPU
      // backend gives them back).
      const size_t stride = row_bytes(w.type, w.cols());
      for (size_t i = 0; i < ids.size(); ++i) {
        dequantize_row(w.type, w.source + static_cast<size_t>(ids[i]) * stride, host[0] + static_cast<int64_t>(i) * w.cols(),
                       w.cols());
      }
    };
    rowwise(std::array{out(out_rows, n)}, on_device, on_cpu, w.on_device);
  }

  void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    run([&] {
      const PluginWeight& w = as_plugin_weight(weight);
      const size_t nx = static_cast<size_t>(n_tokens * w.cols()), ny = static_cast<size_t>(n_tokens * w.rows());
      if (!w.on_device) return cpu_->matmul(*w.cpu, residency_.host_read(x, nx), n_tokens, residency_.host_overwrite(y, ny));
      products_.product(w, residency_.device_input(x, nx), n_tokens, y);
    });
  }

  void matmul_add(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    run([&] {
      const PluginWeight& w = as_plugin_weight(weight);
      const size_t nx = static_cast<size_t>(n_tokens * w.cols()), ny = static_cast<size_t>(n_tokens * w.rows());
      if (w.on_device && residency_.on_device(y, ny)) {  // the residual fused into the product (matmul2)
        products_.product(w, residency_.device_input(x, nx), n_tokens, y, nullptr, /*accumulate=*/true);
        return;
      }
      float* product = scratch(residual_, ny);
      matmul(weight, x, n_tokens, product);
      add(y, product, static_cast<int64_t>(ny));
    });
  }

  // The CPU's weights in one fused call, the device's on one normalised input.
  void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                   std::span<float* const> ys) override {
    run([&] {
      many_on_cpu(weights, input, ys);
      many_on_device(weights, input, ys);
    });
  }

  void matmul_glu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input,
                  Activation act, float* out_rows) override {
    run([&] {
      const PluginWeight& g = as_plugin_weight(gate);
      const PluginWeight& u = as_plugin_weight(up);
      const size_t n = static_cast<size_t>(input.n_tokens * g.rows());
      if (!g.on_device && !u.on_device) {
        const MatmulInput host_input = on_host(input, g.cols());
        return cpu_->matmul_glu(*g.cpu, *u.cpu, host_input, act, residency_.host_overwrite(out_rows, n));
      }
      if (glu_in_one_launch(g, u, input, act, out_rows)) return;
      float* up_out = scratch(up_out_, n);
      const PreparedWeight* both[] = {&gate, &up};
      float* const outs[] = {out_rows, up_out};
      matmul_many(both, input, outs);
      device_glu(up_out, out_rows, n, act);
    });
  }

  // --- Row-wise ops -----------------------------------------------------------------------
  // RoPE on the device waits for what comes next: when it is the store of the rotated keys (and
  // their values) into a cache, q's and k's RoPE and the store run as one launch (rope_store);
  // anything else runs the held RoPE first, as issued (run()).
  void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) override {
    const HeldRope r{x, n_rows, n_heads, head_dim, angles};
    if (device_runs(std::array{in(angles.cos, r.n_angles()), in(angles.sin, r.n_angles()), inout(x, r.size())})) {
      if (held_ropes_.size() == 2) run_held_ropes();
      held_ropes_.push_back(r);
      return;
    }
    rope_now(r);
  }

  void glu(Activation act, float* gate, const float* up, int64_t n) override {
    device_glu(up, gate, static_cast<size_t>(n), act);
  }

  void add(float* x, const float* delta, int64_t n) override { add_repeated(x, delta, n, n); }
  void add_row(float* x, const float* row, int64_t n_rows, int64_t width) override {
    add_repeated(x, row, n_rows * width, width);
  }

  void scale(float* x, int64_t n, float factor) override {
    rowwise(
        std::array{inout(x, static_cast<size_t>(n))},
        [&](const std::array<DeviceSpan, 1>& s) {
          link_.check(link_.api().scale(link_.context(), s[0].buffer, s[0].offset, n, factor), "scale");
        },
        [&](const std::array<float*, 1>& host) { cpu_->scale(host[0], n, factor); });
  }

  void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) override {
    const size_t n = static_cast<size_t>(n_rows * width);
    rowwise(
        std::array{in(weight, static_cast<size_t>(width)), inout(x, n)},
        [&](const std::array<DeviceSpan, 2>& s) { device_rms_norm(s[1], s[1], s[0], n_rows, width, eps); },
        [&](const std::array<float*, 2>& host) { cpu_->rms_norm(host[1], n_rows, width, host[0], eps); });
  }

  // --- The attention block (DeviceKv) -----------------------------------------------------
  void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) override {
    refuse_quantized_cache(kv);
    if (fuse_rope_store(kv, layer, first_slot, n, k, v)) return;
    run([&] {
      const size_t count = static_cast<size_t>(n) * static_cast<size_t>(kv.row_width);
      if (on_cpu_) {  // a layer on the CPU: its rows live on the host alone
        cpu_->store_kv(kv, layer, first_slot, n, residency_.host_read(k, count), residency_.host_read(v, count));
        return;
      }
      if (kv_.may_hold(kv) && residency_.on_device(k, count) && residency_.on_device(v, count) &&
          kv_.store(kv, layer, first_slot, n, k, v)) {
        return;
      }
      kv_.before_host_store(kv);
      cpu_->store_kv(kv, layer, first_slot, n, residency_.host_read(k, count), residency_.host_read(v, count));
      kv_.after_host_store(kv, layer, first_slot, n);
    });
  }

  void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) override {
    for (const AttentionCall& call : calls) refuse_quantized_cache(*call.kv);
    run([&] {
      cpu_calls_.clear();
      const auto on_host = [&](const AttentionCall& call) {
        const size_t n = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim;
        AttentionCall host = call;
        host.q = residency_.host_read(call.q, n);
        host.out = residency_.host_overwrite(call.out, n);
        cpu_calls_.push_back(host);
      };
      for (const AttentionCall& call : calls) {
        if (on_cpu_) {  // a layer on the CPU, over its rows on the host
          on_host(call);
        } else if (const char* why = kv_.why_not_on_device(*call.kv, shape)) {
          notice_once(why);
          kv_.move_to_host(*call.kv);
          on_host(call);
        } else {
          kv_.attend(layer, call, shape);
        }
      }
      if (cpu_calls_.empty()) return;
      AttentionShape host_shape = shape;
      if (shape.sinks != nullptr) host_shape.sinks = residency_.host_read(shape.sinks, static_cast<size_t>(shape.n_head));
      cpu_->attention(layer, host_shape, cpu_calls_);
    });
  }

  void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const RopeAngles& angles,
                  int n_head_kv, int head_dim) override {
    run([&] { kv_.shift_keys(*cpu_, kv, layers, slots, angles, n_head_kv, head_dim); });
  }

 private:
  // A plugin's caches hold fp16 or fp32 rows (its store, attention and shift kernels read no
  // other): a quantized cache is refused by name, before a row is written.
  void refuse_quantized_cache(const KvView& kv) const {
    const bool plain = kv.key_type == KvType::kF16 || kv.key_type == KvType::kF32;
    if (!plain || kv.key_type != kv.value_type) {
      throw std::runtime_error("--cache-type " + kv_types_name(kv.cache_types) + " is not supported on the plugin device " + name_ +
                               ": a device's KV cache is f16 or f32, keys and values alike (use --cache-type f16, or run "
                               "on the CPU)");
    }
  }

  // --- The dispatcher ---------------------------------------------------------------------
  // Every op of the seam runs through run(): a RoPE held back (rope()) runs first, as issued,
  // unless the op is the store that fuses it (store_kv()).
  template <class Op>
  void run(Op&& op) {
    run_held_ropes();
    op();
  }

  // A row-wise op, declared once: the activations it reads and writes (reads first), its
  // kernel on the device (given the operands' device spans, in order) and its CPU fallback
  // (given their host pointers). It runs on the device when every operand is an allocation and
  // the current layer is the device's; Residency brings each operand up to date where it runs
  // and records the writes.
  // `device_takes`: what else the device needs (a weight in its memory).
  template <size_t N, class OnDevice, class OnCpu>
  void rowwise(const std::array<Operand, N>& operands, OnDevice&& on_device, OnCpu&& on_cpu, bool device_takes = true) {
    run([&] {
      if (device_takes && device_runs(operands)) {
        std::array<DeviceSpan, N> spans;
        for (size_t i = 0; i < N; ++i) spans[i] = residency_.on_device_for(operands[i]);
        on_device(spans);
        return;
      }
      std::array<float*, N> host;
      for (size_t i = 0; i < N; ++i) host[i] = residency_.on_host_for(operands[i]);
      on_cpu(host);
    });
  }

  template <size_t N>
  bool device_runs(const std::array<Operand, N>& operands) const {
    return !on_cpu_ && std::all_of(operands.begin(), operands.end(), [&](const Operand& o) { return residency_.on_device(o); });
  }

  void run_held_ropes() {
    std::vector<HeldRope> held;
    held.swap(held_ropes_);
    for (const HeldRope& r : held) rope_now(r);
  }

  void rope_now(const HeldRope& r) {
    const RopeAngles& angles = r.angles;
    rowwise(
        std::array{in(angles.cos, r.n_angles()), in(angles.sin, r.n_angles()), inout(r.x, r.size())},
        [&](const std::array<DeviceSpan, 3>& s) {
          const ringlm_rope_args args = r.args(s[0], s[1], s[2]);
          link_.check(link_.api().rope(link_.context(), &args), "rope");
        },
        [&](const std::array<float*, 3>& host) {
          RopeAngles host_angles = angles;
          host_angles.cos = host[0];
          host_angles.sin = host[1];
          cpu_->rope(host[2], r.n_rows, r.n_heads, r.head_dim, host_angles);
        });
  }

  // RoPE of q and k (held) and the store of k and v into one cache's device copy, in one launch;
  // false (nothing done) when the calls are not that pattern.
  bool fuse_rope_store(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
    if (held_ropes_.size() != 2 || !kv_.may_hold(kv)) return false;
    const HeldRope& q_rope = held_ropes_[0];
    const HeldRope& k_rope = held_ropes_[1];
    const RopeAngles& angles = q_rope.angles;
    const size_t count = static_cast<size_t>(n) * static_cast<size_t>(kv.row_width);
    const bool pattern = k_rope.x == k && k_rope.n_rows == n && q_rope.n_rows == n && q_rope.x != k &&
                         q_rope.head_dim == k_rope.head_dim && k_rope.n_heads * k_rope.head_dim == kv.row_width &&
                         angles.cos == k_rope.angles.cos && angles.sin == k_rope.angles.sin &&
                         angles.n_rot == k_rope.angles.n_rot && angles.adjacent_pairs == k_rope.angles.adjacent_pairs &&
                         residency_.on_device(v, count);
    if (!pattern) return false;
    return kv_.rope_store(kv, layer, first_slot, n, [&](ringlm_rope_store_args& args) {
      const DeviceSpan c = residency_.device_read(angles.cos, q_rope.n_angles());
      const DeviceSpan s = residency_.device_read(angles.sin, q_rope.n_angles());
      const DeviceSpan vs = residency_.device_read(v, count);
      const DeviceSpan qs = residency_.device_write(q_rope.x, q_rope.size());
      const DeviceSpan ks = residency_.device_write(k_rope.x, count);
      args.rope = q_rope.args(c, s, qs);
      args.k = ks.buffer;
      args.k_offset = ks.offset;
      args.v = vs.buffer;
      args.v_offset = vs.offset;
      args.n_head_kv = k_rope.n_heads;
      held_ropes_.clear();  // (q_rope and k_rope are gone: the last use)
    });
  }

  bool layer_on_device(int layer) const { return layer < n_layer_ ? layer >= first_device_layer_ : output_on_device_; }
  // x[i] += delta[i % delta_n] for i < n: a residual (delta_n = n) or a bias on every row.
  void add_repeated(float* x, const float* delta, int64_t n, int64_t delta_n) {
    rowwise(
        std::array{in(delta, static_cast<size_t>(delta_n)), inout(x, static_cast<size_t>(n))},
        [&](const std::array<DeviceSpan, 2>& s) {
          ringlm_add_args args{};
          args.delta = s[0].buffer;
          args.delta_offset = s[0].offset;
          args.x = s[1].buffer;
          args.x_offset = s[1].offset;
          args.n = n;
          args.delta_n = delta_n;
          link_.check(link_.api().add(link_.context(), &args), "add");
        },
        [&](const std::array<float*, 2>& host) {
          if (delta_n == n) return cpu_->add(host[1], host[0], n);
          cpu_->add_row(host[1], host[0], n / delta_n, delta_n);
        });
  }

  void device_rms_norm(DeviceSpan from, DeviceSpan to, DeviceSpan weight, int64_t n_rows, int64_t width,
                       float eps) {
    ringlm_rms_norm_args args{};
    args.x = from.buffer;
    args.x_offset = from.offset;
    args.out = to.buffer;
    args.out_offset = to.offset;
    args.weight = weight.buffer;
    args.weight_offset = weight.offset;
    args.n_rows = n_rows;
    args.width = width;
    args.eps = eps;
    link_.check(link_.api().rms_norm(link_.context(), &args), "rms_norm");
  }

  // gate = act(gate) * up, element-wise.
  void device_glu(const float* up, float* gate, size_t n, Activation act) {
    rowwise(
        std::array{in(up, n), inout(gate, n)},
        [&](const std::array<DeviceSpan, 2>& s) {
          ringlm_glu_args args{};
          args.up = s[0].buffer;
          args.up_offset = s[0].offset;
          args.gate = s[1].buffer;
          args.gate_offset = s[1].offset;
          args.n = static_cast<int64_t>(n);
          args.activation = activation_code(act);
          link_.check(link_.api().glu(link_.context(), &args), "glu");
        },
        [&](const std::array<float*, 2>& host) { cpu::glu(act, host[1], host[0], static_cast<int64_t>(n)); },
        device_activation(act, link_));
  }

  void many_on_cpu(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                   std::span<float* const> ys) {
    std::vector<const PreparedWeight*> cpu_weights;
    std::vector<float*> cpu_ys;
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (w.on_device) continue;
      cpu_weights.push_back(w.cpu.get());
      cpu_ys.push_back(residency_.host_overwrite(ys[i], static_cast<size_t>(input.n_tokens * w.rows())));
    }
    if (!cpu_weights.empty()) cpu_->matmul_many(cpu_weights, on_host(input, weights[0]->cols()), cpu_ys);
  }

  void many_on_device(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                      std::span<float* const> ys) {
    std::vector<const PluginWeight*> device_weights;
    std::vector<float*> device_ys;
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (!w.on_device) continue;
      device_weights.push_back(&w);
      device_ys.push_back(ys[i]);
    }
    if (device_weights.empty()) return;
    const int64_t cols = weights[0]->cols();
    const size_t nx = static_cast<size_t>(input.n_tokens * cols);
    // The norm fused into each product (matmul2), for every number of rows: a row's result then
    // does not depend on how many rows share the call.
    const bool fuse_norm = input.rms_weight != nullptr && residency_.on_device(input.x, nx) &&
                           residency_.on_device(input.rms_weight, static_cast<size_t>(cols));
    DeviceSpan x;
    DeviceNorm norm;
    if (fuse_norm) {
      x = residency_.device_read(input.x, nx);
      norm = {residency_.device_read(input.rms_weight, static_cast<size_t>(cols)), input.rms_eps};
    } else {
      x = normalised_input(input, cols);
    }
    const DeviceNorm* fused_norm = fuse_norm ? &norm : nullptr;
    if (products_.can_fuse(device_weights, device_ys, input.n_tokens)) {  // q, k and v in one launch
      return products_.fused(device_weights, x, input.n_tokens, device_ys, fused_norm);
    }
    for (size_t i = 0; i < device_weights.size(); ++i) {
      products_.product(*device_weights[i], x, input.n_tokens, device_ys[i], fused_norm);
    }
  }

  // gate, up and the activation in one launch, the norm of the input fused too; false (nothing
  // done) when the device cannot.
  bool glu_in_one_launch(const PluginWeight& g, const PluginWeight& u, const MatmulInput& input,
                         Activation act, float* out_rows) {
    const size_t nx = static_cast<size_t>(input.n_tokens * g.cols());
    const std::vector<const PluginWeight*> pair = {&g, &u};
    if (!device_activation(act, link_) || !products_.can_fuse(pair, {out_rows}, input.n_tokens) || !residency_.on_device(input.x, nx) ||
        (input.rms_weight != nullptr && !residency_.on_device(input.rms_weight, static_cast<size_t>(g.cols())))) {
      return false;
    }
    const DeviceSpan x = residency_.device_read(input.x, nx);
    DeviceNorm norm;
    if (input.rms_weight != nullptr) norm = {residency_.device_read(input.rms_weight, static_cast<size_t>(g.cols())), input.rms_eps};
    products_.fused(pair, x, input.n_tokens, {out_rows}, input.rms_weight != nullptr ? &norm : nullptr, act);
    return true;
  }

  MatmulInput on_host(const MatmulInput& input, int64_t cols) {
    MatmulInput host = input;
    host.x = residency_.host_read(input.x, static_cast<size_t>(input.n_tokens * cols));
    if (input.rms_weight != nullptr) host.rms_weight = residency_.host_read(input.rms_weight, static_cast<size_t>(cols));
    return host;
  }

  // The input rows of a product as the products should see them: RMS-normalised when asked,
  // on the device when the rows are there, else on the host (normalized_input_row).
  DeviceSpan normalised_input(const MatmulInput& input, int64_t cols) {
    const size_t n = static_cast<size_t>(input.n_tokens * cols);
    if (input.rms_weight == nullptr) return residency_.device_input(input.x, n);
    if (residency_.on_device(input.x, n) && residency_.on_device(input.rms_weight, static_cast<size_t>(cols))) {
      float* normed = scratch(normed_device_, n);
      const DeviceSpan w = residency_.device_read(input.rms_weight, static_cast<size_t>(cols));
      const DeviceSpan from = residency_.device_read(input.x, n);
      const DeviceSpan to = residency_.device_write(normed, n);
      device_rms_norm(from, to, w, input.n_tokens, cols, input.rms_eps);
      return residency_.device_read(normed, n);
    }
    const MatmulInput host = on_host(input, cols);
    if (normed_.size() < n) normed_.resize(n);
    for (int64_t m = 0; m < input.n_tokens; ++m) normalized_input_row(host, m, cols, normed_.data() + m * cols);
    return residency_.device_input(normed_.data(), n);
  }

  // An internal activation of at least n floats (grown on demand), kept in device memory with
  // ABI v2.
  float* scratch(std::unique_ptr<ActivationBuffer>& buffer, size_t n) {
    if (buffer == nullptr || buffer->size() < n) buffer = alloc_activations(std::max(n, 2 * (buffer ? buffer->size() : 0)));
    return buffer->data();
  }

  // A fallback to the CPU is said once, on stderr, the first time it happens.
  void notice_once(const char* why) {
    if (told_.insert(why).second) std::fprintf(stderr, "ringlm: %s: %s\n", link_.label().c_str(), why);
  }

  DeviceLink link_;
  Residency residency_;
  DeviceProducts products_;
  DeviceKv kv_;
  std::unique_ptr<Backend> cpu_;
  int gpu_layers_ = -1;  // --gpu-layers: the last N layers on the device (-1: all)
  int cpu_moe_layers_ = 0;  // --n-cpu-moe: the experts of the first N layers on the CPU (-1: all, --cpu-moe)
  std::vector<const PreparedWeight*> cpu_gate_, cpu_up_, cpu_down_;  // moe_ffn's CPU weights, reused
  std::string name_;
  int n_layer_ = 0;
  int first_device_layer_ = 0;  // layers before it run on the CPU
  bool output_on_device_ = true;
  bool on_cpu_ = false;  // the ops issued now belong to a layer that runs on the CPU
  int n_weights_ = 0;                            // prepared here
  std::map<std::string, int> cpu_weight_types_;  // of those, left on the CPU, by type
  std::set<std::string> told_;                   // fallbacks already said
  DeviceBuffer ids_buffer_, top_buffer_;         // staging
  std::unique_ptr<ActivationBuffer> up_out_, normed_device_;  // matmul_glu's up, a normalised input
  std::unique_ptr<ActivationBuffer> residual_;  // matmul_add's product when it cannot add in place
  std::vector<float> normed_;
  std::vector<AttentionCall> cpu_calls_;  // attention()'s calls left to the CPU, reused
  std::vector<HeldRope> held_ropes_;      // rope() calls not run yet (at most q's and k's)
};

}  // namespace

std::unique_ptr<Backend> make_plugin_backend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu,
                                             const DevicePlacement& placement) {
  if (device == nullptr || device->context == nullptr) throw std::invalid_argument("make_plugin_backend: no device");
  ringlm_op_desc probe{};
  probe.op = RINGLM_OP_MATMUL;
  probe.weight_format = RINGLM_FORMAT_Q4_0;
  probe.m = 1;
  probe.n = 32;
  probe.k = 32;
  if (device->plugin->api().supports(device->context, &probe) == 0) {
    throw std::runtime_error(device_label(*device) + " does not run the INT4 matmul (Q4_0, 1x32x32); nothing would run there");
  }

  return std::make_unique<PluginBackend>(std::move(device), std::move(cpu), placement);
}

}  // namespace ringlm

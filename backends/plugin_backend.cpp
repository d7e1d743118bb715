#include "backends/plugin_backend.h"

#include <algorithm>
#include <cmath>
#include <compare>
#include <cstring>
#include <functional>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/activation.h"

namespace ringlm {
namespace {

// Rows the device's flat GEMM takes per call (FlashDecoding++'s flat GEMM: M = 1..16); larger
// inputs are cut into such chunks, unless the plugin multiplies up to kMaxGemmRows at once
// (ABI v3, RINGLM_OP_GEMM: a prompt chunk of the model's largest batch in one launch).
constexpr int64_t kMaxDeviceRows = 16;
constexpr int64_t kMaxGemmRows = 512;

// The weight formats the ABI can name (plugin_api.h's ringlm_format = the GGUF type id).
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
      return true;
    default:
      return false;
  }
}

// The ABI's name of an activation (plugin_api.h's ringlm_activation).
uint32_t activation_code(Activation act) { return act == Activation::kGeluTanh ? RINGLM_ACT_GELU_TANH : RINGLM_ACT_SILU; }

std::string device_label(const OpenedDevice& device) {
  return device.plugin->name() + ":" + std::to_string(device.index) + " (" + device.info.name + ")";
}

// Turns a plugin status into an exception naming the device, the call and the plugin's reason.
void check(const OpenedDevice& device, int32_t status, const char* what) {
  if (status == RINGLM_OK) return;
  throw std::runtime_error(device_label(device) + ": " + what + " failed: " + device.plugin->last_error(device.context));
}

// Device memory; freed with the last owner. Holds the device open for as long as it lives.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::shared_ptr<OpenedDevice> device, size_t bytes) : device_(std::move(device)), bytes_(bytes) {
    buffer_ = device_->plugin->api().alloc(device_->context, std::max<size_t>(bytes, 1));
    if (buffer_ == nullptr) {
      throw std::runtime_error(device_label(*device_) + ": cannot allocate " + std::to_string(bytes) +
                               " bytes: " + device_->plugin->last_error(device_->context) +
                               " (out of device memory? fewer --gpu-layers or a smaller -c need less)");
    }
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(buffer_, other.buffer_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (buffer_ != nullptr) device_->plugin->api().free(device_->context, buffer_);
  }

  ringlm_buffer* get() const { return buffer_; }
  size_t bytes() const { return bytes_; }
  void upload(size_t offset, const void* src, size_t n) {
    check(*device_, device_->plugin->api().upload(device_->context, buffer_, offset, src, n), "upload");
  }
  void download(size_t offset, void* dst, size_t n) const {
    check(*device_, device_->plugin->api().download(device_->context, buffer_, offset, dst, n), "download");
  }

 private:
  std::shared_ptr<OpenedDevice> device_;
  ringlm_buffer* buffer_ = nullptr;
  size_t bytes_ = 0;
};

// A range of floats, [begin, end), offsets into one activation allocation.
struct FloatRange {
  size_t begin = 0, end = 0;
  bool empty() const { return begin >= end; }
  bool overlaps(FloatRange o) const { return !empty() && !o.empty() && begin < o.end && o.begin < end; }
  FloatRange hull(FloatRange o) const {
    if (empty()) return o;
    if (o.empty()) return *this;
    return {std::min(begin, o.begin), std::max(end, o.end)};
  }
};

// Activation memory of a device backend: a device buffer and a host mirror of it, each newer
// than the other in places. Host writes (write(), an op the CPU runs) are listed exactly and
// uploaded before the device next touches the allocation; device writes widen one range that is
// downloaded before the host next reads inside it. The device writes only once every host write
// is uploaded, so the device holds the newest values everywhere in that range when it is read.
class MirroredActivations final : public ActivationBuffer {
 public:
  MirroredActivations(std::unique_ptr<float[]> host, size_t n, DeviceBuffer device)
      : ActivationBuffer(host.get(), n), device(std::move(device)), host_(std::move(host)) {}
  DeviceBuffer device;
  std::vector<FloatRange> device_stale;  // written on the host, not yet uploaded
  FloatRange host_stale;                 // written on the device, not yet downloaded
  std::function<void()> on_destroy;      // unregisters it from its backend
  ~MirroredActivations() override {
    if (on_destroy) on_destroy();
  }

 private:
  std::unique_ptr<float[]> host_;
};

// A weight in device memory, or (device == false) one the CPU backend prepared.
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

const PluginWeight& as_plugin_weight(const PreparedWeight& w) { return static_cast<const PluginWeight&>(w); }

// The shape of a KV cache on the device: the host cache's, slot for slot.
struct DeviceKvShape {
  int n_layer = 0;
  int first_layer = 0;  // the layers before it run on the CPU (--gpu-layers): no rows here
  int capacity = 0;   // slots
  int row_width = 0;  // n_kv_head * head_dim elements per slot and layer
  bool f16 = false;
};

// An attention geometry and KV type, as the device was asked whether it runs them.
struct GeometryKey {
  int n_head, n_head_kv, head_dim;
  bool f16;
  auto operator<=>(const GeometryKey&) const = default;
};

// A KV cache's rows on the device, slot for slot as on the host, for the layers the device runs:
// layer l's keys start at layer_at(l) of `keys`, its values likewise in `values`. A cache that
// reads a shared prompt segment (KvView::prefix) holds the segment's rows first, copied on the
// device from the segment's own device copy: the device's attention reads one run of slots, the
// segment's and then the cache's (slot_at(l, s) is the cache's slot s).
class PluginKvCache final : public BackendKvState {
 public:
  PluginKvCache(const std::shared_ptr<OpenedDevice>& device, const DeviceKvShape& s)
      : shape(s),
        row_bytes(static_cast<size_t>(s.row_width) * (s.f16 ? 2 : 4)),
        layer_bytes(row_bytes * static_cast<size_t>(s.capacity)),
        keys(device, layer_bytes * static_cast<size_t>(s.n_layer - s.first_layer)),
        values(device, layer_bytes * static_cast<size_t>(s.n_layer - s.first_layer)),
        positions(device, sizeof(int32_t) * static_cast<size_t>(s.capacity)) {}
  DeviceKvShape shape;
  size_t row_bytes, layer_bytes;
  size_t layer_at(int layer) const { return static_cast<size_t>(layer - shape.first_layer) * layer_bytes; }
  size_t slot_at(int layer, int slot) const {
    return layer_at(layer) + static_cast<size_t>(prefix_slots + slot) * row_bytes;
  }
  int prefix_slots = 0;                // the segment's slots before the cache's own
  uint64_t prefix_id = 0;              // which segment they are (its KvCache::id()), 0: none
  DeviceBuffer keys, values, positions;
  int n_slots = 0;  // slots whose positions were set
  // What the device's `positions` holds, slot for slot (each slot ever uploaded): a forward
  // pass uploads only the slots that changed since.
  std::vector<int32_t> host_positions;
  // The device's rows are newer than the host's (a store on the device, ABI v2): the host's are
  // brought up to date (sync_host_rows) before anything reads them there.
  bool host_stale = false;
  // The device does not run this cache's attention (its geometry): its rows live on the host.
  bool host_only = false;
  int stored_extent = 0;  // slots 0 .. stored_extent - 1 hold rows the device stored
};

class PluginBackend final : public Backend {
 public:
  PluginBackend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu, int gpu_layers)
      : device_(std::move(device)),
        api_(device_->plugin->api()),
        v2_(device_->plugin->abi_version() >= 2),
        v3_(device_->plugin->abi_version() >= 3),
        cpu_(std::move(cpu)),
        gpu_layers_(gpu_layers) {
    name_ = device_->plugin->name();
  }
  ~PluginBackend() override {
    // Allocations the model still holds must not call back into a backend that is gone.
    for (auto& [base, mirror] : mirrors_) mirror->on_destroy = nullptr;
  }

  std::string_view name() const override { return name_; }
  std::string device_description() const override { return device_label(*device_); }
  bool offloads() const override { return true; }

  std::string cpu_fallback_report() const override {
    std::string layers;
    if (first_device_layer_ > 0 || !output_on_device_) {
      layers = device_label(*device_) + ": " +
               (first_device_layer_ >= n_layer_
                    ? "every layer and the output run on the CPU"
                    : "layers 0-" + std::to_string(first_device_layer_ - 1) + " of " + std::to_string(n_layer_) +
                          " run on the CPU, " + std::to_string(first_device_layer_) + "-" + std::to_string(n_layer_ - 1) +
                          " and the output on the device") +
               " (--gpu-layers " + std::to_string(gpu_layers_) + ")";
    }
    if (cpu_weight_types_.empty()) return layers;
    if (!layers.empty()) layers += "\nringlm: ";
    int n_cpu = 0;
    std::string types;
    for (const auto& [type, count] : cpu_weight_types_) {
      n_cpu += count;
      types += (types.empty() ? "" : ", ") + type + " x" + std::to_string(count);
    }
    return layers + device_label(*device_) + ": " + std::to_string(n_cpu) + " of " + std::to_string(n_weights_) +
           " weights run on the CPU (" + types + "; the plugin does not take them)";
  }

  // --- Layers on the device and on the CPU ------------------------------------------------
  // With --gpu-layers N the last N layers and the output run on the device, the first ones on
  // the CPU: their weights stay there, and their ops (begin_layer) run on the host mirrors, the
  // KV rows of their layers on the host, so the hidden state crosses once, where the device's
  // layers begin.

  void plan_layers(int n_layer) override {
    n_layer_ = n_layer;
    first_device_layer_ = gpu_layers_ < 0 ? 0 : std::max(0, n_layer - gpu_layers_);
    output_on_device_ = gpu_layers_ != 0;
  }
  void begin_layer(int layer) override {
    flush_pending();
    // The embedding runs where the first layer does.
    on_cpu_ = layer < n_layer_ ? std::max(layer, 0) < first_device_layer_ : !output_on_device_;
  }
  std::string layer_device(int layer) const override {
    const bool device = layer < n_layer_ ? layer >= first_device_layer_ : output_on_device_;
    return device ? device_->plugin->name() + ":" + std::to_string(device_->index) : "cpu";
  }

  DeviceCounters counters() const override {
    DeviceCounters c;
    if (!v2_) return c;
    ringlm_counters raw{};
    check(*device_, api_.counters(device_->context, &raw), "counters");
    c.launches = raw.launches;
    c.upload_bytes = raw.upload_bytes;
    c.download_bytes = raw.download_bytes;
    c.waits = raw.waits;
    return c;
  }

  // --- Activation memory ------------------------------------------------------------------
  // With ABI v2 every allocation has a device buffer and a host mirror (MirroredActivations);
  // a version-1 plugin runs no op on activations in device memory, so its are host memory.

  std::unique_ptr<ActivationBuffer> alloc_activations(size_t n) override {
    if (!v2_) return Backend::alloc_activations(n);
    auto host = std::make_unique<float[]>(n > 0 ? n : 1);
    DeviceBuffer device(device_, std::max<size_t>(n, 1) * sizeof(float));
    auto made = std::make_unique<MirroredActivations>(std::move(host), n, std::move(device));
    MirroredActivations* raw = made.get();
    raw->device_stale.push_back({0, n});  // the host's zeros go up before the device first uses it
    mirrors_[raw->data()] = raw;
    raw->on_destroy = [this, base = raw->data()] { mirrors_.erase(base); };
    return made;
  }

  void write(float* dst, const float* src, size_t n) override {
    flush_pending();
    float* host = host_write(dst, n);
    if (n > 0) std::memcpy(host, src, n * sizeof(float));
  }
  void read(const float* src, float* dst, size_t n) override {
    flush_pending();
    const float* host = host_read(src, n);
    if (n > 0) std::memcpy(dst, host, n * sizeof(float));
  }
  void copy(float* dst, const float* src, size_t n) override {
    flush_pending();
    if (n == 0) return;
    if (on_device(dst, n) && on_device(src, n)) {
      const DeviceSpan from = device_read(src, n);
      const DeviceSpan to = device_write(dst, n);
      check(*device_, api_.copy(device_->context, to.buffer, to.offset, from.buffer, from.offset, n * sizeof(float)),
            "copy");
      return;
    }
    const float* from = host_read(src, n);
    std::memcpy(host_write(dst, n), from, n * sizeof(float));
  }

  // The device picks the top k of values it computed (a step's logits) and sends back k pairs
  // instead of the n values; values the host holds the newest of are picked on the host.
  void top_k(const float* x, int64_t n_rows, int64_t n, int k, std::span<TopLogit> top) override {
    flush_pending();
    const size_t count = static_cast<size_t>(n_rows * n);
    const MirroredActivations* m = mirror_of(x, count);
    const bool device_newest = m != nullptr && m->host_stale.overlaps(range_in(*m, x, count));
    if (!v3_ || !device_newest || k < 1 || k > RINGLM_TOP_K_MAX || k > n) {
      return Backend::top_k(host_read(x, count), n_rows, n, k, top);
    }
    static_assert(sizeof(TopLogit) == sizeof(ringlm_top_entry) && offsetof(TopLogit, logit) == offsetof(ringlm_top_entry, value));
    const DeviceSpan in = device_read(x, count);
    const size_t bytes = static_cast<size_t>(n_rows) * static_cast<size_t>(k) * sizeof(TopLogit);
    ensure(top_buffer_, bytes);
    ringlm_top_k_args args{};
    args.x = in.buffer;
    args.x_offset = in.offset;
    args.n_rows = n_rows;
    args.n = n;
    args.k = k;
    args.out = top_buffer_.get();
    check(*device_, api_.top_k(device_->context, &args), "top_k");
    top_buffer_.download(0, top.data(), bytes);
  }

  // --- Weights and products ---------------------------------------------------------------

  std::unique_ptr<PreparedWeight> prepare(const WeightView& w) override {
    auto prepared = std::make_unique<PluginWeight>(w.rows, w.cols);
    prepared->type = w.type;
    prepared->source = w.data;
    ++n_weights_;
    const int layer = layer_of(w.name);
    const bool placed_on_device = layer >= 0 ? layer >= first_device_layer_ : output_on_device_;
    prepared->max_rows = placed_on_device ? device_rows_for(w) : 0;
    if (prepared->max_rows > 0) {
      prepared->on_device = true;
      const size_t bytes = row_bytes(w.type, w.cols) * static_cast<size_t>(w.rows);
      upload_weight(*prepared, w, bytes, layer);
    } else {
      prepared->cpu = cpu_->prepare(w);
      if (placed_on_device) ++cpu_weight_types_[std::string(type_traits(static_cast<uint32_t>(w.type))->name)];
    }
    return prepared;
  }

  void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out) override {
    flush_pending();
    const PluginWeight& w = as_plugin_weight(weight);
    const size_t n = ids.size() * static_cast<size_t>(w.cols());
    if (!on_cpu_ && w.on_device && on_device(out, n)) {
      ensure(ids_buffer_, ids.size_bytes());
      upload_staged(ids_buffer_, ids.data(), ids.size_bytes());
      const DeviceSpan to = device_overwrite(out, n);
      ringlm_get_rows_args args{};
      args.weight = w.data.get();
      args.weight_format = static_cast<uint32_t>(w.type);
      args.n_weight_rows = w.rows();
      args.cols = w.cols();
      args.ids = ids_buffer_.get();
      args.n_ids = static_cast<int64_t>(ids.size());
      args.out = to.buffer;
      args.out_offset = to.offset;
      check(*device_, api_.get_rows(device_->context, &args), "get_rows");
      return;
    }
    float* host = host_overwrite(out, n);
    if (!w.on_device) return cpu_->rows(*w.cpu, ids, host);
    // The device copy was uploaded whole; the file's pages are still mapped (only the CPU
    // backend gives them back).
    const size_t stride = row_bytes(w.type, w.cols());
    for (size_t i = 0; i < ids.size(); ++i) {
      dequantize_row(w.type, w.source + static_cast<size_t>(ids[i]) * stride, host + static_cast<int64_t>(i) * w.cols(),
                     w.cols());
    }
  }

  void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    flush_pending();
    const PluginWeight& w = as_plugin_weight(weight);
    const size_t nx = static_cast<size_t>(n_tokens * w.cols()), ny = static_cast<size_t>(n_tokens * w.rows());
    if (!w.on_device) return cpu_->matmul(*w.cpu, host_read(x, nx), n_tokens, host_overwrite(y, ny));
    const DeviceSpan in = device_input(x, nx);
    device_product(w, in, n_tokens, y);
  }

  void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                   std::span<float* const> ys) override {
    flush_pending();
    const int64_t cols = weights[0]->cols();
    const size_t nx = static_cast<size_t>(input.n_tokens * cols);
    // The CPU's weights in one fused call, the device's on one normalised input.
    std::vector<const PreparedWeight*> cpu_weights;
    std::vector<float*> cpu_ys;
    bool any_on_device = false;
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (w.on_device) {
        any_on_device = true;
      } else {
        cpu_weights.push_back(w.cpu.get());
        cpu_ys.push_back(host_overwrite(ys[i], static_cast<size_t>(input.n_tokens * w.rows())));
      }
    }
    if (!cpu_weights.empty()) {
      MatmulInput host_input = input;
      host_input.x = host_read(input.x, nx);
      if (input.rms_weight != nullptr) host_input.rms_weight = host_read(input.rms_weight, static_cast<size_t>(cols));
      cpu_->matmul_many(cpu_weights, host_input, cpu_ys);
    }
    if (!any_on_device) return;
    // The norm fused into each product (matmul2), for every number of rows: a row's result then
    // does not depend on how many rows share the call.
    const bool fuse_norm = input.rms_weight != nullptr && on_device(input.x, nx) &&
                           on_device(input.rms_weight, static_cast<size_t>(cols));
    DeviceSpan in, norm;
    if (fuse_norm) {
      in = device_read(input.x, nx);
      norm = device_read(input.rms_weight, static_cast<size_t>(cols));
    } else {
      in = normalised_input(input, cols);
    }
    std::vector<const PluginWeight*> device_weights;
    std::vector<float*> device_ys;
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (!w.on_device) continue;
      device_weights.push_back(&w);
      device_ys.push_back(ys[i]);
    }
    if (can_fuse(device_weights, device_ys, input.n_tokens)) {  // q, k and v in one launch
      return fused_product(device_weights, in, input.n_tokens, device_ys, fuse_norm ? &norm : nullptr, input.rms_eps);
    }
    for (size_t i = 0; i < device_weights.size(); ++i) {
      device_product(*device_weights[i], in, input.n_tokens, device_ys[i], fuse_norm ? &norm : nullptr, input.rms_eps);
    }
  }

  void matmul_add(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    flush_pending();
    const PluginWeight& w = as_plugin_weight(weight);
    const size_t nx = static_cast<size_t>(n_tokens * w.cols()), ny = static_cast<size_t>(n_tokens * w.rows());
    if (w.on_device && on_device(y, ny)) {  // the residual fused into the product (matmul2)
      device_product(w, device_input(x, nx), n_tokens, y, nullptr, 0.0f, /*accumulate=*/true);
      return;
    }
    float* product = scratch(residual_, ny);
    matmul(weight, x, n_tokens, product);
    add(y, product, static_cast<int64_t>(ny));
  }

  void matmul_glu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input, Activation act,
                  float* out) override {
    flush_pending();
    const PluginWeight& g = as_plugin_weight(gate);
    const PluginWeight& u = as_plugin_weight(up);
    const size_t n = static_cast<size_t>(input.n_tokens * g.rows());
    if (!g.on_device && !u.on_device) {
      MatmulInput host_input = input;
      host_input.x = host_read(input.x, static_cast<size_t>(input.n_tokens * g.cols()));
      if (input.rms_weight != nullptr) host_input.rms_weight = host_read(input.rms_weight, static_cast<size_t>(g.cols()));
      return cpu_->matmul_glu(*g.cpu, *u.cpu, host_input, act, host_overwrite(out, n));
    }
    const size_t nx = static_cast<size_t>(input.n_tokens * g.cols());
    const std::vector<const PluginWeight*> pair = {&g, &u};
    if (can_fuse(pair, {out}, input.n_tokens) && on_device(input.x, nx) &&
        (input.rms_weight == nullptr || on_device(input.rms_weight, static_cast<size_t>(g.cols())))) {
      // gate, up and the activation in one launch, the norm of the input fused too
      const DeviceSpan in = device_read(input.x, nx);
      DeviceSpan norm;
      if (input.rms_weight != nullptr) norm = device_read(input.rms_weight, static_cast<size_t>(g.cols()));
      return fused_product(pair, in, input.n_tokens, {out}, input.rms_weight != nullptr ? &norm : nullptr, input.rms_eps,
                           act);
    }
    float* up_out = scratch(up_out_, n);
    const PreparedWeight* both[] = {&gate, &up};
    float* const outs[] = {out, up_out};
    matmul_many(both, input, outs);
    if (on_device(out, n) && on_device(up_out, n)) {
      ringlm_glu_args args{};
      const DeviceSpan up_span = device_read(up_out, n);
      const DeviceSpan gate_span = device_write(out, n);
      args.gate = gate_span.buffer;
      args.gate_offset = gate_span.offset;
      args.up = up_span.buffer;
      args.up_offset = up_span.offset;
      args.n = static_cast<int64_t>(n);
      args.activation = activation_code(act);
      check(*device_, api_.glu(device_->context, &args), "glu");
      return;
    }
    const float* up_host = host_read(up_out, n);
    cpu::glu(act, host_write(out, n), up_host, static_cast<int64_t>(n));
  }

  // --- Row-wise ops: on the device when their data is there -------------------------------

  // RoPE on the device waits for what comes next: when it is the store of the rotated keys (and
  // their values) into a cache, q's and k's RoPE and the store run as one launch (rope_store);
  // anything else runs the pending RoPE first, as issued.
  void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) override {
    const size_t n = static_cast<size_t>(n_rows) * n_heads * head_dim;
    const size_t n_angles = static_cast<size_t>(n_rows) * static_cast<size_t>(angles.n_rot / 2);
    if (!on_cpu_ && on_device(x, n) && on_device(angles.cos, n_angles) && on_device(angles.sin, n_angles)) {
      if (pending_ropes_.size() == 2) flush_pending();
      pending_ropes_.push_back({x, n_rows, n_heads, head_dim, angles});
      return;
    }
    flush_pending();
    rope_now(x, n_rows, n_heads, head_dim, angles);
  }

  void add(float* x, const float* delta, int64_t n) override { add_repeated(x, delta, n, n); }
  void add_row(float* x, const float* row, int64_t n_rows, int64_t width) override {
    add_repeated(x, row, n_rows * width, width);
  }

  void scale(float* x, int64_t n, float factor) override {
    flush_pending();
    const auto count = static_cast<size_t>(n);
    if (!on_cpu_ && on_device(x, count)) {
      const DeviceSpan io = device_write(x, count);
      check(*device_, api_.scale(device_->context, io.buffer, io.offset, n, factor), "scale");
      return;
    }
    cpu_->scale(host_write(x, count), n, factor);
  }

  void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) override {
    flush_pending();
    const size_t n = static_cast<size_t>(n_rows * width);
    if (!on_cpu_ && on_device(x, n) && on_device(weight, static_cast<size_t>(width))) {
      const DeviceSpan w = device_read(weight, static_cast<size_t>(width));
      const DeviceSpan io = device_write(x, n);
      device_rms_norm(io, io, w, n_rows, width, eps);
      return;
    }
    const float* host_weight = host_read(weight, static_cast<size_t>(width));
    cpu_->rms_norm(host_write(x, n), n_rows, width, host_weight, eps);
  }

  // --- The attention block ----------------------------------------------------------------
  // A cache gets a device copy when the device first stores into it or attends over it
  // (KvView::state). With ABI v2 the device's rows are the newest once it stored there
  // (host_stale); the host's are brought up to date before the CPU reads them (a prefix that
  // other sequences read, a cache whose attention the device cannot run). With ABI v1 the host
  // rows are the truth and every store and shift reaches the copy too.

  void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) override {
    if (fused_rope_store(kv, layer, first_slot, n, k, v)) return;
    flush_pending();
    const size_t count = static_cast<size_t>(n) * static_cast<size_t>(kv.row_width);
    if (on_cpu_) {  // a layer on the CPU: its rows live on the host alone
      cpu_->store_kv(kv, layer, first_slot, n, host_read(k, count), host_read(v, count));
      return;
    }
    if (device_may_hold(kv) && on_device(k, count) && on_device(v, count)) {
      PluginKvCache& copy = ensure_device_copy(kv, first_slot, first_slot + n);
      if (!copy.host_only) {
        device_store(copy, copy.keys, layer, first_slot, n, device_read(k, count));
        device_store(copy, copy.values, layer, first_slot, n, device_read(v, count));
        copy.host_stale = true;
        copy.stored_extent = std::max(copy.stored_extent, first_slot + n);
        return;
      }
    }
    PluginKvCache* copy = device_copy(kv);
    if (copy != nullptr) sync_host_rows(kv, *copy);
    cpu_->store_kv(kv, layer, first_slot, n, host_read(k, count), host_read(v, count));
    if (copy != nullptr) {
      const size_t at = copy->slot_at(layer, first_slot);
      const size_t bytes = static_cast<size_t>(n) * copy->row_bytes;
      upload_staged(copy->keys, kv.key(layer, first_slot), bytes, at);
      upload_staged(copy->values, kv.value(layer, first_slot), bytes, at);
    }
  }

  void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) override {
    flush_pending();
    cpu_calls_.clear();
    if (on_cpu_) {  // a layer on the CPU, over its rows on the host
      for (const AttentionCall& call : calls) {
        const size_t n = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim;
        AttentionCall host = call;
        host.q = host_read(call.q, n);
        host.out = host_overwrite(call.out, n);
        cpu_calls_.push_back(host);
      }
      return cpu_->attention(layer, shape, cpu_calls_);
    }
    for (const AttentionCall& call : calls) {
      if (const char* why = why_not_on_device(*call.kv, shape)) {
        notice_once(why);
        host_attention_call(call, shape);
        continue;
      }
      PluginKvCache& copy = ensure_device_copy(*call.kv);
      // Every call brings the positions up to date: set_positions uploads only what changed, and
      // the first layer that attends here need not be layer 0 (a model whose windowed layers
      // stay on the CPU), nor does a full ring change its slot count when its positions move.
      set_positions(copy, device_positions(copy, *call.kv));
      attend(copy, layer, call, shape);
    }
    if (!cpu_calls_.empty()) cpu_->attention(layer, shape, cpu_calls_);
  }

  void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const RopeAngles& angles,
                  int n_head_kv, int head_dim) override {
    flush_pending();
    PluginKvCache* copy = device_copy(kv);
    // The device turns every layer of its copy at once. When only some layers turn (a model
    // with two RoPE bases in one ring), the host rows turn and the copy is dropped: the next
    // device op on the cache uploads them afresh.
    if (copy != nullptr && static_cast<int>(layers.size()) != kv.n_layer) {
      sync_host_rows(kv, *copy);
      kv.state->reset();
      copy = nullptr;
    }
    if (copy != nullptr && first_device_layer_ > 0) {  // --gpu-layers: each side turns its own layers' rows
      std::vector<int> cpu_layers, device_layers;
      for (const int layer : layers) (layer < first_device_layer_ ? cpu_layers : device_layers).push_back(layer);
      cpu_->shift_keys(kv, cpu_layers, slots, angles, n_head_kv, head_dim);
      if (!copy->host_stale) cpu_->shift_keys(kv, device_layers, slots, angles, n_head_kv, head_dim);
      shift_device_keys(*copy, slots, angles, n_head_kv, head_dim);
      return;
    }
    if (copy == nullptr || !copy->host_stale) cpu_->shift_keys(kv, layers, slots, angles, n_head_kv, head_dim);
    if (copy != nullptr) shift_device_keys(*copy, slots, angles, n_head_kv, head_dim);
  }

 private:
  // A RoPE the device has not run yet (rope()).
  struct PendingRope {
    float* x;
    int64_t n_rows;
    int n_heads, head_dim;
    RopeAngles angles;
  };

  void flush_pending() {
    std::vector<PendingRope> pending;
    pending.swap(pending_ropes_);
    for (const PendingRope& p : pending) rope_now(p.x, p.n_rows, p.n_heads, p.head_dim, p.angles);
  }

  void rope_now(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) {
    const size_t n = static_cast<size_t>(n_rows) * n_heads * head_dim;
    const size_t n_angles = static_cast<size_t>(n_rows) * static_cast<size_t>(angles.n_rot / 2);
    if (!on_cpu_ && on_device(x, n) && on_device(angles.cos, n_angles) && on_device(angles.sin, n_angles)) {
      ringlm_rope_args args{};
      const DeviceSpan c = device_read(angles.cos, n_angles);
      const DeviceSpan s = device_read(angles.sin, n_angles);
      const DeviceSpan io = device_write(x, n);
      args.x = io.buffer;
      args.x_offset = io.offset;
      args.n_rows = n_rows;
      args.n_heads = n_heads;
      args.head_dim = head_dim;
      args.n_rot = angles.n_rot;
      args.adjacent_pairs = angles.adjacent_pairs ? 1 : 0;
      args.cos = c.buffer;
      args.cos_offset = c.offset;
      args.sin = s.buffer;
      args.sin_offset = s.offset;
      check(*device_, api_.rope(device_->context, &args), "rope");
      return;
    }
    RopeAngles host_angles = angles;
    host_angles.cos = host_read(angles.cos, n_angles);
    host_angles.sin = host_read(angles.sin, n_angles);
    cpu_->rope(host_write(x, n), n_rows, n_heads, head_dim, host_angles);
  }

  // RoPE of q and k (pending) and the store of k and v into one cache's device copy, in one launch;
  // false (nothing done) when the calls are not that pattern.
  bool fused_rope_store(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
    if (pending_ropes_.size() != 2 || !device_may_hold(kv)) return false;
    const PendingRope& pq = pending_ropes_[0];
    const PendingRope& pk = pending_ropes_[1];
    const size_t count = static_cast<size_t>(n) * static_cast<size_t>(kv.row_width);
    const bool pattern = pk.x == k && pk.n_rows == n && pq.n_rows == n && pq.x != k && pq.head_dim == pk.head_dim &&
                         pk.n_heads * pk.head_dim == kv.row_width && pq.angles.cos == pk.angles.cos &&
                         pq.angles.sin == pk.angles.sin && pq.angles.n_rot == pk.angles.n_rot &&
                         pq.angles.adjacent_pairs == pk.angles.adjacent_pairs && on_device(v, count);
    if (!pattern) return false;
    PluginKvCache& copy = ensure_device_copy(kv, first_slot, first_slot + n);
    if (copy.host_only) return false;
    const size_t n_q = static_cast<size_t>(n) * pq.n_heads * pq.head_dim;
    const size_t n_angles = static_cast<size_t>(n) * static_cast<size_t>(pq.angles.n_rot / 2);
    ringlm_rope_store_args args{};
    const DeviceSpan c = device_read(pq.angles.cos, n_angles);
    const DeviceSpan s = device_read(pq.angles.sin, n_angles);
    const DeviceSpan vs = device_read(v, count);
    const DeviceSpan qs = device_write(pq.x, n_q);
    const DeviceSpan ks = device_write(pk.x, count);
    args.rope.x = qs.buffer;
    args.rope.x_offset = qs.offset;
    args.rope.n_rows = n;
    args.rope.n_heads = pq.n_heads;
    args.rope.head_dim = pq.head_dim;
    args.rope.n_rot = pq.angles.n_rot;
    args.rope.adjacent_pairs = pq.angles.adjacent_pairs ? 1 : 0;
    args.rope.cos = c.buffer;
    args.rope.cos_offset = c.offset;
    args.rope.sin = s.buffer;
    args.rope.sin_offset = s.offset;
    args.k = ks.buffer;
    args.k_offset = ks.offset;
    args.v = vs.buffer;
    args.v_offset = vs.offset;
    args.n_head_kv = pk.n_heads;
    const size_t at = copy.slot_at(layer, first_slot);
    args.keys = copy.keys.get();
    args.keys_offset = at;
    args.values = copy.values.get();
    args.values_offset = at;
    args.kv_format = copy.shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    pending_ropes_.clear();
    check(*device_, api_.rope_store(device_->context, &args), "rope_store");
    copy.host_stale = true;
    copy.stored_extent = std::max(copy.stored_extent, first_slot + n);
    return true;
  }

  // A place in device memory: a buffer and a byte offset into it.
  struct DeviceSpan {
    ringlm_buffer* buffer = nullptr;
    size_t offset = 0;
  };

  // The layer of a weight named "blk.N. ...", or -1 (the embedding, the output).
  static int layer_of(const std::string& name) {
    int layer = -1;
    if (std::sscanf(name.c_str(), "blk.%d.", &layer) != 1) return -1;
    return layer;
  }

  // The weight's bytes into device memory; a device out of memory says what did not fit and how
  // many layers did.
  void upload_weight(PluginWeight& prepared, const WeightView& w, size_t bytes, int layer) {
    try {
      prepared.data = DeviceBuffer(device_, bytes);
      prepared.data.upload(0, w.data, bytes);
    } catch (const std::exception& e) {
      const auto mib = [](size_t b) { return std::to_string((b + (1 << 20) - 1) >> 20) + " MiB"; };
      // The model places the output first, then the layers in order: the layers placed before
      // this one fitted beside the output; one fewer leaves room for the KV cache and activations.
      const int fitted = layer >= 0 ? layer - first_device_layer_ : 0;
      const std::string advice = fitted > 1 ? "; " + std::to_string(fitted) + " layers fitted before it: try --gpu-layers " +
                                                  std::to_string(fitted - 1)
                                            : "; try --gpu-layers 0";
      throw std::runtime_error(device_label(*device_) + ": " + w.name + " (" + mib(bytes) +
                               ") does not fit in device memory after " + mib(device_weight_bytes_) + " of weights" +
                               advice + "\n  (" + e.what() + ")");
    }
    device_weight_bytes_ += bytes;
  }

  // --- Keeping the two copies of an activation in step -------------------------------------

  // The allocation holding [p, p + n), or nullptr when it is no allocation of this backend's.
  MirroredActivations* mirror_of(const float* p, size_t n) const {
    if (p == nullptr || mirrors_.empty()) return nullptr;
    auto it = mirrors_.upper_bound(p);
    if (it == mirrors_.begin()) return nullptr;
    --it;
    MirroredActivations* m = it->second;
    const float* base = m->data();
    return p >= base && p + n <= base + m->size() ? m : nullptr;
  }
  bool on_device(const float* p, size_t n) const { return mirror_of(p, n) != nullptr; }

  static FloatRange range_in(const MirroredActivations& m, const float* p, size_t n) {
    const auto begin = static_cast<size_t>(p - m.data());
    return {begin, begin + n};
  }

  // Uploads what the host wrote since the device last saw the allocation.
  void flush_to_device(MirroredActivations& m) {
    for (const FloatRange r : m.device_stale) {
      upload_staged(m.device, m.data() + r.begin, (r.end - r.begin) * sizeof(float), r.begin * sizeof(float));
    }
    m.device_stale.clear();
  }

  // [p, p + n) of an allocation, for an op the device runs that reads it.
  DeviceSpan device_read(const float* p, size_t n) {
    MirroredActivations& m = *mirror_of(p, n);
    flush_to_device(m);
    return {m.device.get(), static_cast<size_t>(p - m.data()) * sizeof(float)};
  }
  // ... that writes it (and may read it first).
  DeviceSpan device_write(float* p, size_t n) {
    MirroredActivations& m = *mirror_of(p, n);
    flush_to_device(m);
    m.host_stale = m.host_stale.hull(range_in(m, p, n));
    return {m.device.get(), static_cast<size_t>(p - m.data()) * sizeof(float)};
  }

  // [p, p + n) as the host may read it: an allocation's mirror is brought up to date first
  // (one download, a wait); any other pointer is host memory already.
  const float* host_read(const float* p, size_t n) {
    MirroredActivations* m = mirror_of(p, n);
    if (m == nullptr || !m->host_stale.overlaps(range_in(*m, p, n))) return p;
    flush_to_device(*m);  // the device then holds the newest values in all of host_stale
    const FloatRange r = m->host_stale;
    m->device.download(r.begin * sizeof(float), m->data() + r.begin, (r.end - r.begin) * sizeof(float));
    m->host_stale = {};
    return p;
  }
  // ... as the host may write it (after reading it, as an op in place does).
  float* host_write(float* p, size_t n) {
    host_read(p, n);
    if (MirroredActivations* m = mirror_of(p, n)) {
      const FloatRange r = range_in(*m, p, n);
      const bool listed = std::any_of(m->device_stale.begin(), m->device_stale.end(),
                                      [&](FloatRange d) { return d.begin <= r.begin && r.end <= d.end; });
      if (listed) {  // written again (a residual in every layer on the CPU): uploaded once
      } else if (!m->device_stale.empty() && m->device_stale.back().end == r.begin) {
        m->device_stale.back().end = r.end;
      } else {
        m->device_stale.push_back(r);
      }
    }
    return p;
  }

  // [p, p + n) as an op about to overwrite all of it sees it: on the host, what the device wrote
  // there need not come down first; on the device, what the host wrote there need not go up
  // (with --gpu-layers the two sides take turns writing the same activations every step).
  float* host_overwrite(float* p, size_t n) {
    if (MirroredActivations* m = mirror_of(p, n)) {
      const FloatRange r = range_in(*m, p, n);
      if (m->host_stale.begin >= r.begin && m->host_stale.end <= r.end) m->host_stale = {};
    }
    return host_write(p, n);
  }
  DeviceSpan device_overwrite(float* p, size_t n) {
    MirroredActivations& m = *mirror_of(p, n);
    const FloatRange r = range_in(m, p, n);
    std::erase_if(m.device_stale, [&](FloatRange d) { return d.begin >= r.begin && d.end <= r.end; });
    return device_write(p, n);
  }

  // The input of a product on the device: an allocation's own buffer, or (any other pointer,
  // or a version-1 plugin) the rows uploaded to a staging buffer.
  DeviceSpan device_input(const float* x, size_t n) {
    if (on_device(x, n)) return device_read(x, n);
    ensure(x_buffer_, n * sizeof(float));
    upload_staged(x_buffer_, x, n * sizeof(float));
    return {x_buffer_.get(), 0};
  }

  // The input rows of a product as the products should see them: RMS-normalised when asked,
  // on the device when the rows are there, else on the host (normalized_input_row).
  DeviceSpan normalised_input(const MatmulInput& in, int64_t cols) {
    const size_t n = static_cast<size_t>(in.n_tokens * cols);
    if (in.rms_weight == nullptr) return device_input(in.x, n);
    if (on_device(in.x, n) && on_device(in.rms_weight, static_cast<size_t>(cols))) {
      float* normed = scratch(normed_device_, n);
      const DeviceSpan w = device_read(in.rms_weight, static_cast<size_t>(cols));
      const DeviceSpan from = device_read(in.x, n);
      const DeviceSpan to = device_write(normed, n);
      device_rms_norm(from, to, w, in.n_tokens, cols, in.rms_eps);
      return device_read(normed, n);
    }
    MatmulInput host_in = in;
    host_in.x = host_read(in.x, n);
    host_in.rms_weight = host_read(in.rms_weight, static_cast<size_t>(cols));
    if (normed_.size() < n) normed_.resize(n);
    for (int64_t m = 0; m < in.n_tokens; ++m) normalized_input_row(host_in, m, cols, normed_.data() + m * cols);
    return device_input(normed_.data(), n);
  }

  // y = x · wᵀ for n_tokens rows at `in`, in chunks of the device's flat-GEMM rows, into y on
  // the device (an allocation) or downloaded to it (any other pointer). With ABI v2 the product
  // can take the norm of its input (rms: the weight, on the device) and add itself to y
  // (accumulate, y on the device).
  void device_product(const PluginWeight& w, DeviceSpan in, int64_t n_tokens, float* y, const DeviceSpan* rms = nullptr,
                      float rms_eps = 0.0f, bool accumulate = false) {
    const size_t ny = static_cast<size_t>(n_tokens * w.rows());
    const bool direct = on_device(y, ny);
    DeviceSpan out;
    if (direct) {
      out = accumulate ? device_write(y, ny) : device_overwrite(y, ny);
    } else {
      ensure(y_buffer_, ny * sizeof(float));
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
      if (!v2_) {
        check(*device_, api_.matmul(device_->context, &args), "matmul");
        continue;
      }
      ringlm_matmul2_args fused{};
      fused.base = args;
      if (rms != nullptr) {
        fused.rms_weight = rms->buffer;
        fused.rms_weight_offset = rms->offset;
        fused.rms_eps = rms_eps;
      }
      fused.accumulate = accumulate ? 1 : 0;
      check(*device_, api_.matmul2(device_->context, &fused), "matmul2");
    }
    if (!direct) y_buffer_.download(0, host_write(y, ny), ny * sizeof(float));
  }

  // Whether the device's weights can multiply one input in one launch (matmul2's parts): ABI v2,
  // at most three weights of one format, every output in device memory.
  bool can_fuse(const std::vector<const PluginWeight*>& weights, const std::vector<float*>& ys, int64_t n_tokens) const {
    if (!v2_ || weights.size() < 2 || weights.size() > 3) return false;
    for (const PluginWeight* w : weights) {
      if (!w->on_device || w->type != weights[0]->type || w->cols() != weights[0]->cols()) return false;
    }
    for (size_t i = 0; i < ys.size(); ++i) {
      if (!on_device(ys[i], static_cast<size_t>(n_tokens * weights[i]->rows()))) return false;
    }
    return true;
  }

  // ys[i] = in · weights[i]ᵀ for every weight in one launch per chunk of rows (matmul2's parts),
  // or with `glu` (two weights, one output) ys[0] = act(in · gateᵀ) * (in · upᵀ).
  void fused_product(const std::vector<const PluginWeight*>& weights, DeviceSpan in, int64_t n_tokens,
                     const std::vector<float*>& ys, const DeviceSpan* rms, float rms_eps,
                     std::optional<Activation> glu = std::nullopt) {
    std::vector<DeviceSpan> outs;
    for (size_t i = 0; i < ys.size(); ++i) {
      outs.push_back(device_overwrite(ys[i], static_cast<size_t>(n_tokens * weights[i]->rows())));
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
      if (rms != nullptr) {
        args.rms_weight = rms->buffer;
        args.rms_weight_offset = rms->offset;
        args.rms_eps = rms_eps;
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
      check(*device_, api_.matmul2(device_->context, &args), "matmul2");
    }
  }

  void device_rms_norm(DeviceSpan from, DeviceSpan to, DeviceSpan weight, int64_t n_rows, int64_t width, float eps) {
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
    check(*device_, api_.rms_norm(device_->context, &args), "rms_norm");
  }

  // x[i] += delta[i % delta_n] for i < n: a residual (delta_n = n) or a bias on every row.
  void add_repeated(float* x, const float* delta, int64_t n, int64_t delta_n) {
    flush_pending();
    const auto count = static_cast<size_t>(n), delta_count = static_cast<size_t>(delta_n);
    if (!on_cpu_ && on_device(x, count) && on_device(delta, delta_count)) {
      ringlm_add_args args{};
      const DeviceSpan d = device_read(delta, delta_count);
      const DeviceSpan io = device_write(x, count);
      args.x = io.buffer;
      args.x_offset = io.offset;
      args.delta = d.buffer;
      args.delta_offset = d.offset;
      args.n = n;
      args.delta_n = delta_n;
      check(*device_, api_.add(device_->context, &args), "add");
      return;
    }
    const float* host_delta = host_read(delta, delta_count);
    float* host_x = host_write(x, count);
    if (delta_n == n) return cpu_->add(host_x, host_delta, n);
    cpu_->add_row(host_x, host_delta, n / delta_n, delta_n);
  }

  // An internal activation of at least n floats (grown on demand), kept in device memory with
  // ABI v2.
  float* scratch(std::unique_ptr<ActivationBuffer>& buffer, size_t n) {
    if (buffer == nullptr || buffer->size() < n) buffer = alloc_activations(std::max(n, 2 * (buffer ? buffer->size() : 0)));
    return buffer->data();
  }

  // An upload that does not wait (ABI v2: the plugin copies the bytes), or the v1 upload.
  void upload_staged(DeviceBuffer& buffer, const void* src, size_t bytes, size_t offset = 0) {
    if (bytes == 0) return;
    if (v2_) {
      check(*device_, api_.upload_async(device_->context, buffer.get(), offset, src, bytes), "upload_async");
    } else {
      buffer.upload(offset, src, bytes);
    }
  }

  // --- KV caches on the device ------------------------------------------------------------

  // The device copy the backend keeps for `kv`, or nullptr.
  static PluginKvCache* device_copy(const KvView& kv) {
    return kv.state != nullptr ? static_cast<PluginKvCache*>(kv.state->get()) : nullptr;
  }

  // The host rows of a cache whose device copy is newer, downloaded (a wait): every slot the
  // device ever stored into, in every layer (a prefix's view may show fewer).
  void sync_host_rows(const KvView& kv, PluginKvCache& copy) {
    if (!copy.host_stale) return;
    const auto extent = static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(kv.positions.size()), copy.stored_extent));
    if (extent > 0) {
      const size_t bytes = extent * copy.row_bytes;
      // The layers on the CPU have their rows on the host alone.
      for (int layer = copy.shape.first_layer; layer < kv.n_layer; ++layer) {
        copy.keys.download(copy.slot_at(layer, 0), kv.key(layer, 0), bytes);
        copy.values.download(copy.slot_at(layer, 0), kv.value(layer, 0), bytes);
      }
    }
    copy.host_stale = false;
  }

  // n rows of fp32 at `from` into slots first_slot.. of `layer` in `rows` (keys or values).
  void device_store(const PluginKvCache& copy, DeviceBuffer& rows, int layer, int first_slot, int n, DeviceSpan from) {
    ringlm_store_kv_args args{};
    args.src = from.buffer;
    args.src_offset = from.offset;
    args.dst = rows.get();
    args.dst_offset = copy.slot_at(layer, first_slot);
    args.kv_format = copy.shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    args.n_rows = n;
    args.row_width = copy.shape.row_width;
    check(*device_, api_.store_kv(device_->context, &args), "store_kv");
  }

  // One sequence's attention on the CPU: its cache's rows (and its prefix's) up to date on the
  // host first.
  void host_attention_call(const AttentionCall& call, const AttentionShape& shape) {
    if (PluginKvCache* copy = device_copy(*call.kv)) {
      sync_host_rows(*call.kv, *copy);
      copy->host_only = true;  // from now on its rows are the host's
    }
    if (const KvView* prefix = call.kv->prefix; prefix != nullptr && prefix->source_state != nullptr) {
      if (auto* source = static_cast<PluginKvCache*>(prefix->source_state->get())) sync_host_rows(*prefix, *source);
    }
    const size_t n = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim;
    AttentionCall host = call;
    host.q = host_read(call.q, n);
    host.out = host_overwrite(call.out, n);
    cpu_calls_.push_back(host);
  }

  // Why this cache's attention cannot run on the device, or nullptr when it can: the device
  // must run the geometry (asked once per geometry and cache type), and the cache must read no
  // shared prefix unless it can copy the prefix's rows on the device; a sliding window needs ABI v2.
  const char* why_not_on_device(const KvView& kv, const AttentionShape& shape) {
    if (kv.prefix != nullptr && !v2_) {
      return "attention over a shared prompt segment runs on the CPU (the plugin cannot copy on the device: plugin ABI 1)";
    }
    if (shape.window != 0 && !v2_) {
      return "sliding-window attention runs on the CPU (the plugin's attention has no window: plugin ABI 1)";
    }
    if (kv.state == nullptr) return "attention over a read-only cache runs on the CPU";
    if (const PluginKvCache* copy = device_copy(kv); copy != nullptr && copy->host_only) {
      return "attention of this head geometry runs on the CPU (the plugin does not take it)";
    }
    const GeometryKey key{shape.n_head, shape.n_head_kv, shape.head_dim, kv.f16};
    auto known = geometries_.find(key);
    if (known == geometries_.end()) known = geometries_.emplace(key, supports(shape, kv.f16)).first;
    return known->second ? nullptr : "attention of this head geometry runs on the CPU (the plugin does not take it)";
  }

  // A fallback to the CPU is said once, on stderr, the first time it happens.
  void notice_once(const char* why) {
    if (told_.insert(why).second) std::fprintf(stderr, "ringlm: %s: %s\n", device_label(*device_).c_str(), why);
  }

  bool supports(const AttentionShape& shape, bool f16_kv) const {
    ringlm_op_desc attention{};
    attention.op = shape.window != 0 ? RINGLM_OP_WINDOW_ATTENTION : RINGLM_OP_ATTENTION;
    attention.kv_format = f16_kv ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    attention.n_head = shape.n_head;
    attention.n_head_kv = shape.n_head_kv;
    attention.head_dim = shape.head_dim;
    ringlm_op_desc shift = attention;
    shift.op = RINGLM_OP_ROPE_SHIFT;
    shift.n_rot = shape.head_dim;
    return api_.supports(device_->context, &attention) != 0 && api_.supports(device_->context, &shift) != 0;
  }

  // Whether `kv`'s rows may live on the device: a cache of its own (not a read-only view), whose
  // shared prefix, if any, the device can copy (ABI v2).
  bool device_may_hold(const KvView& kv) const { return kv.state != nullptr && (kv.prefix == nullptr || v2_); }

  // The cache's device copy, made on first use with the rows the cache already holds (and its
  // prefix's), but for slots [fresh_begin, fresh_end): the ones a store is about to write in every
  // layer, whose host rows are not written yet. A copy made for another prefix (the cache was
  // cleared and given a new one) goes.
  PluginKvCache& ensure_device_copy(const KvView& kv, int fresh_begin = 0, int fresh_end = 0) {
    const uint64_t prefix_id = kv.prefix != nullptr ? kv.prefix->cache_id : 0;
    if (PluginKvCache* copy = device_copy(kv)) {
      if (copy->prefix_id == prefix_id) return *copy;
      kv.state->reset();
    }
    const int first_layer = std::min(first_device_layer_, kv.n_layer);
    const int prefix_slots = kv.prefix != nullptr ? static_cast<int>(kv.prefix->positions.size()) : 0;
    auto copy = std::make_unique<PluginKvCache>(
        device_, DeviceKvShape{kv.n_layer, first_layer, prefix_slots + kv.capacity, kv.row_width, kv.f16});
    copy->prefix_slots = prefix_slots;
    copy->prefix_id = prefix_id;
    if (prefix_slots > 0) copy_prefix_rows(*kv.prefix, *copy);
    const auto extent = static_cast<int>(kv.positions.size());
    const auto upload_slots = [&](int begin, int end) {
      if (begin >= end) return;
      const size_t bytes = static_cast<size_t>(end - begin) * copy->row_bytes;
      for (int layer = first_layer; layer < kv.n_layer; ++layer) {
        upload_staged(copy->keys, kv.key(layer, begin), bytes, copy->slot_at(layer, begin));
        upload_staged(copy->values, kv.value(layer, begin), bytes, copy->slot_at(layer, begin));
      }
    };
    upload_slots(0, std::min(fresh_begin, extent));
    upload_slots(std::max(fresh_end, 0), extent);
    PluginKvCache& made = *copy;
    *kv.state = std::move(copy);
    return made;
  }

  // A prompt segment's rows into the front of a reader's device copy: on the device from the
  // segment's own device copy where it has one (its rows the newest), else from the host.
  void copy_prefix_rows(const KvView& prefix, PluginKvCache& reader) {
    const size_t bytes = static_cast<size_t>(reader.prefix_slots) * reader.row_bytes;
    PluginKvCache* source =
        prefix.source_state != nullptr ? static_cast<PluginKvCache*>(prefix.source_state->get()) : nullptr;
    const bool on_device = source != nullptr && !source->host_only && source->prefix_slots == 0 &&
                           source->shape.first_layer == reader.shape.first_layer;
    if (source != nullptr && !on_device) sync_host_rows(prefix, *source);
    for (int layer = reader.shape.first_layer; layer < prefix.n_layer; ++layer) {
      if (on_device) {
        check(*device_,
              api_.copy(device_->context, reader.keys.get(), reader.layer_at(layer), source->keys.get(),
                        source->slot_at(layer, 0), bytes),
              "copy");
        check(*device_,
              api_.copy(device_->context, reader.values.get(), reader.layer_at(layer), source->values.get(),
                        source->slot_at(layer, 0), bytes),
              "copy");
      } else {
        upload_staged(reader.keys, prefix.key(layer, 0), bytes, reader.layer_at(layer));
        upload_staged(reader.values, prefix.value(layer, 0), bytes, reader.layer_at(layer));
      }
    }
  }

  // The positions of a copy's slots: its prefix's (as the cache reads them: the segment's tokens
  // past the shared ones masked), then the cache's own.
  std::span<const int64_t> device_positions(const PluginKvCache& c, const KvView& kv) {
    if (c.prefix_slots == 0) return kv.positions;
    joined_positions_.assign(kv.prefix->positions.begin(), kv.prefix->positions.end());
    joined_positions_.insert(joined_positions_.end(), kv.positions.begin(), kv.positions.end());
    return joined_positions_;
  }

  // A pass changes a few slots (a decode step one, a context shift the ring's): only the span
  // from the first changed slot to the last goes to the device.
  void set_positions(PluginKvCache& c, std::span<const int64_t> positions) {
    // Positions stay below the context size plus what a sequence generates; a ring shifts them
    // back. 2^31 tokens in one sequence is not a case to serve.
    for (const int64_t p : positions) {
      if (p > INT32_MAX) throw std::length_error("device attention: position beyond 2^31");
    }
    const size_t known = c.host_positions.size();  // slots the device holds a position for
    if (known < positions.size()) c.host_positions.resize(positions.size());
    size_t first = positions.size(), end = 0;  // the changed span
    for (size_t j = 0; j < positions.size(); ++j) {
      const auto p = static_cast<int32_t>(positions[j]);
      if (j >= known || c.host_positions[j] != p) {
        c.host_positions[j] = p;
        first = std::min(first, j);
        end = j + 1;
      }
    }
    if (first < end) {
      try {
        upload_staged(c.positions, &c.host_positions[first], (end - first) * sizeof(int32_t), first * sizeof(int32_t));
      } catch (...) {
        c.host_positions.clear();  // the device's copy is unknown now: the next call uploads it all
        throw;
      }
    }
    c.n_slots = static_cast<int>(positions.size());
  }

  void attend(PluginKvCache& c, int layer, const AttentionCall& call, const AttentionShape& shape) {
    const size_t n = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim;
    const bool direct = on_device(call.q, n) && on_device(call.out, n);
    DeviceSpan q, out;
    if (direct) {
      q = device_read(call.q, n);
      out = device_overwrite(call.out, n);
    } else {
      ensure(q_buffer_, n * sizeof(float));
      ensure(out_buffer_, n * sizeof(float));
      upload_staged(q_buffer_, host_read(call.q, n), n * sizeof(float));
      q = {q_buffer_.get(), 0};
      out = {out_buffer_.get(), 0};
    }
    ringlm_attention2_args args{};
    ringlm_attention_args& a = args.base;
    a.q = q.buffer;
    a.q_offset = q.offset;
    a.out = out.buffer;
    a.out_offset = out.offset;
    a.keys = c.keys.get();
    a.keys_offset = c.layer_at(layer);
    a.values = c.values.get();
    a.values_offset = a.keys_offset;
    a.kv_format = c.shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    a.row_stride = c.shape.row_width;
    a.positions = c.positions.get();
    a.n_slots = c.n_slots;
    a.n_tokens = call.n_tokens;
    a.q_pos0 = call.pos0;
    a.n_head = shape.n_head;
    a.n_head_kv = shape.n_head_kv;
    a.head_dim = shape.head_dim;
    a.scale = shape.score_scale();
    args.window = shape.window;
    if (v2_) {
      check(*device_, api_.attention2(device_->context, &args), "attention");
    } else {
      check(*device_, api_.attention(device_->context, &a), "attention");
    }
    if (!direct) out_buffer_.download(0, host_write(call.out, n), n * sizeof(float));
  }

  void shift_device_keys(PluginKvCache& c, std::span<const int> slots, const RopeAngles& angles, int n_kv_head,
                         int head_dim) {
    if (slots.empty()) return;
    const auto half = static_cast<size_t>(angles.n_rot / 2);
    std::vector<int32_t> slot_list(slots.begin(), slots.end());
    for (int32_t& slot : slot_list) slot += c.prefix_slots;  // (a cache with a prefix does not shift)
    std::vector<float> cos_sin(angles.cos, angles.cos + half);
    cos_sin.insert(cos_sin.end(), angles.sin, angles.sin + half);
    DeviceBuffer slot_buffer(device_, slot_list.size() * sizeof(int32_t));
    DeviceBuffer angle_buffer(device_, cos_sin.size() * sizeof(float));
    slot_buffer.upload(0, slot_list.data(), slot_list.size() * sizeof(int32_t));
    angle_buffer.upload(0, cos_sin.data(), cos_sin.size() * sizeof(float));
    ringlm_rope_shift_args args{};
    args.keys = c.keys.get();
    args.layer_stride_bytes = c.layer_bytes;
    args.n_layer = c.shape.n_layer - c.shape.first_layer;
    args.kv_format = c.shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    args.row_stride = c.shape.row_width;
    args.slots = slot_buffer.get();
    args.n_moved = static_cast<int32_t>(slot_list.size());
    args.n_head_kv = n_kv_head;
    args.head_dim = head_dim;
    args.n_rot = angles.n_rot;
    args.adjacent_pairs = angles.adjacent_pairs ? 1 : 0;
    args.cos_sin = angle_buffer.get();
    check(*device_, api_.rope_shift(device_->context, &args), "rope_shift");
  }

  // The largest M (kMaxGemmRows, or <= kMaxDeviceRows) the device multiplies `w` by in one call; 0: the device
  // does not take this weight at all.
  int64_t device_rows_for(const WeightView& w) const {
    if (!nameable_format(w.type)) return 0;
    ringlm_op_desc desc{};
    desc.op = RINGLM_OP_MATMUL;
    desc.weight_format = static_cast<uint32_t>(w.type);
    desc.n = w.rows;
    desc.k = w.cols;
    if (v3_) {
      ringlm_op_desc gemm = desc;
      gemm.op = RINGLM_OP_GEMM;
      gemm.m = kMaxGemmRows;
      if (api_.supports(device_->context, &gemm) != 0) return kMaxGemmRows;
    }
    for (int64_t m = kMaxDeviceRows; m >= 1; m /= 2) {
      desc.m = m;
      if (api_.supports(device_->context, &desc) != 0) return m;
    }
    return 0;
  }

  void ensure(DeviceBuffer& buffer, size_t bytes) {
    if (buffer.get() == nullptr || buffer.bytes() < bytes) buffer = DeviceBuffer(device_, std::max(bytes, 2 * buffer.bytes()));
  }

  std::shared_ptr<OpenedDevice> device_;
  const ringlm_plugin& api_;
  bool v2_;  // the plugin speaks ABI v2: activations live on the device
  bool v3_;  // ... and v3: it picks a step's top k itself
  std::unique_ptr<Backend> cpu_;
  int gpu_layers_ = -1;          // --gpu-layers: the last N layers on the device (-1: all)
  int n_layer_ = 0;
  int first_device_layer_ = 0;   // layers before it run on the CPU
  bool output_on_device_ = true;
  bool on_cpu_ = false;          // the ops issued now belong to a layer that runs on the CPU
  size_t device_weight_bytes_ = 0;
  int n_weights_ = 0;                            // prepared here
  std::map<std::string, int> cpu_weight_types_;  // of those, left on the CPU, by type
  std::set<std::string> told_;                    // fallbacks already said
  std::string name_;
  std::map<const float*, MirroredActivations*> mirrors_;  // every live allocation, by address
  DeviceBuffer x_buffer_, y_buffer_, q_buffer_, out_buffer_, ids_buffer_, top_buffer_;  // staging
  std::unique_ptr<ActivationBuffer> up_out_, normed_device_;  // matmul_glu's up, a normalised input
  std::unique_ptr<ActivationBuffer> residual_;  // matmul_add's product when it cannot add in place
  std::vector<float> normed_;
  std::map<GeometryKey, bool> geometries_;   // whether the device runs each attention geometry
  std::vector<AttentionCall> cpu_calls_;     // attention()'s calls left to the CPU, reused
  std::vector<int64_t> joined_positions_;    // device_positions' prefix and own positions, reused
  std::vector<PendingRope> pending_ropes_;   // rope() calls not run yet (at most q's and k's)
};

}  // namespace

std::unique_ptr<Backend> make_plugin_backend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu,
                                             int gpu_layers) {
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
  return std::make_unique<PluginBackend>(std::move(device), std::move(cpu), gpu_layers);
}

}  // namespace ringlm

namespace ringlm {

std::unique_ptr<Backend> make_backend(const BackendChoice& choice, std::string& notice) {
  notice.clear();
  const DeviceSpec spec = parse_device_spec(choice.device);
  std::unique_ptr<Backend> cpu = make_cpu_backend(choice.n_threads, choice.compute);
  if (spec.kind == DeviceSpec::Kind::kCpu) return cpu;
  const std::vector<std::filesystem::path> dirs = plugin_search_dirs(choice.plugin_dir);
  if (spec.kind == DeviceSpec::Kind::kPlugin) {
    std::shared_ptr<OpenedDevice> device = open_plugin_device(spec, dirs, choice.cache_dir);
    return make_plugin_backend(std::move(device), std::move(cpu), choice.gpu_layers);
  }
  std::string why;
  std::shared_ptr<OpenedDevice> device = open_auto_device(dirs, choice.cache_dir, why);
  if (device == nullptr) {
    notice = "--device auto: " + why;
    return cpu;
  }
  try {
    return make_plugin_backend(std::move(device), std::move(cpu), choice.gpu_layers);
  } catch (const std::exception& e) {
    notice = std::string("--device auto: ") + e.what() + "; running on the CPU";
    return make_cpu_backend(choice.n_threads, choice.compute);
  }
}

}  // namespace ringlm

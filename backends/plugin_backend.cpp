#include "backends/plugin_backend.h"

#include <algorithm>
#include <cmath>
#include <compare>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/activation.h"

namespace ringlm {
namespace {

// Rows the device's flat GEMM takes per call (FlashDecoding++'s flat GEMM: M = 1..16); larger
// inputs are cut into such chunks.
constexpr int64_t kMaxDeviceRows = 16;

// The weight formats the ABI can name (plugin_api.h's ringlm_format = the GGUF type id).
bool nameable_format(TensorType type) {
  switch (type) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::Q4_0:
    case TensorType::Q4_1:
    case TensorType::Q8_0:
      return true;
    default:
      return false;
  }
}

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
                               " bytes: " + device_->plugin->last_error(device_->context));
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

// A KV cache's rows on the device, slot for slot as on the host: layer l's keys start at
// l * layer_bytes of `keys`, its values likewise in `values`.
class PluginKvCache final : public BackendKvState {
 public:
  PluginKvCache(const std::shared_ptr<OpenedDevice>& device, const DeviceKvShape& s)
      : shape(s),
        row_bytes(static_cast<size_t>(s.row_width) * (s.f16 ? 2 : 4)),
        layer_bytes(row_bytes * static_cast<size_t>(s.capacity)),
        keys(device, layer_bytes * static_cast<size_t>(s.n_layer)),
        values(device, layer_bytes * static_cast<size_t>(s.n_layer)),
        positions(device, sizeof(int32_t) * static_cast<size_t>(s.capacity)) {}
  DeviceKvShape shape;
  size_t row_bytes, layer_bytes;
  DeviceBuffer keys, values, positions;
  int n_slots = 0;  // slots whose positions were set
  // What the device's `positions` holds, slot for slot (each slot ever uploaded): a forward
  // pass uploads only the slots that changed since.
  std::vector<int32_t> host_positions;
};

class PluginBackend final : public Backend {
 public:
  PluginBackend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu)
      : device_(std::move(device)), api_(device_->plugin->api()), cpu_(std::move(cpu)) {
    name_ = device_->plugin->name();
  }

  std::string_view name() const override { return name_; }
  std::string device_description() const override { return device_label(*device_); }
  bool offloads() const override { return true; }

  std::string cpu_fallback_report() const override {
    if (cpu_weight_types_.empty()) return {};
    int n_cpu = 0;
    std::string types;
    for (const auto& [type, count] : cpu_weight_types_) {
      n_cpu += count;
      types += (types.empty() ? "" : ", ") + type + " x" + std::to_string(count);
    }
    return device_label(*device_) + ": " + std::to_string(n_cpu) + " of " + std::to_string(n_weights_) +
           " weights run on the CPU (" + types + "; the plugin does not take them)";
  }

  std::unique_ptr<PreparedWeight> prepare(const WeightView& w) override {
    auto prepared = std::make_unique<PluginWeight>(w.rows, w.cols);
    prepared->type = w.type;
    prepared->source = w.data;
    prepared->max_rows = device_rows_for(w);
    ++n_weights_;
    if (prepared->max_rows > 0) {
      prepared->on_device = true;
      const size_t bytes = row_bytes(w.type, w.cols) * static_cast<size_t>(w.rows);
      prepared->data = DeviceBuffer(device_, bytes);
      prepared->data.upload(0, w.data, bytes);
    } else {
      prepared->cpu = cpu_->prepare(w);
      ++cpu_weight_types_[std::string(type_traits(static_cast<uint32_t>(w.type))->name)];
    }
    return prepared;
  }

  void rows(const PreparedWeight& weight, std::span<const int32_t> ids, float* out) override {
    const PluginWeight& w = as_plugin_weight(weight);
    if (!w.on_device) return cpu_->rows(*w.cpu, ids, out);
    // The device copy was uploaded whole; the file's pages are still mapped (only the CPU
    // backend gives them back).
    const size_t stride = row_bytes(w.type, w.cols());
    for (size_t i = 0; i < ids.size(); ++i) {
      dequantize_row(w.type, w.source + static_cast<size_t>(ids[i]) * stride, out + static_cast<int64_t>(i) * w.cols(), w.cols());
    }
  }

  void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) override {
    const PluginWeight& w = as_plugin_weight(weight);
    if (!w.on_device) return cpu_->matmul(*w.cpu, x, n_tokens, y);
    upload_input(x, n_tokens, w.cols());
    device_product(w, n_tokens, y);
  }

  void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                   std::span<float* const> ys) override {
    // The CPU's weights in one fused call, the device's on one upload of the normalised input.
    std::vector<const PreparedWeight*> cpu_weights;
    std::vector<float*> cpu_ys;
    bool any_on_device = false;
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (w.on_device) {
        any_on_device = true;
      } else {
        cpu_weights.push_back(w.cpu.get());
        cpu_ys.push_back(ys[i]);
      }
    }
    if (!cpu_weights.empty()) cpu_->matmul_many(cpu_weights, input, cpu_ys);
    if (!any_on_device) return;
    upload_input(normalised(input, weights[0]->cols()), input.n_tokens, weights[0]->cols());
    for (size_t i = 0; i < weights.size(); ++i) {
      const PluginWeight& w = as_plugin_weight(*weights[i]);
      if (w.on_device) device_product(w, input.n_tokens, ys[i]);
    }
  }

  void matmul_glu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input, Activation act,
                  float* out) override {
    const PluginWeight& g = as_plugin_weight(gate);
    const PluginWeight& u = as_plugin_weight(up);
    if (!g.on_device && !u.on_device) return cpu_->matmul_glu(*g.cpu, *u.cpu, input, act, out);
    const int64_t n = input.n_tokens * g.rows();
    if (up_out_.size() < static_cast<size_t>(n)) up_out_.resize(static_cast<size_t>(n));
    const PreparedWeight* both[] = {&gate, &up};
    float* const outs[] = {out, up_out_.data()};
    matmul_many(both, input, outs);
    cpu::glu(act, out, up_out_.data(), n);
  }

  // --- The attention block ----------------------------------------------------------------
  // The host rows of every cache are the truth, written by the CPU's ops. A cache whose
  // attention the device runs (a geometry it supports, no shared prefix) gets a device copy
  // when its attention first runs there (KvView::state), and from then on every store and
  // shift reaches the copy too, so it is never stale.

  void rope(float* x, int64_t n_rows, int n_heads, int head_dim, const RopeAngles& angles) override {
    cpu_->rope(x, n_rows, n_heads, head_dim, angles);
  }
  void add(float* x, const float* delta, int64_t n) override { cpu_->add(x, delta, n); }
  void add_row(float* x, const float* row, int64_t n_rows, int64_t width) override {
    cpu_->add_row(x, row, n_rows, width);
  }
  void rms_norm(float* x, int64_t n_rows, int64_t width, const float* weight, float eps) override {
    cpu_->rms_norm(x, n_rows, width, weight, eps);
  }

  void store_kv(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) override {
    cpu_->store_kv(kv, layer, first_slot, n, k, v);
    if (PluginKvCache* copy = device_copy(kv)) {
      const size_t at = static_cast<size_t>(layer) * copy->layer_bytes + static_cast<size_t>(first_slot) * copy->row_bytes;
      const size_t bytes = static_cast<size_t>(n) * copy->row_bytes;
      copy->keys.upload(at, kv.key(layer, first_slot), bytes);
      copy->values.upload(at, kv.value(layer, first_slot), bytes);
    }
  }

  void attention(int layer, const AttentionShape& shape, std::span<const AttentionCall> calls) override {
    cpu_calls_.clear();
    for (const AttentionCall& call : calls) {
      if (const char* why = why_not_on_device(*call.kv, shape)) {
        notice_once(why);
        cpu_calls_.push_back(call);
        continue;
      }
      PluginKvCache& copy = ensure_device_copy(*call.kv);
      // Every call brings the positions up to date: set_positions uploads only what changed, and
      // the first layer that attends here need not be layer 0 (a model whose windowed layers
      // stay on the CPU), nor does a full ring change its slot count when its positions move.
      set_positions(copy, call.kv->positions);
      attend(copy, layer, call, shape);
    }
    if (!cpu_calls_.empty()) cpu_->attention(layer, shape, cpu_calls_);
  }

  void shift_keys(const KvView& kv, std::span<const int> layers, std::span<const int> slots, const RopeAngles& angles,
                  int n_head_kv, int head_dim) override {
    cpu_->shift_keys(kv, layers, slots, angles, n_head_kv, head_dim);
    PluginKvCache* copy = device_copy(kv);
    if (copy == nullptr) return;
    // The device turns every layer of its copy at once. When only some layers turn (a model
    // with two RoPE bases shifts each set of layers apart), the copy is dropped instead: the
    // host rows are the truth, and the next attention on the device uploads them afresh.
    if (static_cast<int>(layers.size()) != kv.n_layer) {
      kv.state->reset();
      return;
    }
    shift_device_keys(*copy, slots, angles, n_head_kv, head_dim);
  }
  void scale(float* x, int64_t n, float factor) override { cpu_->scale(x, n, factor); }

 private:
  // The device copy the backend keeps for `kv`, or nullptr.
  static PluginKvCache* device_copy(const KvView& kv) {
    return kv.state != nullptr ? static_cast<PluginKvCache*>(kv.state->get()) : nullptr;
  }

  // Why this cache's attention cannot run on the device, or nullptr when it can: the device
  // must run the geometry (asked once per geometry and cache type), and the cache must read no
  // shared prefix and have no sliding window (ABI v1's attention has neither).
  const char* why_not_on_device(const KvView& kv, const AttentionShape& shape) {
    if (kv.prefix != nullptr) return "attention over a shared prompt segment runs on the CPU";
    if (shape.window != 0) return "sliding-window attention runs on the CPU (the plugin's attention has no window)";
    if (kv.state == nullptr) return "attention over a read-only cache runs on the CPU";
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
    attention.op = RINGLM_OP_ATTENTION;
    attention.kv_format = f16_kv ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    attention.n_head = shape.n_head;
    attention.n_head_kv = shape.n_head_kv;
    attention.head_dim = shape.head_dim;
    ringlm_op_desc shift = attention;
    shift.op = RINGLM_OP_ROPE_SHIFT;
    shift.n_rot = shape.head_dim;
    return api_.supports(device_->context, &attention) != 0 && api_.supports(device_->context, &shift) != 0;
  }

  // The cache's device copy, made on first use with the rows the cache already holds.
  PluginKvCache& ensure_device_copy(const KvView& kv) {
    if (PluginKvCache* copy = device_copy(kv)) return *copy;
    auto copy = std::make_unique<PluginKvCache>(device_, DeviceKvShape{kv.n_layer, kv.capacity, kv.row_width, kv.f16});
    const auto extent = static_cast<int>(kv.positions.size());
    if (extent > 0) {
      const size_t bytes = static_cast<size_t>(extent) * copy->row_bytes;
      for (int layer = 0; layer < kv.n_layer; ++layer) {
        copy->keys.upload(static_cast<size_t>(layer) * copy->layer_bytes, kv.key(layer, 0), bytes);
        copy->values.upload(static_cast<size_t>(layer) * copy->layer_bytes, kv.value(layer, 0), bytes);
      }
    }
    PluginKvCache& made = *copy;
    *kv.state = std::move(copy);
    return made;
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
        c.positions.upload(first * sizeof(int32_t), &c.host_positions[first], (end - first) * sizeof(int32_t));
      } catch (...) {
        c.host_positions.clear();  // the device's copy is unknown now: the next call uploads it all
        throw;
      }
    }
    c.n_slots = static_cast<int>(positions.size());
  }

  void attend(PluginKvCache& c, int layer, const AttentionCall& call, const AttentionShape& shape) {
    const size_t bytes = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim * sizeof(float);
    ensure(q_buffer_, bytes);
    ensure(out_buffer_, bytes);
    q_buffer_.upload(0, call.q, bytes);
    ringlm_attention_args args{};
    args.q = q_buffer_.get();
    args.out = out_buffer_.get();
    args.keys = c.keys.get();
    args.keys_offset = static_cast<size_t>(layer) * c.layer_bytes;
    args.values = c.values.get();
    args.values_offset = args.keys_offset;
    args.kv_format = c.shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
    args.row_stride = c.shape.row_width;
    args.positions = c.positions.get();
    args.n_slots = c.n_slots;
    args.n_tokens = call.n_tokens;
    args.q_pos0 = call.pos0;
    args.n_head = shape.n_head;
    args.n_head_kv = shape.n_head_kv;
    args.head_dim = shape.head_dim;
    args.scale = shape.score_scale();
    check(*device_, api_.attention(device_->context, &args), "attention");
    out_buffer_.download(0, call.out, bytes);
  }

  void shift_device_keys(PluginKvCache& c, std::span<const int> slots, const RopeAngles& angles, int n_kv_head,
                         int head_dim) {
    if (slots.empty()) return;
    const auto half = static_cast<size_t>(angles.n_rot / 2);
    std::vector<int32_t> slot_list(slots.begin(), slots.end());
    std::vector<float> cos_sin(angles.cos, angles.cos + half);
    cos_sin.insert(cos_sin.end(), angles.sin, angles.sin + half);
    DeviceBuffer slot_buffer(device_, slot_list.size() * sizeof(int32_t));
    DeviceBuffer angle_buffer(device_, cos_sin.size() * sizeof(float));
    slot_buffer.upload(0, slot_list.data(), slot_list.size() * sizeof(int32_t));
    angle_buffer.upload(0, cos_sin.data(), cos_sin.size() * sizeof(float));
    ringlm_rope_shift_args args{};
    args.keys = c.keys.get();
    args.layer_stride_bytes = c.layer_bytes;
    args.n_layer = c.shape.n_layer;
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

  // The largest M (<= kMaxDeviceRows) the device multiplies `w` by in one call; 0: the device
  // does not take this weight at all.
  int64_t device_rows_for(const WeightView& w) const {
    if (!nameable_format(w.type)) return 0;
    ringlm_op_desc desc{};
    desc.op = RINGLM_OP_MATMUL;
    desc.weight_format = static_cast<uint32_t>(w.type);
    desc.n = w.rows;
    desc.k = w.cols;
    for (int64_t m = kMaxDeviceRows; m >= 1; m /= 2) {
      desc.m = m;
      if (api_.supports(device_->context, &desc) != 0) return m;
    }
    return 0;
  }

  void ensure(DeviceBuffer& buffer, size_t bytes) {
    if (buffer.get() == nullptr || buffer.bytes() < bytes) buffer = DeviceBuffer(device_, std::max(bytes, 2 * buffer.bytes()));
  }

  // The input rows as the products should see them: normalised on the host when asked.
  const float* normalised(const MatmulInput& in, int64_t cols) {
    if (in.rms_weight == nullptr) return in.x;
    const size_t n = static_cast<size_t>(in.n_tokens * cols);
    if (normed_.size() < n) normed_.resize(n);
    for (int64_t m = 0; m < in.n_tokens; ++m) normalized_input_row(in, m, cols, normed_.data() + m * cols);
    return normed_.data();
  }

  void upload_input(const float* x, int64_t n_tokens, int64_t cols) {
    const size_t bytes = static_cast<size_t>(n_tokens * cols) * sizeof(float);
    ensure(x_buffer_, bytes);
    x_buffer_.upload(0, x, bytes);
  }

  // y = x · wᵀ for the n_tokens rows in x_buffer_, in chunks of the device's flat-GEMM rows.
  void device_product(const PluginWeight& w, int64_t n_tokens, float* y) {
    const size_t bytes = static_cast<size_t>(n_tokens * w.rows()) * sizeof(float);
    ensure(y_buffer_, bytes);
    for (int64_t m0 = 0; m0 < n_tokens; m0 += w.max_rows) {
      ringlm_matmul_args args{};
      args.weight = w.data.get();
      args.weight_format = static_cast<uint32_t>(w.type);
      args.n = w.rows();
      args.k = w.cols();
      args.x = x_buffer_.get();
      args.x_offset = static_cast<size_t>(m0 * w.cols()) * sizeof(float);
      args.y = y_buffer_.get();
      args.y_offset = static_cast<size_t>(m0 * w.rows()) * sizeof(float);
      args.m = std::min(w.max_rows, n_tokens - m0);
      check(*device_, api_.matmul(device_->context, &args), "matmul");
    }
    y_buffer_.download(0, y, bytes);
  }

  std::shared_ptr<OpenedDevice> device_;
  const ringlm_plugin& api_;
  std::unique_ptr<Backend> cpu_;
  int n_weights_ = 0;                            // prepared here
  std::map<std::string, int> cpu_weight_types_;  // of those, left on the CPU, by type
  std::set<std::string> told_;                    // fallbacks already said
  std::string name_;
  DeviceBuffer x_buffer_, y_buffer_, q_buffer_, out_buffer_;
  std::vector<float> normed_, up_out_;
  std::map<GeometryKey, bool> geometries_;   // whether the device runs each attention geometry
  std::vector<AttentionCall> cpu_calls_;     // attention()'s calls left to the CPU, reused
};

}  // namespace

std::unique_ptr<Backend> make_plugin_backend(std::shared_ptr<OpenedDevice> device, std::unique_ptr<Backend> cpu) {
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
  return std::make_unique<PluginBackend>(std::move(device), std::move(cpu));
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
    return make_plugin_backend(std::move(device), std::move(cpu));
  }
  std::string why;
  std::shared_ptr<OpenedDevice> device = open_auto_device(dirs, choice.cache_dir, why);
  if (device == nullptr) {
    notice = "--device auto: " + why;
    return cpu;
  }
  try {
    return make_plugin_backend(std::move(device), std::move(cpu));
  } catch (const std::exception& e) {
    notice = std::string("--device auto: ") + e.what() + "; running on the CPU";
    return make_cpu_backend(choice.n_threads, choice.compute);
  }
}

}  // namespace ringlm

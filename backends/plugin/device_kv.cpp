#include "backends/plugin/device_kv.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

namespace ringlm {

// The shape of a KV cache on the device: the host cache's, slot for slot.
struct DeviceKvShape {
  int n_layer = 0;
  int first_layer = 0;  // the layers before it run on the CPU (--gpu-layers): no rows here
  int capacity = 0;     // slots
  int row_width = 0;    // n_kv_head * head_dim elements per slot and layer
  bool f16 = false;
};

// A KV cache's rows on the device, slot for slot as on the host, for the layers the device runs:
// layer l's keys start at layer_at(l) of `keys`, its values likewise in `values`. A cache that
// reads a shared prompt segment (KvView::prefix) holds the segment's rows first, copied on the
// device from the segment's own device copy: the device's attention reads one run of slots, the
// segment's and then the cache's (slot_at(l, s) is the cache's slot s).
class PluginKvCache final : public BackendKvState {
 public:
  PluginKvCache(const DeviceLink& link, const DeviceKvShape& s);
  size_t layer_at(int layer) const { return static_cast<size_t>(layer - shape.first_layer) * layer_bytes; }
  size_t slot_at(int layer, int slot) const {
    return layer_at(layer) + static_cast<size_t>(prefix_slots + slot) * row_bytes;
  }
  uint32_t kv_format() const { return shape.f16 ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32; }
  // The device now holds rows newer than the host's in slots first_slot .. first_slot + n - 1.
  void mark_stored(int first_slot, int n);

  DeviceKvShape shape;
  size_t row_bytes, layer_bytes;
  int prefix_slots = 0;    // the segment's slots before the cache's own
  uint64_t prefix_id = 0;  // which segment they are (its KvCache::id()), 0: none
  DeviceBuffer keys, values, positions;
  int n_slots = 0;  // slots whose positions were set
  // What the device's `positions` holds, slot for slot (each slot ever uploaded): a forward
  // pass uploads only the slots that changed since.
  std::vector<int32_t> host_positions;
  // The device's rows are newer than the host's (a store on the device, ABI v2): the host's are
  // brought up to date (DeviceKv::sync_host_rows) before anything reads them there.
  bool host_stale = false;
  // The device does not run this cache's attention (its geometry): its rows live on the host.
  bool host_only = false;
  int stored_extent = 0;  // slots 0 .. stored_extent - 1 hold rows the device stored
};

PluginKvCache::PluginKvCache(const DeviceLink& link, const DeviceKvShape& s)
    : shape(s),
      row_bytes(static_cast<size_t>(s.row_width) * (s.f16 ? 2 : 4)),
      layer_bytes(row_bytes * static_cast<size_t>(s.capacity)),
      keys(link.alloc(layer_bytes * static_cast<size_t>(s.n_layer - s.first_layer))),
      values(link.alloc(layer_bytes * static_cast<size_t>(s.n_layer - s.first_layer))),
      positions(link.alloc(sizeof(int32_t) * static_cast<size_t>(s.capacity))) {}

void PluginKvCache::mark_stored(int first_slot, int n) {
  host_stale = true;
  stored_extent = std::max(stored_extent, first_slot + n);
}

PluginKvCache* DeviceKv::copy_of(const KvView& kv) {
  return kv.state != nullptr ? static_cast<PluginKvCache*>(kv.state->get()) : nullptr;
}

// Every slot the device ever stored into, in every layer it holds (a prefix's view may show fewer).
void DeviceKv::sync_host_rows(const KvView& kv, PluginKvCache& copy) {
  if (!copy.host_stale) return;
  const auto extent = static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(kv.positions.size()), copy.stored_extent));
  if (extent > 0) {
    const size_t bytes = extent * copy.row_bytes;
    for (int layer = copy.shape.first_layer; layer < kv.n_layer; ++layer) {
      copy.keys.download(copy.slot_at(layer, 0), kv.key(layer, 0), bytes);
      copy.values.download(copy.slot_at(layer, 0), kv.value(layer, 0), bytes);
    }
  }
  copy.host_stale = false;
}

void DeviceKv::upload_host_slots(const KvView& kv, PluginKvCache& copy, int begin, int end) {
  if (begin >= end) return;
  const size_t bytes = static_cast<size_t>(end - begin) * copy.row_bytes;
  for (int layer = copy.shape.first_layer; layer < kv.n_layer; ++layer) {
    link_.upload_staged(copy.keys, kv.key(layer, begin), bytes, copy.slot_at(layer, begin));
    link_.upload_staged(copy.values, kv.value(layer, begin), bytes, copy.slot_at(layer, begin));
  }
}

PluginKvCache& DeviceKv::ensure_copy(const KvView& kv, int fresh_begin, int fresh_end) {
  const uint64_t prefix_id = kv.prefix != nullptr ? kv.prefix->cache_id : 0;
  if (PluginKvCache* copy = copy_of(kv)) {
    if (copy->prefix_id == prefix_id) return *copy;
    kv.state->reset();
  }
  const int first_layer = std::min(first_device_layer_, kv.n_layer);
  const int prefix_slots = kv.prefix != nullptr ? static_cast<int>(kv.prefix->positions.size()) : 0;
  auto copy = std::make_unique<PluginKvCache>(
      link_, DeviceKvShape{kv.n_layer, first_layer, prefix_slots + kv.capacity, kv.row_width, kv.key_type == KvType::kF16});
  copy->prefix_slots = prefix_slots;
  copy->prefix_id = prefix_id;
  if (prefix_slots > 0) copy_prefix_rows(*kv.prefix, *copy);
  const auto extent = static_cast<int>(kv.positions.size());
  upload_host_slots(kv, *copy, 0, std::min(fresh_begin, extent));
  upload_host_slots(kv, *copy, std::max(fresh_end, 0), extent);
  PluginKvCache& made = *copy;
  *kv.state = std::move(copy);
  return made;
}

// A prompt segment's rows into the front of a reader's device copy: on the device from the
// segment's own device copy where it has one (its rows the newest), else from the host.
void DeviceKv::copy_prefix_rows(const KvView& prefix, PluginKvCache& reader) {
  const size_t bytes = static_cast<size_t>(reader.prefix_slots) * reader.row_bytes;
  PluginKvCache* source =
      prefix.source_state != nullptr ? static_cast<PluginKvCache*>(prefix.source_state->get()) : nullptr;
  const bool on_device = source != nullptr && !source->host_only && source->prefix_slots == 0 &&
                         source->shape.first_layer == reader.shape.first_layer;
  if (source != nullptr && !on_device) sync_host_rows(prefix, *source);
  const ringlm_plugin& api = link_.api();
  for (int layer = reader.shape.first_layer; layer < prefix.n_layer; ++layer) {
    if (on_device) {
      link_.check(api.copy(link_.context(), reader.keys.get(), reader.layer_at(layer), source->keys.get(),
                           source->slot_at(layer, 0), bytes),
                  "copy");
      link_.check(api.copy(link_.context(), reader.values.get(), reader.layer_at(layer), source->values.get(),
                           source->slot_at(layer, 0), bytes),
                  "copy");
    } else {
      link_.upload_staged(reader.keys, prefix.key(layer, 0), bytes, reader.layer_at(layer));
      link_.upload_staged(reader.values, prefix.value(layer, 0), bytes, reader.layer_at(layer));
    }
  }
}

// n rows of fp32 at `from` into slots first_slot.. of `layer` in `rows` (keys or values).
void DeviceKv::device_store(const PluginKvCache& copy, DeviceBuffer& rows, int layer, int first_slot, int n,
                            DeviceSpan from) {
  ringlm_store_kv_args args{};
  args.src = from.buffer;
  args.src_offset = from.offset;
  args.dst = rows.get();
  args.dst_offset = copy.slot_at(layer, first_slot);
  args.kv_format = copy.kv_format();
  args.n_rows = n;
  args.row_width = copy.shape.row_width;
  link_.check(link_.api().store_kv(link_.context(), &args), "store_kv");
}

bool DeviceKv::store(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v) {
  PluginKvCache& copy = ensure_copy(kv, first_slot, first_slot + n);
  if (copy.host_only) return false;
  const size_t count = static_cast<size_t>(n) * static_cast<size_t>(kv.row_width);
  device_store(copy, copy.keys, layer, first_slot, n, residency_.device_read(k, count));
  device_store(copy, copy.values, layer, first_slot, n, residency_.device_read(v, count));
  copy.mark_stored(first_slot, n);
  return true;
}

bool DeviceKv::rope_store(const KvView& kv, int layer, int first_slot, int n,
                          const std::function<void(ringlm_rope_store_args&)>& fill) {
  PluginKvCache& copy = ensure_copy(kv, first_slot, first_slot + n);
  if (copy.host_only) return false;
  ringlm_rope_store_args args{};
  fill(args);
  const size_t at = copy.slot_at(layer, first_slot);
  args.keys = copy.keys.get();
  args.keys_offset = at;
  args.values = copy.values.get();
  args.values_offset = at;
  args.kv_format = copy.kv_format();
  link_.check(link_.api().rope_store(link_.context(), &args), "rope_store");
  copy.mark_stored(first_slot, n);
  return true;
}

void DeviceKv::before_host_store(const KvView& kv) {
  if (PluginKvCache* copy = copy_of(kv)) sync_host_rows(kv, *copy);
}

void DeviceKv::after_host_store(const KvView& kv, int layer, int first_slot, int n) {
  PluginKvCache* copy = copy_of(kv);
  if (copy == nullptr) return;
  const size_t at = copy->slot_at(layer, first_slot);
  const size_t bytes = static_cast<size_t>(n) * copy->row_bytes;
  link_.upload_staged(copy->keys, kv.key(layer, first_slot), bytes, at);
  link_.upload_staged(copy->values, kv.value(layer, first_slot), bytes, at);
}

// The device must run the geometry (asked once per geometry and cache type), and the cache must
// read no shared prefix unless it can copy the prefix's rows on the device; a sliding window
// needs ABI v2, attention sinks ABI v4.
const char* DeviceKv::why_not_on_device(const KvView& kv, const AttentionShape& shape) {
  if (kv.prefix != nullptr && !link_.v2()) {
    return "attention over a shared prompt segment runs on the CPU (the plugin cannot copy on the device: plugin ABI 1)";
  }
  if (shape.window != 0 && !link_.v2()) {
    return "sliding-window attention runs on the CPU (the plugin's attention has no window: plugin ABI 1)";
  }
  if (shape.sinks != nullptr && !link_.v4()) {
    return "attention with sinks (gpt-oss) runs on the CPU (the plugin's attention has none: plugin ABI 3 or older)";
  }
  if (kv.state == nullptr) return "attention over a read-only cache runs on the CPU";
  if (const PluginKvCache* copy = copy_of(kv); copy != nullptr && copy->host_only) {
    return "attention of this head geometry runs on the CPU (the plugin does not take it)";
  }
  const GeometryKey key{shape.n_head, shape.n_head_kv, shape.head_dim, kv.key_type == KvType::kF16};
  auto known = geometries_.find(key);
  if (known == geometries_.end()) known = geometries_.emplace(key, device_runs(shape, key.f16)).first;
  return known->second ? nullptr : "attention of this head geometry runs on the CPU (the plugin does not take it)";
}

bool DeviceKv::device_runs(const AttentionShape& shape, bool f16_kv) const {
  ringlm_op_desc attention{};
  attention.op = shape.window != 0 ? RINGLM_OP_WINDOW_ATTENTION : RINGLM_OP_ATTENTION;
  attention.kv_format = f16_kv ? RINGLM_FORMAT_F16 : RINGLM_FORMAT_F32;
  attention.n_head = shape.n_head;
  attention.n_head_kv = shape.n_head_kv;
  attention.head_dim = shape.head_dim;
  ringlm_op_desc shift = attention;
  shift.op = RINGLM_OP_ROPE_SHIFT;
  shift.n_rot = shape.head_dim;
  return link_.supports(attention) && link_.supports(shift);
}

void DeviceKv::move_to_host(const KvView& kv) {
  if (PluginKvCache* copy = copy_of(kv)) {
    sync_host_rows(kv, *copy);
    copy->host_only = true;  // from now on its rows are the host's
  }
  if (const KvView* prefix = kv.prefix; prefix != nullptr && prefix->source_state != nullptr) {
    if (auto* source = static_cast<PluginKvCache*>(prefix->source_state->get())) sync_host_rows(*prefix, *source);
  }
}

// The positions of a copy's slots: its prefix's (as the cache reads them: the segment's tokens
// past the shared ones masked), then the cache's own.
std::span<const int64_t> DeviceKv::device_positions(const PluginKvCache& c, const KvView& kv) {
  if (c.prefix_slots == 0) return kv.positions;
  joined_positions_.assign(kv.prefix->positions.begin(), kv.prefix->positions.end());
  joined_positions_.insert(joined_positions_.end(), kv.positions.begin(), kv.positions.end());
  return joined_positions_;
}

// A pass changes a few slots (a decode step one, a context shift the ring's): only the span
// from the first changed slot to the last goes to the device.
void DeviceKv::set_positions(PluginKvCache& c, std::span<const int64_t> positions) {
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
      link_.upload_staged(c.positions, &c.host_positions[first], (end - first) * sizeof(int32_t), first * sizeof(int32_t));
    } catch (...) {
      c.host_positions.clear();  // the device's copy is unknown now: the next call uploads it all
      throw;
    }
  }
  c.n_slots = static_cast<int>(positions.size());
}

void DeviceKv::attend(int layer, const AttentionCall& call, const AttentionShape& shape) {
  PluginKvCache& copy = ensure_copy(*call.kv);
  // Every call brings the positions up to date: set_positions uploads only what changed, and
  // the first layer that attends here need not be layer 0 (a model whose windowed layers
  // stay on the CPU), nor does a full ring change its slot count when its positions move.
  set_positions(copy, device_positions(copy, *call.kv));
  const size_t n = static_cast<size_t>(call.n_tokens) * shape.n_head * shape.head_dim;
  if (residency_.on_device(call.q, n) && residency_.on_device(call.out, n)) {
    const DeviceSpan q = residency_.device_read(call.q, n);
    launch_attention(copy, layer, call, shape, q, residency_.device_overwrite(call.out, n));
    return;
  }
  link_.ensure(q_buffer_, n * sizeof(float));
  link_.ensure(out_buffer_, n * sizeof(float));
  link_.upload_staged(q_buffer_, residency_.host_read(call.q, n), n * sizeof(float));
  launch_attention(copy, layer, call, shape, {q_buffer_.get(), 0}, {out_buffer_.get(), 0});
  out_buffer_.download(0, residency_.host_write(call.out, n), n * sizeof(float));
}

void DeviceKv::launch_attention(const PluginKvCache& c, int layer, const AttentionCall& call,
                                const AttentionShape& shape, DeviceSpan q, DeviceSpan out) {
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
  a.kv_format = c.kv_format();
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
  if (shape.sinks != nullptr) {  // ABI v4 (why_not_on_device)
    const DeviceSpan sinks = residency_.device_read(shape.sinks, static_cast<size_t>(shape.n_head));
    ringlm_attention3_args with_sinks{};
    with_sinks.base = args;
    with_sinks.sinks = sinks.buffer;
    with_sinks.sinks_offset = sinks.offset;
    link_.check(link_.api().attention3(link_.context(), &with_sinks), "attention3");
  } else if (link_.v2()) {
    link_.check(link_.api().attention2(link_.context(), &args), "attention");
  } else {
    link_.check(link_.api().attention(link_.context(), &a), "attention");
  }
}

void DeviceKv::shift_keys(Backend& cpu, const KvView& kv, std::span<const int> layers, std::span<const int> slots,
                          const RopeAngles& angles, int n_head_kv, int head_dim) {
  PluginKvCache* copy = copy_of(kv);
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
    cpu.shift_keys(kv, cpu_layers, slots, angles, n_head_kv, head_dim);
    if (!copy->host_stale) cpu.shift_keys(kv, device_layers, slots, angles, n_head_kv, head_dim);
    shift_device_keys(*copy, slots, angles, n_head_kv, head_dim);
    return;
  }
  if (copy == nullptr || !copy->host_stale) cpu.shift_keys(kv, layers, slots, angles, n_head_kv, head_dim);
  if (copy != nullptr) shift_device_keys(*copy, slots, angles, n_head_kv, head_dim);
}

void DeviceKv::shift_device_keys(PluginKvCache& c, std::span<const int> slots, const RopeAngles& angles, int n_kv_head,
                                 int head_dim) {
  if (slots.empty()) return;
  const auto half = static_cast<size_t>(angles.n_rot / 2);
  std::vector<int32_t> slot_list(slots.begin(), slots.end());
  for (int32_t& slot : slot_list) slot += c.prefix_slots;  // (a cache with a prefix does not shift)
  std::vector<float> cos_sin(angles.cos, angles.cos + half);
  cos_sin.insert(cos_sin.end(), angles.sin, angles.sin + half);
  DeviceBuffer slot_buffer = link_.alloc(slot_list.size() * sizeof(int32_t));
  DeviceBuffer angle_buffer = link_.alloc(cos_sin.size() * sizeof(float));
  slot_buffer.upload(0, slot_list.data(), slot_list.size() * sizeof(int32_t));
  angle_buffer.upload(0, cos_sin.data(), cos_sin.size() * sizeof(float));
  ringlm_rope_shift_args args{};
  args.keys = c.keys.get();
  args.layer_stride_bytes = c.layer_bytes;
  args.n_layer = c.shape.n_layer - c.shape.first_layer;
  args.kv_format = c.kv_format();
  args.row_stride = c.shape.row_width;
  args.slots = slot_buffer.get();
  args.n_moved = static_cast<int32_t>(slot_list.size());
  args.n_head_kv = n_kv_head;
  args.head_dim = head_dim;
  args.n_rot = angles.n_rot;
  args.adjacent_pairs = angles.adjacent_pairs ? 1 : 0;
  args.cos_sin = angle_buffer.get();
  link_.check(link_.api().rope_shift(link_.context(), &args), "rope_shift");
}

}  // namespace ringlm

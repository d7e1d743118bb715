// The device's copies of the KV caches, and the ops over them: the KV store, attention, the
// StreamingLLM key shift.
//
// A cache gets a device copy when the device first stores into it or attends over it
// (KvView::state). With ABI v2 the device's rows are the newest once it stored there
// (host_stale); the host's are brought up to date before the CPU reads them (a prefix that other
// sequences read, a cache whose attention the device cannot run). With ABI v1 the host rows are
// the truth and every store and shift reaches the copy too. With --gpu-layers the copy holds only
// the device's layers: the CPU's layers keep their rows on the host alone.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <vector>

#include "backends/backend.h"
#include "backends/plugin/device_link.h"
#include "backends/plugin/residency.h"

namespace ringlm {

class PluginKvCache;  // a cache's rows in device memory (device_kv.cpp)

class DeviceKv {
 public:
  DeviceKv(const DeviceLink& link, Residency& residency) : link_(link), residency_(residency) {}
  // Layers before it run on the CPU (--gpu-layers): device copies made from now on skip them.
  void set_first_device_layer(int layer) { first_device_layer_ = layer; }

  // Whether `kv`'s rows may live on the device: a cache of its own (not a read-only view), whose
  // shared prefix, if any, the device can copy (ABI v2).
  bool may_hold(const KvView& kv) const { return kv.state != nullptr && (kv.prefix == nullptr || link_.v2()); }
  // Stores n rows of keys and values (fp32, on the device) into the cache's device copy; false
  // (nothing done) when its rows live on the host.
  bool store(const KvView& kv, int layer, int first_slot, int n, const float* k, const float* v);
  // The same store fused with the RoPE of q and k before it, in one launch (rope_store): `fill`
  // sets the call's rope, k and v (only once the copy is known to take the rows); false, nothing
  // done, when the cache's rows live on the host.
  bool rope_store(const KvView& kv, int layer, int first_slot, int n,
                  const std::function<void(ringlm_rope_store_args&)>& fill);
  // Before the CPU stores into the host rows, and after: the device copy, if any, kept in step.
  void before_host_store(const KvView& kv);
  void after_host_store(const KvView& kv, int layer, int first_slot, int n);

  // Why this cache's attention cannot run on the device, or nullptr when it can.
  const char* why_not_on_device(const KvView& kv, const AttentionShape& shape);
  // A cache (and its prefix) whose attention runs on the CPU: its rows brought up to date on the
  // host, and kept there from now on.
  void move_to_host(const KvView& kv);
  // One sequence's attention on the device.
  void attend(int layer, const AttentionCall& call, const AttentionShape& shape);

  // StreamingLLM's shift on the rows wherever they are newest; `cpu` turns the host's.
  void shift_keys(Backend& cpu, const KvView& kv, std::span<const int> layers, std::span<const int> slots,
                  const RopeAngles& angles, int n_head_kv, int head_dim);

 private:
  // An attention geometry and KV type, as the device was asked whether it runs them.
  struct GeometryKey {
    int n_head, n_head_kv, head_dim;
    bool f16;
    auto operator<=>(const GeometryKey&) const = default;
  };

  // The device copy the backend keeps for `kv`, or nullptr.
  static PluginKvCache* copy_of(const KvView& kv);
  // The cache's device copy, made on first use with the rows the cache already holds (and its
  // prefix's), but for slots [fresh_begin, fresh_end): the ones a store is about to write in
  // every layer, whose host rows are not written yet. A copy made for another prefix (the cache
  // was cleared and given a new one) goes.
  PluginKvCache& ensure_copy(const KvView& kv, int fresh_begin = 0, int fresh_end = 0);
  // The host rows of a cache whose device copy is newer, downloaded (a wait).
  void sync_host_rows(const KvView& kv, PluginKvCache& copy);
  void device_store(const PluginKvCache& copy, DeviceBuffer& rows, int layer, int first_slot, int n, DeviceSpan from);
  void upload_host_slots(const KvView& kv, PluginKvCache& copy, int begin, int end);
  void copy_prefix_rows(const KvView& prefix, PluginKvCache& reader);
  std::span<const int64_t> device_positions(const PluginKvCache& c, const KvView& kv);
  void set_positions(PluginKvCache& c, std::span<const int64_t> positions);
  void launch_attention(const PluginKvCache& c, int layer, const AttentionCall& call, const AttentionShape& shape,
                        DeviceSpan q, DeviceSpan out);
  void shift_device_keys(PluginKvCache& c, std::span<const int> slots, const RopeAngles& angles, int n_kv_head,
                         int head_dim);
  bool device_runs(const AttentionShape& shape, bool f16_kv) const;

  const DeviceLink& link_;
  Residency& residency_;
  int first_device_layer_ = 0;
  std::map<GeometryKey, bool> geometries_;  // whether the device runs each attention geometry
  std::vector<int64_t> joined_positions_;   // device_positions' prefix and own positions, reused
  DeviceBuffer q_buffer_, out_buffer_;      // staging of attention on host queries
};

}  // namespace ringlm

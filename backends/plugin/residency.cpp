#include "backends/plugin/residency.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace ringlm {
namespace {

// A range of floats, [begin, end), offsets into one activation allocation.
struct FloatRange {
  size_t begin = 0, end = 0;
  bool empty() const { return begin >= end; }
  bool overlaps(FloatRange o) const { return !empty() && !o.empty() && begin < o.end && o.begin < end; }
  bool within(FloatRange o) const { return o.begin <= begin && end <= o.end; }
  FloatRange hull(FloatRange o) const {
    if (empty()) return o;
    if (o.empty()) return *this;
    return {std::min(begin, o.begin), std::max(end, o.end)};
  }
};

}  // namespace

// Activation memory of a device backend: a device buffer and a host mirror of it, each newer
// than the other in places (see residency.h).
class MirroredActivations final : public ActivationBuffer {
 public:
  MirroredActivations(std::unique_ptr<float[]> host, size_t n, DeviceBuffer device)
      : ActivationBuffer(host.get(), n), device(std::move(device)), host_(std::move(host)) {}
  ~MirroredActivations() override {
    if (on_destroy) on_destroy();
  }
  FloatRange range_of(const float* p, size_t n) const {
    const auto begin = static_cast<size_t>(p - data());
    return {begin, begin + n};
  }

  DeviceBuffer device;
  std::vector<FloatRange> device_stale;  // written on the host, not yet uploaded
  FloatRange host_stale;                 // written on the device, not yet downloaded
  std::function<void()> on_destroy;      // unregisters it from its Residency

 private:
  std::unique_ptr<float[]> host_;
};

Residency::~Residency() {
  // Allocations the model still holds must not call back into a backend that is gone.
  for (auto& [base, mirror] : mirrors_) mirror->on_destroy = nullptr;
}

std::unique_ptr<ActivationBuffer> Residency::alloc(size_t n) {
  auto host = std::make_unique<float[]>(n > 0 ? n : 1);
  DeviceBuffer device = link_.alloc(std::max<size_t>(n, 1) * sizeof(float));
  auto made = std::make_unique<MirroredActivations>(std::move(host), n, std::move(device));
  MirroredActivations* raw = made.get();
  raw->device_stale.push_back({0, n});  // the host's zeros go up before the device first uses it
  mirrors_[raw->data()] = raw;
  raw->on_destroy = [this, base = raw->data()] { mirrors_.erase(base); };
  return made;
}

MirroredActivations* Residency::mirror_of(const float* p, size_t n) const {
  if (p == nullptr || mirrors_.empty()) return nullptr;
  auto it = mirrors_.upper_bound(p);
  if (it == mirrors_.begin()) return nullptr;
  --it;
  MirroredActivations* m = it->second;
  const float* base = m->data();
  return p >= base && p + n <= base + m->size() ? m : nullptr;
}

bool Residency::on_device(const float* p, size_t n) const { return mirror_of(p, n) != nullptr; }

bool Residency::device_newest(const float* p, size_t n) const {
  const MirroredActivations* m = mirror_of(p, n);
  return m != nullptr && m->host_stale.overlaps(m->range_of(p, n));
}

// Uploads what the host wrote since the device last saw the allocation.
void Residency::flush_to_device(MirroredActivations& m) {
  for (const FloatRange r : m.device_stale) {
    link_.upload_staged(m.device, m.data() + r.begin, (r.end - r.begin) * sizeof(float), r.begin * sizeof(float));
  }
  m.device_stale.clear();
}

DeviceSpan Residency::on_device_for(const Operand& o) {
  MirroredActivations& m = *mirror_of(o.p, o.n);
  const FloatRange r = m.range_of(o.p, o.n);
  if (o.access == Access::kOverwrite) {  // what the host wrote there need not go up
    std::erase_if(m.device_stale, [&](FloatRange d) { return d.within(r); });
  }
  flush_to_device(m);
  if (o.access != Access::kRead) m.host_stale = m.host_stale.hull(r);
  return {m.device.get(), r.begin * sizeof(float)};
}

// One download (a wait) of everything the device wrote: the device holds the newest values in
// all of host_stale once the host's own writes are up.
void Residency::download_stale(MirroredActivations& m) {
  flush_to_device(m);
  const FloatRange r = m.host_stale;
  m.device.download(r.begin * sizeof(float), m.data() + r.begin, (r.end - r.begin) * sizeof(float));
  m.host_stale = {};
}

void Residency::list_host_write(MirroredActivations& m, const float* p, size_t n) {
  const FloatRange r = m.range_of(p, n);
  const bool listed = std::any_of(m.device_stale.begin(), m.device_stale.end(), [&](FloatRange d) { return r.within(d); });
  if (listed) return;  // written again (a residual in every layer on the CPU): uploaded once
  if (!m.device_stale.empty() && m.device_stale.back().end == r.begin) {
    m.device_stale.back().end = r.end;
  } else {
    m.device_stale.push_back(r);
  }
}

float* Residency::on_host_for(const Operand& o) {
  auto* p = const_cast<float*>(o.p);  // written only when the access says so
  MirroredActivations* m = mirror_of(o.p, o.n);
  if (m == nullptr) return p;
  const FloatRange r = m->range_of(o.p, o.n);
  if (o.access == Access::kOverwrite && m->host_stale.within(r)) m->host_stale = {};  // need not come down
  if (m->host_stale.overlaps(r)) download_stale(*m);
  if (o.access != Access::kRead) list_host_write(*m, o.p, o.n);
  return p;
}

DeviceSpan Residency::device_input(const float* x, size_t n) {
  if (on_device(x, n)) return device_read(x, n);
  link_.ensure(staged_input_, n * sizeof(float));
  link_.upload_staged(staged_input_, x, n * sizeof(float));
  return {staged_input_.get(), 0};
}

}  // namespace ringlm

// Where the newest copy of each activation is: the only unit of the plugin backend that knows.
//
// With ABI v2 every activation allocation is a device buffer with a host mirror
// (MirroredActivations). Host writes (write(), an op the CPU runs) are listed exactly and uploaded
// (without waiting) before the device next touches the allocation; device writes widen one range
// that is downloaded before the host next reads inside it. The device writes only once every host
// write is uploaded, so the device holds the newest values everywhere in that range when it is
// read. Outputs that an op overwrites whole skip the copy the other side wrote (with --gpu-layers
// the two sides take turns writing the same activations every step).
//
// Callers say where an op runs and how it touches each operand (Access); Residency brings the
// operand up to date there and records the write.
#pragma once

#include <cstddef>
#include <map>
#include <memory>

#include "backends/backend.h"
#include "backends/plugin/device_link.h"

namespace ringlm {

class MirroredActivations;

// How an op touches an operand.
enum class Access {
  kRead,       // reads it
  kUpdate,     // writes it, and may read it first (an op in place)
  kOverwrite,  // writes all of it without reading it
};

// An activation range an op reads or writes: [p, p + n) floats.
struct Operand {
  const float* p = nullptr;
  size_t n = 0;
  Access access = Access::kRead;
};

class Residency {
 public:
  explicit Residency(const DeviceLink& link) : link_(link) {}
  ~Residency();
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  // n floats of activation memory (zeroed) on the device, with its host mirror.
  std::unique_ptr<ActivationBuffer> alloc(size_t n);

  // Whether [p, p + n) lies in one allocation of this backend's (else it is plain host memory).
  bool on_device(const float* p, size_t n) const;
  bool on_device(const Operand& o) const { return on_device(o.p, o.n); }
  // Whether the device holds values in [p, p + n) the host has not seen (a step's logits).
  bool device_newest(const float* p, size_t n) const;

  // The operand current on the device (it must be an allocation), its write recorded.
  DeviceSpan on_device_for(const Operand& o);
  // The operand current on the host (any pointer), its write recorded.
  float* on_host_for(const Operand& o);

  DeviceSpan device_read(const float* p, size_t n) { return on_device_for({p, n, Access::kRead}); }
  DeviceSpan device_write(float* p, size_t n) { return on_device_for({p, n, Access::kUpdate}); }
  DeviceSpan device_overwrite(float* p, size_t n) { return on_device_for({p, n, Access::kOverwrite}); }
  const float* host_read(const float* p, size_t n) { return on_host_for({p, n, Access::kRead}); }
  float* host_write(float* p, size_t n) { return on_host_for({p, n, Access::kUpdate}); }
  float* host_overwrite(float* p, size_t n) { return on_host_for({p, n, Access::kOverwrite}); }

  // The input of a product on the device: an allocation's own buffer, or (any other pointer, or a
  // version-1 plugin) the rows uploaded to a staging buffer.
  DeviceSpan device_input(const float* x, size_t n);

 private:
  MirroredActivations* mirror_of(const float* p, size_t n) const;
  void flush_to_device(MirroredActivations& m);
  void download_stale(MirroredActivations& m);
  void list_host_write(MirroredActivations& m, const float* p, size_t n);

  const DeviceLink& link_;
  std::map<const float*, MirroredActivations*> mirrors_;  // every live allocation, by address
  DeviceBuffer staged_input_;
};

}  // namespace ringlm

// Memory for the weights the CPU backend repacks at load, in large slabs backed by transparent
// huge pages where the kernel offers them (madvise).
//
// Why: decode streams every weight byte once per token. With 4 KiB pages a model of 100 MB
// touches 25,000 pages per token, each a TLB miss; with 2 MiB pages, 50. And handing the
// weights out in the order the model prepares them (layer by layer, the order of use) keeps the
// stream of one token sequential across matrices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace ringlm::cpu {

class WeightArena {
 public:
  // A block of `bytes` bytes, 64-byte aligned, uninitialised; it stays valid while the returned
  // pointer (or a copy) lives, even after the arena is gone. Thread-safe.
  std::shared_ptr<uint8_t> allocate(size_t bytes);

  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kFirstSlab = kHugePage;       // slabs double from here ...
  static constexpr size_t kMaxSlab = size_t{64} << 20;  // ... up to this (a larger block gets its own)

 private:
  void release_tail();  // called with mutex_ held

  std::mutex mutex_;
  std::shared_ptr<uint8_t> slab_;  // the slab blocks are cut from now
  size_t slab_size_ = 0;
  size_t used_ = 0;
};

// A block of its own, 64-byte aligned, on huge pages when it spans at least one.
std::shared_ptr<uint8_t> allocate_weight_block(size_t bytes);

}  // namespace ringlm::cpu

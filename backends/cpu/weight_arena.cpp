#include "backends/cpu/weight_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

namespace ringlm::cpu {
namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// `bytes` (a multiple of the huge page) aligned to a huge page, so that the kernel can map it
// with 2 MiB pages. madvise failing (no THP in this kernel) only costs the speed-up.
std::shared_ptr<uint8_t> allocate_huge(size_t bytes) {
  void* p = std::aligned_alloc(WeightArena::kHugePage, bytes);
  if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
}

}  // namespace

std::shared_ptr<uint8_t> allocate_weight_block(size_t bytes) {
  bytes = std::max<size_t>(bytes, 64);
  if (bytes >= WeightArena::kHugePage) return allocate_huge(round_up(bytes, WeightArena::kHugePage));
  void* p = std::aligned_alloc(64, round_up(bytes, 64));
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
}

// The slab's pages past its last block are never written, but a huge page is resident as a
// whole once any byte of it is: give back the whole 4 KiB pages of the tail, which splits a
// partly used huge page instead of keeping up to 2 MiB of nothing per slab.
void WeightArena::release_tail() {
  if (!slab_) return;
  const size_t begin = round_up(used_, 4096);
  if (begin < slab_size_) madvise(slab_.get() + begin, slab_size_ - begin, MADV_DONTNEED);
}

std::shared_ptr<uint8_t> WeightArena::allocate(size_t bytes) {
  bytes = round_up(std::max<size_t>(bytes, 64), 64);
  if (bytes > kMaxSlab / 2) return allocate_weight_block(bytes);
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!slab_ || used_ + bytes > slab_size_) {
    release_tail();
    slab_size_ = slab_ ? std::min(kMaxSlab, slab_size_ * 2) : kFirstSlab;
    slab_size_ = std::max(slab_size_, round_up(bytes, kHugePage));
    slab_ = allocate_huge(slab_size_);
    used_ = 0;
  }
  // The aliasing constructor: the block points into the slab and keeps all of it alive.
  std::shared_ptr<uint8_t> block(slab_, slab_.get() + used_);
  used_ += bytes;
  return block;
}

}  // namespace ringlm::cpu

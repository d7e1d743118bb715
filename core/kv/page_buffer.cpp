#include "core/kv/page_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <new>
#include <utility>
#include <vector>

namespace ringlm {

PageBuffer::PageBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // MAP_NORESERVE: the context's full size is address space, not a promise of memory.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<uint8_t*>(p);
}

PageBuffer::~PageBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
}

PageBuffer::PageBuffer(PageBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PageBuffer& PageBuffer::operator=(PageBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void PageBuffer::release() {
  // On a private anonymous mapping, MADV_DONTNEED drops the pages; the next touch maps zeros.
  if (data_ != nullptr) madvise(data_, size_, MADV_DONTNEED);
}

size_t PageBuffer::resident_bytes() const {
  if (data_ == nullptr) return 0;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size_ + page - 1) / page);
  if (mincore(data_, size_, resident.data()) != 0) return 0;
  size_t pages = 0;
  for (unsigned char r : resident) pages += r & 1;
  return pages * page;
}

}  // namespace ringlm

// A zero-filled byte buffer whose memory is committed page by page, when first written.
//
// A KV cache is sized for its whole context up front (its slots must not move), but most of it
// is usually empty: a sequence of 100 tokens in a 2048-token cache. An anonymous mapping costs
// address space only; the pages a sequence writes become resident, and release() gives them
// back (the contents read as zero again). So a cache's resident memory follows the tokens it
// holds, and n caches that share one prompt segment do not each pay for the prompt.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ringlm {

class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(size_t bytes);
  ~PageBuffer();
  PageBuffer(PageBuffer&& other) noexcept;
  PageBuffer& operator=(PageBuffer&& other) noexcept;
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

  // Returns every committed page to the system; the whole buffer reads as zero afterwards.
  void release();
  // Bytes of the buffer that are resident now (mincore): what it really costs.
  size_t resident_bytes() const;

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ringlm

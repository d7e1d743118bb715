// The decode loop allocates nothing: once a prompt has been prefilled, every later forward()
// of one token runs on buffers sized at load or by that prefill. Checked by counting calls of
// the global operator new (every C++ container allocation goes through it) around the steps.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "core/model/loader.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<long> allocations{0};
}  // namespace

// These replace the global operators, so malloc/free is their matching pair; GCC cannot tell
// and warns at every inlined new-expression.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Every non-aligned form is replaced, so that each allocation is counted and each pointer goes
// back to the free() that matches its malloc() (the sanitizer build checks the pairing).
namespace {
void* counted_malloc(std::size_t size) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size == 0 ? 1 : size);
}
}  // namespace

void* operator new(std::size_t size) {
  if (void* p = counted_malloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) {
  if (void* p = counted_malloc(size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return counted_malloc(size); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return counted_malloc(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace ringlm {
namespace {

// Tiny models the test fixture generated (tests/CMakeLists.txt): an int8-kernel format and an
// fp32-path format, so both compute paths are covered.
class DecodeAllocations : public ::testing::TestWithParam<std::string> {};

TEST_P(DecodeAllocations, NoneAfterThePrefill) {
  for (const ComputeType compute : {ComputeType::kInt8, ComputeType::kFp32}) {
    for (const int n_threads : {1, 2}) {
      LoadedModel m = load_model(std::string(RINGLM_TEST_WORK_DIR) + "/" + GetParam(), n_threads, compute);
      KvCache cache = m.model->make_cache(64);
      std::vector<float> logits(static_cast<size_t>(m.model->hparams().n_vocab));
      const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
      m.model->forward(prompt, cache, logits.data());
      allocations = 0;
      counting = true;
      for (int32_t step = 0; step < 16; ++step) {
        const int32_t token = 20 + step;
        m.model->forward(std::span<const int32_t>(&token, 1), cache, logits.data());
      }
      counting = false;
      EXPECT_EQ(allocations.load(), 0) << "threads " << n_threads << ", compute " << (compute == ComputeType::kInt8 ? "int8" : "fp32");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, DecodeAllocations, ::testing::Values("tiny_q4_1.gguf", "tiny_q8_0.gguf", "tiny_q4_k.gguf",
                                                                  "tiny_mixtral_q4_0.gguf", "tiny_qwen3moe_q8_0.gguf"),
                         [](const auto& info) { return info.param.substr(5, info.param.size() - 10); });

}  // namespace
}  // namespace ringlm

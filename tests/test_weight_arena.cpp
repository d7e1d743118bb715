// The CPU backend's weight arena: aligned, disjoint blocks that outlive the arena.
#include "backends/cpu/weight_arena.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace ringlm::cpu {
namespace {

bool aligned(const void* p, size_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

TEST(WeightArena, BlocksAreAlignedDisjointAndWritable) {
  WeightArena arena;
  // Sizes that are not multiples of 64, small and large, enough to need several slabs.
  const std::vector<size_t> sizes = {1, 63, 64, 65, 4096, 100000, 700000, 3000000, 5, 20000000, 123457, 40000000};
  std::vector<std::pair<std::shared_ptr<uint8_t>, size_t>> blocks;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto b = arena.allocate(sizes[i]);
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(aligned(b.get(), 64)) << "block " << i;
    std::memset(b.get(), static_cast<int>(i + 1), sizes[i]);
    blocks.emplace_back(std::move(b), sizes[i]);
  }
  // No block overlaps another: each still holds its own fill byte everywhere.
  for (size_t i = 0; i < blocks.size(); ++i) {
    const uint8_t* p = blocks[i].first.get();
    const size_t n = blocks[i].second;
    EXPECT_TRUE(std::all_of(p, p + n, [&](uint8_t v) { return v == static_cast<uint8_t>(i + 1); })) << "block " << i;
  }
}

TEST(WeightArena, BlocksOutliveTheArena) {
  std::shared_ptr<uint8_t> kept;
  {
    WeightArena arena;
    kept = arena.allocate(1000);
    arena.allocate(5000);
  }
  // Under AddressSanitizer a use after free here fails the test.
  std::memset(kept.get(), 7, 1000);
  EXPECT_EQ(kept.get()[999], 7);
}

TEST(WeightArena, SeparateBlocksAreAligned) {
  for (size_t n : {size_t{1}, size_t{64}, size_t{5000}, WeightArena::kHugePage + 1}) {
    auto b = allocate_weight_block(n);
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(aligned(b.get(), n >= WeightArena::kHugePage ? WeightArena::kHugePage : 64)) << n;
    std::memset(b.get(), 1, n);
  }
}

}  // namespace
}  // namespace ringlm::cpu

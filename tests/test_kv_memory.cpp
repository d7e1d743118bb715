// The KV cache's memory follows the tokens it holds: its buffer is reserved for the whole
// context, but only the pages that tokens are written to become resident (mincore says which),
// and clear() gives them back. This is what lets n samples that share a prompt segment hold less
// than n copies of it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>

#include "core/kv/kv_cache.h"

namespace ringlm {
namespace {

// Writes every layer's key and value rows of `n` new tokens, as the model does.
void write_tokens(KvCache& cache, int n, int n_layer) {
  const int first = cache.append(n);
  for (int layer = 0; layer < n_layer; ++layer) {
    for (int slot = first; slot < first + n; ++slot) {
      std::memset(cache.key(layer, slot), 0x3c, cache.key_row_bytes());
      std::memset(cache.value(layer, slot), 0x3c, cache.value_row_bytes());
    }
  }
}

TEST(KvMemory, ResidentMemoryFollowsTheTokensHeld) {
  constexpr int kLayers = 4, kContext = 8192;
  KvCache cache(kLayers, kContext, 2, 64, {KvType::kF16, 0, 0, false});  // 256 bytes per row
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(cache.bytes(), size_t{kLayers} * kContext * cache.slot_bytes());
  EXPECT_EQ(cache.resident_bytes(), 0u);  // reserved, not yet used

  write_tokens(cache, 100, kLayers);
  EXPECT_EQ(cache.bytes_in_use(), size_t{100} * kLayers * cache.slot_bytes());
  // Each of the 2 x layers regions rounds up to whole pages: at most one partial page each.
  EXPECT_GE(cache.resident_bytes(), cache.bytes_in_use());
  EXPECT_LE(cache.resident_bytes(), cache.bytes_in_use() + size_t{kLayers} * 2 * page);
  EXPECT_LT(cache.resident_bytes(), cache.bytes() / 50);

  cache.clear();
  EXPECT_EQ(cache.resident_bytes(), 0u);
  EXPECT_EQ(cache.bytes_in_use(), 0u);
  // Released pages read as zero again, as a fresh cache's do.
  const auto* key = static_cast<const unsigned char*>(cache.key(0, 0));
  EXPECT_EQ(key[0], 0);
}

TEST(KvMemory, APrefixIsReadNotHeld) {
  auto prompt = std::make_shared<KvCache>(2, 1024, 2, 64, KvCacheOptions{KvType::kF16, 0, 0, false});
  write_tokens(*prompt, 300, 2);
  KvCache sample(2, 1024, 2, 64, {KvType::kF16, 0, 0, false});
  sample.attach_prefix(prompt);
  EXPECT_EQ(sample.next_position(), 300);  // its own tokens continue the prompt
  write_tokens(sample, 20, 2);
  EXPECT_EQ(sample.size(), 20);
  EXPECT_EQ(sample.context_size(), 320);
  EXPECT_EQ(sample.positions()[0], 300);
  EXPECT_EQ(sample.bytes_in_use(), size_t{20} * 2 * sample.slot_bytes());
  EXPECT_FALSE(sample.can_shift());
  EXPECT_THROW(sample.discard(5), std::logic_error);
  // A prefix of another shape, or a prefix that has one, is refused.
  KvCache other(2, 1024, 2, 64, {KvType::kF16, 0, 0, false});
  EXPECT_THROW(other.attach_prefix(std::make_shared<KvCache>(3, 1024, 2, 64, KvCacheOptions{})), std::invalid_argument);
  auto chained = std::make_shared<KvCache>(2, 1024, 2, 64, KvCacheOptions{});
  chained->attach_prefix(prompt);
  EXPECT_THROW(other.attach_prefix(chained), std::invalid_argument);
  // The first n tokens of a prefix: later ones masked, its own tokens continue at n.
  KvCache partial(2, 1024, 2, 64, {KvType::kF16, 0, 0, false});
  EXPECT_FALSE(partial.can_read_prefix(*prompt, 0));
  EXPECT_FALSE(partial.can_read_prefix(*prompt, 301));
  partial.attach_prefix(prompt, 120);
  EXPECT_EQ(partial.next_position(), 120);
  EXPECT_EQ(partial.context_size(), 120);
  const KvView read = partial.prefix_view();
  ASSERT_EQ(read.positions.size(), 300u);
  EXPECT_EQ(read.positions[119], 119);
  EXPECT_EQ(read.positions[120], -1);
  EXPECT_EQ(read.state, nullptr);
  sample.clear();  // drops the prefix: the prompt is freed when no sample reads it
  EXPECT_EQ(sample.prefix(), nullptr);
  EXPECT_EQ(sample.next_position(), 0);
}

}  // namespace
}  // namespace ringlm

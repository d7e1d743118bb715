// Model-level load errors: a GGUF that the reader accepts but that is not a runnable llama model.
//
// Every case starts from one tiny valid llama file built in memory and changes one thing
// (a key, a tensor's presence, shape or type), then checks that LlamaModel rejects it with a
// GgufError naming what was wrong. The valid file itself must load and run, so that a rejection
// cannot come from a broken baseline.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "core/gguf/gguf.h"
#include "core/model/host_memory.h"
#include "core/model/llama.h"
#include "quant/int4.h"
#include "tests/gguf_test_builder.h"
#include "tests/tiny_llama.h"

namespace ringlm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using test::GgufBuilder;
namespace tt = test::ggml_type;

constexpr char kLabel[] = "tiny-llama.gguf";

using test::build_llama;
using test::LlamaSpec;
using test::TinyLlama;

// The GgufError message of loading the model of `spec`, or "(loaded)". The reader must accept
// the file, and the model must reject it with a GgufError: any other exception fails the test.
std::string load_error(const LlamaSpec& spec) {
  std::unique_ptr<TinyLlama> file;
  try {
    file = std::make_unique<TinyLlama>(spec);
  } catch (const GgufError& e) {
    ADD_FAILURE() << "the reader rejected the file, the model never saw it: " << e.what();
    return "(not parsed)";
  }
  auto backend = make_cpu_backend(1);
  try {
    LlamaModel model(file->gguf(), *backend);
  } catch (const GgufError& e) {
    return e.what();
  }
  return "(loaded)";
}

template <typename... Parts>
auto ErrorNaming(Parts... parts) {
  return AllOf(StartsWith(std::string(kLabel) + ": "), HasSubstr(parts)...);
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The valid baseline

TEST(ModelLoad, TinyLlamaLoadsAndRuns) {
  const TinyLlama file{LlamaSpec{}};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  const LlamaHparams& hp = model.hparams();
  EXPECT_EQ(hp.arch, "llama");
  EXPECT_EQ(hp.n_vocab, 32);
  EXPECT_EQ(hp.n_embd, 64);
  EXPECT_EQ(hp.n_layer, 2);
  EXPECT_EQ(hp.n_head, 4);
  EXPECT_EQ(hp.n_head_kv, 2);
  EXPECT_EQ(hp.head_dim, 16);
  EXPECT_EQ(hp.n_ff, 128);
  EXPECT_EQ(hp.n_ctx_train, 128);
  EXPECT_FLOAT_EQ(hp.rms_eps, 1e-5f);

  KvCache cache = model.make_cache(16);
  std::vector<float> logits(32);
  const std::vector<int32_t> tokens = {1, 5, 31};
  model.forward(tokens, cache, logits.data());
  EXPECT_EQ(cache.size(), 3);
  EXPECT_TRUE(all_finite(logits));
  // Real computation happened: the logits are not all the same value.
  EXPECT_NE(*std::min_element(logits.begin(), logits.end()), *std::max_element(logits.begin(), logits.end()));
}

TEST(ModelLoad, PrefillAndTokenByTokenAgree) {
  // The same three tokens run at once and one at a time must give the same last logits; a
  // loader that wired a tensor to the wrong slot tends to break one path and not the other.
  const TinyLlama file{LlamaSpec{}};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  const std::vector<int32_t> tokens = {3, 0, 17};
  KvCache batch_cache = model.make_cache(8);
  std::vector<float> batch(32);
  model.forward(tokens, batch_cache, batch.data());
  KvCache step_cache = model.make_cache(8);
  std::vector<float> step(32);
  for (int32_t t : tokens) model.forward(std::span<const int32_t>(&t, 1), step_cache, step.data());
  for (size_t i = 0; i < batch.size(); ++i) EXPECT_NEAR(batch[i], step[i], 1e-4f) << "logit " << i;
}

TEST(ModelLoad, TokenIdOutOfRangeInForward) {
  const TinyLlama file{LlamaSpec{}};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  KvCache cache = model.make_cache(8);
  std::vector<float> logits(32);
  for (int32_t bad : {32, -1, 1 << 30}) {
    const std::vector<int32_t> tokens = {1, bad};
    EXPECT_THROW(model.forward(tokens, cache, logits.data()), std::out_of_range) << "token " << bad;
    EXPECT_EQ(cache.size(), 0) << "a rejected call must not leave tokens in the cache";
  }
}

// ---------------------------------------------------------------------------------------------
// Metadata

TEST(ModelLoad, UnknownArchitecture) {
  LlamaSpec s;
  s.arch = "gpt-j";
  EXPECT_THAT(load_error(s), ErrorNaming("'gpt-j'", "supported: llama"));
}

class MissingKey : public ::testing::TestWithParam<const char*> {};

TEST_P(MissingKey, MessageNamesTheKey) {
  LlamaSpec s;
  s.omit_keys.insert(GetParam());
  EXPECT_THAT(load_error(s), ErrorNaming("missing", "'" + std::string(GetParam()) + "'"));
}

INSTANTIATE_TEST_SUITE_P(ModelLoad, MissingKey,
                         ::testing::Values("general.architecture", "llama.context_length", "llama.embedding_length",
                                           "llama.block_count", "llama.feed_forward_length",
                                           "llama.attention.head_count", "llama.attention.layer_norm_rms_epsilon"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST(ModelLoad, HeadCountKvDoesNotDivideHeadCount) {
  LlamaSpec s;
  s.key_values["llama.attention.head_count_kv"] = 3;
  EXPECT_THAT(load_error(s), ErrorNaming("'llama.attention.head_count_kv'", "3", "does not divide"));
}

TEST(ModelLoad, HeadCountKvZero) {
  LlamaSpec s;
  s.key_values["llama.attention.head_count_kv"] = 0;
  EXPECT_THAT(load_error(s), ErrorNaming("'llama.attention.head_count_kv'", "out of range"));
}

TEST(ModelLoad, HeadCountNotDividingTheEmbeddingLength) {
  // Without attention.key_length the head size is embedding_length / head_count; when that
  // does not divide, the file must be rejected, not run with a truncated head size.
  for (uint64_t heads : {3u, 5u, 128u}) {
    LlamaSpec s;
    s.key_values["llama.attention.head_count"] = heads;
    s.key_values["llama.attention.head_count_kv"] = heads;
    EXPECT_THAT(load_error(s), ErrorNaming("'llama.attention.head_count'", "does not divide", "'llama.embedding_length'"))
        << heads << " heads";
  }
}

TEST(ModelLoad, AbsurdBlockCount) {
  LlamaSpec s;
  s.key_values["llama.block_count"] = 1000000000;
  EXPECT_THAT(load_error(s), ErrorNaming("'llama.block_count'", "1000000000", "out of range"));
}

TEST(ModelLoad, HugeDimensionsAreRejectedBeforeAllocating) {
  for (const char* key : {"llama.embedding_length", "llama.feed_forward_length", "llama.context_length",
                          "llama.attention.head_count"}) {
    LlamaSpec s;
    s.key_values[key] = uint64_t{1} << 40;
    EXPECT_THAT(load_error(s), ErrorNaming(std::string("'") + key + "'", "out of range"));
  }
}

TEST(ModelLoad, BlockCountLargerThanTheLayersPresent) {
  LlamaSpec s;
  s.key_values["llama.block_count"] = 3;
  EXPECT_THAT(load_error(s), ErrorNaming("missing tensor 'blk.2."));
}

TEST(ModelLoad, IntegerKeyWithTheWrongType) {
  LlamaSpec s;
  s.string_values["llama.context_length"] = "lots";
  EXPECT_THAT(load_error(s), ErrorNaming("'llama.context_length'", "expected an integer", "found string"));
}

// ---------------------------------------------------------------------------------------------
// Tensors

TEST(ModelLoad, MissingTensor) {
  for (const char* name : {"blk.1.ffn_up.weight", "token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"}) {
    LlamaSpec s;
    s.omit_tensors.insert(name);
    EXPECT_THAT(load_error(s), ErrorNaming("missing tensor '" + std::string(name) + "'"));
  }
}

TEST(ModelLoad, MissingOutputFallsBackToTiedEmbeddings) {
  // output.weight is optional: without it the embedding is reused. Not an error.
  LlamaSpec s;
  s.omit_tensors.insert("output.weight");
  EXPECT_EQ(load_error(s), "(loaded)");
}

TEST(ModelLoad, TensorWithTheWrongShape) {
  LlamaSpec s;
  s.shapes["blk.0.attn_k.weight"] = {64, 16};
  EXPECT_THAT(load_error(s), ErrorNaming("tensor 'blk.0.attn_k.weight'", "[64, 16]", "expected [64, 32]"));

  LlamaSpec transposed;
  transposed.shapes["blk.1.ffn_down.weight"] = {64, 128};
  EXPECT_THAT(load_error(transposed), ErrorNaming("tensor 'blk.1.ffn_down.weight'", "[64, 128]", "expected [128, 64]"));

  LlamaSpec norm;
  norm.shapes["blk.1.ffn_norm.weight"] = {64, 2};
  EXPECT_THAT(load_error(norm), ErrorNaming("tensor 'blk.1.ffn_norm.weight'", "[64, 2]", "expected [64]"));
}

TEST(ModelLoad, TensorOfAnUnsupportedType) {
  // IQ2_XXS needs rows that are a multiple of 256, so this model is wider.
  LlamaSpec s;
  s.n_embd = 256;
  s.types["blk.0.ffn_gate.weight"] = tt::kIQ2_XXS;
  EXPECT_THAT(load_error(s), ErrorNaming("tensor 'blk.0.ffn_gate.weight'", "IQ2_XXS", "not supported"));
  // The same spec with a supported quantized type loads, so it is the type that was rejected.
  s.types["blk.0.ffn_gate.weight"] = tt::kQ8_0;
  EXPECT_EQ(load_error(s), "(loaded)");
}

// ringlm's INT4 formats quantize each row in groups of 32 or 128 weights: a row length that
// is not a multiple of the group is refused when the file is read, naming the tensor.
TEST(ModelLoad, Int4RowLengthNotAMultipleOfTheGroup) {
  LlamaSpec s;
  s.n_embd = 96;  // the row length (K) of attn_q: a multiple of 32 but not of 128
  s.types["blk.0.attn_q.weight"] = int4_type_id({128, false, ScaleType::kF16});
  try {
    TinyLlama file(s);
    ADD_FAILURE() << "a 96-wide i4s-g128 tensor was accepted";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), ErrorNaming("blk.0.attn_q.weight", "row length 96", "i4s-g128", "128"));
  }
  // Group 32 divides 96: the same model loads, so it was the group size that was refused.
  s.types["blk.0.attn_q.weight"] = int4_type_id({32, true, ScaleType::kBF16});
  EXPECT_EQ(load_error(s), "(loaded)");
}

TEST(ModelLoad, UnsupportedTypeOnANormVector) {
  LlamaSpec s;
  s.types["output_norm.weight"] = 28;  // F64: a known GGML type, block size 1, not read by ringlm
  EXPECT_THAT(load_error(s), ErrorNaming("tensor 'output_norm.weight'", "F64", "not supported"));
}

TEST(ModelLoad, CpuBackendAlsoRejectsAnUnsupportedWeight) {
  // The model checks types before it calls the backend; the backend checks again on its own,
  // for callers that hand it weights directly.
  auto backend = make_cpu_backend(1);
  const std::vector<uint8_t> data(2 * 66);
  try {
    backend->prepare(WeightView{"w.iq2", TensorType(tt::kIQ2_XXS), 2, 256, data.data()});
    ADD_FAILURE() << "the CPU backend prepared an IQ2_XXS weight";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'w.iq2'"), HasSubstr("IQ2_XXS"), HasSubstr("not supported")));
  }
}

// ---------------------------------------------------------------------------------------------
// Other families and RoPE scaling: what the file says is read, what it says that the decoder
// does not model is refused by name

LlamaSpec phi3_spec() {
  LlamaSpec s;
  s.arch = "phi3";
  return s;
}

TEST(ModelLoad, Phi3FusedTensorsLoadAndRun) {
  const TinyLlama file{phi3_spec()};
  auto backend = make_cpu_backend(1);
  LlamaModel model(file.gguf(), *backend);
  EXPECT_TRUE(model.hparams().fused_gate_up);
  // The fused matrices are counted once, as in the file.
  EXPECT_EQ(model.n_params(), 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 2 * 32 * 64);
  const std::vector<int32_t> tokens = {3, 0, 17, 5};
  KvCache batch_cache = model.make_cache(8);
  std::vector<float> batch(32), step(32);
  model.forward(tokens, batch_cache, batch.data());
  KvCache step_cache = model.make_cache(8);
  for (int32_t t : tokens) model.forward(std::span<const int32_t>(&t, 1), step_cache, step.data());
  EXPECT_TRUE(all_finite(batch));
  for (size_t i = 0; i < batch.size(); ++i) EXPECT_NEAR(batch[i], step[i], 1e-4f) << "logit " << i;
}

TEST(ModelLoad, Phi3FusedTensorsWithTheWrongShape) {
  LlamaSpec qkv = phi3_spec();
  qkv.shapes["blk.1.attn_qkv.weight"] = {64, 64};
  EXPECT_THAT(load_error(qkv), ErrorNaming("tensor 'blk.1.attn_qkv.weight'", "[64, 64]", "expected [64, 128]"));
  LlamaSpec up = phi3_spec();  // gate and up: 2 * n_ff rows
  up.shapes["blk.0.ffn_up.weight"] = {64, 128};
  EXPECT_THAT(load_error(up), ErrorNaming("tensor 'blk.0.ffn_up.weight'", "[64, 128]", "expected [64, 256]"));
}

TEST(ModelLoad, Phi3SeparateGateIsRefused) {
  // Phi-3's gate lives in ffn_up; an ffn_gate besides it would be ignored, so it is refused.
  LlamaSpec s = phi3_spec();
  s.extra_tensors["blk.0.ffn_gate.weight"] = {64, 128};
  EXPECT_THAT(load_error(s), ErrorNaming("tensor 'blk.0.ffn_gate.weight'", "not part of the 'phi3' decoder"));
}

TEST(ModelLoad, SlidingWindowIgnoredForPhi3RefusedForLlama) {
  // llama.cpp disables Phi-3's sliding window, and so does ringlm; a window on a family without
  // sliding-window layers is not modelled.
  LlamaSpec phi3 = phi3_spec();
  phi3.extra_uints["phi3.attention.sliding_window"] = 4;
  EXPECT_EQ(load_error(phi3), "(loaded)");
  LlamaSpec llama;
  llama.extra_uints["llama.attention.sliding_window"] = 4;
  EXPECT_THAT(load_error(llama), ErrorNaming("'llama.attention.sliding_window'", "not supported"));
  llama.extra_uints["llama.attention.sliding_window"] = 0;  // no window
  EXPECT_EQ(load_error(llama), "(loaded)");
}

TEST(ModelLoad, TensorsTheDecoderDoesNotUseAreRefused) {
  // (attn_output.bias is read wherever a file has it, as llama.cpp's loaders do; sinks are gpt-oss's.)
  for (const auto& [arch, name] : {std::pair{"llama", "blk.0.attn_sinks.weight"}, std::pair{"llama", "output.bias"},
                                   std::pair{"llama", "rope_factors_long.weight"}, std::pair{"phi3", "rope_freqs.weight"}}) {
    LlamaSpec s;
    s.arch = arch;
    s.extra_tensors[name] = {name == std::string("output.bias") ? 64u : 8u};
    EXPECT_THAT(load_error(s), ErrorNaming("tensor '" + std::string(name) + "'", "not part of the '" + std::string(arch) + "' decoder"));
  }
  LlamaSpec rope_freqs;  // Llama 3's frequency factors are the llama decoder's
  rope_freqs.extra_tensors["rope_freqs.weight"] = {8};
  EXPECT_EQ(load_error(rope_freqs), "(loaded)");
}

TEST(ModelLoad, FrequencyFactorsWithTheWrongLength) {
  LlamaSpec s = phi3_spec();
  s.extra_tensors["rope_factors_long.weight"] = {7};
  EXPECT_THAT(load_error(s), ErrorNaming("tensor 'rope_factors_long.weight'", "[7]", "expected [8]"));
  LlamaSpec llama;
  llama.extra_tensors["rope_freqs.weight"] = {16};
  EXPECT_THAT(load_error(llama), ErrorNaming("tensor 'rope_freqs.weight'", "[16]", "expected [8]"));
}

TEST(ModelLoad, RopeScalingTypesOtherThanNoneLinearYarnAreRefused) {
  for (const char* type : {"longrope", "dynamic", "YARN", ""}) {
    LlamaSpec s;
    s.extra_strings["llama.rope.scaling.type"] = type;
    EXPECT_THAT(load_error(s), ErrorNaming("'llama.rope.scaling.type'", "'" + std::string(type) + "' is not supported"));
  }
}

TEST(ModelLoad, BadYarnMetadataNamesTheKey) {
  const auto yarn = [] {
    LlamaSpec s;
    s.extra_strings["llama.rope.scaling.type"] = "yarn";
    s.extra_floats["llama.rope.scaling.factor"] = 4.0f;
    s.extra_uints["llama.rope.scaling.original_context_length"] = 32;
    return s;
  };
  EXPECT_EQ(load_error(yarn()), "(loaded)");
  for (const auto& [key, value] : {std::pair{"llama.rope.scaling.factor", -2.0f}, std::pair{"llama.rope.scaling.factor", NAN},
                                   std::pair{"llama.rope.scaling.yarn_beta_fast", 0.0f},
                                   std::pair{"llama.rope.scaling.yarn_beta_slow", -1.0f},
                                   std::pair{"llama.rope.scaling.attn_factor", INFINITY}}) {
    LlamaSpec s = yarn();
    s.extra_floats[key] = value;
    EXPECT_THAT(load_error(s), ErrorNaming("'" + std::string(key) + "'", "must be a positive number")) << key << " " << value;
  }
  LlamaSpec no_context = yarn();
  no_context.extra_uints["llama.rope.scaling.original_context_length"] = 0;
  EXPECT_THAT(load_error(no_context), ErrorNaming("'llama.rope.scaling.original_context_length'", "out of range"));
  LlamaSpec as_text = yarn();
  as_text.extra_floats.erase("llama.rope.scaling.factor");
  as_text.extra_strings["llama.rope.scaling.factor"] = "4";
  EXPECT_THAT(load_error(as_text), ErrorNaming("'llama.rope.scaling.factor'", "expected a number"));
  // Variants llama.cpp does not read for these families: refused rather than ignored.
  for (const char* key : {"yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"}) {
    LlamaSpec s = yarn();
    s.extra_floats["llama.rope.scaling." + std::string(key)] = 1.0f;
    EXPECT_THAT(load_error(s), ErrorNaming("'llama.rope.scaling." + std::string(key) + "'", "not supported"));
  }
  LlamaSpec gemma = yarn();  // the hyperparameters are refused before any Gemma tensor is looked for
  gemma.arch = "gemma3";
  gemma.extra_strings = {{"gemma3.rope.scaling.type", "yarn"}};
  EXPECT_THAT(load_error(gemma), ErrorNaming("'gemma3.rope.scaling.type'", "sliding-window"));
}

TEST(ModelLoad, RopeScalingHyperparameters) {
  LlamaSpec s;
  s.extra_strings["llama.rope.scaling.type"] = "yarn";
  s.extra_floats["llama.rope.scaling.factor"] = 4.0f;
  s.extra_floats["llama.rope.scaling.attn_factor"] = 0.5f;
  const TinyLlama yarn(s);
  const LlamaHparams hp = LlamaHparams::from_gguf(yarn.gguf());
  EXPECT_EQ(hp.rope_scaling, RopeScaling::kYarn);
  EXPECT_EQ(hp.rope_n_ctx_orig, 128);  // the context length, without original_context_length
  EXPECT_FLOAT_EQ(hp.yarn_beta_fast, 32.0f);
  EXPECT_FLOAT_EQ(hp.yarn_beta_slow, 1.0f);
  EXPECT_FLOAT_EQ(hp.rope_mscale(), 0.5f * (1.0f + 0.1f * std::log(4.0f)));
  // As llama.cpp: without a type, a factor scales linearly; "none" ignores it.
  LlamaSpec bare;
  bare.extra_floats["llama.rope.scaling.factor"] = 2.0f;
  EXPECT_EQ(LlamaHparams::from_gguf(TinyLlama(bare).gguf()).rope_scaling, RopeScaling::kLinear);
  EXPECT_FLOAT_EQ(LlamaHparams::from_gguf(TinyLlama(bare).gguf()).rope_scale, 2.0f);
  EXPECT_FLOAT_EQ(LlamaHparams::from_gguf(TinyLlama(bare).gguf()).rope_mscale(), 1.0f);
  bare.extra_strings["llama.rope.scaling.type"] = "none";
  EXPECT_FLOAT_EQ(LlamaHparams::from_gguf(TinyLlama(bare).gguf()).rope_scale, 1.0f);
}

TEST(ModelLoad, Gemma3AttentionScaleFollowsLlamaCppsRule) {
  // 1/sqrt(head_dim), but 1/sqrt(n_embd / n_head) for 62 layers (Gemma 3 27B).
  for (const uint32_t n_layer : {26u, 62u}) {
    LlamaSpec s;
    s.arch = "gemma3";
    s.n_layer = n_layer;
    s.extra_uints["gemma3.attention.key_length"] = 32;
    s.extra_uints["gemma3.attention.value_length"] = 32;
    const LlamaHparams hp = LlamaHparams::from_gguf(TinyLlama(s).gguf());
    EXPECT_FLOAT_EQ(hp.attn_scale, n_layer == 62 ? 0.25f : 1.0f / std::sqrt(32.0f)) << n_layer;
  }
  EXPECT_FLOAT_EQ(LlamaHparams::from_gguf(TinyLlama(LlamaSpec{}).gguf()).attn_scale, 0.25f);  // llama: head_dim 16
}

// A model larger than the memory available is refused before anything is packed, with both sizes.
TEST(HostMemoryCheck, WeightsLargerThanTheAvailableMemoryAreRefusedWithTheNumbers) {
  constexpr size_t kGiB = size_t{1} << 30;
  const HostMemory machine{16 * kGiB, 4 * kGiB};
  EXPECT_NO_THROW(check_weights_fit(3 * kGiB, machine));
  try {
    check_weights_fit(10 * kGiB, machine);
    FAIL() << "10 GiB of weights fit in 4 GiB";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("10.0 GiB"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("4.0 GiB available (16.0 GiB in all)"));
  }
  EXPECT_NO_THROW(check_weights_fit(10 * kGiB, HostMemory{}));  // unknown: nothing refused
  const HostMemory here = host_memory();
  EXPECT_GT(here.total, 0u);
  EXPECT_LE(here.available, here.total);
}

}  // namespace
}  // namespace ringlm

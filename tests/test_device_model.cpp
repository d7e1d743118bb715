// The model on a plugin's device (the OpenCL plugin on PoCL here) against the model on the CPU:
// the same SmolLM2 weights, the products and attention run by the device's kernels, the KV cache
// kept in the device's memory and shifted there (StreamingLLM). The CPU reference computes in
// fp32 (--compute fp32), as the device does; the two sum in different orders, so logits agree
// to a tolerance and the greedy choices agree exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <omp.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/plugin_backend.h"
#include "core/model/loader.h"
#include "quant/formats.h"
#include "quant/int4.h"
#include "tests/command_runner.h"
#include "tests/build_scale.h"

// Where the build puts the OpenCL plugin's shims of older ABIs (tests/CMakeLists.txt); a build
// without OpenCL has none, and the test that needs them fails saying the plugin is missing.
#ifndef RINGLM_SHIM_PLUGIN_DIR
#define RINGLM_SHIM_PLUGIN_DIR "(not built: no OpenCL)"
#endif

namespace ringlm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string plugin_dir() { return std::filesystem::path(RINGLM_BINARY).parent_path().string(); }
std::string work_dir() { return test::work_dir_for("test_device_model"); }

std::unique_ptr<Backend> opencl_backend(int gpu_layers = -1, int cpu_moe_layers = 0) {
  BackendChoice choice;
  choice.placement.gpu_layers = gpu_layers;
  choice.placement.cpu_moe_layers = cpu_moe_layers;
  choice.device = "opencl";
  choice.plugin_dir = plugin_dir();
  choice.cache_dir = work_dir() + "/kernels";
  choice.n_threads = 1;
  choice.compute = ComputeType::kFp32;
  std::string notice;
  std::unique_ptr<Backend> backend = make_backend(choice, notice);
  EXPECT_EQ(notice, "");
  return backend;
}

int argmax(const std::vector<float>& v) { return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin()); }

// Largest |a - b| over the logits, relative to the range of b.
float relative_gap(const std::vector<float>& a, const std::vector<float>& b) {
  const auto [lo, hi] = std::minmax_element(b.begin(), b.end());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst / (*hi - *lo);
}

class DeviceModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    cpu_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1, ComputeType::kFp32));
    device_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, opencl_backend()));
  }
  static void TearDownTestSuite() {
    delete device_;
    delete cpu_;
    device_ = cpu_ = nullptr;
  }
  static std::vector<int32_t> tokens(const char* text) { return cpu_->tokenizer->encode(text, false, true); }
  static size_t vocab() { return static_cast<size_t>(cpu_->model->hparams().n_vocab); }

  static LoadedModel* cpu_;
  static LoadedModel* device_;
};

LoadedModel* DeviceModel::cpu_ = nullptr;
LoadedModel* DeviceModel::device_ = nullptr;

TEST_F(DeviceModel, RunsOnThePluginDevice) {
  EXPECT_EQ(device_->backend->name(), "opencl");
  EXPECT_TRUE(device_->backend->offloads());
  EXPECT_THAT(device_->backend->device_description(), HasSubstr("opencl:0"));
}

// Prefill and decode: the logits of every step agree, and so does the greedy token.
TEST_F(DeviceModel, PrefillAndDecodeLogitsMatchTheCpu) {
  const std::vector<int32_t> prompt = tokens("The capital of France is Paris. The capital of Italy is");
  KvCache cpu_cache = cpu_->model->make_cache(256), device_cache = device_->model->make_cache(256);
  std::vector<float> cpu_logits(vocab()), device_logits(vocab());
  cpu_->model->forward(prompt, cpu_cache, cpu_logits.data());
  device_->model->forward(prompt, device_cache, device_logits.data());
  ASSERT_TRUE(device_cache.has_backend_state());  // the cache has its copy on the device
  for (int step = 0; step < 8; ++step) {
    EXPECT_LT(relative_gap(device_logits, cpu_logits), 1e-3f) << "step " << step;
    ASSERT_EQ(argmax(device_logits), argmax(cpu_logits)) << "step " << step;
    const std::vector<int32_t> next = {argmax(cpu_logits)};
    cpu_->model->forward(next, cpu_cache, cpu_logits.data());
    device_->model->forward(next, device_cache, device_logits.data());
  }
}

// StreamingLLM on the device: a small ring that overflows several times (sinks kept, keys
// re-rotated on the device) gives the logits the CPU's ring gives.
TEST_F(DeviceModel, StreamingOverflowMatchesTheCpu) {
  KvCacheOptions options;
  options.n_keep = 4;
  options.context_shift = true;
  // (The sanitizer build: a ring of 16 and the first 36 tokens, still three shifts.)
  const int ctx = test::scaled(32, 16);
  KvCache cpu_cache = cpu_->model->make_cache(ctx, options), device_cache = device_->model->make_cache(ctx, options);
  std::vector<int32_t> text = tokens(
      "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness "
      "was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there "
      "be light: and there was light. And God saw the light, that it was good: and God divided the light from the "
      "darkness.");
  ASSERT_GT(text.size(), 70u);
  text.resize(std::min(text.size(), static_cast<size_t>(test::scaled(1000, 36))));
  std::vector<float> cpu_logits(vocab()), device_logits(vocab());
  // Chunks of 7 tokens: prefill chunks that straddle the ring's wrap, then shifts.
  for (size_t at = 0; at < text.size(); at += 7) {
    const std::vector<int32_t> chunk(text.begin() + static_cast<long>(at),
                                     text.begin() + static_cast<long>(std::min(text.size(), at + 7)));
    cpu_->model->forward(chunk, cpu_cache, cpu_logits.data());
    device_->model->forward(chunk, device_cache, device_logits.data());
    EXPECT_LT(relative_gap(device_logits, cpu_logits), 1e-3f) << "after token " << at + chunk.size();
    EXPECT_EQ(argmax(device_logits), argmax(cpu_logits)) << "after token " << at + chunk.size();
  }
  EXPECT_GE(device_cache.shifts(), 3);
  EXPECT_EQ(device_cache.shifts(), cpu_cache.shifts());
  EXPECT_EQ(device_cache.next_position(), cpu_cache.next_position());
}

// Several sequences in one pass on the device: each gets, bit for bit, what it gets alone there
// (a row's product does not depend on the other rows), so batch greedy outputs do not depend on
// --parallel on the device either.
TEST_F(DeviceModel, BatchedSequencesMatchSequencesAlone) {
  LlamaModel& model = *device_->model;
  const std::vector<int32_t> a = tokens("Once upon a time"), b = tokens("The quick brown fox jumps over");
  KvCache ca = model.make_cache(128), cb = model.make_cache(128);
  std::vector<float> la(vocab()), lb(vocab());
  const LlamaModel::SequenceTokens batch[] = {{a, &ca, la.data()}, {b, &cb, lb.data()}};
  model.forward_batch(batch);
  KvCache alone_a = model.make_cache(128), alone_b = model.make_cache(128);
  std::vector<float> alone_la(vocab()), alone_lb(vocab());
  model.forward(a, alone_a, alone_la.data());
  model.forward(b, alone_b, alone_lb.data());
  EXPECT_EQ(la, alone_la);
  EXPECT_EQ(lb, alone_lb);
}

// Embeddings on the device: the final hidden states normed there and read back (the seam's own
// copy, rms_norm and read: no op of their own) give the CPU's mean, cls and last vectors, pooled
// beside a sequence that wants its logits.
TEST_F(DeviceModel, PooledEmbeddingsMatchTheCpu) {
  const std::vector<int32_t> text = tokens("The capital of France is Paris, a city of art."), other = tokens("Once upon");
  const size_t n_embd = static_cast<size_t>(cpu_->model->hparams().n_embd);
  for (const Pooling pooling : {Pooling::kMean, Pooling::kCls, Pooling::kLast}) {
    SCOPED_TRACE(pooling_name(pooling));
    const auto pooled = [&](LlamaModel& model) {
      std::vector<float> v(n_embd), logits(vocab());
      KvCache cache = model.make_cache(64), other_cache = model.make_cache(64);
      std::vector<SequenceTokens> batch = {{other, &other_cache, logits.data()}, {text, &cache}};
      batch[1].pooling = pooling;
      batch[1].embedding = v.data();
      model.forward_batch(batch);
      return v;
    };
    // (Measured 5e-5 of the vector's range at most: the two sum the layers in other orders.)
    EXPECT_LT(relative_gap(pooled(*device_->model), pooled(*cpu_->model)), 1e-3f);
  }
}

// A batched decode step whose sequences want only their top k (batch and serve with a sampler
// that needs no more): the device picks them for every sequence in one launch and the host waits
// once for all of them, reading k pairs a sequence; the picks are the device's logits' own.
TEST_F(DeviceModel, BatchedDecodeStepReadsBackEachSequencesTopKWithOneWait) {
  LlamaModel& model = *device_->model;
  const Backend& backend = *device_->backend;
  const std::vector<int32_t> a = tokens("Once upon a time"), b = tokens("The quick brown fox jumps over"),
                             c = tokens("The capital of France is");
  KvCache ca = model.make_cache(64), cb = model.make_cache(64), cc = model.make_cache(64);
  std::vector<float> la(vocab()), lb(vocab()), lc(vocab());
  const LlamaModel::SequenceTokens prefill[] = {{a, &ca, la.data()}, {b, &cb, lb.data()}, {c, &cc, lc.data()}};
  model.forward_batch(prefill);
  const std::vector<int32_t> ta = {argmax(la)}, tb = {argmax(lb)}, tc = {argmax(lc)};
  std::vector<TopLogit> top_a(40), top_b(40), top_c(1);
  const DeviceCounters before = backend.counters();
  const LlamaModel::SequenceTokens decode[] = {{ta, &ca, nullptr, top_a}, {tb, &cb, nullptr, top_b}, {tc, &cc, nullptr, top_c}};
  model.forward_batch(decode);
  const DeviceCounters after = backend.counters();
  EXPECT_EQ(after.waits - before.waits, 1u);
  EXPECT_EQ(after.download_bytes - before.download_bytes, 3 * 40 * sizeof(TopLogit));  // k_max for every row
  // The same step with the logits: their top is the picks.
  KvCache ca2 = model.make_cache(64), cb2 = model.make_cache(64), cc2 = model.make_cache(64);
  const LlamaModel::SequenceTokens prefill2[] = {{a, &ca2, la.data()}, {b, &cb2, lb.data()}, {c, &cc2, lc.data()}};
  model.forward_batch(prefill2);
  const LlamaModel::SequenceTokens decode2[] = {{ta, &ca2, la.data()}, {tb, &cb2, lb.data()}, {tc, &cc2, lc.data()}};
  model.forward_batch(decode2);
  for (const auto& [logits, top] : {std::pair{&la, &top_a}, std::pair{&lb, &top_b}, std::pair{&lc, &top_c}}) {
    std::vector<TopLogit> want(top->size());
    select_top_k(*logits, want);
    for (size_t e = 0; e < want.size(); ++e) {
      EXPECT_EQ((*top)[e].id, want[e].id) << "pick " << e;
      EXPECT_EQ((*top)[e].logit, want[e].logit) << "pick " << e;
    }
  }
}

// A decode step on the device (plugin ABI v2): the host sends the token id, the RoPE angles and
// the new slot's position, and reads back the logits: one wait, and no more bytes than the
// logits plus 1 KiB (the goal of issue 28). Every op ran there: launches, and nothing else moved.
TEST_F(DeviceModel, DecodeStepSendsTheTokenAndReadsTheLogitsWithOneWait) {
  LlamaModel& model = *device_->model;
  const Backend& backend = *device_->backend;
  const std::vector<int32_t> prompt = tokens("The capital of France is");
  KvCache cache = model.make_cache(64);
  std::vector<float> logits(vocab());
  model.forward(prompt, cache, logits.data());
  for (int step = 0; step < 3; ++step) {
    const std::vector<int32_t> next = {argmax(logits)};
    const DeviceCounters before = backend.counters();
    model.forward(next, cache, logits.data());
    const DeviceCounters after = backend.counters();
    SCOPED_TRACE("decode step " + std::to_string(step));
    EXPECT_EQ(after.waits - before.waits, 1u);
    EXPECT_EQ(after.download_bytes - before.download_bytes, 4 * vocab());
    EXPECT_LE(after.upload_bytes - before.upload_bytes, 1024u);
    EXPECT_GE(after.launches - before.launches, static_cast<uint64_t>(model.hparams().n_layer));
  }
}

// With a sampler that needs only the top k (greedy: k = 1; top-k sampling), the device picks
// them (plugin ABI v3) and the step reads back k pairs instead of the vocabulary: the same picks
// as the CPU's fp32 logits give, and still one wait.
TEST_F(DeviceModel, DecodeStepReadsBackOnlyTheTopKTheSamplerNeeds) {
  LlamaModel& model = *device_->model;
  const Backend& backend = *device_->backend;
  const std::vector<int32_t> prompt = tokens("The capital of France is");
  KvCache cache = model.make_cache(64), cpu_cache = cpu_->model->make_cache(64);
  std::vector<float> cpu_logits(vocab());
  cpu_->model->forward(prompt, cpu_cache, cpu_logits.data());
  std::vector<TopLogit> top(40);
  model.forward_top(prompt, cache, top);
  for (int step = 0; step < 3; ++step) {
    std::vector<TopLogit> cpu_top(top.size());
    select_top_k(cpu_logits, cpu_top);
    // The same greedy pick; the others the CPU's top 40 but where logits are within the device's
    // float noise of each other (the tolerance of the logits tests above).
    const auto [lo, hi] = std::minmax_element(cpu_logits.begin(), cpu_logits.end());
    const float tolerance = 1e-3f * (*hi - *lo);
    EXPECT_EQ(top[0].id, cpu_top[0].id);
    for (size_t e = 0; e < top.size(); ++e) {
      EXPECT_NEAR(top[e].logit, cpu_logits[static_cast<size_t>(top[e].id)], tolerance) << "pick " << e;
      EXPECT_GE(top[e].logit, cpu_top.back().logit - tolerance) << "pick " << e << " is not among the CPU's top 40";
      if (e > 0) {
        EXPECT_LE(top[e].logit, top[e - 1].logit) << "pick " << e;
      }
    }
    const std::vector<int32_t> next = {top[0].id};
    const DeviceCounters before = backend.counters();
    model.forward_top(next, cache, top);
    const DeviceCounters after = backend.counters();
    cpu_->model->forward(next, cpu_cache, cpu_logits.data());
    SCOPED_TRACE("decode step " + std::to_string(step));
    EXPECT_EQ(after.waits - before.waits, 1u);
    EXPECT_EQ(after.download_bytes - before.download_bytes, top.size() * sizeof(TopLogit));
    EXPECT_LE(after.upload_bytes - before.upload_bytes, 1024u);
  }
}

// A cache that reads a shared prompt segment (batch sampling, the server's prompt cache) attends
// on the device: the segment's rows are copied there from the segment's own device copy, so its
// first step moves nothing but the token, the positions and the logits, and every answer is the
// one a cache holding the whole prompt gives. Whole and partial segments; a cache cleared and
// given another segment reads the new one.
TEST_F(DeviceModel, PrefixCachesReadTheirSegmentOnTheDevice) {
  LlamaModel& model = *device_->model;
  const Backend& backend = *device_->backend;
  const std::vector<int32_t> prompt = tokens("Write a haiku about autumn leaves");
  auto shared = std::make_shared<KvCache>(model.make_cache(128));
  std::vector<float> logits(vocab()), whole_logits(vocab());
  model.forward(prompt, *shared, logits.data());
  KvCache sample = model.make_cache(128), whole = model.make_cache(128);
  sample.attach_prefix(shared);
  model.forward(prompt, whole, whole_logits.data());
  const std::vector<int32_t> next = {argmax(logits)};
  const DeviceCounters before = backend.counters();
  model.forward(next, sample, logits.data());
  const DeviceCounters after = backend.counters();
  EXPECT_EQ(after.waits - before.waits, 1u);
  EXPECT_EQ(after.download_bytes - before.download_bytes, 4 * vocab()) << "the segment's rows came to the host";
  EXPECT_LE(after.upload_bytes - before.upload_bytes, 2048u) << "the segment's rows went up from the host";
  model.forward(next, whole, whole_logits.data());
  EXPECT_LT(relative_gap(logits, whole_logits), 1e-3f);
  EXPECT_EQ(argmax(logits), argmax(whole_logits));

  // The first n - 2 tokens of a segment (its last two masked), the rest prefilled here.
  const int n = static_cast<int>(prompt.size()) - 2;
  KvCache partial = model.make_cache(128);
  partial.attach_prefix(shared, n);
  const std::vector<int32_t> rest(prompt.begin() + n, prompt.end());
  std::vector<float> partial_logits(vocab());
  model.forward(rest, partial, partial_logits.data());
  model.forward(next, partial, partial_logits.data());
  EXPECT_LT(relative_gap(partial_logits, whole_logits), 1e-3f);

  // Cleared and given another segment: the device copy follows, even when the new segment's
  // rows take the memory the old one gave back (the first segment goes first here).
  partial.clear();
  sample.clear();
  shared.reset();
  const std::vector<int32_t> other = tokens("The capital of France is");
  auto shared2 = std::make_shared<KvCache>(model.make_cache(128));
  model.forward(other, *shared2, logits.data());
  KvCache whole2 = model.make_cache(128);
  model.forward(other, whole2, whole_logits.data());
  const std::vector<int32_t> next2 = {argmax(logits)};
  partial.attach_prefix(shared2);
  model.forward(next2, partial, partial_logits.data());
  model.forward(next2, whole2, whole_logits.data());
  EXPECT_LT(relative_gap(partial_logits, whole_logits), 1e-3f);
  EXPECT_EQ(argmax(partial_logits), argmax(whole_logits));
}

// A weight in a format the plugin does not take (BF16) stays on the CPU: its product still reads
// and writes the device's activations (through their host mirrors) and gives the CPU's result,
// and the backend lists it after load.
TEST(DeviceFallback, AFormatThePluginDoesNotTakeRunsOnTheCpuAndIsListed) {
  std::unique_ptr<Backend> device = opencl_backend();
  auto cpu = make_cpu_backend(1, ComputeType::kFp32);
  const int64_t rows = 48, cols = 64, m = 2;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
  for (uint16_t& b : w) b = fp32_to_bf16(u(rng));
  std::vector<float> x(static_cast<size_t>(m * cols));
  for (float& v : x) v = u(rng);
  const WeightView view{"blk.0.ffn_up.weight", TensorType::BF16, rows, cols, reinterpret_cast<const uint8_t*>(w.data())};
  auto on_device = device->prepare(view);
  auto on_cpu = cpu->prepare(view);
  EXPECT_THAT(device->cpu_fallback_report(), HasSubstr("1 of 1 weights run on the CPU (BF16 x1"));

  std::unique_ptr<ActivationBuffer> xd = device->alloc_activations(x.size());
  std::unique_ptr<ActivationBuffer> yd = device->alloc_activations(static_cast<size_t>(m * rows));
  device->write(xd->data(), x.data(), x.size());
  device->matmul(*on_device, xd->data(), m, yd->data());
  std::vector<float> got(static_cast<size_t>(m * rows)), want(got.size());
  device->read(yd->data(), got.data(), got.size());
  cpu->matmul(*on_cpu, x.data(), m, want.data());
  EXPECT_EQ(got, want);
}

// The backends say which ops they run themselves, as ggml's supports_op: the device takes the
// formats the plugin names (Q4_0, the K-quants) and not BF16 or ringlm's own INT4 types, which
// run on the CPU it wraps; the CPU runs every type ringlm reads.
TEST(DeviceFallback, BackendsSayWhichOpsAndTypesTheyRun) {
  std::unique_ptr<Backend> device = opencl_backend();
  std::unique_ptr<Backend> cpu = make_cpu_backend(1);
  const auto i4s = static_cast<TensorType>(int4_type_id(Int4Format{128, false, ScaleType::kF16}));
  const auto one = [](TensorType t) { return std::vector<TensorType>{t}; };
  EXPECT_TRUE(device->supports(BackendOp::kMatmul, one(TensorType::Q4_0)));
  EXPECT_TRUE(device->supports(BackendOp::kMatmulGlu, one(TensorType::Q4_K)));
  EXPECT_TRUE(device->supports(BackendOp::kMatmul, one(TensorType::MXFP4)));
  EXPECT_FALSE(device->supports(BackendOp::kMatmul, one(TensorType::BF16)));
  EXPECT_FALSE(device->supports(BackendOp::kMatmul, one(i4s)));
  EXPECT_FALSE(device->supports(BackendOp::kMatmulMany, std::vector{TensorType::Q4_0, TensorType::BF16}));
  EXPECT_TRUE(device->supports(BackendOp::kAttention, one(TensorType::F16)));
  EXPECT_TRUE(device->supports(BackendOp::kRmsNorm, {}));
  for (const TensorType t : {TensorType::Q4_0, TensorType::Q4_K, TensorType::BF16, TensorType::MXFP4, i4s}) {
    EXPECT_TRUE(cpu->supports(BackendOp::kMatmul, one(t))) << static_cast<int>(t);
  }
  EXPECT_FALSE(cpu->supports(BackendOp::kMatmul, one(static_cast<TensorType>(16))));  // IQ2_XXS: not read
}

// A model whose every matrix and embedding is MXFP4 (gpt-oss's experts' type; tests/CMakeLists.txt's
// tiny_mxfp4) runs whole on the device, its 17-byte blocks read in place, and gives the CPU's
// logits (fp32) for a prompt and a few decode steps.
TEST(DeviceFallback, AnMxfp4ModelRunsWholeOnTheDeviceWithTheCpusLogits) {
  const std::string path = std::string(RINGLM_TEST_WORK_DIR) + "/tiny_mxfp4.gguf";
  LoadedModel cpu = load_model(path, 1, ComputeType::kFp32);
  LoadedModel device = load_model(path, opencl_backend());
  EXPECT_EQ(device.backend->cpu_fallback_report(), "");
  const std::vector<int32_t> prompt = cpu.tokenizer->encode("The capital of France is", false, true);
  KvCache cpu_cache = cpu.model->make_cache(64), device_cache = device.model->make_cache(64);
  std::vector<float> cpu_logits(static_cast<size_t>(cpu.model->hparams().n_vocab)), device_logits(cpu_logits.size());
  cpu.model->forward(prompt, cpu_cache, cpu_logits.data());
  device.model->forward(prompt, device_cache, device_logits.data());
  for (int step = 0; step < 4; ++step) {
    EXPECT_LT(relative_gap(device_logits, cpu_logits), 1e-3f) << "step " << step;
    ASSERT_EQ(argmax(device_logits), argmax(cpu_logits)) << "step " << step;
    const std::vector<int32_t> next = {argmax(cpu_logits)};
    cpu.model->forward(next, cpu_cache, cpu_logits.data());
    device.model->forward(next, device_cache, device_logits.data());
  }
}

// With --gpu-layers a weight goes where the layer the model gives it (WeightView::layer) runs,
// whatever its name says: here layer 1 on the device, layer 0 on the CPU.
TEST(DeviceFallback, WeightsArePlacedByTheirLayerNotTheirName) {
  std::unique_ptr<Backend> device = opencl_backend(/*gpu_layers=*/1);
  device->plan_layers(2);
  const int64_t rows = 32, cols = 64;
  const std::vector<uint8_t> bytes(static_cast<size_t>(rows * cols / 32 * sizeof(BlockQ4_0)));
  WeightView view{"blk.0.ffn_up.weight", TensorType::Q4_0, rows, cols, bytes.data()};
  view.layer = 1;
  auto device_weight = device->prepare(view);
  view.name = "blk.1.ffn_up.weight";
  view.layer = 0;
  auto cpu_weight = device->prepare(view);
  const std::vector<float> x(static_cast<size_t>(cols), 1.0f);
  std::vector<float> y(static_cast<size_t>(rows));
  const auto launches = [&](const PreparedWeight& w) {
    const uint64_t before = device->counters().launches;
    device->begin_layer(&w == device_weight.get() ? 1 : 0);
    device->matmul(w, x.data(), 1, y.data());
    return device->counters().launches - before;
  };
  EXPECT_GT(launches(*device_weight), 0u);
  EXPECT_EQ(launches(*cpu_weight), 0u);
  EXPECT_EQ(device->layer_device(0), "cpu");
  EXPECT_EQ(device->layer_device(1), "opencl:0");
}

// A mixture of experts (the tiny Mixtral-style model; gpt-oss's, whose attention sinks and
// clamped SwiGLU take plugin ABI 4 and whose expert biases take the seam's biased path) on the
// device, op by op through the seam's default, with every layer's experts on the CPU (--cpu-moe)
// and with the first layer's (--n-cpu-moe 1): the logits of a prompt and of each decode step are
// the CPU's (fp32).
class DeviceExperts : public ::testing::TestWithParam<const char*> {};

TEST_P(DeviceExperts, AMixtureOfExpertsOnTheDeviceOrBesideItGivesTheCpusLogits) {
  const std::string path = std::string(RINGLM_TEST_WORK_DIR) + "/" + GetParam();
  LoadedModel cpu = load_model(path, 1, ComputeType::kFp32);
  const std::vector<int32_t> prompt = cpu.tokenizer->encode("one two three four five six", false, true);
  const auto logits_of = [&](LlamaModel& model) {
    std::vector<std::vector<float>> steps;
    KvCache cache = model.make_cache(64);
    std::vector<float> logits(static_cast<size_t>(model.hparams().n_vocab));
    model.forward(prompt, cache, logits.data());
    for (int step = 0; step < 6; ++step) {
      steps.push_back(logits);
      const std::vector<int32_t> next = {argmax(logits)};
      model.forward(next, cache, logits.data());
    }
    return steps;
  };
  const auto expected = logits_of(*cpu.model);
  for (const int cpu_moe_layers : {0, -1, 1}) {
    SCOPED_TRACE("cpu_moe_layers " + std::to_string(cpu_moe_layers));
    LoadedModel device = load_model(path, opencl_backend(-1, cpu_moe_layers));
    const auto got = logits_of(*device.model);
    for (size_t step = 0; step < got.size(); ++step) {
      EXPECT_LT(relative_gap(got[step], expected[step]), 1e-3f) << "step " << step;
      EXPECT_EQ(argmax(got[step]), argmax(expected[step])) << "step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DeviceExperts, ::testing::Values("tiny_mixtral_q4_0.gguf", "tiny_gpt_oss_q8_0.gguf"),
                         [](const auto& info) { return std::string(info.param).substr(5, std::string(info.param).size() - 10); });

// --- The command line --------------------------------------------------------------------------

using Output = test::CommandResult;

Output run_ringlm(const std::string& args) { return test::run_command(std::string(RINGLM_BINARY) + " " + args, work_dir()); }

std::string run_args(const std::string& device, const std::string& extra = "", const std::string& plugins = plugin_dir()) {
  return "run -m " + std::string(RINGLM_TEST_MODEL) + " -t 1 --temp 0 -n " + std::to_string(test::scaled(32, 12)) +
         " --ignore-eos -p 'The quick brown fox jumps over the lazy dog. The capital of France is' " +
         "--device " + device + " --plugin-dir " + plugins + " " + extra;
}

// The OpenCL plugin (ABI 3: the whole step on the device, the greedy pick too) and the same
// plugin seen as a version-2 plugin (the pick on the host) and as a version-1 plugin
// (tests/plugins/version_shim.c: products and attention on the device, every other op on the
// CPU) all write the CPU's greedy text (fp32), and so do the kernels in their GPU shapes (the
// prompt through the tiled GEMM); `ringlm devices` shows each one's ABI, and says why a
// version-3 table without its top_k entry does not load.
TEST(DeviceCli, GreedyTextOnOpenclEqualsTheCpuWithPluginsOfEveryAbi) {
  const std::string shims = RINGLM_SHIM_PLUGIN_DIR;
  const Output devices = run_ringlm("devices --plugin-dir " + shims);
  ASSERT_EQ(devices.exit_code, 0) << devices.err;
  EXPECT_THAT(devices.out, HasSubstr("plugin ABI 1"));  // openclv1
  EXPECT_THAT(devices.out, HasSubstr("plugin ABI 2"));  // openclv2
  EXPECT_THAT(devices.out, HasSubstr("plugin ABI 3"));  // openclsmall
  EXPECT_THAT(run_ringlm("devices").out, HasSubstr("plugin ABI 4"));  // the OpenCL plugin beside ringlm
  EXPECT_THAT(devices.out + devices.err, HasSubstr("plugin table (ABI 3) has no 'top_k' function"));
  const Output cpu = run_ringlm(run_args("cpu", "--compute fp32"));
  const Output device = run_ringlm(run_args("opencl", "--stats json"));
  // The kernels in their GPU shapes: the prompt (> 16 tokens) through the tiled GEMM.
  const Output gpu_shapes = test::run_command("env RINGLM_OPENCL_KERNELS=gpu " + std::string(RINGLM_BINARY) + " " +
                                                  run_args("opencl"),
                                              work_dir());
  const Output v2 = run_ringlm(run_args("openclv2", "", shims));
  const Output v1 = run_ringlm(run_args("openclv1", "", shims));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  ASSERT_EQ(device.exit_code, 0) << device.err;
  ASSERT_EQ(v2.exit_code, 0) << v2.err;
  ASSERT_EQ(v1.exit_code, 0) << v1.err;
  EXPECT_GT(cpu.out.size(), static_cast<size_t>(test::scaled(40, 10)));
  EXPECT_EQ(device.out, cpu.out);
  ASSERT_EQ(gpu_shapes.exit_code, 0) << gpu_shapes.err;
  EXPECT_EQ(gpu_shapes.out, cpu.out);
  EXPECT_EQ(v2.out, cpu.out);
  EXPECT_EQ(v1.out, cpu.out);
  // Greedy on ABI 3: each decode step reads back one pick (8 bytes), not the vocabulary.
  EXPECT_THAT(device.err, HasSubstr("\"download_bytes\":[8,8,8"));
  EXPECT_THAT(device.err, Not(HasSubstr("196608")));  // SmolLM2's 49,152 logits
}

// The JSON line `run --stats json` writes on stderr (under LeakSanitizer, its report of the
// suppressions it used may follow).
nlohmann::json run_stats(const Output& o) {
  const size_t at = o.err.rfind("\n{");
  const size_t begin = at == std::string::npos ? 0 : at + 1;
  return nlohmann::json::parse(o.err.substr(begin, o.err.find('\n', begin) - begin));
}

// --gpu-layers (llama.cpp's -ngl): none, half or all of SmolLM2's 30 layers on the device, with a
// context small enough to shift (StreamingLLM) on the way, write the CPU's greedy text (fp32);
// --stats json says where each layer ran, and at half a decode step moves the hidden state up
// once, the greedy pick down, and waits once. A device too small for the model says which
// weight did not fit and how many layers did, and that many then run.
TEST(DeviceCli, GpuLayersSplitTheModelBetweenCpuAndDevice) {
  const std::string small_context = "-c " + std::to_string(test::scaled(40, 24)) + " --compute fp32 ";
  const Output cpu = run_ringlm(run_args("cpu", small_context));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  for (const int gpu_layers : {0, 15}) {
    SCOPED_TRACE("--gpu-layers " + std::to_string(gpu_layers));
    const Output split = run_ringlm(run_args("opencl", small_context + "--stats json --gpu-layers " + std::to_string(gpu_layers)));
    ASSERT_EQ(split.exit_code, 0) << split.err;
    EXPECT_EQ(split.out, cpu.out);
    const nlohmann::json stats = run_stats(split);
    const std::vector<std::string> where = stats.at("layer_device");
    ASSERT_EQ(where.size(), 30u);
    for (size_t layer = 0; layer < where.size(); ++layer) {
      EXPECT_EQ(where[layer], static_cast<int>(layer) >= 30 - gpu_layers ? "opencl:0" : "cpu") << "layer " << layer;
    }
    EXPECT_EQ(stats.at("output_device"), gpu_layers > 0 ? "opencl:0" : "cpu");
    EXPECT_GT(stats.at("n_shifts").get<int>(), 0);
    // Every decode step but the first (after the prompt's pass) and those that shifted the cache
    // (its slot list checked, its angles sent: a few waits more).
    const nlohmann::json& steps = stats.at("token_device");
    const size_t n_steps = steps.at("waits").size();
    size_t lean = 0;
    for (size_t step = 1; step < n_steps; ++step) {
      if (gpu_layers == 0) {
        EXPECT_EQ(steps.at("launches")[step], 0) << "step " << step;
        continue;
      }
      lean += steps.at("waits")[step] == 1 && steps.at("upload_bytes")[step].get<int>() <= 576 * 4 + 1024 &&
              steps.at("download_bytes")[step] == 8;
    }
    if (gpu_layers > 0) {
      EXPECT_GE(lean + 1 + stats.at("n_shifts").get<size_t>(), n_steps) << steps.dump();
    }
  }

  // 48 MB of device memory (tests/plugins/version_shim.c) for 92 MiB of weights.
  const std::string shims = RINGLM_SHIM_PLUGIN_DIR;
  const Output full = run_ringlm(run_args("openclsmall", small_context, shims));
  EXPECT_TRUE(test::exited_with_error(full));
  EXPECT_THAT(full.err, HasSubstr("does not fit in device memory"));
  const size_t at = full.err.find("try --gpu-layers ");
  ASSERT_NE(at, std::string::npos) << full.err;
  const int fits = std::atoi(full.err.c_str() + at + std::strlen("try --gpu-layers "));
  EXPECT_GT(fits, 0);
  EXPECT_LT(fits, 30);
  const Output advised = run_ringlm(run_args("openclsmall", small_context + "--gpu-layers " + std::to_string(fits), shims));
  ASSERT_EQ(advised.exit_code, 0) << advised.err;
  EXPECT_EQ(advised.out, cpu.out);
}

// `batch --parallel` on the device: its batched steps (prompts and decode, each sequence's greedy
// pick read back alone) write, request for request, the CPU's fp32 greedy texts.
TEST(DeviceCli, BatchOnTheDeviceWritesTheCpusTexts) {
  const std::string in = work_dir() + "/batch_in.jsonl";
  {
    std::ofstream f(in);
    f << R"({"id":"a","prompt":"The capital of France is","max_tokens":10})" << "\n"
      << R"({"id":"b","prompt":"One, two, three, four,","max_tokens":10})" << "\n"
      << R"({"id":"c","prompt":"The quick brown fox jumps over the lazy dog because","max_tokens":10})" << "\n";
  }
  std::map<std::string, std::vector<std::string>> texts;
  for (const std::string device : {"cpu", "opencl"}) {
    const std::string out = work_dir() + "/batch_out_" + device + ".jsonl";
    std::filesystem::remove(out);
    const Output o = run_ringlm("batch -m " + std::string(RINGLM_TEST_MODEL) + " -t 1 --temp 0 --compute fp32 --parallel 3 -i " +
                                in + " -o " + out + " --device " + device + " --plugin-dir " + plugin_dir());
    ASSERT_EQ(o.exit_code, 0) << o.err;
    std::ifstream f(out);
    for (std::string line; std::getline(f, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      texts[device].push_back(j.at("id").get<std::string>() + ": " + j.at("text").get<std::string>());
    }
    std::sort(texts[device].begin(), texts[device].end());
  }
  ASSERT_EQ(texts["cpu"].size(), 3u);
  EXPECT_EQ(texts["opencl"], texts["cpu"]);
}

// Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 weights, the mix of the files people download)
// runs whole on the device: no weight stays on the CPU, the sliding-window layers' attention runs
// there too, and the text is the CPU's (both fp32).
TEST(DeviceCli, GemmaQ4KMRunsWholeOnTheDeviceAndWritesTheCpusText) {
  const std::string args = "run -m " + std::string(RINGLM_GEMMA3_MODEL) +
                           " -t 2 --temp 0 -n " + std::to_string(test::scaled(12, 8)) + " -p 'The capital of France is' --compute fp32 --plugin-dir " +
                           plugin_dir();
  const Output cpu = run_ringlm(args + " --device cpu");
  const Output device = run_ringlm(args + " --device opencl --stats json");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  ASSERT_EQ(device.exit_code, 0) << device.err;
  EXPECT_THAT(device.err, Not(HasSubstr("on the CPU")));
  EXPECT_THAT(device.err, HasSubstr("\"download_bytes\":[8,8,8"));  // the greedy pick, not 262,144 logits
  EXPECT_THAT(cpu.out, HasSubstr("France"));
  EXPECT_EQ(device.out, cpu.out);
}

// gpt-oss's attention sinks and clamped SwiGLU run on the device from plugin ABI 4: the tiny
// gpt-oss model (MXFP4 experts) writes the CPU's greedy text through the OpenCL plugin with no op
// left to the CPU, and the same text through the plugin seen as ABI 3
// (tests/plugins/version_shim.c), which leaves the sinks' attention to the CPU and says so.
TEST(DeviceCli, GptOssSinksRunOnTheDeviceFromAbi4) {
  const std::string args = "run -m " + std::string(RINGLM_TEST_WORK_DIR) +
                           "/tiny_gpt_oss_mxfp4.gguf -t 1 --temp 0 --ignore-eos -n 16 -p 'one two three four' ";
  const Output cpu = run_ringlm(args + "--device cpu --compute fp32");
  const Output device = run_ringlm(args + "--device opencl --plugin-dir " + plugin_dir());
  const Output v3 = run_ringlm(args + "--device openclv3 --plugin-dir " + std::string(RINGLM_SHIM_PLUGIN_DIR));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  ASSERT_EQ(device.exit_code, 0) << device.err;
  ASSERT_EQ(v3.exit_code, 0) << v3.err;
  EXPECT_THAT(device.err, Not(HasSubstr("on the CPU")));
  EXPECT_THAT(v3.err, HasSubstr("attention with sinks (gpt-oss) runs on the CPU"));
  EXPECT_FALSE(cpu.out.empty());
  EXPECT_EQ(device.out, cpu.out);
  EXPECT_EQ(v3.out, cpu.out);
}

TEST(DeviceCli, MissingDeviceIndexIsAClearError) {
  const Output o = run_ringlm(run_args("opencl:7"));
  EXPECT_TRUE(test::exited_with_error(o));
  EXPECT_THAT(o.err, HasSubstr("opencl"));
  EXPECT_THAT(o.err, HasSubstr("7"));
  EXPECT_EQ(o.out, "");
}

TEST(DeviceCli, UnknownPluginIsAClearError) {
  const Output o = run_ringlm(run_args("vulkan"));
  EXPECT_TRUE(test::exited_with_error(o));
  EXPECT_THAT(o.err, HasSubstr("vulkan"));
  EXPECT_THAT(o.err, HasSubstr("opencl"));  // what was found instead
}

// A plugin's caches hold fp16 or fp32 rows: a q8_0 cache is refused by name, with the advice,
// before any text.
TEST(DeviceCli, QuantizedCacheOnADeviceIsAClearError) {
  const Output o = run_ringlm(run_args("opencl", "--cache-type q8_0"));
  EXPECT_TRUE(test::exited_with_error(o));
  EXPECT_THAT(o.err, HasSubstr("--cache-type q8_0"));
  EXPECT_THAT(o.err, HasSubstr("--cache-type f16"));
  EXPECT_EQ(o.out, "");
  // Keys and values of two types, even two a device holds: refused, named as keys/values.
  const Output mixed = run_ringlm(run_args("opencl", "-ctk f16 -ctv f32"));
  EXPECT_TRUE(test::exited_with_error(mixed));
  EXPECT_THAT(mixed.err, HasSubstr("--cache-type f16/f32"));
  // kivi2 on Gemma 3, whose sliding-window layers (the first to store) hold q4_0: named as asked.
  const Output kivi = run_ringlm("run -m " + std::string(RINGLM_GEMMA3_MODEL) + " -t 1 -n 2 -p hi --cache-type kivi2 --device opencl --plugin-dir " + plugin_dir());
  EXPECT_TRUE(test::exited_with_error(kivi));
  EXPECT_THAT(kivi.err, HasSubstr("--cache-type kivi2 is not supported"));
  EXPECT_EQ(kivi.out, "");
}

TEST(DeviceCli, MalformedDeviceIsAClearError) {
  const Output o = run_ringlm(run_args("opencl:x"));
  EXPECT_TRUE(test::exited_with_error(o));
  EXPECT_THAT(o.err, HasSubstr("opencl:x"));
}

// Without a GPU (here PoCL's CPU device is the only OpenCL device), auto keeps the native CPU
// path, says why in one line, and still answers; with one, it takes it without a notice.
TEST(DeviceCli, AutoTakesAGpuOrFallsBackToTheCpuWithANotice) {
  bool has_gpu = false;
  for (const auto& plugin : scan_plugins(plugin_search_dirs(plugin_dir())).loaded) {
    for (const ringlm_device_info& info : plugin->devices()) has_gpu = has_gpu || info.type == RINGLM_DEVICE_GPU;
  }
  const Output o = run_ringlm(run_args("auto"));
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_THAT(o.out, HasSubstr("Paris"));
  if (has_gpu) {
    EXPECT_THAT(o.err, Not(HasSubstr("--device auto")));
  } else {
    EXPECT_THAT(o.err, HasSubstr("--device auto: no GPU"));
  }
}

}  // namespace
}  // namespace ringlm

// LlamaModel: loading. The file's tensors checked against the layer schema (layer_weights.h),
// the RoPE tables, and the weights and activations placed on the backend; and the caches its
// passes run on.
#include <stdexcept>

#include "core/model/host_memory.h"
#include "core/model/llama.h"

namespace ringlm {

LlamaModel::LlamaModel(const GgufFile& gguf, Backend& backend, const PipelineStage& stage)
    : hp_(LlamaHparams::from_gguf(gguf)), backend_(backend), stage_(stage) {
  if (stage_.end_layer < 0) stage_.end_layer = hp_.n_layer;
  check_stage();
  ModelTensors tensors(gguf);
  WeightPlan plan;
  read_weights(tensors, plan);
  rope_ = std::make_unique<RopeTables>(hp_, *find_arch(hp_.arch), tensors);
  tensors.refuse_unused(hp_.arch);
  // Sliding-window layers keep a ring of their window plus one pass (make_cache), so shorter
  // passes keep it small: with 256, Gemma 3 270M's cache at 8k tokens is 24% of a full one
  // (27% with 512).
  if (hp_.sliding_window > 0) max_batch_ = kWindowedMaxBatch;
  // The activations before the weights: on a device, what is left once they are placed is the
  // weights' (and a --gpu-layers out-of-memory error counts layers that really fit).
  if (!backend_.offloads()) check_weights_fit(plan.bytes_here(), host_memory());
  allocate_scratch();
  for (std::vector<float>& scales : key_scales_) {  // (a ring's index is below n_layer)
    scales.assign(static_cast<size_t>(hp_.n_layer) * static_cast<size_t>(hp_.n_head_kv * hp_.head_dim), 1.0f);
  }
  backend_.plan_layers(hp_.n_layer);
  constants_ = plan.place(backend_, &output_);
  for (LayerWeights& layer : layers_) layer.index_experts();
  weight_bytes_ = plan.weight_bytes();
  n_params_ = plan.n_params();
}

void LlamaModel::check_stage() const {
  if (stage_.first_layer < 0 || stage_.first_layer >= stage_.end_layer || stage_.end_layer > hp_.n_layer) {
    throw std::invalid_argument("pipeline stage " + std::to_string(stage_.index) + ": layers [" +
                                std::to_string(stage_.first_layer) + ", " + std::to_string(stage_.end_layer) +
                                ") of a model of " + std::to_string(hp_.n_layer));
  }
}

// The embedding, this stage's layers (as the layer schema says) and the output; another stage's
// tensors are its to check and load (the file's pages of them are never touched here).
void LlamaModel::read_weights(ModelTensors& tensors, WeightPlan& plan) {
  const int64_t d = hp_.n_embd;
  token_embd_ = &plan.matrix(tensors, "token_embd.weight", d, hp_.n_vocab);
  layers_.resize(static_cast<size_t>(hp_.n_layer));
  for (int il = 0; il < hp_.n_layer; ++il) {
    LayerWeights& L = layers_[static_cast<size_t>(il)];
    if (hp_.swa_period > 0 && (il + 1) % hp_.swa_period != 0) {
      L.window = hp_.sliding_window;
      L.rope_set = 1;
    }
    if (stage_.runs_layer(il)) {
      read_layer_weights(tensors, plan, hp_, il, L);
    } else {
      plan.count_elsewhere(tensors.leave_to_another_stage("blk." + std::to_string(il) + "."));
    }
  }
  if (!stage_.last()) {  // the output norm and projection are the last stage's
    tensors.leave_to_another_stage("output_norm.weight");
    plan.count_elsewhere(tensors.leave_to_another_stage("output.weight"));
    return;
  }
  plan.constant(output_norm_, tensors.vector("output_norm.weight", d));
  // Tied embeddings: the output projection reuses token_embd.
  tied_output_ = !tensors.has("output.weight");
  const GgufTensorInfo& output = tied_output_ ? *token_embd_ : plan.matrix(tensors, "output.weight", d, hp_.n_vocab);
  plan.prepare(output_, output, hp_.n_layer);
}

KvCache LlamaModel::make_cache(int n_ctx, const KvCacheOptions& options) const {
  // Sliding-window layers get a ring of the window plus one pass's tokens (a pass writes its
  // keys before its first query reads the oldest key in its window), where that is smaller
  // than the context.
  KvWindowRing window;
  window.window = hp_.sliding_window;
  window.slots = hp_.sliding_window + max_batch_;
  if (hp_.sliding_window > 0 && window.slots < n_ctx) {
    for (const LayerWeights& L : layers_) window.layers.push_back(L.window > 0);
  }
  return KvCache(hp_.n_layer, n_ctx, hp_.n_head_kv, hp_.head_dim, options, window);
}

}  // namespace ringlm

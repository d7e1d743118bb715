// POST /v1/embeddings as `ringlm serve` answers it, apart from HTTP: OpenAI's request body read
// and checked field by field (an error names the field), each input turned into token ids (text
// through the model's tokenizer, or ids as given) and checked against the context, the vectors
// gathered from the request's stream, and the response JSON (floats, or base64 of little-endian
// float32 bytes). The pooling is the model's (LlamaHparams::pooling); the model list says which.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/model/sequence_tokens.h"
#include "core/scheduler/serving_engine.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm::serve {

using json = nlohmann::json;

// One POST /v1/embeddings, checked.
struct EmbeddingRequest {
  std::string model;  // echoed back
  // One input each: a text (tokenized with the model's BOS, as a completion's prompt), or token
  // ids as given.
  struct Input {
    std::string text;
    std::vector<int32_t> tokens;
    bool is_tokens = false;
  };
  std::vector<Input> inputs;
  bool base64 = false;  // "encoding_format": "base64"
};

// Inputs one request may hold (OpenAI's limit).
inline constexpr size_t kMaxEmbeddingInputs = 2048;

// Reads a request body for a model of n_embd dimensions and n_vocab tokens: "input" (a string, an
// array of strings, an array of token ids, or an array of arrays of token ids; nothing empty),
// "model", "encoding_format" ("float" or "base64"), "dimensions" (absent, or n_embd: a vector is
// never shortened), "user" (ignored). Throws ApiError (400) naming the field at fault.
EmbeddingRequest parse_embedding_request(const json& body, int n_embd, int n_vocab);

// The inputs as token ids; ApiError 400 naming "input[i]" when one is empty once tokenized or
// longer than the context (n_ctx tokens).
std::vector<std::vector<int32_t>> embedding_inputs(const EmbeddingRequest& request, const Tokenizer& tokenizer, int n_ctx);

// ApiError 400 when the model's pooling cannot make an embedding (none, rank), saying why.
void check_embedding_pooling(Pooling pooling);

// Waits for every input's vector on `stream` (in input order); ApiError 503 when the request was
// cancelled (the server shutting down).
std::vector<std::vector<float>> gather_embeddings(RequestStream& stream, size_t n_inputs);

// {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] or "base64"}],
//  "model", "usage": {"prompt_tokens", "total_tokens"}}.
json embeddings_response(const std::vector<std::vector<float>>& vectors, bool base64, const std::string& model,
                         int prompt_tokens);

// The vector's float32 values as little-endian bytes, in base64 (what OpenAI's clients decode
// with numpy.frombuffer(..., dtype="float32")).
std::string base64_floats(std::span<const float> values);

// What the model list says of embeddings: {"pooling": "mean", "embedding_pooling_source": ...}.
json pooling_fields(Pooling pooling, bool from_file);

}  // namespace ringlm::serve

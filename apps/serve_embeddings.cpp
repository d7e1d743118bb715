#include "apps/serve_embeddings.h"

#include <chrono>
#include <cstring>

#include "apps/serve_api.h"

namespace ringlm::serve {

namespace {

ApiError bad_field(const std::string& param, const std::string& what) {
  return ApiError(400, "'" + param + "': " + what, param);
}

// The field, or nullptr when it is absent or null (OpenAI's clients send null for "not set").
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::string at(const std::string& param, size_t i) { return param + "[" + std::to_string(i) + "]"; }

// A non-empty array of token ids of this vocabulary.
std::vector<int32_t> token_ids(const json& list, const std::string& param, int n_vocab) {
  if (list.empty()) throw bad_field(param, "an empty list of token ids");
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const json& id = list[i];
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= n_vocab) {
      throw bad_field(at(param, i), id.dump() + " is not a token id of this model (0.." + std::to_string(n_vocab - 1) + ")");
    }
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return ids;
}

EmbeddingRequest::Input text_input(const json& text, const std::string& param) {
  if (text.get_ref<const std::string&>().empty()) throw bad_field(param, "an empty string has no embedding");
  return {text.get<std::string>(), {}, false};
}

// "input": a string, or an array of strings, of token ids, or of arrays of token ids (OpenAI's
// four forms; an array of ids is one input).
std::vector<EmbeddingRequest::Input> read_inputs(const json& body, int n_vocab) {
  const json* input = field(body, "input");
  if (input == nullptr) throw bad_field("input", "is required");
  if (input->is_string()) return {text_input(*input, "input")};
  if (!input->is_array()) throw bad_field("input", "must be a string, an array of strings or an array of token ids");
  if (input->empty()) throw bad_field("input", "an empty array has no embedding");
  if (input->size() > kMaxEmbeddingInputs) {
    throw bad_field("input", std::to_string(input->size()) + " inputs; at most " + std::to_string(kMaxEmbeddingInputs) +
                                 " in one request");
  }
  if ((*input)[0].is_number()) return {{{}, token_ids(*input, "input", n_vocab), true}};
  std::vector<EmbeddingRequest::Input> inputs;
  for (size_t i = 0; i < input->size(); ++i) {
    const json& item = (*input)[i];
    if (item.is_string()) {
      inputs.push_back(text_input(item, at("input", i)));
    } else if (item.is_array()) {
      inputs.push_back({{}, token_ids(item, at("input", i), n_vocab), true});
    } else {
      throw bad_field(at("input", i), "must be a string or an array of token ids");
    }
  }
  return inputs;
}

constexpr char kBase64Alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

}  // namespace

EmbeddingRequest parse_embedding_request(const json& body, int n_embd, int n_vocab) {
  if (!body.is_object()) throw ApiError(400, "the body must be a JSON object");
  EmbeddingRequest request;
  if (const json* model = field(body, "model")) {
    if (!model->is_string()) throw bad_field("model", "must be a string");
    request.model = model->get<std::string>();
  }
  request.inputs = read_inputs(body, n_vocab);
  if (const json* format = field(body, "encoding_format")) {
    if (!format->is_string() || (*format != "float" && *format != "base64")) {
      throw bad_field("encoding_format", "must be \"float\" or \"base64\", got " + format->dump());
    }
    request.base64 = *format == "base64";
  }
  // A shorter vector is what a model trained for it (Matryoshka) gives; truncating this one's would
  // not be that, so only the model's own size is taken.
  if (const json* dimensions = field(body, "dimensions")) {
    if (!dimensions->is_number_integer() || dimensions->get<int64_t>() != n_embd) {
      throw bad_field("dimensions", "this model's embeddings have " + std::to_string(n_embd) + " dimensions; got " +
                                        dimensions->dump());
    }
  }
  return request;
}

std::vector<std::vector<int32_t>> embedding_inputs(const EmbeddingRequest& request, const Tokenizer& tokenizer, int n_ctx) {
  std::vector<std::vector<int32_t>> inputs;
  inputs.reserve(request.inputs.size());
  for (size_t i = 0; i < request.inputs.size(); ++i) {
    const EmbeddingRequest::Input& in = request.inputs[i];
    std::vector<int32_t> tokens = in.is_tokens ? in.tokens : tokenizer.encode(in.text, tokenizer.add_bos_by_default(), true);
    const std::string param = request.inputs.size() == 1 ? "input" : at("input", i);
    if (tokens.empty()) throw bad_field(param, "has no tokens");
    if (tokens.size() > static_cast<size_t>(n_ctx)) {
      throw bad_field(param, "is " + std::to_string(tokens.size()) + " tokens, more than the context of " +
                                 std::to_string(n_ctx) + " (the server's -c)");
    }
    inputs.push_back(std::move(tokens));
  }
  return inputs;
}

void check_embedding_pooling(Pooling pooling) {
  if (pooling_runs(pooling)) return;
  throw ApiError(400, std::string("this model's pooling_type is '") + pooling_name(pooling) +
                          "': " + (pooling == Pooling::kRank ? "a reranker, whose classification head ringlm does not run"
                                                             : "per-token vectors, which are not one embedding per input"));
}

std::vector<std::vector<float>> gather_embeddings(RequestStream& stream, size_t n_inputs) {
  std::vector<std::vector<float>> vectors(n_inputs);
  while (!stream.finished()) {
    for (StreamEvent& e : stream.wait(std::chrono::milliseconds(100))) {
      if (e.kind == StreamEvent::Kind::kCancelled) throw ApiError(503, "the server is shutting down");
      if (e.kind == StreamEvent::Kind::kDone) vectors.at(static_cast<size_t>(e.sample)) = std::move(e.result.embedding);
    }
  }
  return vectors;
}

json embeddings_response(const std::vector<std::vector<float>>& vectors, bool base64, const std::string& model,
                         int prompt_tokens) {
  json data = json::array();
  for (size_t i = 0; i < vectors.size(); ++i) {
    json item = {{"object", "embedding"}, {"index", i}};
    if (base64) {
      item["embedding"] = base64_floats(vectors[i]);
    } else {
      item["embedding"] = vectors[i];
    }
    data.push_back(std::move(item));
  }
  return {{"object", "list"},
          {"data", std::move(data)},
          {"model", model},
          {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

std::string base64_floats(std::span<const float> values) {
  std::vector<unsigned char> bytes;
  bytes.reserve(values.size() * 4);
  for (const float v : values) {
    uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof(bits));
    for (int shift = 0; shift < 32; shift += 8) bytes.push_back(static_cast<unsigned char>(bits >> shift));
  }
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t group = static_cast<uint32_t>(bytes[i]) << 16;
    if (n > 1) group |= static_cast<uint32_t>(bytes[i + 1]) << 8;
    if (n > 2) group |= bytes[i + 2];
    for (size_t k = 0; k < 4; ++k) out += k <= n ? kBase64Alphabet[(group >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}

json pooling_fields(Pooling pooling, bool from_file) {
  return {{"pooling", pooling_name(pooling)},
          {"embedding_pooling_source", from_file ? "file (pooling_type)" : "default for a generative model"}};
}

}  // namespace ringlm::serve

// Loading a tokenizer from GGUF metadata, token -> text, and streaming UTF-8 output.
#include "core/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <stdexcept>

#include "core/gguf/gguf.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/unicode.h"

namespace ringlm {
namespace {

constexpr std::string_view kModelKey = "tokenizer.ggml.model";
constexpr std::string_view kPreKey = "tokenizer.ggml.pre";
constexpr std::string_view kTokensKey = "tokenizer.ggml.tokens";
constexpr std::string_view kScoresKey = "tokenizer.ggml.scores";
constexpr std::string_view kTypesKey = "tokenizer.ggml.token_type";
constexpr std::string_view kMergesKey = "tokenizer.ggml.merges";
constexpr std::string_view kAddBosKey = "tokenizer.ggml.add_bos_token";
constexpr std::string_view kAddEosKey = "tokenizer.ggml.add_eos_token";
constexpr std::string_view kAddSpaceKey = "tokenizer.ggml.add_space_prefix";

// Tokens that end a turn in common chat formats. They only count as end-of-generation when
// the vocabulary marks them as control tokens: as plain text they are just text.
constexpr std::array<std::string_view, 10> kEndOfTurnTexts = {
    "<|eot_id|>",    "<|im_end|>",      "<|end|>",    "<end_of_turn>",
    "<|endoftext|>", "<|end_of_text|>", "<|eom_id|>", "<EOT>",
    "<|return|>",    "<|call|>",  // harmony's (gpt-oss)
};

std::string quoted(std::string_view s) {
  std::string out;  // built by appends: g++ 12 warns falsely (-Wrestrict) on "'" + s + "'"
  out.reserve(s.size() + 2);
  out += '\'';
  out += s;
  out += '\'';
  return out;
}

// "<0xNN>" -> NN, or -1 when the text is not a byte token's.
int parse_byte_token(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') {
      value += c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value += c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value += c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

// A numeric array of one value per token (scores or token types); empty when absent.
// Either element kind is accepted, so that integer scores or float types do not fail a model.
std::vector<double> per_token_numbers(const GgufFile& gguf, std::string_view key, size_t n_tokens) {
  const GgufValue* v = gguf.find(key);
  if (v == nullptr) return {};
  const bool numeric = v->type == GgufValueType::ARRAY && v->array_type != GgufValueType::STRING &&
                       v->array_type != GgufValueType::ARRAY;
  if (!numeric) gguf.fail("metadata " + quoted(key) + " must be a numeric array, one value per token");
  std::vector<double> out;
  if (!v->floats.empty()) {
    out = v->floats;
  } else {
    out.assign(v->ints.begin(), v->ints.end());
  }
  if (out.size() != n_tokens) {
    gguf.fail("metadata " + quoted(key) + " has " + std::to_string(out.size()) + " values but " +
              std::string(kTokensKey) + " has " + std::to_string(n_tokens) + " tokens");
  }
  return out;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& gguf) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());

  const std::optional<std::string_view> model = gguf.get_string(kModelKey);
  if (!model) gguf.fail("metadata " + quoted(kModelKey) + " is missing: the file has no tokenizer");
  if (*model == "llama") {
    t->kind_ = Kind::Spm;
  } else if (*model == "gpt2") {
    t->kind_ = Kind::Bpe;
  } else {
    gguf.fail("unsupported " + std::string(kModelKey) + " " + quoted(*model) +
              " (supported: 'llama', 'gpt2')");
  }

  // Defaults as llama.cpp has them; metadata below overrides.
  if (t->kind_ == Kind::Bpe) {
    const std::string_view name = gguf.get_string(kPreKey).value_or("default");
    const PreTokenizerSpec* pre = find_pre_tokenizer(name);
    if (pre == nullptr) {
      // An unknown name still gets a working tokenizer, as a model converted by a newer
      // converter should load; the splits may differ from the model's own in corner cases.
      std::fprintf(stderr, "ringlm: %s: unknown %s '%.*s', using 'default'\n", gguf.path().c_str(),
                   std::string(kPreKey).c_str(), static_cast<int>(name.size()), name.data());
      pre = &default_pre_tokenizer();
    }
    t->pre_name_ = pre->name;
    t->ignore_merges_ = pre->ignore_merges;
    t->add_bos_ = pre->add_bos;
    t->pre_ = std::make_unique<PreTokenizer>(pre->patterns);
  } else {
    t->add_bos_ = true;
    t->add_space_prefix_ = true;
  }

  t->load_vocab(gguf);
  if (t->kind_ == Kind::Bpe) t->load_merges(gguf);
  if (t->kind_ == Kind::Spm) t->spm_words_independent_ = t->no_token_joins_words();
  t->load_special_ids(gguf);
  t->build_byte_tables();
  t->build_pieces();
  t->build_special_list();
  t->build_end_of_generation();
  return t;
}

void Tokenizer::load_vocab(const GgufFile& gguf) {
  const std::vector<std::string_view>* texts = gguf.get_string_array(kTokensKey);
  if (texts == nullptr) {
    gguf.fail("metadata " + quoted(kTokensKey) + " is missing: the tokenizer has no vocabulary");
  }
  if (texts->empty()) gguf.fail("metadata " + quoted(kTokensKey) + " is empty");
  if (texts->size() > static_cast<size_t>(INT32_MAX)) gguf.fail(std::string(kTokensKey) + " is too long");

  const std::vector<double> scores = per_token_numbers(gguf, kScoresKey, texts->size());
  const std::vector<double> types = per_token_numbers(gguf, kTypesKey, texts->size());

  tokens_.resize(texts->size());
  token_ids_.reserve(texts->size());
  for (size_t i = 0; i < texts->size(); ++i) {
    TokenData& tok = tokens_[i];
    tok.text = std::string((*texts)[i]);
    if (!scores.empty()) tok.score = static_cast<float>(scores[i]);
    if (!types.empty()) {
      const double ty = types[i];
      // Values outside the known range behave like Undefined (never produced, renders empty).
      tok.type = (ty >= 0 && ty <= 6) ? static_cast<TokenType>(static_cast<int>(ty)) : TokenType::Undefined;
    }
    if (tok.text.empty()) continue;  // cannot be looked up or matched; keeps its id
    const auto [it, fresh] = token_ids_.emplace(tok.text, static_cast<int32_t>(i));
    if (!fresh) {
      gguf.fail("metadata " + quoted(kTokensKey) + ": token " + quoted(tok.text) + " appears twice (ids " +
                std::to_string(it->second) + " and " + std::to_string(i) + ")");
    }
  }
}

void Tokenizer::load_merges(const GgufFile& gguf) {
  const std::vector<std::string_view>* merges = gguf.get_string_array(kMergesKey);
  if (merges == nullptr) {
    gguf.fail("metadata " + quoted(kMergesKey) + " is missing: a 'gpt2' tokenizer needs its merges");
  }
  merges_.reserve(merges->size());
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const std::string_view m = (*merges)[rank];
    auto bad = [&](const std::string& why) {
      gguf.fail("metadata " + quoted(kMergesKey) + "[" + std::to_string(rank) + "] " + quoted(m) + ": " +
                why);
    };
    // Split at the first space after the first character, so a left part may itself be " ".
    const size_t space = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
    if (space == std::string_view::npos) bad("is not two tokens separated by a space");
    const std::string_view left = m.substr(0, space), right = m.substr(space + 1);
    const int32_t a = lookup(left), b = lookup(right);
    if (a < 0) bad("names " + quoted(left) + ", which is not in " + std::string(kTokensKey));
    if (b < 0) bad("names " + quoted(right) + ", which is not in " + std::string(kTokensKey));
    const int32_t result = lookup(std::string(left) + std::string(right));
    if (result < 0) bad("its result is not in " + std::string(kTokensKey));
    // A repeated pair keeps its first (best) rank.
    merges_.emplace((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b),
                    Merge{static_cast<int32_t>(rank), result});
  }
}

void Tokenizer::load_special_ids(const GgufFile& gguf) {
  // Reads an id key; absent or negative (some converters write -1) means "none".
  auto read_id = [&](std::string_view key, int32_t fallback) -> int32_t {
    const GgufValue* v = gguf.find(key);
    if (v == nullptr) return fallback < n_vocab() ? fallback : -1;
    if (!v->is_integer() || v->type == GgufValueType::BOOL) {
      gguf.fail("metadata " + quoted(key) + " must be an integer token id");
    }
    if (v->i < 0 && v->type != GgufValueType::UINT64) return -1;
    if (v->u >= static_cast<uint64_t>(n_vocab())) {
      gguf.fail("metadata " + quoted(key) + " = " + std::to_string(v->u) + " is outside the vocabulary of " +
                std::to_string(n_vocab()) + " tokens");
    }
    return static_cast<int32_t>(v->u);
  };
  const bool spm = kind_ == Kind::Spm;  // SentencePiece's conventional <unk>=0, <s>=1, </s>=2
  bos_id_ = read_id("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  eos_id_ = read_id("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  unk_id_ = read_id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  eot_id_ = read_id("tokenizer.ggml.eot_token_id", -1);
  eom_id_ = read_id("tokenizer.ggml.eom_token_id", -1);
  pad_id_ = read_id("tokenizer.ggml.padding_token_id", -1);

  add_bos_ = gguf.get_bool(kAddBosKey).value_or(add_bos_);
  add_eos_ = gguf.get_bool(kAddEosKey).value_or(add_eos_);
  // Only SentencePiece adds a space prefix when encoding, so only it removes one when decoding.
  if (spm) add_space_prefix_ = gguf.get_bool(kAddSpaceKey).value_or(add_space_prefix_);
  if (add_bos_ && bos_id_ < 0 && gguf.find(kAddBosKey) != nullptr) {
    gguf.fail("metadata " + quoted(kAddBosKey) + " is true but tokenizer.ggml.bos_token_id is not set");
  }
  if (add_bos_ && bos_id_ < 0) add_bos_ = false;  // only a default asked for it
}

void Tokenizer::build_byte_tables() {
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<uint8_t>(b);
    if (kind_ == Kind::Spm) {
      // <0xNN> when the vocabulary has byte tokens, else the byte itself as a token, else <unk>.
      static constexpr char kHex[] = "0123456789ABCDEF";
      const std::string hex = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
      int32_t id = lookup(hex);
      if (id < 0) id = lookup(std::string(1, static_cast<char>(byte)));
      spm_byte_token_[b] = id >= 0 ? id : unk_id_;
      bpe_byte_token_[b] = -1;
    } else {
      std::string ch;
      unicode::append_utf8(ch, unicode::gpt2_byte_to_code_point(byte));
      bpe_byte_token_[b] = lookup(ch);
      spm_byte_token_[b] = -1;
    }
  }
}

void Tokenizer::build_pieces() {
  for (TokenData& tok : tokens_) {
    switch (tok.type) {
      case TokenType::Control:
      case TokenType::Unknown:
      case TokenType::UserDefined:
        tok.piece = tok.text;  // written as is, never escaped
        break;
      case TokenType::Byte: {
        const int byte = parse_byte_token(tok.text);
        tok.piece = byte >= 0 ? std::string(1, static_cast<char>(byte)) : tok.text;
        break;
      }
      case TokenType::Normal:
        if (kind_ == Kind::Spm) {
          for (size_t pos = 0; pos < tok.text.size();) {
            if (tok.text.compare(pos, unicode::kSpaceMarker.size(), unicode::kSpaceMarker) == 0) {
              tok.piece += ' ';
              pos += unicode::kSpaceMarker.size();
            } else {
              tok.piece += tok.text[pos++];
            }
          }
        } else {
          // GPT-2 characters back to bytes; a character outside the map is kept as it is.
          for (size_t pos = 0; pos < tok.text.size();) {
            const size_t start = pos;
            const int byte = unicode::gpt2_code_point_to_byte(unicode::next_code_point(tok.text, pos));
            if (byte >= 0) {
              tok.piece += static_cast<char>(byte);
            } else {
              tok.piece.append(tok.text, start, pos - start);
            }
          }
        }
        break;
      case TokenType::Unused:
      case TokenType::Undefined:
        break;  // never rendered, as in llama.cpp
    }
  }
}

void Tokenizer::build_special_list() {
  for (int32_t id = 0; id < n_vocab(); ++id) {
    const TokenData& tok = tokens_[static_cast<size_t>(id)];
    const bool special = tok.type == TokenType::Control || tok.type == TokenType::UserDefined ||
                         tok.type == TokenType::Unknown;
    if (special && !tok.text.empty()) special_by_length_.push_back(id);
  }
  std::stable_sort(special_by_length_.begin(), special_by_length_.end(), [&](int32_t a, int32_t b) {
    return tokens_[static_cast<size_t>(a)].text.size() > tokens_[static_cast<size_t>(b)].text.size();
  });
}

void Tokenizer::build_end_of_generation() {
  for (const int32_t id : {eos_id_, eot_id_, eom_id_}) {
    if (id >= 0) eog_ids_.insert(id);
  }
  for (std::string_view text : kEndOfTurnTexts) {
    const int32_t id = lookup(text);
    if (id >= 0 && tokens_[static_cast<size_t>(id)].type == TokenType::Control) eog_ids_.insert(id);
  }
  // gpt-oss's vocabulary (o200k_harmony): a reply ends at <|return|>, or at <|call|> when it is a
  // tool call, while <|end|> ends only one message of it (the reasoning before the answer). As
  // llama.cpp does when the end tokens include all three, <|end|> is no end of generation, and it
  // and the markers of a message's header are user-defined tokens: rendered in the generated text
  // (where reply_parser.h reads the reply's channels from them) and always cut out of a text
  // before it is tokenized.
  const int32_t reply_end = lookup("<|return|>"), call = lookup("<|call|>"), message_end = lookup("<|end|>");
  if (eog_ids_.count(reply_end) != 0 && eog_ids_.count(call) != 0 && eog_ids_.count(message_end) != 0) {
    eog_ids_.erase(message_end);
    for (std::string_view text : {"<|end|>", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"}) {
      const int32_t id = lookup(text);
      if (id >= 0) tokens_[static_cast<size_t>(id)].type = TokenType::UserDefined;
    }
  }
  // The markers that start a tool call (tool_calls.h) are read from the generated text, so they
  // must be in it: Mistral's [TOOL_CALLS] and Llama 3.1's <|python_tag|> are control tokens,
  // which render as nothing. As user-defined tokens they render, and a prompt's text still
  // becomes the one token (what llama.cpp does with a chat format's preserved tokens).
  for (std::string_view text : {"[TOOL_CALLS]", "<|python_tag|>", "<tool_call>", "</tool_call>"}) {
    const int32_t id = lookup(text);
    if (id >= 0 && eog_ids_.count(id) == 0 && tokens_[static_cast<size_t>(id)].type == TokenType::Control) {
      tokens_[static_cast<size_t>(id)].type = TokenType::UserDefined;
    }
  }
}

bool Tokenizer::no_token_joins_words() const {
  const std::string_view marker = unicode::kSpaceMarker;
  for (const TokenData& tok : tokens_) {
    for (size_t pos = tok.text.find(marker, 1); pos != std::string::npos;
         pos = tok.text.find(marker, pos + 1)) {
      if (pos < marker.size() || tok.text.compare(pos - marker.size(), marker.size(), marker) != 0)
        return false;
    }
  }
  return true;
}

int32_t Tokenizer::lookup(std::string_view text) const {
  const auto it = token_ids_.find(text);
  return it == token_ids_.end() ? -1 : it->second;
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  const int32_t id = lookup(text);
  if (id < 0) return std::nullopt;
  return id;
}

// ---------------------------------------------------------------------------------------------
// Token ids -> text

std::string Tokenizer::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) {
    throw std::out_of_range("tokenizer: token id " + std::to_string(id) + " is outside the vocabulary of " +
                            std::to_string(n_vocab()) + " tokens");
  }
  const TokenData& tok = tokens_[static_cast<size_t>(id)];
  const bool hidden = tok.type == TokenType::Control || tok.type == TokenType::Unknown;
  if (hidden && !render_special) return {};
  return tok.piece;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool render_special) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string piece = token_to_piece(ids[i], render_special);
    // Undo the space encode() put in front of the text. Like llama.cpp, only the first
    // token's piece is trimmed: after a BOS the space stays, which is what the model saw.
    if (i == 0 && add_space_prefix_ && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
    text += piece;
  }
  return text;
}

// ---------------------------------------------------------------------------------------------
// Streaming UTF-8

std::string Utf8StreamDecoder::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const unicode::Sequence seq = unicode::check_sequence(std::string_view(pending_).substr(pos));
    if (seq.status == unicode::SequenceStatus::Incomplete) break;  // wait for the rest
    if (seq.status == unicode::SequenceStatus::Complete) {
      out.append(pending_, pos, seq.length);
    } else {
      out += unicode::kReplacement;
    }
    pos += seq.length;
  }
  pending_.erase(0, pos);
  return out;
}

std::string Utf8StreamDecoder::flush() {
  std::string out = push({});
  // Whatever is still held is the start of a sequence that never got its end.
  if (!pending_.empty()) out += unicode::kReplacement;
  pending_.clear();
  return out;
}

}  // namespace ringlm

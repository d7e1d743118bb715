#include "core/tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/tokenizer/unicode.h"

namespace ringlm {
namespace {

// The regexes are llama.cpp's (src/llama-vocab.cpp), which follow each model's tokenizer.json.
// Case-insensitive contractions are spelled out ('[sS]) rather than (?i:'s): with PCRE2_UCP,
// (?i) would also fold characters such as U+017F "ſ" into 's', which the reference does not.

// GPT-2's pattern. Hugging Face ends it with "|\s+", which changes nothing here: whitespace
// that no alternative takes becomes a piece of its own anyway.
constexpr std::string_view kGpt2 =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))re";

// Llama 3: contractions in any case, a letter run with one optional leading non-letter,
// numbers in groups of at most three digits, punctuation runs that keep trailing newlines.
constexpr std::string_view kLlama3 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Qwen 2: as Llama 3 but every digit on its own.
constexpr std::string_view kQwen2 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

constexpr std::array kDefaultPatterns = {std::string_view(R"re([\p{P}\$\+<=>\^~\|]+)re"), kGpt2,
                                         std::string_view(R"re(\p{N}+)re"),
                                         std::string_view(R"re([0-9][0-9][0-9])re")};
constexpr std::array kGpt2Patterns = {kGpt2};
// StarCoder (and SmolLM, which reuses its tokenizer): digits first split one by one.
constexpr std::array kStarcoderPatterns = {std::string_view(R"re(\p{N})re"), kGpt2};
constexpr std::array kLlama3Patterns = {kLlama3};
constexpr std::array kQwen2Patterns = {kQwen2};
constexpr std::array kFalconPatterns = {std::string_view(R"re([\p{P}\$\+<=>\^~\|`]+)re"), kGpt2,
                                        std::string_view(R"re([0-9][0-9][0-9])re")};

struct NamedSpec {
  std::string_view alias;
  PreTokenizerSpec spec;
};

// Aliases are names llama.cpp maps to the same regexes and options.
const std::array kSpecs = {
    NamedSpec{"default", {"default", kDefaultPatterns}},
    NamedSpec{"gpt-2", {"gpt-2", kGpt2Patterns}},
    NamedSpec{"phi-2", {"gpt-2", kGpt2Patterns}},
    NamedSpec{"mpt", {"gpt-2", kGpt2Patterns}},
    NamedSpec{"olmo", {"gpt-2", kGpt2Patterns}},
    NamedSpec{"starcoder", {"starcoder", kStarcoderPatterns}},
    NamedSpec{"smollm", {"smollm", kStarcoderPatterns}},
    NamedSpec{"refact", {"starcoder", kStarcoderPatterns}},
    NamedSpec{"codeshell", {"starcoder", kStarcoderPatterns}},
    NamedSpec{"command-r", {"starcoder", kStarcoderPatterns}},
    NamedSpec{"llama-bpe", {"llama-bpe", kLlama3Patterns, true, true}},
    NamedSpec{"llama3", {"llama-bpe", kLlama3Patterns, true, true}},
    NamedSpec{"llama-v3", {"llama-bpe", kLlama3Patterns, true, true}},
    NamedSpec{"falcon3", {"llama-bpe", kLlama3Patterns, true, true}},
    NamedSpec{"dbrx", {"dbrx", kLlama3Patterns}},
    NamedSpec{"smaug-bpe", {"dbrx", kLlama3Patterns}},
    NamedSpec{"qwen2", {"qwen2", kQwen2Patterns}},
    NamedSpec{"stablelm2", {"qwen2", kQwen2Patterns}},
    NamedSpec{"falcon", {"falcon", kFalconPatterns}},
};

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  pcre2_get_error_message(code, buf.data(), buf.size());
  return reinterpret_cast<const char*>(buf.data());
}

pcre2_code* compile(std::string_view pattern) {
  // MATCH_INVALID_UTF: text with invalid UTF-8 is matched around the bad bytes instead of
  // failing; the bad bytes end up between matches and are still tokenized, byte by byte.
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &error, &offset, nullptr);
  if (code == nullptr) {
    throw std::runtime_error("tokenizer: pre-tokenizer regex '" + std::string(pattern) +
                             "' does not compile at offset " + std::to_string(offset) + ": " +
                             pcre2_message(error));
  }
  // JIT is an optimisation only: without it (unsupported CPU, no exec memory) the
  // interpreter gives the same matches.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// Appends the pieces of `text` under one pattern: matches and the stretches between them.
void split_one(const pcre2_code* code, pcre2_match_data* md, std::string_view text,
               std::vector<std::string_view>& out) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t gap_begin = 0;  // start of text not yet emitted
  size_t start = 0;      // where the next match may begin
  while (start < text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), start, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error("tokenizer: regex match failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0], end = ov[1];
    if (end == begin) {  // an empty match takes nothing; step over one character
      start = begin + unicode::sequence_length(static_cast<uint8_t>(text[begin]));
      continue;
    }
    if (begin > gap_begin) out.push_back(text.substr(gap_begin, begin - gap_begin));
    out.push_back(text.substr(begin, end - begin));
    gap_begin = start = end;
  }
  if (gap_begin < text.size()) out.push_back(text.substr(gap_begin));
}

}  // namespace

const PreTokenizerSpec* find_pre_tokenizer(std::string_view name) {
  for (const NamedSpec& s : kSpecs) {
    if (s.alias == name) return &s.spec;
  }
  return nullptr;
}

const PreTokenizerSpec& default_pre_tokenizer() { return kSpecs[0].spec; }

PreTokenizer::PreTokenizer(std::span<const std::string_view> patterns) {
  try {
    for (std::string_view p : patterns) codes_.push_back(compile(p));
  } catch (...) {
    for (pcre2_code* c : codes_) pcre2_code_free(c);
    throw;
  }
}

PreTokenizer::~PreTokenizer() {
  for (pcre2_code* c : codes_) pcre2_code_free(c);
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  pieces.push_back(text);
  std::vector<std::string_view> next;
  for (const pcre2_code* code : codes_) {
    // Match data is per call, not per object, so that encode() stays const and thread-safe;
    // one allocation per pattern per call is nothing next to the matching itself.
    MatchData md(pcre2_match_data_create_from_pattern(code, nullptr));
    if (!md) throw std::bad_alloc();
    next.clear();
    for (std::string_view piece : pieces) split_one(code, md.get(), piece, next);
    pieces.swap(next);
  }
}

}  // namespace ringlm

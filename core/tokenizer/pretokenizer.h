// Regex pre-tokenizers of byte-level BPE vocabularies (`tokenizer.ggml.pre`), run with PCRE2.
#pragma once

#include <span>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;  // pcre2_code_8, kept out of this header

namespace ringlm {

// How one `tokenizer.ggml.pre` name tokenizes: every name llama.cpp's llama-vocab.cpp maps to a
// regex pre-tokenizer for a byte-level BPE vocabulary, with the flags it sets for that name.
struct PreTokenizerSpec {
  std::string_view name;                       // the `tokenizer.ggml.pre` value
  std::span<const std::string_view> patterns;  // applied in turn, see PreTokenizer::split
  bool ignore_merges = false;                  // a piece that is itself a token is taken whole (Llama 3)
  bool add_bos = false;  // llama.cpp's default for add_bos_token with this pre-tokenizer
};

// The spec for a `tokenizer.ggml.pre` value, or nullptr when unknown.
const PreTokenizerSpec* find_pre_tokenizer(std::string_view name);
const PreTokenizerSpec& default_pre_tokenizer();
// Every name find_pre_tokenizer() knows, "default" first.
std::span<const PreTokenizerSpec> known_pre_tokenizers();

class PreTokenizer {
 public:
  // Compiles the patterns (PCRE2_UTF | PCRE2_UCP, JIT when available); throws
  // std::runtime_error naming the pattern when one does not compile.
  explicit PreTokenizer(std::span<const std::string_view> patterns);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Splits `text` into consecutive non-empty pieces that cover it exactly. Each pattern in turn
  // splits every piece left by the previous one into its matches and the text between them, and
  // sees only that piece (a lookahead stops at the piece's end), as llama.cpp and Hugging Face's
  // Sequence of Split pre-tokenizers do. A match is searched for from where the previous one
  // ended, as Python's re.finditer does: an empty match takes nothing but still cuts the piece
  // where it is (SuperBPE's digit groups are lookaheads only), and the next match may then start
  // at the same place if it is not empty. Safe to call from several threads at once.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  std::vector<pcre2_real_code_8*> codes_;
};

}  // namespace ringlm

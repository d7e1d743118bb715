// Tokenizer built from GGUF metadata alone.
//
// Two model families, as named by `tokenizer.ggml.model`:
//   llama  SentencePiece-style: characters merged by token score, unknown characters fall back
//          to <0xNN> byte tokens, spaces are written as U+2581 "▁" with one added at the start.
//   gpt2   byte-level BPE: text is split by the regex of `tokenizer.ggml.pre` (PCRE2, Unicode
//          classes), each piece's bytes are mapped to GPT-2's printable characters and merged by
//          the rank of `tokenizer.ggml.merges`.
// Special (control and user-defined) tokens are cut out of the text before either runs.
// The results match llama.cpp's tokenizer (and so the Hugging Face one it is tested against).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ringlm {

class GgufFile;
class PreTokenizer;

class Tokenizer {
 public:
  // Builds from GGUF metadata alone. Throws GgufError / std::runtime_error whose message names
  // the offending key when the metadata is missing or inconsistent.
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& gguf);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // parse_special: cut control tokens (e.g. "<|im_start|>") out of the text before tokenizing;
  // user-defined tokens are always cut out, as llama.cpp does. add_bos: prepend BOS when the
  // vocabulary has one.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const;
  // Raw bytes of one token as it appears in output text. Control and unknown tokens render as
  // their text only if render_special. Throws std::out_of_range for an id outside the vocab.
  std::string token_to_piece(int32_t id, bool render_special = false) const;
  // Concatenated pieces; for SentencePiece vocabularies with add_space_prefix, the one space
  // that encode() put in front of the text is removed from the first token again.
  std::string decode(std::span<const int32_t> ids, bool render_special = false) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  // The token as the vocabulary stores it ("▁the", "Ġthe", "<0x0A>", "<s>").
  std::string_view token_text(int32_t id) const { return tokens_.at(static_cast<size_t>(id)).text; }
  int32_t bos_id() const { return bos_id_; }  // -1 if none
  int32_t eos_id() const { return eos_id_; }  // -1 if none
  int32_t eot_id() const { return eot_id_; }  // -1 if none
  int32_t pad_id() const { return pad_id_; }  // -1 if none
  // tokenizer.ggml.add_bos_token, else the model type's default (llama: true, gpt2: false,
  // except the pre-tokenizers llama.cpp gives a BOS: Llama 3's, Tekken's, Chameleon's).
  bool add_bos_by_default() const { return add_bos_; }
  bool add_eos_by_default() const { return add_eos_; }  // informational: encode() never adds EOS
  // EOS, EOT, EOM and control tokens that end a turn (<|im_end|>, <|eot_id|>, <|end|>, ...); in
  // gpt-oss's vocabulary <|return|> and <|call|>, and not <|end|> (see build_end_of_generation).
  bool is_end_of_generation(int32_t id) const { return eog_ids_.count(id) != 0; }
  std::optional<int32_t> find_token(std::string_view text) const;  // exact vocabulary lookup
  std::string_view model_name() const { return kind_ == Kind::Spm ? "llama" : "gpt2"; }
  std::string_view pre_tokenizer_name() const { return pre_name_; }

  // GGUF token_type values.
  enum class TokenType : uint8_t {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
  };
  TokenType token_type(int32_t id) const { return tokens_.at(static_cast<size_t>(id)).type; }

 private:
  enum class Kind { Spm, Bpe };

  struct TokenData {
    std::string text;   // as stored in the vocabulary ("▁the", "Ġthe", "<0x0A>", "<s>")
    std::string piece;  // the bytes it stands for in output text
    float score = 0.0f;
    TokenType type = TokenType::Normal;
  };

  // Result of merging the pair (left, right) in byte-level BPE.
  struct Merge {
    int32_t rank;
    int32_t result;
  };

  // One stretch of the input after special tokens are cut out: either text still to be
  // tokenized or an already known special token.
  struct Fragment {
    std::string_view text;
    int32_t token = -1;  // >= 0: a special token
  };

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  Tokenizer();

  // Loading (tokenizer.cpp).
  void load_vocab(const GgufFile& gguf);
  void load_special_ids(const GgufFile& gguf);
  void load_merges(const GgufFile& gguf);
  void build_byte_tables();
  void build_pieces();
  void build_special_list();
  void build_end_of_generation();
  bool no_token_joins_words() const;  // see spm_words_independent_

  // Encoding.
  std::vector<Fragment> split_special(std::string_view text, bool parse_special) const;
  struct Scratch;  // per-call working memory, reused across words (encode.cpp)
  void encode_spm(std::string_view text, bool space_prefix, Scratch& scratch,
                  std::vector<int32_t>& out) const;
  void merge_spm_chunk(std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const;
  void merge_bpe_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const;
  int32_t lookup(std::string_view text) const;  // -1 when absent

  Kind kind_ = Kind::Bpe;
  std::string pre_name_;
  std::vector<TokenData> tokens_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_ids_;

  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t eot_id_ = -1;
  int32_t eom_id_ = -1;
  int32_t unk_id_ = -1;
  int32_t pad_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
  bool add_space_prefix_ = false;  // SentencePiece only
  // SentencePiece: no token has a "▁" right after another character, so no merge can cross
  // the start of a "▁"-led word and words can be merged one at a time (same result, faster).
  bool spm_words_independent_ = false;
  bool ignore_merges_ = false;  // BPE: a piece that is a whole token is not merged (Llama 3)

  std::vector<int32_t> special_by_length_;  // control/user-defined/unknown ids, longest text first
  std::unordered_set<int32_t> eog_ids_;

  // SentencePiece: token for a byte that no merge covers (<0xNN>, else the 1-char token).
  int32_t spm_byte_token_[256] = {};
  // Byte-level BPE: token of each byte's GPT-2 character, merges keyed by (left << 32 | right).
  int32_t bpe_byte_token_[256] = {};
  std::unordered_map<uint64_t, Merge> merges_;
  std::unique_ptr<PreTokenizer> pre_;
};

// Streaming detokenization: push() the bytes of each new token and get back only complete
// UTF-8; an incomplete multi-byte sequence at the end is held back until the rest arrives.
// Bytes that can never form valid UTF-8 come out as U+FFFD at once. flush() returns what is
// left, an incomplete sequence replaced by U+FFFD.
class Utf8StreamDecoder {
 public:
  std::string push(std::string_view bytes);
  std::string flush();

 private:
  std::string pending_;
};

}  // namespace ringlm

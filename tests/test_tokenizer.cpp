// Tokenizer tests: llama.cpp's tokenizer test vectors (encode exactly, decode back), special
// tokens, end-of-generation, metadata errors, streaming UTF-8, and the real SmolLM2 vocabulary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/vocab_vectors.h"

namespace ringlm {
namespace {

using ::testing::HasSubstr;

const std::string kVocabDir = std::string(RINGLM_SHARED_DATA) + "/vocab/";
// The real model scripts/setup.sh installs; its absence is a set-up failure, not a skip.
const std::string kSmolLm2 = RINGLM_TEST_MODEL;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<Tokenizer> load_vocab(const std::string& name) {
  const auto gguf = GgufFile::open(kVocabDir + name + ".gguf");
  return Tokenizer::from_gguf(*gguf);  // the tokenizer copies what it needs
}

// ---------------------------------------------------------------------------------------------
// llama.cpp's test-tokenizer-0 vectors

using test::read_vocab_cases;
using test::VocabCase;

class VocabVectors : public ::testing::TestWithParam<const char*> {};

TEST_P(VocabVectors, EncodeMatchesAndDecodeRoundTrips) {
  const std::string name = GetParam();
  const auto tok = load_vocab(name);
  const std::vector<VocabCase> cases = read_vocab_cases(kVocabDir + name + ".gguf");
  ASSERT_GE(cases.size(), 40u);
  for (const VocabCase& c : cases) {
    SCOPED_TRACE("text: '" + c.text + "'");
    // As test-tokenizer-0: no BOS, special tokens not parsed.
    EXPECT_EQ(tok->encode(c.text, /*add_bos=*/false, /*parse_special=*/false), c.ids);
    // No normalisation happens on either side (SentencePiece's leading space is added on
    // encode and removed on decode), so every vector decodes back to its exact bytes.
    EXPECT_EQ(tok->decode(c.ids), c.text);
  }
}

INSTANTIATE_TEST_SUITE_P(Ggml, VocabVectors,
                         ::testing::Values("ggml-vocab-llama-spm", "ggml-vocab-gpt-2", "ggml-vocab-starcoder",
                                           "ggml-vocab-llama-bpe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

// ---------------------------------------------------------------------------------------------
// Vocabulary facts

TEST(Tokenizer, ModelNamesAndSpecialIds) {
  const auto spm = load_vocab("ggml-vocab-llama-spm");
  EXPECT_EQ(spm->model_name(), "llama");
  EXPECT_EQ(spm->n_vocab(), 32000);
  EXPECT_EQ(spm->bos_id(), 1);
  EXPECT_EQ(spm->eos_id(), 2);
  EXPECT_TRUE(spm->add_bos_by_default());
  EXPECT_EQ(spm->encode("Hello", true, false).front(), 1);

  const auto gpt2 = load_vocab("ggml-vocab-gpt-2");
  EXPECT_EQ(gpt2->model_name(), "gpt2");
  EXPECT_EQ(gpt2->pre_tokenizer_name(), "gpt-2");
  EXPECT_FALSE(gpt2->add_bos_by_default());
  EXPECT_EQ(gpt2->find_token("Hello"), 15496);
  EXPECT_EQ(gpt2->find_token("no such token here"), std::nullopt);
}

TEST(Tokenizer, EndOfGeneration) {
  for (const char* name :
       {"ggml-vocab-llama-spm", "ggml-vocab-gpt-2", "ggml-vocab-starcoder", "ggml-vocab-llama-bpe"}) {
    SCOPED_TRACE(name);
    const auto tok = load_vocab(name);
    ASSERT_GE(tok->eos_id(), 0);
    EXPECT_TRUE(tok->is_end_of_generation(tok->eos_id()));
    EXPECT_FALSE(tok->is_end_of_generation(*tok->find_token(tok->model_name() == "llama" ? "▁the" : "the")));
  }
  // Llama 3's end of turn is not its EOS but still ends generation.
  const auto llama3 = load_vocab("ggml-vocab-llama-bpe");
  EXPECT_TRUE(llama3->is_end_of_generation(*llama3->find_token("<|eot_id|>")));
  EXPECT_FALSE(llama3->is_end_of_generation(*llama3->find_token("<|start_header_id|>")));
}

// ---------------------------------------------------------------------------------------------
// Special tokens

TEST(Tokenizer, SpecialTokensAreParsedOnlyWhenAsked) {
  const auto tok = load_vocab("ggml-vocab-starcoder");
  const int32_t fim = *tok->find_token("<fim_prefix>");
  const std::string text = "<fim_prefix>user";

  const auto parsed = tok->encode(text, false, true);
  ASSERT_GE(parsed.size(), 2u);
  EXPECT_EQ(parsed[0], fim);
  EXPECT_EQ(std::vector<int32_t>(parsed.begin() + 1, parsed.end()), tok->encode("user", false, false));

  const auto plain = tok->encode(text, false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), fim), 0);
  EXPECT_GT(plain.size(), 2u);
  EXPECT_EQ(tok->decode(plain), text);

  // Control tokens render only on request.
  EXPECT_EQ(tok->token_to_piece(fim), "");
  EXPECT_EQ(tok->token_to_piece(fim, true), "<fim_prefix>");
  EXPECT_EQ(tok->decode(parsed), "user");
  EXPECT_EQ(tok->decode(parsed, true), text);
}

TEST(Tokenizer, SpecialTokensBetweenTextAndLongestFirst) {
  const auto tok = load_vocab("ggml-vocab-llama-bpe");
  const int32_t start = *tok->find_token("<|start_header_id|>");
  const int32_t end = *tok->find_token("<|end_header_id|>");
  const int32_t eot = *tok->find_token("<|eot_id|>");
  const auto ids = tok->encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", true, true);
  const auto user = tok->encode("user", false, false);
  const auto body = tok->encode("\n\nHi", false, false);
  std::vector<int32_t> want = {tok->bos_id(), start};
  want.insert(want.end(), user.begin(), user.end());
  want.push_back(end);
  want.insert(want.end(), body.begin(), body.end());
  want.push_back(eot);
  EXPECT_EQ(ids, want);
}

TEST(Tokenizer, SentencePieceSpacePrefixAfterSpecialToken) {
  // llama.cpp puts the "▁" prefix back after each special token.
  const auto tok = load_vocab("ggml-vocab-llama-spm");
  const auto ids = tok->encode("Hello</s>Hello", false, true);
  const auto hello = tok->encode("Hello", false, false);
  std::vector<int32_t> want = hello;
  want.push_back(2);
  want.insert(want.end(), hello.begin(), hello.end());
  EXPECT_EQ(ids, want);
  EXPECT_EQ(tok->token_to_piece(hello[0]), " Hello");
  EXPECT_EQ(tok->decode(hello), "Hello");
}

TEST(Tokenizer, ByteFallbackAndInvalidUtf8) {
  // Text that is not UTF-8 (a stray continuation byte, a truncated sequence) still tokenizes,
  // byte by byte, and decodes to itself.
  const std::string bytes = {'a', '\x80', 'b', '\xE2', '\x82', 'c', '\xC3'};
  for (const char* name :
       {"ggml-vocab-llama-spm", "ggml-vocab-gpt-2", "ggml-vocab-starcoder", "ggml-vocab-llama-bpe"}) {
    SCOPED_TRACE(name);
    const auto tok = load_vocab(name);
    EXPECT_EQ(tok->decode(tok->encode(bytes, false, false)), bytes);
  }
  // StarCoder's vocabulary has no token for bytes that never occur in UTF-8 (0xC0, 0xC1,
  // 0xF5-0xFF, ...): like llama.cpp, such bytes are dropped rather than failing.
  const auto starcoder = load_vocab("ggml-vocab-starcoder");
  EXPECT_EQ(starcoder->decode(starcoder->encode(std::string{'a', '\xFF', 'b'}, false, false)), "ab");
}

// ---------------------------------------------------------------------------------------------
// Metadata errors: GGUF images written by hand

// GGUF v3 with no tensors: magic, version, n_tensors, n_kv, then key/type/value entries.
class GgufImage {
 public:
  GgufImage& str(const std::string& key, const std::string& value) {
    this->key(key, 8);
    string(value);
    ++n_kv_;
    return *this;
  }
  GgufImage& u32(const std::string& key, uint32_t value) {
    this->key(key, 4);
    pod(value);
    ++n_kv_;
    return *this;
  }
  GgufImage& strings(const std::string& key, const std::vector<std::string>& values) {
    this->key(key, 9);
    pod(uint32_t{8});
    pod(static_cast<uint64_t>(values.size()));
    for (const auto& v : values) string(v);
    ++n_kv_;
    return *this;
  }
  GgufImage& floats(const std::string& key, const std::vector<float>& values) {
    this->key(key, 9);
    pod(uint32_t{6});
    pod(static_cast<uint64_t>(values.size()));
    for (float v : values) pod(v);
    ++n_kv_;
    return *this;
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    auto put = [&](const auto& v) {
      const auto* p = reinterpret_cast<const uint8_t*>(&v);
      out.insert(out.end(), p, p + sizeof(v));
    };
    out.insert(out.end(), {'G', 'G', 'U', 'F'});
    put(uint32_t{3});
    put(uint64_t{0});
    put(n_kv_);
    out.insert(out.end(), body_.begin(), body_.end());
    return out;
  }

 private:
  template <typename T>
  void pod(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    body_.insert(body_.end(), p, p + sizeof(v));
  }
  void string(const std::string& s) {
    pod(static_cast<uint64_t>(s.size()));
    body_.insert(body_.end(), s.begin(), s.end());
  }
  void key(const std::string& k, uint32_t type) {
    string(k);
    pod(type);
  }
  std::vector<uint8_t> body_;
  uint64_t n_kv_ = 0;
};

// The message of the error from_gguf throws for this image ("" if it does not throw).
std::string load_error(const GgufImage& image) {
  const std::vector<uint8_t> bytes = image.bytes();
  const auto gguf = GgufFile::parse(bytes.data(), bytes.size(), "test.gguf");
  try {
    Tokenizer::from_gguf(*gguf);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

GgufImage tiny_bpe() {
  return GgufImage()
      .str("general.architecture", "llama")
      .str("tokenizer.ggml.model", "gpt2")
      .strings("tokenizer.ggml.tokens", {"a", "b", "ab", "Ġ", "Ġa"})
      .strings("tokenizer.ggml.merges", {"a b", "Ġ a"});
}

TEST(TokenizerErrors, MissingTokensNamesTheKey) {
  const GgufImage image =
      GgufImage().str("general.architecture", "llama").str("tokenizer.ggml.model", "gpt2");
  EXPECT_THAT(load_error(image), HasSubstr("'tokenizer.ggml.tokens' is missing"));
}

TEST(TokenizerErrors, BadMetadataNamesTheKey) {
  const std::vector<std::string> two = {"a", "b"};
  EXPECT_THAT(load_error(GgufImage().strings("tokenizer.ggml.tokens", two)),
              HasSubstr("'tokenizer.ggml.model' is missing"));
  EXPECT_THAT(
      load_error(GgufImage().str("tokenizer.ggml.model", "bert").strings("tokenizer.ggml.tokens", two)),
      HasSubstr("unsupported tokenizer.ggml.model 'bert'"));
  EXPECT_THAT(
      load_error(GgufImage().str("tokenizer.ggml.model", "gpt2").strings("tokenizer.ggml.tokens", two)),
      HasSubstr("'tokenizer.ggml.merges' is missing"));
  EXPECT_THAT(load_error(GgufImage()
                             .str("tokenizer.ggml.model", "gpt2")
                             .strings("tokenizer.ggml.tokens", two)
                             .strings("tokenizer.ggml.merges", {"a c"})),
              HasSubstr("tokenizer.ggml.merges'[0] 'a c': names 'c', which is not in tokenizer.ggml.tokens"));
  EXPECT_THAT(load_error(GgufImage()
                             .str("tokenizer.ggml.model", "llama")
                             .strings("tokenizer.ggml.tokens", two)
                             .floats("tokenizer.ggml.scores", {0.0f})),
              HasSubstr("'tokenizer.ggml.scores' has 1 values but tokenizer.ggml.tokens has 2"));
  EXPECT_THAT(load_error(tiny_bpe().u32("tokenizer.ggml.eos_token_id", 99)),
              HasSubstr("'tokenizer.ggml.eos_token_id' = 99 is outside the vocabulary of 5 tokens"));
  EXPECT_THAT(
      load_error(
          GgufImage().str("tokenizer.ggml.model", "llama").strings("tokenizer.ggml.tokens", {"a", "a"})),
      HasSubstr("token 'a' appears twice"));
}

TEST(TokenizerErrors, UnknownPreTokenizerFallsBackToDefault) {
  const std::vector<uint8_t> bytes = tiny_bpe().str("tokenizer.ggml.pre", "no-such-pre").bytes();
  const auto gguf = GgufFile::parse(bytes.data(), bytes.size(), "test.gguf");
  const auto tok = Tokenizer::from_gguf(*gguf);
  EXPECT_EQ(tok->pre_tokenizer_name(), "default");
  EXPECT_EQ(tok->encode("ab a", false, false), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->encode("a", true, false), (std::vector<int32_t>{0}));  // no BOS to add
}

TEST(Tokenizer, EveryKnownPreTokenizerNameLoads) {
  // Each name llama.cpp maps loads under its own name (no fallback to "default"), with the BOS
  // default llama.cpp gives it; the tiny vocabulary splits "ab a" the same way under all of them.
  for (const PreTokenizerSpec& spec : known_pre_tokenizers()) {
    const std::string name(spec.name);
    SCOPED_TRACE(name);
    const std::vector<uint8_t> bytes =
        tiny_bpe().str("tokenizer.ggml.pre", name).u32("tokenizer.ggml.bos_token_id", 0).bytes();
    const auto gguf = GgufFile::parse(bytes.data(), bytes.size(), "test.gguf");
    const auto tok = Tokenizer::from_gguf(*gguf);
    EXPECT_EQ(tok->pre_tokenizer_name(), name);
    EXPECT_EQ(tok->add_bos_by_default(), spec.add_bos);
    EXPECT_EQ(tok->encode("ab a", false, false), (std::vector<int32_t>{2, 4}));
  }
  for (const char* name : {"llama-bpe", "tekken", "chameleon"}) EXPECT_TRUE(find_pre_tokenizer(name)->add_bos);
  for (const char* name : {"deepseek-v3", "qwen2", "gpt-4o"}) EXPECT_FALSE(find_pre_tokenizer(name)->add_bos);
}

// gpt-oss's special tokens (o200k_harmony) on the tiny BPE vocabulary, as control tokens, as the
// GGUF converter writes them; EOS is <|return|> (its tokenizer_config's eos_token).
std::unique_ptr<Tokenizer> harmony_tokenizer(bool with_call) {
  std::vector<std::string> tokens = {"a",         "b",           "ab",          "\u0120",  "\u0120a",
                                     "<|endoftext|>", "<|return|>", "<|start|>", "<|channel|>", "<|message|>",
                                     "<|end|>",   "<|constrain|>"};
  if (with_call) tokens.push_back("<|call|>");
  std::vector<float> types(tokens.size(), 3.0f);  // control
  std::fill_n(types.begin(), 5, 1.0f);            // normal
  const std::vector<uint8_t> bytes = GgufImage()
                                         .str("tokenizer.ggml.model", "gpt2")
                                         .str("tokenizer.ggml.pre", "gpt-4o")
                                         .strings("tokenizer.ggml.tokens", tokens)
                                         .floats("tokenizer.ggml.token_type", types)
                                         .strings("tokenizer.ggml.merges", {"a b", "\u0120 a"})
                                         .u32("tokenizer.ggml.eos_token_id", 6)
                                         .bytes();
  const auto gguf = GgufFile::parse(bytes.data(), bytes.size(), "test.gguf");
  return Tokenizer::from_gguf(*gguf);
}

TEST(Tokenizer, HarmonyEndsAReplyAtReturnOrCallAndRendersTheMessageMarkers) {
  // As llama.cpp: with <|return|>, <|call|> and <|end|> all ending generation, <|end|> does not
  // (it ends the reasoning's message, not the reply), and the markers of a message are
  // user-defined tokens, rendered in generated text.
  const auto tok = harmony_tokenizer(/*with_call=*/true);
  const auto id = [&](std::string_view text) { return tok->find_token(text).value_or(-1); };
  EXPECT_TRUE(tok->is_end_of_generation(id("<|return|>")));
  EXPECT_TRUE(tok->is_end_of_generation(id("<|call|>")));
  EXPECT_TRUE(tok->is_end_of_generation(id("<|endoftext|>")));
  EXPECT_FALSE(tok->is_end_of_generation(id("<|end|>")));
  EXPECT_FALSE(tok->is_end_of_generation(id("<|channel|>")));
  for (std::string_view marker : {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"}) {
    SCOPED_TRACE(marker);
    EXPECT_EQ(tok->token_type(id(marker)), Tokenizer::TokenType::UserDefined);
    EXPECT_EQ(tok->token_to_piece(id(marker)), marker);
  }
  EXPECT_EQ(tok->token_to_piece(id("<|return|>")), "");
  const std::vector<int32_t> reply = {id("<|channel|>"), 0, id("<|message|>"), 1, id("<|end|>"), id("<|return|>")};
  EXPECT_EQ(tok->decode(reply), "<|channel|>a<|message|>b<|end|>");
  // User-defined tokens are cut out of any text, as llama.cpp does; control ones only when asked.
  EXPECT_EQ(tok->encode("ab<|channel|>a", false, /*parse_special=*/false),
            (std::vector<int32_t>{2, id("<|channel|>"), 0}));
  EXPECT_EQ(tok->encode("a<|return|>", false, /*parse_special=*/true), (std::vector<int32_t>{0, id("<|return|>")}));

  // Without <|call|> it is not harmony's vocabulary: <|end|> ends a turn (Phi-3's does) and
  // the other markers stay hidden control tokens.
  const auto other = harmony_tokenizer(/*with_call=*/false);
  EXPECT_TRUE(other->is_end_of_generation(*other->find_token("<|end|>")));
  EXPECT_EQ(other->token_to_piece(*other->find_token("<|channel|>")), "");
  EXPECT_EQ(other->token_type(*other->find_token("<|channel|>")), Tokenizer::TokenType::Control);
}

// ---------------------------------------------------------------------------------------------
// Streaming UTF-8

TEST(Utf8StreamDecoder, HoldsBackAnIncompleteSequence) {
  const std::string llama = "\xF0\x9F\xA6\x99";  // U+1F999, four bytes
  Utf8StreamDecoder d;
  EXPECT_EQ(d.push(std::string("a").append(llama, 0, 1)), "a");
  EXPECT_EQ(d.push(llama.substr(1, 2)), "");
  EXPECT_EQ(d.push(llama.substr(3) + "b"), llama + "b");
  EXPECT_EQ(d.flush(), "");
}

TEST(Utf8StreamDecoder, InvalidBytesBecomeReplacementCharacters) {
  const std::string fffd = "\xEF\xBF\xBD";
  Utf8StreamDecoder d;
  EXPECT_EQ(d.push("x\xFFy"), std::string("x").append(fffd).append("y"));  // never valid: replaced at once
  EXPECT_EQ(d.push("\xE2\x82"), "");                                       // a valid start of "€", held
  EXPECT_EQ(d.flush(), fffd);                                              // ...that never completes
  EXPECT_EQ(d.push("\xE2\x82z"), fffd + "z");             // broken by a non-continuation byte
  EXPECT_EQ(d.push("\xED\xA0\x80"), fffd + fffd + fffd);  // a UTF-16 surrogate is not UTF-8
  EXPECT_EQ(d.flush(), "");
}

TEST(Utf8StreamDecoder, TokenByTokenMatchesWholeDecode) {
  const auto tok = load_vocab("ggml-vocab-llama-bpe");
  const std::string text = "Emoji 🦙 and Khmer កាន់តែ, 我想在apple工作";
  std::string streamed;
  Utf8StreamDecoder d;
  for (int32_t id : tok->encode(text, false, false)) {
    const std::string out = d.push(tok->token_to_piece(id));
    streamed += out;
  }
  streamed += d.flush();
  EXPECT_EQ(streamed, text);
}

// ---------------------------------------------------------------------------------------------
// Real model and speed

TEST(Tokenizer, SmolLm2ChatPrompt) {
  ASSERT_TRUE(std::filesystem::exists(kSmolLm2)) << kSmolLm2 << " not present: run scripts/setup.sh";
  const auto gguf = GgufFile::open(kSmolLm2);
  const auto tok = Tokenizer::from_gguf(*gguf);
  EXPECT_EQ(tok->n_vocab(), 49152);
  EXPECT_EQ(tok->pre_tokenizer_name(), "smollm");
  EXPECT_FALSE(tok->add_bos_by_default());

  const int32_t im_start = *tok->find_token("<|im_start|>");
  const int32_t im_end = *tok->find_token("<|im_end|>");
  const int32_t nl = *tok->find_token("Ċ");  // "\n" in GPT-2 characters
  const std::vector<int32_t> want = {im_start, *tok->find_token("user"), nl, *tok->find_token("Hi"), im_end,
                                     nl};
  EXPECT_EQ(tok->encode("<|im_start|>user\nHi<|im_end|>\n", false, true), want);
  EXPECT_TRUE(tok->is_end_of_generation(im_end));
  EXPECT_TRUE(tok->is_end_of_generation(*tok->find_token("<|endoftext|>")));
  EXPECT_FALSE(tok->is_end_of_generation(im_start));
  // Digits are split one by one (starcoder/smollm pre-tokenizer).
  EXPECT_EQ(tok->encode("2024", false, false).size(), 4u);
}

TEST(Tokenizer, KjvRoundTripAndSpeed) {
  const std::string text = read_file(std::string(RINGLM_SHARED_DATA) + "/text/kjv-pentateuch.txt");
  for (const char* name : {"ggml-vocab-starcoder", "ggml-vocab-llama-bpe", "ggml-vocab-llama-spm"}) {
    SCOPED_TRACE(name);
    const auto tok = load_vocab(name);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok->encode(text, false, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s: %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n", name, text.size(), ids.size(), s,
                text.size() / s / 1e6);
    EXPECT_LT(s, 5.0);
    EXPECT_EQ(tok->decode(ids), text);
  }
}

}  // namespace
}  // namespace ringlm

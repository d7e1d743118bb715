#include "core/tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <string>

namespace ringlm {
namespace {

// The patterns are those of each model's Hugging Face tokenizer.json, under the names llama.cpp's
// llama-vocab.cpp gives them. Where llama.cpp had to rewrite a pattern for std::regex, the
// original is used instead when PCRE2 runs it as written; where PCRE2 cannot run the original,
// the rewrite is said next to it. Two rewrites apply everywhere:
// - Case-insensitive contractions are spelled out ('[sS]) rather than (?i:'s), as llama.cpp
//   does: with PCRE2_UCP, (?i) would also fold characters such as U+017F "ſ" into 's'.
// - Characters outside ASCII are written \x{...}: several of those in the classes (U+2126 OHM
//   SIGN, U+212A KELVIN SIGN, the Greek letters with tonos of U+1Fxx) are canonically equivalent
//   to other code points and turn into them when the text goes through NFC, which an editor or a
//   copy may do silently; the escapes keep the ranges exact.

// GPT-2. Hugging Face ends it with "|\s+", which changes nothing here: whitespace that no
// alternative takes becomes a piece of its own anyway.
constexpr std::string_view kGpt2 =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))re";

// Llama 3: contractions in any case, a letter run with one optional leading non-letter,
// numbers in groups of at most three digits, punctuation runs that keep trailing newlines.
constexpr std::string_view kLlama3 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Qwen 2 (and Qwen 3, whose files say "qwen2"): as Llama 3 but every digit on its own.
constexpr std::string_view kQwen2 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Qwen 3.5: as Qwen 2 with combining marks (\p{M}) kept in letter runs.
constexpr std::string_view kQwen35 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Qwen 2 without the contractions (Turkish suffixes after an apostrophe stay on their word).
constexpr std::string_view kUfakzeka =
    R"re([^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Jais 2: Llama 3 with whitespace runs cut into power-of-two lengths.
constexpr std::string_view kJais2 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1})re";

// Seed-Coder: single digits; punctuation runs stop before a newline.
constexpr std::string_view kSeedCoder =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// MiniCPM 5's second pattern: Llama 3 with unbounded digit runs (its first pattern cuts them).
constexpr std::string_view kMiniCpm5 =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// EXAONE MoE: letter runs go on across single spaces.
constexpr std::string_view kExaoneMoe =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+)re";

// Ling (BailingMoE) as written, possessive quantifiers included: PCRE2 has them, so llama.cpp's
// greedy rewrite (std::regex has none) is not needed.
constexpr std::string_view kBailingMoe =
    R"re('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)re";

// GPT-4o (o200k): words split at case changes, optional contraction after a word, numbers in
// groups of three. llama.cpp rewrites the letter classes with lookaheads over [^a-z] / [^A-Z]
// for std::regex, which treats non-ASCII letters and marks differently; PCRE2 runs the
// original \p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M} classes.
constexpr std::string_view kGpt4o =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Tekken (Mistral NeMo): GPT-4o's word classes, no contractions, single digits. Original form,
// as for GPT-4o.
constexpr std::string_view kTekken =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Youtu: GPT-4o's word classes with single digits, after a first pass that isolates Hangul,
// CJK punctuation, Bopomofo and Han/kana runs.
constexpr std::string_view kYoutuCjk =
    R"re([\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)re";
constexpr std::string_view kYoutu =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Kimi K2 (tiktoken): GPT-4o's word classes with Han taken out of them and Han runs first. The
// original intersects classes ([\p{Lu}...&&[^\p{Han}]]), which PCRE2 10.42 cannot; each class
// becomes a negative lookahead on one character, (?:(?!\p{Han})[\p{Lu}...]), the same set.
// \p{Han} is PCRE2's Script_Extensions match (so "、" and "。" count as Han), as the Rust regex
// crate under tiktoken reads a bare script name. llama.cpp runs a hand-written matcher instead.
constexpr std::string_view kKimiK2 =
    R"re(\p{Han}+|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// DeepSeek V3 (and Hunyuan dense, JoyAI, HY v4): digit groups of three, Han/kana runs, then
// words that may start with one ASCII punctuation character.
constexpr std::string_view kDigits1To3 = R"re(\p{N}{1,3})re";
constexpr std::string_view kHanKana = R"re([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)re";
constexpr std::string_view kDeepseek3Words =
    R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
// Spark 2.5: as DeepSeek V3 but punctuation runs and newlines alone, then single digits.
constexpr std::string_view kSparkWords =
    R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+)re";

// DeepSeek LLM / Coder: newlines alone first; CJK (with everything from U+0800 to U+4E00) and
// Hangul runs.
constexpr std::string_view kNewline = R"re([\r\n])re";
constexpr std::string_view kDeepseekCjk = R"re([\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+)re";
// DeepSeek LLM's words: an optional whitespace and a run of cased letters (Latin, Greek,
// Cyrillic, Armenian, Georgian, Cherokee, letterlike symbols, fullwidth Latin, Deseret, ...),
// the ranges as the tokenizer lists them.
constexpr std::string_view kDeepseekLetters =
    R"re(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF})re"
    R"re(\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1})re"
    R"re(\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5})re"
    R"re(\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A})re"
    R"re(\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B})re"
    R"re(\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC})re"
    R"re(\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107})re"
    R"re(\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134})re"
    R"re(\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4})re"
    R"re(\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787})re"
    R"re(\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A})re"
    R"re(\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2})re"
    R"re(\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)re";
// ASCII, fullwidth and CJK punctuation runs.
constexpr std::string_view kDeepseekPunct =
    R"re(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)re";
// Whitespace at the end of a piece. `$` also matches before a final "\n", but newlines are
// pieces of their own by then.
constexpr std::string_view kTrailingSpace = R"re(\s+$)re";

// AFMoE (Arcee Trinity). Its digit rule splits a digit run into groups of three from the right
// (1234567 -> 1|234|567); llama.cpp implements it by hand under the placeholder
// \p{AFMoE_digits}, written here as the regex that does the same. The script runs that follow
// are written as the Unicode blocks llama.cpp's literal characters open: CJK ideographs,
// extension A, compatibility ideographs, kana, halfwidth katakana, Kangxi radicals, Thai, Lao,
// Khmer, Myanmar (and its extensions), Hangul syllables and jamo.
constexpr std::string_view kAfmoeDigits = R"re(\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N})))re";
constexpr std::string_view kAfmoeScripts =
    R"re([\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{F900}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}\x{FF65}-\x{FF9F})re"
    R"re(\x{2F00}-\x{2FDF}\x{0E00}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}\x{AA60}-\x{AA7F})re"
    R"re(\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+)re";

// Tiny Aya: digit runs in groups of three from the right, as its tokenizer.json writes it (\b:
// a run that goes on into letters is not cut). llama.cpp replaces it with AFMoE's hand-written
// digit rule, which also cuts such runs.
constexpr std::string_view kTinyAyaDigits = R"re(\d{1,3}(?=(?:\d{3})*\b))re";

// BLOOM, Poro, GPT-3 Finnish, Viking: a run of anything but whitespace and sentence punctuation
// (the parentheses and "|" are part of the class, as in the original).
constexpr std::string_view kBloom =
    R"re( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+)re";

constexpr std::string_view kEachDigit = R"re(\p{N})re";
constexpr std::string_view kDigitRuns = R"re(\p{N}+)re";

constexpr std::array kDefaultPatterns = {std::string_view(R"re([\p{P}\$\+<=>\^~\|]+)re"), kGpt2, kDigitRuns,
                                         std::string_view(R"re([0-9][0-9][0-9])re")};
constexpr std::array kGpt2Patterns = {kGpt2};
// StarCoder and the vocabularies that reuse its rules: digits first split one by one.
constexpr std::array kStarcoderPatterns = {kEachDigit, kGpt2};
constexpr std::array kLlama3Patterns = {kLlama3};
constexpr std::array kQwen2Patterns = {kQwen2};
constexpr std::array kQwen35Patterns = {kQwen35};
constexpr std::array kUfakzekaPatterns = {kUfakzeka};
constexpr std::array kJais2Patterns = {kJais2};
constexpr std::array kSeedCoderPatterns = {kSeedCoder};
constexpr std::array kMiniCpm5Patterns = {kDigits1To3, kMiniCpm5};
constexpr std::array kExaoneMoePatterns = {kExaoneMoe};
constexpr std::array kBailingMoePatterns = {kBailingMoe};
constexpr std::array kGpt4oPatterns = {kGpt4o};
constexpr std::array kTinyAyaPatterns = {kTinyAyaDigits, kGpt4o};
constexpr std::array kTekkenPatterns = {kTekken};
constexpr std::array kYoutuPatterns = {kYoutuCjk, kYoutu};
constexpr std::array kKimiK2Patterns = {kKimiK2};
constexpr std::array kDeepseek3Patterns = {kDigits1To3, kHanKana, kDeepseek3Words};
constexpr std::array kSparkPatterns = {kDigits1To3, kHanKana, kSparkWords, kEachDigit};
constexpr std::array kDeepseekLlmPatterns = {kNewline,       kDeepseekLetters, kDeepseekPunct,
                                             kTrailingSpace, kDeepseekCjk,     kDigitRuns};
constexpr std::array kDeepseekCoderPatterns = {kNewline, std::string_view(R"re(\s?\p{L}+)re"),
                                               std::string_view(R"re(\s?\p{P}+)re"), kDeepseekCjk, kEachDigit};
constexpr std::array kAfmoePatterns = {kAfmoeDigits, kAfmoeScripts, kDeepseek3Words};
constexpr std::array kFalconPatterns = {std::string_view(R"re([\p{P}\$\+<=>\^~\|`]+)re"), kGpt2,
                                        std::string_view(R"re([0-9][0-9][0-9])re")};
constexpr std::array kBloomPatterns = {kBloom};
constexpr std::array kVikingPatterns = {kBloom, kEachDigit};
// Chameleon: sentinel and image tokens, tabs/newlines and double or quadruple spaces, single
// digits, single punctuation characters, then GPT-2.
constexpr std::array kChameleonPatterns = {
    std::string_view(R"re(<sentinel:[0-9]+>)re"), std::string_view(R"re((IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z)re"),
    std::string_view(R"re(([\t\n]|    |  ))re"),  kEachDigit,
    std::string_view(R"re([\p{P}!-/:-@\[-`{-~])re"), kGpt2};
// SuperBPE: digit runs, then cut into groups of three from the right by an empty match (the
// pattern is a lookahead only; see PreTokenizer::split).
constexpr std::array kSuperBpePatterns = {kDigitRuns, std::string_view(R"re((?=(\d{3})+(?!\d)))re")};
// Laguna: lines and newline runs apart, then Qwen 2.
constexpr std::array kLagunaPatterns = {std::string_view(R"re([^\n]+|[\n]+)re"), kQwen2};

// Named for brevity in the table: {name, patterns, ignore_merges, add_bos}.
constexpr bool kIgnoreMerges = true;
constexpr bool kAddBos = true;

// Every name llama.cpp maps for a gpt2-type (byte-level BPE) vocabulary, with its flags; the
// ones that only change llama.cpp's detokenizer (clean_spaces) or add a BERT separator
// (add_sep) need nothing here. Not here: the pre-tokenizers that run BPE on raw UTF-8 with
// spaces written as U+2581 instead of GPT-2's byte characters (gemma4, sarvam-moe,
// granite-embed-multi-311m) or split on whitespace alone (whitespace): their vocabularies are
// not byte-level BPE, so a regex table cannot make them right.
constexpr PreTokenizerSpec kSpecs[] = {
    {"default", kDefaultPatterns},
    // Llama 3 and the vocabularies that reuse its pre-tokenizer (BOS by default).
    {"llama3", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"llama-v3", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"llama-bpe", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"falcon3", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"falcon-h1", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"pixtral", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"midm-2.0", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"lfm2", kLlama3Patterns, kIgnoreMerges, kAddBos},
    {"jina-v5-nano", kLlama3Patterns, kIgnoreMerges, kAddBos},
    // Llama 3's regex without its flags. ChatGLM / GLM-4 also has no BOS by default, which is
    // ringlm's default for every BPE vocabulary.
    {"dbrx", kLlama3Patterns},
    {"smaug-bpe", kLlama3Patterns},
    {"glm4", kLlama3Patterns},
    {"chatglm-bpe", kLlama3Patterns},
    {"minicpm5", kMiniCpm5Patterns, kIgnoreMerges},
    {"jais-2", kJais2Patterns},
    // GPT-2's regex alone.
    {"gpt-2", kGpt2Patterns},
    {"phi-2", kGpt2Patterns},
    {"mpt", kGpt2Patterns},
    {"olmo", kGpt2Patterns},
    {"jais", kGpt2Patterns},
    {"trillion", kGpt2Patterns},
    {"granite-docling", kGpt2Patterns},
    {"exaone4", kGpt2Patterns},
    {"jina-es", kGpt2Patterns},
    {"jina-de", kGpt2Patterns},
    {"jina-v2-es", kGpt2Patterns},
    {"jina-v2-de", kGpt2Patterns},
    {"jina-v1-en", kGpt2Patterns},
    {"jina-v2-code", kGpt2Patterns},
    {"roberta-bpe", kGpt2Patterns},
    {"gigachat", kGpt2Patterns},
    {"a.x-4.0", kGpt2Patterns},
    {"mellum", kGpt2Patterns},
    {"modern-bert", kGpt2Patterns},
    // Single digits, then GPT-2.
    {"starcoder", kStarcoderPatterns},
    {"refact", kStarcoderPatterns},
    {"command-r", kStarcoderPatterns},
    {"smollm", kStarcoderPatterns},
    {"codeshell", kStarcoderPatterns},
    {"exaone", kStarcoderPatterns},
    {"minerva-7b", kStarcoderPatterns},
    {"mellum2", kStarcoderPatterns},
    {"falcon", kFalconPatterns},
    // Qwen 2's regex.
    {"qwen2", kQwen2Patterns},
    {"deepseek-r1-qwen", kQwen2Patterns},
    {"kormo", kQwen2Patterns},
    {"f2llmv2", kQwen2Patterns},
    {"megrez", kQwen2Patterns},
    {"stablelm2", kQwen2Patterns},
    {"hunyuan", kQwen2Patterns},
    {"solar-open", kQwen2Patterns},
    {"grok-2", kQwen2Patterns},
    {"qwen35", kQwen35Patterns},
    {"ufakzeka", kUfakzekaPatterns},
    {"seed-coder", kSeedCoderPatterns},
    {"laguna", kLagunaPatterns},
    {"exaone-moe", kExaoneMoePatterns},
    {"bailingmoe", kBailingMoePatterns},
    {"bailingmoe2", kBailingMoePatterns},
    {"llada-moe", kBailingMoePatterns},
    // DeepSeek and the vocabularies that reuse DeepSeek V3's rules.
    {"deepseek-llm", kDeepseekLlmPatterns},
    {"deepseek-coder", kDeepseekCoderPatterns},
    {"deepseek-v3", kDeepseek3Patterns},
    {"hunyuan-dense", kDeepseek3Patterns},
    {"joyai-llm", kDeepseek3Patterns},
    {"hy_v4", kDeepseek3Patterns},
    {"spark2_5", kSparkPatterns},
    {"afmoe", kAfmoePatterns},
    // Case-aware word splitting (GPT-4o and its relatives).
    {"gpt-4o", kGpt4oPatterns},
    {"llama4", kGpt4oPatterns},
    {"kanana2", kGpt4oPatterns},
    {"talkie", kGpt4oPatterns},
    {"minimax-m2", kGpt4oPatterns},
    // llama.cpp adds \p{M} to its GPT-4o rewrite for this one; the original classes have it.
    {"granite-embed-multi-97m", kGpt4oPatterns, kIgnoreMerges},
    {"tiny_aya", kTinyAyaPatterns},
    {"cohere2moe", kTinyAyaPatterns},
    {"tekken", kTekkenPatterns, kIgnoreMerges, kAddBos},
    {"youtu", kYoutuPatterns, kIgnoreMerges},
    {"kimi-k2", kKimiK2Patterns},
    // The rest.
    {"poro-chat", kBloomPatterns},
    {"bloom", kBloomPatterns},
    {"gpt3-finnish", kBloomPatterns},
    {"viking", kVikingPatterns},
    {"chameleon", kChameleonPatterns, false, kAddBos},
    {"superbpe", kSuperBpePatterns},
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

// Appends the pieces of `text` under one pattern: matches and the stretches between them. An
// empty match cuts the stretch it falls in; the search then goes on from the same place for a
// match that is not empty there (PCRE2_NOTEMPTY_ATSTART), as Python's re.finditer does.
void split_one(const pcre2_code* code, pcre2_match_data* md, std::string_view text,
               std::vector<std::string_view>& out) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t gap_begin = 0;  // start of text not yet emitted
  size_t start = 0;      // where the next match may begin
  uint32_t options = 0;
  while (start < text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), start, options, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error("tokenizer: regex match failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0], end = ov[1];
    if (begin > gap_begin) out.push_back(text.substr(gap_begin, begin - gap_begin));
    if (end > begin) out.push_back(text.substr(begin, end - begin));
    gap_begin = start = end;
    options = end == begin ? PCRE2_NOTEMPTY_ATSTART : 0;
  }
  if (gap_begin < text.size()) out.push_back(text.substr(gap_begin));
}

}  // namespace

const PreTokenizerSpec* find_pre_tokenizer(std::string_view name) {
  for (const PreTokenizerSpec& s : kSpecs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

const PreTokenizerSpec& default_pre_tokenizer() { return kSpecs[0]; }

std::span<const PreTokenizerSpec> known_pre_tokenizers() { return kSpecs; }

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

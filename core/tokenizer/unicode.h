// UTF-8 and GPT-2 byte-mapping helpers for the tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ringlm::unicode {

// Length of the UTF-8 sequence a lead byte announces; 1 for ASCII and for bytes that cannot
// start a sequence, so that walking a string by this length always advances.
size_t sequence_length(uint8_t lead);

// How many bytes SentencePiece (and llama.cpp) take as one character: decided by the lead
// byte's top bits alone, without validating what follows. Only matters for invalid UTF-8,
// where it keeps the split of the bytes identical to llama.cpp's.
inline size_t lead_length(uint8_t lead) {
  static constexpr uint8_t kByTopBits[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kByTopBits[lead >> 4];
}

// Appends the UTF-8 encoding of a code point (assumed <= 0x10FFFF).
void append_utf8(std::string& out, uint32_t cp);

// What the bytes at the start of `s` are.
enum class SequenceStatus {
  Complete,    // a valid sequence of `length` bytes
  Incomplete,  // a valid beginning of a sequence that runs past the end of `s`
  Invalid,     // `length` bytes (the maximal invalid subpart, >= 1) that can never be valid
};
struct Sequence {
  SequenceStatus status;
  size_t length;
};
Sequence check_sequence(std::string_view s);

// Decodes one code point at `pos` and advances `pos`; an invalid byte decodes as itself
// (a code point < 256) and advances by one.
uint32_t next_code_point(std::string_view s, size_t& pos);

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
inline constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581 "▁"

// GPT-2's reversible byte <-> printable character map: printable Latin-1 bytes map to
// themselves, the other 68 bytes to U+0100.. in byte order (so ' ' becomes 'Ġ').
uint32_t gpt2_byte_to_code_point(uint8_t byte);
// The byte a code point stands for, or -1 when it is not one of the 256 mapped characters.
int gpt2_code_point_to_byte(uint32_t cp);

}  // namespace ringlm::unicode

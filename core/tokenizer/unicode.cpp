#include "core/tokenizer/unicode.h"

#include <array>

namespace ringlm::unicode {

size_t sequence_length(uint8_t lead) {
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  return 1;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

Sequence check_sequence(std::string_view s) {
  const auto lead = static_cast<uint8_t>(s[0]);
  const size_t need = sequence_length(lead);
  if (need == 1) {
    return {lead < 0x80 ? SequenceStatus::Complete : SequenceStatus::Invalid, 1};
  }
  // The second byte's range is narrower after some leads: it rules out overlong forms
  // (E0, F0), UTF-16 surrogates (ED) and code points above U+10FFFF (F4).
  uint8_t lo = 0x80, hi = 0xBF;
  if (lead == 0xE0) lo = 0xA0;
  if (lead == 0xED) hi = 0x9F;
  if (lead == 0xF0) lo = 0x90;
  if (lead == 0xF4) hi = 0x8F;
  for (size_t i = 1; i < need; ++i) {
    if (i >= s.size()) return {SequenceStatus::Incomplete, i};
    const auto b = static_cast<uint8_t>(s[i]);
    if (b < lo || b > hi) return {SequenceStatus::Invalid, i};
    lo = 0x80;
    hi = 0xBF;
  }
  return {SequenceStatus::Complete, need};
}

uint32_t next_code_point(std::string_view s, size_t& pos) {
  const Sequence seq = check_sequence(s.substr(pos));
  const auto lead = static_cast<uint8_t>(s[pos]);
  if (seq.status != SequenceStatus::Complete) {
    pos += 1;
    return lead;
  }
  static constexpr uint8_t kLeadMask[5] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  uint32_t cp = lead & kLeadMask[seq.length];
  for (size_t i = 1; i < seq.length; ++i) cp = (cp << 6) | (static_cast<uint8_t>(s[pos + i]) & 0x3F);
  pos += seq.length;
  return cp;
}

namespace {

bool gpt2_keeps_byte(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct Gpt2Tables {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 512> to_byte{};  // every mapped code point is below 0x144

  Gpt2Tables() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      to_cp[b] = gpt2_keeps_byte(b) ? static_cast<uint32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const Gpt2Tables& gpt2_tables() {
  static const Gpt2Tables tables;
  return tables;
}

}  // namespace

uint32_t gpt2_byte_to_code_point(uint8_t byte) { return gpt2_tables().to_cp[byte]; }

int gpt2_code_point_to_byte(uint32_t cp) {
  return cp < gpt2_tables().to_byte.size() ? gpt2_tables().to_byte[cp] : -1;
}

}  // namespace ringlm::unicode

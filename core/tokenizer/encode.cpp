// Text -> token ids: special-token splitting, SentencePiece merging, byte-level BPE merging.
#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/unicode.h"

namespace ringlm {

// ---------------------------------------------------------------------------------------------
// Special tokens

// Cuts special tokens out of the text. Tokens are taken longest first, each over all the text
// still left (llama.cpp's order), so "<|im_start|>" is never read as "<|im" + "_start|>".
// Control and unknown tokens only count when parse_special; user-defined tokens always do,
// as in llama.cpp and Hugging Face.
std::vector<Tokenizer::Fragment> Tokenizer::split_special(std::string_view text, bool parse_special) const {
  std::vector<Fragment> frags{{text, -1}};
  std::vector<Fragment> next;
  for (const int32_t id : special_by_length_) {
    const TokenData& tok = tokens_[static_cast<size_t>(id)];
    if (!parse_special && tok.type != TokenType::UserDefined) continue;
    const std::string_view needle = tok.text;
    const bool present = std::any_of(frags.begin(), frags.end(), [&](const Fragment& f) {
      return f.token < 0 && f.text.find(needle) != std::string_view::npos;
    });
    if (!present) continue;

    next.clear();
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      std::string_view rest = f.text;
      for (size_t at; (at = rest.find(needle)) != std::string_view::npos;) {
        if (at > 0) next.push_back({rest.substr(0, at), -1});
        next.push_back({needle, id});
        rest.remove_prefix(at + needle.size());
      }
      if (!rest.empty()) next.push_back({rest, -1});
    }
    frags.swap(next);
  }
  return frags;
}

// ---------------------------------------------------------------------------------------------
// SentencePiece (score-based merging)

namespace {

struct SpmSymbol {
  uint32_t begin;  // byte offset in the chunk
  uint32_t len;    // 0 once merged into its left neighbour
  int32_t prev;    // neighbours in the chain of live symbols, -1 at the ends
  int32_t next;
};

struct SpmCandidate {
  float score;
  int32_t left;
  int32_t right;
  uint32_t len;  // left.len + right.len when queued; a mismatch later means it is stale
};

// Highest score first; among equal scores the leftmost pair, as SentencePiece does.
struct SpmLowerPriority {
  bool operator()(const SpmCandidate& a, const SpmCandidate& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

// Byte-level BPE working state.
struct BpeSymbol {
  int32_t id;    // current token; -1 for a byte without a token (it can never merge)
  int32_t prev;  // neighbours in the chain of live symbols, -1 at the ends
  int32_t next;
  bool alive;
};

struct BpeCandidate {
  int32_t rank;
  int32_t left;
  int32_t right;
  int32_t left_id;  // the pair as it was when queued; a mismatch later means it is stale
  int32_t right_id;
  int32_t result;
};

// Lowest rank first; among equal ranks the leftmost pair.
struct BpeLowerPriority {
  bool operator()(const BpeCandidate& a, const BpeCandidate& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

bool starts_with_space_marker(std::string_view text, size_t pos) {
  return text.compare(pos, unicode::kSpaceMarker.size(), unicode::kSpaceMarker) == 0;
}

}  // namespace

struct Tokenizer::Scratch {
  std::string escaped;  // SentencePiece: the fragment with spaces as "▁"
  std::vector<SpmSymbol> spm_syms;
  std::vector<SpmCandidate> spm_heap;
  std::vector<std::string_view> pieces;  // BPE: pre-tokenizer output
  std::vector<BpeSymbol> bpe_syms;
  std::vector<BpeCandidate> bpe_heap;
  std::string encoded;  // BPE: a piece in GPT-2 characters, for whole-piece lookups
};

void Tokenizer::encode_spm(std::string_view fragment, bool space_prefix, Scratch& scratch,
                           std::vector<int32_t>& out) const {
  std::string& text = scratch.escaped;
  text.clear();
  if (space_prefix) text += unicode::kSpaceMarker;
  for (char c : fragment) {
    if (c == ' ') {
      text += unicode::kSpaceMarker;
    } else {
      text += c;
    }
  }
  if (!spm_words_independent_) {
    merge_spm_chunk(text, scratch, out);
    return;
  }
  // Cut before each "▁" that follows another character; runs of "▁" stay together. The walk
  // steps by character exactly as merge_spm_chunk does, so cuts fall between its symbols.
  size_t begin = 0;
  bool prev_is_space = true;
  for (size_t pos = 0; pos < text.size();) {
    const bool is_space = starts_with_space_marker(text, pos);
    if (is_space && !prev_is_space) {
      merge_spm_chunk(std::string_view(text).substr(begin, pos - begin), scratch, out);
      begin = pos;
    }
    prev_is_space = is_space;
    pos += unicode::lead_length(static_cast<uint8_t>(text[pos]));
  }
  merge_spm_chunk(std::string_view(text).substr(begin), scratch, out);
}

void Tokenizer::merge_spm_chunk(std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const {
  if (text.size() > INT32_MAX) throw std::length_error("tokenizer: text fragment longer than 2 GiB");
  // Start from single characters.
  auto& syms = scratch.spm_syms;
  syms.clear();
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = std::min(unicode::lead_length(static_cast<uint8_t>(text[pos])), text.size() - pos);
    const auto idx = static_cast<int32_t>(syms.size());
    syms.push_back({static_cast<uint32_t>(pos), static_cast<uint32_t>(n), idx - 1,
                    pos + n < text.size() ? idx + 1 : -1});
    pos += n;
  }

  auto& heap = scratch.spm_heap;
  heap.clear();
  const SpmLowerPriority lower;
  auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const SpmSymbol& l = syms[static_cast<size_t>(left)];
    const SpmSymbol& r = syms[static_cast<size_t>(right)];
    const int32_t id = lookup(text.substr(l.begin, l.len + r.len));
    if (id < 0) return;
    heap.push_back({tokens_[static_cast<size_t>(id)].score, left, right, l.len + r.len});
    std::push_heap(heap.begin(), heap.end(), lower);
  };
  for (size_t i = 1; i < syms.size(); ++i) try_pair(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));

  // Repeatedly merge the best-scoring adjacent pair that forms a token.
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    const SpmCandidate c = heap.back();
    heap.pop_back();
    SpmSymbol& l = syms[static_cast<size_t>(c.left)];
    SpmSymbol& r = syms[static_cast<size_t>(c.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != c.len) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.left;
    try_pair(l.prev, c.left);
    try_pair(c.left, l.next);
  }

  // Every merged symbol is a token; a single character that is not falls back to bytes.
  for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
    const SpmSymbol& s = syms[static_cast<size_t>(i)];
    const std::string_view piece = text.substr(s.begin, s.len);
    if (const int32_t id = lookup(piece); id >= 0) {
      out.push_back(id);
      continue;
    }
    for (char b : piece) {
      const int32_t id = spm_byte_token_[static_cast<uint8_t>(b)];
      if (id >= 0) out.push_back(id);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE (rank-based merging)

void Tokenizer::encode_bpe(std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const {
  pre_->split(text, scratch.pieces);
  for (std::string_view piece : scratch.pieces) merge_bpe_word(piece, scratch, out);
}

void Tokenizer::merge_bpe_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    if (const int32_t id = bpe_byte_token_[static_cast<uint8_t>(word[0])]; id >= 0) out.push_back(id);
    return;
  }
  if (ignore_merges_) {
    scratch.encoded.clear();
    for (char b : word) {
      unicode::append_utf8(scratch.encoded, unicode::gpt2_byte_to_code_point(static_cast<uint8_t>(b)));
    }
    if (const int32_t id = lookup(scratch.encoded); id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // One symbol per byte (each byte is one GPT-2 character).
  if (word.size() > INT32_MAX) throw std::length_error("tokenizer: pre-tokenized piece longer than 2 GiB");
  auto& syms = scratch.bpe_syms;
  syms.clear();
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i) {
    syms.push_back({bpe_byte_token_[static_cast<uint8_t>(word[static_cast<size_t>(i)])], i - 1,
                    i + 1 < n ? i + 1 : -1, true});
  }

  auto& heap = scratch.bpe_heap;
  heap.clear();
  const BpeLowerPriority lower;
  auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t a = syms[static_cast<size_t>(left)].id;
    const int32_t b = syms[static_cast<size_t>(right)].id;
    if (a < 0 || b < 0) return;
    const auto it = merges_.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, left, right, a, b, it->second.result});
    std::push_heap(heap.begin(), heap.end(), lower);
  };
  for (int32_t i = 1; i < n; ++i) try_pair(i - 1, i);

  // Repeatedly apply the lowest-ranked merge present in the word.
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    const BpeCandidate c = heap.back();
    heap.pop_back();
    BpeSymbol& l = syms[static_cast<size_t>(c.left)];
    BpeSymbol& r = syms[static_cast<size_t>(c.right)];
    if (!l.alive || !r.alive || l.next != c.right || l.id != c.left_id || r.id != c.right_id) {
      continue;  // stale: one side has merged with something else since
    }
    l.id = c.result;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.left;
    try_pair(l.prev, c.left);
    try_pair(c.left, l.next);
  }

  for (int32_t i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
    if (syms[static_cast<size_t>(i)].id >= 0) out.push_back(syms[static_cast<size_t>(i)].id);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry point

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  // With no BOS in the vocabulary there is nothing to prepend; that is not an error.
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  if (text.empty()) return out;

  Scratch scratch;
  // SentencePiece puts a space in front of the text, and again after each special token,
  // because its tokens carry their leading space ("▁Hello").
  bool after_special = true;
  for (const Fragment& f : split_special(text, parse_special)) {
    if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else if (kind_ == Kind::Spm) {
      encode_spm(f.text, add_space_prefix_ && after_special, scratch, out);
      after_special = false;
    } else {
      encode_bpe(f.text, scratch, out);
      after_special = false;
    }
  }
  return out;
}

}  // namespace ringlm

// Chat formats, recognised by their markers and written out here (see chat_template.h).
//
// Each format writes exactly what its model's own Jinja template renders with HF's settings
// (trim_blocks, lstrip_blocks, add_generation_prompt), except for the deliberate differences
// noted at the format: tests/reference/check_chat_templates.py renders the real templates with
// jinja2 and compares.
#include "core/session/chat_template.h"

#include "core/session/chat_text.h"

#include <algorithm>
#include <array>
#include <ctime>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace ringlm {
namespace {

// Indexed by ChatFormat.
constexpr std::array<std::string_view, 8> kFormatNames = {"chatml", "llama2",  "llama3", "gemma",
                                                          "phi3",   "mistral", "zephyr", "harmony"};

bool contains(std::string_view text, std::string_view marker) { return text.find(marker) != std::string_view::npos; }

// --- Python's str.strip() -------------------------------------------------------------------
// Templates trim with Jinja's `trim` filter or str.strip(), both Python's strip(): it removes
// Unicode whitespace (NBSP, ideographic space, ...), not only ASCII. Bytes that are not valid
// UTF-8 are never whitespace, so they stop the trim (Python could not hold them in a str).

// The characters for which Python's str.isspace() is true.
bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Length of the well-formed UTF-8 sequence at `pos` (setting `code_point`), 0 if there is none.
size_t decode_utf8(std::string_view text, size_t pos, char32_t& code_point) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) {
    code_point = lead;
    return 1;
  }
  size_t length;
  char32_t minimum;
  if ((lead & 0xE0) == 0xC0) {
    length = 2, minimum = 0x80, code_point = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, minimum = 0x800, code_point = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, minimum = 0x10000, code_point = lead & 0x07;
  } else {
    return 0;
  }
  if (pos + length > text.size()) return 0;
  for (size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return 0;
    code_point = (code_point << 6) | (byte(pos + i) & 0x3F);
  }
  const bool surrogate = code_point >= 0xD800 && code_point <= 0xDFFF;
  if (code_point < minimum || code_point > 0x10FFFF || surrogate) return 0;
  return length;
}

// Bytes of the whitespace character that starts at `pos`, 0 if none does.
size_t space_at(std::string_view text, size_t pos) {
  char32_t code_point;
  const size_t length = decode_utf8(text, pos, code_point);
  return length != 0 && is_python_space(code_point) ? length : 0;
}

// Bytes of the whitespace character that ends at `end`, 0 if none does.
size_t space_before(std::string_view text, size_t end) {
  for (size_t length = 1; length <= 4 && length <= end; ++length) {
    const unsigned char byte = static_cast<unsigned char>(text[end - length]);
    if ((byte & 0xC0) == 0x80) continue;  // a continuation byte: the character starts further back
    return space_at(text, end - length) == length ? length : 0;
  }
  return 0;
}

}  // namespace

namespace chat_text {

std::string_view python_strip(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end) {
    const size_t length = space_at(text, begin);
    if (length == 0) break;
    begin += length;
  }
  while (end > begin) {
    const size_t length = space_before(text, end);
    if (length == 0) break;
    end -= length;
  }
  return text.substr(begin, end - begin);
}

}  // namespace chat_text

namespace {

using namespace chat_text;

// --- Reading the template -------------------------------------------------------------------

std::optional<ChatFormat> format_by_markers(std::string_view source) {
  // Harmony's messages are "<|start|>role<|channel|>name<|message|>text<|end|>".
  if (contains(source, "<|channel|>") && contains(source, "<|message|>")) return ChatFormat::kHarmony;
  if (contains(source, "<|im_start|>")) return ChatFormat::kChatMl;
  if (contains(source, "<|start_header_id|>")) return ChatFormat::kLlama3;
  if (contains(source, "<start_of_turn>")) return ChatFormat::kGemma;
  if (contains(source, "[INST]")) return contains(source, "<<SYS>>") ? ChatFormat::kLlama2 : ChatFormat::kMistral;
  if (contains(source, "<|assistant|>")) {
    if (contains(source, "<|end|>")) return ChatFormat::kPhi3;
    if (contains(source, "<|user|>")) return ChatFormat::kZephyr;
  }
  return std::nullopt;
}

// The Jinja string escapes a literal system prompt may use (it has no quotes, see below).
std::string unescape_literal(std::string_view literal) {
  std::string text;
  text.reserve(literal.size());
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i] == '\\' && i + 1 < literal.size()) {
      const char next = literal[i + 1];
      if (next == 'n' || next == 't' || next == '\\') {
        text += next == 'n' ? '\n' : next == 't' ? '\t' : '\\';
        ++i;
        continue;
      }
    }
    text += literal[i];
  }
  return text;
}

// A ChatML template that writes a fixed system block when the conversation has none carries it
// as one literal: "<|im_start|>system\n" (a real newline or a "\n" escape) followed by plain
// text up to "<|im_end|>". Quotes, braces or '+' in between mean the block is assembled from
// variables or several strings (the branch that writes the caller's system message), not a
// literal, so that occurrence is passed over.
std::string literal_default_system(std::string_view source) {
  constexpr std::string_view kHead = "<|im_start|>system";
  constexpr std::string_view kEnd = "<|im_end|>";
  constexpr std::string_view kNotLiteral = "'\"{}+";
  constexpr size_t npos = std::string_view::npos;
  // The next "<|im_end|>" and the next non-literal character from the current occurrence on,
  // searched again only once an occurrence is past them: one pass over the text in all, however
  // many occurrences (the template text may be anything, megabytes long). 0: not searched yet.
  size_t end_at = 0, not_literal_at = 0;
  for (size_t head = source.find(kHead); head != npos; head = source.find(kHead, head + 1)) {
    size_t text_begin = head + kHead.size();
    if (source.substr(text_begin, 1) == "\n") {
      text_begin += 1;
    } else if (source.substr(text_begin, 2) == "\\n") {
      text_begin += 2;
    } else {
      continue;
    }
    if (end_at < text_begin) {
      end_at = source.find(kEnd, text_begin);
      if (end_at == npos) return "";  // no later occurrence can be closed either
    }
    if (not_literal_at < text_begin) not_literal_at = source.find_first_of(kNotLiteral, text_begin);
    if (not_literal_at < end_at) continue;
    return unescape_literal(source.substr(text_begin, end_at - text_begin));
  }
  return "";
}

// --- Writing --------------------------------------------------------------------------------

}  // namespace

namespace chat_text {

std::string concat(std::initializer_list<std::string_view> parts) {
  size_t size = 0;
  for (std::string_view part : parts) size += part.size();
  std::string text;
  text.reserve(size);
  for (std::string_view part : parts) text += part;
  return text;
}

// Formats without a system role get the system prompt in front of the first user message, as
// llama.cpp does.
std::string fold_system(std::string_view content, bool first, std::string_view system) {
  if (!first || system.empty()) return std::string(content);
  return concat({system, "\n\n", content});
}

std::string llama3_header(std::string_view role) {
  return concat({"<|start_header_id|>", role, "<|end_header_id|>\n\n"});
}

}  // namespace chat_text

namespace chat_text {

std::string harmony_system_block(std::string_view date, std::string_view reasoning_effort, bool tools) {
  return concat({"<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                 "Knowledge cutoff: 2024-06\nCurrent date: ",
                 date, "\n\nReasoning: ", reasoning_effort,
                 "\n\n"
                 "# Valid channels: analysis, commentary, final. Channel must be included for every message.",
                 tools ? "\nCalls to these tools must go to the commentary channel: 'functions'." : "", "<|end|>"});
}

}  // namespace chat_text

std::optional<ChatTemplate> ChatTemplate::detect(std::string_view template_source, const ChatSpecialTokens& special) {
  const std::optional<ChatFormat> format = format_by_markers(template_source);
  if (!format) return std::nullopt;
  ChatTemplate chat_template(*format, special);
  chat_template.read_variants(template_source);
  return chat_template;
}

void ChatTemplate::set_reasoning_effort(std::string effort) {
  if (effort != "low" && effort != "medium" && effort != "high") {
    throw std::invalid_argument("reasoning effort '" + effort + "': expected low, medium or high");
  }
  reasoning_effort_ = std::move(effort);
}

void ChatTemplate::read_variants(std::string_view source) {
  think_tags_ = format_ != ChatFormat::kHarmony && contains(source, "</think>");
  switch (format_) {
    case ChatFormat::kChatMl:
      default_system_ = literal_default_system(source);
      native_tools_ = contains(source, "<tool_call>");  // Qwen 2.5 and 3, Hermes
      break;
    case ChatFormat::kLlama3:
      llama3_dated_header_ = contains(source, "Cutting Knowledge Date");
      // Llama 3.1's and 3.2's: tool results come back as the "ipython" role.
      native_tools_ = llama3_dated_header_ && contains(source, "ipython");
      if (native_tools_) tool_syntax_ = ToolSyntax::kLlama3;
      break;
    case ChatFormat::kMistral:
      native_tools_ = contains(source, "[TOOL_CALLS]");  // v0.3, Nemo
      if (native_tools_) tool_syntax_ = ToolSyntax::kMistral;
      // The spacing of the strings the template joins around the message: '[INST] ' and
      // ' [/INST]' (v1), "[INST] " and "[/INST]" (v3), "[INST]" and "[/INST]" (Nemo), ' [INST] '
      // and ' ' before the reply (v0.1/v0.2 since 2024), eos_token + ' ' (v0.1 in 2023).
      mistral_space_after_inst_ = contains(source, "[INST] ");
      mistral_space_before_end_ = contains(source, " [/INST]");
      mistral_space_before_turns_ = contains(source, " [INST]");
      mistral_space_after_eos_ = contains(source, "eos_token + ' '") || contains(source, "eos_token + \" \"");
      break;
    default:
      break;
  }
}

ChatTemplate ChatTemplate::from_name(std::string_view name, const ChatSpecialTokens& special) {
  for (size_t i = 0; i < kFormatNames.size(); ++i) {
    if (kFormatNames[i] == name) return ChatTemplate(static_cast<ChatFormat>(i), special);
  }
  std::string known;
  for (std::string_view known_name : kFormatNames) known += concat({known.empty() ? "" : ", ", known_name});
  throw std::invalid_argument(concat({"unknown chat template '", name, "' (known: ", known, ")"}));
}

std::vector<std::string_view> ChatTemplate::names() { return {kFormatNames.begin(), kFormatNames.end()}; }

std::string ChatTemplate::harmony_date() const { return date_.empty() ? today() : date_; }

std::string ChatTemplate::today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[16];
  return std::string(text, std::strftime(text, sizeof(text), "%Y-%m-%d", &local));
}

std::string_view ChatTemplate::name() const { return kFormatNames[static_cast<size_t>(format_)]; }

bool ChatTemplate::starts_with_bos() const {
  switch (format_) {
    case ChatFormat::kLlama2:
    case ChatFormat::kLlama3:
    case ChatFormat::kGemma:
    case ChatFormat::kMistral:
      return true;
    default:
      return false;
  }
}

std::string ChatTemplate::conversation_start(std::string_view system) const {
  switch (format_) {
    case ChatFormat::kChatMl:
      return system.empty() ? "" : concat({"<|im_start|>system\n", system, "<|im_end|>\n"});
    case ChatFormat::kLlama3:
      // Llama 3.1 writes its dated system block even without a system message.
      if (llama3_dated_header_) {
        return concat({llama3_header("system"), kLlama3DatedHeader, python_strip(system), "<|eot_id|>"});
      }
      return system.empty() ? "" : concat({llama3_header("system"), python_strip(system), "<|eot_id|>"});
    case ChatFormat::kPhi3:
      return system.empty() ? "" : concat({"<|system|>\n", system, "<|end|>\n"});
    case ChatFormat::kZephyr:
      return system.empty() ? "" : concat({"<|system|>\n", system, special_.eos, "\n"});
    case ChatFormat::kHarmony: {
      const std::string system_block = harmony_system_block(harmony_date(), reasoning_effort_, /*tools=*/false);
      if (system.empty()) return system_block;
      return concat({system_block, "<|start|>developer<|message|># Instructions\n\n", system, "\n\n<|end|>"});
    }
    case ChatFormat::kLlama2:
    case ChatFormat::kGemma:
    case ChatFormat::kMistral:
      return "";  // the system prompt goes into the first user message
  }
  return "";
}

std::string ChatTemplate::user_turn(std::string_view content, bool first, std::string_view system) const {
  switch (format_) {
    case ChatFormat::kChatMl:
      return concat({"<|im_start|>user\n", content, "<|im_end|>\n<|im_start|>assistant\n"});
    case ChatFormat::kLlama3:
      return concat({llama3_header("user"), python_strip(content), "<|eot_id|>", llama3_header("assistant")});
    case ChatFormat::kGemma:
      // Gemma's template rejects a system message; folded in, it is trimmed with the message.
      return concat({"<start_of_turn>user\n", python_strip(fold_system(content, first, system)),
                     "<end_of_turn>\n<start_of_turn>model\n"});
    case ChatFormat::kPhi3:
      return concat({"<|user|>\n", content, "<|end|>\n<|assistant|>\n"});
    case ChatFormat::kZephyr:
      return concat({"<|user|>\n", content, special_.eos, "\n<|assistant|>\n"});
    case ChatFormat::kHarmony:
      return concat({"<|start|>user<|message|>", content, "<|end|><|start|>assistant"});
    case ChatFormat::kLlama2: {
      // Every user message starts with BOS; the first one's is the conversation's own (not
      // written here). The template strips the message with its <<SYS>> block as one text, so
      // the user message keeps its leading whitespace after the block.
      const std::string text =
          first && !system.empty() ? concat({"<<SYS>>\n", system, "\n<</SYS>>\n\n", content}) : std::string(content);
      return concat({first ? "" : special_.bos, "[INST] ", python_strip(text), " [/INST]"});
    }
    case ChatFormat::kMistral:
      // Mistral's templates put the system prompt in the first user message (v1) or the last
      // one (v3, Nemo). ringlm always uses the first: the conversation stays in the KV cache, and
      // a system prompt that moved to each new message would change text already evaluated.
      return concat({mistral_space_before_turns_ ? " " : "", "[INST]", mistral_space_after_inst_ ? " " : "",
                     fold_system(content, first, system), mistral_space_before_end_ ? " " : "", "[/INST]"});
  }
  return "";
}

std::string ChatTemplate::assistant_reply(std::string_view content) const {
  switch (format_) {
    case ChatFormat::kLlama3:
    case ChatFormat::kGemma:
      return concat({python_strip(content), reply_end()});
    case ChatFormat::kLlama2:
      return concat({" ", python_strip(content), reply_end()});
    case ChatFormat::kMistral:
      return concat({mistral_space_before_turns_ ? " " : "", content, reply_end()});
    case ChatFormat::kHarmony:
      // The template drops the reasoning of past replies and closes the final message with
      // <|end|> (the <|return|> the model ended it with is for the end of generation only).
      return concat({"<|channel|>final<|message|>", content, reply_end()});
    default:
      return concat({content, reply_end()});
  }
}

std::string ChatTemplate::reply_end() const {
  switch (format_) {
    case ChatFormat::kChatMl:
      return "<|im_end|>\n";
    case ChatFormat::kLlama3:
      return "<|eot_id|>";
    case ChatFormat::kGemma:
      return "<end_of_turn>\n";
    case ChatFormat::kPhi3:
      return "<|end|>\n";
    case ChatFormat::kZephyr:
      return special_.eos + "\n";
    case ChatFormat::kLlama2:
      return " " + special_.eos;
    case ChatFormat::kMistral:
      return mistral_space_after_eos_ ? special_.eos + " " : special_.eos;
    case ChatFormat::kHarmony:
      return "<|end|>";
  }
  return "";
}

std::string ChatTemplate::end_of_turn() const {
  switch (format_) {
    case ChatFormat::kChatMl:
      return "<|im_end|>";
    case ChatFormat::kLlama3:
      return "<|eot_id|>";
    case ChatFormat::kGemma:
      return "<end_of_turn>";
    case ChatFormat::kPhi3:
      return "<|end|>";
    case ChatFormat::kHarmony:
      return "<|return|>";
    case ChatFormat::kZephyr:
    case ChatFormat::kLlama2:
    case ChatFormat::kMistral:
      return special_.eos;
  }
  return "";
}

std::vector<std::string> ChatTemplate::end_markers() const {
  if (format_ == ChatFormat::kHarmony) return {end_of_turn(), "<|call|>"};
  return {end_of_turn()};
}

// An optional system message first, then user and assistant taking turns, user first; after an
// assistant message with tool calls, one or more tool messages (their results), then an
// assistant message again.
void ChatTemplate::check_roles(std::span<const ChatMessage> messages) const {
  const bool has_system = !messages.empty() && messages[0].role == "system";
  std::string_view expected = "user", also = "";
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role != expected && message.role != also) {
      throw std::invalid_argument(concat({"chat message ", std::to_string(i), " has role '", message.role, "' where '",
                                          expected, also.empty() ? "" : "' or '", also,
                                          "' was expected (an optional system message first, then user and "
                                          "assistant messages taking turns, starting with user; after an "
                                          "assistant's tool calls, their tool results)"}));
    }
    if (!message.tool_calls.empty() && message.role != "assistant") {
      throw std::invalid_argument(concat({"chat message ", std::to_string(i), " has tool calls but role '", message.role,
                                          "' (only an assistant message calls tools)"}));
    }
    if (message.role == "user") {
      expected = "assistant", also = "";
    } else if (message.role == "assistant") {
      expected = message.tool_calls.empty() ? "user" : "tool", also = "";
    } else {  // a tool result: more results, or the reply that reads them
      expected = "tool", also = "assistant";
    }
  }
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, std::span<const ToolDefinition> tools) const {
  check_roles(messages);
  const bool tool_messages = std::any_of(messages.begin(), messages.end(), [](const ChatMessage& m) {
    return m.role == "tool" || !m.tool_calls.empty();
  });
  if (!tools.empty() || tool_messages) return render_with_tools(messages, tools);
  const bool has_system = !messages.empty() && messages[0].role == "system";
  const std::string_view system = has_system ? std::string_view(messages[0].content) : std::string_view();
  std::string text = conversation_start(system);
  bool first_user = true;
  for (const ChatMessage& message : messages.subspan(has_system ? 1 : 0)) {
    if (message.role == "user") {
      text += user_turn(message.content, first_user, system);
      first_user = false;
    } else {
      text += assistant_reply(message.content);
    }
  }
  return text;
}

}  // namespace ringlm

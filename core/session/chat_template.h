// Chat templates: how a conversation is written out as the text a chat model was trained on.
//
// A GGUF carries its template as Jinja source (`tokenizer.chat_template`). ringlm does not run
// it: the template is only read to recognise which of the common formats it writes, by the
// markers that format uses (ChatML's <|im_start|>, Llama-3's <|start_header_id|>, ...). Each
// format is then rendered by the code below, so hostile template text can do nothing.
//
// Harmony (gpt-oss) also has a reply format of its own: the model writes its reasoning and its
// answer as messages on channels (analysis, final), which reply_parser.h splits; a past reply is
// written with its final channel only (has_channels()).
//
// A conversation is an optional system message, then user and assistant messages taking turns,
// ending with a user message when a reply is wanted. For a chat that lives in the KV cache, the
// text is built in pieces that concatenate to exactly render(): the part before the first user
// message, each user turn with the header that asks for the reply, and what closes a reply.
// That way each turn only tokenizes and prefills its own new text.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/session/tool_calls.h"

namespace ringlm {

enum class ChatFormat { kChatMl, kLlama2, kLlama3, kGemma, kPhi3, kMistral, kZephyr, kHarmony };

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string role_, std::string content_) : role(std::move(role_)), content(std::move(content_)) {}

  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::vector<ToolCall> tool_calls;  // an assistant message's calls
  std::string tool_call_id;          // a tool message: the call whose result it is
};

// The texts of the vocabulary's BOS and EOS tokens, which some formats write inside the
// conversation (Llama-2's "</s><s>", Zephyr's "</s>").
struct ChatSpecialTokens {
  std::string bos = "<s>";
  std::string eos = "</s>";
};

class ChatTemplate {
 public:
  // The format whose markers `template_source` (Jinja text) contains; nullopt when none match.
  static std::optional<ChatTemplate> detect(std::string_view template_source, const ChatSpecialTokens& special = {});
  // By name (see names()); std::invalid_argument listing the known names otherwise.
  static ChatTemplate from_name(std::string_view name, const ChatSpecialTokens& special = {});
  // "chatml", "llama2", "llama3", "gemma", "phi3", "mistral", "zephyr", "harmony".
  static std::vector<std::string_view> names();

  ChatFormat format() const { return format_; }
  std::string_view name() const;

  // Whether the format starts the conversation with BOS. The pieces below never contain that
  // first BOS: the caller adds it as a token (a BOS written as text could be tokenized apart).
  bool starts_with_bos() const;

  // The system prompt the template writes when the conversation has none (SmolLM2's and
  // Qwen2.5's ChatML templates carry one as a literal string); "" when there is none. render()
  // does not add it: the caller decides whether to pass it as the system message.
  const std::string& default_system_prompt() const { return default_system_; }

  // Today's date as harmony's template writes it (its strftime_now("%Y-%m-%d"): the local date).
  static std::string today();
  // The date harmony's system block says it is ("Current date: 2025-08-05"). Unset (""), each
  // rendering takes today(), as the template does; a chat session fixes it for its conversation
  // (the text in its cache must not change at midnight), tests fix it to compare renderings.
  // Other formats do not write it.
  void set_date(std::string yyyy_mm_dd) { date_ = std::move(yyyy_mm_dd); }
  const std::string& date() const { return date_; }
  // How long harmony's model thinks: "low", "medium" (the template's default) or "high", its
  // system block's "Reasoning: ..." (the template's reasoning_effort variable; OpenAI's and
  // vLLM's request field of that name). std::invalid_argument for anything else. Other formats
  // do not write it.
  void set_reasoning_effort(std::string effort);
  const std::string& reasoning_effort() const { return reasoning_effort_; }

  // Whether replies come as messages on channels (harmony: the analysis channel's reasoning,
  // then the final channel's answer), which ReplyParser splits. The template writes a past reply
  // with its final channel only (assistant_reply()), so the reasoning of earlier turns is not
  // part of the conversation.
  bool has_channels() const { return format_ == ChatFormat::kHarmony; }
  // Whether the model thinks in <think>...</think> before its answer: a template that handles
  // those tags (Qwen3's, its MoE's and QwQ's ChatML). ReplyParser then hands the thinking out as
  // reasoning, as llama-server does; the conversation keeps the reply as generated.
  bool has_think_tags() const { return think_tags_; }

  // Text before the first user message: the system message in formats that give it a block of
  // its own (ChatML, Llama-3, Phi-3, Zephyr); "" in those that fold it into the first user
  // message (Llama-2, Gemma, Mistral) or when `system` is empty (except a format whose header
  // is written even without a system message, such as Llama-3.1's dated header and harmony's
  // system block; harmony writes the caller's system message as its developer message).
  std::string conversation_start(std::string_view system) const;
  // One user message followed by the header that opens the assistant's reply. `first` is true
  // for the first user message of the conversation; `system` is the system prompt, used only by
  // formats that fold it into the first user message.
  std::string user_turn(std::string_view content, bool first, std::string_view system) const;
  // What render() writes for an assistant message after the reply header: its content
  // (trimmed where the format trims) and the text that closes it. Harmony: the content as the
  // final channel's message.
  std::string assistant_reply(std::string_view content) const;
  // Text that closes a reply the model generated (after its last token; the end-of-turn token
  // the model sampled is not in the cache yet, so it is written here).
  std::string reply_end() const;
  // The marker that ends a reply ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>",
  // harmony's "<|return|>", or the EOS text): generation stops when the model writes it.
  // (Harmony's "<|end|>" ends one message of a reply, such as its reasoning, not the reply.)
  std::string end_of_turn() const;
  // Every marker that ends a reply: end_of_turn() and, for harmony, "<|call|>" (a reply that is
  // a tool call).
  std::vector<std::string> end_markers() const;

  // The whole conversation without its leading BOS: conversation_start + for each user
  // message user_turn (the last one always has the reply header, as with Jinja's
  // add_generation_prompt) + for each assistant message assistant_reply. `messages` is an
  // optional system message, then user/assistant turns; std::invalid_argument naming the first
  // message out of place otherwise. No messages: conversation_start(""). The default system
  // prompt is not added here: a caller that wants it passes it as the system message.
  //
  // With `tools` (or tool calls and results in the conversation), the conversation as the
  // format's template writes it with tools (chat_template_tools.cpp): the tools described where
  // the template puts them, an assistant message's tool_calls in tool_syntax(), and after it
  // one or more "tool" messages with their results, each group followed by the reply header as
  // a user message is. The conversation may then end with tool results.
  std::string render(std::span<const ChatMessage> messages, std::span<const ToolDefinition> tools = {}) const;

  // How the format writes tool calls: its template's own way where the template has one (Qwen's
  // <tool_call>, Llama 3.1's JSON, Mistral's [TOOL_CALLS]), Hermes' tags described in the system
  // message otherwise (has_native_tools() false), gpt-oss's harmony messages to "functions.NAME".
  ToolSyntax tool_syntax() const { return tool_syntax_; }
  bool has_native_tools() const { return native_tools_; }

 private:
  ChatTemplate(ChatFormat format, const ChatSpecialTokens& special) : format_(format), special_(special) {
    if (format == ChatFormat::kHarmony) native_tools_ = true, tool_syntax_ = ToolSyntax::kHarmony;
  }
  void read_variants(std::string_view template_source);  // the variant flags below, by markers
  void check_roles(std::span<const ChatMessage> messages) const;
  // render() of a conversation with tools or tool messages (chat_template_tools.cpp).
  std::string render_with_tools(std::span<const ChatMessage> messages, std::span<const ToolDefinition> tools) const;
  std::string tools_conversation_start(std::string_view system, std::span<const ToolDefinition> tools) const;
  std::string tools_user_turn(std::string_view content, bool first, bool last, std::string_view system,
                              std::span<const ToolDefinition> tools) const;
  // `answered`: a later assistant message answers without calls (harmony then drops the call's
  // reasoning, as its template does).
  std::string tool_calls_reply(const ChatMessage& message, bool answered) const;
  // `called`: the function the results answer (harmony writes it as the results' author).
  std::string tool_results_turn(std::span<const ChatMessage> results, std::string_view system,
                                std::string_view called) const;
  std::string harmony_date() const;

  ChatFormat format_;
  ChatSpecialTokens special_;
  std::string default_system_;
  std::string date_;  // harmony's "Current date"; "": today() at each rendering
  std::string reasoning_effort_ = "medium";  // harmony's "Reasoning: ..."
  // Variants read from the template's markers.
  bool llama3_dated_header_ = false;      // Llama-3.1: "Cutting Knowledge Date: ..." system header
  bool think_tags_ = false;               // the template handles <think>...</think> (Qwen3)
  bool mistral_space_after_inst_ = true;  // "[INST] text" (v1, v3) or "[INST]text" (Nemo/tekken)
  bool mistral_space_before_end_ = true;  // "text [/INST]" (v1) or "text[/INST]" (v3, Nemo)
  // Mistral-7B-Instruct-v0.1/v0.2 as shipped since 2024: " [INST] text [/INST] reply</s>", a
  // space before each user message and before each reply.
  bool mistral_space_before_turns_ = false;
  bool mistral_space_after_eos_ = false;  // Mistral-7B-Instruct-v0.1's 2023 template: "reply</s> "
  bool native_tools_ = false;             // the template writes tools and calls itself (harmony always)
  ToolSyntax tool_syntax_ = ToolSyntax::kHermes;
};

}  // namespace ringlm

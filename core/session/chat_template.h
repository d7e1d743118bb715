// Chat templates: how a conversation is written out as the text a chat model was trained on.
//
// A GGUF carries its template as Jinja source (`tokenizer.chat_template`). ringlm does not run
// it: the template is only read to recognise which of the common formats it writes, by the
// markers that format uses (ChatML's <|im_start|>, Llama-3's <|start_header_id|>, ...). Each
// format is then rendered by the code below, so hostile template text can do nothing.
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
#include <vector>

namespace ringlm {

enum class ChatFormat { kChatMl, kLlama2, kLlama3, kGemma, kPhi3, kMistral, kZephyr };

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
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
  // "chatml", "llama2", "llama3", "gemma", "phi3", "mistral", "zephyr".
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

  // Text before the first user message: the system message in formats that give it a block of
  // its own (ChatML, Llama-3, Phi-3, Zephyr); "" in those that fold it into the first user
  // message (Llama-2, Gemma, Mistral) or when `system` is empty (except a format whose header
  // is written even without a system message, such as Llama-3.1's dated header).
  std::string conversation_start(std::string_view system) const;
  // One user message followed by the header that opens the assistant's reply. `first` is true
  // for the first user message of the conversation; `system` is the system prompt, used only by
  // formats that fold it into the first user message.
  std::string user_turn(std::string_view content, bool first, std::string_view system) const;
  // What render() writes for an assistant message after the reply header: its content
  // (trimmed where the format trims) and the text that closes it.
  std::string assistant_reply(std::string_view content) const;
  // Text that closes a reply the model generated (after its last token; the end-of-turn token
  // the model sampled is not in the cache yet, so it is written here).
  std::string reply_end() const;
  // The marker that ends a reply ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", or
  // the EOS text): generation stops when the model writes it.
  std::string end_of_turn() const;

  // The whole conversation without its leading BOS: conversation_start + for each user
  // message user_turn (the last one always has the reply header, as with Jinja's
  // add_generation_prompt) + for each assistant message assistant_reply. `messages` is an
  // optional system message, then user/assistant turns; std::invalid_argument naming the first
  // message out of place otherwise. No messages: conversation_start(""). The default system
  // prompt is not added here: a caller that wants it passes it as the system message.
  std::string render(std::span<const ChatMessage> messages) const;

 private:
  ChatTemplate(ChatFormat format, const ChatSpecialTokens& special) : format_(format), special_(special) {}
  void read_variants(std::string_view template_source);  // the variant flags below, by markers

  ChatFormat format_;
  ChatSpecialTokens special_;
  std::string default_system_;
  // Variants read from the template's markers.
  bool llama3_dated_header_ = false;      // Llama-3.1: "Cutting Knowledge Date: ..." system header
  bool mistral_space_after_inst_ = true;  // "[INST] text" (v1, v3) or "[INST]text" (Nemo/tekken)
  bool mistral_space_before_end_ = true;  // "text [/INST]" (v1) or "text[/INST]" (v3, Nemo)
  // Mistral-7B-Instruct-v0.1/v0.2 as shipped since 2024: " [INST] text [/INST] reply</s>", a
  // space before each user message and before each reply.
  bool mistral_space_before_turns_ = false;
  bool mistral_space_after_eos_ = false;  // Mistral-7B-Instruct-v0.1's 2023 template: "reply</s> "
};

}  // namespace ringlm

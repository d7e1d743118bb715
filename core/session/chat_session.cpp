#include "core/session/chat_session.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "core/gguf/gguf.h"
#include "core/model/llama.h"
#include "core/session/generation.h"
#include "core/session/reply_parser.h"
#include "core/session/timing.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

namespace {

// The chat's words for why a reply ended (ChatTurnStats::stop_reason).
const char* stop_reason(FinishReason finish) {
  switch (finish) {
    case FinishReason::kMaxTokens: return "limit";
    case FinishReason::kInterrupted: return "interrupted";
    case FinishReason::kContextFull: return "context";
    default: return "end";  // the end of the turn (a chat has no stop strings)
  }
}

void append(std::vector<int32_t>& to, const std::vector<int32_t>& tokens) { to.insert(to.end(), tokens.begin(), tokens.end()); }

// A session's template writes one date for the whole conversation (harmony's "Current date"):
// its text in the cache must not change when the day does.
ChatTemplate dated(ChatTemplate chat_template) {
  if (chat_template.date().empty()) chat_template.set_date(ChatTemplate::today());
  return chat_template;
}

// The format a file's architecture is trained on, where ringlm knows it, and what told (the
// notice's reason): a GGUF converted without its template still expects its own turns, not
// ChatML's. nullopt where the architecture does not tell: a llama file may be Llama-2's,
// Llama-3's or ChatML's (SmolLM2); only a Llama-3 vocabulary settles it.
struct ArchitectureFormat {
  std::string_view format;
  std::string reason;
};

std::optional<ArchitectureFormat> architecture_format(std::string_view arch, const Tokenizer& tokenizer) {
  const std::string reason = "architecture " + std::string(arch);
  if (arch == "gemma3") return ArchitectureFormat{"gemma", reason};
  if (arch == "phi3") return ArchitectureFormat{"phi3", reason};
  if (arch == "gpt-oss") return ArchitectureFormat{"harmony", reason};
  if (arch == "qwen2" || arch == "qwen3" || arch == "qwen3moe") return ArchitectureFormat{"chatml", reason};
  if (arch == "llama" && tokenizer.find_token("<|start_header_id|>")) {
    return ArchitectureFormat{"llama3", reason + " with a Llama-3 vocabulary"};
  }
  return std::nullopt;
}

}  // namespace

ChatTemplate chat_template_for(const GgufFile& gguf, const Tokenizer& tokenizer, const std::string& name,
                               std::string& notice) {
  ChatSpecialTokens special;
  if (tokenizer.bos_id() >= 0) special.bos = tokenizer.token_to_piece(tokenizer.bos_id(), true);
  if (tokenizer.eos_id() >= 0) special.eos = tokenizer.token_to_piece(tokenizer.eos_id(), true);
  notice.clear();
  if (!name.empty()) return ChatTemplate::from_name(name, special);
  const std::optional<std::string_view> source = gguf.get_string("tokenizer.chat_template");
  if (source) {
    if (auto recognised = ChatTemplate::detect(*source, special)) return *recognised;
  }
  std::string names;
  for (std::string_view n : ChatTemplate::names()) names += (names.empty() ? "" : ", ") + std::string(n);
  const std::string choices = "--chat-template picks one of: " + names;
  if (source) {
    notice = "the model's chat template is not one ringlm recognises; using chatml (" + choices + ")";
    return ChatTemplate::from_name("chatml", special);
  }
  const std::string arch(gguf.get_string("general.architecture").value_or("unknown"));
  if (const std::optional<ArchitectureFormat> own = architecture_format(arch, tokenizer)) {
    notice = "the model has no chat template; using " + std::string(own->format) + ", the format of its " +
             own->reason + " (" + choices + ")";
    return ChatTemplate::from_name(own->format, special);
  }
  notice = "the model has no chat template; using chatml as the last resort (ringlm knows no format of architecture " +
           arch + "; " + choices + ")";
  return ChatTemplate::from_name("chatml", special);
}

std::vector<int32_t> conversation_prompt(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                         std::vector<ChatMessage> messages, std::span<const ToolDefinition> tools,
                                         std::string_view reply_start) {
  const bool has_system = !messages.empty() && messages.front().role == "system";
  if (!has_system && !chat_template.default_system_prompt().empty()) {
    messages.insert(messages.begin(), ChatMessage{"system", chat_template.default_system_prompt()});
  }
  const bool bos = chat_template.starts_with_bos() || tokenizer.add_bos_by_default();
  return tokenizer.encode(chat_template.render(messages, tools) + std::string(reply_start), bos, /*parse_special=*/true);
}

ChatSession::ChatSession(LlamaModel& model, const Tokenizer& tokenizer, ChatTemplate chat_template,
                         const ChatSessionOptions& options)
    : model_(model),
      tokenizer_(tokenizer),
      template_(dated(std::move(chat_template))),
      options_(options),
      sampler_(options.sampling, model.hparams().n_vocab),
      sequence_(model, model.make_cache(options.n_ctx, cache_options_for(static_cast<int>(conversation_start_tokens("").size()))),
                /*top_k=*/0, options.drafter) {
  system_tokens_ = static_cast<int>(conversation_start_tokens(system_).size());
  // A reply ends at the vocabulary's end-of-generation tokens and at the format's own markers,
  // which some vocabularies do not flag as such (a GGUF converted without them).
  for (const std::string& text : template_.end_markers()) {
    if (auto marker = tokenizer_.find_token(text)) end_of_turn_tokens_.push_back(*marker);
  }
}

std::vector<int32_t> ChatSession::conversation_start_tokens(std::string_view system) const {
  const bool bos = template_.starts_with_bos() || tokenizer_.add_bos_by_default();
  return tokenizer_.encode(template_.conversation_start(system), bos, /*parse_special=*/true);
}

KvCacheOptions ChatSession::cache_options_for(int start_tokens) const {
  if (start_tokens >= options_.n_ctx) {
    throw std::invalid_argument("the system prompt is " + std::to_string(start_tokens) +
                                " tokens, which does not fit the context of " + std::to_string(options_.n_ctx) +
                                " tokens (raise -c)");
  }
  KvCacheOptions opts = options_.cache;
  opts.n_keep = std::min(std::max(opts.n_keep, start_tokens), options_.n_ctx - 1);
  if (opts.n_discard > options_.n_ctx - opts.n_keep) opts.n_discard = 0;  // the sinks grew past it: default
  return opts;
}

void ChatSession::clear_cache() {
  system_tokens_ = static_cast<int>(conversation_start_tokens(system_).size());
  const KvCacheOptions opts = cache_options_for(system_tokens_);
  if (opts.n_keep != cache().n_keep()) {
    sequence_.replace_cache(model_.make_cache(options_.n_ctx, opts));
  } else {
    sequence_.clear();
  }
  started_ = false;
  pending_text_.clear();
}

ChatTurnStats ChatSession::reply(std::string_view user_message, const std::function<void(std::string_view)>& on_text,
                                 const std::atomic<bool>* stop,
                                 const std::function<void(std::string_view)>& on_reasoning) {
  // The new tokens: the conversation start (first turn only, tokenized alone so that it is
  // exactly the sinks), the end of the last reply, the message and the reply header.
  std::vector<int32_t> tokens = started_ ? std::vector<int32_t>{} : conversation_start_tokens(system_);
  append(tokens, tokenizer_.encode(pending_text_ + template_.user_turn(user_message, turns_.empty(), system_),
                                   /*add_bos=*/false, /*parse_special=*/true));
  const int room = cache().capacity() - cache().n_keep();  // what a shift can make free
  const int message_tokens = static_cast<int>(tokens.size()) - (started_ ? 0 : system_tokens_);
  if (message_tokens >= room) {
    throw std::invalid_argument("the message is " + std::to_string(message_tokens) + " tokens; with the " +
                                std::to_string(cache().n_keep()) + " kept tokens of the system prompt, the context of " +
                                std::to_string(cache().capacity()) + " holds at most " + std::to_string(room - 1) +
                                " (raise -c)");
  }
  if (!cache().options().context_shift && cache().size() + static_cast<int>(tokens.size()) >= cache().capacity()) {
    throw std::invalid_argument("the context of " + std::to_string(cache().capacity()) +
                                " tokens is full (context shift is off): /reset, or raise -c");
  }

  ChatTurnStats stats;
  auto t0 = std::chrono::steady_clock::now();
  sequence_.prefill(tokens);
  started_ = true;
  pending_text_.clear();
  turns_.push_back({std::string(user_message), {}});
  stats.prefill_tokens = static_cast<int>(tokens.size());
  stats.prefill_ms = ms_since(t0);

  // Every token shown is also evaluated, so the cache always holds the reply as it was shown,
  // whatever stops it. The sampler's repetition penalty sees the context, as the model does.
  t0 = std::chrono::steady_clock::now();
  StopConditions until;
  until.max_tokens = options_.n_predict;
  until.end_tokens = end_of_turn_tokens_;
  Generation generation(tokenizer_, sampler_, std::move(until), context());
  ReplyParser parser(template_);  // the answer and, with channels or think tags, the reasoning
  const auto show = [&](const ReplyDelta& delta) {
    if (!delta.reasoning.empty() && on_reasoning) on_reasoning(delta.reasoning);
    if (!delta.content.empty() && on_text) on_text(delta.content);
  };
  std::string reply;  // as generated
  GenerateOptions options;
  options.on_text = [&](std::string_view piece) {
    reply += piece;
    show(parser.push(piece));
  };
  options.interrupt = stop;
  options.evaluate_every_token = true;
  options.forget_dropped_history = true;
  if (options_.drafter != nullptr) {
    options.pass_cost = options_.pass_cost;
    options.speculation = &stats.speculation;
  }
  stats.stop_reason = stop_reason(generate(generation, sequence_, options));
  show(parser.finish());
  stats.reply_tokens = generation.n_tokens();
  // Harmony's past replies are their answers (the cache is rewritten to match, below); every
  // other format's conversation holds the reply as generated, think tags and all, as its cache.
  turns_.back().assistant = template_.has_channels() ? parser.content() : std::move(reply);
  stats.reply_ms = ms_since(t0);
  pending_text_ = template_.reply_end();
  if (template_.has_channels()) {
    t0 = std::chrono::steady_clock::now();
    stats.rewritten_tokens = rewrite_reply(generation.text(), generation.n_tokens());
    stats.rewrite_ms = ms_since(t0);
  }
  return stats;
}

int ChatSession::rewrite_reply(std::string_view generated, int n_generated) {
  const std::string rendered = template_.assistant_reply(turns_.back().assistant);
  if (std::string(generated) + template_.reply_end() == rendered) return 0;  // the answer alone already
  // The newest n_generated tokens are the reply's when a shift has left that many after the sinks.
  const bool whole_reply = n_generated <= cache().size() - cache().n_keep();
  if (!whole_reply || n_generated > cache().max_rollback()) return 0;  // kept as generated
  const std::vector<int32_t> tokens = tokenizer_.encode(rendered, /*add_bos=*/false, /*parse_special=*/true);
  // Without a context shift the rendering must fit where the reply was (a reply without
  // headers renders longer than it was).
  const int size_after = cache().size() - n_generated + static_cast<int>(tokens.size());
  if (!cache().options().context_shift && size_after >= cache().capacity()) return 0;
  sequence_.rollback(n_generated);
  sequence_.prefill(tokens);
  pending_text_.clear();  // the rendering closes the reply itself
  return static_cast<int>(tokens.size());
}

void ChatSession::set_system(std::string system) {
  std::vector<Turn> turns = turns_;
  replace_conversation(std::move(system), std::move(turns));
}

void ChatSession::reset() {
  turns_.clear();
  clear_cache();
}

int ChatSession::load(const std::vector<ChatMessage>& messages) {
  template_.render(messages);  // checks roles and order
  const bool has_system = !messages.empty() && messages.front().role == "system";
  std::vector<Turn> turns;
  for (size_t i = has_system ? 1 : 0; i < messages.size(); i += 2) {
    if (i + 1 >= messages.size()) {
      throw std::invalid_argument("message " + std::to_string(i) +
                                  " (user) has no reply: a saved conversation ends with an assistant message");
    }
    turns.push_back({messages[i].content, messages[i + 1].content});
  }
  return replace_conversation(has_system ? messages.front().content : std::string(), std::move(turns));
}

std::vector<int32_t> ChatSession::conversation_tokens(std::string_view system, const std::vector<Turn>& turns) const {
  // The same pieces, tokenized the same way, as the turns were when they were said.
  // A format with channels has its replies in the cache as the template writes them (reply()).
  std::vector<int32_t> tokens = conversation_start_tokens(system);
  std::string pending;
  for (size_t i = 0; i < turns.size(); ++i) {
    append(tokens, tokenizer_.encode(pending + template_.user_turn(turns[i].user, i == 0, system), false, true));
    if (template_.has_channels()) {
      append(tokens, tokenizer_.encode(template_.assistant_reply(turns[i].assistant), false, true));
    } else {
      append(tokens, tokenizer_.encode(turns[i].assistant, false, true));
      pending = template_.reply_end();
    }
  }
  return tokens;
}

int ChatSession::replace_conversation(std::string system, std::vector<Turn> turns) {
  // Everything that can refuse the new conversation runs before the old one is touched.
  const std::vector<int32_t> tokens = conversation_tokens(system, turns);
  cache_options_for(static_cast<int>(conversation_start_tokens(system).size()));
  if (!cache().options().context_shift && static_cast<int>(tokens.size()) >= cache().capacity()) {
    throw std::invalid_argument("the conversation is " + std::to_string(tokens.size()) + " tokens, more than the context of " +
                                std::to_string(cache().capacity()) + " holds with context shift off (raise -c)");
  }
  system_ = std::move(system);
  turns_ = std::move(turns);
  clear_cache();
  sequence_.prefill(tokens);
  started_ = true;
  pending_text_ = turns_.empty() || template_.has_channels() ? std::string() : template_.reply_end();
  return static_cast<int>(tokens.size());
}

std::vector<ChatMessage> ChatSession::messages() const {
  std::vector<ChatMessage> out;
  if (!system_.empty()) out.push_back({"system", system_});
  for (const Turn& t : turns_) {
    out.push_back({"user", t.user});
    out.push_back({"assistant", t.assistant});
  }
  return out;
}

}  // namespace ringlm

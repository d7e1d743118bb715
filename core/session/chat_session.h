// A chat that lives in the KV cache.
//
// The conversation is written out by its chat template piece by piece and only the new pieces
// are prefilled: a turn evaluates the end of the previous reply, the user's message and the
// header of the new reply, then generates. Nothing said before is evaluated again.
//
// When the context fills, the cache's StreamingLLM shift drops the oldest turns. The system
// prompt (and the BOS before it) are the attention sinks: the session sets the cache's n_keep
// to cover them, so the model never loses its instructions however long the chat goes on.
//
// The session mirrors the cache with the token ids it holds (context()), so it can say what is
// in the context and feed the sampler's repetition penalty.
//
// A format whose replies have channels (harmony: reasoning, then the answer) shows each part
// through its own callback, keeps the answer as the reply (messages()), and keeps in the cache
// what its template writes for a past reply: the answer alone. The reply's tokens are forgotten
// (KvCache::rollback) and the answer as the template writes it evaluated in their place, where
// the cache can forget them; see reply().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/kv/kv_cache.h"
#include "core/sampling/sampler.h"
#include "core/session/chat_template.h"
#include "core/session/generation.h"
#include "core/session/sequence_model.h"
#include "core/speculative/draft_length.h"
#include "core/speculative/drafter.h"

namespace ringlm {

class GgufFile;
class LlamaModel;
class Tokenizer;

// The chat template of a model: `name` when given (see ChatTemplate::names()), else the one
// recognised from the GGUF's tokenizer.chat_template; a file without one gets its architecture's
// format where ringlm knows it (gemma3: gemma, phi3: phi3, gpt-oss: harmony, qwen2/qwen3:
// chatml, llama with a Llama-3 vocabulary: llama3), and ChatML as the last resort, as does an
// unrecognised template. Any fallback sets `notice` to a one-line reason naming the format and
// why (it stays empty otherwise). BOS/EOS texts come from the tokenizer.
ChatTemplate chat_template_for(const GgufFile& gguf, const Tokenizer& tokenizer, const std::string& name,
                               std::string& notice);

// A conversation ending with a user message (or tool results) as the model reads it, the reply
// header last: the template's default system prompt first when the conversation has no system
// message (as the Jinja template writes it), BOS when the format or the vocabulary starts with
// one. `tools`: the tools offered (ChatTemplate::render); `reply_start`: text the reply begins
// with, written after the header (a forced tool call's marker).
std::vector<int32_t> conversation_prompt(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                         std::vector<ChatMessage> messages,
                                         std::span<const ToolDefinition> tools = {}, std::string_view reply_start = {});

struct ChatSessionOptions {
  int n_ctx = 4096;
  KvCacheOptions cache;  // n_keep is a minimum: the session raises it to cover the system prompt
  SamplingParams sampling;
  int n_predict = -1;    // most tokens per reply (-1: until the end of the turn)
  Drafter* drafter = nullptr;  // speculative decoding with this guesser (the caller's; null: off)
  PassCost pass_cost;          // what its checking passes cost (DraftLength)
};

// What one turn cost.
struct ChatTurnStats {
  int prefill_tokens = 0;   // new tokens evaluated for this turn (before the reply)
  double prefill_ms = 0;
  int reply_tokens = 0;     // tokens the reply generated
  double reply_ms = 0;
  std::string stop_reason;  // "end" (end of turn), "limit" (-n), "interrupted", "context" (full, no shift)
  // Tokens of the reply as the template writes it, evaluated after the reply in place of the
  // generated ones (harmony: the answer without the reasoning); 0 when the cache kept the reply
  // as generated.
  int rewritten_tokens = 0;
  double rewrite_ms = 0;
  SpeculationStats speculation;  // with a guesser
};

class ChatSession {
 public:
  ChatSession(LlamaModel& model, const Tokenizer& tokenizer, ChatTemplate chat_template, const ChatSessionOptions& options);

  // Streams each piece of the reply's answer (complete UTF-8 only) to `on_text`, and of its
  // reasoning, in a format with channels, to `on_reasoning` (may be empty: not shown). `stop`
  // (may be null), when it becomes true, ends the reply after the token being generated; what
  // was generated stays in the conversation. Throws std::invalid_argument, changing nothing,
  // when the message cannot fit the context.
  //
  // With channels, the cache then holds the reply as the template writes a past one (its answer
  // alone), so that the next turn reads what the template would give the model: the reply's
  // tokens are rolled back and the template's text evaluated, unless the reply is already that
  // text. A cache that cannot roll the whole reply back keeps it as generated, reasoning
  // included: one whose sliding-window ring holds fewer tokens beyond its window than the reply
  // has (LlamaModel keeps a pass, 256 tokens, beyond it), one whose context shift dropped the
  // start of the reply, or one that does not shift and has no room for the rendering.
  // (Re-evaluating the whole conversation instead would cost a prefill of it at every turn.)
  ChatTurnStats reply(std::string_view user_message, const std::function<void(std::string_view)>& on_text,
                      const std::atomic<bool>* stop = nullptr,
                      const std::function<void(std::string_view)>& on_reasoning = {});

  // Replaces the system prompt ("" for none) and prefills the conversation again under it.
  void set_system(std::string system);
  // Forgets the conversation (the system prompt stays).
  void reset();
  // Replaces the conversation with `messages` (an optional system message, then user/assistant
  // turns ending with an assistant message) and prefills it. Returns the tokens prefilled.
  // std::invalid_argument naming the message when the conversation is malformed; the session
  // is unchanged then.
  int load(const std::vector<ChatMessage>& messages);

  // The conversation: the system message first (if any), then user/assistant turns.
  std::vector<ChatMessage> messages() const;
  const std::string& system() const { return system_; }
  const ChatTemplate& chat_template() const { return template_; }

  // Token ids in the KV cache, oldest first (sinks included); context().size() == cache().size().
  const std::vector<int32_t>& context() const { return sequence_.tokens(); }
  const KvCache& cache() const { return sequence_.cache(); }
  // The logits after the last evaluated token: what the next token is sampled from.
  std::span<const float> logits() const { return sequence_.logits(); }
  // Tokens of BOS + system prompt: the sinks cover at least these.
  int system_tokens() const { return system_tokens_; }
  // Tokens evaluated since the session began (prefill and replies): what re-evaluating would cost.
  int64_t evaluated_total() const { return sequence_.evaluated(); }

 private:
  struct Turn {
    std::string user;
    std::string assistant;
  };

  // Tokens of the text before the first user message (BOS + system block) under `system`.
  std::vector<int32_t> conversation_start_tokens(std::string_view system) const;
  // Cache options whose sinks cover `start_tokens` tokens; std::invalid_argument when the
  // context is too small for them.
  KvCacheOptions cache_options_for(int start_tokens) const;
  // Empties the cache for a conversation under system_; makes a new one when the sinks must
  // cover a different number of tokens.
  void clear_cache();
  // The tokens of a whole conversation, in the pieces reply() would have evaluated.
  std::vector<int32_t> conversation_tokens(std::string_view system, const std::vector<Turn>& turns) const;
  // Makes (system, turns) the conversation and prefills it; refuses (unchanged) if it cannot fit.
  int replace_conversation(std::string system, std::vector<Turn> turns);
  // After a reply of `n_generated` tokens whose text was `generated`, in a format with channels:
  // puts the reply as the template writes it in the cache in their place when it differs and
  // the cache can roll them back (see reply()). Returns the tokens evaluated.
  int rewrite_reply(std::string_view generated, int n_generated);

  LlamaModel& model_;
  const Tokenizer& tokenizer_;
  ChatTemplate template_;
  ChatSessionOptions options_;
  Sampler sampler_;
  std::string system_;  // declared before sequence_: the sinks are sized from it
  // The conversation in the cache (the model's full logits: a chat's sampler may need them all).
  SequenceModel sequence_;
  std::vector<int32_t> end_of_turn_tokens_;  // single tokens that end a reply besides the vocab's EOG

  int system_tokens_ = 0;
  std::vector<Turn> turns_;
  bool started_ = false;       // the conversation start (BOS, system prompt) is in the cache
  std::string pending_text_;  // the end of the last reply, evaluated with the next user message
};

}  // namespace ringlm

// The chat session on the real model (SmolLM2-135M-Instruct, ChatML), checked against things
// that do not come from the session itself:
//  - the context it builds turn by turn, detokenized, is the conversation as the chat template
//    renders it whole (the template is checked against Jinja in reference.chat_templates);
//  - a turn evaluates only its own tokens: nothing said before is evaluated again;
//  - a conversation restored by load() continues as the live one does: on the fp32 path to
//    within float rounding, with the same greedy reply; on the int8 path, on every SIMD target,
//    within the rounding of its 8-bit activations;
//  - past the context, the StreamingLLM shift keeps the system prompt's tokens as the sinks;
//  - harmony (gpt-oss's format), on a scripted model whose reply is known: the reasoning and the
//    answer are shown apart, the reply ends at <|return|> and not at the <|end|> after the
//    reasoning, and the cache holds the answer as the template writes a past reply.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/model/loader.h"
#include "core/session/chat_session.h"
#include "tests/logit_distance.h"
#include "tests/build_scale.h"
#include "tests/only_target.h"

namespace ringlm {
namespace {

const auto kIgnore = [](std::string_view) {};

class ChatSessionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One thread: ctest runs two suites at once on two cores, and OpenMP threads that wait for a
    // descheduled peer make everything crawl.
    omp_set_num_threads(1);
    loaded_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1));
    fp32_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1, ComputeType::kFp32));
  }
  static void TearDownTestSuite() {
    delete loaded_;
    delete fp32_;
    loaded_ = fp32_ = nullptr;
  }

  static ChatTemplate model_template() {
    const auto source = loaded_->gguf->get_string("tokenizer.chat_template");
    EXPECT_TRUE(source.has_value());
    auto t = ChatTemplate::detect(source.value_or(""));
    EXPECT_TRUE(t.has_value());
    return t.value_or(ChatTemplate::from_name("chatml"));
  }

  static ChatSessionOptions greedy(int n_ctx, int n_predict) {
    ChatSessionOptions o;
    o.n_ctx = n_ctx;
    o.cache.n_keep = 4;
    o.cache.context_shift = true;
    o.sampling.temperature = 0.0f;
    o.n_predict = n_predict;
    return o;
  }

  static ChatSession make_session(const ChatSessionOptions& o, LoadedModel* m = loaded_) {
    return ChatSession(*m->model, *m->tokenizer, model_template(), o);
  }

  // A live conversation (a system prompt and one exchange of a reply of up to `reply_tokens`,
  // evaluated turn by turn and token by token) and the same conversation restored by load() into
  // a fresh session (prefilled in one batch), both on `m`.
  struct LiveAndRestored {
    ChatSession live, restored;
    std::vector<ChatMessage> saved;
    int prefilled;
  };
  static LiveAndRestored live_and_restored(LoadedModel* m, int reply_tokens, KvTypes cache_type = KvType::kF16) {
    ChatSessionOptions o = greedy(1024, reply_tokens);
    o.cache.type = cache_type;
    LiveAndRestored r{make_session(o, m), make_session(o, m), {}, 0};
    r.live.set_system("You are a helpful assistant.");
    r.live.reply("My name is Alice. Say hello to me.", kIgnore);
    r.saved = r.live.messages();
    r.prefilled = r.restored.load(r.saved);
    return r;
  }

  static std::string detokenize(const std::vector<int32_t>& ids) {
    return loaded_->tokenizer->decode(ids, /*render_special=*/true);
  }

  static LoadedModel* loaded_;  // int8 compute
  static LoadedModel* fp32_;    // the fp32 reference path
};

LoadedModel* ChatSessionTest::loaded_ = nullptr;
LoadedModel* ChatSessionTest::fp32_ = nullptr;

TEST_F(ChatSessionTest, ContextIsTheRenderedConversation) {
  ChatSession s = make_session(greedy(1024, 24));
  s.set_system("You are a terse assistant.");
  std::string streamed;
  s.reply("What is the capital of France?", [&](std::string_view p) { streamed += p; });
  s.reply("And of Italy?", kIgnore);

  const std::vector<ChatMessage> m = s.messages();
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0].role, "system");
  EXPECT_EQ(m[2].content, streamed);  // the reply kept is the reply shown
  EXPECT_FALSE(streamed.empty());
  // The cache holds everything up to the last reply's last token; the text that closes the
  // reply is evaluated with the next message.
  EXPECT_EQ(detokenize(s.context()) + s.chat_template().reply_end(), s.chat_template().render(m));
  EXPECT_EQ(static_cast<int>(s.context().size()), s.cache().size());
}

TEST_F(ChatSessionTest, EachTurnEvaluatesOnlyItsNewTokens) {
  ChatSession s = make_session(greedy(1024, 16));
  s.set_system("You are a helpful assistant.");
  const int system_tokens = static_cast<int>(s.context().size());
  EXPECT_EQ(system_tokens, s.system_tokens());
  const ChatTurnStats first = s.reply("Name a colour.", kIgnore);
  const size_t after_first = s.context().size();
  const std::string second_text = s.chat_template().reply_end() + s.chat_template().user_turn("Another one.", false, "");
  const ChatTurnStats second = s.reply("Another one.", kIgnore);

  EXPECT_EQ(second.prefill_tokens,
            static_cast<int>(loaded_->tokenizer->encode(second_text, false, true).size()));
  EXPECT_EQ(s.context().size(), after_first + static_cast<size_t>(second.prefill_tokens + second.reply_tokens));
  // Nothing was evaluated twice: every token evaluated is still in the context.
  EXPECT_EQ(s.evaluated_total(), static_cast<int64_t>(s.context().size()));
  EXPECT_EQ(static_cast<int>(s.context().size()),
            system_tokens + first.prefill_tokens + first.reply_tokens + second.prefill_tokens + second.reply_tokens);
}

// On the fp32 path the restored context (prefilled in one batch) and the live one (turn by turn,
// token by token) differ only in the order of float sums: the next token's logits agree to
// within 1e-3 of their range, and the next reply is the same text.
TEST_F(ChatSessionTest, LoadedConversationContinuesLikeTheLiveOne) {
  LiveAndRestored r = live_and_restored(fp32_, test::scaled(8, 3));
  EXPECT_EQ(r.prefilled, static_cast<int>(r.live.context().size()));
  EXPECT_EQ(r.restored.context(), r.live.context());
  EXPECT_EQ(r.restored.messages().size(), r.saved.size());

  const std::span<const float> a = r.live.logits(), b = r.restored.logits();
  EXPECT_LT(test::max_abs_diff(a, b), 1e-3f * test::logit_range(a)) << "logit range " << test::logit_range(a);
  EXPECT_EQ(argmax(a), argmax(b));
  std::string live_text, restored_text;
  r.live.reply("What is my name?", [&](std::string_view p) { live_text += p; });
  r.restored.reply("What is my name?", [&](std::string_view p) { restored_text += p; });
  EXPECT_FALSE(live_text.empty());
  EXPECT_EQ(restored_text, live_text);
}

// On the int8 path, on every SIMD target this machine runs (model_test_targets): a rounding
// difference moves whole activation steps (tests/logit_distance.h), so the two next-token
// distributions are compared by their KL divergence, with a bound of about 3x the largest seen
// at any single position between two int8 paths of one text, or between int8 and fp32 (0.12;
// bench/int8_paths). A target whose decode or prefill path diverges is far outside it, as is a
// session that lost the conversation.
TEST_F(ChatSessionTest, LoadedConversationContinuesLikeTheLiveOneOnTheInt8PathOfEveryTarget) {
  constexpr double kMaxKl = 0.3;
  for (const int64_t target : test::model_test_targets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const test::OnlyTarget only(target);
    LiveAndRestored r = live_and_restored(loaded_, 8);
    EXPECT_EQ(r.restored.context(), r.live.context());
    const double kl = test::kl_divergence(r.live.logits(), r.restored.logits());
    EXPECT_LT(kl, kMaxKl);
    std::printf("%s: KL(live || restored) = %.3e\n", hwy::TargetName(target), kl);
    // What the bound tells apart: a session holding the system prompt only.
    ChatSession lost = make_session(greedy(1024, 8));
    lost.set_system("You are a helpful assistant.");
    EXPECT_GT(test::kl_divergence(r.live.logits(), lost.logits()), 10 * kMaxKl);
  }
}

// The same with quantized caches (q8_0 keys, q4_0 values; q4_0 for both; kivi2), on the best target:
// the live reply was decoded token by token (q8_0 keys scored in int8 where the CPU has VNNI),
// the restored one prefilled from the same blocks; the bound is the int8 paths' one.
TEST_F(ChatSessionTest, LoadedConversationContinuesLikeTheLiveOneWithQuantizedCaches) {
  constexpr double kMaxKl = 0.3;
  for (const KvTypes types : {KvTypes(KvType::kQ8_0, KvType::kQ4_0), KvTypes(KvType::kQ4_0), KvTypes(KvType::kKivi2)}) {
    SCOPED_TRACE(kv_types_name(types));
    LiveAndRestored r = live_and_restored(loaded_, 8, types);
    EXPECT_EQ(r.restored.cache().type(), types);
    EXPECT_EQ(r.restored.context(), r.live.context());
    const double kl = test::kl_divergence(r.live.logits(), r.restored.logits());
    EXPECT_LT(kl, kMaxKl);
    std::printf("%s: KL(live || restored) = %.3e\n", kv_types_name(types).c_str(), kl);
  }
}

TEST_F(ChatSessionTest, OverflowKeepsTheSystemPromptAsSinks) {
  ChatSession s = make_session(greedy(160, 40));
  s.set_system("You are a helpful assistant who answers in one sentence.");
  const std::vector<int32_t> start(s.context().begin(), s.context().end());
  ASSERT_GT(start.size(), 4u);
  EXPECT_EQ(s.cache().n_keep(), static_cast<int>(start.size()));  // --keep 4 raised to cover it

  const char* questions[] = {"Tell me about the sea.", "Tell me about mountains.", "Tell me about rivers.",
                             "Tell me about forests.", "Tell me about deserts."};
  for (const char* q : questions) {
    const ChatTurnStats t = s.reply(q, kIgnore);
    EXPECT_GT(t.reply_tokens, 0) << q;
    EXPECT_LE(s.cache().size(), 160);
    EXPECT_EQ(static_cast<int>(s.context().size()), s.cache().size());
    ASSERT_GE(s.context().size(), start.size());
    EXPECT_TRUE(std::equal(start.begin(), start.end(), s.context().begin())) << "the sinks lost the system prompt";
  }
  EXPECT_GT(s.cache().shifts(), 0);
  EXPECT_GT(s.evaluated_total(), 160);
  // The newest turn is whole at the end of the context.
  const std::string tail = detokenize(s.context());
  EXPECT_NE(tail.find("Tell me about deserts."), std::string::npos);
}

TEST_F(ChatSessionTest, MessageLongerThanTheContextIsRefusedAndChangesNothing) {
  ChatSession s = make_session(greedy(128, 8));
  s.set_system("Be brief.");
  s.reply("Hi", kIgnore);
  const std::vector<int32_t> before = s.context();
  std::string long_message;
  for (int i = 0; i < 200; ++i) long_message += "word ";
  try {
    s.reply(long_message, kIgnore);
    FAIL() << "a 200-word message fit a 128-token context";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("raise -c"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.context(), before);
  EXPECT_EQ(s.messages().size(), 3u);
  EXPECT_GT(s.reply("Bye", kIgnore).reply_tokens, 0);  // and the chat goes on
}

TEST_F(ChatSessionTest, SystemPromptLongerThanTheContextIsRefused) {
  ChatSession s = make_session(greedy(64, 8));
  std::string huge;
  for (int i = 0; i < 100; ++i) huge += "rule ";
  EXPECT_THROW(s.set_system(huge), std::invalid_argument);
  EXPECT_EQ(s.system(), "");
  EXPECT_GT(s.reply("Hi", kIgnore).reply_tokens, 0);
}

TEST_F(ChatSessionTest, MalformedConversationIsRefusedAndChangesNothing) {
  ChatSession s = make_session(greedy(512, 8));
  s.reply("Hi", kIgnore);
  const std::vector<int32_t> before = s.context();
  EXPECT_THROW(s.load({{"user", "a"}, {"user", "b"}}), std::invalid_argument);
  EXPECT_THROW(s.load({{"user", "a"}}), std::invalid_argument);  // no reply to the last message
  EXPECT_THROW(s.load({{"assistant", "a"}, {"user", "b"}}), std::invalid_argument);
  EXPECT_THROW(s.load({{"wizard", "a"}}), std::invalid_argument);
  EXPECT_EQ(s.context(), before);
}

TEST_F(ChatSessionTest, InterruptKeepsWhatWasShown) {
  ChatSession s = make_session(greedy(512, 64));
  std::atomic<bool> stop{false};
  std::string shown;
  int pieces = 0;
  const ChatTurnStats t = s.reply("Write a long story about a dragon.", [&](std::string_view p) {
    shown += p;
    if (++pieces == 5) stop = true;
  }, &stop);
  EXPECT_EQ(t.stop_reason, "interrupted");
  EXPECT_LT(t.reply_tokens, 64);
  EXPECT_EQ(s.messages().back().content, shown);
  EXPECT_EQ(detokenize(s.context()) + s.chat_template().reply_end(), s.chat_template().render(s.messages()));
}

TEST_F(ChatSessionTest, ResetForgetsTheConversationButKeepsTheSystemPrompt) {
  ChatSession s = make_session(greedy(512, 8));
  s.set_system("Be brief.");
  s.reply("Hi", kIgnore);
  s.reset();
  EXPECT_EQ(s.system(), "Be brief.");
  EXPECT_EQ(s.messages().size(), 1u);
  EXPECT_EQ(s.cache().size(), 0);
  s.reply("Hello", kIgnore);
  EXPECT_EQ(detokenize(s.context()) + s.chat_template().reply_end(), s.chat_template().render(s.messages()));
}

// ---------------------------------------------------------------------------------------------
// Harmony on a scripted model (tests/data/scripted_harmony.json, written by the CTest fixture
// generate.scripted_harmony): gpt-oss's template and markers; to any prompt it replies with a
// reasoning message, then the answer.

class HarmonyChatSession : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    model_ = new LoadedModel(load_model(std::string(RINGLM_TEST_WORK_DIR) + "/scripted_harmony.gguf", 1));
    std::ifstream spec(std::string(RINGLM_SOURCE_DIR) + "/tests/data/scripted_harmony.json");
    spec_ = new nlohmann::json(nlohmann::json::parse(spec));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete spec_;
    model_ = nullptr;
    spec_ = nullptr;
  }

  static ChatSession make_session(int n_ctx) {
    std::string notice;
    ChatTemplate chat_template = chat_template_for(*model_->gguf, *model_->tokenizer, "", notice);
    EXPECT_EQ(chat_template.name(), "harmony");
    ChatSessionOptions o;
    o.n_ctx = n_ctx;
    o.cache.context_shift = true;
    o.sampling.temperature = 0.0f;
    return ChatSession(*model_->model, *model_->tokenizer, chat_template, o);
  }
  static std::string detokenize(const std::vector<int32_t>& ids) { return model_->tokenizer->decode(ids, true); }
  static std::string spec(const char* key) { return (*spec_)[key].get<std::string>(); }

  static LoadedModel* model_;
  static nlohmann::json* spec_;
};

LoadedModel* HarmonyChatSession::model_ = nullptr;
nlohmann::json* HarmonyChatSession::spec_ = nullptr;

TEST_F(HarmonyChatSession, ReasoningAndAnswerApartAndTheCacheHoldsTheAnswerAsTheTemplateWritesIt) {
  ChatSession s = make_session(4096);
  s.set_system("Be kind.");
  for (const char* message : {"Hi", "Hi again"}) {
    SCOPED_TRACE(message);
    std::string content, reasoning;
    const ChatTurnStats t = s.reply(
        message, [&](std::string_view p) { content += p; }, nullptr, [&](std::string_view p) { reasoning += p; });
    EXPECT_EQ(content, spec("content"));
    EXPECT_EQ(reasoning, spec("reasoning"));
    // The whole reply: it went on after the <|end|> that closes the reasoning and stopped at
    // <|return|> ("LEAK" would follow it).
    EXPECT_EQ(t.stop_reason, "end");
    EXPECT_EQ(t.reply_tokens, static_cast<int>((*spec_)["chain"].size()) - 3);
    EXPECT_EQ(s.messages().back().content, content);
    // The reply's tokens gave way to the answer as the template writes a past reply: the cache is
    // the conversation as the template renders it, reasoning dropped.
    EXPECT_GT(t.rewritten_tokens, 0);
    EXPECT_EQ(detokenize(s.context()), s.chat_template().render(s.messages()));
    EXPECT_EQ(detokenize(s.context()).find(spec("reasoning")), std::string::npos);
    EXPECT_EQ(static_cast<int>(s.context().size()), s.cache().size());
  }
  // A conversation restored by load() is that same cache.
  ChatSession restored = make_session(4096);
  EXPECT_EQ(restored.load(s.messages()), static_cast<int>(s.context().size()));
  EXPECT_EQ(restored.context(), s.context());
}

TEST_F(HarmonyChatSession, InterruptedWhileReasoningKeepsAnEmptyAnswer) {
  ChatSession s = make_session(4096);
  std::atomic<bool> stop{false};
  std::string content, reasoning;
  const ChatTurnStats t = s.reply(
      "Hi", [&](std::string_view p) { content += p; }, &stop,
      [&](std::string_view p) {
        reasoning += p;
        stop = true;
      });
  EXPECT_EQ(t.stop_reason, "interrupted");
  EXPECT_EQ(content, "");
  EXPECT_FALSE(reasoning.empty());
  EXPECT_EQ(s.messages().back().content, "");
  EXPECT_EQ(detokenize(s.context()), s.chat_template().render(s.messages()));
}

TEST_F(HarmonyChatSession, AReplyTheCacheCannotRollBackWholeStaysAsGenerated) {
  // A context of the sinks and 24 tokens: the shifts during the reply drop its first tokens, so
  // they cannot be given back; the reply stays in the cache as the model wrote it.
  const int sinks = make_session(4096).system_tokens();
  ChatSession s = make_session(sinks + 24);
  std::string content;
  const ChatTurnStats t = s.reply("Hi", [&](std::string_view p) { content += p; });
  EXPECT_EQ(content, spec("content"));
  EXPECT_EQ(t.rewritten_tokens, 0);
  EXPECT_GT(s.cache().shifts(), 0);
  const std::string generated = spec("generated");
  const std::string kept = detokenize(s.context());
  EXPECT_EQ(kept.substr(kept.size() - 12), generated.substr(generated.size() - 12));
  EXPECT_EQ(s.reply("Hi", kIgnore).stop_reason, "end");  // and the chat goes on
}

}  // namespace
}  // namespace ringlm

// The chat template a GGUF without tokenizer.chat_template gets (chat_template_for): its
// architecture's own format where ringlm knows it, ChatML as the last resort, each with a notice
// that says which format and why. The files are metadata only: an architecture and a tiny BPE
// vocabulary, which is all the choice reads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/session/chat_session.h"
#include "core/session/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/gguf_test_builder.h"

namespace ringlm {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

// What chat_template_for chose for one file, and the notice it gave.
struct Choice {
  std::string name;
  std::string notice;
  std::string rendered;  // a one-message conversation in the chosen format
};

// `arch`'s file with the tiny vocabulary plus `extra_tokens`, and `chat_template` when given.
Choice choose(const std::string& arch, const std::vector<std::string>& extra_tokens = {},
              const std::string& chat_template = "", const std::string& name = "") {
  std::vector<std::string> tokens = {"a", "b", "ab", "\u0120", "\u0120a"};
  tokens.insert(tokens.end(), extra_tokens.begin(), extra_tokens.end());
  test::GgufBuilder builder;
  builder.kv_string("general.architecture", arch)
      .kv_string("tokenizer.ggml.model", "gpt2")
      .kv_strings("tokenizer.ggml.tokens", tokens)
      .kv_strings("tokenizer.ggml.merges", {"a b", "\u0120 a"});
  if (!chat_template.empty()) builder.kv_string("tokenizer.chat_template", chat_template);
  const std::vector<uint8_t> bytes = builder.build();
  const std::unique_ptr<GgufFile> gguf = GgufFile::parse(bytes.data(), bytes.size(), "test.gguf");
  const std::unique_ptr<Tokenizer> tokenizer = Tokenizer::from_gguf(*gguf);
  Choice choice;
  const ChatTemplate chosen = chat_template_for(*gguf, *tokenizer, name, choice.notice);
  choice.name = chosen.name();
  const std::vector<ChatMessage> hi = {{"user", "hi"}};
  choice.rendered = chosen.render(hi);
  return choice;
}

TEST(ChatTemplateFallback, Gemma3WithoutATemplateGetsGemmasTurns) {
  const Choice c = choose("gemma3");
  EXPECT_EQ(c.name, "gemma");
  EXPECT_EQ(c.rendered, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_THAT(c.notice,
              HasSubstr("the model has no chat template; using gemma, the format of its architecture gemma3"));
}

TEST(ChatTemplateFallback, LlamaWithALlama3VocabularyGetsLlama3) {
  const Choice c = choose("llama", {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
  EXPECT_EQ(c.name, "llama3");
  EXPECT_EQ(c.rendered, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_THAT(c.notice, HasSubstr("using llama3, the format of its architecture llama with a Llama-3 vocabulary"));
}

TEST(ChatTemplateFallback, OtherKnownArchitecturesGetTheirFormats) {
  EXPECT_EQ(choose("phi3").name, "phi3");
  EXPECT_EQ(choose("gpt-oss").name, "harmony");
  for (const char* qwen : {"qwen2", "qwen3", "qwen3moe"}) {
    const Choice c = choose(qwen);
    EXPECT_EQ(c.name, "chatml") << qwen;
    EXPECT_THAT(c.notice, HasSubstr(std::string("using chatml, the format of its architecture ") + qwen));
  }
}

TEST(ChatTemplateFallback, ChatMlIsTheLastResortAndSaysSo) {
  // A llama file without a Llama-3 vocabulary may be Llama-2's or a ChatML model's (SmolLM2).
  const Choice c = choose("llama");
  EXPECT_EQ(c.name, "chatml");
  EXPECT_EQ(c.rendered, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_THAT(c.notice, HasSubstr("the model has no chat template; using chatml as the last resort"));
  EXPECT_THAT(c.notice, HasSubstr("ringlm knows no format of architecture llama"));
}

TEST(ChatTemplateFallback, TheFilesOwnTemplateAndTheFlagComeFirst) {
  const Choice own = choose("gemma3", {}, "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}");
  EXPECT_EQ(own.name, "chatml");
  EXPECT_THAT(own.notice, IsEmpty());
  const Choice flag = choose("gemma3", {}, "", "llama2");
  EXPECT_EQ(flag.name, "llama2");
  EXPECT_THAT(flag.notice, IsEmpty());
  // A template ringlm does not recognise is not a missing one: ChatML, as before.
  const Choice unknown = choose("gemma3", {}, "{{ messages }}");
  EXPECT_EQ(unknown.name, "chatml");
  EXPECT_THAT(unknown.notice, HasSubstr("not one ringlm recognises; using chatml"));
}

}  // namespace
}  // namespace ringlm

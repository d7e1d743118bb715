// Chat template tests: recognising real templates by their markers, the default system prompt,
// names, hand-written renderings of each format, the pieces adding up to render(), malformed
// conversations, and harmony's replies read back as reasoning and answer (ReplyParser), whole
// and streamed in pieces cut anywhere. tests/reference/check_chat_templates.py compares the
// renderings with the real templates run by jinja2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <span>
#include <vector>

#include "core/session/chat_template.h"
#include "core/session/reply_parser.h"

namespace ringlm {
namespace {

using ::testing::HasSubstr;

const std::string kSharedTemplates = std::string(RINGLM_SHARED_DATA) + "/chat-templates/";
const std::string kReferenceTemplates = std::string(RINGLM_SOURCE_DIR) + "/tests/reference/chat_templates/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ChatTemplate detect_file(const std::string& path, const ChatSpecialTokens& special = {}) {
  std::optional<ChatTemplate> detected = ChatTemplate::detect(read_file(path), special);
  if (!detected) throw std::runtime_error("no chat format recognised in " + path);
  return *detected;
}

std::vector<ChatMessage> two_turns_with_system() {
  return {{"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}};
}

// ---------------------------------------------------------------------------------------------
// Recognising real templates

struct TemplateCase {
  const char* file;
  const char* format;
};

class SharedTemplates : public ::testing::TestWithParam<TemplateCase> {};

TEST_P(SharedTemplates, RecognisedByMarkers) {
  const TemplateCase& c = GetParam();
  EXPECT_EQ(detect_file(kSharedTemplates + c.file).name(), c.format);
}

INSTANTIATE_TEST_SUITE_P(ChatTemplate, SharedTemplates,
                         ::testing::Values(TemplateCase{"HuggingFaceTB-SmolLM3-3B.jinja", "chatml"},
                                           TemplateCase{"Qwen-Qwen2.5-7B-Instruct.jinja", "chatml"},
                                           TemplateCase{"google-gemma-2-2b-it.jinja", "gemma"},
                                           TemplateCase{"meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"},
                                           TemplateCase{"microsoft-Phi-3.5-mini-instruct.jinja", "phi3"},
                                           TemplateCase{"mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"}));

class ReferenceTemplates : public ::testing::TestWithParam<TemplateCase> {};

TEST_P(ReferenceTemplates, RecognisedByMarkers) {
  const TemplateCase& c = GetParam();
  EXPECT_EQ(detect_file(kReferenceTemplates + c.file).name(), c.format);
}

INSTANTIATE_TEST_SUITE_P(
    ChatTemplate, ReferenceTemplates,
    ::testing::Values(TemplateCase{"HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "chatml"},
                      TemplateCase{"meta-llama-Llama-2-7b-chat-hf.jinja", "llama2"},
                      TemplateCase{"meta-llama-Meta-Llama-3-8B-Instruct.jinja", "llama3"},
                      TemplateCase{"microsoft-Phi-3-mini-4k-instruct.jinja", "phi3"},
                      TemplateCase{"HuggingFaceH4-zephyr-7b-beta.jinja", "zephyr"},
                      TemplateCase{"mistralai-Mistral-7B-Instruct-v0.1.jinja", "mistral"},
                      TemplateCase{"mistralai-Mistral-7B-Instruct-v0.1-2023.jinja", "mistral"},
                      TemplateCase{"openai-gpt-oss-120b.jinja", "harmony"},
                      TemplateCase{"Qwen-Qwen3-0.6B.jinja", "chatml"}));

TEST(ChatTemplate, EveryTemplateFileHasAnExpectation) {
  // A template added to either folder must be added to the lists above too.
  size_t files = 0;
  for (const std::string& folder : {kSharedTemplates, kReferenceTemplates}) {
    for (const auto& entry : std::filesystem::directory_iterator(folder)) files += entry.path().extension() == ".jinja";
  }
  EXPECT_EQ(files, 6u + 9u);
}

TEST(ChatTemplate, Llama31WritesItsDatedSystemHeader) {
  const ChatTemplate llama31 = detect_file(kSharedTemplates + "meta-llama-Llama-3.1-8B-Instruct.jinja");
  const std::string header =
      "<|start_header_id|>system<|end_header_id|>\n\n"
      "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  EXPECT_EQ(llama31.conversation_start(""), header + "<|eot_id|>");
  EXPECT_EQ(llama31.conversation_start("  Be brief.\n"), header + "Be brief.<|eot_id|>");
  EXPECT_TRUE(llama31.starts_with_bos());
}

TEST(ChatTemplate, Llama3WithoutDateWritesNoEmptySystemBlock) {
  const ChatTemplate llama3 = detect_file(kReferenceTemplates + "meta-llama-Meta-Llama-3-8B-Instruct.jinja");
  EXPECT_EQ(llama3.conversation_start(""), "");
  EXPECT_EQ(llama3.conversation_start("S"), "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>");
}

TEST(ChatTemplate, MistralSpacingFollowsTheTemplate) {
  const ChatTemplate nemo = detect_file(kSharedTemplates + "mistralai-Mistral-Nemo-Instruct-2407.jinja");
  EXPECT_EQ(nemo.user_turn("U", true, ""), "[INST]U[/INST]");
  EXPECT_EQ(nemo.assistant_reply("A"), "A</s>");

  const ChatTemplate v1 = detect_file(kReferenceTemplates + "mistralai-Mistral-7B-Instruct-v0.1.jinja");
  EXPECT_EQ(v1.user_turn("U", true, ""), " [INST] U [/INST]");
  EXPECT_EQ(v1.user_turn("U", true, "S"), " [INST] S\n\nU [/INST]");
  EXPECT_EQ(v1.assistant_reply("A"), " A</s>");

  const ChatTemplate v1_2023 = detect_file(kReferenceTemplates + "mistralai-Mistral-7B-Instruct-v0.1-2023.jinja");
  EXPECT_EQ(v1_2023.user_turn("U", false, ""), "[INST] U [/INST]");
  EXPECT_EQ(v1_2023.assistant_reply("A"), "A</s> ");
  EXPECT_EQ(v1_2023.reply_end(), "</s> ");
}

TEST(ChatTemplate, SpecialTokenTextsComeFromTheVocabulary) {
  const ChatSpecialTokens special{.bos = "<BOS>", .eos = "<EOS>"};
  const ChatTemplate zephyr = detect_file(kReferenceTemplates + "HuggingFaceH4-zephyr-7b-beta.jinja", special);
  EXPECT_EQ(zephyr.user_turn("U", true, ""), "<|user|>\nU<EOS>\n<|assistant|>\n");
  EXPECT_EQ(zephyr.end_of_turn(), "<EOS>");
  const ChatTemplate llama2 = ChatTemplate::from_name("llama2", special);
  EXPECT_EQ(llama2.user_turn("U", false, ""), "<BOS>[INST] U [/INST]");
  EXPECT_EQ(llama2.assistant_reply("A"), " A <EOS>");
}

// ---------------------------------------------------------------------------------------------
// Templates that are not recognised

TEST(ChatTemplate, UnknownTemplatesAreNotRecognised) {
  EXPECT_FALSE(ChatTemplate::detect(""));
  EXPECT_FALSE(ChatTemplate::detect("{% for message in messages %}{{ message['content'] }}{% endfor %}"));
  EXPECT_FALSE(ChatTemplate::detect("### Instruction:\n{{ prompt }}\n### Response:"));
  // "<|assistant|>" alone (neither Phi-3's <|end|> nor Zephyr's <|user|>) is not enough.
  EXPECT_FALSE(ChatTemplate::detect("{{ '<|assistant|>' }}"));
  std::string every_byte;
  for (int i = 0; i < 256; ++i) every_byte += static_cast<char>(i);
  EXPECT_FALSE(ChatTemplate::detect(every_byte + every_byte));
}

TEST(ChatTemplate, TenMegabytesOfGarbageIsNotRecognised) {
  std::mt19937 rng(7);
  std::string garbage(10 << 20, '\0');
  for (char& c : garbage) c = static_cast<char>(rng() & 0xFF);
  EXPECT_FALSE(ChatTemplate::detect(garbage));
}

TEST(ChatTemplate, HugeChatMlTemplatesAreReadInLinearTime) {
  // Every occurrence of the system header could start a default system prompt: each must not
  // rescan the rest of the text.
  std::string repeated;
  for (size_t i = 0; repeated.size() < (10u << 20); ++i) repeated += "<|im_start|>system\nabc ";
  const auto start = std::chrono::steady_clock::now();
  const std::optional<ChatTemplate> open = ChatTemplate::detect(repeated);
  const std::optional<ChatTemplate> closed = ChatTemplate::detect(repeated + "<|im_end|>");
  const std::optional<ChatTemplate> quoted = ChatTemplate::detect(repeated + "'<|im_end|>");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(open && closed && quoted);
  EXPECT_EQ(open->default_system_prompt(), "");
  EXPECT_EQ(closed->default_system_prompt().substr(0, 6), "abc <|");
  EXPECT_EQ(quoted->default_system_prompt(), "");
  EXPECT_LT(seconds, 20.0);  // quadratic would take hours
}

// ---------------------------------------------------------------------------------------------
// Default system prompt

TEST(ChatTemplate, SmolLm2DefaultSystemPrompt) {
  // SmolLM2-135M-Instruct's template as its GGUF carries it: the newlines are real ones.
  const std::string smollm2 =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
      "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  const std::optional<ChatTemplate> chat_template = ChatTemplate::detect(smollm2);
  ASSERT_TRUE(chat_template);
  EXPECT_EQ(chat_template->name(), "chatml");
  const std::string expected = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
  EXPECT_EQ(chat_template->default_system_prompt(), expected);
  EXPECT_EQ(detect_file(kReferenceTemplates + "HuggingFaceTB-SmolLM2-135M-Instruct.jinja").default_system_prompt(),
            expected);
}

TEST(ChatTemplate, QwenDefaultSystemPrompt) {
  // Qwen's template writes "\n" escapes, and its first "<|im_start|>system\n" is a string of its
  // own (followed by a quote): only the literal block counts.
  EXPECT_EQ(detect_file(kSharedTemplates + "Qwen-Qwen2.5-7B-Instruct.jinja").default_system_prompt(),
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
}

TEST(ChatTemplate, NoDefaultSystemPromptWhereTheBlockIsBuilt) {
  EXPECT_EQ(detect_file(kSharedTemplates + "HuggingFaceTB-SmolLM3-3B.jinja").default_system_prompt(), "");
  // The block that writes the caller's system message is not a default.
  EXPECT_EQ(ChatTemplate::detect("{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}")
                ->default_system_prompt(),
            "");
  EXPECT_EQ(ChatTemplate::detect("{{ '<|im_start|>user\\nHi<|im_end|>' }}")->default_system_prompt(), "");
  // Escapes in the literal become the characters they stand for.
  EXPECT_EQ(ChatTemplate::detect("{{ '<|im_start|>system\\nLine one.\\nLine two.<|im_end|>\\n' }}")
                ->default_system_prompt(),
            "Line one.\nLine two.");
  // Only ChatML templates carry one.
  EXPECT_EQ(ChatTemplate::from_name("chatml").default_system_prompt(), "");
}

// ---------------------------------------------------------------------------------------------
// Names

TEST(ChatTemplate, NamesRoundTrip) {
  const std::vector<std::string_view> names = ChatTemplate::names();
  EXPECT_THAT(names,
              ::testing::ElementsAre("chatml", "llama2", "llama3", "gemma", "phi3", "mistral", "zephyr", "harmony"));
  std::vector<ChatFormat> formats;
  for (std::string_view name : names) {
    const ChatTemplate chat_template = ChatTemplate::from_name(name);
    EXPECT_EQ(chat_template.name(), name);
    formats.push_back(chat_template.format());
  }
  EXPECT_THAT(formats, ::testing::ElementsAre(ChatFormat::kChatMl, ChatFormat::kLlama2, ChatFormat::kLlama3,
                                              ChatFormat::kGemma, ChatFormat::kPhi3, ChatFormat::kMistral,
                                              ChatFormat::kZephyr, ChatFormat::kHarmony));
}

TEST(ChatTemplate, UnknownNameListsTheKnownOnes) {
  try {
    ChatTemplate::from_name("vicuna");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_THAT(message, HasSubstr("vicuna"));
    for (std::string_view name : ChatTemplate::names()) EXPECT_THAT(message, HasSubstr(std::string(name)));
  }
  EXPECT_THROW(ChatTemplate::from_name(""), std::invalid_argument);
  EXPECT_THROW(ChatTemplate::from_name("ChatML"), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Renderings, written out from each format's description

TEST(ChatTemplate, ChatMlRendering) {
  const ChatTemplate chatml = ChatTemplate::from_name("chatml");
  EXPECT_FALSE(chatml.starts_with_bos());
  EXPECT_EQ(chatml.render(two_turns_with_system()),
            "<|im_start|>system\nS<|im_end|>\n"
            "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n"
            "A1<|im_end|>\n"
            "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<ChatMessage> untrimmed = {{"user", " hi \n"}};
  EXPECT_EQ(chatml.render(untrimmed), "<|im_start|>user\n hi \n<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chatml.conversation_start(""), "");
  EXPECT_EQ(chatml.reply_end(), "<|im_end|>\n");
  EXPECT_EQ(chatml.end_of_turn(), "<|im_end|>");
}

TEST(ChatTemplate, Llama3Rendering) {
  const ChatTemplate llama3 = ChatTemplate::from_name("llama3");
  EXPECT_TRUE(llama3.starts_with_bos());
  const std::vector<ChatMessage> messages = {
      {"system", " S\n"}, {"user", "\tU1 "}, {"assistant", "\nA1\n"}, {"user", "U2"}};
  EXPECT_EQ(llama3.render(messages),
            "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
            "A1<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(llama3.end_of_turn(), "<|eot_id|>");
}

TEST(ChatTemplate, GemmaRendering) {
  const ChatTemplate gemma = ChatTemplate::from_name("gemma");
  EXPECT_TRUE(gemma.starts_with_bos());
  const std::vector<ChatMessage> messages = {
      {"system", " S"}, {"user", "U1 "}, {"assistant", " A1 "}, {"user", " U2"}};
  EXPECT_EQ(gemma.render(messages),
            "<start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\n"
            "A1<end_of_turn>\n"
            "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(gemma.conversation_start("S"), "");
  EXPECT_EQ(gemma.end_of_turn(), "<end_of_turn>");
}

TEST(ChatTemplate, Phi3Rendering) {
  const ChatTemplate phi3 = ChatTemplate::from_name("phi3");
  EXPECT_FALSE(phi3.starts_with_bos());
  EXPECT_EQ(phi3.render(two_turns_with_system()),
            "<|system|>\nS<|end|>\n"
            "<|user|>\nU1<|end|>\n<|assistant|>\n"
            "A1<|end|>\n"
            "<|user|>\nU2<|end|>\n<|assistant|>\n");
  EXPECT_EQ(phi3.conversation_start(""), "");
  EXPECT_EQ(phi3.end_of_turn(), "<|end|>");
}

TEST(ChatTemplate, ZephyrRendering) {
  const ChatTemplate zephyr = ChatTemplate::from_name("zephyr");
  EXPECT_FALSE(zephyr.starts_with_bos());
  EXPECT_EQ(zephyr.render(two_turns_with_system()),
            "<|system|>\nS</s>\n"
            "<|user|>\nU1</s>\n<|assistant|>\n"
            "A1</s>\n"
            "<|user|>\nU2</s>\n<|assistant|>\n");
  EXPECT_EQ(zephyr.end_of_turn(), "</s>");
}

TEST(ChatTemplate, Llama2Rendering) {
  const ChatTemplate llama2 = ChatTemplate::from_name("llama2");
  EXPECT_TRUE(llama2.starts_with_bos());
  EXPECT_EQ(llama2.render(two_turns_with_system()),
            "[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST]"
            " A1 </s>"
            "<s>[INST] U2 [/INST]");
  const std::vector<ChatMessage> no_system = {{"user", " U1 "}, {"assistant", " A1\n"}, {"user", "\nU2"}};
  EXPECT_EQ(llama2.render(no_system), "[INST] U1 [/INST] A1 </s><s>[INST] U2 [/INST]");
  // The template strips the first message together with its <<SYS>> block: the message keeps
  // its leading whitespace there, and the system prompt is not stripped at all.
  EXPECT_EQ(llama2.user_turn(" U ", true, " S "), "[INST] <<SYS>>\n S \n<</SYS>>\n\n U [/INST]");
  EXPECT_EQ(llama2.end_of_turn(), "</s>");
}

TEST(ChatTemplate, MistralRendering) {
  const ChatTemplate mistral = ChatTemplate::from_name("mistral");
  EXPECT_TRUE(mistral.starts_with_bos());
  EXPECT_EQ(mistral.render(two_turns_with_system()),
            "[INST] S\n\nU1 [/INST]"
            "A1</s>"
            "[INST] U2 [/INST]");
  const std::vector<ChatMessage> untrimmed = {{"user", " U "}};
  EXPECT_EQ(mistral.render(untrimmed), "[INST]  U  [/INST]");
  EXPECT_EQ(mistral.end_of_turn(), "</s>");
}

TEST(ChatTemplate, TrimmingIsPythonsStrip) {
  // Jinja's trim is Python's str.strip(): Unicode whitespace goes too (U+3000, U+00A0, U+0085,
  // U+2028, U+001C), other characters and bytes that are not UTF-8 stay.
  const ChatTemplate llama3 = ChatTemplate::from_name("llama3");
  EXPECT_EQ(llama3.assistant_reply("\xE3\x80\x80\xC2\xA0 caf\xC3\xA9 \xF0\x9F\x99\x82\xC2\x85\xE2\x80\xA8\x1C"),
            "caf\xC3\xA9 \xF0\x9F\x99\x82<|eot_id|>");
  EXPECT_EQ(llama3.assistant_reply(" \xFF x \xFF "), "\xFF x \xFF<|eot_id|>");
  EXPECT_EQ(llama3.assistant_reply("x \xE3\x80"), "x \xE3\x80<|eot_id|>");  // a cut-off U+3000
  EXPECT_EQ(llama3.assistant_reply("\xE2\x80\x8B" "x"), "\xE2\x80\x8Bx<|eot_id|>");  // U+200B is not whitespace
  EXPECT_EQ(llama3.assistant_reply(" \t\n "), "<|eot_id|>");
}

TEST(ChatTemplate, HarmonyRendering) {
  ChatTemplate harmony = ChatTemplate::from_name("harmony");
  harmony.set_date("2025-08-05");
  EXPECT_FALSE(harmony.starts_with_bos());
  EXPECT_EQ(harmony.default_system_prompt(), "");
  const std::string system_block =
      "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
      "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
      "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>";
  // The system message is the developer's; a past reply is its final channel, closed by <|end|>.
  EXPECT_EQ(harmony.render(two_turns_with_system()),
            system_block +
                "<|start|>developer<|message|># Instructions\n\nS\n\n<|end|>"
                "<|start|>user<|message|>U1<|end|><|start|>assistant"
                "<|channel|>final<|message|>A1<|end|>"
                "<|start|>user<|message|>U2<|end|><|start|>assistant");
  // The system block is written without a system message too; contents are not trimmed.
  EXPECT_EQ(harmony.conversation_start(""), system_block);
  EXPECT_EQ(harmony.user_turn(" U \n", true, "S"), "<|start|>user<|message|> U \n<|end|><|start|>assistant");
  EXPECT_EQ(harmony.end_of_turn(), "<|return|>");
  EXPECT_THAT(harmony.end_markers(), ::testing::ElementsAre("<|return|>", "<|call|>"));
  EXPECT_TRUE(harmony.has_channels());
  EXPECT_FALSE(ChatTemplate::from_name("chatml").has_channels());
}

TEST(ChatTemplate, HarmonyDateIsTodaysUnlessSet) {
  // Unset, a rendering says today's local date, as the template's strftime_now("%Y-%m-%d"); the
  // local date is within a day of the UTC one.
  const std::string today = ChatTemplate::today();
  ASSERT_EQ(today.size(), 10u);
  const auto utc = std::chrono::year_month_day(std::chrono::floor<std::chrono::days>(std::chrono::system_clock::now()));
  int year = 0;
  unsigned month = 0, day = 0;
  ASSERT_EQ(std::sscanf(today.c_str(), "%4d-%2u-%2u", &year, &month, &day), 3) << today;
  const std::chrono::year_month_day local{std::chrono::year(year), std::chrono::month(month), std::chrono::day(day)};
  ASSERT_TRUE(local.ok()) << today;
  const auto apart = std::chrono::sys_days(local) - std::chrono::sys_days(utc);
  EXPECT_LE(std::abs(apart.count()), 1) << today;

  const ChatTemplate harmony = ChatTemplate::from_name("harmony");
  EXPECT_EQ(harmony.date(), "");
  EXPECT_THAT(harmony.conversation_start(""), HasSubstr("\nCurrent date: " + today + "\n"));
  ChatTemplate fixed = harmony;
  fixed.set_date("1999-12-31");
  EXPECT_THAT(fixed.conversation_start(""), HasSubstr("\nCurrent date: 1999-12-31\n"));
}

TEST(ChatTemplate, HarmonyReasoningEffortIsItsSystemBlocksReasoningLine) {
  ChatTemplate harmony = ChatTemplate::from_name("harmony");
  harmony.set_date("2025-08-05");
  const std::vector<ChatMessage> messages = {{"system", "S"}, {"user", "U"}};
  std::string want = harmony.render(messages);
  ASSERT_NE(want.find("Reasoning: medium\n"), std::string::npos);
  want.replace(want.find("Reasoning: medium"), 17, "Reasoning: high");
  harmony.set_reasoning_effort("high");
  EXPECT_EQ(harmony.render(messages), want);
  EXPECT_THROW(harmony.set_reasoning_effort("max"), std::invalid_argument);
  EXPECT_EQ(harmony.reasoning_effort(), "high");
}

TEST(ChatTemplate, HarmonyIsRecognisedByItsChannelMarkers) {
  EXPECT_EQ(ChatTemplate::detect("{{ '<|start|>assistant<|channel|>final<|message|>' }}")->name(), "harmony");
  // Neither marker alone is harmony: Phi-3's <|end|> and <|assistant|> are not either.
  EXPECT_FALSE(ChatTemplate::detect("{{ '<|channel|>' }}"));
  EXPECT_EQ(ChatTemplate::detect("{{ '<|user|>' + m + '<|end|><|assistant|>' }}")->name(), "phi3");
}

// ---------------------------------------------------------------------------------------------
// Replies read back: harmony's channels

ReplyDelta parse_harmony(std::string_view reply) {
  return ReplyParser::parse(ChatTemplate::from_name("harmony"), reply);
}

// What gpt-oss writes after the generation prompt "<|start|>assistant" (its <|return|> ends
// generation and is not part of the text).
constexpr std::string_view kHarmonyReply =
    "<|channel|>analysis<|message|>The user asks 2+2. Simple: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4** <|b|> a<|x\n";

TEST(ReplyParser, HarmonySplitsReasoningFromTheAnswer) {
  const ReplyDelta parts = parse_harmony(kHarmonyReply);
  EXPECT_EQ(parts.reasoning, "The user asks 2+2. Simple: 4.");
  // "<|b|>" and "<|x" are no markers of the format: text.
  EXPECT_EQ(parts.content, "2 + 2 = **4** <|b|> a<|x\n");
}

// A reply pushed in `pieces` hands out, piece by piece, the start of what it gives whole, and
// all of it by the end: nothing handed out is ever taken back (no piece of a marker or a tag, no
// whitespace that is trimmed later).
void expect_pieces_give_the_whole(const ChatTemplate& chat_template, std::span<const std::string_view> pieces,
                                  const ReplyDelta& whole) {
  ReplyParser parser(chat_template);
  std::string content, reasoning;
  for (std::string_view piece : pieces) {
    const ReplyDelta delta = parser.push(piece);
    content += delta.content;
    reasoning += delta.reasoning;
    ASSERT_EQ(whole.content.substr(0, content.size()), content);
    ASSERT_EQ(whole.reasoning.substr(0, reasoning.size()), reasoning);
  }
  const ReplyDelta rest = parser.finish();
  EXPECT_EQ(content + rest.content, whole.content);
  EXPECT_EQ(reasoning + rest.reasoning, whole.reasoning);
  EXPECT_EQ(parser.content(), whole.content);
  EXPECT_EQ(parser.reasoning(), whole.reasoning);
}

TEST(ReplyParser, HarmonyStreamedInPiecesCutAnywhereIsTheWholeReply) {
  const ChatTemplate harmony = ChatTemplate::from_name("harmony");
  const ReplyDelta whole = ReplyParser::parse(harmony, kHarmonyReply);
  // Two pieces cut at every byte, and every byte a piece of its own.
  for (size_t cut = 0; cut <= kHarmonyReply.size(); ++cut) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const std::string_view pieces[] = {kHarmonyReply.substr(0, cut), kHarmonyReply.substr(cut)};
    expect_pieces_give_the_whole(harmony, pieces, whole);
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < kHarmonyReply.size(); ++i) bytes.push_back(kHarmonyReply.substr(i, 1));
  expect_pieces_give_the_whole(harmony, bytes, whole);
}

TEST(ReplyParser, HarmonyHoldsBackOnlyWhatCouldStillBeAMarker) {
  ReplyParser parser(ChatTemplate::from_name("harmony"));
  EXPECT_EQ(parser.push("<|channel|>final<|message|>Hi <").content, "Hi ");
  EXPECT_EQ(parser.push("|mess").content, "");   // "<|mess" may become <|message|>
  EXPECT_EQ(parser.push("y").content, "<|messy");  // it cannot any more
  EXPECT_EQ(parser.push(" <|en").content, " ");
  EXPECT_EQ(parser.finish().content, "<|en");  // the reply ended: it was text
  EXPECT_EQ(parser.content(), "Hi <|messy <|en");
}

TEST(ReplyParser, HarmonyMessagesGoWhereLlamaServerPutsThem) {
  // The commentary channel's preamble is part of the answer.
  EXPECT_EQ(parse_harmony("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
                          "<|channel|>final<|message|>Done.")
                .content,
            "Let me check.Done.");
  // A tool call (a recipient other than the assistant) is neither answer nor reasoning, in either
  // place its recipient may be written, with or without <|constrain|>.
  const ReplyDelta call = parse_harmony(
      "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
      "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}");
  EXPECT_EQ(call.reasoning, "Need weather.");
  EXPECT_EQ(call.content, "");
  EXPECT_EQ(parse_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}").content, "");
  EXPECT_EQ(parse_harmony(" to=functions.f<|channel|>commentary json<|message|>{}").content, "");
  // gpt-oss sometimes writes a commentary channel to the assistant before the real one.
  const ReplyDelta stray = parse_harmony("<|channel|>commentary to=assistant<|channel|>analysis<|message|>hmm<|end|>"
                                         "<|start|>assistant<|channel|>final<|message|>ok");
  EXPECT_EQ(stray.reasoning, "hmm");
  EXPECT_EQ(stray.content, "ok");
  // A final message whose format is constrained: the type is part of the header.
  EXPECT_EQ(parse_harmony("<|channel|>final <|constrain|>json<|message|>{\"a\": 1}").content, "{\"a\": 1}");
}

TEST(ReplyParser, HarmonyRepliesThatBreakTheFormat) {
  // No header at all: the text is the answer.
  EXPECT_EQ(parse_harmony("Just an answer.").content, "Just an answer.");
  EXPECT_EQ(parse_harmony(" t").content, " t");  // the start of a recipient, then the reply ended
  // A new channel without <|end|><|start|>assistant before it starts a new message.
  const ReplyDelta skipped = parse_harmony("<|channel|>analysis<|message|>think<|channel|>final<|message|>answer");
  EXPECT_EQ(skipped.reasoning, "think");
  EXPECT_EQ(skipped.content, "answer");
  // Cut off while thinking (a token limit): reasoning only. Markers never reach either part.
  const ReplyDelta cut = parse_harmony("<|channel|>analysis<|message|>hmm <|start|>assistant<|channel|>fi");
  EXPECT_EQ(cut.reasoning, "hmm ");
  EXPECT_EQ(cut.content, "");
  EXPECT_EQ(parse_harmony("<|channel|>final<|message|>a<|message|>b<|constrain|>c<|end|>stray<|return|>").content,
            "abc");
}

TEST(ReplyParser, OtherFormatsAreAllContent) {
  ReplyParser parser(ChatTemplate::from_name("chatml"));
  EXPECT_EQ(parser.push("<|channel|>analysis<|message|>x <").content, "<|channel|>analysis<|message|>x <");
  EXPECT_EQ(parser.finish().content, "");
  EXPECT_EQ(parser.reasoning(), "");
}

// ---------------------------------------------------------------------------------------------
// Replies read back: think tags (Qwen3)

// A ChatML template that handles think tags, as Qwen3's does (its test: the tag's markers).
constexpr std::string_view kThinkingChatMl =
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if '</think>' in message.content %}{{ message.content.split('</think>')[-1] }}{%- endif %}"
    "{{ message.content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}";

// What Qwen3 writes after "<|im_start|>assistant\n".
constexpr std::string_view kThinkingReply = "<think>\nThe user asks 2+2.\n\nSimple: 4. </thin k>\n</think>\n\n2 + 2 = **4**\n";

ReplyDelta parse_thinking(std::string_view reply) {
  return ReplyParser::parse(*ChatTemplate::detect(kThinkingChatMl), reply);
}

TEST(ReplyParser, ThinkTagsAreRecognisedInTheTemplate) {
  EXPECT_TRUE(detect_file(kReferenceTemplates + "Qwen-Qwen3-0.6B.jinja").has_think_tags());
  EXPECT_FALSE(detect_file(kSharedTemplates + "Qwen-Qwen2.5-7B-Instruct.jinja").has_think_tags());
  EXPECT_TRUE(ChatTemplate::detect(kThinkingChatMl)->has_think_tags());
  EXPECT_EQ(ChatTemplate::detect(kThinkingChatMl)->name(), "chatml");
  EXPECT_FALSE(ChatTemplate::from_name("chatml").has_think_tags());
  EXPECT_FALSE(ChatTemplate::from_name("harmony").has_think_tags());
}

TEST(ReplyParser, ThinkTagsSplitReasoningFromTheAnswerTrimmed) {
  const ReplyDelta parts = parse_thinking(kThinkingReply);
  EXPECT_EQ(parts.reasoning, "The user asks 2+2.\n\nSimple: 4. </thin k>");
  EXPECT_EQ(parts.content, "2 + 2 = **4**\n");
  // No thinking: the reply as it came, leading whitespace and all; empty thinking: no reasoning.
  EXPECT_EQ(parse_thinking("  Hello <think>x</think>").content, "  Hello <think>x</think>");
  EXPECT_EQ(parse_thinking("  Hello <think>x</think>").reasoning, "");
  EXPECT_EQ(parse_thinking("<think>\n\n</think>\n\nHi").reasoning, "");
  EXPECT_EQ(parse_thinking("<think>\n\n</think>\n\nHi").content, "Hi");
  // Cut short while thinking: what it thought is reasoning; "<thi" alone is text.
  EXPECT_EQ(parse_thinking("\n<think> deep thought\n</thi").reasoning, "deep thought\n</thi");
  EXPECT_EQ(parse_thinking("\n<think> deep thought\n</thi").content, "");
  EXPECT_EQ(parse_thinking("<thi").content, "<thi");
}

TEST(ReplyParser, ThinkTagsStreamedInPiecesCutAnywhereAreTheWholeReply) {
  const ChatTemplate thinking = *ChatTemplate::detect(kThinkingChatMl);
  for (const std::string_view reply : {kThinkingReply, std::string_view("<think>a  </think>  b  "), std::string_view("<tx")}) {
    const ReplyDelta whole = ReplyParser::parse(thinking, reply);
    for (size_t cut = 0; cut <= reply.size(); ++cut) {
      for (size_t cut2 = cut; cut2 <= reply.size(); cut2 += 3) {
        SCOPED_TRACE("cuts at " + std::to_string(cut) + ", " + std::to_string(cut2));
        const std::string_view pieces[] = {reply.substr(0, cut), reply.substr(cut, cut2 - cut), reply.substr(cut2)};
        expect_pieces_give_the_whole(thinking, pieces, whole);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pieces and render()

class EveryFormat : public ::testing::TestWithParam<std::string_view> {};

TEST_P(EveryFormat, PiecesConcatenateToRender) {
  const ChatTemplate chat_template = ChatTemplate::from_name(GetParam());
  for (const std::string system : {"", "You are terse."}) {
    std::vector<ChatMessage> messages;
    if (!system.empty()) messages.push_back({"system", system});
    messages.push_back({"user", " first question \n"});
    messages.push_back({"assistant", " first answer\n"});
    messages.push_back({"user", "caf\xC3\xA9 \xF0\x9F\x99\x82"});
    const std::string pieces = chat_template.conversation_start(system) +
                               chat_template.user_turn(" first question \n", true, system) +
                               chat_template.assistant_reply(" first answer\n") +
                               chat_template.user_turn("caf\xC3\xA9 \xF0\x9F\x99\x82", false, system);
    EXPECT_EQ(chat_template.render(messages), pieces) << "system: '" << system << "'";
  }
}

TEST_P(EveryFormat, ReplyEndClosesEveryReplyAndHoldsTheEndOfTurn) {
  const ChatTemplate chat_template = ChatTemplate::from_name(GetParam());
  const std::string reply = chat_template.assistant_reply("answer");
  const std::string end = chat_template.reply_end();
  ASSERT_GE(reply.size(), end.size());
  EXPECT_EQ(reply.substr(reply.size() - end.size()), end);
  EXPECT_FALSE(chat_template.end_of_turn().empty());
  EXPECT_EQ(chat_template.end_markers().front(), chat_template.end_of_turn());
  if (chat_template.has_channels()) {
    // Harmony: the model ends a reply with <|return|>, which a past reply is written without.
    EXPECT_EQ(end, "<|end|>");
    EXPECT_EQ(chat_template.end_of_turn(), "<|return|>");
  } else {
    EXPECT_THAT(end, HasSubstr(chat_template.end_of_turn()));
  }
}

TEST_P(EveryFormat, EmptyConversationIsTheConversationStart) {
  const ChatTemplate chat_template = ChatTemplate::from_name(GetParam());
  EXPECT_EQ(chat_template.render({}), chat_template.conversation_start(""));
  const std::vector<ChatMessage> only_system = {{"system", "S"}};
  EXPECT_EQ(chat_template.render(only_system), chat_template.conversation_start("S"));
}

TEST_P(EveryFormat, MalformedConversationsAreRejected) {
  const ChatTemplate chat_template = ChatTemplate::from_name(GetParam());
  const auto expect_rejected = [&](std::vector<ChatMessage> messages, const std::string& index,
                                   const std::string& role) {
    try {
      chat_template.render(messages);
      ADD_FAILURE() << "accepted a conversation whose message " << index << " is '" << role << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("message " + index));
      EXPECT_THAT(e.what(), HasSubstr("'" + role + "'"));
    }
  };
  expect_rejected({{"user", "a"}, {"tool", "b"}}, "1", "tool");
  expect_rejected({{"user", "a"}, {"system", "b"}}, "1", "system");
  expect_rejected({{"system", "a"}, {"system", "b"}}, "1", "system");
  expect_rejected({{"user", "a"}, {"user", "b"}}, "1", "user");
  expect_rejected({{"assistant", "a"}}, "0", "assistant");
  expect_rejected({{"system", "s"}, {"assistant", "a"}}, "1", "assistant");
  expect_rejected({{"system", "s"}, {"user", "u"}, {"assistant", "a"}, {"assistant", "b"}}, "3", "assistant");
  expect_rejected({{"User", "a"}}, "0", "User");
  // A conversation may end with the assistant's reply.
  EXPECT_NO_THROW(chat_template.render(std::vector<ChatMessage>{{"user", "u"}, {"assistant", "a"}}));
}

INSTANTIATE_TEST_SUITE_P(ChatTemplate, EveryFormat, ::testing::ValuesIn(ChatTemplate::names()),
                         [](const ::testing::TestParamInfo<std::string_view>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace ringlm

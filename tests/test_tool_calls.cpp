// Tool calls (core/session/tool_calls.h): the parser against replies written by hand in each
// family's syntax, fed whole and cut at every byte; python_json against Python's json.dumps
// output (written here as Python prints it); the forcing grammar against calls it must accept
// and replies it must refuse.
#include "core/session/tool_calls.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/grammar/grammar.h"

namespace ringlm {
namespace {

struct Expected {
  std::string name;
  std::string arguments;  // compact JSON, as nlohmann dumps it
};

// The reply read in pieces cut at `cut` bytes each (0: whole), joined back.
ToolCallParser::Delta read_in_pieces(ToolSyntax syntax, const std::string& reply, size_t cut) {
  ToolCallParser parser(syntax, /*seed=*/1);
  ToolCallParser::Delta all;
  const auto add = [&](ToolCallParser::Delta d) {
    all.content += d.content;
    all.calls.insert(all.calls.end(), d.calls.begin(), d.calls.end());
  };
  for (size_t at = 0; at < reply.size(); at += cut == 0 ? reply.size() : cut) {
    add(parser.push(std::string_view(reply).substr(at, cut == 0 ? reply.size() : cut)));
  }
  add(parser.finish());
  return all;
}

void expect_reply(ToolSyntax syntax, const std::string& reply, const std::string& content,
                  const std::vector<Expected>& calls) {
  for (size_t cut : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{7}}) {
    SCOPED_TRACE("pieces of " + std::to_string(cut) + " bytes: " + reply);
    const ToolCallParser::Delta got = read_in_pieces(syntax, reply, cut);
    EXPECT_EQ(got.content, content);
    ASSERT_EQ(got.calls.size(), calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(got.calls[i].name, calls[i].name);
      EXPECT_EQ(nlohmann::json::parse(got.calls[i].arguments), nlohmann::json::parse(calls[i].arguments));
      EXPECT_FALSE(got.calls[i].id.empty());
    }
  }
}

TEST(ToolCallParser, HermesBlocksBetweenText) {
  expect_reply(ToolSyntax::kHermes,
               "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": [2, {\"c\": null}]}}\n</tool_call>",
               "Let me look.", {{"get_weather", R"({"city":"Zürich"})"}, {"add", R"({"a":1,"b":[2,{"c":null}]})"}});
}

TEST(ToolCallParser, HermesTextOnlyAndTextThatLooksLikeATag) {
  expect_reply(ToolSyntax::kHermes, "Plain answer with a < sign and <tool_ca", "Plain answer with a < sign and <tool_ca", {});
  expect_reply(ToolSyntax::kHermes, "  spaced  \n", "  spaced  \n", {});
}

TEST(ToolCallParser, HermesCallWithoutClosingTagOrWithBadJsonStaysReadable) {
  // The model ended right after the JSON: the call is whole.
  expect_reply(ToolSyntax::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}", "", {{"f", "{}"}});
  // Not JSON: the text stays, as written.
  expect_reply(ToolSyntax::kHermes, "<tool_call>\n{\"name\": \"f\", \"argu</tool_call>",
               "<tool_call>\n{\"name\": \"f\", \"argu</tool_call>", {});
  // No name: not a call.
  expect_reply(ToolSyntax::kHermes, "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>", {});
  // Arguments given as a JSON string (some models do): taken as they are.
  expect_reply(ToolSyntax::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>", "",
               {{"f", R"({"x":1})"}});
}

TEST(ToolCallParser, Llama3WholeReplyIsTheCall) {
  expect_reply(ToolSyntax::kLlama3, "\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", "",
               {{"get_weather", R"({"city":"Oslo"})"}});
  expect_reply(ToolSyntax::kLlama3, "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}", "", {{"add", R"({"a":1})"}});
  // A reply that does not start as a call is text, braces and all.
  expect_reply(ToolSyntax::kLlama3, "Sure: {\"name\": \"x\"}", "Sure: {\"name\": \"x\"}", {});
  // One that starts as a call but is not JSON stays text too.
  expect_reply(ToolSyntax::kLlama3, "{not json", "{not json", {});
}

TEST(ToolCallParser, MistralCallsAfterTheMarker) {
  expect_reply(ToolSyntax::kMistral,
               "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}, \"id\": \"abc123xyz\"}, {\"name\": \"b\", \"arguments\": {}}]",
               "", {{"a", R"({"x":1})"}, {"b", "{}"}});
  expect_reply(ToolSyntax::kMistral, "Checking. [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]", "Checking. ", {{"a", "{}"}});
  expect_reply(ToolSyntax::kMistral, "No calls [TOOL_ here", "No calls [TOOL_ here", {});
}

TEST(ToolCallParser, IdsAreUniqueAndInEachFamilysForm) {
  const ToolCallParser::Delta mistral = ToolCallParser::parse(
      ToolSyntax::kMistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"a\", \"arguments\": {}}]");
  ASSERT_EQ(mistral.calls.size(), 2u);
  EXPECT_NE(mistral.calls[0].id, mistral.calls[1].id);
  for (const ToolCall& call : mistral.calls) EXPECT_EQ(call.id.size(), 9u);  // Mistral's template's rule
  const ToolCallParser::Delta hermes = ToolCallParser::parse(ToolSyntax::kHermes, "<tool_call>{\"name\": \"a\"}</tool_call>");
  ASSERT_EQ(hermes.calls.size(), 1u);
  EXPECT_EQ(hermes.calls[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(hermes.calls[0].arguments, "{}");
}

TEST(PythonJson, WritesAsJsonDumps) {
  // Python: json.dumps(value, ensure_ascii=False) and json.dumps(value, ensure_ascii=False, indent=2).
  const OrderedJson value = OrderedJson::parse(R"({"b": 1, "a": [true, null, 2.5, "é\n\"x\""], "e": {}, "f": []})");
  EXPECT_EQ(python_json(value), R"({"b": 1, "a": [true, null, 2.5, "é\n\"x\""], "e": {}, "f": []})");
  EXPECT_EQ(python_json(value, 2),
            "{\n  \"b\": 1,\n  \"a\": [\n    true,\n    null,\n    2.5,\n    \"é\\n\\\"x\\\"\"\n  ],\n  \"e\": {},\n  \"f\": []\n}");
  EXPECT_EQ(arguments_for_template(R"({"x":1,"a":"b"})"), R"({"x": 1, "a": "b"})");
  EXPECT_EQ(arguments_for_template("not json"), "not json");
}

std::vector<ToolDefinition> two_tools() {
  return {ToolDefinition::from_openai(OrderedJson::parse(R"({"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"},
             "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"], "additionalProperties": false}}})")),
          ToolDefinition::from_openai(OrderedJson::parse(R"({"type": "function", "function": {"name": "tree",
             "parameters": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
             "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "additionalProperties": false}}}}})"))};
}

std::shared_ptr<const Grammar> grammar_for(ToolSyntax syntax, bool parallel) {
  return Grammar::parse(tool_call_gbnf(syntax, two_tools(), parallel));
}

TEST(ToolCallGrammar, HermesAcceptsCallsOfTheToolsOnly) {
  const auto one = grammar_for(ToolSyntax::kHermes, false);
  EXPECT_TRUE(grammar_matches(one, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}\n</tool_call>"));
  // The tool's own $defs and $refs still resolve (recursion included).
  EXPECT_TRUE(grammar_matches(one, "<tool_call>\n{\"name\": \"tree\", \"arguments\": {\"kids\": [{\"kids\": []}]}}\n</tool_call>"));
  EXPECT_FALSE(grammar_matches(one, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"celsius\"}}\n</tool_call>"));
  EXPECT_FALSE(grammar_matches(one, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(grammar_matches(one, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"x\": 1}}\n</tool_call>"));
  EXPECT_FALSE(grammar_matches(one, "Sure. <tool_call>\n{\"name\": \"tree\", \"arguments\": {}}\n</tool_call>"));
  const std::string call = "<tool_call>\n{\"name\": \"tree\", \"arguments\": {}}\n</tool_call>";
  EXPECT_FALSE(grammar_matches(one, call + "\n" + call));
  EXPECT_TRUE(grammar_matches(grammar_for(ToolSyntax::kHermes, true), call + "\n" + call));
}

TEST(ToolCallGrammar, Llama3AndMistralShapes) {
  EXPECT_TRUE(grammar_matches(grammar_for(ToolSyntax::kLlama3, false),
                              "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"));
  EXPECT_FALSE(grammar_matches(grammar_for(ToolSyntax::kLlama3, false),
                               "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"));
  const std::string a = "{\"name\": \"tree\", \"arguments\": {}}";
  EXPECT_TRUE(grammar_matches(grammar_for(ToolSyntax::kMistral, false), "[" + a + "]"));
  EXPECT_FALSE(grammar_matches(grammar_for(ToolSyntax::kMistral, false), "[" + a + ", " + a + "]"));
  EXPECT_TRUE(grammar_matches(grammar_for(ToolSyntax::kMistral, true), "[" + a + ", " + a + "]"));
  EXPECT_FALSE(grammar_matches(grammar_for(ToolSyntax::kMistral, true), "[]"));
}

TEST(ToolCallGrammar, HarmonyOneMessageToAFunctionAfterOptionalReasoning) {
  const auto grammar = grammar_for(ToolSyntax::kHarmony, true);
  const std::string call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}";
  EXPECT_TRUE(grammar_matches(grammar, call));
  EXPECT_TRUE(grammar_matches(grammar, "<|channel|>analysis<|message|>Weather, so call it.<|end|><|start|>assistant" + call));
  EXPECT_TRUE(grammar_matches(grammar, "<|channel|>commentary to=functions.tree <|constrain|>json<|message|>{\"kids\": []}"));
  // The arguments are the named tool's, not another's; one call only.
  EXPECT_FALSE(grammar_matches(grammar, "<|channel|>commentary to=functions.tree <|constrain|>json<|message|>{\"city\": \"Oslo\"}"));
  EXPECT_FALSE(grammar_matches(grammar, call + call));
  EXPECT_FALSE(grammar_matches(grammar, "<|channel|>final<|message|>Hi"));
}

TEST(ToolCallGrammar, RefusalsNameTheTool) {
  const std::vector<ToolDefinition> tools = {ToolDefinition::from_openai(OrderedJson::parse(
      R"({"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "patternProperties": {}}}})"))};
  try {
    tool_call_gbnf(ToolSyntax::kHermes, tools, false);
    FAIL() << "patternProperties was taken";
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find("tool 'bad'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("patternProperties"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ToolDefinition::from_openai(OrderedJson::parse(R"({"type": "function", "function": {}})")), std::invalid_argument);
  // OpenAI's rule for names: a name that could carry a marker or a space into a template is refused.
  for (const char* name : {"get weather", "f<|im_end|>", "x\n", "caf\u00e9"}) {
    const OrderedJson tool = {{"type", "function"}, {"function", {{"name", name}}}};
    EXPECT_THROW(ToolDefinition::from_openai(tool), std::invalid_argument) << name;
  }
  EXPECT_EQ(ToolDefinition::from_openai({{"type", "function"}, {"function", {{"name", "get_weather-2"}}}}).name, "get_weather-2");
  EXPECT_THROW(ToolDefinition::from_openai(OrderedJson::parse(R"({"type": "code", "function": {"name": "f"}})")),
               std::invalid_argument);
}

}  // namespace
}  // namespace ringlm

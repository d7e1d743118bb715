// JSON Schema -> GBNF: each case of tests/data/json_schema_cases.json (schemas and instances
// written by hand, the instances' validity decided by reading the schema, not by the converter)
// must give a grammar that accepts its valid instances and rejects its invalid ones; the any-value
// grammars must agree with nlohmann::json's own parser; unsupported and hostile schemas must be
// refused with a GrammarError that says why and where.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/grammar/json_schema.h"
#include "tests/build_scale.h"

namespace ringlm {
namespace {

using nlohmann::json;

json load_cases() {
  std::ifstream in(RINGLM_SOURCE_DIR "/tests/data/json_schema_cases.json");
  if (!in) throw std::runtime_error("cannot open tests/data/json_schema_cases.json");
  return json::parse(in);
}

std::shared_ptr<const Grammar> schema_grammar(const json& schema) {
  return Grammar::parse(json_schema_to_gbnf(schema));
}

TEST(JsonSchemaTest, CasesAcceptValidInstancesAndRejectInvalidOnes) {
  const json cases = load_cases();
  ASSERT_GE(cases.size(), 30u);
  for (const json& c : cases) {
    SCOPED_TRACE(c["description"].get<std::string>());
    std::string gbnf;
    ASSERT_NO_THROW(gbnf = json_schema_to_gbnf(c["schema"])) << c["schema"].dump();
    std::shared_ptr<const Grammar> grammar;
    ASSERT_NO_THROW(grammar = Grammar::parse(gbnf)) << gbnf;
    ASSERT_FALSE(c["valid"].empty());
    ASSERT_FALSE(c["invalid"].empty());
    for (const json& instance : c["valid"]) {
      const std::string text = instance.get<std::string>();
      EXPECT_TRUE(json::accept(text)) << "the case's valid instance is not JSON: " << text;
      EXPECT_TRUE(grammar_matches(grammar, text)) << "rejects the valid instance " << text << "\n" << gbnf;
    }
    for (const json& instance : c["invalid"]) {
      const std::string text = instance.get<std::string>();
      EXPECT_FALSE(grammar_matches(grammar, text)) << "accepts the invalid instance " << text << "\n" << gbnf;
    }
  }
}

// Every keyword json_schema.h supports is exercised by some case.
void collect_keywords(const json& schema, std::set<std::string>& keywords) {
  if (!schema.is_object()) return;
  for (const auto& [key, value] : schema.items()) {
    keywords.insert(key);
    if (key == "properties" || key == "$defs" || key == "definitions") {
      for (const auto& [unused, sub] : value.items()) collect_keywords(sub, keywords);
    } else if (key == "anyOf" || key == "oneOf" || key == "allOf" || key == "prefixItems") {
      for (const json& sub : value) collect_keywords(sub, keywords);
    } else if (key == "items" || key == "additionalProperties") {
      collect_keywords(value, keywords);
    }
  }
}

TEST(JsonSchemaTest, CasesCoverEverySupportedKeyword) {
  std::set<std::string> keywords;
  for (const json& c : load_cases()) collect_keywords(c["schema"], keywords);
  for (const char* keyword : {"type",      "properties", "required",    "additionalProperties",
                              "enum",      "const",      "items",       "prefixItems",
                              "minItems",  "maxItems",   "anyOf",       "oneOf",
                              "allOf",     "$ref",       "$defs",       "definitions",
                              "minLength", "maxLength",  "format",      "pattern",
                              "minimum",   "maximum",    "description", "title",
                              "$schema",   "default",    "examples"}) {
    EXPECT_TRUE(keywords.count(keyword)) << "no case uses '" << keyword << "'";
  }
}

// Texts near valid JSON: each of a few documents with one character replaced, inserted or
// deleted (at every position; every 4th in the sanitizer build). The grammars must decide them as
// nlohmann::json's parser does. (The documents hold no whitespace and no long numbers, where the
// grammars are bounded on purpose.)
std::vector<std::string> near_json_texts() {
  const std::vector<std::string> documents = {
      R"({"a":[1,-2.5,3e4],"b":{"c":null,"d":true},"e":"x\"y\\z\u00e9"})",
      R"([{},[],"",0,false,{"k":[{"z":-0.25}]}])",
      R"("str\n\t\/")",
      R"(-12.5e-3)",
  };
  const std::string alphabet = "{}[],:\"0123456789.-+eEabtrufnlsx\\/ \n";
  std::vector<std::string> texts;
  for (const std::string& document : documents) {
    texts.push_back(document);
    for (size_t i = 0; i <= document.size(); i += static_cast<size_t>(test::scaled(1, 4))) {
      if (i < document.size()) texts.push_back(document.substr(0, i) + document.substr(i + 1));
      for (const char c : alphabet) {
        const std::string inserted = document.substr(0, i) + c + document.substr(i);
        if (c != ' ' && c != '\n') texts.push_back(inserted);  // (an inserted space may double one)
        if (i < document.size()) texts.push_back(document.substr(0, i) + c + document.substr(i + 1));
      }
    }
  }
  return texts;
}

// Whether a text starts with whitespace, or holds two whitespace characters in a row outside
// strings: JSON allows both; the grammars allow neither (bounded whitespace).
bool has_unbounded_whitespace(const std::string& text) {
  if (!text.empty() && (text[0] == ' ' || text[0] == '\n')) return true;
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    const bool space = text[i] == ' ' || text[i] == '\n';
    if (space && text[i + 1] == '\n') return true;  // "\n" may be followed by spaces, nothing else
    if (text[i] == ' ' && text[i + 1] == ' ') return true;
  }
  return false;
}

TEST(JsonSchemaTest, AnyValueGrammarAgreesWithAJsonParser) {
  const auto value = Grammar::parse(json_value_gbnf());
  const auto object = Grammar::parse(json_object_gbnf());
  int accepted = 0, compared = 0;
  for (const std::string& text : near_json_texts()) {
    if (has_unbounded_whitespace(text)) continue;
    const bool is_json = json::accept(text);
    ++compared;
    accepted += is_json;
    EXPECT_EQ(grammar_matches(value, text), is_json) << text;
    EXPECT_EQ(grammar_matches(object, text), is_json && json::parse(text).is_object()) << text;
  }
  // Both kinds occur in numbers, so the comparison means something.
  EXPECT_GT(accepted, test::scaled(100, 25));
  EXPECT_GT(compared - accepted, test::scaled(1000, 250));
}

// Every number the grammar lets a model write is one a JSON parser reads as a finite double: the
// digits and the exponent are bounded (a model once wrote 4500000000000000e640, which nlohmann and
// Python refuse or make infinite).
TEST(JsonSchemaTest, NumbersStayInADoublesRange) {
  const auto number = Grammar::parse(json_schema_to_gbnf({{"type", "number"}}));
  for (const char* text : {"0", "-12.5", "9999999999999999.9999999999999999e99", "1E-99", "3e+7"}) {
    EXPECT_TRUE(grammar_matches(number, text)) << text;
    EXPECT_TRUE(std::isfinite(json::parse(text).get<double>())) << text;
  }
  for (const char* text : {"1e100", "4500000000000000e640", "12345678901234567", "01", "1.", ".5"}) {
    EXPECT_FALSE(grammar_matches(number, text)) << text;
  }
}

TEST(JsonSchemaTest, GrammarsParseAsGbnf) {
  EXPECT_NO_THROW(Grammar::parse(json_value_gbnf()));
  EXPECT_NO_THROW(Grammar::parse(json_object_gbnf()));
  EXPECT_EQ(json_value_gbnf(), json_schema_to_gbnf(true));
}

// The converter's error for `schema`, or "" when it converts.
std::string conversion_error(const json& schema) {
  try {
    json_schema_to_gbnf(schema);
  } catch (const GrammarError& e) {
    return e.what();
  }
  return "";
}

TEST(JsonSchemaTest, UnsupportedKeywordsAreRefusedByName) {
  struct Refusal {
    const char* schema;
    std::vector<const char*> message_holds;
  };
  const std::vector<Refusal> refusals = {
      {R"({"type":"object","properties":{"a":{"patternProperties":{"x":{}}}}})",
       {"unsupported keyword 'patternProperties' at /properties/a"}},
      {R"({"not":{"type":"string"}})", {"'not'", "the root"}},
      {R"({"if":{},"then":{}})", {"'if'"}},
      {R"({"type":"array","uniqueItems":true})", {"'uniqueItems'"}},
      {R"({"type":"number","multipleOf":2})", {"'multipleOf'"}},
      {R"({"type":"object","minProperties":1})", {"'minProperties'"}},
      {R"({"type":"object","dependentRequired":{}})", {"'dependentRequired'"}},
      {R"({"type":"string","format":"email"})", {"'format'", "email", "/format"}},
      {R"({"items":[{"type":"string"}]})", {"'items'"}},
      {R"({"type":"unicorn"})", {"'type'", "unicorn"}},
      {R"({"$ref":"https://example.com/s.json"})", {"'$ref'", "only local"}},
      {R"({"$ref":"#/$defs/missing"})", {"'$ref'", "points nowhere"}},
      {R"({"$defs":{"a":{"type":"string"}},"$ref":"#/$defs/a","maxLength":3})", {"'maxLength' next to '$ref'"}},
      {R"({"anyOf":[{"type":"string"}],"type":"object","properties":{}})", {"next to 'anyOf'"}},
      {R"({"enum":[1,2],"minimum":0})", {"'minimum' next to 'enum'"}},
      {R"({"type":"string","pattern":"^(a)\\1$"})", {"'pattern'", "backreference", "/pattern"}},
      {R"({"type":"string","pattern":"^(?=a)b$"})", {"'pattern'", "lookaround"}},
      {R"({"type":"string","pattern":"(?<!a)b"})", {"'pattern'", "lookaround"}},
      {R"({"type":"string","pattern":"\\bword"})", {"'pattern'", "word boundary"}},
      {R"({"type":"string","pattern":"a^b"})", {"'pattern'", "anchor"}},
      {R"({"type":"string","pattern":"\\p{L}"})", {"'pattern'", "Unicode property"}},
      {R"({"type":"string","pattern":"(ab"})", {"'pattern'", "unclosed"}},
      {R"({"type":"string","pattern":"^a","minLength":2})", {"'minLength' next to 'pattern'"}},
      {R"({"allOf":[{"type":"object"},{"type":"string"}]})", {"allOf", "/allOf/1"}},
      {R"({"type":"string","minLength":-1})", {"'minLength'", "non-negative"}},
      {R"({"type":"array","minItems":3,"maxItems":2})", {"'minItems'"}},
      {R"({"properties":{"a":false},"required":["a"]})", {"false", "/properties/a"}},
  };
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.schema);
    const std::string error = conversion_error(json::parse(refusal.schema));
    ASSERT_FALSE(error.empty()) << "converted";
    EXPECT_EQ(error.rfind("json_schema: ", 0), 0u) << error;
    for (const char* part : refusal.message_holds) EXPECT_NE(error.find(part), std::string::npos) << error;
  }
}

json nested(const char* keyword, int depth) {
  json schema = {{"type", "integer"}};
  for (int i = 0; i < depth; ++i) {
    schema = std::string(keyword) == "items" ? json{{"type", "array"}, {"items", schema}}
                                             : json{{keyword, json::array({schema, {{"type", "null"}}})}};
  }
  return schema;
}

TEST(JsonSchemaTest, DeepNestingIsRefusedAndShallowerNestingWorks) {
  for (const char* keyword : {"items", "anyOf"}) {
    SCOPED_TRACE(keyword);
    EXPECT_NE(conversion_error(nested(keyword, 100)).find("deeper than 64"), std::string::npos);
    const json shallow = nested(keyword, 60);
    const auto grammar = schema_grammar(shallow);
    EXPECT_TRUE(grammar_matches(
        grammar, std::string(keyword) == "items" ? std::string(60, '[') + "1" + std::string(60, ']') : "1"));
  }
  std::string pattern;
  for (int i = 0; i < 100; ++i) pattern = "(" + pattern + "a)";
  EXPECT_NE(conversion_error({{"type", "string"}, {"pattern", pattern}}).find("deeper than 64"), std::string::npos);
}

TEST(JsonSchemaTest, OversizedGrammarsAreRefused) {
  json properties = json::object();
  for (int i = 0; i < 20000; ++i) properties["p" + std::to_string(i)] = {{"type", "integer"}};
  EXPECT_NE(conversion_error({{"type", "object"}, {"properties", properties}}).find("more than 10000 rules"),
            std::string::npos);
  EXPECT_NE(conversion_error({{"type", "string"}, {"maxLength", 1000000000}}).find("'maxLength'"), std::string::npos);
  EXPECT_NE(conversion_error({{"type", "array"}, {"minItems", 123456789012LL}}).find("'minItems'"), std::string::npos);
  EXPECT_NE(conversion_error({{"type", "string"}, {"pattern", "^a{1000000}$"}}).find("more than 10000 rules"),
            std::string::npos);
  EXPECT_NE(conversion_error({{"type", "array"}, {"prefixItems", json::array()}, {"items", false}, {"minItems", 1}})
                .find("'minItems'"),
            std::string::npos);
}

TEST(JsonSchemaTest, SchemasThatAreNotSchemasAreRefused) {
  for (const json& schema : {json(42), json("string"), json(nullptr), json::array(), json(false)}) {
    SCOPED_TRACE(schema.dump());
    EXPECT_FALSE(conversion_error(schema).empty());
  }
  EXPECT_NE(conversion_error(json::array()).find("must be an object or a boolean"), std::string::npos);
  EXPECT_NE(conversion_error({{"type", "object"}, {"properties", {{"a", 7}}}}).find("/properties/a"),
            std::string::npos);
}

// A $ref loop that reads nothing would be left recursion: refused by the converter, naming the
// ref; a loop that reads a character first is fine (the recursive cases above).
TEST(JsonSchemaTest, RefLoopsThatReadNothingAreRefused) {
  for (const char* text :
       {R"({"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})",
        R"({"$defs":{"a":{"anyOf":[{"type":"null"},{"$ref":"#/$defs/a"}]}},"items":{"$ref":"#/$defs/a"}})",
        R"({"anyOf":[{"$ref":"#"},{"type":"null"}]})"}) {
    SCOPED_TRACE(text);
    const std::string error = conversion_error(json::parse(text));
    EXPECT_NE(error.find("'$ref'"), std::string::npos) << error;
    EXPECT_NE(error.find("loops"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace ringlm

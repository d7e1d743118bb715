// JSON Schema -> GBNF (see json_schema.h). Each schema becomes a rule whose text is one JSON value
// followed by optional whitespace; $ref targets become rules of their own, written after the
// schema that first names them, so that recursion and shared definitions cost one rule each.
#include "core/grammar/json_schema.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "core/tokenizer/unicode.h"

namespace ringlm {

namespace {

using nlohmann::json;
using unicode::append_utf8;

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw GrammarError("json_schema: " + what + " at " + (path.empty() ? std::string("the root") : path));
}

// --- Text helpers ------------------------------------------------------------------------------

// The code points of UTF-8 text; false if it is not valid UTF-8.
bool decode_utf8(const std::string& text, std::u32string& out) {
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const int extra = lead < 0x80 ? 0 : lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : -1;
    if (extra < 0 || i + static_cast<size_t>(extra) >= text.size()) return false;
    char32_t c = extra == 0 ? lead : lead & (0x3F >> extra);
    for (int k = 1; k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
      if ((next & 0xC0) != 0x80) return false;
      c = c << 6 | (next & 0x3F);
    }
    out += c;
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

std::string hex_escape(char32_t c, const char* prefix, int digits) {
  static const char* kDigits = "0123456789ABCDEF";
  std::string out = prefix;
  for (int shift = 4 * (digits - 1); shift >= 0; shift -= 4) out += kDigits[(c >> shift) & 0xF];
  return out;
}

// A GBNF string literal of UTF-8 text.
std::string gbnf_literal(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7F) {
      out += hex_escape(c, "\\x", 2);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// A code point inside a GBNF character class: letters and digits as they are, other ASCII and the
// rest of the BMP as escapes (no class metacharacter can slip through), beyond it UTF-8.
std::string class_char(char32_t c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
    return std::string(1, static_cast<char>(c));
  if (c < 0x80) return hex_escape(c, "\\x", 2);
  if (c < 0x10000) return hex_escape(c, "\\u", 4);
  std::string out;
  append_utf8(out, c);
  return out;
}

// How a code point is written inside a JSON string: as itself, or as its canonical escape.
std::string json_encoded(char32_t c) {
  std::string utf8;
  append_utf8(utf8, c);
  const std::string quoted = json(utf8).dump();
  return quoted.substr(1, quoted.size() - 2);
}

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string out;
  for (const std::string& part : parts) {
    if (part.empty()) continue;
    if (!out.empty()) out += separator;
    out += part;
  }
  return out;
}

// A JSON pointer token: ~ and / escaped.
std::string pointer_token(const std::string& key) {
  std::string out;
  for (const char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

// A rule name from free text: GBNF names are [a-zA-Z0-9-]+.
std::string rule_name_part(const std::string& text) {
  std::string out;
  for (const char c : text.substr(0, 64)) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  return out.empty() ? "x" : out;
}

// --- Code point sets (pattern classes) ---------------------------------------------------------

constexpr char32_t kMaxCodePoint = 0x10FFFF;
using Ranges = std::vector<std::pair<char32_t, char32_t>>;  // inclusive

Ranges normalized(Ranges ranges) {
  std::sort(ranges.begin(), ranges.end());
  Ranges out;
  for (const auto& r : ranges) {
    if (!out.empty() && r.first <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

Ranges complement(const Ranges& ranges) {
  Ranges out;
  char32_t next = 0;
  for (const auto& [low, high] : normalized(ranges)) {
    if (low > next) out.emplace_back(next, low - 1);
    next = high + 1;
  }
  if (next <= kMaxCodePoint) out.emplace_back(next, kMaxCodePoint);
  return out;
}

bool contains(const Ranges& ranges, char32_t c) {
  return std::any_of(ranges.begin(), ranges.end(), [c](const auto& r) { return r.first <= c && c <= r.second; });
}

// The code points a JSON string cannot hold as themselves: controls, the quote and the backslash.
const Ranges& json_escaped_chars() {
  static const Ranges kEscaped = {{0x00, 0x1F}, {'"', '"'}, {'\\', '\\'}};
  return kEscaped;
}

std::string class_text(const Ranges& ranges, bool negated) {
  std::string out = negated ? "[^" : "[";
  for (const auto& [low, high] : ranges)
    out += low == high ? class_char(low) : class_char(low) + "-" + class_char(high);
  return out + "]";
}

// The escapes of the control characters in `set`: the short ones (\n) and the \u00XX ones, hex
// digits in either case.
std::string control_escapes(const Ranges& set) {
  std::string short_letters;
  for (const auto& [c, letter] : {std::pair{U'\b', 'b'}, {U'\t', 't'}, {U'\n', 'n'}, {U'\f', 'f'}, {U'\r', 'r'}}) {
    if (contains(set, c)) short_letters += letter;
  }
  std::vector<std::string> by_high_digit;
  for (char32_t high = 0; high < 2; ++high) {
    std::string low_digits;
    for (char32_t low = 0; low < 16; ++low) {
      if (!contains(set, high * 16 + low)) continue;
      low_digits += "0123456789abcdef"[low];
      if (low >= 10) low_digits += "ABCDEF"[low - 10];
    }
    if (!low_digits.empty()) by_high_digit.push_back(gbnf_literal(std::to_string(high)) + " [" + low_digits + "]");
  }
  std::vector<std::string> escapes;
  if (!short_letters.empty()) escapes.push_back("[" + short_letters + "]");
  if (!by_high_digit.empty()) escapes.push_back("\"u00\" ( " + join(by_high_digit, " | ") + " )");
  return escapes.empty() ? "" : "\"\\\\\" ( " + join(escapes, " | ") + " )";
}

// GBNF for one character of a JSON string whose decoded code point is in `set`: a class for the
// code points written as themselves, and the escapes of those that must be escaped.
std::string json_char_in(const Ranges& set, const std::string& path) {
  const Ranges wanted = normalized(set);
  std::vector<std::string> alternatives;
  // The code points written as themselves: wanted minus the escaped ones, as a negated class when
  // it reaches the end of Unicode (no UTF-8 above U+FFFF needed, and shorter).
  Ranges raw_excluded = complement(wanted);
  raw_excluded.insert(raw_excluded.end(), json_escaped_chars().begin(), json_escaped_chars().end());
  const Ranges raw = complement(raw_excluded);
  if (!raw.empty()) {
    alternatives.push_back(contains(raw, kMaxCodePoint) ? class_text(normalized(raw_excluded), true)
                                                        : class_text(raw, false));
  }
  for (const char32_t c : {U'"', U'\\'}) {
    if (contains(wanted, c)) alternatives.push_back(gbnf_literal(json_encoded(c)));
  }
  const std::string controls = control_escapes(wanted);
  if (!controls.empty()) alternatives.push_back(controls);
  if (alternatives.empty()) fail("keyword 'pattern' has a character class that matches nothing", path);
  return alternatives.size() == 1 ? alternatives[0] : "( " + join(alternatives, " | ") + " )";
}

// --- Fixed rules -------------------------------------------------------------------------------

struct FixedRule {
  const char* name;
  const char* body;
  std::vector<const char*> uses;
};

// The rules every schema builds on, in the order they are written. Numbers and whitespace are
// bounded so that a model cannot write digits or spaces forever.
const std::vector<FixedRule>& fixed_rules() {
  static const std::vector<FixedRule> kRules = {
      {"space", R"(( " " | "\n" [ \t]{0,20} )?)", {}},
      {"char", R"([^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ))", {}},
      {"string", R"("\"" char* "\"" space)", {"char", "space"}},
      {"integer", R"("-"? ( "0" | [1-9] [0-9]{0,15} ) space)", {"space"}},
      {"number",
       R"("-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )? space)",
       {"space"}},
      {"boolean", R"(( "true" | "false" ) space)", {"space"}},
      {"null", R"("null" space)", {"space"}},
      {"value",
       "object | array | string | number | boolean | null",
       {"object", "array", "string", "number", "boolean", "null"}},
      {"object",
       R"("{" space ( string ":" space value ( "," space string ":" space value )* )? "}" space)",
       {"string", "value", "space"}},
      {"array", R"("[" space ( value ( "," space value )* )? "]" space)", {"value", "space"}},
      {"date", R"([0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] ))", {}},
      {"time",
       R"(( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,9} )? )"
       R"(( [Zz] | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ))",
       {}},
      {"date-string", R"("\"" date "\"" space)", {"date", "space"}},
      {"time-string", R"("\"" time "\"" space)", {"time", "space"}},
      {"date-time-string", R"("\"" date [Tt] time "\"" space)", {"date", "time", "space"}},
      {"uuid-string",
       R"("\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\"" space)",
       {"space"}},
  };
  return kRules;
}

const FixedRule* find_fixed_rule(const std::string& name) {
  for (const FixedRule& rule : fixed_rules()) {
    if (name == rule.name) return &rule;
  }
  return nullptr;
}

// --- Keywords ----------------------------------------------------------------------------------

const std::set<std::string> kAnnotations = {"description", "title",      "$schema",  "$comment", "default",
                                            "examples",    "deprecated", "readOnly", "writeOnly"};
const std::set<std::string> kDefinitionContainers = {"$defs", "definitions"};
// Keywords that decide the whole schema alone.
const std::set<std::string> kApplicators = {"$ref", "anyOf", "oneOf", "allOf"};
const std::map<std::string, std::string> kKeywordType = {
    {"properties", "object"}, {"required", "object"},         {"additionalProperties", "object"},
    {"items", "array"},       {"prefixItems", "array"},       {"minItems", "array"},
    {"maxItems", "array"},    {"minLength", "string"},        {"maxLength", "string"},
    {"pattern", "string"},    {"format", "string"},           {"minimum", "number"},
    {"maximum", "number"},    {"exclusiveMinimum", "number"}, {"exclusiveMaximum", "number"},
};
const std::vector<std::string> kTypes = {"string", "number", "integer", "boolean", "null", "object", "array"};

bool is_value_list(const std::string& key) { return key == "enum" || key == "const"; }

bool value_has_type(const json& value, const std::string& type) {
  if (type == "string") return value.is_string();
  if (type == "number") return value.is_number();
  if (type == "integer")
    return value.is_number_integer() ||
           (value.is_number_float() && std::floor(value.get<double>()) == value.get<double>());
  if (type == "boolean") return value.is_boolean();
  if (type == "null") return value.is_null();
  if (type == "object") return value.is_object();
  return value.is_array();
}

// --- The converter -----------------------------------------------------------------------------

constexpr int kUnbounded = -1;

class SchemaConverter {
 public:
  // `root_name`: the name of the rule that matches the document ("root" is never used otherwise
  // either, so that a grammar that embeds this one can have its own root).
  SchemaConverter(const json& document, std::string root_name) : document_(document), root_name_(std::move(root_name)) {
    names_.insert("root");
    names_.insert(root_name_);
  }

  std::string convert() {
    const std::string root = visit(document_, "", "document", 0);
    while (!pending_refs_.empty()) {
      const std::string ref = pending_refs_.back();
      pending_refs_.pop_back();
      current_ref_ = ref;
      at_value_start_ = true;
      const std::string& name = ref_rules_.at(ref);
      ref_bodies_.emplace_back(name, visit(resolve(ref, ""), ref.substr(1), name, 0));
    }
    refuse_left_recursive_refs();
    return text(root);
  }

  // `item` repeated min to max times (kUnbounded: any number) as GBNF, counted against the rule
  // budget as the engine expands it.
  std::string repeat(const std::string& item, int min, int max, const std::string& path) {
    if (max == 0) return "";
    charge(max == kUnbounded ? min + 1 : max, path);
    if (max == kUnbounded) return item + (min == 0 ? "*" : min == 1 ? "+" : "{" + std::to_string(min) + ",}");
    if (min == 0 && max == 1) return item + "?";
    if (min == max) return item + "{" + std::to_string(min) + "}";
    return item + "{" + std::to_string(min) + "," + std::to_string(max) + "}";
  }

  // A fixed rule (and those it uses) for the grammar; its name.
  std::string use(const std::string& name) {
    if (used_fixed_.insert(name).second) {
      for (const char* dependency : find_fixed_rule(name)->uses) use(dependency);
    }
    return name;
  }

 private:
  std::string visit(const json& schema, const std::string& path, const std::string& name, int depth);
  std::string visit_ref(const std::string& ref, const std::string& path);
  std::string visit_alternatives(const json& list, const std::string& keyword, const std::string& path,
                                 const std::string& name, int depth);
  std::string visit_all_of(const json& list, const std::string& path, const std::string& name, int depth);
  std::string visit_values(const json& schema, const std::string& path, const std::string& name);
  std::string visit_type(const json& schema, const std::string& type, const std::string& path, const std::string& name,
                         int depth);
  std::string visit_string(const json& schema, const std::string& path, const std::string& name);
  std::string visit_object(const json& schema, const std::string& path, const std::string& name, int depth);
  std::string visit_array(const json& schema, const std::string& path, const std::string& name, int depth);
  std::string other_key(const std::set<std::string>& declared, const std::string& path, const std::string& name);

  std::vector<std::string> types_of(const json& schema, const std::string& path) const;
  void check_keywords(const json& schema, const std::string& path) const;
  const json& resolve(const std::string& ref, const std::string& path) const;
  void refuse_left_recursive_refs() const;

  std::string add_rule(const std::string& name_hint, const std::string& body, const std::string& path) {
    charge(1, path);
    std::string name = rule_name_part(name_hint);
    if (!names_.insert(name).second) {
      int& suffix = next_suffix_[name];
      while (!names_.insert(name + "-" + std::to_string(++suffix)).second) {
      }
      name += "-" + std::to_string(suffix);
    }
    rules_.emplace_back(name, body);
    return name;
  }

  void charge(int rules, const std::string& path) {
    rule_count_ += rules;
    if (rule_count_ > kMaxSchemaRules)
      fail("the grammar needs more than " + std::to_string(kMaxSchemaRules) + " rules", path);
  }

  // A child value's rule, with the flag that says whether it starts its rule's text.
  std::string visit_inside(const json& schema, const std::string& path, const std::string& name, int depth) {
    const bool was_at_start = at_value_start_;
    at_value_start_ = false;
    std::string rule = visit(schema, path, name, depth);
    at_value_start_ = was_at_start;
    return rule;
  }

  std::string text(const std::string& root) const {
    std::vector<std::pair<std::string, std::string>> rules = {{root_name_, root}};
    rules.insert(rules.end(), rules_.begin(), rules_.end());
    rules.insert(rules.end(), ref_bodies_.begin(), ref_bodies_.end());
    for (const FixedRule& rule : fixed_rules()) {
      if (used_fixed_.count(rule.name)) rules.emplace_back(rule.name, rule.body);
    }
    std::string out;
    for (const auto& [name, body] : rules) out += name + " ::= " + body + "\n";
    return out;
  }

  const json& document_;
  const std::string root_name_;
  std::vector<std::pair<std::string, std::string>> rules_;       // in the order made
  std::vector<std::pair<std::string, std::string>> ref_bodies_;  // a $ref's rule: its schema's rule
  std::set<std::string> names_;
  std::map<std::string, int> next_suffix_;
  std::set<std::string> used_fixed_;
  int rule_count_ = 0;
  std::map<std::string, std::string> ref_rules_;  // "$ref" text -> its rule
  std::vector<std::string> pending_refs_;         // refs named but not written yet
  // For left recursion: which refs each ref's rule (the root's: "") can start with, before any
  // character is read. Only $ref, anyOf, oneOf and type lists pass the start on; every other
  // value starts with a character.
  std::map<std::string, std::set<std::string>> leading_refs_;
  std::string current_ref_;
  bool at_value_start_ = true;
};

void SchemaConverter::check_keywords(const json& schema, const std::string& path) const {
  std::vector<std::string> constraints;
  for (const auto& [key, value] : schema.items()) {
    if (kAnnotations.count(key) || kDefinitionContainers.count(key)) continue;
    if (!kApplicators.count(key) && !kKeywordType.count(key) && !is_value_list(key) && key != "type") {
      fail("unsupported keyword '" + key + "'", path);
    }
    constraints.push_back(key);
  }
  // An applicator stands alone; enum and const go only with type (which filters them).
  for (const std::string& key : constraints) {
    const bool alone = kApplicators.count(key) > 0;
    for (const std::string& other : constraints) {
      if (other == key) continue;
      if (alone || (is_value_list(key) && other != "type")) {
        fail("unsupported keyword '" + other + "' next to '" + key + "'", path);
      }
    }
  }
}

std::vector<std::string> SchemaConverter::types_of(const json& schema, const std::string& path) const {
  std::vector<std::string> types;
  if (schema.contains("type")) {
    const json& type = schema["type"];
    const json list = type.is_array() ? type : json::array({type});
    if (list.empty()) fail("keyword 'type' lists no type", path + "/type");
    for (const json& entry : list) {
      if (!entry.is_string() || std::find(kTypes.begin(), kTypes.end(), entry.get<std::string>()) == kTypes.end()) {
        fail("unsupported keyword 'type' value " + entry.dump(), path + "/type");
      }
      if (std::find(types.begin(), types.end(), entry.get<std::string>()) == types.end())
        types.push_back(entry.get<std::string>());
    }
    return types;
  }
  // No type: the types the keywords constrain (llama.cpp's reading); none means any value.
  for (const std::string& type : kTypes) {
    for (const auto& [keyword, keyword_type] : kKeywordType) {
      if (keyword_type == type && schema.contains(keyword)) {
        types.push_back(type);
        break;
      }
    }
  }
  return types;
}

std::string SchemaConverter::visit(const json& schema, const std::string& path, const std::string& name, int depth) {
  if (depth > kMaxSchemaDepth) fail("schema nested deeper than " + std::to_string(kMaxSchemaDepth) + " levels", path);
  if (schema.is_boolean()) {
    if (!schema.get<bool>()) fail("schema false matches nothing", path);
    return use("value");
  }
  if (!schema.is_object()) fail("a schema must be an object or a boolean", path);
  check_keywords(schema, path);
  if (schema.contains("$ref")) {
    if (!schema["$ref"].is_string()) fail("keyword '$ref' must be a string", path);
    return visit_ref(schema["$ref"].get<std::string>(), path);
  }
  if (schema.contains("anyOf")) return visit_alternatives(schema["anyOf"], "anyOf", path, name, depth);
  if (schema.contains("oneOf")) return visit_alternatives(schema["oneOf"], "oneOf", path, name, depth);
  if (schema.contains("allOf")) return visit_all_of(schema["allOf"], path, name, depth);
  if (schema.contains("enum") || schema.contains("const")) return visit_values(schema, path, name);
  const std::vector<std::string> types = types_of(schema, path);
  if (types.empty()) return use("value");
  std::vector<std::string> alternatives;
  for (const std::string& type : types) {
    alternatives.push_back(visit_type(schema, type, path, types.size() == 1 ? name : name + "-" + type, depth));
  }
  return alternatives.size() == 1 ? alternatives[0] : add_rule(name, join(alternatives, " | "), path);
}

const json& SchemaConverter::resolve(const std::string& ref, const std::string& path) const {
  if (ref.empty() || ref[0] != '#') fail("unsupported keyword '$ref' to '" + ref + "' (only local references)", path);
  try {
    const json::json_pointer pointer(ref.substr(1));
    if (document_.contains(pointer)) return document_.at(pointer);
  } catch (const json::exception&) {
  }
  fail("keyword '$ref' to '" + ref + "' points nowhere", path);
}

std::string SchemaConverter::visit_ref(const std::string& ref, const std::string& path) {
  resolve(ref, path);
  if (at_value_start_) leading_refs_[current_ref_].insert(ref);
  auto [it, added] = ref_rules_.emplace(ref, "");
  if (added) {
    const std::string last_token = ref.substr(ref.rfind('/') + 1);
    it->second = add_rule("ref-" + (last_token == "#" ? std::string("document") : last_token), "", path);
    rules_.pop_back();  // its body comes when the worklist reaches it
    pending_refs_.push_back(ref);
  }
  return it->second;
}

// A ref's rule that can reach itself before reading a character would be left recursion, which
// no matcher can expand: refused here, with the ref that loops.
void SchemaConverter::refuse_left_recursive_refs() const {
  std::map<std::string, int> state;  // 1: on the path, 2: done
  for (const auto& [start, unused] : leading_refs_) {
    std::vector<std::pair<std::string, std::set<std::string>::const_iterator>> path;
    auto push = [&](const std::string& ref) {
      state[ref] = 1;
      static const std::set<std::string> kNone;
      auto found = leading_refs_.find(ref);
      path.emplace_back(ref, (found == leading_refs_.end() ? kNone : found->second).begin());
    };
    if (state[start] != 0) continue;
    push(start);
    while (!path.empty()) {
      auto& [ref, next] = path.back();
      auto found = leading_refs_.find(ref);
      if (found == leading_refs_.end() || next == found->second.end()) {
        state[ref] = 2;
        path.pop_back();
        continue;
      }
      const std::string target = *next++;
      if (state[target] == 1)
        fail("keyword '$ref' to '" + target + "' loops back before any value is read", target.substr(1));
      if (state[target] == 0) push(target);
    }
  }
}

std::string SchemaConverter::visit_alternatives(const json& list, const std::string& keyword, const std::string& path,
                                                const std::string& name, int depth) {
  if (!list.is_array() || list.empty()) fail("keyword '" + keyword + "' must be a non-empty array", path);
  std::vector<std::string> alternatives;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string item_path = path + "/" + keyword + "/" + std::to_string(i);
    alternatives.push_back(visit(list[i], item_path, name + "-" + std::to_string(i), depth + 1));
  }
  return alternatives.size() == 1 ? alternatives[0] : add_rule(name, join(alternatives, " | "), path);
}

// allOf of object schemas: one object with all their properties and required names. A single
// schema is itself.
std::string SchemaConverter::visit_all_of(const json& list, const std::string& path, const std::string& name,
                                          int depth) {
  if (!list.is_array() || list.empty()) fail("keyword 'allOf' must be a non-empty array", path);
  if (list.size() == 1) return visit(list[0], path + "/allOf/0", name, depth + 1);
  json merged = {{"type", "object"}, {"properties", json::object()}, {"required", json::array()}};
  for (size_t i = 0; i < list.size(); ++i) {
    std::string part_path = path + "/allOf/" + std::to_string(i);
    const json* part = &list[i];
    for (int hops = 0; part->is_object() && part->contains("$ref"); ++hops) {
      if (hops == kMaxSchemaDepth)
        fail("keyword '$ref' chain longer than " + std::to_string(kMaxSchemaDepth), part_path);
      const std::string ref = (*part)["$ref"].is_string() ? (*part)["$ref"].get<std::string>() : "";
      part = &resolve(ref, part_path);
      part_path = ref.substr(1);
    }
    if (!part->is_object()) fail("keyword 'allOf' merges only object schemas", part_path);
    for (const auto& [key, value] : part->items()) {
      if (kAnnotations.count(key) || kDefinitionContainers.count(key)) continue;
      if (key == "type" && value == "object") continue;
      if (key == "properties" && value.is_object()) {
        for (const auto& [property, property_schema] : value.items()) {
          if (merged["properties"].contains(property)) fail("allOf names property '" + property + "' twice", part_path);
          merged["properties"][property] = property_schema;
        }
      } else if (key == "required" && value.is_array()) {
        for (const json& required : value) merged["required"].push_back(required);
      } else if (key == "additionalProperties") {
        if (value == false || !merged.contains(key)) {
          merged[key] = value;
        } else if (merged[key] != false && merged[key] != value) {
          fail("allOf gives two different 'additionalProperties'", part_path);
        }
      } else {
        fail("unsupported keyword '" + key + "' in an allOf (only objects merge)", part_path);
      }
    }
  }
  return visit_object(merged, path, name, depth + 1);
}

std::string SchemaConverter::visit_values(const json& schema, const std::string& path, const std::string& name) {
  const bool is_const = schema.contains("const");
  const json values = is_const ? json::array({schema["const"]}) : schema["enum"];
  if (!values.is_array()) fail("keyword 'enum' must be an array", path);
  const std::vector<std::string> types = types_of(schema, path);
  std::vector<std::string> literals;
  for (const json& value : values) {
    const bool typed = types.empty() || std::any_of(types.begin(), types.end(), [&](const std::string& type) {
                         return value_has_type(value, type);
                       });
    if (typed) literals.push_back(gbnf_literal(value.dump()));
  }
  if (literals.empty()) fail(std::string("keyword '") + (is_const ? "const" : "enum") + "' allows no value", path);
  return add_rule(name, "( " + join(literals, " | ") + " ) " + use("space"), path);
}

std::string SchemaConverter::visit_type(const json& schema, const std::string& type, const std::string& path,
                                        const std::string& name, int depth) {
  if (type == "string") return visit_string(schema, path, name);
  if (type == "object") return visit_object(schema, path, name, depth);
  if (type == "array") return visit_array(schema, path, name, depth);
  return use(type);  // number, integer, boolean, null
}

// A count keyword (minLength, maxItems...): a non-negative integer, or `fallback` when absent.
int count_keyword(const json& schema, const std::string& keyword, int fallback, const std::string& path) {
  if (!schema.contains(keyword)) return fallback;
  const json& value = schema[keyword];
  if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<long long>() < 0)) {
    fail("keyword '" + keyword + "' must be a non-negative integer", path);
  }
  if (value.get<unsigned long long>() > static_cast<unsigned long long>(kMaxSchemaRules)) {
    fail("keyword '" + keyword + "' of " + value.dump() + " needs more than " + std::to_string(kMaxSchemaRules) +
             " rules",
         path);
  }
  return value.get<int>();
}

// --- Strings and patterns ----------------------------------------------------------------------

// A JavaScript regular expression (JSON Schema's dialect) as GBNF over the characters of a JSON
// string: the subset of literals, escapes, ., classes, groups, |, *, +, ?, {m,n}, ^ and $.
class PatternTranslator {
 public:
  PatternTranslator(SchemaConverter& converter, const std::string& path) : converter_(converter), path_(path) {}

  std::string translate(const std::string& pattern) {
    if (!decode_utf8(pattern, pattern_)) refuse("is not valid UTF-8");
    const bool anchored_start = !pattern_.empty() && pattern_[0] == '^';
    if (anchored_start) pos_ = 1;
    std::string body = alternation(0);
    bool anchored_end = false;
    if (at('$')) {
      ++pos_;
      anchored_end = true;
    }
    if (pos_ < pattern_.size()) refuse(pattern_[pos_] == ')' ? "has an unmatched ')'" : "has '$' before its end");
    // Unanchored ends match anywhere in the string, as JSON Schema's search semantics say.
    auto any = [&](bool anchored) -> std::string {
      return anchored ? "" : converter_.repeat(converter_.use("char"), 0, kUnbounded, path_);
    };
    if (body.empty()) return any(anchored_start && anchored_end);
    return join({any(anchored_start), body, any(anchored_end)}, " ");
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const { fail("keyword 'pattern' " + what, path_); }

  // One code point of the string; a control character in any of its escapes.
  std::string literal(char32_t c) const {
    return c < 0x20 ? json_char_in({{c, c}}, path_) : gbnf_literal(json_encoded(c));
  }

  bool at(char32_t c) const { return pos_ < pattern_.size() && pattern_[pos_] == c; }
  // Whether the pattern's end anchor is next: '$' as its last character.
  bool at_end_anchor() const { return at('$') && pos_ + 1 == pattern_.size(); }

  std::string alternation(int depth) {
    if (depth > kMaxSchemaDepth) refuse("nests groups deeper than " + std::to_string(kMaxSchemaDepth));
    std::vector<std::string> alternatives = {sequence(depth)};
    while (at('|')) {
      ++pos_;
      alternatives.push_back(sequence(depth));
    }
    const bool any_empty =
        std::any_of(alternatives.begin(), alternatives.end(), [](const auto& a) { return a.empty(); });
    const std::string joined = join(alternatives, " | ");
    if (joined.empty()) return "";
    if (any_empty) return "( " + joined + " )?";
    return alternatives.size() == 1 ? joined : "( " + joined + " )";
  }

  std::string sequence(int depth) {
    std::vector<std::string> pieces;
    while (pos_ < pattern_.size() && !at('|') && !at(')') && !at_end_anchor()) {
      const std::string piece = atom(depth);
      pieces.push_back(quantified(piece));
    }
    return join(pieces, " ");
  }

  // One atom: a single GBNF token or a parenthesised group, so that a quantifier can follow it.
  std::string atom(int depth) {
    const char32_t c = pattern_[pos_++];
    switch (c) {
      case '(': {
        if (at('?')) {
          if (pos_ + 1 < pattern_.size() && pattern_[pos_ + 1] == ':') {
            pos_ += 2;
          } else {
            refuse("uses a lookaround or named group '(?', which is unsupported");
          }
        }
        const std::string inner = alternation(depth + 1);
        if (!at(')')) refuse("has an unclosed '('");
        ++pos_;
        return inner.empty() ? "" : "( " + inner + " )";
      }
      case '[': return character_class();
      case '.': return json_char_in(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}), path_);
      case '\\': return escape();
      case '^': refuse("has the anchor '^' inside it");
      case '$': refuse("has the anchor '$' inside it");
      case '*':
      case '+':
      case '?': refuse("repeats nothing");
      default: return literal(c);
    }
  }

  std::string quantified(const std::string& atom) {
    int min = 0, max = kUnbounded;
    if (at('*')) {
      ++pos_;
    } else if (at('+')) {
      ++pos_;
      min = 1;
    } else if (at('?')) {
      ++pos_;
      max = 1;
    } else if (!braces(min, max)) {
      return atom;
    }
    if (at('?')) ++pos_;  // lazy: the same strings
    if (atom.empty()) return "";
    if (at('*') || at('+') || at('?') || at('{')) refuse("repeats a repetition");
    return converter_.repeat(atom, min, max, path_);
  }

  // {m}, {m,}, {m,n}; anything else is a literal '{' (as JavaScript reads it).
  bool braces(int& min, int& max) {
    if (!at('{')) return false;
    size_t p = pos_ + 1;
    auto number = [&](int& out) {
      const size_t start = p;
      long long value = 0;
      while (p < pattern_.size() && pattern_[p] >= '0' && pattern_[p] <= '9') {
        value = std::min<long long>(value * 10 + (pattern_[p++] - '0'), kMaxSchemaRules + 1);
      }
      out = static_cast<int>(value);
      return p > start;
    };
    if (!number(min)) return false;
    max = min;
    if (p < pattern_.size() && pattern_[p] == ',') {
      ++p;
      if (!number(max)) max = kUnbounded;
    }
    if (p >= pattern_.size() || pattern_[p] != '}') return false;
    if (max != kUnbounded && max < min) refuse("has a repetition {m,n} with n below m");
    pos_ = p + 1;
    return true;
  }

  // The class escapes \d \w \s and their negations; false for any other escape letter.
  static bool class_escape(char32_t letter, Ranges& ranges, bool& negated) {
    static const Ranges kDigit = {{'0', '9'}};
    static const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
    static const Ranges kSpace = {{'\t', '\r'},     {' ', ' '},       {0xA0, 0xA0},     {0x1680, 0x1680},
                                  {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F},
                                  {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
    const char32_t lower = letter | 0x20;
    if (lower != 'd' && lower != 'w' && lower != 's') return false;
    ranges = lower == 'd' ? kDigit : lower == 'w' ? kWord : kSpace;
    negated = letter != lower;
    return true;
  }

  char32_t hex_digit() {
    const char32_t h = pos_ < pattern_.size() ? pattern_[pos_++] : 0;
    if (h >= '0' && h <= '9') return h - '0';
    if ((h | 0x20) >= 'a' && (h | 0x20) <= 'f') return (h | 0x20) - 'a' + 10;
    refuse("has a bad hexadecimal escape");
  }

  // A code point after '\' (\n, \x41, \u0041, \u{1F600}, \cJ, \., ...); no surrogates, which
  // are no characters.
  char32_t escaped_code_point(bool in_class) {
    const char32_t c = escaped_unit(in_class);
    if ((c >= 0xD800 && c <= 0xDFFF) || c > kMaxCodePoint) refuse("has an escape that is no character");
    return c;
  }

  char32_t escaped_unit(bool in_class) {
    if (pos_ >= pattern_.size()) refuse("ends with '\\'");
    const char32_t c = pattern_[pos_++];
    auto hex = [&](size_t digits) {
      char32_t value = 0;
      for (size_t i = 0; i < digits; ++i) value = value * 16 + hex_digit();
      return value;
    };
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0': return 0;
      case 'x': return hex(2);
      case 'u': {
        if (!at('{')) return hex(4);
        ++pos_;
        char32_t value = 0;
        for (int digits = 0; !at('}'); ++digits) {
          if (digits == 6) refuse("has a bad \\u{...} escape");
          value = value * 16 + hex_digit();
        }
        ++pos_;
        return value;
      }
      case 'c': {
        if (pos_ >= pattern_.size() || (pattern_[pos_] | 0x20) < 'a' || (pattern_[pos_] | 0x20) > 'z')
          refuse("has a bad \\c escape");
        return pattern_[pos_++] % 32;
      }
      case 'b':
        if (in_class) return '\b';
        refuse("uses the word boundary '\\b', which is unsupported");
      case 'B': refuse("uses the word boundary '\\B', which is unsupported");
      case 'k': refuse("uses the backreference '\\k', which is unsupported");
      case 'p':
      case 'P': refuse("uses a Unicode property escape, which is unsupported");
      default:
        if (c >= '1' && c <= '9')
          refuse("uses a backreference '\\" + std::string(1, static_cast<char>(c)) + "', which is unsupported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
          refuse("has the unknown escape '\\" + std::string(1, static_cast<char>(c)) + "'");
        return c;  // an escaped punctuation character is itself
    }
  }

  std::string escape() {
    Ranges ranges;
    bool negated = false;
    if (pos_ < pattern_.size() && class_escape(pattern_[pos_], ranges, negated)) {
      ++pos_;
      return json_char_in(negated ? complement(ranges) : ranges, path_);
    }
    return literal(escaped_code_point(false));
  }

  std::string character_class() {
    const bool negated = at('^');
    if (negated) ++pos_;
    Ranges ranges;
    while (!at(']')) {
      if (pos_ >= pattern_.size()) refuse("has an unclosed '['");
      char32_t low = 0;
      if (!class_member(ranges, low)) continue;
      char32_t high = low;
      if (at('-') && pos_ + 1 < pattern_.size() && pattern_[pos_ + 1] != ']') {
        ++pos_;
        if (!class_member(ranges, high)) refuse("has a range that ends in a class escape");
        if (high < low) refuse("has a character range that runs backwards");
      }
      ranges.emplace_back(low, high);
    }
    ++pos_;
    return json_char_in(negated ? complement(ranges) : ranges, path_);
  }

  // One member of a class: a code point (true, in `c`), or a class escape added to `ranges`.
  bool class_member(Ranges& ranges, char32_t& c) {
    if (!at('\\')) {
      c = pattern_[pos_++];
      return true;
    }
    ++pos_;
    Ranges escape_ranges;
    bool negated = false;
    if (pos_ < pattern_.size() && class_escape(pattern_[pos_], escape_ranges, negated)) {
      ++pos_;
      const Ranges added = negated ? complement(escape_ranges) : escape_ranges;
      ranges.insert(ranges.end(), added.begin(), added.end());
      return false;
    }
    c = escaped_code_point(true);
    return true;
  }

  SchemaConverter& converter_;
  std::string path_;
  std::u32string pattern_;
  size_t pos_ = 0;
};

std::string SchemaConverter::visit_string(const json& schema, const std::string& path, const std::string& name) {
  const bool has_length = schema.contains("minLength") || schema.contains("maxLength");
  if (schema.contains("format")) {
    for (const char* other : {"pattern", "minLength", "maxLength"}) {
      if (schema.contains(other)) fail(std::string("unsupported keyword '") + other + "' next to 'format'", path);
    }
    const json& format = schema["format"];
    if (!format.is_string() || !find_fixed_rule(format.get<std::string>() + "-string")) {
      fail("unsupported keyword 'format' value " + format.dump(), path + "/format");
    }
    return use(format.get<std::string>() + "-string");
  }
  if (schema.contains("pattern")) {
    if (has_length)
      fail(std::string("unsupported keyword '") + (schema.contains("minLength") ? "minLength" : "maxLength") +
               "' next to 'pattern'",
           path);
    if (!schema["pattern"].is_string()) fail("keyword 'pattern' must be a string", path);
    const std::string body = PatternTranslator(*this, path + "/pattern").translate(schema["pattern"]);
    return add_rule(name, join({R"("\"")", body, R"("\"")", use("space")}, " "), path);
  }
  if (!has_length) return use("string");
  const int min = count_keyword(schema, "minLength", 0, path);
  const int max = count_keyword(schema, "maxLength", kUnbounded, path);
  if (max != kUnbounded && max < min) fail("keyword 'maxLength' is below 'minLength'", path);
  return add_rule(name, join({R"("\"")", repeat(use("char"), min, max, path), R"("\"")", use("space")}, " "), path);
}

// A string that spells none of `declared` (an additional property's name): a trie of the names,
// one rule per node, each allowing any other character to leave the trie for good.
std::string SchemaConverter::other_key(const std::set<std::string>& declared, const std::string& path,
                                       const std::string& name) {
  struct Node {
    std::map<char32_t, size_t> children;
    bool ends_a_name = false;
  };
  std::vector<Node> trie(1);
  for (const std::string& key : declared) {
    std::u32string code_points;
    if (!decode_utf8(key, code_points)) fail("property name is not valid UTF-8", path);
    size_t node = 0;
    for (const char32_t c : code_points) {
      auto [it, added] = trie[node].children.emplace(c, trie.size());
      if (added) trie.emplace_back();
      node = it->second;
      charge(1, path);
    }
    trie[node].ends_a_name = true;
  }
  const std::string char_rule = use("char");
  // A rule per node, named first (the bodies name the children's rules), written below.
  const size_t first_node_rule = rules_.size();
  std::vector<std::string> node_rules;
  for (size_t i = 0; i < trie.size(); ++i) node_rules.push_back(add_rule(name + "-other-key", "", path));
  for (size_t i = 0; i < trie.size(); ++i) {
    std::vector<std::string> alternatives;
    Ranges taken;
    std::string taken_escapes;
    for (const auto& [c, child] : trie[i].children) {
      alternatives.push_back(gbnf_literal(json_encoded(c)) + " " + node_rules[child]);
      taken.emplace_back(c, c);
      const std::string encoded = json_encoded(c);
      if (encoded.size() == 2 && encoded[0] == '\\') taken_escapes += encoded[1];
    }
    // Any character that leaves the trie: written as itself, or as an escape the names do not use.
    taken.insert(taken.end(), json_escaped_chars().begin(), json_escaped_chars().end());
    std::string simple_escapes;
    for (const char e : std::string("\"\\/bfnrt")) {
      if (taken_escapes.find(e) == std::string::npos) simple_escapes += class_char(static_cast<unsigned char>(e));
    }
    std::string escapes = R"("u" [0-9a-fA-F]{4})";
    if (!simple_escapes.empty()) escapes = "[" + simple_escapes + "] | " + escapes;
    alternatives.push_back("( " + class_text(normalized(taken), true) + " | \"\\\\\" ( " + escapes + " ) ) " +
                           char_rule + "*");
    const std::string body = join(alternatives, " | ");
    rules_[first_node_rule + i].second = trie[i].ends_a_name ? body : "( " + body + " )?";
  }
  return add_rule(name + "-other-name", join({R"("\"")", node_rules[0], R"("\"")", use("space")}, " "), path);
}

std::string SchemaConverter::visit_object(const json& schema, const std::string& path, const std::string& name,
                                          int depth) {
  const json properties = schema.value("properties", json::object());
  const json required = schema.value("required", json::array());
  if (!properties.is_object()) fail("keyword 'properties' must be an object", path);
  if (!required.is_array()) fail("keyword 'required' must be an array", path);
  // Required members in the order of "required", then the optional ones in key order.
  std::vector<std::string> required_names, optional_names;
  for (const json& entry : required) {
    if (!entry.is_string()) fail("keyword 'required' must list strings", path + "/required");
    const std::string key = entry.get<std::string>();
    if (std::find(required_names.begin(), required_names.end(), key) == required_names.end())
      required_names.push_back(key);
  }
  for (const auto& [key, unused] : properties.items()) {
    if (std::find(required_names.begin(), required_names.end(), key) == required_names.end())
      optional_names.push_back(key);
  }
  auto member = [&](const std::string& key) {
    const bool declared = properties.contains(key);
    const json& member_schema = declared ? properties[key] : json(true);  // required, not described: any value
    const std::string member_path = declared ? path + "/properties/" + pointer_token(key) : path + "/required";
    const std::string value = visit_inside(member_schema, member_path, name + "-" + key, depth + 1);
    return add_rule(name + "-" + key + "-kv",
                    join({gbnf_literal(json(key).dump()), use("space"), "\":\"", use("space"), value}, " "),
                    member_path);
  };
  std::vector<std::string> required_members;
  for (const std::string& key : required_names) required_members.push_back(member(key));
  // Optional members: a chain of rules, rest_i = member_i ("," rest_{i+1})? | rest_{i+1}, so that
  // any ordered subset may appear.
  std::vector<std::string> optional_members;
  for (const std::string& key : optional_names) {
    if (properties[key] != false) optional_members.push_back(member(key));  // false: the member never appears
  }
  std::string rest;
  for (size_t i = optional_members.size(); i-- > 0;) {
    rest = rest.empty()
               ? optional_members[i]
               : add_rule(name + "-rest", optional_members[i] + " ( \",\" space " + rest + " )? | " + rest, path);
  }
  std::string additional;
  const json additional_schema = schema.value("additionalProperties", json(true));
  if (additional_schema != false) {
    std::set<std::string> declared(required_names.begin(), required_names.end());
    for (const auto& [key, unused] : properties.items()) declared.insert(key);
    const std::string key_rule = declared.empty() ? use("string") : other_key(declared, path, name);
    const std::string value =
        visit_inside(additional_schema, path + "/additionalProperties", name + "-additional", depth + 1);
    additional = add_rule(name + "-additional-kv", key_rule + " \":\" " + use("space") + " " + value, path);
  }
  const std::string more_additional = additional.empty() ? "" : "( \",\" space " + additional + " )*";
  std::string members;
  if (!required_members.empty()) {
    members = join(
        {join(required_members, " \",\" space "), rest.empty() ? "" : "( \",\" space " + rest + " )?", more_additional},
        " ");
  } else {
    std::vector<std::string> starts;
    if (!rest.empty()) starts.push_back(rest + (more_additional.empty() ? "" : " " + more_additional));
    if (!additional.empty()) starts.push_back(additional + " " + more_additional);
    if (!starts.empty()) members = "( " + join(starts, " | ") + " )?";
  }
  use("space");
  return add_rule(name, join({"\"{\" space", members, "\"}\" space"}, " "), path);
}

std::string SchemaConverter::visit_array(const json& schema, const std::string& path, const std::string& name,
                                         int depth) {
  const json prefix = schema.value("prefixItems", json::array());
  const json items = schema.value("items", json(true));
  if (!prefix.is_array()) fail("keyword 'prefixItems' must be an array", path);
  if (!items.is_boolean() && !items.is_object())
    fail("unsupported keyword 'items' as an array (use prefixItems)", path);
  const int count = static_cast<int>(std::min<size_t>(prefix.size(), kMaxSchemaRules + 1));
  const int min = count_keyword(schema, "minItems", 0, path);
  int max = count_keyword(schema, "maxItems", kUnbounded, path);
  if (items == false) max = max == kUnbounded ? count : std::min(max, count);
  if (max != kUnbounded && max < min) fail("keyword 'minItems' asks for more items than the array may hold", path);
  use("space");
  // Element i: a prefix item's schema, then `items`.
  const int prefix_used = max == kUnbounded ? count : std::min(max, count);
  std::vector<std::string> prefix_rules;
  for (int i = 0; i < prefix_used; ++i) {
    charge(1, path);
    prefix_rules.push_back(visit_inside(prefix[static_cast<size_t>(i)], path + "/prefixItems/" + std::to_string(i),
                                        name + "-" + std::to_string(i), depth + 1));
  }
  // After the prefix: the items, as many as the bounds leave.
  std::string tail;
  const bool more_items = items != false && (max == kUnbounded || max > prefix_used);
  if (more_items) {
    const std::string item = visit_inside(items, path + "/items", name + "-item", depth + 1);
    const int least = std::max(0, min - prefix_used);
    const int most = max == kUnbounded ? kUnbounded : max - prefix_used;
    const std::string separated = "( \",\" space " + item + " )";
    if (prefix_used > 0) {
      tail = repeat(separated, least, most, path);
    } else {
      tail = join({item, repeat(separated, std::max(0, least - 1), most == kUnbounded ? kUnbounded : most - 1, path)},
                  " ");
      if (least == 0) tail = "( " + tail + " )?";
    }
  }
  // The prefix from its end: an element past minItems may be the last, so it and what follows
  // are an optional rule of their own (no deep nesting of groups).
  for (int i = prefix_used; i-- > 0;) {
    const std::string element = join({i > 0 ? "\",\" space" : "", prefix_rules[static_cast<size_t>(i)], tail}, " ");
    tail = i < min ? element : add_rule(name + "-from-" + std::to_string(i), element, path) + "?";
  }
  return add_rule(name, join({"\"[\" space", tail, "\"]\" space"}, " "), path);
}

}  // namespace

std::string json_schema_to_gbnf(const nlohmann::json& schema, const std::string& root_name) {
  try {
    return SchemaConverter(schema, root_name).convert();
  } catch (const nlohmann::json::exception& e) {  // e.g. a string that is not UTF-8, built in code
    throw GrammarError(std::string("json_schema: invalid schema: ") + e.what());
  }
}

std::string json_object_gbnf() { return json_schema_to_gbnf({{"type", "object"}}); }

std::string json_value_gbnf() { return json_schema_to_gbnf(true); }

}  // namespace ringlm

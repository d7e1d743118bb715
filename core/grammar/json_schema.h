// JSON Schema -> GBNF: the grammar that lets a model write only JSON documents a schema accepts
// (OpenAI's response_format {"type": "json_schema"}), in the ideas of llama.cpp's
// json_schema_to_grammar, for the subset below. A schema outside it is refused, never guessed at.
//
// Supported: type (one or a list), properties, required, additionalProperties (false, true or a
// schema), enum, const, items, prefixItems, minItems/maxItems, anyOf/oneOf, allOf of objects,
// local $ref ("#", "#/$defs/...", "#/definitions/...", any pointer into the document; recursion
// included), minLength/maxLength, format (date, time, date-time, uuid) and pattern (literals,
// escapes, ., classes, groups, |, *, +, ?, {m,n}, ^ and $ at the ends). Annotations (description,
// title, $schema, $comment, default, examples, deprecated, readOnly, writeOnly) are ignored.
//
// Where the grammar is narrower or wider than the schema, by choice:
// - Object members come in one order: the required ones in the order of "required", then the
//   optional ones (each may be absent) in key order (nlohmann::json keeps no other), then the
//   additional ones. additionalProperties absent means any other member is allowed, as JSON
//   Schema and llama.cpp say; give false for OpenAI's strict mode. An additional member's name
//   never spells a declared one (written without escapes).
// - A schema with no "type" takes the types its keywords imply (properties: an object, items: an
//   array, minLength: a string...), as llama.cpp does; with none of them, any value.
// - minimum, maximum, exclusiveMinimum and exclusiveMaximum are accepted and ignored: any integer
//   or number matches. An integer has at most 16 digits, a fraction at most 16, an exponent at
//   most 2, so that a model cannot write digits forever nor a number past a double's range (a
//   model wrote 4500000000000000e640, which JSON parsers refuse); "integer" never has a fraction.
// - Whitespace between tokens is bounded: nothing, a space, or a line break and up to 20 spaces or
//   tabs. The document starts with its value.
// - enum and const values are written compactly (nlohmann's dump); oneOf does not check that only
//   one alternative matches.
// - Refused because a grammar cannot intersect them: pattern or format with minLength/maxLength,
//   $ref/anyOf/oneOf/allOf with other constraints beside them, enum/const with any but type.
// - pattern follows JavaScript's semantics (unanchored unless ^ and $, . stops at line ends); its
//   strings escape only what JSON must: \", \\ and control characters (\n or \u000a alike).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/grammar/grammar.h"

namespace ringlm {

// GBNF text whose root rule matches exactly the JSON documents valid under `schema` (the subset
// above). Throws GrammarError naming the unsupported keyword and where it is, e.g.
// "json_schema: unsupported keyword 'patternProperties' at /properties/a"; likewise for a schema
// nested deeper than kMaxSchemaDepth, a grammar of more than kMaxSchemaRules rules (bounded
// repetitions count as many rules as their bound, as the grammar engine expands them), a $ref
// loop that reads nothing, or a schema that is neither an object nor a boolean.
// `root_name`: the rule that matches the document; another name leaves "root" free for a grammar
// that embeds this one (a tool call's arguments inside the call's tags).
std::string json_schema_to_gbnf(const nlohmann::json& schema, const std::string& root_name = "root");

inline constexpr int kMaxSchemaDepth = 64;
inline constexpr int kMaxSchemaRules = 10000;

// GBNF for any JSON object (OpenAI's response_format {"type": "json_object"}), and for any JSON
// value, with the same whitespace and number bounds.
std::string json_object_gbnf();
std::string json_value_gbnf();

}  // namespace ringlm

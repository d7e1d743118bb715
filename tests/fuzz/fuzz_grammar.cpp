// libFuzzer target for the grammar engine and the JSON Schema converter: any input must compile
// or throw GrammarError, and a compiled grammar must follow any text without another exception.
// The first byte chooses: GBNF text, or a JSON Schema (the rest of the input); after a GBNF
// grammar, the input is also fed to its matcher in pieces, split code points included.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/grammar/grammar.h"
#include "core/grammar/json_schema.h"

namespace {

volatile bool g_sink;

void follow(const std::shared_ptr<const ringlm::Grammar>& grammar, std::string_view text) {
  ringlm::GrammarMatcher m(grammar);
  for (size_t at = 0; at < text.size(); at += 3) {
    (void)m.accept(text.substr(at, 3));  // (refused pieces leave it as it was)
  }
  g_sink = m.accepting() || m.finished();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 0) {
      const auto grammar = ringlm::Grammar::parse(input);
      follow(grammar, input);
    } else {
      const nlohmann::json schema = nlohmann::json::parse(input, nullptr, false);
      if (schema.is_discarded()) return 0;
      const auto grammar = ringlm::Grammar::parse(ringlm::json_schema_to_gbnf(schema));
      follow(grammar, "{\"a\": [1, \"b\", null]}");
    }
  } catch (const ringlm::GrammarError&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  return 0;
}

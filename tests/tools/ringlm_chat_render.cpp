// Test tool for the Jinja comparison (tests/reference/check_chat_templates.py): recognises a chat
// template file (or takes a format by name), renders a conversation with ringlm's ChatTemplate
// and prints {"format", "starts_with_bos", "default_system_prompt", "text"} as JSON. `text` is
// render(), without the leading BOS that starts_with_bos says the caller adds.
//
//   ringlm_chat_render (TEMPLATE_FILE | --format NAME) MESSAGES_JSON [--bos TEXT] [--eos TEXT] [--date YYYY-MM-DD]
//                      [--tools TOOLS_JSON]
//
// --date: the date a format that writes one says it is (harmony's "Current date"; default today).
// MESSAGES_JSON holds [{"role": ..., "content": ...}, ...], as OpenAI's messages: an assistant's
// "tool_calls" ([{"id", "function": {"name", "arguments"}}], arguments a JSON text) and a tool
// message's "tool_call_id" too. TOOLS_JSON: OpenAI's "tools". Errors: a message on stderr, exit 1.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/session/chat_template.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<ringlm::ChatMessage> read_messages(const std::string& path) {
  const nlohmann::json json = nlohmann::json::parse(read_file(path));
  if (!json.is_array()) throw std::runtime_error(path + ": expected a JSON array of messages");
  std::vector<ringlm::ChatMessage> messages;
  for (const nlohmann::json& message : json) {
    ringlm::ChatMessage m{message.at("role").get<std::string>(), message.value("content", std::string())};
    for (const nlohmann::json& call : message.value("tool_calls", nlohmann::json::array())) {
      m.tool_calls.push_back({call.at("id").get<std::string>(), call.at("function").at("name").get<std::string>(),
                              call.at("function").at("arguments").get<std::string>()});
    }
    m.tool_call_id = message.value("tool_call_id", std::string());
    messages.push_back(std::move(m));
  }
  return messages;
}

// OpenAI's "tools", read keeping the order of their members (the templates write them so).
std::vector<ringlm::ToolDefinition> read_tools(const std::string& path) {
  std::vector<ringlm::ToolDefinition> tools;
  if (path.empty()) return tools;
  for (const ringlm::OrderedJson& tool : ringlm::OrderedJson::parse(read_file(path))) {
    tools.push_back(ringlm::ToolDefinition::from_openai(tool));
  }
  return tools;
}

ringlm::ChatTemplate choose_template(const std::string& template_path, const std::string& format,
                                     const ringlm::ChatSpecialTokens& special) {
  if (!format.empty()) return ringlm::ChatTemplate::from_name(format, special);
  std::optional<ringlm::ChatTemplate> detected = ringlm::ChatTemplate::detect(read_file(template_path), special);
  if (!detected) throw std::runtime_error(template_path + ": no known chat format in this template");
  return *detected;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  std::string format;
  ringlm::ChatSpecialTokens special;
  std::string date, tools_path;
  CLI::App app{"ringlm_chat_render: render a conversation with the chat format a template is recognised as"};
  app.add_option("files", files, "[TEMPLATE_FILE] MESSAGES_JSON (messages: [{\"role\", \"content\"}, ...])")
      ->required()
      ->expected(1, 2);
  app.add_option("--format", format, "a format by name instead of a template file");
  app.add_option("--bos", special.bos, "BOS token text");
  app.add_option("--eos", special.eos, "EOS token text");
  app.add_option("--tools", tools_path, "OpenAI's \"tools\" as a JSON file");
  app.add_option("--date", date, "the date the conversation is rendered on (YYYY-MM-DD; default: today)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help: 0
  }
  try {
    const bool has_template_file = files.size() == 2;
    if (has_template_file == !format.empty()) throw std::runtime_error("give either a template file or --format NAME");
    const std::string template_path = has_template_file ? files[0] : "";
    const std::string& messages_path = files.back();
    ringlm::ChatTemplate chat_template = choose_template(template_path, format, special);
    chat_template.set_date(date);
    const std::vector<ringlm::ChatMessage> messages = read_messages(messages_path);
    nlohmann::json out;
    out["format"] = chat_template.name();
    out["starts_with_bos"] = chat_template.starts_with_bos();
    out["default_system_prompt"] = chat_template.default_system_prompt();
    out["text"] = chat_template.render(messages, read_tools(tools_path));
    std::printf("%s\n", out.dump().c_str());  // dump() throws on invalid UTF-8: reported below
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringlm_chat_render: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

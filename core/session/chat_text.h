// Pieces of text the chat formats share, for chat_template.cpp and chat_template_tools.cpp.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

namespace ringlm::chat_text {

// Python's str.strip(), which the templates' `trim` filter is: Unicode whitespace off both ends.
std::string_view python_strip(std::string_view text);

std::string concat(std::initializer_list<std::string_view> parts);

// Formats without a system role get the system prompt in front of the first user message, as
// llama.cpp does.
std::string fold_system(std::string_view content, bool first, std::string_view system);

// Llama 3.1's system header after "Environment: ipython" (the date its template writes when the
// caller gives none).
inline constexpr std::string_view kLlama3DatedHeader =
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";

std::string llama3_header(std::string_view role);

// gpt-oss's template writes this system message before every conversation, with the default of
// its model_identity variable and its reasoning_effort (default "medium"); with tools, the line
// that sends their calls to the commentary channel. The caller's system message becomes the
// developer message after it.
std::string harmony_system_block(std::string_view date, std::string_view reasoning_effort, bool tools);

}  // namespace ringlm::chat_text

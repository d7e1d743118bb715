#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm tokenize`: the token ids of a text, as llama.cpp's llama-tokenize prints them. Reads
// only the vocabulary, so it also works on vocabulary-only GGUFs.
void add_tokenize_command(CLI::App& app);
}  // namespace ringlm

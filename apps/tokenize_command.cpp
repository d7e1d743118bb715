// `ringlm tokenize [-m MODEL] (-p TEXT | -f FILE) [--ids] [--no-bos] [--no-parse-special]`: how
// the model's tokenizer cuts a text. Only the GGUF's metadata is read (Tokenizer::from_gguf),
// never a tensor, so a vocabulary-only file such as llama.cpp's ggml-vocab-*.gguf works too.
//
// The output is llama-tokenize's: one line per token, `%6d -> 'PIECE'` (the piece's raw bytes,
// special tokens as their text), or with --ids one line `[id, id, ...]`. The text is taken as it
// is (llama-tokenize would turn "\n" written as two characters into a newline; here the shell or
// the file gives the real characters). BOS is added when the vocabulary asks for it, unless
// --no-bos; special-token text such as "<|im_start|>" becomes that token, unless
// --no-parse-special.
#include "apps/tokenize_command.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "core/gguf/gguf.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

namespace {

struct TokenizeOptions {
  std::string model_path;  // empty: the default model
  std::string prompt;
  std::string prompt_file;
  bool print_ids = false;
  bool no_bos = false;
  bool no_parse_special = false;
};

// The whole file, bytes as they are. fopen() also opens a directory; fread() then fails, so
// every failure is caught by looking at ferror() too.
std::string read_text_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot read text file '" + path + "': " + std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) throw std::runtime_error("cannot read text file '" + path + "': " + std::strerror(err));
  return text;
}

void write_bytes(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

void tokenize(const TokenizeOptions& o) {
  const std::string text = o.prompt_file.empty() ? o.prompt : read_text_file(o.prompt_file);
  const std::unique_ptr<GgufFile> gguf = GgufFile::open(resolve_model_path(o.model_path));
  const std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(*gguf);

  const bool add_bos = tok->add_bos_by_default() && !o.no_bos;
  const std::vector<int32_t> ids = tok->encode(text, add_bos, !o.no_parse_special);
  if (o.print_ids) {
    std::string line = "[";
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i > 0) line += ", ";
      line += std::to_string(ids[i]);
    }
    write_bytes(line + "]\n");
  } else {
    for (const int32_t id : ids) {
      char head[32];
      std::snprintf(head, sizeof(head), "%6d -> '", id);
      write_bytes(head + tok->token_to_piece(id, /*render_special=*/true) + "'\n");
    }
  }
  std::fflush(stdout);
  if (std::ferror(stdout)) throw std::runtime_error("cannot write to standard output");
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand("tokenize", "print the tokens of a text (reads only the vocabulary)");
  cmd->add_option("-m,--model", opts->model_path, "GGUF file (a vocabulary-only one will do); default: the default model");
  auto* p = cmd->add_option("-p,--prompt", opts->prompt, "text to tokenize");
  auto* f = cmd->add_option("-f,--file", opts->prompt_file, "read the text from a file");
  cmd->add_flag("--ids", opts->print_ids, "print only the ids, as [id, id, ...]");
  cmd->add_flag("--no-bos", opts->no_bos, "do not add the BOS token that the vocabulary would add");
  cmd->add_flag("--no-parse-special", opts->no_parse_special,
                "treat special-token text (e.g. <|im_start|>) as plain text");
  cmd->callback([opts, p, f] {
    // Checked here rather than with CLI11's excludes/required, so that these mistakes read as
    // every other "ringlm: error: ...".
    if (p->count() > 0 && f->count() > 0) throw std::runtime_error("give the text with -p or -f, not both");
    if (p->count() == 0 && f->count() == 0) throw std::runtime_error("no text: give it with -p TEXT or -f FILE");
    tokenize(*opts);
  });
}

}  // namespace ringlm

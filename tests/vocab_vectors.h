// llama.cpp's test-tokenizer-0 vectors (../shared/data/vocab): X.gguf.inp holds the strings,
// separated by "\n__ggml_vocab_test__\n" (the last one is followed by it too); X.gguf.out holds
// one line of space-separated ids per string.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ringlm::test {

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

inline std::string read_vocab_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The cases of `vocab` (the path of X.gguf).
inline std::vector<VocabCase> read_vocab_cases(const std::string& vocab) {
  const std::string inp = read_vocab_file(vocab + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      cases.push_back({inp.substr(pos), {}});
      break;
    }
    cases.push_back({inp.substr(pos, next - pos), {}});
    pos = next + sep.size();
  }
  std::istringstream out(read_vocab_file(vocab + ".out"));
  std::string line;
  for (VocabCase& c : cases) {
    if (!std::getline(out, line)) throw std::runtime_error(vocab + ".out has too few lines");
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
  }
  return cases;
}

}  // namespace ringlm::test

// libFuzzer target for the GGUF reader: any input must either parse or throw GgufError.
// Any other exception escapes and aborts (libFuzzer reports it as a crash); memory errors are
// caught by the sanitizers the target is built with.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/gguf/gguf.h"

namespace {

volatile size_t g_sink;  // where touch()'s checksum goes, so that its reads are not optimised away

// After a successful parse every accessor must be safe: read what a model loader would read.
size_t touch(const ringlm::GgufFile& f) {
  size_t sum = 0;
  for (const std::string& key : f.keys()) {
    const ringlm::GgufValue* v = f.find(key);
    sum += v->str.size() + v->strings.size() + v->ints.size() + v->floats.size();
    for (std::string_view s : v->strings) sum += s.empty() ? 0 : static_cast<unsigned char>(s.back());
    // The typed getters may refuse the value's type, but only with a GgufError.
    try { sum += f.get_uint(key).value_or(0); } catch (const ringlm::GgufError&) {}
    try { sum += static_cast<size_t>(f.get_float(key).value_or(0) != 0); } catch (const ringlm::GgufError&) {}
    try { sum += f.get_string(key).value_or("").size(); } catch (const ringlm::GgufError&) {}
  }
  for (const ringlm::GgufTensorInfo& t : f.tensors()) {
    sum += static_cast<size_t>(t.n_elements() + t.rows() + t.cols());
    if (t.n_bytes > 0) sum += t.data[0] + t.data[t.n_bytes - 1];  // ASan flags data outside the input
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto file = ringlm::GgufFile::parse(data, size, "fuzz-input");
    g_sink = touch(*file);
  } catch (const ringlm::GgufError&) {
    // Rejected with a message: the expected outcome for most inputs.
  }
  return 0;
}

#include "apps/chat_input.h"

#include <fcntl.h>
#include <histedit.h>
#include <langinfo.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cwchar>
#include <clocale>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string_view>

namespace ringlm {

namespace {

std::atomic<bool> g_interrupt{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the SIGINT handler sets it");

// The self-pipe: the handler also writes a byte here, so a terminal read that waits in poll()
// wakes up whenever the signal lands (even between two reads, where EINTR cannot tell it).
int g_wake_pipe[2] = {-1, -1};

void on_sigint(int) {
  const int saved_errno = errno;
  g_interrupt.store(true);
  if (g_wake_pipe[1] >= 0) {
    const char byte = 1;
    [[maybe_unused]] const ssize_t ignored = write(g_wake_pipe[1], &byte, 1);
  }
  errno = saved_errno;
}

void drain_wake_pipe() {
  char bytes[64];
  while (g_wake_pipe[0] >= 0 && ::read(g_wake_pipe[0], bytes, sizeof bytes) > 0) {
  }
}

bool input_waiting(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
}

std::string strip_newline(std::string_view line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  return std::string(line);
}

class TerminalInput : public ChatInput {
 public:
  explicit TerminalInput(std::string history_file) : history_file_(std::move(history_file)) {
    use_utf8_locale();
    editline_ = el_init("ringlm", stdin, stdout, stderr);
    history_ = history_init();
    HistEvent ev;
    history(history_, &ev, H_SETSIZE, 1000);
    history(history_, &ev, H_SETUNIQUE, 1);
    if (!history_file_.empty()) history(history_, &ev, H_LOAD, history_file_.c_str());
    el_set(editline_, EL_EDITOR, "emacs");
    el_set(editline_, EL_HIST, history, history_);
    el_set(editline_, EL_CLIENTDATA, this);
    el_set(editline_, EL_PROMPT, &TerminalInput::prompt);
    el_set(editline_, EL_GETCFN, &TerminalInput::read_key);
    el_source(editline_, nullptr);  // the user's ~/.editrc
  }

  ~TerminalInput() override {
    if (!history_file_.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(history_file_).parent_path(), ec);
      HistEvent ev;
      history(history_, &ev, H_SAVE, history_file_.c_str());
    }
    history_end(history_);
    el_end(editline_);
  }

  bool is_terminal() const override { return true; }

  InputEvent read() override {
    std::string message;
    continuing_ = false;
    typed_at_interrupt_.clear();
    while (true) {
      // A Ctrl-C that came while no read was waiting (between two prompts) counts now.
      drain_wake_pipe();
      if (g_interrupt.exchange(false)) {
        std::fputc('\n', stdout);
        return {InputEvent::Kind::kInterrupt, message};
      }
      int count = 0;
      const char* line = el_gets(editline_, &count);
      if (line == nullptr || count <= 0) {
        if (g_interrupt.exchange(false)) {
          message += typed_at_interrupt_;
          std::fputc('\n', stdout);
          return {InputEvent::Kind::kInterrupt, message};
        }
        if (!message.empty()) break;  // Ctrl-D after a continued line: send what there is
        std::fputc('\n', stdout);
        return {InputEvent::Kind::kEnd, {}};
      }
      std::string text = strip_newline(line);
      // A trailing backslash asks for another line; a paste delivers its next lines at once.
      const bool continued = !text.empty() && text.back() == '\\';
      if (continued) text.pop_back();
      if (!message.empty()) message += '\n';
      message += text;
      continuing_ = true;
      if (!continued && !input_waiting(STDIN_FILENO)) break;
    }
    if (!message.empty()) {
      HistEvent ev;
      history(history_, &ev, H_ENTER, message.c_str());
    }
    return {InputEvent::Kind::kMessage, message};
  }

 private:
  // libedit's own key reader retries a read() that SIGINT interrupted and cannot see a signal
  // that lands between two reads, so Ctrl-C would wait for the next key. This one waits on the
  // terminal and the self-pipe together: on Ctrl-C it keeps the line typed so far and fails the
  // read, which ends el_gets at once.
  static int read_key(EditLine* el, wchar_t* key) {
    void* self = nullptr;
    el_get(el, EL_CLIENTDATA, &self);
    auto* input = static_cast<TerminalInput*>(self);
    std::mbstate_t state{};
    while (true) {
      if (g_interrupt.load()) {
        const LineInfo* typed = el_line(el);
        input->typed_at_interrupt_.assign(typed->buffer, typed->lastchar);
        errno = EINTR;
        return -1;
      }
      pollfd waiting[2] = {{STDIN_FILENO, POLLIN, 0}, {g_wake_pipe[0], POLLIN, 0}};
      if (poll(waiting, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return -1;
      }
      if (waiting[1].revents != 0) drain_wake_pipe();
      if (waiting[0].revents == 0) continue;
      char byte = 0;
      const ssize_t got = ::read(STDIN_FILENO, &byte, 1);
      if (got == 0) return 0;  // end of input
      if (got < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return -1;
      }
      // One wide character from UTF-8 bytes (the locale is UTF-8); a broken sequence is dropped.
      const std::size_t decoded = std::mbrtowc(key, &byte, 1, &state);
      if (decoded == static_cast<std::size_t>(-2)) continue;
      if (decoded == static_cast<std::size_t>(-1)) {
        state = {};
        continue;
      }
      if (decoded == 0) *key = L'\0';
      return 1;
    }
  }

  static const char* prompt(EditLine* el) {
    void* self = nullptr;
    el_get(el, EL_CLIENTDATA, &self);
    return static_cast<TerminalInput*>(self)->continuing_ ? "... " : "> ";
  }

  // libedit handles multibyte characters only under a UTF-8 LC_CTYPE; numbers (LC_NUMERIC)
  // keep the C locale.
  static void use_utf8_locale() {
    std::setlocale(LC_CTYPE, "");
    if (std::string_view(nl_langinfo(CODESET)) != "UTF-8") std::setlocale(LC_CTYPE, "C.UTF-8");
  }

  std::string history_file_;
  EditLine* editline_ = nullptr;
  History* history_ = nullptr;
  bool continuing_ = false;
  std::string typed_at_interrupt_;  // the line on screen when Ctrl-C ended el_gets
};

class PipeInput : public ChatInput {
 public:
  bool is_terminal() const override { return false; }
  InputEvent read() override {
    std::string line;
    if (!std::getline(std::cin, line)) return {InputEvent::Kind::kEnd, {}};
    return {InputEvent::Kind::kMessage, strip_newline(line)};
  }
};

}  // namespace

void install_interrupt_handler() {
  if (g_wake_pipe[0] < 0 && pipe2(g_wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) g_wake_pipe[0] = g_wake_pipe[1] = -1;
  struct sigaction action {};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART: a blocking wait returns EINTR and looks at the flag
  sigaction(SIGINT, &action, nullptr);
}

std::atomic<bool>& interrupt_requested() { return g_interrupt; }

std::unique_ptr<ChatInput> make_terminal_input(const std::string& history_file) {
  return std::make_unique<TerminalInput>(history_file);
}

std::unique_ptr<ChatInput> make_pipe_input() { return std::make_unique<PipeInput>(); }

}  // namespace ringlm

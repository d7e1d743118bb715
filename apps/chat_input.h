// Where `ringlm chat` reads its messages: a terminal (libedit line editing and history) or a
// pipe (one message per line).
//
// Ctrl-C is one SIGINT handler for the whole chat: it sets interrupt_requested(), which stops
// a reply being generated, and it wakes a terminal read through a self-pipe (the key reader
// waits on the terminal and that pipe together), so the line being typed is reported at once.
#pragma once

#include <atomic>
#include <memory>
#include <string>

namespace ringlm {

// Installs the SIGINT handler (once). Until then Ctrl-C ends the process as usual.
void install_interrupt_handler();
std::atomic<bool>& interrupt_requested();

struct InputEvent {
  enum class Kind {
    kMessage,    // `text` is one message (several lines joined with '\n' for a continued or pasted one)
    kInterrupt,  // Ctrl-C at the prompt; `text` holds what had been typed (empty at an empty prompt)
    kEnd,        // Ctrl-D at an empty prompt, or the end of the input
  };
  Kind kind;
  std::string text;
};

class ChatInput {
 public:
  virtual ~ChatInput() = default;
  virtual InputEvent read() = 0;
  virtual bool is_terminal() const = 0;
};

// libedit on the terminal: emacs key bindings, history (kept in `history_file` when not empty),
// a line ending in a backslash continued on the next, a paste of several lines taken as one
// message (lines that are already waiting when one ends belong to it).
std::unique_ptr<ChatInput> make_terminal_input(const std::string& history_file);
// One message per line of stdin.
std::unique_ptr<ChatInput> make_pipe_input();

}  // namespace ringlm

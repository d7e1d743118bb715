// The generation state and loop (core/session/generation.h):
//  - hand-built token sequences with real vocabularies (llama.cpp's GPT-2 and SentencePiece
//    ones): stop strings split over several tokens are never shown, partial matches that do not
//    complete are released intact, characters split across tokens, end tokens and ignore_eos,
//    the token limit; whatever happens, the pieces handed out join into the final text;
//  - generate() driven by a scripted model: which tokens are evaluated, the full-context rule
//    in both of its forms, the stop flag;
//  - the real model (SmolLM2): the pieces streamed by generate() are the text `ringlm batch`'s
//    scheduler returns for the same prompt and stop string.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/grammar/grammar.h"
#include "core/grammar/token_constraint.h"
#include "core/model/loader.h"
#include "core/scheduler/batch_scheduler.h"
#include "core/session/generation.h"
#include "core/session/sequence_model.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/build_scale.h"

namespace ringlm {
namespace {

const std::string kVocabDir = std::string(RINGLM_SHARED_DATA) + "/vocab/";

std::unique_ptr<Tokenizer> load_vocab(const std::string& name) {
  const auto gguf = GgufFile::open(kVocabDir + name + ".gguf");
  return Tokenizer::from_gguf(*gguf);
}

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A generation fed tokens by hand, remembering every piece it handed out.
class Feed {
 public:
  Feed(const Tokenizer& tok, StopConditions stop)
      : tok_(tok), sampler_(greedy(), tok.n_vocab()), g_(tok, sampler_, std::move(stop), {}) {}

  // Takes the tokens of `text` (encoded on its own, so its start and end are token boundaries);
  // returns the text those steps handed out.
  std::string take_text(std::string_view text) {
    std::string out;
    for (int32_t id : tok_.encode(text, /*add_bos=*/false, /*parse_special=*/false)) {
      if (g_.finished()) break;
      out += take(id);
    }
    return out;
  }
  std::string take(int32_t id) { return keep(g_.take(id)); }
  std::string finish(FinishReason why) { return keep(g_.finish(why)); }

  std::string joined() const {
    std::string all;
    for (const std::string& p : pieces_) all += p;
    return all;
  }
  const std::vector<std::string>& pieces() const { return pieces_; }
  Generation& generation() { return g_; }

 private:
  std::string keep(const GenerationStep& step) {
    pieces_.push_back(step.text);
    return step.text;
  }

  const Tokenizer& tok_;
  Sampler sampler_;
  Generation g_;
  std::vector<std::string> pieces_;
};

class GenerationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    gpt2_ = load_vocab("ggml-vocab-gpt-2").release();
    spm_ = load_vocab("ggml-vocab-llama-spm").release();
  }
  static void TearDownTestSuite() {
    delete gpt2_;
    delete spm_;
  }
  static StopConditions stops(std::vector<std::string> strings, int max_tokens = -1) {
    StopConditions s;
    s.stop_strings = std::move(strings);
    s.max_tokens = max_tokens;
    return s;
  }
  // The id of a SentencePiece byte token (<0xNN>).
  static int32_t byte_token(unsigned char b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    return spm_->find_token(name).value();
  }

  static Tokenizer* gpt2_;
  static Tokenizer* spm_;
};

Tokenizer* GenerationTest::gpt2_ = nullptr;
Tokenizer* GenerationTest::spm_ = nullptr;

// A draw under a grammar, checked against its definition (the grammar's verdicts taken token by
// token on a copy of the matcher; a sampler of the same seed drawing as the definition says) over
// random logits with a token the grammar refuses on top, so that every draw is made again:
// greedy, the masked argmax; at a temperature, a draw from the first draw's candidates (after
// top-k, top-p, min-p) that the grammar allows, renormalised, or when none is from the masked
// logits. The allowed tokens near the top on even steps, far down on odd ones (masked).
TEST_F(GenerationTest, GrammarDrawFollowsItsDefinition) {
  const Tokenizer& tok = *gpt2_;
  const auto grammar = Grammar::parse(R"(root ::= [0-9]+ ("." [0-9]+)?)");  // (never finished: digits may follow)
  const auto vocabulary = std::make_shared<const GrammarVocabulary>(tok);
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const int steps = test::scaled(40, 8);
  for (const float temperature : {0.0f, 1.5f}) {
    SamplingParams params;  // (flat enough that each of the top 40 is drawn now and then)
    params.temperature = temperature;
    params.top_p = 1.0f;
    params.min_p = 0.0f;
    params.seed = 11;
    Sampler sampler(params, tok.n_vocab()), reference(params, tok.n_vocab());
    StopConditions no_end;
    no_end.ignore_eos = true;  // (every step draws)
    Generation g(tok, sampler, no_end, {});
    g.constrain(grammar, vocabulary);
    GrammarMatcher matcher(grammar);
    for (int step = 0; step < steps; ++step) {
      ASSERT_FALSE(g.finished());
      std::vector<float> logits(static_cast<size_t>(tok.n_vocab()));
      for (float& l : logits) l = noise(rng);
      std::vector<uint8_t> ok(logits.size());
      for (size_t t = 0; t < logits.size(); ++t) {
        GrammarMatcher trial = matcher;
        const bool end = g.is_end_token(static_cast<int32_t>(t));
        const std::string piece = tok.token_to_piece(static_cast<int32_t>(t));
        ok[t] = end ? matcher.accepting() : !piece.empty() && trial.accept(piece);
        if (ok[t] && step % 2 == 0) logits[t] += 6.0f;  // (even steps: the allowed ones near the top)
      }
      // A token the grammar refuses on top: the first draw takes it, and the draw is made again.
      const auto refused = std::find(ok.begin(), ok.end(), 0) - ok.begin() + static_cast<std::ptrdiff_t>(step);
      if (!ok[static_cast<size_t>(refused)]) logits[static_cast<size_t>(refused)] += 20.0f;
      std::vector<float> for_reference = logits;
      const auto masked_draw = [&] {
        std::vector<float> masked = logits;
        for (size_t t = 0; t < masked.size(); ++t) {
          if (!ok[t]) masked[t] = -INFINITY;
        }
        return reference.sample(std::span<float>(masked), g.history());
      };
      int32_t expected = -1;
      if (temperature <= 0.0f) {
        const int32_t first = reference.sample(std::span<float>(for_reference), g.history());
        expected = ok[static_cast<size_t>(first)] ? first : masked_draw();
      } else {
        const std::vector<Sampler::Candidate> candidates = [&] {
          const auto d = reference.distribution(std::span<float>(for_reference), g.history());
          return std::vector<Sampler::Candidate>(d.begin(), d.end());
        }();
        const int32_t first = reference.draw_from(candidates);
        std::vector<Sampler::Candidate> kept;
        double total = 0.0;
        for (const Sampler::Candidate& c : candidates) {
          if (ok[static_cast<size_t>(c.id)]) kept.push_back(c), total += c.p;
        }
        for (Sampler::Candidate& c : kept) c.p = static_cast<float>(c.p / total);
        expected = ok[static_cast<size_t>(first)] ? first : kept.empty() ? masked_draw() : reference.draw_from(kept);
      }
      const int32_t drawn = g.draw(std::span<float>(logits));
      ASSERT_EQ(drawn, expected) << "temperature " << temperature << ", step " << step;
      if (!g.is_end_token(drawn)) {
        ASSERT_TRUE(matcher.accept(tok.token_to_piece(drawn)));
      }
      g.take(drawn);
    }
    EXPECT_TRUE(grammar_matches(grammar, std::string(g.text()))) << g.text();
  }
}

// A greedy generation over a vocabulary, never ending on its own, under a lazy grammar; each
// draw is made from logits with one token far on top of the others.
struct LazyGrammarRun {
  LazyGrammarRun(const Tokenizer& tokenizer, const std::string& gbnf, std::string trigger, bool at_start)
      : tok(tokenizer), sampler(greedy(), tokenizer.n_vocab()), g(tokenizer, sampler, without_end(), {}) {
    g.constrain(Grammar::parse(gbnf), std::make_shared<const GrammarVocabulary>(tok), std::move(trigger), at_start);
  }
  static SamplingParams greedy() {
    SamplingParams p;
    p.temperature = 0.0f;
    return p;
  }
  static StopConditions without_end() {
    StopConditions s;
    s.ignore_eos = true;
    return s;
  }
  int32_t id(std::string_view text) const {
    const std::optional<int32_t> token = tok.find_token(text);
    EXPECT_TRUE(token.has_value()) << text;
    return token.value_or(0);
  }
  int32_t draw_favouring(std::string_view text) {
    std::vector<float> logits(static_cast<size_t>(tok.n_vocab()), 0.0f);
    logits[static_cast<size_t>(id(text))] = 30.0f;
    return g.draw(std::span<float>(logits));
  }
  void take(std::string_view text) { g.take(id(text)); }
  bool is_digit(int32_t token) const {
    const std::string piece = tok.token_to_piece(token);
    return !piece.empty() && std::isdigit(static_cast<unsigned char>(piece[0]));
  }

  const Tokenizer& tok;
  Sampler sampler;
  Generation g;
};

// A lazy grammar (a tool call's, with tool_choice "auto"): the text is free until it holds the
// trigger, held from there (the grammar reading from the trigger's start, the token that brought
// it included); an occurrence from which the grammar cannot read leaves it waiting for the next.
TEST_F(GenerationTest, LazyGrammarHoldsTheTextFromItsTriggerOn) {
  {
    LazyGrammarRun run(*gpt2_, R"(root ::= "<<" [0-9]+ ">>")", "<<", false);
    EXPECT_EQ(run.draw_favouring("hello"), run.id("hello"));  // free before the trigger: the grammar would refuse it
    run.take("hello");
    run.take("<<");
    const int32_t digit = run.draw_favouring("abc");  // held now: the most likely token it allows
    EXPECT_TRUE(run.is_digit(digit)) << run.tok.token_to_piece(digit);
    run.g.take(digit);
    run.take(">>");
    EXPECT_TRUE(run.g.finished());  // nothing can follow the grammar's sentence
  }
  {
    LazyGrammarRun run(*gpt2_, R"(root ::= "<" [0-9]+)", "<", false);
    run.take("</");  // the trigger, in text the grammar cannot read from: still free
    EXPECT_EQ(run.draw_favouring("abc"), run.id("abc"));
    run.take("abc");
    run.take("<");  // another occurrence, which it can read: held from there
    EXPECT_TRUE(run.is_digit(run.draw_favouring("abc")));
    EXPECT_FALSE(run.g.finished());
  }
}

// Llama 3.1's call is the whole reply: its lazy grammar counts the trigger only where the text
// starts (after space), and a text that starts otherwise stays free to its end.
TEST_F(GenerationTest, LazyGrammarAtTheStartOnly) {
  const std::string digits_in_braces = R"(root ::= "{" [0-9]+ "}")";
  const std::string space = "\xc4\xa0";  // GPT-2's byte character for a space
  ASSERT_EQ(gpt2_->token_to_piece(gpt2_->find_token(space).value_or(0)), " ");
  {
    LazyGrammarRun run(*gpt2_, digits_in_braces, "{", true);
    run.take(space);  // space: still undecided
    EXPECT_EQ(run.draw_favouring("abc"), run.id("abc"));
    run.take("{");  // the reply starts with the trigger: held from here
    EXPECT_TRUE(run.is_digit(run.draw_favouring("abc")));
  }
  {
    LazyGrammarRun run(*gpt2_, digits_in_braces, "{", true);
    run.take("hello");  // starts otherwise: the grammar is dropped
    run.take("{");      // a brace later is text like any other
    EXPECT_EQ(run.draw_favouring("abc"), run.id("abc"));
  }
}

TEST_F(GenerationTest, StopStringOverTwoTokensIsNeverShown) {
  Feed f(*gpt2_, stops({"STOP"}));
  EXPECT_EQ(f.take_text("Hello wor"), "Hello wor");
  EXPECT_EQ(f.take_text("ld ST"), "ld ");  // "ST" may start "STOP": held back
  EXPECT_FALSE(f.generation().finished());
  EXPECT_EQ(f.take_text("OP and more"), "");
  EXPECT_EQ(f.generation().finish_reason(), FinishReason::kStopString);
  EXPECT_EQ(f.joined(), "Hello world ");
  EXPECT_EQ(f.generation().text(), f.joined());
  EXPECT_FALSE(contains(f.joined(), "S"));
}

TEST_F(GenerationTest, StopStringOverThreeTokensIsNeverShown) {
  // A chat-like stop string whose pieces arrive in three tokens, each of which could still be
  // the start of it.
  Feed f(*gpt2_, stops({"\n\nUser:"}));
  EXPECT_EQ(f.take_text("Sure, here it is."), "Sure, here it is.");
  EXPECT_EQ(f.take_text("\n"), "");
  EXPECT_EQ(f.take_text("\nUs"), "");
  EXPECT_EQ(f.take_text("er: what"), "");
  EXPECT_EQ(f.generation().finish_reason(), FinishReason::kStopString);
  EXPECT_EQ(f.joined(), "Sure, here it is.");
  for (const std::string& p : f.pieces()) EXPECT_FALSE(contains(p, "\n")) << p;
}

TEST_F(GenerationTest, EarliestOfSeveralStopStringsWins) {
  // The text ends before the stop string that starts first, whichever the list names first.
  Feed f(*gpt2_, stops({"cd", "abc"}));
  EXPECT_EQ(f.take_text("x a"), "x ");
  EXPECT_EQ(f.take_text("bcd"), "");
  EXPECT_EQ(f.joined(), "x ");
}

TEST_F(GenerationTest, PartialMatchThatDoesNotCompleteIsReleasedIntact) {
  Feed f(*gpt2_, stops({"STOP", "\n\nUser:"}));
  EXPECT_EQ(f.take_text("a ST"), "a ");
  EXPECT_EQ(f.take_text("ORM is coming"), "STORM is coming");  // no longer a start of STOP
  EXPECT_EQ(f.take_text("\n"), "");
  EXPECT_EQ(f.take_text("\nUse"), "");
  EXPECT_EQ(f.take_text("ful"), "\n\nUseful");
  EXPECT_FALSE(f.generation().finished());
  // Held back at the end, then the sequence ends otherwise: the tail comes out whole.
  EXPECT_EQ(f.take_text(" STO"), " ");
  EXPECT_EQ(f.take(gpt2_->eos_id()), "STO");
  EXPECT_EQ(f.generation().finish_reason(), FinishReason::kEndToken);
  EXPECT_EQ(f.joined(), "a STORM is coming\n\nUseful STO");
  EXPECT_EQ(f.generation().text(), f.joined());
}

TEST_F(GenerationTest, TokenLimitReleasesTheHeldBackTail) {
  Feed f(*gpt2_, stops({"STOP"}, /*max_tokens=*/3));
  const std::vector<int32_t> ids = gpt2_->encode("one two ST", false, false);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(f.take(ids[0]), "one");
  EXPECT_EQ(f.take(ids[1]), " two");
  EXPECT_FALSE(f.generation().finished());
  EXPECT_EQ(f.take(ids[2]), " ST");
  EXPECT_EQ(f.generation().finish_reason(), FinishReason::kMaxTokens);
  EXPECT_EQ(f.generation().n_tokens(), 3);
  EXPECT_EQ(f.joined(), "one two ST");
}

TEST_F(GenerationTest, ZeroTokensIsFinishedFromTheStart) {
  Sampler sampler(greedy(), gpt2_->n_vocab());
  StopConditions s;
  s.max_tokens = 0;
  Generation g(*gpt2_, sampler, s, {});
  EXPECT_TRUE(g.finished());
  EXPECT_EQ(g.finish_reason(), FinishReason::kMaxTokens);
  EXPECT_EQ(g.text(), "");
  EXPECT_EQ(g.finish(FinishReason::kContextFull).finish, FinishReason::kNone);  // already over
}

TEST_F(GenerationTest, CharactersSplitAcrossTokensComeOutWhole) {
  const std::string smile = "\xF0\x9F\x98\x80";  // U+1F600, four bytes
  Feed f(*spm_, stops({"\xC3\xA9!"}));           // "é!"
  EXPECT_EQ(f.take(byte_token(0xF0)), "");
  EXPECT_EQ(f.take(byte_token(0x9F)), "");
  EXPECT_EQ(f.take(byte_token(0x98)), "");
  EXPECT_EQ(f.take(byte_token(0x80)), smile);
  // A character that may start a stop string is held as a whole, then released whole.
  EXPECT_EQ(f.take(byte_token(0xC3)), "");
  EXPECT_EQ(f.take(byte_token(0xA9)), "");
  EXPECT_EQ(f.take(byte_token('?')), "\xC3\xA9?");
  // A character cut off by the end becomes U+FFFD, as the stream decoder says.
  EXPECT_EQ(f.take(byte_token(0xE2)), "");
  EXPECT_EQ(f.finish(FinishReason::kInterrupted), "\xEF\xBF\xBD");
  EXPECT_EQ(f.joined(), smile + "\xC3\xA9?\xEF\xBF\xBD");
  EXPECT_EQ(f.generation().n_tokens(), 8);
}

TEST_F(GenerationTest, StopStringAfterASplitCharacter) {
  Feed f(*spm_, stops({"\xC3\xA9!"}));
  EXPECT_EQ(f.take(byte_token('a')), "a");
  EXPECT_EQ(f.take(byte_token(0xC3)), "");
  EXPECT_EQ(f.take(byte_token(0xA9)), "");
  EXPECT_EQ(f.take(byte_token('!')), "");
  EXPECT_EQ(f.generation().finish_reason(), FinishReason::kStopString);
  EXPECT_EQ(f.joined(), "a");
}

TEST_F(GenerationTest, EndTokensAndIgnoreEos) {
  const int32_t eos = gpt2_->eos_id();
  ASSERT_TRUE(gpt2_->is_end_of_generation(eos));
  {
    Feed f(*gpt2_, {});
    f.take_text("Hi");
    EXPECT_EQ(f.take(eos), "");
    EXPECT_EQ(f.generation().finish_reason(), FinishReason::kEndToken);
    EXPECT_EQ(f.generation().n_tokens(), 1);  // the end token is not taken
    EXPECT_EQ(f.generation().history().size(), 1u);
  }
  {
    StopConditions s;
    s.ignore_eos = true;
    Feed f(*gpt2_, s);
    f.take_text("Hi");
    EXPECT_EQ(f.take(eos), "");  // a control token shows nothing
    EXPECT_FALSE(f.generation().finished());
    EXPECT_EQ(f.generation().n_tokens(), 2);
    EXPECT_EQ(f.take_text(" again"), " again");
  }
  {
    // An extra end token (a chat template's end-of-turn marker the vocabulary does not flag).
    const int32_t marker = gpt2_->encode("###", false, false).at(0);
    ASSERT_FALSE(gpt2_->is_end_of_generation(marker));
    StopConditions s;
    s.end_tokens = {marker};
    Feed f(*gpt2_, s);
    f.take_text("Done");
    EXPECT_EQ(f.take(marker), "");
    EXPECT_EQ(f.generation().finish_reason(), FinishReason::kEndToken);
    EXPECT_EQ(f.joined(), "Done");
  }
}

TEST_F(GenerationTest, DrawingChangesNothingUntilTheTokenIsTaken) {
  Sampler sampler(greedy(), gpt2_->n_vocab());
  Generation g(*gpt2_, sampler, {}, {1, 2, 3});
  std::vector<float> logits(static_cast<size_t>(gpt2_->n_vocab()), 0.0f);
  logits[42] = 5.0f;
  EXPECT_EQ(g.draw(logits), 42);
  EXPECT_EQ(g.draw(logits), 42);
  EXPECT_EQ(g.n_tokens(), 0);
  EXPECT_EQ(g.history().size(), 3u);
  g.take(42);
  EXPECT_EQ(std::vector<int32_t>(g.history().begin(), g.history().end()), (std::vector<int32_t>{1, 2, 3, 42}));
  g.drop_history(1, 2);  // a context shift dropped tokens 2 and 3
  EXPECT_EQ(std::vector<int32_t>(g.history().begin(), g.history().end()), (std::vector<int32_t>{1, 42}));
}

// ---------------------------------------------------------------------------------------------
// generate() on a scripted model: the logits always point at the next token of a script.

class ScriptedModel final : public GenerationModel {
 public:
  ScriptedModel(const Tokenizer& tok, std::vector<int32_t> script, int room)
      : script_(std::move(script)), room_(room), logits_(static_cast<size_t>(tok.n_vocab()), 0.0f) {
    point_at(0);
  }
  TokenScores scores() override { return {logits_, {}}; }
  DroppedTokens evaluate(int32_t token) override {
    evaluated_.push_back(token);
    point_at(evaluated_.size());
    return {};
  }
  bool has_room() const override { return static_cast<int>(evaluated_.size()) < room_; }
  // No speculative decoding here: generate() never asks for the rest.
  Drafter* drafter() const override { return nullptr; }
  std::span<float> evaluate_draft(std::span<const int32_t>) override {
    ADD_FAILURE() << "no drafter, no draft";
    return {};
  }
  void rollback(int) override { ADD_FAILURE() << "no drafter, no rollback"; }
  int draft_room() const override { return 0; }
  const std::vector<int32_t>& evaluated() const { return evaluated_; }

 private:
  void point_at(size_t i) {
    std::fill(logits_.begin(), logits_.end(), 0.0f);
    if (i < script_.size()) logits_[static_cast<size_t>(script_[i])] = 1.0f;
  }
  std::vector<int32_t> script_;
  int room_;  // tokens that can be evaluated before the context is full
  std::vector<float> logits_;
  std::vector<int32_t> evaluated_;
};

struct Generated {
  FinishReason finish;
  std::string text;
  int n_tokens;
  std::vector<int32_t> evaluated;
};

Generated run_script(const Tokenizer& tok, const std::vector<int32_t>& script, StopConditions stop, int room,
                     bool evaluate_every_token, const std::atomic<bool>* flag = nullptr,
                     const std::function<void()>& on_piece = {}) {
  ScriptedModel model(tok, script, room);
  Sampler sampler(greedy(), tok.n_vocab());
  Generation g(tok, sampler, std::move(stop), {});
  std::string shown;
  GenerateOptions o;
  o.on_text = [&](std::string_view piece) {
    EXPECT_FALSE(piece.empty());
    shown += piece;
    if (on_piece) on_piece();
  };
  o.interrupt = flag;
  o.evaluate_every_token = evaluate_every_token;
  const FinishReason finish = generate(g, model, o);
  EXPECT_EQ(shown, g.text());
  return {finish, shown, g.n_tokens(), model.evaluated()};
}

TEST_F(GenerationTest, LoopEvaluatesTheLastTokenOnlyWhenAskedTo) {
  const std::vector<int32_t> script = gpt2_->encode("one two three four five", false, false);
  ASSERT_EQ(script.size(), 5u);
  StopConditions s;
  s.max_tokens = 4;
  const Generated run = run_script(*gpt2_, script, s, 100, false);
  EXPECT_EQ(run.finish, FinishReason::kMaxTokens);
  EXPECT_EQ(run.text, "one two three four");
  EXPECT_EQ(run.evaluated.size(), 3u);  // nothing reads the logits of the last one
  const Generated chat = run_script(*gpt2_, script, s, 100, true);
  EXPECT_EQ(chat.text, "one two three four");
  EXPECT_EQ(chat.evaluated, std::vector<int32_t>(script.begin(), script.begin() + 4));  // the cache holds what was shown
}

TEST_F(GenerationTest, LoopStopsAtAFullContext) {
  std::vector<int32_t> script = gpt2_->encode("one two three four five", false, false);
  // Room for two evaluated tokens. Shown tokens need not be evaluated: the third is shown, then
  // the sequence ends; when they must be, the third is not taken.
  const Generated run = run_script(*gpt2_, script, {}, 2, false);
  EXPECT_EQ(run.finish, FinishReason::kContextFull);
  EXPECT_EQ(run.text, "one two three");
  EXPECT_EQ(run.n_tokens, 3);
  const Generated chat = run_script(*gpt2_, script, {}, 2, true);
  EXPECT_EQ(chat.finish, FinishReason::kContextFull);
  EXPECT_EQ(chat.text, "one two");
  EXPECT_EQ(chat.n_tokens, 2);
  EXPECT_EQ(chat.evaluated.size(), 2u);
  // An end token still ends the turn as such when the context is full.
  script[2] = gpt2_->eos_id();
  EXPECT_EQ(run_script(*gpt2_, script, {}, 2, true).finish, FinishReason::kEndToken);
}

TEST_F(GenerationTest, LoopStopsWhenAskedAfterTheCurrentToken) {
  const std::vector<int32_t> script = gpt2_->encode("one two three four five", false, false);
  std::atomic<bool> flag{false};
  int pieces = 0;
  const Generated g = run_script(*gpt2_, script, {}, 100, true, &flag, [&] {
    if (++pieces == 2) flag = true;
  });
  EXPECT_EQ(g.finish, FinishReason::kInterrupted);
  EXPECT_EQ(g.text, "one two");
  EXPECT_EQ(g.evaluated.size(), 2u);
}

TEST_F(GenerationTest, LoopStreamsAroundAStopString) {
  const std::vector<int32_t> script = gpt2_->encode("Answer: 42\n\nUser: thanks", false, false);
  const Generated g = run_script(*gpt2_, script, stops({"\n\nUser:"}), 100, false);
  EXPECT_EQ(g.finish, FinishReason::kStopString);
  EXPECT_EQ(g.text, "Answer: 42");
}

// ---------------------------------------------------------------------------------------------
// The real model: streamed pieces against the batch scheduler's text.

class GenerationOnModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);  // ctest runs two suites at once on two cores
    loaded_ = new LoadedModel(load_model(RINGLM_TEST_MODEL, 1));
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }

  struct Streamed {
    std::vector<std::string> pieces;
    std::string text;
    FinishReason finish;
    std::vector<int32_t> tokens;  // taken
  };

  // Greedy generation of one prompt through generate(), as `ringlm run` does it.
  static Streamed stream(const std::vector<int32_t>& prompt, StopConditions stop) {
    LlamaModel& model = *loaded_->model;
    SequenceModel sequence(model, model.make_cache(256));
    sequence.prefill(prompt);
    Sampler sampler(greedy(), model.hparams().n_vocab);
    Generation g(*loaded_->tokenizer, sampler, std::move(stop), prompt);
    Streamed out;
    GenerateOptions o;
    o.on_text = [&](std::string_view p) { out.pieces.emplace_back(p); };
    out.finish = generate(g, sequence, o);
    out.text = std::string(g.text());
    out.tokens.assign(g.history().begin() + static_cast<std::ptrdiff_t>(prompt.size()), g.history().end());
    return out;
  }

  // The same prompts through the batch scheduler (two slots, so the rows share passes).
  static std::vector<GenerationResult> batch(const std::vector<GenerationRequest>& requests) {
    BatchOptions o;
    o.n_parallel = 2;
    o.n_ctx = 256;
    BatchScheduler scheduler(*loaded_->model, *loaded_->tokenizer, o);
    for (const GenerationRequest& r : requests) scheduler.submit(r);
    std::vector<GenerationResult> results(requests.size());
    while (scheduler.step([&](GenerationResult r) { results[r.index] = std::move(r); })) {
    }
    return results;
  }

  static GenerationRequest request(size_t index, const std::vector<int32_t>& prompt, int max_tokens,
                                   std::vector<std::string> stop) {
    GenerationRequest r;
    r.index = index;
    r.prompt = prompt;
    r.sampling = greedy();
    r.max_tokens = max_tokens;
    r.stop = std::move(stop);
    return r;
  }

  static LoadedModel* loaded_;
};

LoadedModel* GenerationOnModel::loaded_ = nullptr;

TEST_F(GenerationOnModel, StreamedPiecesAreTheBatchText) {
  const Tokenizer& tok = *loaded_->tokenizer;
  const std::vector<int32_t> prompt = tok.encode("Once upon a time, in a small village,", tok.add_bos_by_default(), true);
  constexpr int kTokens = 40;
  StopConditions limit;
  limit.max_tokens = kTokens;
  const Streamed whole = stream(prompt, limit);
  ASSERT_EQ(whole.finish, FinishReason::kMaxTokens);
  ASSERT_EQ(whole.tokens.size(), static_cast<size_t>(kTokens));

  // A stop string over a token boundary well into the text: the end of one token's piece and
  // the start of the next two (ASCII, so any cut is a character boundary).
  std::string stop;
  size_t before_stop = 0;
  for (size_t i = kTokens / 3; i + 2 < whole.tokens.size() && stop.empty(); ++i) {
    const std::string a = tok.token_to_piece(whole.tokens[i]), b = tok.token_to_piece(whole.tokens[i + 1]),
                      c = tok.token_to_piece(whole.tokens[i + 2]);
    const std::string candidate = a.substr(a.size() - std::min<size_t>(a.size(), 2)) + b + c.substr(0, 1);
    const bool ascii = std::all_of(candidate.begin(), candidate.end(), [](char ch) { return ch > 0; });
    if (a.empty() || b.empty() || c.empty() || !ascii) continue;
    stop = candidate;
    before_stop = whole.text.find(stop);
  }
  ASSERT_FALSE(stop.empty()) << whole.text;
  const std::string expected = whole.text.substr(0, before_stop);

  StopConditions with_stop = limit;
  with_stop.stop_strings = {stop};
  const Streamed cut = stream(prompt, with_stop);
  EXPECT_EQ(cut.finish, FinishReason::kStopString);
  EXPECT_EQ(cut.text, expected) << "stop string '" << stop << "'";
  std::string joined;
  for (const std::string& p : cut.pieces) {
    joined += p;
    EXPECT_FALSE(contains(p, stop));
    EXPECT_EQ(expected.compare(0, joined.size(), joined), 0) << "shown text that was cut: '" << joined << "'";
  }
  EXPECT_EQ(joined, expected);

  const std::vector<GenerationResult> results =
      batch({request(0, prompt, kTokens, {}), request(1, prompt, kTokens, {stop})});
  EXPECT_EQ(results[0].text, whole.text);
  EXPECT_EQ(results[0].finish_reason, "length");
  EXPECT_EQ(results[0].n_tokens, kTokens);
  EXPECT_EQ(results[1].text, joined);
  EXPECT_EQ(results[1].finish_reason, "stop");
  EXPECT_EQ(results[1].n_tokens, static_cast<int>(cut.tokens.size()));
}

// The calls the batch scheduler makes: a prompt prefilled in one sequence's pass, shared, read by
// another sequence as its prefix; both then decode in one batched pass and check a draft. Each
// must see what a sequence that did all of it alone sees.
TEST_F(GenerationOnModel, SequencesPlannedTogetherAndSharingAPromptMatchOneAlone) {
  LlamaModel& model = *loaded_->model;
  const Tokenizer& tok = *loaded_->tokenizer;
  const std::vector<int32_t> prompt = tok.encode("The river ran past the old mill", tok.add_bos_by_default(), true);
  const int32_t next = prompt[1], draft[] = {prompt[2], prompt[3]};

  SequenceModel alone(model, model.make_cache(256));
  alone.prefill(prompt);
  const std::vector<float> after_prompt(alone.logits().begin(), alone.logits().end());
  alone.evaluate(next);
  const std::vector<float> after_next(alone.logits().begin(), alone.logits().end());

  SequenceModel owner(model, model.make_cache(256)), reader(model, model.make_cache(256));
  model.forward(owner.plan(prompt, SequenceModel::Scores::kLogits));
  owner.passed();
  ASSERT_EQ(std::vector<float>(owner.logits().begin(), owner.logits().end()), after_prompt);
  const std::shared_ptr<const KvCache> shared = owner.share_cache(model.make_cache(256));
  EXPECT_EQ(owner.cache().size(), 0);
  EXPECT_EQ(owner.tokens(), prompt);
  reader.read_prefix(shared, owner.tokens(), owner.logits());
  EXPECT_EQ(reader.tokens(), prompt);
  EXPECT_EQ(reader.cache().context_size(), static_cast<int>(prompt.size()));
  EXPECT_EQ(std::vector<float>(reader.scores().logits.begin(), reader.scores().logits.end()), after_prompt);

  // One batched pass: the owner decodes `next`, the reader checks `next` and a draft of two.
  const SequenceTokens pass[] = {owner.plan(std::span<const int32_t>(&next, 1), SequenceModel::Scores::kSampled),
                                 reader.plan_check(next, draft)};
  model.forward_batch(pass);
  owner.passed();
  reader.passed();
  EXPECT_EQ(std::vector<float>(owner.logits().begin(), owner.logits().end()), after_next);
  const std::span<const float> first_row = reader.checked_rows().first(after_next.size());
  EXPECT_EQ(std::vector<float>(first_row.begin(), first_row.end()), after_next);
  EXPECT_EQ(reader.tokens().size(), prompt.size() + 3);
  EXPECT_EQ(reader.evaluated(), 3);

  // The draft rejected: its two tokens leave the cache and the history, and the scores are the
  // row after `next` again.
  reader.rollback(2);
  EXPECT_EQ(reader.tokens().size(), prompt.size() + 1);
  EXPECT_EQ(reader.tokens().back(), next);
  EXPECT_EQ(reader.cache().context_size(), static_cast<int>(prompt.size()) + 1);
  EXPECT_EQ(std::vector<float>(reader.logits().begin(), reader.logits().end()), after_next);
}

}  // namespace
}  // namespace ringlm

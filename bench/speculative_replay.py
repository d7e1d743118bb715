#!/usr/bin/env python3
"""What bounds prompt lookup's speed-up (issue 31): a replay of bench/speculative.py's prompts.

    python3 bench/speculative_replay.py [-m MODEL] [--ringlm build/bin/ringlm] [-n 128] [--lookup 8]
        [--row-cost 0.25 ...]

With a tuning table (RINGLM_TUNING, else ringlm's default path) that holds `ringlm tune`'s
checking passes for this model at 2 threads, the draft lengths follow them, as ringlm's do, and a
column charges each pass what the table says it costs.

Greedy decoding gives the same text with and without a guesser, so a run's passes can be
replayed offline: ringlm writes the plain greedy answer; its tokens (`ringlm tokenize`) are fed
through the same rules as the C++ (core/speculative/prompt_lookup.cpp: the latest earlier
occurrence of the last 3, else 2 tokens; core/speculative/draft_length.h: the draft limit), which
give every checking pass's drafted and accepted counts; the replay checks them against ringlm's
own --stats json. Each pass of 1 + k rows is then charged 1 + row_cost * k decode steps (a plain
step costs 1), for each --row-cost given, and the speed-up is the plain steps over the charged
ones. Row cost 0 is the bound with free checking rows. The last column charges the row cost the
run itself showed: its checking passes' times (--stats json's token_ms) against its median plain
step, the median over its passes.

The last columns bound every prompt-lookup guesser, not just ringlm's: an oracle that, at each
position, drafts exactly the longest run of the coming tokens that occurs earlier right after the
same last token (what a lookup of 1-grams could find at best), with free rows and, with a tuned
table, at the tuned passes' cost (the cheapest split into passes, by dynamic programming).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

from speculative import PROMPTS


class PassCost:
    """core/speculative/draft_length.h's PassCost: a checking pass of 1 + k rows in decode steps."""

    ROW_COST = 0.25

    def __init__(self, measured: list[float] | None = None) -> None:
        self.measured = []
        for c in measured or []:
            self.measured.append(max(c, self.measured[-1] if self.measured else 1.0))
        self.row_cost = (self.measured[-1] - 1.0) / len(self.measured) if self.measured else self.ROW_COST

    def of(self, k: int) -> float:
        if k <= 0:
            return 1.0
        if k <= len(self.measured):
            return self.measured[k - 1]
        return (self.measured[-1] if self.measured else 1.0) + self.row_cost * (k - len(self.measured))


class DraftLength:
    """core/speculative/draft_length.h."""

    MAX_LIMIT, FIRST_PAUSE, LONGEST_PAUSE = 64, 8, 128
    LEARNING_RATE, FIRST_ACCEPTANCE = 0.2, 0.8

    def __init__(self, cost: PassCost) -> None:
        self.cost = cost
        self.acceptance, self.pause, self.next_pause = self.FIRST_ACCEPTANCE, 0, self.FIRST_PAUSE

    def next_limit(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        best, best_rate, tokens, power = 1, 0.0, 1.0, 1.0
        for k in range(1, self.MAX_LIMIT + 1):
            power *= self.acceptance
            tokens += power
            rate = tokens / self.cost.of(k)
            if rate > best_rate:
                best_rate, best = rate, k
        return best

    def record(self, drafted: int, accepted: int) -> None:
        share = accepted / (accepted + (1 if accepted < drafted else 0))
        self.acceptance += self.LEARNING_RATE * (share - self.acceptance)
        if accepted > 0:
            self.next_pause = self.FIRST_PAUSE
        if drafted == 1 and accepted == 0:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, self.LONGEST_PAUSE)


def lookup(history: list[int], limit: int, max_draft: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """core/speculative/prompt_lookup.cpp's PromptLookup::propose."""
    wanted = min(limit, max_draft)
    if wanted <= 0:
        return []
    n_history = len(history)
    for n in range(min(max_ngram, n_history - 1), min_ngram - 1, -1):
        tail = history[n_history - n:]
        for start in range(n_history - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + min(wanted, n_history - start - n)]
    return []


def replay(prompt: list[int], text: list[int], max_draft: int, max_tokens: int,
           cost: PassCost) -> list[tuple[int, int]]:
    """(drafted, accepted) of every pass that checked a draft, and (0, 0) for each plain step."""
    passes = []
    policy = DraftLength(cost)
    pos = len(prompt) + 1  # the first token comes from the prompt's pass
    while pos < len(text):
        tokens_left = max_tokens - (pos - len(prompt))  # no guess past the token limit
        draft = lookup(text[:pos], min(policy.next_limit(), tokens_left), max_draft)
        accepted = 0
        while accepted < len(draft) and pos + accepted < len(text) and draft[accepted] == text[pos + accepted]:
            accepted += 1
        if draft:
            policy.record(len(draft), accepted)
        passes.append((len(draft), accepted))
        pos += accepted + 1
    return passes


def longest_copies(text: list[int], start: int, max_draft: int, context: int = 1) -> list[int]:
    """For each position from start on, the longest run of the coming tokens (at most max_draft)
    that an n-gram lookup could copy there: one that occurs in full in the tokens before that
    position, right after the same `context` tokens as those just before it (a lookup finds its
    source by the last tokens; 1 is the least any lookup uses, llama.cpp's included)."""
    longest = []
    for pos in range(start, len(text)):
        best = 0
        for source in range(context, pos):
            if text[source - context:source] != text[pos - context:pos]:
                continue
            n = 0
            while n < max_draft and source + n < pos and pos + n < len(text) and text[source + n] == text[pos + n]:
                n += 1
            best = max(best, n)
        longest.append(best)
    return longest


def best_lookup_cost(text: list[int], start: int, max_draft: int, cost) -> float:
    """The least cost, in decode steps, in which any prompt-lookup guesser of at most max_draft
    tokens could produce text[start:]: an oracle that always finds the right source and drafts
    exactly the copy it should take there (the longest, or a shorter one when that is cheaper:
    dynamic programming over the positions). A pass of k drafted rows costs cost(k)."""
    longest = longest_copies(text, start, max_draft)
    n = len(text) - start
    least = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        least[i] = min(cost(k) + least[min(n, i + k + 1)] for k in range(0, longest[i] + 1))
    return least[0]


def measured_row_cost(passes: list[tuple[int, int]], token_ms: list[float]) -> float:
    """The run's own cost of a checking row, in decode steps: its passes' times (--stats json's
    token_ms, one per pass or plain step, in order) against the median plain step."""
    if len(token_ms) != len(passes):
        return float("nan")
    plain = statistics.median(t for t, (k, _) in zip(token_ms, passes) if k == 0)
    return statistics.median((t / plain - 1) / k for t, (k, _) in zip(token_ms, passes) if k > 0)


def tokens(args, text: str) -> list[int]:
    r = subprocess.run([args.ringlm, "tokenize", "-m", args.model, "--ids", "-p", text], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)


def tuned_pass_cost(model: str, threads: int = 2) -> list[float] | None:
    """The tuning table's checking passes for this model file (ringlm's KernelTable::pass_cost)."""
    path = os.environ.get("RINGLM_TUNING") or os.path.join(
        os.environ.get("RINGLM_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                        "ringlm"), "tuning.json")
    if path == "off" or not os.path.exists(path):
        return None
    with open(path) as f:
        table = json.load(f)
    for e in table.get("checking_passes", []):
        if e["model"] == os.path.basename(model) and e["bytes"] == os.path.getsize(model) and e["threads"] == threads:
            return e["cost"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/ringlm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ringlm", default="build/bin/ringlm")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--row-cost", type=float, nargs="+", default=[0.0, 0.15, 0.25])
    args = ap.parse_args()

    tuned = tuned_pass_cost(args.model)
    cost = PassCost(tuned)
    print(f"draft lengths from {'the tuned passes ' + str(tuned) if tuned else 'the estimated row cost'}\n")
    print("| prompt | checking passes | drafted | accepted | generated | "
          + " | ".join(f"speed-up at row cost {c:g}" for c in args.row_cost)
          + (" | tuned passes' cost: speed-up" if tuned else "") + " | this run's row cost: speed-up"
          + " | any lookup's bound, free rows" + (" | any lookup's bound, tuned passes' cost" if tuned else "") + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * (len(args.row_cost) + 2 + (2 if tuned else 0)))
    for name, prompt in PROMPTS.items():
        run = subprocess.run([args.ringlm, "run", "-m", args.model, "-t", "2", "--temp", "0", "-n", str(args.n), "--stats",
                              "json", "--lookup", str(args.lookup), "-p", prompt], capture_output=True, text=True, check=True)
        stats = json.loads(run.stderr.strip().splitlines()[-1])
        prompt_tokens = tokens(args, prompt)
        text = tokens(args, prompt + run.stdout)
        if text[:len(prompt_tokens)] != prompt_tokens or len(text) - len(prompt_tokens) != stats["gen_tokens"]:
            print(f"| {name} | the answer's text does not tokenize back to its tokens: not replayed |")
            continue
        if stats["stop_reason"] == "eos":
            text.append(-1)  # the end token: drawn after the last text token was evaluated
        passes = replay(prompt_tokens, text, args.lookup, args.n, cost)
        checked = [(k, j) for k, j in passes if k > 0]
        drafted, accepted = sum(k for k, _ in checked), sum(j for _, j in checked)
        spec = stats["speculative"]
        if (len(checked), drafted, accepted) != (spec["passes"], spec["drafted"], spec["accepted"]):
            print(f"| {name} | the replay ({len(checked)} passes, {drafted} drafted, {accepted} accepted) differs from "
                  f"ringlm's ({spec['passes']}, {spec['drafted']}, {spec['accepted']}): not replayed |")
            continue
        plain_steps = len(text) - len(prompt_tokens) - 1
        costs = [*args.row_cost, measured_row_cost(passes, stats["token_ms"])]
        speed_ups = [plain_steps / sum(1 + c * k for k, _ in passes) for c in costs]
        if tuned:
            speed_ups.insert(-1, plain_steps / sum(cost.of(k) for k, _ in passes))
        first = len(prompt_tokens) + 1
        best = [plain_steps / best_lookup_cost(text, first, args.lookup, lambda k: 1.0)]
        if tuned:
            best.append(plain_steps / best_lookup_cost(text, first, args.lookup, cost.of))
        print(f"| {name} | {len(checked)} | {drafted} | {accepted} | {stats['gen_tokens']} | "
              + " | ".join(f"{s:.2f}x" for s in speed_ups[:-1]) + f" | {costs[-1]:.2f}: {speed_ups[-1]:.2f}x | " + " | ".join(f"{b:.2f}x" for b in best) + " |",
              flush=True)


if __name__ == "__main__":
    main()

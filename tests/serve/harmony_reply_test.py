#!/usr/bin/env python3
"""`ringlm serve` with gpt-oss's harmony format, driven by the `openai` package: a chat reply comes
back as `content` (the final channel) and `reasoning_content` (the analysis channel), whole and
streamed, as llama-server sends them, and no marker of the format reaches either. The same with
Qwen3's think tags (SPEC tests/data/scripted_think.json): the text in <think> is the reasoning.

  harmony_reply_test.py RINGLM MODEL SPEC

MODEL is the scripted model of SPEC (tests/data/scripted_harmony.json, written by
tests/reference/make_scripted_gguf.py): gpt-oss's chat template and special tokens, and a greedy
reply known in advance (a reasoning message, <|end|>, a second header whose markers come as plain
tokens cut inside them, the answer, <|return|>, then "LEAK" had it not stopped). The prompt the
server renders is checked against the template rendered by jinja2 (today's date on both sides)."""
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

import jinja2
import jinja2.sandbox
import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from gguf_fast import GGUFReader  # noqa: E402

RINGLM, MODEL, SPEC_PATH = sys.argv[1], sys.argv[2], sys.argv[3]
with open(SPEC_PATH, encoding="utf-8") as f:
    SPEC = json.load(f)
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


class Server:
    def __init__(self):
        self.proc = subprocess.Popen([RINGLM, "serve", "-m", MODEL, "--port", "0", "-t", "1", "--parallel", "2"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = self.proc.stderr.readline()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", first)
        if not m:
            raise RuntimeError("no address in: " + first + self.proc.stderr.read())
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.log = [first]
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server never became ready: " + "".join(self.log))
            time.sleep(0.05)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def template_prompt(messages, **kwargs):
    """The model's own template (its GGUF's tokenizer.chat_template) rendered by jinja2, as
    transformers does, with today's date (and the template variables in kwargs)."""
    reader = GGUFReader(MODEL)
    field = reader.fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kwargs)


def extra(obj, name):
    """A field the openai package does not declare (llama-server's reasoning_content)."""
    return (obj.model_extra or {}).get(name)


MESSAGES = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]


class HarmonyReplies(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="none", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()  # a kept-alive connection would hold the shutdown for its 5 s timeout
        code = cls.server.stop()
        if code != 0:
            raise AssertionError(f"ringlm serve exited {code}")

    def test_whole_reply_splits_reasoning_from_content(self):
        r = self.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
        message = r.choices[0].message
        self.assertEqual(message.content, SPEC["content"])
        self.assertEqual(extra(message, "reasoning_content"), SPEC["reasoning"])
        # It stopped at <|return|>, not at the <|end|> after the reasoning: every token up to it.
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.completion_tokens, len(SPEC["chain"]) - 3)

    def test_the_prompt_is_the_templates_and_the_text_is_the_models(self):
        # The same prompt through the completions endpoint, which sends the text as generated:
        # the markers as the model wrote them, and what the chat endpoint split.
        chat = self.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
        raw = self.client.completions.create(model="m", prompt=template_prompt(MESSAGES), temperature=0,
                                             max_tokens=64)
        self.assertEqual(raw.usage.prompt_tokens, chat.usage.prompt_tokens)
        self.assertEqual(raw.choices[0].text, SPEC["generated"])
        self.assertEqual(raw.choices[0].finish_reason, "stop")

    def test_reasoning_effort_is_the_templates_variable(self):
        # OpenAI's field and llama-server's chat_template_kwargs both set the template's
        # reasoning_effort (harmony's "Reasoning: high"; a template without it ignores it): the
        # prompt is the template's with it, token for token, as the completions endpoint shows.
        raw = self.client.completions.create(model="m", prompt=template_prompt(MESSAGES, reasoning_effort="high"),
                                             temperature=0, max_tokens=1, logprobs=0)
        plain = self.client.completions.create(model="m", prompt=template_prompt(MESSAGES), temperature=0,
                                               max_tokens=1)
        for body in ({"reasoning_effort": "high"}, {"chat_template_kwargs": {"reasoning_effort": "high"}}):
            chat = self.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=1,
                                                       extra_body=body)
            self.assertEqual(chat.usage.prompt_tokens, raw.usage.prompt_tokens, body)
        if "Reasoning: high" in template_prompt(MESSAGES, reasoning_effort="high"):  # (harmony) the check can fail
            self.assertNotEqual(raw.usage.prompt_tokens, plain.usage.prompt_tokens)
        with self.assertRaises(openai.BadRequestError) as bad:
            self.client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"reasoning_effort": "max"})
        self.assertIn("reasoning_effort", str(bad.exception))

    def test_streamed_reply_is_the_whole_one_and_never_shows_a_marker(self):
        # Two samples at once: each choice's text is read apart.
        contents, reasonings, finishes, order = {}, {}, {}, {}
        stream = self.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, stream=True, n=2)
        for chunk in stream:
            for c in chunk.choices:
                piece, thought = c.delta.content or "", extra(c.delta, "reasoning_content") or ""
                for text in (piece, thought):
                    self.assertFalse(any(m in text for m in MARKERS + ["<think>", "</think>"]), text)
                    self.assertNotIn("<|", text)  # not even a piece of one
                contents[c.index] = contents.get(c.index, "") + piece
                reasonings[c.index] = reasonings.get(c.index, "") + thought
                if piece:
                    order.setdefault(c.index, []).append("content")
                if thought:
                    order.setdefault(c.index, []).append("reasoning")
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        for i in (0, 1):
            self.assertEqual(contents[i], SPEC["content"])
            self.assertEqual(reasonings[i], SPEC["reasoning"])
            self.assertEqual(finishes[i], "stop")
            # The reasoning streamed first, then the answer, each in several pieces.
            first_content = order[i].index("content")
            self.assertGreater(first_content, 1)
            self.assertNotIn("reasoning", order[i][first_content:])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)

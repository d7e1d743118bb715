#!/usr/bin/env python3
"""Tool calls through `ringlm serve`, driven by the `openai` package: OpenAI's tools, tool_choice
and parallel_tool_calls; the calls read back as tool_calls, whole and streamed; tool results
sent back through the template.

  tool_calls_test.py RINGLM MODEL --spec SPEC   a scripted model (tests/data/scripted_tools_*.json)
  tool_calls_test.py RINGLM MODEL --prompts N   a real model (SmolLM2)

A scripted model (tests/reference/make_scripted_gguf.py) carries a family's real template (Qwen
2.5's <tool_call>, Llama 3.1's JSON, Mistral Nemo's [TOOL_CALLS], gpt-oss's messages to
functions) and writes a reply known in
advance: the calls the server reads out of it must be the spec's, its prompt with tools must be
the template's as transformers renders it (jinja2, arguments as dicts; compared token for token
through the completions endpoint), and a conversation with the calls and their results must be
taken. A real model's template knows no tools (SmolLM2's ChatML): ringlm describes them in the
system message and, with tool_choice "required" or a named tool, its grammar makes the reply
calls whose arguments pydantic validates against the tool's own schema."""
import argparse
import datetime
import json
import os
import sys
import time
import unittest

import jinja2
import jinja2.ext
import jinja2.sandbox
import openai
import pydantic

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from gguf_fast import GGUFReader  # noqa: E402
from serve_client_test import Server  # noqa: E402  (one `ringlm serve` on a free port)

ARGS = None
SPEC = None


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=40, description="The city, e.g. Zürich")
    unit: str | None = pydantic.Field(default=None, pattern="^(celsius|fahrenheit)$")


class Add(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    a: float
    b: float


class Flight(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    origin: str = pydantic.Field(max_length=30)
    destination: str = pydantic.Field(max_length=30)
    passengers: int


def function(name, description, model):
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": model.model_json_schema()}}


TOOLS = [function("get_weather", "The weather in a city", Weather), function("add", "Adds two numbers", Add)]
MODELS = {"get_weather": Weather, "add": Add, "book_flight": Flight}
FLIGHT = function("book_flight", "Books a flight", Flight)


def transformers_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_prompt(messages, tools):
    """The model's own template rendered by jinja2 as transformers does (call arguments as dicts)."""
    reader = GGUFReader(ARGS.model)
    field = reader.fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = transformers_tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # (gpt-oss's date)
    hf_messages = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        hf_messages.append(m)
    return env.from_string(source).render(messages=hf_messages, tools=tools, add_generation_prompt=True,
                                          bos_token=SPEC["bos"], eos_token=SPEC["eos"])


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(stream):
    """A streamed reply put together as the openai docs do: content, and tool_calls by index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import serve_client_test
        serve_client_test.RINGLM, serve_client_test.MODEL = ARGS.ringlm, ARGS.model
        cls.server = Server("--parallel", "4")
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="none", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def chat(self, messages, **kwargs):
        return self.client.chat.completions.create(model="m", messages=messages, temperature=0, **kwargs)


class ScriptedFamily(ServerTest):
    """The spec's family: its calls read from the model's reply, whole and streamed."""
    QUESTION = [{"role": "user", "content": "Weather in Zürich, and 2 + 3.5?"}]

    def expected_calls(self):
        return [(c["name"], c["arguments"]) for c in SPEC["calls"]]

    def parallel(self):
        return len(SPEC["calls"]) > 1

    def test_calls_are_read_from_the_reply(self):
        r = self.chat(self.QUESTION, tools=TOOLS, parallel_tool_calls=self.parallel())
        message = r.choices[0].message
        self.assertEqual(calls_of(message), self.expected_calls())
        self.assertEqual(message.content, SPEC["content"])
        self.assertEqual((message.model_extra or {}).get("reasoning_content"), SPEC.get("reasoning"))
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")
        ids = [c.id for c in message.tool_calls]
        self.assertEqual(len(set(ids)), len(ids))
        self.assertTrue(all(c.type == "function" and c.id for c in message.tool_calls))

    def test_streamed_calls_are_the_whole_ones(self):
        content, calls, finish = streamed(self.chat(self.QUESTION, tools=TOOLS, stream=True,
                                                    parallel_tool_calls=self.parallel()))
        self.assertEqual([(c["name"], json.loads(c["arguments"])) for c in calls], self.expected_calls())
        self.assertEqual(content, SPEC["content"] or "")
        self.assertEqual(finish, "tool_calls")
        for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
            self.assertNotIn(marker, content)

    def test_forced_calls(self):
        if not SPEC["forced"]:
            self.skipTest("this family's scripted reply starts with text, which a forced call does not allow")
        r = self.chat(self.QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=self.parallel())
        self.assertEqual(calls_of(r.choices[0].message), self.expected_calls())
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")

    def test_one_call_unless_parallel(self):
        # tool_choice "auto": from the call's marker on, the reply is held to the calls' grammar
        # (a lazy grammar), which without parallel calls ends it after the first.
        if not SPEC["chain"][1:].count("Let me check."):
            self.skipTest("the scripted reply of this family has no text before its calls")
        r = self.chat(self.QUESTION, tools=TOOLS)
        self.assertEqual(calls_of(r.choices[0].message), self.expected_calls()[:1])
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")

    def test_without_tools_the_reply_is_text(self):
        # No tools, or tool_choice "none": nothing is read as a call (and the prompt has no tools).
        for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):
            message = self.chat(self.QUESTION, max_tokens=64, **kwargs).choices[0].message
            self.assertFalse(message.tool_calls, kwargs)
            # (gpt-oss's message to a function, offered none, is neither: its reasoning remains)
            self.assertTrue(message.content or (message.model_extra or {}).get("reasoning_content"), kwargs)

    def test_prompts_with_tools_and_results_are_the_templates(self):
        # The call ids as the server gave them (Mistral's are 9 letters and digits).
        first = self.chat(self.QUESTION, tools=TOOLS).choices[0].message
        assistant = {"role": "assistant", "content": "",
                     "tool_calls": [{"id": c.id, "type": "function",
                                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                    for c in first.tool_calls]}
        results = [{"role": "tool", "tool_call_id": c.id, "content": "21 degrees" if c.function.name == "get_weather"
                    else "5.5"} for c in first.tool_calls]
        for messages in (self.QUESTION, self.QUESTION + [assistant] + results):
            chat = self.chat(messages, tools=TOOLS, max_tokens=1)
            raw = self.client.completions.create(model="m", prompt=template_prompt(messages, TOOLS), max_tokens=1,
                                                 temperature=0)
            self.assertEqual(chat.usage.prompt_tokens, raw.usage.prompt_tokens, messages)
        if SPEC["chain"][1] != "[TOOL_CALLS]":  # (Mistral's call ids must be 9 letters and digits)
            return
        self.assertTrue(all(len(c.id) == 9 and c.id.isalnum() for c in first.tool_calls))


class RealModel(ServerTest):
    """A real model whose template knows no tools: calls forced by the grammar, then answered."""
    QUESTIONS = ["What is the weather in Paris?", "How warm is it in Tokyo in fahrenheit?", "Add 17 and 25.",
                 "What is 3.5 plus 4?", "Is it raining in London?", "Book a flight from Oslo to Rome for two.",
                 "I need 3 seats from Berlin to Madrid.", "Sum 1000 and 2024.", "Weather in Nairobi please.",
                 "Fly me and my wife from Lima to Quito."]

    def check_call(self, call, names):
        self.assertIn(call.function.name, names)
        MODELS[call.function.name].model_validate_json(call.function.arguments)  # raises if invalid
        self.assertTrue(call.id.startswith("call_"))

    def test_required_calls_parse(self):
        tools = TOOLS + [FLIGHT]
        for i, question in enumerate(self.QUESTIONS[:ARGS.prompts]):
            r = self.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": question}], tools=tools, tool_choice="required",
                max_tokens=120, temperature=0.7, seed=i)
            choice = r.choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls", choice.message)
            self.assertEqual(len(choice.message.tool_calls), 1)  # parallel_tool_calls is off by default
            self.check_call(choice.message.tool_calls[0], MODELS)

    def test_call_ids_are_unique_across_choices(self):
        for stream in (False, True):
            kwargs = dict(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                          tool_choice="required", max_tokens=80, n=3, temperature=0.9, seed=5, stream=stream)
            ids = []
            if stream:
                for chunk in self.client.chat.completions.create(**kwargs):
                    for choice in chunk.choices:
                        ids += [c.id for c in choice.delta.tool_calls or [] if c.id]
            else:
                for choice in self.client.chat.completions.create(**kwargs).choices:
                    ids += [c.id for c in choice.message.tool_calls or []]
            self.assertEqual(len(ids), 3, stream)
            self.assertEqual(len(set(ids)), 3, (stream, ids))

    def test_named_tool_streamed(self):
        stream = self.chat([{"role": "user", "content": "Book me a flight."}], tools=TOOLS + [FLIGHT],
                           tool_choice={"type": "function", "function": {"name": "book_flight"}}, stream=True,
                           max_tokens=120)
        content, calls, finish = streamed(stream)
        self.assertEqual(finish, "tool_calls")
        self.assertEqual(content, "")
        self.assertEqual([c["name"] for c in calls], ["book_flight"])
        Flight.model_validate_json(calls[0]["arguments"])

    def test_round_trip(self):
        question = {"role": "user", "content": "What is the weather in Paris?"}
        first = self.chat([question], tools=TOOLS, tool_choice="required", max_tokens=120).choices[0].message
        self.check_call(first.tool_calls[0], MODELS)
        messages = [question, first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                     "content": json.dumps({"temperature_celsius": 21, "sky": "sunny"})}]
        answer = self.chat(messages, tools=TOOLS, tool_choice="none", max_tokens=48).choices[0]
        self.assertFalse(answer.message.tool_calls)
        self.assertTrue(answer.message.content.strip())

    def test_bad_tools_are_400_naming_the_field(self):
        question = [{"role": "user", "content": "Hi"}]
        cases = [
            ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
            ({"tools": "get_weather"}, "tools"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
            ({"tools": [function("f", "", Add) | {"function": {"name": "f", "parameters": {
                "type": "object", "patternProperties": {"^x": {}}}}}], "tool_choice": "required"}, "tools"),
        ]
        for body, param in cases:
            with self.assertRaises(openai.BadRequestError, msg=body) as bad:
                self.chat(question, max_tokens=1, extra_body=body)
            self.assertEqual(bad.exception.body.get("param"), param, (body, bad.exception.body))
        # A conversation out of order: a tool result with no call before it.
        with self.assertRaises(openai.BadRequestError) as bad:
            self.chat(question + [{"role": "tool", "tool_call_id": "x", "content": "1"}], tools=TOOLS, max_tokens=1)
        self.assertEqual(bad.exception.body.get("param"), "messages")

    def test_hostile_tool_schemas_are_refused_in_bounded_time(self):
        deep = {"type": "object"}
        for _ in range(300):
            deep = {"type": "object", "properties": {"x": deep}}
        wide = {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(200000)]}}}
        for parameters in (deep, wide):
            tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
            start = time.monotonic()
            with self.assertRaises(openai.BadRequestError):
                self.chat([{"role": "user", "content": "Hi"}], tools=[tool], tool_choice="required", max_tokens=1)
            self.assertLess(time.monotonic() - start, 30)


def main():
    global ARGS, SPEC
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ringlm")
    parser.add_argument("model")
    parser.add_argument("--spec", help="a scripted model's spec (tests/data/scripted_tools_*.json)")
    parser.add_argument("--prompts", type=int, default=10, help="real model: questions to force calls on")
    ARGS, rest = parser.parse_known_args()
    if ARGS.spec:
        with open(ARGS.spec, encoding="utf-8") as f:
            SPEC = json.load(f)
    case = ScriptedFamily if ARGS.spec else RealModel
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(case)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())

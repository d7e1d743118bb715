#!/usr/bin/env python3
"""Structured output from `ringlm serve`, as programs ask for it: the `openai` package with a
pydantic model as `response_format` (its `parse()` helper: a strict JSON schema), a JSON object,
llama-server's `grammar` (GBNF) field, streamed and whole; schemas and grammars that cannot be
used are a 400 naming the field. The answers are judged by pydantic, `json` and a regular
expression, never against the server's own earlier output.

  structured_output_test.py RINGLM MODEL [--prompts N]"""
import argparse
import json
import os
import re
import sys
import unittest

import openai
import pydantic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_client_test import Server  # noqa: E402  (one `ringlm serve` on a free port)

ARGS = None
PROMPTS = ["a cat", "a retired sailor", "a chess player", "a baker from Lyon", "a child who likes trains",
           "a doctor", "an old king", "a painter", "a robot", "a farmer", "a pilot", "a teacher"]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int
    hobbies: list[pydantic.constr(max_length=30)] = pydantic.Field(max_length=3)


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=20)
    owner: Person  # (a nested model: $defs and $ref in the schema)


class StructuredOutput(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import serve_client_test
        serve_client_test.RINGLM, serve_client_test.MODEL = ARGS.ringlm, ARGS.model
        cls.server = Server("--parallel", "4")
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="none")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def ask(self, prompt, max_tokens=400, **kwargs):
        return self.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, **kwargs)

    def test_pydantic_models_parse(self):
        for i, who in enumerate(PROMPTS[:ARGS.prompts]):
            model = Pet if i % 3 == 2 else Person
            prompt = f"Describe {who} as JSON." if model is Person else f"Describe {who} and their pet as JSON."
            done = self.client.beta.chat.completions.parse(
                model="m", messages=[{"role": "user", "content": prompt}], response_format=model,
                max_tokens=400, seed=i, temperature=0.8)
            choice = done.choices[0]
            self.assertEqual(choice.finish_reason, "stop", choice.message.content)
            self.assertIsInstance(choice.message.parsed, model, choice.message.content)  # pydantic validated it

    def test_schema_streamed(self):
        # A strict schema as OpenAI's API takes one (and as the package's parse() writes it): no
        # properties beyond the listed ones. Without that, a sampled reply may add properties of
        # unbounded strings and run to max_tokens in one (seen on AVX2: "-Mermad-Mermad-...").
        schema = {**Person.model_json_schema(), "additionalProperties": False}
        stream = self.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Describe a lighthouse keeper as JSON."}], max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}},
            stream=True, seed=7)
        parts, finish = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        self.assertEqual(finish, "stop")
        Person.model_validate_json("".join(parts))

    def test_json_object(self):
        # Any object: strings are unbounded, so a sequence may run to max_tokens inside one (as
        # with llama-server); every one that stops is an object.
        stopped = 0
        for seed in range(3):
            reply = self.ask("Give me a JSON object about the weather.", response_format={"type": "json_object"},
                             seed=seed, max_tokens=150)
            if reply.choices[0].finish_reason == "stop":
                stopped += 1
                self.assertIsInstance(json.loads(reply.choices[0].message.content), dict)
        self.assertGreater(stopped, 0)

    def test_gbnf_grammar_field(self):
        grammar = 'root ::= "The answer is " [0-9]{1,3} "."'
        for seed in range(2):
            reply = self.ask("What is 6 times 7?", extra_body={"grammar": grammar}, seed=seed)
            self.assertRegex(reply.choices[0].message.content, r"^The answer is [0-9]{1,3}\.$")
            self.assertEqual(reply.choices[0].finish_reason, "stop")

    def test_text_completion_with_schema(self):
        schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                   "population": {"type": "integer"}},
                  "required": ["city", "population"], "additionalProperties": False}
        done = self.client.completions.create(model="m", prompt="A European capital as JSON:", max_tokens=200,
                                              extra_body={"json_schema": schema}, seed=3)
        value = json.loads(done.choices[0].text)
        self.assertIn(value["city"], ["Paris", "Rome", "Oslo"])
        self.assertIsInstance(value["population"], int)

    def test_bad_schemas_and_grammars_are_400s(self):
        cases = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "patternProperties": {"^a": {"type": "string"}}}}}}, "patternProperties"),
            ({"response_format": {"type": "yaml"}}, "response_format.type"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
            ({"grammar": "root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\""}, "left-recursive"),
            ({"grammar": "root ::= missing"}, "undefined rule 'missing'"),
            ({"grammar": "root ::= \"a\"", "response_format": {"type": "json_object"}}, "at most one"),
        ]
        for extra, words in cases:
            with self.assertRaises(openai.BadRequestError) as caught:
                self.ask("hi", extra_body=extra)
            self.assertIn(words, str(caught.exception), extra)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ringlm")
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)

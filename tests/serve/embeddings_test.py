#!/usr/bin/env python3
"""`/v1/embeddings` of `ringlm serve` through the `openai` package: unit vectors of the model's
size, the same vector for a text alone and among others, base64 that decodes to the same floats,
400s that name the field, the model list's pooling; and the vector against the numpy reference
(tests/reference/llama_ref.py on the same file: the mean of the final-normed hidden states,
normalised), never against an earlier answer of the server itself.

  embeddings_test.py RINGLM MODEL

Two servers: the default one (int8 activations, f16 cache) for the API, and one on the reference
path (--compute fp32 --cache-type f32) for the tight comparison with the oracle."""
import argparse
import base64
import json
import os
import sys
import unittest
import urllib.error
import urllib.request

import numpy as np
import openai

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from serve_client_test import Server  # noqa: E402  (one `ringlm serve` on a free port)

ARGS = None
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "def add(a, b):\n    return a + b",
         "Paris is the capital of France, and its largest city.",
         "Embeddings turn text into vectors.",
         "Une phrase en français, avec des accents : été, où, ça."]
CONTEXT = 256  # the servers' -c: an input longer than this is a 400

# The fp32 server against the float64 oracle: measured 2e-7 at most (max |difference| of a unit
# vector's entries, three texts of 10-19 tokens), the rounding of fp32 sums over 30 layers. The
# int8 server's activations are quantized per group of 32 at every product: cosine 0.9991 to
# 0.9999 measured. A wrong pooling (the first or the last token's state) or a missing output norm
# is far outside both: cosine 0.43-0.81 to the mean.
FP32_TOLERANCE = 1e-5
INT8_MIN_COSINE = 0.998


def post(url, path, body):
    """(status, JSON) of a POST, whatever the status."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


class Embeddings(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import serve_client_test
        import llama_ref
        serve_client_test.RINGLM, serve_client_test.MODEL = ARGS.ringlm, ARGS.model
        cls.server = Server("--parallel", "4", "-c", str(CONTEXT))
        cls.fp32_server = Server("--parallel", "2", "-c", str(CONTEXT), "--compute", "fp32", "--cache-type", "f32")
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="none")
        cls.reference = llama_ref.LlamaModel(ARGS.model)  # float64
        cls.n_embd = cls.reference.n_embd

    @classmethod
    def tearDownClass(cls):
        cls.client.close()  # a kept-alive connection would hold the server's shutdown for its 5 s timeout
        # SIGTERM: exit 0 (under the sanitizers, also no leak and no error report at exit).
        codes = [cls.server.stop(), cls.fp32_server.stop()]
        if codes != [0, 0]:
            raise AssertionError(f"the servers exited {codes}: " + "".join(cls.server.log[-20:] + cls.fp32_server.log[-20:]))

    def embed(self, inputs, **kwargs):
        return [np.array(d.embedding) for d in self.client.embeddings.create(model="m", input=inputs, **kwargs).data]

    def tokens(self, text):
        return post(self.server.url, "/tokenize", {"content": text})[1]["tokens"]

    def reference_mean(self, ids):
        self.reference.reset(len(ids))
        rows = self.reference.final_hidden(ids)
        return rows, rows.mean(axis=0) / np.linalg.norm(rows.mean(axis=0))

    def test_unit_vectors_of_the_models_size_with_the_usage(self):
        done = self.client.embeddings.create(model="m", input=TEXTS[:3], encoding_format="float")
        self.assertEqual([d.index for d in done.data], [0, 1, 2])
        for d in done.data:
            self.assertEqual(d.object, "embedding")
            self.assertEqual(len(d.embedding), self.n_embd)
            self.assertAlmostEqual(float(np.linalg.norm(d.embedding)), 1.0, delta=1e-5)
        n_tokens = sum(len(self.tokens(t)) for t in TEXTS[:3])
        self.assertEqual((done.usage.prompt_tokens, done.usage.total_tokens), (n_tokens, n_tokens))
        self.assertEqual(done.object, "list")

    def test_a_text_alone_and_among_others_gives_the_same_vector(self):
        alone = [self.embed(text)[0] for text in TEXTS]
        together = self.embed(TEXTS)  # one request: its inputs share the passes
        for i, (a, b) in enumerate(zip(alone, together)):
            self.assertLess(float(np.abs(a - b).max()), 1e-5, TEXTS[i])
        self.assertGreater(float(np.abs(together[0] - together[1]).max()), 1e-2, "different texts, different vectors")
        # Token ids are inputs too: the text's own ids give the text's vector.
        self.assertLess(float(np.abs(self.embed([self.tokens(TEXTS[2])])[0] - alone[2]).max()), 1e-5)

    def test_base64_decodes_to_the_same_floats(self):
        as_floats = post(self.server.url, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "float"})[1]
        as_base64 = post(self.server.url, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})[1]
        decoded = np.frombuffer(base64.b64decode(as_base64["data"][0]["embedding"]), dtype="<f4")
        self.assertEqual(decoded.tolist(), np.array(as_floats["data"][0]["embedding"], dtype=np.float32).tolist())
        # (The openai package asks for base64 by itself when no format is given, and decodes it.)
        self.assertEqual(np.array(self.embed(TEXTS[1])[0], dtype=np.float32).tolist(), decoded.tolist())

    def test_the_vector_is_the_references_mean_of_the_normed_hidden_states(self):
        for text in TEXTS[:3]:
            ids = self.tokens(text)
            rows, want = self.reference_mean(ids)
            status, body = post(self.fp32_server.url, "/v1/embeddings", {"input": [ids]})
            self.assertEqual(status, 200, body)
            got = np.array(body["data"][0]["embedding"])
            self.assertLess(float(np.abs(got - want).max()), FP32_TOLERANCE, text)
            int8 = self.embed([ids])[0]
            self.assertGreater(float(int8 @ want), INT8_MIN_COSINE, text)
            # What the oracle would catch: the first or the last row instead of the mean.
            for wrong in (rows[0], rows[-1]):
                self.assertLess(float(int8 @ (wrong / np.linalg.norm(wrong))), 0.9, text)

    def test_bad_inputs_are_400s_naming_the_field(self):
        cases = [
            ({}, "input"),
            ({"input": ""}, "input"),
            ({"input": []}, "input"),
            ({"input": ["fine", ""]}, "input[1]"),
            ({"input": [[]]}, "input[0]"),
            ({"input": [1.5]}, "input[0]"),
            ({"input": [[1, 2], [3, 10 ** 9]]}, "input[1][1]"),
            ({"input": {"text": "hi"}}, "input"),
            ({"input": [True]}, "input[0]"),
            ({"input": "word " * (CONTEXT + 10)}, "input"),
            ({"input": ["short", "word " * (CONTEXT + 10)]}, "input[1]"),
            ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
            ({"input": "hi", "dimensions": 64}, "dimensions"),
            ({"input": "hi", "model": 7}, "model"),
        ]
        for body, param in cases:
            status, answer = post(self.server.url, "/v1/embeddings", body)
            self.assertEqual((status, answer["error"]["param"]), (400, param), (body if len(str(body)) < 99 else param, answer))
            self.assertEqual(answer["error"]["type"], "invalid_request_error")
        with self.assertRaises(openai.BadRequestError) as caught:
            self.client.embeddings.create(model="m", input="hi", dimensions=self.n_embd - 1)
        self.assertIn(str(self.n_embd), str(caught.exception))
        # What is allowed: the model's own size, and a user field.
        self.assertEqual(post(self.server.url, "/v1/embeddings", {"input": "hi", "dimensions": self.n_embd,
                                                                  "user": "u1"})[0], 200)
        self.assertEqual(post(self.server.url, "/embeddings", {"input": "hi"})[0], 200)  # without /v1 too

    def test_the_model_list_says_the_pooling(self):
        model = self.client.models.list().data[0]
        self.assertEqual(model.pooling, "mean")
        self.assertEqual(model.embedding_pooling_source, "default for a generative model")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ringlm")
    parser.add_argument("model")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)

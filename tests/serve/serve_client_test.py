#!/usr/bin/env python3
"""`ringlm serve` driven by clients that ringlm did not write: the `openai` package (plain and
streamed chat and text completions) and curl (the error cases, as a shell script would see them).

  serve_client_test.py RINGLM MODEL

Texts are checked against `ringlm run` (greedy) and against the model's own chat template
rendered by jinja2, never against an earlier answer of the server itself."""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import jinja2
import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from gguf_fast import GGUFReader  # noqa: E402  (gguf's own reader, without np.memmap's per-read cost)

RINGLM, MODEL = sys.argv[1], sys.argv[2]
API_KEY = "sk-test-0123456789"


class Server:
    """One `ringlm serve` on a free loopback port; its stderr is kept for the log checks."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen([RINGLM, "serve", "-m", MODEL, "--port", "0", "-t", "1", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.log = []
        first = self.proc.stderr.readline()
        self.log.append(first)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", first)
        if not m:
            raise RuntimeError("no address in: " + first + self.proc.stderr.read())
        self.url = f"http://127.0.0.1:{m.group(1)}"
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.time() + 60
        while curl(self.url + "/health")[0] != 200:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server never became ready: " + "".join(self.log))
            time.sleep(0.05)

    def __del__(self):
        if self.proc.poll() is None:
            self.proc.kill()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        time.sleep(0.1)  # the log thread reads to the end
        self.proc.stderr.close()
        return code


def curl(url, *args):
    """(status, body) of `curl -s URL ARGS...`."""
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", url, *args], capture_output=True, text=True,
                         timeout=120).stdout
    body, _, status = out.rpartition("\n")
    return int(status), body


def status_and_retry_after(url, body):
    """The status and Retry-After header of a POST to /v1/completions, read as soon as the headers
    come: a request admitted by mistake would stream for minutes, and closing it cancels it."""
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("Retry-After")
    finally:
        conn.close()


def written(out):
    """What a client has written so far to the file `out` (read without moving its offset: the
    client writes through the same one)."""
    return os.pread(out.fileno(), os.fstat(out.fileno()).st_size, 0)


def wait_until(condition, failure, seconds=60):
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError(failure)
        time.sleep(0.05)


_plain_texts = {}


def ringlm_run(prompt, n):
    """`ringlm run`'s greedy text (each prompt and length run once: the sanitizer build runs this
    suite too)."""
    if (prompt, n) not in _plain_texts:
        _plain_texts[(prompt, n)] = subprocess.run(
            [RINGLM, "run", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1"],
            capture_output=True, text=True, check=True, timeout=120).stdout
    return _plain_texts[(prompt, n)]


_beam_texts = {}


def ringlm_run_beams(prompt, n, beams):
    """`ringlm run --beams`'s text: the best of its hypotheses."""
    if (prompt, n, beams) not in _beam_texts:
        _beam_texts[(prompt, n, beams)] = subprocess.run(
            [RINGLM, "run", "-m", MODEL, "-p", prompt, "-n", str(n), "--beams", str(beams), "-t", "1"],
            capture_output=True, text=True, check=True, timeout=120).stdout
    return _beam_texts[(prompt, n, beams)]


def chat_prompt(messages):
    """The model's own chat template (its GGUF's tokenizer.chat_template) rendered by jinja2."""
    reader = GGUFReader(MODEL)
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="",
                                            eos_token="")


PROMPTS = ["The capital of France is", "Once upon a time", "The three primary colors are"]


class OpenAiClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--parallel", "4", "-c", "512")
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="none", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        if code != 0:
            raise AssertionError(f"ringlm serve exited {code}")

    def test_completion_greedy_equals_ringlm_run(self):
        for prompt in PROMPTS:
            r = self.client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
            self.assertEqual(r.choices[0].text, ringlm_run(prompt, 16), prompt)
            self.assertEqual(r.choices[0].finish_reason, "length")
            self.assertEqual(r.usage.completion_tokens, 16)
            self.assertEqual(r.object, "text_completion")

    def test_beam_search_completion_equals_ringlm_run_beams(self):
        prompt = PROMPTS[0]
        r = self.client.completions.create(model="m", prompt=prompt, max_tokens=12, n=2, best_of=4,
                                           extra_body={"use_beam_search": True})
        self.assertEqual(len(r.choices), 2)
        texts = {c.index: c.text for c in r.choices}
        self.assertEqual(texts[0], ringlm_run_beams(prompt, 12, 4))
        self.assertNotEqual(texts[1], texts[0])
        bad = [({"best_of": 2}, "best_of"),
               ({"use_beam_search": True, "best_of": 2, "n": 3}, "best_of"),
               ({"use_beam_search": True, "stream": True}, "stream"),
               ({"use_beam_search": True, "best_of": 8}, "best_of")]  # more beams than --parallel 4
        for fields, param in bad:
            body = json.dumps({"prompt": prompt, "max_tokens": 4, **fields})
            status, text = curl(self.server.url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body)
            self.assertEqual(status, 400, body)
            self.assertEqual(json.loads(text)["error"]["param"], param, text)

    def test_streamed_completion_is_the_same_text(self):
        prompt = PROMPTS[1]
        stream = self.client.completions.create(model="m", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        self.assertEqual("".join(pieces), ringlm_run(prompt, 20))
        self.assertEqual(finish, "length")
        self.assertEqual(usage.completion_tokens, 20)
        self.assertGreater(usage.prompt_tokens, 0)

    def test_chat_follows_the_models_own_template(self):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = self.client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
        expected = self.client.completions.create(model="m", prompt=chat_prompt(messages), max_tokens=24,
                                                  temperature=0)
        self.assertEqual(r.choices[0].message.content, expected.choices[0].text)
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.usage.prompt_tokens, expected.usage.prompt_tokens)

    def test_streamed_chat_is_the_same_text(self):
        messages = [{"role": "system", "content": "You answer briefly."},
                    {"role": "user", "content": "Name a color."}]
        whole = self.client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0)
        roles, pieces, finish = [], [], None
        for chunk in self.client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                                         stream=True):
            self.assertEqual(chunk.object, "chat.completion.chunk")
            for c in chunk.choices:
                roles += [c.delta.role] if c.delta.role else []
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        self.assertEqual(roles, ["assistant"])
        self.assertEqual("".join(pieces), whole.choices[0].message.content)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertIn(finish, ("stop", "length"))

    def test_stop_sequence_ends_the_text_before_it(self):
        full = ringlm_run(PROMPTS[0], 16)  # " Paris.\n\nThe answer is: ..."
        stop = full[full.index("."):full.index(".") + 1]
        r = self.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
        self.assertEqual(r.choices[0].text, full[:full.index(stop)])
        self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_n_samples_seeded_and_logprobs(self):
        kwargs = dict(model="m", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=3)
        a = self.client.completions.create(**kwargs)
        b = self.client.completions.create(**kwargs)
        self.assertEqual(sorted(c.index for c in a.choices), [0, 1, 2])
        self.assertEqual([c.text for c in a.choices], [c.text for c in b.choices])  # the seed decides
        self.assertEqual(a.usage.completion_tokens, 24)
        for c in a.choices:
            lp = c.logprobs
            self.assertEqual(len(lp.tokens), 8)
            self.assertEqual("".join(lp.tokens), c.text)
            for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
                self.assertLessEqual(chosen, 0.0)
                self.assertEqual(len(top), 3)
                self.assertLessEqual(sum(2.718281828 ** v for v in top.values()), 1.0001)
                self.assertLessEqual(chosen, max(top.values()) + 1e-4)

    def test_chat_logprobs_of_greedy_tokens_are_the_top_ones(self):
        r = self.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 6)
        for t in content:
            self.assertEqual(len(t.top_logprobs), 2)
            self.assertAlmostEqual(t.logprob, t.top_logprobs[0].logprob, places=4)
            self.assertGreaterEqual(t.top_logprobs[0].logprob, t.top_logprobs[1].logprob)

    def test_models_tokenize_detokenize(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], [os.path.basename(MODEL)])
        ids = subprocess.run([RINGLM, "tokenize", "-m", MODEL, "-p", "Hello, world!", "--ids", "--no-bos"],
                             capture_output=True, text=True, check=True).stdout.strip()
        status, body = curl(self.server.url + "/tokenize", "-d", json.dumps({"content": "Hello, world!"}))
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body)["tokens"], json.loads(ids))
        status, body = curl(self.server.url + "/detokenize", "-d", json.dumps({"tokens": json.loads(ids)}))
        self.assertEqual(json.loads(body)["content"], "Hello, world!")

    def test_metrics_count_requests_and_tokens(self):
        def value(text, name):
            return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
        status, before = curl(self.server.url + "/metrics")
        self.assertEqual(status, 200)
        self.client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=5, temperature=0)
        _, after = curl(self.server.url + "/metrics")
        self.assertEqual(value(after, "ringlm_generated_tokens_total") - value(before, "ringlm_generated_tokens_total"), 5)
        self.assertGreaterEqual(value(after, "ringlm_requests_finished_total"), 1)
        for name in ("ringlm_requests_queued", "ringlm_sequences_running", "ringlm_kv_cache_bytes",
                     "ringlm_generated_tokens_per_second"):
            value(after, name)
        self.assertRegex(after, r'ringlm_http_requests_total\{path="/v1/completions",status="200"\} \d+')

    def test_errors_name_the_field(self):
        url = self.server.url + "/v1/chat/completions"
        cases = [
            ("{not json", None),
            (json.dumps({"messages": "hi"}), "messages"),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}), "temperature"),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}), "max_tokens"),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 2}), "top_p"),
            (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "messages[0].role"),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}), "n"),
            (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": 3}), "stop"),
            (json.dumps({"messages": [{"role": "user", "content": "hi " * 600}]}), "messages"),  # > -c 512
        ]
        for body, field in cases:
            status, text = curl(url, "-H", "Content-Type: application/json", "-d", body)
            self.assertEqual(status, 400, body[:80])
            error = json.loads(text)["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertTrue(error["message"])
            if field:
                self.assertEqual(error["param"], field, error["message"])
        status, text = curl(self.server.url + "/v1/completions", "-d", json.dumps({"prompt": "x " * 600}))
        self.assertEqual((status, json.loads(text)["error"]["param"]), (400, "prompt"))
        status, text = curl(self.server.url + "/v1/nothing")
        self.assertEqual(status, 404)
        self.assertIn("error", json.loads(text))

    def test_the_server_logs_one_line_per_request(self):
        curl(self.server.url + "/v1/models")
        time.sleep(0.2)
        self.assertTrue(any(re.search(r"GET /v1/models 200 .* ms", line) for line in self.server.log), self.server.log)


class SpeculativeServer(unittest.TestCase):
    """`serve --lookup`: drafts checked inside continuous batching give the greedy text of plain
    `ringlm run`, concurrent requests each their own; /metrics counts the drafts."""

    COPY = "Copy the list: apples, pears, plums, cherries, grapes. Copy: apples, pears,"

    def test_greedy_texts_are_plain_decodings_and_metrics_count_drafts(self):
        server = Server("--parallel", "2", "-c", "512", "--lookup", "8")
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            prompts = [self.COPY, PROMPTS[1]]
            results = {}

            def ask(prompt, extra):
                r = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
                results[(prompt, json.dumps(extra))] = r.choices[0].text

            threads = [threading.Thread(target=ask, args=(p, {})) for p in prompts]
            threads.append(threading.Thread(target=ask, args=(self.COPY, {"speculative.n_max": 0})))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            plain = {prompt: ringlm_run(prompt, 16) for prompt in prompts}  # PROMPTS[1]'s: run for the test above
            for (prompt, _), text in results.items():
                self.assertEqual(text, plain[prompt], prompt)
            _, metrics = curl(server.url + "/metrics")
            drafted = float(re.search(r"^ringlm_draft_tokens_total (\S+)$", metrics, re.M).group(1))
            accepted = float(re.search(r"^ringlm_draft_tokens_accepted_total (\S+)$", metrics, re.M).group(1))
            self.assertGreater(accepted, 0)
            self.assertLessEqual(accepted, drafted)
        finally:
            self.assertEqual(server.stop(), 0)


class Limits(unittest.TestCase):
    def test_a_file_that_is_not_a_model_is_a_clear_error(self):
        with tempfile.NamedTemporaryFile(suffix=".gguf") as bad:
            bad.write(b"not a model at all")
            bad.flush()
            r = subprocess.run([RINGLM, "serve", "-m", bad.name, "--port", "0"], capture_output=True, text=True,
                               timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("not a GGUF file", r.stderr)

    def test_body_over_the_limit_is_413(self):
        s = Server("--max-body", "4096")
        try:
            status, text = curl(s.url + "/v1/completions", "-d", json.dumps({"prompt": "x" * 10000}))
            self.assertEqual(status, 413)
            self.assertEqual(json.loads(text)["error"]["type"], "invalid_request_error")
        finally:
            self.assertEqual(s.stop(), 0)

    def test_api_key(self):
        s = Server(env={"RINGLM_API_KEY": API_KEY})
        try:
            url = s.url + "/v1/models"
            self.assertEqual(curl(url)[0], 401)
            self.assertEqual(curl(url, "-H", "Authorization: Bearer sk-wrong")[0], 401)
            self.assertEqual(json.loads(curl(url)[1])["error"]["type"], "authentication_error")
            self.assertEqual(curl(url, "-H", f"Authorization: Bearer {API_KEY}")[0], 200)
            self.assertEqual(curl(s.url + "/health")[0], 200)  # a load balancer's check carries no key
            with self.assertRaises(openai.AuthenticationError):
                openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
            ok = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
            self.assertEqual(len(ok.completions.create(model="m", prompt="Hi", max_tokens=2).choices), 1)
        finally:
            self.assertEqual(s.stop(), 0)

    # The server admits and counts the queue under one lock (ServingEngine::submit, stats), so the
    # test's own setup is what must hold still: one stream running and one queued for as long as
    # the third request takes. No token limit and -c 16384 keep the first running for minutes; the
    # streams go to files, not to pipes that nobody reads, so the server never stalls writing one
    # (cpp-httplib's write timeout would cancel it and free the slot).
    def test_full_queue_is_503_with_retry_after(self):
        s = Server("--parallel", "1", "--max-queue", "1", "-c", "16384")
        streams = []
        try:
            endless = json.dumps({"prompt": "Once upon a time", "max_tokens": -1, "temperature": 0, "stream": True})

            def start_stream():
                out = tempfile.TemporaryFile()
                streams.append((subprocess.Popen(["curl", "-sN", s.url + "/v1/completions", "-d", endless],
                                                 stdout=out), out))
                return out

            running = start_stream()
            wait_until(lambda: written(running), "the first request never ran")
            queued = start_stream()
            wait_until(lambda: re.search(r"(?m)^ringlm_requests_queued 1$", curl(s.url + "/metrics")[1]),
                       "the second request never queued")
            status, retry_after = status_and_retry_after(s.url, endless)
            # Both earlier requests still hold their places: the one that runs has not ended and
            # the one that waits has no token yet, so the queue was full all along.
            _, metrics = curl(s.url + "/metrics")
            self.assertRegex(metrics, r"(?m)^ringlm_requests_finished_total 0$")
            self.assertRegex(metrics, r"(?m)^ringlm_sequences_running 1$")
            self.assertEqual(written(queued), b"", "the queued request started: the queue was not full")
            self.assertNotIn(b"[DONE]", written(running))
            self.assertEqual(status, 503)
            self.assertRegex(retry_after or "", r"^\d+$")
        finally:
            for proc, out in streams:
                proc.kill()
                proc.wait()
                out.close()
            self.assertEqual(s.stop(), 0)

    # -c 16384: a request that kept running would hold the one slot for minutes, not seconds.
    def test_a_client_that_goes_away_frees_its_slot(self):
        s = Server("--parallel", "1", "-c", "16384")
        try:
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100000, "temperature": 0, "stream": True})
            req = urllib.request.Request(s.url + "/v1/completions", data=body.encode())
            with urllib.request.urlopen(req) as r:
                r.readline()
            # The one slot is free again: a second request runs to its end at once.
            started = time.time()
            status, _ = curl(s.url + "/v1/completions", "-d", json.dumps({"prompt": "Hi", "max_tokens": 4}))
            self.assertEqual(status, 200)
            self.assertLess(time.time() - started, 15)
            _, metrics = curl(s.url + "/metrics")
            self.assertRegex(metrics, r"(?m)^ringlm_requests_finished_total 1$")
            self.assertRegex(metrics, r"(?m)^ringlm_sequences_running 0$")
        finally:
            self.assertEqual(s.stop(), 0)

    def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(self):
        s = Server("--parallel", "1", "-c", "16384")
        try:
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100000, "temperature": 0})
            sock = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
            time.sleep(1.5)  # running, no answer yet
            sock.close()
            started = time.time()
            status, text = curl(s.url + "/v1/completions", "-d", json.dumps({"prompt": "Hi", "max_tokens": 4}))
            self.assertEqual(status, 200, text)
            self.assertLess(time.time() - started, 15)
            _, metrics = curl(s.url + "/metrics")
            self.assertRegex(metrics, r"(?m)^ringlm_requests_finished_total 1$")  # the abandoned one: cancelled
            # A long whole answer arrives chunked, after spaces: still one JSON document.
            status, text = curl(s.url + "/v1/completions", "-d", json.dumps({"prompt": "Hi", "max_tokens": 400,
                                                                            "temperature": 0}))
            self.assertEqual(status, 200)
            self.assertEqual(json.loads(text)["usage"]["completion_tokens"] > 0, True)
        finally:
            self.assertEqual(s.stop(), 0)

    def test_sigterm_finishes_the_running_stream_and_exits_0(self):
        s = Server("--parallel", "2", "--shutdown-grace", "120")  # ample, for a sanitizer build too
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "stream": True})
        stream = subprocess.Popen(["curl", "-sN", s.url + "/v1/completions", "-d", body], stdout=subprocess.PIPE,
                                  text=True)
        first = stream.stdout.readline()
        self.assertTrue(first.startswith("data: {"), first)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        self.assertEqual(curl(s.url + "/health")[0], 503)  # the load balancer takes it out
        rest = stream.stdout.read()
        self.assertTrue(rest.endswith("data: [DONE]\n\n"), rest[-200:])
        text = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in (first + rest).splitlines() if line.startswith("data: {"))
        self.assertEqual(text, ringlm_run("Once upon a time", 60))
        self.assertEqual(s.stop(), 0)
        stream.wait()
        stream.stdout.close()


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)

#!/usr/bin/env python3
"""Structured output, measured (issue 48's goals):

  valid    `ringlm serve` asked through the openai package, a pydantic model as response_format
           (its parse() helper, a strict JSON schema), for each of --prompts varied prompts:
           how many answers stop on their own and pydantic validates.
  speed    `ringlm run` with a JSON schema of about 2 KB against the same prompt unconstrained,
           as many tokens (--ignore-eos), alternated: generated tokens/s, medians, and the
           grammar's own cost per token from --stats json.
  latency  time to the first streamed token from `ringlm serve`, with that schema and without,
           alternated over --latency-requests requests: medians.
  tools    `ringlm serve` with three tools (pydantic models as their parameters): for each of
           --prompts questions, a call forced (tool_choice "required"), its arguments validated
           by pydantic, the result sent back and the answer read; and the same questions with
           tool_choice "auto": how many replies are calls that validate or plain text (none a
           call that does not parse). With --llama-server, the same against `llama-server --jinja`.
  clients  (with --llama-server PATH) --clients concurrent clients asking for that schema,
           --requests each, against `ringlm serve --parallel N` and `llama-server -np N` in turn:
           completion tokens per second of wall time, every answer checked against the schema.

    python3 bench/structured_output.py [-m MODEL] [--prompts 50] [-t 2] [-r 5] [--llama-server PATH]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import openai
import pydantic

HERE = os.path.dirname(os.path.abspath(__file__))
RINGLM = os.path.join(HERE, "..", "build", "bin", "ringlm")

SUBJECTS = ["a cat", "a retired sailor", "a chess player", "a baker from Lyon", "a child who likes trains", "a doctor",
            "an old king", "a painter", "a robot", "a farmer", "a pilot", "a teacher", "a nurse", "a miner",
            "a violinist", "a librarian", "a fisherman", "a judge", "a gardener", "a firefighter", "a poet",
            "a mountain guide", "a taxi driver", "a beekeeper", "an astronaut"]
FORMS = ["Describe {} as JSON.", "Invent {} and give their details in JSON."]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int
    hobbies: list[pydantic.constr(max_length=30)] = pydantic.Field(max_length=3)


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # (additionalProperties: false, as a strict schema has)
    street: str = pydantic.Field(max_length=40)
    city: str = pydantic.Field(max_length=30)
    postcode: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Contact(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: str = pydantic.Field(pattern="^(email|phone)$")
    value: str = pydantic.Field(max_length=40)


class Employee(pydantic.BaseModel):
    """The about-2-KB schema of the speed and latency runs: nesting, $defs, enums, patterns."""
    model_config = pydantic.ConfigDict(extra="forbid")
    id: str = pydantic.Field(pattern=r"^[A-Z]{2}-[0-9]{4}$")
    first_name: str = pydantic.Field(max_length=30)
    last_name: str = pydantic.Field(max_length=30)
    age: int
    department: str = pydantic.Field(pattern="^(sales|engineering|support|finance)$")
    manager: bool
    salary: float
    address: Address
    contacts: list[Contact] = pydantic.Field(max_length=3)
    skills: list[pydantic.constr(max_length=20)] = pydantic.Field(max_length=4)
    started: str = pydantic.Field(json_schema_extra={"format": "date"})


def serve(model, threads, parallel):
    proc = subprocess.Popen([RINGLM, "serve", "-m", model, "--port", "0", "-t", str(threads), "--parallel", str(parallel)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    port = re.search(r"127\.0\.0\.1:(\d+)", first).group(1)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    for _ in range(600):
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            time.sleep(0.1)
    return proc, client


def valid_answers(client, n_prompts):
    ok, reasons = 0, []
    for i in range(n_prompts):
        prompt = FORMS[i % 2].format(SUBJECTS[i % len(SUBJECTS)])
        done = client.beta.chat.completions.parse(model="m", messages=[{"role": "user", "content": prompt}],
                                                  response_format=Person, max_tokens=600, seed=i, temperature=0.8)
        c = done.choices[0]
        if c.finish_reason == "stop" and isinstance(c.message.parsed, Person):
            ok += 1
        else:
            reasons.append((prompt, c.finish_reason, c.message.content[:120]))
    return ok, reasons


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=40)
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


TOOL_MODELS = {"get_weather": Weather, "add": Add, "book_flight": Flight}
TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": model.model_json_schema()}}
         for (name, model), description in zip(TOOL_MODELS.items(), ["The weather in a city", "Adds two numbers",
                                                                      "Books a flight"])]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Nairobi", "Quito", "Hanoi", "Perth", "Cairo", "Denver"]
QUESTIONS = ["What is the weather in {}?", "Add {} and 17.", "Book a flight from {} to Rome for two.",
             "Is it cold in {} today?", "How many is {} plus 3.5? Use the tool."]


def valid_call(call):
    try:
        TOOL_MODELS[call.function.name].model_validate_json(call.function.arguments)
        return True
    except (KeyError, pydantic.ValidationError):
        return False


def tool_calls(client, n_prompts):
    """(forced calls valid, round trips answered, auto replies that are valid calls, auto plain text)."""
    forced = answered = auto_calls = auto_text = 0
    failures = []
    for i in range(n_prompts):
        question = QUESTIONS[i % len(QUESTIONS)].format(CITIES[i % len(CITIES)] if i % 5 != 1 and i % 5 != 4 else 10 + i)
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, seed=i, temperature=0.8)
        message = r.choices[0].message
        if r.choices[0].finish_reason == "tool_calls" and message.tool_calls and all(map(valid_call, message.tool_calls)):
            forced += 1
            messages += [message.model_dump(exclude_none=True)] + [
                {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "value": 21})}
                for c in message.tool_calls]
            answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                                    max_tokens=60, seed=i).choices[0].message
            answered += bool(answer.content and answer.content.strip() and not answer.tool_calls)
        else:
            failures.append(("required", question, r.choices[0].finish_reason, message.content, message.tool_calls))
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                           max_tokens=200, seed=i, temperature=0.8)
        message = r.choices[0].message
        if message.tool_calls and all(map(valid_call, message.tool_calls)):
            auto_calls += 1
        elif not message.tool_calls and "<tool_call>" not in (message.content or ""):
            auto_text += 1
        else:
            failures.append(("auto", question, r.choices[0].finish_reason, message.content, message.tool_calls))
    return forced, answered, auto_calls, auto_text, failures


def run_stats(model, threads, args):
    out = subprocess.run([RINGLM, "run", "-m", model, "-t", str(threads), "--stats", "json", *args],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stderr.strip().splitlines()[-1])


def speed(model, threads, rounds):
    schema = json.dumps(Employee.model_json_schema())
    prompt = "Invent an employee record as JSON:"
    constrained, free, per_token = [], [], []
    for r in range(rounds):
        s = run_stats(model, threads, ["-p", prompt, "--json-schema", schema, "--seed", str(r), "-n", "400"])
        n = s["gen_tokens"]
        u = run_stats(model, threads, ["-p", prompt, "--seed", str(r), "-n", str(n), "--ignore-eos"])
        constrained.append(s["gen_tps"])
        free.append(u["gen_tps"])
        per_token.append(s["grammar"]["ms_per_token"])
        print(f"  round {r}: {n} tokens, constrained {s['gen_tps']:.1f} t/s (grammar {s['grammar']['ms_per_token']:.3f} "
              f"ms/token, {s['grammar']['masked_draws']} masked draws), unconstrained {u['gen_tps']:.1f} t/s", flush=True)
    return len(schema), statistics.median(constrained), statistics.median(free), statistics.median(per_token)


def start_llama_server(path, model, threads, parallel, n_ctx, extra=()):
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([path, "-m", model, "--port", str(port), "-t", str(threads), "-np", str(parallel),
                             "-c", str(n_ctx * parallel), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    for _ in range(1200):
        try:
            client.models.list()
            break
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            time.sleep(0.1)
    return proc, client


def clients_rate(client, n_clients, n_requests):
    """Aggregate completion tokens/s of n_clients threads, each asking n_requests times for an
    Employee: (tokens/s, answers that stopped but are not one, answers cut at max_tokens)."""
    schema = Employee.model_json_schema()
    tokens, failures, cut = [0] * n_clients, [0] * n_clients, [0] * n_clients

    def one(i):
        for r in range(n_requests):
            done = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Invent employee number {i * n_requests + r} as JSON."}],
                max_tokens=1000, seed=i * n_requests + r, temperature=0.8,
                response_format={"type": "json_schema", "json_schema": {"name": "employee", "schema": schema}})
            tokens[i] += done.usage.completion_tokens
            if done.choices[0].finish_reason == "length":
                cut[i] += 1
                continue
            try:
                Employee.model_validate_json(done.choices[0].message.content)
            except pydantic.ValidationError:
                failures[i] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - t0), sum(failures), sum(cut)


def first_token_ms(client, schema, seed):
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}} if schema else {}
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "An employee record:"}],
                                            max_tokens=2, stream=True, seed=seed, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ms = 1000 * (time.perf_counter() - t0)
            break
    for _ in stream:
        pass
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/ringlm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--latency-requests", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: tools, valid, speed, latency")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server, for the clients part")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client in the clients part")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"model {os.path.basename(args.model)}, {args.threads} threads")
    if "tools" not in skip:
        servers = [("ringlm", lambda: serve(args.model, args.threads, 4))]
        if args.llama_server:
            servers.append(("llama-server", lambda: start_llama_server(args.llama_server, args.model, args.threads, 4, 4096,
                                                                            ["--jinja"])))
        for name, start in servers:
            proc, client = start()
            try:
                forced, answered, auto_calls, auto_text, failures = tool_calls(client, args.prompts)
            finally:
                proc.terminate()
                proc.wait()
            n = args.prompts
            print(f"tools: {name}: required: {forced}/{n} calls valid, {answered}/{forced} round trips answered; "
                  f"auto: {auto_calls} valid calls + {auto_text} plain answers of {n}", flush=True)
            for f in failures[:10]:
                print("  failed:", f)
    if "valid" not in skip or "latency" not in skip:
        proc, client = serve(args.model, args.threads, 4)
        try:
            if "valid" not in skip:
                ok, reasons = valid_answers(client, args.prompts)
                print(f"valid: {ok}/{args.prompts} answers stopped and parsed as the pydantic model")
                for r in reasons:
                    print("  not valid:", r)
            if "latency" not in skip:
                schema = Employee.model_json_schema()
                first_token_ms(client, schema, 0)  # (the vocabulary's token texts are decoded on first use)
                with_s, without = [], []
                for i in range(args.latency_requests):
                    with_s.append(first_token_ms(client, schema, i))
                    without.append(first_token_ms(client, None, i))
                a, b = statistics.median(with_s), statistics.median(without)
                print(f"latency: first token {a:.1f} ms with the schema, {b:.1f} ms without: {a / b:.2f}x")
        finally:
            proc.terminate()
            proc.wait()
    if args.llama_server:
        rates = {}
        for name in ("ringlm", "llama-server"):
            if name == "ringlm":
                proc, client = serve(args.model, args.threads, args.clients)
            else:
                proc, client = start_llama_server(args.llama_server, args.model, args.threads, args.clients, 1024)
            try:
                rates[name] = clients_rate(client, args.clients, args.requests)
            finally:
                proc.terminate()
                proc.wait()
            print(f"clients: {name}: {rates[name][0]:.1f} completion tokens/s, {rates[name][1]} answers not valid, "
                  f"{rates[name][2]} cut at max_tokens", flush=True)
        print(f"clients: ringlm / llama-server {rates['ringlm'][0] / rates['llama-server'][0]:.2f}x")
    if "speed" not in skip:
        size, c, u, per = speed(args.model, args.threads, args.rounds)
        print(f"speed: schema of {size} bytes; constrained {c:.1f} t/s, unconstrained {u:.1f} t/s: {c / u:.3f}x; "
              f"grammar {per:.3f} ms/token (medians of {args.rounds})")


if __name__ == "__main__":
    sys.exit(main())

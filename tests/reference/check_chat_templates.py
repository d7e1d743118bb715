#!/usr/bin/env python3
"""Checks ringlm's chat formats against the real Jinja chat templates, rendered by jinja2.

ringlm never runs a model's template: it recognises the format by its markers and writes the
conversation itself (core/session/chat_template.cpp). Here each template is rendered the way
Hugging Face's apply_chat_template does (ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, add_generation_prompt=True) for several conversations, and ringlm's rendering,
printed by the test tool ringlm_chat_render, must be identical, with the BOS text in front when
ringlm says the format starts with BOS (ringlm adds that BOS as a token, never as text).

    check_chat_templates.py --tool build/tests/ringlm_chat_render --shared-data ../shared/data

Templates that write today's date (gpt-oss's strftime_now("%Y-%m-%d")) are rendered on a fixed
date, RENDER_DATE, on both sides: jinja2's strftime_now formats it, ringlm_chat_render is given it
with --date.

Where a template does what ringlm deliberately does not (see TEMPLATES below), only that
combination is skipped, with the reason printed; the format detection is still checked.

Conversations with tools (TOOL_CONVERSATIONS: OpenAI's "tools", assistant tool_calls and "tool"
results) are compared for the templates that write tools themselves ("tools": Qwen 2.5 and
3, Llama 3.1, Mistral Nemo, gpt-oss), as transformers renders them: arguments as dicts, its tojson filter
(json.dumps, keys in order, ensure_ascii=False). ringlm gets the arguments as OpenAI sends them,
JSON text. For the other templates ringlm's own rendering (the tools in the system message) is
only checked to succeed and to name every tool.
Exit status: 0 when everything matches, 1 on the first mismatch (both texts printed).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jinja2
import jinja2.ext
import jinja2.sandbox

HERE = os.path.dirname(os.path.abspath(__file__))

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The day both sides render on (not today: a ringlm that ignored it would fail).
RENDER_DATE = datetime.datetime(2024, 2, 29, 13, 5, 0)


def has_system(conversation):
    return bool(conversation) and conversation[0]["role"] == "system"


def user_turns(conversation):
    return sum(1 for message in conversation if message["role"] == "user")


# Skip rules: each returns the reason a conversation cannot be compared, or None.
def skip_never(_conversation):
    return None


def skip_smollm3(_conversation):
    return ("SmolLM3's template always writes its '## Metadata' system header and reasoning "
            "instructions; ringlm writes plain ChatML")


def skip_gemma_system(conversation):
    if has_system(conversation):
        return "Gemma's template raises on a system message; ringlm folds it into the first user message"
    return None


def skip_mistral_2023_system(conversation):
    if has_system(conversation):
        return ("Mistral-7B-Instruct-v0.1's 2023 template raises on a system message; ringlm folds it into "
                "the first user message")
    return None


def skip_nemo_system(conversation):
    if has_system(conversation) and (user_turns(conversation) > 1 or conversation[-1]["role"] != "user"):
        return ("Mistral-Nemo's template puts the system prompt in the last message when it is a user message "
                "(and drops it otherwise); ringlm keeps it in the first (the conversation stays in the KV cache)")
    return None


# file name -> what ringlm must recognise and how to compare. "default_system": the system prompt
# the template injects when the conversation has none (ringlm does not inject it: its caller
# passes default_system_prompt() as the system message, so the tool gets it explicitly).
TEMPLATES = {
    # ../shared/data/chat-templates
    "HuggingFaceTB-SmolLM3-3B.jinja": dict(format="chatml", bos="", eos="<|im_end|>", skip=skip_smollm3),
    "Qwen-Qwen2.5-7B-Instruct.jinja": dict(format="chatml", bos="", eos="<|im_end|>",
                                           default_system=QWEN_DEFAULT_SYSTEM, tools="hermes"),
    "google-gemma-2-2b-it.jinja": dict(format="gemma", bos="<bos>", eos="<eos>", skip=skip_gemma_system),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": dict(format="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>",
                                                   tools="llama3"),
    "microsoft-Phi-3.5-mini-instruct.jinja": dict(format="phi3", bos="<s>", eos="<|endoftext|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": dict(format="mistral", bos="<s>", eos="</s>",
                                                       skip=skip_nemo_system, tools="mistral"),
    # tests/reference/chat_templates
    "HuggingFaceTB-SmolLM2-135M-Instruct.jinja": dict(format="chatml", bos="<|im_start|>", eos="<|im_end|>",
                                                      default_system=SMOLLM2_DEFAULT_SYSTEM),
    "meta-llama-Llama-2-7b-chat-hf.jinja": dict(format="llama2", bos="<s>", eos="</s>"),
    "meta-llama-Meta-Llama-3-8B-Instruct.jinja": dict(format="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "microsoft-Phi-3-mini-4k-instruct.jinja": dict(format="phi3", bos="<s>", eos="<|endoftext|>"),
    "HuggingFaceH4-zephyr-7b-beta.jinja": dict(format="zephyr", bos="<s>", eos="</s>"),
    "mistralai-Mistral-7B-Instruct-v0.1.jinja": dict(format="mistral", bos="<s>", eos="</s>"),
    "mistralai-Mistral-7B-Instruct-v0.1-2023.jinja": dict(format="mistral", bos="<s>", eos="</s>",
                                                          skip=skip_mistral_2023_system),
    # gpt-oss (harmony): a system block with the date, the system message as the developer's,
    # past replies as their final channel. bos/eos: o200k_harmony's (the template writes neither).
    "openai-gpt-oss-120b.jinja": dict(format="harmony", bos="<|startoftext|>", eos="<|return|>", tools="harmony"),
    # Qwen3 (and Qwen3-MoE): ChatML whose replies think in <think> tags (ReplyParser's reasoning).
    "Qwen-Qwen3-0.6B.jinja": dict(format="chatml", bos="", eos="<|im_end|>", tools="hermes"),
}


def msg(role, content):
    return {"role": role, "content": content}


# With and without a system message, one and three user turns; contents with leading and
# trailing spaces and newlines (which some formats trim), Unicode whitespace (which Python's
# strip() also trims), and non-ASCII text.
CONVERSATIONS = {
    "one turn": [msg("user", "Hello")],
    "system, one turn": [msg("system", "You are a terse assistant."), msg("user", "What is 2+2?")],
    "three turns": [
        msg("user", "  Hi there  "),
        msg("assistant", "\nHello! How can I help?\n"),
        msg("user", "café 日本 🙂\n"),
        msg("assistant", "  Ça va 🙂  "),
        msg("user", "\t\u3000last question?\u00a0\r\n"),
    ],
    "system, three turns": [
        msg("system", "  Be brief.\nAnswer in English.\n"),
        msg("user", "\n first\n"),
        msg("assistant", "one"),
        msg("user", "second  "),
        msg("assistant", " two\n\n"),
        msg("user", "third: 日本語?"),
    ],
    "system with unicode, one turn": [msg("system", "Réponds en français 🙂"), msg("user", " Bonjour ")],
}


def tool(name, description, properties, required):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


# Unicode in descriptions, an enum, a nested object, members in an order that is not sorted.
TOOLS = [
    tool("get_weather", "The weather in a city, in °C or °F", {
        "city": {"type": "string", "description": "e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    tool("add", "Adds two numbers", {"b": {"type": "number"}, "a": {"type": "number"},
                                     "options": {"type": "object", "properties": {"round": {"type": "boolean"}}}},
         ["a", "b"]),
]


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calls_message(content, *calls):
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def tool_result(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# Mistral's template wants call ids of 9 letters and digits.
WEATHER_CALL = call("abc123xyz", "get_weather", {"city": "Zürich", "unit": "celsius"})
ADD_CALL = call("def456uvw", "add", {"a": 2, "b": 3.5})
TOOL_CONVERSATIONS = {
    "tools, one turn": [msg("user", "What is the weather in Zürich?")],
    "tools, system, a call and its result": [
        msg("system", "You are a weather bot."),
        msg("user", "Weather in Zürich?"),
        calls_message("", WEATHER_CALL),
        tool_result("abc123xyz", '{"temperature": 21, "sky": "clear"}'),
    ],
    "tools, a call answered, then a new question": [
        msg("user", "Weather in Zürich?"),
        calls_message("", WEATHER_CALL),
        tool_result("abc123xyz", "21 degrees"),
        msg("assistant", "It is 21 °C in Zürich."),
        msg("user", "And 2 + 3.5?"),
    ],
    "tools, two calls at once": [
        msg("user", "Weather in Zürich, and 2 + 3.5?"),
        calls_message("Let me look.", WEATHER_CALL, ADD_CALL),
        tool_result("abc123xyz", "21 degrees"),
        tool_result("def456uvw", "5.5"),
    ],
}


def skip_one_call_per_message(conversation):
    if any(len(m.get("tool_calls", [])) > 1 for m in conversation):
        return ("Llama 3.1's template raises on two calls in one message and gpt-oss's writes only the first; "
                "ringlm refuses them")
    return None


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def transformers_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces jinja2's tojson (which sorts keys and escapes HTML) with this.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def jinja_render(source, conversation, bos, eos, tools=None):
    # As transformers' apply_chat_template sets up its environment.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = transformers_tojson
    # transformers: datetime.now().strftime(format); here the fixed day.
    env.globals["strftime_now"] = RENDER_DATE.strftime
    template = env.from_string(source)
    extra = {"tools": tools} if tools else {}
    return template.render(messages=conversation, add_generation_prompt=True, bos_token=bos, eos_token=eos, **extra)


def as_openai(conversation):
    """The conversation as an OpenAI client sends it: call arguments as JSON text."""
    out = []
    for message in conversation:
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
                                     for c in message["tool_calls"]]
        out.append(message)
    return out


def write_json(value):
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8", delete=False) as f:
        json.dump(value, f, ensure_ascii=False)
        return f.name


def ringlm_render(tool, template_path, conversation, bos, eos, tools=None):
    messages_path = write_json(as_openai(conversation))
    tools_path = write_json(tools) if tools else None
    try:
        result = subprocess.run([tool, template_path, messages_path, "--bos", bos, "--eos", eos,
                                 "--date", RENDER_DATE.strftime("%Y-%m-%d")] +
                                (["--tools", tools_path] if tools_path else []), capture_output=True, timeout=60)
    finally:
        os.unlink(messages_path)
        if tools_path:
            os.unlink(tools_path)
    if result.returncode != 0:
        raise RuntimeError(f"{tool} failed ({result.returncode}): {result.stderr.decode(errors='replace')}")
    return json.loads(result.stdout.decode("utf-8"))


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def expect_same(what, jinja_text, ringlm_text):
    if jinja_text != ringlm_text:
        at = first_difference(jinja_text, ringlm_text)
        raise AssertionError(f"{what}: ringlm differs from jinja2 at character {at}\n"
                             f"  jinja2: {jinja_text!r}\n  ringlm: {ringlm_text!r}\n"
                             f"  from there: jinja2 {jinja_text[at:at + 40]!r}"
                             f" / ringlm {ringlm_text[at:at + 40]!r}")


def check_template(tool, path, spec):
    """Returns (compared, skipped) counts; raises AssertionError on a mismatch."""
    name = os.path.basename(path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    compared = skipped = 0
    for label, conversation in CONVERSATIONS.items():
        tool_conversation = conversation
        if spec.get("default_system") and not has_system(conversation):
            tool_conversation = [msg("system", spec["default_system"])] + conversation
        out = ringlm_render(tool, path, tool_conversation, spec["bos"], spec["eos"])
        if out["format"] != spec["format"]:
            raise AssertionError(f"{name}: recognised as {out['format']!r}, expected {spec['format']!r}")
        expected_default = spec.get("default_system", "")
        if out["default_system_prompt"] != expected_default:
            raise AssertionError(f"{name}: default system prompt {out['default_system_prompt']!r}, "
                                 f"expected {expected_default!r}")
        reason = spec.get("skip", skip_never)(conversation)
        if reason:
            print(f"  skip   {name} [{label}]: {reason}")
            skipped += 1
            continue
        jinja_text = jinja_render(source, conversation, spec["bos"], spec["eos"])
        ringlm_text = (spec["bos"] if out["starts_with_bos"] else "") + out["text"]
        expect_same(f"{name} [{label}]", jinja_text, ringlm_text)
        print(f"  ok     {name} [{label}]")
        compared += 1
    for label, conversation in TOOL_CONVERSATIONS.items():
        tool_conversation = conversation
        if spec.get("default_system") and not has_system(conversation):
            tool_conversation = [msg("system", spec["default_system"])] + conversation
        reason = (spec.get("skip", skip_never)(conversation) or
                  (skip_one_call_per_message(conversation) if spec.get("tools") in ("llama3", "harmony") else None))
        if reason:
            print(f"  skip   {name} [{label}]: {reason}")
            skipped += 1
            continue
        out = ringlm_render(tool, path, tool_conversation, spec["bos"], spec["eos"], TOOLS)
        if not spec.get("tools"):  # ringlm's own: the tools described in the system message
            missing = [t["function"]["name"] for t in TOOLS if t["function"]["name"] not in out["text"]]
            if missing or "<tool_call>" not in out["text"]:
                raise AssertionError(f"{name} [{label}]: ringlm's rendering does not describe the tools: {out['text']!r}")
            print(f"  ok     {name} [{label}] (ringlm's own tool prompt)")
            compared += 1
            continue
        jinja_text = jinja_render(source, conversation, spec["bos"], spec["eos"], TOOLS)
        ringlm_text = (spec["bos"] if out["starts_with_bos"] else "") + out["text"]
        expect_same(f"{name} [{label}]", jinja_text, ringlm_text)
        print(f"  ok     {name} [{label}]")
        compared += 1
    return compared, skipped


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tool", required=True, help="path of ringlm_chat_render")
    parser.add_argument("--shared-data", required=True, help="the shared data folder (has chat-templates/)")
    parser.add_argument("--templates", default=os.path.join(HERE, "chat_templates"),
                        help="folder of the extra templates (default: chat_templates/ beside this script)")
    args = parser.parse_args()

    folders = [os.path.join(args.shared_data, "chat-templates"), args.templates]
    paths = sorted(os.path.join(folder, name) for folder in folders for name in os.listdir(folder)
                   if name.endswith(".jinja"))
    unknown = [os.path.basename(p) for p in paths if os.path.basename(p) not in TEMPLATES]
    missing = set(TEMPLATES) - {os.path.basename(p) for p in paths}
    if unknown or missing:
        print(f"FAIL: templates without an expectation here: {unknown}; expected but not found: {sorted(missing)}")
        return 1
    total_compared = total_skipped = 0
    try:
        for path in paths:
            compared, skipped = check_template(args.tool, path, TEMPLATES[os.path.basename(path)])
            total_compared += compared
            total_skipped += skipped
    except (AssertionError, RuntimeError, jinja2.exceptions.TemplateError) as e:
        print(f"FAIL: {e}")
        return 1
    print(f"OK: {len(paths)} templates, {total_compared} renderings identical to jinja2 (or, with tools for a template "
          f"that has none, ringlm's own tool prompt written), {total_skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Write a tiny llama GGUF whose greedy continuation is a given chain of tokens: a scripted model.

    make_scripted_gguf.py OUT.gguf --spec tests/data/scripted_harmony.json --chat-template T.jinja

The spec (JSON) names the vocabulary's special tokens ("special", control tokens; "bos", "eos")
and the chain: "chain"[0] is the token a prompt ends with, and after each token of the chain the
model's most likely next token is the one after it in the chain, by a wide margin (greedy
decoding follows it exactly, on the int8 path too). Chain tokens must be distinct (the model
sees only the last token); those that are not special become tokens of a byte-level BPE
vocabulary (GPT-2's byte characters, the 256 bytes first) with merges that build each of them
left to right, the earlier chain tokens at the lower ranks, so a prompt that ends with the text
of chain[0] after a special token ends with that token.

How: one layer whose attention and FFN write nothing (their output matrices are zero), so the
final norm sees the last token's embedding; chain token i has the i-th unit vector as its
embedding (every other token zero: all its logits are 0), and the output row of chain token
i + 1 is 10 times that unit vector: its logit is 10 sqrt(n_embd), every other one is 0.
The tokenizer.chat_template is --chat-template's text. Byte-identical output for the same input.
"""
import argparse
import json
import sys

import numpy as np
import gguf


def gpt2_byte_chars():
    """GPT-2's printable character for each byte (its bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--spec", required=True, help="JSON: special, bos, eos, chain")
    parser.add_argument("--chat-template", required=True, help="the Jinja template to store")
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args(argv)

    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    with open(args.chat_template, encoding="utf-8") as f:
        chat_template = f.read()
    special, chain = spec["special"], spec["chain"]
    if len(set(chain)) != len(chain):
        raise SystemExit("the chain's tokens must be distinct")
    if len(chain) - 1 > args.n_embd:
        raise SystemExit(f"a chain of {len(chain)} tokens needs --n-embd {len(chain) - 1} or more")

    byte_chars = gpt2_byte_chars()
    tokens = list(byte_chars)
    merges = []
    for text in chain:
        if text in special:
            continue
        word = "".join(byte_chars[b] for b in text.encode("utf-8"))
        for end in range(2, len(word) + 1):  # prefix[:end-1] + char -> prefix[:end]
            if word[:end] not in tokens:
                tokens.append(word[:end])
                merges.append(f"{word[:end - 1]} {word[end - 1]}")
    n_plain = len(tokens)
    tokens += special
    types = [1] * n_plain + [3] * len(special)  # normal, control
    ids = {t: i for i, t in enumerate(tokens)}

    def token_id(text):
        return ids[text] if text in special else ids["".join(byte_chars[b] for b in text.encode("utf-8"))]

    n_vocab, d, ff, n_head = len(tokens), args.n_embd, 32, 2
    embd = np.zeros((n_vocab, d), np.float32)
    output = np.zeros((n_vocab, d), np.float32)
    for i in range(len(chain) - 1):
        embd[token_id(chain[i]), i] = 1.0
        output[token_id(chain[i + 1]), i] = 10.0

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_string("general.name", "ringlm scripted model")
    w.add_uint32("general.file_type", 0)
    w.add_uint32("llama.vocab_size", n_vocab)
    w.add_uint32("llama.context_length", 4096)
    w.add_uint32("llama.embedding_length", d)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.feed_forward_length", ff)
    w.add_uint32("llama.attention.head_count", n_head)
    w.add_uint32("llama.attention.head_count_kv", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", token_id(spec["bos"]))
    w.add_uint32("tokenizer.ggml.eos_token_id", token_id(spec["eos"]))
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)

    hd = d // n_head
    zeros = np.zeros
    tensors = [("token_embd.weight", embd), ("output_norm.weight", np.ones(d, np.float32)),
               ("output.weight", output),
               ("blk.0.attn_norm.weight", np.ones(d, np.float32)),
               ("blk.0.attn_q.weight", zeros((n_head * hd, d), np.float32)),
               ("blk.0.attn_k.weight", zeros((hd, d), np.float32)),
               ("blk.0.attn_v.weight", zeros((hd, d), np.float32)),
               ("blk.0.attn_output.weight", zeros((d, n_head * hd), np.float32)),
               ("blk.0.ffn_norm.weight", np.ones(d, np.float32)),
               ("blk.0.ffn_gate.weight", zeros((ff, d), np.float32)),
               ("blk.0.ffn_up.weight", zeros((ff, d), np.float32)),
               ("blk.0.ffn_down.weight", zeros((d, ff), np.float32))]
    for name, value in tensors:
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: {n_vocab} tokens, a chain of {len(chain)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The pre-tokenizer oracle: splits texts with every `tokenizer.ggml.pre` regex, in Python.

    pretokenizer_splits.py TEXTS.json

TEXTS.json is a JSON array of strings. Prints one JSON object on stdout:
{"NAME": [[piece, ...] for each text], ...} for every pre-tokenizer name below.

The patterns are written here as the models' tokenizer.json files have them (case-insensitive
contractions as (?i:...), GPT-4o's letter classes, Kimi K2's class intersections, Ling's
possessive quantifiers, the literal characters of the DeepSeek and CJK classes), not copied from
ringlm's table (core/tokenizer/pretokenizer.cpp), which rewrites some of them for PCRE2. The
engine is PyPI's `regex`, which has the Unicode classes (\\p{L}, \\p{Lu}, \\p{Han}, ...). AFMoE's
digit rule is not a regex in llama.cpp but a hand-written loop; it is one here too.

How the patterns apply (Hugging Face's Sequence of Split pre-tokenizers with behavior Isolated,
and llama.cpp's unicode_regex_split): each pattern in turn splits every piece left by the
previous one into its matches and the text between them, seeing only that piece; an empty
match cuts the piece where it is. Known differences with ringlm that the test strings avoid:
(?i) also folds U+017F "ſ" into "s" (ringlm spells contractions out as '[sS]), and this
module's Unicode tables are newer than PCRE2's.
"""
import json
import sys

try:
    import regex
except ImportError:  # pragma: no cover - set-up error
    sys.exit("pretokenizer_splits.py: the Python package 'regex' is missing (scripts/setup.sh installs it)")

CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"

# GPT-2's pattern as tokenizer.json has it, with the final |\s+ that llama.cpp leaves out.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's own default and Falcon's middle pattern: GPT-2's without |\s+.
GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
JAIS2 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
         r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
SEED_CODER = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
MINICPM5 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
              r"|\s*[\r\n]|\s+(?!\S)|\s+")
BAILINGMOE = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (r"[^\r\n\p{L}\p{N}]?" + UPPER + "*" + LOWER + "+" + CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?" + UPPER + "+" + LOWER + "*" + CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + UPPER + "*" + LOWER + "+"
          r"|[^\r\n\p{L}\p{N}]?" + UPPER + "+" + LOWER + "*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
YOUTU_CJK = "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+"
YOUTU = (r"[^\r\n\p{L}\p{N}]?" + UPPER + "*" + LOWER + "+" + CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?" + UPPER + "+" + LOWER + "*" + CONTRACTIONS + "?"
         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2's tiktoken pattern with its class intersections (regex.V1 has them). A bare script
# name in the Rust regex crate under tiktoken means Script_Extensions: \p{scx=Han}.
KIMI_K2 = (r"[\p{scx=Han}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{scx=Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{scx=Han}]]+"
           + CONTRACTIONS + "?"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{scx=Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{scx=Han}]]*"
           + CONTRACTIONS + "?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HAN_KANA = "[一-龥぀-ゟ゠-ヿ]+"
DEEPSEEK3_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                   r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPARK_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
               r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
# The canonically equivalent look-alikes in this class are escaped: an editor or a copy through
# NFC turns U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126 and U+212A into U+03CE, U+03B9, U+0390,
# U+038A, U+03A9 and "K", which would change the ranges.
DEEPSEEK_LETTERS = ("\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
                    "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ"
                    "\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲"
                    "𑢠-𑣟𞤀-𞥃]+")
DEEPSEEK_PUNCT = "\\s?[!-/:-~！-／：-～‘-‟　-。]+"
DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"
BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
AFMOE_SCRIPTS = ("[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
                 "\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
                 "\u1100-\u11ff]+")


def afmoe_digits(piece):
    """AFMoE's digit rule as llama.cpp writes it by hand: a run of \\p{N} characters is cut into
    its first (length mod 3) digits, then groups of three; other text stays as it is."""
    is_digit = regex.compile(r"\p{N}")
    out, i, n = [], 0, len(piece)
    while i < n:
        j = i
        while j < n and not is_digit.match(piece[j]):
            j += 1
        if j > i:
            out.append(piece[i:j])
        k = j
        while k < n and is_digit.match(piece[k]):
            k += 1
        run, first = piece[j:k], (k - j) % 3
        if first:
            out.append(run[:first])
        out.extend(run[m:m + 3] for m in range(first, len(run), 3))
        i = k
    return out


STARCODER = [r"\p{N}", GPT2_NO_TAIL]
DEEPSEEK3 = [r"\p{N}{1,3}", HAN_KANA, DEEPSEEK3_WORDS]
TINY_AYA = [r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O]

# name -> patterns (strings, compiled as VERSION0, or (string, flags), or a function).
PRE_TOKENIZERS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_NO_TAIL, r"\p{N}+", "[0-9][0-9][0-9]"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_NO_TAIL, "[0-9][0-9][0-9]"],
    "deepseek-llm": ["[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCT, r"\s+$", DEEPSEEK_CJK, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
    "spark2_5": [r"\p{N}{1,3}", HAN_KANA, SPARK_WORDS, r"\p{N}"],
    "youtu": [YOUTU_CJK, YOUTU],
    "afmoe": [afmoe_digits, AFMOE_SCRIPTS, DEEPSEEK3_WORDS],
    "kimi-k2": [(KIMI_K2, regex.V1)],
    "minicpm5": [r"\p{N}{1,3}", MINICPM5],
    "jais-2": [JAIS2],
    "qwen35": [QWEN35],
    "ufakzeka": [UFAKZEKA],
    "seed-coder": [SEED_CODER],
    "exaone-moe": [EXAONE_MOE],
    "laguna": [r"[^\n]+|[\n]+", QWEN2],
    "tekken": [TEKKEN],
    "tiny_aya": TINY_AYA,
    "cohere2moe": TINY_AYA,
    "poro-chat": [BLOOM],
    "bloom": [BLOOM],
    "gpt3-finnish": [BLOOM],
    "viking": [BLOOM, r"\p{N}"],
    "chameleon": ["<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", GPT2_NO_TAIL],
    "superbpe": [r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
}
for name in ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
             "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"]:
    PRE_TOKENIZERS[name] = [LLAMA3]
for name in ["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-es", "jina-de",
             "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "a.x-4.0", "mellum",
             "modern-bert"]:
    PRE_TOKENIZERS[name] = [GPT2]
for name in ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"]:
    PRE_TOKENIZERS[name] = STARCODER
for name in ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"]:
    PRE_TOKENIZERS[name] = [QWEN2]
for name in ["bailingmoe", "bailingmoe2", "llada-moe"]:
    PRE_TOKENIZERS[name] = [BAILINGMOE]
for name in ["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"]:
    PRE_TOKENIZERS[name] = DEEPSEEK3
for name in ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2", "granite-embed-multi-97m"]:
    PRE_TOKENIZERS[name] = [GPT4O]


def compile_step(step):
    if callable(step):
        return step
    pattern, flags = step if isinstance(step, tuple) else (step, regex.V0)
    compiled = regex.compile(pattern, flags)

    def split_piece(piece):
        out, prev = [], 0
        for m in compiled.finditer(piece):
            begin, end = m.span()
            if begin > prev:
                out.append(piece[prev:begin])
            if end > begin:
                out.append(piece[begin:end])
            prev = end
        if prev < len(piece):
            out.append(piece[prev:])
        return out

    return split_piece


def split(text, steps):
    pieces = [text] if text else []
    for step in steps:
        pieces = [part for piece in pieces for part in step(piece)]
    return pieces


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: pretokenizer_splits.py TEXTS.json")
    with open(sys.argv[1], encoding="utf-8") as f:
        texts = json.load(f)
    result = {}
    for name, patterns in PRE_TOKENIZERS.items():
        steps = [compile_step(p) for p in patterns]
        result[name] = [split(text, steps) for text in texts]
    json.dump(result, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

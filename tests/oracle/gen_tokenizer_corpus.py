#!/usr/bin/env python3
"""Generates the tokenizer fixtures from Hugging Face tokenizers/transformers.

Run by hand from the repo root (not in CI):

    /work/venv/bin/python tests/oracle/gen_tokenizer_corpus.py [SHARED_DIR]

SHARED_DIR defaults to ../shared.  Writes
- tests/data/tokenizer_corpus.jsonl: {"text" | "utf8_hex", "ids"} for >= 2,000
  varied strings, encoded by the real Qwen3 tokenizer files;
- tests/data/tokenizer_tiny/{pairs,strings}/: a small tokenizer.json (the first
  3,000 merges of Qwen3) with merges in ["a","b"] and "a b" form, and
  tests/data/tokenizer_tiny/cases.jsonl with its ids for some strings.

Two reference tokenizers are built and must agree on everything written:
(a) `tokenizers.Tokenizer` assembled from vocab.json + merges.txt + the added
tokens and the Qwen2 normalizer/pre-tokenizer, and (b) transformers'
AutoTokenizer loaded from the same folder (what diffusers uses).  Before any
corpus is written both must reproduce data/qwen3-tokenizer/golden.jsonl and
oracle/tokenizer_vectors.json.

Strings whose NFC form differs between tokenizers (whose normalisation tables
predate Unicode 10) and utf8proc (the C side, Unicode 15) are left out and
counted: that divergence is documented in models/tokenizer.h.
"""
import ctypes
import json
import os
import random
import sys
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors
import transformers

SHARED = sys.argv[1] if len(sys.argv) > 1 else os.path.join("..", "shared")
TOKDIR = os.path.join(SHARED, "data", "qwen3-tokenizer")
OUT = os.path.join("tests", "data")

# transformers models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX
PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_pipeline(tok):
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)


def read_files():
    with open(os.path.join(TOKDIR, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(TOKDIR, "merges.txt"), encoding="utf-8") as f:
        merges = [tuple(l.split(" ")) for l in f.read().split("\n")
                  if l and not l.startswith("#version")]
    with open(os.path.join(TOKDIR, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    added = sorted((int(i), t) for i, t in config["added_tokens_decoder"].items())
    return vocab, merges, added


def build_tokenizer(vocab, merges, added):
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False, ignore_merges=False))
    qwen2_pipeline(tok)
    for want_id, t in added:
        token = AddedToken(t["content"], special=t["special"], normalized=False,
                           lstrip=False, rstrip=False, single_word=False)
        if t["special"]:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        assert tok.token_to_id(t["content"]) == want_id, t
    return tok


def check_references(enc_a, enc_b):
    cases = []
    with open(os.path.join(TOKDIR, "golden.jsonl"), encoding="utf-8") as f:
        cases += [json.loads(l) for l in f if l.strip()]
    with open(os.path.join(SHARED, "oracle", "tokenizer_vectors.json"), encoding="utf-8") as f:
        vec = json.load(f)
    cases += vec["plain"] + vec["chat"]
    for c in cases:
        for name, enc in (("tokenizers", enc_a), ("transformers", enc_b)):
            got = enc(c["text"])
            assert got == c["ids"], f"{name} disagrees on {c['text']!r}: {got} vs {c['ids']}"
    print(f"both references reproduce {len(cases)} golden/oracle vectors")


def utf8proc_nfc():
    """utf8proc_map(STABLE | COMPOSE) with an explicit length, as the C side calls it."""
    lib = ctypes.CDLL("libutf8proc.so.2")
    libc = ctypes.CDLL("libc.so.6")
    lib.utf8proc_map.restype = ctypes.c_ssize_t
    lib.utf8proc_map.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]

    def nfc(s):
        raw, dst = s.encode("utf-8"), ctypes.c_void_p()
        n = lib.utf8proc_map(raw, len(raw), ctypes.byref(dst), (1 << 1) | (1 << 3))
        assert n >= 0, n
        r = ctypes.string_at(dst, n).decode("utf-8")
        libc.free(dst)
        return r
    return nfc


# ---- the corpus -------------------------------------------------------------

WORDS = ("the a cat dog house river light tower sea boat night over under quick brown fox "
         "jumps lazy photograph portrait of in at with and or but painting watercolor "
         "cinematic lighting golden hour 35mm lens bokeh ultra detailed neon city rain "
         "mountain forest snow castle dragon robot astronaut garden flower bridge").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Re", "'rE",
                "'VE", "'vE", "'M", "'LL", "'lL", "'Ll", "'D", "'x", "'", "''", "'ſ", "\u2019s"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<|vision_start|>", "<|image_pad|>", "<|fim_prefix|>",
            "<tool_response>", "<|box_start|>"]
NEAR_SPECIALS = ["<|im_start", "<|im_start|", "im_start|>", "<|IM_START|>", "<THINK>", "< think>",
                 "<<|im_end|>>", "<|im_end|><|im_end|>", "<think></think>", "<|endoftext|>>",
                 "<|<|im_start|>|>", "</think", "<think", "<|", "|>"]
SCRIPTS = [
    "灯塔在夜晚照亮了大海", "一只猫坐在窗台上看雨", "日本語のテキストです。カタカナとひらがな",
    "한국어 문장입니다", "Привет, мир! Съешь же ещё этих мягких французских булок",
    "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "வணக்கம் உலகம்", "ওহে বিশ্ব", "Xin chào thế giới", "Tiếng Việt có dấu: ắằẳẵặ",
    "ᚠᛇᚻ᛫ᛒᛦᚦ", "ⲘⲈⲦⲢⲈⲘⲚⲔⲎⲘⲈ", "𐌰𐌱𐌲", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "Ελληνικά ΣΊΣΥΦΟΣ",
    "𠀀𠀁𪚥 𰀀𱍐𲎯", "ꓚꓰꓪ", "ܫܠܡܐ", "ᠮᠣᠩᠭᠣᠯ", "ꦧꦱꦗꦮ", "ⴰⵣⵓⵍ", "𞤀𞤁𞤂", "ǅungla ǈj ǋj",
]
EMOJI = ["🌊", "🔥", "👍🏽", "👨‍👩‍👧", "👩🏾‍💻", "🏳️‍🌈", "🇫🇷🇯🇵", "1️⃣", "❤️", "🧑🏻‍🤝‍🧑🏿",
         "👁️‍🗨️", "😀😃😄", "🫠", "🐈‍⬛", "☺︎", "#️⃣", "🏴󠁧󠁢󠁳󠁣󠁴󠁿"]
COMBINING = ["e\u0301", "a\u0301\u0323", "a\u0323\u0301", "o\u0308\u0304", "n\u0303",
             "\u1100\u1161\u11a8", "A\u030a", "\u212b", "\u0041\u0300\u0316", "x\u0338",
             ">\u0338", "=\u0338", "\u0915\u093c", "\u0e01\u0e48\u0e33", "s\u0323\u0307",
             "\u1e9b\u0323", "\u0344", "\u0340", "\u0958", "e\u0301\u0301\u0301", "\u00e9\u0300",
             "\u3099", "か\u3099", "\u0627\u0653", "\u05e9\u05c1\u05bc"]
# Marks from Unicode >= 10: tokenizers' NFC leaves them, utf8proc reorders/composes.
# These are expected to be left out; they show that the filter works.
NFC_DIVERGENT = ["a\u0898\u0334", "\U00011935\U00011930"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\r\n\r\n", " \n", "\n ",
          "  \n  ", " \t \n", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\u2029",
          "\u180e", "\u200b", "\u000b", "\u000c", "\u001c", "\u202f", " \u00a0 "]
PUNCT = ["!!!", "???", "...", "---", "!?", "\"quoted\"", "'single'", "`back`", "(paren)", "[x]",
         "{y}", "#hash", "@at", "$100", "50%", "a&b", "x*y", "~~~", "***", "+-+", "::", ";;",
         "“curly”", "‘x’", "«fr»", "…", "—", "–", "¡hola!", "¿qué?", "!\n", "?\r\n", "...\n\n"]
CODE = [
    "def f(x):\n    return x**2  # square\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (let i = 0; i < n; i++) { arr[i] += i * 2; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"x\">Hello</div>", "{\"key\": [1, 2.5, null, true], \"s\": \"v\"}",
    "$ ls -la /usr/local/bin | grep -v '^d'", "x = [i for i in range(10) if i % 2 == 0]",
    "    indented\n        more\n\tTAB", "```python\nprint('hi')\n```", "a_b_c __init__ CamelCase snake_case",
]
URLS = ["https://example.com/a?b=c&d=e", "http://foo.bar/baz#frag", "ftp://1.2.3.4:21/x",
        "user@example.org", "C:\\Users\\me\\file.txt", "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "www.test-site.co.uk/path_to/page.html?q=a+b", "mailto:someone@x.io"]
NUMBERS = ["0", "7", "42", "1234567890", "3.14159", "-42", "1e-10", "1,000,000", "0x1F",
           "２０２４年", "٣٤٥", "१२३", "²³", "½¾", "Ⅻ", "①②③", "1st 2nd 3rd", "v1.2.3", "10:30pm",
           "9" * 64, "12" * 100]


def rand_word(r):
    w = r.choice(WORDS)
    return r.choice([w, w.capitalize(), w.upper()])


def rand_sentence(r, n):
    parts = []
    for _ in range(n):
        k = r.random()
        if k < 0.55:
            parts.append(rand_word(r))
        elif k < 0.62:
            parts.append(r.choice(NUMBERS))
        elif k < 0.69:
            parts.append(r.choice(PUNCT))
        elif k < 0.74:
            parts.append(rand_word(r) + r.choice(CONTRACTIONS))
        elif k < 0.79:
            parts.append(r.choice(EMOJI))
        elif k < 0.84:
            parts.append(r.choice(SCRIPTS))
        elif k < 0.88:
            parts.append(r.choice(COMBINING))
        elif k < 0.91:
            parts.append(r.choice(SPECIALS + NEAR_SPECIALS))
        elif k < 0.94:
            parts.append(r.choice(URLS))
        else:
            parts.append(r.choice(SPACES))
        parts.append(r.choice([" "] * 8 + SPACES + [""]))
    return "".join(parts).rstrip(" ") if r.random() < 0.7 else "".join(parts)


ASSIGNED = [c for c in range(0x110000)
            if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"]


def rand_unicode(r, n, assigned_only):
    out = []
    for _ in range(n):
        if assigned_only:
            out.append(chr(r.choice(ASSIGNED)))
        else:
            c = r.randrange(0x110000 - 0x800)
            out.append(chr(c + 0x800 if c >= 0xD800 else c))
    return "".join(out)


def rand_bmp_mix(r, n):
    """Characters from blocks where pre-tokenizer classes change often."""
    pools = [(0x20, 0x7f), (0xa0, 0x250), (0x300, 0x370), (0x370, 0x530), (0x2000, 0x2070),
             (0x3000, 0x3040), (0xff00, 0xffef), (0x1f300, 0x1f64f), (0x0600, 0x0700),
             (0x0900, 0x0980), (0x1100, 0x1200), (0x4e00, 0x4e80), (0xac00, 0xac80), (0, 0x20)]
    out = []
    for _ in range(n):
        lo, hi = r.choice(pools)
        out.append(chr(r.randrange(lo, hi)))
    return "".join(out)


def corpus(r):
    items = []
    # Each fixed list verbatim and in small combinations.
    for group in (CONTRACTIONS, SPECIALS, NEAR_SPECIALS, SCRIPTS, EMOJI, COMBINING, SPACES, PUNCT,
                  CODE, URLS, NUMBERS):
        items += group
        items += [a + b for a in group[:8] for b in group[:8]]
    for c in CONTRACTIONS:  # contractions after words, spaces, digits, at the start
        items += [f"it{c}", f"IT{c} ok", f" {c}", f"{c}", f"7{c}", f"dog{c}{c}", f"{c}s"]
    for s in SPACES:  # whitespace in every position
        items += [f"{s}x", f"x{s}", f"x{s}y", f"{s}", f"x{s}{s}y", f"!{s}", f"{s}!", f"7{s}8",
                  f"<|im_end|>{s}", f"{s}<|im_end|>", f"a{s}<think>{s}b"]
    for s in SPECIALS:
        items += [f"hello{s}world", f" {s} ", f"{s}\n", f"\u00e9{s}\u0301", f"{s}{s}", f"x{s}'s"]
    items += [" " * n for n in (1, 2, 3, 5, 8, 17, 64)]
    items += ["\n" * n for n in (1, 2, 3, 7)] + ["\t" * n for n in (1, 2, 9)]
    items += [" " * n + "word" + " " * m for n in (0, 1, 2, 4) for m in (0, 1, 2, 4)]
    for _ in range(700):
        items.append(rand_sentence(r, r.randint(1, 25)))
    for _ in range(250):
        items.append(rand_unicode(r, r.randint(1, 40), assigned_only=True))
    for _ in range(150):
        items.append(rand_unicode(r, r.randint(1, 20), assigned_only=False))
    for _ in range(250):
        items.append(rand_bmp_mix(r, r.randint(1, 40)))
    items += NFC_DIVERGENT
    # A NUL byte (written as utf8_hex: C JSON parsers stop strings at \u0000).
    items += ["a\x00b", "\x00", " \x00 x\x00\x00"]
    # Very long inputs: several 10k+ character strings of different kinds.
    items.append(" ".join(rand_sentence(r, 12) for _ in range(150))[:20000])
    items.append("".join(r.choice(SCRIPTS[:3]) for _ in range(1200))[:12000])  # one CJK pre-token
    items.append("".join(str(r.randrange(10)) for _ in range(10000)))
    items.append(" " * 10000 + "x" + "\n" * 3000)
    items.append(rand_unicode(r, 10500, assigned_only=True))
    items.append("".join(r.choice(EMOJI) for _ in range(3000)))
    items.append("a" * 15000)
    # Long runs of marks of many combining classes (canonical reordering at scale).
    marks = "\u0301\u0323\u0334\u0345\u05b0\u0e48\u0300\u0316\u031b\u0327\u302a\u3099"
    for _ in range(40):
        items.append(r.choice("aeoAEOsx>\u3042") +
                     "".join(r.choice(marks) for _ in range(r.randint(2, 60))))
    items.append("e" + "".join(r.choice(marks) for _ in range(20000)))
    seen, out = set(), []
    for s in items:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def entry(text, ids):
    if "\x00" in text:
        return {"utf8_hex": text.encode("utf-8").hex(), "ids": ids}
    return {"text": text, "ids": ids}


def tiny_fixtures(vocab, merges, added, texts):
    """A 3,256-token tokenizer.json: merges in pair and in string form."""
    small_merges = merges[:3000]
    small_vocab = {t: i for t, i in vocab.items() if i < 256 + len(small_merges)}
    tok = Tokenizer(models.BPE(vocab=small_vocab, merges=small_merges))
    qwen2_pipeline(tok)
    tok.add_special_tokens([AddedToken(t["content"], special=True, normalized=False)
                            for _, t in added if t["special"]])
    tok.add_tokens([AddedToken(t["content"], special=False, normalized=False)
                    for _, t in added if not t["special"]])
    base = os.path.join(OUT, "tokenizer_tiny")
    os.makedirs(os.path.join(base, "pairs"), exist_ok=True)
    os.makedirs(os.path.join(base, "strings"), exist_ok=True)
    doc = json.loads(tok.to_str())
    assert isinstance(doc["model"]["merges"][0], list), "tokenizers now writes pairs"
    with open(os.path.join(base, "pairs", "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    with open(os.path.join(base, "pairs", "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"}, f)
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    text = json.dumps(doc, ensure_ascii=False)
    with open(os.path.join(base, "strings", "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    again = Tokenizer.from_str(text)
    rows = []
    for s in texts:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert again.encode(s, add_special_tokens=False).ids == ids
        rows.append(entry(s, ids))
    write_jsonl(os.path.join(base, "cases.jsonl"), rows)
    print(f"wrote {base}: {len(small_vocab)} tokens, {len(small_merges)} merges, {len(rows)} cases")


def main():
    vocab, merges, added = read_files()
    tok_a = build_tokenizer(vocab, merges, added)
    tok_b = transformers.AutoTokenizer.from_pretrained(TOKDIR)

    def enc_a(s):
        return tok_a.encode(s, add_special_tokens=False).ids

    def enc_b(s):
        return tok_b(s)["input_ids"]  # as diffusers calls it

    check_references(enc_a, enc_b)
    nfc_c, nfc_hf = utf8proc_nfc(), normalizers.NFC()
    rows, skipped = [], []
    for s in corpus(random.Random(20240611)):
        ids = enc_a(s)
        assert enc_b(s) == ids, f"tokenizers and transformers disagree on {s!r}"
        if nfc_hf.normalize_str(s) != nfc_c(s):
            skipped.append(s)
            continue
        rows.append(entry(s, ids))
    assert len(rows) >= 2000, len(rows)
    path = os.path.join(OUT, "tokenizer_corpus.jsonl")
    write_jsonl(path, rows)
    print(f"wrote {path}: {len(rows)} strings, {os.path.getsize(path)} bytes; "
          f"{len(skipped)} left out for the NFC divergence")
    for s in skipped:
        print("  NFC differs:", ascii(s[:60]))
    tiny_fixtures(vocab, merges, added, [json_row["text"] if "text" in json_row else
                                         bytes.fromhex(json_row["utf8_hex"]).decode()
                                         for json_row in rows[:400]])


if __name__ == "__main__":
    main()

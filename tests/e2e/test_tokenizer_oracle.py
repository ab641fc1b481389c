#!/usr/bin/env python3
"""Oracle parity of the tokenizer: `shoal tokenize` against tiktoken.

The oracle is the `tiktoken` package (tools/requirements.txt pins 0.14.0)
constructed as K3's tokenization_kimi.py constructs it: the K3 pattern (SPEC
§5.2, tiktoken's own fancy-regex syntax with `&&`), the mergeable ranks of the
model's tiktoken.model, and the special tokens of its tokenizer_config.json
plus "<|reserved_token_ID|>" for the unnamed reserved ids; and it is called as
tokenization_kimi.py's encode calls it: the text cut every 400,000 characters
and before runs of more than 25,000 (non-)white-space characters, each part
encoded with allowed_special="all" (allow) or disallowed_special=() (not).
Bytes that are not UTF-8 are decoded with errors="replace" first (our defined
behaviour: U+FFFD per maximal invalid subpart).

The corpus is generated here (seeded, so every run makes the same bytes) and
kept in $SHOAL_BUILD/tok_oracle/ for inspection: CJK/Han mixed with Latin, kana
and Hangul, emoji ZWJ sequences, skin tones, flags and keycaps, accents precomposed
and with combining marks, Indic and Thai and Arabic marks, contractions in mixed
case (and with U+017F), digit runs of every length and script, white-space runs
(tabs, NBSP, ideographic space, U+0085, U+2028, U+180E, U+001C..U+001F, CRLF, runs
over 25,000), non-white-space runs over 25,000, a text over 400,000 characters,
literal special-token strings, and invalid UTF-8. Each document is checked with
special tokens allowed and not allowed, and the oracle's ids are decoded back by
`shoal detokenize` (including id sequences that split code points).

On K3's real vocabulary (../shared/k3 beside the checkout, or
SHOAL_K3_TOKENIZER_DIR; checked against SPEC §5.1's size and sha256) the same
corpus runs again, and then a large one (bulk_corpus: the Python standard
library's sources, seeded generated documents of every kind, long runs):
SHOAL_TOK_ORACLE_MB megabytes, 10 by default (CI too: the whole test is ~22 s of
CPU), more for a longer run (docs/TESTING.md). Without the real vocabulary those cases are SKIPPED.

The oracle itself (pattern, splitting, special tokens) is tools/k3_oracle.py.
"""
import base64
import hashlib
import json
import os
import random
import subprocess
import sys

SRC = os.environ.get("SHOAL_SRC", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
RESULTS = os.environ.get("SHOAL_TEST_RESULTS")
NAME = "test_tokenizer_oracle"
K3_SIZE = 2795286
K3_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"

counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def record(status, case, reason=None):
    counts[status] += 1
    line = f"{status}\t{NAME}\t{case}" + (f": {reason}" if reason else "")
    print(line.replace("\t", " "), flush=True)
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(line + "\n")


try:
    import tiktoken
except ImportError as e:  # the venv lacks it: a broken setup, not a skip
    record("FAIL", "import_tiktoken", str(e))
    sys.exit(1)

sys.path.insert(0, os.path.join(SRC, "tools"))
import k3_oracle  # noqa: E402  (the pattern, the kimi split; written from SPEC §5)

K3_PAT_STR = k3_oracle.K3_PAT_STR
kimi_split = k3_oracle.split_runs


def load_oracle(model_dir):
    tok = k3_oracle.KimiTokenizer(model_dir)
    return tok.enc, sorted(tok.names.values())


def oracle_encode(enc, data, allow):
    """tokenization_kimi.py's encode(text, allow_special_tokens=allow) on bytes
    decoded with errors="replace": every 400,000 characters, then before runs of
    more than 25,000 (non-)white-space characters, each part encoded with
    allowed_special="all" or disallowed_special=()."""
    text = data.decode("utf-8", errors="replace")
    out = []
    for part in k3_oracle.kimi_parts(text):
        if allow:
            out += enc.encode(part, allowed_special="all")
        else:
            out += enc.encode(part, disallowed_special=())
    return out


# ------------------------------------------------------------------ corpus --

LATIN = ["the", "The", "THE", "quick", "Brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "façade",
         "Ærøskøbing", "straße", "İstanbul", "ǅemal", "ǈ", "x", "McDonald", "iPhone", "URL", "HTTPServer",
         "résumé", "coöperate", "Ωmega", "μ", "ﬁne", "ﬀ"]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'m", "'M", "'ll", "'LL",
                "'lL", "'d", "'D", "'ſ", "\u2019s", "'x", "''s", "'"]
HAN = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切陈欢云须"
HAN_RARE = "\U00020000\U0002A6D6\U0002B739\U0002EBF0\U00031350\U000323AF\u3400\u4DBF\u3007\u3005\u2E80\u2F00\uF900"
KANA = "ひらがなカタカナーゃゅょッ゛゜ｱｲｳ"
HANGUL = "한국어 조선말 각"
EMOJI = ["🦉", "😀", "👍🏽", "👍🏿", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🇫🇷", "🇯🇵", "1️⃣", "#️⃣", "❤️", "☺", "🫠",
         "\U0001FAE8", "🧑🏻‍🤝‍🧑🏿", "👁‍🗨"]
MARKS = ["e\u0301", "a\u0308\u0301", "n\u0303", "\u0301", "Z\u0351\u0352\u0353\u0354\u0355", "हिन्दी", "क्षत्रिय",
         "ไทย", "ภาษา", "العَرَبِيَّة", "עִבְרִית", "가", "\u200d", "\u200c", "ㅤ", "\ufe0f", "a\u20dd",
         "\U00010D69", "\u0897", "Ỷ", "ự"]
DIGITS = ["7", "42", "123", "1234", "12345678901234567890", "١٢٣٤", "۱۲۳", "१२३", "１２３４", "²³", "½", "Ⅻ",
          "〇〇〇〇", "𝟘𝟙𝟚", "3.14159", "1,000,000", "0x1F", "v2.0.1", "2024-06-01"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", "\r", "\n\r", "\u00a0", "\u3000",
          "\u2028", "\u2029", "\u0085", "\u180e", "\u2009", "\u200b", "\x1c", "\x1f", "\x0b", "\x0c", " \n ", "\t \n"]
PUNCT = [".", ",", "!", "?", "...", "—", "–", "«»", "“", "”", "'", "\"", "(", ")", "[", "]", "{", "}", "<", ">",
         "->", "=>", "::", "#", "@", "$", "%", "^", "&&", "||", "//", "/*", "*/", "、", "。", "「」", "！",
         "\u00ad", "\x00", "\x07", "\x7f", "\ue000", "\U000f0000", "\ufffd", "\ufdd0", "\U0010ffff"]
CODE = ["def f(x):\n    return x**2\n", "int main(void) { return 0; }\r\n", "for (i=0;i<n;i++) a[i]+=b[i];",
        "https://example.com/a?b=c&d=e#f", "user@example.org", "{\"key\": [1, 2.5e-3, null, true]}",
        "SELECT * FROM t WHERE id=42;", "    indented\n\tline\n", "<div class=\"x\">&amp;</div>",
        "aGVsbG8gd29ybGQ=" * 3]


def specials_for(names):
    return names + ["<|reserved_token_3900|>", "<|reserved_token_163600|>", "<|open|", "<|sep|>>", "<<|close|>",
                    "[BOS", "[EOS]]", "<|end_of_msg|><|end_of_msg|>"]


def random_cp(r):
    while True:
        c = r.randrange(0x110000) if r.random() < 0.3 else r.randrange(0x3000)
        if not 0xD800 <= c < 0xE000:
            return chr(c)


INVALID = [b"\xff", b"\xfe", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf",
           b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\x80", b"\xbf\x80", b"\xe4\xbd", b"\xf0\x9f\xa6",
           b"\xc3", b"\xe2\x82", b"\xf8\x88\x80\x80\x80", b"\xa0\xa1"]


def document(r, kind, names, size):
    parts = []
    n = 0
    while n < size:
        k = kind if kind != "mixed" else r.choice(["latin", "cjk", "emoji", "marks", "digits", "space",
                                                    "punct", "code", "special", "random", "invalid"])
        if k == "latin":
            w = r.choice(LATIN)
            if r.random() < 0.3:
                w += r.choice(CONTRACTIONS)
            s = w + r.choice([" ", " ", "", ", ", ". ", "\n"])
        elif k == "cjk":
            s = "".join(r.choice(HAN) for _ in range(r.randint(1, 8)))
            s += r.choice(["", " ", "，", "。", r.choice(LATIN), r.choice(KANA), r.choice(HANGUL),
                           r.choice(HAN_RARE), " " + r.choice(LATIN) + " "])
        elif k == "emoji":
            s = r.choice(EMOJI) * r.randint(1, 3) + r.choice(["", " ", r.choice(LATIN)])
        elif k == "marks":
            s = r.choice(MARKS) + r.choice(["", " ", r.choice(LATIN)])
        elif k == "digits":
            s = r.choice(DIGITS) + r.choice(["", " ", "x", r.choice(HAN), ","])
        elif k == "space":
            s = "".join(r.choice(SPACES) for _ in range(r.randint(1, 6))) + r.choice(["", "a", "Word", "中", "1"])
        elif k == "punct":
            s = "".join(r.choice(PUNCT) for _ in range(r.randint(1, 4))) + r.choice(["", " ", "\n", "\r\n", "a"])
        elif k == "code":
            s = r.choice(CODE)
        elif k == "special":
            s = r.choice(specials_for(names)) + r.choice(["", " ", "x", "\n"])
        elif k == "random":
            s = "".join(random_cp(r) for _ in range(r.randint(1, 10)))
        else:
            parts.append(r.choice(INVALID))
            n += 2
            continue
        b = s.encode("utf-8", errors="surrogatepass")
        parts.append(b)
        n += len(b)
    return b"".join(parts)


def make_corpus(names):
    r = random.Random(20260522)
    docs = {}
    for kind in ["latin", "cjk", "emoji", "marks", "digits", "space", "punct", "code", "special", "random"]:
        docs[kind] = document(r, kind, names, 6000)
    for i in range(24):
        docs[f"mixed{i:02d}"] = document(r, "mixed", names, 12000)
    # long runs: exactly at, just over and well over 25,000; whitespace kinds; the 400,000 boundary
    docs["ws_run_25000"] = b"a" + b" " * 25000 + b"b"
    docs["ws_run_25001"] = b"a" + b" " * 25001 + b"b"
    docs["ws_run_mixed_60000"] = b"x" + ("\t \n\u3000\r\n" * 12000).encode() + b"y"
    docs["nonws_run_30000"] = b"start " + b"a" * 30000 + b" end"
    docs["nonws_run_mixed_80000"] = ("Ab1!中é" * 13334).encode()
    docs["nonws_run_punct_26000"] = b"!" * 26000
    docs["han_run_30000"] = ("中文" * 15000).encode()
    docs["digits_run_50001"] = b"9" * 50001
    docs["isspace_not_regex_space"] = ("a" + "\x1c" * 25010 + "b").encode()
    long_doc = document(r, "mixed", names, 1_300_000)
    docs["over_400000_chars"] = long_doc
    docs["word_on_400000_boundary"] = b"a" * 399_998 + b"boundary word" + b" tail"
    docs["special_on_400000_boundary"] = b"b" * 399_995 + b"<|open|>" + b" tail"
    docs["empty"] = b""
    docs["crlf_only"] = b"\r\n" * 100 + b"\r" * 7 + b"\n" * 9
    return docs


def bulk_corpus(names, mb):
    """The large corpus of the real-vocabulary run (issue 24): `mb` MB (10**6
    bytes) in documents of about 1 MB, made at test time and never committed --
    the Python standard library's sources of this machine (/usr/lib/python3*,
    present on every Debian with python3: code, English docstrings and comments;
    sorted, so the same files on the same Python), then seeded generated
    documents of each kind in turn (prose, CJK, emoji and ZWJ sequences,
    combining marks, digits, white space, code, mixed with invalid UTF-8),
    and long runs over 25,000 characters of several kinds."""
    import glob
    budget = mb * 1_000_000
    docs, total = {}, 0
    runs = {
        "bulk_ws_run_100000": ("a" + "\t \u3000\u00a0\n" * 20000 + "b").encode(),
        "bulk_zwj_run_70000": ("👨‍👩‍👧‍👦" * 10000).encode(),
        "bulk_marks_run_30001": ("e" + "\u0301" * 30000 + " end").encode(),
        "bulk_digits_run_60000": ("1234567890" * 6000).encode(),
        "bulk_cjk_emoji_run_52000": ("中文🦉" * 17334).encode(),
        "bulk_punct_ws_alternating": ((" " * 24999 + "!" * 25001) * 4).encode(),
    }
    for k, v in runs.items():
        docs[k] = v
        total += len(v)
    pys = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    buf, part = bytearray(), 0
    for path in pys:
        if total + len(buf) >= budget * 0.4:
            break
        try:
            with open(path, "rb") as f:
                buf += f.read()
        except OSError:
            continue
        if len(buf) >= 1_000_000:
            docs[f"bulk_stdlib_{part:02d}"] = bytes(buf)
            total += len(buf)
            buf, part = bytearray(), part + 1
    if buf:
        docs[f"bulk_stdlib_{part:02d}"] = bytes(buf)
        total += len(buf)
    r = random.Random(20260524)
    kinds = ["mixed", "latin", "cjk", "emoji", "marks", "digits", "space", "code", "mixed", "random"]
    i = 0
    while total < budget:
        kind = kinds[i % len(kinds)]
        d = document(r, kind, names, min(500_000, budget - total))
        docs[f"bulk_{kind}_{i:02d}"] = d
        total += len(d)
        i += 1
    return docs


# ------------------------------------------------------------------- runs --

def shoal_tokenize(model, path, allow):
    cmd = [BIN, "tokenize", "--model", model] + (["--allow-special"] if allow else []) + ["--file", path]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr.decode(errors='replace')[:300]}")
    out = p.stdout.decode().strip()
    return [int(x) for x in out.split(",")] if out else []


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_corpus(label, model, enc, docs, keep):
    for name, data in docs.items():
        path = os.path.join(keep, name + ".txt")
        with open(path, "wb") as f:
            f.write(data)
        for allow in (0, 1):
            case = f"{label}/{name}/{'allow' if allow else 'plain'}"
            try:
                want = oracle_encode(enc, data, allow)
                got = shoal_tokenize(model, path, allow)
            except Exception as e:  # noqa: BLE001 - reported as the case's failure
                record("FAIL", case, str(e))
                continue
            if got == want:
                record("PASS", case, f"{len(data)} bytes, {len(got)} ids")
            else:
                i = first_diff(got, want)
                record("FAIL", case, f"first difference at id {i}: shoal {got[i:i + 5]} oracle {want[i:i + 5]} "
                                     f"(lengths {len(got)}, {len(want)}); corpus kept in {path}")


def run_detokenize(label, model, enc, docs):
    r = random.Random(7)
    n_vocab = enc.n_vocab
    seqs = {}
    for name in ["mixed00", "emoji", "marks", "special"]:
        seqs["doc_" + name] = oracle_encode(enc, docs[name], 1)
    # id sequences that split code points and produce invalid UTF-8
    single_high = [enc.encode_single_token(bytes([b])) for b in range(0x80, 0x100)]
    for i in range(20):
        seqs[f"random{i:02d}"] = [r.choice(single_high) if r.random() < 0.5 else r.randrange(n_vocab)
                                  for _ in range(r.randint(1, 200))]
    for name, ids in seqs.items():
        case = f"{label}/detokenize/{name}"
        want = enc.decode(ids, errors="replace").encode("utf-8", errors="surrogatepass")
        p = subprocess.run([BIN, "detokenize", "--model", model, ",".join(map(str, ids)) or ","],
                           capture_output=True, timeout=60)
        got = p.stdout[:-1] if p.stdout.endswith(b"\n") else p.stdout
        if p.returncode == 0 and got == want:
            record("PASS", case, f"{len(ids)} ids")
        else:
            record("FAIL", case, f"exit {p.returncode}, {len(got)} bytes vs {len(want)}: {p.stderr[:200]!r}")


def main():
    keep = os.path.join(BUILD, "tok_oracle")
    os.makedirs(keep, exist_ok=True)
    tiny = os.path.join(SRC, "tests", "models", "tiny-k3")
    if not os.access(BIN, os.X_OK):
        record("FAIL", "binary", f"{BIN} not built")
        return 1
    enc, names = load_oracle(tiny)
    docs = make_corpus(names)
    run_corpus("tiny-k3", tiny, enc, docs, keep)
    run_detokenize("tiny-k3", tiny, enc, docs)

    real = os.environ.get("SHOAL_K3_TOKENIZER_DIR")
    if not real:  # the shared copy beside the checkout, as the C tests find it (tests/unit/test.h)
        shared = os.path.join(os.environ.get("SHOAL_SRC", "."), "..", "shared", "k3")
        real = shared if os.path.exists(os.path.join(shared, "tiktoken.model")) else None
    if not real:
        record("SKIP", "real-k3/corpus", "no ../shared/k3/tiktoken.model beside the checkout; set "
                                         "SHOAL_K3_TOKENIZER_DIR to a directory with K3's tiktoken.model "
                                         "and tokenizer_config.json")
    else:
        path = os.path.join(real, "tiktoken.model")
        data = open(path, "rb").read()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != K3_SIZE or digest != K3_SHA256:
            record("FAIL", "real-k3/identity", f"{path}: {len(data)} bytes, sha256 {digest}; SPEC §5.1 says "
                                               f"{K3_SIZE} bytes, {K3_SHA256}")
        else:
            record("PASS", "real-k3/identity")
            renc, rnames = load_oracle(real)
            run_corpus("real-k3", real, renc, make_corpus(rnames), keep)
            # SHOAL_TOK_ORACLE_MB: the size of the large corpus (default 10, the
            # issue's floor, ~4 s of CPU; more for a longer run, docs/TESTING.md)
            mb = float(os.environ.get("SHOAL_TOK_ORACLE_MB", "10"))
            if mb > 0:
                bulk = bulk_corpus(rnames, mb)
                failed = counts["FAIL"]
                run_corpus("real-k3", real, renc, bulk, keep)
                record("PASS" if counts["FAIL"] == failed else "FAIL", "real-k3/bulk_total",
                       f"{sum(len(d) for d in bulk.values())} bytes in {len(bulk)} documents, x2 (specials "
                       f"allowed and not)")
            run_detokenize("real-k3", real, renc, docs)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if counts["FAIL"]:
        return 1
    return 77 if counts["PASS"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

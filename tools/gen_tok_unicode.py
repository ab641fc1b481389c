#!/usr/bin/env python3
"""Generates the Unicode class data of the K3 pre-tokenizer (SPEC §5.2).

    python3 tools/gen_tok_unicode.py        # needs tiktoken (tools/requirements.txt)

Why: the oracle is tiktoken, whose pattern engine (Rust fancy-regex/regex)
carries its own Unicode tables, while the C tokenizer runs the pattern with
PCRE2 from Debian 12 (10.42, Unicode 14.0.0). The two disagree on a few
thousand code points (characters added after Unicode 14, PCRE2's \\p{Han}
meaning Script_Extensions, U+180E in PCRE2's \\s). This script measures both
on every code point and writes:

  coordinator/text/tokenizer_uni.h
      for each property the pattern uses, the code point ranges the oracle
      puts in the class and PCRE2's property lacks ("add" ranges, appended
      inside the class), for the PCRE2 Unicode version measured here; the
      tokenizer refuses to load with any other PCRE2 Unicode version.
      White space is written out in full (the oracle's \\s, not PCRE2's).
  tests/fixtures/tokenizer/unicode_classes.tsv
      the oracle's membership (ranges) of every class as the pattern uses it,
      and Python's str.isspace (the long-run splitter of tokenization_kimi.py);
      the unit test checks the compiled C classes against it, code point by
      code point.

The oracle side: a tiktoken Encoding whose pattern is the class alone and
whose vocabulary is the 256 single bytes; tiktoken encodes only what the
pattern matches, so decoding the ids of "every code point" gives the members.
"""
import ctypes
import ctypes.util
import os
import sys

import tiktoken

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# class name -> (oracle pattern, PCRE2 base property or None for explicit)
BASE = {
    "Han": (r"[\p{Han}]", r"\p{sc:Han}"),
    "L": (r"\p{L}", r"\p{L}"),
    "N": (r"\p{N}", r"\p{N}"),
    "Lu": (r"\p{Lu}", r"\p{Lu}"),
    "Lt": (r"\p{Lt}", r"\p{Lt}"),
    "Ll": (r"\p{Ll}", r"\p{Ll}"),
    "Lm": (r"\p{Lm}", r"\p{Lm}"),
    "Lo": (r"\p{Lo}", r"\p{Lo}"),
    "M": (r"\p{M}", r"\p{M}"),
    "WS": (r"\s", None),
}
# the classes exactly as the pattern uses them (oracle syntax), for the fixture
COMPOSITE = {
    "Han": r"[\p{Han}]",
    "UPPER": r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]",
    "LOWER": r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]",
    "PREFIX": r"[^\r\n\p{L}\p{N}]",
    "N": r"\p{N}",
    "PUNCT": r"[^\s\p{L}\p{N}]",
    "WS": r"\s",
    "NOTWS": r"\S",
    "CRLF": r"[\r\n]",
}

ALL = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
BYTES = {bytes([i]): i for i in range(256)}


def oracle_set(pat):
    enc = tiktoken.Encoding(name="probe", pat_str=pat, mergeable_ranks=BYTES, special_tokens={})
    return {ord(ch) for ch in bytes(enc.encode_ordinary(ALL)).decode("utf-8")}


class Pcre2:
    UTF, UCP, ANCHORED = 0x00080000, 0x00020000, 0x80000000
    CONFIG_UNICODE_VERSION = 10

    def __init__(self):
        path = ctypes.util.find_library("pcre2-8") or "libpcre2-8.so.0"
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.pcre2_compile_8.restype = ctypes.c_void_p
        lib.pcre2_compile_8.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.c_void_p]
        lib.pcre2_match_data_create_from_pattern_8.restype = ctypes.c_void_p
        lib.pcre2_match_data_create_from_pattern_8.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.pcre2_match_8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
        lib.pcre2_get_ovector_pointer_8.restype = ctypes.POINTER(ctypes.c_size_t)
        lib.pcre2_get_ovector_pointer_8.argtypes = [ctypes.c_void_p]
        lib.pcre2_config_8.argtypes = [ctypes.c_uint32, ctypes.c_void_p]
        buf = ctypes.create_string_buffer(64)
        lib.pcre2_config_8(self.CONFIG_UNICODE_VERSION, buf)
        self.unicode_version = buf.value.decode()

    def members(self, pat):
        ec, eo = ctypes.c_int(), ctypes.c_size_t()
        code = self.lib.pcre2_compile_8(pat.encode(), len(pat.encode()), self.UTF | self.UCP | self.ANCHORED,
                                        ctypes.byref(ec), ctypes.byref(eo), None)
        if not code:
            sys.exit(f"gen_tok_unicode: PCRE2 refused {pat!r} (error {ec.value} at {eo.value})")
        md = self.lib.pcre2_match_data_create_from_pattern_8(code, None)
        out = set()
        for c in range(0x110000):
            if 0xD800 <= c < 0xE000:
                continue
            b = chr(c).encode("utf-8")
            if self.lib.pcre2_match_8(code, b, len(b), 0, 0, md, None) > 0:
                if self.lib.pcre2_get_ovector_pointer_8(md)[1] == len(b):
                    out.add(c)
        return out


def ranges(s):
    rs = []
    for c in sorted(s):
        if rs and rs[-1][1] == c - 1:
            rs[-1][1] = c
        else:
            rs.append([c, c])
    return rs


def pcre_class_text(s):
    parts = []
    for a, b in ranges(s):
        parts.append(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}")
    return "".join(parts)


def main():
    pc = Pcre2()
    lines = [
        "/* Generated by tools/gen_tok_unicode.py: do not edit. Unicode class data of the",
        " * K3 pre-tokenizer (SPEC 5.2) for PCRE2 with Unicode " + pc.unicode_version + ".",
        " * Each SHOAL_TOK_UNI_<P>_ADD lists the code points the oracle (tiktoken "
        + tiktoken.__version__ + ", Rust regex",
        " * tables) puts in property P that PCRE2's property lacks; they are appended inside",
        " * the character class. The generator checked that PCRE2's property has no member",
        " * the oracle lacks. White space is written out in full (PCRE2's \\s also matches",
        " * U+180E). The tokenizer refuses a PCRE2 whose Unicode version differs. */",
        "#ifndef SHOAL_TOKENIZER_UNI_H",
        "#define SHOAL_TOKENIZER_UNI_H",
        "",
        f'#define SHOAL_TOK_UNI_PCRE2_UNICODE "{pc.unicode_version}"',
    ]
    for name, (opat, ppat) in BASE.items():
        want = oracle_set(opat)
        if ppat is None:
            text = pcre_class_text(want).replace("\\", "\\\\")
            lines.append(f'#define SHOAL_TOK_UNI_{name.upper()} "{text}"')
            continue
        have = pc.members(ppat)
        extra = have - want
        if extra:
            sys.exit(f"gen_tok_unicode: PCRE2 {ppat} has {len(extra)} code points the oracle lacks "
                     f"(first U+{min(extra):04X}); this class needs an explicit form")
        add = want - have
        text = pcre_class_text(add).replace("\\", "\\\\")
        lines.append(f'#define SHOAL_TOK_UNI_{name.upper()}_ADD "{text}" /* {len(add)} code points */')
        print(f"{name}: +{len(add)} code points", file=sys.stderr)
    lines += ["", "#endif", ""]
    with open(os.path.join(ROOT, "coordinator", "text", "tokenizer_uni.h"), "w") as f:
        f.write("\n".join(lines))

    fix = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
    os.makedirs(fix, exist_ok=True)
    with open(os.path.join(fix, "unicode_classes.tsv"), "w") as f:
        f.write(f"# oracle: tiktoken {tiktoken.__version__} (class membership, hex ranges); "
                f"isspace: Python {sys.version.split()[0]} str.isspace\n")
        for name, pat in COMPOSITE.items():
            rs = ranges(oracle_set(pat))
            f.write(name + "\t" + " ".join(f"{a:x}-{b:x}" for a, b in rs) + "\n")
        sp = {c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and chr(c).isspace()}
        f.write("ISSPACE\t" + " ".join(f"{a:x}-{b:x}" for a, b in ranges(sp)) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Trains the project's own small byte-level BPE vocabulary (tiktoken format).

    python3 tools/train_vocab.py OUT_tiktoken.model [--ranks 3840] [--seed 1]

The text comes from tools/vocab_corpus.py (written for this project). It is
split with the exact K3 pre-tokenizer pattern (K3_PAT_STR below, SPEC §5.2, in
the fancy-regex form tiktoken accepts), evaluated here with the `regex` module
in VERSION1 mode, which has the same `&&` class intersection. Ranks 0..255 are
the single bytes in byte order; each further rank is the next BPE merge (the
most frequent adjacent pair; ties broken by the smaller (left bytes, right
bytes)), and a merge whose bytes already have a rank adds none. Output: one
line per rank, `base64(bytes) rank`, rank order, '\\n' line ends, exactly as
the official tiktoken.model is laid out. Deterministic: same inputs, same
bytes. Needs only `regex` (no torch, no numpy).
"""
import base64
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vocab_corpus  # noqa: E402

# SPEC §5.2: the eight alternatives, in order.
K3_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def pretokenize(text):
    import regex
    pat = regex.compile(K3_PAT_STR, regex.VERSION1)
    return [m.group(0) for m in pat.finditer(text)]


def train(text, n_ranks):
    words = {}
    for piece in pretokenize(text):
        b = piece.encode("utf-8")
        words[b] = words.get(b, 0) + 1
    # each word: list of byte-string symbols, its count
    wlist = [[bytes([c]) for c in w] for w in sorted(words)]
    wcount = [words[w] for w in sorted(words)]
    pairs = {}
    where = {}
    for i, syms in enumerate(wlist):
        for a, b in zip(syms, syms[1:]):
            pairs[(a, b)] = pairs.get((a, b), 0) + wcount[i]
            where.setdefault((a, b), set()).add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    vocab = [bytes([i]) for i in range(256)]
    have = set(vocab)
    while len(vocab) < n_ranks and heap:
        negc, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -negc or negc == 0:
            continue  # stale heap entry
        merged = pair[0] + pair[1]
        if merged not in have:
            have.add(merged)
            vocab.append(merged)
        changed = {}
        for i in sorted(where.pop(pair, ())):
            syms, c = wlist[i], wcount[i]
            j, out = 0, []
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == pair[0] and syms[j + 1] == pair[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] -= c
                changed[(a, b)] = True
            for a, b in zip(out, out[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
                where.setdefault((a, b), set()).add(i)
                changed[(a, b)] = True
            wlist[i] = out
        pairs.pop(pair, None)
        for p in changed:
            if pairs.get(p, 0) > 0:
                heapq.heappush(heap, (-pairs[p], p))
    if len(vocab) < n_ranks:
        raise SystemExit(f"train_vocab: corpus too small: only {len(vocab)} ranks")
    return vocab


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=3840)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    vocab = train(vocab_corpus.corpus(a.seed), a.ranks)
    with open(a.out, "wb") as f:
        for r, b in enumerate(vocab):
            f.write(base64.b64encode(b) + b" " + str(r).encode() + b"\n")


if __name__ == "__main__":
    main()

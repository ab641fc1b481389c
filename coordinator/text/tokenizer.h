/* tokenizer: K3's tiktoken-style byte-level BPE (SPEC §5.1-5.3). Owns the
 * vocabulary loaded from a model directory (`tiktoken.model` + `tokenizer_config.json`),
 * the K3 pre-tokenizer (PCRE2, SPEC §5.2), rank-based BPE, special-token
 * recognition, and the streaming UTF-8-safe detokenizer. Callers: the chat
 * encoder (coordinator/text/chat.h), the output parser (coordinator/text/chatparse.h), the
 * HTTP layer, the engine's sampler loop and the `shoal tokenize|detokenize`
 * commands.
 *
 * Thread safety: a shoal_tok is immutable after shoal_tok_open; every function
 * taking a `const shoal_tok *` may run concurrently from many threads. A
 * shoal_detok is single-threaded (one per stream).
 *
 * Encoding contract (what "identical to the oracle" means, tests/e2e/test_tokenizer_oracle.py):
 * shoal_tok_encode(t, bytes, allow_special) returns exactly the ids of K3's
 * `tokenization_kimi.py` TikTokenTokenizer.encode(text, allow_special_tokens=allow_special)
 * run with tiktoken 0.14.0, where text = bytes.decode("utf-8", errors="replace"):
 *   - invalid UTF-8 input is first replaced, U+FFFD per maximal invalid subpart
 *     (Unicode §3.9 "best practice", which is what Python's decoder does); so
 *     the encoder never fails on bytes and never emits ids for invalid bytes;
 *   - the text is cut every 400,000 code points, and inside each piece before any
 *     run of more than 25,000 consecutive white-space (Python str.isspace) or
 *     non-white-space code points (tokenization_kimi.py), and each part is
 *     encoded on its own;
 *   - with allow_special, any occurrence of a special-token string (the
 *     names of tokenizer_config.json's added_tokens_decoder plus the unnamed
 *     reserved ids, which are called "<|reserved_token_ID|>") becomes that id;
 *     without it, those strings are ordinary bytes;
 *   - the rest is split by the pre-tokenizer and each piece BPE-encoded by rank.
 *
 * Decoding contract: ids -> bytes is the concatenation of token bytes
 * (special ids give their name's bytes). Text handed to a client goes through
 * shoal_detok, which emits only complete UTF-8 and replaces invalid sequences
 * U+FFFD per maximal subpart, exactly as bytes.decode("utf-8", "replace") of the
 * whole stream would; it never splits a code point across two outputs. */
#ifndef SHOAL_TOKENIZER_H
#define SHOAL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/utf8.h"

typedef struct shoal_tok shoal_tok;

typedef struct {
    /* Number of ids reserved for special tokens after the ranks (K3: 256,
     * SPEC §5.1: 163,584 ranks + 256 = vocab 163,840). 0 means 256. */
    int n_reserved;
} shoal_tok_opts;

/* A growable id array owned by the caller; zero-initialise it
 * (shoal_tok_ids ids = {0};), let the encoders append, free with
 * shoal_tok_ids_free. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} shoal_tok_ids;

void shoal_tok_ids_free(shoal_tok_ids *ids);
void shoal_tok_ids_push(shoal_tok_ids *ids, int32_t id);

/* Loads DIR/tiktoken.model and DIR/tokenizer_config.json. Refuses (with the
 * file and line or field in err) ranks that are not exactly 0..N-1, duplicate
 * token bytes, a missing single byte, special ids outside [N, N+n_reserved),
 * duplicate or empty special names, a name that is a prefix of another, and
 * a PCRE2 whose Unicode version is not the one coordinator/text/tokenizer_uni.h was
 * generated for. *out is NULL on error. */
int shoal_tok_open(shoal_tok **out, const char *model_dir, const shoal_tok_opts *o,
                   char *err, size_t errlen);
void shoal_tok_close(shoal_tok *t);

/* Sizes: n_ranks ordinary tokens (ids 0..n_ranks-1), then n_reserved special
 * ids; n_vocab = n_ranks + n_reserved. */
int32_t shoal_tok_n_ranks(const shoal_tok *t);
int32_t shoal_tok_n_vocab(const shoal_tok *t);

/* sha256 of tiktoken.model as loaded (for model fingerprints and for checking a
 * user-supplied real K3 vocabulary against SPEC §5.1). */
void shoal_tok_vocab_sha256(const shoal_tok *t, uint8_t out[32]);
/* Byte size of tiktoken.model as loaded. */
size_t shoal_tok_vocab_size_bytes(const shoal_tok *t);

/* SPEC §5.1: K3's tiktoken.model, and SPEC §1.1: K3's published config.json. */
#define SHOAL_K3_VOCAB_BYTES 2795286
#define SHOAL_K3_VOCAB_SHA256 "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"
#define SHOAL_K3_CONFIG_SHA256 "9710e121a58d03ac92c8d6da287a19541994319afbbe6d6202af001ffd379213"

/* Does t belong to the model whose config.json is config_path, with
 * config_vocab = its (text_config.)vocab_size? Refused with SHOAL_ECONFIG,
 * naming tok_dir's tiktoken.model and config_path:
 *   - a size mismatch: n_vocab (ranks + reserved) != config_vocab;
 *   - a digest mismatch: config_path is byte-identical to K3's published
 *     config.json (SHOAL_K3_CONFIG_SHA256) but tiktoken.model is not K3's
 *     (SHOAL_K3_VOCAB_BYTES, SHOAL_K3_VOCAB_SHA256).
 * A config.json that cannot be read is an error too (the file named). */
int shoal_tok_check_model(const shoal_tok *t, const char *tok_dir, const char *config_path, int config_vocab,
                          char *err, size_t errlen);

/* Special tokens. shoal_tok_special_id returns the id of a special name (a
 * named one from tokenizer_config.json or "<|reserved_token_ID|>"), or
 * SHOAL_ENOTFOUND. Named roles come from tokenizer_config.json's bos_token,
 * eos_token, pad_token, unk_token (-1 when the file has none). Note K3's
 * tokenizer eos is [EOS], while config.json's eos_token_id is <|end_of_msg|>;
 * generation stops on both (SPEC §5.3): look the latter up by name. */
int32_t shoal_tok_special_id(const shoal_tok *t, const char *name);
int32_t shoal_tok_bos_id(const shoal_tok *t);
int32_t shoal_tok_eos_id(const shoal_tok *t);
int32_t shoal_tok_pad_id(const shoal_tok *t);
int32_t shoal_tok_unk_id(const shoal_tok *t);
/* 1 if id is one of the n_reserved special ids. */
int shoal_tok_is_special(const shoal_tok *t, int32_t id);
/* 1 if id is a special token marked "special": true in tokenizer_config.json or
 * an unnamed reserved id (what HF's skip_special_tokens drops; K3's <|open|>,
 * <|close|>, <|sep|> are special ids but not "skippable"). */
int shoal_tok_is_skippable(const shoal_tok *t, int32_t id);

/* The bytes of one id (not NUL-terminated), valid while t is open; NULL and
 * *len = 0 for an id outside [0, n_vocab). */
const uint8_t *shoal_tok_token_bytes(const shoal_tok *t, int32_t id, size_t *len);

/* Appends the ids of text[0..len) to *out (see the encoding contract above).
 * allow_special: 1 to turn special-token strings into their ids, 0 to encode
 * them as ordinary bytes (user text, always). Returns 0, or SHOAL_EINTERNAL
 * when PCRE2 fails (err names the PCRE2 error); never fails on input bytes. */
int shoal_tok_encode(const shoal_tok *t, const char *text, size_t len, int allow_special,
                     shoal_tok_ids *out, char *err, size_t errlen);

/* Appends the raw bytes of ids to a NUL-terminated growable buffer *buf of
 * capacity *cap (both may start NULL/0; free(*buf) when done); *len is the
 * byte count. Returns SHOAL_ERANGE (naming the index) for an id outside
 * [0, n_vocab). The bytes may be invalid UTF-8: use shoal_detok for text. */
int shoal_tok_decode(const shoal_tok *t, const int32_t *ids, size_t n, char **buf, size_t *len,
                     size_t *cap, char *err, size_t errlen);

/* Streaming detokenizer: feed ids one at a time, get the UTF-8 text that is now
 * final. */
typedef struct shoal_detok shoal_detok;

typedef struct {
    int skip_special; /* 1: drop skippable ids (shoal_tok_is_skippable) */
} shoal_detok_opts;

/* t must outlive the detokenizer. */
int shoal_detok_open(shoal_detok **out, const shoal_tok *t, const shoal_detok_opts *o);
void shoal_detok_close(shoal_detok *d);
/* Feeds one id. On return *text points to the newly final UTF-8 text (*len
 * bytes, NUL-terminated, possibly empty), borrowed until the next call on d.
 * Incomplete trailing sequences are held back; bytes that can no longer
 * become valid are emitted as U+FFFD. SHOAL_ERANGE for an id outside the vocab
 * (nothing is consumed). */
int shoal_detok_feed(shoal_detok *d, int32_t id, const char **text, size_t *len);
/* Feeds raw bytes instead of an id (used by the output parser for tag texts). */
int shoal_detok_feed_bytes(shoal_detok *d, const uint8_t *b, size_t n, const char **text,
                           size_t *len);
/* Ends the stream: a held-back incomplete sequence becomes U+FFFD per maximal
 * subpart. *text as for feed. The detokenizer is reset and can be reused. */
void shoal_detok_flush(shoal_detok *d, const char **text, size_t *len);

/* UTF-8 validation and replacement: common/utf8.h (included above). */

#endif

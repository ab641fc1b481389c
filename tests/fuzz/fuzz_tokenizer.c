/* libFuzzer target: the tokenizer on arbitrary bytes. Byte 0's low bit turns
 * special-token recognition on; the rest is the text. Checks, besides memory
 * safety: decode(encode(text)) is the text with invalid UTF-8 replaced, the
 * streaming detokenizer gives the same text without ever splitting a code
 * point, the heap BPE agrees with tiktoken's quadratic loop on the first 128
 * bytes, and the ASCII fast path of the split agrees with PCRE2 alone. Any
 * mismatch aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/text/tokenizer.h"
#include "coordinator/text/tokenizer_int.h"
#include "tests/fuzz/fuzz_tok_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    shoal_tok *t = fuzz_tok();
    int allow = data[0] & 1;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    shoal_tok_ids ids = {0};
    char err[256];
    if (shoal_tok_encode(t, text, n, allow, &ids, err, sizeof err))
        abort();
    char *dec = NULL, *want;
    size_t dl = 0, dc = 0, wl;
    if (shoal_tok_decode(t, ids.v, ids.n, &dec, &dl, &dc, err, sizeof err))
        abort();
    shoal_utf8_sanitize(text, n, &want, &wl);
    if (dl != wl || memcmp(dec, want, wl))
        abort();
    shoal_detok *d;
    shoal_detok_open(&d, t, NULL);
    size_t got = 0;
    for (size_t i = 0; i < ids.n; i++) {
        const char *s;
        size_t l;
        shoal_detok_feed(d, ids.v[i], &s, &l);
        if (!shoal_utf8_valid(s, l) || got + l > wl || memcmp(want + got, s, l))
            abort();
        got += l;
    }
    const char *s;
    size_t l;
    shoal_detok_flush(d, &s, &l);
    if (l || got != wl)
        abort();
    shoal_detok_close(d);
    size_t m = n > 128 ? 128 : n;
    if (m >= 2) {
        shoal_tok_ids a = {0}, b = {0};
        shoal__tok_bpe_forced(t, (const uint8_t *)text, m, 0, &a);
        shoal__tok_bpe_forced(t, (const uint8_t *)text, m, 1, &b);
        if (a.n != b.n || memcmp(a.v, b.v, a.n * sizeof *a.v))
            abort();
        shoal_tok_ids_free(&a);
        shoal_tok_ids_free(&b);
    }
    shoal_tok_ids fa = {0}, pa = {0};
    if (shoal__tok_split(t, (const uint8_t *)want, wl, 1, &fa) || shoal__tok_split(t, (const uint8_t *)want, wl, 0, &pa))
        abort();
    if (fa.n != pa.n || (fa.n && memcmp(fa.v, pa.v, fa.n * sizeof *fa.v)))
        abort();
    shoal_tok_ids_free(&fa);
    shoal_tok_ids_free(&pa);
    free(dec);
    free(want);
    shoal_tok_ids_free(&ids);
    return 0;
}

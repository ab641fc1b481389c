/* detok: the text side of the tokenizer: ids to bytes, and the streaming
 * detokenizer (see tokenizer.h for the contracts). Uses the tokenizer's
 * vocabulary (tokenizer.c) and common/utf8; nothing here is called back by
 * tokenizer.c. */
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"
#include "coordinator/text/tokenizer.h"
#include "coordinator/text/tokenizer_int.h"

/* -------------------------------------------------------------- decode -- */

int shoal_tok_decode(const shoal_tok *t, const int32_t *ids, size_t n, char **buf, size_t *len,
                     size_t *cap, char *err, size_t errlen)
{
    size_t need = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l;
        if (!shoal_tok_token_bytes(t, ids[i], &l))
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "decode: ids[%zu] = %d outside [0, %d)",
                                 i, ids[i], shoal_tok_n_vocab(t));
        need += l;
    }
    size_t used = *buf ? *len : 0;
    if (!*buf || *cap < used + need + 1) {
        size_t c = *cap ? *cap : 64;
        while (c < used + need + 1)
            c *= 2;
        *buf = shoal_xrealloc(*buf, c);
        *cap = c;
    }
    for (size_t i = 0; i < n; i++) {
        size_t l;
        const uint8_t *b = shoal_tok_token_bytes(t, ids[i], &l);
        memcpy(*buf + used, b, l);
        used += l;
    }
    (*buf)[used] = 0;
    *len = used;
    return 0;
}

struct shoal_detok {
    const shoal_tok *t;
    int skip_special;
    uint8_t pend[4];
    size_t npend;
    uint8_t *in;
    size_t in_cap;
    char *out;
    size_t out_cap;
};

int shoal_detok_open(shoal_detok **out, const shoal_tok *t, const shoal_detok_opts *o)
{
    shoal_detok *d = shoal_xcalloc(1, sizeof *d);
    d->t = t;
    d->skip_special = o ? o->skip_special : 0;
    d->out_cap = 256;
    d->out = shoal_xmalloc(d->out_cap);
    d->out[0] = 0;
    *out = d;
    return 0;
}

void shoal_detok_close(shoal_detok *d)
{
    if (!d)
        return;
    free(d->in);
    free(d->out);
    free(d);
}

int shoal_detok_feed_bytes(shoal_detok *d, const uint8_t *b, size_t n, const char **text,
                           size_t *len)
{
    size_t total = d->npend + n;
    if (d->in_cap < total + 1) {
        d->in_cap = total + 64;
        d->in = shoal_xrealloc(d->in, d->in_cap);
    }
    memcpy(d->in, d->pend, d->npend);
    if (n)
        memcpy(d->in + d->npend, b, n);
    if (d->out_cap < 3 * total + 1) {
        d->out_cap = 3 * total + 64;
        d->out = shoal_xrealloc(d->out, d->out_cap);
    }
    size_t i = 0, k = 0;
    d->npend = 0;
    while (i < total) {
        uint32_t cp;
        int r = shoal_utf8_step(d->in + i, total - i, &cp);
        if (r > 0) {
            memcpy(d->out + k, d->in + i, (size_t)r);
            k += (size_t)r;
            i += (size_t)r;
        } else if (r < 0) {
            memcpy(d->out + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i += (size_t)-r;
        } else {
            /* an incomplete sequence at the end: wait for more bytes */
            d->npend = total - i;
            memcpy(d->pend, d->in + i, d->npend);
            break;
        }
    }
    d->out[k] = 0;
    *text = d->out;
    *len = k;
    return 0;
}

int shoal_detok_feed(shoal_detok *d, int32_t id, const char **text, size_t *len)
{
    size_t l;
    const uint8_t *b = shoal_tok_token_bytes(d->t, id, &l);
    if (!b) {
        d->out[0] = 0;
        *text = d->out;
        *len = 0;
        return SHOAL_ERANGE;
    }
    if (d->skip_special && shoal_tok_is_skippable(d->t, id))
        l = 0;
    return shoal_detok_feed_bytes(d, b, l, text, len);
}

void shoal_detok_flush(shoal_detok *d, const char **text, size_t *len)
{
    size_t k = 0;
    if (d->npend) {
        /* a proper prefix of a valid sequence is one maximal subpart */
        memcpy(d->out, "\xEF\xBF\xBD", 3);
        k = 3;
        d->npend = 0;
    }
    d->out[k] = 0;
    *text = d->out;
    *len = k;
}

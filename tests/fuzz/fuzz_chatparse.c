/* libFuzzer target: the output parser on arbitrary ids. Byte 0: bit 0 thinking
 * off, bit 1 truncated at the end, bit 2 the input mode: text with the
 * structural markers encoded with special tokens allowed (reaches deep
 * structure quickly), or raw little-endian 16-bit ids (any id, in the
 * vocabulary or not). Nothing may crash or leak; every text delta must be
 * valid UTF-8 and the deltas must add up to the totals; the message must build. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/text/chatparse.h"
#include "tests/fuzz/fuzz_tok_common.h"

static size_t streamed[2];

static void on_event(void *ud, const shoal_chatparse_event *ev)
{
    (void)ud;
    if (ev->kind == SHOAL_CHATPARSE_REASONING || ev->kind == SHOAL_CHATPARSE_CONTENT) {
        if (!shoal_utf8_valid(ev->text, ev->len))
            abort();
        streamed[ev->kind == SHOAL_CHATPARSE_CONTENT] += ev->len;
    } else if (ev->kind == SHOAL_CHATPARSE_TOOL_CALL) {
        json_t *a = json_loads(ev->arguments, JSON_DECODE_ANY, NULL); /* may be invalid: passed as written */
        json_decref(a);
        if (!ev->name || !ev->id)
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    shoal_tok *t = fuzz_tok();
    shoal_tok_ids ids = {0};
    char err[256];
    if (data[0] & 4) {
        for (size_t i = 1; i + 1 < size; i += 2)
            shoal_tok_ids_push(&ids, (int32_t)(data[i] | data[i + 1] << 8) - 8);
    } else {
        shoal_tok_encode(t, (const char *)data + 1, size - 1, 1, &ids, err, sizeof err);
    }
    streamed[0] = streamed[1] = 0;
    shoal_chatparse *p;
    if (shoal_chatparse_open(&p, t, &(shoal_chatparse_opts){.thinking_off = data[0] & 1, .on_event = on_event},
                             err, sizeof err))
        abort();
    for (size_t i = 0; i < ids.n; i++)
        shoal_chatparse_feed(p, ids.v[i]);
    shoal_chatparse_finish(p, (data[0] >> 1) & 1);
    size_t rl, cl;
    shoal_chatparse_reasoning(p, &rl);
    shoal_chatparse_content(p, &cl);
    if (rl != streamed[0] || cl != streamed[1])
        abort();
    json_t *m = shoal_chatparse_message(p);
    if (!m)
        abort();
    json_decref(m);
    shoal_chatparse_close(p);
    shoal_tok_ids_free(&ids);
    return 0;
}

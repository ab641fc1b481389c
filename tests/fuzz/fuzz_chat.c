/* libFuzzer target: the chat encoder on arbitrary JSON. Byte 0 picks options
 * (thinking off, no generation prompt, the effort rule, an effort value); the
 * rest is parsed with jansson: an array is the messages, an object is a
 * request body (options from it, messages from its "messages"). Rendering may
 * refuse with an error; it must never crash, leak, or produce a special
 * segment the vocabulary lacks, and text segments must never encode to a
 * special id. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/text/chat.h"
#include "tests/fuzz/fuzz_tok_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    shoal_tok *t = fuzz_tok();
    static const char *efforts[] = {NULL, "low", "medium", "high", "max", "bogus"};
    shoal_chat_opts o = {
        .thinking_off = data[0] & 1,
        .no_generation_prompt = (data[0] >> 1) & 1,
        .effort_rule = (data[0] >> 2) & 1 ? SHOAL_CHAT_EFFORT_TEMPLATE : SHOAL_CHAT_EFFORT_ENCODER,
        .thinking_effort = efforts[(data[0] >> 3) % 6],
    };
    json_error_t je;
    json_t *root = json_loadb((const char *)data + 1, size - 1, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!root)
        return 0;
    const json_t *messages = root;
    char err[512];
    if (json_is_object(root)) {
        if (shoal_chat_opts_from_request(root, &o, err, sizeof err)) {
            json_decref(root);
            return 0;
        }
        messages = json_object_get(root, "messages");
    }
    shoal_chat_segs *s;
    if (shoal_chat_render(messages, &o, &s, err, sizeof err) == 0) {
        for (size_t i = 0; i < shoal_chat_segs_count(s); i++) {
            shoal_chat_seg g = shoal_chat_segs_get(s, i);
            shoal_tok_ids ids = {0};
            if (g.special) {
                if (shoal_tok_special_id(t, g.text) < 0)
                    abort();
            } else {
                if (shoal_tok_encode(t, g.text, g.len, 0, &ids, err, sizeof err))
                    abort();
                for (size_t k = 0; k < ids.n; k++)
                    if (shoal_tok_is_special(t, ids.v[k]))
                        abort();
            }
            shoal_tok_ids_free(&ids);
        }
        shoal_chat_segs_free(s);
    }
    json_decref(root);
    return 0;
}

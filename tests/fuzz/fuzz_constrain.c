/* Fuzz target of the structured-output compiler and matcher (issue 36).
 * Input: byte 0 picks the mode (% 3: a JSON schema, a regex, a GBNF grammar); bytes
 * 1..k (k = byte 1 * 4, at most the rest) are the schema text / pattern; the
 * rest is fed to a run of the compiled constraint, then one mask is computed.
 * Contract checked: compile either succeeds or refuses with an error code and
 * a message, within bounded time and memory; feeding and masking never crash;
 * a mask's count equals its number of set entries. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/text/constrain.h"
#include "fuzz_tok_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static shoal_cons_vocab *v;
    static uint8_t *mask;
    char err[300];
    if (!v) {
        if (shoal_cons_vocab_build(&v, fuzz_tok(), err, sizeof err))
            abort();
        mask = malloc((size_t)shoal_cons_vocab_size(v));
    }
    if (size < 2)
        return 0;
    size_t k = (size_t)data[1] * 4;
    if (k > size - 2)
        k = size - 2;
    const char *src = (const char *)data + 2;
    shoal_cons *c = NULL;
    err[0] = '\0';
    int rc;
    if (data[0] % 3 == 1) {
        rc = shoal_cons_compile_regex(&c, src, k, err, sizeof err);
    } else if (data[0] % 3 == 2) {
        rc = shoal_cons_compile_gbnf(&c, src, k, err, sizeof err);
    } else {
        json_t *s = json_loadb(src, k, JSON_DECODE_ANY, NULL);
        rc = shoal_cons_compile_json(&c, s, err, sizeof err);
        json_decref(s);
    }
    if (rc) {
        if (c || !err[0])
            abort(); /* a refusal comes with a message and no object */
        return 0;
    }
    int32_t end = shoal_cons_vocab_size(v) - 1;
    shoal_cons_run *r;
    if (shoal_cons_run_create(&r, c, v, &end, 1, err, sizeof err))
        abort();
    shoal_cons_run_feed(r, data + 2 + k, size - 2 - k);
    int n = shoal_cons_run_mask(r, mask), cnt = 0;
    for (int32_t i = 0; i < shoal_cons_vocab_size(v); i++)
        cnt += mask[i];
    if (n != cnt)
        abort();
    shoal_cons_run_free(r);
    shoal_cons_free(c);
    return 0;
}

/* libFuzzer target: the worker's request path over arbitrary bytes -- decode
 * (PROTOCOL.md §2-§4), batch validation against a small model (§6), and the
 * coordinator's reply decoder on the same frames. Nothing may crash, leak or
 * read out of bounds; every refusal must carry an ERROR code.
 *
 * Input: byte 0 picks the frame count (1 + b % 3); then, for every frame but
 * the last, a 2-byte little-endian length and that many bytes; the last frame
 * takes the rest. tests/fuzz/corpus/fuzz_proto/ holds the golden messages of
 * tests/fixtures/proto/golden.json in this form. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "proto/proto.h"

static int owns_some(const void *ctx, int layer, int e)
{
    (void)ctx;
    return (layer + e) % 3 != 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int n = 1 + data[0] % 3;
    size_t at = 1, off[3], len[3];
    for (int i = 0; i < n; i++) {
        if (i == n - 1) {
            len[i] = size - at;
        } else {
            if (size - at < 2)
                return 0;
            len[i] = (size_t)data[at] | (size_t)data[at + 1] << 8;
            at += 2;
            if (len[i] > size - at)
                return 0;
        }
        off[i] = at;
        at += len[i];
    }
    /* copy each frame so ASan sees its exact bounds */
    shoal_frame f[3];
    for (int i = 0; i < n; i++) {
        uint8_t *p = malloc(len[i] ? len[i] : 1);
        memcpy(p, data + off[i], len[i]);
        f[i] = (shoal_frame){p, len[i]};
    }
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr = 0;
    char err[512];
    int rc = shoal_proto_decode(f, n, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err);
    if (rc && (perr < SHOAL_PERR_MALFORMED || perr > SHOAL_PERR_INTERNAL))
        abort(); /* a refusal must name an ERROR code */
    if (!rc && m.type == SHOAL_MSG_EXPERT_BATCH) {
        static const uint8_t is_moe[4] = {0, 1, 1, 1};
        shoal_proto_limits lim = {.num_layers = 4, .is_moe = is_moe, .num_experts = 8, .k = 2, .d = 32,
                                  .max_tokens = 16, .act_mask = 6, .out_mask = 6, .owns = owns_some};
        int pe = shoal_proto_check_batch(&m, &lim, err, sizeof err);
        if (pe == SHOAL_PERR_OK) {
            /* a checked batch may be read in full */
            volatile uint32_t acc = 0;
            for (uint32_t i = 0; i < m.batch.route.rows; i++) {
                int32_t t, e;
                shoal_proto_route_pair(&m.batch.route, i, &t, &e);
                acc += m.batch.act.data[(size_t)t * m.batch.act.cols * shoal_wire_dtype_size(m.batch.act.dtype)];
                acc += (uint32_t)e;
            }
            (void)acc;
        }
    }
    shoal_proto_msg_clear(&m);
    memset(&m, 0, sizeof m);
    shoal_proto_decode(f, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err);
    shoal_proto_msg_clear(&m);
    for (int i = 0; i < n; i++)
        free((void *)f[i].data);
    return 0;
}

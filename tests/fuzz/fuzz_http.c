/* Fuzz target: bytes from a client socket through the HTTP request parser
 * (small limits, so the refusals are reached), then every complete request's
 * body through the API validation of both generation endpoints. Nothing here
 * may crash, leak or read out of bounds whatever the bytes; a refusal must
 * carry a 4xx status. The first input byte picks how the rest is split into
 * reads, so request boundaries falling inside a read are covered too. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/api/api.h"
#include "coordinator/api/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t step = (size_t)(data[0] % 17) + 1; /* bytes per simulated read: 1..17, or all at 17 */
    if (step == 17)
        step = size;
    data++;
    size--;
    shoal_http_parser *p;
    char err[128];
    if (shoal_http_parser_create(&p, 1024, 4096, err, sizeof err))
        abort();
    static const shoal_api_limits lim = {.model_name = "m", .vocab = 4096, .max_context = 256};
    size_t off = 0;
    int requests = 0;
    while (off < size && requests < 16) {
        size_t chunk = size - off < step ? size - off : step;
        int status;
        long n = shoal_http_parser_feed(p, (const char *)data + off, chunk, &status);
        if (n < 0) {
            if (status < 400 || status > 505)
                abort();
            break;
        }
        off += (size_t)n;
        const shoal_http_request *r = shoal_http_parser_request(p);
        if (r) {
            requests++;
            if (!r->method || !r->path || r->body_len > 4096 || r->nheaders > SHOAL_HTTP_MAX_HEADERS)
                abort();
            for (int i = 0; i < r->nheaders; i++)
                if (strlen(r->name[i]) > 1024 || strlen(r->value[i]) > 1024)
                    abort();
            for (int k = 0; k < 2; k++) {
                shoal_api_req q;
                shoal_api_error e;
                if (shoal_api_parse(k ? SHOAL_GEN_COMPLETION : SHOAL_GEN_CHAT, r->body, r->body_len, &lim, &q,
                                    &e) == 0)
                    shoal_api_req_free(&q);
                else if (e.status != 400 || !e.message[0])
                    abort();
            }
            shoal_http_parser_next(p);
        } else if (n == 0 && chunk > 0) {
            abort(); /* nothing consumed and no request: the parser would stall */
        }
    }
    shoal_http_parser_free(p);
    return 0;
}

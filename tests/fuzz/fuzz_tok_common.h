/* Shared by the tokenizer/chat/parser fuzz targets: the project vocabulary,
 * loaded once from $SHOAL_SRC/tests/models/tiny-k3 (or ./tests/models/tiny-k3,
 * where scripts/fuzz.sh runs). A missing model is a broken setup: abort. */
#ifndef SHOAL_FUZZ_TOK_COMMON_H
#define SHOAL_FUZZ_TOK_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#include "coordinator/text/tokenizer.h"

static shoal_tok *fuzz_tok(void)
{
    static shoal_tok *t;
    if (!t) {
        const char *src = getenv("SHOAL_SRC");
        char dir[4096], err[512];
        snprintf(dir, sizeof dir, "%s/tests/models/tiny-k3", src ? src : ".");
        if (shoal_tok_open(&t, dir, NULL, err, sizeof err)) {
            fprintf(stderr, "fuzz: %s\n", err);
            abort();
        }
    }
    return t;
}

#endif

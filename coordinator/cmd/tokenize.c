/* `shoal tokenize` and `shoal detokenize`: the tokenizer from the command line
 * (for people and for the oracle test, which runs the binary). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/suggest.h"
#include "cli/commands.h"
#include "common/err.h"
#include "coordinator/text/text.h"

static int read_all(const char *path, char **buf, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f)
        return -errno;
    int rc = shoal_read_stream(f, 0, buf, len);
    if (f != stdin)
        fclose(f);
    return rc;
}

/* --chat: a request body's messages and options to the prompt's ids */
static int chat_encode(const shoal_tok *t, const char *text, size_t len, shoal_tok_ids *ids, char *err,
                       size_t errlen)
{
    json_error_t je;
    json_t *body = json_loadb(text, len, 0, &je);
    if (!body)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--chat: line %d: %s", je.line, je.text);
    shoal_chat_opts o = {0};
    int rc = json_is_object(body) ? 0
                                  : shoal_err_set(err, errlen, SHOAL_EINVAL, "--chat: the body is not an object");
    if (!rc)
        rc = shoal_chat_opts_from_request(body, &o, err, errlen);
    if (!rc) {
        o.no_generation_prompt = json_is_false(json_object_get(body, "add_generation_prompt"));
        rc = shoal_chat_encode(t, json_object_get(body, "messages"), &o, ids, err, errlen);
    }
    json_decref(body);
    return rc;
}

static void tokenize_usage(FILE *f)
{
    fprintf(f, "usage: shoal tokenize --model DIR [--allow-special] (TEXT | --file FILE)\n"
               "       shoal tokenize --model DIR --chat FILE\n"
               "Prints the token ids of TEXT (or of FILE's bytes, '-' for stdin) on one line,\n"
               "comma-separated. Special-token strings are ordinary text unless --allow-special.\n"
               "Invalid UTF-8 is replaced by U+FFFD per maximal invalid subpart first.\n"
               "--chat: FILE is a /v1/chat/completions body (messages, tools, tool_choice,\n"
               "response_format, chat_template_kwargs.thinking, thinking_effort; and\n"
               "\"add_generation_prompt\": false to leave the assistant's turn unopened); prints\n"
               "the ids of the K3 XTML prompt, as the server counts them (usage.prompt_tokens).\n");
}

int shoal_cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *file = NULL, *text = NULL;
    int allow = 0, chat = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--file") && i + 1 < argc)
            file = argv[++i];
        else if (!strcmp(argv[i], "--chat") && i + 1 < argc) {
            file = argv[++i];
            chat = 1;
        } else if (!strcmp(argv[i], "--allow-special"))
            allow = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tokenize_usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1] == '-' && !text) {
            shoal_suggest_unknown_flag("shoal tokenize", argv[i], tokenize_usage);
            return 2;
        } else if (!text)
            text = argv[i];
        else {
            tokenize_usage(stderr);
            return 2;
        }
    }
    if (!model || (!file) == (!text) || (chat && allow)) {
        tokenize_usage(stderr);
        return 2;
    }
    char err[512];
    shoal_tok *t;
    int rc = shoal_tok_open(&t, model, NULL, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal tokenize: %s\n", err);
        return 3;
    }
    char *buf = NULL;
    size_t len;
    if (file) {
        rc = read_all(file, &buf, &len);
        if (rc) {
            fprintf(stderr, "shoal tokenize: %s: %s\n", file, shoal_strerror(rc));
            shoal_tok_close(t);
            return 4;
        }
        text = buf;
    } else {
        len = strlen(text);
    }
    shoal_tok_ids ids = {0};
    rc = chat ? chat_encode(t, text, len, &ids, err, sizeof err)
              : shoal_tok_encode(t, text, len, allow, &ids, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal tokenize: %s\n", err);
    } else {
        for (size_t i = 0; i < ids.n; i++)
            printf(i ? ",%d" : "%d", ids.v[i]);
        printf("\n");
    }
    shoal_tok_ids_free(&ids);
    free(buf);
    shoal_tok_close(t);
    return rc ? 4 : 0;
}

static void detokenize_usage(FILE *f)
{
    fprintf(f, "usage: shoal detokenize --model DIR [--skip-special] IDS\n"
               "Prints the text of IDS (comma- or space-separated; '-' reads them from stdin),\n"
               "invalid UTF-8 replaced by U+FFFD per maximal subpart. --skip-special drops the\n"
               "special ids marked \"special\" in tokenizer_config.json.\n");
}

int shoal_cmd_detokenize(int argc, char **argv)
{
    const char *model = NULL, *idtext = NULL;
    int skip = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--skip-special"))
            skip = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            detokenize_usage(stdout);
            return 0;
        } else if (!idtext)
            idtext = argv[i];
        else {
            detokenize_usage(stderr);
            return 2;
        }
    }
    if (!model || !idtext) {
        detokenize_usage(stderr);
        return 2;
    }
    char *buf = NULL;
    if (!strcmp(idtext, "-")) {
        size_t len;
        if (read_all("-", &buf, &len)) {
            fprintf(stderr, "shoal detokenize: cannot read stdin\n");
            return 4;
        }
        buf = shoal_xrealloc(buf, len + 1);
        buf[len] = 0;
        idtext = buf;
    }
    char err[512];
    shoal_tok *t;
    int rc = shoal_tok_open(&t, model, NULL, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal detokenize: %s\n", err);
        free(buf);
        return 3;
    }
    shoal_detok *d;
    shoal_detok_open(&d, t, &(shoal_detok_opts){.skip_special = skip});
    int status = 0;
    const char *p = idtext;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v >= shoal_tok_n_vocab(t)) {
            fprintf(stderr, "shoal detokenize: bad id near \"%.20s\" (ids are 0..%d)\n", p,
                    shoal_tok_n_vocab(t) - 1);
            status = 2;
            break;
        }
        const char *out;
        size_t n;
        shoal_detok_feed(d, (int32_t)v, &out, &n);
        fwrite(out, 1, n, stdout);
        p = end;
    }
    const char *out;
    size_t n;
    shoal_detok_flush(d, &out, &n);
    fwrite(out, 1, n, stdout);
    if (!status)
        fputc('\n', stdout);
    shoal_detok_close(d);
    shoal_tok_close(t);
    free(buf);
    return status;
}

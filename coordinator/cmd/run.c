/* `shoal run`: one prompt through the in-process engine, a continuation and a
 * run report (engine.h, sampler.h). */
#include <errno.h>
#include <jansson.h>
#include <omp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "common/suggest.h"
#include "common/err.h"
#include "common/k3cfg.h"
#include "common/log.h"
#include "common/memplan.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/pcache/pcache.h"
#include "coordinator/engine/engine.h"
#include "proto/fprint.h"
#include "coordinator/text/text.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal run --model DIR (--ids 1,2,3 | --prompt TEXT | --prompt-file FILE) [options]\n"
            "\n"
            "Runs the prompt through the model in this process (batched prefill, then\n"
            "incremental decode) and prints the continuation and a run report.\n"
            "\n"
            "  --model DIR          model directory (config.json, safetensors, tokenizer files)\n"
            "  --tokenizer DIR      tiktoken.model + tokenizer_config.json from DIR instead of\n"
            "                       the model's folder; refused unless it is the model's\n"
            "                       vocabulary (config.json vocab_size; K3's sha256 for K3)\n"
            "  --ids LIST           prompt token ids, comma-separated (no tokenizer needed)\n"
            "  --prompt TEXT        prompt text, encoded with the model's tokenizer\n"
            "                       (tiktoken.model + tokenizer_config.json in DIR)\n"
            "  --prompt-file FILE   prompt text read from FILE\n"
            "  --allow-special      let special-token names in the prompt text become their ids\n"
            "                       (default: they are ordinary text)\n"
            "  --gen N              tokens to generate at most (default 16); stops early on an\n"
            "                       EOS id (config.json eos_token_id, tokenizer_config.json eos_token)\n"
            "  --threads N          OpenMP threads (default: OpenMP's); results do not depend on it\n"
            "  --temperature T      0 (default) = greedy; > 0 samples\n"
            "  --top-p P            nucleus mass in (0, 1] (default 1 = off)\n"
            "  --top-k K            keep the K most likely (default 0 = off)\n"
            "  --seed S             PRNG seed (default 0); same seed, same ids\n"
            "  --max-context N      sequence capacity (default: prompt + gen)\n"
            "  --batch N            prefill chunk size (default 256)\n"
            "  --dump-logits FILE   write the logits of every generated step: raw float32\n"
            "                       little-endian, [steps, vocab], row i = the logits that chose\n"
            "                       generated token i\n"
            "  --save-state FILE    after the prompt's prefill, write its state (KDA states, conv\n"
            "                       windows, MLA rows) and last logits to FILE (the prefix cache's\n"
            "                       format: docs/ARCHITECTURE.md, with the model fingerprint)\n"
            "  --load-state FILE    start from FILE's state instead of prefilling its tokens: they must\n"
            "                       be a prefix of the prompt; only the rest is prefilled (the same\n"
            "                       logits, bit for bit). A file of another model, or damaged, is\n"
            "                       refused naming it (exit 3)\n"
            "  --trace FILE         record every routing decision (token, layer, experts) in\n"
            "                       FILE (format: docs/METRICS.md; read by 'shoal trace stats')\n"
            "  --metrics-file FILE  write the coordinator's metrics (Prometheus text, the families\n"
            "                       of shoal serve's /metrics: docs/METRICS.md) to FILE at the end\n"
            "  --numerics CLASS     portable (default: the fp32-activation order) or mu (the matrix-unit\n"
            "                       order: AMX where it passes its self-test, an exact emulation elsewhere);\n"
            "                       every worker must compute the same class (docs/CONFIG.md)\n"
            "  --trunk-gb G         trunk RAM budget: small|medium|large|auto or GiB (fractions allowed).\n"
            "                       The trunk is then read with pread (O_DIRECT where possible) into\n"
            "                       owned memory: the layers that fit stay resident, the rest are\n"
            "                       streamed from disk ahead of use, double-buffered; same tokens.\n"
            "                       A budget below the minimum is refused (exit 3) naming it.\n"
            "                       Default: the trunk is mapped (docs/CONFIG.md)\n"
            "  --trunk-no-direct    buffered reads for --trunk-gb (no O_DIRECT)\n"
            "  --draft ngram|off    speculative decoding (default ngram): draft up to K next tokens\n"
            "                       from the longest earlier match of the text's end in prompt +\n"
            "                       output, verify them in one pass; same ids as off\n"
            "  --draft-max K        most drafted tokens per pass, 1..16 (default 8; adapted down\n"
            "                       to the recent acceptance)\n"
            "  --draft-ngram-min N  shortest match that drafts (default 2)\n"
            "  --draft-cost A[,B]   a verify pass of k drafts costs 1 + B + A*k plain passes\n"
            "                       (default 0.2,0.3); K maximises tokens per cost\n"
            "  --draft-ids LIST     testing: draft from LIST (ids of the whole sequence, prompt\n"
            "                       first) instead of the lookup, K fixed at --draft-max\n"
            "  --json               print one JSON object instead of the text report; it has\n"
            "                       prompt_ids, generated_ids, text (when the tokenizer loads),\n"
            "                       stop_reason, prefill/decode tokens and tokens_per_s,\n"
            "                       decode_step_ms, weight bytes per token, peak_rss_bytes\n"
            "\n");
    shoal_dist_usage(f);
    fprintf(f,
            "\n"
            "exit codes:\n"
            "  0  ok\n"
            "  2  usage error\n"
            "  3  invalid model or config (the reason is printed)\n"
            "  4  the run failed part-way (the reason is printed)\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

/* "1,2,3" -> ids (caller frees) */
static int parse_ids(const char *s, int32_t **out, int *n)
{
    int cap = 16, k = 0;
    int32_t *ids = shoal_xmalloc(sizeof(int32_t) * (size_t)cap);
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(ids);
            return -1;
        }
        if (k == cap) {
            cap *= 2;
            ids = shoal_xrealloc(ids, sizeof(int32_t) * (size_t)cap);
        }
        ids[k++] = (int32_t)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) {
            free(ids);
            return -1;
        }
    }
    if (!k) {
        free(ids);
        return -1;
    }
    *out = ids;
    *n = k;
    return 0;
}

static uint64_t peak_rss_bytes(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru))
        return 0;
    return (uint64_t)ru.ru_maxrss * 1024u;
}

/* append to a growable text buffer, echoing to stdout when echo */
static void append_text(char **buf, size_t *len, size_t *cap, const char *p, size_t n, int echo)
{
    if (!n)
        return;
    if (*len + n + 1 > *cap) {
        *cap = (*len + n + 1) * 2;
        *buf = shoal_xrealloc(*buf, *cap);
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
    if (echo) {
        fwrite(p, 1, n, stdout);
        fflush(stdout);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int shoal_cmd_run(int argc, char **argv)
{
    const char *model = NULL, *ids_s = NULL, *prompt = NULL, *prompt_file = NULL, *dump = NULL, *trace_path = NULL, *metrics_path = NULL;
    const char *tokenizer_dir = NULL, *save_state = NULL, *load_state = NULL;
    long gen = 16, threads = 0, top_k = 0, max_ctx = 0, batch = 256, draft_max = 8, draft_ngram_min = 2;
    shoal_draft_mode draft_mode = SHOAL_DRAFT_NGRAM;
    const char *draft_ids_s = NULL;
    shoal_draft_opts dcost = {0};
    double temp = 0.0, top_p = 1.0;
    unsigned long long seed = 0;
    int json = 0, allow_special = 0, dr, trunk_no_direct = 0;
    shoal_trunk_mode trunk_mode = SHOAL_TRUNK_MAPPED;
    uint64_t trunk_budget = 0;
    shoal_dist_opts dopts = {0};
    shoal_dist *dist = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
#define VAL()                                                                  \
    do {                                                                       \
        if (!v) {                                                              \
            fprintf(stderr, "shoal run: %s needs a value\n", a);               \
            return 2;                                                          \
        }                                                                      \
        i++;                                                                   \
    } while (0)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--model")) {
            VAL();
            model = v;
        } else if (!strcmp(a, "--tokenizer")) {
            VAL();
            tokenizer_dir = v;
        } else if (!strcmp(a, "--ids")) {
            VAL();
            ids_s = v;
        } else if (!strcmp(a, "--prompt")) {
            VAL();
            prompt = v;
        } else if (!strcmp(a, "--prompt-file")) {
            VAL();
            prompt_file = v;
        } else if (!strcmp(a, "--gen")) {
            VAL();
            bad = parse_int(v, 0, 1 << 24, &gen);
        } else if (!strcmp(a, "--threads")) {
            VAL();
            bad = parse_int(v, 1, 4096, &threads);
        } else if (!strcmp(a, "--temperature")) {
            VAL();
            bad = parse_float(v, &temp) || temp < 0;
        } else if (!strcmp(a, "--top-p")) {
            VAL();
            bad = parse_float(v, &top_p) || !(top_p > 0 && top_p <= 1);
        } else if (!strcmp(a, "--top-k")) {
            VAL();
            bad = parse_int(v, 0, INT_MAX, &top_k);
        } else if (!strcmp(a, "--seed")) {
            VAL();
            char *end;
            errno = 0;
            seed = strtoull(v, &end, 10);
            bad = errno || end == v || *end || v[0] == '-';
        } else if (!strcmp(a, "--max-context")) {
            VAL();
            bad = parse_int(v, 1, INT_MAX, &max_ctx);
        } else if (!strcmp(a, "--batch")) {
            VAL();
            bad = parse_int(v, 1, 1 << 16, &batch);
        } else if (!strcmp(a, "--dump-logits")) {
            VAL();
            dump = v;
        } else if (!strcmp(a, "--trace")) {
            VAL();
            trace_path = v;
        } else if (!strcmp(a, "--metrics-file")) {
            VAL();
            metrics_path = v;
        } else if (!strcmp(a, "--numerics")) {
            VAL();
            shoal_numerics nc;
            bad = shoal_numerics_parse(v, &nc) != 0;
            if (!bad)
                shoal_kernels_set_numerics(nc);
        } else if (!strcmp(a, "--trunk-gb")) {
            VAL();
            bad = shoal_model_parse_trunk(v, &trunk_mode, &trunk_budget) != 0;
        } else if (!strcmp(a, "--trunk-no-direct")) {
            trunk_no_direct = 1;
        } else if (!strcmp(a, "--draft")) {
            VAL();
            bad = shoal_draft_parse_mode(v, &draft_mode) != 0;
        } else if (!strcmp(a, "--draft-max")) {
            VAL();
            bad = parse_int(v, 1, SHOAL_DRAFT_MAX_K, &draft_max);
        } else if (!strcmp(a, "--draft-ngram-min")) {
            VAL();
            bad = parse_int(v, 1, 64, &draft_ngram_min);
        } else if (!strcmp(a, "--draft-cost")) {
            VAL();
            bad = shoal_draft_parse_cost(v, &dcost) != 0;
        } else if (!strcmp(a, "--draft-ids")) {
            VAL();
            draft_ids_s = v;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--save-state")) {
            VAL();
            save_state = v;
        } else if (!strcmp(a, "--load-state")) {
            VAL();
            load_state = v;
        } else if (!strcmp(a, "--allow-special")) {
            allow_special = 1;
        } else if ((dr = shoal_dist_parse_arg(&dopts, "shoal run", argc, argv, &i)) != 0) {
            if (dr < 0)
                return 2;
        } else {
            shoal_suggest_unknown_flag("shoal run", a, usage);
            return 2;
        }
#undef VAL
        if (bad) {
            fprintf(stderr, "shoal run: bad value for %s: '%s'\n", a, v);
            return 2;
        }
    }
    if (!model || (!!ids_s + !!prompt + !!prompt_file) != 1) {
        fprintf(stderr, "shoal run: need --model and exactly one of --ids, --prompt, --prompt-file\n");
        usage(stderr);
        return 2;
    }
    if (shoal_dist_enabled(&dopts) < 0) {
        fprintf(stderr, "shoal run: --worker, --workers and --plan are exclusive\n");
        return 2;
    }
    shoal_log_set_role("C");
    char err[8192];
    /* the tokenizer: required for text prompts, optional (for the text of the
     * continuation) with --ids */
    shoal_tok *tok = NULL;
    const char *tok_dir = tokenizer_dir ? tokenizer_dir : model;
    int trc = shoal_tok_open(&tok, tok_dir, NULL, err, sizeof err);
    if (trc && (!ids_s || tokenizer_dir)) {
        fprintf(stderr, "shoal run: %s: tokenizer: %s: %s\n", tok_dir, shoal_strerror(trc), err);
        return 3;
    }
    if (tok) { /* it must be the model's vocabulary (size; K3's digest for K3's config) */
        shoal_k3cfg cfg;
        char cpath[PATH_MAX];
        snprintf(cpath, sizeof cpath, "%s/config.json", model);
        trc = shoal_k3cfg_load(&cfg, cpath, err, sizeof err);
        if (!trc)
            trc = shoal_tok_check_model(tok, tok_dir, cpath, cfg.vocab_size, err, sizeof err);
        if (trc) {
            fprintf(stderr, "shoal run: %s\n", err);
            shoal_tok_close(tok);
            return 3;
        }
    }
    int32_t *prompt_ids = NULL, *draft_script = NULL;
    int n_prompt = 0, n_draft_script = 0;
    if (draft_ids_s && parse_ids(draft_ids_s, &draft_script, &n_draft_script)) {
        fprintf(stderr, "shoal run: --draft-ids must be comma-separated non-negative integers\n");
        shoal_tok_close(tok);
        return 2;
    }
    if (ids_s) {
        if (parse_ids(ids_s, &prompt_ids, &n_prompt)) {
            fprintf(stderr, "shoal run: --ids must be comma-separated non-negative integers\n");
            shoal_tok_close(tok);
            return 2;
        }
    } else {
        char *text = NULL;
        size_t tlen = 0;
        if (prompt_file) {
            FILE *pf = fopen(prompt_file, "rb");
            if (!pf) {
                fprintf(stderr, "shoal run: %s: %s\n", prompt_file, strerror(errno));
                shoal_tok_close(tok);
                return 2;
            }
            size_t cap = 4096;
            text = shoal_xmalloc(cap);
            size_t r;
            while ((r = fread(text + tlen, 1, cap - tlen, pf)) > 0) {
                tlen += r;
                if (tlen == cap)
                    text = shoal_xrealloc(text, cap *= 2);
            }
            fclose(pf);
        } else {
            tlen = strlen(prompt);
            text = shoal_xmalloc(tlen + 1);
            memcpy(text, prompt, tlen);
        }
        shoal_tok_ids ti = {0};
        trc = shoal_tok_encode(tok, text, tlen, allow_special, &ti, err, sizeof err);
        free(text);
        if (trc || ti.n == 0) {
            fprintf(stderr, "shoal run: the prompt %s\n", trc ? err : "encodes to no tokens");
            shoal_tok_ids_free(&ti);
            shoal_tok_close(tok);
            return trc ? 4 : 2;
        }
        prompt_ids = ti.v; /* ownership moves here (malloc'd by the tokenizer) */
        n_prompt = (int)ti.n;
    }

    shoal_model_opts mo = {
        .max_context = max_ctx ? (int)max_ctx : n_prompt + (int)gen + 1,
        .max_batch = (int)batch,
        .threads = (int)threads,
        .quiet = json,
        .remote_experts = shoal_dist_enabled(&dopts),
        .trunk_mode = trunk_mode,
        .trunk_budget = trunk_budget,
        .trunk_no_direct = trunk_no_direct,
        .tokenizer_dir = tokenizer_dir,
    };
    shoal_model *m = NULL;
    int rc = shoal_model_open(&m, model, &mo, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal run: %s: %s\n%s\n", model, shoal_strerror(rc), err);
        free(prompt_ids);
        shoal_tok_close(tok);
        return 3;
    }
    if (shoal_dist_enabled(&dopts) && (rc = shoal_dist_start(&dist, &dopts, model, m, err, sizeof err))) {
        fprintf(stderr, "shoal run: expert workers: %s: %s\n", shoal_strerror(rc), err);
        shoal_model_close(m);
        free(prompt_ids);
        shoal_tok_close(tok);
        return shoal_err_exit_code(rc);
    }
    shoal_model_guard(m); /* a mapped file truncated under a read: one line naming it */
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    int status = 0;
    shoal_seq *seq = NULL;
    shoal_sampler *smp = NULL;
    float *logits = shoal_xmalloc(sizeof(float) * (size_t)info.vocab);
    int32_t *out_ids = shoal_xmalloc(sizeof(int32_t) * (size_t)(gen + 1));
    /* the whole sequence for the drafter: prompt, then every sampled id */
    int32_t *hist = shoal_xmalloc(sizeof(int32_t) * (size_t)(n_prompt + gen + 1));
    memcpy(hist, prompt_ids, sizeof(int32_t) * (size_t)n_prompt);
    shoal_spec *spec = NULL;
    shoal_spec_stats sst = {0};
    double *step_s = shoal_xmalloc(sizeof(double) * (size_t)(gen + 1));
    FILE *df = NULL;
    int n_out = 0;
    const char *stop = "length";
    double prefill_s = 0, decode_s = 0;
    int loaded = 0; /* prompt tokens that came from --load-state */
    shoal_model_stats ps = {0}, ds = {0};
    /* the continuation's text, when a tokenizer is loaded (specials as their
     * names; streamed to stdout in the text report); declared before the
     * first goto done, which reads them */
    shoal_detok *dt = NULL;
    char *otext = NULL;
    size_t otext_len = 0, otext_cap = 0;
    /* monitoring: per-phase time (always) and the routing trace (--trace) */
    shoal_cmetrics *cm = NULL;
    shoal_trace *tr = NULL;
    shoal_cmetrics_totals cm_prefill = {0};
    shoal_cmetrics_opts cmo = {.num_layers = info.cfg->num_layers, .is_moe = info.cfg->is_moe,
                               .num_experts = info.cfg->num_experts, .expert_bytes = info.expert_bytes,
                               .max_workers = shoal_dist_nworkers(dist)};
    if ((rc = shoal_cmetrics_open(&cm, &cmo, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 4;
        goto done;
    }
    if ((rc = shoal_dist_set_metrics(dist, cm, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 4;
        goto done;
    }
    if (trace_path) {
        shoal_trace_hdr th = {.num_layers = (uint32_t)info.cfg->num_layers,
                              .num_experts = (uint32_t)info.cfg->num_experts,
                              .k = (uint32_t)info.cfg->experts_per_token};
        /* the fingerprint names the model the trace belongs to; a coordinator
         * without the expert tensors writes zeros (unknown) */
        if (shoal_fprint_model(th.fingerprint, info.cfg, shoal_model_store(m), err, sizeof err))
            memset(th.fingerprint, 0, sizeof th.fingerprint);
        if ((rc = shoal_trace_create(&tr, trace_path, &th, err, sizeof err))) {
            fprintf(stderr, "shoal run: %s\n", err);
            status = 2;
            goto done;
        }
    }
    shoal_model_set_monitor(m, cm, tr);
    if (tok) {
        shoal_detok_opts dto = {.skip_special = 0};
        if (shoal_detok_open(&dt, tok, &dto))
            dt = NULL;
    }

    for (int i = 0; i < n_prompt; i++)
        if (prompt_ids[i] >= info.vocab) {
            fprintf(stderr, "shoal run: prompt id %d (index %d) is outside the vocabulary [0, %d)\n",
                    (int)prompt_ids[i], i, info.vocab);
            status = 2;
            goto done;
        }
    for (int i = 0; i < n_draft_script; i++)
        if (draft_script[i] >= info.vocab) {
            fprintf(stderr, "shoal run: --draft-ids id %d (index %d) is outside the vocabulary [0, %d)\n",
                    (int)draft_script[i], i, info.vocab);
            status = 2;
            goto done;
        }
    if (n_prompt + gen > mo.max_context) {
        fprintf(stderr, "shoal run: prompt (%d) + gen (%ld) exceeds --max-context %d\n", n_prompt, gen,
                mo.max_context);
        status = 2;
        goto done;
    }
    if ((rc = shoal_seq_create(&seq, m, 0, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 4;
        goto done;
    }
    shoal_sampler_opts so = {.temperature = (float)temp, .top_p = (float)top_p, .top_k = (int)top_k, .seed = seed};
    if ((rc = shoal_sampler_create(&smp, &so, info.vocab, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 2;
        goto done;
    }
    {
        shoal_draft_opts dop = {.mode = draft_script ? SHOAL_DRAFT_SCRIPT : draft_mode,
                                .max = (int)draft_max,
                                .ngram_min = (int)draft_ngram_min,
                                .ngram_max = draft_ngram_min > 16 ? (int)draft_ngram_min : 0,
                                .fixed = draft_script != NULL,
                                .cost = dcost.cost,
                                .cost0 = dcost.cost0,
                                .script = draft_script,
                                .n_script = n_draft_script};
        if ((rc = shoal_spec_create(&spec, seq, &dop, err, sizeof err))) {
            fprintf(stderr, "shoal run: %s\n", err);
            status = 2;
            goto done;
        }
    }
    if (dump && !(df = fopen(dump, "wb"))) {
        fprintf(stderr, "shoal run: %s: %s\n", dump, strerror(errno));
        status = 2;
        goto done;
    }

    uint8_t state_fp[SHOAL_PCACHE_FP_BYTES];
    if ((save_state || load_state) && (rc = shoal_pcache_fingerprint(state_fp, m, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 3;
        goto done;
    }
    if (load_state) {
        shoal_pcache_file *sf = NULL;
        rc = shoal_pcache_file_read(&sf, load_state, state_fp, info.seq_fixed_bytes, info.seq_bytes_per_token, err,
                                    sizeof err);
        if (!rc && ((int)sf->h.n_ids > n_prompt || memcmp(sf->ids, prompt_ids, 4 * (size_t)sf->h.n_ids)))
            rc = shoal_err_set(err, sizeof err, SHOAL_EINVAL, "state file %s: its %u ids are not a prefix of the prompt",
                               load_state, sf->h.n_ids);
        if (!rc && (int)sf->h.n_ids == n_prompt && sf->h.n_logits != (uint32_t)info.vocab)
            rc = shoal_err_set(err, sizeof err, SHOAL_EINVAL,
                               "state file %s holds the whole prompt but not its logits (a prefix cache file): "
                               "add a token to the prompt",
                               load_state);
        if (!rc)
            rc = shoal_seq_import(seq, (int)sf->h.n_ids, sf->state, (size_t)sf->h.state_bytes, err, sizeof err);
        if (!rc) {
            loaded = (int)sf->h.n_ids;
            if (loaded == n_prompt)
                memcpy(logits, sf->logits, sizeof(float) * (size_t)info.vocab);
        }
        shoal_pcache_file_free(sf);
        if (rc) {
            fprintf(stderr, "shoal run: %s\n", err);
            status = rc == SHOAL_EINVAL ? 2 : 3;
            goto done;
        }
        if (!json)
            printf("state: %d prompt tokens from %s\n", loaded, load_state);
    }
    double t0 = now_s();
    rc = loaded < n_prompt ? shoal_seq_prefill(seq, prompt_ids + loaded, n_prompt - loaded, SHOAL_LOGITS_LAST,
                                               logits, err, sizeof err)
                           : 0;
    prefill_s = now_s() - t0;
    if (!rc && save_state) {
        size_t sb = shoal_seq_state_size(m, n_prompt);
        void *buf = shoal_xmalloc(sb);
        rc = shoal_seq_export(seq, buf, sb, err, sizeof err);
        if (!rc)
            rc = shoal_pcache_file_write(save_state, state_fp, prompt_ids, n_prompt, buf, sb, logits, info.vocab, err,
                                         sizeof err);
        free(buf);
        if (rc) {
            fprintf(stderr, "shoal run: --save-state: %s\n", err);
            status = 4;
            goto done;
        }
    }
    shoal_model_get_stats(m, &ps);
    shoal_model_reset_stats(m);
    shoal_dist_mark(dist, "prefill", n_prompt);
    shoal_cmetrics_get_totals(cm, &cm_prefill);
    if (rc) {
        fprintf(stderr, "shoal run: prefill failed: %s: %s\n", shoal_strerror(rc), err);
        status = rc == SHOAL_EMODEL ? 3 : 4; /* e.g. non-finite logits: the model is invalid */
        goto done;
    }
    if (!json) {
        printf("prompt: %d tokens\ncontinuation: ", n_prompt);
        fflush(stdout);
    }
    shoal_spec_begin(spec);
    for (int step = 0; step < gen; step++) {
        if (df && fwrite(logits, sizeof(float), (size_t)info.vocab, df) != (size_t)info.vocab) {
            fprintf(stderr, "shoal run: %s: write failed\n", dump);
            status = 4;
            goto done;
        }
        uint64_t ts0 = shoal_metrics_now_ns();
        int32_t id = shoal_sampler_sample(smp, logits);
        shoal_cmetrics_add_phase(cm, SHOAL_PHASE_SAMPLING, shoal_metrics_now_ns() - ts0);
        out_ids[n_out++] = id;
        if (dt) {
            const char *piece;
            size_t plen;
            if (shoal_detok_feed(dt, id, &piece, &plen) == 0)
                append_text(&otext, &otext_len, &otext_cap, piece, plen, !json);
        }
        int is_eos = 0;
        for (int e = 0; e < info.n_eos; e++)
            is_eos |= info.eos[e] == id;
        if (is_eos) {
            stop = "eos";
            break;
        }
        if (step + 1 == gen)
            break;
        double s0 = now_s();
        /* plain decoding's logits, bit for bit, drafted ahead when it pays */
        hist[n_prompt + n_out - 1] = id;
        rc = shoal_spec_decode(spec, hist, n_prompt + n_out, (int)gen - n_out - 1, logits, err, sizeof err);
        step_s[n_out - 1] = now_s() - s0;
        decode_s += step_s[n_out - 1];
        if (rc) {
            fprintf(stderr, "shoal run: decode step %d failed: %s: %s\n", step + 1, shoal_strerror(rc), err);
            status = rc == SHOAL_EMODEL ? 3 : 4;
            goto done;
        }
    }
    shoal_model_get_stats(m, &ds);
    if (spec && (rc = shoal_spec_settle(spec, err, sizeof err))) {
        fprintf(stderr, "shoal run: %s\n", err);
        status = 4;
    }

done:;
    if (spec)
        shoal_spec_get_stats(spec, &sst);
    shoal_model_set_monitor(m, NULL, NULL);
    if (metrics_path && cm) {
        shoal_metrics_buf mb = {0};
        shoal_cmetrics_write(cm, &mb);
        FILE *mf = fopen(metrics_path, "w");
        int bad = !mf || fwrite(mb.p, 1, mb.len, mf) != mb.len;
        if (mf && fclose(mf))
            bad = 1;
        if (bad) {
            fprintf(stderr, "shoal run: %s: cannot write the metrics\n", metrics_path);
            if (!status)
                status = 4;
        }
        shoal_metrics_buf_free(&mb);
    }
    if (tr) {
        uint64_t nrec = shoal_trace_count(tr);
        if (shoal_trace_close(tr, err, sizeof err)) {
            fprintf(stderr, "shoal run: %s\n", err);
            if (!status)
                status = 4;
        } else if (!json) {
            fprintf(stderr, "shoal run: trace %s: %llu routing records\n", trace_path, (unsigned long long)nrec);
        }
    }
    if (dt) {
        const char *piece;
        size_t plen;
        shoal_detok_flush(dt, &piece, &plen);
        append_text(&otext, &otext_len, &otext_cap, piece, plen, !json);
    }
    if (!json && status != 2) {
        printf("%s\n", dt ? "" : "(no tokenizer: ids below)");
        fflush(stdout);
    }
    /* decode steps: tokens fed back (a drafted token that was rejected ran
     * through the forward but is no step) */
    int n_steps = (int)sst.fed;
    if (ps.tokens)
        shoal_dist_mark(dist, "decode", n_steps);
    double prefill_tps = prefill_s > 0 ? (n_prompt - loaded) / prefill_s : 0;
    double decode_tps = decode_s > 0 ? n_steps / decode_s : 0;
    double wb_decode = n_steps ? (double)(ds.trunk_bytes + ds.expert_bytes) / n_steps : 0;
    double wb_prefill = ps.tokens ? (double)(ps.trunk_bytes + ps.expert_bytes) / (double)ps.tokens : 0;
    uint64_t rss = peak_rss_bytes(), hwm = shoal_memplan_peak_rss();
    {
        char r1[32], r2[32];
        SHOAL_INFO("peak resident memory: %s (getrusage ru_maxrss), %s (VmHWM)", shoal_memplan_fmt(rss, r1, sizeof r1),
                   shoal_memplan_fmt(hwm, r2, sizeof r2));
    }
    if (status == 0 || status == 4) {
        if (json) {
            json_t *o = json_object();
            json_t *pa = json_array(), *ga = json_array(), *sa = json_array();
            for (int i = 0; i < n_prompt; i++)
                json_array_append_new(pa, json_integer(prompt_ids[i]));
            for (int i = 0; i < n_out; i++)
                json_array_append_new(ga, json_integer(out_ids[i]));
            for (int i = 0; i < n_steps; i++)
                json_array_append_new(sa, json_real(step_s[i] * 1e3));
            json_object_set_new(o, "prompt_ids", pa);
            json_object_set_new(o, "generated_ids", ga);
            if (dt)
                json_object_set_new(o, "text", json_stringn(otext ? otext : "", otext_len));
            json_object_set_new(o, "stop_reason", json_string(status ? "error" : stop));
            json_object_set_new(o, "prefill_tokens", json_integer(n_prompt - loaded));
            json_object_set_new(o, "state_loaded_tokens", json_integer(loaded));
            json_object_set_new(o, "prefill_s", json_real(prefill_s));
            json_object_set_new(o, "prefill_tokens_per_s", json_real(prefill_tps));
            json_object_set_new(o, "decode_tokens", json_integer(n_steps));
            json_object_set_new(o, "decode_s", json_real(decode_s));
            json_object_set_new(o, "decode_tokens_per_s", json_real(decode_tps));
            json_object_set_new(o, "decode_step_ms", sa);
            json_object_set_new(o, "decode_weight_bytes_per_token", json_real(wb_decode));
            json_object_set_new(o, "prefill_weight_bytes_per_token", json_real(wb_prefill));
            /* remote trunk round trips (--trunk remote): one per fused step of a layer */
            json_object_set_new(o, "decode_trunk_round_trips_per_token",
                                json_real(n_steps ? (double)ds.rmat_requests / n_steps : 0.0));
            json_object_set_new(o, "prefill_trunk_round_trips", json_integer((json_int_t)ps.rmat_requests));
            json_object_set_new(o, "seq_state_bytes_per_token", json_integer((json_int_t)info.seq_bytes_per_token));
            json_object_set_new(o, "seq_state_fixed_bytes", json_integer((json_int_t)info.seq_fixed_bytes));
            json_object_set_new(o, "scratch_bytes", json_integer((json_int_t)info.scratch_bytes));
            json_object_set_new(o, "max_context", json_integer(info.max_context));
            json_object_set_new(o, "max_batch", json_integer(info.max_batch));
            json_object_set_new(o, "peak_rss_bytes", json_integer((json_int_t)rss));
            json_object_set_new(o, "peak_vmhwm_bytes", json_integer((json_int_t)hwm));
            if (info.trunk_mode != SHOAL_TRUNK_MAPPED) {
                json_t *tj = json_object();
                json_object_set_new(tj, "budget_bytes", json_integer((json_int_t)info.trunk_budget));
                json_object_set_new(tj, "min_bytes", json_integer((json_int_t)info.trunk_min_bytes));
                json_object_set_new(tj, "full_bytes", json_integer((json_int_t)info.trunk_full_bytes));
                json_object_set_new(tj, "resident_bytes", json_integer((json_int_t)info.trunk_resident_bytes));
                json_object_set_new(tj, "buffer_bytes", json_integer((json_int_t)info.trunk_buffer_bytes));
                json_object_set_new(tj, "streamed_bytes_per_forward", json_integer((json_int_t)info.trunk_stream_bytes));
                json_object_set_new(tj, "units", json_integer(info.trunk_units));
                json_object_set_new(tj, "units_resident", json_integer(info.trunk_units_resident));
                json_object_set_new(tj, "direct", json_boolean(info.trunk_direct));
                json_object_set_new(tj, "prefill_read_bytes", json_integer((json_int_t)ps.trunk_read_bytes));
                json_object_set_new(tj, "decode_read_bytes_per_token",
                                    json_real(n_steps ? (double)ds.trunk_read_bytes / n_steps : 0));
                json_object_set_new(tj, "decode_stall_s", json_real(ds.trunk_stall_s));
                json_object_set_new(o, "trunk", tj);
            }
            {
                json_t *dj = json_object();
                json_object_set_new(dj, "mode", json_string(draft_script ? "ids" : draft_mode ? "ngram" : "off"));
                json_object_set_new(dj, "max", json_integer(draft_max));
                json_object_set_new(dj, "drafted", json_integer((json_int_t)sst.drafted));
                json_object_set_new(dj, "accepted", json_integer((json_int_t)sst.accepted));
                json_object_set_new(dj, "acceptance",
                                    json_real(sst.drafted ? (double)sst.accepted / (double)sst.drafted : 0.0));
                json_object_set_new(dj, "passes", json_integer((json_int_t)sst.passes));
                json_object_set_new(dj, "verifies", json_integer((json_int_t)sst.verifies));
                json_object_set_new(dj, "passes_per_token",
                                    json_real(sst.fed ? (double)sst.passes / (double)sst.fed : 0.0));
                json_object_set_new(dj, "rewinds", json_integer((json_int_t)sst.rewinds));
                json_object_set_new(dj, "shadowed", json_integer((json_int_t)sst.shadowed));
                json_object_set_new(dj, "shadow_hits", json_integer((json_int_t)sst.shadow_hits));
                json_object_set_new(dj, "k_now", json_integer(spec ? shoal_spec_k(spec) : 0));
                json_object_set_new(dj, "rewind_s", json_real(sst.rewind_s));
                json_object_set_new(dj, "forward_tokens", json_integer((json_int_t)ds.tokens));
                json_object_set_new(o, "draft", dj);
            }
            json_object_set_new(o, "threads", json_integer(omp_get_max_threads()));
            json_object_set_new(o, "isa", json_string(shoal_isa_name(shoal_kernels_isa())));
            /* the numerics class (--numerics) and where the matrix-unit-order kernels run (AMX only
             * after its self-test) */
            json_object_set_new(o, "numerics", json_string(shoal_numerics_name(shoal_kernels_numerics())));
            json_object_set_new(o, "mu_path", json_string(shoal_kernels_mu_engine()));
            shoal_dist_json(dist, o);
            if (ps.prefetch_hinted || ds.prefetch_hinted) {
                json_t *pf = json_object();
                const shoal_model_stats *st[2] = {&ps, &ds};
                for (int i = 0; i < 2; i++) {
                    json_t *x = json_object();
                    json_object_set_new(x, "hinted", json_integer((json_int_t)st[i]->prefetch_hinted));
                    json_object_set_new(x, "hinted_used", json_integer((json_int_t)st[i]->prefetch_hinted_used));
                    json_object_set_new(x, "used", json_integer((json_int_t)st[i]->prefetch_used));
                    json_object_set_new(pf, i ? "decode" : "prefill", x);
                }
                json_object_set_new(o, "prefetch_hints", pf);
            }
            if (cm) {
                /* decode only: totals since the end of the prefill */
                shoal_cmetrics_totals ct;
                shoal_cmetrics_get_totals(cm, &ct);
                json_t *ph = json_object();
                uint64_t nt = ct.tokens - cm_prefill.tokens;
                for (int p = 0; p < SHOAL_PHASE_COUNT; p++)
                    json_object_set_new(ph, shoal_cmetrics_phase_name(p),
                                        json_real(nt ? (ct.phase_s[p] - cm_prefill.phase_s[p]) * 1e3 / (double)nt : 0));
                json_object_set_new(o, "decode_phase_ms_per_token", ph);
            }
            char *s = json_dumps(o, JSON_COMPACT);
            printf("%s\n", s);
            free(s);
            json_decref(o);
        } else {
            printf("\nprompt ids:");
            for (int i = 0; i < n_prompt; i++)
                printf(" %d", (int)prompt_ids[i]);
            printf("\ngenerated ids:");
            for (int i = 0; i < n_out; i++)
                printf(" %d", (int)out_ids[i]);
            printf("\n\n-- run report --\n");
            printf("stop: %s\n", status ? "error" : stop);
            printf("prefill: %d tokens in %.3f s = %.2f tokens/s, %.0f weight bytes read per prompt token\n",
                   n_prompt - loaded, prefill_s, prefill_tps, wb_prefill);
            printf("decode: %d steps in %.3f s = %.3f tokens/s, %.0f weight bytes touched per token\n", n_steps,
                   decode_s, decode_tps, wb_decode);
            if (n_steps) {
                qsort(step_s, (size_t)n_steps, sizeof(double), cmp_double);
                printf("decode step ms: min %.2f median %.2f max %.2f\n", step_s[0] * 1e3,
                       step_s[n_steps / 2] * 1e3, step_s[n_steps - 1] * 1e3);
            }
            printf("sequence state: %zu B fixed + %zu B per token\n", info.seq_fixed_bytes,
                   info.seq_bytes_per_token);
            printf("peak RSS: %llu B (%.1f MiB), VmHWM %llu B\n", (unsigned long long)rss, (double)rss / (1 << 20),
                   (unsigned long long)hwm);
            if (info.trunk_mode != SHOAL_TRUNK_MAPPED)
                printf("trunk: budget %llu B, resident %llu B, buffers %llu B, %.0f bytes read from disk per "
                       "decoded token, %.3f s waiting for reads in decode\n",
                       (unsigned long long)info.trunk_budget, (unsigned long long)info.trunk_resident_bytes,
                       (unsigned long long)info.trunk_buffer_bytes,
                       n_steps ? (double)ds.trunk_read_bytes / n_steps : 0.0, ds.trunk_stall_s);
            printf("kernels: %s, %d threads, numerics %s (mu path %s)\n", shoal_isa_name(shoal_kernels_isa()),
                   omp_get_max_threads(), shoal_numerics_name(shoal_kernels_numerics()), shoal_kernels_mu_engine());
            shoal_dist_print(dist, stdout);
            if (ps.prefetch_hinted || ds.prefetch_hinted) {
                const shoal_model_stats *st[2] = {&ps, &ds};
                for (int i = 0; i < 2; i++)
                    if (st[i]->prefetch_hinted)
                        printf("%s prefetch hints: %llu experts hinted, %llu of them used (%.1f%%), covering %.1f%% "
                               "of the %llu experts the hinted layers used\n",
                               i ? "decode" : "prefill", (unsigned long long)st[i]->prefetch_hinted,
                               (unsigned long long)st[i]->prefetch_hinted_used,
                               100.0 * (double)st[i]->prefetch_hinted_used / (double)st[i]->prefetch_hinted,
                               st[i]->prefetch_used
                                   ? 100.0 * (double)st[i]->prefetch_hinted_used / (double)st[i]->prefetch_used
                                   : 0.0,
                               (unsigned long long)st[i]->prefetch_used);
            }
            if (cm) {
                printf("decode ");
                shoal_cmetrics_report(cm, stdout, &cm_prefill);
            }
        }
    }
    if (spec && sst.fed)
        fprintf(stderr,
                "shoal run: draft %s: %llu drafted, %llu accepted (%.1f%%), %llu passes for %llu tokens (%.3f per "
                "token), %llu rewinds (%.3f ms)\n",
                draft_script ? "ids" : draft_mode ? "ngram" : "off", (unsigned long long)sst.drafted,
                (unsigned long long)sst.accepted, sst.drafted ? 100.0 * (double)sst.accepted / (double)sst.drafted : 0.0,
                (unsigned long long)sst.passes, (unsigned long long)sst.fed, (double)sst.passes / (double)sst.fed,
                (unsigned long long)sst.rewinds, sst.rewind_s * 1e3);
    if (df)
        fclose(df);
    shoal_detok_close(dt);
    shoal_tok_close(tok);
    free(otext);
    shoal_sampler_free(smp);
    shoal_spec_free(spec);
    shoal_seq_free(seq);
    shoal_model_guard(NULL);
    shoal_model_close(m); /* closes the expert client */
    shoal_dist_stop(dist);
    shoal_cmetrics_close(cm);
    free(logits);
    free(out_ids);
    free(step_s);
    free(prompt_ids);
    free(hist);
    free(draft_script);
    return status;
}

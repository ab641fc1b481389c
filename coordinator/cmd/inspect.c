/* `shoal inspect`: the config summary, the layer schedule and, with weights,
 * the inventory check of every tensor the engine needs (common/k3schema.h).
 *
 *   shoal inspect [--json] MODEL_DIR              config.json + weights
 *   shoal inspect [--json] --config CONFIG_JSON [MODEL_DIR]
 *   shoal inspect [--json] FILE.safetensors | INDEX.json   weights alone
 *
 * Exit codes (cli/main.c): 0 ok, 2 usage error, 3 invalid model or config
 * (including an incomplete inventory). Problems go to stderr, one per line;
 * the report goes to stdout. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/suggest.h"
#include "cli/commands.h"
#include "common/err.h"
#include "common/k3cfg.h"
#include "common/k3schema.h"
#include "common/st.h"

#define EXIT_USAGE 2
#define EXIT_INVALID 3
#define JSON_MAX_PROBLEMS 1000

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal inspect [--json] MODEL_DIR\n"
            "       shoal inspect [--json] --config CONFIG_JSON [MODEL_DIR]\n"
            "       shoal inspect [--json] FILE.safetensors | model.safetensors.index.json\n"
            "\n"
            "Prints the K3 config summary, the layer schedule (0-indexed) and, when weights\n"
            "are given, checks that every tensor the engine needs is present with the right\n"
            "dtype and shape (listing every missing or mismatched one), with bytes per class.\n"
            "Vision tensors are counted and ignored.\n"
            "\n"
            "  --json   machine-readable output (fields include num_layers, kda_layers,\n"
            "           mla_layers, moe_layers, num_experts, experts_per_token, bytes, inventory)\n"
            "\n"
            "exit codes: 0 ok, 2 usage error, 3 invalid model or config\n");
}

typedef struct {
    json_t *problems; /* JSON mode: array (capped) */
    uint64_t n;
    int json;
} problem_sink;

static void on_problem(const char *line, void *ctx)
{
    problem_sink *ps = ctx;
    ps->n++;
    if (ps->json) {
        if (ps->n <= JSON_MAX_PROBLEMS)
            json_array_append_new(ps->problems, json_string(line));
    } else {
        printf("  %s\n", line);
    }
}

static json_t *layer_list(const shoal_k3cfg *c, int which)
{
    json_t *a = json_array();
    for (int L = 0; L < c->num_layers; L++) {
        int in = which == 0   ? c->attn[L] == SHOAL_ATTN_KDA
                 : which == 1 ? c->attn[L] == SHOAL_ATTN_MLA
                 : which == 2 ? c->is_moe[L]
                 : which == 3 ? !c->is_moe[L]
                              : c->block_start[L];
        if (in)
            json_array_append_new(a, json_integer(L));
    }
    return a;
}

/* "0,1,2,4" with runs compressed: "1-92". */
static void print_list(const char *label, const shoal_k3cfg *c, int which)
{
    json_t *a = layer_list(c, which);
    size_t n = json_array_size(a);
    printf("  %-13s", label);
    if (!n)
        printf("(none)");
    for (size_t i = 0; i < n;) {
        long long s = json_integer_value(json_array_get(a, i)), e = s;
        size_t j = i + 1;
        while (j < n && json_integer_value(json_array_get(a, j)) == e + 1)
            e = json_integer_value(json_array_get(a, j++));
        if (e - s >= 2)
            printf("%s%lld-%lld", i ? "," : "", s, e);
        else
            for (long long x = s; x <= e; x++)
                printf("%s%lld", i || x > s ? "," : "", x);
        i = j;
    }
    printf("  (%zu)\n", n);
    json_decref(a);
}

static void human_bytes(char *b, size_t n, uint64_t v)
{
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = (double)v;
    int k = 0;
    while (x >= 1024 && k < 4) {
        x /= 1024;
        k++;
    }
    snprintf(b, n, k ? "%llu B (%.2f %s)" : "%llu B", (unsigned long long)v, x, u[k]);
}

static void print_config(const char *cfg_path, const shoal_k3cfg *c)
{
    printf("config: %s\n", cfg_path);
    printf("  model_type %s%s, dtype %s, vocab %d, hidden %d, layers %d, rms_norm_eps %g, max_position %d\n",
           c->model_type, strcmp(c->model_type, "kimi_k3") ? " (flat)" : " (nested, text kimi_linear)", c->dtype,
           c->vocab_size, c->hidden_size, c->num_layers, (double)c->rms_norm_eps, c->max_position);
    printf("  KDA: %d layers, %d heads x %d, conv %d, gate %s", c->num_kda, c->kda_heads, c->kda_head_dim,
           c->conv_kernel, c->gate == SHOAL_GATE_LOWER_BOUND ? "lower-bound sigmoid" : "softplus");
    if (c->gate == SHOAL_GATE_LOWER_BOUND)
        printf(" (gate_lower_bound %g)", (double)c->gate_lower_bound);
    printf("\n  MLA: %d layers, %d heads, q_lora %d, kv_lora %d, nope %d, rope %d, v %d (NoPE, output gate)\n",
           c->num_mla, c->mla_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_nope_dim, c->qk_rope_dim,
           c->v_head_dim);
    printf("  MoE: %d layers, %d experts, top-%d, %d shared (width %d), expert width %d, latent %d%s, "
           "renormalize %s, scaling %g\n",
           c->num_moe, c->num_experts, c->experts_per_token, c->num_shared_experts,
           c->num_shared_experts * c->moe_intermediate_size, c->moe_intermediate_size, c->latent_size,
           c->latent_norm ? " (normed)" : "", c->renormalize ? "yes" : "no", (double)c->routed_scaling);
    if (c->expert_format == SHOAL_EXPERTS_MXFP4)
        printf("  experts: MXFP4 (compressed-tensors mxfp4-pack-quantized, group %d)\n", c->expert_group_size);
    else
        printf("  experts: unquantized (no quantization_config)\n");
    printf("  dense MLP: intermediate %d (first_k_dense_replace %d, moe_layer_freq %d)\n", c->intermediate_size,
           c->first_k_dense, c->moe_layer_freq);
    printf("  SiTU beta %g / linear beta %g; AttnRes block size %d\n", (double)c->situ_beta,
           (double)c->situ_linear_beta, c->attn_res_block_size);
    printf("  tokens: bos %d, eos %d, pad %d\n", c->bos_token_id, c->eos_token_id, c->pad_token_id);
    printf("schedule (0-indexed):\n");
    print_list("kda_layers", c, 0);
    print_list("mla_layers", c, 1);
    print_list("dense_layers", c, 3);
    print_list("moe_layers", c, 2);
    print_list("block_starts", c, 4);
}

static void print_layer_table(const shoal_k3cfg *c, const uint64_t *layer_bytes, const uint64_t *expert_bytes)
{
    printf("  %5s  %-4s %-5s %-5s  %15s  %17s\n", "layer", "attn", "mlp", "block", "trunk_bytes", "expert_bytes");
    for (int L = 0; L < c->num_layers; L++)
        printf("  %5d  %-4s %-5s %-5s  %15llu  %17llu\n", L, c->attn[L] == SHOAL_ATTN_MLA ? "MLA" : "KDA",
               c->is_moe[L] ? "moe" : "dense", c->block_start[L] ? "start" : "", (unsigned long long)layer_bytes[L],
               (unsigned long long)expert_bytes[L]);
}

static json_t *bytes_json(uint64_t global, uint64_t layers, uint64_t experts, uint64_t per_expert,
                          const shoal_k3cfg *c, const uint64_t *lb, const uint64_t *eb)
{
    json_t *b = json_object();
    json_object_set_new(b, "global", json_integer((json_int_t)global));
    json_object_set_new(b, "layers", json_integer((json_int_t)layers));
    json_object_set_new(b, "trunk", json_integer((json_int_t)(global + layers)));
    json_object_set_new(b, "routed_experts", json_integer((json_int_t)experts));
    json_object_set_new(b, "per_expert", json_integer((json_int_t)per_expert));
    json_t *pl = json_array(), *pe = json_array();
    for (int L = 0; L < c->num_layers; L++) {
        json_array_append_new(pl, json_integer((json_int_t)lb[L]));
        json_array_append_new(pe, json_integer((json_int_t)eb[L]));
    }
    json_object_set_new(b, "per_layer_trunk", pl);
    json_object_set_new(b, "per_layer_experts", pe);
    return b;
}

static json_t *config_json(const shoal_k3cfg *c)
{
    json_t *o = json_object();
    json_object_set_new(o, "model_type", json_string(c->model_type));
    json_object_set_new(o, "dtype", json_string(c->dtype));
    json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(o, "hidden_size", json_integer(c->hidden_size));
    json_object_set_new(o, "num_layers", json_integer(c->num_layers));
    json_object_set_new(o, "kda_layers", layer_list(c, 0));
    json_object_set_new(o, "mla_layers", layer_list(c, 1));
    json_object_set_new(o, "moe_layers", layer_list(c, 2));
    json_object_set_new(o, "dense_layers", layer_list(c, 3));
    json_object_set_new(o, "block_starts", layer_list(c, 4));
    json_object_set_new(o, "num_experts", json_integer(c->num_experts));
    json_object_set_new(o, "experts_per_token", json_integer(c->experts_per_token));
    json_object_set_new(o, "num_shared_experts", json_integer(c->num_shared_experts));
    json_object_set_new(o, "kda_heads", json_integer(c->kda_heads));
    json_object_set_new(o, "kda_head_dim", json_integer(c->kda_head_dim));
    json_object_set_new(o, "mla_heads", json_integer(c->mla_heads));
    json_object_set_new(o, "gate", json_string(c->gate == SHOAL_GATE_LOWER_BOUND ? "lower_bound" : "softplus"));
    if (c->gate == SHOAL_GATE_LOWER_BOUND)
        json_object_set_new(o, "gate_lower_bound", json_real(c->gate_lower_bound));
    json_object_set_new(o, "expert_format",
                        json_string(c->expert_format == SHOAL_EXPERTS_MXFP4 ? "mxfp4" : "unquantized"));
    json_object_set_new(o, "expert_group_size", json_integer(c->expert_group_size));
    json_object_set_new(o, "attn_res_block_size", json_integer(c->attn_res_block_size));
    return o;
}

static int is_dir(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Weights without a config: validate the store and summarise it. */
static int inspect_store_only(const char *path, int as_json)
{
    shoal_st *st = NULL;
    char err[2048];
    shoal_st_opts o = {.map = 0};
    if (shoal_st_open(&st, path, &o, err, sizeof err)) {
        fprintf(stderr, "shoal inspect: %s\n", err);
        return EXIT_INVALID;
    }
    uint64_t bytes[SHOAL_DT_COUNT] = {0}, count[SHOAL_DT_COUNT] = {0}, vis = 0;
    for (size_t i = 0; i < shoal_st_count(st); i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        bytes[t->dtype] += t->nbytes;
        count[t->dtype]++;
        vis += shoal_k3schema_is_vision(t->name);
    }
    if (as_json) {
        json_t *r = json_object(), *d = json_object();
        json_object_set_new(r, "path", json_string(path));
        json_object_set_new(r, "files", json_integer(shoal_st_nfiles(st)));
        json_object_set_new(r, "tensors", json_integer((json_int_t)shoal_st_count(st)));
        json_object_set_new(r, "vision_tensors", json_integer((json_int_t)vis));
        for (int k = 0; k < SHOAL_DT_COUNT; k++)
            if (count[k]) {
                json_t *e = json_object();
                json_object_set_new(e, "count", json_integer((json_int_t)count[k]));
                json_object_set_new(e, "bytes", json_integer((json_int_t)bytes[k]));
                json_object_set_new(d, shoal_dtype_name((shoal_dtype)k), e);
            }
        json_object_set_new(r, "dtypes", d);
        char *s = json_dumps(r, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
        puts(s);
        free(s);
        json_decref(r);
    } else {
        printf("weights: %s: %d file(s), %zu tensors (%llu vision), headers valid\n", path, shoal_st_nfiles(st),
               shoal_st_count(st), (unsigned long long)vis);
        for (int k = 0; k < SHOAL_DT_COUNT; k++)
            if (count[k]) {
                char hb[64];
                human_bytes(hb, sizeof hb, bytes[k]);
                printf("  %-8s %8llu tensors  %s\n", shoal_dtype_name((shoal_dtype)k), (unsigned long long)count[k],
                       hb);
            }
        printf("  (no config: pass MODEL_DIR with config.json, or --config, for the inventory check)\n");
    }
    shoal_st_close(st);
    return 0;
}

int shoal_cmd_inspect(int argc, char **argv)
{
    const char *cfg_path = NULL, *model = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--json")) {
            as_json = 1;
        } else if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc || cfg_path) {
                fprintf(stderr, "shoal inspect: --config needs one CONFIG_JSON\n");
                usage(stderr);
                return EXIT_USAGE;
            }
            cfg_path = argv[++i];
        } else if (argv[i][0] == '-' && argv[i][1]) {
            shoal_suggest_unknown_flag("shoal inspect", argv[i], usage);
            return EXIT_USAGE;
        } else if (!model) {
            model = argv[i];
        } else {
            fprintf(stderr, "shoal inspect: more than one model path ('%s', '%s')\n", model, argv[i]);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (!cfg_path && !model) {
        usage(stderr);
        return EXIT_USAGE;
    }
    char cfg_buf[4096];
    if (!cfg_path) {
        if (!is_dir(model))
            return inspect_store_only(model, as_json);
        snprintf(cfg_buf, sizeof cfg_buf, "%s/config.json", model);
        cfg_path = cfg_buf;
    }

    shoal_k3cfg *c = shoal_xcalloc(1, sizeof *c);
    char err[16384];
    int rc = shoal_k3cfg_load(c, cfg_path, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal inspect: invalid config (%s):\n%s\n", shoal_strerror(rc), err);
        free(c);
        return EXIT_INVALID;
    }
    shoal_k3schema_totals *tot = shoal_xcalloc(1, sizeof *tot);
    shoal_k3schema_sum(c, tot);

    shoal_st *st = NULL;
    shoal_k3schema_report *rep = NULL;
    problem_sink ps = {.json = as_json, .problems = json_array()};
    int status = 0;
    char ierr[2048] = "";
    if (model) {
        shoal_st_opts o = {.map = 0};
        rc = shoal_st_open(&st, model, &o, err, sizeof err);
        if (rc) {
            fprintf(stderr, "shoal inspect: invalid weights: %s\n", err);
            free(tot);
            free(c);
            json_decref(ps.problems);
            return EXIT_INVALID;
        }
    }
    if (!as_json) {
        print_config(cfg_path, c);
        char a[64], b[64], d[64], e[64];
        human_bytes(a, sizeof a, tot->bytes[SHOAL_TC_GLOBAL]);
        human_bytes(b, sizeof b, tot->bytes[SHOAL_TC_LAYER]);
        human_bytes(d, sizeof d, tot->bytes[SHOAL_TC_GLOBAL] + tot->bytes[SHOAL_TC_LAYER]);
        human_bytes(e, sizeof e, tot->bytes[SHOAL_TC_EXPERT]);
        printf("expected tensors: %llu (%llu global, %llu per-layer, %llu routed-expert)\n",
               (unsigned long long)(tot->count[0] + tot->count[1] + tot->count[2]),
               (unsigned long long)tot->count[0], (unsigned long long)tot->count[1],
               (unsigned long long)tot->count[2]);
        printf("expected bytes: global %s; per-layer %s; trunk %s; routed experts %s (%llu per expert)\n", a, b, d,
               e, (unsigned long long)tot->bytes_per_expert);
    }
    if (st) {
        rep = shoal_xcalloc(1, sizeof *rep);
        if (!as_json)
            printf("weights: %s: %d file(s), %zu tensors\n", model, shoal_st_nfiles(st), shoal_st_count(st));
        rc = shoal_k3schema_check(c, st, rep, on_problem, &ps, ierr, sizeof ierr);
        if (rc)
            status = EXIT_INVALID;
        if (!as_json) {
            char a[64], b[64], d[64], e[64], v[64];
            human_bytes(a, sizeof a, rep->bytes[SHOAL_TC_GLOBAL]);
            human_bytes(b, sizeof b, rep->bytes[SHOAL_TC_LAYER]);
            human_bytes(d, sizeof d, rep->bytes[SHOAL_TC_GLOBAL] + rep->bytes[SHOAL_TC_LAYER]);
            human_bytes(e, sizeof e, rep->bytes[SHOAL_TC_EXPERT]);
            human_bytes(v, sizeof v, rep->vision_bytes);
            if (rc)
                printf("inventory: FAILED: %llu missing, %llu mismatched, %llu unexpected (listed above) of %llu "
                       "expected\n",
                       (unsigned long long)rep->missing, (unsigned long long)rep->mismatched,
                       (unsigned long long)rep->unexpected, (unsigned long long)rep->expected);
            else
                printf("inventory: OK: %llu of %llu tensors present with the right dtype and shape\n",
                       (unsigned long long)rep->present, (unsigned long long)rep->expected);
            printf("  vision: %llu tensors, %s (ignored)\n", (unsigned long long)rep->vision_count, v);
            if (rep->a_log_max)
                printf("  A_log stored with length %d..%d (the first %d entries are used)\n", rep->a_log_min,
                       rep->a_log_max, c->kda_heads);
            if (rep->experts_bf16)
                printf("  unquantized experts stored as BF16 under the %s trunk\n", c->dtype);
            printf("stored bytes: global %s; per-layer %s; trunk %s; routed experts %s\n", a, b, d, e);
            print_layer_table(c, rep->layer_bytes, rep->expert_bytes);
        }
    } else if (!as_json) {
        print_layer_table(c, tot->layer_bytes, tot->expert_bytes);
    }

    if (as_json) {
        json_t *r = json_object();
        json_object_set_new(r, "config", json_string(cfg_path));
        json_object_set_new(r, "model", model ? json_string(model) : json_null());
        json_t *cj = config_json(c);
        json_object_update(r, cj);
        json_decref(cj);
        json_t *ex = json_object();
        json_object_set_new(ex, "tensors", json_integer((json_int_t)(tot->count[0] + tot->count[1] + tot->count[2])));
        json_object_set_new(ex, "global_tensors", json_integer((json_int_t)tot->count[0]));
        json_object_set_new(ex, "layer_tensors", json_integer((json_int_t)tot->count[1]));
        json_object_set_new(ex, "expert_tensors", json_integer((json_int_t)tot->count[2]));
        json_object_set_new(ex, "bytes",
                            bytes_json(tot->bytes[0], tot->bytes[1], tot->bytes[2], tot->bytes_per_expert, c,
                                       tot->layer_bytes, tot->expert_bytes));
        json_object_set_new(r, "expected", ex);
        if (rep) {
            json_t *inv = json_object();
            json_object_set_new(inv, "ok", json_boolean(status == 0));
            json_object_set_new(inv, "files", json_integer(shoal_st_nfiles(st)));
            json_object_set_new(inv, "stored_tensors", json_integer((json_int_t)shoal_st_count(st)));
            json_object_set_new(inv, "expected", json_integer((json_int_t)rep->expected));
            json_object_set_new(inv, "present", json_integer((json_int_t)rep->present));
            json_object_set_new(inv, "missing", json_integer((json_int_t)rep->missing));
            json_object_set_new(inv, "mismatched", json_integer((json_int_t)rep->mismatched));
            json_object_set_new(inv, "unexpected", json_integer((json_int_t)rep->unexpected));
            json_object_set_new(inv, "vision_tensors", json_integer((json_int_t)rep->vision_count));
            json_object_set_new(inv, "vision_bytes", json_integer((json_int_t)rep->vision_bytes));
            json_t *al = json_array();
            if (rep->a_log_max) {
                json_array_append_new(al, json_integer(rep->a_log_min));
                json_array_append_new(al, json_integer(rep->a_log_max));
            }
            json_object_set_new(inv, "a_log_len", al);
            json_object_set_new(inv, "problems", json_incref(ps.problems));
            json_object_set_new(inv, "problems_truncated", json_boolean(ps.n > JSON_MAX_PROBLEMS));
            json_object_set_new(r, "inventory", inv);
            json_object_set_new(r, "bytes",
                                bytes_json(rep->bytes[0], rep->bytes[1], rep->bytes[2], tot->bytes_per_expert, c,
                                           rep->layer_bytes, rep->expert_bytes));
        } else {
            json_object_set_new(r, "inventory", json_null());
            json_object_set_new(r, "bytes",
                                bytes_json(tot->bytes[0], tot->bytes[1], tot->bytes[2], tot->bytes_per_expert, c,
                                           tot->layer_bytes, tot->expert_bytes));
        }
        char *s = json_dumps(r, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
        puts(s);
        free(s);
        json_decref(r);
    }
    if (status)
        fprintf(stderr, "shoal inspect: invalid model: %s\n", ierr);
    json_decref(ps.problems);
    free(rep);
    shoal_st_close(st);
    free(tot);
    free(c);
    return status;
}

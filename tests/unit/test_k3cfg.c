/* common/k3cfg: the official config (a committed byte-exact copy, and the
 * shared one when present), a flat kimi_linear config, and refusals.
 * Expected values are read off the JSON fixtures and SPEC §1.2, not off the C. */
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "test.h"

static const char *OFFICIAL_SHA256 = "9710e121a58d03ac92c8d6da287a19541994319afbbe6d6202af001ffd379213";

static int file_sha256_hex(const char *path, char hex[65])
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    unsigned char buf[4096], out[32];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        crypto_hash_sha256_update(&st, buf, n);
    fclose(f);
    crypto_hash_sha256_final(&st, out);
    sodium_bin2hex(hex, 65, out, 32);
    return 0;
}

/* SPEC §1.2: MLA iff (L+1) % 4 == 0 or L == 92; dense L0; blocks L % 12 == 0. */
static void check_official(const shoal_k3cfg *c)
{
    CHECK(!strcmp(c->model_type, "kimi_k3"));
    CHECK(!strcmp(c->dtype, "bfloat16"));
    CHECK_EQ_INT(c->num_layers, 93);
    CHECK_EQ_INT(c->num_kda, 69);
    CHECK_EQ_INT(c->num_mla, 24);
    CHECK_EQ_INT(c->num_moe, 92);
    CHECK_EQ_INT(c->num_experts, 896);
    CHECK_EQ_INT(c->experts_per_token, 16);
    CHECK_EQ_INT(c->num_shared_experts, 2);
    CHECK_EQ_INT(c->hidden_size, 7168);
    CHECK_EQ_INT(c->vocab_size, 163840);
    CHECK_EQ_INT(c->kda_heads, 96);
    CHECK_EQ_INT(c->kda_head_dim, 128);
    CHECK_EQ_INT(c->conv_kernel, 4);
    CHECK_EQ_INT(c->mla_heads, 96);
    CHECK_EQ_INT(c->q_lora_rank, 1536);
    CHECK_EQ_INT(c->kv_lora_rank, 512);
    CHECK_EQ_INT(c->qk_nope_dim, 128);
    CHECK_EQ_INT(c->qk_rope_dim, 64);
    CHECK_EQ_INT(c->v_head_dim, 128);
    CHECK_EQ_INT(c->intermediate_size, 33792);
    CHECK_EQ_INT(c->moe_intermediate_size, 3072);
    CHECK_EQ_INT(c->latent_size, 3584);
    CHECK_EQ_INT(c->latent_norm, 1);
    CHECK_EQ_INT(c->first_k_dense, 1);
    CHECK_EQ_INT(c->moe_layer_freq, 1);
    CHECK_EQ_INT(c->renormalize, 1);
    CHECK_EQ_INT(c->attn_res_block_size, 12);
    CHECK_EQ_INT(c->max_position, 1048576);
    CHECK_EQ_INT(c->bos_token_id, 163584);
    CHECK_EQ_INT(c->eos_token_id, 163586);
    CHECK_EQ_INT(c->pad_token_id, 163839);
    CHECK(c->rms_norm_eps == 1e-5f);
    CHECK(c->routed_scaling == 1.0f);
    CHECK(c->situ_beta == 4.0f);
    CHECK(c->situ_linear_beta == 25.0f);
    CHECK(c->gate == SHOAL_GATE_LOWER_BOUND);
    CHECK(c->gate_lower_bound == -5.0f);
    CHECK(c->expert_format == SHOAL_EXPERTS_MXFP4);
    CHECK_EQ_INT(c->expert_group_size, 32);
    int nmla = 0, nblock = 0;
    for (int L = 0; L < 93; L++) {
        int mla = (L + 1) % 4 == 0 || L == 92;
        CHECK_MSG(c->attn[L] == (mla ? SHOAL_ATTN_MLA : SHOAL_ATTN_KDA), "layer %d", L);
        CHECK_MSG(c->is_moe[L] == (L != 0), "layer %d", L);
        CHECK_MSG(c->block_start[L] == (L % 12 == 0), "layer %d", L);
        nmla += mla;
        nblock += L % 12 == 0;
    }
    CHECK_EQ_INT(nmla, 24);
    CHECK_EQ_INT(nblock, 8);
    CHECK(c->attn[91] == SHOAL_ATTN_MLA && c->attn[92] == SHOAL_ATTN_MLA && c->attn[90] == SHOAL_ATTN_KDA);
}

static void t_official_fixture(void)
{
    const char *p = test_src_path("tests/fixtures/official/config.json");
    char hex[65];
    CHECK(sodium_init() >= 0);
    CHECK_EQ_INT(file_sha256_hex(p, hex), 0);
    CHECK_MSG(!strcmp(hex, OFFICIAL_SHA256), "fixture sha256 %s", hex);
    shoal_k3cfg c;
    char err[4096];
    int rc = shoal_k3cfg_load(&c, p, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (!rc)
        check_official(&c);
}

/* The shared copy beside the checkout ($SHOAL_SRC/../shared/k3/config.json). */
static void t_official_shared(void)
{
    const char *p = test_src_path("../shared/k3/config.json");
    FILE *f = fopen(p, "rb");
    if (!f)
        SKIP("%s not present", p);
    fclose(f);
    char hex[65];
    CHECK(sodium_init() >= 0);
    CHECK_EQ_INT(file_sha256_hex(p, hex), 0);
    CHECK_MSG(!strcmp(hex, OFFICIAL_SHA256), "shared config sha256 %s", hex);
    shoal_k3cfg c;
    char err[4096];
    int rc = shoal_k3cfg_load(&c, p, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (!rc)
        check_official(&c);
}

/* tiny-flat.json: kimi_linear flat, kda_layers [1,2,4,5], full_attn [3,6],
 * no gate_lower_bound, no quantization_config, first_k_dense 2. */
static void t_flat(void)
{
    shoal_k3cfg c;
    char err[4096];
    int rc = shoal_k3cfg_load(&c, test_src_path("tests/fixtures/configs/tiny-flat.json"), err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    CHECK(!strcmp(c.model_type, "kimi_linear"));
    CHECK(!strcmp(c.dtype, "float32"));
    CHECK_EQ_INT(c.num_layers, 6);
    CHECK(c.gate == SHOAL_GATE_SOFTPLUS);
    CHECK(c.expert_format == SHOAL_EXPERTS_UNQUANTIZED);
    CHECK_EQ_INT(c.expert_group_size, 0);
    static const int mla[6] = {0, 0, 1, 0, 0, 1}, moe[6] = {0, 0, 1, 1, 1, 1}, blk[6] = {1, 0, 0, 0, 1, 0};
    for (int L = 0; L < 6; L++) {
        CHECK_MSG(c.attn[L] == (mla[L] ? SHOAL_ATTN_MLA : SHOAL_ATTN_KDA), "layer %d", L);
        CHECK_MSG(c.is_moe[L] == moe[L], "layer %d", L);
        CHECK_MSG(c.block_start[L] == blk[L], "layer %d", L);
    }
    CHECK_EQ_INT(c.num_kda, 4);
    CHECK_EQ_INT(c.num_mla, 2);
    CHECK_EQ_INT(c.num_moe, 4);
    CHECK_EQ_INT(c.latent_norm, 0);
    CHECK_EQ_INT(c.renormalize, 0);
    CHECK(c.routed_scaling == 2.5f);
    CHECK(c.rms_norm_eps == 1e-6f);
    CHECK_EQ_INT(c.num_shared_experts, 0);
}

static void t_nested_tiny(void)
{
    shoal_k3cfg c;
    char err[4096];
    int rc = shoal_k3cfg_load(&c, test_src_path("tests/fixtures/configs/tiny-nested.json"), err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    CHECK_EQ_INT(c.num_layers, 5);
    CHECK(c.attn[0] == SHOAL_ATTN_KDA && c.attn[2] == SHOAL_ATTN_KDA);
    CHECK(c.attn[3] == SHOAL_ATTN_MLA && c.attn[4] == SHOAL_ATTN_MLA);
    CHECK(c.gate == SHOAL_GATE_LOWER_BOUND);
    CHECK(c.expert_format == SHOAL_EXPERTS_MXFP4);
    CHECK_EQ_INT(c.bos_token_id, 1);
}

/* Parses `json` and checks that every needle appears in the message. */
static void refuse(const char *json, const char *const *needles)
{
    shoal_k3cfg c;
    char err[8192];
    int rc = shoal_k3cfg_parse(&c, json, strlen(json), err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_ECONFIG);
    for (; *needles; needles++)
        CHECK_STR_CONTAINS(err, *needles);
}

static void t_refuse_malformed(void)
{
    refuse("{\"model_type\": \"kimi_linear\",}", (const char *const[]){"malformed JSON", NULL});
    refuse("[1,2]", (const char *const[]){"top level must be an object", NULL});
    refuse("{\"model_type\": \"llama\"}", (const char *const[]){"model_type: 'llama' is not supported", NULL});
    refuse("{\"model_type\": \"kimi_k3\"}", (const char *const[]){"text_config: missing", NULL});
    refuse("{\"model_type\": \"kimi_linear\", \"model_type\": \"kimi_linear\"}",
           (const char *const[]){"duplicate", NULL});
}

/* Every missing field is listed, not only the first. */
static void t_refuse_lists_all(void)
{
    refuse("{\"model_type\": \"kimi_linear\"}",
           (const char *const[]){"hidden_size: missing", "vocab_size: missing", "num_hidden_layers: missing",
                                 "linear_attn_config: missing", "num_experts: missing", "dtype: missing",
                                 "attn_res_block_size: missing", "eos_token_id: missing",
                                 "routed_expert_hidden_size: missing", NULL});
}

static char *load_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(b);
        return NULL;
    }
    fclose(f);
    b[n] = 0;
    return b;
}

/* Replaces the first occurrence of `from` by `to` in the official config text. */
static char *official_with(const char *from, const char *to)
{
    char *s = load_text(test_src_path("tests/fixtures/official/config.json"));
    if (!s)
        return NULL;
    char *at = strstr(s, from);
    if (!at) {
        free(s);
        return NULL;
    }
    size_t a = (size_t)(at - s), fl = strlen(from), tl = strlen(to), n = strlen(s);
    char *r = malloc(n - fl + tl + 1);
    memcpy(r, s, a);
    memcpy(r + a, to, tl);
    memcpy(r + a + tl, at + fl, n - a - fl + 1);
    free(s);
    return r;
}

static void refuse_official(const char *from, const char *to, const char *needle)
{
    char *j = official_with(from, to);
    CHECK_MSG(j != NULL, "pattern %s not in fixture", from);
    if (!j)
        return;
    refuse(j, (const char *const[]){needle, NULL});
    free(j);
}

static void t_refuse_ill_formed(void)
{
    refuse_official("\"hidden_size\": 7168", "\"hidden_size\": \"7168\"",
                    "text_config.hidden_size: expected an integer, got a string");
    refuse_official("\"hidden_size\": 7168", "\"hidden_size\": 7168.0",
                    "text_config.hidden_size: expected an integer, got a real number");
    refuse_official("\"num_hidden_layers\": 93", "\"num_hidden_layers\": 300", "num_hidden_layers: 300 is out of range");
    refuse_official("\"num_experts_per_token\": 16", "\"num_experts_per_token\": 900", "exceeds num_experts");
    refuse_official("\"hidden_act\": \"situ\"", "\"hidden_act\": \"silu\"", "hidden_act: 'silu' is not supported");
    refuse_official("\"group_size\": 32", "\"group_size\": 16", "group_size: 16 is not supported");
    refuse_official("\"quant_method\": \"compressed-tensors\"", "\"quant_method\": \"gptq\"",
                    "quant_method: 'gptq' is not supported");
    refuse_official("\"dtype\": \"bfloat16\",\n    \"early", "\"dtype\": \"float16\",\n    \"early",
                    "text_config.dtype: 'float16' is not supported");
    refuse_official("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1", "rms_norm_eps: -1 is out of range");
    refuse_official("\"mla_use_nope\": true", "\"mla_use_nope\": false", "mla_use_nope: false is not supported");
    refuse_official("\"tie_word_embeddings\": false,\n    \"tokenizer", "\"tie_word_embeddings\": true,\n    \"tokenizer",
                    "tie_word_embeddings: true is not supported");
    refuse_official("\"q_lora_rank\": 1536", "\"q_lora_rank\": null", "q_lora_rank: null");
    refuse_official("\"num_expert_group\": 1", "\"num_expert_group\": 8", "num_expert_group: must be 1");
    refuse_official("\"attn_res_block_size\": 12,", "", "text_config.attn_res_block_size: missing");
    refuse_official("\"latent_moe_use_norm\": true,", "", "latent_moe_use_norm: missing");
    refuse_official("\"eos_token_id\": 163586,\n    \"exp", "\"eos_token_id\": 200000,\n    \"exp",
                    "eos_token_id: 200000 is out of range");
    refuse_official("\"routed_expert_hidden_size\": 3584", "\"routed_expert_hidden_size\": 3580",
                    "not a multiple of the MXFP4 group");
}

static void t_refuse_layer_lists(void)
{
    /* 1-indexed: layer 0 is not a valid entry */
    refuse_official("\"kda_layers\": [\n        1,", "\"kda_layers\": [\n        0,",
                    "kda_layers[0]: layer 0 is outside 1..93 (the list is 1-indexed)");
    refuse_official("\"full_attn_layers\": [\n        4,", "\"full_attn_layers\": [\n        5,",
                    "listed as both KDA and MLA (first: 5");
    refuse_official("        92,\n        93\n", "        92\n", "in neither kda_layers nor full_attn_layers (first: 93");
    refuse_official("\"full_attn_layers\": [\n        4,", "\"full_attn_layers\": [\n        8,",
                    "full_attn_layers: layer 8 listed twice");
    refuse_official("\"kda_layers\": [", "\"kda_layerz\": [", "linear_attn_config.kda_layers: missing");
}

/* A missing gate_lower_bound selects the softplus gate; quantization_config
 * absent selects unquantized experts. Neither is a default: both are the
 * documented meaning of absence (SPEC §1.3, §3.3). */
static void t_absence_semantics(void)
{
    char *j = official_with("\"gate_lower_bound\": -5.0,", "");
    CHECK(j != NULL);
    if (!j)
        return;
    shoal_k3cfg c;
    char err[4096];
    CHECK_EQ_INT(shoal_k3cfg_parse(&c, j, strlen(j), err, sizeof err), 0);
    CHECK(c.gate == SHOAL_GATE_SOFTPLUS);
    free(j);
    refuse_official("\"gate_lower_bound\": -5.0", "\"gate_lower_bound\": \"-5\"",
                    "gate_lower_bound: expected a number, got a string");
}

int main(void)
{
    test_binary = "test_k3cfg";
    RUN(t_official_fixture);
    RUN(t_official_shared);
    RUN(t_flat);
    RUN(t_nested_tiny);
    RUN(t_refuse_malformed);
    RUN(t_refuse_lists_all);
    RUN(t_refuse_ill_formed);
    RUN(t_refuse_layer_lists);
    RUN(t_absence_semantics);
    return test_finish();
}

/* K3 model configuration: parsed from config.json (the official nested
 * kimi_k3 form with text_config/quantization_config, or a flat kimi_linear
 * form; ../shared/k3/SPEC.md §1) and the derived layer schedule.
 * A missing or ill-formed required field is refused, listing every bad field;
 * no model field is ever defaulted. Plain struct, filled by the loader, owned
 * by the caller, no pointers inside. */
#ifndef SHOAL_K3CFG_H
#define SHOAL_K3CFG_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_MAX_LAYERS 256
#define SHOAL_MAX_EOS 4

typedef enum { SHOAL_ATTN_KDA = 0, SHOAL_ATTN_MLA = 1 } shoal_attn_kind;
typedef enum { SHOAL_GATE_SOFTPLUS = 0, SHOAL_GATE_LOWER_BOUND = 1 } shoal_gate_kind;
typedef enum { SHOAL_EXPERTS_MXFP4 = 0, SHOAL_EXPERTS_UNQUANTIZED = 1 } shoal_expert_format;

typedef struct {
    char model_type[32];    /* "kimi_k3" (nested) or "kimi_linear" (flat) */
    char dtype[16];         /* trunk dtype as declared: "bfloat16" or "float32" */
    int vocab_size;
    int hidden_size;        /* d = 7168 */
    int num_layers;         /* 93 */
    float rms_norm_eps;     /* 1e-5 */
    int max_position;

    /* MLA (gated, NoPE) */
    int mla_heads;          /* num_attention_heads, 96 */
    int q_lora_rank;        /* 1536 */
    int kv_lora_rank;       /* 512 */
    int qk_nope_dim;        /* 128 */
    int qk_rope_dim;        /* 64 */
    int v_head_dim;         /* 128 */

    /* KDA */
    int kda_heads;          /* 96 */
    int kda_head_dim;       /* 128 */
    int conv_kernel;        /* 4 */
    shoal_gate_kind gate;   /* LOWER_BOUND iff gate_lower_bound present */
    float gate_lower_bound; /* -5.0 when gate == LOWER_BOUND */

    /* MLPs and MoE */
    int intermediate_size;      /* dense layer(s), 33792 */
    int moe_intermediate_size;  /* per routed expert, 3072 */
    int latent_size;            /* routed_expert_hidden_size, 3584 */
    int latent_norm;            /* latent_moe_use_norm */
    int num_experts;            /* 896 */
    int experts_per_token;      /* top-k, 16 */
    int num_shared_experts;     /* 2: one fused MLP of width num_shared * moe_intermediate */
    int first_k_dense;          /* 1 */
    int moe_layer_freq;         /* 1 */
    int renormalize;            /* moe_renormalize */
    float routed_scaling;       /* 1.0 */
    float situ_beta;            /* activation_situ_beta, 4.0 */
    float situ_linear_beta;     /* activation_situ_linear_beta, 25.0 */
    int attn_res_block_size;    /* 12 */

    /* experts storage */
    shoal_expert_format expert_format;
    int expert_group_size;      /* 32 for MXFP4, 0 otherwise */

    /* token ids from config.json (the tokenizer files add their own eos) */
    int bos_token_id;
    int eos_token_id;
    int pad_token_id;

    /* derived schedule, 0-indexed layers */
    shoal_attn_kind attn[SHOAL_MAX_LAYERS];
    uint8_t is_moe[SHOAL_MAX_LAYERS];      /* 0 = dense MLP */
    uint8_t block_start[SHOAL_MAX_LAYERS]; /* L % attn_res_block_size == 0 */
    int num_kda, num_mla, num_moe;
} shoal_k3cfg;

/* Parse a config.json file / buffer. err receives every problem found, one per
 * line. Returns 0, SHOAL_ECONFIG, or -errno for I/O. */
int shoal_k3cfg_load(shoal_k3cfg *cfg, const char *path, char *err, size_t errlen);
int shoal_k3cfg_parse(shoal_k3cfg *cfg, const char *json, size_t len, char *err, size_t errlen);

#endif

#include "ckpt_presets.h"

#include <string.h>

#define DIFFUSERS_VERSION "0.40.0.dev0"
#define TRANSFORMERS_VERSION "5.17.0"

/* The oracle's tiny text encoder (shared/oracle/README.md) and the real
 * Qwen3-4B / Qwen3-8B (qwen3-encoder.md §2). */
#define QWEN3_TINY(lm) {16, 4, 4, 2, 8, 48, 151936, lm, 1}
#define QWEN3_4B {2560, 36, 32, 8, 128, 9728, 151936, 1, 1}
#define QWEN3_8B {4096, 36, 32, 8, 128, 12288, 151936, 1, 0}
/* Z-Image's Qwen3-4B is a Qwen3Model: no LM head, no `model.` prefix. */
#define QWEN3_4B_BARE {2560, 36, 32, 8, 128, 9728, 151936, 0, 1}
/* flux2-klein.md §1 */
#define FLUX2_4B {5, 20, 24, 128, 7680, 128, 256, 3.0, {32, 32, 32, 32}}
#define FLUX2_9B {8, 24, 32, 128, 12288, 128, 256, 3.0, {32, 32, 32, 32}}
#define FLUX2_TINY {2, 2, 2, 64, 48, 32, 256, 3.0, {16, 16, 16, 16}}
/* vae.md §1 */
#define VAE_FLUX2 {{128, 256, 512, 512}, 32, 32, 2, 1024, 1, 0, 0}
#define VAE_FLUX2_TINY {{8, 16, 32, 32}, 8, 4, 2, 256, 1, 0, 0}
#define VAE_KL_TINY {{8, 16, 32, 32}, 4, 4, 2, 256, 0, 0.3611, 0.1159}
#define VAE_KL {{128, 256, 512, 512}, 16, 32, 2, 1024, 0, 0.3611, 0.1159}

static const kiln_ckpt_preset presets[] = {
    {"tiny", "Flux2KleinPipeline", 1, 0, 28, QWEN3_TINY(1), FLUX2_TINY, {0}, VAE_FLUX2_TINY},
    {"klein-4b", "Flux2KleinPipeline", 1, 0, 36, QWEN3_4B, FLUX2_4B, {0}, VAE_FLUX2},
    {"klein-9b", "Flux2KleinPipeline", 1, 0, 36, QWEN3_8B, FLUX2_9B, {0}, VAE_FLUX2},
    {"klein-9b-kv", "Flux2KleinKVPipeline", -1, 0, 36, QWEN3_8B, FLUX2_9B, {0}, VAE_FLUX2},
    {"klein-base-4b", "Flux2KleinPipeline", 0, 0, 36, QWEN3_4B, FLUX2_4B, {0}, VAE_FLUX2},
    {"zimage-tiny", "ZImagePipeline", -1, 1, 28, QWEN3_TINY(0), {0},
     {128, 2, 2, 2, 4, 16, 2, 1, {16, 24, 24}, {1536, 512, 512}}, VAE_KL_TINY},
    /* z-image-turbo.md §1: 6.15 B DiT, D 3840, 30 layers of 30 heads */
    {"zimage-turbo", "ZImagePipeline", -1, 1, 36, QWEN3_4B_BARE, {0},
     {3840, 30, 30, 2, 16, 2560, 2, 1, {32, 48, 48}, {1536, 512, 512}}, VAE_KL},
};

const kiln_ckpt_preset *kiln_ckpt_preset_find(const char *name)
{
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (!strcmp(presets[i].name, name))
            return &presets[i];
    return NULL;
}

const char *kiln_ckpt_preset_names(void)
{
    return "tiny|klein-4b|klein-9b|klein-9b-kv|klein-base-4b|zimage-tiny|zimage-turbo";
}

/* Builders that remember an allocation failure so each document is checked
 * once at the end. */
typedef struct jb {
    cJSON *obj;
    int fail;
} jb;

static void put(jb *b, const char *key, cJSON *v)
{
    if (!v || !cJSON_AddItemToObject(b->obj, key, v)) {
        cJSON_Delete(v);
        b->fail = 1;
    }
}

static void str(jb *b, const char *k, const char *v) { put(b, k, cJSON_CreateString(v)); }
static void num(jb *b, const char *k, double v) { put(b, k, cJSON_CreateNumber(v)); }
static void flag(jb *b, const char *k, int v) { put(b, k, cJSON_CreateBool(v)); }
static void null(jb *b, const char *k) { put(b, k, cJSON_CreateNull()); }

static void ints(jb *b, const char *k, const int *v, int n)
{
    put(b, k, cJSON_CreateIntArray(v, n));
}

static void strs(jb *b, const char *k, const char *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++)
        if (!cJSON_AddItemToArray(a, cJSON_CreateString(v)))
            b->fail = 1;
    put(b, k, a);
}

static void pair(jb *b, const char *k, const char *lib, const char *cls)
{
    const char *v[2] = {lib, cls};
    put(b, k, cJSON_CreateStringArray(v, 2));
}

/* The two keys every diffusers config and model_index.json open with. */
static void diffusers_class(jb *b, const char *cls)
{
    str(b, "_class_name", cls);
    str(b, "_diffusers_version", DIFFUSERS_VERSION);
}

static cJSON *done(jb *b)
{
    if (b->fail) {
        cJSON_Delete(b->obj);
        return NULL;
    }
    return b->obj;
}

static cJSON *model_index(const kiln_ckpt_preset *p, jb *b)
{
    diffusers_class(b, p->pipeline);
    if (p->is_distilled >= 0)
        flag(b, "is_distilled", p->is_distilled);
    pair(b, "scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler");
    pair(b, "text_encoder", "transformers", p->text.causal_lm ? "Qwen3ForCausalLM" : "Qwen3Model");
    pair(b, "tokenizer", "transformers", p->zimage ? "Qwen2Tokenizer" : "Qwen2TokenizerFast");
    pair(b, "transformer", "diffusers",
         p->zimage ? "ZImageTransformer2DModel" : "Flux2Transformer2DModel");
    pair(b, "vae", "diffusers", p->zimage ? "AutoencoderKL" : "AutoencoderKLFlux2");
    /* A text encoder too shallow for diffusers' default hidden states
     * (9, 18, 27) records the ones its DiT was made for, so that every
     * command runs on it without --text-encoder-out-layers
     * (kiln_encode_layers_of).  The published checkpoints have no such key. */
    if (!p->zimage && p->text.layers < 27)
        ints(b, "text_encoder_out_layers", (const int[]){1, 2, 3}, 3);
    return done(b);
}

static cJSON *flux2_config(const kiln_flux2_dims *d, jb *b)
{
    diffusers_class(b, "Flux2Transformer2DModel");
    num(b, "attention_head_dim", d->head_dim);
    ints(b, "axes_dims_rope", d->axes, 4);
    num(b, "eps", 1e-6);
    flag(b, "guidance_embeds", 0);
    num(b, "in_channels", d->in_channels);
    num(b, "joint_attention_dim", d->joint_dim);
    num(b, "mlp_ratio", d->mlp_ratio);
    num(b, "num_attention_heads", d->heads);
    num(b, "num_layers", d->layers);
    num(b, "num_single_layers", d->single_layers);
    null(b, "out_channels");
    num(b, "patch_size", 1);
    num(b, "rope_theta", 2000);
    num(b, "timestep_guidance_channels", d->timestep_channels);
    return done(b);
}

static cJSON *zimage_config(const kiln_zimage_dims *d, jb *b)
{
    diffusers_class(b, "ZImageTransformer2DModel");
    ints(b, "all_f_patch_size", &d->f_patch, 1);
    ints(b, "all_patch_size", &d->patch, 1);
    ints(b, "axes_dims", d->axes, 3);
    ints(b, "axes_lens", d->axes_lens, 3);
    num(b, "cap_feat_dim", d->cap_feat_dim);
    num(b, "dim", d->dim);
    num(b, "in_channels", d->in_channels);
    num(b, "n_heads", d->heads);
    num(b, "n_kv_heads", d->heads);
    num(b, "n_layers", d->layers);
    num(b, "n_refiner_layers", d->refiner_layers);
    num(b, "norm_eps", 1e-5);
    flag(b, "qk_norm", 1);
    num(b, "rope_theta", 256.0);
    null(b, "siglip_feat_dim");
    num(b, "t_scale", 1000.0);
    return done(b);
}

static cJSON *qwen3_config(const kiln_ckpt_preset *p, jb *b)
{
    const kiln_qwen3_dims *d = &p->text;
    const char *arch = d->causal_lm ? "Qwen3ForCausalLM" : "Qwen3Model";
    put(b, "architectures", cJSON_CreateStringArray(&arch, 1));
    flag(b, "attention_bias", 0);
    num(b, "attention_dropout", 0.0);
    num(b, "bos_token_id", 151643);
    str(b, "dtype", "bfloat16");
    num(b, "eos_token_id", 151645);
    num(b, "head_dim", d->head_dim);
    str(b, "hidden_act", "silu");
    num(b, "hidden_size", d->hidden);
    num(b, "initializer_range", 0.02);
    num(b, "intermediate_size", d->intermediate);
    strs(b, "layer_types", "full_attention", d->layers);
    num(b, "max_position_embeddings", 40960);
    num(b, "max_window_layers", p->max_window_layers);
    str(b, "model_type", "qwen3");
    num(b, "num_attention_heads", d->heads);
    num(b, "num_hidden_layers", d->layers);
    num(b, "num_key_value_heads", d->kv_heads);
    null(b, "pad_token_id");
    num(b, "rms_norm_eps", 1e-6);
    jb rope = {cJSON_CreateObject(), 0};
    if (rope.obj) {
        num(&rope, "rope_theta", 1000000.0);
        str(&rope, "rope_type", "default");
    }
    put(b, "rope_parameters", done(&rope));
    null(b, "sliding_window");
    flag(b, "tie_word_embeddings", d->tied);
    str(b, "transformers_version", TRANSFORMERS_VERSION);
    flag(b, "use_cache", 1);
    flag(b, "use_sliding_window", 0);
    num(b, "vocab_size", d->vocab);
    return done(b);
}

static cJSON *generation_config(jb *b)
{
    flag(b, "_from_model_config", 1);
    num(b, "bos_token_id", 151643);
    num(b, "eos_token_id", 151645);
    flag(b, "output_attentions", 0);
    flag(b, "output_hidden_states", 0);
    str(b, "transformers_version", TRANSFORMERS_VERSION);
    flag(b, "use_cache", 1);
    return done(b);
}

static cJSON *vae_config(const kiln_vae_dims *d, jb *b)
{
    diffusers_class(b, d->flux2 ? "AutoencoderKLFlux2" : "AutoencoderKL");
    str(b, "act_fn", "silu");
    if (d->flux2) {
        num(b, "batch_norm_eps", 1e-4);
        num(b, "batch_norm_momentum", 0.1);
    }
    ints(b, "block_out_channels", d->channels, 4);
    if (d->flux2)
        null(b, "decoder_block_out_channels");
    strs(b, "down_block_types", "DownEncoderBlock2D", 4);
    flag(b, "force_upcast", 1);
    num(b, "in_channels", 3);
    num(b, "latent_channels", d->latent);
    if (!d->flux2) {
        null(b, "latents_mean");
        null(b, "latents_std");
    }
    num(b, "layers_per_block", d->layers_per_block);
    flag(b, "mid_block_add_attention", 1);
    num(b, "norm_num_groups", d->groups);
    num(b, "out_channels", 3);
    if (d->flux2)
        ints(b, "patch_size", (const int[]){2, 2}, 2);
    num(b, "sample_size", d->sample_size);
    if (!d->flux2) {
        num(b, "scaling_factor", d->scaling);
        num(b, "shift_factor", d->shift);
    }
    strs(b, "up_block_types", "UpDecoderBlock2D", 4);
    flag(b, "use_post_quant_conv", d->flux2);
    flag(b, "use_quant_conv", d->flux2);
    return done(b);
}

/* pipeline.md §5 (klein: dynamic shifting) and z-image-turbo.md §1 (static
 * shift 3.0). */
static cJSON *scheduler_config(const kiln_ckpt_preset *p, jb *b)
{
    diffusers_class(b, "FlowMatchEulerDiscreteScheduler");
    num(b, "base_image_seq_len", 256);
    num(b, "base_shift", 0.5);
    flag(b, "invert_sigmas", 0);
    num(b, "max_image_seq_len", 4096);
    num(b, "max_shift", 1.15);
    num(b, "num_train_timesteps", 1000);
    num(b, "shift", 3.0);
    null(b, "shift_terminal");
    flag(b, "stochastic_sampling", 0);
    str(b, "time_shift_type", "exponential");
    flag(b, "use_beta_sigmas", 0);
    flag(b, "use_dynamic_shifting", !p->zimage);
    flag(b, "use_exponential_sigmas", 0);
    flag(b, "use_karras_sigmas", 0);
    return done(b);
}

cJSON *kiln_ckpt_config(const kiln_ckpt_preset *p, const char *what)
{
    if (!strcmp(what, "text_encoder_generation") && !p->text.causal_lm)
        return NULL;
    jb b = {cJSON_CreateObject(), 0};
    if (!b.obj)
        return NULL;
    if (!strcmp(what, "model_index"))
        return model_index(p, &b);
    if (!strcmp(what, "transformer"))
        return p->zimage ? zimage_config(&p->zdit, &b) : flux2_config(&p->flux2, &b);
    if (!strcmp(what, "text_encoder"))
        return qwen3_config(p, &b);
    if (!strcmp(what, "text_encoder_generation"))
        return generation_config(&b);
    if (!strcmp(what, "vae"))
        return vae_config(&p->vae, &b);
    if (!strcmp(what, "scheduler"))
        return scheduler_config(p, &b);
    cJSON_Delete(b.obj);
    return NULL;
}

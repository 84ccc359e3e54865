/* The FLUX.2 [klein] denoiser (diffusers Flux2Transformer2DModel,
 * shared/spec/flux2-klein.md), written once against kernels/backend.h.
 *
 *   kiln_flux2_dit *dit = kiln_flux2_dit_load(be, ck, &err);
 *   if (!dit) die(err.msg);
 *   float t = kiln_sched_flux2_dit_time(tau, be->act_dtype);  // models/scheduler.h
 *   kiln_flux2_dit_input in = {
 *       .x = &latents, .txt = &prompt_embeds, .t = &t,   // B = 1
 *       .img_ids = img_ids, .txt_ids = txt_ids,          // (N, 4), (T, 4)
 *   };
 *   kiln_tensor v;                            // (B, N, out_channels)
 *   kiln_be_alloc(be, &v, be->act_dtype, 3, (int64_t[]){1, N, C_out});
 *   if (kiln_flux2_dit_forward(dit, &in, &v, &err)) die(err.msg);
 *   ...
 *   kiln_flux2_dit_destroy(dit);
 *
 * One code path runs klein 4B, 9B, 9B-kv, the base checkpoints and the tiny
 * oracle model: every size comes from transformer/config.json.
 *
 * Time: the pipeline passes diffusers `timestep = tau / 1000` and the network
 * multiplies by 1000 in its own dtype; `t` here is that product, the value
 * the sinusoidal embedding sees.  kiln_sched_flux2_dit_time (models/scheduler.h)
 * reproduces the roundings of diffusers' fp32 and bf16 pipelines
 * (spec/pipeline.md §6).
 *
 * Reference K/V cache (klein 9B-kv, spec §6): a forward in
 * KILN_FLUX2_KV_EXTRACT mode takes x = [ref ; img] (the R reference tokens
 * first, ids in the same order), runs the reference tokens with t = 0
 * modulation and reference-only attention, stores their per-layer K and V in
 * a kiln_flux2_kv_cache and returns the image rows only.  Later forwards in
 * KILN_FLUX2_KV_CACHED mode take the image tokens alone and attend to
 * [txt ; cached ref ; img].  The plain edit pipeline needs no mode: it passes
 * x = [img ; ref] with ids to match and keeps the first N output rows.
 *
 * Thread-safety: a kiln_flux2_dit uses its backend and owns scratch memory
 * and cached RoPE tables, so it belongs to the backend's thread; the same
 * holds for a cache.  Distinct instances are independent.
 */
#ifndef KILN_MODELS_FLUX2_DIT_H
#define KILN_MODELS_FLUX2_DIT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/checkpoint.h"
#include "common/error.h"
#include "kernels/backend.h"

/* Position ids have four axes (t, h, w, l), spec §4. */
#define KILN_FLUX2_ROPE_AXES 4

/* The fields of transformer/config.json the network uses, plus derived
 * sizes. */
typedef struct kiln_flux2_dit_config {
    int64_t num_layers;        /* double-stream blocks */
    int64_t num_single_layers; /* single-stream blocks */
    int64_t num_heads;         /* h */
    int64_t head_dim;          /* d */
    int64_t hidden;            /* D = h * d */
    int64_t mlp_hidden;        /* F = int(D * mlp_ratio) */
    int64_t joint_dim;         /* J, text feature width */
    int64_t in_channels;
    int64_t out_channels;      /* config null -> in_channels */
    int64_t time_channels;     /* timestep_guidance_channels */
    int64_t axes_dims[KILN_FLUX2_ROPE_AXES];
    double rope_theta;
    double eps;
} kiln_flux2_dit_config;

/* Parses a Flux2Transformer2DModel config document.  The block counts, head
 * sizes, joint_attention_dim and in_channels are required; the rest take
 * diffusers' klein values when absent.  guidance_embeds true, patch_size
 * other than 1 or a RoPE with other than four axes is KILN_ERR_UNSUPPORTED;
 * inconsistent sizes (axes not summing to head_dim, odd dims) are
 * KILN_ERR_FORMAT. */
kiln_status kiln_flux2_dit_config_parse(const cJSON *cfg, kiln_flux2_dit_config *out,
                                        kiln_err *err);

typedef struct kiln_flux2_dit kiln_flux2_dit;

/* Loads the checkpoint's transformer/ component into `be` (weights in
 * be->act_dtype; the double blocks' q/k/v projections are fused into one
 * matrix per stream, the single blocks' to_qkv_mlp_proj split into its
 * attention and MLP parts).  A missing tensor or a wrong shape fails with a
 * message naming it.  Returns NULL with err set; the caller owns the result,
 * `be` must outlive it and `ck` is only used during the call. */
kiln_flux2_dit *kiln_flux2_dit_load(kiln_backend *be, const kiln_checkpoint *ck, kiln_err *err);
void kiln_flux2_dit_destroy(kiln_flux2_dit *m);

/* The FP8 mode (docs/PERFORMANCE.md "FP8 mode"): the transformer blocks'
 * linear weights (the double blocks' fused q|k|v, output and MLP
 * projections of both streams, the single blocks' q|k|v, MLP input and
 * output projections) become E4M3 with one scale per tensor
 * (models/dit_util.h kiln_dit_quantize_fp8); the embedders, modulations
 * and output layer stay in be->act_dtype, as do attention and the norms.
 * Call right after kiln_flux2_dit_load, before any forward.  *converted
 * (may be NULL) gets the number of weights converted; the rest of the
 * model is untouched.  A backend failure is reported in err (the model
 * stays usable for destroy only). */
kiln_status kiln_flux2_dit_quantize_fp8(kiln_flux2_dit *m, int *converted, kiln_err *err);

const kiln_flux2_dit_config *kiln_flux2_dit_get_config(const kiln_flux2_dit *m);
/* Bytes of backend scratch memory held for activations: it grows with the
 * first forward of a larger shape and stays put for repeats of a shape. */
size_t kiln_flux2_dit_scratch_bytes(const kiln_flux2_dit *m);

/* --- reference K/V cache ------------------------------------------------ */

typedef enum kiln_flux2_kv_mode {
    KILN_FLUX2_KV_OFF,     /* plain forward */
    KILN_FLUX2_KV_EXTRACT, /* x = [ref ; img]; fill the cache */
    KILN_FLUX2_KV_CACHED,  /* x = img; attend to the cached reference K/V */
} kiln_flux2_kv_mode;

typedef struct kiln_flux2_kv_cache kiln_flux2_kv_cache;

/* An empty cache for `m` (backend memory is taken by the first extract
 * forward and kept for later ones of the same batch and reference size).
 * NULL with err set on allocation failure.  Destroy it before the model. */
kiln_flux2_kv_cache *kiln_flux2_kv_cache_create(const kiln_flux2_dit *m, kiln_err *err);
void kiln_flux2_kv_cache_destroy(kiln_flux2_kv_cache *c);
/* Reference tokens held (R), 0 while empty or after a failed extract. */
int64_t kiln_flux2_kv_cache_tokens(const kiln_flux2_kv_cache *c);

/* --- forward ---------------------------------------------------------------- */

/* Called with intermediate results during a forward, for tests and
 * debugging: `module` is the diffusers module name (x_embedder,
 * context_embedder, time_guidance_embed, double_stream_modulation_img,
 * double_stream_modulation_txt, single_stream_modulation,
 * transformer_blocks.<i> with part 0 = text stream and 1 = image stream,
 * single_transformer_blocks.<j> ([txt ; img] rows, without reference rows
 * in the KV modes), norm_out, proj_out); `part` is -1 where the module has
 * one output.  The tensor is valid only during the call. */
typedef void (*kiln_flux2_probe_fn)(void *user, const char *module, int part,
                                    const kiln_tensor *t);

typedef struct kiln_flux2_dit_input {
    const kiln_tensor *x;     /* (B, N_tot, in_channels), be->act_dtype */
    const kiln_tensor *txt;   /* (B, T, joint_dim), be->act_dtype */
    const float *t;           /* [B] time after the *1000 (see above) */
    const int32_t *img_ids;   /* (N_tot, 4) host array, shared by all rows */
    const int32_t *txt_ids;   /* (T, 4) host array */
    kiln_flux2_kv_mode kv_mode;
    int64_t num_ref;          /* R, EXTRACT only: leading reference rows of x */
    kiln_flux2_kv_cache *kv;  /* EXTRACT: filled; CACHED: read */
    kiln_flux2_probe_fn probe; /* NULL in production */
    void *probe_user;
} kiln_flux2_dit_input;

/* Runs one forward.  `out` is a caller-allocated (B, N_out, out_channels)
 * tensor of be->act_dtype with N_out = N_tot - R in EXTRACT mode and N_tot
 * otherwise.  Bad shapes, ids or mode arguments are KILN_ERR_INVALID; a
 * backend failure is reported naming the block it happened in.  Scratch
 * memory and the RoPE tables (rebuilt only when the ids change) are reused
 * between calls. */
kiln_status kiln_flux2_dit_forward(kiln_flux2_dit *m, const kiln_flux2_dit_input *in,
                                   kiln_tensor *out, kiln_err *err);

/* --- host-side helpers (exposed for tests and the pipeline) -------------- */

/* The sinusoidal timestep projection of spec §3.1 in fp32: `channels`
 * (even) values, cos half first.  out has `channels` floats. */
void kiln_flux2_time_proj(float t, int64_t channels, float *out);

/* RoPE tables of spec §4 for n tokens with ids (n, 4): cos and sin of shape
 * (n, sum(axes_dims)), each pair value repeated (interleaved layout),
 * computed in float64 and rounded to fp32. */
void kiln_flux2_rope_table(const int32_t *ids, int64_t n, const int64_t *axes_dims,
                           double theta, float *cos_out, float *sin_out);

#endif

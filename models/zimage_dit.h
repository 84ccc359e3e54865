/* The Z-Image denoiser (diffusers ZImageTransformer2DModel,
 * shared/spec/z-image-turbo.md §3), written once against kernels/backend.h.
 *
 *   kiln_zimage_dit *dit = kiln_zimage_dit_load(be, ck, &err);
 *   if (!dit) die(err.msg);
 *   float t = kiln_sched_zimage_dit_input(tau);        // models/scheduler.h
 *   int64_t cap_len[1] = {L};
 *   kiln_zimage_dit_input in = {
 *       .x = &tokens, .h = H / 16, .w = W / 16,        // (B, h*w, P) patches
 *       .cap = &cap_feats, .cap_len = cap_len, .t = &t,  // (B, T >= L, Cc)
 *   };
 *   kiln_tensor out;                                   // (B, h*w, P)
 *   kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){1, N, P});
 *   if (kiln_zimage_dit_forward(dit, &in, &out, &err)) die(err.msg);
 *   ... v = -out (the pipeline's sign, spec §4 item 4) ...
 *   kiln_zimage_dit_destroy(dit);
 *
 * One code path runs the published 6B model and the tiny oracle model: every
 * size comes from transformer/config.json.
 *
 * Tokens: P = in_channels * patch^2 features per token; token (y, x) of an
 * h x w grid holds latent[c, 2y + py, 2x + px] at (py * 2 + px) * C + c
 * (spec §3.2; kiln_latents_zimage_patchify in models/latents.h).  The output
 * uses the same layout.
 *
 * Batching: every item has the same image grid; captions may differ in
 * length (cap_len[b] rows of item b are real, the rest of the T rows are
 * ignored).  Each item is padded as diffusers pads it (image and caption
 * rows to multiples of 32 with the learned pad tokens, which are ordinary
 * tokens of its attention); where the items' padded lengths differ, each
 * item's attention runs over its own rows only, which is diffusers' boolean
 * key mask over the batch-padded sequence, and its RoPE rows follow its own
 * caption length.
 *
 * Time: `t` is the pipeline's (1000 - tau) / 1000 in fp32; the network
 * multiplies by t_scale itself (spec §3.1).
 *
 * Thread-safety: a kiln_zimage_dit uses its backend and owns scratch memory
 * and RoPE tables, so it belongs to the backend's thread.
 */
#ifndef KILN_MODELS_ZIMAGE_DIT_H
#define KILN_MODELS_ZIMAGE_DIT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/checkpoint.h"
#include "common/error.h"
#include "kernels/backend.h"

#define KILN_ZIMAGE_ROPE_AXES 3
/* diffusers SEQ_MULTI_OF: image and caption rows are padded to multiples. */
#define KILN_ZIMAGE_SEQ_MULTIPLE 32

typedef struct kiln_zimage_dit_config {
    int64_t dim;              /* D */
    int64_t n_layers;         /* main single-stream layers */
    int64_t n_refiner_layers; /* noise_refiner and context_refiner blocks each */
    int64_t n_heads;
    int64_t head_dim;         /* d = D / n_heads */
    int64_t cap_feat_dim;     /* Cc, caption feature width */
    int64_t in_channels;      /* latent channels C */
    int64_t patch;            /* all_patch_size[0] */
    int64_t patch_features;   /* P = C * patch^2 */
    int64_t adaln_dim;        /* A = min(D, 256) */
    int64_t ffn_hidden;       /* int(D / 3 * 8) */
    int64_t t_hidden;         /* t_embedder's middle width (1024) */
    int qk_norm;
    int64_t axes_dims[KILN_ZIMAGE_ROPE_AXES];
    int64_t axes_lens[KILN_ZIMAGE_ROPE_AXES];
    double rope_theta, t_scale, norm_eps;
} kiln_zimage_dit_config;

/* Parses a ZImageTransformer2DModel config document.  dim, the layer and
 * head counts, cap_feat_dim and in_channels are required; the rest take the
 * class defaults.  Several patch sizes, an f_patch other than 1 or SigLIP
 * features (the omni mode) are KILN_ERR_UNSUPPORTED; inconsistent sizes
 * (axes not summing to the head dim) KILN_ERR_FORMAT. */
kiln_status kiln_zimage_dit_config_parse(const cJSON *cfg, kiln_zimage_dit_config *out,
                                         kiln_err *err);

typedef struct kiln_zimage_dit kiln_zimage_dit;

/* Loads the checkpoint's transformer/ component into `be` (weights in
 * be->act_dtype; q/k/v fused into one matrix per block, w1/w3 into one).
 * NULL with err set (a missing tensor or wrong shape is named); the caller
 * owns the result, `be` must outlive it, `ck` is only used during the call. */
kiln_zimage_dit *kiln_zimage_dit_load(kiln_backend *be, const kiln_checkpoint *ck, kiln_err *err);
void kiln_zimage_dit_destroy(kiln_zimage_dit *m);

/* The FP8 mode, as kiln_flux2_dit_quantize_fp8: the q|k|v, output and
 * feed-forward weights of every block (the main layers and both refiners)
 * become E4M3 with one scale per tensor; the embedders, adaLN and final
 * layer stay in be->act_dtype.  Call right after load, before any
 * forward. */
kiln_status kiln_zimage_dit_quantize_fp8(kiln_zimage_dit *m, int *converted, kiln_err *err);

const kiln_zimage_dit_config *kiln_zimage_dit_get_config(const kiln_zimage_dit *m);
/* Bytes of backend scratch memory held for activations. */
size_t kiln_zimage_dit_scratch_bytes(const kiln_zimage_dit *m);

/* Called with intermediate results, for tests: `module` is the diffusers
 * module name (t_embedder (B, A); all_x_embedder.2-1 (B, N, D), real rows;
 * cap_embedder (B, T, D), rows past cap_len[b] meaningless;
 * noise_refiner.<i> (B, N_p, D); context_refiner.<i> (B, L_max, D);
 * layers.<i> (B, N_p + L_max, D); all_final_layer.2-1 (B, N, P)), where
 * rows past an item's own padded length are meaningless.  Valid only
 * during the call. */
typedef void (*kiln_zimage_probe_fn)(void *user, const char *module, const kiln_tensor *t);

typedef struct kiln_zimage_dit_input {
    const kiln_tensor *x;   /* (B, h*w, P) patch tokens, be->act_dtype */
    int64_t h, w;           /* token grid */
    const kiln_tensor *cap; /* (B, T, Cc) caption features, be->act_dtype */
    const int64_t *cap_len; /* [B] host: real rows of each item, 1..T */
    const float *t;         /* [B] (1000 - tau) / 1000 */
    kiln_zimage_probe_fn probe; /* NULL in production */
    void *probe_user;
} kiln_zimage_dit_input;

/* Runs one forward into `out`, a caller-allocated (B, h*w, P) tensor of
 * be->act_dtype.  Bad shapes, lengths, times or positions past the RoPE
 * tables (axes_lens) are KILN_ERR_INVALID; a backend failure is reported
 * naming the block.  Scratch memory and RoPE tables are reused between
 * calls of the same shape. */
kiln_status kiln_zimage_dit_forward(kiln_zimage_dit *m, const kiln_zimage_dit_input *in,
                                    kiln_tensor *out, kiln_err *err);

/* RoPE tables of spec §3.3 for n positions `ids` (n, 3): cos and sin (n,
 * sum(axes_dims)), each pair's value repeated (interleaved layout); the
 * angle is computed in float64, rounded to fp32, and its cosine and sine
 * taken in fp32 as torch.polar does on the CPU. */
void kiln_zimage_rope_table(const int32_t *ids, int64_t n, const int64_t *axes_dims, double theta,
                            float *cos_out, float *sin_out);

#endif

/* kiln latent layout helpers on host f32 buffers: FLUX.2 packing and
 * patchifying, position ids, latent (de)normalisation before the VAE, and the
 * decoder output's conversion to 8-bit RGB.
 *
 *   // klein t2i, after the last step: x (B, h*w, 128) -> VAE input (B, 32, 2h, 2w)
 *   kiln_latents_unpack(x, grid, B, 128, h, w);                  // (B, 128, h, w)
 *   kiln_latents_bn_denormalize(grid, B, 128, h * w, info->bn_mean, info->bn_var,
 *                               info->bn_eps, KILN_BF16);
 *   kiln_latents_unpatchify(grid, z, B, 32, h, w);
 *   ... VAE decode z -> img (B, 3, H, W) ...
 *   kiln_latents_to_rgb8(img, rgb, B, H, W, KILN_BF16);          // (B, H, W, 3) bytes
 *
 * Layouts follow shared/spec/pipeline.md §4 and vae.md §5 (diffusers
 * Flux2KleinPipeline._pack_latents / _patchify_latents and their inverses):
 * token n = y*w + x holds the channels of cell (y, x), and the patchified
 * channel 4c + 2dy + dx holds latent[c, 2y+dy, 2x+dx].
 *
 * Arithmetic functions take the pipeline dtype: KILN_F32 rounds every
 * operation to fp32 as torch does; KILN_BF16 reproduces diffusers' bf16
 * pipeline, rounding every operation to bf16 (inputs must then hold
 * bf16-representable values, outputs do).  Another dtype is a bug (assert).
 *
 * Sizes are the caller's responsibility (validated upstream); all dims must be
 * positive and the buffers large enough.  Source and destination of the
 * layout functions must not overlap.  Everything is pure and thread-safe.
 */
#ifndef KILN_MODELS_LATENTS_H
#define KILN_MODELS_LATENTS_H

#include <stdint.h>

#include "common/tensor.h"

/* (B, C, h, w) -> (B, h*w, C) and back. */
void kiln_latents_pack(const float *src, float *dst, int64_t B, int64_t C, int64_t h, int64_t w);
void kiln_latents_unpack(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                         int64_t w);

/* (B, C, 2h, 2w) -> (B, 4C, h, w) and back; C is the un-patchified channel
 * count (the VAE's latent channels, 32 for FLUX.2). */
void kiln_latents_patchify(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                           int64_t w);
void kiln_latents_unpatchify(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                             int64_t w);

/* Z-Image's patch tokens (spec/z-image-turbo.md §3.2, diffusers
 * ZImageTransformer2DModel.patchify_and_embed / unpatchify): latents (B, C,
 * p*h, p*w) <-> tokens (B, h*w, p*p*C) where token y*w + x holds
 * latent[c, p*y + py, p*x + px] at feature (py*p + px)*C + c (channel
 * fastest, unlike FLUX.2's 4c + 2dy + dx). */
void kiln_latents_zimage_patchify(const float *src, float *dst, int64_t B, int64_t C, int64_t p,
                                  int64_t h, int64_t w);
void kiln_latents_zimage_unpatchify(const float *src, float *dst, int64_t B, int64_t C,
                                    int64_t p, int64_t h, int64_t w);

/* FLUX.2 BatchNorm statistics applied in place to x (B, C, hw), C = 4z:
 * std_c = sqrt(var_c + eps) computed in `dt` (eps from vae/config.json's
 * batch_norm_eps, rounded to fp32 as torch does with a Python scalar).
 * normalize: x = (x - mean_c) / std_c (edit references after the encoder);
 * denormalize: x = x * std_c + mean_c (before the decoder). */
void kiln_latents_bn_normalize(float *x, int64_t B, int64_t C, int64_t hw, const float *mean,
                               const float *var, double eps, kiln_dtype dt);
void kiln_latents_bn_denormalize(float *x, int64_t B, int64_t C, int64_t hw, const float *mean,
                                 const float *var, double eps, kiln_dtype dt);

/* FLUX.1 VAE input (Z-Image), in place over n values:
 * x = x / scaling_factor + shift_factor.  For KILN_BF16 x is first rounded to
 * bf16 (the latents are cast to the VAE dtype). */
void kiln_latents_kl_unscale(float *x, int64_t n, double scaling_factor, double shift_factor,
                             kiln_dtype dt);

/* Position ids, rows of 4 (t, y, x, i) in the int32 form the DiT takes
 * (models/flux2_dit.h; diffusers holds them as int64, same values):
 * output-image tokens (0, y, x, 0) for an h x w grid, y-major; */
void kiln_latents_image_ids(int32_t *ids, int64_t h, int64_t w);
/* reference image k (0-based, in request order): (10 + 10k, y, x, 0); */
void kiln_latents_ref_ids(int32_t *ids, int k, int64_t h, int64_t w);
/* text tokens: (0, 0, 0, i) for i in 0..T-1, padding rows included. */
void kiln_latents_text_ids(int32_t *ids, int64_t T);

/* Decoder output (B, 3, H, W) -> 8-bit RGB (B, H, W, 3) as diffusers'
 * postprocess + numpy_to_pil: clamp(x * 0.5 + 0.5, 0, 1) in `dt`, then
 * round_half_even(fp32(v) * 255).  The per-value rule is kernels/rgb8.h's,
 * which the backends' to_rgb8 op (the decode stage's path) applies too. */
void kiln_latents_to_rgb8(const float *x, uint8_t *rgb, int64_t B, int64_t H, int64_t W,
                          kiln_dtype dt);

#endif

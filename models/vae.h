/* kiln VAEs: FLUX.2 AutoencoderKLFlux2 (klein) and FLUX.1 AutoencoderKL
 * (Z-Image), written once against kernels/backend.h.
 *
 *   const cJSON *cfg = kiln_checkpoint_config(ck, "vae", &err);
 *   kiln_st *st = kiln_checkpoint_weights(ck, "vae", &err);
 *   kiln_vae *vae = kiln_vae_load(be, cfg, st, KILN_VAE_DECODER, &err);
 *   kiln_st_close(st);                        // weights now live in the backend
 *   const kiln_vae_info *info = kiln_vae_get_info(vae);
 *   // z: (B, info->latent_channels, h, w), img: (B, 3, 8h, 8w), both be->act_dtype
 *   if (kiln_vae_decode(vae, &z, &img, NULL, &err)) ...err.msg...
 *   kiln_vae_free(vae);
 *
 * The architecture follows shared/spec/vae.md (diffusers vae.py Encoder /
 * Decoder, ResnetBlock2D, UNetMidBlock2D with one single-head attention) and
 * is read from vae/config.json, so the tiny oracle checkpoints and the real
 * ones load through the same code.  The latent (de)normalisation is the
 * pipeline's job (models/latents.c); this module exposes what it needs: the
 * BatchNorm running statistics (FLUX.2) or the scaling/shift factors (FLUX.1).
 *
 * Memory: weights are uploaded once at load (decoder ~49.6 M parameters,
 * encoder ~34.4 M for the real configs).  Activations come from a scratch
 * arena owned by the VAE: three rotating buffers of the largest activation
 * (B x 256 x H x W elements at the full resolution of the real decoder, e.g.
 * 3 x 512 MiB in bf16 for one 1024x1024 image), plus four token buffers for
 * the mid-block attention at 1/8 resolution; kiln_vae_scratch_bytes() gives
 * the exact figure.  The arena is reserved at that size and keeps it between
 * calls, so repeated calls with the same or smaller shapes allocate nothing.
 * Whatever the backend needs internally (attention scores on the CPU) comes
 * on top.  Images above a size (kiln_vae_set_banding; 1024x1024 by default)
 * run in bands of rows with the same result (models/vae_band.h), so scratch
 * grows with two activations of one stage instead of three of the widest
 * (a 2048x2048 klein decode: about 2.2 GiB instead of 6.3 GiB).
 *
 * Thread-safety: a kiln_vae uses its backend and its arena, so it belongs to
 * the backend's thread; use one kiln_vae per backend instance.
 */
#ifndef KILN_MODELS_VAE_H
#define KILN_MODELS_VAE_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/safetensors.h"
#include "kernels/backend.h"

typedef struct kiln_vae kiln_vae;

typedef enum kiln_vae_kind {
    KILN_VAE_FLUX2, /* AutoencoderKLFlux2: quant convs, BatchNorm latent statistics */
    KILN_VAE_KL,    /* AutoencoderKL (FLUX.1 VAE used by Z-Image): scaling/shift factors */
} kiln_vae_kind;

/* Which halves to load (or'ed); a decoder service loads only the decoder.
 * KILN_VAE_LOGVAR (with the encoder): it also keeps the posterior's
 * log-variance half, for pipelines that sample the posterior (Z-Image's
 * img2img and inpainting) rather than take its mode (klein). */
enum { KILN_VAE_DECODER = 1, KILN_VAE_ENCODER = 2, KILN_VAE_LOGVAR = 4 };

typedef struct kiln_vae_info {
    kiln_vae_kind kind;
    int latent_channels; /* z: 32 for FLUX.2, 16 for FLUX.1 (8 / 4 in the tiny oracle) */
    int downscale;       /* pixels per latent pixel: 2^(len(block_out_channels) - 1) = 8 */
    unsigned parts;      /* KILN_VAE_DECODER / KILN_VAE_ENCODER / KILN_VAE_LOGVAR as loaded */
    int encode_channels; /* kiln_vae_encode's: latent_channels, 2x with KILN_VAE_LOGVAR */
    /* FLUX.2 only (bn_channels 0 otherwise): BatchNorm running statistics over
     * the 2x2-patchified latent, bn_channels = z * patch_h * patch_w floats
     * each, host memory owned by the VAE; the pipeline uses
     * std_c = sqrt(bn_var[c] + bn_eps).  vae.md section 5. */
    int bn_channels;
    int patch_h, patch_w;
    const float *bn_mean;
    const float *bn_var;
    double bn_eps;
    /* FLUX.1 only: decode input z = latents / scaling_factor + shift_factor
     * (diffusers defaults 0.18215 / 0 when the config omits them). */
    double scaling_factor;
    double shift_factor;
} kiln_vae_info;

/* Debug taps: when given, `fn` is called after each named stage with the
 * activation (a view into scratch memory, valid only during the call; on a
 * device backend download it to read it), channels-last (B, H, W, C).
 * Decoder stage names are diffusers' module names: "post_quant_conv",
 * "conv_in", "mid_block", "up_blocks.<i>"; encoder: "conv_in",
 * "down_blocks.<i>", "mid_block". */
typedef struct kiln_vae_tap {
    void (*fn)(void *ctx, const char *stage, const kiln_tensor *t);
    void *ctx;
} kiln_vae_tap;

/* Builds the VAE described by `config` (vae/config.json) from `weights`
 * (vae/ safetensors), uploading the parts asked for into `be`.  The weights
 * file may be closed afterwards.  Fails with KILN_ERR_UNSUPPORTED for another
 * _class_name or block type, KILN_ERR_FORMAT for an inconsistent config or a
 * missing / misshapen tensor (named in the message), KILN_ERR_NOMEM.  Returns
 * NULL with err set; the caller owns the result and frees it with
 * kiln_vae_free before destroying the backend. */
kiln_vae *kiln_vae_load(kiln_backend *be, const cJSON *config, const kiln_st *weights,
                        unsigned parts, kiln_err *err);
void kiln_vae_free(kiln_vae *vae);

/* Owned by vae, valid until kiln_vae_free. */
const kiln_vae_info *kiln_vae_get_info(const kiln_vae *vae);

/* Decodes z (B, latent_channels, h, w) into img (B, 3, h*downscale,
 * w*downscale), both backend tensors of be->act_dtype allocated by the caller
 * (img may not overlap z).  The output is raw decoder output, nominally in
 * [-1, 1] and not clamped.  Wrong ranks, channel counts, dtypes or output
 * sizes are KILN_ERR_INVALID; backend failures are reported as the backend
 * recorded them.  Needs a loaded decoder. */
kiln_status kiln_vae_decode(kiln_vae *vae, const kiln_tensor *z, kiln_tensor *img,
                            const kiln_vae_tap *tap, kiln_err *err);

/* Images of more than `above_pixels` pixels (H x W of one image, batch rows
 * not counted; 0: every image, KILN_VAE_BAND_NEVER: none) decode and encode
 * in bands of about `rows` full-resolution
 * rows (models/vae_band.h): the whole-image result (GroupNorm statistics
 * over the whole image, convolutions with halos; bit-identical on the CPU
 * up to the statistics' summation order) with less scratch memory.  After
 * load: above KILN_VAE_BAND_ABOVE_DEFAULT
 * pixels, bands of KILN_VAE_BAND_ROWS_DEFAULT rows.  Taps are not called for
 * banded passes.  KILN_ERR_INVALID for a negative size or rows outside
 * 1..KILN_VAE_BAND_ROWS_MAX. */
#define KILN_VAE_BAND_ABOVE_DEFAULT ((int64_t)1 << 20) /* 1024 x 1024 */
#define KILN_VAE_BAND_ROWS_DEFAULT 128
/* The most rows a band may have: the one bound of --vae-band-rows, which
 * kiln-encoder, kiln-decoder and kiln serve check against this so that a
 * value they accept is one this function accepts. */
#define KILN_VAE_BAND_ROWS_MAX 65536
#define KILN_VAE_BAND_NEVER INT64_MAX
kiln_status kiln_vae_set_banding(kiln_vae *vae, int64_t above_pixels, int64_t rows,
                                 kiln_err *err);

/* Encodes img (B, 3, H, W) in [-1, 1], H and W positive multiples of
 * downscale, into the posterior (B, encode_channels, H/downscale,
 * W/downscale): its mean (diffusers' latent_dist.mode()), followed with
 * KILN_VAE_LOGVAR by its log-variance, unclamped (DiagonalGaussianDistribution
 * clamps it to [-30, 20]; that is the sampler's job).  Without
 * KILN_VAE_LOGVAR the log-variance half is never computed.  Errors as for
 * decode.  Needs a loaded encoder. */
kiln_status kiln_vae_encode(kiln_vae *vae, const kiln_tensor *img, kiln_tensor *mean,
                            const kiln_vae_tap *tap, kiln_err *err);

/* Scratch bytes one call of `part` (KILN_VAE_DECODER or KILN_VAE_ENCODER)
 * needs for a batch of B images of H x W pixels with the current banding
 * setting, not counting the backend's own temporaries.  0 for a part that is
 * not loaded or a bad size. */
size_t kiln_vae_scratch_bytes(const kiln_vae *vae, unsigned part, int64_t B, int64_t H, int64_t W);

#endif

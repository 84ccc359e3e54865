/* The decode stage: the denoise stage's latents to 8-bit RGB images: the
 * family's tokens back to VAE latents (engine/family_stages.h: packed
 * FLUX.2 latents are BatchNorm de-normalised and unpatchified, Z-Image
 * patch tokens unpatchified, / scaling_factor + shift_factor), then the
 * VAE decoder, clamp and rounding as diffusers' image processor does (on
 * the backend, ops.to_rgb8: only the 8-bit image comes back to the host).
 *
 *   kiln_decode_stage *dec = kiln_decode_stage_create(be, ck, &err);
 *   kiln_image imgs[B];
 *   if (kiln_decode_run(dec, &latents, width, height, imgs, &err)) ...
 *   ... kiln_image_free(&imgs[i]); kiln_decode_stage_destroy(dec);
 *
 * Thread-safety: a stage uses its backend and scratch memory, so it belongs
 * to the backend's thread.
 */
#ifndef KILN_ENGINE_DECODE_STAGE_H
#define KILN_ENGINE_DECODE_STAGE_H

#include "common/checkpoint.h"
#include "common/image.h"
#include "kernels/backend.h"

typedef struct kiln_decode_stage kiln_decode_stage;

/* Loads the VAE decoder and its latent statistics.  NULL with err set. */
kiln_decode_stage *kiln_decode_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                            kiln_err *err);
void kiln_decode_stage_destroy(kiln_decode_stage *s);

/* Images of more than above_pixels pixels decode in bands of `rows` rows
 * (kiln_vae_set_banding: the whole-image result, less memory); the stage
 * starts with the VAE's defaults (above 1024x1024, 128 rows).
 * KILN_ERR_INVALID for values out of range. */
kiln_status kiln_decode_stage_set_banding(kiln_decode_stage *s, int64_t above_pixels,
                                          int64_t rows, kiln_err *err);

/* Decodes latents (B, N, C) with N = (height/16) * (width/16) (any
 * activation dtype) into B new
 * images (each freed by the caller with kiln_image_free).  raw_out, when not
 * NULL, receives the decoder output (B, 3, H, W) as host f32 (tests).  On
 * failure no image is left allocated. */
kiln_status kiln_decode_run(kiln_decode_stage *s, const kiln_tensor *latents, int width,
                            int height, kiln_image *images, float *raw_out, kiln_err *err);

#endif

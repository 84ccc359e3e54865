/* Banded VAE passes (internal to models/vae*.c): the decoder's up blocks
 * and the encoder's down blocks run over horizontal bands of rows, so that
 * scratch memory holds two whole activations of the current stage (its
 * input and its output) plus a few bands, instead of three whole
 * activations of the widest stage; the result is that of the whole-image
 * pass, not an approximation of it.
 *
 *   size_t need = vae_band_decode_bytes(&cfg, &dec, dsize, B, h, w, rows);
 *   if (vae_band_decode(be, arena, &cfg, &dec, rows, &z, &img, &err)) ...
 *
 * How each band gets the whole-image values:
 * - Convolutions read a halo: a 3x3 convolution's output row needs one
 *   input row above and below, so a band of R output rows reads R + 2 rows
 *   (and a resnet, two convolutions deep, R + 4 of its input); zero padding
 *   is applied only at the image's own top and bottom edge.
 * - GroupNorm uses the statistics of the whole image: every stored
 *   activation's per-group (mean, M2) is measured once over the whole of it
 *   (group_norm_stats); a resnet's inner norm (after conv1, whose output is
 *   never stored whole) gets its statistics from a first pass over all bands
 *   that computes conv1 and accumulates them, then a second pass recomputes
 *   conv1 with its halo and finishes the block (group_norm_apply).
 * - The mid block (with its attention over every latent pixel) and
 *   everything at latent resolution around it run whole, as in vae.c.
 * So the only differences from a whole pass are the statistics' summation
 * order and whatever the backend's convolution does differently for a band
 * shape (none on the CPU: its sums run in the same order).
 *
 * - The decoder's last upsampler (its output, at full resolution with 256
 *   channels, is the widest activation) is never stored: the first
 *   full-resolution resnet recomputes the rows of it that each pass needs.
 *
 * - A resnet that keeps the channel count writes its output over its input
 *   (each band's rows once the next band has read its halo).
 *
 * Memory (scratch, bf16, one 2048x2048 klein image, bands of 128 rows):
 * the largest pair of whole activations is the first full-resolution
 * resnet's input and output (256 channels at half resolution, 0.5 GiB, and
 * 128 at full, 1 GiB), plus about 0.6 GiB of band buffers and the 64 MiB
 * mid-block output: about 2.2 GiB, where the whole pass needs 6.3 GiB (3 x
 * 2 GiB of slots) and a whole 1024x1024 decode 1.6 GiB.  The price is compute: each resnet's conv1
 * runs twice and the last upsampler's conv three times, about 1.6 times the
 * whole pass's convolution work, plus the halo rows.  Every buffer is laid
 * out once from a dry run of the same walk, so the arena is reserved at its
 * exact size before anything runs.
 *
 * Not thread-safe: runs on its backend's thread.
 */
#ifndef KILN_MODELS_VAE_BAND_H
#define KILN_MODELS_VAE_BAND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "models/vae_blocks.h"
#include "models/vae_config.h"

/* Scratch bytes of a banded decode of latent z (B, latent, h, w), bands of
 * `rows` output rows. */
size_t vae_band_decode_bytes(const vae_config *c, const vae_coder *d, size_t dsize, int64_t B,
                             int64_t h, int64_t w, int64_t rows);

/* Decodes z (B, latent, h, w) into img (B, out_channels, h*f, w*f) in bands
 * of `rows` output rows, with every buffer from `arena` (reset and reserved
 * here).  Shapes are the caller's to validate.  Backend errors come back as
 * the backend recorded them. */
kiln_status vae_band_decode(kiln_backend *be, kiln_arena *arena, const vae_config *c,
                            const vae_coder *d, int64_t rows, const kiln_tensor *z,
                            kiln_tensor *img, kiln_err *err);

/* The same for the encoder: img (B, in_channels, H, W) to the posterior
 * mean (B, latent, H/f, W/f), bands of `rows` input rows. */
size_t vae_band_encode_bytes(const vae_config *c, const vae_coder *e, size_t dsize, int64_t B,
                             int64_t H, int64_t W, int64_t rows);
kiln_status vae_band_encode(kiln_backend *be, kiln_arena *arena, const vae_config *c,
                            const vae_coder *e, int64_t rows, const kiln_tensor *img,
                            kiln_tensor *mean, kiln_err *err);

#endif

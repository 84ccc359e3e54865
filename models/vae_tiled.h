/* Tiled VAE decoding (internal to models/vae*.c): the latent is cut into
 * overlapping tiles that are decoded one at a time and blended, so decoder
 * scratch memory stays that of one tile whatever the image size.
 *
 *   vae_tiling t;
 *   if (vae_tiling_init(&t, sample_size, 8, &err)) ...;
 *   if (vae_tiling_applies(&t, h, w))
 *       st = vae_decode_tiled(be, tiles_arena, &t, 8, &z, &img, decode_one, vae, &err);
 *
 * This is diffusers' AutoencoderKL.tiled_decode (what enable_tiling()
 * switches on; AutoencoderKLFlux2 has the same): tiles of sample_size /
 * downscale latent pixels every 3/4 of a tile; each decoded tile is blended
 * linearly into its upper neighbour over the first sample_size/4 rows, then
 * into its left neighbour over as many columns, both neighbours as already
 * blended; the top-left 3/4 of every tile is kept.  The result differs from
 * an untiled decode (each tile's mid-block attention sees only the tile),
 * which is why the pipelines leave it off.  Blends compute a + t (b - a)
 * where diffusers computes a (1 - t) + b t, the same up to rounding.
 * Not thread-safe: runs on its backend's thread.
 */
#ifndef KILN_MODELS_VAE_TILED_H
#define KILN_MODELS_VAE_TILED_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

typedef struct vae_tiling {
    int64_t tile;  /* tile side in latent pixels (tile_latent_min_size) */
    int64_t step;  /* latent distance between tile origins (overlap_size) */
    int64_t blend; /* output pixels blended with a neighbour (blend_extent) */
    int64_t limit; /* output pixels kept per tile side (row_limit) */
} vae_tiling;

/* Derives the tiling from the config's sample_size.  KILN_ERR_UNSUPPORTED
 * when the sizes do not tile the output exactly (kept tiles of `limit`
 * pixels must advance by `step` latent pixels). */
kiln_status vae_tiling_init(vae_tiling *t, int64_t sample_size, int64_t downscale,
                            kiln_err *err);

/* diffusers tiles when either latent side exceeds the tile. */
int vae_tiling_applies(const vae_tiling *t, int64_t h, int64_t w);

/* Decodes one tile z (B, zc, th, tw) into img (B, oc, th*f, tw*f). */
typedef kiln_status (*vae_tile_fn)(void *ctx, const kiln_tensor *z, kiln_tensor *img,
                                   kiln_err *err);

/* Decodes z (B, zc, h, w) into img (B, oc, h*f, w*f) tile by tile through
 * `fn`, with the tile buffers taken from `arena` (reset here; it must not be
 * the arena `fn` uses).  Shapes are the caller's to validate. */
kiln_status vae_decode_tiled(kiln_backend *be, kiln_arena *arena, const vae_tiling *t,
                             int64_t f, const kiln_tensor *z, kiln_tensor *img, vae_tile_fn fn,
                             void *ctx, kiln_err *err);

/* Bytes vae_decode_tiled takes from its arena for these sizes. */
size_t vae_tiled_bytes(const vae_tiling *t, int64_t f, int64_t B, int64_t zc, int64_t oc,
                       int64_t h, int64_t w, size_t dsize);

#endif

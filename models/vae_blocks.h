/* Building blocks of the VAE encoder and decoder (internal to models/vae*.c):
 * convolutions, GroupNorm, ResnetBlock2D, the single-head mid-block attention
 * and the up/down samplers, each with a loader and a forward step.
 *
 *   vae_run r = {.be = be, .arena = arena, .groups = 32, .cap = n};
 *   if (vae_run_begin(&r)) ...;          // three slot buffers from the arena
 *   vae_conv_from(&r, &conv_in, &z);     // external input -> slot
 *   vae_mid_apply(&r, &mid);  vae_resnet_apply(&r, &res);  ...
 *   vae_conv_to(&r, &conv_out, &img);    // slot -> external output
 *
 * A forward pass keeps its activation in one of three equal slot buffers of
 * `cap` elements and every step writes into the other two, so a whole pass
 * needs three buffers no matter how deep the network is.  Activations are
 * channels-last, (B, H, W, C), and conv weights are laid out (cout, k, k,
 * cin) at load (kernels/backend.h: tensor-core convolutions read that
 * layout, so none of them transposes); tensors outside the pass (latents,
 * images) stay (B, C, H, W) as diffusers has them.  Steps record
 * failures as the backend's sticky error (vae.md sections 2-4 for the maths).
 * Not thread-safe: a vae_run belongs to its backend's thread.
 */
#ifndef KILN_MODELS_VAE_BLOCKS_H
#define KILN_MODELS_VAE_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/vae.h"
#include "models/vae_config.h"

/* diffusers' GroupNorm eps in the VAE (resnets, attention, conv_norm_out). */
#define VAE_GN_EPS 1e-6f

typedef struct vae_conv {
    kiln_tensor w, b; /* (cout, k, k, cin) channels-last, (cout) */
} vae_conv;

typedef struct vae_norm {
    kiln_tensor w, b; /* (C), (C) */
} vae_norm;

typedef struct vae_resnet {
    vae_norm norm1, norm2;
    vae_conv conv1, conv2;
    vae_conv shortcut; /* 1x1, only when cin != cout (w.data NULL otherwise) */
} vae_resnet;

typedef struct vae_attn {
    vae_norm norm;
    kiln_tensor wq, bq, wk, bk, wv, bv, wo, bo; /* Linear (C, C) + (C) */
} vae_attn;

typedef struct vae_mid {
    vae_resnet res[2];
    int has_attn; /* mid_block_add_attention */
    vae_attn attn;
} vae_mid;

/* One down (encoder) or up (decoder) block: layers_per_block resnets in the
 * encoder, layers_per_block + 1 in the decoder, then the sampler except in
 * the last block. */
typedef struct vae_block {
    int nres;
    vae_resnet res[VAE_MAX_LAYERS + 1];
    int has_sampler;
    vae_conv sampler;
} vae_block;

/* Encoder or Decoder of diffusers vae.py plus the adjacent 1x1 conv of the
 * autoencoder (quant_conv after the encoder, post_quant_conv before the
 * decoder), when the config has it. */
typedef struct vae_coder {
    vae_conv quant;
    vae_conv conv_in;
    vae_block blocks[VAE_MAX_BLOCKS];
    vae_mid mid;
    vae_norm norm_out;
    vae_conv conv_out;
} vae_coder;

typedef struct vae_run {
    kiln_backend *be;
    kiln_arena *arena;
    int groups;               /* GroupNorm groups (norm_num_groups) */
    int64_t cap;              /* elements per slot */
    const kiln_vae_tap *tap;  /* or NULL */
    kiln_tensor slot[3];      /* 1-D capacity views into the arena */
    int cur;                  /* slot holding the activation */
    int64_t B, C, H, W;       /* its shape */
} vae_run;

/* Loaders: `prefix` is the module path ("decoder.up_blocks.0.resnets.1").
 * Missing or misshapen tensors fail with KILN_ERR_FORMAT / _NOT_FOUND naming
 * the tensor.  On failure the tensors loaded so far stay in the struct for
 * the caller's free. */
kiln_status vae_conv_load(kiln_backend *be, const kiln_st *st, vae_conv *c, int64_t cout,
                          int64_t cin, int k, const char *prefix, kiln_err *err);
/* Loads only the first `rows` output channels of a conv stored with `cout`
 * (the mean half of the encoder's moments). */
kiln_status vae_conv_load_rows(kiln_backend *be, const kiln_st *st, vae_conv *c, int64_t rows,
                               int64_t cout, int64_t cin, int k, const char *prefix,
                               kiln_err *err);
kiln_status vae_norm_load(kiln_backend *be, const kiln_st *st, vae_norm *n, int64_t c,
                          const char *prefix, kiln_err *err);
kiln_status vae_resnet_load(kiln_backend *be, const kiln_st *st, vae_resnet *r, int64_t cin,
                            int64_t cout, const char *prefix, kiln_err *err);
kiln_status vae_mid_load(kiln_backend *be, const kiln_st *st, vae_mid *m, int64_t c, int attn,
                         const char *prefix, kiln_err *err);

void vae_conv_free(kiln_backend *be, vae_conv *c);
void vae_norm_free(kiln_backend *be, vae_norm *n);
void vae_resnet_free(kiln_backend *be, vae_resnet *r);
void vae_mid_free(kiln_backend *be, vae_mid *m);

/* The layout changes at the pass's edges: x (B, C, H, W) -> y (B, H, W, C)
 * and back. */
void vae_nchw_to_nhwc(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void vae_nhwc_to_nchw(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

/* Takes the three slot buffers from the arena (after the caller's reset). */
kiln_status vae_run_begin(vae_run *r);
/* Hands the current activation to the tap, if any. */
void vae_run_tap(vae_run *r, const char *stage);
/* Copies x (B, H, W, C) into the current slot as the activation, and the
 * activation out into y of its shape (models/vae_band.c's hand-overs
 * between whole and banded stages). */
void vae_run_load(vae_run *r, const kiln_tensor *x);
void vae_run_store(vae_run *r, kiln_tensor *y);

/* conv from an external tensor x (B, cin, H, W) into a slot (padding 1 for
 * 3x3, 0 for 1x1); x goes channels-last through another slot first. */
void vae_conv_from(vae_run *r, const vae_conv *c, const kiln_tensor *x);
/* conv of the current activation into an external tensor y (B, cout, H,
 * W), through another slot. */
void vae_conv_to(vae_run *r, const vae_conv *c, kiln_tensor *y);
/* conv of the current activation into another slot, same padding rule. */
void vae_conv_apply(vae_run *r, const vae_conv *c);
/* GroupNorm + SiLU in place (conv_norm_out + conv_act). */
void vae_norm_silu_apply(vae_run *r, const vae_norm *n);
void vae_resnet_apply(vae_run *r, const vae_resnet *res);
void vae_mid_apply(vae_run *r, const vae_mid *m);
/* Upsample2D: nearest 2x then the 3x3 conv. */
void vae_upsample_apply(vae_run *r, const vae_conv *c);
/* Downsample2D: zero pad right and bottom by one, 3x3 conv with stride 2. */
void vae_downsample_apply(vae_run *r, const vae_conv *c);

/* kernels/backend.c hands out arena tensors on 256-byte boundaries; scratch
 * estimates round each tensor the same way. */
#define VAE_ARENA_ALIGN 256

static inline size_t vae_align_bytes(int64_t elems, size_t dsize)
{
    return ((size_t)elems * dsize + VAE_ARENA_ALIGN - 1) & ~(size_t)(VAE_ARENA_ALIGN - 1);
}

/* The mid-block attention takes this many (B, H*W, C) token buffers from the
 * arena on top of the slots. */
#define VAE_ATTN_BUFS 4

#endif

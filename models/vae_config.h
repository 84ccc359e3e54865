/* The VAE's vae/config.json, parsed and validated (internal to models/vae*.c).
 *
 *   vae_config cfg;
 *   if (vae_config_parse(json, &cfg, &err)) return err.code;
 *
 * Only the keys that change the computation are read; keys that would select
 * an architecture this code does not implement (another block type, another
 * activation, separate decoder channels) are rejected rather than ignored.
 */
#ifndef KILN_MODELS_VAE_CONFIG_H
#define KILN_MODELS_VAE_CONFIG_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "models/vae.h"

#define VAE_MAX_BLOCKS 6
#define VAE_MAX_LAYERS 4

typedef struct vae_config {
    kiln_vae_kind kind;
    int nblocks;                     /* len(block_out_channels) */
    int64_t channels[VAE_MAX_BLOCKS]; /* block_out_channels */
    int layers;                      /* layers_per_block */
    int64_t latent;                  /* latent_channels (z) */
    int groups;                      /* norm_num_groups */
    int64_t in_channels, out_channels;
    int mid_attn;                    /* mid_block_add_attention */
    int quant, post_quant;           /* use_quant_conv, use_post_quant_conv */
    double bn_eps;                   /* FLUX.2 */
    int patch_h, patch_w;            /* FLUX.2 */
    double scaling, shift;           /* FLUX.1 */
} vae_config;

/* Fails with KILN_ERR_FORMAT (missing/mistyped/inconsistent key) or
 * KILN_ERR_UNSUPPORTED (another class or block type); messages start with
 * "vae/config.json". */
kiln_status vae_config_parse(const cJSON *json, vae_config *cfg, kiln_err *err);

#endif

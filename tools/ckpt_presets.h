/* Checkpoint maker presets: the dimensions of the published FLUX.2 klein
 * checkpoints and of the oracle's tiny ones, and the config documents each
 * component folder carries (key sets as diffusers 0.40 / transformers 5.17
 * write them, values from shared/spec/).
 *
 *   const kiln_ckpt_preset *p = kiln_ckpt_preset_find("tiny");
 *   cJSON *cfg = kiln_ckpt_config(p, "transformer");   // caller deletes
 *
 * Presets are constant data; everything here is thread-safe.
 */
#ifndef KILN_TOOLS_CKPT_PRESETS_H
#define KILN_TOOLS_CKPT_PRESETS_H

#include <cjson/cJSON.h>

#include "ckpt_arch.h"

typedef struct kiln_ckpt_preset {
    const char *name;
    const char *pipeline;  /* model_index _class_name */
    int is_distilled;      /* 1/0, or -1: no is_distilled key (the KV pipeline) */
    int zimage;            /* Z-Image DiT + AutoencoderKL instead of FLUX.2 */
    int max_window_layers; /* Qwen3 config value (unused by the model) */
    kiln_qwen3_dims text;
    kiln_flux2_dims flux2;
    kiln_zimage_dims zdit;
    kiln_vae_dims vae;
} kiln_ckpt_preset;

/* NULL when unknown. */
const kiln_ckpt_preset *kiln_ckpt_preset_find(const char *name);
/* "tiny|klein-4b|..." for usage messages. */
const char *kiln_ckpt_preset_names(void);

/* The document for "model_index", "transformer", "text_encoder",
 * "text_encoder_generation" (generation_config.json, Qwen3ForCausalLM only;
 * NULL otherwise), "vae" or "scheduler".  NULL on allocation failure or an
 * unknown name. */
cJSON *kiln_ckpt_config(const kiln_ckpt_preset *p, const char *what);

#endif

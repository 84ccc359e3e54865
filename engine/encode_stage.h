/* The encode stage: prompts to FLUX.2 klein or Z-Image text embeddings
 * (tokenizer + Qwen3 with the pipeline's chat template and hidden states),
 * and edit reference images to packed latent tokens (VAE encoder).
 *
 *   kiln_encode_opts o = KILN_ENCODE_DEFAULTS;      // the checkpoint's layers
 *   kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &o, &err);
 *   kiln_tensor emb;                                 // (B, T, J) in backend memory
 *   if (kiln_encode_prompts(enc, prompts, B, 512, &emb, NULL, NULL, &err)) ...
 *   ... kiln_be_free(be, &emb); kiln_encode_stage_destroy(enc);
 *
 * Thread-safety: a stage uses its backend and scratch memory, so it belongs
 * to the backend's thread.
 */
#ifndef KILN_ENGINE_ENCODE_STAGE_H
#define KILN_ENGINE_ENCODE_STAGE_H

#include <stdint.h>

#include "common/checkpoint.h"
#include "common/image.h"
#include "kernels/backend.h"
#include "prompt_cache.h"
#include "request.h"

typedef struct kiln_encode_opts {
    int out_layers[KILN_MAX_OUT_LAYERS]; /* text_encoder_out_layers */
    int n_out_layers; /* 0: the checkpoint's (kiln_encode_layers_of) */
    int with_references; /* also load the VAE encoder, for edits */
    /* Host memory for prompt embeddings already computed
     * (engine/prompt_cache.h); 0 computes every prompt. */
    size_t prompt_cache_bytes;
} kiln_encode_opts;

/* The checkpoint's text_encoder_out_layers (kiln_encode_layers_of).  The
 * prompt cache stays off here: the one-process users (kiln generate,
 * kiln-stagebench, which times encode with prompts it repeats) gain nothing
 * from it; kiln-encoder turns it on. */
#define KILN_ENCODE_DEFAULTS ((kiln_encode_opts){{0}, 0, 1, 0})

typedef struct kiln_encode_stage kiln_encode_stage;

/* The hidden states a checkpoint's DiT consumes: model_index.json's
 * `text_encoder_out_layers` when it records them (kiln's tiny checkpoints
 * do: their Qwen3 has 4 layers; diffusers ignores the key, its pipelines
 * take the layers as a call argument), else the pipeline's default
 * (diffusers' Flux2KleinPipeline: 9, 18, 27; ZImagePipeline: -2).
 * out gets up to KILN_MAX_OUT_LAYERS indices; KILN_ERR_FORMAT names the key
 * when it is malformed.  Thread-safe. */
kiln_status kiln_encode_layers_of(const kiln_checkpoint *ck, int *out, int *n, kiln_err *err);

/* Loads the tokenizer, the Qwen3 layers the requested hidden states need
 * (opts->n_out_layers 0: kiln_encode_layers_of's)
 * and, with with_references, the VAE encoder.  NULL with err set (a missing
 * component is named).  The caller owns the stage; `be` must outlive it. */
kiln_encode_stage *kiln_encode_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                            const kiln_encode_opts *opts, kiln_err *err);
void kiln_encode_stage_destroy(kiln_encode_stage *s);

/* Reference images of more than above_pixels pixels (as prepared) encode
 * in bands of `rows` rows (kiln_vae_set_banding: the whole-image result,
 * less memory); the stage starts with the VAE's defaults (above 1024x1024,
 * 128 rows).  A no-op without with_references.  KILN_ERR_INVALID for
 * values out of range. */
kiln_status kiln_encode_stage_set_banding(kiln_encode_stage *s, int64_t above_pixels,
                                          int64_t rows, kiln_err *err);

/* Text embedding width J (= n_out_layers * hidden size). */
int64_t kiln_encode_stage_width(const kiln_encode_stage *s);

/* Encodes B prompts with the pipeline's chat template, truncated / padded to
 * max_seq tokens, into `out`, allocated here as (B, max_seq, J) of
 * be->act_dtype (caller frees with kiln_be_free).  ids_out, when not NULL,
 * receives the B * max_seq token ids, lens_out the B real-token counts
 * (Z-Image's DiT takes only the real rows, which come first in each row of
 * out; the rows after them are Qwen3's outputs at the padding).  Invalid
 * UTF-8 is KILN_ERR_INVALID.
 * Rows found in the prompt cache are uploaded, a prompt repeated within the
 * batch is computed once, the others run through Qwen3 in one batch and
 * enter the cache when it admits them (from a prompt's second miss on);
 * each row has the bytes it gets encoded alone. */
kiln_status kiln_encode_prompts(kiln_encode_stage *s, const char *const *prompts, int B,
                                int max_seq, kiln_tensor *out, int32_t *ids_out, int *lens_out,
                                kiln_err *err);

/* The request traits of the stage's checkpoint (kiln_model_traits_of). */
kiln_model_traits kiln_encode_stage_traits(const kiln_encode_stage *s);

/* The prompt cache's counters (engine/prompt_cache.h). */
void kiln_encode_stage_cache_stats(const kiln_encode_stage *s, kiln_prompt_cache_stats *out);

/* VAE-encodes n images in order into the family's tokens: klein prepares
 * each as a reference (spec/pipeline.md section 8: shrunk, cropped), then
 * patchifies, BN-normalises and packs its posterior's mode, 4z features a
 * token; Z-Image takes each image as it is (already sized by
 * kiln_inpaint_prepare_image) and hands on its posterior's mean and
 * log-variance as patch tokens, 2 x 4z features (the denoise stage
 * samples them).  `tokens` is allocated here as (1, R, C) of
 * be->act_dtype and `ids` as a malloc'd (R, 4) array with t = 10 + 10k
 * for image k (klein's positions; Z-Image reads none); the caller frees
 * both.  Needs with_references.  Bad images are KILN_ERR_INVALID. */
kiln_status kiln_encode_references(kiln_encode_stage *s, const kiln_image *refs, int n,
                                   kiln_tensor *tokens, int32_t **ids, int64_t *R, kiln_err *err);

/* The inpainting mask (kiln_image_decode_mask, any size: resized) at the
 * grid the family's pipeline blends on, for a width x height output: klein
 * one value per 16-pixel token (engine/inpaint.h kiln_inpaint_mask),
 * Z-Image one per 8-pixel VAE latent (kiln_inpaint_mask_latent).  *out is
 * malloc'd (*n floats, row-major; the caller frees it).  KILN_ERR_INVALID
 * for sizes that are not multiples of 16, _NOMEM.  Thread-safe (reads
 * the stage's constant family entry only). */
kiln_status kiln_encode_mask(const kiln_encode_stage *s, const kiln_image *mask, int width,
                             int height, float **out, int64_t *n, kiln_err *err);

#endif

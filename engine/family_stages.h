/* The engine's model-family seam: what the encode, denoise and decode
 * stages need of a family, one constant entry per family.  The stages
 * call through it and name no family themselves.
 *
 *   const kiln_family_stages *fs = kiln_family_stages_of(ck);  // never NULL
 *   if (vae_info->kind != fs->vae_kind) ...                    // decode stage
 *   fs->denoise->run(stage, job, &latents, &err);              // denoise stage
 *
 * Each family's entry is written once, in its own files: FLUX.2 klein in
 * family_klein.c (latents <-> VAE, template) and denoise_klein.c (its DiT
 * and loop), Z-Image in family_zimage.c and denoise_zimage.c.  A new family
 * is those two files, its enum value and traits entry in engine/family.c,
 * and its line in family_stages.c's table (a static assertion there fails
 * to compile when a family has no line).
 *
 * Why a second table beside engine/family.h: family.c (the pipeline class
 * to family and request traits) is linked by the service tests' fake
 * replicas without any model code, while this one names models/ code.
 *
 * The entries are constant: thread-safe.
 */
#ifndef KILN_ENGINE_FAMILY_STAGES_H
#define KILN_ENGINE_FAMILY_STAGES_H

#include <stdint.h>

#include "common/checkpoint.h"
#include "common/image.h"
#include "models/tokenizer.h"
#include "models/vae.h"

/* A family's DiT and denoising loop (engine/denoise_internal.h): private to
 * the denoise stage. */
typedef struct kiln_denoise_loop kiln_denoise_loop;

/* How the DiT's latent tokens (B, h*w, channels), one token per 16x16
 * pixels, lie over the VAE's latents (B, z, h*patch, w*patch). */
typedef struct kiln_token_layout {
    int64_t channels; /* features per token */
    int64_t patch;    /* latent pixels per token side */
} kiln_token_layout;

typedef struct kiln_family_stages {
    const char *title; /* the family in messages: "klein", "Z-Image" */
    /* Encode stage: the pipeline's Qwen3 chat template (its
     * enable_thinking: Flux2KleinPipeline False, ZImagePipeline True). */
    kiln_chat_template chat;
    /* Denoise stage: the DiT, the initial noise and the loop. */
    const kiln_denoise_loop *denoise;
    /* Decode stage: the VAE class the pipeline takes (checked on load) and
     * its diffusers name for the refusal. */
    kiln_vae_kind vae_kind;
    const char *vae_class;
    /* The token layout of checkpoint ck over its loaded VAE; fails
     * (KILN_ERR_FORMAT, err set) when the transformer and VAE disagree. */
    kiln_status (*token_layout)(const kiln_checkpoint *ck, const kiln_vae_info *vae,
                                kiln_token_layout *out, kiln_err *err);
    /* The denoised tokens x (B, h*w, channels), host f32, to the VAE's
     * input latents (B, z, h*patch, w*patch) in x, with the pipeline's
     * de-normalisation rounded to act (the backend's dtype, as diffusers'
     * latents.to(vae dtype)).  scratch holds as many floats as x. */
    void (*unpack)(const kiln_token_layout *l, const kiln_vae_info *vae, float *x, float *scratch,
                   int64_t B, int64_t h, int64_t w, kiln_dtype act);
    /* Encode stage, input images (edit references, img2img and
     * inpainting starts).  vae_parts: how its VAE encoder loads (or'ed
     * into KILN_VAE_ENCODER).  prepare: the image to the VAE's input
     * (1, 3, H, W) host F32 (klein: kiln_image_flux2_ref_prepare, which
     * shrinks and crops a reference; Z-Image: the image as it is, already
     * sized by kiln_inpaint_prepare_image).  pack: the VAE's output
     * (1, encode_channels, 2h, 2w) host f32 to h*w tokens of
     * image_moments x channels features in `tokens` (scratch as large as
     * the input), rounded to act where the pipeline rounds. */
    unsigned vae_parts;
    kiln_status (*prepare)(const kiln_image *img, kiln_tensor *out, kiln_err *err);
    void (*pack)(const kiln_vae_info *vae, const float *posterior, float *scratch, float *tokens,
                 int64_t h, int64_t w, kiln_dtype act);
    /* 1: an image's tokens are the DiT's latents (klein: the posterior's
     * mode, normalised); 2: the posterior's mean then log-variance per
     * token, which the denoise stage samples from each row's generator
     * before its noise (ZImageImg2ImgPipeline, ZImageInpaintPipeline). */
    int image_moments;
    /* Inpainting: the mask (kiln_image_decode_mask) at the grid the
     * pipeline blends on, one float per mask_cell x mask_cell pixels of
     * the W x H output (klein 16: a token; Z-Image 8: a VAE latent pixel). */
    int mask_cell;
    kiln_status (*mask)(const kiln_image *mask, int width, int height, float *out, kiln_err *err);
} kiln_family_stages;

/* The entry of a checkpoint's family (engine/family.h kiln_family_of).
 * Never NULL. */
const kiln_family_stages *kiln_family_stages_of(const kiln_checkpoint *ck);

/* The entries, for family_stages.c's table. */
extern const kiln_family_stages kiln_family_stages_klein, kiln_family_stages_zimage;

#endif

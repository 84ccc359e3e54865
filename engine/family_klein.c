/* FLUX.2 klein's entry of the engine seam (family_stages.h): its latent
 * tokens over AutoencoderKLFlux2, its chat template; its DiT and loop are
 * denoise_klein.c. */
#include "denoise_internal.h"
#include "inpaint.h"
#include "models/latents.h"

/* Flux2KleinPipeline's packed latents: 2x2 patches of the VAE latents,
 * bn_channels = z x 2 x 2 features a token (the channels of the VAE's
 * BatchNorm statistics). */
static kiln_status token_layout(const kiln_checkpoint *ck, const kiln_vae_info *vae,
                                kiln_token_layout *out, kiln_err *err)
{
    (void)ck, (void)err;
    out->channels = vae->bn_channels, out->patch = 2;
    return KILN_OK;
}

/* pipeline.md section 10 (Flux2KleinPipeline's _unpack_latents_with_ids,
 * then x * std + mean with the VAE's BatchNorm statistics and
 * _unpatchify_latents): unpack, de-normalise, unpatchify to (B, z, 2h, 2w). */
static void unpack(const kiln_token_layout *l, const kiln_vae_info *vae, float *x, float *scratch,
                   int64_t B, int64_t h, int64_t w, kiln_dtype act)
{
    kiln_latents_unpack(x, scratch, B, l->channels, h, w);
    kiln_latents_bn_denormalize(scratch, B, l->channels, h * w, vae->bn_mean, vae->bn_var,
                                vae->bn_eps, act);
    kiln_latents_unpatchify(scratch, x, B, vae->latent_channels, h, w);
}

/* pipeline.md section 8 step 5: patchify, (x - mean_c) / std_c, pack. */
static void pack(const kiln_vae_info *vae, const float *posterior, float *scratch, float *tokens,
                 int64_t h, int64_t w, kiln_dtype act)
{
    int64_t C = vae->bn_channels;
    kiln_latents_patchify(posterior, scratch, 1, vae->latent_channels, h, w);
    kiln_latents_bn_normalize(scratch, 1, C, h * w, vae->bn_mean, vae->bn_var, vae->bn_eps, act);
    kiln_latents_pack(scratch, tokens, 1, C, h, w);
}

const kiln_family_stages kiln_family_stages_klein = {
    .title = "klein",
    .chat = KILN_CHAT_KLEIN,
    .denoise = &kiln_denoise_loop_klein,
    .vae_kind = KILN_VAE_FLUX2,
    .vae_class = "AutoencoderKLFlux2",
    .token_layout = token_layout,
    .unpack = unpack,
    .vae_parts = KILN_VAE_ENCODER,
    .prepare = kiln_image_flux2_ref_prepare,
    .pack = pack,
    .image_moments = 1,
    .mask_cell = 16,
    .mask = kiln_inpaint_mask,
};

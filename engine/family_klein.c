/* FLUX.2 klein's entry of the engine seam (family_stages.h): its latent
 * tokens over AutoencoderKLFlux2, its chat template; its DiT and loop are
 * denoise_klein.c. */
#include "denoise_internal.h"
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

const kiln_family_stages kiln_family_stages_klein = {
    .title = "klein",
    .chat = KILN_CHAT_KLEIN,
    .denoise = &kiln_denoise_loop_klein,
    .vae_kind = KILN_VAE_FLUX2,
    .vae_class = "AutoencoderKLFlux2",
    .token_layout = token_layout,
    .unpack = unpack,
};

/* Z-Image's entry of the engine seam (family_stages.h): its patch tokens
 * over AutoencoderKL (the FLUX.1 VAE), its chat template; its DiT and loop
 * are denoise_zimage.c. */
#include <string.h>

#include "denoise_internal.h"
#include "inpaint.h"
#include "models/latents.h"
#include "models/zimage_dit.h"

/* The DiT's patches (all_patch_size[0]) of the VAE latents; the DiT must
 * read the VAE's channels, and a token must cover 16 pixels (the 1/8 VAE
 * and 2x2 patches every front end's size rules assume). */
static kiln_status token_layout(const kiln_checkpoint *ck, const kiln_vae_info *vae,
                                kiln_token_layout *out, kiln_err *err)
{
    const cJSON *tcfg = kiln_checkpoint_config(ck, "transformer", err);
    kiln_zimage_dit_config zc;
    if (!tcfg || kiln_zimage_dit_config_parse(tcfg, &zc, err))
        return err ? err->code : KILN_ERR_FORMAT;
    if (zc.in_channels != vae->latent_channels || zc.patch * 8 != 16 || vae->downscale != 8)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "the transformer's %lld channels in %lld-patches do not match the "
                            "VAE's %d latent channels at 1/%d scale", (long long)zc.in_channels,
                            (long long)zc.patch, vae->latent_channels, vae->downscale);
    out->channels = zc.in_channels * zc.patch * zc.patch, out->patch = zc.patch;
    return KILN_OK;
}

/* z-image-turbo.md §4 item 6 (ZImagePipeline's decode): the DiT's tokens
 * back to (B, z, 2h, 2w), then latents.to(vae dtype) / scaling_factor +
 * shift_factor. */
static void unpack(const kiln_token_layout *l, const kiln_vae_info *vae, float *x, float *scratch,
                   int64_t B, int64_t h, int64_t w, kiln_dtype act)
{
    int64_t n = B * h * w * l->channels;
    kiln_latents_zimage_unpatchify(x, scratch, B, vae->latent_channels, l->patch, h, w);
    kiln_latents_kl_unscale(scratch, n, vae->scaling_factor, vae->shift_factor, act);
    memcpy(x, scratch, (size_t)n * sizeof *x);
}

/* The posterior (1, 2z, 2h, 2w), mean then log-variance, each to the DiT's
 * patch tokens; a token holds its mean's features, then its
 * log-variance's.  Nothing is rounded: the denoise stage samples in fp32
 * as DiagonalGaussianDistribution does. */
static void pack(const kiln_vae_info *vae, const float *posterior, float *scratch, float *tokens,
                 int64_t h, int64_t w, kiln_dtype act)
{
    (void)act;
    int64_t z = vae->latent_channels, C = 4 * z, N = h * w;
    for (int half = 0; half < 2; half++) {
        kiln_latents_zimage_patchify(posterior + half * z * 4 * N, scratch, 1, z, 2, h, w);
        for (int64_t t = 0; t < N; t++)
            memcpy(tokens + (t * 2 + half) * C, scratch + t * C, (size_t)C * sizeof *tokens);
    }
}

const kiln_family_stages kiln_family_stages_zimage = {
    .title = "Z-Image",
    .chat = KILN_CHAT_ZIMAGE,
    .denoise = &kiln_denoise_loop_zimage,
    .vae_kind = KILN_VAE_KL,
    .vae_class = "AutoencoderKL",
    .token_layout = token_layout,
    .unpack = unpack,
    .vae_parts = KILN_VAE_ENCODER | KILN_VAE_LOGVAR,
    .prepare = kiln_image_to_unit_tensor,
    .pack = pack,
    .image_moments = 2,
    .mask_cell = 8,
    .mask = kiln_inpaint_mask_latent,
};

#include "decode_stage.h"

#include <stdlib.h>

#include "family_stages.h"
#include "models/vae.h"

struct kiln_decode_stage {
    kiln_backend *be;
    kiln_vae *vae;
    const kiln_family_stages *family; /* the checkpoint's */
    kiln_token_layout layout;         /* the DiT's tokens over the VAE's latents */
};

kiln_decode_stage *kiln_decode_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                            kiln_err *err)
{
    kiln_decode_stage *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    const cJSON *cfg = kiln_checkpoint_config(ck, "vae", err);
    kiln_st *st = cfg ? kiln_checkpoint_weights(ck, "vae", err) : NULL;
    if (!st)
        goto fail;
    s->vae = kiln_vae_load(be, cfg, st, KILN_VAE_DECODER, err);
    kiln_st_close(st);
    if (!s->vae)
        goto fail;
    const kiln_vae_info *info = kiln_vae_get_info(s->vae);
    s->family = kiln_family_stages_of(ck);
    if (info->kind != s->family->vae_kind) {
        kiln_err_set(err, KILN_ERR_UNSUPPORTED, "vae: the %s pipeline needs %s",
                     s->family->title, s->family->vae_class);
        goto fail;
    }
    if (s->family->token_layout(ck, info, &s->layout, err))
        goto fail;
    return s;
fail:
    kiln_decode_stage_destroy(s);
    return NULL;
}

void kiln_decode_stage_destroy(kiln_decode_stage *s)
{
    if (!s)
        return;
    kiln_vae_free(s->vae);
    free(s);
}

kiln_status kiln_decode_stage_set_banding(kiln_decode_stage *s, int64_t above_pixels,
                                          int64_t rows, kiln_err *err)
{
    return kiln_vae_set_banding(s->vae, above_pixels, rows, err);
}

/* Pixels per VAE pass.  The decoder's scratch grows with rows x pixels
 * (three slots of 256 channels at full resolution: 1.5 KiB a pixel in bf16,
 * 1.5 GiB for one 1024x1024 image; about half of that per pixel above it,
 * where the VAE runs in bands), and one 1024x1024 image already fills the
 * GPU, so a batch of large images is decoded a row at a time (small ones
 * still together); the VAE treats rows independently. */
#define DECODE_PASS_PIXELS ((int64_t)1 << 20)

kiln_status kiln_decode_run(kiln_decode_stage *s, const kiln_tensor *latents, int width,
                            int height, kiln_image *images, float *raw_out, kiln_err *err)
{
    kiln_backend *be = s->be;
    const kiln_vae_info *info = kiln_vae_get_info(s->vae);
    int64_t h = height / 16, w = width / 16, z = info->latent_channels;
    int64_t C = s->layout.channels, p = s->layout.patch;
    if (latents->ndim != 3 || latents->shape[1] != h * w || latents->shape[2] != C ||
        width % 16 || height % 16 || width < 16 || height < 16)
        return kiln_err_set(err, KILN_ERR_INVALID, "decode: latents do not match %dx%d", width,
                            height);
    int64_t B = latents->shape[0], H = height, W = width;
    size_t n_lat = (size_t)(B * h * w * C);
    float *packed = malloc(n_lat * sizeof(float)), *grid = malloc(n_lat * sizeof(float));
    kiln_tensor zt = {0}, img = {0}, rgb = {0};
    kiln_status st = KILN_OK;
    int made = 0;
    if (!packed || !grid) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory decoding latents");
        goto done;
    }
    kiln_be_download(be, latents, packed);
    /* The family's unpacking and de-normalisation, to (B, z, ph, pw). */
    s->family->unpack(&s->layout, info, packed, grid, B, h, w, be->act_dtype);
    if (kiln_be_from_host(be, &zt, 4, (int64_t[]){B, z, p * h, p * w}, packed, KILN_F32) ||
        kiln_be_alloc(be, &img, be->act_dtype, 4, (int64_t[]){B, 3, H, W}) ||
        kiln_be_alloc(be, &rgb, KILN_U8, 4, (int64_t[]){B, H, W, 3})) {
        st = kiln_be_check(be, err);
        goto done;
    }
    int64_t per_pass = DECODE_PASS_PIXELS / (H * W) > 1 ? DECODE_PASS_PIXELS / (H * W) : 1;
    for (int64_t b0 = 0; b0 < B; b0 += per_pass) {
        int64_t n = B - b0 < per_pass ? B - b0 : per_pass;
        kiln_tensor zv = kiln_tensor_batch_view(&zt, b0, n);
        kiln_tensor iv = kiln_tensor_batch_view(&img, b0, n);
        if ((st = kiln_vae_decode(s->vae, &zv, &iv, NULL, err)))
            goto done;
    }
    /* diffusers' postprocess (clamp, * 255, round) on the backend
     * (kernels/rgb8.h's rule, the bytes kiln_latents_to_rgb8 gives on the
     * host): 3 bytes a pixel come back instead of 3 activations, and the
     * host does no per-pixel work. */
    kiln_be_to_rgb8(be, &rgb, &img);
    if (raw_out)
        kiln_be_download(be, &img, raw_out);
    for (; made < B; made++) {
        if ((st = kiln_image_alloc(&images[made], width, height, err)))
            goto done;
        kiln_tensor one = kiln_tensor_batch_view(&rgb, made, 1);
        kiln_be_download_bytes(be, &one, images[made].pixels);
    }
    st = kiln_be_check(be, err);
done:
    if (st)
        for (int i = 0; i < made; i++)
            kiln_image_free(&images[i]);
    kiln_be_free(be, &zt), kiln_be_free(be, &img), kiln_be_free(be, &rgb);
    free(packed), free(grid);
    return st;
}

#include "vae.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vae_blocks.h"
#include "vae_config.h"
#include "vae_band.h"

struct kiln_vae {
    kiln_backend *be;
    kiln_arena *arena;
    vae_config cfg;
    kiln_vae_info info;
    vae_coder dec, enc;
    float *bn_mean, *bn_var;
    int64_t band_above;      /* kiln_vae_set_banding: pixels per image */
    int64_t band_rows;
};

static void coder_free(kiln_backend *be, vae_coder *c)
{
    vae_conv_free(be, &c->quant);
    vae_conv_free(be, &c->conv_in);
    for (int i = 0; i < VAE_MAX_BLOCKS; i++) {
        for (int j = 0; j < c->blocks[i].nres; j++)
            vae_resnet_free(be, &c->blocks[i].res[j]);
        vae_conv_free(be, &c->blocks[i].sampler);
    }
    vae_mid_free(be, &c->mid);
    vae_norm_free(be, &c->norm_out);
    vae_conv_free(be, &c->conv_out);
}

/* vae.md section 3 and section 6 (tensor names). */
static kiln_status decoder_load(kiln_vae *v, const kiln_st *st, kiln_err *err)
{
    const vae_config *c = &v->cfg;
    kiln_backend *be = v->be;
    vae_coder *d = &v->dec;
    int n = c->nblocks;
    int64_t top = c->channels[n - 1];
    char p[128];
    if (c->post_quant &&
        vae_conv_load(be, st, &d->quant, c->latent, c->latent, 1, "post_quant_conv", err))
        return err->code;
    if (vae_conv_load(be, st, &d->conv_in, top, c->latent, 3, "decoder.conv_in", err) ||
        vae_mid_load(be, st, &d->mid, top, c->mid_attn, "decoder.mid_block", err))
        return err->code;
    for (int i = 0; i < n; i++) {
        vae_block *b = &d->blocks[i];
        int64_t ch = c->channels[n - 1 - i], prev = c->channels[i ? n - i : n - 1];
        for (int j = 0; j < c->layers + 1; j++) {
            snprintf(p, sizeof p, "decoder.up_blocks.%d.resnets.%d", i, j);
            b->nres = j + 1;
            if (vae_resnet_load(be, st, &b->res[j], j ? ch : prev, ch, p, err))
                return err->code;
        }
        b->has_sampler = i < n - 1;
        snprintf(p, sizeof p, "decoder.up_blocks.%d.upsamplers.0.conv", i);
        if (b->has_sampler && vae_conv_load(be, st, &b->sampler, ch, ch, 3, p, err))
            return err->code;
    }
    if (vae_norm_load(be, st, &d->norm_out, c->channels[0], "decoder.conv_norm_out", err) ||
        vae_conv_load(be, st, &d->conv_out, c->out_channels, c->channels[0], 3,
                      "decoder.conv_out", err))
        return err->code;
    return KILN_OK;
}

/* vae.md section 4.  Only the mean half of the moments is ever used, so the
 * last conv is loaded with its first `latent` output channels only. */
/* rows: the output rows kept, z (the mean) or 2z (and the log-variance). */
static kiln_status encoder_load(kiln_vae *v, const kiln_st *st, int64_t rows, kiln_err *err)
{
    const vae_config *c = &v->cfg;
    kiln_backend *be = v->be;
    vae_coder *e = &v->enc;
    int n = c->nblocks;
    int64_t top = c->channels[n - 1], z = c->latent;
    char p[128];
    if (vae_conv_load(be, st, &e->conv_in, c->channels[0], c->in_channels, 3, "encoder.conv_in",
                      err))
        return err->code;
    for (int i = 0; i < n; i++) {
        vae_block *b = &e->blocks[i];
        int64_t ch = c->channels[i], prev = c->channels[i ? i - 1 : 0];
        for (int j = 0; j < c->layers; j++) {
            snprintf(p, sizeof p, "encoder.down_blocks.%d.resnets.%d", i, j);
            b->nres = j + 1;
            if (vae_resnet_load(be, st, &b->res[j], j ? ch : prev, ch, p, err))
                return err->code;
        }
        b->has_sampler = i < n - 1;
        snprintf(p, sizeof p, "encoder.down_blocks.%d.downsamplers.0.conv", i);
        if (b->has_sampler && vae_conv_load(be, st, &b->sampler, ch, ch, 3, p, err))
            return err->code;
    }
    if (vae_mid_load(be, st, &e->mid, top, c->mid_attn, "encoder.mid_block", err) ||
        vae_norm_load(be, st, &e->norm_out, top, "encoder.conv_norm_out", err))
        return err->code;
    if (!c->quant)
        return vae_conv_load_rows(be, st, &e->conv_out, rows, 2 * z, top, 3,
                                  "encoder.conv_out", err);
    if (vae_conv_load(be, st, &e->conv_out, 2 * z, top, 3, "encoder.conv_out", err))
        return err->code;
    return vae_conv_load_rows(be, st, &e->quant, rows, 2 * z, 2 * z, 1, "quant_conv", err);
}

/* BatchNorm running statistics as host f32 (the module itself never runs). */
static kiln_status bn_load(kiln_vae *v, const kiln_st *st, kiln_err *err)
{
    int64_t n = v->cfg.latent * v->cfg.patch_h * v->cfg.patch_w;
    v->bn_mean = malloc(sizeof(float) * (size_t)n);
    v->bn_var = malloc(sizeof(float) * (size_t)n);
    if (!v->bn_mean || !v->bn_var)
        return kiln_err_set(err, KILN_ERR_NOMEM, "vae: out of memory");
    const char *names[2] = {"bn.running_mean", "bn.running_var"};
    float *dst[2] = {v->bn_mean, v->bn_var};
    for (int i = 0; i < 2; i++) {
        const kiln_st_tensor *t = kiln_st_expect(st, names[i], 1, &n, err);
        if (!t)
            return err->code;
        if (kiln_convert_to_f32(dst[i], t->data, t->dtype, (size_t)n))
            return kiln_err_set(err, KILN_ERR_FORMAT, "vae: '%s' has unsupported dtype %s",
                                names[i], kiln_dtype_name(t->dtype));
    }
    return KILN_OK;
}

static void fill_info(kiln_vae *v, unsigned parts)
{
    const vae_config *c = &v->cfg;
    kiln_vae_info *in = &v->info;
    in->kind = c->kind;
    in->latent_channels = (int)c->latent;
    in->downscale = 1 << (c->nblocks - 1);
    in->parts = parts;
    in->encode_channels = (int)c->latent * (parts & KILN_VAE_LOGVAR ? 2 : 1);
    in->scaling_factor = c->scaling;
    in->shift_factor = c->shift;
    if (c->kind == KILN_VAE_FLUX2) {
        in->bn_channels = (int)(c->latent * c->patch_h * c->patch_w);
        in->patch_h = c->patch_h;
        in->patch_w = c->patch_w;
        in->bn_mean = v->bn_mean;
        in->bn_var = v->bn_var;
        in->bn_eps = c->bn_eps;
    }
}

kiln_vae *kiln_vae_load(kiln_backend *be, const cJSON *config, const kiln_st *weights,
                        unsigned parts, kiln_err *err)
{
    if (!config || !weights) {
        kiln_err_set(err, KILN_ERR_INVALID, "vae: no config or weights given");
        return NULL;
    }
    if (!(parts & (KILN_VAE_DECODER | KILN_VAE_ENCODER)) ||
        (parts & ~(unsigned)(KILN_VAE_DECODER | KILN_VAE_ENCODER | KILN_VAE_LOGVAR)) ||
        ((parts & KILN_VAE_LOGVAR) && !(parts & KILN_VAE_ENCODER))) {
        kiln_err_set(err, KILN_ERR_INVALID, "vae: parts must be KILN_VAE_DECODER and/or "
                     "KILN_VAE_ENCODER (with KILN_VAE_LOGVAR)");
        return NULL;
    }
    kiln_vae *v = calloc(1, sizeof *v);
    if (!v) {
        kiln_err_set(err, KILN_ERR_NOMEM, "vae: out of memory");
        return NULL;
    }
    v->be = be;
    if (vae_config_parse(config, &v->cfg, err) ||
        (v->cfg.kind == KILN_VAE_FLUX2 && bn_load(v, weights, err)) ||
        ((parts & KILN_VAE_DECODER) && decoder_load(v, weights, err)) ||
        ((parts & KILN_VAE_ENCODER) &&
         encoder_load(v, weights, v->cfg.latent * (parts & KILN_VAE_LOGVAR ? 2 : 1), err)))
        goto fail;
    if (!(v->arena = kiln_arena_create(be, 0, err)))
        goto fail;
    v->band_above = KILN_VAE_BAND_ABOVE_DEFAULT;
    v->band_rows = KILN_VAE_BAND_ROWS_DEFAULT;
    fill_info(v, parts);
    return v;
fail:
    kiln_vae_free(v);
    return NULL;
}

void kiln_vae_free(kiln_vae *v)
{
    if (!v)
        return;
    coder_free(v->be, &v->dec);
    coder_free(v->be, &v->enc);
    kiln_arena_destroy(v->arena);
    free(v->bn_mean);
    free(v->bn_var);
    free(v);
}

const kiln_vae_info *kiln_vae_get_info(const kiln_vae *v) { return &v->info; }

/* --- scratch planning ---------------------------------------------------------
 * The largest activation of a pass sets the size of its three slots; these
 * walks follow the forward passes below stage by stage. */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Per image, latent h x w.  The latent itself passes through a slot on its
 * way channels-last (vae_conv_from). */
static int64_t decoder_slot_elems(const vae_config *c, int64_t h, int64_t w)
{
    int n = c->nblocks;
    int64_t m = c->latent * h * w;
    for (int i = 0; i < n; i++) {
        int64_t ch = c->channels[n - 1 - i], prev = c->channels[i ? n - i : n - 1];
        m = max64(m, max64(ch, prev) * h * w);
        if (i < n - 1) {
            h *= 2;
            w *= 2;
            m = max64(m, ch * h * w);
        }
    }
    return m;
}

/* Per image, H x W pixels (multiples of the downscale). */
static int64_t encoder_slot_elems(const vae_config *c, int64_t h, int64_t w)
{
    int n = c->nblocks;
    int64_t m = max64(c->in_channels, c->channels[0]) * h * w;
    for (int i = 0; i < n; i++) {
        int64_t ch = c->channels[i], prev = c->channels[i ? i - 1 : 0];
        m = max64(m, max64(ch, prev) * h * w);
        if (i < n - 1) {
            h /= 2;
            w /= 2;
            m = max64(m, ch * h * w);
        }
    }
    return c->quant ? max64(m, 2 * c->latent * h * w) : m;
}

/* Mid-block resolution h x w (latent size in both directions). */
static size_t pass_bytes(const kiln_vae *v, int64_t B, int64_t slot, int64_t h, int64_t w)
{
    size_t ds = kiln_dtype_size(v->be->act_dtype);
    size_t total = 3 * vae_align_bytes(B * slot, ds);
    if (v->cfg.mid_attn)
        total += VAE_ATTN_BUFS * vae_align_bytes(B * v->cfg.channels[v->cfg.nblocks - 1] * h * w, ds);
    return total;
}

/* Sizes beyond this many elements per slot are refused before any
 * arithmetic can overflow (2^40 elements is 2 TiB in bf16). */
#define VAE_MAX_SLOT_ELEMS ((int64_t)1 << 40)

static int size_ok(int64_t B, int64_t h, int64_t w)
{
    return B >= 1 && h >= 1 && w >= 1 && B <= (1 << 16) && h <= (1 << 16) && w <= (1 << 16);
}

/* Whether a pass over H x W pixels per image runs in bands. */
static int banded(const kiln_vae *v, int64_t H, int64_t W)
{
    /* A backend without the pieced GroupNorm can only run whole passes. */
    const kiln_backend_ops *ops = v->be->ops;
    return H * W > v->band_above && ops->group_norm_stats &&
           ops->group_norm_apply;
}

size_t kiln_vae_scratch_bytes(const kiln_vae *v, unsigned part, int64_t B, int64_t H, int64_t W)
{
    int f = v->info.downscale;
    size_t ds = kiln_dtype_size(v->be->act_dtype);
    if (!(v->info.parts & part) || !size_ok(B, H, W) || H % f || W % f)
        return 0;
    int64_t h = H / f, w = W / f;
    if (part == KILN_VAE_ENCODER)
        return banded(v, H, W) ?
               vae_band_encode_bytes(&v->cfg, &v->enc, ds, B, H, W, v->band_rows) :
               pass_bytes(v, B, encoder_slot_elems(&v->cfg, H, W), h, w);
    return banded(v, H, W) ? vae_band_decode_bytes(&v->cfg, &v->dec, ds, B, h, w, v->band_rows)
                           : pass_bytes(v, B, decoder_slot_elems(&v->cfg, h, w), h, w);
}

kiln_status kiln_vae_set_banding(kiln_vae *v, int64_t above_pixels, int64_t rows, kiln_err *err)
{
    if (above_pixels < 0 || rows < 1 || rows > KILN_VAE_BAND_ROWS_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: banding above %lld pixels in bands of "
                            "%lld rows is out of range (rows 1..%d)", (long long)above_pixels,
                            (long long)rows, KILN_VAE_BAND_ROWS_MAX);
    v->band_above = above_pixels;
    v->band_rows = rows;
    return KILN_OK;
}

/* --- forward passes ------------------------------------------------------------ */

static kiln_status check_tensor(const kiln_vae *v, const kiln_tensor *t, const char *what,
                                kiln_err *err)
{
    if (t->ndim != 4)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: %s must have 4 dims (B, C, H, W), got "
                            "%d", what, t->ndim);
    if (t->dtype != v->be->act_dtype)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: %s has dtype %s, the backend computes "
                            "in %s", what, kiln_dtype_name(t->dtype),
                            kiln_dtype_name(v->be->act_dtype));
    if (!t->data)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: %s has no data", what);
    return KILN_OK;
}

static kiln_status check_output(const kiln_tensor *t, const int64_t want[4], const char *what,
                                kiln_err *err)
{
    char got[64], exp[64];
    kiln_tensor w = *t;
    kiln_tensor_set_shape(&w, t->dtype, 4, want);
    if (memcmp(t->shape, want, 4 * sizeof(int64_t)))
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: %s has shape %s, expected %s", what,
                            kiln_tensor_shape_str(t, got, sizeof got),
                            kiln_tensor_shape_str(&w, exp, sizeof exp));
    return KILN_OK;
}

/* Starts a pass: surfaces an error left in the backend by earlier work,
 * rewinds the arena and takes the slots. */
static kiln_status pass_begin(kiln_vae *v, vae_run *r, int64_t B, int64_t slot, int64_t r_h,
                              int64_t r_w, const kiln_vae_tap *tap, kiln_err *err)
{
    if (kiln_be_check(v->be, err))
        return kiln_err_wrap(err, "vae: backend error before the pass");
    kiln_arena_reset(v->arena);
    /* Reserved at the exact size, so the arena never holds a doubled block
     * and the blocks it outgrew at once (kiln_arena_reserve). */
    if (kiln_arena_reserve(v->arena, pass_bytes(v, B, slot, r_h, r_w))) {
        kiln_be_check(v->be, err);
        return kiln_err_wrap(err, "vae: scratch memory");
    }
    *r = (vae_run){.be = v->be, .arena = v->arena, .groups = v->cfg.groups, .cap = B * slot,
                   .tap = tap};
    if (vae_run_begin(r)) {
        kiln_be_check(v->be, err);
        return kiln_err_wrap(err, "vae: scratch memory");
    }
    return KILN_OK;
}

/* One whole-image decoder pass (vae.md section 3); shapes already validated. */
static kiln_status decode_pass(kiln_vae *v, const kiln_tensor *z, kiln_tensor *img,
                               const kiln_vae_tap *tap, kiln_err *err)
{
    const vae_config *c = &v->cfg;
    vae_run r;
    if (pass_begin(v, &r, z->shape[0], decoder_slot_elems(c, z->shape[2], z->shape[3]),
                   z->shape[2], z->shape[3], tap, err))
        return err->code;
    const vae_coder *d = &v->dec;
    if (c->post_quant) {
        vae_conv_from(&r, &d->quant, z);
        vae_run_tap(&r, "post_quant_conv");
        vae_conv_apply(&r, &d->conv_in);
    } else {
        vae_conv_from(&r, &d->conv_in, z);
    }
    vae_run_tap(&r, "conv_in");
    vae_mid_apply(&r, &d->mid);
    vae_run_tap(&r, "mid_block");
    for (int i = 0; i < c->nblocks; i++) {
        const vae_block *b = &d->blocks[i];
        for (int j = 0; j < b->nres; j++)
            vae_resnet_apply(&r, &b->res[j]);
        if (b->has_sampler)
            vae_upsample_apply(&r, &b->sampler);
        char stage[32];
        snprintf(stage, sizeof stage, "up_blocks.%d", i);
        vae_run_tap(&r, stage);
    }
    vae_norm_silu_apply(&r, &d->norm_out);
    vae_conv_to(&r, &d->conv_out, img);
    if (kiln_be_check(v->be, err))
        return kiln_err_wrap(err, "vae decode");
    return KILN_OK;
}

kiln_status kiln_vae_decode(kiln_vae *v, const kiln_tensor *z, kiln_tensor *img,
                            const kiln_vae_tap *tap, kiln_err *err)
{
    const vae_config *c = &v->cfg;
    if (!(v->info.parts & KILN_VAE_DECODER))
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: the decoder was not loaded");
    if (check_tensor(v, z, "latent", err) || check_tensor(v, img, "image", err))
        return err->code;
    int64_t B = z->shape[0], h = z->shape[2], w = z->shape[3], f = v->info.downscale;
    if (z->shape[1] != c->latent)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: latent has %lld channels, this VAE "
                            "decodes %lld", (long long)z->shape[1], (long long)c->latent);
    if (!size_ok(B, h, w) || !size_ok(B, h * f, w * f))
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: latent size %lldx%lld (batch %lld) is "
                            "out of range", (long long)h, (long long)w, (long long)B);
    if (check_output(img, (int64_t[]){B, c->out_channels, h * f, w * f}, "image", err))
        return err->code;
    if (decoder_slot_elems(c, h, w) > VAE_MAX_SLOT_ELEMS / B)
        return kiln_err_set(err, KILN_ERR_TOO_LARGE, "vae: decode of %lld x %lldx%lld is too "
                            "large", (long long)B, (long long)(h * f), (long long)(w * f));
    if (banded(v, h * f, w * f))
        return vae_band_decode(v->be, v->arena, c, &v->dec, v->band_rows, z, img, err);
    return decode_pass(v, z, img, tap, err);
}

kiln_status kiln_vae_encode(kiln_vae *v, const kiln_tensor *img, kiln_tensor *mean,
                            const kiln_vae_tap *tap, kiln_err *err)
{
    const vae_config *c = &v->cfg;
    if (!(v->info.parts & KILN_VAE_ENCODER))
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: the encoder was not loaded");
    if (check_tensor(v, img, "image", err) || check_tensor(v, mean, "latent mean", err))
        return err->code;
    int64_t B = img->shape[0], H = img->shape[2], W = img->shape[3], f = v->info.downscale;
    if (img->shape[1] != c->in_channels)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: image has %lld channels, expected %lld",
                            (long long)img->shape[1], (long long)c->in_channels);
    if (!size_ok(B, H, W) || H % f || W % f)
        return kiln_err_set(err, KILN_ERR_INVALID, "vae: image size %lldx%lld must be positive "
                            "multiples of %lld", (long long)H, (long long)W, (long long)f);
    if (check_output(mean, (int64_t[]){B, v->info.encode_channels, H / f, W / f}, "latent mean",
                     err))
        return err->code;
    int64_t slot = encoder_slot_elems(c, H, W);
    if (slot > VAE_MAX_SLOT_ELEMS / B)
        return kiln_err_set(err, KILN_ERR_TOO_LARGE, "vae: encode of %lld x %lldx%lld is too "
                            "large", (long long)B, (long long)H, (long long)W);

    if (banded(v, H, W))
        return vae_band_encode(v->be, v->arena, c, &v->enc, v->band_rows, img, mean, err);
    vae_run r;
    if (pass_begin(v, &r, B, slot, H / f, W / f, tap, err))
        return err->code;
    const vae_coder *e = &v->enc;
    vae_conv_from(&r, &e->conv_in, img);
    vae_run_tap(&r, "conv_in");
    for (int i = 0; i < c->nblocks; i++) {
        const vae_block *b = &e->blocks[i];
        for (int j = 0; j < b->nres; j++)
            vae_resnet_apply(&r, &b->res[j]);
        if (b->has_sampler)
            vae_downsample_apply(&r, &b->sampler);
        char stage[32];
        snprintf(stage, sizeof stage, "down_blocks.%d", i);
        vae_run_tap(&r, stage);
    }
    vae_mid_apply(&r, &e->mid);
    vae_run_tap(&r, "mid_block");
    vae_norm_silu_apply(&r, &e->norm_out);
    if (c->quant) {
        vae_conv_apply(&r, &e->conv_out);
        vae_conv_to(&r, &e->quant, mean);
    } else {
        vae_conv_to(&r, &e->conv_out, mean);
    }
    if (kiln_be_check(v->be, err))
        return kiln_err_wrap(err, "vae encode");
    return KILN_OK;
}

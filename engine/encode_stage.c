#include "encode_stage.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "models/latents.h"
#include "models/qwen3.h"
#include "models/tokenizer.h"
#include "models/vae.h"

struct kiln_encode_stage {
    kiln_backend *be;
    kiln_tokenizer *tok;
    kiln_qwen3 *qwen;
    kiln_vae *vae; /* encoder half, edits only */
};

kiln_encode_stage *kiln_encode_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                            const kiln_encode_opts *opts, kiln_err *err)
{
    kiln_encode_stage *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    char dir[PATH_MAX];
    if (kiln_checkpoint_path(ck, "tokenizer", dir, sizeof dir, err))
        goto fail;
    s->tok = kiln_tokenizer_load(dir, err);
    if (!s->tok) {
        kiln_err_wrap(err, "tokenizer");
        goto fail;
    }
    s->qwen = kiln_qwen3_load(be, ck, opts->out_layers, opts->n_out_layers, err);
    if (!s->qwen)
        goto fail;
    if (opts->with_references) {
        const cJSON *cfg = kiln_checkpoint_config(ck, "vae", err);
        kiln_st *st = cfg ? kiln_checkpoint_weights(ck, "vae", err) : NULL;
        if (!st)
            goto fail;
        s->vae = kiln_vae_load(be, cfg, st, KILN_VAE_ENCODER, err);
        kiln_st_close(st);
        if (!s->vae)
            goto fail;
    }
    return s;
fail:
    kiln_encode_stage_destroy(s);
    return NULL;
}

void kiln_encode_stage_destroy(kiln_encode_stage *s)
{
    if (!s)
        return;
    kiln_vae_free(s->vae);
    kiln_qwen3_destroy(s->qwen);
    kiln_tokenizer_free(s->tok);
    free(s);
}

int64_t kiln_encode_stage_width(const kiln_encode_stage *s) { return kiln_qwen3_out_width(s->qwen); }

kiln_status kiln_encode_prompts(kiln_encode_stage *s, const char *const *prompts, int B,
                                int max_seq, kiln_tensor *out, int32_t *ids_out, kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (B < 1 || max_seq < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "encode: bad batch or sequence length");
    int32_t *ids = malloc((size_t)B * (size_t)max_seq * sizeof *ids);
    int *lens = malloc((size_t)B * sizeof *lens);
    kiln_status st = KILN_OK;
    if (!ids || !lens) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int b = 0; b < B && !st; b++)
        st = kiln_tokenizer_encode_chat(s->tok, prompts[b], strlen(prompts[b]), KILN_CHAT_KLEIN,
                                        max_seq, ids + (size_t)b * max_seq, &lens[b], NULL, err);
    if (st)
        goto done;
    int64_t shape[] = {B, max_seq, kiln_qwen3_out_width(s->qwen)};
    if (kiln_be_alloc(s->be, out, s->be->act_dtype, 3, shape)) {
        st = kiln_be_check(s->be, err);
        goto done;
    }
    st = kiln_qwen3_encode(s->qwen, ids, lens, B, max_seq, out, err);
    if (st)
        kiln_be_free(s->be, out);
    else if (ids_out)
        memcpy(ids_out, ids, (size_t)B * (size_t)max_seq * sizeof *ids);
done:
    free(ids);
    free(lens);
    return st;
}

/* One reference: prepared pixels -> VAE mean -> patchified, BN-normalised,
 * packed tokens (h*w, 4z) appended at `tokens` (host f32). */
static kiln_status encode_one(kiln_encode_stage *s, const kiln_image *ref, float *tokens,
                              int64_t *h_out, int64_t *w_out, kiln_err *err)
{
    kiln_backend *be = s->be;
    const kiln_vae_info *info = kiln_vae_get_info(s->vae);
    kiln_tensor pixels = {0}, dev_in = {0}, dev_mean = {0};
    float *mean = NULL, *patched = NULL;
    kiln_status st = kiln_image_flux2_ref_prepare(ref, &pixels, err);
    if (st)
        return st;
    int64_t H = pixels.shape[2], W = pixels.shape[3], z = info->latent_channels;
    int64_t h = H / 16, w = W / 16, C = 4 * z;
    size_t n = (size_t)(C * h * w);
    mean = malloc(n * sizeof *mean);
    patched = malloc(n * sizeof *patched);
    if (!mean || !patched) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (kiln_be_from_host(be, &dev_in, 4, pixels.shape, pixels.data, KILN_F32) ||
        kiln_be_alloc(be, &dev_mean, be->act_dtype, 4, (int64_t[]){1, z, 2 * h, 2 * w})) {
        st = kiln_be_check(be, err);
        goto done;
    }
    if ((st = kiln_vae_encode_mean(s->vae, &dev_in, &dev_mean, NULL, err)))
        goto done;
    kiln_be_download(be, &dev_mean, mean);
    if ((st = kiln_be_check(be, err)))
        goto done;
    /* pipeline.md section 8 step 5: patchify, (x - mean_c) / std_c, pack. */
    kiln_latents_patchify(mean, patched, 1, z, h, w);
    kiln_latents_bn_normalize(patched, 1, C, h * w, info->bn_mean, info->bn_var, info->bn_eps,
                              be->act_dtype);
    kiln_latents_pack(patched, tokens, 1, C, h, w);
    *h_out = h, *w_out = w;
done:
    kiln_tensor_host_free(&pixels);
    kiln_be_free(be, &dev_in), kiln_be_free(be, &dev_mean);
    free(mean), free(patched);
    return st;
}

kiln_status kiln_encode_references(kiln_encode_stage *s, const kiln_image *refs, int n,
                                   kiln_tensor *tokens, int32_t **ids, int64_t *R, kiln_err *err)
{
    memset(tokens, 0, sizeof *tokens);
    *ids = NULL, *R = 0;
    if (!s->vae)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "encode stage loaded without the VAE encoder");
    if (n < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "no reference images");
    const kiln_vae_info *info = kiln_vae_get_info(s->vae);
    int64_t C = 4 * (int64_t)info->latent_channels, total = 0;
    int64_t sizes[KILN_MAX_REFS][2];
    if (n > KILN_MAX_REFS)
        return kiln_err_set(err, KILN_ERR_INVALID, "at most %d reference images", KILN_MAX_REFS);
    for (int k = 0; k < n; k++) {
        int pw, ph;
        if (kiln_image_flux2_ref_size(refs[k].width, refs[k].height, &pw, &ph, err))
            return kiln_err_wrap(err, "image %d", k);
        sizes[k][0] = ph / 16, sizes[k][1] = pw / 16;
        total += sizes[k][0] * sizes[k][1];
    }
    float *host = malloc((size_t)(total * C) * sizeof *host);
    int32_t *id32 = malloc((size_t)total * 4 * sizeof *id32);
    kiln_status st = KILN_OK;
    if (!host || !id32) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    int64_t row = 0;
    for (int k = 0; k < n && !st; k++) {
        int64_t h = 0, w = 0;
        st = encode_one(s, &refs[k], host + row * C, &h, &w, err);
        if (st) {
            kiln_err_wrap(err, "image %d", k);
            break;
        }
        kiln_latents_ref_ids(id32 + row * 4, k, h, w);
        row += h * w;
    }
    if (st)
        goto done;
    if (kiln_be_from_host(s->be, tokens, 3, (int64_t[]){1, total, C}, host, KILN_F32)) {
        st = kiln_be_check(s->be, err);
        goto done;
    }
    *ids = id32, id32 = NULL;
    *R = total;
done:
    free(host), free(id32);
    return st;
}

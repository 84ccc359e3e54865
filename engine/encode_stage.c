#include "encode_stage.h"

#include <assert.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "family.h"
#include "family_stages.h"
#include "models/latents.h"
#include "models/qwen3.h"
#include "models/tokenizer.h"
#include "models/vae.h"

struct kiln_encode_stage {
    kiln_backend *be;
    kiln_tokenizer *tok;
    kiln_qwen3 *qwen;
    kiln_vae *vae; /* encoder half, edits only */
    const kiln_family_stages *fs;
    kiln_model_traits traits;
    kiln_prompt_cache *cache;
    kiln_chat_template tmpl; /* the pipeline's chat template */
};

kiln_status kiln_encode_layers_of(const kiln_checkpoint *ck, int *out, int *n, kiln_err *err)
{
    int64_t v[KILN_MAX_OUT_LAYERS];
    int count = 0;
    if (kiln_json_int_array(kiln_checkpoint_index(ck), "text_encoder_out_layers", 0, v,
                            KILN_MAX_OUT_LAYERS, &count, err))
        return kiln_err_wrap(err, "model_index.json");
    if (count) {
        for (int i = 0; i < count; i++) {
            if (v[i] < -1000 || v[i] > 1000)
                return kiln_err_set(err, KILN_ERR_FORMAT,
                                    "model_index.json: text_encoder_out_layers entry %d is out "
                                    "of range", i);
            out[i] = (int)v[i];
        }
        *n = count;
    } else { /* the pipeline's default (engine/family.c) */
        const kiln_family *f = kiln_family_of(ck);
        for (int i = 0; i < f->n_default_layers; i++)
            out[i] = f->default_layers[i];
        *n = f->n_default_layers;
    }
    return KILN_OK;
}

kiln_encode_stage *kiln_encode_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                            const kiln_encode_opts *opts, kiln_err *err)
{
    kiln_encode_stage *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    s->cache = kiln_prompt_cache_create(opts->prompt_cache_bytes, err);
    if (!s->cache)
        goto fail;
    char dir[PATH_MAX];
    if (kiln_checkpoint_path(ck, "tokenizer", dir, sizeof dir, err))
        goto fail;
    s->tok = kiln_tokenizer_load(dir, err);
    if (!s->tok) {
        kiln_err_wrap(err, "tokenizer");
        goto fail;
    }
    s->fs = kiln_family_stages_of(ck);
    s->traits = kiln_model_traits_of(ck);
    s->tmpl = s->fs->chat; /* the pipeline's enable_thinking */
    int layers[KILN_MAX_OUT_LAYERS], n_layers = opts->n_out_layers;
    memcpy(layers, opts->out_layers, sizeof layers);
    if (!n_layers && kiln_encode_layers_of(ck, layers, &n_layers, err))
        goto fail;
    s->qwen = kiln_qwen3_load(be, ck, layers, n_layers, err);
    if (!s->qwen)
        goto fail;
    if (opts->with_references) {
        const cJSON *cfg = kiln_checkpoint_config(ck, "vae", err);
        kiln_st *st = cfg ? kiln_checkpoint_weights(ck, "vae", err) : NULL;
        if (!st)
            goto fail;
        s->vae = kiln_vae_load(be, cfg, st, KILN_VAE_ENCODER | s->fs->vae_parts, err);
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
    kiln_prompt_cache_destroy(s->cache);
    free(s);
}

kiln_status kiln_encode_stage_set_banding(kiln_encode_stage *s, int64_t above_pixels,
                                          int64_t rows, kiln_err *err)
{
    return s->vae ? kiln_vae_set_banding(s->vae, above_pixels, rows, err) : KILN_OK;
}

int64_t kiln_encode_stage_width(const kiln_encode_stage *s) { return kiln_qwen3_out_width(s->qwen); }

/* How row b of a batch gets its embedding: copied from an earlier row with
 * the same prompt, uploaded from the cache, or computed in row `slot` of
 * the Qwen3 batch of the remaining prompts. */
typedef struct row_plan {
    size_t len;      /* the prompt's bytes */
    int same_as;     /* an earlier row with the same prompt, or -1 */
    int slot;        /* its row of the Qwen3 batch, or -1 */
    const void *hit; /* its cached embedding, or NULL */
} row_plan;

/* Fills plan[B] and returns the number of rows Qwen3 must compute.  A
 * prompt repeated in the batch is looked up once; B is at most a few
 * hundred rows, so comparing against the earlier ones is cheap. */
static int plan_rows(kiln_encode_stage *s, const char *const *prompts, int B, int max_seq,
                     row_plan *plan)
{
    int M = 0;
    for (int b = 0; b < B; b++) {
        row_plan *p = &plan[b];
        *p = (row_plan){.len = strlen(prompts[b]), .same_as = -1, .slot = -1};
        for (int a = 0; a < b && p->same_as < 0; a++)
            if (plan[a].same_as < 0 && plan[a].len == p->len &&
                !memcmp(prompts[a], prompts[b], p->len))
                p->same_as = a;
        if (p->same_as >= 0)
            continue;
        /* The key holds max_seq and J and the dtype are the stage's, so a
         * hit is always one row of out. */
        size_t unused;
        p->hit = kiln_prompt_cache_get(s->cache, prompts[b], p->len, max_seq, &unused);
        if (!p->hit)
            p->slot = M++;
    }
    return M;
}

/* Puts computed row b of `out` in the cache, in the backend's activation
 * dtype, when the cache admits its prompt: a prompt seen for the first time
 * is not downloaded at all, since the download and conversion (about 8 ms
 * for a klein-4B row on an H200 host) would delay its job for a row most
 * likely never asked for again.  The download gives f32; on a bf16 backend
 * those floats are bf16 values widened, so keeping their upper halves gives
 * back the exact bits (kiln_f32_to_bf16 would also quiet a signalling NaN).
 * A row the cache cannot hold for want of memory is simply not cached. */
static kiln_status cache_row(kiln_encode_stage *s, const char *prompt, size_t len, int max_seq,
                             const kiln_tensor *out, int b, kiln_err *err)
{
    kiln_backend *be = s->be;
    kiln_tensor row = kiln_tensor_batch_view(out, b, 1);
    size_t n = (size_t)kiln_tensor_numel(&row), bytes = kiln_tensor_nbytes(&row);
    assert(be->act_dtype == KILN_F32 || be->act_dtype == KILN_BF16);
    if (!kiln_prompt_cache_accepts(s->cache, prompt, len, max_seq, bytes))
        return KILN_OK;
    unsigned char *v = malloc(n * sizeof(float));
    if (!v)
        return KILN_OK;
    kiln_be_download(be, &row, (float *)v);
    kiln_status st = kiln_be_check(be, err);
    if (st) {
        free(v);
        return st;
    }
    if (be->act_dtype == KILN_BF16) {
        for (size_t i = 0; i < n; i++) { /* in place: element i is read before it is written */
            uint32_t u;
            memcpy(&u, v + 4 * i, 4);
            uint16_t h = (uint16_t)(u >> 16);
            memcpy(v + 2 * i, &h, 2);
        }
        unsigned char *shrunk = realloc(v, bytes);
        if (shrunk)
            v = shrunk;
    }
    kiln_err ignored = {0};
    (void)kiln_prompt_cache_put(s->cache, prompt, len, max_seq, v, bytes, &ignored);
    return KILN_OK;
}

/* Moves the Qwen3 batch, computed in rows [0, M) of out, to its rows,
 * uploads the cached rows and copies the repeated ones.  Slot k goes to a
 * row b >= k, so moving from the last slot down never overwrites a slot
 * still to move; cached rows are uploaded after the moves, since their row
 * may have held a slot, and repeats are copied last, from finished rows. */
static void place_rows(kiln_backend *be, const row_plan *plan, int B, kiln_tensor *out)
{
    for (int b = B - 1; b >= 0; b--)
        if (plan[b].slot >= 0 && plan[b].slot != b) {
            kiln_tensor dst = kiln_tensor_batch_view(out, b, 1);
            kiln_tensor src = kiln_tensor_batch_view(out, plan[b].slot, 1);
            kiln_be_copy(be, &dst, &src);
        }
    for (int b = 0; b < B; b++)
        if (plan[b].hit) {
            kiln_tensor dst = kiln_tensor_batch_view(out, b, 1);
            kiln_be_upload(be, &dst, plan[b].hit, be->act_dtype);
        }
    for (int b = 0; b < B; b++)
        if (plan[b].same_as >= 0) {
            kiln_tensor dst = kiln_tensor_batch_view(out, b, 1);
            kiln_tensor src = kiln_tensor_batch_view(out, plan[b].same_as, 1);
            kiln_be_copy(be, &dst, &src);
        }
}

/* Token ids: only the computed rows need them for Qwen3.  Cached rows are
 * tokenized again only when the caller asks for ids or lengths: that costs
 * far less than keeping max_seq ids beside every cached row would save, and
 * it cannot fail where it once succeeded.  Repeated rows take their first
 * row's (after the loop). */
static kiln_status tokenize_rows(kiln_encode_stage *s, const char *const *prompts, int B,
                                 int max_seq, const row_plan *plan, int32_t *ids, int *lens,
                                 int32_t *ids_out, int *lens_out, int32_t *scratch,
                                 kiln_err *err)
{
    kiln_status st = KILN_OK;
    for (int b = 0; b < B && !st; b++) {
        int32_t *dst = plan[b].slot >= 0 ? ids + (size_t)plan[b].slot * max_seq
                       : ids_out && plan[b].hit ? ids_out + (size_t)b * max_seq
                       : lens_out && plan[b].hit ? scratch
                                                 : NULL;
        int n_real = 0;
        if (dst)
            st = kiln_tokenizer_encode_chat(s->tok, prompts[b], plan[b].len, s->tmpl, max_seq,
                                            dst, &n_real, NULL, err);
        if (plan[b].slot >= 0)
            lens[plan[b].slot] = n_real;
        if (lens_out && dst)
            lens_out[b] = n_real;
    }
    for (int b = 0; b < B && lens_out; b++)
        if (plan[b].same_as >= 0)
            lens_out[b] = lens_out[plan[b].same_as];
    return st;
}

kiln_status kiln_encode_prompts(kiln_encode_stage *s, const char *const *prompts, int B,
                                int max_seq, kiln_tensor *out, int32_t *ids_out, int *lens_out,
                                kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (B < 1 || max_seq < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "encode: bad batch or sequence length");
    kiln_backend *be = s->be;
    int64_t shape[] = {B, max_seq, kiln_qwen3_out_width(s->qwen)};
    size_t T = (size_t)max_seq;
    row_plan *plan = malloc((size_t)B * sizeof *plan);
    int32_t *ids = malloc((size_t)(B + 1) * T * sizeof *ids);
    int *lens = malloc((size_t)B * sizeof *lens);
    kiln_status st = KILN_OK;
    if (!plan || !ids || !lens) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    int M = plan_rows(s, prompts, B, max_seq, plan);
    if ((st = tokenize_rows(s, prompts, B, max_seq, plan, ids, lens, ids_out, lens_out,
                            ids + (size_t)B * T, err)))
        goto done;
    if (kiln_be_alloc(be, out, be->act_dtype, 3, shape)) {
        st = kiln_be_check(be, err);
        goto done;
    }
    if (M) {
        kiln_tensor batch = kiln_tensor_batch_view(out, 0, M);
        if ((st = kiln_qwen3_encode(s->qwen, ids, lens, M, max_seq, &batch, err)))
            goto done;
    }
    place_rows(be, plan, B, out);
    if ((st = kiln_be_check(be, err)))
        goto done;
    for (int b = 0; b < B && !st; b++) {
        if (plan[b].slot >= 0)
            st = cache_row(s, prompts[b], plan[b].len, max_seq, out, b, err);
        if (ids_out && plan[b].slot >= 0)
            memcpy(ids_out + (size_t)b * T, ids + (size_t)plan[b].slot * T, T * sizeof *ids);
        if (ids_out && plan[b].same_as >= 0)
            memcpy(ids_out + (size_t)b * T, ids_out + (size_t)plan[b].same_as * T,
                   T * sizeof *ids);
    }
done:
    if (st)
        kiln_be_free(be, out);
    free(plan);
    free(ids);
    free(lens);
    return st;
}

kiln_model_traits kiln_encode_stage_traits(const kiln_encode_stage *s) { return s->traits; }

void kiln_encode_stage_cache_stats(const kiln_encode_stage *s, kiln_prompt_cache_stats *out)
{
    kiln_prompt_cache_get_stats(s->cache, out);
}

/* One image: prepared pixels -> the VAE's posterior -> the family's tokens
 * (h*w, image_moments x 4z) at `tokens` (host f32). */
static kiln_status encode_one(kiln_encode_stage *s, const kiln_image *ref, float *tokens,
                              int64_t *h_out, int64_t *w_out, kiln_err *err)
{
    kiln_backend *be = s->be;
    const kiln_vae_info *info = kiln_vae_get_info(s->vae);
    kiln_tensor pixels = {0}, dev_in = {0}, dev_out = {0};
    float *posterior = NULL, *scratch = NULL;
    kiln_status st = s->fs->prepare(ref, &pixels, err);
    if (st)
        return st;
    int64_t H = pixels.shape[2], W = pixels.shape[3], e = info->encode_channels;
    int64_t h = H / 16, w = W / 16;
    size_t n = (size_t)(e * 4 * h * w);
    posterior = malloc(n * sizeof *posterior);
    scratch = malloc(n * sizeof *scratch);
    if (!posterior || !scratch) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (kiln_be_from_host(be, &dev_in, 4, pixels.shape, pixels.data, KILN_F32) ||
        kiln_be_alloc(be, &dev_out, be->act_dtype, 4, (int64_t[]){1, e, 2 * h, 2 * w})) {
        st = kiln_be_check(be, err);
        goto done;
    }
    if ((st = kiln_vae_encode(s->vae, &dev_in, &dev_out, NULL, err)))
        goto done;
    kiln_be_download(be, &dev_out, posterior);
    if ((st = kiln_be_check(be, err)))
        goto done;
    s->fs->pack(info, posterior, scratch, tokens, h, w, be->act_dtype);
    *h_out = h, *w_out = w;
done:
    kiln_tensor_host_free(&pixels);
    kiln_be_free(be, &dev_in), kiln_be_free(be, &dev_out);
    free(posterior), free(scratch);
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
    int64_t C = 4 * (int64_t)info->latent_channels * s->fs->image_moments, total = 0;
    int64_t sizes[KILN_MAX_REFS][2];
    if (n > KILN_MAX_REFS)
        return kiln_err_set(err, KILN_ERR_INVALID, "at most %d reference images", KILN_MAX_REFS);
    for (int k = 0; k < n; k++) {
        int pw = refs[k].width / 16 * 16, ph = refs[k].height / 16 * 16;
        if (s->fs->image_moments == 1 &&
            kiln_image_flux2_ref_size(refs[k].width, refs[k].height, &pw, &ph, err))
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

kiln_status kiln_encode_mask(const kiln_encode_stage *s, const kiln_image *mask, int width,
                             int height, float **out, int64_t *n, kiln_err *err)
{
    int cell = s->fs->mask_cell;
    *out = NULL, *n = 0;
    if (width < 16 || height < 16 || width % 16 || height % 16)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad mask size %dx%d", width, height);
    int64_t count = (int64_t)(width / cell) * (height / cell);
    float *grid = malloc((size_t)count * sizeof *grid);
    if (!grid)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_status st = s->fs->mask(mask, width, height, grid, err);
    if (st) {
        free(grid);
        return st;
    }
    *out = grid, *n = count;
    return KILN_OK;
}

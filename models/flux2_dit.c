/* FLUX.2 DiT forward driver: input checks, RoPE tables, time embedding,
 * shared modulations, the block loop and the output layer
 * (spec/flux2-klein.md §2, §3.1-3.3, §3.6, §6); the blocks are in
 * flux2_dit_blocks.c.  Matches diffusers Flux2Transformer2DModel.forward. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dit_util.h"
#include "flux2_dit_internal.h"

/* --- reference K/V cache ------------------------------------------------------ */

kiln_flux2_kv_cache *kiln_flux2_kv_cache_create(const kiln_flux2_dit *m, kiln_err *err)
{
    kiln_flux2_kv_cache *c = calloc(1, sizeof *c);
    int64_t layers = m->cfg.num_layers + m->cfg.num_single_layers;
    if (c) {
        c->k = calloc((size_t)layers + 1, sizeof *c->k);
        c->v = calloc((size_t)layers + 1, sizeof *c->v);
    }
    if (!c || !c->k || !c->v) {
        kiln_flux2_kv_cache_destroy(c);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->owner = m;
    c->be = m->be;
    c->layers = layers;
    c->hidden = m->cfg.hidden;
    return c;
}

static void kv_release(kiln_flux2_kv_cache *c)
{
    for (int64_t l = 0; l < c->layers; l++) {
        kiln_be_free(c->be, &c->k[l]);
        kiln_be_free(c->be, &c->v[l]);
    }
    c->alloc_batch = c->alloc_tokens = 0;
}

void kiln_flux2_kv_cache_destroy(kiln_flux2_kv_cache *c)
{
    if (!c)
        return;
    if (c->k && c->v)
        kv_release(c);
    free(c->k);
    free(c->v);
    free(c);
}

int64_t kiln_flux2_kv_cache_tokens(const kiln_flux2_kv_cache *c)
{
    return c->tokens;
}

/* Sizes the cache for (B, R); memory is kept when the size repeats. */
static kiln_status kv_prepare(kiln_flux2_dit *m, kiln_flux2_kv_cache *c, int64_t B, int64_t R,
                              kiln_err *err)
{
    c->tokens = 0;
    if (c->alloc_batch == B && c->alloc_tokens == R)
        return KILN_OK;
    kv_release(c);
    c->serial = ++m->kv_serial; /* recorded CACHED forwards of the old memory go stale */
    const int64_t shape[3] = {B, R, c->hidden};
    for (int64_t l = 0; l < c->layers; l++) {
        if (kiln_be_alloc(c->be, &c->k[l], c->be->act_dtype, 3, shape) ||
            kiln_be_alloc(c->be, &c->v[l], c->be->act_dtype, 3, shape)) {
            kiln_be_check(c->be, err);
            kv_release(c);
            return kiln_err_wrap(err, "allocating the reference K/V cache");
        }
    }
    c->alloc_batch = B;
    c->alloc_tokens = R;
    return KILN_OK;
}

/* --- input checks ------------------------------------------------------------- */

static kiln_status check_act(const kiln_flux2_dit *m, const kiln_tensor *t, const char *what,
                             int64_t B, int64_t cols, kiln_err *err)
{
    char buf[96];
    if (t->ndim != 3 || t->dtype != m->be->act_dtype || t->shape[0] < 1 || t->shape[1] < 1 ||
        (B && t->shape[0] != B) || t->shape[2] != cols || !t->data) {
        const char *dt = kiln_dtype_name(t->dtype);
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "flux2 dit: %s has shape %s %s, expected (%s, rows, %lld) %s", what,
                            kiln_tensor_shape_str(t, buf, sizeof buf), dt ? dt : "?",
                            B ? "B" : "batch", (long long)cols, kiln_dtype_name(m->be->act_dtype));
    }
    return KILN_OK;
}

static kiln_status check_input(const kiln_flux2_dit *m, const kiln_flux2_dit_input *in,
                               const kiln_tensor *out, kiln_err *err)
{
    const kiln_flux2_dit_config *c = &m->cfg;
    if (!in || !in->x || !in->txt || !in->t || !in->img_ids || !in->txt_ids || !out)
        return kiln_err_set(err, KILN_ERR_INVALID, "flux2 dit: missing input");
    if (check_act(m, in->x, "x", 0, c->in_channels, err))
        return err->code;
    const int64_t B = in->x->shape[0], N_tot = in->x->shape[1];
    if (check_act(m, in->txt, "text features", B, c->joint_dim, err))
        return err->code;
    for (int64_t b = 0; b < B; b++)
        if (!isfinite(in->t[b]))
            return kiln_err_set(err, KILN_ERR_INVALID, "flux2 dit: timestep %lld is not finite",
                                (long long)b);
    int64_t R = 0;
    switch (in->kv_mode) {
    case KILN_FLUX2_KV_OFF:
        if (in->num_ref)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "flux2 dit: num_ref is only used in KV extract mode");
        break;
    case KILN_FLUX2_KV_EXTRACT:
        R = in->num_ref;
        if (R < 1 || R >= N_tot)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "flux2 dit: %lld reference tokens out of %lld input rows",
                                (long long)R, (long long)N_tot);
        /* fall through */
    case KILN_FLUX2_KV_CACHED:
        if (!in->kv || in->kv->owner != m)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "flux2 dit: KV mode needs a cache created for this model");
        if (in->kv_mode == KILN_FLUX2_KV_CACHED &&
            (in->num_ref || !in->kv->tokens || in->kv->batch != B))
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "flux2 dit: the K/V cache is empty or holds another batch size");
        break;
    default:
        return kiln_err_set(err, KILN_ERR_INVALID, "flux2 dit: unknown KV mode %d",
                            (int)in->kv_mode);
    }
    if (check_act(m, out, "output", B, c->out_channels, err))
        return err->code;
    if (out->shape[1] != N_tot - R)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "flux2 dit: output has %lld rows, expected %lld",
                            (long long)out->shape[1], (long long)(N_tot - R));
    return KILN_OK;
}

/* --- RoPE tables --------------------------------------------------------------- */

static flux2_rope rope_rows(const kiln_flux2_dit *m, int64_t row0, int64_t n)
{
    const int64_t d = m->cfg.head_dim;
    flux2_rope r = {m->rope_cos, m->rope_sin};
    size_t off = (size_t)(row0 * d) * sizeof(float);
    r.cos.data = (char *)r.cos.data + off;
    r.sin.data = (char *)r.sin.data + off;
    kiln_tensor_set_shape(&r.cos, KILN_F32, 2, (int64_t[]){n, d});
    kiln_tensor_set_shape(&r.sin, KILN_F32, 2, (int64_t[]){n, d});
    return r;
}

/* Makes m->rope_* hold tables whose first rows are `ids` (rows x 4).
 *
 * The buffers only grow: new tables are written into the ones in place,
 * on the stream, after the forwards that read the old ones.  A recorded
 * forward (flux2_dit_replay.c) reads the tables at the addresses it was
 * recorded with, so they must never move under it; rope_epoch counts the
 * moves and is part of a recording's key.  (Freeing and reallocating them
 * per shape let cudaMalloc return the cosine table at its old address and
 * the sine table elsewhere: a key holding one pointer then matched a
 * recording that read freed memory, the illegal address of mixed-shape
 * service traffic.) */
static kiln_status rope_update(kiln_flux2_dit *m, const int32_t *ids, int64_t rows, kiln_err *err)
{
    const size_t id_bytes = (size_t)rows * KILN_FLUX2_ROPE_AXES * sizeof(int32_t);
    if (m->rope_ids && rows <= m->rope_rows && !memcmp(m->rope_ids, ids, id_bytes))
        return KILN_OK;
    kiln_backend *be = m->be;
    const int64_t d = m->cfg.head_dim;
    int32_t *copy = malloc(id_bytes);
    float *tab = malloc((size_t)(2 * rows * d) * sizeof(float));
    if (!copy || !tab) {
        free(copy);
        free(tab);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for RoPE tables");
    }
    memcpy(copy, ids, id_bytes);
    kiln_flux2_rope_table(ids, rows, m->cfg.axes_dims, m->cfg.rope_theta, tab, tab + rows * d);
    free(m->rope_ids);
    m->rope_ids = NULL;
    m->rope_rows = 0;
    kiln_dit_rope_reserve(be, &m->rope_cos, &m->rope_sin, &m->rope_cap, &m->rope_epoch, rows, d);
    flux2_rope r = rope_rows(m, 0, rows);
    kiln_be_upload(be, &r.cos, tab, KILN_F32);
    kiln_be_upload(be, &r.sin, tab + rows * d, KILN_F32);
    free(tab);
    if (kiln_be_check(be, err)) {
        free(copy);
        kiln_be_free(be, &m->rope_cos);
        kiln_be_free(be, &m->rope_sin);
        m->rope_cap = 0;
        m->rope_epoch++;
        return kiln_err_wrap(err, "uploading RoPE tables");
    }
    m->rope_ids = copy;
    m->rope_rows = rows;
    return KILN_OK;
}

/* Table rows [txt ; img ; ref]: in EXTRACT the input is [ref ; img], so
 * its ids are reordered to put the reference rows last. */
static kiln_status rope_prepare(kiln_flux2_dit *m, const kiln_flux2_dit_input *in, int64_t T,
                                int64_t N, int64_t R, kiln_err *err)
{
    const size_t A = KILN_FLUX2_ROPE_AXES;
    int32_t *ids = malloc((size_t)(T + N + R) * A * sizeof(int32_t));
    if (!ids)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for position ids");
    memcpy(ids, in->txt_ids, (size_t)T * A * sizeof(int32_t));
    memcpy(ids + T * A, in->img_ids + R * A, (size_t)N * A * sizeof(int32_t));
    memcpy(ids + (T + N) * A, in->img_ids, (size_t)R * A * sizeof(int32_t));
    kiln_status rc = rope_update(m, ids, T + N + R, err);
    free(ids);
    return rc;
}

/* --- embeddings and modulation ---------------------------------------------------- */

static kiln_tensor fwd_tensor(flux2_fwd *f, int ndim, const int64_t *shape)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->fwd, &t, f->be->act_dtype, ndim, shape);
    return t;
}

static kiln_tensor blk_tensor(flux2_fwd *f, int ndim, const int64_t *shape)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->blk, &t, f->be->act_dtype, ndim, shape);
    return t;
}

/* The sinusoids of the B times in `t` (staged in `host_e`, B x
 * time_channels floats) uploaded into a (B, time_channels) tensor: the one
 * per-step input of the time embedding, kept outside a recorded step. */
static kiln_tensor time_input(flux2_fwd *f, const float *t, float *host_e)
{
    const int64_t B = f->B, C = f->m->cfg.time_channels;
    for (int64_t b = 0; b < B; b++)
        kiln_flux2_time_proj(t[b], C, host_e + b * C);
    kiln_tensor e = fwd_tensor(f, 2, (int64_t[]){B, C});
    kiln_be_upload(f->be, &e, host_e, KILN_F32);
    return e;
}

/* SiLU(temb) of the sinusoids `e`; temb itself goes to the probe. */
static kiln_tensor time_embed(flux2_fwd *f, const kiln_tensor *e, kiln_tensor *temb_out)
{
    kiln_flux2_dit *m = f->m;
    const int64_t B = f->B, D = m->cfg.hidden;
    kiln_tensor h = blk_tensor(f, 2, (int64_t[]){B, D});
    kiln_tensor temb = fwd_tensor(f, 2, (int64_t[]){B, D});
    kiln_tensor s = fwd_tensor(f, 2, (int64_t[]){B, D});
    kiln_be_linear(f->be, &h, e, &m->time_lin1, NULL);
    kiln_be_silu(f->be, &h, &h);
    kiln_be_linear(f->be, &temb, &h, &m->time_lin2, NULL);
    kiln_be_silu(f->be, &s, &temb);
    if (temb_out)
        *temb_out = temb;
    return s;
}

/* Chunk `k` of width D of a (B, kD) modulation output as its own (B, D). */
static kiln_tensor chunk(flux2_fwd *f, const kiln_tensor *all, int k)
{
    const int64_t D = f->m->cfg.hidden;
    kiln_tensor t = fwd_tensor(f, 2, (int64_t[]){f->B, D});
    kiln_be_copy_cols(f->be, &t, 0, all, k * D, D);
    return t;
}

/* w(s) split into `count` (shift, scale, gate) triples, diffusers' order. */
static kiln_tensor modulate(flux2_fwd *f, const kiln_tensor *s, const kiln_tensor *w,
                            flux2_mod *mods, int count)
{
    kiln_tensor all = blk_tensor(f, 2, (int64_t[]){f->B, 3 * count * f->m->cfg.hidden});
    kiln_be_linear(f->be, &all, s, w, NULL);
    for (int i = 0; i < count; i++) {
        mods[i].shift = chunk(f, &all, 3 * i);
        mods[i].scale = chunk(f, &all, 3 * i + 1);
        mods[i].gate = chunk(f, &all, 3 * i + 2);
    }
    return all;
}

static void probe(const kiln_flux2_dit_input *in, flux2_fwd *f, const char *module, int part,
                  const kiln_tensor *t)
{
    if (in->probe && !f->be->error.code)
        in->probe(in->probe_user, module, part, t);
}

static kiln_status host_reserve(kiln_flux2_dit *m, size_t floats, kiln_err *err)
{
    return kiln_dit_host_reserve(&m->host, &m->host_cap, floats, err);
}

/* --- forward ----------------------------------------------------------------------- */

static kiln_status step_check(flux2_fwd *f, kiln_err *err, const char *what, int index)
{
    kiln_arena_reset(f->m->blk);
    if (!kiln_be_check(f->be, err))
        return KILN_OK;
    return index < 0 ? kiln_err_wrap(err, "flux2 dit %s", what)
                     : kiln_err_wrap(err, "flux2 dit %s %d", what, index);
}

static kiln_status embed(flux2_fwd *f, const kiln_flux2_dit_input *in, const flux2_io *io,
                         kiln_tensor *s, kiln_err *err)
{
    kiln_flux2_dit *m = f->m;
    const int64_t B = f->B, T = f->T, N = f->N, R = f->ref_stream ? f->R : 0;
    const int64_t D = m->cfg.hidden;
    kiln_tensor temb;
    const int64_t C = m->cfg.time_channels;
    *s = time_embed(f, &io->e, &temb);
    probe(in, f, "time_guidance_embed", -1, &temb);
    flux2_mod img[2], txt[2], single;
    kiln_tensor all = modulate(f, s, &m->mod_img, img, 2);
    probe(in, f, "double_stream_modulation_img", -1, &all);
    all = modulate(f, s, &m->mod_txt, txt, 2);
    probe(in, f, "double_stream_modulation_txt", -1, &all);
    all = modulate(f, s, &m->mod_single, &single, 1);
    probe(in, f, "single_stream_modulation", -1, &all);
    f->img_msa = img[0];
    f->img_mlp = img[1];
    f->txt_msa = txt[0];
    f->txt_mlp = txt[1];
    f->single = single;
    if (f->ref_stream) {
        /* diffusers' ref_fixed_timestep 0.0; the text modulation is not
         * changed for the reference tokens' step.  (EXTRACT forwards are
         * never recorded, so this upload may stay here.) */
        float *zeros = m->host + 2 * B * C;
        for (int64_t b = 0; b < B; b++)
            zeros[b] = 0.0f;
        kiln_tensor e_ref = time_input(f, zeros, m->host + B * C);
        kiln_tensor s_ref = time_embed(f, &e_ref, NULL);
        flux2_mod ref[2];
        modulate(f, &s_ref, &m->mod_img, ref, 2);
        modulate(f, &s_ref, &m->mod_single, &f->ref_single, 1);
        f->ref_msa = ref[0];
        f->ref_mlp = ref[1];
    }

    kiln_tensor xe = fwd_tensor(f, 3, (int64_t[]){B, R + N, D});
    kiln_be_linear(f->be, &xe, io->x, &m->x_embedder, NULL);
    probe(in, f, "x_embedder", -1, &xe);
    if (f->ref_stream) {
        f->r = fwd_tensor(f, 3, (int64_t[]){B, R, D});
        f->x = fwd_tensor(f, 3, (int64_t[]){B, N, D});
        kiln_be_copy_rows(f->be, &f->r, 0, &xe, 0, R);
        kiln_be_copy_rows(f->be, &f->x, 0, &xe, R, N);
    } else {
        f->x = xe;
    }
    f->c = fwd_tensor(f, 3, (int64_t[]){B, T, D});
    kiln_be_linear(f->be, &f->c, io->txt, &m->context_embedder, NULL);
    probe(in, f, "context_embedder", -1, &f->c);
    return step_check(f, err, "embeddings", -1);
}

kiln_status kiln_flux2_dit_forward(kiln_flux2_dit *m, const kiln_flux2_dit_input *in,
                                   kiln_tensor *out, kiln_err *err)
{
    if (check_input(m, in, out, err))
        return err->code;
    kiln_backend *be = m->be;
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "flux2 dit: backend error pending from an earlier call");
    const kiln_flux2_dit_config *c = &m->cfg;
    const int64_t B = in->x->shape[0], T = in->txt->shape[1];
    const int extract = in->kv_mode == KILN_FLUX2_KV_EXTRACT;
    const int64_t R_in = extract ? in->num_ref : 0;
    const int64_t N = in->x->shape[1] - R_in;

    flux2_fwd f = {.m = m, .be = be, .B = B, .T = T, .N = N, .ref_stream = extract};
    if (in->kv_mode != KILN_FLUX2_KV_OFF) {
        f.kv = in->kv;
        f.R = extract ? R_in : in->kv->tokens;
        if (extract && kv_prepare(m, in->kv, B, R_in, err))
            return err->code;
    }
    if (rope_prepare(m, in, T, N, R_in, err) ||
        host_reserve(m, (size_t)(B * (2 * c->time_channels + 1)), err))
        return err->code;
    f.rope_txt = rope_rows(m, 0, T);
    f.rope_img = rope_rows(m, T, N);
    f.rope_main = rope_rows(m, 0, T + N);
    if (extract)
        f.rope_ref = rope_rows(m, T + N, R_in);

    if (flux2_replay_usable(m, in))
        return flux2_forward_replayed(&f, in, out, err);
    kiln_arena_reset(m->fwd);
    kiln_arena_reset(m->blk);
    flux2_io io = {.x = in->x, .txt = in->txt, .out = out};
    io.e = time_input(&f, in->t, m->host);
    if (flux2_forward_body(&f, in, &io, err))
        return err->code;
    if (extract) {
        in->kv->batch = B;
        in->kv->tokens = R_in;
    }
    return KILN_OK;
}

kiln_status flux2_forward_body(flux2_fwd *f, const kiln_flux2_dit_input *in, const flux2_io *io,
                               kiln_err *err)
{
    kiln_flux2_dit *m = f->m;
    kiln_backend *be = f->be;
    const kiln_flux2_dit_config *c = &m->cfg;
    const int64_t B = f->B, T = f->T, N = f->N, D = c->hidden;
    kiln_tensor s;
    if (embed(f, in, io, &s, err))
        return err->code;

    char name[64];
    for (int i = 0; i < c->num_layers; i++) {
        flux2_double_block(f, i);
        snprintf(name, sizeof name, "transformer_blocks.%d", i);
        probe(in, f, name, 0, &f->c);
        probe(in, f, name, 1, &f->x);
        if (step_check(f, err, "double block", i))
            return err->code;
    }

    f->y = fwd_tensor(f, 3, (int64_t[]){B, T + N, D});
    kiln_be_copy_rows(be, &f->y, 0, &f->c, 0, T);
    kiln_be_copy_rows(be, &f->y, T, &f->x, 0, N);
    for (int j = 0; j < c->num_single_layers; j++) {
        flux2_single_block(f, j);
        snprintf(name, sizeof name, "single_transformer_blocks.%d", j);
        probe(in, f, name, -1, &f->y);
        if (step_check(f, err, "single block", j))
            return err->code;
    }

    /* Output layer: image rows only; norm_out's linear is ordered scale,
     * then shift (the opposite of the block modulations). */
    kiln_tensor xo = blk_tensor(f, 3, (int64_t[]){B, N, D});
    kiln_tensor emb = blk_tensor(f, 2, (int64_t[]){B, 2 * D});
    kiln_tensor n = blk_tensor(f, 3, (int64_t[]){B, N, D});
    kiln_be_copy_rows(be, &xo, 0, &f->y, T, N);
    kiln_be_linear(be, &emb, &s, &m->norm_out, NULL);
    kiln_tensor scale = chunk(f, &emb, 0), shift = chunk(f, &emb, 1);
    kiln_be_layer_norm_mod(be, &n, &xo, &shift, &scale, (float)c->eps);
    probe(in, f, "norm_out", -1, &n);
    kiln_be_linear(be, io->out, &n, &m->proj_out, NULL);
    probe(in, f, "proj_out", -1, io->out);
    return step_check(f, err, "output layer", -1);
}

kiln_status flux2_stage_inputs(flux2_fwd *f, const kiln_flux2_dit_input *in, flux2_io *io,
                               kiln_tensor *out)
{
    kiln_flux2_dit *m = f->m;
    kiln_arena_reset(m->fwd);
    kiln_arena_reset(m->blk);
    io->e = time_input(f, in->t, m->host);
    io->x_buf = fwd_tensor(f, in->x->ndim, in->x->shape);
    io->txt_buf = fwd_tensor(f, in->txt->ndim, in->txt->shape);
    io->out_buf = fwd_tensor(f, out->ndim, out->shape);
    kiln_be_copy(f->be, &io->x_buf, in->x);
    kiln_be_copy(f->be, &io->txt_buf, in->txt);
    io->x = &io->x_buf;
    io->txt = &io->txt_buf;
    io->out = &io->out_buf;
    return f->be->error.code;
}

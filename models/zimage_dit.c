/* Z-Image DiT forward driver: input checks, RoPE tables, the timestep
 * embedding, patch and caption embeddings with their padding, the refiners,
 * the main layers over [image ; caption] and the final layer
 * (spec/z-image-turbo.md §3.1-3.3, §3.5).  Matches diffusers
 * ZImageTransformer2DModel.forward (basic mode); the blocks are in
 * zimage_dit_blocks.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dit_util.h"
#include "flux2_dit.h" /* kiln_flux2_time_proj: the same sinusoids */
#include "zimage_dit_internal.h"

#define T_FREQ 256 /* TimestepEmbedder.frequency_embedding_size */
#define FINAL_EPS 1e-6f /* LayerNorm(elementwise_affine=False, eps=1e-6) */

static int64_t round_up(int64_t n)
{
    return (n + KILN_ZIMAGE_SEQ_MULTIPLE - 1) / KILN_ZIMAGE_SEQ_MULTIPLE *
           KILN_ZIMAGE_SEQ_MULTIPLE;
}

/* --- input checks ------------------------------------------------------------- */

static kiln_status check_act(const kiln_zimage_dit *m, const kiln_tensor *t, const char *what,
                             int64_t B, int64_t rows, int64_t cols, kiln_err *err)
{
    char buf[96];
    if (!t || t->ndim != 3 || t->dtype != m->be->act_dtype || t->shape[0] < 1 ||
        (B && t->shape[0] != B) || t->shape[1] < 1 || (rows && t->shape[1] != rows) ||
        t->shape[2] != cols || !t->data) {
        const char *dt = t ? kiln_dtype_name(t->dtype) : NULL;
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "zimage dit: %s has shape %s %s, expected (B, %lld, %lld) %s", what,
                            t ? kiln_tensor_shape_str(t, buf, sizeof buf) : "(none)",
                            dt ? dt : "?", (long long)rows, (long long)cols,
                            kiln_dtype_name(m->be->act_dtype));
    }
    return KILN_OK;
}

static kiln_status check_input(const kiln_zimage_dit *m, const kiln_zimage_dit_input *in,
                               const kiln_tensor *out, kiln_err *err)
{
    const kiln_zimage_dit_config *c = &m->cfg;
    if (!in || !in->x || !in->cap || !in->cap_len || !in->t || !out)
        return kiln_err_set(err, KILN_ERR_INVALID, "zimage dit: missing input");
    if (in->h < 1 || in->w < 1 || in->h > c->axes_lens[1] || in->w > c->axes_lens[2])
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "zimage dit: a %lld x %lld token grid is outside the RoPE tables "
                            "(%lld x %lld)", (long long)in->h, (long long)in->w,
                            (long long)c->axes_lens[1], (long long)c->axes_lens[2]);
    const int64_t N = in->h * in->w;
    if (check_act(m, in->x, "x", 0, N, c->patch_features, err))
        return err->code;
    const int64_t B = in->x->shape[0];
    if (check_act(m, in->cap, "caption features", B, 0, c->cap_feat_dim, err) ||
        check_act(m, out, "output", B, N, c->patch_features, err))
        return err->code;
    for (int64_t b = 0; b < B; b++) {
        if (in->cap_len[b] < 1 || in->cap_len[b] > in->cap->shape[1])
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "zimage dit: caption %lld has %lld rows of %lld", (long long)b,
                                (long long)in->cap_len[b], (long long)in->cap->shape[1]);
        /* Caption rows sit at positions 1..L_p and the image at L_p + 1 on
         * the first axis (spec §3.3). */
        if (round_up(in->cap_len[b]) + 1 >= c->axes_lens[0])
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "zimage dit: caption %lld (%lld tokens) is longer than the RoPE "
                                "table (%lld)", (long long)b, (long long)in->cap_len[b],
                                (long long)c->axes_lens[0]);
        if (!isfinite(in->t[b]))
            return kiln_err_set(err, KILN_ERR_INVALID, "zimage dit: timestep %lld is not finite",
                                (long long)b);
    }
    return KILN_OK;
}

static kiln_status host_reserve(kiln_zimage_dit *m, size_t floats, kiln_err *err)
{
    return kiln_dit_host_reserve(&m->host, &m->host_cap, floats, err);
}

/* --- RoPE tables --------------------------------------------------------------- */

/* Position ids of one item's rows [image N_p ; caption Lmax] (spec §3.3):
 * image token (y, x) at (L_p + 1, y, x), image padding at (0, 0, 0),
 * caption row r at (1 + r, 0, 0), its padding and the batch padding
 * included (the batch padding is never read). */
static void item_ids(int32_t *ids, int64_t h, int64_t w, int64_t Np, int64_t Lp, int64_t Lmax)
{
    const int64_t A = KILN_ZIMAGE_ROPE_AXES;
    memset(ids, 0, (size_t)((Np + Lmax) * A) * sizeof *ids);
    for (int64_t y = 0; y < h; y++)
        for (int64_t x = 0; x < w; x++) {
            int32_t *r = ids + (y * w + x) * A;
            r[0] = (int32_t)(Lp + 1), r[1] = (int32_t)y, r[2] = (int32_t)x;
        }
    for (int64_t r = 0; r < Lmax; r++)
        ids[(Np + r) * A] = (int32_t)(1 + r);
}

/* Makes m->rope_* hold the tables of this forward: one item's rows when
 * every item has the same padded caption length, else B items' rows.  The
 * buffers only grow, so they never move under a recorded step whose layout
 * they still hold (rope_epoch counts their moves), as in flux2_dit.c. */
static kiln_status rope_prepare(zimage_fwd *f, int64_t h, int64_t w, kiln_err *err)
{
    kiln_zimage_dit *m = f->m;
    kiln_backend *be = m->be;
    const int64_t items = f->ragged ? f->B : 1, per = f->Np + f->Lmax;
    const int64_t rows = items * per, d = m->cfg.head_dim;
    const int64_t key[4] = {items, h, w, f->Lmax};
    if (m->rope_rows == rows && !memcmp(m->rope_key, key, sizeof key) &&
        !memcmp(m->rope_caps, f->cap_p, (size_t)items * sizeof *f->cap_p))
        return KILN_OK;
    int64_t *caps = realloc(m->rope_caps, (size_t)items * sizeof *caps);
    if (!caps)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for RoPE tables");
    m->rope_caps = caps;
    m->rope_rows = 0;
    int32_t *ids = malloc((size_t)(per * KILN_ZIMAGE_ROPE_AXES) * sizeof *ids);
    float *tab = malloc((size_t)(2 * rows * d) * sizeof *tab);
    if (!ids || !tab) {
        free(ids);
        free(tab);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for RoPE tables");
    }
    for (int64_t b = 0; b < items; b++) {
        item_ids(ids, h, w, f->Np, f->cap_p[b], f->Lmax);
        kiln_zimage_rope_table(ids, per, m->cfg.axes_dims, m->cfg.rope_theta,
                               tab + b * per * d, tab + (rows + b * per) * d);
    }
    free(ids);
    kiln_dit_rope_reserve(be, &m->rope_cos, &m->rope_sin, &m->rope_cap, &m->rope_epoch, rows, d);
    kiln_tensor c = m->rope_cos, s = m->rope_sin;
    kiln_tensor_set_shape(&c, KILN_F32, 2, (int64_t[]){rows, d});
    kiln_tensor_set_shape(&s, KILN_F32, 2, (int64_t[]){rows, d});
    kiln_be_upload(be, &c, tab, KILN_F32);
    kiln_be_upload(be, &s, tab + rows * d, KILN_F32);
    free(tab);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "uploading RoPE tables");
    memcpy(m->rope_key, key, sizeof key);
    memcpy(m->rope_caps, f->cap_p, (size_t)items * sizeof *caps);
    m->rope_rows = rows;
    return KILN_OK;
}

/* Rows [row0, row0 + n) of every item's table. */
static zimage_rope rope_view(const zimage_fwd *f, int64_t row0, int64_t n)
{
    const kiln_zimage_dit *m = f->m;
    const int64_t d = m->cfg.head_dim;
    zimage_rope r = {m->rope_cos, m->rope_sin, f->ragged ? f->Np + f->Lmax : 0};
    size_t off = (size_t)(row0 * d) * sizeof(float);
    r.cos.data = (char *)r.cos.data + off;
    r.sin.data = (char *)r.sin.data + off;
    kiln_tensor_set_shape(&r.cos, KILN_F32, 2, (int64_t[]){n, d});
    kiln_tensor_set_shape(&r.sin, KILN_F32, 2, (int64_t[]){n, d});
    return r;
}

/* --- forward ------------------------------------------------------------------------ */

static kiln_tensor fwd_tensor(zimage_fwd *f, int ndim, const int64_t *shape)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->fwd, &t, f->be->act_dtype, ndim, shape);
    return t;
}

static void probe(const kiln_zimage_dit_input *in, zimage_fwd *f, const char *module,
                  const kiln_tensor *t)
{
    if (in->probe && !f->be->error.code)
        in->probe(in->probe_user, module, t);
}

static kiln_status step_check(zimage_fwd *f, kiln_err *err, const char *what, int index)
{
    kiln_arena_reset(f->m->blk);
    if (!kiln_be_check(f->be, err))
        return KILN_OK;
    return index < 0 ? kiln_err_wrap(err, "zimage dit %s", what)
                     : kiln_err_wrap(err, "zimage dit %s %d", what, index);
}

/* The sinusoids of t * t_scale (spec §3.1: fp32 on the host, the table
 * FLUX.2 uses) uploaded into a (B, 256) tensor: the one per-step upload of
 * a forward, kept outside a recorded step. */
static kiln_tensor time_input(zimage_fwd *f, const float *t)
{
    kiln_zimage_dit *m = f->m;
    const int64_t B = f->B;
    float *e = m->host;
    for (int64_t b = 0; b < B; b++)
        kiln_flux2_time_proj(t[b] * (float)m->cfg.t_scale, T_FREQ, e + b * T_FREQ);
    kiln_tensor et = fwd_tensor(f, 2, (int64_t[]){B, T_FREQ});
    kiln_be_upload(f->be, &et, e, KILN_F32);
    return et;
}

/* adaln = t_embedder(t * t_scale): Linear, SiLU, Linear on the sinusoids. */
static void time_embed(zimage_fwd *f, const kiln_tensor *et)
{
    kiln_zimage_dit *m = f->m;
    const int64_t B = f->B;
    kiln_tensor h = fwd_tensor(f, 2, (int64_t[]){B, m->cfg.t_hidden});
    f->adaln = fwd_tensor(f, 2, (int64_t[]){B, m->cfg.adaln_dim});
    kiln_be_linear(f->be, &h, et, &m->t_lin1, &m->t_lin1_b);
    kiln_be_silu(f->be, &h, &h);
    kiln_be_linear(f->be, &f->adaln, &h, &m->t_lin2, &m->t_lin2_b);
}

/* Image rows (B, N_p, D): the patch embedding, then x_pad_token rows. */
static kiln_tensor embed_image(zimage_fwd *f, const kiln_zimage_dit_input *in,
                               const zimage_io *io)
{
    kiln_zimage_dit *m = f->m;
    const int64_t B = f->B, N = f->N, Np = f->Np, D = m->cfg.dim;
    kiln_tensor xe = fwd_tensor(f, 3, (int64_t[]){B, N, D});
    kiln_tensor X = fwd_tensor(f, 3, (int64_t[]){B, Np, D});
    kiln_be_linear(f->be, &xe, io->x, &m->x_emb, &m->x_emb_b);
    probe(in, f, "all_x_embedder.2-1", &xe);
    kiln_be_copy_rows(f->be, &X, 0, &xe, 0, N);
    for (int64_t b = 0; b < B && Np > N; b++) {
        kiln_tensor xb = kiln_tensor_batch_view(&X, b, 1);
        kiln_be_copy_rows(f->be, &xb, N, &m->x_pad, 0, Np - N);
    }
    return X;
}

/* Caption rows (B, Lmax, D): RMSNorm + Linear, then cap_pad_token rows up
 * to each item's padded length (rows past it are left as they are). */
static kiln_tensor embed_caption(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                 const zimage_io *io)
{
    kiln_zimage_dit *m = f->m;
    const int64_t B = f->B, T = in->cap->shape[1], D = m->cfg.dim;
    kiln_tensor cn = fwd_tensor(f, 3, (int64_t[]){B, T, m->cfg.cap_feat_dim});
    kiln_tensor ce = fwd_tensor(f, 3, (int64_t[]){B, T, D});
    kiln_tensor C = fwd_tensor(f, 3, (int64_t[]){B, f->Lmax, D});
    kiln_be_rms_norm(f->be, &cn, io->cap, &m->cap_norm, (float)m->cfg.norm_eps);
    kiln_be_linear(f->be, &ce, &cn, &m->cap_emb, &m->cap_emb_b);
    probe(in, f, "cap_embedder", &ce);
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = in->cap_len[b];
        kiln_tensor cb = kiln_tensor_batch_view(&C, b, 1), eb = kiln_tensor_batch_view(&ce, b, 1);
        kiln_be_copy_rows(f->be, &cb, 0, &eb, 0, L);
        if (f->cap_p[b] > L)
            kiln_be_copy_rows(f->be, &cb, L, &m->cap_pad, 0, f->cap_p[b] - L);
    }
    return C;
}

/* The final layer on the image rows: LN(x) * (1 + Linear(SiLU(adaln))),
 * then Linear to the patch features. */
static void final_layer(zimage_fwd *f, const kiln_zimage_dit_input *in, const kiln_tensor *U,
                        kiln_tensor *out)
{
    kiln_zimage_dit *m = f->m;
    const int64_t B = f->B, N = f->N, D = m->cfg.dim;
    kiln_tensor xo = fwd_tensor(f, 3, (int64_t[]){B, N, D});
    kiln_tensor s = fwd_tensor(f, 2, (int64_t[]){B, m->cfg.adaln_dim});
    kiln_tensor scale = fwd_tensor(f, 2, (int64_t[]){B, D});
    kiln_be_copy_rows(f->be, &xo, 0, U, 0, N);
    kiln_be_silu(f->be, &s, &f->adaln);
    kiln_be_linear(f->be, &scale, &s, &m->final_ada, &m->final_ada_b);
    kiln_be_layer_norm_mod(f->be, &xo, &xo, NULL, &scale, FINAL_EPS);
    kiln_be_linear(f->be, out, &xo, &m->final_lin, &m->final_lin_b);
    probe(in, f, "all_final_layer.2-1", out);
}

kiln_status zimage_forward_body(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                const zimage_io *io, kiln_err *err)
{
    kiln_zimage_dit *m = f->m;
    const kiln_zimage_dit_config *c = &m->cfg;
    const int64_t B = f->B, Np = f->Np, Lmax = f->Lmax, D = c->dim;
    char name[64];

    time_embed(f, &io->e);
    probe(in, f, "t_embedder", &f->adaln);
    kiln_tensor X = embed_image(f, in, io);
    kiln_tensor C = embed_caption(f, in, io);
    if (step_check(f, err, "embeddings", -1))
        return err->code;

    /* Image rows alone: every item has N_p of them, so no item needs its
     * own attention, but their RoPE rows follow each caption's length. */
    zimage_rope rope = rope_view(f, 0, Np);
    for (int i = 0; i < c->n_refiner_layers; i++) {
        zimage_mod mod = zimage_modulation(f, &m->noise_ref[i]);
        zimage_block(f, &m->noise_ref[i], &X, NULL, &rope, &mod);
        snprintf(name, sizeof name, "noise_refiner.%d", i);
        probe(in, f, name, &X);
        if (step_check(f, err, "noise refiner", i))
            return err->code;
    }
    /* Caption rows alone: the same positions for every item. */
    rope = rope_view(f, Np, Lmax);
    rope.stride = 0;
    for (int i = 0; i < c->n_refiner_layers; i++) {
        zimage_block(f, &m->ctx_ref[i], &C, f->ragged ? f->cap_p : NULL, &rope, NULL);
        snprintf(name, sizeof name, "context_refiner.%d", i);
        probe(in, f, name, &C);
        if (step_check(f, err, "context refiner", i))
            return err->code;
    }

    /* [image ; caption], image first (spec §3.5 item 4). */
    kiln_tensor U = fwd_tensor(f, 3, (int64_t[]){B, Np + Lmax, D});
    kiln_be_copy_rows(f->be, &U, 0, &X, 0, Np);
    kiln_be_copy_rows(f->be, &U, Np, &C, 0, Lmax);
    for (int64_t b = 0; b < B; b++)
        f->lens[b] = Np + f->cap_p[b];
    rope = rope_view(f, 0, Np + Lmax);
    for (int i = 0; i < c->n_layers; i++) {
        zimage_mod mod = zimage_modulation(f, &m->layers[i]);
        zimage_block(f, &m->layers[i], &U, f->ragged ? f->lens : NULL, &rope, &mod);
        snprintf(name, sizeof name, "layers.%d", i);
        probe(in, f, name, &U);
        if (step_check(f, err, "layer", i))
            return err->code;
    }
    final_layer(f, in, &U, io->out);
    return step_check(f, err, "final layer", -1);
}

kiln_status zimage_stage_inputs(zimage_fwd *f, const kiln_zimage_dit_input *in, zimage_io *io,
                                kiln_tensor *out)
{
    kiln_zimage_dit *m = f->m;
    kiln_arena_reset(m->fwd);
    kiln_arena_reset(m->blk);
    io->e = time_input(f, in->t);
    io->x_buf = fwd_tensor(f, in->x->ndim, in->x->shape);
    io->cap_buf = fwd_tensor(f, in->cap->ndim, in->cap->shape);
    io->out_buf = fwd_tensor(f, out->ndim, out->shape);
    kiln_be_copy(f->be, &io->x_buf, in->x);
    kiln_be_copy(f->be, &io->cap_buf, in->cap);
    io->x = &io->x_buf;
    io->cap = &io->cap_buf;
    io->out = &io->out_buf;
    return f->be->error.code;
}

kiln_status kiln_zimage_dit_forward(kiln_zimage_dit *m, const kiln_zimage_dit_input *in,
                                    kiln_tensor *out, kiln_err *err)
{
    if (check_input(m, in, out, err))
        return err->code;
    kiln_backend *be = m->be;
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "zimage dit: backend error pending from an earlier call");
    const int64_t B = in->x->shape[0], N = in->h * in->w;
    int64_t *ints = malloc((size_t)(2 * B) * sizeof *ints);
    if (!ints)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    zimage_fwd f = {.m = m, .be = be, .B = B, .N = N, .Np = round_up(N), .cap_p = ints,
                    .lens = ints + B};
    for (int64_t b = 0; b < B; b++) {
        ints[b] = round_up(in->cap_len[b]);
        if (ints[b] > f.Lmax)
            f.Lmax = ints[b];
        if (ints[b] != ints[0])
            f.ragged = 1;
    }
    kiln_status st = host_reserve(m, (size_t)(B * T_FREQ), err);
    if (!st)
        st = rope_prepare(&f, in->h, in->w, err);
    if (!st && zimage_replay_usable(m, in)) {
        st = zimage_forward_replayed(&f, in, out, err);
    } else if (!st) {
        kiln_arena_reset(m->fwd);
        kiln_arena_reset(m->blk);
        zimage_io io = {.x = in->x, .cap = in->cap, .out = out};
        io.e = time_input(&f, in->t);
        st = zimage_forward_body(&f, in, &io, err);
    }
    free(ints);
    return st;
}

/* FLUX.2 double-stream and single-stream blocks (spec/flux2-klein.md §3.4,
 * §3.5, and §6 for the reference K/V modes), diffusers
 * Flux2TransformerBlock / Flux2SingleTransformerBlock.
 *
 * Every op except attention works token by token, so in the KV extract mode
 * the reference tokens run as a separate stream `r` with their own (t = 0)
 * modulation and meet the other tokens only in the key/value concatenation
 * [txt ; ref ; img]; their queries attend to reference keys alone.  The
 * cached mode inserts stored reference K/V rows at the same place. */
#include <math.h>

#include "dit_util.h"
#include "flux2_dit_internal.h"

static kiln_tensor tmp(flux2_fwd *f, int64_t S, int64_t C)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->blk, &t, f->be->act_dtype, 3, (int64_t[]){f->B, S, C});
    return t;
}

/* (B, S, D) seen as (B, S, h, d). */
static kiln_tensor heads(const flux2_fwd *f, const kiln_tensor *t)
{
    return kiln_dit_heads(t, f->m->cfg.num_heads, f->m->cfg.head_dim);
}

static kiln_tensor ln_mod(flux2_fwd *f, const kiln_tensor *x, const flux2_mod *mod)
{
    kiln_tensor n = tmp(f, x->shape[1], x->shape[2]);
    kiln_be_layer_norm_mod(f->be, &n, x, &mod->shift, &mod->scale, (float)f->m->cfg.eps);
    return n;
}

typedef struct flux2_qkv {
    kiln_tensor q, k, v; /* (B, S, D) each */
} flux2_qkv;

/* The fused projection P (B, S, 3D) split into r's q, k, v (B, S, D), with
 * the per-head RMSNorm and RoPE of q and k in the same pass (backend
 * qkv_split). */
static void project_into(flux2_fwd *f, const kiln_tensor *n, const kiln_tensor *w,
                         const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                         const flux2_rope *rope, flux2_qkv *r)
{
    const int64_t S = n->shape[1], D = f->m->cfg.hidden;
    kiln_tensor P = tmp(f, S, 3 * D);
    kiln_be_linear(f->be, &P, n, w, NULL);
    kiln_be_qkv_split(f->be, &r->q, &r->k, &r->v, &P, norm_q, norm_k, (float)f->m->cfg.eps,
                      &rope->cos, &rope->sin, KILN_ROPE_INTERLEAVED);
}

static flux2_qkv project(flux2_fwd *f, const kiln_tensor *n, const kiln_tensor *w,
                         const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                         const flux2_rope *rope)
{
    const int64_t S = n->shape[1], D = f->m->cfg.hidden;
    flux2_qkv r = {tmp(f, S, D), tmp(f, S, D), tmp(f, S, D)};
    project_into(f, n, w, norm_q, norm_k, rope, &r);
    return r;
}

/* With one batch row a stream's rows are contiguous, so a stream can be
 * produced in place inside a concatenation (and read back out of one)
 * without copies. */
#define rows_view kiln_dit_rows_view

/* Rows [row0, row0 + n) of a (B, S, C) tensor; t NULL or n 0 adds nothing. */
typedef struct seg {
    const kiln_tensor *t;
    int64_t row0, n;
} seg;

static kiln_tensor cat_rows(flux2_fwd *f, const seg *s, int count)
{
    int64_t total = 0, cols = s[0].t->shape[2];
    for (int i = 0; i < count; i++)
        if (s[i].t)
            total += s[i].n;
    kiln_tensor out = tmp(f, total, cols);
    int64_t at = 0;
    for (int i = 0; i < count; i++) {
        if (!s[i].t || !s[i].n)
            continue;
        kiln_be_copy_rows(f->be, &out, at, s[i].t, s[i].row0, s[i].n);
        at += s[i].n;
    }
    return out;
}

/* Full SDPA, no mask (spec §5): (B, Sq, D) x (B, Sk, D) -> (B, Sq, D). */
static kiln_tensor attend(flux2_fwd *f, const kiln_tensor *q, const kiln_tensor *k,
                          const kiln_tensor *v)
{
    kiln_tensor o = tmp(f, q->shape[1], f->m->cfg.hidden);
    kiln_tensor oh = heads(f, &o), qh = heads(f, q), kh = heads(f, k), vh = heads(f, v);
    kiln_attn_opts opts = {.scale = (float)(1.0 / sqrt((double)f->m->cfg.head_dim))};
    kiln_be_attention(f->be, &oh, &qh, &kh, &vh, &opts);
    return o;
}

static void kv_store(flux2_fwd *f, int64_t layer, const flux2_qkv *ref)
{
    kiln_be_copy(f->be, &f->kv->k[layer], &ref->k);
    kiln_be_copy(f->be, &f->kv->v[layer], &ref->v);
}

/* Gated attention output, then the gated SwiGLU feed-forward. */
static void stream_finish(flux2_fwd *f, kiln_tensor *x, const kiln_tensor *o,
                          const kiln_tensor *w_out, const flux2_mod *msa, const flux2_mod *mlp,
                          const kiln_tensor *ff_in, const kiln_tensor *ff_out)
{
    const int64_t S = x->shape[1], D = f->m->cfg.hidden, F = f->m->cfg.mlp_hidden;
    kiln_tensor a = tmp(f, S, D);
    kiln_be_linear(f->be, &a, o, w_out, NULL);
    kiln_be_gated_add(f->be, x, &msa->gate, &a);
    kiln_tensor n = ln_mod(f, x, mlp);
    kiln_tensor h = tmp(f, S, 2 * F), g = tmp(f, S, F);
    kiln_be_linear(f->be, &h, &n, ff_in, NULL);
    kiln_be_swiglu(f->be, &g, &h);
    kiln_be_linear(f->be, &a, &g, ff_out, NULL);
    kiln_be_gated_add(f->be, x, &mlp->gate, &a);
}

/* Text first, as diffusers concatenates the streams: Q = [txt ; img] and
 * K, V = [txt ; ref ; img]. */
typedef struct flux2_joint {
    kiln_tensor Q, K, V;
} flux2_joint;

/* One batch row: both streams are projected straight into the joint Q, K,
 * V (and the reference rows copied there). */
static flux2_joint joint_in_place(flux2_fwd *f, const flux2_double_w *W, const kiln_tensor *kr,
                                  const kiln_tensor *vr)
{
    const int64_t T = f->T, N = f->N, R = f->R, D = f->m->cfg.hidden;
    flux2_joint j = {tmp(f, T + N, D), tmp(f, T + R + N, D), tmp(f, T + R + N, D)};
    flux2_qkv txt = {rows_view(&j.Q, 0, T), rows_view(&j.K, 0, T), rows_view(&j.V, 0, T)};
    flux2_qkv img = {rows_view(&j.Q, T, N), rows_view(&j.K, T + R, N),
                     rows_view(&j.V, T + R, N)};
    kiln_tensor n = ln_mod(f, &f->c, &f->txt_msa);
    project_into(f, &n, &W->add_qkv, &W->norm_add_q, &W->norm_add_k, &f->rope_txt, &txt);
    n = ln_mod(f, &f->x, &f->img_msa);
    project_into(f, &n, &W->qkv, &W->norm_q, &W->norm_k, &f->rope_img, &img);
    if (kr) {
        kiln_be_copy_rows(f->be, &j.K, T, kr, 0, R);
        kiln_be_copy_rows(f->be, &j.V, T, vr, 0, R);
    }
    return j;
}

/* Several batch rows: each stream's rows are strided in the joint tensors,
 * so the streams are projected on their own and concatenated. */
static flux2_joint joint_by_copy(flux2_fwd *f, const flux2_double_w *W, const kiln_tensor *kr,
                                 const kiln_tensor *vr)
{
    const int64_t T = f->T, N = f->N, R = f->R;
    kiln_tensor n = ln_mod(f, &f->c, &f->txt_msa);
    flux2_qkv txt = project(f, &n, &W->add_qkv, &W->norm_add_q, &W->norm_add_k, &f->rope_txt);
    n = ln_mod(f, &f->x, &f->img_msa);
    flux2_qkv img = project(f, &n, &W->qkv, &W->norm_q, &W->norm_k, &f->rope_img);
    return (flux2_joint){
        cat_rows(f, (seg[]){{&txt.q, 0, T}, {&img.q, 0, N}}, 2),
        cat_rows(f, (seg[]){{&txt.k, 0, T}, {kr, 0, R}, {&img.k, 0, N}}, 3),
        cat_rows(f, (seg[]){{&txt.v, 0, T}, {vr, 0, R}, {&img.v, 0, N}}, 3),
    };
}

void flux2_double_block(flux2_fwd *f, int i)
{
    const flux2_double_w *W = &f->m->dbl[i];
    const int64_t T = f->T, N = f->N;

    /* The reference stream first: its K/V join the image's attention. */
    flux2_qkv ref = {0};
    const kiln_tensor *kr = NULL, *vr = NULL;
    if (f->ref_stream) {
        kiln_tensor n = ln_mod(f, &f->r, &f->ref_msa);
        ref = project(f, &n, &W->qkv, &W->norm_q, &W->norm_k, &f->rope_ref);
        kv_store(f, i, &ref);
        kr = &ref.k;
        vr = &ref.v;
    } else if (f->kv) {
        kr = &f->kv->k[i];
        vr = &f->kv->v[i];
    }

    flux2_joint j = f->B == 1 ? joint_in_place(f, W, kr, vr) : joint_by_copy(f, W, kr, vr);
    kiln_tensor O = attend(f, &j.Q, &j.K, &j.V);
    kiln_tensor o_txt, o_img;
    if (f->B == 1) {
        o_txt = rows_view(&O, 0, T);
        o_img = rows_view(&O, T, N);
    } else {
        o_txt = cat_rows(f, (seg[]){{&O, 0, T}}, 1);
        o_img = cat_rows(f, (seg[]){{&O, T, N}}, 1);
    }

    stream_finish(f, &f->c, &o_txt, &W->add_out, &f->txt_msa, &f->txt_mlp, &W->ffc_in,
                  &W->ffc_out);
    stream_finish(f, &f->x, &o_img, &W->out, &f->img_msa, &f->img_mlp, &W->ff_in, &W->ff_out);
    if (f->ref_stream) {
        kiln_tensor o_ref = attend(f, &ref.q, &ref.k, &ref.v);
        stream_finish(f, &f->r, &o_ref, &W->out, &f->ref_msa, &f->ref_mlp, &W->ff_in,
                      &W->ff_out);
    }
}

/* y += gate * to_out([attn | SiLU(g) * u]). */
static void single_finish(flux2_fwd *f, kiln_tensor *y, const kiln_tensor *o,
                          const kiln_tensor *h, const flux2_single_w *W, const flux2_mod *mod)
{
    const int64_t S = y->shape[1], D = f->m->cfg.hidden, F = f->m->cfg.mlp_hidden;
    kiln_tensor cat = tmp(f, S, D + F), a = tmp(f, S, D);
    kiln_be_copy_cols(f->be, &cat, 0, o, 0, D);
    kiln_be_swiglu_cols(f->be, &cat, D, h);
    kiln_be_linear(f->be, &a, &cat, &W->out, NULL);
    kiln_be_gated_add(f->be, y, &mod->gate, &a);
}

void flux2_single_block(flux2_fwd *f, int j)
{
    const flux2_single_w *W = &f->m->sgl[j];
    const int64_t T = f->T, N = f->N, R = f->R, F = f->m->cfg.mlp_hidden;
    const int64_t layer = f->m->cfg.num_layers + j;

    kiln_tensor n = ln_mod(f, &f->y, &f->single);
    flux2_qkv main = project(f, &n, &W->qkv, &W->norm_q, &W->norm_k, &f->rope_main);
    kiln_tensor h = tmp(f, T + N, 2 * F);
    kiln_be_linear(f->be, &h, &n, &W->mlp_in, NULL);

    flux2_qkv ref = {0};
    kiln_tensor h_ref = {0};
    const kiln_tensor *kr = NULL, *vr = NULL;
    if (f->ref_stream) {
        kiln_tensor nr = ln_mod(f, &f->r, &f->ref_single);
        ref = project(f, &nr, &W->qkv, &W->norm_q, &W->norm_k, &f->rope_ref);
        h_ref = tmp(f, R, 2 * F);
        kiln_be_linear(f->be, &h_ref, &nr, &W->mlp_in, NULL);
        kv_store(f, layer, &ref);
        kr = &ref.k;
        vr = &ref.v;
    } else if (f->kv) {
        kr = &f->kv->k[layer];
        vr = &f->kv->v[layer];
    }

    kiln_tensor O;
    if (kr) {
        kiln_tensor K = cat_rows(f, (seg[]){{&main.k, 0, T}, {kr, 0, R}, {&main.k, T, N}}, 3);
        kiln_tensor V = cat_rows(f, (seg[]){{&main.v, 0, T}, {vr, 0, R}, {&main.v, T, N}}, 3);
        O = attend(f, &main.q, &K, &V);
    } else {
        O = attend(f, &main.q, &main.k, &main.v);
    }
    single_finish(f, &f->y, &O, &h, W, &f->single);
    if (f->ref_stream) {
        kiln_tensor o_ref = attend(f, &ref.q, &ref.k, &ref.v);
        single_finish(f, &f->r, &o_ref, &h_ref, W, &f->ref_single);
    }
}

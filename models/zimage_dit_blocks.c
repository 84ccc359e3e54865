/* The Z-Image transformer block (diffusers ZImageTransformerBlock,
 * spec/z-image-turbo.md §3.4): sandwich RMSNorms around attention and the
 * SwiGLU feed-forward, scale and tanh-gate modulation from the timestep
 * (no shift), or none in the context refiner. */
#include <math.h>

#include "dit_util.h"
#include "zimage_dit_internal.h"

static kiln_tensor tmp(zimage_fwd *f, int64_t S, int64_t C)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->blk, &t, f->be->act_dtype, 3, (int64_t[]){f->B, S, C});
    return t;
}

static kiln_tensor tmp2(zimage_fwd *f, int64_t C)
{
    kiln_tensor t;
    kiln_arena_tensor(f->m->blk, &t, f->be->act_dtype, 2, (int64_t[]){f->B, C});
    return t;
}

zimage_mod zimage_modulation(zimage_fwd *f, const zimage_block_w *W)
{
    const int64_t D = f->m->cfg.dim;
    /* adaLN_modulation.0 is a bare Linear (no SiLU before it, unlike the
     * final layer's), chunks in the order scale_msa, gate_msa, scale_mlp,
     * gate_mlp. */
    kiln_tensor all = tmp2(f, 4 * D);
    kiln_be_linear(f->be, &all, &f->adaln, &W->ada, &W->ada_b);
    kiln_tensor *parts[4];
    zimage_mod mod;
    parts[0] = &mod.scale_msa, parts[1] = &mod.gate_msa;
    parts[2] = &mod.scale_mlp, parts[3] = &mod.gate_mlp;
    for (int k = 0; k < 4; k++) {
        *parts[k] = tmp2(f, D);
        kiln_be_copy_cols(f->be, parts[k], 0, &all, k * D, D);
    }
    kiln_be_tanh(f->be, &mod.gate_msa, &mod.gate_msa);
    kiln_be_tanh(f->be, &mod.gate_mlp, &mod.gate_mlp);
    return mod;
}

/* RMSNorm(x; w), times (1 + scale) when scale is given: n + scale * n,
 * which is the product up to rounding (diffusers rounds 1 + scale first). */
static kiln_tensor norm_mod(zimage_fwd *f, const kiln_tensor *x, const kiln_tensor *w,
                            const kiln_tensor *scale)
{
    const float eps = (float)f->m->cfg.norm_eps;
    kiln_tensor n = tmp(f, x->shape[1], x->shape[2]);
    kiln_be_rms_norm(f->be, &n, x, w, eps);
    if (!scale)
        return n;
    kiln_tensor s = tmp(f, x->shape[1], x->shape[2]);
    kiln_be_copy(f->be, &s, &n);
    kiln_be_gated_add(f->be, &s, scale, &n);
    return s;
}

/* Item b's rows [0, n) of a (B, S, C) tensor, as (1, n, C). */
static kiln_tensor item_rows(const kiln_tensor *t, int64_t b, int64_t n)
{
    kiln_tensor v = kiln_tensor_batch_view(t, b, 1);
    return kiln_dit_rows_view(&v, 0, n);
}

/* RoPE rows of item b, n of them. */
static void rope_rows(const zimage_rope *r, int64_t b, int64_t n, int64_t d, kiln_tensor *cos,
                      kiln_tensor *sin)
{
    size_t off = (size_t)(b * r->stride * d) * sizeof(float);
    *cos = r->cos, *sin = r->sin;
    cos->data = (char *)cos->data + off;
    sin->data = (char *)sin->data + off;
    cos->shape[0] = sin->shape[0] = n;
}

/* o = SDPA(q, k, v) with q and k normed and rotated from the fused
 * projection P (B, S, 3D).  Items run one at a time where their RoPE rows
 * or their lengths differ (lens: each attends to its own rows only, the
 * boolean key mask of diffusers' padded batch). */
static void attention(zimage_fwd *f, const zimage_block_w *W, const kiln_tensor *P,
                      const int64_t *lens, const zimage_rope *rope, kiln_tensor *o)
{
    const kiln_zimage_dit_config *c = &f->m->cfg;
    const int64_t S = P->shape[1], D = c->dim, H = c->n_heads, d = c->head_dim;
    const float eps = (float)c->norm_eps;
    const kiln_tensor *nq = W->norm_q.data ? &W->norm_q : NULL;
    const kiln_tensor *nk = W->norm_k.data ? &W->norm_k : NULL;
    kiln_tensor q = tmp(f, S, D), k = tmp(f, S, D), v = tmp(f, S, D);
    kiln_attn_opts opts = {.scale = (float)(1.0 / sqrt((double)d))};
    if (!rope->stride) {
        kiln_be_qkv_split(f->be, &q, &k, &v, P, nq, nk, eps, &rope->cos, &rope->sin,
                          KILN_ROPE_INTERLEAVED);
    } else {
        for (int64_t b = 0; b < f->B; b++) {
            kiln_tensor qb = item_rows(&q, b, S), kb = item_rows(&k, b, S);
            kiln_tensor vb = item_rows(&v, b, S), pb = item_rows(P, b, S), cs, sn;
            rope_rows(rope, b, S, d, &cs, &sn);
            kiln_be_qkv_split(f->be, &qb, &kb, &vb, &pb, nq, nk, eps, &cs, &sn,
                              KILN_ROPE_INTERLEAVED);
        }
    }
    if (!lens) {
        kiln_tensor oh = kiln_dit_heads(o, H, d), qh = kiln_dit_heads(&q, H, d);
        kiln_tensor kh = kiln_dit_heads(&k, H, d), vh = kiln_dit_heads(&v, H, d);
        kiln_be_attention(f->be, &oh, &qh, &kh, &vh, &opts);
        return;
    }
    for (int64_t b = 0; b < f->B; b++) {
        kiln_tensor ob = item_rows(o, b, lens[b]), qb = item_rows(&q, b, lens[b]);
        kiln_tensor kb = item_rows(&k, b, lens[b]), vb = item_rows(&v, b, lens[b]);
        kiln_tensor oh = kiln_dit_heads(&ob, H, d), qh = kiln_dit_heads(&qb, H, d);
        kiln_tensor kh = kiln_dit_heads(&kb, H, d), vh = kiln_dit_heads(&vb, H, d);
        kiln_be_attention(f->be, &oh, &qh, &kh, &vh, &opts);
    }
}

void zimage_block(zimage_fwd *f, const zimage_block_w *W, kiln_tensor *x, const int64_t *lens,
                  const zimage_rope *rope, const zimage_mod *mod)
{
    const kiln_zimage_dit_config *c = &f->m->cfg;
    const int64_t S = x->shape[1], D = c->dim, F = c->ffn_hidden;
    const float eps = (float)c->norm_eps;

    /* x += gate_msa * RMSNorm(Attention(RMSNorm(x) * scale_msa)) */
    kiln_tensor n = norm_mod(f, x, &W->norm1, mod ? &mod->scale_msa : NULL);
    kiln_tensor P = tmp(f, S, 3 * D), o = tmp(f, S, D), a = tmp(f, S, D);
    kiln_be_linear(f->be, &P, &n, &W->qkv, NULL);
    attention(f, W, &P, lens, rope, &o);
    kiln_be_linear(f->be, &a, &o, &W->out, NULL);
    kiln_be_rms_norm(f->be, &a, &a, &W->norm2, eps);
    kiln_be_gated_add(f->be, x, mod ? &mod->gate_msa : NULL, &a);

    /* x += gate_mlp * RMSNorm(w2(SiLU(w1 h) * w3 h)), h = RMSNorm(x) * scale_mlp */
    n = norm_mod(f, x, &W->ffn_norm1, mod ? &mod->scale_mlp : NULL);
    kiln_tensor h = tmp(f, S, 2 * F), g = tmp(f, S, F);
    kiln_be_linear(f->be, &h, &n, &W->w13, NULL);
    kiln_be_swiglu(f->be, &g, &h);
    kiln_be_linear(f->be, &a, &g, &W->w2, NULL);
    kiln_be_rms_norm(f->be, &a, &a, &W->ffn_norm2, eps);
    kiln_be_gated_add(f->be, x, mod ? &mod->gate_mlp : NULL, &a);
}

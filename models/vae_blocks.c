#include "vae_blocks.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "models/weights.h"

/* --- loading ---------------------------------------------------------------- */

/* Conv weights are stored (cout, cin, k, k) and used channels-last,
 * (cout, k, k, cin): the stored tensor viewed as (cout, cin, k*k) and
 * transposed on the backend. */
static kiln_status to_channels_last(kiln_backend *be, kiln_tensor *w, kiln_err *err)
{
    int64_t cout = w->shape[0], cin = w->shape[1], kh = w->shape[2], kw = w->shape[3];
    kiln_tensor stored = *w, src;
    if (kh * kw == 1) {
        kiln_tensor_set_shape(w, w->dtype, 4, (int64_t[]){cout, kh, kw, cin});
        return KILN_OK;
    }
    if (kiln_be_alloc(be, w, stored.dtype, 4, (int64_t[]){cout, kh, kw, cin}) == KILN_OK) {
        kiln_tensor dst = *w;
        src = stored;
        kiln_tensor_set_shape(&src, src.dtype, 3, (int64_t[]){cout, cin, kh * kw});
        kiln_tensor_set_shape(&dst, dst.dtype, 3, (int64_t[]){cout, kh * kw, cin});
        kiln_be_transpose(be, &dst, &src);
    }
    kiln_be_free(be, &stored);
    if (kiln_be_check(be, err)) {
        kiln_be_free(be, w);
        return kiln_err_wrap(err, "vae: laying out a conv weight channels-last");
    }
    return KILN_OK;
}

kiln_status vae_conv_load(kiln_backend *be, const kiln_st *st, vae_conv *c, int64_t cout,
                          int64_t cin, int k, const char *prefix, kiln_err *err)
{
    if (kiln_weight_load(be, st, &c->w, 4, (int64_t[]){cout, cin, k, k}, err, "%s.weight",
                         prefix) ||
        to_channels_last(be, &c->w, err))
        return err->code;
    return kiln_weight_load(be, st, &c->b, 1, (int64_t[]){cout}, err, "%s.bias", prefix);
}

/* Keeps the first `rows` entries along dim 0 of a loaded weight: the full
 * tensor is viewed as (1, n, rest) and its leading rows copied into a
 * smaller one, so the stored tensor goes through kiln_weight_load's checks. */
static kiln_status keep_rows(kiln_backend *be, kiln_tensor *t, int64_t rows, kiln_err *err)
{
    kiln_tensor full = *t, part;
    int64_t rest = kiln_tensor_numel(t) / t->shape[0];
    int64_t shape[KILN_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = rows;
    if (kiln_be_alloc(be, &part, t->dtype, t->ndim, shape) == KILN_OK) {
        kiln_tensor src = full, dst = part;
        kiln_tensor_set_shape(&src, full.dtype, 3, (int64_t[]){1, full.shape[0], rest});
        kiln_tensor_set_shape(&dst, part.dtype, 3, (int64_t[]){1, rows, rest});
        kiln_be_copy_rows(be, &dst, 0, &src, 0, rows);
    }
    kiln_be_free(be, &full);
    *t = part;
    if (kiln_be_check(be, err)) {
        kiln_be_free(be, t);
        return kiln_err_wrap(err, "vae: slicing a weight");
    }
    return KILN_OK;
}

kiln_status vae_conv_load_rows(kiln_backend *be, const kiln_st *st, vae_conv *c, int64_t rows,
                               int64_t cout, int64_t cin, int k, const char *prefix,
                               kiln_err *err)
{
    if (vae_conv_load(be, st, c, cout, cin, k, prefix, err) ||
        keep_rows(be, &c->w, rows, err) || keep_rows(be, &c->b, rows, err))
        return err->code;
    return KILN_OK;
}

kiln_status vae_norm_load(kiln_backend *be, const kiln_st *st, vae_norm *n, int64_t c,
                          const char *prefix, kiln_err *err)
{
    if (kiln_weight_load(be, st, &n->w, 1, (int64_t[]){c}, err, "%s.weight", prefix))
        return err->code;
    return kiln_weight_load(be, st, &n->b, 1, (int64_t[]){c}, err, "%s.bias", prefix);
}

kiln_status vae_resnet_load(kiln_backend *be, const kiln_st *st, vae_resnet *r, int64_t cin,
                            int64_t cout, const char *prefix, kiln_err *err)
{
    char p[256];
#define SUB(name) (snprintf(p, sizeof p, "%s." name, prefix), p)
    if (vae_norm_load(be, st, &r->norm1, cin, SUB("norm1"), err) ||
        vae_conv_load(be, st, &r->conv1, cout, cin, 3, SUB("conv1"), err) ||
        vae_norm_load(be, st, &r->norm2, cout, SUB("norm2"), err) ||
        vae_conv_load(be, st, &r->conv2, cout, cout, 3, SUB("conv2"), err))
        return err->code;
    if (cin != cout)
        return vae_conv_load(be, st, &r->shortcut, cout, cin, 1, SUB("conv_shortcut"), err);
#undef SUB
    return KILN_OK;
}

static kiln_status linear_load(kiln_backend *be, const kiln_st *st, kiln_tensor *w,
                               kiln_tensor *b, int64_t c, const char *prefix, const char *name,
                               kiln_err *err)
{
    if (kiln_weight_load(be, st, w, 2, (int64_t[]){c, c}, err, "%s.%s.weight", prefix, name))
        return err->code;
    return kiln_weight_load(be, st, b, 1, (int64_t[]){c}, err, "%s.%s.bias", prefix, name);
}

kiln_status vae_mid_load(kiln_backend *be, const kiln_st *st, vae_mid *m, int64_t c, int attn,
                         const char *prefix, kiln_err *err)
{
    char p[256];
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s.resnets.%d", prefix, i);
        if (vae_resnet_load(be, st, &m->res[i], c, c, p, err))
            return err->code;
    }
    m->has_attn = attn;
    if (!attn)
        return KILN_OK;
    vae_attn *a = &m->attn;
    snprintf(p, sizeof p, "%s.attentions.0.group_norm", prefix);
    if (vae_norm_load(be, st, &a->norm, c, p, err))
        return err->code;
    snprintf(p, sizeof p, "%s.attentions.0", prefix);
    if (linear_load(be, st, &a->wq, &a->bq, c, p, "to_q", err) ||
        linear_load(be, st, &a->wk, &a->bk, c, p, "to_k", err) ||
        linear_load(be, st, &a->wv, &a->bv, c, p, "to_v", err) ||
        linear_load(be, st, &a->wo, &a->bo, c, p, "to_out.0", err))
        return err->code;
    return KILN_OK;
}

void vae_conv_free(kiln_backend *be, vae_conv *c)
{
    kiln_be_free(be, &c->w);
    kiln_be_free(be, &c->b);
}

void vae_norm_free(kiln_backend *be, vae_norm *n)
{
    kiln_be_free(be, &n->w);
    kiln_be_free(be, &n->b);
}

void vae_resnet_free(kiln_backend *be, vae_resnet *r)
{
    vae_norm_free(be, &r->norm1);
    vae_conv_free(be, &r->conv1);
    vae_norm_free(be, &r->norm2);
    vae_conv_free(be, &r->conv2);
    vae_conv_free(be, &r->shortcut);
}

void vae_mid_free(kiln_backend *be, vae_mid *m)
{
    for (int i = 0; i < 2; i++)
        vae_resnet_free(be, &m->res[i]);
    vae_attn *a = &m->attn;
    vae_norm_free(be, &a->norm);
    kiln_tensor *ts[] = {&a->wq, &a->bq, &a->wk, &a->bk, &a->wv, &a->bv, &a->wo, &a->bo};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        kiln_be_free(be, ts[i]);
}

/* --- forward ---------------------------------------------------------------- */

kiln_status vae_run_begin(vae_run *r)
{
    for (int s = 0; s < 3; s++)
        if (kiln_arena_tensor(r->arena, &r->slot[s], r->be->act_dtype, 1, (int64_t[]){r->cap}))
            return r->be->error.code;
    r->cur = 0;
    return KILN_OK;
}

/* Slot s viewed as the activation (B, H, W, C): channels last. */
static kiln_tensor slot_view(vae_run *r, int s, int64_t C, int64_t H, int64_t W)
{
    kiln_tensor t = r->slot[s];
    if (r->B * C * H * W > r->cap)
        kiln_be_fail(r->be, KILN_ERR_INTERNAL, "vae: activation of %lld elements exceeds the "
                     "%lld-element scratch slot", (long long)(r->B * C * H * W),
                     (long long)r->cap);
    kiln_tensor_set_shape(&t, t.dtype, 4, (int64_t[]){r->B, H, W, C});
    return t;
}

static kiln_tensor act(vae_run *r) { return slot_view(r, r->cur, r->C, r->H, r->W); }

void vae_run_tap(vae_run *r, const char *stage)
{
    if (!r->tap || !r->tap->fn || r->be->error.code)
        return;
    kiln_tensor t = act(r);
    r->tap->fn(r->tap->ctx, stage, &t);
}

void vae_run_load(vae_run *r, const kiln_tensor *x)
{
    r->B = x->shape[0];
    r->H = x->shape[1];
    r->W = x->shape[2];
    r->C = x->shape[3];
    kiln_tensor t = act(r);
    kiln_be_copy(r->be, &t, x);
}

void vae_run_store(vae_run *r, kiln_tensor *y)
{
    kiln_tensor t = act(r);
    kiln_be_copy(r->be, y, &t);
}

void vae_nchw_to_nhwc(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t B = x->shape[0], C = x->shape[1], HW = x->shape[2] * x->shape[3];
    kiln_tensor src = *x, dst = *y;
    kiln_tensor_set_shape(&src, src.dtype, 3, (int64_t[]){B, C, HW});
    kiln_tensor_set_shape(&dst, dst.dtype, 3, (int64_t[]){B, HW, C});
    kiln_be_transpose(be, &dst, &src);
}

void vae_nhwc_to_nchw(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t B = x->shape[0], HW = x->shape[1] * x->shape[2], C = x->shape[3];
    kiln_tensor src = *x, dst = *y;
    kiln_tensor_set_shape(&src, src.dtype, 3, (int64_t[]){B, HW, C});
    kiln_tensor_set_shape(&dst, dst.dtype, 3, (int64_t[]){B, C, HW});
    kiln_be_transpose(be, &dst, &src);
}

static int conv_pad(const vae_conv *c) { return (int)(c->w.shape[1] / 2); }

void vae_conv_from(vae_run *r, const vae_conv *c, const kiln_tensor *x)
{
    int p = conv_pad(c), s = (r->cur + 1) % 3;
    r->B = x->shape[0];
    r->H = x->shape[2];
    r->W = x->shape[3];
    kiln_tensor t = slot_view(r, s, x->shape[1], r->H, r->W);
    vae_nchw_to_nhwc(r->be, &t, x);
    r->C = c->w.shape[0];
    kiln_tensor y = act(r);
    kiln_be_conv2d(r->be, &y, &t, &c->w, &c->b, NULL, 1, (int[]){p, p, p, p});
}

void vae_conv_to(vae_run *r, const vae_conv *c, kiln_tensor *y)
{
    int p = conv_pad(c), s = (r->cur + 1) % 3;
    kiln_tensor x = act(r);
    kiln_tensor t = slot_view(r, s, c->w.shape[0], r->H, r->W);
    kiln_be_conv2d(r->be, &t, &x, &c->w, &c->b, NULL, 1, (int[]){p, p, p, p});
    vae_nhwc_to_nchw(r->be, y, &t);
}

void vae_conv_apply(vae_run *r, const vae_conv *c)
{
    int p = conv_pad(c), s = (r->cur + 1) % 3;
    kiln_tensor x = act(r);
    kiln_tensor y = slot_view(r, s, c->w.shape[0], r->H, r->W);
    kiln_be_conv2d(r->be, &y, &x, &c->w, &c->b, NULL, 1, (int[]){p, p, p, p});
    r->cur = s;
    r->C = c->w.shape[0];
}

void vae_norm_silu_apply(vae_run *r, const vae_norm *n)
{
    kiln_tensor x = act(r);
    kiln_be_group_norm(r->be, &x, &x, &n->w, &n->b, r->groups, VAE_GN_EPS, 1);
}

/* ResnetBlock2D (temb None, output_scale_factor 1):
 * out = shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x)))))), the sum taken
 * by conv2 as it writes (conv2d's residual).  Without a shortcut conv the
 * input stays in its slot and the result lands in slot a; with one, the
 * shortcut's output takes slot a (norm1's, read by conv1 already) and the
 * result the input's slot, which the shortcut has read. */
void vae_resnet_apply(vae_run *r, const vae_resnet *res)
{
    kiln_backend *be = r->be;
    static const int p1[4] = {1, 1, 1, 1}, p0[4] = {0, 0, 0, 0};
    int a = (r->cur + 1) % 3, b = (r->cur + 2) % 3;
    int64_t cin = r->C, cout = res->conv1.w.shape[0];
    kiln_tensor x = act(r);
    kiln_tensor ta = slot_view(r, a, cin, r->H, r->W);
    kiln_be_group_norm(be, &ta, &x, &res->norm1.w, &res->norm1.b, r->groups, VAE_GN_EPS, 1);
    kiln_tensor tb = slot_view(r, b, cout, r->H, r->W);
    kiln_be_conv2d(be, &tb, &ta, &res->conv1.w, &res->conv1.b, NULL, 1, p1);
    kiln_be_group_norm(be, &tb, &tb, &res->norm2.w, &res->norm2.b, r->groups, VAE_GN_EPS, 1);
    if (res->shortcut.w.data) {
        kiln_tensor sc = slot_view(r, a, cout, r->H, r->W);
        kiln_be_conv2d(be, &sc, &x, &res->shortcut.w, &res->shortcut.b, NULL, 1, p0);
        kiln_tensor h = slot_view(r, r->cur, cout, r->H, r->W);
        kiln_be_conv2d(be, &h, &tb, &res->conv2.w, &res->conv2.b, &sc, 1, p1);
    } else {
        kiln_tensor h = slot_view(r, a, cout, r->H, r->W);
        kiln_be_conv2d(be, &h, &tb, &res->conv2.w, &res->conv2.b, &x, 1, p1);
        r->cur = a;
    }
    r->C = cout;
}

/* diffusers Attention with AttnProcessor2_0, heads = 1, head dim = C,
 * residual_connection, rescale 1: x + to_out(softmax(q k^T / sqrt(C)) v) with
 * q, k, v projected from GroupNorm(x) laid out as (B, H*W, C) tokens, which
 * is the channels-last activation as it stands. */
static void attn_apply(vae_run *r, const vae_attn *at)
{
    kiln_backend *be = r->be;
    int64_t B = r->B, C = r->C, S = r->H * r->W;
    int a = (r->cur + 1) % 3;
    kiln_tensor x = act(r);
    kiln_tensor n = slot_view(r, a, C, r->H, r->W);
    kiln_be_group_norm(be, &n, &x, &at->norm.w, &at->norm.b, r->groups, VAE_GN_EPS, 0);

    kiln_tensor q, k, v, o;
    kiln_tensor *bufs[VAE_ATTN_BUFS] = {&q, &k, &v, &o};
    for (int i = 0; i < VAE_ATTN_BUFS; i++)
        if (kiln_arena_tensor(r->arena, bufs[i], be->act_dtype, 3, (int64_t[]){B, S, C}))
            return;
    kiln_tensor tok = n; /* (B, S, C) view of the normalised input */
    kiln_tensor_set_shape(&tok, n.dtype, 3, (int64_t[]){B, S, C});
    kiln_be_linear(be, &q, &tok, &at->wq, &at->bq);
    kiln_be_linear(be, &k, &tok, &at->wk, &at->bk);
    kiln_be_linear(be, &v, &tok, &at->wv, &at->bv);

    /* One head: view the tokens as (B, S, 1, C). */
    kiln_tensor q4 = q, k4 = k, v4 = v, o4 = o;
    int64_t shape4[4] = {B, S, 1, C};
    kiln_tensor_set_shape(&q4, q.dtype, 4, shape4);
    kiln_tensor_set_shape(&k4, k.dtype, 4, shape4);
    kiln_tensor_set_shape(&v4, v.dtype, 4, shape4);
    kiln_tensor_set_shape(&o4, o.dtype, 4, shape4);
    kiln_attn_opts opts = {.scale = 1.0f / sqrtf((float)C)};
    kiln_be_attention(be, &o4, &q4, &k4, &v4, &opts);

    kiln_be_linear(be, &tok, &o, &at->wo, &at->bo);
    kiln_be_add(be, &n, &n, &x);
    r->cur = a;
}

void vae_mid_apply(vae_run *r, const vae_mid *m)
{
    vae_resnet_apply(r, &m->res[0]);
    if (m->has_attn)
        attn_apply(r, &m->attn);
    vae_resnet_apply(r, &m->res[1]);
}

void vae_upsample_apply(vae_run *r, const vae_conv *c)
{
    int a = (r->cur + 1) % 3;
    kiln_tensor x = act(r);
    kiln_tensor u = slot_view(r, a, r->C, 2 * r->H, 2 * r->W);
    kiln_be_upsample_nearest2x(r->be, &u, &x);
    r->cur = a;
    r->H *= 2;
    r->W *= 2;
    vae_conv_apply(r, c);
}

void vae_downsample_apply(vae_run *r, const vae_conv *c)
{
    /* pad (0, 1, 0, 1) in F.pad's (left, right, top, bottom) order, then no
     * conv padding: Ho = (H + 1 - 3) / 2 + 1 = H / 2 for even H. */
    static const int pad[4] = {0, 0, 1, 1}; /* top, left, bottom, right */
    int s = (r->cur + 1) % 3;
    int64_t ho = (r->H + 1 - 3) / 2 + 1, wo = (r->W + 1 - 3) / 2 + 1;
    kiln_tensor x = act(r);
    kiln_tensor y = slot_view(r, s, c->w.shape[0], ho, wo);
    kiln_be_conv2d(r->be, &y, &x, &c->w, &c->b, NULL, 2, pad);
    r->cur = s;
    r->C = c->w.shape[0];
    r->H = ho;
    r->W = wo;
}

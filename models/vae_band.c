#include "vae_band.h"

#include <string.h>

/* Band buffers: a stage's input rows (with halo), a resnet's conv1 output,
 * a stage's output rows, a resnet's own input rows for its shortcut (when
 * its input is computed on the fly), a second output band for a resnet
 * that writes over its input (or, in one with a shortcut conv, that conv's
 * output).  An upsampled input borrows T_OUT and T_MID while it is
 * computed. */
enum { T_IN, T_MID, T_OUT, T_XS, T_OUT2, T_COUNT };
/* Statistics tensors: one per end of the region, one for a plane outside
 * it (the decoder's mid-block output), one for a resnet's inner norm, one
 * for an upsampler's output (never stored). */
enum { S_SIDE0, S_SIDE1, S_EXT, S_INNER, S_UP, S_COUNT };

/* A whole activation and the GroupNorm statistics of all of it. */
typedef struct plane {
    kiln_tensor t;      /* (B, H, W, C) */
    kiln_tensor *stats; /* (B, groups, 2) F32 */
    int in_region;
} plane;

/* One banded walk.  The same code runs twice: dry (shapes only, recording
 * how big every buffer must be) and then for real over buffers of exactly
 * those sizes. */
typedef struct band {
    kiln_backend *be;
    int dry;
    int groups;
    int64_t rows, full_h; /* band rows at full resolution, full-resolution height */
    kiln_dtype dt;
    size_t dsize;
    size_t region_bytes;  /* whole activations: the most two planes need at once */
    int64_t tmp_elems[T_COUNT];
    kiln_tensor region;   /* U8: planes alternate between its two ends */
    kiln_tensor tmp[T_COUNT];
    kiln_tensor stats[S_COUNT];
    int side;             /* end of the region the next plane goes to */
} band;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Band height at a stage of H rows: the configured rows scaled with the
 * resolution, so that every stage has about as many bands. */
static int64_t band_rows(const band *bd, int64_t H)
{
    return max64(1, bd->rows * H / bd->full_h);
}

/* Band buffer i viewed as the activation (B, H, W, C) (channels last, as
 * everywhere in the VAE); the dry run records its size. */
static kiln_tensor tmp(band *bd, int i, int64_t B, int64_t C, int64_t H, int64_t W)
{
    int64_t n = B * C * H * W;
    kiln_tensor t = bd->tmp[i];
    if (bd->dry)
        bd->tmp_elems[i] = max64(bd->tmp_elems[i], n);
    else if (n > kiln_tensor_numel(&bd->tmp[i]))
        kiln_be_fail(bd->be, KILN_ERR_INTERNAL, "vae: band buffer %d too small", i);
    kiln_tensor_set_shape(&t, bd->dt, 4, (int64_t[]){B, H, W, C});
    return t;
}

/* The next whole activation, at the end of the region that the stage's
 * input `in` does not occupy. */
static void plane_new(band *bd, plane *p, const plane *in, int64_t B, int64_t C, int64_t H,
                      int64_t W)
{
    size_t bytes = vae_align_bytes(B * C * H * W, bd->dsize);
    *p = (plane){.t = bd->region, .stats = &bd->stats[bd->side], .in_region = 1};
    kiln_tensor_set_shape(&p->t, bd->dt, 4, (int64_t[]){B, H, W, C});
    if (bd->dry) {
        size_t in_bytes = in && in->in_region ?
                          vae_align_bytes(kiln_tensor_numel(&in->t), bd->dsize) : 0;
        if (bytes + in_bytes > bd->region_bytes)
            bd->region_bytes = bytes + in_bytes;
    } else if (bytes > bd->region_bytes) {
        kiln_be_fail(bd->be, KILN_ERR_INTERNAL, "vae: band region too small");
    } else {
        p->t.data = (char *)bd->region.data + (bd->side ? bd->region_bytes - bytes : 0);
    }
    bd->side ^= 1;
}

/* (B, H, W*C) view of an activation, the layout copy_rows moves rows in. */
static kiln_tensor rows3(const kiln_tensor *t)
{
    kiln_tensor v = *t;
    kiln_tensor_set_shape(&v, t->dtype, 3,
                          (int64_t[]){t->shape[0], t->shape[1], t->shape[2] * t->shape[3]});
    return v;
}

/* (B*C, H, W) view of an image outside the pass, (B, C, H, W). */
static kiln_tensor planes3(const kiln_tensor *t)
{
    kiln_tensor v = *t;
    kiln_tensor_set_shape(&v, t->dtype, 3,
                          (int64_t[]){t->shape[0] * t->shape[1], t->shape[2], t->shape[3]});
    return v;
}

/* dst's rows from rows [r0, ...) of src. */
static void rows_in(band *bd, kiln_tensor *dst, const kiln_tensor *src, int64_t r0)
{
    if (bd->dry)
        return;
    kiln_tensor d = rows3(dst), s = rows3(src);
    kiln_be_copy_rows(bd->be, &d, 0, &s, r0, dst->shape[1]);
}

/* Rows [s0, s0 + n) of src into rows [r0, r0 + n) of dst. */
static void rows_out(band *bd, kiln_tensor *dst, int64_t r0, const kiln_tensor *src, int64_t s0,
                     int64_t n)
{
    if (bd->dry)
        return;
    kiln_tensor d = rows3(dst), s = rows3(src);
    kiln_be_copy_rows(bd->be, &d, r0, &s, s0, n);
}

/* Measures a plane's statistics over all of it. */
static void measure(band *bd, plane *p)
{
    if (!bd->dry)
        kiln_be_group_norm_stats(bd->be, p->stats, &p->t, bd->groups, 0);
}

/* GroupNorm + SiLU in place on a band, with statistics over `count`
 * elements per group (the whole activation the band belongs to). */
static void norm(band *bd, kiln_tensor *x, const vae_norm *n, const kiln_tensor *stats,
                 int64_t count)
{
    if (!bd->dry)
        kiln_be_group_norm_apply(bd->be, x, x, &n->w, &n->b, stats, count, bd->groups,
                                 VAE_GN_EPS, 1);
}

static int64_t plane_count(const band *bd, const plane *p)
{
    return p->t.shape[3] / bd->groups * p->t.shape[1] * p->t.shape[2];
}

/* Stride-1 convolution (3x3 with padding 1, or 1x1) giving output rows
 * [o0, o1) of an H-row image into y, from x holding input rows
 * [in_lo(o0), in_hi(o1)): zero padding only at the image's own edges, so
 * the rows are exactly the whole image's. */
static int conv_k(const vae_conv *c) { return (int)(c->w.shape[1] / 2); }
static int64_t in_lo(int64_t o0, int k) { return max64(o0 - k, 0); }
static int64_t in_hi(int64_t o1, int k, int64_t H) { return min64(o1 + k, H); }

static void conv_res(band *bd, kiln_tensor *y, const kiln_tensor *x, const vae_conv *c,
                     int64_t o0, int64_t o1, int64_t H, const kiln_tensor *residual)
{
    if (bd->dry)
        return;
    int k = conv_k(c);
    int top = o0 - k < 0 ? k : 0, bottom = o1 + k > H ? k : 0;
    kiln_be_conv2d(bd->be, y, x, &c->w, &c->b, residual, 1, (int[]){top, k, bottom, k});
}

static void conv_out(band *bd, kiln_tensor *y, const kiln_tensor *x, const vae_conv *c,
                     int64_t o0, int64_t o1, int64_t H)
{
    conv_res(bd, y, x, c, o0, o1, H, NULL);
}

/* A stage's input: a stored plane, or an upsampler (Upsample2D: nearest
 * 2x, then its 3x3 conv) applied on the fly to a stored plane of half the
 * height and width.  The last upsampler's output is the decoder's widest
 * activation (full resolution, 256 channels: 2 GiB for one 2048x2048
 * image), so it is never stored: the first full-resolution resnet
 * recomputes the rows it needs, once for its statistics and once per pass
 * (about 25% more decoder work than storing it). */
typedef struct source {
    const plane *p;
    const vae_conv *up; /* NULL: the input is p itself */
    const kiln_tensor *stats;
    int64_t B, C, H, W, count; /* the input's shape, elements per group */
} source;

static source stored(const band *bd, const plane *p)
{
    const int64_t *sh = p->t.shape;
    return (source){.p = p, .stats = p->stats, .B = sh[0], .C = sh[3], .H = sh[1], .W = sh[2],
                    .count = sh[3] / bd->groups * sh[1] * sh[2]};
}

static source upsampled(const band *bd, const plane *p, const vae_conv *up)
{
    const int64_t *sh = p->t.shape;
    source s = {.p = p, .up = up, .B = sh[0], .C = up->w.shape[0], .H = 2 * sh[1],
                .W = 2 * sh[2]};
    s.count = s.C / bd->groups * s.H * s.W;
    return s;
}

/* Rows [a0, a1) of the source into dst (B, a1 - a0, W, C). */
static void source_rows(band *bd, const source *s, kiln_tensor *dst, int64_t a0, int64_t a1)
{
    if (!s->up) {
        rows_in(bd, dst, &s->p->t, a0);
        return;
    }
    /* The conv reads upsampled rows [u0, u1); nearest 2x makes them in
     * pairs from rows [c0, c1) of the stored plane. */
    int64_t u0 = in_lo(a0, 1), u1 = in_hi(a1, 1, s->H), c0 = u0 / 2, c1 = (u1 + 1) / 2;
    int64_t B = s->B, Cu = s->p->t.shape[3], w = s->p->t.shape[2];
    kiln_tensor half = tmp(bd, T_OUT, B, Cu, c1 - c0, w);
    rows_in(bd, &half, &s->p->t, c0);
    kiln_tensor up = tmp(bd, T_MID, B, Cu, 2 * (c1 - c0), s->W);
    if (!bd->dry)
        kiln_be_upsample_nearest2x(bd->be, &up, &half);
    kiln_tensor win = up;
    if (2 * c0 != u0 || 2 * c1 != u1) { /* a row too many at an end */
        win = tmp(bd, T_OUT, B, Cu, u1 - u0, s->W);
        if (!bd->dry) {
            kiln_tensor d = rows3(&win), src = rows3(&up);
            kiln_be_copy_rows(bd->be, &d, 0, &src, u0 - 2 * c0, u1 - u0);
        }
    }
    conv_out(bd, dst, &win, s->up, a0, a1, s->H);
}

/* An upsampled source's statistics, band by band. */
static void measure_source(band *bd, source *s)
{
    int64_t R = band_rows(bd, s->H), cpg = s->C / bd->groups;
    s->stats = &bd->stats[S_UP];
    for (int64_t r0 = 0; r0 < s->H; r0 += R) {
        int64_t r1 = min64(r0 + R, s->H);
        kiln_tensor t = tmp(bd, T_IN, s->B, s->C, r1 - r0, s->W);
        source_rows(bd, s, &t, r0, r1);
        if (!bd->dry)
            kiln_be_group_norm_stats(bd->be, &bd->stats[S_UP], &t, bd->groups, cpg * r0 * s->W);
    }
}

/* Upsample2D (vae_upsample_apply) stored whole, band by band. */
static void up_stage(band *bd, const plane *x, plane *y, const vae_conv *c)
{
    source s = upsampled(bd, x, c);
    int64_t R = band_rows(bd, s.H);
    plane_new(bd, y, x, s.B, s.C, s.H, s.W);
    for (int64_t r0 = 0; r0 < s.H; r0 += R) {
        int64_t r1 = min64(r0 + R, s.H);
        kiln_tensor t = tmp(bd, T_IN, s.B, s.C, r1 - r0, s.W);
        source_rows(bd, &s, &t, r0, r1);
        rows_out(bd, &y->t, r0, &t, 0, r1 - r0);
    }
    measure(bd, y);
}

/* ResnetBlock2D (vae_resnet_apply) over bands.  Pass A computes conv1 of
 * each band (input rows with a halo of one) for norm2's statistics; pass B
 * recomputes conv1 over the band plus one row each side (input halo two),
 * then norm2, conv2 and the shortcut give exactly the band's output rows.
 * A block that keeps the channel count writes its output over its stored
 * input: a band's output rows are written once the next band has read its
 * input (the two halo rows above it included), so the stage needs one
 * whole activation instead of two. */
static void res_stage(band *bd, const source *x, plane *y, const vae_resnet *res)
{
    int64_t B = x->B, cin = x->C, H = x->H, W = x->W;
    int64_t cout = res->conv1.w.shape[0], R = band_rows(bd, H);
    int64_t inner = cout / bd->groups * H * W;
    kiln_tensor *s1 = &bd->stats[S_INNER];
    int inplace = !x->up && x->p->in_region && cin == cout && R >= 2;
    if (inplace)
        *y = *x->p;
    else
        plane_new(bd, y, x->p, B, cout, H, W);
    kiln_tensor pending = {0};
    int64_t pending_r0 = 0, k = 0;
    for (int64_t r0 = 0; r0 < H; r0 += R) {
        int64_t r1 = min64(r0 + R, H), a0 = in_lo(r0, 1), a1 = in_hi(r1, 1, H);
        kiln_tensor t0 = tmp(bd, T_IN, B, cin, a1 - a0, W);
        source_rows(bd, x, &t0, a0, a1);
        norm(bd, &t0, &res->norm1, x->stats, x->count);
        kiln_tensor t1 = tmp(bd, T_MID, B, cout, r1 - r0, W);
        conv_out(bd, &t1, &t0, &res->conv1, r0, r1, H);
        if (!bd->dry)
            kiln_be_group_norm_stats(bd->be, s1, &t1, bd->groups, cout / bd->groups * r0 * W);
    }
    for (int64_t r0 = 0; r0 < H; r0 += R, k++) {
        int64_t r1 = min64(r0 + R, H), n = r1 - r0;
        int64_t b0 = in_lo(r0, 1), b1 = in_hi(r1, 1, H), a0 = in_lo(b0, 1), a1 = in_hi(b1, 1, H);
        kiln_tensor t0 = tmp(bd, T_IN, B, cin, a1 - a0, W);
        source_rows(bd, x, &t0, a0, a1);
        /* The shortcut reads the band's own input rows, unnormalised: from
         * the plane, or kept aside before norm1 when computed here. */
        kiln_tensor xs = tmp(bd, x->up ? T_XS : T_IN, B, cin, n, W);
        if (x->up && !bd->dry) {
            kiln_tensor d = rows3(&xs), src = rows3(&t0);
            kiln_be_copy_rows(bd->be, &d, 0, &src, r0 - a0, n);
        }
        norm(bd, &t0, &res->norm1, x->stats, x->count);
        kiln_tensor t1 = tmp(bd, T_MID, B, cout, b1 - b0, W);
        conv_out(bd, &t1, &t0, &res->conv1, b0, b1, H);
        norm(bd, &t1, &res->norm2, s1, inner);
        /* The residual joins conv2's output as it is written: the band's
         * own input rows (read into T_IN, whose window conv1 has used), or
         * the shortcut conv's output in T_OUT2, free since a block with a
         * shortcut changes the channel count and so never runs in place. */
        if (!x->up)
            rows_in(bd, &xs, &x->p->t, r0);
        kiln_tensor residual = xs;
        if (res->shortcut.w.data) {
            residual = tmp(bd, T_OUT2, B, cout, n, W);
            conv_out(bd, &residual, &xs, &res->shortcut, r0, r1, H);
        }
        kiln_tensor out = tmp(bd, inplace && k % 2 ? T_OUT2 : T_OUT, B, cout, n, W);
        conv_res(bd, &out, &t1, &res->conv2, r0, r1, H, &residual);
        if (!inplace) {
            rows_out(bd, &y->t, r0, &out, 0, n);
            continue;
        }
        /* This band has read its input: the previous band's rows may go. */
        if (k > 0)
            rows_out(bd, &y->t, pending_r0, &pending, 0, pending.shape[1]);
        pending = out;
        pending_r0 = r0;
    }
    if (inplace)
        rows_out(bd, &y->t, pending_r0, &pending, 0, pending.shape[1]);
    measure(bd, y);
}

/* Downsample2D (vae_downsample_apply): output row o reads input rows 2o to
 * 2o + 2, the last one below the image being the zero padding. */
static void down_stage(band *bd, const plane *x, plane *y, const vae_conv *c)
{
    int64_t B = x->t.shape[0], H = x->t.shape[1], W = x->t.shape[2], C = x->t.shape[3];
    int64_t Ho = (H + 1 - 3) / 2 + 1, Wo = (W + 1 - 3) / 2 + 1, cout = c->w.shape[0];
    int64_t R = band_rows(bd, Ho);
    plane_new(bd, y, x, B, cout, Ho, Wo);
    for (int64_t o0 = 0; o0 < Ho; o0 += R) {
        int64_t o1 = min64(o0 + R, Ho), i0 = 2 * o0, i1 = min64(2 * o1 + 1, H);
        int bottom = 2 * o1 + 1 > H;
        kiln_tensor t0 = tmp(bd, T_IN, B, C, i1 - i0, W);
        rows_in(bd, &t0, &x->t, i0);
        kiln_tensor out = tmp(bd, T_OUT, B, cout, o1 - o0, Wo);
        if (!bd->dry)
            kiln_be_conv2d(bd->be, &out, &t0, &c->w, &c->b, NULL, 2, (int[]){0, 0, bottom, 1});
        rows_out(bd, &y->t, o0, &out, 0, o1 - o0);
    }
    measure(bd, y);
}

/* The encoder's conv_in, from the input image (B, C, H, W): each band's
 * rows are taken as planes and laid out channels-last. */
static void in_stage(band *bd, const kiln_tensor *img, const vae_conv *c, plane *y)
{
    int64_t B = img->shape[0], C = img->shape[1], H = img->shape[2], W = img->shape[3];
    int64_t cout = c->w.shape[0], R = band_rows(bd, H);
    plane_new(bd, y, NULL, B, cout, H, W);
    for (int64_t r0 = 0; r0 < H; r0 += R) {
        int64_t r1 = min64(r0 + R, H), a0 = in_lo(r0, 1), a1 = in_hi(r1, 1, H);
        kiln_tensor t0 = tmp(bd, T_IN, B, C, a1 - a0, W);
        kiln_tensor pl = tmp(bd, T_MID, B, C, a1 - a0, W);
        kiln_tensor_set_shape(&pl, pl.dtype, 4, (int64_t[]){B, C, a1 - a0, W});
        if (!bd->dry) {
            kiln_tensor d = planes3(&pl), s = planes3(img);
            kiln_be_copy_rows(bd->be, &d, 0, &s, a0, a1 - a0);
            vae_nchw_to_nhwc(bd->be, &t0, &pl);
        }
        kiln_tensor out = tmp(bd, T_OUT, B, cout, r1 - r0, W);
        conv_out(bd, &out, &t0, c, r0, r1, H);
        rows_out(bd, &y->t, r0, &out, 0, r1 - r0);
    }
    measure(bd, y);
}

/* The decoder's conv_norm_out + SiLU + conv_out, into the output image
 * (B, C, H, W): each band's rows are laid out as planes and put in place. */
static void out_stage(band *bd, const plane *x, const vae_norm *n, const vae_conv *c,
                      kiln_tensor *img)
{
    int64_t B = x->t.shape[0], H = x->t.shape[1], W = x->t.shape[2], C = x->t.shape[3];
    int64_t cout = c->w.shape[0], R = band_rows(bd, H);
    for (int64_t r0 = 0; r0 < H; r0 += R) {
        int64_t r1 = min64(r0 + R, H), a0 = in_lo(r0, 1), a1 = in_hi(r1, 1, H);
        kiln_tensor t0 = tmp(bd, T_IN, B, C, a1 - a0, W);
        rows_in(bd, &t0, &x->t, a0);
        norm(bd, &t0, n, x->stats, plane_count(bd, x));
        kiln_tensor out = tmp(bd, T_OUT, B, cout, r1 - r0, W);
        conv_out(bd, &out, &t0, c, r0, r1, H);
        kiln_tensor pl = tmp(bd, T_MID, B, cout, r1 - r0, W);
        kiln_tensor_set_shape(&pl, pl.dtype, 4, (int64_t[]){B, cout, r1 - r0, W});
        if (!bd->dry) {
            vae_nhwc_to_nchw(bd->be, &pl, &out);
            kiln_tensor d = planes3(img), s = planes3(&pl);
            kiln_be_copy_rows(bd->be, &d, r0, &s, 0, r1 - r0);
        }
    }
}

/* --- decoder -------------------------------------------------------------- */

/* The up blocks and the output, from the mid block's output m. */
static void decode_walk(band *bd, const vae_coder *d, int nblocks, const plane *m,
                        kiln_tensor *img)
{
    plane cur = *m, next;
    const vae_conv *up = NULL; /* an upsampler left to the next resnet */
    for (int i = 0; i < nblocks; i++) {
        const vae_block *b = &d->blocks[i];
        for (int j = 0; j < b->nres; j++, cur = next, up = NULL) {
            source x = stored(bd, &cur);
            if (up) {
                x = upsampled(bd, &cur, up);
                measure_source(bd, &x);
            }
            res_stage(bd, &x, &next, &b->res[j]);
        }
        if (b->has_sampler && i + 2 == nblocks) {
            up = &b->sampler; /* into the full-resolution block: never stored */
        } else if (b->has_sampler) {
            up_stage(bd, &cur, &next, &b->sampler);
            cur = next;
        }
    }
    out_stage(bd, &cur, &d->norm_out, &d->conv_out, img);
}

typedef struct layout {
    size_t head;  /* kept across the pass: the mid-block output, statistics */
    size_t whole; /* the whole-image part at latent resolution (slots, attention) */
    size_t bands; /* the region and the band buffers */
    int64_t slot; /* elements per slot of the whole-image part */
} layout;

static size_t stats_bytes(const vae_config *c, int64_t B)
{
    return S_COUNT * vae_align_bytes(B * c->groups * 2, sizeof(float));
}

static size_t bands_bytes(const band *bd)
{
    size_t total = bd->region_bytes;
    for (int i = 0; i < T_COUNT; i++)
        total += vae_align_bytes(max64(bd->tmp_elems[i], 1), bd->dsize);
    return total;
}

/* Slots (and the attention's token buffers) of a whole pass at latent
 * h x w whose widest activation has `ch` channels. */
static size_t whole_bytes(const vae_config *c, size_t dsize, int64_t B, int64_t ch, int64_t h,
                          int64_t w)
{
    int64_t top = c->channels[c->nblocks - 1];
    size_t total = 3 * vae_align_bytes(B * ch * h * w, dsize);
    if (c->mid_attn)
        total += VAE_ATTN_BUFS * vae_align_bytes(B * top * h * w, dsize);
    return total;
}

static layout decode_layout(band *bd, const vae_config *c, const vae_coder *d, int64_t B,
                            int64_t h, int64_t w, kiln_tensor *img)
{
    int64_t top = c->channels[c->nblocks - 1];
    /* The latent itself passes through a slot on its way channels-last. */
    layout l = {.slot = B * max64(c->latent, top) * h * w};
    plane m = {.in_region = 0};
    kiln_tensor_set_shape(&m.t, bd->dt, 4, (int64_t[]){B, h, w, top});
    bd->dry = 1;
    decode_walk(bd, d, c->nblocks, &m, img);
    l.head = vae_align_bytes(B * top * h * w, bd->dsize) + stats_bytes(c, B);
    l.whole = whole_bytes(c, bd->dsize, B, l.slot / (B * h * w), h, w);
    l.bands = bands_bytes(bd);
    return l;
}

static band band_init(kiln_backend *be, const vae_config *c, size_t dsize, int64_t rows,
                      int64_t full_h)
{
    return (band){.be = be, .groups = c->groups, .rows = rows, .full_h = full_h,
                  .dt = be ? be->act_dtype : KILN_F32, .dsize = dsize};
}

size_t vae_band_decode_bytes(const vae_config *c, const vae_coder *d, size_t dsize, int64_t B,
                             int64_t h, int64_t w, int64_t rows)
{
    int64_t f = (int64_t)1 << (c->nblocks - 1);
    band bd = band_init(NULL, c, dsize, rows, h * f);
    kiln_tensor img = {0};
    kiln_tensor_set_shape(&img, KILN_F32, 4, (int64_t[]){B, c->out_channels, h * f, w * f});
    layout l = decode_layout(&bd, c, d, B, h, w, &img);
    return l.head + (l.whole > l.bands ? l.whole : l.bands);
}

/* Takes the statistics tensors, the band buffers and the region. */
static kiln_status take_bands(band *bd, kiln_arena *arena, int64_t B)
{
    for (int i = 0; i < S_COUNT; i++)
        if (kiln_arena_tensor(arena, &bd->stats[i], KILN_F32, 3, (int64_t[]){B, bd->groups, 2}))
            return KILN_ERR_NOMEM;
    for (int i = 0; i < T_COUNT; i++)
        if (kiln_arena_tensor(arena, &bd->tmp[i], bd->dt, 1,
                              (int64_t[]){max64(bd->tmp_elems[i], 1)}))
            return KILN_ERR_NOMEM;
    return kiln_arena_tensor(arena, &bd->region, KILN_U8, 1,
                             (int64_t[]){(int64_t)bd->region_bytes});
}

kiln_status vae_band_decode(kiln_backend *be, kiln_arena *arena, const vae_config *c,
                            const vae_coder *d, int64_t rows, const kiln_tensor *z,
                            kiln_tensor *img, kiln_err *err)
{
    int64_t B = z->shape[0], h = z->shape[2], w = z->shape[3];
    int64_t top = c->channels[c->nblocks - 1];
    band bd = band_init(be, c, kiln_dtype_size(be->act_dtype), rows, img->shape[2]);
    layout l = decode_layout(&bd, c, d, B, h, w, img);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "vae: backend error before the pass");
    kiln_arena_reset(arena);
    plane m = {.in_region = 0};
    if (kiln_arena_reserve(arena, l.head + (l.whole > l.bands ? l.whole : l.bands)) ||
        kiln_arena_tensor(arena, &m.t, be->act_dtype, 4, (int64_t[]){B, h, w, top})) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "vae: scratch memory");
    }
    /* Latent resolution, whole: post_quant_conv, conv_in and the mid block
     * (vae.c's decode_pass up to its "mid_block" tap), in slots that the
     * bands then reuse. */
    size_t mark = kiln_arena_mark(arena);
    vae_run r = {.be = be, .arena = arena, .groups = c->groups, .cap = l.slot};
    if (!vae_run_begin(&r)) {
        if (c->post_quant) {
            vae_conv_from(&r, &d->quant, z);
            vae_conv_apply(&r, &d->conv_in);
        } else {
            vae_conv_from(&r, &d->conv_in, z);
        }
        vae_mid_apply(&r, &d->mid);
        vae_run_store(&r, &m.t);
    }
    kiln_arena_rewind(arena, mark);
    bd.side = 0;
    bd.dry = 0;
    if (take_bands(&bd, arena, B)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "vae: scratch memory");
    }
    m.stats = &bd.stats[S_EXT];
    measure(&bd, &m);
    decode_walk(&bd, d, c->nblocks, &m, img);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "vae banded decode");
    return KILN_OK;
}

/* --- encoder -------------------------------------------------------------- */

/* conv_in and the down blocks; *last is the input of the mid block. */
static void encode_walk(band *bd, const vae_coder *e, int nblocks, const kiln_tensor *img,
                        plane *last)
{
    plane cur, next;
    in_stage(bd, img, &e->conv_in, &cur);
    for (int i = 0; i < nblocks; i++) {
        const vae_block *b = &e->blocks[i];
        for (int j = 0; j < b->nres; j++, cur = next) {
            source x = stored(bd, &cur);
            res_stage(bd, &x, &next, &b->res[j]);
        }
        if (b->has_sampler) {
            down_stage(bd, &cur, &next, &b->sampler);
            cur = next;
        }
    }
    *last = cur;
}

static layout encode_layout(band *bd, const vae_config *c, const vae_coder *e,
                            const kiln_tensor *img, plane *last)
{
    int64_t B = img->shape[0], f = (int64_t)1 << (c->nblocks - 1);
    int64_t h = img->shape[2] / f, w = img->shape[3] / f, top = c->channels[c->nblocks - 1];
    layout l = {.slot = B * max64(top, c->quant ? 2 * c->latent : c->latent) * h * w};
    bd->dry = 1;
    encode_walk(bd, e, c->nblocks, img, last);
    l.head = stats_bytes(c, B);
    l.bands = bands_bytes(bd);
    l.whole = whole_bytes(c, bd->dsize, B, l.slot / (B * h * w), h, w);
    return l;
}

size_t vae_band_encode_bytes(const vae_config *c, const vae_coder *e, size_t dsize, int64_t B,
                             int64_t H, int64_t W, int64_t rows)
{
    band bd = band_init(NULL, c, dsize, rows, H);
    kiln_tensor img = {0};
    kiln_tensor_set_shape(&img, KILN_F32, 4, (int64_t[]){B, c->in_channels, H, W});
    plane last;
    layout l = encode_layout(&bd, c, e, &img, &last);
    return l.head + l.bands + l.whole;
}

kiln_status vae_band_encode(kiln_backend *be, kiln_arena *arena, const vae_config *c,
                            const vae_coder *e, int64_t rows, const kiln_tensor *img,
                            kiln_tensor *mean, kiln_err *err)
{
    int64_t B = img->shape[0];
    band bd = band_init(be, c, kiln_dtype_size(be->act_dtype), rows, img->shape[2]);
    plane last;
    layout l = encode_layout(&bd, c, e, img, &last);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "vae: backend error before the pass");
    kiln_arena_reset(arena);
    if (kiln_arena_reserve(arena, l.head + l.bands + l.whole) || take_bands(&bd, arena, B)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "vae: scratch memory");
    }
    bd.side = 0;
    bd.dry = 0;
    encode_walk(&bd, e, c->nblocks, img, &last);
    /* 1/8 resolution, whole: the mid block and the output convs
     * (kiln_vae_encode's tail). */
    vae_run r = {.be = be, .arena = arena, .groups = c->groups, .cap = l.slot};
    if (!vae_run_begin(&r)) {
        vae_run_load(&r, &last.t);
        vae_mid_apply(&r, &e->mid);
        vae_norm_silu_apply(&r, &e->norm_out);
        if (c->quant) {
            vae_conv_apply(&r, &e->conv_out);
            vae_conv_to(&r, &e->quant, mean);
        } else {
            vae_conv_to(&r, &e->conv_out, mean);
        }
    }
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "vae banded encode");
    return KILN_OK;
}

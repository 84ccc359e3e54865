#include "vae_tiled.h"

#include <stdlib.h>
#include <string.h>

#include "vae_blocks.h"

kiln_status vae_tiling_init(vae_tiling *t, int64_t sample, int64_t f, kiln_err *err)
{
    /* diffusers: tile_latent_min_size = int(sample_size / 2^(n-1)),
     * overlap_size = int(tile * 0.75), blend_extent = int(sample * 0.25),
     * row_limit = sample - blend_extent (all exact in integers). */
    t->tile = f > 0 ? sample / f : 0;
    t->step = t->tile * 3 / 4;
    t->blend = sample / 4;
    t->limit = sample - t->blend;
    if (sample < 1 || t->step < 1 || t->blend < 1 || t->step * f != t->limit)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "vae: sample_size %lld does not tile "
                            "the output exactly (kept tiles of %lld pixels, step %lld latents)",
                            (long long)sample, (long long)t->limit, (long long)t->step);
    return KILN_OK;
}

int vae_tiling_applies(const vae_tiling *t, int64_t h, int64_t w)
{
    return h > t->tile || w > t->tile;
}

/* Buffers of one tiled decode, sized for the largest tile. */
enum { B_ZROWS, B_ZTILE, B_SLAB0, B_SLAB1, B_SLAB2, B_SLAB3, B_GATE, B_CROP, B_BAND, B_COUNT };

typedef struct plan {
    int64_t nc;              /* tiles per row */
    int64_t elems[B_COUNT];
    int64_t tile_elems;      /* each of 2 * nc decoded tiles */
} plan;

static void make_plan(const vae_tiling *t, int64_t f, int64_t B, int64_t zc, int64_t oc,
                      int64_t h, int64_t w, plan *p)
{
    int64_t T = t->tile < h ? t->tile : h, P = B * oc, tf = t->tile * f;
    p->nc = (w + t->step - 1) / t->step;
    p->elems[B_ZROWS] = B * zc * T * w;
    p->elems[B_ZTILE] = B * zc * t->tile * t->tile;
    for (int i = B_SLAB0; i <= B_SLAB3; i++)
        p->elems[i] = P * t->blend * tf;
    p->elems[B_GATE] = t->blend;
    p->elems[B_CROP] = P * t->limit * tf;
    p->elems[B_BAND] = P * t->limit * w * f;
    p->tile_elems = P * tf * tf;
}

size_t vae_tiled_bytes(const vae_tiling *t, int64_t f, int64_t B, int64_t zc, int64_t oc,
                       int64_t h, int64_t w, size_t dsize)
{
    plan p;
    make_plan(t, f, B, zc, oc, h, w, &p);
    size_t total = 2 * (size_t)p.nc * vae_align_bytes(p.tile_elems, dsize);
    for (int i = 0; i < B_COUNT; i++)
        total += vae_align_bytes(p.elems[i], dsize);
    return total;
}

typedef struct tiler {
    kiln_backend *be;
    int64_t blend;
    kiln_tensor buf[B_COUNT];
    float *gate_host; /* blend weights x / e, uploaded per blend */
} tiler;

/* buf viewed with a shape that must fit in it. */
static kiln_tensor view(kiln_backend *be, const kiln_tensor *buf, int nd, const int64_t *shape)
{
    kiln_tensor t = *buf;
    kiln_tensor_set_shape(&t, buf->dtype, nd, shape);
    if (kiln_tensor_numel(&t) > kiln_tensor_numel(buf))
        kiln_be_fail(be, KILN_ERR_INTERNAL, "vae: tile buffer too small");
    return t;
}

#define V2(buf, a, b) view(tl->be, (buf), 2, (int64_t[]){(a), (b)})
#define V3(buf, a, b, c) view(tl->be, (buf), 3, (int64_t[]){(a), (b), (c)})

/* Uploads the weights t_x = x / e of one blend as a (1, e) gate. */
static kiln_tensor gate(tiler *tl, int64_t e)
{
    for (int64_t x = 0; x < e; x++)
        tl->gate_host[x] = (float)((double)x / (double)e);
    kiln_tensor g = V2(&tl->buf[B_GATE], 1, e);
    kiln_be_upload(tl->be, &g, tl->gate_host, KILN_F32);
    return g;
}

/* diffusers blend_h: b[..., x] = lerp(a[..., Wa - e + x], b[..., x], x / e)
 * for x < e = min(Wa, Wb, blend); a (P, H, Wa), b (P, H, Wb). */
static void blend_h(tiler *tl, const kiln_tensor *a, kiln_tensor *b)
{
    kiln_backend *be = tl->be;
    int64_t rows = a->shape[0] * a->shape[1], wa = a->shape[2], wb = b->shape[2];
    int64_t e = wa < wb ? wa : wb;
    e = e < tl->blend ? e : tl->blend;
    kiln_tensor as = V3(&tl->buf[B_SLAB0], 1, rows, e), bs = V3(&tl->buf[B_SLAB1], 1, rows, e);
    kiln_tensor a2 = V2(a, rows, wa), b2 = V2(b, rows, wb);
    kiln_be_copy_cols(be, &as, 0, &a2, wa - e, e);
    kiln_be_copy_cols(be, &bs, 0, &b2, 0, e);
    kiln_be_euler_step(be, &bs, &as, -1.0f); /* b - a */
    kiln_tensor g = gate(tl, e);
    kiln_be_gated_add(be, &as, &g, &bs);     /* a + t (b - a) */
    kiln_be_copy_cols(be, &b2, 0, &as, 0, e);
}

/* diffusers blend_v: b[:, :, y] = lerp(a[:, :, Ha - e + y], b[:, :, y], y / e)
 * for y < e = min(Ha, Hb, blend); a (P, Ha, W), b (P, Hb, W).  The weight
 * varies along rows, so the slabs are transposed to put it on the last
 * axis, where gated_add applies a per-column gate. */
static void blend_v(tiler *tl, const kiln_tensor *a, kiln_tensor *b)
{
    kiln_backend *be = tl->be;
    int64_t P = a->shape[0], ha = a->shape[1], hb = b->shape[1], W = a->shape[2];
    int64_t e = ha < hb ? ha : hb;
    e = e < tl->blend ? e : tl->blend;
    kiln_tensor as = V3(&tl->buf[B_SLAB0], P, e, W), bs = V3(&tl->buf[B_SLAB1], P, e, W);
    kiln_tensor at = V3(&tl->buf[B_SLAB2], P, W, e), dt = V3(&tl->buf[B_SLAB3], P, W, e);
    kiln_be_copy_rows(be, &as, 0, a, ha - e, e);
    kiln_be_copy_rows(be, &bs, 0, b, 0, e);
    kiln_be_euler_step(be, &bs, &as, -1.0f);
    kiln_be_transpose(be, &at, &as);
    kiln_be_transpose(be, &dt, &bs);
    kiln_tensor at1 = V3(&at, 1, P * W, e), dt1 = V3(&dt, 1, P * W, e);
    kiln_tensor g = gate(tl, e);
    kiln_be_gated_add(be, &at1, &g, &dt1);
    kiln_be_transpose(be, &as, &at);
    kiln_be_copy_rows(be, b, 0, &as, 0, e);
}

kiln_status vae_decode_tiled(kiln_backend *be, kiln_arena *arena, const vae_tiling *t,
                             int64_t f, const kiln_tensor *z, kiln_tensor *img, vae_tile_fn fn,
                             void *ctx, kiln_err *err)
{
    int64_t B = z->shape[0], zc = z->shape[1], h = z->shape[2], w = z->shape[3];
    int64_t oc = img->shape[1], P = B * oc, Pz = B * zc, W = w * f, S = t->step;
    plan p;
    make_plan(t, f, B, zc, oc, h, w, &p);
    tiler tls = {.be = be, .blend = t->blend}, *tl = &tls;
    kiln_tensor *tiles = calloc(2 * (size_t)p.nc, sizeof *tiles);
    tl->gate_host = malloc(sizeof(float) * (size_t)t->blend);
    kiln_status st = KILN_OK;
    if (!tiles || !tl->gate_host) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "vae: out of memory");
        goto out;
    }
    kiln_arena_reset(arena);
    for (int i = 0; i < B_COUNT; i++)
        kiln_arena_tensor(arena, &tl->buf[i], be->act_dtype, 1, (int64_t[]){p.elems[i]});
    for (int64_t i = 0; i < 2 * p.nc; i++)
        kiln_arena_tensor(arena, &tiles[i], be->act_dtype, 1, (int64_t[]){p.tile_elems});
    if (kiln_be_check(be, err)) {
        st = kiln_err_wrap(err, "vae: tile memory");
        goto out;
    }

    kiln_tensor *prev = tiles, *cur = tiles + p.nc;
    int64_t prev_h = 0;
    for (int64_t r = 0; r * S < h; r++) {
        int64_t th = h - r * S < t->tile ? h - r * S : t->tile, ht = th * f;
        int64_t lr = ht < t->limit ? ht : t->limit;
        kiln_tensor z3 = V3(z, Pz, h, w), zrows = V3(&tl->buf[B_ZROWS], Pz, th, w);
        kiln_be_copy_rows(be, &zrows, 0, &z3, r * S, th);
        for (int64_t c = 0; c < p.nc; c++) {
            int64_t tw = w - c * S < t->tile ? w - c * S : t->tile, wt = tw * f;
            int64_t lc = wt < t->limit ? wt : t->limit;
            kiln_tensor zt = V2(&tl->buf[B_ZTILE], Pz * th, tw), zr2 = V2(&zrows, Pz * th, w);
            kiln_be_copy_cols(be, &zt, 0, &zr2, c * S, tw);
            kiln_tensor zt4 = view(be, &zt, 4, (int64_t[]){B, zc, th, tw});
            kiln_tensor tile = view(be, &cur[c], 4, (int64_t[]){B, oc, ht, wt});
            if ((st = fn(ctx, &zt4, &tile, err)))
                goto out;
            kiln_tensor t3 = V3(&cur[c], P, ht, wt);
            if (r > 0) {
                kiln_tensor above = V3(&prev[c], P, prev_h, wt);
                blend_v(tl, &above, &t3);
            }
            if (c > 0) {
                kiln_tensor left = V3(&cur[c - 1], P, ht, t->tile * f); /* never the last */
                blend_h(tl, &left, &t3);
            }
            /* Keep the top-left lr x lc of the tile at (r, c) * limit. */
            kiln_tensor crop = V3(&tl->buf[B_CROP], P, lr, wt);
            kiln_be_copy_rows(be, &crop, 0, &t3, 0, lr);
            kiln_tensor band2 = V2(&tl->buf[B_BAND], P * lr, W), crop2 = V2(&crop, P * lr, wt);
            kiln_be_copy_cols(be, &band2, c * t->limit, &crop2, 0, lc);
        }
        kiln_tensor out3 = V3(img, P, h * f, W), band = V3(&tl->buf[B_BAND], P, lr, W);
        kiln_be_copy_rows(be, &out3, r * t->limit, &band, 0, lr);
        kiln_tensor *swap = prev;
        prev = cur;
        cur = swap;
        prev_h = ht;
    }
    if (kiln_be_check(be, err))
        st = kiln_err_wrap(err, "vae tiled decode");
out:
    free(tiles);
    free(tl->gate_host);
    return st;
}

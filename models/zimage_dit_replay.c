/* Recorded Z-Image DiT forwards (models/dit_replay.h has the machinery, as
 * for klein): a step of the 6B model is ~1400 kernels and copies, replayed
 * with one launch.  This file gives its parts: the key (shape, each item's
 * caption length, since the per-item copies, RoPE rows and attention views
 * are baked into a recording, and the epochs of the RoPE tables and the
 * arenas, memory that only grows: the invariant of the DiT replay fix of
 * issue 11), the staging of the inputs (zimage_stage_inputs) and the body
 * (zimage_forward_body).  The tables' contents for a layout are written
 * before every forward that changes layout (rope_prepare), in place and in
 * stream order, so a recording always reads its layout's. */
#include <string.h>

#include "zimage_dit_internal.h"

int zimage_replay_usable(const kiln_zimage_dit *m, const kiln_zimage_dit_input *in)
{
    return m->replay_enabled && !in->probe && in->x->shape[0] <= ZIMAGE_REPLAY_MAX_B;
}

typedef struct replay_ctx {
    zimage_fwd *f;
    const kiln_zimage_dit_input *in;
    zimage_io io;
    kiln_tensor *out;
} replay_ctx;

static void key_of(void *ctx, void *key)
{
    const replay_ctx *c = ctx;
    const zimage_fwd *f = c->f;
    zimage_replay_key k;
    memset(&k, 0, sizeof k); /* keys are compared bytewise, padding included */
    k.B = f->B, k.h = c->in->h, k.w = c->in->w, k.T = c->in->cap->shape[1];
    for (int64_t b = 0; b < f->B; b++)
        k.cap_len[b] = c->in->cap_len[b];
    k.rope_epoch = f->m->rope_epoch;
    k.fwd_epoch = kiln_arena_epoch(f->m->fwd);
    k.blk_epoch = kiln_arena_epoch(f->m->blk);
    memcpy(key, &k, sizeof k);
}

static kiln_status stage(void *ctx)
{
    replay_ctx *c = ctx;
    return zimage_stage_inputs(c->f, c->in, &c->io, c->out);
}

static kiln_status body(void *ctx, kiln_err *err)
{
    replay_ctx *c = ctx;
    return zimage_forward_body(c->f, c->in, &c->io, err);
}

static void finish(void *ctx)
{
    replay_ctx *c = ctx;
    kiln_be_copy(c->f->be, c->out, &c->io.out_buf);
}

kiln_status zimage_forward_replayed(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                    kiln_tensor *out, kiln_err *err)
{
    replay_ctx c = {.f = f, .in = in, .out = out};
    const kiln_dit_replay_fwd rf = {.be = f->be, .what = "zimage dit", .rows = f->B,
                                    .tokens = f->Np + f->Lmax,
                                    .key_size = sizeof(zimage_replay_key), .key = key_of,
                                    .stage = stage, .body = body, .finish = finish, .ctx = &c};
    return kiln_dit_replay_run(&f->m->replays, &rf, err);
}

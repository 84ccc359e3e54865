/* Recorded klein DiT forwards: a klein step is ~350 kernels and copies,
 * replayed with one launch (models/dit_replay.h has the machinery).  This
 * file gives its parts: the key (shape, K/V mode and the sizing of the K/V
 * cache, the RoPE tables' allocation and the arenas' epochs), the staging
 * of the inputs (flux2_stage_inputs) and the body (flux2_forward_body).
 * EXTRACT forwards are not recorded (they run once per request). */
#include <string.h>

#include "flux2_dit_internal.h"

int flux2_replay_usable(const kiln_flux2_dit *m, const kiln_flux2_dit_input *in)
{
    return m->replay_enabled && !in->probe && in->kv_mode != KILN_FLUX2_KV_EXTRACT;
}

typedef struct replay_ctx {
    flux2_fwd *f;
    const kiln_flux2_dit_input *in;
    flux2_io io;
    kiln_tensor *out;
} replay_ctx;

static void key_of(void *ctx, void *key)
{
    const replay_ctx *c = ctx;
    const flux2_fwd *f = c->f;
    flux2_replay_key k;
    memset(&k, 0, sizeof k); /* keys are compared bytewise, padding included */
    k.B = f->B, k.T = f->T, k.N = f->N, k.R = f->R;
    k.kv_mode = (int)c->in->kv_mode;
    k.kv_serial = f->kv ? f->kv->serial : 0;
    k.rope_epoch = f->m->rope_epoch;
    k.fwd_epoch = kiln_arena_epoch(f->m->fwd);
    k.blk_epoch = kiln_arena_epoch(f->m->blk);
    memcpy(key, &k, sizeof k);
}

static kiln_status stage(void *ctx)
{
    replay_ctx *c = ctx;
    return flux2_stage_inputs(c->f, c->in, &c->io, c->out);
}

static kiln_status body(void *ctx, kiln_err *err)
{
    replay_ctx *c = ctx;
    return flux2_forward_body(c->f, c->in, &c->io, err);
}

static void finish(void *ctx)
{
    replay_ctx *c = ctx;
    kiln_be_copy(c->f->be, c->out, &c->io.out_buf);
}

kiln_status flux2_forward_replayed(flux2_fwd *f, const kiln_flux2_dit_input *in, kiln_tensor *out,
                                   kiln_err *err)
{
    replay_ctx c = {.f = f, .in = in, .out = out};
    const kiln_dit_replay_fwd rf = {.be = f->be, .what = "flux2 dit", .rows = f->B,
                                    .tokens = f->T + f->N, .key_size = sizeof(flux2_replay_key),
                                    .key = key_of, .stage = stage, .body = body,
                                    .finish = finish, .ctx = &c};
    return kiln_dit_replay_run(&f->m->replays, &rf, err);
}

/* Recorded DiT forwards: a klein step is ~350 kernels and copies; recorded
 * once as a backend graph (kernels/backend.h graph_*) it is replayed with one
 * launch, so the GPU runs them back to back instead of at the pace the host
 * queues them.
 *
 * A recording holds the addresses it ran on, so every forward of a
 * recordable kind copies its inputs into staging tensors at fixed places in
 * the fwd arena (flux2_stage_inputs) and its output back out; the key of a
 * recording names everything else it points into: the shape, the RoPE
 * tables' allocation, the K/V cache sizing and the arenas' epochs (each
 * counts the moves of memory that only grows, so a key never matches a
 * recording whose memory was freed).  A key runs op by op
 * the first time (the arenas and the backend's plans settle), is recorded
 * the second time and replayed from then on.  The values are those of the
 * op-by-op forward: the same kernels run on the same data. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "flux2_dit_internal.h"

int flux2_replay_usable(const kiln_flux2_dit *m, const kiln_flux2_dit_input *in)
{
    return m->replay_enabled && !in->probe && in->kv_mode != KILN_FLUX2_KV_EXTRACT;
}

static flux2_replay_key key_of(const flux2_fwd *f, const kiln_flux2_dit_input *in)
{
    flux2_replay_key k;
    memset(&k, 0, sizeof k); /* keys are compared bytewise, padding included */
    k.B = f->B, k.T = f->T, k.N = f->N, k.R = f->R;
    k.kv_mode = (int)in->kv_mode;
    k.kv_serial = f->kv ? f->kv->serial : 0;
    k.rope_epoch = f->m->rope_epoch;
    k.fwd_epoch = kiln_arena_epoch(f->m->fwd);
    k.blk_epoch = kiln_arena_epoch(f->m->blk);
    return k;
}

static void slot_clear(kiln_flux2_dit *m, flux2_replay *r)
{
    if (r->graph)
        m->be->ops->graph_destroy(m->be, r->graph);
    memset(r, 0, sizeof *r);
}

/* The slot of `key`, or the least recently used one, cleared for it. */
static flux2_replay *slot_for(kiln_flux2_dit *m, const flux2_replay_key *key)
{
    flux2_replay *lru = &m->replays[0];
    for (int i = 0; i < FLUX2_REPLAY_SLOTS; i++) {
        flux2_replay *r = &m->replays[i];
        if (r->runs && !memcmp(&r->key, key, sizeof *key)) {
            r->last_use = ++m->replay_clock;
            return r;
        }
        if (r->last_use < lru->last_use)
            lru = r;
    }
    slot_clear(m, lru);
    lru->key = *key;
    lru->last_use = ++m->replay_clock;
    return lru;
}

/* Records the body into r->graph; on failure the forward still has to run,
 * op by op.  Returns 1 when recorded. */
static int record(flux2_fwd *f, const kiln_flux2_dit_input *in, const flux2_io *io,
                  flux2_replay *r)
{
    kiln_backend *be = f->be;
    kiln_err err = {0};
    /* A cancel must not cut a recording short (the key would be marked as
     * unrecordable): it takes effect at the step's next op instead. */
    int (*cancel)(void *) = be->cancel;
    void *cancel_user = be->cancel_user;
    kiln_be_set_cancel(be, NULL, NULL);
    be->ops->graph_begin(be);
    kiln_status st = flux2_forward_body(f, in, io, &err);
    kiln_graph *g = be->ops->graph_end(be);
    kiln_be_set_cancel(be, cancel, cancel_user);
    kiln_err why = {0};
    kiln_be_check(be, &why); /* what graph_end recorded, if anything */
    if (st || !g) {
        be->ops->graph_destroy(be, g);
        KILN_LOG_WARN("flux2 dit: a step of %lld x %lld tokens could not be recorded (%s); "
                      "it runs op by op",
                      (long long)f->B, (long long)(f->T + f->N), st ? err.msg : why.msg);
        r->failed = 1;
        return 0;
    }
    flux2_replay_key now = key_of(f, in);
    if (memcmp(&now, &r->key, sizeof now)) {
        /* An arena moved while recording: the graph points at freed memory. */
        be->ops->graph_destroy(be, g);
        return 0;
    }
    r->graph = g;
    return 1;
}

kiln_status flux2_forward_replayed(flux2_fwd *f, const kiln_flux2_dit_input *in, kiln_tensor *out,
                                   kiln_err *err)
{
    kiln_flux2_dit *m = f->m;
    kiln_backend *be = f->be;
    flux2_io io;
    memset(&io, 0, sizeof io);
    if (flux2_stage_inputs(f, in, &io, out)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "flux2 dit: staging inputs");
    }
    flux2_replay_key key = key_of(f, in);
    flux2_replay *r = slot_for(m, &key);
    if (r->graph && !be->ops->graph_launch(be, r->graph)) {
        /* The backend's scratch moved since: record again. */
        be->ops->graph_destroy(be, r->graph);
        r->graph = NULL;
    }
    int done = r->graph != NULL, staged = 1;
    if (!done && r->runs && !r->failed) {
        done = record(f, in, &io, r);
        if (done)
            be->ops->graph_launch(be, r->graph);
        else
            staged = 0; /* the attempt advanced the arenas */
    }
    r->runs++;
    if (!done && ((!staged && flux2_stage_inputs(f, in, &io, out)) ||
                  flux2_forward_body(f, in, &io, err)))
        return be->error.code ? kiln_be_check(be, err) : err->code;
    kiln_be_copy(be, out, &io.out_buf);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "flux2 dit: replayed step");
    return KILN_OK;
}

void flux2_replay_release(kiln_flux2_dit *m)
{
    for (int i = 0; i < FLUX2_REPLAY_SLOTS; i++)
        slot_clear(m, &m->replays[i]);
}

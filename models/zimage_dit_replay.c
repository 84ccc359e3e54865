/* Recorded Z-Image DiT forwards, as flux2_dit_replay.c records klein's: a
 * step of the 6B model is ~1400 kernels and copies; recorded once as a
 * backend graph it is replayed with one launch.
 *
 * A recording holds the addresses it ran on, so a recordable forward copies
 * its inputs into staging tensors at fixed places in the fwd arena
 * (zimage_stage_inputs) and its output back out.  Its key names everything
 * else it depends on: the shape, each item's caption length (the per-item
 * copies, RoPE rows and attention views are baked into the recording), the
 * RoPE tables' allocation and the arenas' epochs (each counts the moves of
 * memory that only grows, so a key never matches a recording whose memory
 * was freed: the invariant of the DiT replay fix of issue 11).  The tables'
 * contents for a layout are written before every forward (rope_prepare), in
 * place, so a recording reads the current ones.  A key runs op by op the
 * first time (the arenas and the backend's plans settle), is recorded the
 * second time and replayed from then on: the same kernels on the same
 * data, so the values are those of the op-by-op forward. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "zimage_dit_internal.h"

int zimage_replay_usable(const kiln_zimage_dit *m, const kiln_zimage_dit_input *in)
{
    return m->replay_enabled && !in->probe && in->x->shape[0] <= ZIMAGE_REPLAY_MAX_B;
}

static zimage_replay_key key_of(const zimage_fwd *f, const kiln_zimage_dit_input *in)
{
    zimage_replay_key k;
    memset(&k, 0, sizeof k); /* keys are compared bytewise, padding included */
    k.B = f->B, k.h = in->h, k.w = in->w, k.T = in->cap->shape[1];
    for (int64_t b = 0; b < f->B; b++)
        k.cap_len[b] = in->cap_len[b];
    k.rope_epoch = f->m->rope_epoch;
    k.fwd_epoch = kiln_arena_epoch(f->m->fwd);
    k.blk_epoch = kiln_arena_epoch(f->m->blk);
    return k;
}

static void slot_clear(kiln_zimage_dit *m, zimage_replay *r)
{
    if (r->graph)
        m->be->ops->graph_destroy(m->be, r->graph);
    memset(r, 0, sizeof *r);
}

/* The slot of `key`, or the least recently used one, cleared for it. */
static zimage_replay *slot_for(kiln_zimage_dit *m, const zimage_replay_key *key)
{
    zimage_replay *lru = &m->replays[0];
    for (int i = 0; i < ZIMAGE_REPLAY_SLOTS; i++) {
        zimage_replay *r = &m->replays[i];
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
static int record(zimage_fwd *f, const kiln_zimage_dit_input *in, const zimage_io *io,
                  zimage_replay *r)
{
    kiln_backend *be = f->be;
    kiln_err err = {0};
    /* A cancel must not cut a recording short (the key would be marked as
     * unrecordable): it takes effect at the step's next op instead. */
    int (*cancel)(void *) = be->cancel;
    void *cancel_user = be->cancel_user;
    kiln_be_set_cancel(be, NULL, NULL);
    be->ops->graph_begin(be);
    kiln_status st = zimage_forward_body(f, in, io, &err);
    kiln_graph *g = be->ops->graph_end(be);
    kiln_be_set_cancel(be, cancel, cancel_user);
    kiln_err why = {0};
    kiln_be_check(be, &why); /* what graph_end recorded, if anything */
    if (st || !g) {
        be->ops->graph_destroy(be, g);
        KILN_LOG_WARN("zimage dit: a step of %lld x %lld tokens could not be recorded (%s); "
                      "it runs op by op",
                      (long long)f->B, (long long)(f->Np + f->Lmax), st ? err.msg : why.msg);
        r->failed = 1;
        return 0;
    }
    zimage_replay_key now = key_of(f, in);
    if (memcmp(&now, &r->key, sizeof now)) {
        /* An arena moved while recording: the graph points at freed memory. */
        be->ops->graph_destroy(be, g);
        return 0;
    }
    r->graph = g;
    return 1;
}

kiln_status zimage_forward_replayed(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                    kiln_tensor *out, kiln_err *err)
{
    kiln_zimage_dit *m = f->m;
    kiln_backend *be = f->be;
    zimage_io io;
    memset(&io, 0, sizeof io);
    if (zimage_stage_inputs(f, in, &io, out)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "zimage dit: staging inputs");
    }
    zimage_replay_key key = key_of(f, in);
    zimage_replay *r = slot_for(m, &key);
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
    if (!done && ((!staged && zimage_stage_inputs(f, in, &io, out)) ||
                  zimage_forward_body(f, in, &io, err)))
        return be->error.code ? kiln_be_check(be, err) : err->code;
    kiln_be_copy(be, out, &io.out_buf);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "zimage dit: replayed step");
    return KILN_OK;
}

void zimage_replay_release(kiln_zimage_dit *m)
{
    for (int i = 0; i < ZIMAGE_REPLAY_SLOTS; i++)
        slot_clear(m, &m->replays[i]);
}

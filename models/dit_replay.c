/* Recorded DiT forwards (dit_replay.h). */
#include "dit_replay.h"

#include <string.h>

#include "common/log.h"

static void slot_clear(kiln_backend *be, kiln_dit_replay_slot *s)
{
    if (s->graph)
        be->ops->graph_destroy(be, s->graph);
    memset(s, 0, sizeof *s);
}

/* The slot of `key`, or the least recently used one, cleared for it. */
static kiln_dit_replay_slot *slot_for(kiln_dit_replays *r, kiln_backend *be, const void *key,
                                      size_t size)
{
    kiln_dit_replay_slot *lru = &r->slots[0];
    for (int i = 0; i < KILN_DIT_REPLAY_SLOTS; i++) {
        kiln_dit_replay_slot *s = &r->slots[i];
        if (s->runs && !memcmp(s->key, key, size)) {
            s->last_use = ++r->clock;
            return s;
        }
        if (s->last_use < lru->last_use)
            lru = s;
    }
    slot_clear(be, lru);
    memcpy(lru->key, key, size);
    lru->last_use = ++r->clock;
    return lru;
}

/* Records the body into s->graph; on failure the forward still has to run,
 * op by op.  Returns 1 when recorded. */
static int record(const kiln_dit_replay_fwd *f, kiln_dit_replay_slot *s)
{
    kiln_backend *be = f->be;
    kiln_err err = {0};
    /* A cancel must not cut a recording short (the key would be marked as
     * unrecordable): it takes effect at the step's next op instead. */
    int (*cancel)(void *) = be->cancel;
    void *cancel_user = be->cancel_user;
    kiln_be_set_cancel(be, NULL, NULL);
    be->ops->graph_begin(be);
    kiln_status st = f->body(f->ctx, &err);
    kiln_graph *g = be->ops->graph_end(be);
    kiln_be_set_cancel(be, cancel, cancel_user);
    kiln_err why = {0};
    kiln_be_check(be, &why); /* what graph_end recorded, if anything */
    if (st || !g) {
        be->ops->graph_destroy(be, g);
        KILN_LOG_WARN("%s: a step of %lld x %lld tokens could not be recorded (%s); "
                      "it runs op by op",
                      f->what, (long long)f->rows, (long long)f->tokens,
                      st ? err.msg : why.msg);
        s->failed = 1;
        return 0;
    }
    unsigned char now[KILN_DIT_REPLAY_KEY_MAX];
    f->key(f->ctx, now);
    if (memcmp(now, s->key, f->key_size)) {
        /* An arena moved while recording: the graph points at freed memory. */
        be->ops->graph_destroy(be, g);
        return 0;
    }
    s->graph = g;
    return 1;
}

kiln_status kiln_dit_replay_run(kiln_dit_replays *r, const kiln_dit_replay_fwd *f, kiln_err *err)
{
    kiln_backend *be = f->be;
    if (f->key_size > KILN_DIT_REPLAY_KEY_MAX)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "%s: replay key too large", f->what);
    if (f->stage(f->ctx)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "%s: staging inputs", f->what);
    }
    unsigned char key[KILN_DIT_REPLAY_KEY_MAX];
    f->key(f->ctx, key);
    kiln_dit_replay_slot *s = slot_for(r, be, key, f->key_size);
    if (s->graph && !be->ops->graph_launch(be, s->graph)) {
        /* The backend's scratch moved since: record again. */
        be->ops->graph_destroy(be, s->graph);
        s->graph = NULL;
    }
    int done = s->graph != NULL, staged = 1;
    if (!done && s->runs && !s->failed) {
        done = record(f, s);
        if (done)
            be->ops->graph_launch(be, s->graph);
        else
            staged = 0; /* the attempt advanced the arenas */
    }
    s->runs++;
    if (!done && ((!staged && f->stage(f->ctx)) || f->body(f->ctx, err)))
        return be->error.code ? kiln_be_check(be, err) : err->code;
    f->finish(f->ctx);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "%s: replayed step", f->what);
    return KILN_OK;
}

void kiln_dit_replay_release(kiln_backend *be, kiln_dit_replays *r)
{
    for (int i = 0; i < KILN_DIT_REPLAY_SLOTS; i++)
        slot_clear(be, &r->slots[i]);
}

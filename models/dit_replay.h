/* Recorded DiT forwards, shared by the FLUX.2 and Z-Image DiTs
 * (flux2_dit_replay.c, zimage_dit_replay.c give the model's parts).  A
 * step is hundreds to thousands of kernels and copies; recorded once as a
 * backend graph (kernels/backend.h graph_*) it is replayed with one launch,
 * so the GPU runs them back to back instead of at the pace the host queues
 * them.
 *
 *   kiln_dit_replay_fwd rf = {.be = be, .what = "zimage dit", .key_size = sizeof key,
 *                             .key = my_key, .stage = my_stage, .body = my_body,
 *                             .finish = my_finish, .ctx = &ctx};
 *   if (kiln_dit_replay_run(&m->replays, &rf, &err)) ...
 *
 * A recording holds the addresses it ran on, so a recordable forward first
 * copies its inputs into staging tensors at fixed places of its arenas
 * (`stage`) and its output back out (`finish`); its key names everything
 * else the body points into (shape, the allocation of tables and caches,
 * the arenas' epochs: counters of the moves of memory that only grows, so a
 * key never matches a recording whose memory was freed, docs/ARCHITECTURE.md).
 * A key runs op by op the first time (the arenas and the backend's plans
 * settle), is recorded the second time and replayed from then on: the same
 * kernels on the same data, so the values are those of the op-by-op
 * forward.  Up to KILN_DIT_REPLAY_SLOTS keys are kept, the least recently
 * used replaced.  Belongs to the backend's thread, like the model.
 */
#ifndef KILN_MODELS_DIT_REPLAY_H
#define KILN_MODELS_DIT_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define KILN_DIT_REPLAY_SLOTS 4
#define KILN_DIT_REPLAY_KEY_MAX 256

typedef struct kiln_dit_replay_slot {
    unsigned char key[KILN_DIT_REPLAY_KEY_MAX];
    kiln_graph *graph;
    int runs;   /* forwards of this key so far */
    int failed; /* recording failed once: op by op from then on */
    uint64_t last_use;
} kiln_dit_replay_slot;

typedef struct kiln_dit_replays {
    kiln_dit_replay_slot slots[KILN_DIT_REPLAY_SLOTS];
    uint64_t clock;
} kiln_dit_replays;

/* One forward as the model runs it. */
typedef struct kiln_dit_replay_fwd {
    kiln_backend *be;
    const char *what;   /* "flux2 dit": names the model in messages */
    int64_t rows, tokens; /* for the message when a step cannot be recorded */
    size_t key_size;    /* at most KILN_DIT_REPLAY_KEY_MAX */
    /* The key as things stand now, key_size bytes (padding zeroed: keys
     * are compared bytewise). */
    void (*key)(void *ctx, void *key);
    /* Resets the arenas and stages the inputs; the sticky error code. */
    kiln_status (*stage)(void *ctx);
    /* The forward's device work from the staged inputs (what is recorded). */
    kiln_status (*body)(void *ctx, kiln_err *err);
    /* Copies the staged output into the caller's tensor. */
    void (*finish)(void *ctx);
    void *ctx;
} kiln_dit_replay_fwd;

/* Runs the forward: replayed, recorded then launched, or op by op.  The
 * error of the backend or of the body, wrapped with f->what. */
kiln_status kiln_dit_replay_run(kiln_dit_replays *r, const kiln_dit_replay_fwd *f, kiln_err *err);
/* Destroys every recording (model teardown). */
void kiln_dit_replay_release(kiln_backend *be, kiln_dit_replays *r);

#endif

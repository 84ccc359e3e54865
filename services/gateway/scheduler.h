/* kiln gateway scheduler: the job table, per-stage queues, replica
 * registry and dispatch (docs/ARCHITECTURE.md, "Services").
 *
 *   kiln_sched_ops ops = {.send = bus_send, .finish = answer_client};
 *   kiln_sched *s = kiln_sched_create(&opts, &ops, ud, metrics, &err);
 *   kiln_sched_on_msg(s, "encode-box-17", msg, now);     // every bus message
 *   uint64_t id;
 *   if (kiln_sched_submit(s, &req, client, now, &id, &err)) -> 429 / 503
 *   ... later ops.finish(ud, client, &result) is called exactly once ...
 *   kiln_sched_cancel(s, id, now);   // the client went away: no finish
 *   kiln_sched_tick(s, now);         // every 250 ms: heartbeats, progress, timeouts
 *
 * A request becomes one job that flows encode -> denoise -> decode.
 * A streamed request with partial_images > 0 also gets previews
 * (scheduler_preview.c): the denoiser's `partial` latents each become a
 * decode job of their own, dispatched only to a decoder's spare credit
 * (behind every queued final decode), answered through ops.partial in
 * index order and always before the request's finish; previews still
 * queued when the final latents come are dropped, and the finish waits
 * only for those already decoding.  Each
 * stage has a queue in the gateway, fair across clients and weighted by
 * the requests' cost (fairq.h); a job is sent to a live replica
 * of its stage only while that replica has credits (pull: a replica's
 * `ready` adds credits, each `done` returns one, each job sent takes one).
 * Outputs of a stage are forwarded as the next stage's inputs by reference
 * (the gateway never reads tensor bytes).  The decoders' image files come
 * inline in their done, or by reference through their shm pool where the
 * gateway can open it (scheduler_images.c): the gateway copies them out,
 * checks that the range still held them, and frees it at once.  While a job waits between
 * stages the gateway holds the references and frees them itself if the
 * job ends there; once dispatched they are the consumer's to release, and
 * a `release` is forwarded as `free` to the owning incarnation only when
 * it comes from the consumer they were handed to, once per reference (a
 * `done` returns what is left).
 *
 * Failures: a replica incarnation silent for heartbeat_timeout_ms, with
 * jobs but no progress for progress_timeout_ms, unreachable on the bus,
 * reconnected, replaced by a new incarnation under its id, or answering
 * with references it did not make, is fenced
 * (scheduler_impl.h, sched_replica_fence): nothing it sends counts any
 * more, each of its in-flight jobs runs again once from the encode stage
 * on fresh references when the stages still have live replicas, else
 * fails with 503.  A stage losing its last replica fails the jobs queued
 * for it with 503.  A job older than job_timeout_ms is failed with 504 and
 * cancelled in its stage.  Error `done`s map to 400 (invalid), 429
 * (busy), 503 (unavailable, nomem, cancelled by the replica) or 500,
 * except a consumer's not_found (its inputs are gone or changed under
 * it), which re-runs the job once from the encode stage, then 503.
 *
 * Time is passed in (milliseconds on any monotonic clock) so tests drive
 * it.  Not thread-safe: the event loop thread owns the scheduler; ops are
 * called from within its functions.
 */
#ifndef KILN_GW_SCHED_H
#define KILN_GW_SCHED_H

#include <stdint.h>

#include "api_request.h"
#include "common/proto.h"
#include "common/transport.h"
#include "metrics.h"
#include "traces.h"

typedef struct kiln_sched kiln_sched;

typedef struct kiln_sched_opts {
    const char *model_id;      /* replicas serving another model are refused */
    int queue_max;             /* per stage: admission refuses (429) beyond it */
    /* A client (kiln_api_request.client) may have at most this share of
     * queue_max requests accepted and unanswered (at least one); beyond,
     * 429.  0: no per-client limit. */
    double client_share;
    double heartbeat_timeout_ms; /* 2000 */
    /* A replica with jobs in flight whose progress (hb.progress, dones)
     * stands still this long is fenced: its backend hangs. */
    double progress_timeout_ms;  /* 60000 */
    /* A replica left with only cancelled jobs that has not answered the
     * cancel within this (from the cancel, or from the end of its last
     * live job) is fenced: it is busy with work nobody waits for, and does
     * not do as told.  0: never. */
    double cancel_timeout_ms;
    double job_timeout_ms;       /* 300000 */
    /* Images by reference: a shm transport the gateway reads the
     * decoders' image files with (it never allocates from it; borrowed,
     * it must outlive the scheduler) and the gateway's own transport
     * domain (copied).  A decoder whose shm can be opened from `domain` is
     * asked for its files by reference (docs/ARCHITECTURE.md, "Images by
     * reference").  NULL (either): every image comes inline. */
    kiln_transport *images;
    const kiln_domain *domain;
} kiln_sched_opts;

typedef struct kiln_sched_result {
    int status;          /* 200, or the HTTP error status */
    const char *message; /* errors: safe to show the client */
    const char *code;    /* errors: OpenAI-style code */
    /* 200: the images in row order, each with its seed, and the request. */
    int n_images;
    const kiln_bytes *images;
    const uint64_t *seeds;
    const kiln_api_request *req;
    /* The scheduler's spans of the request (its queues and stages), errors
     * too; NULL when none. */
    const kiln_trace *trace;
} kiln_sched_result;

/* A preview of a streamed request (partial_images): its index and one
 * image per row of the request, in row order. */
typedef struct kiln_sched_partial {
    int index;
    int n_images;
    const kiln_bytes *images;
    const uint64_t *seeds;
    const kiln_api_request *req;
} kiln_sched_partial;

typedef struct kiln_sched_ops {
    /* Queues `m` for replica `peer` (the message borrows scheduler memory:
     * encode it before returning).  A failure here (the message does not
     * encode, no memory) fails the job it carries with 500; a peer that
     * turns out unreachable later comes back as kiln_sched_on_unreachable. */
    kiln_status (*send)(void *ud, const char *peer, const kiln_msg *m, kiln_err *err);
    /* The answer for `client`: exactly once per accepted request, never
     * after kiln_sched_cancel.  The result's memory is valid during the
     * call only. */
    void (*finish)(void *ud, void *client, const kiln_sched_result *res);
    /* Optional: a preview for `client` (a request with stream and
     * partial_images > 0), in rising index order, before its finish;
     * memory valid during the call only.  NULL: no previews are made. */
    void (*partial)(void *ud, void *client, const kiln_sched_partial *p);
} kiln_sched_ops;

/* NULL with err set.  `metrics` is borrowed and must outlive s. */
kiln_sched *kiln_sched_create(const kiln_sched_opts *opts, const kiln_sched_ops *ops, void *ud,
                              kiln_metrics *metrics, kiln_err *err);
/* Frees every job (without finishing them: the caller is shutting its
 * clients down) and every replica record.  Accepts NULL. */
void kiln_sched_destroy(kiln_sched *s);

/* Admits a validated request with req->plan.req.seed already chosen.  On
 * success the job owns req's memory (req is zeroed) and *id names it; it
 * waits in the encode queue until kiln_sched_kick (so that finish never
 * runs before the caller has recorded the id).  Errors leave req to the
 * caller: KILN_ERR_UNAVAILABLE (503: a stage has no live replica),
 * KILN_ERR_BUSY (429: a stage queue is full, or the client has its share
 * of requests in), _INVALID (n beyond the protocol's rows), _NOMEM. */
kiln_status kiln_sched_submit(kiln_sched *s, kiln_api_request *req, void *client, double now,
                              uint64_t *id, kiln_err *err);

/* Sends queued jobs to replicas with credits. */
void kiln_sched_kick(kiln_sched *s, double now);

/* The client of job `id` went away: drop it from its queue or cancel it on
 * its replica, free the references the gateway holds.  No finish call
 * follows.  Unknown ids are ignored. */
void kiln_sched_cancel(kiln_sched *s, uint64_t id, double now);

/* One message from replica `peer`; the scheduler takes ownership of m. */
void kiln_sched_on_msg(kiln_sched *s, const char *peer, kiln_msg *m, double now);

/* The bus could not route a message to `peer`: it is gone. */
void kiln_sched_on_unreachable(kiln_sched *s, const char *peer, double now);

/* A tick more than this after the one before means the gateway itself did
 * not run meanwhile (SIGSTOP, a frozen cgroup, a loaded host): it judges
 * nobody on it. */
#define SCHED_LATE_TICK_MS 1000.0

/* Fences silent and stalled replicas and times jobs out; call it every
 * 250 ms, after handing the scheduler every bus message that arrived.  A
 * late tick (SCHED_LATE_TICK_MS) fences nobody: the replicas' silence
 * while the gateway did not run is not theirs, so their clocks move on by
 * the gap. */
void kiln_sched_tick(kiln_sched *s, double now);

/* Hand-offs that failed in a row into one stage before the service says it
 * is not ready. */
#define SCHED_HANDOFF_STREAK 3

/* 1 when every stage has at least one live replica and none had its last
 * SCHED_HANDOFF_STREAK hand-offs fail (consumers that could not open what
 * their producer made: /dev/shm full or cleaned, an IPC namespace apart). */
int kiln_sched_ready(const kiln_sched *s);

void kiln_sched_gauges(const kiln_sched *s, kiln_metrics_gauges *g);

/* The served model's traits (common/traits.h) as the first replica to
 * register announced them in its hello: 1 and *out filled from then on
 * (they never change; a replica announcing other traits is refused), 0
 * before.  The gateway resolves requests with them. */
int kiln_sched_traits(const kiln_sched *s, kiln_model_traits *out);

#endif

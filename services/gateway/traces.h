/* Stage traces: where one request spent its time, across the gateway and
 * the replicas that ran it, kept for the last requests and served as
 * Chrome trace-event JSON (Perfetto, chrome://tracing) by
 * GET /v1/traces/<request id>.
 *
 *   kiln_trace t = {0};
 *   kiln_trace_span_add(&t, "gateway", "receive", t_first_byte, t_accepted);
 *   ... the scheduler adds each stage's spans (scheduler_done.c) ...
 *   kiln_traces_put(store, "req_...", 200, &t);
 *   kiln_traces_json(store, "req_...", &body, &err);   // 1 when unknown
 *
 * A span is a named interval on a track: "gateway" for the gateway's own
 * work, else the replica id that did it.  Times are the gateway's
 * monotonic clock (ms).  Replicas report durations, not times (their
 * clocks are not the gateway's): a stage's replica spans (its queue, its
 * run and the run's parts) are laid out inside the stage's dispatch-to-done
 * interval, with the time the replica did not account for (bus messages
 * and tensor hand-offs) split evenly before and after as "handoff" spans.
 * A span of work on a CUDA backend also carries the device time the
 * replica measured with CUDA events (kernels/backend.h, timer_ms), beside
 * its wall time: the denoiser's setup and steps, the decoder's VAE and the
 * encoder's text encoder; in the JSON, the event's args.gpu_ms.
 *
 * Not thread-safe: the event loop thread alone uses a store.
 */
#ifndef KILN_GW_TRACES_H
#define KILN_GW_TRACES_H

#include "common/buf.h"
#include "common/error.h"
#include "common/proto.h"

#define KILN_TRACE_MAX_SPANS 64

typedef struct kiln_trace_span {
    char track[KILN_PROTO_ID_MAX]; /* "gateway" or a replica id */
    const char *name;              /* a string constant */
    double t0, t1;                 /* ms, gateway clock */
    double gpu_ms;                 /* device time inside it, ms; < 0: none measured */
} kiln_trace_span;

typedef struct kiln_trace {
    kiln_trace_span span[KILN_TRACE_MAX_SPANS];
    int n; /* spans past the bound are dropped */
} kiln_trace;

/* Appends a span (t1 >= t0 enforced by clamping) without a device time,
 * and returns it to set one; NULL when the trace is full (the span is
 * dropped). */
kiln_trace_span *kiln_trace_span_add(kiln_trace *t, const char *track, const char *name, double t0,
                                     double t1);

typedef struct kiln_traces kiln_traces;

/* A store of the last `cap` requests' traces.  NULL with err set. */
kiln_traces *kiln_traces_create(int cap, kiln_err *err);
void kiln_traces_destroy(kiln_traces *s);

/* Keeps request `id`'s trace (copied), replacing the oldest one. */
void kiln_traces_put(kiln_traces *s, const char *id, int status, const kiln_trace *t);

/* Appends the trace of request `id` as Chrome trace-event JSON: one
 * process per track (gateway first), complete ("X") events in
 * microseconds from the request's first byte, args {gpu_ms} on those
 * with a device time, and otherData {request_id, status}.  KILN_OK, 1 when no such trace is kept, or
 * KILN_ERR_NOMEM. */
int kiln_traces_json(const kiln_traces *s, const char *id, kiln_buf *out, kiln_err *err);

#endif

/* kiln gateway metrics: counters and histograms kept by the event loop and
 * rendered in the Prometheus text format (version 0.0.4) for /metrics.
 *
 *   kiln_metrics *m = kiln_metrics_create(&err);
 *   kiln_metrics_request(m, "/v1/images/generations", 200);
 *   kiln_metrics_latency(m, KILN_PHASE_DENOISE, 0.412);
 *   kiln_metrics_gauges g = {...from the scheduler...};
 *   kiln_metrics_render(m, &g, &body, &err);
 *
 * Families (names per the Prometheus conventions, one quantity each):
 * kiln_http_requests_total{route,status}; kiln_request_duration_seconds
 * {route,status} (an image request from its first byte to its answer, by
 * how it ended); kiln_queue_wait_seconds{stage,queue} (a job's wait in
 * the gateway's queue of a stage, queue="gateway", and in the replica's
 * own queue before its batch started, queue="replica", as the replica
 * reports it); kiln_stage_duration_seconds{stage} (dispatch to done of
 * that stage at the gateway: the replica's queue, its run and the
 * hand-offs); kiln_stage_seconds{part} (the replicas' timings of the parts
 * of a stage); kiln_batch_rows{stage}; kiln_images_generated_total;
 * kiln_job_failures_total{stage,code} (a stage's failed jobs by kiln status
 * name); kiln_prompt_cache_{hits,misses,evictions}_total (the encoders'
 * prompt caches); kiln_events_total{event} (replica_lost: an incarnation
 * fenced, redispatch, timeout, cancel, handoff_failure, cancel_timeout);
 * kiln_image_handoffs_total{via} (the decoders' image files, by how they
 * reached the gateway: kiln_image_via);
 * kiln_bus_rejected_total{reason} (kiln_reject); the gauges
 * kiln_queue_depth{stage}, kiln_inflight{stage}, kiln_replicas{stage},
 * kiln_replicas_busy{stage}, kiln_cancelling{stage}, kiln_jobs,
 * kiln_connections, kiln_clients, kiln_body_bytes, kiln_body_waiting; per
 * replica kiln_replica_inflight{stage,replica},
 * kiln_replica_jobs_total{stage,replica} and
 * kiln_replica_heartbeat_age_seconds{stage,replica}; the counters
 * kiln_body_waits_total and kiln_connections_refused_total{reason}; every
 * configured limit as kiln_limit{name}; kiln_build_info{version,...} and
 * the gateway's process_* (proc_metrics.h).  Duration buckets run from
 * 5 ms to 300 s, dense between 50 ms and 60 s where GPU stages fall.
 *
 * Not thread-safe: the event loop thread alone updates and renders.
 */
#ifndef KILN_GW_METRICS_H
#define KILN_GW_METRICS_H

#include "common/buf.h"
#include "common/error.h"
#include "common/proto.h"

/* Which queue a wait was spent in. */
typedef enum kiln_queue {
    KILN_QUEUE_GATEWAY = 0, /* the gateway's fair queue of a stage */
    KILN_QUEUE_REPLICA,     /* the replica's own queue, until its batch started */
    KILN_QUEUE_COUNT
} kiln_queue;

/* Parts of the stages, from the timings replicas report with each done
 * (kiln_worker_timing) and the gateway's own clock: what kiln-bench breaks
 * a request's time into. */
typedef enum kiln_part {
    KILN_PART_ENCODE_RUN = 0,  /* tokenizer + Qwen3 (+ VAE encoder), the whole batch */
    KILN_PART_DENOISE_SETUP,   /* noise, schedule, inputs before the first step */
    KILN_PART_DENOISE_STEP,    /* one denoising step (mean over the job's steps) */
    KILN_PART_DECODE_VAE,      /* VAE decode, 8-bit conversion, download */
    KILN_PART_IMAGE_ENCODE,    /* PNG / JPEG / WebP of the job's images */
    /* A stage's time at the gateway minus the replica's queue and run: bus
     * messages and the tensor hand-off, one part per stage (in kiln_stage
     * order) so that a slow hop shows as itself. */
    KILN_PART_ENCODE_HANDOFF,
    KILN_PART_DENOISE_HANDOFF,
    KILN_PART_DECODE_HANDOFF,
    KILN_PART_COUNT
} kiln_part;
_Static_assert(KILN_PART_DENOISE_HANDOFF - KILN_PART_ENCODE_HANDOFF == KILN_STAGE_DENOISE &&
                   KILN_PART_DECODE_HANDOFF - KILN_PART_ENCODE_HANDOFF == KILN_STAGE_DECODE &&
                   KILN_STAGE_ENCODE == 0,
               "the hand-off parts follow kiln_stage's order");

typedef enum kiln_event {
    KILN_EVENT_REPLICA_LOST = 0,
    KILN_EVENT_REDISPATCH,
    KILN_EVENT_TIMEOUT,
    KILN_EVENT_CANCEL,
    KILN_EVENT_HANDOFF_FAILURE, /* a consumer could not open (or keep) its inputs */
    KILN_EVENT_CANCEL_TIMEOUT,  /* a replica fenced for not answering a cancel in time */
    KILN_EVENT_REPLICA_LEFT,    /* a replica said `leaving`, then `bye` with its jobs answered */
    KILN_EVENT_COUNT
} kiln_event;

/* Why the gateway did not act on (part of) a bus message. */
typedef enum kiln_reject {
    KILN_REJECT_FENCED = 0,   /* from a fenced incarnation */
    KILN_REJECT_UNREGISTERED, /* from a peer without a live registration */
    KILN_REJECT_NOT_HANDED,   /* a release of a reference not handed to the sender (or twice) */
    KILN_REJECT_FOREIGN_REF,  /* a done naming references the sender did not make */
    KILN_REJECT_COUNT
} kiln_reject;

/* How a decoded image file reached the gateway. */
typedef enum kiln_image_via {
    KILN_IMAGE_VIA_SHM = 0, /* by reference, read from the decoder's shm pool */
    KILN_IMAGE_VIA_INLINE,  /* inline in the decoder's done */
    /* by a reference the gateway could not use (gone, changed under it, or
     * never valid): the request ran again or failed */
    KILN_IMAGE_VIA_FAILED,
    KILN_IMAGE_VIA_COUNT
} kiln_image_via;

/* A configured limit, exported as kiln_limit{name="..."}. */
typedef struct kiln_metrics_limit {
    const char *name;
    double value;
} kiln_metrics_limit;

#define KILN_METRICS_MAX_REPLICAS 128

/* Values read at render time from the scheduler and the HTTP side. */
typedef struct kiln_metrics_gauges {
    int queued[KILN_STAGE_COUNT];   /* jobs waiting in the gateway's stage queue */
    int inflight[KILN_STAGE_COUNT]; /* jobs sent to a replica, not done */
    int replicas[KILN_STAGE_COUNT]; /* live replicas */
    int busy[KILN_STAGE_COUNT];     /* live replicas running jobs or still on cancelled ones */
    int cancelling[KILN_STAGE_COUNT]; /* cancels sent to running jobs, not yet answered */
    int shm_short[KILN_STAGE_COUNT]; /* live replicas without room in /dev/shm for their outputs */
    int jobs;                       /* accepted requests not yet answered */
    int handoff_failures;           /* consumers that could not open their inputs, in all */
    int handoff_streak[KILN_STAGE_COUNT]; /* ...in a row into a stage */
    int connections;                /* open HTTP connections */
    int clients;                    /* clients holding a connection or a body */
    double body_bytes;              /* request body bytes held (the body budget's use) */
    int body_waiting;               /* bodies waiting for budget */
    double body_waits;              /* bodies that had to wait, ever */
    double refused_global, refused_client; /* connections refused, ever */
    const kiln_metrics_limit *limits;
    int n_limits;
    /* Per replica (live ones; the first KILN_METRICS_MAX_REPLICAS). */
    struct {
        const char *id; /* owned by the scheduler; valid until it next runs */
        kiln_stage stage;
        int inflight;
        double jobs;         /* jobs it answered, this incarnation */
        double heartbeat_age; /* seconds since it was last heard */
        double rss;           /* its resident memory, bytes (0: not reported) */
        double dev_used, dev_total; /* its GPU's memory in use / in all (0: none) */
    } replica[KILN_METRICS_MAX_REPLICAS];
    int n_replicas;
} kiln_metrics_gauges;

typedef struct kiln_metrics kiln_metrics;

/* NULL with err set (KILN_ERR_NOMEM). */
kiln_metrics *kiln_metrics_create(kiln_err *err);
/* Accepts NULL. */
void kiln_metrics_destroy(kiln_metrics *m);

/* `route` must outlive m (the gateway passes string constants).  Counting
 * silently stops for new (route, status) pairs past an internal bound. */
void kiln_metrics_request(kiln_metrics *m, const char *route, int status);
/* An image request answered with `status` after `seconds`; route as for
 * kiln_metrics_request.  Past an internal bound of (route, status) pairs
 * new ones are not kept. */
void kiln_metrics_duration(kiln_metrics *m, const char *route, int status, double seconds);
void kiln_metrics_queue_wait(kiln_metrics *m, kiln_stage stage, kiln_queue q, double seconds);
void kiln_metrics_stage(kiln_metrics *m, kiln_stage stage, double seconds);
/* A failed job of a stage, by its status. */
void kiln_metrics_failure(kiln_metrics *m, kiln_stage stage, kiln_status code);
void kiln_metrics_prompt_cache(kiln_metrics *m, double hits, double misses, double evictions);
void kiln_metrics_part(kiln_metrics *m, kiln_part part, double seconds);
void kiln_metrics_batch(kiln_metrics *m, kiln_stage stage, int rows);
void kiln_metrics_images(kiln_metrics *m, int n);
void kiln_metrics_event(kiln_metrics *m, kiln_event ev);
void kiln_metrics_rejected(kiln_metrics *m, kiln_reject why, int n);
void kiln_metrics_image_handoffs(kiln_metrics *m, kiln_image_via via, int n);

/* Appends the exposition text.  KILN_ERR_NOMEM. */
kiln_status kiln_metrics_render(const kiln_metrics *m, const kiln_metrics_gauges *g, kiln_buf *out,
                                kiln_err *err);

#endif

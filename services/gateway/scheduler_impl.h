/* Internals of the gateway scheduler (scheduler.c: jobs, queues, dispatch;
 * scheduler_replica.c: the replica registry; scheduler_done.c: results and
 * references). */
#ifndef KILN_GW_SCHED_IMPL_H
#define KILN_GW_SCHED_IMPL_H

#include <stddef.h>

#include "fairq.h"
#include "idmap.h"
#include "scheduler.h"

/* Intrusive circular doubly-linked list; a head is its own sentinel. */
typedef struct sched_link {
    struct sched_link *prev, *next;
} sched_link;

static inline void link_init(sched_link *h) { h->prev = h->next = h; }
static inline int link_empty(const sched_link *h) { return h->next == h; }
static inline void link_remove(sched_link *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    link_init(n);
}
static inline void link_insert_before(sched_link *at, sched_link *n)
{
    n->prev = at->prev;
    n->next = at;
    at->prev->next = n;
    at->prev = n;
}
#define LINK_OWNER(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* A replica id and its current incarnation.  An incarnation lives from
 * its hello until it is fenced (sched_replica_fence); a fenced one never
 * counts again, and the same id comes back only as a new incarnation
 * (another epoch).  The record of a fenced incarnation is kept a while so
 * that its late messages are recognised and answered `fenced`. */
typedef struct sched_replica {
    sched_link node; /* in kiln_sched.replicas */
    char id[KILN_PROTO_ID_MAX];
    uint64_t epoch; /* the current (or last, when !alive) incarnation */
    kiln_stage stage;
    int alive;      /* 0 once that incarnation is fenced */
    /* It said `leaving` (a graceful stop): no new jobs and no credits; it
     * answers those it holds, then says `bye`.  Not live for readiness,
     * admission or placement (sched_live), still trusted for its work. */
    int leaving;
    /* Its incarnation ended with `bye` after `leaving`: it exits by itself
     * with 0, so a heartbeat of it still on the way is not answered
     * `fenced` (which would make it exit 75 and be restarted). */
    int left;
    int credits;
    int max_batch;
    double last_seen;
    uint64_t progress;  /* the last hb.progress */
    uint64_t shm_short; /* the last hb.shm_short: no room in /dev/shm, no work */
    double progress_at; /* when it last moved (or work arrived on an idle replica) */
    sched_link inflight; /* jobs running here */
    int n_inflight;
    sched_link handoffs; /* sched_handoff: references handed to this incarnation */
    sched_link cancelling; /* scheduler_cancel.c: cancels it has not answered yet */
    int n_cancelling;
    double live_at; /* scheduler_cancel.c: when it last had live jobs in flight */
    uint64_t last_job;   /* kiln_sched.n_dispatched when it last got a job */
    uint64_t jobs_done;  /* dones of this incarnation (kiln_replica_jobs_total) */
    uint64_t rss, dev_used, dev_total; /* the last hb's memory (0: not reported) */
    /* From its hello: where its references open, what it can open, and
     * its data socket for by-value hand-offs ("" when none). */
    kiln_domain domain;
    unsigned transports;
    /* 1 once the gateway failed to map one of its slabs (another user's
     * files, say): its images are asked for inline from then on. */
    int images_inline;
    char data[KILN_PROTO_ENDPOINT_MAX], data_key[KILN_PROTO_KEY_TEXT];
    /* Its hello's process token ("" when not said): the incarnations that
     * share one end together (scheduler_replica.c, sched_replica_fence). */
    char process[KILN_PROTO_PROCESS_MAX];
} sched_replica;

/* References a job took to a consumer: held here from dispatch until the
 * consumer releases each one (`release`), answers the job (`done`: what it
 * did not release comes back with it) or is fenced (then the gateway
 * returns them).  Only the consumer they were handed to, in that
 * incarnation, can release them, and each at most once; the job itself
 * may be gone meanwhile (cancelled, timed out). */
typedef struct sched_handoff {
    sched_link node; /* in sched_replica.handoffs */
    uint64_t job;
    int n;
    kiln_tensor_ref refs[KILN_PROTO_MAX_TENSORS];
    unsigned freed; /* bit i: refs[i] went back to its owner */
} sched_handoff;

typedef enum job_state { JOB_NEW = 0, JOB_QUEUED, JOB_RUNNING } job_state;

typedef struct sched_job {
    uint64_t id;
    void *client; /* NULL once cancelled */
    kiln_api_request req;
    uint64_t *seeds; /* req.req.n */
    kiln_stage stage;
    job_state state;
    sched_replica *on; /* JOB_RUNNING */
    kiln_fairq_node fq; /* JOB_QUEUED: in its stage's queue */
    sched_link qnode;  /* JOB_RUNNING: in its replica's in-flight list */
    sched_link anode;  /* kiln_sched.all, in submission order */
    int redispatched;
    /* The previous stage's done, owning the current stage's input
     * references, while the job waits in a queue between stages; at
     * dispatch they move to a sched_handoff of the consumer. */
    kiln_msg *held;
    double t_submit, t_enqueue, t_dispatch;
    kiln_trace trace; /* its spans so far (traces.h), handed to finish */
    /* Previews (scheduler_preview.c).  A preview is a decode job of its
     * own: parent is the request it shows (NULL for a request), preview
     * its index; it is not in kiln_sched.all, queues in
     * kiln_sched.previews (pq) rather than the fair queue, and sits in
     * its parent's list (pnode).  A request keeps its previews, the last
     * index it answered (-1: none), and its final decode done while
     * previews still decode (final). */
    struct sched_job *parent;
    int preview;
    sched_link pq, pnode;
    sched_link previews;
    int last_preview;
    kiln_msg *final;
    /* The image files its decode done handed by reference, copied out
     * (scheduler_images.c): that done's images point into it. */
    uint8_t *image_bytes;
    /* What its last dispatch asked a decoder for (decode.image_kinds): the
     * references its done may carry, whatever was decided since. */
    unsigned image_kinds;
} sched_job;

#define SCHED_TOMBSTONES 256

struct kiln_sched {
    kiln_sched_opts opts;
    kiln_domain domain; /* opts.domain's copy */
    char model_id[KILN_PROTO_ID_MAX];
    /* The served model's traits, from the first replica's hello; every
     * later replica must announce the same (kiln_sched_traits). */
    kiln_model_traits traits;
    int have_traits;
    kiln_sched_ops ops;
    void *ud;
    kiln_metrics *metrics;
    sched_link replicas;
    kiln_fairq queue[KILN_STAGE_COUNT]; /* fair across clients (fairq.h) */
    int queued[KILN_STAGE_COUNT], inflight[KILN_STAGE_COUNT];
    sched_link all;
    sched_link previews; /* queued previews, oldest first (scheduler_preview.c) */
    int n_jobs;
    kiln_idmap jobs;
    uint64_t next_id;
    uint64_t n_dispatched; /* jobs sent so far, all stages */
    double now; /* the time of the call being handled (callers pass it in) */
    /* Hand-offs into a stage whose consumer could not open its inputs
     * (not_found): all of them, and in a row since the last one that
     * worked (kiln_sched_ready). */
    int handoff_failures;
    int handoff_streak[KILN_STAGE_COUNT];
    double last_tick; /* 0 before the first */
    /* Ended incarnations whose records were forgotten: late messages of a
     * fenced one are still answered `fenced`, of one that left ignored (a
     * ring, oldest overwritten). */
    struct {
        char id[KILN_PROTO_ID_MAX];
        uint64_t epoch;
        int left;
    } tombs[SCHED_TOMBSTONES];
    int n_tombs, next_tomb;
};

#define FQ_JOB(node) LINK_OWNER(node, sched_job, fq)

/* scheduler.c */
void sched_enqueue(kiln_sched *s, sched_job *j, kiln_stage stage, int front, double now);
void sched_dispatch(kiln_sched *s, double now);
void sched_detach(kiln_sched *s, sched_job *j);
/* Answers the client (when still there) with an error, stops the job in
 * its stage and destroys it. */
void sched_fail(kiln_sched *s, sched_job *j, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void sched_destroy_job(kiln_sched *s, sched_job *j);
int sched_live(const kiln_sched *s, kiln_stage stage);

/* scheduler_replica.c */
sched_replica *sched_replica_find(kiln_sched *s, const char *id);
/* Fencing: declares incarnation r dead, now and for good.  Nothing it
 * sends counts from here on (its dones, releases and heartbeats are
 * ignored, and answered `fenced`); the jobs it was running run again from
 * the encode stage on fresh references (or fail with 503 after their one
 * re-run), the references handed to it go back to their owners, queued
 * jobs whose inputs it made start over, and it is sent `fenced`, on which
 * a replica exits to be restarted.  `why` ends a log line ("stopped
 * heartbeating").  No-op for an incarnation already fenced.  Any reason
 * to stop trusting a replica is a reason to call this. */
void sched_replica_fence(kiln_sched *s, sched_replica *r, const char *why, double now);
/* A replica's `leaving`: it gets no job from now on, and its credits are
 * void. */
void sched_replica_leaving(sched_replica *r);
/* A leaving replica's `bye`: it has answered every job it held.  Ended
 * like a fenced one (its record, the references still handed to it, the
 * `gone` to the others; a job still in flight runs again) but counted as
 * replica_left, not replica_lost, and not sent `fenced`: it exits on its
 * own, with 0. */
void sched_replica_left(kiln_sched *s, sched_replica *r, double now);
/* Job j, running on r, was not done there: it runs again once from the
 * encode stage (or fails with 503 when it already did, or no encoder is
 * live).  `stage` and `why` name what happened for the 503. */
void sched_rerun_or_fail(kiln_sched *s, sched_job *j, const char *stage, const char *why,
                         double now);
void sched_on_hello(kiln_sched *s, const char *peer, const kiln_msg *m, double now);
/* A message from `peer` that its current incarnation did not send (a
 * fenced one's, or an id the gateway does not know): counted, answered
 * `fenced` when it comes from a fenced incarnation, and otherwise
 * ignored, except that the references a done carries go back to the
 * sender when it owns them. */
void sched_on_stale(kiln_sched *s, sched_replica *r, const char *peer, kiln_msg *m);
void sched_replica_gc(kiln_sched *s, double now);

/* scheduler_cancel.c: cancels sent to a replica running the job, until
 * the replica's done for it; a replica left with only cancelled work,
 * unanswered past opts.cancel_timeout_ms, is fenced (sched_cancel_overdue,
 * from the tick).  sched_cancel_shift moves its clocks on by a gap the
 * gateway itself did not run. */
void sched_cancel_sent(sched_replica *r, uint64_t job, double now);
void sched_cancel_answered(sched_replica *r, uint64_t job);
void sched_cancel_forget(sched_replica *r);
void sched_cancel_shift(sched_replica *r, double gap);
void sched_cancel_overdue(kiln_sched *s, double now);
/* scheduler_pair.c: which replica may take a job whose inputs live in
 * another replica's memory (common/domain.h). */
typedef enum sched_pairing {
    PAIR_NONE = 0, /* r cannot get at the inputs */
    PAIR_FETCH,    /* r fetches some inputs by value from their owner */
    PAIR_LOCAL,    /* r opens every input where it is */
} sched_pairing;
sched_pairing sched_pairing_of(kiln_sched *s, const sched_job *j, const sched_replica *r);
/* 1 when a live replica of j's stage could take j now or later. */
int sched_placeable(kiln_sched *s, const sched_job *j);
/* The reference kinds a job for `producer` may output: no cuda_ipc when
 * no live replica of the next stage could open its cuda_ipc slabs. */
unsigned sched_out_kinds(kiln_sched *s, const sched_replica *producer, kiln_stage stage);
/* Fills mj->src for the inputs `r` must fetch by value. */
void sched_fill_src(kiln_sched *s, const sched_job *j, const sched_replica *r, kiln_msg_job *mj);
/* How decoder r may hand its image files besides inline (a decode job's
 * image_kinds): shm when the gateway can open r's /dev/shm, else 0. */
unsigned sched_image_kinds(const kiln_sched *s, const sched_replica *r);

/* scheduler_images.c */
/* The ok decode done m of job j (a request's or a preview's) from r, with
 * its image files made whole: those it names by reference (out
 * "image.<row>") are copied into j->image_bytes, verified and their
 * ranges freed, and m->done.images then holds every row in order, with
 * nothing left in out.  0 when so.  Otherwise the job is dealt with and m
 * freed: a reference the gateway cannot read any more (its decoder's
 * memory is gone) runs the request again once (sched_restart_lost), one
 * that was never valid (a wrong name, kind, length, or offset) fails it;
 * a preview is dropped.  Each image is counted in
 * kiln_image_handoffs_total.  The loop waits for at most a slab mapping
 * and a copy of the files. */
int sched_images_take(kiln_sched *s, sched_replica *r, sched_job *j, kiln_msg *m, double now);

/* scheduler_preview.c */
/* A denoiser's `partial` (m is taken): a preview job for the request it
 * names, or its latents freed when nobody wants them. */
void sched_on_partial(kiln_sched *s, sched_replica *r, kiln_msg *m, double now);
/* The decode done of preview p (m is taken): answered through
 * ops.partial when it is newer than the last one sent, then ended. */
void sched_preview_done(kiln_sched *s, sched_job *p, kiln_msg *m, double now);
/* Ends preview p (its inputs freed when held, nothing sent); its parent,
 * when waiting for it with its final images, completes. */
void sched_preview_end(kiln_sched *s, sched_job *p);
/* Ends the request's previews that wait in the queue (its final latents
 * are here: they would only delay the image). */
void sched_preview_drop_queued(kiln_sched *s, sched_job *j);
/* 1 when some preview of request j is decoding. */
int sched_preview_running(const sched_job *j);
/* Queued previews whose inputs incarnation (owner, epoch) made end. */
void sched_preview_fenced(kiln_sched *s, const char *owner, uint64_t epoch);

/* scheduler_done.c */
/* Answers request j with the decode done m (taken) and destroys j. */
void sched_complete(kiln_sched *s, sched_job *j, kiln_msg *m);
void sched_on_done(kiln_sched *s, sched_replica *r, kiln_msg *m, double now);
void sched_on_release(kiln_sched *s, sched_replica *r, const kiln_msg_refs *refs);
/* Job j lost data it needs (`what`: "inputs", "images"), which a replica
 * of stage `holder` held: a consumer's inputs are gone, or the gateway
 * could not read its decoded images.  As for the jobs of a lost replica:
 * once more from the encode stage, else 503; a preview is dropped. */
void sched_restart_lost(kiln_sched *s, sched_job *j, const char *what, kiln_stage holder,
                        double now);
/* Sends `free` to the owners of the shm / cuda_ipc references in refs[n]
 * (one message per owner incarnation; none to an owner whose incarnation
 * is not the one that made them: its memory went with it). */
void sched_free_refs(kiln_sched *s, const kiln_tensor_ref *refs, int n);
void sched_free_map(kiln_sched *s, const kiln_ref_map *m);
/* The references `sender` (incarnation `epoch`) made among refs[n]: the
 * only ones a done from it may return to it. */
void sched_free_own(kiln_sched *s, const char *sender, uint64_t epoch, const kiln_ref_map *m);
/* A done or partial (m) from r may carry only references r's current
 * incarnation made.  When it carries another's: counted, what it made
 * goes back to it, m is freed, r is fenced and 1 is returned (`what`
 * names the message in the log: "answered", "sent a preview of").
 * 0 otherwise, m untouched. */
int sched_refuse_foreign(kiln_sched *s, sched_replica *r, kiln_msg *m, const char *what,
                         double now);
/* 1 when a held reference of j was made by incarnation `epoch` of `owner`. */
int sched_job_holds_from(const sched_job *j, const char *owner, uint64_t epoch);
/* Moves the job's held references to a new handoff of r (before its job
 * is sent there).  KILN_ERR_NOMEM. */
kiln_status sched_handoff_add(kiln_sched *s, sched_replica *r, sched_job *j, kiln_err *err);
/* Returns what is left of r's handoffs (all of them, or only that of job
 * `job` when job != 0) to the references' owners and forgets them. */
void sched_handoff_return(kiln_sched *s, sched_replica *r, uint64_t job);

#endif

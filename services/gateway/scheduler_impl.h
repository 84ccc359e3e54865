/* Internals of the gateway scheduler (scheduler.c: jobs, queues, dispatch;
 * scheduler_replica.c: the replica registry; scheduler_done.c: results and
 * references). */
#ifndef KILN_GW_SCHED_IMPL_H
#define KILN_GW_SCHED_IMPL_H

#include <stddef.h>

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

typedef struct sched_replica {
    sched_link node; /* in kiln_sched.replicas */
    char id[KILN_PROTO_ID_MAX];
    kiln_stage stage;
    int alive;
    int credits;
    int max_batch;
    double last_seen;
    sched_link inflight; /* jobs running here */
    int n_inflight;
    uint64_t last_job; /* kiln_sched.n_dispatched when it last got a job */
} sched_replica;

typedef enum job_state { JOB_NEW = 0, JOB_QUEUED, JOB_RUNNING } job_state;

typedef struct sched_job {
    uint64_t id;
    void *client; /* NULL once cancelled */
    kiln_api_request req;
    uint64_t *seeds; /* req.req.n */
    kiln_stage stage;
    job_state state;
    sched_replica *on; /* JOB_RUNNING */
    sched_link qnode;  /* stage queue or replica in-flight list */
    sched_link anode;  /* kiln_sched.all, in submission order */
    int redispatched;
    /* The previous stage's done (owning the current stage's input
     * references) until the current stage finishes.  `handed`: a consumer
     * holds them (it releases them); `released`: it said so. */
    kiln_msg *held;
    int handed, released;
    double t_submit, t_enqueue, t_dispatch;
} sched_job;

struct kiln_sched {
    kiln_sched_opts opts;
    char model_id[KILN_PROTO_ID_MAX];
    kiln_sched_ops ops;
    void *ud;
    kiln_metrics *metrics;
    sched_link replicas;
    sched_link queue[KILN_STAGE_COUNT];
    int queued[KILN_STAGE_COUNT], inflight[KILN_STAGE_COUNT];
    sched_link all;
    int n_jobs;
    kiln_idmap jobs;
    uint64_t next_id;
    uint64_t n_dispatched; /* jobs sent so far, all stages */
};

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
void sched_replica_lost(kiln_sched *s, sched_replica *r, const char *why, double now);
void sched_on_hello(kiln_sched *s, const char *peer, const kiln_msg_hello *h, double now);
void sched_replica_gc(kiln_sched *s, double now);

/* scheduler_done.c */
void sched_on_done(kiln_sched *s, sched_replica *r, kiln_msg *m, double now);
void sched_on_release(kiln_sched *s, sched_replica *r, const kiln_msg_refs *refs);
/* Sends `free` to the owners of the shm / cuda_ipc references in refs[n]. */
void sched_free_refs(kiln_sched *s, const kiln_tensor_ref *refs, int n);
void sched_free_map(kiln_sched *s, const kiln_ref_map *m);
/* 1 when a held reference of j is owned by replica `owner`. */
int sched_job_holds_from(const sched_job *j, const char *owner);

#endif

/* The replica registry: registration, liveness, and what happens to the
 * jobs of a replica that is gone. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

/* A dead replica's record is kept this long (its late messages revive it,
 * and its late dones are recognised) before it is forgotten. */
#define DEAD_RECORD_MS 60000.0

sched_replica *sched_replica_find(kiln_sched *s, const char *id)
{
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (strcmp(r->id, id) == 0)
            return r;
    }
    return NULL;
}

/* A job of a lost replica runs again once, elsewhere: from the same stage
 * when its inputs are intact, else from the start. */
static void retry_or_fail(kiln_sched *s, sched_job *j, const char *why, double now)
{
    kiln_stage stage = j->stage;
    if (j->redispatched || !sched_live(s, stage)) {
        sched_fail(s, j, 503, "stage_unavailable",
                   "the %s replica running this request %s and no other could take it over",
                   kiln_stage_name(stage), why);
        return;
    }
    j->redispatched = 1;
    kiln_metrics_event(s->metrics, KILN_EVENT_REDISPATCH);
    sched_detach(s, j);
    if (j->held && j->released) {
        /* The consumer gave the inputs back before it died: they are gone. */
        kiln_msg_free(j->held);
        j->held = NULL;
        stage = KILN_STAGE_ENCODE;
    }
    j->handed = 0;
    j->released = 0;
    sched_enqueue(s, j, stage, 1, now);
}

void sched_replica_lost(kiln_sched *s, sched_replica *r, const char *why, double now)
{
    if (!r->alive)
        return;
    r->alive = 0;
    kiln_metrics_event(s->metrics, KILN_EVENT_REPLICA_LOST);
    KILN_LOG_WARN("gateway: %s replica %s %s (%d job(s) in flight)", kiln_stage_name(r->stage),
                  r->id, why, r->n_inflight);
    while (!link_empty(&r->inflight))
        retry_or_fail(s, LINK_OWNER(r->inflight.next, sched_job, qnode), why, now);
    /* Queued jobs whose inputs lived in the lost replica's memory start
     * over too. */
    for (int st = KILN_STAGE_DENOISE; st < KILN_STAGE_COUNT; st++)
        for (sched_link *l = s->queue[st].next, *next; l != &s->queue[st]; l = next) {
            next = l->next;
            sched_job *j = LINK_OWNER(l, sched_job, qnode);
            if (!sched_job_holds_from(j, r->id))
                continue;
            if (j->redispatched) {
                sched_fail(s, j, 503, "stage_unavailable",
                           "the %s replica holding this request's data %s",
                           kiln_stage_name(r->stage), why);
                continue;
            }
            j->redispatched = 1;
            kiln_metrics_event(s->metrics, KILN_EVENT_REDISPATCH);
            kiln_msg_free(j->held); /* their memory went with the replica */
            j->held = NULL;
            sched_enqueue(s, j, KILN_STAGE_ENCODE, 1, now);
        }
    if (sched_live(s, r->stage))
        return;
    while (!link_empty(&s->queue[r->stage]))
        sched_fail(s, LINK_OWNER(s->queue[r->stage].next, sched_job, qnode), 503,
                   "stage_unavailable", "no %s replica is available", kiln_stage_name(r->stage));
}

void sched_on_hello(kiln_sched *s, const char *peer, const kiln_msg_hello *h, double now)
{
    if (strcmp(h->model, s->model_id) != 0) {
        KILN_LOG_ERROR("gateway: replica %s serves model '%s', not '%s': refused", peer, h->model,
                       s->model_id);
        return;
    }
    if (strcmp(h->replica, peer) != 0)
        KILN_LOG_WARN("gateway: replica %s says its id is %s; using the routing id", peer,
                      h->replica);
    sched_replica *r = sched_replica_find(s, peer);
    if (r && r->stage != h->stage) {
        /* The same id now serves another stage: the old one is gone. */
        r->alive = 1;
        sched_replica_lost(s, r, "re-registered for another stage", now);
    }
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) {
            KILN_LOG_ERROR("gateway: out of memory registering %s", peer);
            return;
        }
        snprintf(r->id, sizeof r->id, "%s", peer);
        link_init(&r->inflight);
        link_insert_before(&s->replicas, &r->node);
        KILN_LOG_INFO("gateway: %s replica %s registered (host %s, max batch %d)",
                      kiln_stage_name(h->stage), peer, h->host, h->max_batch);
    }
    /* Its in-flight jobs stay in flight; credits come anew with `ready`. */
    r->stage = h->stage;
    r->alive = 1;
    r->credits = 0;
    r->max_batch = h->max_batch;
    r->last_seen = now;
}

void sched_replica_gc(kiln_sched *s, double now)
{
    for (sched_link *l = s->replicas.next, *next; l != &s->replicas; l = next) {
        next = l->next;
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (!r->alive && !r->n_inflight && now - r->last_seen > DEAD_RECORD_MS) {
            link_remove(&r->node);
            free(r);
        }
    }
}

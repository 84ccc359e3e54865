/* Cancels a replica has not acknowledged yet.  A job running on a replica
 * when the gateway gives up on it (its client left, it timed out, another
 * stage failed it) is told `cancel`; the job is gone from the gateway at
 * once, but the replica keeps computing until it sees the cancel, and
 * answers with a `done` when it has stopped.  Until then the replica is
 * busy (kiln_replicas_busy).
 *
 * A replica whose only work is cancelled jobs and that has not answered
 * within opts.cancel_timeout_ms is fenced (sched_replica_fence: it exits
 * and is restarted): its capacity is taken by work nobody waits for and
 * it no longer does what it is told.  While it still has live jobs in
 * flight the clock does not run: a cancelled job batched with live ones is
 * answered when the batch ends (services/denoiser: a batch stops only when
 * all its jobs are cancelled), however long that takes, and a replica that
 * hangs with live work is the progress check's (kiln_sched_tick).  So the
 * bound is cancel_timeout_ms from the cancel or from the end of its last
 * live job, whichever is later, give or take a tick. */
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "scheduler_impl.h"

typedef struct sched_cancelling {
    sched_link node; /* in sched_replica.cancelling, oldest first */
    uint64_t job;
    double t; /* when the cancel was sent */
} sched_cancelling;

void sched_cancel_sent(sched_replica *r, uint64_t job, double now)
{
    sched_cancelling *c = calloc(1, sizeof *c);
    if (!c) {
        /* Untracked: the replica looks idle early; nothing else changes. */
        KILN_LOG_WARN("gateway: out of memory tracking the cancel of job %llu",
                      (unsigned long long)job);
        return;
    }
    c->job = job;
    c->t = now;
    link_insert_before(&r->cancelling, &c->node);
    r->n_cancelling++;
}

void sched_cancel_answered(sched_replica *r, uint64_t job)
{
    for (sched_link *l = r->cancelling.next; l != &r->cancelling; l = l->next) {
        sched_cancelling *c = LINK_OWNER(l, sched_cancelling, node);
        if (c->job == job) {
            link_remove(&c->node);
            free(c);
            r->n_cancelling--;
            return;
        }
    }
}

void sched_cancel_forget(sched_replica *r)
{
    while (!link_empty(&r->cancelling)) {
        sched_cancelling *c = LINK_OWNER(r->cancelling.next, sched_cancelling, node);
        link_remove(&c->node);
        free(c);
    }
    r->n_cancelling = 0;
}

void sched_cancel_shift(sched_replica *r, double gap)
{
    r->live_at += gap;
    for (sched_link *l = r->cancelling.next; l != &r->cancelling; l = l->next)
        LINK_OWNER(l, sched_cancelling, node)->t += gap;
}

void sched_cancel_overdue(kiln_sched *s, double now)
{
    if (s->opts.cancel_timeout_ms <= 0)
        return;
    for (sched_link *l = s->replicas.next, *next; l != &s->replicas; l = next) {
        next = l->next;
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (!r->alive || link_empty(&r->cancelling))
            continue;
        if (r->n_inflight) {
            r->live_at = now;
            continue;
        }
        const sched_cancelling *oldest = LINK_OWNER(r->cancelling.next, sched_cancelling, node);
        double since = oldest->t > r->live_at ? oldest->t : r->live_at;
        if (now - since <= s->opts.cancel_timeout_ms)
            continue;
        char why[128];
        snprintf(why, sizeof why, "did not stop cancelled job %llu within %.0f s",
                 (unsigned long long)oldest->job, s->opts.cancel_timeout_ms / 1000.0);
        kiln_metrics_event(s->metrics, KILN_EVENT_CANCEL_TIMEOUT);
        sched_replica_fence(s, r, why, now);
    }
}

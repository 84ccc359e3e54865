/* The replica registry: registration, fencing, and what happens to the
 * jobs and references of an incarnation that is gone. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

/* A fenced incarnation's record is kept this long (its late messages are
 * recognised and answered `fenced`) before only a tombstone remains. */
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

static void bury(kiln_sched *s, const sched_replica *r)
{
    snprintf(s->tombs[s->next_tomb].id, sizeof s->tombs[0].id, "%s", r->id);
    s->tombs[s->next_tomb].epoch = r->epoch;
    s->tombs[s->next_tomb].left = r->left;
    s->next_tomb = (s->next_tomb + 1) % SCHED_TOMBSTONES;
    if (s->n_tombs < SCHED_TOMBSTONES)
        s->n_tombs++;
}

/* 0: incarnation (id, epoch) has no tombstone; 1: it was fenced; 2: it left. */
static int buried(const kiln_sched *s, const char *id, uint64_t epoch)
{
    for (int i = 0; i < s->n_tombs; i++)
        if (s->tombs[i].epoch == epoch && !strcmp(s->tombs[i].id, id))
            return s->tombs[i].left ? 2 : 1;
    return 0;
}

static void send_fenced(kiln_sched *s, const char *peer, uint64_t epoch)
{
    kiln_msg m = {.type = KILN_MSG_FENCED, .epoch = epoch};
    kiln_err err = {0};
    if (s->ops.send(s->ud, peer, &m, &err))
        KILN_LOG_DEBUG("gateway: fenced to %s: %s", peer, err.msg);
}

/* Tells every live replica that incarnation r is gone, so that consumers
 * drop their mappings of its slabs (its references are not handed out
 * again; mappings in use go when their job is done). */
static void announce_gone(kiln_sched *s, const sched_replica *r)
{
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *x = LINK_OWNER(l, sched_replica, node);
        if (x == r || !x->alive)
            continue;
        kiln_msg m = {.type = KILN_MSG_GONE, .epoch = x->epoch,
                      .gone = {.replica = r->id, .incarnation = r->epoch}};
        kiln_err err = {0};
        if (s->ops.send(s->ud, x->id, &m, &err))
            KILN_LOG_DEBUG("gateway: gone to %s: %s", x->id, err.msg);
    }
}

/* A job of a fenced incarnation runs again once, elsewhere, from the
 * encode stage: the references it was handed went back to their owners
 * (the fenced incarnation may still read them, so they are never handed
 * on again), and whatever it made does not count. */
void sched_rerun_or_fail(kiln_sched *s, sched_job *j, const char *stage, const char *why,
                         double now)
{
    if (j->parent) { /* a preview is not run again: sched_fail ends it */
        sched_fail(s, j, 503, "stage_unavailable", "the %s replica %s", stage, why);
        return;
    }
    if (j->redispatched || !sched_live(s, KILN_STAGE_ENCODE)) {
        sched_fail(s, j, 503, "stage_unavailable",
                   "the %s replica %s this request %s and no other could take it over", stage,
                   j->state == JOB_RUNNING ? "running" : "holding the data of", why);
        return;
    }
    j->redispatched = 1;
    kiln_metrics_event(s->metrics, KILN_EVENT_REDISPATCH);
    if (j->held) {
        sched_free_map(s, &j->held->done.out);
        kiln_msg_free(j->held);
        j->held = NULL;
    }
    sched_enqueue(s, j, KILN_STAGE_ENCODE, 1, now);
}

/* Ends incarnation r: fenced (lost) or, after `leaving`, left. */
static void end_incarnation(kiln_sched *s, sched_replica *r, const char *why, int left,
                            double now)
{
    if (!r->alive)
        return;
    r->alive = 0;
    r->left = left;
    r->credits = 0;
    kiln_metrics_event(s->metrics, left ? KILN_EVENT_REPLICA_LEFT : KILN_EVENT_REPLICA_LOST);
    if (left)
        KILN_LOG_INFO("gateway: %s replica %s epoch %016llx left (%d job(s) in flight)",
                      kiln_stage_name(r->stage), r->id, (unsigned long long)r->epoch,
                      r->n_inflight);
    else
        KILN_LOG_WARN("gateway: %s replica %s epoch %016llx %s: fenced (%d job(s) in flight)",
                      kiln_stage_name(r->stage), r->id, (unsigned long long)r->epoch, why,
                      r->n_inflight);
    /* Nothing it holds will be released by it any more. */
    sched_handoff_return(s, r, 0);
    sched_cancel_forget(r); /* it is no longer busy for us: it goes */
    while (!link_empty(&r->inflight))
        sched_rerun_or_fail(s, LINK_OWNER(r->inflight.next, sched_job, qnode),
                      kiln_stage_name(r->stage), why, now);
    /* Queued jobs whose inputs it made start over too; the ranges go back
     * to it while it still runs. */
    for (int st = KILN_STAGE_DENOISE; st < KILN_STAGE_COUNT; st++)
        for (kiln_fairq_node *n = kiln_fairq_first(&s->queue[st]), *next; n; n = next) {
            next = kiln_fairq_next(&s->queue[st], n);
            sched_job *j = FQ_JOB(n);
            if (sched_job_holds_from(j, r->id, r->epoch))
                sched_rerun_or_fail(s, j, kiln_stage_name(r->stage), why, now);
        }
    sched_preview_fenced(s, r->id, r->epoch);
    /* It may still be running (paused, stuck, cut off): it exits when it
     * hears this.  One that left exits by itself, with 0. */
    if (!left)
        send_fenced(s, r->id, r->epoch);
    announce_gone(s, r);
    if (s->opts.images) /* the gateway's own mappings of its image slabs */
        kiln_transport_forget(s->opts.images, r->epoch);
    if (sched_live(s, r->stage))
        return;
    for (kiln_fairq_node *n; (n = kiln_fairq_peek(&s->queue[r->stage]));)
        sched_fail(s, FQ_JOB(n), 503,
                   "stage_unavailable", "no %s replica is available", kiln_stage_name(r->stage));
}

/* A fenced replica's process is lost for all its stages (kiln-stages
 * halts them together): its siblings are fenced now, not one by one as
 * their byes or silences arrive, so that no job re-run from r lands on a
 * sibling that is about to go, spending its one re-run. */
static void fence_siblings(kiln_sched *s, const sched_replica *r, double now)
{
    if (!r->process[0])
        return;
    char why[KILN_PROTO_ID_MAX + 64];
    snprintf(why, sizeof why, "shares its process with %s, which was fenced", r->id);
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        sched_replica *x = LINK_OWNER(l, sched_replica, node);
        if (x != r && x->alive && !strcmp(x->process, r->process))
            end_incarnation(s, x, why, 0, now);
    }
}

void sched_replica_fence(kiln_sched *s, sched_replica *r, const char *why, double now)
{
    if (!r->alive)
        return;
    end_incarnation(s, r, why, 0, now);
    fence_siblings(s, r, now);
}

void sched_replica_left(kiln_sched *s, sched_replica *r, double now)
{
    end_incarnation(s, r, "left", 1, now);
}

void sched_replica_leaving(sched_replica *r)
{
    if (!r->alive || r->leaving)
        return;
    r->leaving = 1;
    r->credits = 0;
    KILN_LOG_INFO("gateway: %s replica %s epoch %016llx is leaving: no new work; its %d job(s) "
                  "in flight finish there", kiln_stage_name(r->stage), r->id,
                  (unsigned long long)r->epoch, r->n_inflight);
}

void sched_on_stale(kiln_sched *s, sched_replica *r, const char *peer, kiln_msg *m)
{
    int ours = r && r->epoch == m->epoch, tomb = ours ? 0 : buried(s, peer, m->epoch);
    if ((ours && r->left) || tomb == 2) {
        /* A heartbeat it sent before its `bye` was read: it is on its way
         * out, exiting with 0; nothing to refuse and nothing to tell it. */
        if (m->type == KILN_MSG_DONE || m->type == KILN_MSG_PARTIAL)
            sched_free_own(s, peer, m->epoch, &m->done.out);
        KILN_LOG_DEBUG("gateway: ignored a %s from %s epoch %016llx (it left)",
                       kiln_msg_type_name(m->type), peer, (unsigned long long)m->epoch);
        return;
    }
    int fenced = ours || tomb;
    if (fenced && m->type == KILN_MSG_BYE) {
        /* Its halt crossed our fence (a sibling's fence ends it first):
         * nothing to refuse, and it is already on its way out. */
        KILN_LOG_DEBUG("gateway: ignored a bye from %s epoch %016llx (fenced before it)", peer,
                       (unsigned long long)m->epoch);
        return;
    }
    kiln_metrics_rejected(s->metrics, fenced ? KILN_REJECT_FENCED : KILN_REJECT_UNREGISTERED, 1);
    if (m->type == KILN_MSG_DONE || m->type == KILN_MSG_PARTIAL) {
        /* Its outputs are its own memory: back to it (a fenced incarnation
         * drains them before it exits; an unregistered one may be a
         * replica whose hello is still on its way after a gateway restart). */
        sched_free_own(s, peer, m->epoch, &m->done.out);
    }
    KILN_LOG_DEBUG("gateway: ignored a %s from %s epoch %016llx (%s)", kiln_msg_type_name(m->type),
                   peer, (unsigned long long)m->epoch, fenced ? "fenced" : "unregistered");
    if (fenced)
        send_fenced(s, peer, m->epoch);
}

void sched_on_hello(kiln_sched *s, const char *peer, const kiln_msg *m, double now)
{
    const kiln_msg_hello *h = &m->hello;
    if (strcmp(h->model, s->model_id) != 0) {
        KILN_LOG_ERROR("gateway: replica %s serves model '%s', not '%s': refused", peer, h->model,
                       s->model_id);
        return;
    }
    if (s->have_traits && !kiln_model_traits_equal(&s->traits, &h->traits)) {
        /* Same folder name, other contents (or another kiln's rules): its
         * requests would be resolved against the wrong defaults. */
        KILN_LOG_ERROR("gateway: replica %s serves '%s' with other traits (%s: %d steps, "
                       "guidance %g, CFG %d) than the replicas before it (%s: %d steps, "
                       "guidance %g, CFG %d): refused", peer, h->model, h->traits.family,
                       h->traits.default_steps, (double)h->traits.default_guidance,
                       h->traits.cfg, s->traits.family, s->traits.default_steps,
                       (double)s->traits.default_guidance, s->traits.cfg);
        return;
    }
    if (strcmp(h->replica, peer) != 0)
        KILN_LOG_WARN("gateway: replica %s says its id is %s; using the routing id", peer,
                      h->replica);
    sched_replica *r = sched_replica_find(s, peer);
    if (buried(s, peer, m->epoch) || (r && r->epoch == m->epoch && !r->alive)) {
        send_fenced(s, peer, m->epoch); /* a fenced incarnation never comes back */
        return;
    }
    if (r && r->epoch == m->epoch) {
        /* The same incarnation again: its connection was re-established,
         * and messages queued on the old one may have been lost both ways
         * (jobs, dones, releases, frees), which nothing could reconcile.
         * It starts afresh instead. */
        sched_replica_fence(s, r, "reconnected (messages may have been lost)", now);
        return;
    }
    if (r) {
        sched_replica_fence(s, r, "was replaced by a new incarnation", now);
        bury(s, r);
    } else {
        r = calloc(1, sizeof *r);
        if (!r) {
            KILN_LOG_ERROR("gateway: out of memory registering %s", peer);
            return;
        }
        snprintf(r->id, sizeof r->id, "%s", peer);
        link_init(&r->inflight);
        link_init(&r->handoffs);
        link_init(&r->cancelling);
        link_insert_before(&s->replicas, &r->node);
    }
    KILN_LOG_INFO("gateway: %s replica %s registered (epoch %016llx, host %s, max batch %d, "
                  "domain %.13s shm %s, %s)", kiln_stage_name(h->stage), peer,
                  (unsigned long long)m->epoch, h->host, h->max_batch, h->domain.host,
                  h->domain.shm[0] ? h->domain.shm : "none",
                  h->data && h->data[0] ? h->data : "no data socket");
    if (!s->have_traits) {
        s->traits = h->traits;
        s->have_traits = 1;
        KILN_LOG_INFO("gateway: model '%s' is of family %s: %d steps and guidance %g by default, "
                      "%s%s%s", h->model, h->traits.family, h->traits.default_steps,
                      (double)h->traits.default_guidance,
                      !h->traits.cfg ? "no CFG"
                      : h->traits.cfg_above_zero ? "CFG when guidance > 0"
                                                 : "CFG when guidance > 1",
                      h->traits.kv_cache ? ", reference K/V cache" : "",
                      h->traits.no_references ? ", edits are img2img or inpainting only" : "");
    }
    /* Fencing emptied the record of the incarnation before; credits come
     * with `ready`. */
    r->epoch = m->epoch;
    r->stage = h->stage;
    r->alive = 1;
    r->leaving = 0;
    r->left = 0;
    r->credits = 0;
    r->max_batch = h->max_batch;
    r->last_seen = now;
    r->progress = 0;
    r->shm_short = 0;
    r->progress_at = now;
    r->domain = h->domain;
    r->transports = h->transports;
    snprintf(r->data, sizeof r->data, "%s", h->data ? h->data : "");
    snprintf(r->data_key, sizeof r->data_key, "%s", h->data_key ? h->data_key : "");
    snprintf(r->process, sizeof r->process, "%s", h->process ? h->process : "");
}

void sched_replica_gc(kiln_sched *s, double now)
{
    for (sched_link *l = s->replicas.next, *next; l != &s->replicas; l = next) {
        next = l->next;
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (!r->alive && now - r->last_seen > DEAD_RECORD_MS) {
            bury(s, r);
            link_remove(&r->node);
            sched_cancel_forget(r);
            free(r);
        }
    }
}

int kiln_sched_traits(const kiln_sched *s, kiln_model_traits *out)
{
    if (s->have_traits)
        *out = s->traits;
    return s->have_traits;
}

/* Previews of streamed requests (partial_images): the denoiser's
 * `partial` latents decoded like final ones and answered in order before
 * the request's finish (scheduler.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

int sched_preview_running(const sched_job *j)
{
    for (const sched_link *l = j->previews.next; l != &j->previews; l = l->next)
        if (LINK_OWNER(l, sched_job, pnode)->state == JOB_RUNNING)
            return 1;
    return 0;
}

/* 1 when the request still wants preview `index` from its denoise job on
 * r: it streams to a client, asked for that many, runs there now, and has
 * not sent a later one (a re-run's previews start over at 0). */
static int wanted(const kiln_sched *s, const sched_job *j, const sched_replica *r, int index)
{
    return j && !j->parent && j->client && j->req.stream && s->ops.partial &&
           index < j->req.partial_images && index > j->last_preview &&
           j->state == JOB_RUNNING && j->on == r && j->stage == KILN_STAGE_DENOISE;
}

void sched_on_partial(kiln_sched *s, sched_replica *r, kiln_msg *m, double now)
{
    if (sched_refuse_foreign(s, r, m, "sent a preview of", now))
        return;
    const kiln_msg_done *d = &m->done;
    sched_job *j = kiln_idmap_get(&s->jobs, d->job);
    sched_job *p = wanted(s, j, r, d->preview) ? calloc(1, sizeof *p) : NULL;
    kiln_err err = {0};
    if (p && kiln_idmap_put(&s->jobs, s->next_id, p, &err)) {
        free(p);
        p = NULL;
    }
    if (!p) {
        sched_free_map(s, &d->out); /* nobody shows it: the range goes back */
        kiln_msg_free(m);
        return;
    }
    p->id = s->next_id++;
    p->parent = j;
    p->preview = d->preview;
    snprintf(p->req.request_id, sizeof p->req.request_id, "%s", j->req.request_id);
    p->stage = KILN_STAGE_DECODE;
    p->state = JOB_QUEUED;
    p->held = m; /* its input: the estimate's latents */
    p->t_submit = p->t_enqueue = now;
    link_init(&p->qnode), link_init(&p->anode), link_init(&p->previews);
    link_insert_before(&s->previews, &p->pq);
    link_insert_before(&j->previews, &p->pnode);
    s->n_jobs++;
}

void sched_preview_end(kiln_sched *s, sched_job *p)
{
    sched_job *j = p->parent;
    sched_destroy_job(s, p);
    if (j->final && !sched_preview_running(j)) {
        kiln_msg *m = j->final;
        j->final = NULL;
        sched_complete(s, j, m);
    }
}

void sched_preview_done(kiln_sched *s, sched_job *p, kiln_msg *m, double now)
{
    (void)now;
    const kiln_msg_done *d = &m->done;
    sched_job *j = p->parent;
    sched_detach(s, p);
    if (!d->ok)
        KILN_LOG_INFO("gateway: request %s: preview %d failed on the decode stage: %s: %s",
                      j->req.request_id, p->preview, kiln_status_name(d->code),
                      d->message ? d->message : "");
    else if (d->n_images != j->req.plan.req.n)
        KILN_LOG_ERROR("gateway: request %s: preview %d came back with %d images for %d",
                       j->req.request_id, p->preview, d->n_images, j->req.plan.req.n);
    else if (j->client && p->preview > j->last_preview) {
        /* Later previews only: one overtaken by a newer one is stale. */
        j->last_preview = p->preview;
        kiln_sched_partial res = {.index = p->preview, .n_images = d->n_images,
                                  .images = d->images, .seeds = j->seeds, .req = &j->req};
        s->ops.partial(s->ud, j->client, &res);
    }
    sched_free_map(s, &d->out);
    kiln_msg_free(m);
    sched_preview_end(s, p);
}

void sched_preview_drop_queued(kiln_sched *s, sched_job *j)
{
    for (sched_link *l = j->previews.next, *next; l != &j->previews; l = next) {
        next = l->next;
        sched_job *p = LINK_OWNER(l, sched_job, pnode);
        if (p->state == JOB_QUEUED)
            sched_destroy_job(s, p);
    }
}

void sched_preview_fenced(kiln_sched *s, const char *owner, uint64_t epoch)
{
    for (sched_link *l = s->previews.next, *next; l != &s->previews; l = next) {
        next = l->next;
        sched_job *p = LINK_OWNER(l, sched_job, pq);
        /* queued: its request has no final images yet, nothing to complete */
        if (sched_job_holds_from(p, owner, epoch))
            sched_destroy_job(s, p);
    }
}

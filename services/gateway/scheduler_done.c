/* Results from replicas, and the references that travel with them. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

static int releasable(const kiln_tensor_ref *r)
{
    return r->kind == KILN_REF_SHM || r->kind == KILN_REF_CUDA_IPC;
}

void sched_free_refs(kiln_sched *s, const kiln_tensor_ref *refs, int n)
{
    /* One `free` per owner; references are few (a job's map, or one
     * release), so grouping by repeated scans is cheap. */
    int sent[KILN_PROTO_MAX_REFS] = {0};
    for (int i = 0; i < n; i++) {
        if (sent[i] || !releasable(&refs[i]))
            continue;
        kiln_msg m = {.type = KILN_MSG_FREE};
        for (int k = i; k < n; k++)
            if (!sent[k] && releasable(&refs[k]) && strcmp(refs[k].owner, refs[i].owner) == 0) {
                m.refs.refs[m.refs.n++] = refs[k];
                sent[k] = 1;
            }
        sched_replica *r = sched_replica_find(s, refs[i].owner);
        if (r && !r->alive)
            continue; /* its pool went with it */
        kiln_err err = {0};
        if (s->ops.send(s->ud, refs[i].owner, &m, &err))
            KILN_LOG_WARN("gateway: free to %s: %s", refs[i].owner, err.msg);
    }
}

void sched_free_map(kiln_sched *s, const kiln_ref_map *map)
{
    kiln_tensor_ref refs[KILN_PROTO_MAX_TENSORS];
    for (int i = 0; i < map->n; i++)
        refs[i] = map->items[i].ref;
    sched_free_refs(s, refs, map->n);
}

static int same_ref(const kiln_tensor_ref *a, const kiln_tensor_ref *b)
{
    return a->kind == b->kind && a->off == b->off && strcmp(a->owner, b->owner) == 0 &&
           strcmp(a->slab, b->slab) == 0;
}

int sched_job_holds_from(const sched_job *j, const char *owner)
{
    if (!j->held)
        return 0;
    const kiln_ref_map *map = &j->held->done.out;
    for (int i = 0; i < map->n; i++)
        if (releasable(&map->items[i].ref) && strcmp(map->items[i].ref.owner, owner) == 0)
            return 1;
    return 0;
}

void sched_on_release(kiln_sched *s, sched_replica *r, const kiln_msg_refs *rel)
{
    sched_free_refs(s, rel->refs, rel->n);
    if (!r)
        return;
    /* A job whose inputs came back cannot be re-run from its stage. */
    for (sched_link *l = r->inflight.next; l != &r->inflight; l = l->next) {
        sched_job *j = LINK_OWNER(l, sched_job, qnode);
        if (!j->held)
            continue;
        const kiln_ref_map *map = &j->held->done.out;
        for (int i = 0; i < map->n && !j->released; i++)
            for (int k = 0; k < rel->n; k++)
                if (same_ref(&map->items[i].ref, &rel->refs[k])) {
                    j->released = 1;
                    break;
                }
    }
}

/* The HTTP status an error done maps to. */
static int status_of(kiln_status code, const char **api_code)
{
    switch (code) {
    case KILN_ERR_INVALID: *api_code = "invalid_value"; return 400;
    case KILN_ERR_TOO_LARGE: *api_code = "too_large"; return 413;
    case KILN_ERR_BUSY: *api_code = "busy"; return 429;
    case KILN_ERR_UNAVAILABLE:
    case KILN_ERR_NOMEM:
    case KILN_ERR_CANCELLED: *api_code = "stage_unavailable"; return 503;
    default: *api_code = "server_error"; return 500;
    }
}

static const char *timing_phase_name(kiln_stage st)
{
    return st == KILN_STAGE_ENCODE ? "encode" : st == KILN_STAGE_DENOISE ? "denoise" : "decode";
}

/* A timing of the done message, in milliseconds, or -1 when absent. */
static double timing(const kiln_msg_done *d, const char *name)
{
    for (int i = 0; i < d->n_ms; i++)
        if (strcmp(d->ms[i].name, name) == 0)
            return d->ms[i].ms;
    return -1;
}

static void part(kiln_sched *s, kiln_part p, double ms)
{
    if (ms >= 0)
        kiln_metrics_part(s->metrics, p, ms / 1000.0);
}

static void record(kiln_sched *s, const sched_job *j, const kiln_msg_done *d, double now)
{
    double at_gateway = now - j->t_dispatch;
    kiln_metrics_latency(s->metrics, (kiln_phase)(KILN_PHASE_ENCODE + j->stage),
                         at_gateway / 1000.0);
    /* The replica reports the rows of the batch the job ran in as the
     * timing "batch_rows"; without it the job's own rows count. */
    double rows = timing(d, "batch_rows");
    kiln_metrics_batch(s->metrics, j->stage,
                       rows >= 1 ? (int)rows : j->stage == KILN_STAGE_ENCODE ? 1 : j->req.req.n);
    double queue = timing(d, "queue"), run = timing(d, "run");
    if (queue >= 0 && run >= 0)
        part(s, KILN_PART_HANDOFF, at_gateway - queue - run);
    switch (j->stage) {
    case KILN_STAGE_ENCODE: part(s, KILN_PART_ENCODE_RUN, run); break;
    case KILN_STAGE_DENOISE:
        part(s, KILN_PART_DENOISE_SETUP, timing(d, "setup"));
        part(s, KILN_PART_DENOISE_STEP, timing(d, "step"));
        break;
    default:
        part(s, KILN_PART_DECODE_VAE, timing(d, "vae"));
        part(s, KILN_PART_IMAGE_ENCODE, timing(d, "image_encode"));
        break;
    }
}

static void complete(kiln_sched *s, sched_job *j, kiln_msg *m, double now)
{
    const kiln_msg_done *d = &m->done;
    const kiln_request *q = &j->req.req;
    if (d->n_images != q->n) {
        KILN_LOG_ERROR("gateway: job %llu: decoder returned %d images for %d",
                       (unsigned long long)j->id, d->n_images, q->n);
        sched_fail(s, j, 500, "server_error", "the decode stage returned a wrong result");
        kiln_msg_free(m);
        return;
    }
    kiln_metrics_latency(s->metrics, KILN_PHASE_TOTAL, (now - j->t_submit) / 1000.0);
    kiln_metrics_images(s->metrics, q->n);
    if (j->client) {
        kiln_sched_result res = {.status = 200, .n_images = d->n_images, .images = d->images,
                                 .seeds = j->seeds, .req = &j->req};
        s->ops.finish(s->ud, j->client, &res);
    }
    kiln_msg_free(m);
    sched_destroy_job(s, j);
}

/* A consumer could not open its inputs (KILN_ERR_NOT_FOUND): their
 * producer died and its slabs were removed before they were opened.  As
 * for the jobs of a lost replica: once more from the start, else 503. */
static void restart_lost_inputs(kiln_sched *s, sched_job *j, double now)
{
    const char *producer = kiln_stage_name((kiln_stage)(j->stage - 1));
    sched_detach(s, j);
    if (j->redispatched) {
        sched_fail(s, j, 503, "stage_unavailable",
                   "the %s replica holding this request's data stopped", producer);
        return;
    }
    KILN_LOG_WARN("gateway: job %llu: its inputs from a %s replica are gone; starting over",
                  (unsigned long long)j->id, producer);
    j->redispatched = 1;
    kiln_metrics_event(s->metrics, KILN_EVENT_REDISPATCH);
    sched_enqueue(s, j, KILN_STAGE_ENCODE, 1, now);
}

void sched_on_done(kiln_sched *s, sched_replica *r, kiln_msg *m, double now)
{
    const kiln_msg_done *d = &m->done;
    sched_job *j = kiln_idmap_get(&s->jobs, d->job);
    if (r)
        r->credits++; /* each done returns a credit */
    if (!j || j->state != JOB_RUNNING || j->on != r) {
        /* Cancelled, timed out, or re-dispatched away from this replica:
         * what it made goes back. */
        sched_free_map(s, &d->out);
        kiln_msg_free(m);
        return;
    }
    record(s, j, d, now);
    /* The consumer is done with its inputs (it released them). */
    if (j->held) {
        kiln_msg_free(j->held);
        j->held = NULL;
    }
    j->handed = j->released = 0;
    kiln_stage stage = j->stage;
    if (!d->ok && d->code == KILN_ERR_NOT_FOUND && stage != KILN_STAGE_ENCODE) {
        sched_free_map(s, &d->out);
        kiln_msg_free(m);
        restart_lost_inputs(s, j, now);
        return;
    }
    if (!d->ok) {
        const char *code;
        int status = status_of(d->code, &code);
        sched_free_map(s, &d->out);
        if (status >= 500)
            KILN_LOG_ERROR("gateway: job %llu: %s stage failed on %s: %s: %s",
                           (unsigned long long)j->id, kiln_stage_name(stage), r->id,
                           kiln_status_name(d->code), d->message ? d->message : "");
        sched_detach(s, j);
        if (status == 400)
            sched_fail(s, j, status, code, "%s", d->message ? d->message : "invalid request");
        else
            sched_fail(s, j, status, code, "the %s stage failed: %s", timing_phase_name(stage),
                       d->message ? d->message : kiln_status_name(d->code));
        kiln_msg_free(m);
        return;
    }
    if (stage == KILN_STAGE_DECODE) {
        sched_detach(s, j);
        complete(s, j, m, now);
        return;
    }
    const char *need = stage == KILN_STAGE_ENCODE ? "embeds" : "latents";
    if (!kiln_ref_map_get(&d->out, need)) {
        KILN_LOG_ERROR("gateway: job %llu: %s done without '%s'", (unsigned long long)j->id,
                       kiln_stage_name(stage), need);
        sched_free_map(s, &d->out);
        sched_detach(s, j);
        sched_fail(s, j, 500, "server_error", "the %s stage returned a wrong result",
                   timing_phase_name(stage));
        kiln_msg_free(m);
        return;
    }
    j->held = m; /* the next stage's inputs */
    sched_enqueue(s, j, (kiln_stage)(stage + 1), 0, now);
}

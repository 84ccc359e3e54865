/* Results from replicas, and the references that travel with them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

static int releasable(const kiln_tensor_ref *r)
{
    return r->kind == KILN_REF_SHM || r->kind == KILN_REF_CUDA_IPC;
}

static int same_owner(const kiln_tensor_ref *a, const kiln_tensor_ref *b)
{
    return a->epoch == b->epoch && strcmp(a->owner, b->owner) == 0;
}

void sched_free_refs(kiln_sched *s, const kiln_tensor_ref *refs, int n)
{
    /* One `free` per owner incarnation; references are few (a job's map,
     * or one release), so grouping by repeated scans is cheap. */
    int sent[KILN_PROTO_MAX_REFS] = {0};
    for (int i = 0; i < n && i < KILN_PROTO_MAX_REFS; i++) {
        if (sent[i] || !releasable(&refs[i]))
            continue;
        kiln_msg m = {.type = KILN_MSG_FREE, .epoch = refs[i].epoch};
        for (int k = i; k < n && k < KILN_PROTO_MAX_REFS; k++)
            if (!sent[k] && releasable(&refs[k]) && same_owner(&refs[k], &refs[i])) {
                m.refs.refs[m.refs.n++] = refs[k];
                sent[k] = 1;
            }
        /* A fenced incarnation that still runs gets its ranges back (it
         * waits for them before it exits); one replaced by another
         * incarnation took its memory along. */
        sched_replica *r = sched_replica_find(s, refs[i].owner);
        if (!r || r->epoch != refs[i].epoch)
            continue;
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

void sched_free_own(kiln_sched *s, const char *sender, uint64_t epoch, const kiln_ref_map *map)
{
    kiln_tensor_ref refs[KILN_PROTO_MAX_TENSORS];
    int n = 0;
    for (int i = 0; i < map->n; i++)
        if (map->items[i].ref.epoch == epoch && !strcmp(map->items[i].ref.owner, sender))
            refs[n++] = map->items[i].ref;
    sched_free_refs(s, refs, n);
}

static int same_ref(const kiln_tensor_ref *a, const kiln_tensor_ref *b)
{
    return a->kind == b->kind && a->off == b->off && a->len == b->len && a->gen == b->gen &&
           same_owner(a, b) && strcmp(a->slab, b->slab) == 0;
}

int sched_job_holds_from(const sched_job *j, const char *owner, uint64_t epoch)
{
    if (!j->held)
        return 0;
    const kiln_ref_map *map = &j->held->done.out;
    for (int i = 0; i < map->n; i++)
        if (releasable(&map->items[i].ref) && map->items[i].ref.epoch == epoch &&
            strcmp(map->items[i].ref.owner, owner) == 0)
            return 1;
    return 0;
}

kiln_status sched_handoff_add(kiln_sched *s, sched_replica *r, sched_job *j, kiln_err *err)
{
    (void)s;
    sched_handoff *h = calloc(1, sizeof *h);
    if (!h)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    h->job = j->id;
    const kiln_ref_map *map = &j->held->done.out;
    for (int i = 0; i < map->n; i++)
        if (releasable(&map->items[i].ref))
            h->refs[h->n++] = map->items[i].ref;
    link_insert_before(&r->handoffs, &h->node);
    return KILN_OK;
}

void sched_handoff_return(kiln_sched *s, sched_replica *r, uint64_t job)
{
    for (sched_link *l = r->handoffs.next, *next; l != &r->handoffs; l = next) {
        next = l->next;
        sched_handoff *h = LINK_OWNER(l, sched_handoff, node);
        if (job && h->job != job)
            continue;
        kiln_tensor_ref left[KILN_PROTO_MAX_TENSORS];
        int n = 0;
        for (int i = 0; i < h->n; i++)
            if (!(h->freed & (1u << i)))
                left[n++] = h->refs[i];
        sched_free_refs(s, left, n);
        link_remove(&h->node);
        free(h);
    }
}

void sched_on_release(kiln_sched *s, sched_replica *r, const kiln_msg_refs *rel)
{
    kiln_tensor_ref ok[KILN_PROTO_MAX_REFS];
    int n = 0, refused = 0;
    for (int k = 0; k < rel->n; k++) {
        int found = 0;
        for (sched_link *l = r->handoffs.next; l != &r->handoffs && !found; l = l->next) {
            sched_handoff *h = LINK_OWNER(l, sched_handoff, node);
            for (int i = 0; i < h->n && !found; i++)
                if (!(h->freed & (1u << i)) && same_ref(&h->refs[i], &rel->refs[k])) {
                    h->freed |= 1u << i;
                    ok[n++] = h->refs[i];
                    found = 1;
                }
        }
        if (!found) {
            refused++;
            KILN_LOG_WARN("gateway: refused a release from %s: %s %s+%llu gen %llu of %s was not "
                          "handed to it (or was already released)", r->id,
                          kiln_ref_kind_name(rel->refs[k].kind), rel->refs[k].slab,
                          (unsigned long long)rel->refs[k].off,
                          (unsigned long long)rel->refs[k].gen, rel->refs[k].owner);
        }
    }
    if (refused)
        kiln_metrics_rejected(s->metrics, KILN_REJECT_NOT_HANDED, refused);
    sched_free_refs(s, ok, n);
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

/* Gives a span the device time a replica measured (ms; < 0: none). */
static void gpu(kiln_trace_span *sp, double ms)
{
    if (sp && ms >= 0)
        sp->gpu_ms = ms;
}

/* The stage's spans: the whole stage on the gateway's track, and on the
 * replica's its queue, its run and the run's parts, laid out from the
 * durations it reports with the unaccounted time (bus, tensor hand-offs)
 * split before and after (traces.h). */
static void trace_stage(sched_job *j, const kiln_msg_done *d, double now)
{
    static const char *const names[KILN_STAGE_COUNT][4] = {
        {"encode", "encode: handoff", "encode: replica queue", "encode: run"},
        {"denoise", "denoise: handoff", "denoise: replica queue", "denoise: run"},
        {"decode", "decode: handoff", "decode: replica queue", "decode: run"},
    };
    const char *const *nm = names[j->stage];
    kiln_trace *t = &j->trace;
    const char *rid = j->on ? j->on->id : "replica";
    kiln_trace_span_add(t, "gateway", nm[0], j->t_dispatch, now);
    double queue = timing(d, "queue"), run = timing(d, "run");
    if (queue < 0 || run < 0)
        return;
    double gap = now - j->t_dispatch - queue - run;
    double h = gap > 0 ? gap / 2 : 0;
    double a = j->t_dispatch + h, b = a + queue, c = b + run;
    kiln_trace_span_add(t, rid, nm[1], j->t_dispatch, a);
    kiln_trace_span_add(t, rid, nm[2], a, b);
    kiln_trace_span_add(t, rid, nm[3], b, c);
    if (j->stage == KILN_STAGE_ENCODE) {
        double text = timing(d, "text_encode");
        if (text >= 0)
            gpu(kiln_trace_span_add(t, rid, "encode: text encoder", b, b + text),
                timing(d, "gpu_text_encode"));
    } else if (j->stage == KILN_STAGE_DENOISE) {
        double setup = timing(d, "setup"), step = timing(d, "step");
        /* the steps that ran (fewer than asked under img2img); older
         * replicas do not say */
        double ran = timing(d, "steps");
        int steps = ran >= 1 ? (int)ran : j->req.plan.req.steps;
        if (setup >= 0)
            gpu(kiln_trace_span_add(t, rid, "denoise: setup", b, b + setup),
                timing(d, "gpu_setup"));
        if (setup >= 0 && step >= 0) {
            /* one span per step: the replica reports their mean, of wall
             * and of device time */
            double gpu_step = timing(d, "gpu_step");
            for (int k = 0; k < steps && t->n < KILN_TRACE_MAX_SPANS - 16; k++)
                gpu(kiln_trace_span_add(t, rid, "denoise: step", b + setup + k * step,
                                        b + setup + (k + 1) * step),
                    gpu_step);
        }
    } else if (j->stage == KILN_STAGE_DECODE) {
        double vae = timing(d, "vae"), img = timing(d, "image_encode");
        if (vae >= 0)
            gpu(kiln_trace_span_add(t, rid, "decode: vae", b, b + vae), timing(d, "gpu_vae"));
        if (vae >= 0 && img >= 0)
            kiln_trace_span_add(t, rid, "decode: image encode", b + vae, b + vae + img);
    }
    kiln_trace_span_add(t, rid, nm[1], c, now);
}

static void record(kiln_sched *s, sched_job *j, const kiln_msg_done *d, double now)
{
    trace_stage(j, d, now);
    double at_gateway = now - j->t_dispatch;
    kiln_metrics_stage(s->metrics, j->stage, at_gateway / 1000.0);
    if (j->on)
        j->on->jobs_done++;
    if (!d->ok)
        kiln_metrics_failure(s->metrics, j->stage, d->code);
    /* The replica reports the rows of the batch the job ran in as the
     * timing "batch_rows"; without it the job's own rows count. */
    double rows = timing(d, "batch_rows");
    kiln_metrics_batch(s->metrics, j->stage,
                       rows >= 1 ? (int)rows : j->stage == KILN_STAGE_ENCODE ? 1 : j->req.plan.req.n);
    double queue = timing(d, "queue"), run = timing(d, "run");
    if (queue >= 0)
        kiln_metrics_queue_wait(s->metrics, j->stage, KILN_QUEUE_REPLICA, queue / 1000.0);
    if (queue >= 0 && run >= 0)
        part(s, (kiln_part)(KILN_PART_ENCODE_HANDOFF + j->stage), at_gateway - queue - run);
    switch (j->stage) {
    case KILN_STAGE_ENCODE:
        part(s, KILN_PART_ENCODE_RUN, run);
        /* the prompt cache's lookups of the batch, on its first job */
        kiln_metrics_prompt_cache(s->metrics, timing(d, "cache_hits"), timing(d, "cache_misses"),
                                  timing(d, "cache_evictions"));
        break;
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

void sched_complete(kiln_sched *s, sched_job *j, kiln_msg *m)
{
    const kiln_msg_done *d = &m->done;
    const kiln_request *q = &j->req.plan.req;
    if (d->n_images != q->n) {
        KILN_LOG_ERROR("gateway: request %s (job %llu): decoder returned %d images for %d",
                       j->req.request_id, (unsigned long long)j->id, d->n_images, q->n);
        sched_fail(s, j, 500, "server_error", "the decode stage returned a wrong result");
        kiln_msg_free(m);
        return;
    }
    kiln_metrics_images(s->metrics, q->n);
    if (j->client) {
        kiln_sched_result res = {.status = 200, .n_images = d->n_images, .images = d->images,
                                 .seeds = j->seeds, .req = &j->req, .trace = &j->trace};
        s->ops.finish(s->ud, j->client, &res);
    }
    kiln_msg_free(m);
    sched_destroy_job(s, j);
}

void sched_restart_lost(kiln_sched *s, sched_job *j, const char *what, kiln_stage holder,
                        double now)
{
    const char *producer = kiln_stage_name(holder);
    sched_detach(s, j);
    if (j->redispatched || j->parent) { /* a preview is not run again: sched_fail ends it */
        sched_fail(s, j, 503, "stage_unavailable",
                   "the %s replica holding this request's data stopped", producer);
        return;
    }
    KILN_LOG_WARN("gateway: request %s (job %llu): its %s from a %s replica are gone; "
                  "starting over", j->req.request_id, (unsigned long long)j->id, what, producer);
    j->redispatched = 1;
    kiln_metrics_event(s->metrics, KILN_EVENT_REDISPATCH);
    sched_enqueue(s, j, KILN_STAGE_ENCODE, 1, now);
}

/* 1 when every shm / cuda_ipc reference in the outputs was made by the
 * incarnation that sent them: the only memory a done may hand on. */
static int outputs_own(const sched_replica *r, const kiln_ref_map *out)
{
    for (int i = 0; i < out->n; i++) {
        const kiln_tensor_ref *ref = &out->items[i].ref;
        if (releasable(ref) && (ref->epoch != r->epoch || strcmp(ref->owner, r->id)))
            return 0;
    }
    return 1;
}

int sched_refuse_foreign(kiln_sched *s, sched_replica *r, kiln_msg *m, const char *what,
                         double now)
{
    const kiln_msg_done *d = &m->done;
    if (outputs_own(r, &d->out))
        return 0;
    KILN_LOG_ERROR("gateway: %s %s job %llu with references it did not make", r->id, what,
                   (unsigned long long)d->job);
    kiln_metrics_rejected(s->metrics, KILN_REJECT_FOREIGN_REF, 1);
    sched_free_own(s, r->id, r->epoch, &d->out);
    kiln_msg_free(m);
    char why[96];
    snprintf(why, sizeof why, "%s a job with references it did not make", what);
    sched_replica_fence(s, r, why, now);
    return 1;
}

void sched_on_done(kiln_sched *s, sched_replica *r, kiln_msg *m, double now)
{
    const kiln_msg_done *d = &m->done;
    sched_job *j = kiln_idmap_get(&s->jobs, d->job);
    if (!r->leaving)
        r->credits++; /* each done returns a credit */
    sched_cancel_answered(r, d->job);
    /* Done with the job, the consumer is done with its inputs: what it
     * did not release goes back now. */
    sched_handoff_return(s, r, d->job);
    if (sched_refuse_foreign(s, r, m, "answered", now))
        return;
    if (!j || j->state != JOB_RUNNING || j->on != r) {
        /* Cancelled or timed out: what it made goes back. */
        sched_free_map(s, &d->out);
        kiln_msg_free(m);
        return;
    }
    if (j->stage == KILN_STAGE_DECODE && d->ok) {
        double t0 = kiln_now_ms();
        if (sched_images_take(s, r, j, m, now))
            return;
        /* Reading the files it handed by reference is part of the
         * hand-off (kiln_stage_seconds{part="decode_handoff"}). */
        if (j->image_bytes)
            now += kiln_now_ms() - t0;
    }
    if (j->parent) {
        sched_preview_done(s, j, m, now);
        return;
    }
    kiln_stage stage = j->stage;
    if (!d->ok && r->leaving &&
        (d->code == KILN_ERR_UNAVAILABLE || d->code == KILN_ERR_CANCELLED)) {
        /* A leaving replica whose drain time ran out gave the job back
         * (nobody cancelled it: its client is still here): elsewhere. */
        sched_free_map(s, &d->out);
        kiln_msg_free(m);
        sched_detach(s, j);
        sched_rerun_or_fail(s, j, kiln_stage_name(stage), "stopped before finishing it", now);
        return;
    }
    record(s, j, d, now);
    if (stage != KILN_STAGE_ENCODE && (d->ok || d->code != KILN_ERR_NOT_FOUND))
        s->handoff_streak[stage] = 0;
    if (!d->ok && d->code == KILN_ERR_NOT_FOUND && stage != KILN_STAGE_ENCODE) {
        s->handoff_failures++;
        s->handoff_streak[stage]++;
        kiln_metrics_event(s->metrics, KILN_EVENT_HANDOFF_FAILURE);
        sched_free_map(s, &d->out);
        kiln_msg_free(m);
        /* Their producer died and its slabs were removed before they
         * were opened. */
        sched_restart_lost(s, j, "inputs", (kiln_stage)(stage - 1), now);
        return;
    }
    if (!d->ok) {
        const char *code;
        int status = status_of(d->code, &code);
        sched_free_map(s, &d->out);
        sched_detach(s, j);
        if (status < 500 && status != 429) /* the client's doing: it may know why */
            sched_fail(s, j, status, code, "%s", d->message ? d->message : "invalid request");
        else if (status == 500) /* sched_fail keeps the detail to the log */
            sched_fail(s, j, status, code, "the %s stage failed on %s: %s: %s",
                       timing_phase_name(stage), r->id, kiln_status_name(d->code),
                       d->message ? d->message : "");
        else {
            KILN_LOG_WARN("gateway: request %s: the %s stage answered %s on %s: %s",
                          j->req.request_id, timing_phase_name(stage), kiln_status_name(d->code),
                          r->id, d->message ? d->message : "");
            sched_fail(s, j, status, code, "the %s stage is %s", timing_phase_name(stage),
                       status == 429 ? "busy" : "unavailable");
        }
        kiln_msg_free(m);
        return;
    }
    if (stage == KILN_STAGE_DECODE) {
        sched_detach(s, j);
        if (sched_preview_running(j)) {
            /* Its previews come first; they were sent to a decoder before
             * this and are about done (scheduler_preview.c). */
            j->final = m;
            return;
        }
        sched_complete(s, j, m);
        return;
    }
    const char *need = stage == KILN_STAGE_ENCODE ? "embeds" : "latents";
    if (!kiln_ref_map_get(&d->out, need)) {
        KILN_LOG_ERROR("gateway: request %s (job %llu): %s done without '%s'",
                       j->req.request_id, (unsigned long long)j->id, kiln_stage_name(stage), need);
        sched_free_map(s, &d->out);
        sched_detach(s, j);
        sched_fail(s, j, 500, "server_error", "the %s stage returned a wrong result",
                   timing_phase_name(stage));
        kiln_msg_free(m);
        return;
    }
    if (stage == KILN_STAGE_DENOISE)
        sched_preview_drop_queued(s, j); /* the final latents go first */
    j->held = m; /* the next stage's inputs */
    sched_enqueue(s, j, (kiln_stage)(stage + 1), 0, now);
}

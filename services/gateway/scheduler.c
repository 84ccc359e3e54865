/* The job table, stage queues and dispatch. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

kiln_sched *kiln_sched_create(const kiln_sched_opts *opts, const kiln_sched_ops *ops, void *ud,
                              kiln_metrics *metrics, kiln_err *err)
{
    if (strlen(opts->model_id) >= KILN_PROTO_ID_MAX) {
        kiln_err_set(err, KILN_ERR_INVALID, "model id is longer than %d bytes",
                     KILN_PROTO_ID_MAX - 1);
        return NULL;
    }
    kiln_sched *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->opts = *opts;
    if (opts->domain)
        s->domain = *opts->domain, s->opts.domain = &s->domain;
    snprintf(s->model_id, sizeof s->model_id, "%s", opts->model_id);
    s->opts.model_id = s->model_id;
    s->ops = *ops;
    s->ud = ud;
    s->metrics = metrics;
    link_init(&s->replicas);
    link_init(&s->all);
    link_init(&s->previews);
    for (int i = 0; i < KILN_STAGE_COUNT; i++)
        kiln_fairq_init(&s->queue[i]);
    s->next_id = 1;
    return s;
}

void kiln_sched_destroy(kiln_sched *s)
{
    if (!s)
        return;
    while (!link_empty(&s->all)) {
        sched_job *j = LINK_OWNER(s->all.next, sched_job, anode);
        j->client = NULL;
        sched_destroy_job(s, j);
    }
    while (!link_empty(&s->replicas)) {
        sched_replica *r = LINK_OWNER(s->replicas.next, sched_replica, node);
        while (!link_empty(&r->handoffs)) {
            sched_handoff *h = LINK_OWNER(r->handoffs.next, sched_handoff, node);
            link_remove(&h->node);
            free(h);
        }
        link_remove(&r->node);
        sched_cancel_forget(r);
        free(r);
    }
    kiln_idmap_free(&s->jobs);
    for (int i = 0; i < KILN_STAGE_COUNT; i++)
        kiln_fairq_free(&s->queue[i]);
    free(s);
}

int sched_live(const kiln_sched *s, kiln_stage stage)
{
    int n = 0;
    for (const sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *r = LINK_OWNER(l, sched_replica, node);
        n += r->alive && !r->leaving && r->stage == stage;
    }
    return n;
}

/* Live replicas of `stage` without room in /dev/shm for their outputs. */
static int shm_short(const kiln_sched *s, kiln_stage stage)
{
    int n = 0;
    for (const sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *r = LINK_OWNER(l, sched_replica, node);
        n += r->alive && !r->leaving && r->stage == stage && r->shm_short;
    }
    return n;
}

/* 1 when `stage` has live replicas and none has room in /dev/shm. */
static int stage_shm_full(const kiln_sched *s, kiln_stage stage)
{
    int live = sched_live(s, stage);
    return live && shm_short(s, stage) == live;
}

int kiln_sched_ready(const kiln_sched *s)
{
    for (int i = 0; i < KILN_STAGE_COUNT; i++)
        if (!sched_live(s, (kiln_stage)i) || s->handoff_streak[i] >= SCHED_HANDOFF_STREAK ||
            stage_shm_full(s, (kiln_stage)i))
            return 0;
    return 1;
}

void kiln_sched_gauges(const kiln_sched *s, kiln_metrics_gauges *g)
{
    memset(g, 0, sizeof *g);
    for (int i = 0; i < KILN_STAGE_COUNT; i++) {
        g->queued[i] = s->queued[i];
        g->inflight[i] = s->inflight[i];
        g->replicas[i] = sched_live(s, (kiln_stage)i);
        g->shm_short[i] = shm_short(s, (kiln_stage)i);
        g->handoff_streak[i] = s->handoff_streak[i];
    }
    /* Busy: running jobs, or still on cancelled ones. */
    for (const sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (!r->alive)
            continue;
        g->busy[r->stage] += r->n_inflight + r->n_cancelling > 0;
        g->cancelling[r->stage] += r->n_cancelling;
        if (g->n_replicas < KILN_METRICS_MAX_REPLICAS) {
            int k = g->n_replicas++;
            g->replica[k].id = r->id;
            g->replica[k].stage = r->stage;
            g->replica[k].inflight = r->n_inflight;
            g->replica[k].jobs = (double)r->jobs_done;
            double age = (kiln_now_ms() - r->last_seen) / 1000.0;
            g->replica[k].heartbeat_age = age > 0 ? age : 0;
            g->replica[k].rss = (double)r->rss;
            g->replica[k].dev_used = (double)r->dev_used;
            g->replica[k].dev_total = (double)r->dev_total;
        }
    }
    g->jobs = s->n_jobs;
    g->handoff_failures = s->handoff_failures;
}

/* Takes the job out of its queue or off its replica. */
void sched_detach(kiln_sched *s, sched_job *j)
{
    if (j->state == JOB_QUEUED && j->parent) {
        link_remove(&j->pq); /* previews queue apart, uncounted (admission) */
    } else if (j->state == JOB_QUEUED) {
        s->queued[j->stage]--;
        kiln_fairq_remove(&s->queue[j->stage], &j->fq);
    } else if (j->state == JOB_RUNNING) {
        s->inflight[j->stage]--;
        j->on->n_inflight--;
        j->on = NULL;
        link_remove(&j->qnode);
    }
    j->state = JOB_NEW;
}

static void send_cancel(kiln_sched *s, sched_job *j);

void sched_destroy_job(kiln_sched *s, sched_job *j)
{
    sched_detach(s, j);
    if (j->parent) {
        link_remove(&j->pnode);
    } else {
        /* Its previews go with it (a running one is told to stop). */
        while (!link_empty(&j->previews)) {
            sched_job *p = LINK_OWNER(j->previews.next, sched_job, pnode);
            send_cancel(s, p);
            sched_destroy_job(s, p);
        }
        if (j->final) {
            sched_free_map(s, &j->final->done.out);
            kiln_msg_free(j->final);
        }
    }
    if (j->held) {
        /* Waiting between stages, nobody else holds them. */
        sched_free_map(s, &j->held->done.out);
        kiln_msg_free(j->held);
    }
    link_remove(&j->anode);
    kiln_idmap_del(&s->jobs, j->id);
    s->n_jobs--;
    kiln_api_request_free(&j->req);
    free(j->seeds);
    free(j->image_bytes);
    free(j);
}

static void send_cancel(kiln_sched *s, sched_job *j)
{
    if (j->state != JOB_RUNNING || !j->on->alive)
        return;
    kiln_msg m = {.type = KILN_MSG_CANCEL, .epoch = j->on->epoch, .cancel_job = j->id};
    kiln_err err = {0};
    if (s->ops.send(s->ud, j->on->id, &m, &err))
        KILN_LOG_WARN("gateway: request %s (job %llu): cancel to %s: %s", j->req.request_id,
                      (unsigned long long)j->id, j->on->id, err.msg);
    else
        sched_cancel_sent(j->on, j->id, s->now);
}

void sched_fail(kiln_sched *s, sched_job *j, int status, const char *code, const char *fmt, ...)
{
    if (j->parent) {
        /* A preview that cannot be made costs the client that preview,
         * never the request. */
        KILN_LOG_DEBUG("gateway: request %s: preview %d dropped (%d)", j->req.request_id,
                       j->preview, status);
        send_cancel(s, j);
        sched_preview_end(s, j);
        return;
    }
    char detail[KILN_ERR_MSG_MAX], msg[KILN_ERR_MSG_MAX + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    /* A replica still running the job is told to stop; the inputs it was
     * handed come back with its done (its handoff outlives the job). */
    send_cancel(s, j);
    const char *rid = j->req.request_id[0] ? j->req.request_id : "without id";
    if (status >= 500 && status != 503 && status != 504) {
        /* Faults: the client learns that there was one and how to name it;
         * what happened stays in the log under that name. */
        KILN_LOG_ERROR("gateway: request %s (job %llu) failed (%d): %s", rid,
                       (unsigned long long)j->id, status, detail);
        snprintf(msg, sizeof msg, "internal error (request %s)", rid);
    } else {
        KILN_LOG_INFO("gateway: request %s (job %llu) failed (%d): %s", rid,
                      (unsigned long long)j->id, status, detail);
        snprintf(msg, sizeof msg, status >= 500 ? "%s (request %s)" : "%s", detail, rid);
    }
    if (j->client) {
        kiln_sched_result res = {.status = status, .message = msg, .code = code,
                                 .trace = &j->trace};
        s->ops.finish(s->ud, j->client, &res);
    }
    sched_destroy_job(s, j);
}

void sched_enqueue(kiln_sched *s, sched_job *j, kiln_stage stage, int front, double now)
{
    sched_detach(s, j);
    if (!sched_live(s, stage)) {
        sched_fail(s, j, 503, "stage_unavailable", "no %s replica is available",
                   kiln_stage_name(stage));
        return;
    }
    kiln_err err = {0};
    if (kiln_fairq_push(&s->queue[stage], &j->fq, j->req.client, j->req.plan.cost, front, &err)) {
        sched_fail(s, j, 500, "server_error", "out of memory queueing the request");
        return;
    }
    j->stage = stage;
    j->state = JOB_QUEUED;
    j->t_enqueue = now;
    s->queued[stage]++;
}

/* The live replica of j's stage with credits that can get at j's inputs,
 * those that open them where they are before those that would fetch them
 * by value (scheduler_pair.c); among equals the one with the most
 * credits.  Ties go to the least busy (jobs in flight, and cancelled ones
 * it is still on), then to the replica that got a job the longest ago:
 * idle replicas take turns, so sequential requests do not all land on the
 * first one registered.  Never one without room in /dev/shm: it could not
 * hand its outputs on.  NULL when none can take it now. */
static sched_replica *pick(kiln_sched *s, const sched_job *j)
{
    sched_replica *best = NULL;
    sched_pairing best_pair = PAIR_NONE;
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (!r->alive || r->leaving || r->stage != j->stage || r->credits <= 0 || r->shm_short)
            continue;
        sched_pairing pair = sched_pairing_of(s, j, r);
        if (pair == PAIR_NONE || pair < best_pair)
            continue;
        int busy = r->n_inflight + r->n_cancelling;
        int best_busy = best ? best->n_inflight + best->n_cancelling : 0;
        if (!best || pair > best_pair || r->credits > best->credits ||
            (r->credits == best->credits &&
             (busy < best_busy || (busy == best_busy && r->last_job < best->last_job))))
            best = r, best_pair = pair;
    }
    return best;
}

static void build_job(kiln_sched *s, const sched_job *j, const sched_replica *r, kiln_msg *m)
{
    memset(m, 0, sizeof *m);
    m->type = KILN_MSG_JOB;
    m->epoch = r->epoch;
    kiln_msg_job *mj = &m->job;
    /* a preview: its request's */
    const kiln_request *q = j->parent ? &j->parent->req.plan.req : &j->req.plan.req;
    mj->job = j->id;
    mj->stage = j->stage;
    mj->out_kinds = sched_out_kinds(s, r, j->stage);
    sched_fill_src(s, j, r, mj);
    switch (j->stage) {
    case KILN_STAGE_ENCODE:
        mj->encode.n_prompts = 1;
        mj->encode.prompts[0] = j->req.prompt;
        mj->encode.negative = j->req.plan.negative;
        mj->encode.max_seq = q->max_sequence_length;
        mj->encode.n_refs = j->req.n_images;
        for (int i = 0; i < j->req.n_images; i++)
            mj->encode.refs[i] = (kiln_bytes){j->req.images[i].data, j->req.images[i].len};
        mj->encode.mask = (kiln_bytes){j->req.mask.data, j->req.mask.len};
        mj->encode.start = q->strength > 0 && !j->req.mask.len;
        break;
    case KILN_STAGE_DENOISE:
        mj->denoise.n = q->n;
        mj->denoise.n_seeds = (int)j->req.plan.rows;
        memcpy(mj->denoise.seeds, j->seeds, (size_t)j->req.plan.rows * sizeof *j->seeds);
        mj->denoise.width = q->width;
        mj->denoise.height = q->height;
        mj->denoise.steps = q->steps;
        mj->denoise.guidance = q->guidance;
        mj->denoise.batch_noise = q->batch_noise;
        mj->denoise.strength = q->strength;
        /* previews only where someone reads them (a stream) */
        mj->denoise.previews = j->req.stream && s->ops.partial ? j->req.partial_images : 0;
        mj->in = j->held->done.out;
        break;
    default:
        mj->decode.width = q->width;
        mj->decode.height = q->height;
        mj->decode.format = q->format;
        mj->decode.compression = q->compression;
        mj->decode.image_kinds = sched_image_kinds(s, r);
        mj->in = j->held->done.out;
        break;
    }
}

static void send_job(kiln_sched *s, sched_job *j, sched_replica *r, double now)
{
    kiln_msg *m = malloc(sizeof *m); /* a job message is ~20 KB: not on the stack */
    kiln_err err = {0};
    kiln_status st = m ? KILN_OK : kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
    /* The inputs become r's to release before r can see the job. */
    int handed = 0;
    if (!st && j->held)
        handed = !(st = sched_handoff_add(s, r, j, &err));
    if (!st) {
        build_job(s, j, r, m);
        if (j->stage == KILN_STAGE_DECODE)
            j->image_kinds = m->job.decode.image_kinds;
        st = s->ops.send(s->ud, r->id, m, &err);
    }
    free(m);
    if (handed) {
        if (st)
            sched_handoff_return(s, r, j->id); /* never sent: back to their owners */
        kiln_msg_free(j->held);
        j->held = NULL;
    }
    if (st) {
        KILN_LOG_ERROR("gateway: request %s (job %llu): cannot send it to %s: %s",
                       j->req.request_id, (unsigned long long)j->id, r->id, err.msg);
        sched_fail(s, j, 500, "server_error", "internal error dispatching the request");
        return;
    }
    if (!j->parent) /* previews are no request's wait */
        kiln_metrics_queue_wait(s->metrics, j->stage, KILN_QUEUE_GATEWAY,
                                (now - j->t_enqueue) / 1000.0);
    static const char *const queue_span[KILN_STAGE_COUNT] = {
        "encode: gateway queue", "denoise: gateway queue", "decode: gateway queue"};
    kiln_trace_span_add(&j->trace, "gateway", queue_span[j->stage], j->t_enqueue, now);
    sched_detach(s, j);
    r->credits--;
    r->last_job = ++s->n_dispatched;
    if (!r->n_inflight)
        r->progress_at = now; /* work starts now: it must progress from here */
    j->state = JOB_RUNNING;
    j->on = r;
    j->t_dispatch = now;
    link_insert_before(&r->inflight, &j->qnode);
    r->n_inflight++;
    s->inflight[j->stage]++;
}

/* 1 when some live replica of `stage` has a credit left. */
static int has_credit(const kiln_sched *s, kiln_stage stage)
{
    for (const sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        const sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (r->alive && !r->leaving && r->stage == stage && r->credits > 0)
            return 1;
    }
    return 0;
}

/* Sends j to a replica that can take it now, or fails it when none ever
 * could; 0 when it waits (it stays queued). */
static int place(kiln_sched *s, sched_job *j, double now)
{
    sched_replica *r = pick(s, j);
    if (r)
        send_job(s, j, r, now);
    else if (!sched_placeable(s, j))
        sched_fail(s, j, 503, "stage_unavailable",
                   "no %s replica can reach this request's tensors from where they are "
                   "(another machine or container, and no by-value path)",
                   kiln_stage_name(j->stage));
    else if (stage_shm_full(s, j->stage))
        sched_fail(s, j, 503, "stage_unavailable",
                   "no %s replica has room for its outputs (its shared memory is full)",
                   kiln_stage_name(j->stage));
    else
        return 0;
    return 1;
}

void sched_dispatch(kiln_sched *s, double now)
{
    for (int st = KILN_STAGE_COUNT - 1; st >= 0; st--) { /* later stages first: finish work */
        kiln_fairq *q = &s->queue[st];
        kiln_fairq_node *head;
        while ((head = kiln_fairq_peek(q)) && has_credit(s, (kiln_stage)st) &&
               place(s, FQ_JOB(head), now))
            ;
        if (!head || !has_credit(s, (kiln_stage)st))
            continue;
        /* The next job waits for a busy replica that can open its inputs:
         * the jobs behind it that another replica can take do not wait
         * with it. */
        for (kiln_fairq_node *n = kiln_fairq_first(q), *next; n && has_credit(s, (kiln_stage)st);
             n = next) {
            next = kiln_fairq_next(q, n);
            place(s, FQ_JOB(n), now);
        }
    }
    /* Previews take a decoder's spare credit only: never one a final
     * decode waits for. */
    if (kiln_fairq_peek(&s->queue[KILN_STAGE_DECODE]))
        return;
    for (sched_link *l = s->previews.next, *next; l != &s->previews &&
                                                  has_credit(s, KILN_STAGE_DECODE); l = next) {
        next = l->next;
        place(s, LINK_OWNER(l, sched_job, pq), now);
    }
}

kiln_status kiln_sched_submit(kiln_sched *s, kiln_api_request *req, void *client, double now,
                              uint64_t *id, kiln_err *err)
{
    s->now = now;
    for (int st = 0; st < KILN_STAGE_COUNT; st++) {
        if (!sched_live(s, (kiln_stage)st))
            return kiln_err_set(err, KILN_ERR_UNAVAILABLE, "no %s replica is available",
                                kiln_stage_name((kiln_stage)st));
        /* The request would fail there after the stages before it ran. */
        if (stage_shm_full(s, (kiln_stage)st))
            return kiln_err_set(err, KILN_ERR_UNAVAILABLE,
                                "no %s replica has room for its outputs (its shared memory is full)",
                                kiln_stage_name((kiln_stage)st));
    }
    for (int st = 0; st < KILN_STAGE_COUNT; st++)
        if (s->queued[st] >= s->opts.queue_max)
            return kiln_err_set(err, KILN_ERR_BUSY, "the server is busy (the %s queue is full); "
                                                    "retry later",
                                kiln_stage_name((kiln_stage)st));
    if (s->opts.client_share > 0) {
        int cap = (int)(s->opts.client_share * s->opts.queue_max + 0.999), mine = 0;
        if (cap < 1)
            cap = 1;
        for (sched_link *l = s->all.next; l != &s->all; l = l->next)
            mine += LINK_OWNER(l, sched_job, anode)->req.client == req->client;
        if (mine >= cap)
            return kiln_err_set(err, KILN_ERR_BUSY, "the server is busy with %d requests of "
                                                    "this client, its share; retry later", mine);
    }
    if (req->plan.rows < 1 || req->plan.rows > KILN_PROTO_MAX_ROWS)
        return kiln_err_set(err, KILN_ERR_INVALID, "n must be between 1 and %d",
                            KILN_PROTO_MAX_ROWS);
    sched_job *j = calloc(1, sizeof *j);
    uint64_t *seeds = malloc((size_t)req->plan.rows * sizeof *seeds);
    if (!j || !seeds || kiln_idmap_put(&s->jobs, s->next_id, j, err)) {
        free(j);
        free(seeds);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    j->id = s->next_id++;
    j->client = client;
    j->req = *req;
    memset(req, 0, sizeof *req);
    j->seeds = seeds;
    /* The plan's rows and seeds, as the CLI's. */
    for (int64_t i = 0; i < j->req.plan.rows; i++)
        seeds[i] = kiln_plan_row_seed(&j->req.plan, i);
    j->t_submit = now;
    link_init(&j->qnode);
    link_init(&j->pq), link_init(&j->pnode), link_init(&j->previews);
    j->last_preview = -1;
    link_insert_before(&s->all, &j->anode);
    s->n_jobs++;
    *id = j->id;
    sched_enqueue(s, j, KILN_STAGE_ENCODE, 0, now); /* cannot fail: the stage is live */
    return KILN_OK;
}

void kiln_sched_kick(kiln_sched *s, double now)
{
    s->now = now;
    sched_dispatch(s, now);
}

void kiln_sched_cancel(kiln_sched *s, uint64_t id, double now)
{
    s->now = now;
    sched_job *j = kiln_idmap_get(&s->jobs, id);
    if (!j)
        return;
    kiln_metrics_event(s->metrics, KILN_EVENT_CANCEL);
    j->client = NULL;
    sched_fail(s, j, 499, "cancelled", "the client went away");
}

void kiln_sched_on_unreachable(kiln_sched *s, const char *peer, double now)
{
    s->now = now;
    sched_replica *r = sched_replica_find(s, peer);
    if (r)
        sched_replica_fence(s, r, "is unreachable on the bus", now);
    sched_dispatch(s, now);
}

void kiln_sched_on_msg(kiln_sched *s, const char *peer, kiln_msg *m, double now)
{
    s->now = now;
    sched_replica *r = sched_replica_find(s, peer);
    if (m->type == KILN_MSG_HELLO) {
        sched_on_hello(s, peer, m, now);
    } else if (!r || !r->alive || r->epoch != m->epoch) {
        sched_on_stale(s, r, peer, m);
    } else {
        r->last_seen = now;
        switch (m->type) {
        case KILN_MSG_READY:
            if (!r->leaving)
                r->credits += m->ready.credits;
            break;
        case KILN_MSG_LEAVING: sched_replica_leaving(r); break;
        case KILN_MSG_DONE:
            r->progress_at = now;
            sched_on_done(s, r, m, now);
            m = NULL; /* taken */
            break;
        case KILN_MSG_PARTIAL:
            sched_on_partial(s, r, m, now);
            m = NULL; /* taken */
            break;
        case KILN_MSG_RELEASE: sched_on_release(s, r, &m->refs); break;
        case KILN_MSG_HB:
            if (m->progress != r->progress)
                r->progress = m->progress, r->progress_at = now;
            if (!r->shm_short != !m->shm_short) {
                if (m->shm_short)
                    KILN_LOG_ERROR("gateway: %s has no room in /dev/shm for its outputs (a "
                                   "%.1f MiB slab does not fit): it takes no work until there "
                                   "is; give the stages a bigger /dev/shm (docs/OPERATIONS.md, "
                                   "Sizing)", r->id, (double)m->shm_short / (1 << 20));
                else
                    KILN_LOG_INFO("gateway: %s has room in /dev/shm again", r->id);
            }
            r->shm_short = m->shm_short;
            r->rss = m->rss, r->dev_used = m->dev_used, r->dev_total = m->dev_total;
            break;
        case KILN_MSG_BYE: {
            /* After `leaving`, with every job answered: a graceful stop. */
            if (r->leaving && !r->n_inflight) {
                sched_replica_left(s, r, now);
                break;
            }
            char why[300];
            snprintf(why, sizeof why, "said bye (%.200s)", m->bye_reason);
            sched_replica_fence(s, r, why, now);
            break;
        }
        default:
            KILN_LOG_WARN("gateway: unexpected %s message from %s", kiln_msg_type_name(m->type),
                          peer);
        }
    }
    kiln_msg_free(m);
    sched_dispatch(s, now);
}

/* The gateway was not running for `gap` ms: nobody's silence counts. */
static void forgive(kiln_sched *s, double gap)
{
    KILN_LOG_WARN("gateway: its own tick came %.0f ms late (the process did not run): nobody is "
                  "judged on it", gap);
    for (sched_link *l = s->replicas.next; l != &s->replicas; l = l->next) {
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        r->last_seen += gap;
        r->progress_at += gap;
        sched_cancel_shift(r, gap);
    }
}

void kiln_sched_tick(kiln_sched *s, double now)
{
    s->now = now;
    double gap = s->last_tick > 0 ? now - s->last_tick : 0;
    s->last_tick = now;
    if (gap > SCHED_LATE_TICK_MS)
        forgive(s, gap);
    for (sched_link *l = s->replicas.next, *next; l != &s->replicas; l = next) {
        next = l->next;
        sched_replica *r = LINK_OWNER(l, sched_replica, node);
        if (r->alive && now - r->last_seen > s->opts.heartbeat_timeout_ms) {
            sched_replica_fence(s, r, "stopped heartbeating", now);
        } else if (r->alive && r->n_inflight && now - r->progress_at > s->opts.progress_timeout_ms) {
            char why[96];
            snprintf(why, sizeof why, "made no progress for %.0f s with work",
                     (now - r->progress_at) / 1000);
            sched_replica_fence(s, r, why, now);
        }
    }
    sched_cancel_overdue(s, now);
    sched_replica_gc(s, now);
    /* Every job has the same timeout, so submission order is deadline
     * order. */
    while (!link_empty(&s->all)) {
        sched_job *j = LINK_OWNER(s->all.next, sched_job, anode);
        if (now - j->t_submit < s->opts.job_timeout_ms)
            break;
        kiln_metrics_event(s->metrics, KILN_EVENT_TIMEOUT);
        sched_fail(s, j, 504, "timeout", "the request did not complete within %.0f s",
                   s->opts.job_timeout_ms / 1000.0);
    }
    sched_dispatch(s, now);
}

#include "soak_run.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_http.h"
#include "bench_metrics.h"
#include "common/log.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* State shared by the run's threads; `mu` guards the records and errors. */
typedef struct shared {
    const kiln_soak_opts *o;
    const kiln_soak_traffic *t;
    const kiln_soak_verify *v;
    kiln_soak_run *run;
    double t0;        /* the run's clock origin (monotonic seconds) */
    double end;       /* no request starts after this (monotonic) */
    uint64_t next_k;
    pthread_mutex_t mu;
    volatile int faults_done;
} shared;

static void keep_error(shared *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void keep_error(shared *s, const char *fmt, ...)
{
    if (s->run->n_errors >= KILN_SOAK_ERRORS_KEPT)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->run->errors[s->run->n_errors++], sizeof s->run->errors[0], fmt, ap);
    va_end(ap);
}

static void record(shared *s, const kiln_soak_record *r, const char *why)
{
    pthread_mutex_lock(&s->mu);
    kiln_soak_run *run = s->run;
    if (run->n_rec == run->cap_rec) {
        size_t cap = run->cap_rec ? 2 * run->cap_rec : 1024;
        kiln_soak_record *n = realloc(run->rec, cap * sizeof *n);
        if (n)
            run->rec = n, run->cap_rec = cap;
    }
    if (run->n_rec < run->cap_rec)
        run->rec[run->n_rec++] = *r;
    /* Reasons are kept for what is surely wrong here; statuses are judged
     * against the faults' windows later (kiln_soak_run_classify). */
    if (why)
        keep_error(s, "request %llu at %.1f s: %s", (unsigned long long)r->k, r->t0, why);
    pthread_mutex_unlock(&s->mu);
}

/* One request, sent and judged. */
static void one(shared *s, kiln_http_client *c, const kiln_soak_req *q, kiln_buf *body,
                kiln_buf *resp)
{
    kiln_err e = {0};
    char ctype[128], why[KILN_ERR_MSG_MAX + 64] = "";
    kiln_soak_record r = {.k = q->k, .edit = q->edit, .width = q->width, .height = q->height,
                          .n = q->n, .n_refs = q->n_refs, .format = q->format};
    r.t0 = now_s() - s->t0;
    if (kiln_soak_traffic_body(s->t, q, body, ctype, sizeof ctype, &e)) {
        r.status = KILN_SOAK_NO_ANSWER;
        snprintf(why, sizeof why, "%s", e.msg);
    } else if (q->leave) {
        int answered;
        r.status = KILN_SOAK_LEFT;
        if (kiln_http_send_and_drop(c, "POST", kiln_soak_req_path(q), ctype, body->data, body->len,
                                    q->leave_after_s, (int)(q->k & 1), &answered, &e)) {
            r.status = KILN_SOAK_NO_ANSWER;
            snprintf(why, sizeof why, "(leaving client) %s", e.msg);
        }
    } else if (kiln_http_request(c, "POST", kiln_soak_req_path(q), ctype, body->data, body->len,
                                 &r.status, resp, &e)) {
        r.status = KILN_SOAK_NO_ANSWER;
        snprintf(why, sizeof why, "%s", e.msg);
    } else {
        kiln_soak_images im;
        if (kiln_soak_check(q, r.status, resp, &im, &e)) {
            r.bad = r.status == 200;
            snprintf(why, sizeof why, "%s %dx%d n=%d %s%s: %s", q->edit ? "edit" : "generation",
                     q->width, q->height, q->n, kiln_image_format_name(q->format),
                     q->edit ? " (refs)" : "", e.msg);
        } else if (s->v) {
            for (int i = 0; i < im.n; i++) {
                int same = kiln_soak_verify_image(s->v, q, i, &im.files[i]);
                r.verified += same == 1;
                r.wrong += same != 1;
                if (same != 1 && !why[0])
                    snprintf(why, sizeof why,
                             "%s %dx%d n=%d %s seed %llu (pool entry %d): image %d %s",
                             q->edit ? "edit" : "generation", q->width, q->height, q->n,
                             kiln_image_format_name(q->format),
                             (unsigned long long)q->seed, q->pool_index, i,
                             same ? "has no CLI reference" : "differs from the CLI's");
            }
        }
        kiln_soak_images_free(&im);
    }
    r.t1 = now_s() - s->t0;
    /* A status other than 200 is kept as a reason only when classify
     * finds it unexpected; keep the message for the first few anyway. */
    record(s, &r, why[0] && (r.status == 200 || r.status == KILN_SOAK_NO_ANSWER) ? why : NULL);
    if (why[0] && r.status != 200 && r.status > 0)
        KILN_LOG_DEBUG("kiln-soak: request %llu: %s", (unsigned long long)q->k, why);
}

static void *worker(void *arg)
{
    shared *s = arg;
    kiln_err err = {0};
    kiln_http_client *c = kiln_http_client_create(s->o->url, s->o->timeout_s, &err);
    kiln_buf body = {0}, resp = {0};
    while (c && now_s() < s->end) {
        pthread_mutex_lock(&s->mu);
        uint64_t k = s->next_k++;
        pthread_mutex_unlock(&s->mu);
        kiln_soak_req q;
        kiln_soak_traffic_request(s->t, k, &q);
        one(s, c, &q, &body, &resp);
    }
    kiln_buf_free(&body);
    kiln_buf_free(&resp);
    kiln_http_client_destroy(c);
    return NULL;
}

/* --- faults ------------------------------------------------------------ */

/* The stage's live replicas by /metrics (-1 when the gateway did not
 * answer), the replicas it lost so far (kiln_events_total{event=
 * "replica_lost"}) and whether /readyz says ready. */
static int replicas(kiln_http_client *c, const char *stage, double *lost, int *ready)
{
    kiln_err e = {0};
    kiln_buf b = {0};
    int status = 0, n = -1;
    *ready = !kiln_http_request(c, "GET", "/readyz", NULL, NULL, 0, &status, &b, &e) &&
             status == 200;
    *lost = -1;
    if (!kiln_http_request(c, "GET", "/metrics", NULL, NULL, 0, &status, &b, &e) &&
        status == 200) {
        kiln_prom *p = kiln_prom_parse((const char *)b.data, b.len, &e);
        char labels[64];
        snprintf(labels, sizeof labels, "stage=\"%s\"", stage);
        double v;
        if (p && kiln_prom_get(p, "kiln_replicas", labels, &v))
            n = (int)v;
        if (p && !kiln_prom_get(p, "kiln_events_total", "event=\"replica_lost\"", lost))
            *lost = 0;
        kiln_prom_free(p);
    }
    kiln_buf_free(&b);
    return n;
}

static int alive(pid_t pid) { return kill(pid, 0) == 0; }

static void do_fault(shared *s, kiln_http_client *c, kiln_soak_fault *f, int stop,
                     double stop_for)
{
    const char *bin = kiln_soak_stage_binary(f->stage);
    pid_t pids[16];
    int n = kiln_soak_children(s->o->serve_pid, bin, pids, 16), ready;
    /* kiln serve --colocate: the stage runs in kiln-stages processes, and
     * the fault takes one of them whole. */
    if (!n && (n = kiln_soak_children(s->o->serve_pid, "kiln-stages", pids, 16)) > 0)
        bin = "kiln-stages";
    double lost0, lost;
    f->before = replicas(c, f->stage, &lost0, &ready);
    f->at_s = now_s() - s->t0;
    f->healed_s = -1;
    if (!n) {
        KILN_LOG_WARN("kiln-soak: %s: no %s child of pid %d", f->what, bin,
                      (int)s->o->serve_pid);
        return;
    }
    /* The replica: the run's seed picks it, so a rerun faults the same slot. */
    f->pid = pids[(s->o->seed + (uint64_t)stop) % (uint64_t)n];
    KILN_LOG_INFO("kiln-soak: %s %s pid %d at %.1f s (%d live %s replicas)", f->what, bin,
                  (int)f->pid, f->at_s, f->before, f->stage);
    kill(f->pid, stop ? SIGSTOP : SIGKILL);
    if (stop) {
        sleep_s(stop_for);
        kill(f->pid, SIGCONT);
        f->cont_s = now_s() - s->t0;
        KILN_LOG_INFO("kiln-soak: SIGCONT to pid %d at %.1f s", (int)f->pid, f->cont_s);
    }
    /* Healed: the gateway noticed the loss (a replica fenced: a restarted
     * one may register before the dead one is, so the live count need not
     * drop), has as many of the stage as before again (a restarted one
     * registers after its model load) and is ready; or the stop was too
     * short to be noticed and the replica still serves. */
    double until = s->end + 120, since_cont = now_s();
    while (now_s() < until) {
        int live = replicas(c, f->stage, &lost, &ready);
        if (ready && live >= f->before &&
            (lost > lost0 || (stop && alive(f->pid) && now_s() - since_cont >= 2))) {
            f->healed_s = now_s() - s->t0;
            break;
        }
        sleep_s(0.25);
    }
    KILN_LOG_INFO("kiln-soak: %s of %s pid %d: %s %.1f s", f->what, f->stage, (int)f->pid,
                  f->healed_s >= 0 ? "healed at" : "NOT healed by", f->healed_s >= 0 ? f->healed_s : until - s->t0);
}

typedef struct fault_plan {
    shared *s;
    double traffic_t0; /* monotonic */
} fault_plan;

static void *faults(void *arg)
{
    fault_plan *p = arg;
    shared *s = p->s;
    const kiln_soak_opts *o = s->o;
    kiln_err err = {0};
    kiln_http_client *c = kiln_http_client_create(o->url, 10, &err);
    typedef struct step {
        const char *stage;
        double at;
        int stop;
    } step;
    step plan[2];
    int n = 0;
    if (o->kill_stage[0])
        plan[n++] = (step){o->kill_stage, o->kill_at_s, 0};
    if (o->stop_stage[0])
        plan[n++] = (step){o->stop_stage, o->stop_at_s, 1};
    if (n == 2 && plan[1].at < plan[0].at) {
        step x = plan[0];
        plan[0] = plan[1], plan[1] = x;
    }
    for (int i = 0; c && i < n; i++) {
        double at = p->traffic_t0 + plan[i].at;
        while (now_s() < at && now_s() < s->end)
            sleep_s(at - now_s() < 0.5 ? at - now_s() : 0.5);
        if (now_s() >= s->end)
            break;
        kiln_soak_fault *f = &s->run->faults[s->run->n_faults++];
        snprintf(f->what, sizeof f->what, "%s", plan[i].stop ? "stop" : "kill");
        snprintf(f->stage, sizeof f->stage, "%s", plan[i].stage);
        do_fault(s, c, f, plan[i].stop, o->stop_for_s);
    }
    kiln_http_client_destroy(c);
    s->faults_done = 1;
    return NULL;
}

/* --- the run ------------------------------------------------------------- */

static kiln_status first_request(shared *s, kiln_err *err)
{
    kiln_soak_req q;
    kiln_soak_traffic_first(s->t, s->o->first_w, s->o->first_h, &q);
    kiln_http_client *c = kiln_http_client_create(s->o->url, s->o->timeout_s, err);
    if (!c)
        return err->code;
    kiln_buf body = {0}, resp = {0};
    char ctype[128];
    kiln_err e = {0};
    double t = now_s();
    int status = 0;
    if (!kiln_soak_traffic_body(s->t, &q, &body, ctype, sizeof ctype, &e) &&
        !kiln_http_request(c, "POST", kiln_soak_req_path(&q), ctype, body.data, body.len, &status,
                           &resp, &e)) {
        kiln_soak_images im;
        kiln_soak_check(&q, status, &resp, &im, &e);
        kiln_soak_images_free(&im);
    }
    s->run->first_s = now_s() - t;
    s->run->first_status = status ? status : -1;
    if (e.code)
        snprintf(s->run->first_error, sizeof s->run->first_error, "%s", e.msg);
    KILN_LOG_INFO("kiln-soak: first request %dx%d: HTTP %d in %.2f s %s", q.width, q.height,
                  status, s->run->first_s, e.code ? e.msg : "");
    kiln_buf_free(&body);
    kiln_buf_free(&resp);
    kiln_http_client_destroy(c);
    return KILN_OK;
}

kiln_status kiln_soak_run_do(const kiln_soak_opts *o, const kiln_soak_traffic *t,
                             const kiln_soak_verify *v, kiln_soak_run *run, kiln_err *err)
{
    memset(run, 0, sizeof *run);
    kiln_bench_opts wait = {.url = o->url, .wait_ready_s = o->wait_ready_s};
    if (o->wait_ready_s > 0 && kiln_bench_wait_ready(&wait, err))
        return err->code;
    shared s = {.o = o, .t = t, .v = v, .run = run, .mu = PTHREAD_MUTEX_INITIALIZER};
    if (o->serve_pid && !(run->mem = kiln_soak_mem_start(o->serve_pid, o->sample_s, err)))
        return err->code;
    s.t0 = now_s(); /* the sampler's clock too, within microseconds */
    s.end = s.t0 + 1e9;
    kiln_status st = o->first_w ? first_request(&s, err) : KILN_OK;
    double traffic_t0 = now_s();
    s.end = traffic_t0 + o->duration_s;
    run->mem_end_s = s.end - s.t0;
    pthread_t th[256], fth;
    int started = 0, fstarted = 0;
    fault_plan plan = {&s, traffic_t0};
    if (!st && o->serve_pid && (o->kill_stage[0] || o->stop_stage[0])) {
        int rc = pthread_create(&fth, NULL, faults, &plan);
        if (rc)
            st = kiln_err_set(err, KILN_ERR_NOMEM, "pthread_create: %s", strerror(rc));
        fstarted = !rc;
    }
    for (; !st && started < o->concurrency; started++) {
        int rc = pthread_create(&th[started], NULL, worker, &s);
        if (rc)
            st = kiln_err_set(err, KILN_ERR_NOMEM, "pthread_create: %s", strerror(rc));
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    run->wall_s = now_s() - traffic_t0;
    if (fstarted)
        pthread_join(fth, NULL);
    kiln_soak_mem_stop(run->mem);
    return st;
}

static int overlaps_fault(const kiln_soak_run *run, const kiln_soak_record *r, double grace,
                          double end)
{
    for (int i = 0; i < run->n_faults; i++) {
        const kiln_soak_fault *f = &run->faults[i];
        double until = (f->healed_s >= 0 ? f->healed_s : end) + grace;
        if (r->t1 >= f->at_s && r->t0 <= until)
            return 1;
    }
    return 0;
}

void kiln_soak_run_classify(kiln_soak_run *run, const kiln_soak_opts *o)
{
    run->requests = (long)run->n_rec;
    run->answered = run->left = run->no_answer = run->ok = run->allowed_503 = 0;
    run->unexpected = run->images = run->verified = run->wrong = run->bad = 0;
    double end = 1e18;
    int kept = run->n_errors;
    for (size_t i = 0; i < run->n_rec; i++) {
        kiln_soak_record *r = &run->rec[i];
        r->unexpected = 0;
        run->verified += r->verified;
        run->wrong += r->wrong;
        run->bad += r->bad;
        if (r->status == KILN_SOAK_LEFT) {
            run->left++;
            continue;
        }
        if (r->status == KILN_SOAK_NO_ANSWER) {
            run->no_answer++;
            r->unexpected = 1;
        } else {
            run->answered++;
        }
        if (r->status == 200) {
            run->ok++;
            run->images += r->n;
        } else if (r->status == 503 && overlaps_fault(run, r, o->heal_grace_s, end)) {
            run->allowed_503++;
        } else if (r->status > 0) {
            r->unexpected = 1;
            if (kept < KILN_SOAK_ERRORS_KEPT)
                snprintf(run->errors[kept++], sizeof run->errors[0],
                         "request %llu at %.1f-%.1f s: HTTP %d (%s %dx%d n=%d)",
                         (unsigned long long)r->k, r->t0, r->t1, r->status,
                         r->edit ? "edit" : "generation", r->width, r->height, r->n);
        }
        run->unexpected += r->unexpected;
    }
    run->n_errors = kept;
}

void kiln_soak_run_free(kiln_soak_run *run)
{
    free(run->rec);
    kiln_soak_mem_free(run->mem);
    memset(run, 0, sizeof *run);
}

/* The worker's two loops: the bus thread (socket, heartbeats, incoming
 * messages) and the batch loop on the backend thread. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "worker_impl.h"

volatile sig_atomic_t kiln_worker_signalled;

static void wake(kiln_worker *w)
{
    uint64_t one = 1;
    /* A full eventfd counter still wakes the reader, so EAGAIN is fine. */
    if (write(w->efd, &one, sizeof one) < 0 && errno != EAGAIN)
        KILN_LOG_ERROR("worker: eventfd write: %s", strerror(errno));
}

int worker_halted(kiln_worker *w) { return atomic_load(&w->halt) != WORKER_RUNNING; }

kiln_status worker_send(kiln_worker *w, kiln_msg *m)
{
    kiln_err err = {0};
    kiln_buf f = {0};
    m->epoch = w->epoch;
    if (kiln_msg_encode(m, &f, &err)) {
        KILN_LOG_ERROR("worker: cannot encode %s: %s", kiln_msg_type_name(m->type), err.msg);
        return err.code;
    }
    pthread_mutex_lock(&w->out_mu);
    if (w->n_frames == w->cap_frames) {
        int cap = w->cap_frames ? 2 * w->cap_frames : 16;
        kiln_buf *v = realloc(w->frames, (size_t)cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&w->out_mu);
            KILN_LOG_ERROR("worker: out of memory queueing %s", kiln_msg_type_name(m->type));
            kiln_buf_free(&f);
            return KILN_ERR_NOMEM;
        }
        w->frames = v, w->cap_frames = cap;
    }
    w->frames[w->n_frames++] = f;
    pthread_mutex_unlock(&w->out_mu);
    wake(w);
    return KILN_OK;
}

void worker_unhold(kiln_worker *w, kiln_worker_job *j)
{
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_held; i++)
        if (w->held[i] == j) {
            w->held[i] = w->held[--w->n_held];
            break;
        }
    pthread_mutex_unlock(&w->mu);
}

static void send_hello(kiln_worker *w)
{
    /* A leaving incarnation registers nowhere again (a gateway that
     * restarted meanwhile never sends it work). */
    if (worker_halted(w) || atomic_load(&w->leaving))
        return;
    kiln_msg m = {.type = KILN_MSG_HELLO,
                  .hello = {.stage = w->ops->stage, .replica = w->replica, .model = w->model,
                            .host = w->host, .max_batch = w->opts.max_batch,
                            .transports = KILN_TRANSPORT_BIT(KILN_REF_INLINE) |
                                          KILN_TRANSPORT_BIT(KILN_REF_SHM) |
                                          (w->cuda ? KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC) : 0),
                            .domain = w->domain, .data = w->data_ep,
                            .data_key = w->data_ep[0] && w->bus_keys.secret[0]
                                            ? w->bus_keys.public_key
                                            : "",
                            .traits = w->traits,
                            .process = w->group ? w->group->process : NULL}};
    worker_send(w, &m);
    pthread_mutex_lock(&w->mu);
    int credits = w->capacity - w->n_held;
    pthread_mutex_unlock(&w->mu);
    if (credits > 0) {
        m = (kiln_msg){.type = KILN_MSG_READY, .ready.credits = credits};
        worker_send(w, &m);
    }
    atomic_store(&w->registered, 1);
    KILN_LOG_INFO("%s: registered with the gateway as %s epoch %016llx (%d credits)",
                  w->ops->binary, w->replica, (unsigned long long)w->epoch,
                  credits > 0 ? credits : 0);
}

static void fail_now(kiln_worker *w, kiln_msg *msg, kiln_status code, const char *why)
{
    /* A job we will not hold: answer it and give the credit back. */
    kiln_worker_job *j = calloc(1, sizeof *j);
    kiln_msg *done = calloc(1, sizeof *done);
    if (!j || !done) {
        free(j), free(done);
        kiln_msg_free(msg);
        KILN_LOG_ERROR("worker: out of memory refusing a job");
        return;
    }
    j->msg = msg, j->done = done;
    kiln_err err = {.code = code};
    snprintf(err.msg, sizeof err.msg, "%s", why);
    kiln_worker_done(w, j, code, &err);
}

static void on_job(kiln_worker *w, kiln_msg *msg)
{
    if (msg->job.stage != w->ops->stage) {
        fail_now(w, msg, KILN_ERR_INVALID, "job for another stage");
        return;
    }
    if (atomic_load(&w->stop)) {
        /* Sent before the gateway heard we stop: back at once (it runs
         * it elsewhere when we were leaving), not held until we exit. */
        fail_now(w, msg, KILN_ERR_UNAVAILABLE, "replica shutting down");
        return;
    }
    kiln_worker_job *j = calloc(1, sizeof *j);
    kiln_msg *done = calloc(1, sizeof *done);
    pthread_mutex_lock(&w->mu);
    int dup = 0;
    for (int i = 0; i < w->n_held; i++)
        dup |= w->held[i]->msg->job.job == msg->job.job;
    if (!dup && j && done && w->n_held == w->cap_held) {
        int cap = w->cap_held ? 2 * w->cap_held : 16;
        kiln_worker_job **v = realloc(w->held, (size_t)cap * sizeof *v);
        if (v)
            w->held = v, w->cap_held = cap;
    }
    if (dup || !j || !done || w->n_held == w->cap_held) {
        pthread_mutex_unlock(&w->mu);
        free(j), free(done);
        if (dup) {
            KILN_LOG_WARN("worker: dropped a duplicate of job %llu",
                          (unsigned long long)msg->job.job);
            kiln_msg_free(msg);
        } else {
            fail_now(w, msg, KILN_ERR_NOMEM, "out of memory");
        }
        return;
    }
    j->msg = msg, j->done = done;
    j->stop = &w->stop;
    j->t_recv = kiln_now_ms();
    j->queued = 1;
    w->held[w->n_held++] = j;
    if (w->q_tail)
        w->q_tail->next = j;
    else
        w->q_head = j;
    w->q_tail = j;
    w->q_rows += w->ops->rows(&msg->job);
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void unlink_queued(kiln_worker *w, kiln_worker_job *j)
{
    kiln_worker_job **pp = &w->q_head, *prev = NULL;
    while (*pp && *pp != j)
        prev = *pp, pp = &(*pp)->next;
    if (!*pp)
        return;
    *pp = j->next;
    if (w->q_tail == j)
        w->q_tail = prev;
    j->next = NULL;
    j->queued = 0;
    w->q_rows -= w->ops->rows(&j->msg->job);
}

static void on_cancel(kiln_worker *w, uint64_t id)
{
    kiln_worker_job *queued = NULL;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_held; i++) {
        kiln_worker_job *j = w->held[i];
        if (j->msg->job.job != id)
            continue;
        atomic_store(&j->t_cancel, kiln_now_ms());
        atomic_store(&j->cancelled, 1);
        if (j->queued) {
            unlink_queued(w, j);
            queued = j;
        }
        break;
    }
    pthread_mutex_unlock(&w->mu);
    if (queued)
        kiln_worker_done(w, queued, KILN_ERR_CANCELLED, NULL);
}

static void on_free(kiln_worker *w, const kiln_msg_refs *r)
{
    for (int i = 0; i < r->n; i++) {
        kiln_err err = {0};
        kiln_ref_kind k = r->refs[i].kind;
        kiln_transport *tx = k == KILN_REF_SHM ? w->shm : k == KILN_REF_CUDA_IPC ? w->cuda : NULL;
        if (!tx || kiln_transport_free(tx, &r->refs[i], &err))
            KILN_LOG_WARN("worker: ignored a free: %s",
                          err.msg[0] ? err.msg : "not a reference of our pools");
    }
}

int worker_halt_mark(kiln_worker *w, int why, const char *reason)
{
    int expected = WORKER_RUNNING;
    if (!atomic_compare_exchange_strong(&w->halt, &expected, why))
        return 0;
    KILN_LOG_ERROR("%s: %s epoch %016llx: %s; stopping to be restarted", w->ops->binary,
                   w->replica, (unsigned long long)w->epoch, reason);
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_held; i++)
        atomic_store(&w->held[i]->cancelled, 1); /* a running denoise stops at its next step */
    atomic_store(&w->stop, 1);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 1;
}

void worker_say_bye(kiln_worker *w, const char *reason)
{
    /* The gateway re-runs our jobs at once instead of after a timeout
     * (the bus thread still sends what is queued after a halt). */
    kiln_msg bye = {.type = KILN_MSG_BYE, .bye_reason = reason};
    worker_send(w, &bye);
}

void worker_halt(kiln_worker *w, int why, const char *reason)
{
    if (worker_halt_mark(w, why, reason))
        worker_group_halt_others(w, reason, why == WORKER_FAULTED);
}

static void dispatch(kiln_worker *w, const kiln_buf *f)
{
    kiln_err err = {0};
    kiln_msg *m = kiln_msg_decode(f->data, f->len, &err);
    if (!m) {
        KILN_LOG_WARN("worker: dropped a malformed message: %s", err.msg);
        return;
    }
    if (m->epoch != w->epoch) {
        /* Meant for another incarnation of this replica id (one that ran
         * before us, or a duplicate): never ours to act on. */
        KILN_LOG_WARN("worker: dropped a '%s' for epoch %016llx (ours is %016llx)",
                      kiln_msg_type_name(m->type), (unsigned long long)m->epoch,
                      (unsigned long long)w->epoch);
        kiln_msg_free(m);
        return;
    }
    switch (m->type) {
    case KILN_MSG_JOB:
        if (!worker_halted(w)) {
            on_job(w, m); /* the job owns m */
            return;
        }
        break;
    case KILN_MSG_CANCEL: on_cancel(w, m->cancel_job); break;
    case KILN_MSG_FREE: on_free(w, &m->refs); break;
    case KILN_MSG_FENCED:
        /* The gateway declared this incarnation dead: whatever it finishes
         * now is not wanted (its jobs run again elsewhere). */
        worker_halt(w, WORKER_FENCED, "fenced by the gateway (declared dead)");
        break;
    case KILN_MSG_GONE:
        /* Its references will not come again: drop our mappings of its
         * slabs (those in use when their job is done). */
        kiln_transport_forget(w->shm, m->gone.incarnation);
        if (w->cuda)
            kiln_transport_forget(w->cuda, m->gone.incarnation);
        break;
    default:
        KILN_LOG_WARN("worker: dropped an unexpected '%s' message", kiln_msg_type_name(m->type));
    }
    kiln_msg_free(m);
}

static void flush_frames(kiln_worker *w)
{
    pthread_mutex_lock(&w->out_mu);
    kiln_buf *frames = w->frames;
    int n = w->n_frames;
    w->frames = NULL, w->n_frames = w->cap_frames = 0;
    pthread_mutex_unlock(&w->out_mu);
    for (int i = 0; i < n; i++) {
        kiln_err err = {0};
        /* Not connected because the gateway refused us: the bus logs why
         * (rate-limited); heartbeats lost meanwhile are no news. */
        if (kiln_bus_send(w->bus, NULL, frames[i].data, frames[i].len, &err))
            kiln_log(err.code == KILN_ERR_UNAVAILABLE ? KILN_LOG_DEBUG : KILN_LOG_ERROR,
                     "worker: lost an outgoing message: %s", err.msg);
        kiln_buf_free(&frames[i]);
    }
    free(frames);
}

static void begin_stop(kiln_worker *w)
{
    pthread_mutex_lock(&w->mu);
    atomic_store(&w->stop, 1);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void worker_sample_memory(kiln_worker *w)
{
    size_t used = 0, total = 0;
    kiln_err err = {0};
    if (!w->be || !w->be->ops->mem_info || kiln_backend_mem_info(w->be, &used, &total, &err))
        return;
    atomic_store(&w->dev_used, used);
    atomic_store(&w->dev_total, total);
}

/* The process's resident set (VmRSS of /proc/self/status), bytes; 0 when
 * unreadable.  Any thread. */
static uint64_t process_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return (uint64_t)kb << 10;
}

/* Whether this producer has room in /dev/shm for its outputs: the slab
 * its pool last failed to make for want of room, for as long as /dev/shm
 * still has less than that free (then the gateway sends it no work); 0
 * otherwise.  Sets w->shm_short and logs the changes.  Bus thread. */
static uint64_t worker_shm_short(kiln_worker *w)
{
    /* A decoder's shm holds only image files, which go inline when it has
     * no room: it still takes work. */
    if (w->ops->stage == KILN_STAGE_DECODE)
        return 0;
    kiln_transport_stats st = {0};
    if (w->shm)
        kiln_transport_stats_get(w->shm, &st);
    uint64_t need = st.short_bytes, avail = 0, total = 0;
    kiln_err err = {0};
    int known = need && !kiln_domain_fs_space("/dev/shm", &avail, &total, &err);
    if (known && avail >= need)
        need = 0;
    uint64_t was = atomic_exchange(&w->shm_short, need);
    if (need && !was)
        KILN_LOG_ERROR("%s: /dev/shm has no room for the %.1f MiB slab this stage's outputs "
                       "need (%llu MiB free of %llu MiB): it takes no work until there is; "
                       "give the stages a bigger /dev/shm", w->ops->binary,
                       (double)need / (1 << 20), (unsigned long long)(avail >> 20),
                       (unsigned long long)(total >> 20));
    else if (!need && was)
        KILN_LOG_INFO("%s: /dev/shm has room again", w->ops->binary);
    return need;
}

/* The first SIGINT/SIGTERM with --drain-s: `leaving` to the gateway,
 * which sends no more work; the jobs held are answered (worker_leave_check
 * ends it).  A second signal, or none of that, stops at once: a running
 * batch stops at its next op and queued jobs go back `unavailable`.  Bus
 * thread. */
static void on_signals(kiln_worker *w, double now)
{
    int sig = kiln_worker_signalled;
    if (sig == w->signals_seen)
        return;
    int first = !w->signals_seen;
    w->signals_seen = sig;
    if (atomic_load(&w->stop))
        return;
    if (first && w->opts.drain_s > 0 && !worker_halted(w)) {
        pthread_mutex_lock(&w->mu);
        int held = w->n_held;
        pthread_mutex_unlock(&w->mu);
        w->leave_started = now;
        w->leave_deadline = now + w->opts.drain_s * 1000.0;
        atomic_store(&w->leaving, 1);
        kiln_msg m = {.type = KILN_MSG_LEAVING};
        if (atomic_load(&w->registered)) /* else no gateway knows us */
            worker_send(w, &m);
        KILN_LOG_INFO("%s %s: signal received: leaving (no new work; the %d job(s) held "
                      "finish within --drain-s %d; another signal stops at once)",
                      w->ops->binary, w->replica, held, w->opts.drain_s);
        return;
    }
    KILN_LOG_INFO("%s: signal received, shutting down", w->ops->binary);
    begin_stop(w);
}

/* A leaving incarnation stops once it holds no job, or at its deadline.
 * Bus thread. */
static void leave_check(kiln_worker *w, double now)
{
    if (!atomic_load(&w->leaving) || atomic_load(&w->stop))
        return;
    pthread_mutex_lock(&w->mu);
    int held = w->n_held;
    pthread_mutex_unlock(&w->mu);
    /* Not before the gateway had time to hear `leaving`: a job it sent
     * meanwhile is still on its way (one that comes later anyway is
     * given back, on_job). */
    if ((held && now < w->leave_deadline) || now < w->leave_started + WORKER_LEAVE_SETTLE_MS)
        return;
    if (held)
        KILN_LOG_WARN("%s %s: --drain-s %d is over with %d job(s) held: stopping them (the "
                      "gateway runs them elsewhere)", w->ops->binary, w->replica,
                      w->opts.drain_s, held);
    else
        KILN_LOG_INFO("%s %s: every job it held is answered; stopping", w->ops->binary,
                      w->replica);
    begin_stop(w);
}

static void *bus_main(void *arg)
{
    kiln_worker *w = arg;
    kiln_buf f = {0};
    double next_hb = kiln_now_ms(), halted_at = 0;
    while (!atomic_load(&w->bus_stop)) {
        kiln_err err = {0};
        double now = kiln_now_ms();
        on_signals(w, now);
        leave_check(w, now);
        atomic_store(&w->bus_tick_ms, (long long)now);
        if (worker_halted(w) && !halted_at)
            halted_at = now;
        if (halted_at && now - halted_at > WORKER_HALT_EXIT_MS) {
            /* The backend thread did not wind down (stuck in the device or
             * a kernel): end the process; the slabs it leaves are removed
             * by the next start-up or the supervisor (their owner lock
             * dies with us). */
            KILN_LOG_ERROR("%s: %s did not stop within %d ms of its halt; exiting now",
                           w->ops->binary, w->replica, WORKER_HALT_EXIT_MS);
            _exit(KILN_WORKER_EXIT_RESTART);
        }
        /* Not before the first hello: the gateway refuses (and counts as
         * kiln_bus_rejected_total{reason="unregistered"}) what an unknown
         * peer sends. */
        if (now >= next_hb && !worker_halted(w) && atomic_load(&w->registered)) {
            kiln_msg hb = {.type = KILN_MSG_HB, .progress = atomic_load(&w->progress),
                           .shm_short = worker_shm_short(w), .rss = process_rss(),
                           .dev_used = atomic_load(&w->dev_used),
                           .dev_total = atomic_load(&w->dev_total)};
            worker_send(w, &hb);
            next_hb = now + WORKER_HB_MS;
        }
        /* A halted incarnation sends no heartbeats but must still wake to
         * end the process in time. */
        int wait_ms = worker_halted(w) ? 100 : (int)(next_hb - now) + 1;
        int ev = kiln_bus_wait(w->bus, w->efd, wait_ms > 0 ? wait_ms : 0, &err);
        if (ev < 0) {
            KILN_LOG_ERROR("worker: %s", err.msg);
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (ev & KILN_BUS_FD) {
            uint64_t v;
            (void)!read(w->efd, &v, sizeof v);
        }
        if (ev & KILN_BUS_CONNECTED) {
            send_hello(w);
            /* The first heartbeat right behind it, so the gateway knows the
             * replica's memory from its registration on, not a period later. */
            next_hb = now;
        }
        for (int rc; (rc = kiln_bus_recv(w->bus, NULL, 0, &f, &err)) != 0;) {
            if (rc < 0) {
                KILN_LOG_WARN("worker: %s", err.msg);
                if (err.code != KILN_ERR_INVALID)
                    break;
                continue;
            }
            dispatch(w, &f);
        }
        flush_frames(w);
    }
    flush_frames(w);
    kiln_buf_free(&f);
    return NULL;
}

kiln_status worker_init(kiln_worker *w, kiln_err *err)
{
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "eventfd: %s", strerror(errno));
    if (pthread_mutex_init(&w->mu, NULL) || pthread_mutex_init(&w->out_mu, NULL) ||
        pthread_cond_init(&w->cv, NULL))
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot create worker locks");
    return KILN_OK;
}

kiln_status worker_start(kiln_worker *w, kiln_err *err)
{
    w->bus = kiln_bus_connect(w->opts.bus, w->replica, &w->bus_keys, err);
    if (!w->bus)
        return err->code;
    if (pthread_create(&w->bus_thread, NULL, bus_main, w))
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot start the bus thread");
    w->bus_started = 1;
    return KILN_OK;
}

static int timed_wait(kiln_worker *w, double deadline_ms)
{
    double left = deadline_ms - kiln_now_ms();
    if (left <= 0)
        return ETIMEDOUT;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(left * 1e6);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return pthread_cond_timedwait(&w->cv, &w->mu, &ts);
}

/* Takes the oldest job and the compatible ones behind it, up to
 * max_batch rows, after giving the oldest a short window to gather
 * company.  Called with w->mu held; returns the count. */
static int take_batch(kiln_worker *w, kiln_worker_job **batch)
{
    kiln_worker_job *head = w->q_head;
    double deadline = head->t_recv + w->opts.batch_window_ms;
    while (!atomic_load(&w->stop) && w->q_rows < w->opts.max_batch &&
           timed_wait(w, deadline) != ETIMEDOUT) {
    }
    head = w->q_head;
    int n = 0, rows = 0;
    for (kiln_worker_job *j = head, *next; j && n < KILN_PROTO_MAX_ROWS; j = next) {
        next = j->next;
        int r = w->ops->rows(&j->msg->job);
        if (j != head && (rows + r > w->opts.max_batch ||
                          !w->ops->compatible(&head->msg->job, &j->msg->job)))
            continue;
        unlink_queued(w, j);
        batch[n++] = j;
        rows += r;
    }
    return n;
}

void worker_serve(kiln_worker *w)
{
    kiln_worker_job *batch[KILN_PROTO_MAX_ROWS];
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->q_head && !atomic_load(&w->stop))
            pthread_cond_wait(&w->cv, &w->mu);
        if (atomic_load(&w->stop)) {
            pthread_mutex_unlock(&w->mu);
            break;
        }
        int n = take_batch(w, batch);
        pthread_mutex_unlock(&w->mu);
        int live = 0, rows = 0;
        double now = kiln_now_ms();
        for (int i = 0; i < n; i++) {
            if (kiln_worker_cancelled(batch[i])) {
                kiln_worker_done(w, batch[i], KILN_ERR_CANCELLED, NULL);
                continue;
            }
            batch[i]->t_start = now;
            kiln_worker_timing(batch[i], "queue", now - batch[i]->t_recv);
            rows += w->ops->rows(&batch[i]->msg->job);
            batch[live++] = batch[i];
        }
        if (!live)
            continue;
        /* The gateway's kiln_batch_rows histogram reads this (a count
         * carried as a timing: done has no other place for it). */
        for (int i = 0; i < live; i++)
            kiln_worker_timing(batch[i], "batch_rows", rows);
        KILN_LOG_DEBUG("%s %s: batch of %d job(s), %d row(s)", w->ops->binary, w->replica, live,
                       rows);
        w->steps_at_batch = w->steps;
        w->ops->run(w->state, w, batch, live);
        worker_sample_memory(w);
        /* A stage that reports no steps made one with the whole batch. */
        if (w->steps == w->steps_at_batch)
            kiln_worker_step(w);
        if (kiln_be_lost(w->be))
            worker_halt(w, WORKER_FAULTED, "its device is lost");
    }
}

void worker_shutdown(kiln_worker *w)
{
    /* Jobs still queued go back to the gateway, which may re-dispatch them
     * (a halted incarnation's answers do not count: they go unsent). */
    for (;;) {
        pthread_mutex_lock(&w->mu);
        kiln_worker_job *j = w->q_head;
        if (j)
            unlink_queued(w, j);
        pthread_mutex_unlock(&w->mu);
        if (!j)
            break;
        kiln_err err = {.code = KILN_ERR_UNAVAILABLE};
        snprintf(err.msg, sizeof err.msg, "replica shutting down");
        kiln_worker_done(w, j, KILN_ERR_UNAVAILABLE, &err);
    }
    /* Give consumers up to 2 s (a halted incarnation: up to
     * WORKER_HALT_DRAIN_MS, as its consumers' jobs run on) to release our
     * ranges before the slabs go away, and jobs finishing on other
     * threads time to reply. */
    if (!w->bus_started)
        return;
    double until = kiln_now_ms() + (worker_halted(w) ? WORKER_HALT_DRAIN_MS : 2000);
    /* A leaving one waits for its last outputs up to its deadline: their
     * consumer may take long to come (a job queued behind others). */
    int left = atomic_load(&w->leaving) && !worker_halted(w);
    if (left && w->leave_deadline > until)
        until = w->leave_deadline;
    kiln_transport_stats st = {0}, dev = {0};
    int held;
    for (;;) {
        kiln_transport_stats_get(w->shm, &st);
        if (w->cuda)
            kiln_transport_stats_get(w->cuda, &dev);
        pthread_mutex_lock(&w->mu);
        held = w->n_held;
        pthread_mutex_unlock(&w->mu);
        /* (A second signal ends a leaving one's wait too.) */
        if ((!st.live && !dev.live && !held) || kiln_now_ms() >= until ||
            (left && kiln_worker_signalled > 1))
            break;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    /* What a leak would leave behind (the service tests read this line). */
    KILN_LOG_INFO("%s: at exit: %d job(s) held, shm %d slab(s) with %d range(s) in use, "
                  "cuda_ipc %d slab(s) with %d range(s) in use, %d free(s) refused",
                  w->ops->binary, held, st.slabs, st.live, dev.slabs, dev.live,
                  st.refused + dev.refused);
    KILN_LOG_INFO("%s: by value: %lld input(s) fetched (%lld bytes), %lld output(s) served "
                  "(%lld bytes)", w->ops->binary, (long long)atomic_load(&w->fetched),
                  (long long)atomic_load(&w->fetched_bytes), (long long)atomic_load(&w->served),
                  (long long)atomic_load(&w->served_bytes));
    if (left && atomic_load(&w->registered)) {
        /* Its jobs are answered (those given back came before this): the
         * gateway ends the incarnation as left, not lost. */
        kiln_msg bye = {.type = KILN_MSG_BYE, .bye_reason = "left"};
        worker_send(w, &bye);
    }
    atomic_store(&w->bus_stop, 1);
    wake(w);
    pthread_join(w->bus_thread, NULL);
    w->bus_started = 0;
}

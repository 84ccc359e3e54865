/* The stages of one process: kiln-encoder, kiln-denoiser and kiln-decoder
 * run one each; kiln-stages runs several, so that stages sharing a GPU
 * share one CUDA context, where their kernels overlap instead of
 * time-slicing between processes (docs/ARCHITECTURE.md, "One process,
 * several stages").
 *
 * Each stage keeps everything it has as its own process would (replica id,
 * epoch, bus socket, transports, backend, threads): the gateway sees
 * separate replicas.  What they share is the process's fate.  They load
 * together and register only once all have loaded, so a process never
 * serves half a pipeline; one that halts (fenced, or its device lost)
 * halts the others, since a lost CUDA context or a stopped process is all
 * of theirs, and the process exits to be restarted whole. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

#include "common/log.h"
#include "worker_impl.h"

/* A setup error that restarting cannot mend gets EX_CONFIG (worker.h). */
static int load_status(kiln_status st)
{
    return st == KILN_ERR_INVALID || st == KILN_ERR_NOT_FOUND || st == KILN_ERR_FORMAT ||
                   st == KILN_ERR_UNSUPPORTED
               ? KILN_WORKER_EXIT_CONFIG
               : 1;
}

/* The group's two barriers, counted in *step: n_arrived (a stage loaded,
 * or failed to: then n_failed too) and n_served (a stage runs no work any
 * more). */
static void pass(worker_group *g, int *step, int failed)
{
    pthread_mutex_lock(&g->mu);
    ++*step;
    g->n_failed += failed;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Waits until every stage passed *step; 1 when none failed to load. */
static int wait_all(worker_group *g, const int *step)
{
    pthread_mutex_lock(&g->mu);
    while (*step < g->n)
        pthread_cond_wait(&g->cv, &g->mu);
    int ok = !g->n_failed;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

/* One stage's life, on the thread that owns its backend. */
static void stage_life(kiln_worker *w)
{
    worker_group *g = w->group;
    kiln_err err = {0};
    kiln_status st = worker_load(w, &err);
    if (st) {
        fprintf(stderr, "%s: %s\n", w->ops->binary, err.msg);
        w->status = load_status(st);
    }
    pass(g, &g->n_arrived, st != KILN_OK);
    if (wait_all(g, &g->n_arrived)) {
        if (worker_start(w, &err)) {
            fprintf(stderr, "%s: %s\n", w->ops->binary, err.msg);
            w->status = 1;
            worker_group_halt_others(w, "it could not start", 0);
        } else {
            worker_serve(w);
        }
    }
    /* Inside one process a consumer uses a producer's cuda_ipc slab in
     * place (no mapping of its own keeps it alive): no stage frees its
     * transports while another may still run work on them. */
    pass(g, &g->n_served, 0);
    wait_all(g, &g->n_served);
    worker_teardown(w);
    if (worker_halted(w) && !w->status)
        w->status = KILN_WORKER_EXIT_RESTART;
    KILN_LOG_INFO("%s: %s stopped", w->ops->binary, w->replica);
}

static void *stage_thread(void *arg)
{
    stage_life(arg);
    return NULL;
}

void worker_group_halt_others(kiln_worker *w, const char *reason, int bye)
{
    worker_group *g = w->group;
    kiln_worker *halted[WORKER_GROUP_MAX];
    int n = 0;
    char why[512];
    /* Only the first to halt speaks for the process: the others' halts,
     * caused by it, name it rather than each other. */
    if (g && g->n > 1 && !atomic_exchange(&g->halting, 1)) {
        snprintf(why, sizeof why, "%s of its process halted (%s)", w->ops->binary, reason);
        for (int i = 0; i < g->n; i++)
            if (g->w[i] != w && worker_halt_mark(g->w[i], WORKER_FAULTED, why))
                halted[n++] = g->w[i];
    }
    /* The byes only once every stage has halted: the first one the
     * gateway reads fences them all (they share the process token), and a
     * stage still running when its `fenced` came would halt as fenced,
     * not as its process's. */
    if (bye)
        worker_say_bye(w, reason);
    for (int i = 0; i < n; i++)
        worker_say_bye(halted[i], why);
}

/* The process token: 64 random bits in hex, so that no other process
 * (another host, a restart) says the same one. */
static int draw_process_token(worker_group *g)
{
    uint64_t t;
    if (getrandom(&t, sizeof t, 0) != (ssize_t)sizeof t)
        return -1;
    snprintf(g->process, sizeof g->process, "%016llx", (unsigned long long)t);
    return 0;
}

int worker_group_run(worker_group *g)
{
    kiln_err err = {0};
    if (draw_process_token(g)) {
        fprintf(stderr, "%s: getrandom: %s\n", g->binary, strerror(errno));
        return 1;
    }
    if (pthread_mutex_init(&g->mu, NULL) || pthread_cond_init(&g->cv, NULL)) {
        fprintf(stderr, "%s: cannot create the start barrier\n", g->binary);
        return 1;
    }
    /* The health port answers from the start (503 while loading), so a
     * startup probe tells a slow load from a dead process. */
    if (worker_health_start(g, &err)) {
        fprintf(stderr, "%s: %s\n", g->binary, err.msg);
        return 1;
    }
    pthread_t threads[WORKER_GROUP_MAX];
    int started[WORKER_GROUP_MAX] = {0};
    for (int i = 1; i < g->n; i++) {
        started[i] = !pthread_create(&threads[i], NULL, stage_thread, g->w[i]);
        if (!started[i]) {
            fprintf(stderr, "%s: cannot start a thread for %s\n", g->binary, g->w[i]->ops->binary);
            g->w[i]->status = 1;
            pass(g, &g->n_arrived, 1);
            pass(g, &g->n_served, 0); /* it never serves */
        }
    }
    stage_life(g->w[0]);
    for (int i = 1; i < g->n; i++)
        if (started[i])
            pthread_join(threads[i], NULL);
    worker_health_stop(g);
    /* A stage that could not load or start says why the process ended;
     * else a halted one asks to be restarted. */
    int rc = 0;
    for (int i = 0; i < g->n; i++)
        if (g->w[i]->status && g->w[i]->status != KILN_WORKER_EXIT_RESTART)
            return g->w[i]->status;
        else if (g->w[i]->status)
            rc = g->w[i]->status;
    return rc;
}

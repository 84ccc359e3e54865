#include "pool.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct task {
    void (*fn)(void *);
    void *arg;
    struct task *next;
} task;

struct kiln_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task *head, *tail;
    int closing;
    int n;
    pthread_t threads[];
};

static void *pool_main(void *arg)
{
    kiln_pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->head && !p->closing)
            pthread_cond_wait(&p->cv, &p->mu);
        task *t = p->head;
        if (t) {
            p->head = t->next;
            if (!p->head)
                p->tail = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        if (!t)
            return NULL; /* closing and drained */
        t->fn(t->arg);
        free(t);
    }
}

kiln_pool *kiln_pool_create(int threads, kiln_err *err)
{
    if (threads < 1 || threads > KILN_POOL_MAX_THREADS) {
        kiln_err_set(err, KILN_ERR_INVALID, "pool: 1 to %d threads", KILN_POOL_MAX_THREADS);
        return NULL;
    }
    kiln_pool *p = calloc(1, sizeof *p + (size_t)threads * sizeof(pthread_t));
    if (!p || pthread_mutex_init(&p->mu, NULL) || pthread_cond_init(&p->cv, NULL)) {
        free(p);
        kiln_err_set(err, KILN_ERR_NOMEM, "pool: out of memory");
        return NULL;
    }
    for (; p->n < threads; p->n++)
        if (pthread_create(&p->threads[p->n], NULL, pool_main, p)) {
            kiln_err_set(err, KILN_ERR_NOMEM, "pool: cannot start a thread");
            kiln_pool_destroy(p);
            return NULL;
        }
    return p;
}

kiln_status kiln_pool_submit(kiln_pool *p, void (*fn)(void *arg), void *arg, kiln_err *err)
{
    task *t = malloc(sizeof *t);
    if (!t)
        return kiln_err_set(err, KILN_ERR_NOMEM, "pool: out of memory");
    *t = (task){.fn = fn, .arg = arg};
    pthread_mutex_lock(&p->mu);
    if (p->closing) {
        pthread_mutex_unlock(&p->mu);
        free(t);
        return kiln_err_set(err, KILN_ERR_UNAVAILABLE, "pool: shutting down");
    }
    if (p->tail)
        p->tail->next = t;
    else
        p->head = t;
    p->tail = t;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return KILN_OK;
}

void kiln_pool_destroy(kiln_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

#include "fairq.h"

#include <stdlib.h>
#include <string.h>

struct kiln_fairq_client {
    uint64_t key;
    kiln_fairq_node *head, *tail;
    double finish; /* end tag of its last queued job */
    kiln_fairq_client *prev, *next; /* kiln_fairq.active, in arrival order */
};

/* idmap keys are never 0. */
static uint64_t key_of(uint64_t client)
{
    return client + 1 ? client + 1 : 1;
}

void kiln_fairq_init(kiln_fairq *q)
{
    memset(q, 0, sizeof *q);
}

void kiln_fairq_free(kiln_fairq *q)
{
    while (q->active) {
        kiln_fairq_client *c = q->active;
        q->active = c->next;
        free(c);
    }
    kiln_idmap_free(&q->clients);
    memset(q, 0, sizeof *q);
}

kiln_status kiln_fairq_push(kiln_fairq *q, kiln_fairq_node *n, uint64_t client, double cost,
                            int front, kiln_err *err)
{
    uint64_t key = key_of(client);
    kiln_fairq_client *c = kiln_idmap_get(&q->clients, key);
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c || kiln_idmap_put(&q->clients, key, c, err)) {
            free(c);
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        }
        c->key = key;
        c->finish = q->vtime;
        /* Appended: iteration sees clients in the order they came. */
        kiln_fairq_client **at = &q->active, *last = NULL;
        while (*at)
            last = *at, at = &(*at)->next;
        c->prev = last;
        *at = c;
    }
    n->client = c;
    n->cost = cost > 0 ? cost : 0;
    n->seq = q->seq++;
    n->front = front;
    if (front) {
        n->start = q->vtime;
        n->prev = NULL;
        n->next = c->head;
        if (c->head)
            c->head->prev = n;
        else
            c->tail = n;
        c->head = n;
    } else {
        n->start = c->finish > q->vtime ? c->finish : q->vtime;
        c->finish = n->start + n->cost;
        n->next = NULL;
        n->prev = c->tail;
        if (c->tail)
            c->tail->next = n;
        else
            c->head = n;
        c->tail = n;
    }
    q->count++;
    return KILN_OK;
}

/* 1 when a goes before b. */
static int before(const kiln_fairq_node *a, const kiln_fairq_node *b)
{
    if (a->front != b->front)
        return a->front;
    if (!a->front && a->start != b->start)
        return a->start < b->start;
    return a->seq < b->seq;
}

kiln_fairq_node *kiln_fairq_peek(const kiln_fairq *q)
{
    kiln_fairq_node *best = NULL;
    for (const kiln_fairq_client *c = q->active; c; c = c->next)
        if (!best || before(c->head, best))
            best = c->head;
    return best;
}

void kiln_fairq_remove(kiln_fairq *q, kiln_fairq_node *n)
{
    kiln_fairq_client *c = n->client;
    if (!n->front && n == kiln_fairq_peek(q) && n->start > q->vtime)
        q->vtime = n->start;
    if (n->prev)
        n->prev->next = n->next;
    else
        c->head = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        c->tail = n->prev;
    n->prev = n->next = NULL;
    n->client = NULL;
    q->count--;
    if (!c->head) {
        if (c->prev)
            c->prev->next = c->next;
        else
            q->active = c->next;
        if (c->next)
            c->next->prev = c->prev;
        kiln_idmap_del(&q->clients, c->key);
        free(c);
    }
}

kiln_fairq_node *kiln_fairq_first(const kiln_fairq *q)
{
    return q->active ? q->active->head : NULL;
}

kiln_fairq_node *kiln_fairq_next(const kiln_fairq *q, const kiln_fairq_node *n)
{
    (void)q;
    if (n->next)
        return n->next;
    return n->client->next ? n->client->next->head : NULL;
}

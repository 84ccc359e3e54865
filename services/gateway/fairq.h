/* kiln fair queue: the jobs waiting in one of the gateway's stage queues,
 * served fairly across clients rather than first come, first served, so a
 * client that queues many (or costly) requests delays its own, not
 * everyone's.
 *
 *   kiln_fairq q;
 *   kiln_fairq_init(&q);
 *   kiln_fairq_push(&q, &job->fq, client, cost, 0, &err);  // 1: ahead of everyone
 *   kiln_fairq_node *n = kiln_fairq_peek(&q);              // the next to serve, or NULL
 *   kiln_fairq_remove(&q, n);                              // served, or cancelled
 *   for (n = kiln_fairq_first(&q); n; n = kiln_fairq_next(&q, n)) ...  // every queued node
 *   kiln_fairq_free(&q);
 *
 * Start-time fair queuing (Goyal et al., 1996) weighted by cost: each
 * client's jobs keep their order; a job's start tag is the later of the
 * queue's virtual time and the end tag of its client's previous job, its
 * end tag that plus its cost; the queued head with the smallest start tag
 * goes next (ties: arrival order) and the virtual time moves to it.  So
 * clients are served in proportion to cost, a newcomer waits behind at
 * most one job of each busy client, and an idle client banks no credit.
 * A job pushed to the front (a re-dispatch) goes before every tagged one.
 * Peek costs one pass over the clients with queued jobs.
 *
 * Intrusive (the node lives in the job) and not thread-safe.
 */
#ifndef KILN_GW_FAIRQ_H
#define KILN_GW_FAIRQ_H

#include <stdint.h>

#include "common/error.h"
#include "idmap.h"

typedef struct kiln_fairq_client kiln_fairq_client;

typedef struct kiln_fairq_node {
    struct kiln_fairq_node *prev, *next; /* in its client's queue */
    kiln_fairq_client *client;
    double start, cost;
    uint64_t seq;
    int front;
} kiln_fairq_node;

typedef struct kiln_fairq {
    kiln_idmap clients; /* client id + 1 -> kiln_fairq_client, while it has queued nodes */
    kiln_fairq_client *active; /* the same, listed in arrival order */
    double vtime;
    uint64_t seq;
    int count;
} kiln_fairq;

void kiln_fairq_init(kiln_fairq *q);
/* Frees the client records (the nodes belong to their owners). */
void kiln_fairq_free(kiln_fairq *q);

/* Queues n for `client` (any value, 0 included).  KILN_ERR_NOMEM when a
 * new client cannot be recorded (n is not queued). */
kiln_status kiln_fairq_push(kiln_fairq *q, kiln_fairq_node *n, uint64_t client, double cost,
                            int front, kiln_err *err);
kiln_fairq_node *kiln_fairq_peek(const kiln_fairq *q);
/* Takes a queued node out; when it is the one peek gives, the virtual time
 * moves on to it. */
void kiln_fairq_remove(kiln_fairq *q, kiln_fairq_node *n);

/* Every queued node: each client's in order, clients in arrival order.
 * A loop may remove the node it is on once it has its next. */
kiln_fairq_node *kiln_fairq_first(const kiln_fairq *q);
kiln_fairq_node *kiln_fairq_next(const kiln_fairq *q, const kiln_fairq_node *n);

#endif

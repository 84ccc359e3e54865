/* The gateway's fair stage queue (services/gateway/fairq.c): one client's
 * jobs keep their order; a client arriving behind a flood is served after
 * at most one job of the flood; service follows cost; re-dispatches go
 * first; cancelled jobs leave cleanly; iteration sees every job, also
 * while removing; a client that was idle banks no credit. */
#include <string.h>

#include "services/gateway/fairq.h"
#include "tests/test.h"

typedef struct job {
    kiln_fairq_node fq;
    int id;
} job;

static job jobs[64];

static void push(kiln_fairq *q, int id, uint64_t client, double cost, int front)
{
    jobs[id].id = id;
    CHECK(kiln_fairq_push(q, &jobs[id].fq, client, cost, front, NULL) == KILN_OK);
}

/* Serves `n` jobs; their ids into out. */
static void serve(kiln_fairq *q, int n, int *out)
{
    for (int i = 0; i < n; i++) {
        kiln_fairq_node *f = kiln_fairq_peek(q);
        out[i] = f ? ((job *)f)->id : -1;
        if (f)
            kiln_fairq_remove(q, f);
    }
}

static void test_flood_and_newcomer(void)
{
    kiln_fairq q;
    kiln_fairq_init(&q);
    for (int i = 0; i < 10; i++)
        push(&q, i, 7, 1.0, 0); /* a flood from client 7 */
    push(&q, 10, 8, 1.0, 0);    /* then one request of client 8 */
    CHECK(q.count == 11);
    int out[11];
    serve(&q, 11, out);
    CHECK(out[0] == 0 && out[1] == 10); /* behind one job of the flood */
    for (int i = 2; i < 11; i++)
        CHECK(out[i] == i - 1); /* the flood keeps its order */
    CHECK(q.count == 0 && !kiln_fairq_peek(&q));
    kiln_fairq_free(&q);
}

static void test_cost_weighted(void)
{
    kiln_fairq q;
    kiln_fairq_init(&q);
    /* Client 1's jobs cost 3, client 2's cost 1: in the same span client 2
     * gets three jobs for each of client 1's. */
    for (int i = 0; i < 4; i++)
        push(&q, i, 1, 3.0, 0);
    for (int i = 0; i < 12; i++)
        push(&q, 4 + i, 2, 1.0, 0);
    int out[16], ones = 0;
    serve(&q, 8, out);
    for (int i = 0; i < 8; i++)
        ones += out[i] < 4;
    CHECKF(ones == 2, "%d of client 1's costly jobs in the first 8", ones);
    serve(&q, 8, out);
    kiln_fairq_free(&q);
}

static void test_front_cancel_iterate(void)
{
    kiln_fairq q;
    kiln_fairq_init(&q);
    push(&q, 0, 1, 1, 0), push(&q, 1, 1, 1, 0), push(&q, 2, 2, 1, 0), push(&q, 3, 2, 1, 0);
    push(&q, 4, 2, 1, 1); /* a re-dispatch: first of all */
    int seen = 0, n = 0;
    for (kiln_fairq_node *f = kiln_fairq_first(&q); f; f = kiln_fairq_next(&q, f))
        seen |= 1 << ((job *)f)->id, n++;
    CHECK(n == 5 && seen == 31);
    /* Remove every job of client 2 while iterating. */
    for (kiln_fairq_node *f = kiln_fairq_first(&q), *next; f; f = next) {
        next = kiln_fairq_next(&q, f);
        if (((job *)f)->id >= 2)
            kiln_fairq_remove(&q, f);
    }
    CHECK(q.count == 2);
    push(&q, 5, 3, 1, 1);
    kiln_fairq_remove(&q, &jobs[0].fq); /* a cancel in the middle */
    int out[2];
    serve(&q, 2, out);
    CHECK(out[0] == 5 && out[1] == 1);
    kiln_fairq_free(&q);
}

static void test_no_banked_credit(void)
{
    kiln_fairq q;
    kiln_fairq_init(&q);
    /* Client 1 is served alone for a while; client 2, idle meanwhile,
     * then arrives with a burst: they alternate, client 2 does not get
     * its idle time back as a run of its own. */
    for (int i = 0; i < 5; i++)
        push(&q, i, 1, 1, 0);
    int out[10];
    serve(&q, 3, out);
    for (int i = 0; i < 4; i++)
        push(&q, 5 + i, 2, 1, 0);
    serve(&q, 6, out);
    /* Left of client 1: 3, 4 (start tags 3, 4); client 2's 5..8 start
     * at the virtual time of the last job served (2), so the two
     * alternate; banked credit would have put 5, 6, 7 before 3. */
    CHECKF(out[0] == 5 && out[1] == 3 && out[2] == 6 && out[3] == 4 && out[4] == 7 && out[5] == 8,
           "%d %d %d %d %d %d", out[0], out[1], out[2], out[3], out[4], out[5]);
    kiln_fairq_free(&q);
}

int main(void)
{
    RUN(test_flood_and_newcomer);
    RUN(test_cost_weighted);
    RUN(test_front_cancel_iterate);
    RUN(test_no_banked_credit);
    return test_finish();
}

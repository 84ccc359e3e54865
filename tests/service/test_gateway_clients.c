/* The gateway's client accounting (services/gateway/clients.c) without a
 * server: connections per address, ids per token and address, and the
 * body budget: charges within the global budget and each client's share,
 * waiters granted in order as bytes come back, one client at its share
 * never holding up the others, one held back by the global budget not
 * overtaken by newcomers, cancelled waits and the stats. */
#include <string.h>

#include "services/gateway/clients.h"
#include "tests/test.h"

static int granted[8];

static void on_granted(void *ud)
{
    granted[(int *)ud - granted]++;
}

static void test_ids_and_connections(void)
{
    kiln_gw_clients_limits lim = {.max_connections = 2, .body_budget = 100, .client_body_budget = 50};
    kiln_gw_clients *cl = kiln_gw_clients_create(&lim, NULL);
    CHECK(cl != NULL);
    uint64_t a = kiln_gw_client_id(cl, KILN_GW_CLIENT_ADDRESS, "10.0.0.1", 8);
    uint64_t b = kiln_gw_client_id(cl, KILN_GW_CLIENT_ADDRESS, "10.0.0.2", 8);
    uint64_t t = kiln_gw_client_id(cl, KILN_GW_CLIENT_TOKEN, "10.0.0.1", 8);
    CHECK(a && b && t && a != b && a != t);
    CHECK(a == kiln_gw_client_id(cl, KILN_GW_CLIENT_ADDRESS, "10.0.0.1", 8));
    CHECK(kiln_gw_clients_connect(cl, a) == 0 && kiln_gw_clients_connect(cl, a) == 0);
    CHECK(kiln_gw_clients_connect(cl, a) == -1); /* its third */
    CHECK(kiln_gw_clients_connect(cl, b) == 0);  /* another address is not affected */
    kiln_gw_clients_stats st;
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.conn_refused == 1 && st.clients == 2);
    kiln_gw_clients_disconnect(cl, a);
    CHECK(kiln_gw_clients_connect(cl, a) == 0);
    kiln_gw_clients_disconnect(cl, a), kiln_gw_clients_disconnect(cl, a);
    kiln_gw_clients_disconnect(cl, b);
    kiln_gw_clients_disconnect(cl, b); /* one too many is ignored */
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.clients == 0);
    kiln_gw_clients_destroy(cl);
}

static void test_body_budget(void)
{
    kiln_gw_clients_limits lim = {.body_budget = 100, .client_body_budget = 50};
    kiln_gw_clients *cl = kiln_gw_clients_create(&lim, NULL);
    memset(granted, 0, sizeof granted);
    uint64_t x = 11, y = 22, z = 33, u = 44;
    CHECK(kiln_gw_clients_body_too_large(cl, 51) && !kiln_gw_clients_body_too_large(cl, 50));
    CHECK(kiln_gw_clients_take_body(cl, x, 40) == 0);
    /* x at its share: its next body waits, without holding up y. */
    CHECK(kiln_gw_clients_take_body(cl, x, 20) == -1);
    kiln_gw_body_waiter wx = {0}, wz = {0}, wu = {0};
    kiln_gw_clients_wait_body(cl, &wx, x, 20, on_granted, &granted[0]);
    CHECK(kiln_gw_clients_take_body(cl, y, 50) == 0);
    /* 90 of 100 used: z's 30 waits for the global budget, and u's 5,
     * which would fit, queues behind it rather than overtake it. */
    CHECK(kiln_gw_clients_take_body(cl, z, 30) == -1);
    kiln_gw_clients_wait_body(cl, &wz, z, 30, on_granted, &granted[1]);
    CHECK(kiln_gw_clients_take_body(cl, u, 5) == -1);
    kiln_gw_clients_wait_body(cl, &wu, u, 5, on_granted, &granted[2]);
    kiln_gw_clients_stats st;
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.body_bytes == 90 && st.body_waiting == 3 && st.body_waits == 3);
    /* y gives back 50: x is still at its share (skipped), z and u fit. */
    kiln_gw_clients_give_body(cl, y, 50);
    CHECK(granted[0] == 0 && granted[1] == 1 && granted[2] == 1);
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.body_bytes == 75 && st.body_waiting == 1 && st.body_peak == 90);
    /* x's first body goes: its waiter gets its 20. */
    kiln_gw_clients_give_body(cl, x, 40);
    CHECK(granted[0] == 1);
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.body_bytes == 55 && st.body_waiting == 0);
    /* A cancelled waiter is never granted. */
    CHECK(kiln_gw_clients_take_body(cl, y, 50) == -1);
    kiln_gw_body_waiter wy = {0};
    kiln_gw_clients_wait_body(cl, &wy, y, 50, on_granted, &granted[3]);
    kiln_gw_clients_cancel_wait(cl, &wy);
    kiln_gw_clients_cancel_wait(cl, &wy); /* twice is harmless */
    kiln_gw_clients_give_body(cl, z, 30);
    kiln_gw_clients_give_body(cl, u, 5);
    kiln_gw_clients_give_body(cl, x, 20);
    CHECK(granted[3] == 0);
    kiln_gw_clients_stats_get(cl, &st);
    CHECK(st.body_bytes == 0 && st.clients == 0 && st.body_waiting == 0);
    /* Zero bytes are always fine. */
    CHECK(kiln_gw_clients_take_body(cl, x, 0) == 0);
    kiln_gw_clients_destroy(cl);
}

int main(void)
{
    RUN(test_ids_and_connections);
    RUN(test_body_budget);
    return test_finish();
}

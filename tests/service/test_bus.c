/* Bus sockets: DEALER <-> ROUTER round trips with routing ids, the
 * connection event a replica registers on (again after the ROUTER side
 * restarts), refusal to send to unknown peers, and messages with the wrong
 * frame count dropped without desynchronising the socket, frames over the
 * ROUTER's limit never taken in. */
#include <stdio.h>
#include <unistd.h>

#include <zmq.h>

#include "common/bus.h"
#include "common/log.h"
#include "tests/test.h"

static char endpoint[256];

/* Waits up to 5 s for `flag` from kiln_bus_wait. */
static int wait_flag(kiln_bus *b, int flag)
{
    kiln_err err = {0};
    double until = kiln_now_ms() + 5000;
    while (kiln_now_ms() < until) {
        int ev = kiln_bus_wait(b, -1, 50, &err);
        if (ev < 0)
            return 0;
        if (ev & flag)
            return 1;
    }
    return 0;
}

static int recv_one(kiln_bus *b, char *peer, size_t cap, kiln_buf *f)
{
    kiln_err err = {0};
    double until = kiln_now_ms() + 5000;
    while (kiln_now_ms() < until) {
        int rc = kiln_bus_recv(b, peer, cap, f, &err);
        if (rc)
            return rc;
        kiln_bus_wait(b, -1, 50, &err);
    }
    return 0;
}

static void test_roundtrip_and_reconnect(void)
{
    kiln_err err = {0};
    kiln_bus *router = kiln_bus_bind(endpoint, 0, &err);
    CHECKF(router != NULL, "%s", err.msg);
    kiln_bus *dealer = kiln_bus_connect(endpoint, "decode-test-1", &err);
    CHECKF(dealer != NULL, "%s", err.msg);
    if (!router || !dealer)
        return;
    CHECK(wait_flag(dealer, KILN_BUS_CONNECTED));

    kiln_msg hb = {.type = KILN_MSG_HB, .epoch = 1};
    CHECK(kiln_bus_send_msg(dealer, NULL, &hb, &err) == KILN_OK);
    CHECK(kiln_bus_send_msg(dealer, "someone", &hb, &err) == KILN_ERR_INTERNAL);
    char peer[KILN_PROTO_ID_MAX];
    kiln_buf f = {0};
    CHECK(recv_one(router, peer, sizeof peer, &f) == 1);
    CHECK(!strcmp(peer, "decode-test-1"));
    kiln_msg *m = kiln_msg_decode(f.data, f.len, &err);
    CHECK(m && m->type == KILN_MSG_HB);
    kiln_msg_free(m);

    kiln_msg cancel = {.type = KILN_MSG_CANCEL, .epoch = 1, .cancel_job = 99};
    CHECK(kiln_bus_send_msg(router, "decode-test-1", &cancel, &err) == KILN_OK);
    CHECK(kiln_bus_send_msg(router, "nobody-2", &cancel, &err) == KILN_ERR_UNAVAILABLE);
    CHECK(kiln_bus_send_msg(router, NULL, &cancel, &err) == KILN_ERR_INTERNAL);
    CHECK(recv_one(dealer, NULL, 0, &f) == 1);
    m = kiln_msg_decode(f.data, f.len, &err);
    CHECK(m && m->type == KILN_MSG_CANCEL && m->cancel_job == 99);
    kiln_msg_free(m);

    /* The gateway restarts: the replica sees a new connection (and would
     * say hello again), and messages flow to the new ROUTER. */
    kiln_bus_close(router);
    router = kiln_bus_bind(endpoint, 0, &err);
    CHECKF(router != NULL, "%s", err.msg);
    CHECK(wait_flag(dealer, KILN_BUS_CONNECTED));
    CHECK(kiln_bus_send_msg(dealer, NULL, &hb, &err) == KILN_OK);
    CHECK(router && recv_one(router, peer, sizeof peer, &f) == 1 &&
          !strcmp(peer, "decode-test-1"));
    kiln_buf_free(&f);
    kiln_bus_close(dealer);
    kiln_bus_close(router);
}

/* A raw peer sending two frames, then one: the first message is dropped
 * as malformed, the second arrives intact. */
static void test_bad_framing(void)
{
    kiln_err err = {0};
    kiln_bus *router = kiln_bus_bind(endpoint, 0, &err);
    void *ctx = zmq_ctx_new();
    void *raw = zmq_socket(ctx, ZMQ_DEALER);
    CHECK(router && raw && !zmq_setsockopt(raw, ZMQ_ROUTING_ID, "raw-1", 5) &&
          !zmq_connect(raw, endpoint));
    CHECK(zmq_send(raw, "a", 1, ZMQ_SNDMORE) == 1 && zmq_send(raw, "b", 1, 0) == 1);
    CHECK(zmq_send(raw, "ok", 2, 0) == 2);
    char peer[KILN_PROTO_ID_MAX];
    kiln_buf f = {0};
    CHECK(recv_one(router, peer, sizeof peer, &f) == -1);
    CHECK(recv_one(router, peer, sizeof peer, &f) == 1 && f.len == 2 && !memcmp(f.data, "ok", 2));
    kiln_buf_free(&f);
    int linger = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(raw);
    zmq_ctx_term(ctx);
    kiln_bus_close(router);
    CHECK(kiln_bus_bind("nonsense://x", 0, &err) == NULL && err.code == KILN_ERR_IO);
}

/* A ROUTER bound with a frame limit: a peer announcing a larger frame is
 * cut off before the frame is taken in (nothing arrives), and a peer that
 * keeps to the limit is heard. */
static void test_max_message(void)
{
    kiln_err err = {0};
    kiln_bus *router = kiln_bus_bind(endpoint, 64 << 10, &err);
    void *ctx = zmq_ctx_new();
    void *big = zmq_socket(ctx, ZMQ_DEALER), *small = zmq_socket(ctx, ZMQ_DEALER);
    CHECK(router && big && small && !zmq_setsockopt(big, ZMQ_ROUTING_ID, "big-1", 5) &&
          !zmq_setsockopt(small, ZMQ_ROUTING_ID, "small-1", 7) && !zmq_connect(big, endpoint) &&
          !zmq_connect(small, endpoint));
    static char frame[(64 << 10) + 1];
    memset(frame, 'x', sizeof frame);
    CHECK(zmq_send(big, frame, sizeof frame, 0) == (int)sizeof frame);
    char peer[KILN_PROTO_ID_MAX];
    kiln_buf f = {0};
    double t0 = kiln_now_ms();
    while (kiln_now_ms() - t0 < 500) {
        CHECK(kiln_bus_recv(router, peer, sizeof peer, &f, &err) == 0);
        kiln_bus_wait(router, -1, 50, &err);
    }
    CHECK(zmq_send(small, frame, sizeof frame - 1, 0) == (int)sizeof frame - 1);
    CHECK(recv_one(router, peer, sizeof peer, &f) == 1 && f.len == sizeof frame - 1);
    /* The same frame reaches a ROUTER with the default limit. */
    kiln_bus_close(router);
    router = kiln_bus_bind(endpoint, 0, &err);
    CHECK(router != NULL);
    CHECK(zmq_send(big, frame, sizeof frame, 0) == (int)sizeof frame);
    CHECK(recv_one(router, peer, sizeof peer, &f) == 1 && f.len == sizeof frame &&
          !strcmp(peer, "big-1"));
    kiln_buf_free(&f);
    int linger = 0;
    zmq_setsockopt(big, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(small, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(big);
    zmq_close(small);
    zmq_ctx_term(ctx);
    kiln_bus_close(router);
}

int main(void)
{
    snprintf(endpoint, sizeof endpoint, "ipc:///tmp/kiln-test-bus-%ld", (long)getpid());
    RUN(test_roundtrip_and_reconnect);
    RUN(test_bad_framing);
    RUN(test_max_message);
    unlink(endpoint + strlen("ipc://"));
    return test_finish();
}

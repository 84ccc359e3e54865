#include "bus.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

struct kiln_bus {
    void *ctx;
    void *sock;
    void *mon; /* DEALER: PAIR receiving the socket's connection events */
    int router;
};

static kiln_status zfail(kiln_err *err, kiln_status code, const char *what)
{
    return kiln_err_set(err, code, "zmq %s: %s", what, zmq_strerror(zmq_errno()));
}

static kiln_status set_int(kiln_bus *b, int opt, int v, const char *what, kiln_err *err)
{
    if (zmq_setsockopt(b->sock, opt, &v, sizeof v))
        return zfail(err, KILN_ERR_IO, what);
    return KILN_OK;
}

/* Set before bind / connect: libzmq copies socket options into each
 * listener and connection when it makes them. */
static kiln_status set_max_msg(kiln_bus *b, size_t max_msg, kiln_err *err)
{
    int64_t v = (int64_t)(max_msg && max_msg < KILN_PROTO_MAX_FRAME ? max_msg : KILN_PROTO_MAX_FRAME);
    if (zmq_setsockopt(b->sock, ZMQ_MAXMSGSIZE, &v, sizeof v))
        return zfail(err, KILN_ERR_IO, "max message size");
    return KILN_OK;
}

void kiln_bus_close(kiln_bus *b)
{
    if (!b)
        return;
    if (b->mon) {
        zmq_socket_monitor(b->sock, NULL, 0);
        zmq_close(b->mon);
    }
    if (b->sock)
        zmq_close(b->sock);
    if (b->ctx)
        zmq_ctx_term(b->ctx);
    free(b);
}

static kiln_bus *bus_new(int type, size_t max_msg, kiln_err *err)
{
    kiln_bus *b = calloc(1, sizeof *b);
    if (!b) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    b->router = type == ZMQ_ROUTER;
    b->ctx = zmq_ctx_new();
    if (!b->ctx) {
        zfail(err, KILN_ERR_IO, "context");
        free(b);
        return NULL;
    }
    b->sock = zmq_socket(b->ctx, type);
    /* Linger bounds how long close waits to flush the last replies.  A
     * peer that vanished without closing TCP is noticed by the kernel's
     * keepalive (about 25 s), not by ZMTP heartbeats: those are answered
     * by the process, so a process paused for a few seconds (SIGSTOP, a
     * cgroup freeze, a long GC-like stall) would lose its connection, and
     * with it the messages queued on it.  Liveness is the protocol's
     * business (hb, progress), judged by the gateway. */
    if (!b->sock || set_int(b, ZMQ_LINGER, 500, "linger", err) ||
        set_int(b, ZMQ_TCP_KEEPALIVE, 1, "tcp keepalive", err) ||
        set_int(b, ZMQ_TCP_KEEPALIVE_IDLE, 10, "tcp keepalive idle", err) ||
        set_int(b, ZMQ_TCP_KEEPALIVE_INTVL, 5, "tcp keepalive interval", err) ||
        set_int(b, ZMQ_TCP_KEEPALIVE_CNT, 3, "tcp keepalive count", err) ||
        set_int(b, ZMQ_SNDHWM, 10000, "send hwm", err) ||
        set_int(b, ZMQ_RCVHWM, 10000, "receive hwm", err) || set_max_msg(b, max_msg, err)) {
        if (!b->sock)
            zfail(err, KILN_ERR_IO, "socket");
        kiln_bus_close(b);
        return NULL;
    }
    return b;
}

kiln_bus *kiln_bus_connect(const char *endpoint, const char *identity, kiln_err *err)
{
    kiln_bus *b = bus_new(ZMQ_DEALER, 0, err);
    if (!b)
        return NULL;
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://kiln-bus-mon-%p", (void *)b);
    if (zmq_setsockopt(b->sock, ZMQ_ROUTING_ID, identity, strlen(identity))) {
        zfail(err, KILN_ERR_INVALID, "routing id");
        goto fail;
    }
    if (set_int(b, ZMQ_RECONNECT_IVL, 100, "reconnect interval", err) ||
        set_int(b, ZMQ_RECONNECT_IVL_MAX, 2000, "reconnect max", err))
        goto fail;
    if (zmq_socket_monitor(b->sock, mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED)) {
        zfail(err, KILN_ERR_IO, "monitor");
        goto fail;
    }
    b->mon = zmq_socket(b->ctx, ZMQ_PAIR);
    if (!b->mon || zmq_connect(b->mon, mon)) {
        zfail(err, KILN_ERR_IO, "monitor socket");
        goto fail;
    }
    if (zmq_connect(b->sock, endpoint)) {
        kiln_err_set(err, KILN_ERR_INVALID, "bus endpoint '%s': %s", endpoint,
                     zmq_strerror(zmq_errno()));
        goto fail;
    }
    return b;
fail:
    kiln_bus_close(b);
    return NULL;
}

kiln_bus *kiln_bus_bind(const char *endpoint, size_t max_msg, kiln_err *err)
{
    kiln_bus *b = bus_new(ZMQ_ROUTER, max_msg, err);
    if (!b)
        return NULL;
    /* Mandatory: an unknown peer is an error, not a silent drop.  Handover:
     * a replica that reconnects with the same id takes its route over. */
    if (set_int(b, ZMQ_ROUTER_MANDATORY, 1, "router mandatory", err) ||
        set_int(b, ZMQ_ROUTER_HANDOVER, 1, "router handover", err))
        goto fail;
    if (zmq_bind(b->sock, endpoint)) {
        kiln_err_set(err, KILN_ERR_IO, "cannot bind the bus on '%s': %s", endpoint,
                     zmq_strerror(zmq_errno()));
        goto fail;
    }
    return b;
fail:
    kiln_bus_close(b);
    return NULL;
}

static kiln_status send_status(const char *what, kiln_err *err)
{
    int e = zmq_errno();
    if (e == EAGAIN)
        return kiln_err_set(err, KILN_ERR_BUSY, "bus %s: queue full", what);
    if (e == EHOSTUNREACH)
        return kiln_err_set(err, KILN_ERR_UNAVAILABLE, "bus %s: unknown peer", what);
    return kiln_err_set(err, KILN_ERR_IO, "bus %s: %s", what, zmq_strerror(e));
}

kiln_status kiln_bus_send(kiln_bus *b, const char *peer, const void *frame, size_t len,
                          kiln_err *err)
{
    if (!b->router != !peer)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "bus send: peer is %s on a %s",
                            peer ? "set" : "missing", b->router ? "ROUTER" : "DEALER");
    if (peer && zmq_send(b->sock, peer, strlen(peer), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return send_status("send", err);
    if (zmq_send(b->sock, frame, len, ZMQ_DONTWAIT) < 0)
        return send_status("send", err);
    return KILN_OK;
}

kiln_status kiln_bus_send_msg(kiln_bus *b, const char *peer, const kiln_msg *m, kiln_err *err)
{
    kiln_buf f = {0};
    kiln_status st = kiln_msg_encode(m, &f, err);
    if (!st)
        st = kiln_bus_send(b, peer, f.data, f.len, err);
    kiln_buf_free(&f);
    return st;
}

/* Reads the remaining parts of a multi-part message so the next recv
 * starts on a message boundary. */
static void drain(void *sock)
{
    int more = 1;
    size_t sz = sizeof more;
    while (!zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) && more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        int rc = zmq_msg_recv(&m, sock, ZMQ_DONTWAIT);
        zmq_msg_close(&m);
        if (rc < 0)
            break;
        sz = sizeof more;
    }
}

static int has_more(void *sock)
{
    int more = 0;
    size_t sz = sizeof more;
    return !zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) && more;
}

int kiln_bus_recv(kiln_bus *b, char *peer, size_t peer_cap, kiln_buf *frame, kiln_err *err)
{
    kiln_buf_clear(frame);
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, b->sock, ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        zmq_msg_close(&part);
        if (e == EAGAIN)
            return 0;
        kiln_err_set(err, KILN_ERR_IO, "bus receive: %s", zmq_strerror(e));
        return -1;
    }
    if (b->router) {
        size_t n = zmq_msg_size(&part);
        const char *id = zmq_msg_data(&part);
        int printable = n > 0 && n < peer_cap;
        for (size_t i = 0; printable && i < n; i++)
            printable = id[i] > 0x20 && id[i] < 0x7f;
        if (printable) {
            memcpy(peer, id, n);
            peer[n] = '\0';
        }
        int more = has_more(b->sock);
        zmq_msg_close(&part);
        if (!printable || !more) {
            drain(b->sock);
            kiln_err_set(err, KILN_ERR_INVALID, "bus: dropped a message with a bad routing id");
            return -1;
        }
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, b->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            kiln_err_set(err, KILN_ERR_IO, "bus receive: %s", zmq_strerror(zmq_errno()));
            return -1;
        }
    }
    if (has_more(b->sock)) {
        zmq_msg_close(&part);
        drain(b->sock);
        kiln_err_set(err, KILN_ERR_INVALID, "bus: dropped a message of more than one frame");
        return -1;
    }
    kiln_status st = kiln_buf_append(frame, zmq_msg_data(&part), zmq_msg_size(&part), err);
    zmq_msg_close(&part);
    return st ? -1 : 1;
}

/* Consumes pending monitor events; 1 when one was a completed handshake. */
static int monitor_events(kiln_bus *b)
{
    int connected = 0;
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, b->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return connected;
        }
        /* Frame 1: u16 event + u32 value; frame 2: the endpoint. */
        if (zmq_msg_size(&ev) >= 2) {
            uint16_t id;
            memcpy(&id, zmq_msg_data(&ev), sizeof id);
            connected |= id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
        }
        zmq_msg_close(&ev);
        drain(b->mon);
    }
}

int kiln_bus_wait(kiln_bus *b, int fd, int timeout_ms, kiln_err *err)
{
    zmq_pollitem_t items[3] = {{.socket = b->sock, .events = ZMQ_POLLIN}};
    int n = 1, fd_at = -1, mon_at = -1;
    if (fd >= 0)
        fd_at = n, items[n++] = (zmq_pollitem_t){.fd = fd, .events = ZMQ_POLLIN};
    if (b->mon)
        mon_at = n, items[n++] = (zmq_pollitem_t){.socket = b->mon, .events = ZMQ_POLLIN};
    int rc = zmq_poll(items, n, timeout_ms);
    if (rc < 0) {
        if (zmq_errno() == EINTR)
            return 0;
        kiln_err_set(err, KILN_ERR_IO, "bus poll: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    int ev = 0;
    if (items[0].revents & ZMQ_POLLIN)
        ev |= KILN_BUS_READABLE;
    if (fd_at >= 0 && (items[fd_at].revents & ZMQ_POLLIN))
        ev |= KILN_BUS_FD;
    if (mon_at >= 0 && (items[mon_at].revents & ZMQ_POLLIN) && monitor_events(b))
        ev |= KILN_BUS_CONNECTED;
    return ev;
}

#include "bus.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "log.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01" /* fixed by RFC 27 */
#define ZAP_DOMAIN "kiln"
#define REFUSED_LOG_MS 5000.0
#define RETRY_MS 2000.0 /* a refused DEALER connects again after this */

/* Handshake events the monitor reports: success (a DEALER says hello
 * again) and failures (logged, so an operator sees a key mismatch). */
#define MON_FAILED                                                                             \
    (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |               \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

typedef struct {
    double next_ms; /* when the next line may be written */
    int unlogged;   /* refused since the last line */
} refusal_log;

struct kiln_bus {
    void *ctx;
    void *sock;
    void *mon; /* PAIR receiving the socket's handshake events */
    void *zap; /* ROUTER with CURVE: REP answering handshakes (RFC 27) */
    int router;
    kiln_bus_keys keys; /* a copy; allow owned */
    int refused;        /* DEALER: the last handshake failed, none succeeded since */
    int refusals;       /* failed handshakes seen */
    /* DEALER: libzmq ends a session for good after a protocol-level
     * refusal (a key not allowed, CURVE against plaintext); we connect
     * again at this time, so a fixed gateway finds us without a restart. */
    double retry_at;
    char *endpoint;
    /* Refused handshakes (the monitor's view) and refused keys (ZAP) are
     * rate-limited apart: a plaintext peer retrying must not hide that a
     * keyed one was refused, which is the line an operator looks for. */
    refusal_log handshake_log, key_log;
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

int kiln_bus_endpoint_local(const char *endpoint)
{
    if (!strncmp(endpoint, "ipc://", 6) || !strncmp(endpoint, "inproc://", 9))
        return 1;
    if (strncmp(endpoint, "tcp://", 6))
        return 0;
    const char *host = endpoint + 6;
    if (!strncmp(host, "[::1]:", 6) || !strncmp(host, "localhost:", 10))
        return 1;
    /* 127.0.0.0/8: four dotted numbers, the first 127. */
    unsigned a, b, c, d;
    char colon;
    return sscanf(host, "%u.%u.%u.%u%c", &a, &b, &c, &d, &colon) == 5 && colon == ':' &&
           a == 127 && b < 256 && c < 256 && d < 256;
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
    if (b->zap)
        zmq_close(b->zap);
    if (b->ctx)
        zmq_ctx_term(b->ctx);
    kiln_bus_keys_free(&b->keys);
    free(b->endpoint);
    free(b);
}

/* Logs a refused handshake, at most one line per REFUSED_LOG_MS with the
 * count of those not logged in between (a scan of the port must not
 * flood the log). */
static void log_refused(refusal_log *l, const char *fmt, const char *detail)
{
    double now = kiln_now_ms();
    if (now < l->next_ms) {
        l->unlogged++;
        return;
    }
    char line[384];
    snprintf(line, sizeof line, fmt, detail);
    if (l->unlogged)
        KILN_LOG_WARN("bus: %s (and %d more refused since the last such line)", line, l->unlogged);
    else
        KILN_LOG_WARN("bus: %s", line);
    l->unlogged = 0;
    l->next_ms = now + REFUSED_LOG_MS;
}

static kiln_status set_str(void *sock, int opt, const char *v, const char *what, kiln_err *err)
{
    if (zmq_setsockopt(sock, opt, v, strlen(v)))
        return zfail(err, KILN_ERR_IO, what);
    return KILN_OK;
}

/* Watches the socket's handshakes through a PAIR on an inproc endpoint. */
static kiln_status start_monitor(kiln_bus *b, int events, kiln_err *err)
{
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://kiln-bus-mon-%p", (void *)b);
    if (zmq_socket_monitor(b->sock, mon, events))
        return zfail(err, KILN_ERR_IO, "monitor");
    b->mon = zmq_socket(b->ctx, ZMQ_PAIR);
    if (!b->mon || zmq_connect(b->mon, mon))
        return zfail(err, KILN_ERR_IO, "monitor socket");
    return KILN_OK;
}

static kiln_status copy_keys(kiln_bus *b, const kiln_bus_keys *keys, kiln_err *err)
{
    if (!keys || !keys->secret[0])
        return KILN_OK;
    b->keys = *keys;
    b->keys.allow = NULL;
    b->keys.n_allow = 0;
    for (int i = 0; i < keys->n_allow; i++) {
        uint8_t(*v)[KILN_BUS_KEY_BYTES] = realloc(b->keys.allow, (size_t)(i + 1) * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        b->keys.allow = v;
        memcpy(v[i], keys->allow[i], KILN_BUS_KEY_BYTES);
        b->keys.n_allow = i + 1;
    }
    return KILN_OK;
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

kiln_bus *kiln_bus_connect(const char *endpoint, const char *identity, const kiln_bus_keys *keys,
                           kiln_err *err)
{
    kiln_bus *b = bus_new(ZMQ_DEALER, 0, err);
    if (!b)
        return NULL;
    if (zmq_setsockopt(b->sock, ZMQ_ROUTING_ID, identity, strlen(identity))) {
        zfail(err, KILN_ERR_INVALID, "routing id");
        goto fail;
    }
    if (set_int(b, ZMQ_RECONNECT_IVL, 100, "reconnect interval", err) ||
        set_int(b, ZMQ_RECONNECT_IVL_MAX, 2000, "reconnect max", err) ||
        copy_keys(b, keys, err))
        goto fail;
    if (b->keys.secret[0]) {
        if (!b->keys.server[0]) {
            kiln_err_set(err, KILN_ERR_INVALID, "a bus key needs the gateway's public key too");
            goto fail;
        }
        if (set_str(b->sock, ZMQ_CURVE_SERVERKEY, b->keys.server, "curve server key", err) ||
            set_str(b->sock, ZMQ_CURVE_PUBLICKEY, b->keys.public_key, "curve public key", err) ||
            set_str(b->sock, ZMQ_CURVE_SECRETKEY, b->keys.secret, "curve secret key", err))
            goto fail;
    }
    if (start_monitor(b, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | MON_FAILED, err))
        goto fail;
    if (zmq_connect(b->sock, endpoint)) {
        kiln_err_set(err, KILN_ERR_INVALID, "bus endpoint '%s': %s", endpoint,
                     zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (!(b->endpoint = strdup(endpoint))) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto fail;
    }
    return b;
fail:
    kiln_bus_close(b);
    return NULL;
}

/* The ROUTER as CURVE server, with the ZAP handler bound first: libzmq
 * admits every CURVE client when no handler listens (ZMQ_ZAP_ENFORCE_DOMAIN,
 * which would refuse them, is a draft option Debian's libzmq lacks), so
 * the handler is there before the socket binds and closes after it. */
static kiln_status setup_curve_server(kiln_bus *b, kiln_err *err)
{
    if (!b->keys.n_allow)
        return kiln_err_set(err, KILN_ERR_INVALID, "a bus key needs an allow-list of the "
                            "replicas' public keys");
    b->zap = zmq_socket(b->ctx, ZMQ_REP);
    if (!b->zap || zmq_bind(b->zap, ZAP_ENDPOINT))
        return zfail(err, KILN_ERR_IO, "ZAP handler");
    int one = 1;
    if (zmq_setsockopt(b->sock, ZMQ_CURVE_SERVER, &one, sizeof one))
        return zfail(err, KILN_ERR_IO, "curve server");
    if (set_str(b->sock, ZMQ_CURVE_SECRETKEY, b->keys.secret, "curve secret key", err) ||
        set_str(b->sock, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN, "zap domain", err))
        return err->code;
    return start_monitor(b, MON_FAILED, err);
}

kiln_bus *kiln_bus_bind(const char *endpoint, size_t max_msg, const kiln_bus_keys *keys,
                        kiln_err *err)
{
    kiln_bus *b = bus_new(ZMQ_ROUTER, max_msg, err);
    if (!b)
        return NULL;
    /* Mandatory: an unknown peer is an error, not a silent drop.  Handover:
     * a replica that reconnects with the same id takes its route over. */
    if (set_int(b, ZMQ_ROUTER_MANDATORY, 1, "router mandatory", err) ||
        set_int(b, ZMQ_ROUTER_HANDOVER, 1, "router handover", err) || copy_keys(b, keys, err))
        goto fail;
    if (b->keys.secret[0] && setup_curve_server(b, err))
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

static kiln_status send_status(kiln_bus *b, const char *what, kiln_err *err)
{
    int e = zmq_errno();
    /* A refused DEALER has no pipe to queue in: not a full queue. */
    if (e == EAGAIN && b->refused)
        return kiln_err_set(err, KILN_ERR_UNAVAILABLE, "bus %s: not connected (the gateway "
                            "refused the handshake)", what);
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
        return send_status(b, "send", err);
    if (zmq_send(b->sock, frame, len, ZMQ_DONTWAIT) < 0)
        return send_status(b, "send", err);
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

static void log_failed(kiln_bus *b, uint16_t id, uint32_t value)
{
    char why[160];
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
        snprintf(why, sizeof why, "%s (ZAP status %u)", b->router ? "its key is not allowed"
                 : "the gateway does not allow this replica's key", (unsigned)value);
    else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
             value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        snprintf(why, sizeof why, "one side uses CURVE keys and the other does not");
    else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
        snprintf(why, sizeof why, "protocol error 0x%x (a wrong %s key?)", (unsigned)value,
                 b->router ? "server" : "gateway public");
    else if (b->router)
        snprintf(why, sizeof why, "no detail");
    else
        snprintf(why, sizeof why, "no detail (%s)",
                 b->keys.secret[0] ? "a wrong --bus-server-key, or a gateway without keys?"
                                   : "does the gateway require bus keys? --bus-key, "
                                     "--bus-server-key");
    log_refused(&b->handshake_log,
                b->router ? "refused a peer's handshake: %s"
                          : "the handshake with the gateway failed: %s",
                why);
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
        if (zmq_msg_size(&ev) >= 6) {
            uint16_t id;
            uint32_t value;
            memcpy(&id, zmq_msg_data(&ev), sizeof id);
            memcpy(&value, (const char *)zmq_msg_data(&ev) + 2, sizeof value);
            if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
                connected = 1;
                b->refused = 0;
            } else if (id & MON_FAILED) {
                b->refused = !b->router;
                b->refusals++;
                log_failed(b, id, value);
                if (!b->router && id != ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
                    b->retry_at = kiln_now_ms() + RETRY_MS;
            }
        }
        zmq_msg_close(&ev);
        drain(b->mon);
    }
}

/* Answers the waiting ZAP requests (RFC 27): 200 for a CURVE handshake in
 * our domain from an allowed key, 400 for anything else.  Every request
 * gets a reply (a REP socket takes no new request before it), even a
 * malformed one, which libzmq never sends. */
static void zap_serve(kiln_bus *b)
{
    enum { FRAMES = 7, CAP = 256 };
    for (;;) {
        char f[FRAMES][CAP];
        int n[FRAMES] = {0}, got = 0, bad = 0;
        for (int more = 1; more;) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, b->zap, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                if (!got)
                    return; /* nothing waiting */
                bad = 1;
                break;
            }
            size_t len = zmq_msg_size(&m);
            if (got < FRAMES && len < CAP) {
                memcpy(f[got], zmq_msg_data(&m), len);
                f[got][len] = '\0';
                n[got] = (int)len;
            } else {
                bad = 1;
            }
            got++;
            more = has_more(b->zap);
            zmq_msg_close(&m);
        }
        int ok = !bad && got == FRAMES && !strcmp(f[0], "1.0") && !strcmp(f[2], ZAP_DOMAIN) &&
                 !strcmp(f[5], "CURVE") && n[6] == KILN_BUS_KEY_BYTES &&
                 kiln_bus_keys_allowed(&b->keys, (const uint8_t *)f[6]);
        if (!ok)
            log_refused(&b->key_log,
                        "refused a replica whose key is not in the allow-list (from %s)",
                        got > 3 && n[3] < CAP ? f[3] : "?");
        const char *code = ok ? "200" : "400";
        const char *text = ok ? "OK" : "key not allowed";
        size_t id_len = got > 1 && n[1] < CAP ? (size_t)n[1] : 0;
        if (zmq_send(b->zap, "1.0", 3, ZMQ_SNDMORE) < 0 ||
            zmq_send(b->zap, f[1], id_len, ZMQ_SNDMORE) < 0 ||
            zmq_send(b->zap, code, 3, ZMQ_SNDMORE) < 0 ||
            zmq_send(b->zap, text, strlen(text), ZMQ_SNDMORE) < 0 ||
            zmq_send(b->zap, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(b->zap, "", 0, 0) < 0)
            KILN_LOG_ERROR("bus: ZAP reply: %s", zmq_strerror(zmq_errno()));
    }
}

int kiln_bus_refusals(const kiln_bus *b) { return b->refusals; }

int kiln_bus_bound_endpoint(kiln_bus *b, char *out, size_t cap)
{
    size_t len = cap;
    if (zmq_getsockopt(b->sock, ZMQ_LAST_ENDPOINT, out, &len) || len == 0 || len > cap)
        return -1;
    out[len - 1] = '\0';
    return 0;
}

int kiln_bus_wait(kiln_bus *b, int fd, int timeout_ms, kiln_err *err)
{
    zmq_pollitem_t items[4] = {{.socket = b->sock, .events = ZMQ_POLLIN}};
    int n = 1, fd_at = -1, mon_at = -1, zap_at = -1;
    if (fd >= 0)
        fd_at = n, items[n++] = (zmq_pollitem_t){.fd = fd, .events = ZMQ_POLLIN};
    if (b->mon)
        mon_at = n, items[n++] = (zmq_pollitem_t){.socket = b->mon, .events = ZMQ_POLLIN};
    if (b->zap)
        zap_at = n, items[n++] = (zmq_pollitem_t){.socket = b->zap, .events = ZMQ_POLLIN};
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
    if (zap_at >= 0 && (items[zap_at].revents & ZMQ_POLLIN))
        zap_serve(b);
    if (b->retry_at && kiln_now_ms() >= b->retry_at) {
        b->retry_at = 0;
        zmq_disconnect(b->sock, b->endpoint); /* what is left of the ended session, if any */
        if (zmq_connect(b->sock, b->endpoint))
            KILN_LOG_ERROR("bus: connecting again to %s: %s", b->endpoint,
                           zmq_strerror(zmq_errno()));
    }
    return ev;
}

/* kiln bus sockets: the ZeroMQ side of the protocol in proto.h.  The
 * gateway binds a ROUTER; each replica connects a DEALER whose routing id
 * is its replica id.  One message = one msgpack frame (after the routing-id
 * frame on the ROUTER side).
 *
 *   kiln_bus *b = kiln_bus_connect("tcp://127.0.0.1:8001", "decode-box-42", &keys, &err);
 *   kiln_bus_send_msg(b, NULL, &hello, &err);
 *   for (;;) {
 *       int ev = kiln_bus_wait(b, wake_fd, 250, &err);   // socket, fd or timeout
 *       if (ev & KILN_BUS_CONNECTED) ...re-send hello...
 *       kiln_buf f = {0};
 *       while (kiln_bus_recv(b, NULL, 0, &f, &err) > 0) { ...kiln_msg_decode(f.data, f.len)... }
 *   }
 *   kiln_bus_close(b);
 *
 * Every zmq call is checked; failures come back as kiln_status with the
 * zmq error text.  A DEALER reconnects by itself (100 ms, backing off to
 * 2 s) and reports each established connection as KILN_BUS_CONNECTED, which
 * is how a replica notices a restarted gateway and registers again.
 * A ROUTER refuses to send to an unknown peer (KILN_ERR_UNAVAILABLE) rather
 * than dropping the message silently.  Every socket refuses frames larger
 * than the largest legal message (ZMQ_MAXMSGSIZE: KILN_PROTO_MAX_FRAME, or
 * what kiln_bus_bind is given): libzmq drops the connection of a peer that
 * announces one, before allocating it, so a hostile peer cannot make a
 * replica or the gateway buffer more than that per frame.
 *
 * Security (docs/ARCHITECTURE.md, "Bus security"): with keys
 * (common/bus_keys.h) the bus runs ZeroMQ CURVE.  The ROUTER is the CURVE
 * server and admits a peer only when its public key is in the
 * allow-list: a ZAP handler (RFC 27) on an inproc socket of the same
 * context answers each handshake, served from kiln_bus_wait, so a process
 * without an allowed secret key never completes a handshake and can
 * neither send nor receive a single message.  The DEALER is a CURVE client
 * that also checks the gateway's key (the handshake fails against a
 * server without the matching secret key).  Handshakes the other side
 * refused are logged (at most once per 5 s per socket) with the reason;
 * a refused DEALER connects again every 2 s (libzmq itself gives up
 * after such a refusal), so fixing the gateway's allow-list is enough.
 * Without keys the bus is plaintext, as before.
 *
 * Thread-safety: a kiln_bus (its zmq context and sockets) belongs to one
 * thread; hand messages to it through a queue and an eventfd.
 */
#ifndef KILN_BUS_H
#define KILN_BUS_H

#include <stddef.h>

#include "buf.h"
#include "bus_keys.h"
#include "error.h"
#include "proto.h"

typedef struct kiln_bus kiln_bus;

/* A DEALER connected to `endpoint` with routing id `identity` (a replica
 * id: 1..127 characters, see proto.h).  The connection is made in the
 * background; sends queue until it is up.  `keys` (NULL or without a
 * secret: plaintext) needs secret and server for CURVE; it is copied.
 * NULL with err set. */
kiln_bus *kiln_bus_connect(const char *endpoint, const char *identity, const kiln_bus_keys *keys,
                           kiln_err *err);

/* A ROUTER bound to `endpoint` ("tcp://host:port", "ipc://path") that
 * takes frames of at most max_msg bytes (0: KILN_PROTO_MAX_FRAME).  `keys`
 * (NULL or without a secret: plaintext) needs secret and a non-empty
 * allow-list for CURVE; it is copied.  KILN_ERR_IO naming the endpoint
 * when it cannot bind, _INVALID for keys without an allow-list.  NULL with
 * err set. */
kiln_bus *kiln_bus_bind(const char *endpoint, size_t max_msg, const kiln_bus_keys *keys,
                        kiln_err *err);

/* 1 when only this machine can reach `endpoint`: ipc:// and inproc://,
 * or tcp:// on a loopback address (127.x.y.z, localhost, [::1]); a
 * wildcard or any other address is 0. */
int kiln_bus_endpoint_local(const char *endpoint);

/* Closes the socket, waiting at most 500 ms to flush queued messages.
 * Accepts NULL. */
void kiln_bus_close(kiln_bus *b);

/* Sends one frame without blocking.  `peer` is the routing id on a ROUTER
 * and must be NULL on a DEALER.  KILN_ERR_BUSY when the peer's queue is
 * full, KILN_ERR_UNAVAILABLE for an unknown peer (ROUTER) or, on a
 * DEALER, while the gateway refuses the handshake, KILN_ERR_IO. */
kiln_status kiln_bus_send(kiln_bus *b, const char *peer, const void *frame, size_t len,
                          kiln_err *err);

/* kiln_msg_encode + kiln_bus_send. */
kiln_status kiln_bus_send_msg(kiln_bus *b, const char *peer, const kiln_msg *m, kiln_err *err);

/* Receives one message without blocking into `frame` (cleared first; the
 * caller owns it).  On a ROUTER, `peer` (peer_cap bytes) receives the
 * sender's routing id as a C string.  Returns 1 for a message, 0 when none
 * is waiting, -1 with err set: KILN_ERR_INVALID for a message with the
 * wrong number of frames or an unprintable routing id (it is dropped; keep
 * receiving), KILN_ERR_IO for a socket failure. */
int kiln_bus_recv(kiln_bus *b, char *peer, size_t peer_cap, kiln_buf *frame, kiln_err *err);

enum {
    KILN_BUS_READABLE = 1, /* kiln_bus_recv has a message */
    KILN_BUS_FD = 2,       /* `fd` is readable */
    KILN_BUS_CONNECTED = 4 /* (DEALER) a connection to the peer was established */
};

/* Waits up to timeout_ms (-1: forever) for the socket, the extra file
 * descriptor `fd` (-1: none) or a connection event, answering CURVE
 * handshakes (ROUTER) on the way.  Returns a mask of the KILN_BUS_* flags
 * (0 on timeout or after answering handshakes), or -1 with err set. */
int kiln_bus_wait(kiln_bus *b, int fd, int timeout_ms, kiln_err *err);

/* The endpoint the socket bound last, with the port the system picked
 * for a wildcard port (ZMQ_LAST_ENDPOINT), into out (cap bytes).  0 or -1. */
int kiln_bus_bound_endpoint(kiln_bus *b, char *out, size_t cap);

/* How many handshakes of this socket failed so far (kiln_bus_wait sees
 * them): a DEALER's refused by the gateway, a ROUTER's refused peers. */
int kiln_bus_refusals(const kiln_bus *b);

#endif

/* kiln gateway bus bridge: a thread that owns the gateway's ZeroMQ ROUTER
 * (common/bus.h) and exchanges messages with the libuv event loop.
 *
 *   kiln_gw_bus *b = kiln_gw_bus_start(loop, "tcp://127.0.0.1:8001", &keys, on_msg, on_lost, ud,
 *                                      &err);
 *   kiln_gw_bus_send(b, "denoise-box-42", &msg, &err);   // from the loop thread
 *   ... on_msg(ud, peer, msg) runs on the loop thread for every message ...
 *   kiln_gw_bus_stop(b);                                   // joins the thread
 *
 * Incoming frames are received and decoded (kiln_msg_decode: strict, a
 * malformed frame is logged and dropped) on the bus thread, queued under a
 * mutex and handed to the loop through one uv_async_t.  Outgoing messages
 * are encoded on the loop thread (so they may borrow loop-owned memory),
 * queued under the same kind of mutex, and the bus thread is woken through
 * an eventfd that it polls beside the socket.  A message the ROUTER cannot
 * route (the peer disconnected) or whose peer queue is full is dropped and
 * reported as on_lost(peer).
 *
 * Thread-safety: kiln_gw_bus_send, kiln_gw_bus_drain and kiln_gw_bus_stop
 * are for the loop thread only; callbacks run on the loop thread.
 */
#ifndef KILN_GW_BUS_H
#define KILN_GW_BUS_H

#include <uv.h>

#include "common/bus_keys.h"
#include "common/error.h"
#include "common/proto.h"

typedef struct kiln_gw_bus kiln_gw_bus;

/* Takes ownership of m. */
typedef void (*kiln_gw_bus_msg_cb)(void *ud, const char *peer, kiln_msg *m);
typedef void (*kiln_gw_bus_lost_cb)(void *ud, const char *peer);

/* Binds the ROUTER, taking frames of at most max_msg bytes (kiln_bus_bind;
 * KILN_ERR_IO naming the endpoint when it cannot; with CURVE when `keys`
 * has a secret key, see common/bus.h) and starts the thread.  NULL with
 * err set. */
kiln_gw_bus *kiln_gw_bus_start(uv_loop_t *loop, const char *endpoint, size_t max_msg,
                               const kiln_bus_keys *keys,
                               kiln_gw_bus_msg_cb on_msg, kiln_gw_bus_lost_cb on_lost, void *ud,
                               kiln_err *err);

/* Encodes m and queues it for `peer`.  KILN_ERR_INVALID when the message
 * does not encode (kiln_msg_encode's checks), _NOMEM. */
kiln_status kiln_gw_bus_send(kiln_gw_bus *b, const char *peer, const kiln_msg *m, kiln_err *err);

/* Delivers now (on_msg / on_lost, on this thread) every message the bus
 * thread has received so far, as the async handle would later.  Loop
 * thread only. */
void kiln_gw_bus_drain(kiln_gw_bus *b);

/* Stops and joins the thread, closes the socket (queued outgoing messages
 * are dropped) and the async handle; the memory goes in its close
 * callback, so the loop must run once more.  No callback runs after this
 * returns. */
void kiln_gw_bus_stop(kiln_gw_bus *b);

#endif

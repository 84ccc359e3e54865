/* kiln gateway clients: who a connection or a request belongs to, and what
 * each client holds of the gateway's bounded resources (connections and
 * buffered request bodies).
 *
 *   kiln_gw_clients_limits lim = {.max_connections = 64, .body_budget = 1u << 30,
 *                                 .client_body_budget = 256u << 20};
 *   kiln_gw_clients *cl = kiln_gw_clients_create(&lim, &err);
 *   uint64_t addr = kiln_gw_client_id(cl, KILN_GW_CLIENT_ADDRESS, "10.0.0.7", 8);
 *   if (kiln_gw_clients_connect(cl, addr)) -> 503, too many connections from it
 *   ...
 *   uint64_t who = kiln_gw_client_id(cl, KILN_GW_CLIENT_TOKEN, token, len);  // or addr
 *   if (kiln_gw_clients_take_body(cl, who, bytes))
 *       kiln_gw_clients_wait_body(cl, &waiter, who, bytes, on_granted, conn);  // FIFO
 *   ... the request is answered: kiln_gw_clients_give_body(cl, who, bytes);
 *   kiln_gw_clients_disconnect(cl, addr);
 *
 * A client is its bearer token when the request has one (a keyed 64-bit
 * hash: tokens are not kept), else its peer address; connections are
 * counted per address, the only identity a new connection has.  The body
 * budget bounds the bytes of request bodies the gateway holds at once
 * (being received, parsed or waiting for their answer): a body is charged
 * its declared length before it is read, and must fit both the global
 * budget and its client's share, so one client cannot take what the
 * others need.  A body that does not fit waits; waiters are granted in
 * arrival order as bytes come back, except that one held back only by its
 * own client's share does not hold up the others.
 *
 * Not thread-safe: the event loop thread owns it.
 */
#ifndef KILN_GW_CLIENTS_H
#define KILN_GW_CLIENTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct kiln_gw_clients_limits {
    int max_connections;       /* per address; 0: no limit */
    size_t body_budget;        /* bytes of bodies held at once, all clients */
    size_t client_body_budget; /* bytes one client may hold */
} kiln_gw_clients_limits;

typedef struct kiln_gw_clients_stats {
    size_t body_bytes;     /* charged now */
    size_t body_peak;      /* the most charged at once */
    int body_waiting;      /* bodies waiting for budget now */
    uint64_t body_waits;   /* bodies that had to wait */
    uint64_t conn_refused; /* connections refused for their address's limit */
    int clients;           /* clients holding a connection or a body */
} kiln_gw_clients_stats;

typedef enum kiln_gw_client_kind {
    KILN_GW_CLIENT_ADDRESS = 'a',
    KILN_GW_CLIENT_TOKEN = 't',
} kiln_gw_client_kind;

typedef struct kiln_gw_clients kiln_gw_clients;

/* A body waiting for budget; owned by the caller (e.g. inside its
 * connection) until granted or cancelled. */
typedef struct kiln_gw_body_waiter {
    struct kiln_gw_body_waiter *prev, *next;
    uint64_t client;
    size_t bytes;
    void (*granted)(void *ud); /* the bytes are charged; called from give_body */
    void *ud;
    int linked;
} kiln_gw_body_waiter;

/* NULL with err set (KILN_ERR_NOMEM). */
kiln_gw_clients *kiln_gw_clients_create(const kiln_gw_clients_limits *lim, kiln_err *err);
/* Accepts NULL.  Waiters still linked are dropped without a call. */
void kiln_gw_clients_destroy(kiln_gw_clients *cl);

/* The client id of an address or a token (never 0).  Keyed with a random
 * value drawn at create, so ids cannot be aimed at each other. */
uint64_t kiln_gw_client_id(const kiln_gw_clients *cl, kiln_gw_client_kind kind, const char *text,
                           size_t len);

/* Counts a connection of `addr`: 0, or -1 when the address is at its
 * limit (nothing counted) or memory ran out. */
int kiln_gw_clients_connect(kiln_gw_clients *cl, uint64_t addr);
void kiln_gw_clients_disconnect(kiln_gw_clients *cl, uint64_t addr);

/* Charges `bytes` to `client` when they fit the budget and its share and
 * no earlier waiter is held back by the global budget: 0, else -1 (nothing
 * charged). */
int kiln_gw_clients_take_body(kiln_gw_clients *cl, uint64_t client, size_t bytes);
/* 1 when `bytes` can never fit (over the client's share). */
int kiln_gw_clients_body_too_large(const kiln_gw_clients *cl, size_t bytes);
/* Queues w (its client and bytes set here) to be charged as soon as it
 * fits; w->granted runs then, from a later give_body. */
void kiln_gw_clients_wait_body(kiln_gw_clients *cl, kiln_gw_body_waiter *w, uint64_t client,
                               size_t bytes, void (*granted)(void *), void *ud);
/* Takes w out of the queue, when it is in. */
void kiln_gw_clients_cancel_wait(kiln_gw_clients *cl, kiln_gw_body_waiter *w);
/* Returns charged bytes and grants the waiters that now fit. */
void kiln_gw_clients_give_body(kiln_gw_clients *cl, uint64_t client, size_t bytes);

void kiln_gw_clients_stats_get(const kiln_gw_clients *cl, kiln_gw_clients_stats *s);
const kiln_gw_clients_limits *kiln_gw_clients_limits_get(const kiln_gw_clients *cl);

#endif

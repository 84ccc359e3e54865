#include "clients.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "idmap.h"

typedef struct client {
    int conns;
    size_t body;
} client;

struct kiln_gw_clients {
    kiln_gw_clients_limits lim;
    uint64_t key; /* hash key */
    kiln_idmap map; /* client id -> client */
    kiln_gw_body_waiter waiters; /* sentinel of a circular list, FIFO */
    kiln_gw_clients_stats st;
};

kiln_gw_clients *kiln_gw_clients_create(const kiln_gw_clients_limits *lim, kiln_err *err)
{
    kiln_gw_clients *cl = calloc(1, sizeof *cl);
    if (!cl) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    cl->lim = *lim;
    /* Ids only need to be hard to aim at another client's; the clock
     * stands in when getrandom cannot answer. */
    if (getrandom(&cl->key, sizeof cl->key, GRND_NONBLOCK) != (ssize_t)sizeof cl->key)
        cl->key = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull;
    cl->waiters.prev = cl->waiters.next = &cl->waiters;
    return cl;
}

void kiln_gw_clients_destroy(kiln_gw_clients *cl)
{
    if (!cl)
        return;
    for (size_t i = 0; i < cl->map.cap; i++)
        free(cl->map.slots[i].value);
    kiln_idmap_free(&cl->map);
    free(cl);
}

uint64_t kiln_gw_client_id(const kiln_gw_clients *cl, kiln_gw_client_kind kind, const char *text,
                           size_t len)
{
    /* FNV-1a over the key, the kind and the text, then a final mix. */
    uint64_t h = 14695981039346656037ull ^ cl->key;
    h = (h ^ (uint64_t)kind) * 1099511628211ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)text[i]) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h ? h : 1;
}

static client *get(kiln_gw_clients *cl, uint64_t id, int create)
{
    client *c = kiln_idmap_get(&cl->map, id);
    if (c || !create)
        return c;
    c = calloc(1, sizeof *c);
    if (!c || kiln_idmap_put(&cl->map, id, c, NULL)) {
        free(c);
        return NULL;
    }
    cl->st.clients++;
    return c;
}

static void maybe_forget(kiln_gw_clients *cl, uint64_t id, client *c)
{
    if (c->conns || c->body)
        return;
    kiln_idmap_del(&cl->map, id);
    free(c);
    cl->st.clients--;
}

int kiln_gw_clients_connect(kiln_gw_clients *cl, uint64_t addr)
{
    client *c = get(cl, addr, 1);
    if (!c)
        return -1;
    if (cl->lim.max_connections && c->conns >= cl->lim.max_connections) {
        cl->st.conn_refused++;
        maybe_forget(cl, addr, c);
        return -1;
    }
    c->conns++;
    return 0;
}

void kiln_gw_clients_disconnect(kiln_gw_clients *cl, uint64_t addr)
{
    client *c = get(cl, addr, 0);
    if (!c || !c->conns)
        return;
    c->conns--;
    maybe_forget(cl, addr, c);
}

int kiln_gw_clients_body_too_large(const kiln_gw_clients *cl, size_t bytes)
{
    return bytes > cl->lim.client_body_budget || bytes > cl->lim.body_budget;
}

static int fits_global(const kiln_gw_clients *cl, size_t bytes)
{
    return bytes <= cl->lim.body_budget - cl->st.body_bytes;
}

static int fits_client(const kiln_gw_clients *cl, const client *c, size_t bytes)
{
    return bytes <= cl->lim.client_body_budget - (c ? c->body : 0);
}

static void charge(kiln_gw_clients *cl, client *c, size_t bytes)
{
    c->body += bytes;
    cl->st.body_bytes += bytes;
    if (cl->st.body_bytes > cl->st.body_peak)
        cl->st.body_peak = cl->st.body_bytes;
}

/* 1 when a waiter ahead is held back by the global budget: newcomers
 * queue behind it rather than overtake it forever. */
static int global_queue(const kiln_gw_clients *cl)
{
    for (const kiln_gw_body_waiter *w = cl->waiters.next; w != &cl->waiters; w = w->next) {
        const client *c = kiln_idmap_get(&cl->map, w->client);
        if (fits_client(cl, c, w->bytes))
            return 1;
    }
    return 0;
}

int kiln_gw_clients_take_body(kiln_gw_clients *cl, uint64_t client_id, size_t bytes)
{
    if (bytes == 0)
        return 0;
    client *c = get(cl, client_id, 0);
    if (kiln_gw_clients_body_too_large(cl, bytes) || !fits_global(cl, bytes) ||
        !fits_client(cl, c, bytes) || global_queue(cl))
        return -1;
    if (!(c = get(cl, client_id, 1)))
        return -1;
    charge(cl, c, bytes);
    return 0;
}

void kiln_gw_clients_wait_body(kiln_gw_clients *cl, kiln_gw_body_waiter *w, uint64_t client_id,
                               size_t bytes, void (*granted)(void *), void *ud)
{
    w->client = client_id;
    w->bytes = bytes;
    w->granted = granted;
    w->ud = ud;
    w->next = &cl->waiters;
    w->prev = cl->waiters.prev;
    w->prev->next = w;
    cl->waiters.prev = w;
    w->linked = 1;
    cl->st.body_waiting++;
    cl->st.body_waits++;
}

void kiln_gw_clients_cancel_wait(kiln_gw_clients *cl, kiln_gw_body_waiter *w)
{
    if (!w->linked)
        return;
    w->prev->next = w->next;
    w->next->prev = w->prev;
    w->prev = w->next = NULL;
    w->linked = 0;
    cl->st.body_waiting--;
}

void kiln_gw_clients_give_body(kiln_gw_clients *cl, uint64_t client_id, size_t bytes)
{
    client *c = get(cl, client_id, 0);
    if (c && bytes) {
        size_t k = bytes < c->body ? bytes : c->body;
        c->body -= k;
        cl->st.body_bytes -= k;
        maybe_forget(cl, client_id, c);
    }
    /* Grant in order; one over its client's share is passed over, one
     * over the global budget stops the pass.  The granted are unlinked
     * first and called after, so a callback may take or give freely. */
    kiln_gw_body_waiter *granted = NULL, **tail = &granted;
    for (kiln_gw_body_waiter *w = cl->waiters.next, *next; w != &cl->waiters; w = next) {
        next = w->next;
        client *wc = get(cl, w->client, 0);
        if (!fits_client(cl, wc, w->bytes))
            continue;
        if (!fits_global(cl, w->bytes))
            break;
        if (!wc && !(wc = get(cl, w->client, 1)))
            break;
        charge(cl, wc, w->bytes);
        kiln_gw_clients_cancel_wait(cl, w);
        *tail = w;
        tail = &w->next;
    }
    *tail = NULL;
    while (granted) {
        kiln_gw_body_waiter *w = granted;
        granted = w->next;
        w->next = NULL;
        w->granted(w->ud);
    }
}

void kiln_gw_clients_stats_get(const kiln_gw_clients *cl, kiln_gw_clients_stats *s)
{
    *s = cl->st;
}

const kiln_gw_clients_limits *kiln_gw_clients_limits_get(const kiln_gw_clients *cl)
{
    return &cl->lim;
}

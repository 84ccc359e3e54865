#include "gw_bus.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/bus.h"
#include "common/log.h"

typedef struct bus_item {
    struct bus_item *next;
    char peer[KILN_PROTO_ID_MAX];
    kiln_msg *msg;  /* incoming; NULL for a lost peer */
    kiln_buf frame; /* outgoing */
} bus_item;

typedef struct item_queue {
    bus_item *head, *tail;
} item_queue;

struct kiln_gw_bus {
    kiln_bus *bus; /* the bus thread's alone once it runs */
    pthread_t thread;
    int thread_started;
    int efd;
    atomic_int stop;
    pthread_mutex_t mu;
    item_queue in, out;
    uv_async_t async;
    kiln_gw_bus_msg_cb on_msg;
    kiln_gw_bus_lost_cb on_lost;
    void *ud;
    int stopped;
};

static void push(item_queue *q, bus_item *it)
{
    it->next = NULL;
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
}

static bus_item *take_all(kiln_gw_bus *b, item_queue *q)
{
    pthread_mutex_lock(&b->mu);
    bus_item *all = q->head;
    q->head = q->tail = NULL;
    pthread_mutex_unlock(&b->mu);
    return all;
}

static void free_items(bus_item *it)
{
    while (it) {
        bus_item *next = it->next;
        kiln_msg_free(it->msg);
        kiln_buf_free(&it->frame);
        free(it);
        it = next;
    }
}

/* Bus thread: hands an item to the loop. */
static void to_loop(kiln_gw_bus *b, bus_item *it)
{
    pthread_mutex_lock(&b->mu);
    push(&b->in, it);
    pthread_mutex_unlock(&b->mu);
}

static void report_lost(kiln_gw_bus *b, const char *peer)
{
    bus_item *it = calloc(1, sizeof *it);
    if (!it) {
        KILN_LOG_ERROR("gateway bus: out of memory reporting %s lost", peer);
        return;
    }
    snprintf(it->peer, sizeof it->peer, "%s", peer);
    to_loop(b, it);
}

static int send_outgoing(kiln_gw_bus *b)
{
    int lost = 0;
    bus_item *it = take_all(b, &b->out);
    while (it) {
        bus_item *next = it->next;
        kiln_err err = {0};
        kiln_status st = kiln_bus_send(b->bus, it->peer, it->frame.data, it->frame.len, &err);
        if (st == KILN_ERR_UNAVAILABLE || st == KILN_ERR_BUSY) {
            KILN_LOG_WARN("gateway bus: %s: %s", it->peer, err.msg);
            report_lost(b, it->peer);
            lost = 1;
        } else if (st) {
            KILN_LOG_ERROR("gateway bus: send to %s: %s", it->peer, err.msg);
        }
        it->next = NULL;
        free_items(it);
        it = next;
    }
    return lost;
}

/* Receives what is waiting (at most a batch, so sends are not starved). */
static int receive(kiln_gw_bus *b)
{
    int got = 0;
    kiln_buf frame = {0};
    for (int i = 0; i < 256; i++) {
        char peer[KILN_PROTO_ID_MAX];
        kiln_err err = {0};
        int rc = kiln_bus_recv(b->bus, peer, sizeof peer, &frame, &err);
        if (rc == 0)
            break;
        if (rc < 0) {
            KILN_LOG_WARN("gateway bus: %s", err.msg);
            if (err.code == KILN_ERR_INVALID)
                continue;
            break;
        }
        kiln_msg *m = kiln_msg_decode(frame.data, frame.len, &err);
        if (!m) {
            KILN_LOG_WARN("gateway bus: dropped a malformed message from %s: %s", peer, err.msg);
            continue;
        }
        bus_item *it = calloc(1, sizeof *it);
        if (!it) {
            KILN_LOG_ERROR("gateway bus: out of memory; dropped a message from %s", peer);
            kiln_msg_free(m);
            continue;
        }
        snprintf(it->peer, sizeof it->peer, "%s", peer);
        it->msg = m;
        to_loop(b, it);
        got = 1;
    }
    kiln_buf_free(&frame);
    return got;
}

static void *bus_thread(void *arg)
{
    kiln_gw_bus *b = arg;
    while (!atomic_load(&b->stop)) {
        kiln_err err = {0};
        int ev = kiln_bus_wait(b->bus, b->efd, 1000, &err);
        if (ev < 0) {
            KILN_LOG_ERROR("gateway bus: %s", err.msg);
            usleep(10000);
            continue;
        }
        if (ev & KILN_BUS_FD) {
            uint64_t v;
            if (read(b->efd, &v, sizeof v) < 0)
                KILN_LOG_DEBUG("gateway bus: eventfd read interrupted");
        }
        int wake = send_outgoing(b);
        wake |= receive(b);
        if (wake)
            uv_async_send(&b->async);
    }
    return NULL;
}

void kiln_gw_bus_drain(kiln_gw_bus *b)
{
    if (b->stopped)
        return;
    for (bus_item *it = take_all(b, &b->in), *next; it; it = next) {
        next = it->next;
        if (it->msg)
            b->on_msg(b->ud, it->peer, it->msg);
        else
            b->on_lost(b->ud, it->peer);
        it->msg = NULL; /* the callback took it */
        it->next = NULL;
        free_items(it);
    }
}

static void on_async(uv_async_t *h) { kiln_gw_bus_drain(h->data); }

static void on_closed(uv_handle_t *h)
{
    kiln_gw_bus *b = h->data;
    free_items(b->in.head);
    free_items(b->out.head);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

kiln_gw_bus *kiln_gw_bus_start(uv_loop_t *loop, const char *endpoint, size_t max_msg,
                               const kiln_bus_keys *keys,
                               kiln_gw_bus_msg_cb on_msg, kiln_gw_bus_lost_cb on_lost, void *ud,
                               kiln_err *err)
{
    kiln_gw_bus *b = calloc(1, sizeof *b);
    if (!b) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    b->on_msg = on_msg, b->on_lost = on_lost, b->ud = ud;
    b->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (b->efd < 0) {
        kiln_err_set(err, KILN_ERR_IO, "eventfd failed");
        free(b);
        return NULL;
    }
    pthread_mutex_init(&b->mu, NULL);
    b->bus = kiln_bus_bind(endpoint, max_msg, keys, err);
    int rc = b->bus ? uv_async_init(loop, &b->async, on_async) : -1;
    if (rc) {
        if (b->bus)
            kiln_err_set(err, KILN_ERR_IO, "uv_async_init: %s", uv_strerror(rc));
        kiln_bus_close(b->bus);
        close(b->efd);
        pthread_mutex_destroy(&b->mu);
        free(b);
        return NULL;
    }
    b->async.data = b;
    if (pthread_create(&b->thread, NULL, bus_thread, b)) {
        kiln_err_set(err, KILN_ERR_IO, "cannot start the bus thread");
        kiln_gw_bus_stop(b);
        return NULL;
    }
    b->thread_started = 1;
    return b;
}

kiln_status kiln_gw_bus_send(kiln_gw_bus *b, const char *peer, const kiln_msg *m, kiln_err *err)
{
    bus_item *it = calloc(1, sizeof *it);
    if (!it)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    snprintf(it->peer, sizeof it->peer, "%s", peer);
    kiln_status st = kiln_msg_encode(m, &it->frame, err);
    if (st) {
        free_items(it);
        return st;
    }
    pthread_mutex_lock(&b->mu);
    push(&b->out, it);
    pthread_mutex_unlock(&b->mu);
    uint64_t one = 1;
    if (write(b->efd, &one, sizeof one) < 0)
        KILN_LOG_DEBUG("gateway bus: eventfd already signalled");
    return KILN_OK;
}

void kiln_gw_bus_stop(kiln_gw_bus *b)
{
    if (!b)
        return;
    atomic_store(&b->stop, 1);
    uint64_t one = 1;
    if (write(b->efd, &one, sizeof one) < 0)
        KILN_LOG_DEBUG("gateway bus: eventfd already signalled");
    if (b->thread_started)
        pthread_join(b->thread, NULL);
    kiln_bus_close(b->bus);
    b->bus = NULL;
    close(b->efd);
    b->stopped = 1;
    uv_close((uv_handle_t *)&b->async, on_closed);
}

/* The by-value hand-off between stages in different transport domains
 * (docs/ARCHITECTURE.md, "Transport domains"): a producer serves its own
 * shm ranges on a data socket (a ROUTER, CURVE with the allow-list when
 * the bus has keys) from a thread of its own; a consumer fetches them over
 * a DEALER per producer, on the thread that opens the job's inputs.  The
 * gateway decides which inputs travel this way (job `src`); their
 * `release` goes through the gateway as for any shm input, and the owner
 * frees the range when it hears of it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "worker_impl.h"

#define FETCH_TIMEOUT_MS 30000
#define MAX_CONNS 16

/* Reply frame: one status byte, then the bytes (ok) or a message. */
enum { REPLY_OK = 0, REPLY_ERROR = 1 };

typedef struct data_conn {
    char endpoint[KILN_PROTO_ENDPOINT_MAX];
    char key[KILN_PROTO_KEY_TEXT];
    kiln_bus *bus;
    double used;
} data_conn;

static void reply_error(kiln_worker *w, const char *peer, const char *fmt, const char *what)
{
    char text[KILN_ERR_MSG_MAX + 1];
    text[0] = REPLY_ERROR;
    int n = snprintf(text + 1, sizeof text - 1, fmt, what);
    kiln_err err = {0};
    if (kiln_bus_send(w->data, peer, text, 1 + (size_t)(n < 0 ? 0 : n), &err))
        KILN_LOG_WARN("%s: data socket: %s", w->ops->binary, err.msg);
}

/* Answers one fetch: the bytes of one of our live shm ranges. */
static void serve_one(kiln_worker *w, const char *peer, const kiln_buf *frame)
{
    kiln_err err = {0};
    kiln_msg *m = kiln_msg_decode(frame->data, frame->len, &err);
    if (!m || m->type != KILN_MSG_FETCH || m->refs.n != 1) {
        reply_error(w, peer, "%s", m ? "expected a fetch of one reference" : err.msg);
        kiln_msg_free(m);
        return;
    }
    const kiln_tensor_ref *ref = &m->refs.refs[0];
    const void *p;
    if (ref->kind != KILN_REF_SHM || strcmp(ref->owner, w->replica) || ref->epoch != w->epoch) {
        reply_error(w, peer, "%s", "not a shm reference of this incarnation");
    } else if (kiln_transport_open(w->shm, ref, &p, &err)) {
        reply_error(w, peer, "%s", err.msg);
    } else {
        kiln_buf out = {0};
        uint8_t ok = REPLY_OK;
        /* Verified after the copy: bytes of a range freed (and perhaps
         * handed out again) meanwhile never leave here. */
        if (kiln_buf_reserve(&out, 1 + (size_t)ref->len, &err) ||
            kiln_buf_append(&out, &ok, 1, &err) || kiln_buf_append(&out, p, ref->len, &err))
            reply_error(w, peer, "%s", "out of memory");
        else if (kiln_transport_verify(w->shm, ref, &err))
            reply_error(w, peer, "%s", err.msg);
        else if (kiln_bus_send(w->data, peer, out.data, out.len, &err))
            KILN_LOG_WARN("%s: data socket: %s", w->ops->binary, err.msg);
        else
            atomic_fetch_add(&w->served, 1), atomic_fetch_add(&w->served_bytes, (long long)ref->len);
        kiln_buf_free(&out);
        kiln_transport_close(w->shm, ref);
    }
    kiln_msg_free(m);
}

static void *data_main(void *arg)
{
    kiln_worker *w = arg;
    kiln_buf f = {0};
    while (!atomic_load(&w->data_stop)) {
        kiln_err err = {0};
        if (kiln_bus_wait(w->data, -1, 200, &err) < 0) {
            KILN_LOG_ERROR("%s: data socket: %s", w->ops->binary, err.msg);
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        char peer[KILN_PROTO_ID_MAX];
        for (int rc; (rc = kiln_bus_recv(w->data, peer, sizeof peer, &f, &err)) != 0;) {
            if (rc < 0) {
                KILN_LOG_WARN("%s: data socket: %s", w->ops->binary, err.msg);
                if (err.code != KILN_ERR_INVALID)
                    break;
                continue;
            }
            serve_one(w, peer, &f);
        }
    }
    kiln_buf_free(&f);
    return NULL;
}

kiln_status worker_data_start(kiln_worker *w, kiln_err *err)
{
    const kiln_worker_opts *o = &w->opts;
    if (w->ops->stage == KILN_STAGE_DECODE || o->data_port < 0)
        return KILN_OK; /* the decoder's outputs are images, which go to the gateway */
    if (w->bus_keys.secret[0] && !w->bus_keys.n_allow) {
        KILN_LOG_WARN("%s: no --bus-allow: this replica cannot hand tensors by value to stages "
                      "in other transport domains (its data socket needs the allow-list)",
                      w->ops->binary);
        return KILN_OK;
    }
    char bind[64], bound[KILN_PROTO_ENDPOINT_MAX];
    if (o->data_port)
        snprintf(bind, sizeof bind, "tcp://*:%d", o->data_port);
    else
        snprintf(bind, sizeof bind, "tcp://*:*");
    /* Fetches are a reference each: a few hundred bytes. */
    w->data = kiln_bus_bind(bind, 64 << 10, w->bus_keys.secret[0] ? &w->bus_keys : NULL, err);
    if (!w->data)
        return kiln_err_wrap(err, "data socket (--data-port)");
    const char *port = NULL;
    if (!kiln_bus_bound_endpoint(w->data, bound, sizeof bound))
        port = strrchr(bound, ':');
    if (!port)
        return kiln_err_set(err, KILN_ERR_IO, "data socket: cannot read its port");
    snprintf(w->data_ep, sizeof w->data_ep, "tcp://%s%s", w->data_host, port);
    if (pthread_create(&w->data_thread, NULL, data_main, w))
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot start the data socket thread");
    w->data_started = 1;
    KILN_LOG_INFO("%s: serving by-value hand-offs at %s%s", w->ops->binary, w->data_ep,
                  w->bus_keys.secret[0] ? " (CURVE)" : "");
    return KILN_OK;
}

void worker_data_stop(kiln_worker *w)
{
    if (w->data_started) {
        atomic_store(&w->data_stop, 1);
        pthread_join(w->data_thread, NULL);
        w->data_started = 0;
    }
    kiln_bus_close(w->data);
    w->data = NULL;
    for (int i = 0; i < w->n_conns; i++)
        kiln_bus_close(w->conns[i].bus);
    free(w->conns);
    w->conns = NULL;
    w->n_conns = 0;
}

static void drop_conn(kiln_worker *w, data_conn *c)
{
    kiln_bus_close(c->bus);
    *c = w->conns[--w->n_conns];
}

/* The DEALER to a producer's data socket, made on first use; the least
 * recently used one goes when MAX_CONNS are open. */
static data_conn *conn_for(kiln_worker *w, const kiln_fetch_src *src, kiln_err *err)
{
    for (int i = 0; i < w->n_conns; i++)
        if (!strcmp(w->conns[i].endpoint, src->endpoint) && !strcmp(w->conns[i].key, src->key)) {
            w->conns[i].used = kiln_now_ms();
            return &w->conns[i];
        }
    if (!w->conns && !(w->conns = calloc(MAX_CONNS, sizeof *w->conns))) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (w->n_conns == MAX_CONNS) {
        int old = 0;
        for (int i = 1; i < w->n_conns; i++)
            if (w->conns[i].used < w->conns[old].used)
                old = i;
        drop_conn(w, &w->conns[old]);
    }
    kiln_bus_keys keys = w->bus_keys;
    keys.allow = NULL, keys.n_allow = 0;
    snprintf(keys.server, sizeof keys.server, "%s", src->key);
    char id[KILN_PROTO_ID_MAX];
    snprintf(id, sizeof id, "%.100s@%u", w->replica, ++w->conn_serial);
    kiln_bus *b = kiln_bus_connect(src->endpoint, id, keys.secret[0] && src->key[0] ? &keys : NULL,
                                   err);
    if (!b)
        return NULL;
    data_conn *c = &w->conns[w->n_conns++];
    memset(c, 0, sizeof *c);
    snprintf(c->endpoint, sizeof c->endpoint, "%s", src->endpoint);
    snprintf(c->key, sizeof c->key, "%s", src->key);
    c->bus = b;
    c->used = kiln_now_ms();
    return c;
}

kiln_status worker_data_fetch(kiln_worker *w, kiln_worker_job *j, const kiln_fetch_src *src,
                              const kiln_tensor_ref *ref, void **out, kiln_err *err)
{
    *out = NULL;
    if (ref->kind != KILN_REF_SHM)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "%s references cannot be fetched by value",
                            kiln_ref_kind_name(ref->kind));
    double t0 = kiln_now_ms();
    data_conn *c = conn_for(w, src, err);
    if (!c)
        return err->code;
    kiln_msg m = {.type = KILN_MSG_FETCH, .epoch = w->epoch, .refs = {.n = 1}};
    m.refs.refs[0] = *ref;
    if (kiln_bus_send_msg(c->bus, NULL, &m, err)) {
        drop_conn(w, c);
        return err->code;
    }
    kiln_buf f = {0};
    int got = 0;
    while (!got) {
        if (kiln_worker_cancelled(j) || kiln_now_ms() - t0 > FETCH_TIMEOUT_MS) {
            /* A late reply must not answer the next request: the socket goes. */
            drop_conn(w, c);
            kiln_buf_free(&f);
            return kiln_worker_cancelled(j)
                       ? kiln_err_set(err, KILN_ERR_CANCELLED, "cancelled")
                       : kiln_err_set(err, KILN_ERR_UNAVAILABLE, "no answer from %s within %d s",
                                      src->owner, FETCH_TIMEOUT_MS / 1000);
        }
        if (kiln_bus_wait(c->bus, -1, 100, err) < 0 ||
            (got = kiln_bus_recv(c->bus, NULL, 0, &f, err)) < 0) {
            drop_conn(w, c);
            kiln_buf_free(&f);
            return err->code;
        }
    }
    kiln_status st = KILN_OK;
    if (f.len < 1 || f.data[0] != REPLY_OK)
        st = kiln_err_set(err, KILN_ERR_NOT_FOUND, "%s refused the fetch: %.*s", src->owner,
                          (int)(f.len > 1 ? f.len - 1 : 0), f.len > 1 ? (char *)f.data + 1 : "");
    else if (f.len - 1 != ref->len)
        st = kiln_err_set(err, KILN_ERR_INVALID, "%s sent %zu bytes for a %llu-byte tensor",
                          src->owner, f.len - 1, (unsigned long long)ref->len);
    /* 64-byte aligned, as slab ranges are: the CPU backend uses it in place. */
    else if (!(*out = aligned_alloc(64, ((size_t)ref->len + 63) & ~(size_t)63)))
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    else
        memcpy(*out, f.data + 1, (size_t)ref->len);
    kiln_buf_free(&f);
    if (!st) {
        atomic_fetch_add(&w->fetched, 1);
        atomic_fetch_add(&w->fetched_bytes, (long long)ref->len);
        KILN_LOG_DEBUG("%s: fetched %llu bytes from %s in %.2f ms", w->ops->binary,
                       (unsigned long long)ref->len, src->owner, kiln_now_ms() - t0);
    }
    return st;
}

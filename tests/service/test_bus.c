/* Bus sockets: DEALER <-> ROUTER round trips with routing ids, the
 * connection event a replica registers on (again after the ROUTER side
 * restarts), refusal to send to unknown peers, and messages with the wrong
 * frame count dropped without desynchronising the socket, frames over the
 * ROUTER's limit never taken in.  CURVE: a peer without keys, with a key
 * not in the allow-list, or with the wrong gateway key never gets a
 * message through and cannot be sent one, while an allowed peer works; key
 * files and allow-lists refuse bad content; which endpoints count as
 * local. */
#include <stdio.h>
#include <sys/stat.h>
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
    kiln_bus *router = kiln_bus_bind(endpoint, 0, NULL, &err);
    CHECKF(router != NULL, "%s", err.msg);
    kiln_bus *dealer = kiln_bus_connect(endpoint, "decode-test-1", NULL, &err);
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
    router = kiln_bus_bind(endpoint, 0, NULL, &err);
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
    kiln_bus *router = kiln_bus_bind(endpoint, 0, NULL, &err);
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
    CHECK(kiln_bus_bind("nonsense://x", 0, NULL, &err) == NULL && err.code == KILN_ERR_IO);
}

/* A ROUTER bound with a frame limit: a peer announcing a larger frame is
 * cut off before the frame is taken in (nothing arrives), and a peer that
 * keeps to the limit is heard. */
static void test_max_message(void)
{
    kiln_err err = {0};
    kiln_bus *router = kiln_bus_bind(endpoint, 64 << 10, NULL, &err);
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
    router = kiln_bus_bind(endpoint, 0, NULL, &err);
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

static void write_text(const char *path, const char *text)
{
    unlink(path);
    FILE *f = fopen(path, "w");
    CHECK(f && fputs(text, f) >= 0);
    if (f)
        fclose(f);
}

/* Sends on `d` while waiting (up to 20 s) until its handshake has been
 * refused twice (it retried), checking that `router` receives nothing
 * meanwhile and that `d` never reported a connection.  1 when so. */
static int refused_silently(kiln_bus *router, kiln_bus *d)
{
    kiln_err err = {0};
    kiln_msg hb = {.type = KILN_MSG_HB, .epoch = 1};
    kiln_buf f = {0};
    char peer[KILN_PROTO_ID_MAX];
    int received = 0, connected = 0;
    double until = kiln_now_ms() + 20000;
    while (kiln_bus_refusals(d) < 2 && kiln_now_ms() < until) {
        int ev = kiln_bus_wait(d, -1, 20, &err);
        connected |= ev > 0 && (ev & KILN_BUS_CONNECTED);
        kiln_bus_wait(router, -1, 20, &err); /* serves the handshakes */
        kiln_bus_send_msg(d, NULL, &hb, &err);
        while (kiln_bus_recv(router, peer, sizeof peer, &f, &err) == 1)
            received++;
    }
    kiln_buf_free(&f);
    return kiln_bus_refusals(d) >= 2 && !received && !connected;
}

static void test_curve(void)
{
    kiln_err err = {0};
    char gw_pub[KILN_BUS_KEY_TEXT], rep_pub[KILN_BUS_KEY_TEXT];
    char dir[64], gk[96], gp[96], rk[96], rp[96], ok[96], op[96];
    snprintf(dir, sizeof dir, "/tmp/kiln-test-curve-%ld", (long)getpid());
    CHECK(mkdir(dir, 0700) == 0);
    snprintf(gk, sizeof gk, "%s/gw.key", dir), snprintf(gp, sizeof gp, "%s/gw.pub", dir);
    snprintf(rk, sizeof rk, "%s/rep.key", dir), snprintf(rp, sizeof rp, "%s/rep.pub", dir);
    snprintf(ok, sizeof ok, "%s/other.key", dir), snprintf(op, sizeof op, "%s/other.pub", dir);
    CHECK(kiln_bus_keys_write_pair(gk, gp, gw_pub, &err) == KILN_OK);
    CHECK(kiln_bus_keys_write_pair(rk, rp, rep_pub, &err) == KILN_OK);
    CHECK(kiln_bus_keys_write_pair(ok, op, NULL, &err) == KILN_OK);
    /* Never over an existing file. */
    CHECK(kiln_bus_keys_write_pair(gk, op, NULL, &err) == KILN_ERR_IO && strstr(err.msg, "exists"));
    struct stat st;
    CHECK(stat(gk, &st) == 0 && (st.st_mode & 0777) == 0600);

    kiln_bus_keys gw = {0}, rep = {0}, other = {0}, wrong_server = {0};
    CHECK(kiln_bus_keys_load_secret(&gw, gk, &err) == KILN_OK && !strcmp(gw.public_key, gw_pub));
    CHECK(kiln_bus_keys_load_allow(&gw, rp, &err) == KILN_OK && gw.n_allow == 1);
    CHECK(kiln_bus_keys_load_secret(&rep, rk, &err) == KILN_OK && !strcmp(rep.public_key, rep_pub));
    CHECK(kiln_bus_keys_load_server(&rep, gp, &err) == KILN_OK && !strcmp(rep.server, gw_pub));
    CHECK(kiln_bus_keys_load_secret(&other, ok, &err) == KILN_OK);
    CHECK(kiln_bus_keys_load_server(&other, gp, &err) == KILN_OK);
    /* The allowed replica's key pair, but the wrong gateway key. */
    CHECK(kiln_bus_keys_load_secret(&wrong_server, rk, &err) == KILN_OK);
    CHECK(kiln_bus_keys_load_server(&wrong_server, op, &err) == KILN_OK);

    kiln_bus *router = kiln_bus_bind(endpoint, 0, &gw, &err);
    CHECKF(router != NULL, "%s", err.msg);
    if (!router)
        return;
    kiln_bus_keys_free(&gw); /* the socket keeps its own copy */

    /* Not in the allow-list, no keys at all, the wrong gateway key. */
    kiln_bus *rogues[3] = {kiln_bus_connect(endpoint, "denoise-rogue-1", &other, &err),
                           kiln_bus_connect(endpoint, "denoise-rogue-2", NULL, &err),
                           kiln_bus_connect(endpoint, "denoise-rogue-3", &wrong_server, &err)};
    for (int i = 0; i < 3; i++) {
        CHECK(rogues[i] != NULL);
        CHECKF(rogues[i] && refused_silently(router, rogues[i]), "rogue %d", i + 1);
        char id[32];
        snprintf(id, sizeof id, "denoise-rogue-%d", i + 1);
        kiln_msg cancel = {.type = KILN_MSG_CANCEL, .epoch = 1, .cancel_job = 1};
        CHECK(kiln_bus_send_msg(router, id, &cancel, &err) == KILN_ERR_UNAVAILABLE);
    }

    /* The operator's replica gets through both ways. */
    kiln_bus *good = kiln_bus_connect(endpoint, "denoise-good-1", &rep, &err);
    CHECK(good != NULL);
    int connected = 0;
    kiln_msg hb = {.type = KILN_MSG_HB, .epoch = 1};
    for (double until = kiln_now_ms() + 10000; good && !connected && kiln_now_ms() < until;) {
        kiln_bus_wait(router, -1, 20, &err);
        connected = kiln_bus_wait(good, -1, 20, &err) > 0 &&
                    kiln_bus_send_msg(good, NULL, &hb, &err) == 0;
    }
    char peer[KILN_PROTO_ID_MAX] = "";
    kiln_buf f = {0};
    int got = 0;
    for (double until = kiln_now_ms() + 10000; !got && kiln_now_ms() < until;) {
        kiln_bus_wait(router, -1, 20, &err);
        got = kiln_bus_recv(router, peer, sizeof peer, &f, &err) == 1;
    }
    CHECK(got && !strcmp(peer, "denoise-good-1"));
    kiln_msg cancel = {.type = KILN_MSG_CANCEL, .epoch = 1, .cancel_job = 7};
    CHECK(kiln_bus_send_msg(router, "denoise-good-1", &cancel, &err) == KILN_OK);
    CHECK(good && recv_one(good, NULL, 0, &f) == 1);
    kiln_buf_free(&f);

    for (int i = 0; i < 3; i++)
        kiln_bus_close(rogues[i]);
    kiln_bus_close(good);
    kiln_bus_close(router);
    /* A CURVE ROUTER needs its allow-list; a DEALER needs the server key. */
    kiln_bus_keys no_allow = {0}, no_server = {0};
    CHECK(kiln_bus_keys_load_secret(&no_allow, gk, &err) == KILN_OK);
    CHECK(kiln_bus_bind(endpoint, 0, &no_allow, &err) == NULL && err.code == KILN_ERR_INVALID);
    CHECK(kiln_bus_keys_load_secret(&no_server, rk, &err) == KILN_OK);
    CHECK(kiln_bus_connect(endpoint, "x-1", &no_server, &err) == NULL &&
          err.code == KILN_ERR_INVALID);
    kiln_bus_keys_free(&rep), kiln_bus_keys_free(&other), kiln_bus_keys_free(&wrong_server);
    const char *files[] = {gk, gp, rk, rp, ok, op};
    for (int i = 0; i < 6; i++)
        unlink(files[i]);
    rmdir(dir);
}

/* Key files and allow-lists: what they accept and what they refuse. */
static void test_key_files(void)
{
    char pub[KILN_BUS_KEY_TEXT], sec[KILN_BUS_KEY_TEXT], text[512];
    kiln_err err = {0};
    CHECK(kiln_bus_keygen(pub, sec, &err) == KILN_OK && strlen(pub) == 40 && strlen(sec) == 40);
    char path[64];
    snprintf(path, sizeof path, "/tmp/kiln-test-keyfile-%ld", (long)getpid());
    kiln_bus_keys k = {0};

    snprintf(text, sizeof text, "# a comment\n\n  %s  \n", sec);
    write_text(path, text);
    CHECK(kiln_bus_keys_load_secret(&k, path, &err) == KILN_OK && !strcmp(k.public_key, pub));

    static const char *const bad[] = {
        "",                                            /* no key */
        "# only a comment\n",                          /* no key */
        "abc\n",                                       /* too short */
        "0123456789012345678901234567890123456789X\n", /* too long */
        "01234567890123456789012345678901234567\"9\n", /* outside Z85 */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(path, bad[i]);
        CHECKF(kiln_bus_keys_load_secret(&k, path, &err) == KILN_ERR_INVALID, "case %zu", i);
        CHECK(strstr(err.msg, path) != NULL);
    }
    snprintf(text, sizeof text, "%s\n%s\n", sec, pub); /* two keys in a key file */
    write_text(path, text);
    CHECK(kiln_bus_keys_load_secret(&k, path, &err) == KILN_ERR_INVALID && strstr(err.msg, "line 2"));
    snprintf(text, sizeof text, "%s label\n", sec); /* labels only in allow-lists */
    write_text(path, text);
    CHECK(kiln_bus_keys_load_server(&k, path, &err) == KILN_ERR_INVALID && strstr(err.msg, "line 1"));

    /* Allow-lists: labels, comments, and a bad line named. */
    snprintf(text, sizeof text, "# replicas\n%s denoiser-a\n\n%s\tdecoder-b\n", pub, sec);
    write_text(path, text);
    CHECK(kiln_bus_keys_load_allow(&k, path, &err) == KILN_OK && k.n_allow == 2);
    snprintf(text, sizeof text, "%s\nnot-a-key\n", pub);
    write_text(path, text);
    CHECK(kiln_bus_keys_load_allow(&k, path, &err) == KILN_ERR_INVALID && strstr(err.msg, "line 2"));
    CHECK(k.n_allow == 2); /* a failed load leaves the earlier list */
    write_text(path, "# nobody\n");
    CHECK(kiln_bus_keys_load_allow(&k, path, &err) == KILN_ERR_INVALID);
    kiln_bus_keys_free(&k);
    unlink(path);
    CHECK(kiln_bus_keys_load_secret(&k, path, &err) == KILN_ERR_NOT_FOUND);

    /* Endpoints only this machine can reach. */
    CHECK(kiln_bus_endpoint_local("tcp://127.0.0.1:8001"));
    CHECK(kiln_bus_endpoint_local("tcp://127.1.2.3:8001"));
    CHECK(kiln_bus_endpoint_local("tcp://localhost:8001"));
    CHECK(kiln_bus_endpoint_local("tcp://[::1]:8001"));
    CHECK(kiln_bus_endpoint_local("ipc:///tmp/x"));
    CHECK(!kiln_bus_endpoint_local("tcp://0.0.0.0:8001"));
    CHECK(!kiln_bus_endpoint_local("tcp://*:8001"));
    CHECK(!kiln_bus_endpoint_local("tcp://10.0.0.1:8001"));
    CHECK(!kiln_bus_endpoint_local("tcp://127.0.0.1.evil:8001"));
    CHECK(!kiln_bus_endpoint_local("tcp://gateway:8001"));
}

int main(void)
{
    snprintf(endpoint, sizeof endpoint, "ipc:///tmp/kiln-test-bus-%ld", (long)getpid());
    RUN(test_roundtrip_and_reconnect);
    RUN(test_bad_framing);
    RUN(test_max_message);
    RUN(test_curve);
    RUN(test_key_files);
    unlink(endpoint + strlen("ipc://"));
    return test_finish();
}

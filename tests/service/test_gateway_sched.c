/* The gateway scheduler driven by hand-made bus messages and a fake clock:
 * the encode -> denoise -> decode flow with references forwarded, credits
 * (pull), idle replicas taking turns, release -> free forwarding,
 * admission (503 / 429), cancellation in every state, heartbeat loss with
 * one re-dispatch then 503, restarts from the encode stage when inputs
 * were already released or are gone (a consumer's not_found), timeouts
 * (504), error dones, and dones nobody waits for.  Every message the scheduler
 * sends goes through kiln_msg_encode / kiln_msg_decode, so it must be a
 * valid protocol message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "services/gateway/scheduler.h"
#include "tests/test.h"

#define MAX_SENT 256

typedef struct sent {
    char peer[KILN_PROTO_ID_MAX];
    kiln_msg *m;
} sent;

typedef struct world {
    kiln_sched *s;
    kiln_metrics *metrics;
    sent out[MAX_SENT];
    int n_out, seen_out;
    int n_finished, last_status, last_images;
    char last_message[KILN_ERR_MSG_MAX];
    uint64_t last_seeds[16];
    double now;
} world;

static kiln_status fake_send(void *ud, const char *peer, const kiln_msg *m, kiln_err *err)
{
    world *w = ud;
    kiln_buf f = {0};
    kiln_status st = kiln_msg_encode(m, &f, err);
    CHECKF(st == KILN_OK, "scheduler sent an invalid message: %s", err->msg);
    if (st)
        return st;
    kiln_msg *d = kiln_msg_decode(f.data, f.len, err);
    kiln_buf_free(&f);
    CHECK(d != NULL && w->n_out < MAX_SENT);
    if (!d || w->n_out == MAX_SENT)
        return KILN_ERR_INTERNAL;
    snprintf(w->out[w->n_out].peer, sizeof w->out[w->n_out].peer, "%s", peer);
    w->out[w->n_out++].m = d;
    return KILN_OK;
}

static void fake_finish(void *ud, void *client, const kiln_sched_result *res)
{
    world *w = ud;
    CHECK(client == (void *)w);
    w->n_finished++;
    w->last_status = res->status;
    w->last_images = res->status == 200 ? res->n_images : 0;
    snprintf(w->last_message, sizeof w->last_message, "%s", res->message ? res->message : "");
    for (int i = 0; i < res->n_images && i < 16; i++) {
        w->last_seeds[i] = res->seeds[i];
        CHECK(res->images[i].len == 3 && memcmp(res->images[i].data, "img", 3) == 0);
    }
}

/* The next message sent since the last call (NULL when none). */
static kiln_msg *next_sent(world *w, const char **peer)
{
    if (w->seen_out == w->n_out)
        return NULL;
    *peer = w->out[w->seen_out].peer;
    return w->out[w->seen_out++].m;
}

/* Expects the next sent message to be `type` to `peer`. */
static kiln_msg *expect_sent(world *w, kiln_msg_type type, const char *peer)
{
    const char *to = NULL;
    kiln_msg *m = next_sent(w, &to);
    CHECKF(m != NULL, "expected a %s to %s, nothing sent", kiln_msg_type_name(type), peer);
    if (!m)
        return NULL;
    CHECKF(m->type == type && strcmp(to, peer) == 0, "expected %s to %s, got %s to %s",
           kiln_msg_type_name(type), peer, kiln_msg_type_name(m->type), to);
    return m;
}

static void expect_quiet(world *w)
{
    const char *to;
    kiln_msg *m = next_sent(w, &to);
    CHECKF(m == NULL, "unexpected %s to %s", m ? kiln_msg_type_name(m->type) : "", m ? to : "");
}

static void deliver(world *w, const char *peer, const kiln_msg *m)
{
    kiln_buf f = {0};
    kiln_err err = {0};
    CHECKF(kiln_msg_encode(m, &f, &err) == KILN_OK, "test message: %s", err.msg);
    kiln_msg *d = kiln_msg_decode(f.data, f.len, &err);
    kiln_buf_free(&f);
    CHECK(d != NULL);
    if (d)
        kiln_sched_on_msg(w->s, peer, d, w->now);
}

static void hello(world *w, const char *id, kiln_stage st, const char *model, int credits)
{
    kiln_msg m = {.type = KILN_MSG_HELLO,
                  .hello = {.stage = st, .replica = id, .model = model, .host = "test",
                            .max_batch = 4, .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM)}};
    deliver(w, id, &m);
    if (credits) {
        kiln_msg r = {.type = KILN_MSG_READY, .ready.credits = credits};
        deliver(w, id, &r);
    }
}

static void hb(world *w, const char *id)
{
    kiln_msg m = {.type = KILN_MSG_HB};
    deliver(w, id, &m);
}

static kiln_tensor_ref shm_ref(const char *owner, const char *slab, uint64_t off)
{
    kiln_tensor_ref r = {.kind = KILN_REF_SHM, .dtype = KILN_F32, .ndim = 3,
                         .shape = {1, 4, 8}, .len = 128, .off = off};
    snprintf(r.owner, sizeof r.owner, "%s", owner);
    snprintf(r.slab, sizeof r.slab, "%s", slab);
    return r;
}

static void done_with(world *w, const char *from, uint64_t job, const char *name,
                      const kiln_tensor_ref *ref)
{
    kiln_msg m = {.type = KILN_MSG_DONE, .done = {.job = job, .ok = 1}};
    kiln_ref_map_put(&m.done.out, name, ref, NULL);
    m.done.n_ms = 1;
    m.done.ms[0] = (kiln_timing){"batch_rows", 2};
    deliver(w, from, &m);
}

static void done_images(world *w, const char *from, uint64_t job, int n)
{
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_DONE;
    m->done.job = job;
    m->done.ok = 1;
    m->done.n_images = n;
    for (int i = 0; i < n; i++)
        m->done.images[i] = (kiln_bytes){(const uint8_t *)"img", 3};
    deliver(w, from, m);
    free(m);
}

static void done_error(world *w, const char *from, uint64_t job, kiln_status code, const char *msg)
{
    kiln_msg m = {.type = KILN_MSG_DONE, .done = {.job = job, .ok = 0, .code = code, .message = msg}};
    deliver(w, from, &m);
}

static void world_init(world *w, int queue_max)
{
    memset(w, 0, sizeof *w);
    w->now = 1000;
    kiln_err err = {0};
    w->metrics = kiln_metrics_create(&err);
    kiln_sched_opts o = {.model_id = "klein-tiny", .queue_max = queue_max,
                         .heartbeat_timeout_ms = 2000, .job_timeout_ms = 60000};
    kiln_sched_ops ops = {.send = fake_send, .finish = fake_finish};
    w->s = kiln_sched_create(&o, &ops, w, w->metrics, &err);
    CHECK(w->s != NULL);
}

static void world_free(world *w)
{
    kiln_sched_destroy(w->s);
    kiln_metrics_destroy(w->metrics);
    for (int i = 0; i < w->n_out; i++)
        kiln_msg_free(w->out[i].m);
}

static void expect_idle(world *w)
{
    kiln_metrics_gauges g;
    kiln_sched_gauges(w->s, &g);
    CHECKF(g.jobs == 0, "%d jobs left", g.jobs);
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        CHECKF(g.queued[s] == 0 && g.inflight[s] == 0, "stage %d: %d queued, %d in flight", s,
               g.queued[s], g.inflight[s]);
}

static kiln_status submit(world *w, const char *json, uint64_t *id)
{
    kiln_api_config c = {.model_id = "klein-tiny",
                         .traits = {.default_steps = 4, .default_guidance = 1.0f},
                         .limits = KILN_LIMITS_SERVICE,
                         .image_limits = KILN_IMAGE_LIMITS_DEFAULT};
    c.limits.min_side = 64;
    kiln_api_request r;
    kiln_api_error e;
    CHECKF(kiln_api_parse(KILN_API_GENERATE, NULL, json, strlen(json), &c, &r, &e) == KILN_OK,
           "%s", e.err.msg);
    kiln_err err = {0};
    kiln_status st = kiln_sched_submit(w->s, &r, w, w->now, id, &err);
    if (st) {
        CHECK(err.msg[0] != '\0');
        kiln_api_request_free(&r);
    } else {
        CHECK(r.prompt == NULL); /* the job took it */
        kiln_sched_kick(w->s, w->now);
    }
    return st;
}

static void cluster(world *w)
{
    hello(w, "encode-a", KILN_STAGE_ENCODE, "klein-tiny", 2);
    hello(w, "denoise-a", KILN_STAGE_DENOISE, "klein-tiny", 2);
    hello(w, "decode-a", KILN_STAGE_DECODE, "klein-tiny", 2);
}

static void test_flow(void)
{
    world w;
    world_init(&w, 8);
    uint64_t id;
    CHECK(!kiln_sched_ready(w.s));
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_ERR_UNAVAILABLE);
    /* A replica of another model is refused. */
    hello(&w, "encode-z", KILN_STAGE_ENCODE, "other-model", 2);
    cluster(&w);
    CHECK(kiln_sched_ready(w.s));
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[0] == 1 && g.replicas[1] == 1 && g.replicas[2] == 1);

    CHECK(submit(&w, "{\"prompt\":\"a cat\",\"size\":\"128x64\",\"n\":2,\"seed\":40,"
                     "\"num_inference_steps\":3,\"max_sequence_length\":77}",
                 &id) == KILN_OK);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    if (!m)
        goto out;
    CHECK(m->job.job == id && m->job.stage == KILN_STAGE_ENCODE);
    CHECK(m->job.encode.n_prompts == 1 && strcmp(m->job.encode.prompts[0], "a cat") == 0);
    CHECK(m->job.encode.negative == NULL && m->job.encode.max_seq == 77);
    expect_quiet(&w);

    kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 64);
    done_with(&w, "encode-a", id, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    if (!m)
        goto out;
    CHECK(m->job.stage == KILN_STAGE_DENOISE && m->job.denoise.n == 2 && m->job.denoise.n_seeds == 2);
    CHECK(m->job.denoise.seeds[0] == 40 && m->job.denoise.seeds[1] == 41);
    CHECK(m->job.denoise.width == 128 && m->job.denoise.height == 64 && m->job.denoise.steps == 3);
    const kiln_tensor_ref *in = kiln_ref_map_get(&m->job.in, "embeds");
    CHECK(in && in->off == 64 && strcmp(in->slab, "/kiln-encode-1-0") == 0 &&
          strcmp(in->owner, "encode-a") == 0);
    /* The denoiser releases its input: the owner gets a free. */
    kiln_msg rel = {.type = KILN_MSG_RELEASE, .refs = {.n = 1}};
    rel.refs.refs[0] = emb;
    deliver(&w, "denoise-a", &rel);
    m = expect_sent(&w, KILN_MSG_FREE, "encode-a");
    CHECK(m && m->refs.n == 1 && m->refs.refs[0].off == 64);

    kiln_tensor_ref lat = shm_ref("denoise-a", "/kiln-denoise-1-0", 0);
    done_with(&w, "denoise-a", id, "latents", &lat);
    m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
    if (!m)
        goto out;
    CHECK(m->job.decode.width == 128 && m->job.decode.height == 64 &&
          m->job.decode.format == KILN_IMAGE_PNG);
    CHECK(kiln_ref_map_get(&m->job.in, "latents") != NULL);
    CHECK(w.n_finished == 0);
    done_images(&w, "decode-a", id, 2);
    CHECK(w.n_finished == 1 && w.last_status == 200 && w.last_images == 2);
    CHECK(w.last_seeds[0] == 40 && w.last_seeds[1] == 41);
    expect_quiet(&w);
    expect_idle(&w);
out:
    world_free(&w);
}

static void test_credits_and_admission(void)
{
    world w;
    world_init(&w, 2);
    hello(&w, "encode-a", KILN_STAGE_ENCODE, "klein-tiny", 1);
    hello(&w, "denoise-a", KILN_STAGE_DENOISE, "klein-tiny", 0);
    hello(&w, "decode-a", KILN_STAGE_DECODE, "klein-tiny", 1);
    uint64_t a, b, c, d;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_OK);
    CHECK(submit(&w, "{\"prompt\":\"b\",\"size\":\"64x64\"}", &b) == KILN_OK);
    CHECK(submit(&w, "{\"prompt\":\"c\",\"size\":\"64x64\"}", &c) == KILN_OK);
    /* One credit: one job out, two queued, and the queue (2) is full. */
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a);
    expect_quiet(&w);
    CHECK(submit(&w, "{\"prompt\":\"d\",\"size\":\"64x64\"}", &d) == KILN_ERR_BUSY);
    /* The done returns the credit: the next job goes. */
    kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-a", a, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == b);
    expect_quiet(&w); /* the denoiser has no credit */
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.queued[0] == 1 && g.inflight[0] == 1 && g.queued[1] == 1 && g.jobs == 3);
    /* A `ready` lets the denoiser pull. */
    kiln_msg r = {.type = KILN_MSG_READY, .ready.credits = 5};
    deliver(&w, "denoise-a", &r);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    CHECK(m && m->job.job == a);
    /* Cancelling: the running encode gets a cancel, the queued one just
     * goes, the running denoise gets a cancel. */
    kiln_sched_cancel(w.s, b, w.now);
    expect_sent(&w, KILN_MSG_CANCEL, "encode-a");
    kiln_sched_cancel(w.s, c, w.now);
    kiln_sched_cancel(w.s, a, w.now);
    m = expect_sent(&w, KILN_MSG_CANCEL, "denoise-a");
    CHECK(m && m->cancel_job == a);
    expect_quiet(&w);
    CHECK(w.n_finished == 0); /* nobody to answer */
    expect_idle(&w);
    /* Their late dones: the outputs go back to their owner. */
    kiln_tensor_ref late = shm_ref("encode-a", "/kiln-encode-1-0", 128);
    done_with(&w, "encode-a", b, "embeds", &late);
    m = expect_sent(&w, KILN_MSG_FREE, "encode-a");
    CHECK(m && m->refs.n == 1 && m->refs.refs[0].off == 128);
    done_error(&w, "denoise-a", a, KILN_ERR_CANCELLED, "request cancelled");
    expect_quiet(&w);
    world_free(&w);
}

static void test_cancel_between_stages(void)
{
    world w;
    world_init(&w, 8);
    hello(&w, "encode-a", KILN_STAGE_ENCODE, "klein-tiny", 1);
    hello(&w, "denoise-a", KILN_STAGE_DENOISE, "klein-tiny", 0);
    hello(&w, "decode-a", KILN_STAGE_DECODE, "klein-tiny", 1);
    uint64_t a;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 0);
    kiln_tensor_ref neg = shm_ref("encode-a", "/kiln-encode-1-0", 128);
    kiln_msg m = {.type = KILN_MSG_DONE, .done = {.job = a, .ok = 1}};
    kiln_ref_map_put(&m.done.out, "embeds", &emb, NULL);
    kiln_ref_map_put(&m.done.out, "neg", &neg, NULL);
    deliver(&w, "encode-a", &m);
    expect_quiet(&w); /* waiting for a denoise credit */
    /* The gateway holds the embeddings: it frees both, in one message. */
    kiln_sched_cancel(w.s, a, w.now);
    kiln_msg *f = expect_sent(&w, KILN_MSG_FREE, "encode-a");
    CHECK(f && f->refs.n == 2);
    expect_quiet(&w);
    expect_idle(&w);
    world_free(&w);
}

static void test_replica_loss(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    uint64_t a;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\",\"seed\":5}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-a", a, "embeds", &emb);
    const char *first;
    kiln_msg *m = next_sent(&w, &first);
    CHECK(m && m->type == KILN_MSG_JOB && m->job.stage == KILN_STAGE_DENOISE);
    if (!m)
        goto out;
    const char *second = strcmp(first, "denoise-a") == 0 ? "denoise-b" : "denoise-a";
    /* 2.5 s later only the other replicas have spoken. */
    w.now += 2500;
    hb(&w, "encode-a");
    hb(&w, second);
    hb(&w, "decode-a");
    kiln_sched_tick(w.s, w.now);
    m = expect_sent(&w, KILN_MSG_JOB, second);
    CHECK(m && m->job.job == a && m->job.denoise.seeds[0] == 5);
    CHECK(m && kiln_ref_map_get(&m->job.in, "embeds") != NULL);
    CHECK(w.n_finished == 0);
    /* The first one's late done is not the job's any more. */
    kiln_tensor_ref stale = shm_ref(first, "/kiln-denoise-9-0", 0);
    done_with(&w, first, a, "latents", &stale);
    expect_sent(&w, KILN_MSG_FREE, first);
    /* The second dies too: one re-dispatch only, so 503. */
    w.now += 2500;
    hb(&w, "encode-a");
    hb(&w, "decode-a");
    kiln_sched_tick(w.s, w.now);
    CHECK(w.n_finished == 1 && w.last_status == 503);
    CHECK(strstr(w.last_message, "denoise") != NULL);
    /* first came back (it spoke); both stopping now leaves no denoiser:
     * admission answers 503. */
    w.now += 2500;
    hb(&w, "encode-a");
    hb(&w, "decode-a");
    kiln_sched_tick(w.s, w.now);
    CHECK(!kiln_sched_ready(w.s));
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_ERR_UNAVAILABLE);
    /* Unreachable on the bus is lost as well. */
    kiln_sched_on_unreachable(w.s, "decode-a", w.now);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[2] == 0);
    while (next_sent(&w, &first))
        ;
    expect_idle(&w);
out:
    world_free(&w);
}

static void test_restart_after_release(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "decode-b", KILN_STAGE_DECODE, "klein-tiny", 1);
    uint64_t a;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-a", a, "embeds", &emb);
    expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    kiln_tensor_ref lat = shm_ref("denoise-a", "/kiln-denoise-1-0", 0);
    done_with(&w, "denoise-a", a, "latents", &lat);
    const char *dec;
    kiln_msg *m = next_sent(&w, &dec);
    CHECK(m && m->type == KILN_MSG_JOB && m->job.stage == KILN_STAGE_DECODE);
    if (!m)
        goto out;
    /* The decoder released the latents, then died: the job starts over. */
    kiln_msg rel = {.type = KILN_MSG_RELEASE, .refs = {.n = 1}};
    rel.refs.refs[0] = lat;
    deliver(&w, dec, &rel);
    expect_sent(&w, KILN_MSG_FREE, "denoise-a");
    kiln_sched_on_unreachable(w.s, dec, w.now);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a && m->job.stage == KILN_STAGE_ENCODE);
    CHECK(w.n_finished == 0);
    /* The job re-runs from the start; losing the encoder that made the
     * references the running denoise reads is not the denoise's loss: the
     * consumer has them mapped, and it answers for the job. */
    kiln_tensor_ref emb2 = shm_ref("encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    CHECK(m != NULL);
    kiln_sched_on_unreachable(w.s, "encode-a", w.now);
    CHECK(w.n_finished == 0);
out:
    world_free(&w);
}

static void test_errors_and_timeout(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t a;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    done_error(&w, "encode-a", a, KILN_ERR_INVALID, "prompt has too many tokens");
    CHECK(w.n_finished == 1 && w.last_status == 400);
    CHECK(strcmp(w.last_message, "prompt has too many tokens") == 0);
    CHECK(submit(&w, "{\"prompt\":\"b\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    done_error(&w, "encode-a", a, KILN_ERR_DEVICE, "cuda failure");
    CHECK(w.n_finished == 2 && w.last_status == 500);
    /* A done without the output the next stage needs is a fault. */
    CHECK(submit(&w, "{\"prompt\":\"c\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref x = shm_ref("encode-a", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-a", a, "wrong", &x);
    CHECK(w.n_finished == 3 && w.last_status == 500);
    expect_sent(&w, KILN_MSG_FREE, "encode-a");
    /* Timeout: 504 and the replica is told to stop. */
    CHECK(submit(&w, "{\"prompt\":\"d\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    for (int i = 0; i < 31; i++) {
        w.now += 2000;
        hb(&w, "encode-a"), hb(&w, "denoise-a"), hb(&w, "decode-a");
        kiln_sched_tick(w.s, w.now);
    }
    CHECK(w.n_finished == 4 && w.last_status == 504);
    kiln_msg *m = expect_sent(&w, KILN_MSG_CANCEL, "encode-a");
    CHECK(m && m->cancel_job == a);
    expect_idle(&w);
    /* The decoder returns the wrong number of images: 500. */
    CHECK(submit(&w, "{\"prompt\":\"e\",\"size\":\"64x64\",\"n\":2}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    done_with(&w, "encode-a", a, "embeds", &x);
    expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    kiln_tensor_ref lat = shm_ref("denoise-a", "/kiln-denoise-1-0", 0);
    done_with(&w, "denoise-a", a, "latents", &lat);
    expect_sent(&w, KILN_MSG_JOB, "decode-a");
    done_images(&w, "decode-a", a, 1);
    CHECK(w.n_finished == 5 && w.last_status == 500);
    expect_idle(&w);
    world_free(&w);
}

/* A decoder that cannot open its input (the denoiser that made it died
 * and its slabs were removed): the job starts over from the encode stage
 * once, then fails with 503. */
static void test_inputs_gone(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t id;
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
    for (int round = 0; round < 2; round++) {
        expect_sent(&w, KILN_MSG_JOB, "encode-a");
        kiln_tensor_ref emb = shm_ref("encode-a", "/kiln-encode-1-0", 0);
        done_with(&w, "encode-a", id, "embeds", &emb);
        expect_sent(&w, KILN_MSG_JOB, "denoise-a");
        kiln_tensor_ref lat = shm_ref("denoise-a", "/kiln-denoise-1-0", 0);
        done_with(&w, "denoise-a", id, "latents", &lat);
        kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
        CHECK(m && m->job.job == id);
        done_error(&w, "decode-a", id, KILN_ERR_NOT_FOUND, "shm slab /kiln-denoise-1-0: gone");
        CHECK(w.n_finished == round);
    }
    CHECK(w.n_finished == 1 && w.last_status == 503);
    CHECKF(!strstr(w.last_message, "/kiln-"), "the message names a slab: %s", w.last_message);
    expect_quiet(&w);
    expect_idle(&w);
    world_free(&w);
}

/* Idle replicas with equal credits take turns: sequential requests do
 * not all go to the first replica registered. */
static void test_idle_replicas_take_turns(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "encode-b", KILN_STAGE_ENCODE, "klein-tiny", 2);
    static const char *const expect[] = {"encode-a", "encode-b", "encode-a", "encode-b"};
    for (int i = 0; i < 4; i++) {
        uint64_t id;
        CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
        kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, expect[i]);
        CHECK(m && m->job.job == id);
        done_error(&w, expect[i], id, KILN_ERR_INVALID, "bad prompt"); /* its credit back */
        CHECK(w.n_finished == i + 1 && w.last_status == 400);
    }
    expect_quiet(&w);
    expect_idle(&w);
    world_free(&w);
}

int main(void)
{
    RUN(test_flow);
    RUN(test_credits_and_admission);
    RUN(test_idle_replicas_take_turns);
    RUN(test_inputs_gone);
    RUN(test_cancel_between_stages);
    RUN(test_replica_loss);
    RUN(test_restart_after_release);
    RUN(test_errors_and_timeout);
    return test_finish();
}

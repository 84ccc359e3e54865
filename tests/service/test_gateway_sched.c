/* The gateway scheduler driven by hand-made bus messages and a fake clock:
 * the encode -> denoise -> decode flow with references forwarded, credits
 * (pull), idle replicas taking turns, release -> free forwarding (and a
 * done returning what was not released), admission (503 / 429),
 * cancellation in every state, fencing (heartbeat loss, a reconnect, a
 * restart under the same id, a done naming references the replica did not
 * make) with one re-run from the encode stage on fresh references then
 * 503, messages of fenced incarnations ignored and answered `fenced`,
 * forged and repeated releases refused, restarts when inputs are gone (a
 * consumer's not_found), timeouts (504), error dones, dones nobody
 * waits for, cancels a replica answers late or never (busy gauges,
 * fencing), replicas leaving gracefully (`leaving`, then `bye`),
 * previews of streamed requests (partial_images: a denoiser's `partial`
 * decoded as a job of its own on a spare decoder credit, answered in
 * index order before the finish, which waits for a preview still
 * decoding; queued ones dropped when the final latents come; stale,
 * unwanted and cancelled ones freed), and decoded images by reference
 * (read, verified and freed at once; a stale or invalid reference never
 * answered with).
 * Every message the scheduler sends goes through kiln_msg_encode /
 * kiln_msg_decode, so it must be a valid protocol message. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
    /* The current incarnation of each replica id the test registered. */
    struct {
        char id[KILN_PROTO_ID_MAX];
        uint64_t epoch;
        uint64_t progress; /* what its next hb reports (hb moves it on) */
    } reps[16];
    int n_reps;
    uint64_t next_epoch, next_gen;
    int show_gone; /* next_sent returns `gone` broadcasts too (else skips them) */
    sent out[MAX_SENT];
    int n_out, seen_out;
    int n_finished, last_status, last_images;
    char last_message[KILN_ERR_MSG_MAX];
    uint64_t last_seeds[16];
    kiln_trace last_trace; /* the last finished request's spans */
    const char *want_images[16]; /* what finish must get (NULL: "img") */
    int partials[16], n_partials; /* preview indices answered, in order */
    int finished_after;           /* n_partials when the finish came */
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

static void fake_partial(void *ud, void *client, const kiln_sched_partial *p)
{
    world *w = ud;
    CHECK(client == (void *)w && w->n_partials < 16);
    CHECK(p->n_images == p->req->plan.req.n && p->images[0].len == 3);
    CHECKF(w->n_finished == 0, "a preview after the finish");
    if (w->n_partials < 16)
        w->partials[w->n_partials++] = p->index;
}

static void fake_finish(void *ud, void *client, const kiln_sched_result *res)
{
    world *w = ud;
    CHECK(client == (void *)w);
    w->finished_after = w->n_partials;
    w->n_finished++;
    w->last_status = res->status;
    w->last_images = res->status == 200 ? res->n_images : 0;
    snprintf(w->last_message, sizeof w->last_message, "%s", res->message ? res->message : "");
    w->last_trace.n = 0;
    if (res->trace)
        w->last_trace = *res->trace;
    for (int i = 0; i < res->n_images && i < 16; i++) {
        w->last_seeds[i] = res->seeds[i];
        const char *want = w->want_images[i] ? w->want_images[i] : "img";
        CHECKF(res->images[i].len == strlen(want) &&
                   memcmp(res->images[i].data, want, strlen(want)) == 0,
               "image %d is not '%s'", i, want);
    }
}

/* The next message sent since the last call (NULL when none); `gone`
 * broadcasts only when the world shows them. */
static kiln_msg *next_sent(world *w, const char **peer)
{
    while (w->seen_out < w->n_out && !w->show_gone &&
           w->out[w->seen_out].m->type == KILN_MSG_GONE)
        w->seen_out++;
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

/* The epoch replica `id` registered with (0 when it never did). */
static uint64_t epoch_of(const world *w, const char *id)
{
    for (int i = 0; i < w->n_reps; i++)
        if (!strcmp(w->reps[i].id, id))
            return w->reps[i].epoch;
    return 0;
}

/* A fresh incarnation of `id`: a new epoch, as a restarted process draws. */
static uint64_t new_epoch(world *w, const char *id)
{
    uint64_t e = 0x1000 + ++w->next_epoch;
    for (int i = 0; i < w->n_reps; i++)
        if (!strcmp(w->reps[i].id, id))
            return w->reps[i].epoch = e;
    snprintf(w->reps[w->n_reps].id, sizeof w->reps[0].id, "%s", id);
    w->reps[w->n_reps++].epoch = e;
    return e;
}

/* Sends m as from `peer`, in its registered incarnation unless m names an
 * epoch itself (a forged or stale message). */
/* The traits the replicas of these tests announce (a distilled klein), and
 * the requests are resolved with. */
static const kiln_model_traits tiny = {.family = "flux2", .default_steps = 4,
                                       .default_guidance = 1.0f, .text_width = 48,
                                       .latent_channels = 32, .shrink_images = 1,
                                       .inpaint_strength = 0.8};

static void deliver(world *w, const char *peer, const kiln_msg *m)
{
    kiln_buf f = {0};
    kiln_err err = {0};
    kiln_msg stamped = *m;
    if (stamped.type == KILN_MSG_HELLO && !stamped.hello.traits.family[0])
        stamped.hello.traits = tiny;
    if (!stamped.epoch)
        stamped.epoch = epoch_of(w, peer) ? epoch_of(w, peer) : 0xdead;
    m = &stamped;
    CHECKF(kiln_msg_encode(m, &f, &err) == KILN_OK, "test message: %s", err.msg);
    kiln_msg *d = kiln_msg_decode(f.data, f.len, &err);
    kiln_buf_free(&f);
    CHECK(d != NULL);
    if (d)
        kiln_sched_on_msg(w->s, peer, d, w->now);
}

/* Every replica of these tests shares one transport domain, unless a test
 * says otherwise (test_domains). */
static const kiln_domain one_box = {.host = "boot-1", .shm = "27:1", .ipc_ns = 1, .mnt_ns = 2,
                                    .pid_ns = 3, .gpu = -1};

/* Registers a new incarnation of `id` (a new epoch each call), one of
 * the stages of process `process` (hello's token; NULL: it does not say). */
static void hello_of_process(world *w, const char *id, kiln_stage st, const char *model,
                             int credits, const char *process)
{
    kiln_msg m = {.type = KILN_MSG_HELLO, .epoch = new_epoch(w, id),
                  .hello = {.stage = st, .replica = id, .model = model, .host = "test",
                            .max_batch = 4, .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM),
                            .domain = one_box, .process = process}};
    deliver(w, id, &m);
    if (credits) {
        kiln_msg r = {.type = KILN_MSG_READY, .ready.credits = credits};
        deliver(w, id, &r);
    }
}

static void hello(world *w, const char *id, kiln_stage st, const char *model, int credits)
{
    hello_of_process(w, id, st, model, credits, NULL);
}

/* A heartbeat of a replica whose backend moves on. */
static void hb(world *w, const char *id)
{
    kiln_msg m = {.type = KILN_MSG_HB};
    for (int i = 0; i < w->n_reps; i++)
        if (!strcmp(w->reps[i].id, id))
            m.progress = ++w->reps[i].progress;
    deliver(w, id, &m);
}

/* A heartbeat of a replica whose backend stands still. */
static void hb_stuck(world *w, const char *id)
{
    kiln_msg m = {.type = KILN_MSG_HB, .progress = 0};
    deliver(w, id, &m);
}

/* Lets ms pass as the gateway does, a tick every 250 ms, while the
 * replicas in talking[] (NULL-terminated) heartbeat. */
static void advance(world *w, double ms, const char *const *talking)
{
    for (double t = 0; t < ms; t += 250) {
        w->now += 250;
        for (int i = 0; talking && talking[i]; i++)
            hb(w, talking[i]);
        kiln_sched_tick(w->s, w->now);
    }
}

/* A new allocation of the current incarnation of `owner`. */
static kiln_tensor_ref shm_ref(world *w, const char *owner, const char *slab, uint64_t off)
{
    kiln_tensor_ref r = {.kind = KILN_REF_SHM, .dtype = KILN_F32, .ndim = 3,
                         .shape = {1, 4, 8}, .len = 128, .off = off};
    snprintf(r.owner, sizeof r.owner, "%s", owner);
    snprintf(r.slab, sizeof r.slab, "%s", slab);
    r.epoch = epoch_of(w, owner) ? epoch_of(w, owner) : 0xdead;
    r.gen = ++w->next_gen;
    return r;
}

static void release(world *w, const char *from, const kiln_tensor_ref *ref)
{
    kiln_msg rel = {.type = KILN_MSG_RELEASE, .refs = {.n = 1}};
    rel.refs.refs[0] = *ref;
    deliver(w, from, &rel);
}

/* The next message must be a free to `owner` of exactly `ref`. */
static void expect_free(world *w, const char *owner, const kiln_tensor_ref *ref)
{
    kiln_msg *m = expect_sent(w, KILN_MSG_FREE, owner);
    CHECKF(m && m->refs.n == 1 && m->refs.refs[0].gen == ref->gen &&
               m->refs.refs[0].off == ref->off && m->epoch == ref->epoch,
           "free to %s is not of %s+%llu gen %llu", owner, ref->slab,
           (unsigned long long)ref->off, (unsigned long long)ref->gen);
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

/* The next world's opts.cancel_timeout_ms (0: never fence), and its
 * reader of image files by reference and transport domain (NULL: images
 * come inline). */
static double world_cancel_ms;
static kiln_transport *world_images;
static const kiln_domain *world_domain;

static void world_init(world *w, int queue_max)
{
    memset(w, 0, sizeof *w);
    w->now = 1000;
    kiln_err err = {0};
    w->metrics = kiln_metrics_create(&err);
    kiln_sched_opts o = {.model_id = "klein-tiny", .queue_max = queue_max,
                         .heartbeat_timeout_ms = 2000, .progress_timeout_ms = 3000,
                         .job_timeout_ms = 60000, .cancel_timeout_ms = world_cancel_ms,
                         .images = world_images, .domain = world_domain};
    kiln_sched_ops ops = {.send = fake_send, .finish = fake_finish, .partial = fake_partial};
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
    kiln_api_config c = {.model_id = "klein-tiny", .traits = tiny,
                         .limits = KILN_LIMITS_SERVICE,
                         .image_limits = KILN_IMAGE_LIMITS_DEFAULT, .max_body_bytes = 64u << 20};
    c.limits.min_side = 64;
    kiln_api_request r;
    kiln_api_error e;
    CHECKF(kiln_api_parse(KILN_API_GENERATE, NULL, json, strlen(json), &c, &r, &e) == KILN_OK,
           "%s", e.err.msg);
    kiln_err err = {0};
    static int n_submitted;
    snprintf(r.request_id, sizeof r.request_id, "req_t%d", ++n_submitted);
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

/* Submits a request and takes it through the encode stage (encode-a
 * answers with new embeddings *emb); returns the denoise job it became,
 * sent to *to (checked to be a denoise job for *id; NULL when none). */
static kiln_msg *to_denoise(world *w, const char *json, uint64_t *id, kiln_tensor_ref *emb,
                            const char **to)
{
    *to = "";
    CHECK(submit(w, json, id) == KILN_OK);
    expect_sent(w, KILN_MSG_JOB, "encode-a");
    *emb = shm_ref(w, "encode-a", "/kiln-encode-1-0", 64);
    done_with(w, "encode-a", *id, "embeds", emb);
    kiln_msg *m = next_sent(w, to);
    CHECK(m && m->type == KILN_MSG_JOB && m->job.stage == KILN_STAGE_DENOISE && m->job.job == *id);
    return m && m->type == KILN_MSG_JOB ? m : NULL;
}

/* Job `id`, just sent to encode-a, through the encode and denoise stages
 * of the cluster: *lat is what the decoder gets, dispatched to decode-a. */
static kiln_msg *to_decode(world *w, uint64_t id, kiln_tensor_ref *lat)
{
    expect_sent(w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref emb = shm_ref(w, "encode-a", "/kiln-encode-1-0", 64);
    done_with(w, "encode-a", id, "embeds", &emb);
    expect_sent(w, KILN_MSG_JOB, "denoise-a");
    *lat = shm_ref(w, "denoise-a", "/kiln-denoise-1-0", 64);
    done_with(w, "denoise-a", id, "latents", lat);
    expect_free(w, "encode-a", &emb);
    kiln_msg *m = expect_sent(w, KILN_MSG_JOB, "decode-a");
    CHECK(m && m->job.job == id);
    return m;
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
    CHECK(m->epoch == epoch_of(&w, "encode-a"));
    CHECK(m->job.encode.n_prompts == 1 && strcmp(m->job.encode.prompts[0], "a cat") == 0);
    CHECK(m->job.encode.negative == NULL && m->job.encode.max_seq == 77);
    expect_quiet(&w);

    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
    done_with(&w, "encode-a", id, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    if (!m)
        goto out;
    CHECK(m->job.stage == KILN_STAGE_DENOISE && m->job.denoise.n == 2 && m->job.denoise.n_seeds == 2);
    CHECK(m->epoch == epoch_of(&w, "denoise-a"));
    CHECK(m->job.denoise.seeds[0] == 40 && m->job.denoise.seeds[1] == 41);
    CHECK(m->job.denoise.width == 128 && m->job.denoise.height == 64 && m->job.denoise.steps == 3);
    const kiln_tensor_ref *in = kiln_ref_map_get(&m->job.in, "embeds");
    CHECK(in && in->off == 64 && strcmp(in->slab, "/kiln-encode-1-0") == 0 &&
          strcmp(in->owner, "encode-a") == 0 && in->gen == emb.gen && in->epoch == emb.epoch);
    /* The denoiser releases its input: the owner gets a free, once. */
    release(&w, "denoise-a", &emb);
    expect_free(&w, "encode-a", &emb);
    release(&w, "denoise-a", &emb);
    expect_quiet(&w);

    kiln_tensor_ref lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 0);
    done_with(&w, "denoise-a", id, "latents", &lat);
    m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
    if (!m)
        goto out;
    CHECK(m->job.decode.width == 128 && m->job.decode.height == 64 &&
          m->job.decode.format == KILN_IMAGE_PNG);
    CHECK(kiln_ref_map_get(&m->job.in, "latents") != NULL);
    CHECK(w.n_finished == 0);
    /* The decoder answers without releasing first: its done returns the
     * latents it was handed. */
    done_images(&w, "decode-a", id, 2);
    CHECK(w.n_finished == 1 && w.last_status == 200 && w.last_images == 2);
    CHECK(w.last_seeds[0] == 40 && w.last_seeds[1] == 41);
    expect_free(&w, "denoise-a", &lat);
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
    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
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
    CHECK(m && m->cancel_job == a && m->epoch == epoch_of(&w, "denoise-a"));
    expect_quiet(&w);
    CHECK(w.n_finished == 0); /* nobody to answer */
    expect_idle(&w);
    /* Their late dones: the outputs go back to their owner, and so do the
     * inputs the denoiser was handed for the job that is gone. */
    kiln_tensor_ref late = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", b, "embeds", &late);
    expect_free(&w, "encode-a", &late);
    done_error(&w, "denoise-a", a, KILN_ERR_CANCELLED, "request cancelled");
    expect_free(&w, "encode-a", &emb);
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
    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
    kiln_tensor_ref neg = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 192);
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

/* A denoiser that stops heartbeating is fenced: the references it was
 * handed go back to their owner (it may still read them: they are never
 * handed on again), its job runs again from the encode stage on fresh
 * references, and nothing it sends afterwards counts. */
static void test_replica_loss(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *first;
    kiln_msg *m = to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\",\"seed\":5}", &a, &emb,
                             &first);
    if (!m)
        goto out;
    const char *second = strcmp(first, "denoise-a") == 0 ? "denoise-b" : "denoise-a";
    /* 2.5 s later only the other replicas have spoken. */
    advance(&w, 2500, (const char *[]){"encode-a", second, "decode-a", NULL});
    expect_free(&w, "encode-a", &emb);
    m = expect_sent(&w, KILN_MSG_FENCED, first);
    CHECK(m && m->epoch == epoch_of(&w, first));
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a && m->job.stage == KILN_STAGE_ENCODE);
    CHECK(w.n_finished == 0);
    kiln_tensor_ref emb2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    m = expect_sent(&w, KILN_MSG_JOB, second);
    CHECK(m && m->job.job == a && m->job.denoise.seeds[0] == 5);
    const kiln_tensor_ref *in = m ? kiln_ref_map_get(&m->job.in, "embeds") : NULL;
    CHECK(in && in->gen == emb2.gen);
    /* The fenced one resumes: its release, done and heartbeat do not
     * count; each is answered `fenced`, and what its done made goes back
     * to it. */
    release(&w, first, &emb);
    expect_sent(&w, KILN_MSG_FENCED, first);
    kiln_tensor_ref stale = shm_ref(&w, first, "/kiln-denoise-9-0", 64);
    done_with(&w, first, a, "latents", &stale);
    expect_free(&w, first, &stale);
    expect_sent(&w, KILN_MSG_FENCED, first);
    hb(&w, first);
    expect_sent(&w, KILN_MSG_FENCED, first);
    expect_quiet(&w);
    CHECK(w.n_finished == 0);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 1 && g.inflight[1] == 1);
    /* The second dies too: one re-run only, so 503. */
    advance(&w, 2500, (const char *[]){"encode-a", "decode-a", NULL});
    CHECK(w.n_finished == 1 && w.last_status == 503);
    CHECK(strstr(w.last_message, "denoise") != NULL && strstr(w.last_message, "(request req_t"));
    expect_free(&w, "encode-a", &emb2);
    expect_sent(&w, KILN_MSG_FENCED, second);
    /* No denoiser is left: admission answers 503. */
    CHECK(!kiln_sched_ready(w.s));
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a) == KILN_ERR_UNAVAILABLE);
    /* Unreachable on the bus is fenced as well. */
    kiln_sched_on_unreachable(w.s, "decode-a", w.now);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[2] == 0);
    expect_sent(&w, KILN_MSG_FENCED, "decode-a");
    expect_quiet(&w);
    expect_idle(&w);
    /* A fenced incarnation cannot come back; the same id can, as a new
     * incarnation. */
    kiln_msg again = {.type = KILN_MSG_HELLO, .epoch = epoch_of(&w, first),
                      .hello = {.stage = KILN_STAGE_DENOISE, .replica = first,
                                .model = "klein-tiny", .host = "test", .max_batch = 4,
                                .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM),
                                .domain = one_box}};
    deliver(&w, first, &again);
    expect_sent(&w, KILN_MSG_FENCED, first);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 0);
    hello(&w, first, KILN_STAGE_DENOISE, "klein-tiny", 2);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 1);
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
    kiln_tensor_ref emb;
    const char *den;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &den);
    CHECK(!strcmp(den, "denoise-a"));
    kiln_tensor_ref lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 64);
    done_with(&w, "denoise-a", a, "latents", &lat);
    expect_free(&w, "encode-a", &emb); /* the denoiser's done returns its input */
    const char *dec;
    kiln_msg *m = next_sent(&w, &dec);
    CHECK(m && m->type == KILN_MSG_JOB && m->job.stage == KILN_STAGE_DECODE);
    if (!m)
        goto out;
    /* The decoder released the latents, then died: the job starts over. */
    release(&w, dec, &lat);
    expect_free(&w, "denoise-a", &lat);
    kiln_sched_on_unreachable(w.s, dec, w.now);
    expect_sent(&w, KILN_MSG_FENCED, dec);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a && m->job.stage == KILN_STAGE_ENCODE);
    CHECK(w.n_finished == 0);
    /* The job re-runs from the start; losing the encoder that made the
     * references the running denoise reads is not the denoise's loss: the
     * consumer has them mapped, and it answers for the job. */
    kiln_tensor_ref emb2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    CHECK(m != NULL);
    kiln_sched_on_unreachable(w.s, "encode-a", w.now);
    expect_sent(&w, KILN_MSG_FENCED, "encode-a");
    CHECK(w.n_finished == 0);
    /* Its release still goes to the encoder's incarnation (which may wait
     * for its ranges before it exits). */
    release(&w, "denoise-a", &emb2);
    expect_free(&w, "encode-a", &emb2);
    expect_quiet(&w);
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
    done_error(&w, "encode-a", a, KILN_ERR_DEVICE, "cudaStreamSynchronize(upload) at /work/x.cu");
    CHECK(w.n_finished == 2 && w.last_status == 500);
    /* A 500 says that there was a fault and names the request; the detail
     * stays in the log. */
    CHECKF(!strncmp(w.last_message, "internal error (request req_t", 29) &&
               !strstr(w.last_message, "cuda") && !strstr(w.last_message, "/work"),
           "500 message: %s", w.last_message);
    CHECK(submit(&w, "{\"prompt\":\"b2\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    done_error(&w, "encode-a", a, KILN_ERR_NOMEM, "shm slab of 8 bytes in /dev/shm: no space");
    CHECKF(w.last_status == 503 && strstr(w.last_message, "unavailable (request req_t") &&
               !strstr(w.last_message, "/dev/shm"),
           "503 message: %s", w.last_message);
    /* A done without the output the next stage needs is a fault. */
    CHECK(submit(&w, "{\"prompt\":\"c\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref x = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
    done_with(&w, "encode-a", a, "wrong", &x);
    CHECK(w.n_finished == 4 && w.last_status == 500);
    expect_free(&w, "encode-a", &x);
    /* Timeout: 504 and the replica is told to stop. */
    CHECK(submit(&w, "{\"prompt\":\"d\",\"size\":\"64x64\"}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    advance(&w, 62000, (const char *[]){"encode-a", "denoise-a", "decode-a", NULL});
    CHECK(w.n_finished == 5 && w.last_status == 504);
    CHECK(strstr(w.last_message, "(request req_t") != NULL);
    kiln_msg *m = expect_sent(&w, KILN_MSG_CANCEL, "encode-a");
    CHECK(m && m->cancel_job == a);
    expect_idle(&w);
    /* The decoder returns the wrong number of images: 500. */
    CHECK(submit(&w, "{\"prompt\":\"e\",\"size\":\"64x64\",\"n\":2}", &a) == KILN_OK);
    kiln_tensor_ref lat;
    to_decode(&w, a, &lat);
    done_images(&w, "decode-a", a, 1);
    CHECK(w.n_finished == 6 && w.last_status == 500);
    expect_free(&w, "denoise-a", &lat);
    expect_quiet(&w);
    expect_idle(&w);
    world_free(&w);
}

/* A decoder that cannot open its input (the denoiser that made it died
 * and its slabs were removed): the job starts over from the encode stage
 * once, then fails with 503; hand-off failures in a row make the service
 * not ready. */
static void test_inputs_gone(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t id;
    kiln_tensor_ref lat;
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
    for (int round = 0; round < 2; round++) {
        to_decode(&w, id, &lat);
        done_error(&w, "decode-a", id, KILN_ERR_NOT_FOUND, "shm slab /kiln-denoise-1-0: gone");
        expect_free(&w, "denoise-a", &lat);
        CHECK(w.n_finished == round);
    }
    CHECK(w.n_finished == 1 && w.last_status == 503);
    CHECKF(!strstr(w.last_message, "/kiln-"), "the message names a slab: %s", w.last_message);
    expect_quiet(&w);
    expect_idle(&w);
    /* Two hand-offs into the decode stage failed in a row: still ready; a
     * third makes the service say it is not, until one works again. */
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.handoff_failures == 2 && g.handoff_streak[KILN_STAGE_DECODE] == 2);
    CHECK(kiln_sched_ready(w.s));
    CHECK(submit(&w, "{\"prompt\":\"y\",\"size\":\"64x64\"}", &id) == KILN_OK);
    to_decode(&w, id, &lat);
    done_error(&w, "decode-a", id, KILN_ERR_NOT_FOUND, "gone");
    CHECK(!kiln_sched_ready(w.s));
    expect_free(&w, "denoise-a", &lat);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    done_error(&w, "encode-a", id, KILN_ERR_INVALID, "bad"); /* ends it */
    CHECK(submit(&w, "{\"prompt\":\"z\",\"size\":\"64x64\"}", &id) == KILN_OK);
    to_decode(&w, id, &lat);
    done_images(&w, "decode-a", id, 1);
    CHECK(kiln_sched_ready(w.s) && w.last_status == 200);
    expect_free(&w, "denoise-a", &lat);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.handoff_failures == 3 && g.handoff_streak[KILN_STAGE_DECODE] == 0);
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

/* The value of one /metrics sample: `key_fmt` with %s for its label
 * value, e.g. "kiln_events_total{event=\"%s\"}"; -1 when absent. */
static double metric_sample(world *w, const char *key_fmt, const char *label)
{
    kiln_buf b = {0};
    kiln_metrics_gauges g;
    kiln_sched_gauges(w->s, &g);
    CHECK(kiln_metrics_render(w->metrics, &g, &b, NULL) == KILN_OK);
    char name[96], key[100];
    snprintf(name, sizeof name, key_fmt, label);
    snprintf(key, sizeof key, "%s ", name); /* the whole sample, not a prefix of another */
    const char *at = b.data ? memmem(b.data, b.len, key, strlen(key)) : NULL;
    double v = at ? strtod(at + strlen(key), NULL) : -1;
    kiln_buf_free(&b);
    return v;
}

static double rejected(world *w, const char *reason)
{
    return metric_sample(w, "kiln_bus_rejected_total{reason=\"%s\"}", reason);
}

static double event_count(world *w, const char *event)
{
    return metric_sample(w, "kiln_events_total{event=\"%s\"}", event);
}

/* Releases are honoured only from the consumer a reference was handed to,
 * in that incarnation, once, with every field of the reference right:
 * forged ones from an unregistered peer or another replica, repeated ones
 * and ones naming another generation are refused and counted, and never
 * reach the owner. */
static void test_forged_releases(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 0);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *den;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &den);
    CHECK(!strcmp(den, "denoise-a"));
    release(&w, "mallory-1", &emb); /* never registered */
    release(&w, "denoise-b", &emb); /* registered, but not handed this */
    release(&w, "encode-a", &emb);  /* the owner itself */
    kiln_tensor_ref other = emb;
    other.gen++; /* the same range, another allocation */
    release(&w, "denoise-a", &other);
    other = emb, other.len = 64, other.shape[2] = 4;
    release(&w, "denoise-a", &other);
    kiln_msg forged = {.type = KILN_MSG_RELEASE, .epoch = epoch_of(&w, "denoise-a") + 1,
                       .refs = {.n = 1}};
    forged.refs.refs[0] = emb; /* the right id, another incarnation */
    deliver(&w, "denoise-a", &forged);
    expect_quiet(&w);
    CHECK(rejected(&w, "unregistered") == 2);
    CHECK(rejected(&w, "not_handed") == 4);
    CHECK(rejected(&w, "fenced") == 0);
    /* The real one goes through, once. */
    release(&w, "denoise-a", &emb);
    expect_free(&w, "encode-a", &emb);
    release(&w, "denoise-a", &emb);
    expect_quiet(&w);
    CHECK(rejected(&w, "not_handed") == 5);
    /* A done from a registered replica that names references it did not
     * make: it is fenced, nothing of the other owner is freed, and the job
     * runs again from the start. */
    kiln_tensor_ref theirs = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "denoise-a", a, "latents", &theirs);
    CHECK(rejected(&w, "foreign_ref") == 1);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a);
    expect_quiet(&w);
    CHECK(w.n_finished == 0);
    world_free(&w);
}

/* A replica id says hello again.  A new epoch is a new process under the
 * same id (a container's PID 1 after a restart): the old incarnation is
 * fenced and its job re-runs, on the new one if need be, with the new
 * epoch in the job.  The same epoch is the same process reconnected, which
 * may have lost messages either way: it is fenced too. */
static void test_hello_again(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *den;
    kiln_msg *m = to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &den);
    uint64_t old = epoch_of(&w, "denoise-a");
    CHECK(m && m->epoch == old);
    hello(&w, "denoise-a", KILN_STAGE_DENOISE, "klein-tiny", 2);
    CHECK(epoch_of(&w, "denoise-a") != old);
    expect_free(&w, "encode-a", &emb);
    m = expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    CHECK(m && m->epoch == old);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a);
    kiln_tensor_ref emb2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    CHECK(m && m->job.job == a && m->epoch == epoch_of(&w, "denoise-a"));
    /* The old incarnation's done is not the new one's. */
    kiln_msg late = {.type = KILN_MSG_DONE, .epoch = old, .done = {.job = a, .ok = 1}};
    deliver(&w, "denoise-a", &late);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    expect_quiet(&w);
    /* ...nor can it come back: its hello is answered `fenced`, and the new
     * incarnation keeps its job. */
    kiln_msg zombie = {.type = KILN_MSG_HELLO, .epoch = old,
                       .hello = {.stage = KILN_STAGE_DENOISE, .replica = "denoise-a",
                                 .model = "klein-tiny", .host = "test", .max_batch = 4,
                                 .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM),
                                 .domain = one_box}};
    deliver(&w, "denoise-a", &zombie);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    expect_quiet(&w);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 1 && g.inflight[1] == 1);
    /* The same incarnation reconnecting: fenced, its job failed this time
     * (it had its one re-run). */
    kiln_msg same = {.type = KILN_MSG_HELLO, .epoch = epoch_of(&w, "denoise-a"),
                     .hello = {.stage = KILN_STAGE_DENOISE, .replica = "denoise-a",
                               .model = "klein-tiny", .host = "test", .max_batch = 4,
                               .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM),
                               .domain = one_box}};
    deliver(&w, "denoise-a", &same);
    CHECK(w.n_finished == 1 && w.last_status == 503);
    expect_free(&w, "encode-a", &emb2);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    expect_quiet(&w);
    expect_idle(&w);
    world_free(&w);
}

/* A fenced incarnation is announced `gone` to every other live replica,
 * each message addressed to its receiver's incarnation: consumers drop
 * their mappings of its slabs. */
static void test_gone_broadcast(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    w.show_gone = 1;
    uint64_t old = epoch_of(&w, "denoise-a");
    kiln_sched_on_unreachable(w.s, "denoise-a", w.now);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    static const char *const others[] = {"encode-a", "decode-a", "denoise-b"};
    int seen[3] = {0};
    for (int i = 0; i < 3; i++) {
        const char *to;
        kiln_msg *m = next_sent(&w, &to);
        CHECK(m && m->type == KILN_MSG_GONE);
        if (!m || m->type != KILN_MSG_GONE)
            break;
        CHECK(!strcmp(m->gone.replica, "denoise-a") && m->gone.incarnation == old);
        for (int k = 0; k < 3; k++)
            if (!strcmp(to, others[k])) {
                seen[k]++;
                CHECK(m->epoch == epoch_of(&w, others[k]));
            }
    }
    CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1);
    expect_quiet(&w);
    world_free(&w);
}

/* Liveness on progress: a replica whose heartbeats go on but whose
 * backend stands still while it has work is fenced after the progress
 * timeout (3 s here), its job re-run; one that progresses, or stands
 * still without work, is not. */
static void test_progress_stall(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *stuck;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &stuck);
    const char *other = strcmp(stuck, "denoise-a") ? "denoise-a" : "denoise-b";
    for (int i = 0; i < 11; i++) { /* 2.75 s: within the bound */
        w.now += 250;
        hb(&w, "encode-a"), hb(&w, "decode-a"), hb_stuck(&w, other), hb_stuck(&w, stuck);
        kiln_sched_tick(w.s, w.now);
    }
    expect_quiet(&w);
    for (int i = 0; i < 2; i++) {
        w.now += 250;
        hb(&w, "encode-a"), hb(&w, "decode-a"), hb_stuck(&w, other), hb_stuck(&w, stuck);
        kiln_sched_tick(w.s, w.now);
    }
    expect_free(&w, "encode-a", &emb);
    expect_sent(&w, KILN_MSG_FENCED, stuck);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a);
    expect_quiet(&w);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 1); /* the idle one, standing still, is fine */
    /* Its re-run progresses on the other: no fence however long it runs. */
    kiln_tensor_ref emb2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    expect_sent(&w, KILN_MSG_JOB, other);
    advance(&w, 10000, (const char *[]){"encode-a", "decode-a", other, NULL});
    expect_quiet(&w);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[1] == 1 && g.inflight[1] == 1);
    world_free(&w);
}

/* A gateway that did not run for 8 s (SIGSTOP) judges nobody on the tick
 * that comes late: the replicas' heartbeats of those seconds are queued
 * behind it.  After it, silence counts again as usual. */
static void test_gateway_stall(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *den;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &den);
    advance(&w, 1000, (const char *[]){"encode-a", "denoise-a", "decode-a", NULL});
    w.now += 8000; /* the gateway stopped */
    kiln_sched_tick(w.s, w.now);
    expect_quiet(&w);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[0] == 1 && g.replicas[1] == 1 && g.replicas[2] == 1 && g.inflight[1] == 1);
    /* Their queued heartbeats arrive; then the denoiser really goes
     * silent: fenced after the usual 2 s. */
    advance(&w, 1000, (const char *[]){"encode-a", "denoise-a", "decode-a", NULL});
    expect_quiet(&w);
    advance(&w, 1750, (const char *[]){"encode-a", "decode-a", NULL});
    expect_quiet(&w);
    advance(&w, 500, (const char *[]){"encode-a", "decode-a", NULL});
    expect_free(&w, "encode-a", &emb);
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    world_free(&w);
}

/* A replica whose device is lost says bye: fenced at once, its job runs
 * again elsewhere, and its reason stays in the log. */
static void test_bye(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *gone;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &gone);
    kiln_msg bye = {.type = KILN_MSG_BYE, .bye_reason = "device lost: cuda: illegal address"};
    deliver(&w, gone, &bye);
    expect_free(&w, "encode-a", &emb);
    expect_sent(&w, KILN_MSG_FENCED, gone);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == a);
    kiln_tensor_ref emb2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", a, "embeds", &emb2);
    const char *other = strcmp(gone, "denoise-a") ? "denoise-a" : "denoise-b";
    expect_sent(&w, KILN_MSG_JOB, other);
    expect_quiet(&w);
    CHECK(w.n_finished == 0);
    world_free(&w);
}

/* The stages of one process (kiln-stages) share its fate: when one is
 * fenced (here its device is lost), the gateway fences the others at once,
 * so that the job re-run from it cannot land on the encoder of the same
 * dying process (whose own bye comes a moment later and would have spent
 * the job's one re-run: a 503).  Their byes then change nothing.  A stage
 * that leaves gracefully ends alone. */
static void test_process_siblings(void)
{
    world w;
    world_init(&w, 8);
    static const char p[] = "00000000000000aa", q[] = "00000000000000bb";
    hello_of_process(&w, "p-encode", KILN_STAGE_ENCODE, "klein-tiny", 2, p);
    hello_of_process(&w, "p-denoise", KILN_STAGE_DENOISE, "klein-tiny", 2, p);
    hello_of_process(&w, "p-decode", KILN_STAGE_DECODE, "klein-tiny", 2, p);
    /* Process q's stages offer their credits only after p's denoiser is
     * gone, so a re-run the gateway could still place on p's encoder
     * would go there. */
    hello_of_process(&w, "q-encode", KILN_STAGE_ENCODE, "klein-tiny", 0, q);
    hello_of_process(&w, "q-denoise", KILN_STAGE_DENOISE, "klein-tiny", 0, q);
    hello_of_process(&w, "q-decode", KILN_STAGE_DECODE, "klein-tiny", 0, q);
    uint64_t a;
    CHECK(submit(&w, "{\"prompt\":\"a\",\"size\":\"64x64\",\"seed\":3}", &a) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "p-encode");
    kiln_tensor_ref emb = shm_ref(&w, "p-encode", "/kiln-encode-1-0", 64);
    done_with(&w, "p-encode", a, "embeds", &emb);
    expect_sent(&w, KILN_MSG_JOB, "p-denoise");

    kiln_msg bye = {.type = KILN_MSG_BYE, .bye_reason = "device lost: cuda: illegal address"};
    deliver(&w, "p-denoise", &bye);
    int fenced[3] = {0}, jobs_to_p = 0;
    const char *to;
    for (kiln_msg *m; (m = next_sent(&w, &to));) {
        fenced[0] += m->type == KILN_MSG_FENCED && !strcmp(to, "p-encode");
        fenced[1] += m->type == KILN_MSG_FENCED && !strcmp(to, "p-denoise");
        fenced[2] += m->type == KILN_MSG_FENCED && !strcmp(to, "p-decode");
        jobs_to_p += m->type == KILN_MSG_JOB;
    }
    CHECKF(fenced[0] == 1 && fenced[1] == 1 && fenced[2] == 1,
           "fenced sent to p's encoder %d, denoiser %d, decoder %d times", fenced[0], fenced[1],
           fenced[2]);
    CHECKF(jobs_to_p == 0, "the re-run went to a stage of the dying process");
    CHECK(event_count(&w, "replica_lost") == 3 && event_count(&w, "redispatch") == 1);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    for (int st = 0; st < KILN_STAGE_COUNT; st++)
        CHECKF(g.replicas[st] == 1, "stage %d: %d live replicas", st, g.replicas[st]);

    /* The siblings' own byes, sent as their process halted, change
     * nothing: no message back, nothing counted as rejected. */
    double rejected_before = rejected(&w, "fenced");
    deliver(&w, "p-encode", &bye);
    deliver(&w, "p-decode", &bye);
    expect_quiet(&w);
    CHECK(rejected(&w, "fenced") == rejected_before && event_count(&w, "replica_lost") == 3);

    /* Process q takes the job from the start, to its image. */
    kiln_msg ready = {.type = KILN_MSG_READY, .ready.credits = 2};
    deliver(&w, "q-denoise", &ready);
    deliver(&w, "q-decode", &ready);
    deliver(&w, "q-encode", &ready);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "q-encode");
    CHECK(m && m->job.job == a);
    kiln_tensor_ref emb2 = shm_ref(&w, "q-encode", "/kiln-encode-2-0", 64);
    done_with(&w, "q-encode", a, "embeds", &emb2);
    expect_sent(&w, KILN_MSG_JOB, "q-denoise");
    kiln_tensor_ref lat = shm_ref(&w, "q-denoise", "/kiln-denoise-2-0", 0);
    done_with(&w, "q-denoise", a, "latents", &lat);
    expect_free(&w, "q-encode", &emb2);
    expect_sent(&w, KILN_MSG_JOB, "q-decode");
    done_images(&w, "q-decode", a, 1);
    CHECK(w.n_finished == 1 && w.last_status == 200 && w.last_seeds[0] == 3);
    expect_free(&w, "q-denoise", &lat);

    /* q's denoiser leaves gracefully: its siblings stay. */
    kiln_msg leaving = {.type = KILN_MSG_LEAVING}, left = {.type = KILN_MSG_BYE,
                                                          .bye_reason = "left"};
    deliver(&w, "q-denoise", &leaving);
    deliver(&w, "q-denoise", &left);
    expect_quiet(&w);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_ENCODE] == 1 && g.replicas[KILN_STAGE_DECODE] == 1 &&
          g.replicas[KILN_STAGE_DENOISE] == 0 && event_count(&w, "replica_lost") == 3);
    expect_idle(&w);
    world_free(&w);
}

/* A replica that says `leaving` (SIGTERM) gets no job and no credit from
 * then on and no longer counts as live (readiness, admission, placement),
 * while the job it runs finishes there normally; its `bye` afterwards
 * ends it as left (replica_left, no `fenced`, nothing re-run).  One whose
 * drain time runs out gives its job back `unavailable`: the job runs
 * again elsewhere, not 503. */
static void test_leaving(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    uint64_t a, b, c;
    kiln_tensor_ref emb;
    const char *leaver;
    kiln_msg *m = to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\",\"seed\":5}", &a, &emb,
                             &leaver);
    if (!m)
        goto out;
    const char *stayer = strcmp(leaver, "denoise-a") == 0 ? "denoise-b" : "denoise-a";
    kiln_msg leaving = {.type = KILN_MSG_LEAVING};
    deliver(&w, leaver, &leaving);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 1 && g.busy[KILN_STAGE_DENOISE] == 1 &&
          kiln_sched_ready(w.s));
    /* Credits it offers now are void: the next job goes to the other. */
    kiln_msg ready = {.type = KILN_MSG_READY, .ready.credits = 8};
    deliver(&w, leaver, &ready);
    kiln_tensor_ref emb_b;
    const char *to;
    m = to_denoise(&w, "{\"prompt\":\"b\",\"size\":\"64x64\",\"seed\":6}", &b, &emb_b, &to);
    CHECKF(m && !strcmp(to, stayer), "a job went to %s while %s was leaving", to, leaver);
    /* Its job in flight finishes there and goes on to the decoder. */
    kiln_tensor_ref lat = shm_ref(&w, leaver, "/kiln-denoise-7-0", 0);
    done_with(&w, leaver, a, "latents", &lat);
    expect_free(&w, "encode-a", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
    CHECK(m && m->job.job == a);
    done_images(&w, "decode-a", a, 1);
    CHECK(w.n_finished == 1 && w.last_status == 200);
    expect_free(&w, leaver, &lat);
    /* Its done returned no credit either. */
    kiln_tensor_ref emb_c;
    m = to_denoise(&w, "{\"prompt\":\"c\",\"size\":\"64x64\",\"seed\":7}", &c, &emb_c, &to);
    CHECKF(m && !strcmp(to, stayer), "job c went to %s", to);
    kiln_msg bye = {.type = KILN_MSG_BYE, .bye_reason = "left"};
    deliver(&w, leaver, &bye);
    expect_quiet(&w); /* no `fenced`, no job re-run */
    CHECK(event_count(&w, "replica_left") == 1 && event_count(&w, "replica_lost") == 0 &&
          event_count(&w, "redispatch") == 0);
    /* A heartbeat it sent before the gateway read its bye arrives late:
     * ignored, not answered `fenced` (it exits with 0 by itself). */
    double fenced_before = rejected(&w, "fenced");
    kiln_msg hb = {.type = KILN_MSG_HB};
    deliver(&w, leaver, &hb);
    expect_quiet(&w);
    CHECK(rejected(&w, "fenced") == fenced_before);

    /* The last denoiser leaves too: the stage has no live replica (not
     * ready, new requests 503), and its drain time runs out with b and c
     * held: given back, they run again from the encode stage and wait for
     * a denoiser. */
    deliver(&w, stayer, &leaving);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 0 && !kiln_sched_ready(w.s));
    uint64_t d;
    CHECK(submit(&w, "{\"prompt\":\"d\",\"size\":\"64x64\"}", &d) == KILN_ERR_UNAVAILABLE);
    done_error(&w, stayer, b, KILN_ERR_UNAVAILABLE, "replica shutting down");
    expect_free(&w, "encode-a", &emb_b);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == b);
    done_error(&w, stayer, c, KILN_ERR_CANCELLED, "cancelled");
    expect_free(&w, "encode-a", &emb_c);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == c);
    CHECK(w.n_finished == 1 && event_count(&w, "redispatch") == 2);
    deliver(&w, stayer, &bye);
    expect_quiet(&w);
    /* A new denoiser (the restarted one) takes b over. */
    hello(&w, "denoise-c", KILN_STAGE_DENOISE, "klein-tiny", 2);
    kiln_tensor_ref emb_b2 = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 512);
    done_with(&w, "encode-a", b, "embeds", &emb_b2);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-c");
    CHECK(m && m->job.job == b && m->job.denoise.seeds[0] == 6);
    CHECK(event_count(&w, "replica_left") == 2 && event_count(&w, "replica_lost") == 0);
out:
    world_free(&w);
}

/* Messages of `type` to `peer` among those sent since the last look (all
 * of them are looked at). */
static int count_sent(world *w, kiln_msg_type type, const char *peer)
{
    int n = 0;
    const char *to;
    for (kiln_msg *m; (m = next_sent(w, &to));)
        n += m->type == type && !strcmp(to, peer);
    return n;
}

static const char *const all_talk[] = {"encode-a", "denoise-a", "decode-a", NULL};

/* A replica running a job the gateway cancels is busy until its done for
 * it comes (kiln_replicas_busy, kiln_cancelling); one answering within
 * cancel_timeout_ms (5 s here) stays, one that does not is fenced, and a
 * gateway stall does not count towards the bound. */
static void test_cancel_answered_or_fenced(void)
{
    world w;
    world_cancel_ms = 5000;
    world_init(&w, 8);
    world_cancel_ms = 0;
    cluster(&w);
    uint64_t a;
    kiln_tensor_ref emb;
    const char *to;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &to);
    CHECK(!strcmp(to, "denoise-a"));
    kiln_sched_cancel(w.s, a, w.now);
    CHECK(count_sent(&w, KILN_MSG_CANCEL, "denoise-a") == 1);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.jobs == 0 && g.inflight[KILN_STAGE_DENOISE] == 0);
    CHECK(g.busy[KILN_STAGE_DENOISE] == 1 && g.cancelling[KILN_STAGE_DENOISE] == 1);
    CHECK(g.busy[KILN_STAGE_ENCODE] == 0 && g.busy[KILN_STAGE_DECODE] == 0);
    advance(&w, 4500, all_talk);
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") == 0);
    done_error(&w, "denoise-a", a, KILN_ERR_CANCELLED, "request cancelled");
    kiln_sched_gauges(w.s, &g);
    CHECK(g.busy[KILN_STAGE_DENOISE] == 0 && g.cancelling[KILN_STAGE_DENOISE] == 0);
    advance(&w, 10000, all_talk);
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") == 0);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 1);

    /* Never answered: fenced once the timeout has passed, not counting
     * the 8 s the gateway itself did not run. */
    to_denoise(&w, "{\"prompt\":\"b\",\"size\":\"64x64\"}", &a, &emb, &to);
    kiln_sched_cancel(w.s, a, w.now);
    CHECK(count_sent(&w, KILN_MSG_CANCEL, "denoise-a") == 1);
    advance(&w, 2000, all_talk);
    w.now += 8000; /* the gateway stopped */
    kiln_sched_tick(w.s, w.now);
    advance(&w, 2500, all_talk);
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") == 0);
    advance(&w, 1000, all_talk); /* its heartbeats after the fence are answered `fenced` too */
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") >= 1);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 0 && g.busy[KILN_STAGE_DENOISE] == 0 &&
          g.cancelling[KILN_STAGE_DENOISE] == 0);
    kiln_buf text = {0};
    CHECK(kiln_metrics_render(w.metrics, &g, &text, NULL) == KILN_OK);
    kiln_buf_append(&text, "", 1, NULL);
    CHECK(strstr((const char *)text.data, "kiln_events_total{event=\"cancel_timeout\"} 1"));
    CHECK(strstr((const char *)text.data, "kiln_replicas_busy{stage=\"denoise\"} 0"));
    kiln_buf_free(&text);
    world_free(&w);
}

/* A cancelled job batched with a live one is answered when the batch
 * ends (the denoiser stops a batch only when all of it is cancelled):
 * however long the live job runs, progressing, its replica is not fenced;
 * left with only the cancelled job, unanswered, it is, cancel_timeout_ms
 * after the live job's done. */
static void test_cancel_in_live_batch(void)
{
    world w;
    world_cancel_ms = 5000;
    world_init(&w, 8);
    world_cancel_ms = 0;
    cluster(&w);
    uint64_t a, b;
    kiln_tensor_ref emb_a, emb_b;
    const char *to;
    to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb_a, &to);
    CHECK(!strcmp(to, "denoise-a"));
    to_denoise(&w, "{\"prompt\":\"b\",\"size\":\"64x64\"}", &b, &emb_b, &to);
    CHECK(!strcmp(to, "denoise-a"));
    kiln_sched_cancel(w.s, a, w.now);
    CHECK(count_sent(&w, KILN_MSG_CANCEL, "denoise-a") == 1);
    advance(&w, 20000, all_talk); /* four times the bound */
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") == 0);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 1 && g.inflight[KILN_STAGE_DENOISE] == 1 &&
          g.cancelling[KILN_STAGE_DENOISE] == 1 && g.busy[KILN_STAGE_DENOISE] == 1);
    kiln_tensor_ref lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 64);
    done_with(&w, "denoise-a", b, "latents", &lat);
    CHECK(count_sent(&w, KILN_MSG_JOB, "decode-a") == 1);
    advance(&w, 4500, all_talk);
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") == 0);
    advance(&w, 1000, all_talk); /* its heartbeats after the fence are answered `fenced` too */
    CHECK(count_sent(&w, KILN_MSG_FENCED, "denoise-a") >= 1);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[KILN_STAGE_DENOISE] == 0 && g.cancelling[KILN_STAGE_DENOISE] == 0);
    world_free(&w);
}

/* A producer whose /dev/shm has no room for its outputs (hb.shm_short)
 * gets no work while another replica of its stage has room; when none
 * has, requests are refused at once (503, before any stage ran) and the
 * gateway is not ready, until a heartbeat says there is room again. */
static void test_shm_full(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    hello(&w, "denoise-b", KILN_STAGE_DENOISE, "klein-tiny", 2);
    kiln_msg full = {.type = KILN_MSG_HB, .shm_short = 64 << 20};
    deliver(&w, "denoise-a", &full);
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.shm_short[KILN_STAGE_DENOISE] == 1 && kiln_sched_ready(w.s));
    for (int i = 0; i < 2; i++) { /* taking turns, the first would be denoise-a's */
        uint64_t a;
        kiln_tensor_ref emb;
        const char *den;
        to_denoise(&w, "{\"prompt\":\"a\",\"size\":\"64x64\"}", &a, &emb, &den);
        CHECK(den && !strcmp(den, "denoise-b"));
    }
    deliver(&w, "denoise-b", &full);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.shm_short[KILN_STAGE_DENOISE] == 2 && !kiln_sched_ready(w.s));
    uint64_t id;
    CHECK(submit(&w, "{\"prompt\":\"b\",\"size\":\"64x64\"}", &id) == KILN_ERR_UNAVAILABLE);
    expect_quiet(&w);
    kiln_msg room = {.type = KILN_MSG_HB, .shm_short = 0};
    deliver(&w, "denoise-a", &room);
    CHECK(kiln_sched_ready(w.s));
    CHECK(submit(&w, "{\"prompt\":\"c\",\"size\":\"64x64\"}", &id) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    world_free(&w);
}

/* Transport domains (scheduler_pair.c): a consumer that opens the inputs
 * where it is goes first, even with fewer credits; without one, any
 * consumer takes the job and fetches shm inputs from the owner's data
 * socket (src); a producer without a data socket, or cuda_ipc inputs,
 * only go where they open, and a job nobody could ever take fails at
 * once; a producer is told not to make cuda_ipc outputs (outk) when no
 * replica of the next stage could open them. */
static kiln_domain dom(const char *host, const char *shm, uint64_t ipc, int gpu)
{
    kiln_domain d = {.ipc_ns = ipc, .mnt_ns = ipc + 1, .pid_ns = 7, .gpu = -1};
    snprintf(d.host, sizeof d.host, "%s", host);
    snprintf(d.shm, sizeof d.shm, "%s", shm);
    if (gpu >= 0) {
        d.n_gpus = 2, d.gpu = gpu;
        snprintf(d.gpus[0], sizeof d.gpus[0], "GPU-0000");
        snprintf(d.gpus[1], sizeof d.gpus[1], "GPU-1111");
    }
    return d;
}

static void hello_in(world *w, const char *id, kiln_stage st, int credits, kiln_domain d,
                     unsigned transports, const char *data)
{
    kiln_msg m = {.type = KILN_MSG_HELLO, .epoch = new_epoch(w, id),
                  .hello = {.stage = st, .replica = id, .model = "klein-tiny", .host = "test",
                            .max_batch = 4, .transports = transports, .domain = d,
                            .data = data, .data_key = ""}};
    deliver(w, id, &m);
    if (credits) {
        kiln_msg r = {.type = KILN_MSG_READY, .ready.credits = credits};
        deliver(w, id, &r);
    }
}

static void test_domains(void)
{
    const unsigned host = KILN_TRANSPORT_BIT(KILN_REF_INLINE) | KILN_TRANSPORT_BIT(KILN_REF_SHM);
    const unsigned gpu = host | KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC);
    world w;
    world_init(&w, 8);
    hello_in(&w, "encode-a", KILN_STAGE_ENCODE, 4, dom("boot-a", "27:1", 100, -1), host,
             "tcp://pod-a:7001");
    hello_in(&w, "denoise-a", KILN_STAGE_DENOISE, 0, dom("boot-a", "27:1", 100, -1), host, "");
    hello_in(&w, "denoise-b", KILN_STAGE_DENOISE, 3, dom("boot-b", "27:1", 100, -1), host, "");
    hello_in(&w, "decode-a", KILN_STAGE_DECODE, 4, dom("boot-a", "27:1", 100, -1), host, "");
    /* The local denoiser is busy: the other machine's fetches by value. */
    uint64_t id;
    CHECK(submit(&w, "{\"prompt\":\"p\",\"size\":\"64x64\"}", &id) == KILN_OK);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.out_kinds == host); /* no consumer opens cuda_ipc */
    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-a", id, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-b");
    CHECK(m && m->job.n_src == 1 && !strcmp(m->job.src[0].owner, "encode-a") &&
          !strcmp(m->job.src[0].endpoint, "tcp://pod-a:7001"));
    /* Once the local one has a credit it goes first, with fewer credits. */
    kiln_msg r = {.type = KILN_MSG_READY, .ready.credits = 1};
    deliver(&w, "denoise-a", &r);
    uint64_t id2;
    CHECK(submit(&w, "{\"prompt\":\"q\",\"size\":\"64x64\"}", &id2) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-a", id2, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    CHECK(m && m->job.n_src == 0);
    /* Another /dev/shm on the same kernel is another domain too. */
    CHECK(!kiln_domain_can_open(KILN_REF_SHM, &(kiln_domain){.host = "k", .shm = "1:1"},
                                &(kiln_domain){.host = "k", .shm = "2:1"}, host));
    world_free(&w);

    /* A producer without a data socket: only its own domain can take its
     * outputs; with no consumer there at all, the job fails at once. */
    world_init(&w, 8);
    hello_in(&w, "encode-c", KILN_STAGE_ENCODE, 4, dom("boot-c", "27:1", 100, -1), host, "");
    hello_in(&w, "denoise-b", KILN_STAGE_DENOISE, 3, dom("boot-b", "27:1", 100, -1), host, "");
    hello_in(&w, "decode-b", KILN_STAGE_DECODE, 3, dom("boot-b", "27:1", 100, -1), host, "");
    CHECK(submit(&w, "{\"prompt\":\"p\",\"size\":\"64x64\"}", &id) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-c");
    emb = shm_ref(&w, "encode-c", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-c", id, "embeds", &emb);
    CHECK(w.n_finished == 1 && w.last_status == 503);
    m = expect_sent(&w, KILN_MSG_FREE, "encode-c"); /* its range goes back */
    expect_quiet(&w);
    world_free(&w);

    /* cuda_ipc: a denoiser is told to make it only when a decoder that
     * sees its GPU shares its IPC and PID namespaces; its cuda_ipc
     * latents never go to a CPU decoder or one in another IPC namespace. */
    world_init(&w, 8);
    hello_in(&w, "encode-g", KILN_STAGE_ENCODE, 4, dom("boot-g", "27:1", 100, 0), gpu, "");
    hello_in(&w, "denoise-g", KILN_STAGE_DENOISE, 4, dom("boot-g", "27:1", 100, 1), gpu, "");
    hello_in(&w, "decode-cpu", KILN_STAGE_DECODE, 4, dom("boot-g", "27:1", 100, -1), host, "");
    hello_in(&w, "decode-ns", KILN_STAGE_DECODE, 4, dom("boot-g", "27:1", 200, 1), gpu, "");
    CHECK(submit(&w, "{\"prompt\":\"p\",\"size\":\"64x64\"}", &id) == KILN_OK);
    m = expect_sent(&w, KILN_MSG_JOB, "encode-g");
    CHECK(m && m->job.out_kinds == gpu); /* denoise-g sees GPU 0 in the same namespaces */
    emb = shm_ref(&w, "encode-g", "/kiln-encode-1-0", 0);
    done_with(&w, "encode-g", id, "embeds", &emb);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-g");
    CHECK(m && m->job.out_kinds == host); /* no decoder shares its IPC namespace and GPU */
    hello_in(&w, "decode-g", KILN_STAGE_DECODE, 1, dom("boot-g", "27:1", 100, 1), gpu, "");
    uint64_t id3;
    CHECK(submit(&w, "{\"prompt\":\"r\",\"size\":\"64x64\"}", &id3) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-g");
    kiln_tensor_ref emb3 = shm_ref(&w, "encode-g", "/kiln-encode-1-0", 256);
    done_with(&w, "encode-g", id3, "embeds", &emb3);
    m = expect_sent(&w, KILN_MSG_JOB, "denoise-g");
    CHECK(m && (m->job.out_kinds & KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC)));
    kiln_tensor_ref lat = shm_ref(&w, "denoise-g", "/kiln-cuda-denoise-1-0-64", 0);
    lat.kind = KILN_REF_CUDA_IPC, lat.device = 1;
    done_with(&w, "denoise-g", id3, "latents", &lat);
    expect_free(&w, "encode-g", &emb3); /* the inputs it did not release */
    expect_sent(&w, KILN_MSG_JOB, "decode-g"); /* not the CPU one with more credits */
    /* decode-g is now out of credits: the next cuda_ipc latents wait for
     * it rather than going to a decoder that cannot open them. */
    lat = shm_ref(&w, "denoise-g", "/kiln-cuda-denoise-1-0-64", 256);
    lat.kind = KILN_REF_CUDA_IPC, lat.device = 1;
    done_with(&w, "denoise-g", id, "latents", &lat);
    expect_free(&w, "encode-g", &emb);
    expect_quiet(&w);
    CHECK(w.n_finished == 0);
    r = (kiln_msg){.type = KILN_MSG_READY, .ready.credits = 1};
    deliver(&w, "decode-g", &r);
    expect_sent(&w, KILN_MSG_JOB, "decode-g");
    world_free(&w);
}

/* A done carrying the timings a replica reports (names[i] = vals[i]). */
static void done_timed(world *w, const char *from, uint64_t job, const char *name,
                       const kiln_tensor_ref *ref, int n_images, const char *const *names,
                       const double *vals, int n)
{
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_DONE;
    m->done.job = job;
    m->done.ok = 1;
    if (ref)
        kiln_ref_map_put(&m->done.out, name, ref, NULL);
    m->done.n_images = n_images;
    for (int i = 0; i < n_images; i++)
        m->done.images[i] = (kiln_bytes){(const uint8_t *)"img", 3};
    for (int i = 0; i < n; i++)
        m->done.ms[m->done.n_ms++] = (kiln_timing){names[i], vals[i]};
    deliver(w, from, m);
    free(m);
}

static const kiln_trace_span *trace_span(const kiln_trace *t, const char *name, int k)
{
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->span[i].name, name) && k-- == 0)
            return &t->span[i];
    return NULL;
}

/* The replicas' timings become the trace's spans: the device times (CUDA
 * events) of the text encoder, the denoise setup and steps and the VAE
 * ride on them (args.gpu_ms in the JSON), and the denoise steps are the
 * ones the replica ran (an img2img job runs fewer than it asked for). */
static void test_trace_device_times(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w);
    uint64_t id;
    CHECK(submit(&w, "{\"prompt\":\"a cat\",\"size\":\"64x64\",\"num_inference_steps\":4}",
                 &id) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    w.now += 30;
    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
    const char *en[] = {"queue", "run", "text_encode", "gpu_text_encode"};
    done_timed(&w, "encode-a", id, "embeds", &emb, 0, en, (double[]){2, 20, 12, 9.5}, 4);
    expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    w.now += 100;
    kiln_tensor_ref lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 0);
    const char *dn[] = {"queue", "run", "setup", "step", "steps", "gpu_setup", "gpu_step"};
    done_timed(&w, "denoise-a", id, "latents", &lat, 0, dn, (double[]){1, 90, 10, 40, 2, 4, 37.5},
               7);
    expect_free(&w, "encode-a", &emb);
    expect_sent(&w, KILN_MSG_JOB, "decode-a");
    w.now += 50;
    const char *cn[] = {"queue", "run", "vae", "image_encode", "gpu_vae"};
    done_timed(&w, "decode-a", id, NULL, NULL, 1, cn, (double[]){1, 40, 30, 8, 28.25}, 5);
    CHECK(w.n_finished == 1 && w.last_status == 200);
    const kiln_trace *t = &w.last_trace;
    const kiln_trace_span *text = trace_span(t, "encode: text encoder", 0);
    const kiln_trace_span *run = trace_span(t, "encode: run", 0);
    CHECK(text && run && text->t0 >= run->t0 && text->t1 <= run->t1 && text->gpu_ms == 9.5);
    const kiln_trace_span *setup = trace_span(t, "denoise: setup", 0);
    CHECK(setup && setup->gpu_ms == 4 && setup->t1 - setup->t0 == 10);
    CHECK(trace_span(t, "denoise: step", 1) && !trace_span(t, "denoise: step", 2));
    for (int k = 0; k < 2; k++) {
        const kiln_trace_span *st = trace_span(t, "denoise: step", k);
        CHECK(st && st->gpu_ms == 37.5 && st->t1 - st->t0 == 40 &&
              st->t0 == setup->t1 + 40 * k);
    }
    const kiln_trace_span *vae = trace_span(t, "decode: vae", 0);
    CHECK(vae && vae->gpu_ms == 28.25);
    /* what no device time was measured for carries none */
    CHECK(trace_span(t, "decode: image encode", 0) &&
          trace_span(t, "decode: image encode", 0)->gpu_ms < 0);
    CHECK(run->gpu_ms < 0 && trace_span(t, "denoise", 0) && trace_span(t, "denoise", 0)->gpu_ms < 0);
    /* in the JSON: args.gpu_ms on those spans alone */
    kiln_err err = {0};
    kiln_traces *store = kiln_traces_create(2, &err);
    CHECK(store != NULL);
    kiln_buf json = {0};
    if (store) {
        kiln_traces_put(store, "req_t", 200, t);
        CHECK(kiln_traces_json(store, "req_t", &json, &err) == KILN_OK &&
              kiln_buf_append(&json, "", 1, &err) == KILN_OK); /* a C string */
        const char *js = json.data ? (const char *)json.data : "";
        const char *want[] = {"\"name\":\"denoise: step\"", "\"name\":\"denoise: setup\"",
                              "\"name\":\"decode: vae\"", "\"name\":\"encode: text encoder\""};
        const char *gpu[] = {"{\"gpu_ms\":37.500}", "{\"gpu_ms\":4.000}", "{\"gpu_ms\":28.250}",
                             "{\"gpu_ms\":9.500}"};
        for (int i = 0; i < 4; i++) {
            const char *at = strstr(js, want[i]), *end = at ? strchr(at, '}') : NULL;
            const char *args = at ? strstr(at, "\"args\":") : NULL;
            CHECKF(at && args && end && args < end && !strncmp(args + 7, gpu[i], strlen(gpu[i])),
                   "%s without %s", want[i], gpu[i]);
        }
        const char *img = strstr(js, "\"name\":\"decode: image encode\"");
        const char *close = img ? strchr(img, '}') : NULL, *args = img ? strstr(img, "\"args\"") : NULL;
        CHECK(img && close && (!args || args > close));
        kiln_buf_free(&json);
        kiln_traces_destroy(store);
    }
    world_free(&w);
}

/* The model's traits come from the first replica's hello; a replica of the
 * same model name announcing other traits is refused, and they stay. */
static void test_traits(void)
{
    world w;
    world_init(&w, 8);
    kiln_model_traits t;
    CHECK(!kiln_sched_traits(w.s, &t));
    hello(&w, "encode-z", KILN_STAGE_ENCODE, "other-model", 2); /* refused: no traits taken */
    CHECK(!kiln_sched_traits(w.s, &t));
    kiln_model_traits zimage = {.family = "zimage", .cfg = 1, .cfg_above_zero = 1,
                                .no_references = 1, .img2img_strength = 0.6, .inpaint_strength = 1.0, .default_steps = 9, .text_width = 2560,
                                .latent_channels = 64};
    kiln_msg m = {.type = KILN_MSG_HELLO, .epoch = new_epoch(&w, "denoise-z"),
                  .hello = {.stage = KILN_STAGE_DENOISE, .replica = "denoise-z",
                            .model = "klein-tiny", .host = "test", .max_batch = 4,
                            .transports = KILN_TRANSPORT_BIT(KILN_REF_SHM), .domain = one_box,
                            .traits = zimage}};
    deliver(&w, "denoise-z", &m);
    CHECK(kiln_sched_traits(w.s, &t) && kiln_model_traits_equal(&t, &zimage));
    CHECK(!strcmp(t.family, "zimage") && t.default_steps == 9 && t.default_guidance == 0.0f);
    hello(&w, "encode-a", KILN_STAGE_ENCODE, "klein-tiny", 2); /* tiny's traits: refused */
    kiln_metrics_gauges g;
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[0] == 0 && g.replicas[1] == 1);
    m.epoch = new_epoch(&w, "encode-b");
    m.hello.replica = "encode-b", m.hello.stage = KILN_STAGE_ENCODE;
    deliver(&w, "encode-b", &m);
    kiln_sched_gauges(w.s, &g);
    CHECK(g.replicas[0] == 1);
    CHECK(kiln_sched_traits(w.s, &t) && kiln_model_traits_equal(&t, &zimage));
    world_free(&w);
}

static void partial(world *w, const char *from, uint64_t job, int index,
                    const kiln_tensor_ref *ref)
{
    kiln_msg m = {.type = KILN_MSG_PARTIAL, .done = {.job = job, .ok = 1, .preview = index}};
    kiln_ref_map_put(&m.done.out, "latents", ref, NULL);
    deliver(w, from, &m);
}

/* The preview job just sent to decode-a for latents `ref` (its id). */
static uint64_t preview_sent(world *w, uint64_t request, const kiln_tensor_ref *ref)
{
    kiln_msg *m = expect_sent(w, KILN_MSG_JOB, "decode-a");
    const kiln_tensor_ref *in = m ? kiln_ref_map_get(&m->job.in, "latents") : NULL;
    CHECK(m && m->job.job != request && m->job.stage == KILN_STAGE_DECODE && in &&
          in->gen == ref->gen && m->job.decode.width == 64);
    return m ? m->job.job : 0;
}

/* A decode done from `from` for job `id` whose rows are files[], those
 * with by_ref[row] set handed as the references refs[row] (the others
 * inline, in order). */
static void done_files(world *w, const char *from, uint64_t id, int n, const char *const *files,
                       const int *by_ref, const kiln_tensor_ref *refs)
{
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_DONE;
    m->done = (kiln_msg_done){.job = id, .ok = 1};
    for (int row = 0; row < n; row++) {
        char name[KILN_PROTO_TENSOR_NAME_MAX];
        kiln_image_ref_name(row, name);
        if (by_ref[row])
            CHECK(kiln_ref_map_put(&m->done.out, name, &refs[row], NULL) == KILN_OK);
        else
            m->done.images[m->done.n_images++] =
                (kiln_bytes){(const uint8_t *)files[row], strlen(files[row])};
    }
    deliver(w, from, m);
    free(m);
}

/* File `text` in a new range of the decoder's pool tx. */
static kiln_tensor_ref file_ref(kiln_transport *tx, const char *text)
{
    kiln_tensor_ref r;
    void *p;
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){(int64_t)strlen(text)}, &r, &p, NULL) ==
          KILN_OK);
    memcpy(p, text, strlen(text));
    return r;
}

static double via(world *w, const char *how)
{
    return metric_sample(w, "kiln_image_handoffs_total{via=\"%s\"}", how);
}

/* A world whose gateway reads image references (*rx, in one_box's
 * domain); returns decode-a's pool of image files. */
static kiln_transport *image_world(world *w, kiln_transport **rx)
{
    kiln_err err = {0};
    *rx = kiln_transport_shm_create("gateway", 1, "gateway", 0, 0, &err);
    CHECK(*rx != NULL);
    world_images = *rx, world_domain = &one_box;
    world_init(w, 8);
    world_images = NULL, world_domain = NULL;
    cluster(w);
    kiln_transport *tx = kiln_transport_shm_create("decode-a", epoch_of(w, "decode-a"), "decode",
                                                   1 << 20, 0, &err);
    CHECK(tx != NULL);
    return tx;
}

/* Images by reference (scheduler_images.c): a decoder the gateway can
 * reach through /dev/shm is asked for its files in its shm pool; the
 * gateway answers with exactly their bytes, rows in order (by reference
 * or inline, each on its own), and frees every range at once.  A range
 * freed before the gateway read it (the decoder died, or reused it) runs
 * the request again once, then 503, never answered with those bytes; a
 * reference that was never valid (a wrong name, length or offset, one
 * the gateway did not ask for) fails the request; a decoder elsewhere, or
 * a gateway without a reader, gets inline files. */
static void test_image_refs(void)
{
    kiln_transport *rx;
    world w;
    kiln_transport *tx = image_world(&w, &rx);
    if (!rx || !tx)
        goto out;
    uint64_t id;
    kiln_tensor_ref lat;
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\",\"n\":3}", &id) == KILN_OK);
    expect_sent(&w, KILN_MSG_JOB, "encode-a");
    kiln_tensor_ref emb = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 64);
    done_with(&w, "encode-a", id, "embeds", &emb);
    expect_sent(&w, KILN_MSG_JOB, "denoise-a");
    lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 64);
    done_with(&w, "denoise-a", id, "latents", &lat);
    expect_free(&w, "encode-a", &emb);
    kiln_msg *m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
    CHECK(m && m->job.decode.image_kinds == KILN_TRANSPORT_BIT(KILN_REF_SHM));
    /* Rows 0 and 2 by reference, row 1 inline. */
    static const char *const files[] = {"first png", "second", "third file"};
    kiln_tensor_ref refs[3] = {file_ref(tx, files[0]), {0}, file_ref(tx, files[2])};
    for (int i = 0; i < 3; i++)
        w.want_images[i] = files[i];
    done_files(&w, "decode-a", id, 3, files, (const int[]){1, 0, 1}, refs);
    CHECK(w.n_finished == 1 && w.last_status == 200 && w.last_images == 3);
    expect_free(&w, "denoise-a", &lat);
    kiln_msg *f = expect_sent(&w, KILN_MSG_FREE, "decode-a");
    CHECK(f && f->refs.n == 2 && f->epoch == epoch_of(&w, "decode-a"));
    for (int i = 0; f && i < f->refs.n; i++)
        CHECK(kiln_transport_free(tx, &f->refs.refs[i], NULL) == KILN_OK);
    kiln_transport_stats st;
    kiln_transport_stats_get(tx, &st);
    CHECK(st.live == 0);
    kiln_transport_stats_get(rx, &st);
    CHECK(st.open == 0 && st.mapped == 1 && st.slabs == 0);
    CHECK(via(&w, "shm") == 2 && via(&w, "inline") == 1 && via(&w, "failed") == 0);
    expect_quiet(&w);

    /* Gone before the gateway read it: once more from the encode stage,
     * then 503; no answer ever carries the bytes now in that range. */
    memset(w.want_images, 0, sizeof w.want_images);
    CHECK(submit(&w, "{\"prompt\":\"y\",\"size\":\"64x64\"}", &id) == KILN_OK);
    for (int round = 0; round < 2; round++) {
        to_decode(&w, id, &lat);
        kiln_tensor_ref stale = file_ref(tx, "img");
        CHECK(kiln_transport_free(tx, &stale, NULL) == KILN_OK);
        kiln_tensor_ref other = file_ref(tx, "someone else's"); /* the same range, reused */
        CHECK(other.off == stale.off && other.gen != stale.gen);
        done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){1}, &stale);
        expect_free(&w, "denoise-a", &lat);
        expect_free(&w, "decode-a", &stale);
        CHECK(kiln_transport_free(tx, &stale, NULL) == KILN_ERR_INVALID);
        CHECK(kiln_transport_free(tx, &other, NULL) == KILN_OK);
        CHECK(w.n_finished == 1 + round);
    }
    CHECK(w.last_status == 503 && via(&w, "failed") == 2 && event_count(&w, "redispatch") == 1);
    expect_quiet(&w);

    /* Never valid: the request fails (500), the range goes back. */
    kiln_tensor_ref good = file_ref(tx, "img"), bad[4] = {good, good, good, good};
    bad[0].len = bad[0].shape[0] = 2;             /* not the allocation's length: gone */
    bad[1].off = (1 << 20) + 64;                  /* outside its slab */
    bad[2].dtype = KILN_F32, bad[2].len *= 4;     /* not bytes */
    snprintf(bad[3].owner, sizeof bad[3].owner, "denoise-a"); /* another's */
    static const int want[] = {503, 500, 500, 0};
    for (int k = 0; k < 4; k++) {
        CHECK(submit(&w, "{\"prompt\":\"z\",\"size\":\"64x64\"}", &id) == KILN_OK);
        to_decode(&w, id, &lat);
        int before = w.n_finished;
        done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){1}, &bad[k]);
        if (k == 0) { /* restarted once, then the same again */
            expect_free(&w, "denoise-a", &lat);
            expect_free(&w, "decode-a", &bad[k]);
            to_decode(&w, id, &lat);
            done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){1},
                       &bad[k]);
        }
        if (k == 3) { /* decode-a is fenced, the job runs again */
            CHECK(w.n_finished == before && rejected(&w, "foreign_ref") == 1);
            break;
        }
        CHECKF(w.n_finished == before + 1 && w.last_status == want[k], "case %d: status %d", k,
               w.last_status);
        expect_free(&w, "denoise-a", &lat);
        kiln_msg *fr = expect_sent(&w, KILN_MSG_FREE, "decode-a");
        CHECK(fr && fr->refs.n == 1 && fr->refs.refs[0].gen == good.gen);
        expect_quiet(&w);
    }
    kiln_transport_stats_get(rx, &st);
    CHECK(st.open == 0);
    world_free(&w);

    /* A decoder whose /dev/shm the gateway cannot open (another machine,
     * another pod), or a gateway without a reader: inline, and references
     * it did not ask for fail the request. */
    kiln_domain elsewhere = dom("boot-2", "27:1", 1, -1);
    world_images = rx, world_domain = &elsewhere;
    world_init(&w, 8);
    world_images = NULL, world_domain = NULL;
    cluster(&w);
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
    m = to_decode(&w, id, &lat);
    CHECK(m && m->job.decode.image_kinds == 0);
    done_images(&w, "decode-a", id, 1);
    CHECK(w.last_status == 200 && via(&w, "inline") == 1);
    world_free(&w);
    world_init(&w, 8);
    cluster(&w);
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
    to_decode(&w, id, &lat);
    kiln_tensor_ref unasked = file_ref(tx, "img");
    done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){1}, &unasked);
    CHECK(w.n_finished == 1 && w.last_status == 500 && via(&w, "failed") == 1);
    world_free(&w);
out:
    kiln_transport_destroy(tx);
    kiln_transport_destroy(rx);
}

/* A decoder whose slab the gateway finds but cannot map (another user's
 * 0600 files; here an empty file, which mmap refuses): the request runs
 * again once and that decoder is asked for inline files from then on,
 * rather than every request failing twice. */
static void test_image_refs_unmappable(void)
{
    kiln_transport *rx;
    world w;
    kiln_transport *tx = image_world(&w, &rx);
    char empty[64];
    snprintf(empty, sizeof empty, "/kiln-test-unmappable-%ld", (long)getpid());
    int fd = shm_open(empty, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    CHECK(rx && tx && fd >= 0);
    if (fd >= 0)
        close(fd);
    if (!rx || !tx || fd < 0)
        goto out;
    uint64_t id, id2;
    kiln_tensor_ref lat, lat2;
    CHECK(submit(&w, "{\"prompt\":\"x\",\"size\":\"64x64\"}", &id) == KILN_OK);
    to_decode(&w, id, &lat);
    kiln_tensor_ref bad = file_ref(tx, "img");
    snprintf(bad.slab, sizeof bad.slab, "%s", empty);
    done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){1}, &bad);
    CHECK(w.n_finished == 0 && via(&w, "failed") == 1);
    expect_free(&w, "denoise-a", &lat);
    expect_free(&w, "decode-a", &bad);
    /* Once more from the encode stage: this dispatch asks for inline. */
    kiln_msg *m = to_decode(&w, id, &lat2);
    CHECK(m && m->job.decode.image_kinds == 0);
    w.want_images[0] = "img";
    done_files(&w, "decode-a", id, 1, (const char *const[]){"img"}, (const int[]){0}, NULL);
    CHECK(w.n_finished == 1 && w.last_status == 200 && via(&w, "inline") == 1);
    expect_free(&w, "denoise-a", &lat2);
    expect_quiet(&w);
    /* A later request: inline from the start. */
    CHECK(submit(&w, "{\"prompt\":\"y\",\"size\":\"64x64\"}", &id2) == KILN_OK);
    m = to_decode(&w, id2, &lat2);
    CHECK(m && m->job.decode.image_kinds == 0);
    world_free(&w);
out:
    if (fd >= 0)
        shm_unlink(empty);
    kiln_transport_destroy(tx);
    kiln_transport_destroy(rx);
}

static void test_previews(void)
{
    world w;
    world_init(&w, 8);
    cluster(&w); /* decode-a: 2 credits */
    uint64_t id;
    kiln_tensor_ref emb;
    const char *to;
    kiln_msg *m = to_denoise(&w, "{\"prompt\":\"x\",\"size\":\"64x64\",\"stream\":true,"
                                 "\"partial_images\":3}", &id, &emb, &to);
    CHECK(m && m->job.denoise.previews == 3);
    kiln_tensor_ref p0 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 0);
    kiln_tensor_ref p1 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 128);
    kiln_tensor_ref p2 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 256);
    kiln_tensor_ref again = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 384);
    partial(&w, "denoise-a", id, 0, &p0);
    uint64_t j0 = preview_sent(&w, id, &p0);
    partial(&w, "denoise-a", id, 1, &p1);
    uint64_t j1 = preview_sent(&w, id, &p1);
    partial(&w, "denoise-a", id, 2, &p2); /* no credit left: it waits */
    expect_quiet(&w);
    /* the final latents: the queued preview goes, the final decode waits */
    kiln_tensor_ref lat = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 512);
    done_with(&w, "denoise-a", id, "latents", &lat);
    expect_free(&w, "encode-a", &emb);
    expect_free(&w, "denoise-a", &p2);
    expect_quiet(&w);
    /* preview 0 answered: sent; its credit goes to the final decode */
    done_images(&w, "decode-a", j0, 1);
    CHECK(w.n_partials == 1 && w.partials[0] == 0);
    expect_free(&w, "denoise-a", &p0);
    m = expect_sent(&w, KILN_MSG_JOB, "decode-a");
    CHECK(m && m->job.job == id);
    /* a late partial (the request is past its denoise stage) is freed */
    partial(&w, "denoise-a", id, 2, &again);
    expect_free(&w, "denoise-a", &again);
    /* the final images wait for preview 1, still decoding */
    done_images(&w, "decode-a", id, 1);
    expect_free(&w, "denoise-a", &lat);
    CHECK(w.n_finished == 0);
    done_images(&w, "decode-a", j1, 1);
    expect_free(&w, "denoise-a", &p1);
    CHECK(w.n_finished == 1 && w.last_status == 200 && w.n_partials == 2 &&
          w.partials[1] == 1 && w.finished_after == 2);
    expect_quiet(&w);
    expect_idle(&w);

    /* Out of order: preview 1 answered before 0, which is then stale. */
    w.n_finished = w.n_partials = 0;
    m = to_denoise(&w, "{\"prompt\":\"y\",\"size\":\"64x64\",\"stream\":true,"
                       "\"partial_images\":2}", &id, &emb, &to);
    p0 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 0);
    p1 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 128);
    partial(&w, "denoise-a", id, 0, &p0);
    j0 = preview_sent(&w, id, &p0);
    partial(&w, "denoise-a", id, 1, &p1);
    j1 = preview_sent(&w, id, &p1);
    done_images(&w, "decode-a", j1, 1);
    expect_free(&w, "denoise-a", &p1);
    done_images(&w, "decode-a", j0, 1);
    expect_free(&w, "denoise-a", &p0);
    CHECK(w.n_partials == 1 && w.partials[0] == 1);
    /* The client goes: its preview still decoding is cancelled too. */
    partial(&w, "denoise-a", id, 1, &again); /* stale: freed */
    expect_free(&w, "denoise-a", &again);
    kiln_tensor_ref p3 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 640);
    CHECK(w.n_partials == 1);
    kiln_sched_cancel(w.s, id, w.now);
    expect_sent(&w, KILN_MSG_CANCEL, "denoise-a");
    expect_quiet(&w);
    done_error(&w, "denoise-a", id, KILN_ERR_CANCELLED, "request cancelled");
    expect_free(&w, "encode-a", &emb);
    expect_idle(&w);

    /* A request that does not stream asks for none, and a partial for it
     * is freed at once. */
    m = to_denoise(&w, "{\"prompt\":\"z\",\"size\":\"64x64\",\"partial_images\":2}", &id,
                   &emb, &to);
    CHECK(m && m->job.denoise.previews == 0);
    partial(&w, "denoise-a", id, 0, &p3);
    expect_free(&w, "denoise-a", &p3);
    expect_quiet(&w);
    kiln_sched_cancel(w.s, id, w.now);
    expect_sent(&w, KILN_MSG_CANCEL, "denoise-a");
    done_error(&w, "denoise-a", id, KILN_ERR_CANCELLED, "request cancelled");
    expect_free(&w, "encode-a", &emb);
    expect_idle(&w);

    /* Cancelled while a preview decodes: the decoder is told as well. */
    m = to_denoise(&w, "{\"prompt\":\"w\",\"size\":\"64x64\",\"stream\":true,"
                       "\"partial_images\":1}", &id, &emb, &to);
    p0 = shm_ref(&w, "denoise-a", "/kiln-denoise-1-0", 0);
    partial(&w, "denoise-a", id, 0, &p0);
    j0 = preview_sent(&w, id, &p0);
    kiln_sched_cancel(w.s, id, w.now);
    const char *peers[2] = {NULL, NULL};
    kiln_msg *c1 = next_sent(&w, &peers[0]), *c2 = next_sent(&w, &peers[1]);
    CHECK(c1 && c2 && c1->type == KILN_MSG_CANCEL && c2->type == KILN_MSG_CANCEL);
    CHECK(c1 && c2 && ((c1->cancel_job == id && c2->cancel_job == j0) ||
                       (c1->cancel_job == j0 && c2->cancel_job == id)));
    done_error(&w, "decode-a", j0, KILN_ERR_CANCELLED, "request cancelled");
    expect_free(&w, "denoise-a", &p0);
    done_error(&w, "denoise-a", id, KILN_ERR_CANCELLED, "request cancelled");
    expect_free(&w, "encode-a", &emb);
    CHECK(w.n_partials == 1 && w.n_finished == 0);
    expect_idle(&w);

    /* A preview naming references its sender did not make: refused, the
     * sender fenced, nothing shown, and the job runs again from the start
     * (as for such a done, test_forged_releases). */
    w.n_partials = 0;
    m = to_denoise(&w, "{\"prompt\":\"v\",\"size\":\"64x64\",\"stream\":true,"
                       "\"partial_images\":1}", &id, &emb, &to);
    kiln_tensor_ref theirs = shm_ref(&w, "encode-a", "/kiln-encode-1-0", 256);
    partial(&w, "denoise-a", id, 0, &theirs);
    CHECK(rejected(&w, "foreign_ref") == 1);
    expect_free(&w, "encode-a", &emb); /* its embeddings: the re-run encodes again */
    expect_sent(&w, KILN_MSG_FENCED, "denoise-a");
    m = expect_sent(&w, KILN_MSG_JOB, "encode-a");
    CHECK(m && m->job.job == id);
    expect_quiet(&w);
    CHECK(w.n_partials == 0 && w.n_finished == 0);
    world_free(&w);
}

int main(void)
{
    RUN(test_traits);
    RUN(test_flow);
    RUN(test_previews);
    RUN(test_bye);
    RUN(test_process_siblings);
    RUN(test_leaving);
    RUN(test_progress_stall);
    RUN(test_gateway_stall);
    RUN(test_gone_broadcast);
    RUN(test_credits_and_admission);
    RUN(test_idle_replicas_take_turns);
    RUN(test_inputs_gone);
    RUN(test_cancel_between_stages);
    RUN(test_replica_loss);
    RUN(test_restart_after_release);
    RUN(test_errors_and_timeout);
    RUN(test_forged_releases);
    RUN(test_hello_again);
    RUN(test_cancel_answered_or_fenced);
    RUN(test_cancel_in_live_batch);
    RUN(test_domains);
    RUN(test_shm_full);
    RUN(test_trace_device_times);
    RUN(test_image_refs);
    RUN(test_image_refs_unmappable);
    return test_finish();
}

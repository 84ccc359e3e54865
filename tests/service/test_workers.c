/* The stage workers end to end without a gateway: this test binds the bus
 * ROUTER itself, plays the gateway's part (dispatch, forwarding `release`
 * as `free`), drives real kiln-encoder / kiln-denoiser / kiln-decoder
 * processes on the tiny oracle checkpoints, and checks that:
 * - the PNGs are byte-identical to `kiln generate` / `kiln edit` for the
 *   same request and seed (t2i with n = 2, an edit, a base checkpoint with
 *   CFG and a negative prompt);
 * - two requests batched together give the same bytes as alone;
 * - heartbeats keep coming during a long denoise, and cancel stops it;
 * - malformed messages and bad references fail one job, not the worker;
 * - messages for another incarnation (epoch) are dropped, and `fenced`
 *   makes a worker exit with 75, leaving no slab;
 * - SIGTERM stops every worker cleanly and their shm slabs are gone;
 * - SIGTERM during a long denoise: the denoiser says `leaving`, keeps
 *   running its job, and when its --drain-s runs out stops it at the next
 *   op and gives it back with the job that came meanwhile (both
 *   `unavailable`: the gateway runs them elsewhere), says `bye` ("left")
 *   and exits with 0, no slab left. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/bus.h"
#include "common/log.h"
#include "tests/run_util.h"
#include "tests/test.h"

#define TIMEOUT_MS 120000.0

static const char *build_root, *shared;
/* --drain-s for the denoisers start() spawns (NULL: the default). */
static const char *denoiser_drain;
static char tmpdir[256];

typedef struct cluster {
    kiln_bus *bus;
    pid_t pid[KILN_STAGE_COUNT];
    char id[KILN_STAGE_COUNT][KILN_PROTO_ID_MAX];
    uint64_t epoch[KILN_STAGE_COUNT];
    int credits[KILN_STAGE_COUNT];
    double last_hb[KILN_STAGE_COUNT], max_hb_gap[KILN_STAGE_COUNT];
    uint64_t next_job;
    /* Dones read while waiting for another job's, kept for their turn. */
    kiln_msg *unclaimed[8];
    int n_unclaimed;
} cluster;

static int stage_of(const cluster *c, const char *peer)
{
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        if (!strcmp(c->id[s], peer))
            return s;
    return -1;
}

/* Sends m to the replica of `stage`, addressed to its incarnation. */
static void send_to(cluster *c, int stage, kiln_msg *m)
{
    kiln_err err = {0};
    m->epoch = c->epoch[stage];
    CHECKF(kiln_bus_send_msg(c->bus, c->id[stage], m, &err) == KILN_OK, "%s", err.msg);
}

/* Receives until a message of `want` type arrives (NULL on timeout),
 * doing the gateway's chores on the way: hello, ready, hb bookkeeping and
 * release -> free forwarding. */
static kiln_msg *wait_for(cluster *c, kiln_msg_type want, char *peer, double timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    kiln_buf f = {0};
    kiln_msg *found = NULL;
    char from[KILN_PROTO_ID_MAX];
    while (!found && kiln_now_ms() < until) {
        kiln_err err = {0};
        int ev = kiln_bus_wait(c->bus, -1, 50, &err);
        CHECK(ev >= 0);
        int rc;
        while (!found && (rc = kiln_bus_recv(c->bus, from, sizeof from, &f, &err)) != 0) {
            CHECKF(rc > 0, "%s", err.msg);
            if (rc < 0)
                break;
            kiln_msg *m = kiln_msg_decode(f.data, f.len, &err);
            CHECKF(m != NULL, "worker sent a malformed message: %s", err.msg);
            if (!m)
                continue;
            int s = stage_of(c, from);
            if (m->type == KILN_MSG_HELLO) {
                s = m->hello.stage;
                snprintf(c->id[s], sizeof c->id[s], "%s", m->hello.replica);
                c->epoch[s] = m->epoch;
                CHECK(!strcmp(m->hello.replica, from));
                CHECK(m->hello.transports & KILN_TRANSPORT_BIT(KILN_REF_SHM));
                c->last_hb[s] = kiln_now_ms();
            } else if (m->type == KILN_MSG_READY && s >= 0) {
                c->credits[s] += m->ready.credits;
            } else if (m->type == KILN_MSG_HB && s >= 0) {
                double now = kiln_now_ms();
                if (c->last_hb[s] > 0 && now - c->last_hb[s] > c->max_hb_gap[s])
                    c->max_hb_gap[s] = now - c->last_hb[s];
                c->last_hb[s] = now;
            } else if (m->type == KILN_MSG_RELEASE) {
                /* The gateway's job: hand each range back to its owner. */
                for (int i = 0; i < m->refs.n; i++) {
                    kiln_msg fr = {.type = KILN_MSG_FREE, .refs = {.n = 1}};
                    fr.refs.refs[0] = m->refs.refs[i];
                    int owner = stage_of(c, m->refs.refs[i].owner);
                    /* Only the test's dangling reference has no owner. */
                    CHECK(owner >= 0 || strstr(m->refs.refs[i].owner, "nowhere"));
                    CHECK(m->epoch == c->epoch[s]);
                    if (owner >= 0) {
                        CHECK(m->refs.refs[i].epoch == c->epoch[owner]);
                        send_to(c, owner, &fr);
                    }
                }
            }
            if (m->type == want) {
                found = m;
                if (peer)
                    snprintf(peer, KILN_PROTO_ID_MAX, "%s", from);
            } else {
                kiln_msg_free(m);
            }
        }
    }
    kiln_buf_free(&f);
    return found;
}

static pid_t spawn(const char *const argv[])
{
    pid_t pid = fork();
    if (pid == 0) {
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    return pid;
}

static int run_wait(const char *const argv[])
{
    pid_t pid = spawn(argv);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int registered(const cluster *c)
{
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        if (!c->id[s][0] || !c->credits[s])
            return 0;
    return 1;
}

/* A cluster that failed to start: its workers are killed, not left to
 * run into the next test. */
static void abandon(cluster *c)
{
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        if (c->pid[s] > 0) {
            kill(c->pid[s], SIGKILL);
            waitpid(c->pid[s], NULL, 0);
        }
    kiln_bus_close(c->bus);
}

static int start(cluster *c, const char *model, const char *layers, const char *endpoint)
{
    memset(c, 0, sizeof *c);
    c->next_job = 1;
    kiln_err err = {0};
    c->bus = kiln_bus_bind(endpoint, 0, NULL, &err);
    CHECKF(c->bus != NULL, "%s", err.msg);
    if (!c->bus)
        return -1;
    static const char *const bins[] = {"kiln-encoder", "kiln-denoiser", "kiln-decoder"};
    for (int s = 0; s < KILN_STAGE_COUNT; s++) {
        char exe[512];
        snprintf(exe, sizeof exe, "%s/services/%s", build_root, bins[s]);
        /* Jobs sent back to back land well inside a 50 ms window, so the
         * batch test batches on a loaded machine too. */
        const char *argv[] = {exe, "--model", model, "--bus", endpoint, "--max-batch", "4",
                              "--batch-window-ms", "50", NULL, NULL, NULL};
        if (s == KILN_STAGE_ENCODE)
            argv[9] = "--text-encoder-out-layers", argv[10] = layers;
        if (s == KILN_STAGE_DENOISE && denoiser_drain)
            argv[9] = "--drain-s", argv[10] = denoiser_drain;
        c->pid[s] = spawn(argv);
        CHECK(c->pid[s] > 0);
    }
    /* Registered means a hello and a ready from each. wait_for does that
     * bookkeeping for any message it reads, so the test waits on the state
     * itself: a hello read at the end of one wait can have its ready read
     * in the next, and no further hello need ever come. */
    double until = kiln_now_ms() + TIMEOUT_MS;
    while (!registered(c)) {
        if (kiln_now_ms() >= until) {
            CHECKF(0, "workers did not register within %.0f s", TIMEOUT_MS / 1000);
            abandon(c);
            return -1;
        }
        kiln_msg_free(wait_for(c, KILN_MSG_DONE, NULL, 20)); /* no job yet: none comes */
    }
    return 0;
}

static int slabs_of(pid_t pid)
{
    char needle[32];
    snprintf(needle, sizeof needle, "-%ld-", (long)pid);
    int n = 0;
    DIR *d = opendir("/dev/shm");
    for (struct dirent *e; d && (e = readdir(d));)
        n += !strncmp(e->d_name, "kiln-", 5) && strstr(e->d_name, needle) != NULL;
    if (d)
        closedir(d);
    return n;
}

static void stop(cluster *c)
{
    /* Each done returned the credit of its job; `ready` only announced the
     * capacity (2 x --max-batch) at registration. */
    double until = kiln_now_ms() + 200;
    while (kiln_now_ms() < until)
        kiln_msg_free(wait_for(c, KILN_MSG_DONE, NULL, 20));
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        CHECKF(c->credits[s] == 8, "stage %d announced %d credits with ready, want 8", s,
               c->credits[s]);
    CHECKF(c->n_unclaimed == 0, "%d done(s) for jobs nobody waited for", c->n_unclaimed);
    while (c->n_unclaimed)
        kiln_msg_free(c->unclaimed[--c->n_unclaimed]);
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        if (c->pid[s] > 0)
            kill(c->pid[s], SIGTERM);
    for (int s = 0; s < KILN_STAGE_COUNT; s++) {
        if (c->pid[s] <= 0)
            continue;
        int status = 0;
        CHECK(waitpid(c->pid[s], &status, 0) == c->pid[s]);
        CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "stage %d exit status %d", s, status);
        CHECKF(slabs_of(c->pid[s]) == 0, "stage %d left shm slabs behind", s);
    }
    kiln_bus_close(c->bus);
}

typedef struct request {
    const char *prompt, *negative;
    int n, width, height, steps, max_seq;
    float guidance;
    uint64_t seed;
    const char *ref_path; /* edit */
} request;

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(n > 0 ? (size_t)n : 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

/* `kiln generate` / `kiln edit` for the request into tmpdir/<name>.png. */
static int cli_reference(const request *q, const char *model, const char *layers,
                         const char *name)
{
    char kiln[512], out[512], seed[32], n[16], w[16], h[16], steps[16], seq[16], g[32];
    snprintf(kiln, sizeof kiln, "%s/tools/kiln", build_root);
    snprintf(out, sizeof out, "%s/%s.png", tmpdir, name);
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)q->seed);
    snprintf(n, sizeof n, "%d", q->n), snprintf(w, sizeof w, "%d", q->width);
    snprintf(h, sizeof h, "%d", q->height), snprintf(steps, sizeof steps, "%d", q->steps);
    snprintf(seq, sizeof seq, "%d", q->max_seq), snprintf(g, sizeof g, "%.9g", q->guidance);
    const char *argv[32] = {kiln, q->ref_path ? "edit" : "generate", "--model", model,
                            "--prompt", q->prompt, "--out", out, "--seed", seed, "-n", n,
                            "--width", w, "--height", h, "--steps", steps,
                            "--max-sequence-length", seq, "--guidance", g,
                            "--text-encoder-out-layers", layers,
                            "--no-metadata"}; /* the workers' PNGs carry no text chunks */
    int k = 25;
    if (q->negative)
        argv[k++] = "--negative-prompt", argv[k++] = q->negative;
    if (q->ref_path)
        argv[k++] = "--image", argv[k++] = q->ref_path;
    return run_wait(argv);
}

static int reference_matches(const char *name, int i, int total, const kiln_bytes *img)
{
    char path[600];
    if (total == 1)
        snprintf(path, sizeof path, "%s/%s.png", tmpdir, name);
    else
        snprintf(path, sizeof path, "%s/%s-%d.png", tmpdir, name, i);
    size_t len = 0;
    uint8_t *ref = read_file(path, &len);
    int same = ref && len == img->len && !memcmp(ref, img->data, len);
    if (ref && !same)
        fprintf(stderr, "%s: service image differs (%zu vs %zu bytes)\n", path, img->len, len);
    free(ref);
    return same;
}

static kiln_msg *new_job(cluster *c, kiln_stage stage)
{
    kiln_msg *m = calloc(1, sizeof *m);
    m->type = KILN_MSG_JOB;
    m->job.stage = stage;
    m->job.job = c->next_job++;
    return m;
}

/* The done of `job`, whichever order the stages answer in (a decode can
 * finish before the denoise of a request sent with it). */
static kiln_msg *wait_done(cluster *c, uint64_t job)
{
    kiln_msg *d = NULL;
    for (int i = 0; i < c->n_unclaimed && !d; i++)
        if (c->unclaimed[i]->done.job == job) {
            d = c->unclaimed[i];
            c->unclaimed[i] = c->unclaimed[--c->n_unclaimed];
        }
    for (double until = kiln_now_ms() + TIMEOUT_MS; !d && kiln_now_ms() < until;) {
        kiln_msg *m = wait_for(c, KILN_MSG_DONE, NULL, until - kiln_now_ms());
        if (m && m->done.job == job)
            d = m;
        else if (m && c->n_unclaimed < (int)(sizeof c->unclaimed / sizeof c->unclaimed[0]))
            c->unclaimed[c->n_unclaimed++] = m;
        else if (m) {
            CHECKF(0, "done for job %llu unclaimed", (unsigned long long)m->done.job);
            kiln_msg_free(m);
        }
    }
    CHECKF(d != NULL, "no done for job %llu", (unsigned long long)job);
    if (d && !d->done.ok)
        fprintf(stderr, "job %llu failed: %s\n", (unsigned long long)job, d->done.message);
    return d;
}

typedef struct ref_file {
    uint8_t *data;
    size_t len;
} ref_file;

static kiln_msg *encode_job(cluster *c, const request *q, ref_file *rf)
{
    kiln_msg *m = new_job(c, KILN_STAGE_ENCODE);
    m->job.encode = (kiln_job_encode){.n_prompts = 1, .prompts = {q->prompt},
                                      .negative = q->negative, .max_seq = q->max_seq};
    if (q->ref_path) {
        rf->data = read_file(q->ref_path, &rf->len);
        CHECK(rf->data != NULL);
        m->job.encode.n_refs = 1;
        m->job.encode.refs[0] = (kiln_bytes){rf->data, rf->len};
    }
    return m;
}

static kiln_msg *denoise_job(cluster *c, const request *q, const kiln_msg *enc_done)
{
    kiln_msg *m = new_job(c, KILN_STAGE_DENOISE);
    kiln_job_denoise *d = &m->job.denoise;
    *d = (kiln_job_denoise){.n = q->n, .n_seeds = q->n, .width = q->width, .height = q->height,
                            .steps = q->steps, .guidance = q->guidance};
    for (int i = 0; i < q->n; i++)
        d->seeds[i] = q->seed + (uint64_t)i;
    m->job.in = enc_done->done.out;
    return m;
}

static kiln_msg *decode_job(cluster *c, const request *q, const kiln_msg *den_done)
{
    kiln_msg *m = new_job(c, KILN_STAGE_DECODE);
    m->job.decode = (kiln_job_decode){.width = q->width, .height = q->height,
                                      .format = KILN_IMAGE_PNG, .compression = 0};
    m->job.in = den_done->done.out;
    return m;
}

/* Runs several requests through the three stages, each stage's jobs sent
 * back to back (so they may batch), and compares with the CLI files. */
static void run_requests(cluster *c, const request *qs, const char *const *names, int n)
{
    kiln_msg *enc[4], *den[4], *dec[4];
    ref_file rf[4] = {{0}};
    for (int i = 0; i < n; i++)
        enc[i] = encode_job(c, &qs[i], &rf[i]), send_to(c, KILN_STAGE_ENCODE, enc[i]);
    kiln_msg *ed[4], *dd[4], *cd[4];
    for (int i = 0; i < n; i++)
        ed[i] = wait_done(c, enc[i]->job.job);
    for (int i = 0; i < n; i++) {
        CHECK(ed[i] && ed[i]->done.ok && kiln_ref_map_get(&ed[i]->done.out, "embeds"));
        if (!ed[i] || !ed[i]->done.ok)
            return;
        CHECK(!qs[i].ref_path == !kiln_ref_map_get(&ed[i]->done.out, "ref_tokens"));
        CHECK(!qs[i].negative == !kiln_ref_map_get(&ed[i]->done.out, "neg"));
        den[i] = denoise_job(c, &qs[i], ed[i]);
        send_to(c, KILN_STAGE_DENOISE, den[i]);
    }
    double t_done[4] = {0}, run_ms[4] = {0}, batch_rows[4] = {0};
    for (int i = 0; i < n; i++) {
        dd[i] = wait_done(c, den[i]->job.job);
        t_done[i] = kiln_now_ms();
        for (int k = 0; dd[i] && k < dd[i]->done.n_ms; k++) {
            if (!strcmp(dd[i]->done.ms[k].name, "run"))
                run_ms[i] = dd[i]->done.ms[k].ms;
            if (!strcmp(dd[i]->done.ms[k].name, "batch_rows"))
                batch_rows[i] = dd[i]->done.ms[k].ms;
        }
        CHECKF(batch_rows[i] >= qs[i].n, "denoise done reports batch_rows %g for a job of %d rows",
               batch_rows[i], qs[i].n);
        if (!dd[i] || !dd[i]->done.ok)
            return;
        const kiln_tensor_ref *lat = kiln_ref_map_get(&dd[i]->done.out, "latents");
        CHECK(lat && lat->kind == KILN_REF_SHM && lat->shape[0] == qs[i].n);
        dec[i] = decode_job(c, &qs[i], dd[i]);
        send_to(c, KILN_STAGE_DECODE, dec[i]);
    }
    /* Batched: the second request finished with the first, not one run
     * later. */
    if (n == 2 && run_ms[0] > 0)
        CHECKF(t_done[1] - t_done[0] < run_ms[0] / 2, "denoise jobs were not batched (%.0f ms apart, "
               "run %.0f ms)", t_done[1] - t_done[0], run_ms[0]);
    if (n == 2)
        CHECKF(batch_rows[0] == qs[0].n + qs[1].n && batch_rows[1] == batch_rows[0],
               "batched denoise jobs report batch_rows %g and %g, want %d", batch_rows[0],
               batch_rows[1], qs[0].n + qs[1].n);
    for (int i = 0; i < n; i++) {
        cd[i] = wait_done(c, dec[i]->job.job);
        CHECK(cd[i] && cd[i]->done.ok && cd[i]->done.n_images == qs[i].n);
        for (int k = 0; cd[i] && k < cd[i]->done.n_images; k++)
            CHECKF(reference_matches(names[i], k, qs[i].n, &cd[i]->done.images[k]),
                   "%s image %d", names[i], k);
    }
    for (int i = 0; i < n; i++) {
        kiln_msg_free(ed[i]), kiln_msg_free(dd[i]), kiln_msg_free(cd[i]);
        free(enc[i]), free(den[i]), free(dec[i]);
        free(rf[i].data);
    }
}

static void test_klein_distilled(void)
{
    char model[512], endpoint[300];
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-tiny", shared);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/bus", tmpdir);
    const char *layers = "1,2,3";
    request t2i = {.prompt = "a red cube on a table", .n = 2, .width = 64, .height = 64,
                   .steps = 2, .max_seq = 32, .guidance = 1.0f, .seed = 42};
    request other = {.prompt = "ein blauer Ball", .n = 1, .width = 64, .height = 64, .steps = 2,
                     .max_seq = 32, .guidance = 1.0f, .seed = 7};
    char ref_path[300];
    snprintf(ref_path, sizeof ref_path, "%s/t2i-0.png", tmpdir);
    request edit = {.prompt = "make it green", .n = 1, .width = 64, .height = 64, .steps = 2,
                    .max_seq = 32, .guidance = 1.0f, .seed = 3, .ref_path = ref_path};
    CHECK(cli_reference(&t2i, model, layers, "t2i") == 0);
    CHECK(cli_reference(&other, model, layers, "other") == 0);
    CHECK(cli_reference(&edit, model, layers, "edit") == 0);

    cluster c;
    if (start(&c, model, layers, endpoint))
        return;
    /* One request alone, then two that batch, then an edit. */
    run_requests(&c, &t2i, (const char *[]){"t2i"}, 1);
    run_requests(&c, (request[]){t2i, other}, (const char *[]){"t2i", "other"}, 2);
    run_requests(&c, &edit, (const char *[]){"edit"}, 1);

    /* A long denoise: heartbeats keep coming, cancel stops it. */
    request slow = t2i;
    slow.steps = 1000, slow.n = 1;
    ref_file rf = {0};
    kiln_msg *e = encode_job(&c, &slow, &rf);
    send_to(&c, KILN_STAGE_ENCODE, e);
    kiln_msg *ed = wait_done(&c, e->job.job);
    if (ed && ed->done.ok) {
        kiln_msg *d = denoise_job(&c, &slow, ed);
        send_to(&c, KILN_STAGE_DENOISE, d);
        c.max_hb_gap[KILN_STAGE_DENOISE] = 0;
        kiln_msg *early = wait_for(&c, KILN_MSG_DONE, NULL, 1500);
        CHECKF(early == NULL, "a 1000-step denoise answered within 1.5 s");
        kiln_msg_free(early);
        kiln_msg cancel = {.type = KILN_MSG_CANCEL, .cancel_job = d->job.job};
        double t0 = kiln_now_ms();
        send_to(&c, KILN_STAGE_DENOISE, &cancel);
        kiln_msg *dd = wait_done(&c, d->job.job);
        CHECK(dd && !dd->done.ok && dd->done.code == KILN_ERR_CANCELLED);
        CHECKF(kiln_now_ms() - t0 < 5000, "cancel took %.0f ms", kiln_now_ms() - t0);
        /* Within the gateway's default --heartbeat-timeout-ms (2000), as
         * this test receives them. */
        CHECKF(c.max_hb_gap[KILN_STAGE_DENOISE] > 0 && c.max_hb_gap[KILN_STAGE_DENOISE] < 2000,
               "heartbeat gap %.0f ms during a long job", c.max_hb_gap[KILN_STAGE_DENOISE]);
        kiln_msg_free(dd);
        free(d);
    }
    kiln_msg_free(ed);
    free(e);

    /* Garbage, a job for the wrong stage and a dangling reference each
     * cost one answer, never the worker. */
    static const uint8_t junk[] = {0xc1, 0xff, 0x00};
    kiln_err err = {0};
    CHECK(kiln_bus_send(c.bus, c.id[KILN_STAGE_DECODE], junk, sizeof junk, &err) == KILN_OK);
    kiln_msg *wrong = new_job(&c, KILN_STAGE_ENCODE);
    wrong->job.encode = (kiln_job_encode){.n_prompts = 1, .prompts = {"x"}, .max_seq = 8};
    send_to(&c, KILN_STAGE_DECODE, wrong);
    kiln_msg *wd = wait_done(&c, wrong->job.job);
    CHECK(wd && !wd->done.ok && wd->done.code == KILN_ERR_INVALID);
    kiln_msg *dangling = new_job(&c, KILN_STAGE_DECODE);
    dangling->job.decode = (kiln_job_decode){.width = 64, .height = 64, .format = KILN_IMAGE_PNG};
    kiln_tensor_ref r = {.kind = KILN_REF_SHM, .dtype = KILN_F32, .ndim = 3, .shape = {1, 16, 32},
                         .len = 16 * 32 * 4};
    snprintf(r.owner, sizeof r.owner, "denoise-nowhere-1");
    snprintf(r.slab, sizeof r.slab, "/kiln-denoise-999999999-0");
    r.epoch = 1, r.gen = 1, r.off = 64;
    kiln_ref_map_put(&dangling->job.in, "latents", &r, NULL);
    send_to(&c, KILN_STAGE_DECODE, dangling);
    kiln_msg *dg = wait_done(&c, dangling->job.job);
    CHECK(dg && !dg->done.ok && dg->done.code == KILN_ERR_NOT_FOUND);
    kiln_msg_free(wd), kiln_msg_free(dg);
    free(wrong), free(dangling);
    /* ...and the pipeline still produces the same bytes afterwards. */
    run_requests(&c, &other, (const char *[]){"other"}, 1);
    stop(&c);
}

/* A base checkpoint: CFG with the negative prompt repeated on every row. */
static void test_klein_base_cfg(void)
{
    char model[512], endpoint[300];
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-base-tiny", shared);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/bus-base", tmpdir);
    const char *layers = "1,2,3";
    request q = {.prompt = "a lighthouse", .negative = "blurry", .n = 2, .width = 64,
                 .height = 64, .steps = 2, .max_seq = 32, .guidance = 4.0f, .seed = 11};
    CHECK(cli_reference(&q, model, layers, "cfg") == 0);
    cluster c;
    if (start(&c, model, layers, endpoint))
        return;
    run_requests(&c, &q, (const char *[]){"cfg"}, 1);
    stop(&c);
}

/* The exit status of child `pid` within timeout_ms, or -1. */
static int wait_exit(pid_t pid, double timeout_ms)
{
    double until = kiln_now_ms() + timeout_ms;
    while (kiln_now_ms() < until) {
        int status = 0;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (r < 0)
            return -1;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return -1;
}

/* Messages for another incarnation of a replica id are not its own: a job
 * addressed to another epoch is dropped unanswered, a `fenced` for
 * another epoch is ignored; `fenced` for its own makes it stop, answer
 * nothing more and exit with 75 (restart me), its slabs gone. */
static void test_fenced_worker(void)
{
    char model[512], endpoint[300];
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-tiny", shared);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/bus-fence", tmpdir);
    cluster c;
    if (start(&c, model, "1,2,3", endpoint))
        return;
    request q = {.prompt = "fenced", .n = 1, .width = 64, .height = 64, .steps = 1, .max_seq = 16,
                 .guidance = 1.0f, .seed = 1};
    ref_file rf = {0};
    kiln_msg *e = encode_job(&c, &q, &rf);
    kiln_err err = {0};
    e->epoch = c.epoch[KILN_STAGE_ENCODE] ^ 1;
    CHECK(kiln_bus_send_msg(c.bus, c.id[KILN_STAGE_ENCODE], e, &err) == KILN_OK);
    kiln_msg *d = wait_for(&c, KILN_MSG_DONE, NULL, 1500);
    CHECKF(d == NULL, "a job for another epoch was answered");
    kiln_msg_free(d);
    send_to(&c, KILN_STAGE_ENCODE, e);
    d = wait_done(&c, e->job.job);
    CHECK(d && d->done.ok && d->epoch == c.epoch[KILN_STAGE_ENCODE]);
    if (d) {
        kiln_msg fr = {.type = KILN_MSG_FREE};
        for (int i = 0; i < d->done.out.n; i++)
            if (d->done.out.items[i].ref.kind == KILN_REF_SHM)
                fr.refs.refs[fr.refs.n++] = d->done.out.items[i].ref;
        if (fr.refs.n)
            send_to(&c, KILN_STAGE_ENCODE, &fr);
    }
    kiln_msg_free(d);
    free(e);
    kiln_msg fenced = {.type = KILN_MSG_FENCED, .epoch = c.epoch[KILN_STAGE_ENCODE] ^ 1};
    CHECK(kiln_bus_send_msg(c.bus, c.id[KILN_STAGE_ENCODE], &fenced, &err) == KILN_OK);
    pid_t enc = c.pid[KILN_STAGE_ENCODE];
    CHECKF(wait_exit(enc, 1000) == -1, "the encoder exited on a fenced for another epoch");
    send_to(&c, KILN_STAGE_ENCODE, &fenced);
    int st = wait_exit(enc, 20000);
    CHECKF(st == 75, "a fenced encoder exited with %d, want 75", st);
    CHECKF(slabs_of(enc) == 0, "the fenced encoder left shm slabs behind");
    c.pid[KILN_STAGE_ENCODE] = -1;
    stop(&c);
}

/* A denoiser with --drain-s 2 gets SIGTERM in the middle of a long job. */
static void test_leave_drain_out(void)
{
    char model[512], endpoint[300];
    snprintf(model, sizeof model, "%s/oracle/ckpt/klein-tiny", shared);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/bus-leave", tmpdir);
    cluster c;
    denoiser_drain = "2";
    int rc = start(&c, model, "1,2,3", endpoint);
    denoiser_drain = NULL;
    if (rc)
        return;
    request slow = {.prompt = "leaving", .n = 1, .width = 128, .height = 128, .steps = 1000,
                    .max_seq = 16, .guidance = 1.0f, .seed = 9};
    ref_file rf = {0};
    kiln_msg *e = encode_job(&c, &slow, &rf);
    send_to(&c, KILN_STAGE_ENCODE, e);
    kiln_msg *ed = wait_done(&c, e->job.job);
    CHECK(ed && ed->done.ok);
    pid_t den = c.pid[KILN_STAGE_DENOISE];
    if (ed && ed->done.ok) {
        kiln_msg *d = denoise_job(&c, &slow, ed);
        send_to(&c, KILN_STAGE_DENOISE, d);
        kiln_msg *early = wait_for(&c, KILN_MSG_DONE, NULL, 500);
        CHECKF(early == NULL, "a 1000-step denoise answered within 0.5 s");
        kiln_msg_free(early);
        double t0 = kiln_now_ms();
        kill(den, SIGTERM);
        char from[KILN_PROTO_ID_MAX] = "";
        kiln_msg *l = wait_for(&c, KILN_MSG_LEAVING, from, 5000);
        CHECKF(l && !strcmp(from, c.id[KILN_STAGE_DENOISE]), "no `leaving` from the denoiser");
        kiln_msg_free(l);
        /* A job the gateway sent before hearing it: held, then given back. */
        kiln_msg *d2 = denoise_job(&c, &slow, ed);
        send_to(&c, KILN_STAGE_DENOISE, d2);
        /* Nothing back before the drain time; the window ends short of it,
         * counted from the signal, so a late reader cannot mistake the
         * drain's answers for early ones. */
        kiln_msg *dd = NULL;
        double quiet_ms = t0 + 1500 - kiln_now_ms();
        if (quiet_ms > 0)
            dd = wait_for(&c, KILN_MSG_DONE, NULL, quiet_ms);
        CHECKF(dd == NULL, "the leaving denoiser answered job %llu before its drain time",
               dd ? (unsigned long long)dd->done.job : 0ull);
        kiln_msg_free(dd);
        int stopped = 0, given_back = 0;
        for (int i = 0; i < 2; i++) {
            dd = wait_for(&c, KILN_MSG_DONE, NULL, 30000);
            CHECK(dd && !dd->done.ok && dd->done.code == KILN_ERR_UNAVAILABLE);
            stopped += dd && dd->done.job == d->job.job;
            given_back += dd && dd->done.job == d2->job.job;
            kiln_msg_free(dd);
        }
        double ms = kiln_now_ms() - t0;
        CHECKF(stopped == 1 && given_back == 1, "after the drain: running job back %d, queued "
               "job back %d", stopped, given_back);
        CHECKF(ms >= 1900 && ms < 15000, "the jobs came back %.0f ms after SIGTERM (--drain-s 2)",
               ms);
        kiln_msg *bye = wait_for(&c, KILN_MSG_BYE, from, 30000);
        CHECKF(bye && !strcmp(bye->bye_reason, "left"), "no bye (left) from the denoiser");
        kiln_msg_free(bye);
        free(d), free(d2);
    }
    int st = wait_exit(den, 30000);
    CHECKF(st == 0, "the leaving denoiser exited with %d", st);
    CHECKF(slabs_of(den) == 0, "the leaving denoiser left shm slabs behind");
    c.pid[KILN_STAGE_DENOISE] = -1;
    kiln_msg_free(ed);
    free(e);
    stop(&c);
}

/* Bad option values are refused before anything loads (exit 2), naming the
 * option, including an option the stage does not have (for kiln-stages:
 * that none of the stages it runs has). */
static void test_bad_options(void)
{
    static const struct {
        const char *bin, *opt, *val, *stages;
    } cases[] = {
        {"kiln-encoder", "--prompt-cache-mb", "-1"},
        {"kiln-encoder", "--prompt-cache-mb", "1048577"},
        {"kiln-encoder", "--prompt-cache-mb", "lots"},
        {"kiln-denoiser", "--prompt-cache-mb", "8"},
        {"kiln-decoder", "--batch-window-ms", "1001"},
        {"kiln-denoiser", "--vae-band-above", "1"},
        {"kiln-decoder", "--vae-band-above", "-0.5"},
        {"kiln-encoder", "--vae-band-above", "lots"},
        {"kiln-decoder", "--vae-band-rows", "0"},
        {"kiln-encoder", "--vae-band-rows", "65537"},
        {"kiln-decoder", "--image-threads", "0"},
        {"kiln-decoder", "--image-threads", "65"},
        {"kiln-encoder", "--image-threads", "2"},
        {"kiln-stages", "--image-threads", "2", "encode,denoise"},
        {"kiln-stages", "--stages", "encode,encode"},
        {"kiln-stages", "--stages", "encode,render"},
        {"kiln-stages", "--stages", ""},
        {"kiln-denoiser", "--stages", "denoise"},
        {"kiln-stages", "--prompt-cache-mb", "8", "denoise,decode"},
        {"kiln-stages", "--precision", "fp8", "encode"},
        {"kiln-stages", "--vae-band-rows", "64", "denoise"},
        {"kiln-stages", "--data-port", "65535", "encode,denoise"},
        {"kiln-stages", "--data-port", "65535"},
        /* 120 characters: no room for -denoise in a replica id (127 at most) */
        {"kiln-stages", "--replica-id",
         "pod-0123456789012345678901234567890123456789012345678901234567890123456789012345678901"
         "2345678901234567890123456789012345"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char exe[512], log[4096];
        snprintf(exe, sizeof exe, "%s/services/%s", build_root, cases[i].bin);
        const char *argv[] = {NULL, "--model", "/nonexistent", "--bus", "ipc:///nonexistent",
                              cases[i].opt, cases[i].val,
                              cases[i].stages ? "--stages" : NULL, cases[i].stages, NULL};
        int rc = test_run(exe, argv, log, sizeof log);
        CHECKF(rc == 2 && strstr(log, cases[i].opt), "%s %s %s: exit %d: %s", cases[i].bin,
               cases[i].opt, cases[i].val, rc, log);
    }
}

int main(void)
{
    /* The workers' OpenMP teams would compete with the other tests that
     * meson runs beside this one (and delay the heartbeats it times). */
    setenv("OMP_NUM_THREADS", "1", 1);
    build_root = getenv("KILN_BUILD_ROOT");
    shared = getenv("KILN_SHARED");
    if (!build_root || !shared) {
        fprintf(stderr, "KILN_BUILD_ROOT and KILN_SHARED must be set (meson test sets them)\n");
        return 1;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln-test-workers-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_bad_options);
    RUN(test_klein_distilled);
    RUN(test_klein_base_cfg);
    RUN(test_fenced_worker);
    RUN(test_leave_drain_out);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd))
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return test_finish();
}

/* The service with several replicas per stage: `kiln serve --encoders 2
 * --denoisers 2 --decoders 2` on the tiny klein checkpoint (CPU backend),
 * driven over HTTP.  Checks that
 * - every replica registers (kiln_replicas is 2 for each stage) and
 *   /readyz is ready;
 * - an HTTP generation (n = 2) and an HTTP edit return PNG bytes identical
 *   to `kiln generate` / `kiln edit` for the same request and seed;
 * - 13 concurrent mixed requests (sizes, steps, n, edits; one connection
 *   each) all succeed with images byte-identical to the CLI's for their
 *   seeds and, for one request per kind, to the same request sent alone
 *   afterwards (batch invariance: some denoise batches held several
 *   requests);
 * - the work was spread: every replica of every stage ran batches (their
 *   debug logs), and the gateway's kiln_batch_rows histograms add up to
 *   exactly the batches the replicas logged (the `batch_rows` they report);
 * - SIGTERM stops kiln serve and all its children with status 0, leaving
 *   no slab of theirs in /dev/shm. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "services/gateway/base64.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

static int port;
static pid_t serve;
static const char *serve_log;
static kiln_buf ref_png; /* an edit reference: image 0 of the first generation */

static const char *const serve_env[] = {
    "KILN_LOG=debug", /* the replicas log each batch they run */
    "OMP_NUM_THREADS=1", /* 7 processes on a 2-core CI machine: no spinning thread teams */
    NULL,
};

/* ---- requests ---- */

/* The concurrent requests come in groups sharing prompt, size and steps,
 * with consecutive seeds: one `kiln generate -n` (or `kiln edit -n`) of a
 * group gives the images of all its requests, since image i of a run uses
 * seed + i drawn alone.  64x64 mostly: the VAE decode of bigger images is
 * what costs time in the sanitizer build. */
typedef struct group {
    const char *prompt;
    int edit, w, h, steps;
    uint64_t seed; /* the first; the group's images use seed .. seed + images - 1 */
    int images;
} group;

typedef struct req {
    int group, n;
    uint64_t seed;
} req;

static const group groups[] = {
    {"mixed a", 0, 64, 64, 1, 300, 8}, {"mixed b", 0, 128, 64, 1, 400, 2},
    {"mixed c", 0, 64, 128, 2, 500, 3}, {"mixed d", 0, 128, 128, 2, 600, 1},
    {"mixed e", 1, 64, 64, 1, 700, 3},
};
#define N_GROUPS ((int)(sizeof groups / sizeof groups[0]))

static const req mixed[] = {
    {0, 1, 300}, {0, 1, 301}, {0, 2, 302}, {0, 1, 304}, {0, 1, 305}, {0, 2, 306}, {1, 1, 400},
    {1, 1, 401}, {2, 1, 500},  {2, 2, 501}, {3, 1, 600}, {4, 1, 700}, {4, 2, 701},
};
#define N_MIXED ((int)(sizeof mixed / sizeof mixed[0]))

/* The JSON body of a request (edits carry ref_png as base64). */
static void body_of(const req *q, kiln_buf *out)
{
    const group *g = &groups[q->group];
    char head[512];
    snprintf(head, sizeof head,
             "{\"prompt\":\"%s\",\"size\":\"%dx%d\",\"seed\":%llu,\"n\":%d,"
             "\"num_inference_steps\":%d,\"max_sequence_length\":32%s",
             g->prompt, g->w, g->h, (unsigned long long)q->seed, q->n, g->steps,
             g->edit ? ",\"image\":\"" : "}");
    kiln_buf_clear(out);
    kiln_buf_append(out, head, strlen(head), NULL);
    if (g->edit) {
        kiln_buf b64 = {0};
        kiln_base64_encode(ref_png.data, ref_png.len, &b64, NULL);
        kiln_buf_append(out, b64.data, b64.len, NULL);
        kiln_buf_append(out, "\"}", 2, NULL);
        kiln_buf_free(&b64);
    }
    kiln_buf_append(out, "", 1, NULL);
    out->len--; /* NUL-terminated for svc_post_json */
}

static const char *path_of(const req *q)
{
    return groups[q->group].edit ? "/v1/images/edits" : "/v1/images/generations";
}

/* The CLI file of image k of request q (from cli_group). */
static const char *cli_file(const req *q, int k)
{
    const group *g = &groups[q->group];
    char name[48];
    if (g->images == 1)
        snprintf(name, sizeof name, "group%d.png", q->group);
    else
        snprintf(name, sizeof name, "group%d-%d.png", q->group, (int)(q->seed - g->seed) + k);
    return svc_tmp(name);
}

/* Runs group g through the CLI; 0 or -1. */
static int cli_group(int gi)
{
    const group *g = &groups[gi];
    char w[16], h[16], steps[16], n[16], seed[32], out[32];
    snprintf(w, sizeof w, "%d", g->w);
    snprintf(h, sizeof h, "%d", g->h);
    snprintf(steps, sizeof steps, "%d", g->steps);
    snprintf(n, sizeof n, "%d", g->images);
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)g->seed);
    snprintf(out, sizeof out, "group%d.png", gi);
    const char *args[] = {"--prompt", g->prompt, "--seed", seed, "--width", w, "--height", h,
                          "--steps", steps, "-n", n, "--max-sequence-length", "32",
                          g->edit ? "--image" : NULL, svc_tmp("ref.png"), NULL};
    return svc_cli(g->edit ? "edit" : "generate", args, svc_tmp(out));
}

/* ---- tests ---- */

static void test_replicas_registered(void)
{
    static const char *const stages[] = {"encode", "denoise", "decode"};
    for (int s = 0; s < 3; s++) {
        char prefix[64];
        double v;
        snprintf(prefix, sizeof prefix, "kiln_replicas{stage=\"%s\"}", stages[s]);
        CHECKF(svc_wait_metric(port, prefix, 2, 60000, &v) == 0, "%s: %g live replicas, want 2",
               prefix, v);
    }
    CHECK(svc_get_status(port, "/readyz") == 200);
}

static void test_generate_and_edit_match_cli(void)
{
    gwc_response r;
    svc_images im;
    CHECK(svc_post_json(port, "/v1/images/generations",
                        "{\"prompt\":\"a red fox\",\"size\":\"64x64\",\"seed\":1234,\"n\":2,"
                        "\"num_inference_steps\":2,\"max_sequence_length\":32}",
                        &r, SVC_T_REQ) == 0);
    CHECKF(svc_parse_images(&r, &im) == 0 && im.n == 2, "generation: status %d: %.*s", r.status,
           (int)r.body.len, r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
    if (im.n != 2)
        return;
    CHECK(im.seeds[0] == 1234 && im.seeds[1] == 1235);
    const char *args[] = {"--prompt", "a red fox", "--seed", "1234", "--width", "64", "--height",
                          "64", "--steps", "2", "-n", "2", "--max-sequence-length", "32", NULL};
    CHECK(svc_cli("generate", args, svc_tmp("gen.png")) == 0);
    CHECKF(svc_same_file(svc_tmp("gen-0.png"), &im.files[0]) &&
               svc_same_file(svc_tmp("gen-1.png"), &im.files[1]),
           "HTTP generation differs from kiln generate");
    kiln_buf_append(&ref_png, im.files[0].data, im.files[0].len, NULL);
    CHECK(svc_write_file(svc_tmp("ref.png"), ref_png.data, ref_png.len) == 0);
    svc_images_free(&im);

    /* An edit of that image, its size from the reference. */
    kiln_buf b64 = {0}, json = {0};
    kiln_base64_encode(ref_png.data, ref_png.len, &b64, NULL);
    const char *head = "{\"prompt\":\"make it blue\",\"seed\":77,\"num_inference_steps\":2,"
                       "\"max_sequence_length\":32,\"image\":\"";
    kiln_buf_append(&json, head, strlen(head), NULL);
    kiln_buf_append(&json, b64.data, b64.len, NULL);
    kiln_buf_append(&json, "\"}", 3, NULL); /* with the NUL */
    CHECK(svc_post_json(port, "/v1/images/edits", (const char *)json.data, &r, SVC_T_REQ) == 0);
    CHECKF(svc_parse_images(&r, &im) == 0 && im.n == 1, "edit: status %d: %.*s", r.status,
           (int)r.body.len, r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
    const char *eargs[] = {"--image", svc_tmp("ref.png"), "--prompt", "make it blue", "--seed", "77",
                           "--steps", "2", "--max-sequence-length", "32", NULL};
    CHECK(svc_cli("edit", eargs, svc_tmp("edit.png")) == 0);
    CHECKF(im.n == 1 && svc_same_file(svc_tmp("edit.png"), &im.files[0]),
           "HTTP edit differs from kiln edit");
    svc_images_free(&im);
    kiln_buf_free(&b64), kiln_buf_free(&json);
}

/* Sends every request on its own connection at once and reads all the
 * answers; out[i] gets request i's response (status 0 when none came). */
static void send_concurrently(const req *qs, int n, gwc_response *out)
{
    int fds[N_MIXED];
    kiln_buf in[N_MIXED];
    for (int i = 0; i < n; i++) {
        kiln_buf body = {0}, wire = {0};
        in[i] = (kiln_buf){0};
        body_of(&qs[i], &body);
        gwc_format(&wire, "POST", path_of(&qs[i]), "application/json", body.data, body.len, 0);
        fds[i] = gwc_connect(port);
        CHECK(fds[i] >= 0 && gwc_send(fds[i], wire.data, wire.len, 5000) == 0);
        kiln_buf_free(&body), kiln_buf_free(&wire);
        memset(&out[i], 0, sizeof out[i]);
    }
    for (int i = 0; i < n; i++) {
        CHECKF(gwc_read_response(fds[i], &in[i], &out[i], SVC_T_REQ) == 0,
               "request %d: no answer within %d s", i, SVC_T_REQ / 1000);
        close(fds[i]);
        kiln_buf_free(&in[i]);
    }
}

static void test_concurrent_mixed(void)
{
    gwc_response rs[N_MIXED];
    svc_images batched[N_MIXED];
    double t0 = kiln_now_ms();
    send_concurrently(mixed, N_MIXED, rs);
    KILN_LOG_INFO("replicas: %d concurrent requests answered in %.1f s", N_MIXED,
                  (kiln_now_ms() - t0) / 1000);
    for (int i = 0; i < N_MIXED; i++) {
        CHECKF(svc_parse_images(&rs[i], &batched[i]) == 0 && batched[i].n == mixed[i].n,
               "concurrent request %d: status %d: %.*s", i, rs[i].status,
               (int)(rs[i].body.len > 300 ? 300 : rs[i].body.len),
               rs[i].body.data ? (char *)rs[i].body.data : "");
        for (int k = 0; k < batched[i].n; k++)
            CHECK(batched[i].seeds[k] == mixed[i].seed + (uint64_t)k);
        gwc_response_free(&rs[i]);
    }
    /* Several requests shared a denoise batch (else this proves little). */
    kiln_buf log = {0};
    svc_read_log(serve_log, &log);
    int shared = 0;
    for (const char *p = (const char *)log.data; p && (p = strstr(p, "kiln-denoiser ")); p++) {
        const char *b = strstr(p, ": batch of ");
        const char *nl = strchr(p, '\n');
        if (b && (!nl || b < nl) && atoi(b + strlen(": batch of ")) > 1)
            shared++;
    }
    kiln_buf_free(&log);
    CHECKF(shared > 0, "no denoise batch held more than one request");

    /* Each image is the CLI's for its seed... */
    for (int g = 0; g < N_GROUPS; g++)
        CHECKF(cli_group(g) == 0, "kiln %s of group %d failed", groups[g].edit ? "edit" : "generate",
               g);
    for (int i = 0; i < N_MIXED; i++)
        for (int k = 0; k < batched[i].n; k++)
            CHECKF(svc_same_file(cli_file(&mixed[i], k), &batched[i].files[k]),
                   "concurrent request %d image %d differs from the CLI's", i, k);
    /* ...and what the first request of each group gets alone. */
    for (int g = 0, i = 0; g < N_GROUPS; g++) {
        while (mixed[i].group != g)
            i++;
        kiln_buf body = {0};
        body_of(&mixed[i], &body);
        gwc_response r;
        svc_images alone;
        CHECK(svc_post_json(port, path_of(&mixed[i]), (const char *)body.data, &r, SVC_T_REQ) == 0);
        CHECKF(svc_parse_images(&r, &alone) == 0 && alone.n == mixed[i].n,
               "request %d alone: status %d", i, r.status);
        for (int k = 0; k < alone.n && k < batched[i].n; k++)
            CHECKF(alone.files[k].len == batched[i].files[k].len &&
                       !memcmp(alone.files[k].data, batched[i].files[k].data, alone.files[k].len),
                   "request %d image %d: batched with others it differs from alone", i, k);
        svc_images_free(&alone);
        gwc_response_free(&r);
        kiln_buf_free(&body);
    }
    for (int i = 0; i < N_MIXED; i++)
        svc_images_free(&batched[i]);
}

/* The batches replica `id` of `binary` logged: their count, and the jobs
 * and job-rows (each job reports its batch's rows) they add up to. */
static int batches_of(const char *text, const char *binary, const char *id, double *jobs,
                      double *rows)
{
    char pattern[200];
    snprintf(pattern, sizeof pattern, "%s %s: batch of ", binary, id);
    int n = 0;
    for (const char *b = text; (b = strstr(b, pattern)); b++) {
        int j, r;
        if (sscanf(b + strlen(pattern), "%d job(s), %d row(s)", &j, &r) == 2) {
            n++;
            *jobs += j;
            *rows += (double)j * r;
        }
    }
    return n;
}

/* Every replica ran batches, and the gateway's kiln_batch_rows histogram
 * holds exactly what the replicas logged: per job, the rows of its batch. */
static void test_spread_and_batch_rows(void)
{
    static const struct {
        const char *stage, *binary;
    } st[3] = {{"encode", "kiln-encoder"}, {"denoise", "kiln-denoiser"}, {"decode", "kiln-decoder"}};
    kiln_buf log = {0}, m = {0};
    svc_read_log(serve_log, &log);
    CHECK(svc_metrics(port, &m) == 0);
    for (int s = 0; s < 3; s++) {
        char key[64];
        snprintf(key, sizeof key, "gateway: %s replica %%127s registered", st[s].stage);
        int replicas = 0;
        double jobs = 0, rows = 0;
        for (char *line = (char *)log.data, *next; line && *line; line = next) {
            next = strchr(line, '\n');
            if (next)
                *next++ = '\0';
            const char *at = strstr(line, "gateway: ");
            char id[128];
            if (!at || sscanf(at, key, id) != 1 || !strstr(at, " registered"))
                continue;
            replicas++;
            /* The rest of the log (lines split so far are behind us). */
            int n = batches_of(next ? next : "", st[s].binary, id, &jobs, &rows);
            KILN_LOG_INFO("replicas: %s ran %d batches", id, n);
            CHECKF(n > 0, "%s replica %s ran no batch: the work was not spread", st[s].stage, id);
        }
        svc_read_log(serve_log, &log); /* whole again for the next stage */
        CHECKF(replicas == 2, "%d %s replicas registered, want 2", replicas, st[s].stage);
        char count[96], sum[96];
        snprintf(count, sizeof count, "kiln_batch_rows_count{stage=\"%s\"}", st[s].stage);
        snprintf(sum, sizeof sum, "kiln_batch_rows_sum{stage=\"%s\"}", st[s].stage);
        double mc = svc_metric((const char *)m.data, count), ms = svc_metric((const char *)m.data, sum);
        CHECKF(mc == jobs && ms == rows,
               "%s: kiln_batch_rows count %g sum %g, the replicas logged %g jobs, %g job-rows",
               st[s].stage, mc, ms, jobs, rows);
    }
    kiln_buf_free(&log), kiln_buf_free(&m);
}

/* ---- set-up ---- */

static int start(void)
{
    port = svc_free_port();
    char port_s[16], bus[128];
    snprintf(port_s, sizeof port_s, "%d", port);
    snprintf(bus, sizeof bus, "ipc://%s/bus", svc.tmpdir);
    serve_log = strdup(svc_tmp("serve.log"));
    const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                          "--bus", bus, "--min-size", "64", "--max-size", "128",
                          "--text-encoder-out-layers", "1,2,3", "--encoders", "2", "--denoisers",
                          "2", "--decoders", "2", NULL};
    serve = svc_spawn(argv, serve_env, serve_log);
    return serve > 0 && svc_wait_ready(port, 60000) == 0 ? 0 : -1;
}

static void stop(void)
{
    pid_t kids[16];
    int n = 0;
    static const char *const comms[] = {"kiln-gateway", "kiln-encoder", "kiln-denoiser",
                                        "kiln-decoder"};
    for (int i = 0; i < 4; i++)
        n += svc_children(serve, comms[i], kids + n, 16 - n);
    int st = svc_stop(serve, 60000);
    CHECKF(st == 0, "kiln serve exit status %d", st);
    CHECKF(svc_log_count(serve_log, "kiln serve: all children stopped") == 1,
           "kiln serve did not stop its children");
    for (int i = 0; i < n; i++)
        CHECKF(svc_shm_slabs(kids[i]) == 0, "pid %ld left slabs in /dev/shm", (long)kids[i]);
    CHECKF(n == 7, "%d children of kiln serve, want 7", n);
}

int main(void)
{
    if (svc_init("replicas"))
        return 1;
    if (start()) {
        fprintf(stderr, "kiln serve did not become ready; log in %s\n", serve_log);
        svc_stop(serve, 60000);
        svc_cleanup(1);
        return 1;
    }
    RUN(test_replicas_registered);
    RUN(test_generate_and_edit_match_cli);
    RUN(test_concurrent_mixed);
    RUN(test_spread_and_batch_rows);
    stop();
    kiln_buf_free(&ref_png);
    int rc = test_finish();
    svc_cleanup(rc != 0);
    free((void *)serve_log);
    return rc;
}

/* What an operator sees of `kiln serve`: the playground page at /, the
 * ready line with the URL once
 * every stage is up (and no URL before), one access line per request (id,
 * method, path, status, bytes, steps, time), the model id of a Hugging Face cache
 * folder (models--ORG--NAME/snapshots/<commit> -> ORG/NAME) or of
 * --served-model-name in /v1/models and in requests, the gateway's
 * timeouts set through kiln serve, /metrics clean for prom_lint.c and
 * for promtool where installed, and a bad served name refused at start. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tests/service/prom_lint.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

/* A Hugging Face cache snapshot of the tiny checkpoint: real folders, each
 * entry a symlink (the hub links snapshot files to blobs/). */
static int make_hub_snapshot(const char *oracle, char *out, size_t cap)
{
    const char *parts[] = {"hub", "hub/models--acme--tiny-klein",
                           "hub/models--acme--tiny-klein/snapshots",
                           "hub/models--acme--tiny-klein/snapshots/0123abcd"};
    for (int i = 0; i < 4; i++)
        if (mkdir(svc_tmp(parts[i]), 0755))
            return -1;
    snprintf(out, cap, "%s", svc_tmp(parts[3]));
    const char *entries[] = {"model_index.json", "transformer", "text_encoder", "tokenizer",
                             "vae", "scheduler"};
    for (int i = 0; i < 6; i++) {
        char from[PATH_MAX + 32], to[PATH_MAX + 32];
        snprintf(from, sizeof from, "%s/%s", oracle, entries[i]);
        snprintf(to, sizeof to, "%s/%s", out, entries[i]);
        if (symlink(from, to))
            return -1;
    }
    return 0;
}

/* `promtool check metrics` (Prometheus' own linter) on a scrape, where
 * promtool is installed: scripts/install-deps.sh --test takes Debian's out
 * of the prometheus package; with KILN_REQUIRE_PROMTOOL=1 (CI) its absence
 * fails.  Returns 0 when clean or skipped. */
static int promtool_check(const char *text)
{
    const char *path = svc_tmp("metrics.txt");
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) == EOF || fclose(f)) {
        fprintf(stderr, "promtool: cannot write %s\n", path);
        return -1;
    }
    char cmd[PATH_MAX + 64], out[4096] = "";
    snprintf(cmd, sizeof cmd, "promtool check metrics < '%s' 2>&1", path);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 127) {
        const char *req = getenv("KILN_REQUIRE_PROMTOOL");
        fprintf(stderr, "promtool: not installed (scripts/install-deps.sh --test)%s\n",
                req && !strcmp(req, "1") ? ", and KILN_REQUIRE_PROMTOOL=1" : ": skipped");
        return req && !strcmp(req, "1") ? -1 : 0;
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) || out[0]) {
        fprintf(stderr, "promtool check metrics (exit %d):\n%s\n",
                WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
        return -1;
    }
    return 0;
}

/* The X event of `name` on track pid (any when 0), the k-th of its name. */
static const cJSON *span(const cJSON *ev, const char *name, int pid, int k)
{
    const cJSON *e;
    cJSON_ArrayForEach(e, ev)
    {
        const cJSON *ph = cJSON_GetObjectItem(e, "ph"), *nm = cJSON_GetObjectItem(e, "name");
        if (cJSON_IsString(ph) && !strcmp(ph->valuestring, "X") && cJSON_IsString(nm) &&
            !strcmp(nm->valuestring, name) &&
            (!pid || cJSON_GetObjectItem(e, "pid")->valueint == pid) && k-- == 0)
            return e;
    }
    return NULL;
}

static double ts(const cJSON *e) { return e ? cJSON_GetObjectItem(e, "ts")->valuedouble : -1; }
static double te(const cJSON *e)
{
    return e ? ts(e) + cJSON_GetObjectItem(e, "dur")->valuedouble : -1;
}
static int pid_of(const cJSON *e) { return e ? cJSON_GetObjectItem(e, "pid")->valueint : -1; }

/* One request's trace: Chrome trace events with a process per track (the
 * gateway and each replica that ran it), every span inside the request,
 * each stage's replica spans (hand-offs, queue, run) inside the stage's
 * dispatch-to-done span at the gateway and adding up to it, the denoise
 * steps and the stages in order. */
static void check_trace(int port, const char *id, int steps)
{
    char path[160];
    snprintf(path, sizeof path, "/v1/traces/%s", id);
    gwc_response r = {0};
    CHECK(gwc_request(port, "GET", path, NULL, NULL, 0, &r, 10000) == 0 && r.status == 200);
    cJSON *j = r.body.data ? cJSON_ParseWithLength((const char *)r.body.data, r.body.len) : NULL;
    CHECKF(j != NULL, "trace is not JSON: %.*s", (int)r.body.len, r.body.data ? (char *)r.body.data : "");
    gwc_response_free(&r);
    if (!j)
        return;
    const cJSON *other = cJSON_GetObjectItem(j, "otherData");
    CHECK(!strcmp(cJSON_GetObjectItem(other, "request_id")->valuestring, id) &&
          cJSON_GetObjectItem(other, "status")->valueint == 200);
    const cJSON *ev = cJSON_GetObjectItem(j, "traceEvents");
    const cJSON *req = span(ev, "request", 1, 0);
    CHECK(req && ts(req) == 0 && te(req) > 0);
    int processes = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, ev)
    {
        const char *ph = cJSON_GetObjectItem(e, "ph")->valuestring;
        if (!strcmp(ph, "M") && !strcmp(cJSON_GetObjectItem(e, "name")->valuestring,
                                        "process_name"))
            processes++;
        else if (!strcmp(ph, "X"))
            CHECKF(ts(e) >= 0 && te(e) <= te(req) + 1, "%s outside the request",
                   cJSON_GetObjectItem(e, "name")->valuestring);
    }
    CHECKF(processes == 4, "%d processes", processes); /* the gateway and 3 replicas */
    CHECK(span(ev, "receive", 1, 0) && span(ev, "parse", 1, 0) && span(ev, "respond", 1, 0));
    static const char *const stages[] = {"encode", "denoise", "decode"};
    double prev_end = 0;
    for (int st = 0; st < 3; st++) {
        char n[4][48];
        snprintf(n[0], sizeof n[0], "%s: handoff", stages[st]);
        snprintf(n[1], sizeof n[1], "%s: replica queue", stages[st]);
        snprintf(n[2], sizeof n[2], "%s: run", stages[st]);
        snprintf(n[3], sizeof n[3], "%s: gateway queue", stages[st]);
        const cJSON *whole = span(ev, stages[st], 1, 0), *q = span(ev, n[3], 1, 0);
        const cJSON *run = span(ev, n[2], 0, 0);
        int rp = pid_of(run);
        const cJSON *parts[] = {span(ev, n[0], rp, 0), span(ev, n[1], rp, 0), run,
                                span(ev, n[0], rp, 1)};
        CHECKF(whole && q && run && rp > 1 && parts[0] && parts[1] && parts[3],
               "stage %s spans", stages[st]);
        if (!whole || !q || !parts[0] || !parts[1] || !run || !parts[3])
            continue;
        CHECK(ts(q) >= prev_end - 1 && te(q) <= ts(whole) + 1); /* queued, then dispatched */
        double sum = 0;
        for (int k = 0; k < 4; k++) {
            CHECKF(ts(parts[k]) >= ts(whole) - 1 && te(parts[k]) <= te(whole) + 1,
                   "%s part %d outside its stage", stages[st], k);
            sum += te(parts[k]) - ts(parts[k]);
        }
        CHECKF(fabs(sum - (te(whole) - ts(whole))) <= 4, "%s: parts %.0f us, stage %.0f us",
               stages[st], sum, te(whole) - ts(whole));
        prev_end = te(whole);
    }
    CHECK(span(ev, "denoise: step", 0, steps - 1) && !span(ev, "denoise: step", 0, steps));
    CHECK(span(ev, "denoise: setup", 0, 0) && span(ev, "decode: vae", 0, 0) &&
          span(ev, "decode: image encode", 0, 0));
    const cJSON *text = span(ev, "encode: text encoder", 0, 0), *erun = span(ev, "encode: run", 0, 0);
    CHECK(text && erun && ts(text) >= ts(erun) - 1 && te(text) <= te(erun) + 1);
    /* the CPU backend has no device clock: no span claims a GPU time */
    cJSON_ArrayForEach(e, ev)
    {
        if (!strcmp(cJSON_GetObjectItem(e, "ph")->valuestring, "X"))
            CHECKF(!cJSON_GetObjectItem(e, "args"), "%s has args on the CPU",
                   cJSON_GetObjectItem(e, "name")->valuestring);
    }
    cJSON_Delete(j);
    CHECK(svc_get_status(port, "/v1/traces/req_0000000000000000") == 404);
    CHECK(svc_get_status(port, "/v1/traces/") == 404);
}

static void test_ready_access_and_hub_name(void)
{
    char oracle[512], hub[400];
    snprintf(oracle, sizeof oracle, "%s", svc.model);
    CHECK(make_hub_snapshot(oracle, hub, sizeof hub) == 0);
    snprintf(svc.model, sizeof svc.model, "%s", hub);
    int port;
    const char *extra[] = {"--image-threads", "3", NULL};
    pid_t serve = svc_serve(1, extra, NULL, &port);
    CHECK(serve > 0);
    /* kiln serve hands the decoders their image encoders' count */
    CHECK(svc_log_count(svc_tmp("serve.log"), "kiln-decoder: 3 image encoder thread(s)") == 1);
    char ready[160];
    snprintf(ready, sizeof ready, "ready: http://127.0.0.1:%d serves model 'acme/tiny-klein'",
             port);
    CHECKF(svc_wait_log(svc_tmp("serve.log"), ready, 1, 30000) == 0, "no '%s'", ready);
    /* kiln serve itself names no URL: it is not serving yet when it starts */
    kiln_buf log = {0};
    svc_read_log(svc_tmp("serve.log"), &log);
    const char *start = log.data ? strstr((const char *)log.data, "kiln serve: starting") : NULL;
    CHECK(start && !memmem(start, strcspn(start, "\n"), "http://", 7));
    kiln_buf_free(&log);

    gwc_response r = {0};
    CHECK(gwc_request(port, "GET", "/v1/models", NULL, NULL, 0, &r, 10000) == 0 &&
          r.status == 200 && r.body.data && strstr((const char *)r.body.data,
                                                   "\"id\":\"acme/tiny-klein\""));
    gwc_response_free(&r);
    CHECK(svc_get_status(port, "/v1/models/acme/tiny-klein") == 200);

    const char *ok = "{\"prompt\":\"a cat\",\"model\":\"acme/tiny-klein\",\"size\":\"64x64\","
                     "\"num_inference_steps\":1,\"seed\":1}";
    CHECK(svc_post_json(port, "/v1/images/generations", ok, &r, SVC_T_REQ) == 0 &&
          r.status == 200);
    char id[64] = "", line[160];
    CHECK(gwc_header(&r, "X-Request-Id", id, sizeof id) == 0 && id[0]);
    size_t bytes = r.body.len;
    gwc_response_free(&r);
    snprintf(line, sizeof line, "access: %s POST /v1/images/generations 200 %zu bytes 1 steps ",
             id, bytes);
    CHECKF(svc_wait_log(svc_tmp("serve.log"), line, 1, 10000) == 0, "no '%s'", line);
    check_trace(port, id, 1);
    const char *other = "{\"prompt\":\"a cat\",\"model\":\"klein-tiny\",\"size\":\"64x64\"}";
    CHECK(svc_post_json(port, "/v1/images/generations", other, &r, SVC_T_REQ) == 0 &&
          r.status >= 400 && r.status < 500);
    /* refused before its steps were resolved */
    snprintf(line, sizeof line, " POST /v1/images/generations %d %zu bytes - steps ", r.status,
             r.body.len);
    gwc_response_free(&r);
    CHECK(svc_wait_log(svc_tmp("serve.log"), line, 1, 10000) == 0);
    /* the playground page: self-contained, calling this gateway's API */
    CHECK(gwc_request(port, "GET", "/", NULL, NULL, 0, &r, 10000) == 0 && r.status == 200);
    char ctype[64] = "", csp[256] = "";
    CHECK(gwc_header(&r, "Content-Type", ctype, sizeof ctype) == 0 &&
          !strncmp(ctype, "text/html", 9));
    CHECK(gwc_header(&r, "Content-Security-Policy", csp, sizeof csp) == 0 &&
          strstr(csp, "default-src 'self'"));
    const char *page = r.body.data ? (const char *)r.body.data : "";
    CHECK(strstr(page, "<form") && strstr(page, "/v1/images/generations") &&
          strstr(page, "/v1/images/edits") && strstr(page, "id=\"seed\"") &&
          strstr(page, "id=\"steps\"") && strstr(page, "id=\"n\""));
    CHECK(!strstr(page, "src=\"http") && !strstr(page, "href=\"http") &&
          !strstr(page, "url(http") && !strstr(page, "@import"));
    gwc_response_free(&r);
    CHECK(svc_get_status(port, "/index.html") == 404);
    /* /metrics: in the exposition format promtool accepts, with the
     * families an SRE needs, filled by the request above */
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0);
    const char *t = m.data ? (const char *)m.data : "";
    char why[256] = "";
    CHECKF(prom_lint(t, why, sizeof why) == 0, "%s", why);
    CHECK(promtool_check(t) == 0);
    CHECK(svc_metric(t, "kiln_request_duration_seconds_count{route=\"/v1/images/generations\","
                        "status=\"200\"}") == 1);
    CHECK(svc_metric(t, "kiln_request_duration_seconds_count{route=\"/v1/images/generations\","
                        "status=\"404\"}") + svc_metric(t, "kiln_request_duration_seconds_count{"
                        "route=\"/v1/images/generations\",status=\"400\"}") == 1);
    static const char *const stages[] = {"encode", "denoise", "decode"};
    for (int st = 0; st < 3; st++) {
        char k[160];
        snprintf(k, sizeof k, "kiln_queue_wait_seconds_count{stage=\"%s\",queue=\"gateway\"}",
                 stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_queue_wait_seconds_count{stage=\"%s\",queue=\"replica\"}",
                 stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_stage_duration_seconds_count{stage=\"%s\"}", stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        snprintf(k, sizeof k, "kiln_replica_jobs_total{stage=\"%s\",", stages[st]);
        CHECKF(svc_metric(t, k) == 1, "%s", k);
        /* the replicas' memory from their heartbeats (no GPU here) */
        snprintf(k, sizeof k, "kiln_replica_resident_memory_bytes{stage=\"%s\",", stages[st]);
        CHECKF(svc_metric(t, k) > 1e6, "%s", k);
    }
    CHECK(strstr(t, "le=\"0.3\"") && strstr(t, "le=\"0.4\""));
    CHECK(svc_metric(t, "kiln_prompt_cache_misses_total") == 1);
    /* replicas speak only after their hello: nothing of theirs refused */
    CHECK(svc_metric(t, "kiln_bus_rejected_total{reason=\"unregistered\"}") == 0);
    CHECK(!strstr(t, "\nkiln_replica_gpu_memory_used_bytes{")); /* the CPU has none */
    const char *bi = strstr(t, "\nkiln_build_info{version=\"");
    CHECK(bi && bi[strcspn(bi + 1, "\n")] == '1' && bi[strcspn(bi + 1, "\n") - 1] == ' ');
    CHECK(svc_metric(t, "process_resident_memory_bytes") > 1e6);
    CHECK(svc_metric(t, "process_open_fds") > 3);
    CHECK(svc_metric(t, "process_cpu_seconds_total") > 0);
    double started = svc_metric(t, "process_start_time_seconds");
    CHECKF(started > (double)time(NULL) - 600 && started <= (double)time(NULL) + 1, "%f", started);
    kiln_buf_free(&m);
    /* probes are not logged */
    CHECK(svc_get_status(port, "/healthz") == 200);
    CHECK(svc_log_count(svc_tmp("serve.log"), "access: - GET /healthz") == 0);
    CHECK(svc_stop(serve, 60000) == 0);
    snprintf(svc.model, sizeof svc.model, "%s", oracle);
}

/* The checker itself refuses what promtool refuses. */
static void test_prom_lint(void)
{
    char why[256];
    CHECK(prom_lint("# HELP a_total x\n# TYPE a_total counter\na_total 1\n", why, sizeof why) == 0);
    CHECK(prom_lint("# TYPE a counter\na 1\n", why, sizeof why) == -1);   /* no _total */
    CHECK(prom_lint("a 1\n", why, sizeof why) == -1);                      /* no TYPE */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
                    "h_sum 1\nh_count 1\n", why, sizeof why) == -1);      /* not cumulative */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                    "h_sum 1\nh_count 3\n", why, sizeof why) == -1);      /* +Inf != count */
    CHECK(prom_lint("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                    "h_sum 1\nh_count 2\n", why, sizeof why) == 0);
    CHECK(prom_lint("# TYPE g gauge\ng{a=\"1\"} 1\ng{a=\"1\"} 2\n", why, sizeof why) == -1);
    CHECK(prom_lint("# TYPE g gauge\n# TYPE f gauge\ng 1\nf 1\ng{x=\"y\"} 1\n", why,
                    sizeof why) == -1); /* g's samples apart */
    CHECK(prom_lint("# TYPE g gauge\ng{a=\"x\\q\"} 1\n", why, sizeof why) == -1);
}

static void test_served_name_and_timeouts(void)
{
    char traces[300];
    snprintf(traces, sizeof traces, "%s", svc_tmp("traces.jsonl"));
    const char *extra[] = {"--served-model-name", "klein-4b", "--header-timeout-ms", "4000",
                           "--drain-s", "5", "--trace-file", traces, NULL};
    int port;
    pid_t serve = svc_serve(1, extra, NULL, &port);
    CHECK(serve > 0);
    gwc_response r = {0};
    CHECK(gwc_request(port, "GET", "/v1/models", NULL, NULL, 0, &r, 10000) == 0 &&
          r.status == 200 && strstr((const char *)r.body.data, "\"id\":\"klein-4b\""));
    gwc_response_free(&r);
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0);
    CHECK(svc_metric((const char *)m.data, "kiln_limit{name=\"header_timeout_seconds\"}") == 4);
    kiln_buf_free(&m);
    /* --trace-file: each answered request's trace, one JSON line */
    const char *one = "{\"prompt\":\"a cat\",\"size\":\"64x64\",\"num_inference_steps\":1}";
    for (int i = 0; i < 2; i++) {
        CHECK(svc_post_json(port, "/v1/images/generations", one, &r, SVC_T_REQ) == 0 &&
              r.status == 200);
        gwc_response_free(&r);
    }
    CHECK(svc_stop(serve, 60000) == 0);
    kiln_buf tf = {0};
    svc_read_log(traces, &tf);
    int lines = 0;
    for (char *l = tf.data ? (char *)tf.data : ""; *l; lines++) {
        char *nl = strchr(l, '\n');
        if (!nl)
            break;
        cJSON *j = cJSON_ParseWithLength(l, (size_t)(nl - l));
        CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItem(j, "traceEvents")) > 10);
        cJSON_Delete(j);
        l = nl + 1;
    }
    CHECKF(lines == 2, "%d trace lines", lines);
    kiln_buf_free(&tf);

    /* a name that cannot be an id is refused, and the service stops */
    char port_s[16], bus[160];
    snprintf(port_s, sizeof port_s, "%d", svc_free_port());
    snprintf(bus, sizeof bus, "ipc://%s/bus2", svc.tmpdir);
    const char *bad[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                         "--bus", bus, "--served-model-name", "a\"b", NULL};
    pid_t p = svc_spawn(bad, NULL, svc_tmp("bad.log"));
    CHECK(p > 0 && svc_wait_exit(p, 60000) == 1);
    CHECK(svc_log_count(svc_tmp("bad.log"), "--served-model-name takes") == 1);

    /* start-up failures kiln serve says itself, at once, before any child:
     * a port in use, a checkpoint that does not open */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 1) == 0 &&
          getsockname(fd, (struct sockaddr *)&a, &al) == 0);
    snprintf(port_s, sizeof port_s, "%d", ntohs(a.sin_port));
    const char *taken[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                           NULL};
    p = svc_spawn(taken, NULL, svc_tmp("taken.log"));
    CHECK(p > 0 && svc_wait_exit(p, 10000) == 1);
    CHECK(svc_log_count(svc_tmp("taken.log"), "cannot listen on 127.0.0.1:") == 1 &&
          svc_log_count(svc_tmp("taken.log"), "choose --port") == 1 &&
          svc_log_count(svc_tmp("taken.log"), "started kiln-gateway") == 0);
    close(fd);
    const char *nomodel[] = {svc_exe("tools/kiln"), "serve", "--model", svc_tmp("no-model"),
                             "--port", port_s, NULL};
    p = svc_spawn(nomodel, NULL, svc_tmp("nomodel.log"));
    CHECK(p > 0 && svc_wait_exit(p, 10000) == 1);
    CHECK(svc_log_count(svc_tmp("nomodel.log"), "checkpoint folder not found") == 1 &&
          svc_log_count(svc_tmp("nomodel.log"), "started kiln-") == 0);
    /* --colocate with the stages of one process pinned to different GPUs:
     * a usage error (exit 2), said before anything starts */
    const char *split[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", port_s,
                           "--colocate", "--gpus", "2", "--encoder-gpu", "1", NULL};
    p = svc_spawn(split, NULL, svc_tmp("split.log"));
    CHECK(p > 0 && svc_wait_exit(p, 10000) == 2);
    CHECK(svc_log_count(svc_tmp("split.log"), "--colocate runs replica 0 of every stage") == 1 &&
          svc_log_count(svc_tmp("split.log"), "started kiln-") == 0);
    /* --image-threads outside 1..64: a usage error naming the value, before
     * anything starts (the decoders never see it) */
    const char *threads[][2] = {{"0", "threads0.log"}, {"65", "threads65.log"}};
    for (int i = 0; i < 2; i++) {
        const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port",
                              port_s, "--image-threads", threads[i][0], NULL};
        char said[64];
        snprintf(said, sizeof said, "invalid value '%s' for --image-threads", threads[i][0]);
        p = svc_spawn(argv, NULL, svc_tmp(threads[i][1]));
        CHECK(p > 0 && svc_wait_exit(p, 10000) == 2);
        CHECKF(svc_log_count(svc_tmp(threads[i][1]), said) == 1 &&
                   svc_log_count(svc_tmp(threads[i][1]), "started kiln-") == 0,
               "--image-threads %s", threads[i][0]);
    }
}

int main(void)
{
    if (svc_init("serve_ux"))
        return 1;
    RUN(test_prom_lint);
    RUN(test_ready_access_and_hub_name);
    RUN(test_served_name_and_timeouts);
    svc_cleanup(test_failures);
    return test_finish();
}

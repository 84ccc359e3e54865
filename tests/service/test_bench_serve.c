/* kiln-bench end to end: `kiln serve` on the tiny klein checkpoint (CPU
 * backend), then the kiln-bench binary in both modes with a few small
 * requests.  Checks that every request succeeds, the JSON report holds the
 * right counts (latency samples, throughput repeats, images/s > 0) and the
 * gateway's per-stage timings read from /metrics (one encode, denoise and
 * decode observation per request), and that a bad request size makes
 * kiln-bench fail with the server's message. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "svc_util.h"
#include "tests/run_util.h"
#include "tests/test.h"

static double num(const cJSON *o, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *save, *k = strtok_r(buf, ".", &save); k && o; k = strtok_r(NULL, ".", &save))
        o = cJSON_IsArray(o) ? cJSON_GetArrayItem(o, atoi(k)) : cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(o) ? o->valuedouble : -1;
}

/* A field ("count" or "mean_ms") of the series metric{labels}. */
static double series_l(const cJSON *phase, const char *metric, const char *labels,
                       const char *field)
{
    const cJSON *s;
    cJSON_ArrayForEach(s, cJSON_GetObjectItem(phase, "stages"))
    {
        const cJSON *m = cJSON_GetObjectItem(s, "metric"), *l = cJSON_GetObjectItem(s, "labels");
        if (cJSON_IsString(m) && !strcmp(m->valuestring, metric) && cJSON_IsString(l) &&
            !strcmp(l->valuestring, labels))
            return num(s, field);
    }
    return 0;
}

/* A field of the series metric{label="<name>"}. */
static double series(const cJSON *phase, const char *metric, const char *label, const char *name,
                     const char *field)
{
    char labels[64];
    snprintf(labels, sizeof labels, "%s=\"%s\"", label, name);
    return series_l(phase, metric, labels, field);
}

static double stage_count(const cJSON *phase, const char *name)
{
    return series(phase, "kiln_stage_duration_seconds", "stage", name, "count");
}

static void check_report(const char *path)
{
    FILE *f = fopen(path, "rb");
    CHECKF(f != NULL, "no report at %s", path);
    if (!f)
        return;
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    cJSON *j = cJSON_Parse(text);
    CHECK(j != NULL);
    const cJSON *lat = cJSON_GetObjectItem(j, "latency");
    CHECK(num(lat, "requests") == 2 && num(lat, "errors") == 0);
    CHECK(num(lat, "latency_ms.n") == 2 && num(lat, "latency_ms.median") > 0);
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(lat, "latency_s_samples")) == 2);
    for (const char *const *p = (const char *const[]){"encode", "denoise", "decode", 0}; *p; p++)
        CHECKF(stage_count(lat, *p) == 2, "latency stage %s", *p);
    CHECK(series_l(lat, "kiln_request_duration_seconds",
                   "route=\"/v1/images/generations\",status=\"200\"", "count") == 2);
    /* each job waited once in each stage's gateway queue and its replica's */
    CHECK(series_l(lat, "kiln_queue_wait_seconds", "stage=\"denoise\",queue=\"gateway\"",
                   "count") == 2);
    CHECK(series_l(lat, "kiln_queue_wait_seconds", "stage=\"denoise\",queue=\"replica\"",
                   "count") == 2);
    /* The parts of the stages the replicas time: one observation per
     * request each (a hand-off per stage); steps and image encoding take
     * time, and no part is longer than its stage. */
    for (const char *const *p =
             (const char *const[]){"encode_run",     "denoise_setup",   "denoise_step",
                                   "decode_vae",     "image_encode",    "encode_handoff",
                                   "denoise_handoff", "decode_handoff", 0};
         *p; p++)
        CHECKF(series(lat, "kiln_stage_seconds", "part", *p, "count") == 2, "part %s", *p);
    double step = series(lat, "kiln_stage_seconds", "part", "denoise_step", "mean_ms");
    double denoise = series(lat, "kiln_stage_duration_seconds", "stage", "denoise", "mean_ms");
    CHECKF(step > 0 && step <= denoise, "step %.3f ms, denoise %.3f ms", step, denoise);
    double vae = series(lat, "kiln_stage_seconds", "part", "decode_vae", "mean_ms");
    double png = series(lat, "kiln_stage_seconds", "part", "image_encode", "mean_ms");
    double decode = series(lat, "kiln_stage_duration_seconds", "stage", "decode", "mean_ms");
    CHECKF(vae > 0 && png > 0 && vae + png <= decode, "vae %.3f + image %.3f > decode %.3f", vae,
           png, decode);
    const cJSON *tp = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "throughput"), 0);
    CHECK(num(tp, "concurrency") == 2 && num(tp, "requests") == 4 && num(tp, "errors") == 0);
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(tp, "images_per_s_repeats")) == 2);
    CHECK(num(tp, "images_per_s.median") > 0 && num(tp, "latency_ms.n") == 4);
    CHECK(stage_count(tp, "denoise") == 4);
    cJSON_Delete(j);
}

int main(void)
{
    if (svc_init("bench-serve"))
        return 1;
    char port[16], url[64], bus[128], log[256], json[256];
    int p = svc_free_port();
    snprintf(port, sizeof port, "%d", p);
    snprintf(url, sizeof url, "http://127.0.0.1:%d", p);
    snprintf(bus, sizeof bus, "ipc://%s", svc_tmp("bus"));
    snprintf(log, sizeof log, "%s", svc_tmp("serve.log"));
    snprintf(json, sizeof json, "%s", svc_tmp("report.json"));
    char kiln[4096];
    snprintf(kiln, sizeof kiln, "%s", svc_exe("tools/kiln"));
    const char *serve[] = {kiln, "serve", "--model", svc.model, "--device", "cpu", "--port", port,
                           "--bus", bus, "--min-size", "64", "--text-encoder-out-layers", "1,2,3",
                           NULL};
    pid_t pid = svc_spawn(serve, NULL, log);
    CHECK(pid > 0);

    char out[16384], err[16384];
    const char *bench[] = {NULL, "--url", url, "--wait-ready", "60", "--size", "64x64",
                           "--steps", "1", "--warmup", "1", "--requests", "2", "--concurrency",
                           "2", "--images", "2", "--repeats", "2", "--json", json, NULL};
    char exe[4096];
    snprintf(exe, sizeof exe, "%s", svc_exe("tools/bench/kiln-bench"));
    int rc = test_run_capture(exe, bench, out, sizeof out, err, sizeof err);
    CHECKF(rc == 0, "kiln-bench exited %d: %s%s", rc, out, err);
    CHECK(strstr(out, "latency (B=1") &&
          strstr(out, "kiln_stage_duration_seconds{stage=\"denoise\"}"));
    check_report(json);

    /* 72x64 is within the size range but not a multiple of 16: every request fails. */
    const char *bad[] = {NULL, "--url", url, "--mode", "latency", "--size", "72x64", "--steps",
                         "1", "--warmup", "0", "--requests", "1", NULL};
    rc = test_run_capture(exe, bad, out, sizeof out, err, sizeof err);
    CHECKF(rc == 1 && strstr(out, "HTTP 400"), "rc %d: %s", rc, out);

    if (pid > 0)
        CHECK(svc_stop(pid, 30000) == 0);
    if (test_failures) {
        kiln_buf text = {0};
        svc_read_log(log, &text);
        if (text.len)
            fputs((const char *)text.data, stderr);
        kiln_buf_free(&text);
    }
    svc_cleanup(test_failures != 0);
    return test_finish();
}

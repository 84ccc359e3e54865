/* kiln-bench: HTTP load client for kiln-gateway (see bench_args.h for the
 * options and bench_run.h for what a run sends).  Exit status: 0 when every
 * request succeeded, 1 when some failed or the run could not be made, 2 for
 * a usage error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_args.h"
#include "bench_report.h"
#include "bench_run.h"

#ifndef KILN_BENCH_PROMPTS
#define KILN_BENCH_PROMPTS "tools/bench/prompts.txt"
#endif

static int write_json(const char *path, const cJSON *doc)
{
    char *text = cJSON_Print(doc);
    if (!text) {
        fprintf(stderr, "kiln-bench: out of memory\n");
        return -1;
    }
    FILE *f = strcmp(path, "-") ? fopen(path, "w") : stdout;
    int bad = !f || fprintf(f, "%s\n", text) < 0;
    if (f && f != stdout)
        bad |= fclose(f) != 0;
    if (bad)
        fprintf(stderr, "kiln-bench: cannot write %s\n", path);
    cJSON_free(text);
    return bad ? -1 : 0;
}

int main(int argc, char **argv)
{
    kiln_bench_opts o;
    kiln_err err = {0};
    if (kiln_bench_parse_args(argc, argv, &o, &err)) {
        fprintf(stderr, "kiln-bench: %s\n%s", err.msg, kiln_bench_usage());
        return 2;
    }
    if (o.help) {
        fputs(kiln_bench_usage(), stdout);
        return 0;
    }
    kiln_bench_prompts prompts;
    if (kiln_bench_prompts_load(o.prompts ? o.prompts : KILN_BENCH_PROMPTS, &prompts, &err)) {
        fprintf(stderr, "kiln-bench: %s\n", err.msg);
        return 1;
    }
    if (o.wait_ready_s > 0 && kiln_bench_wait_ready(&o, &err)) {
        fprintf(stderr, "kiln-bench: %s\n", err.msg);
        kiln_bench_prompts_free(&prompts);
        return 1;
    }
    kiln_bench_phase lat = {0}, tp[KILN_BENCH_MAX_CONC] = {{0}};
    int n_tp = 0, rc = 0;
    uint64_t next = 0;
    kiln_status st = KILN_OK;
    if (o.latency) {
        fprintf(stderr, "kiln-bench: latency, %d warm-ups + %d requests\n", o.warmup, o.n_latency);
        st = kiln_bench_run_latency(&o, &prompts, &next, &lat, &err);
    }
    for (int i = 0; !st && o.throughput && i < o.n_conc; i++) {
        fprintf(stderr, "kiln-bench: throughput at concurrency %d, %d x %d images\n", o.conc[i],
                o.repeats, o.images);
        st = kiln_bench_run_throughput(&o, &prompts, o.conc[i], &next, &tp[n_tp++], &err);
    }
    if (st) {
        fprintf(stderr, "kiln-bench: %s\n", err.msg);
        rc = 1;
    }
    /* With --json -, the JSON owns stdout and the table goes to stderr. */
    FILE *table = o.json && !strcmp(o.json, "-") ? stderr : stdout;
    kiln_bench_report_table(table, &o, o.latency ? &lat : NULL, tp, n_tp);
    if (o.json) {
        cJSON *doc = kiln_bench_report_json(&o, o.latency ? &lat : NULL, tp, n_tp);
        if (!doc || write_json(o.json, doc))
            rc = 1;
        if (!doc)
            fprintf(stderr, "kiln-bench: out of memory\n");
        cJSON_Delete(doc);
    }
    rc |= lat.errors > 0;
    for (int i = 0; i < n_tp; i++) {
        rc |= tp[i].errors > 0;
        kiln_bench_phase_free(&tp[i]);
    }
    kiln_bench_phase_free(&lat);
    kiln_bench_prompts_free(&prompts);
    return rc;
}

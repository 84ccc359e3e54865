/* kiln-soak: mixed traffic with replica faults against a running kiln
 * service, for a given time (soak_opts.h for the options, soak_run.h for
 * what a run does, soak_report.h for what it writes).  Exit status: 0 when
 * the run passed (no unexpected answer, no wrong image, every fault
 * healed, memory within bounds), 1 otherwise, 2 for a usage error. */
#include <stdio.h>
#include <stdlib.h>

#include "bench_run.h"
#include "common/log.h"
#include "soak_opts.h"
#include "soak_report.h"
#include "soak_run.h"
#include "soak_traffic.h"
#include "soak_verify.h"

#ifndef KILN_BENCH_PROMPTS
#define KILN_BENCH_PROMPTS "tools/bench/prompts.txt"
#endif

int main(int argc, char **argv)
{
    kiln_soak_opts o;
    kiln_err err = {0};
    if (kiln_soak_parse_args(argc, argv, &o, &err)) {
        fprintf(stderr, "kiln-soak: %s\n%s", err.msg, kiln_soak_usage());
        return 2;
    }
    if (o.help) {
        fputs(kiln_soak_usage(), stdout);
        return 0;
    }
    kiln_bench_prompts prompts;
    if (kiln_bench_prompts_load(o.prompts ? o.prompts : KILN_BENCH_PROMPTS, &prompts, &err)) {
        fprintf(stderr, "kiln-soak: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    kiln_soak_traffic *t = kiln_soak_traffic_create(&o, &prompts, &err);
    kiln_soak_verify *v = NULL;
    kiln_soak_run run = {0};
    if (!t)
        goto out;
    if (o.verify_kiln) {
        if (!(v = kiln_soak_verify_create(&o, t, &err)))
            goto out;
        KILN_LOG_INFO("kiln-soak: the CLI's images for the %d distinct requests (cache %s)",
                      o.pool, o.verify_cache);
        if (kiln_soak_verify_prepare(v, &err))
            goto out;
        int runs;
        double s = kiln_soak_verify_prepare_s(v, &runs);
        KILN_LOG_INFO("kiln-soak: %d CLI run(s) in %.1f s", runs, s);
    }
    KILN_LOG_INFO("kiln-soak: %.0f s of traffic against %s", o.duration_s, o.url);
    if (kiln_soak_run_do(&o, t, v, &run, &err))
        goto out;
    kiln_soak_run_classify(&run, &o);
    kiln_soak_verdict vd;
    kiln_soak_judge(&run, &o, &vd);
    kiln_soak_report_text(stdout, &run, &o, &vd);
    rc = !vd.pass;
    if (o.out_dir && kiln_soak_report_files(o.out_dir, &run, &o, &vd, &err)) {
        fprintf(stderr, "kiln-soak: %s\n", err.msg);
        rc = 1;
    }
    free(vd.growth);
    err.code = KILN_OK;
out:
    if (err.code)
        fprintf(stderr, "kiln-soak: %s\n", err.msg);
    kiln_soak_run_free(&run);
    kiln_soak_verify_destroy(v);
    kiln_soak_traffic_destroy(t);
    kiln_bench_prompts_free(&prompts);
    return rc;
}

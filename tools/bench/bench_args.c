#include "bench_args.h"
#include "common/args.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

const char *kiln_bench_usage(void)
{
    return "usage: kiln-bench [--url http://HOST:PORT] [--mode latency|throughput|both]\n"
           "  [--model NAME] [--size WxH] [--steps N] [--format png|jpeg|webp]\n"
           "  [--prompts FILE] [--warmup N] [--requests N] [--concurrency 4,8,16]\n"
           "  [--images N] [--repeats N] [--timeout SECONDS] [--wait-ready SECONDS]\n"
           "  [--json FILE|-] [--label TEXT]\n"
           "Load client for kiln-gateway's POST /v1/images/generations.  Request k uses\n"
           "prompt k mod P of the prompt list and seed = that prompt's index.  latency:\n"
           "--warmup requests, then --requests one at a time (median, p95).  throughput:\n"
           "per concurrency level, --repeats runs of --images requests (n = 1 each) from\n"
           "that many connections (images/s: median and range).  /metrics is read before\n"
           "and after each phase to show where the time went.\n";
}

int kiln_bench_parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0 && v <= 86400))
        return -1;
    *out = v;
    return 0;
}

int kiln_bench_parse_size(const char *s, int *w, int *h)
{
    char buf[32];
    const char *x = strchr(s, 'x');
    if (!x || (size_t)(x - s) >= sizeof buf)
        return -1;
    memcpy(buf, s, (size_t)(x - s));
    buf[x - s] = '\0';
    return kiln_parse_int(buf, 16, 16384, w) || kiln_parse_int(x + 1, 16, 16384, h) ? -1 : 0;
}

static int parse_conc(const char *s, kiln_bench_opts *o)
{
    o->n_conc = 0;
    const char *p = s;
    for (;;) {
        char buf[16];
        size_t n = strcspn(p, ",");
        if (!n || n >= sizeof buf || o->n_conc == KILN_BENCH_MAX_CONC)
            return -1;
        memcpy(buf, p, n);
        buf[n] = '\0';
        if (kiln_parse_int(buf, 1, 1024, &o->conc[o->n_conc++]))
            return -1;
        if (!p[n])
            return 0;
        p += n + 1;
    }
}

kiln_status kiln_bench_next_opt(int argc, char **argv, int *i, const char **name,
                                const char **value, int *help, kiln_err *err)
{
    const char *a = argv[*i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
        *help = 1;
        return KILN_OK;
    }
    if (strncmp(a, "--", 2))
        return kiln_err_set(err, KILN_ERR_INVALID, "unexpected argument '%s'", a);
    if (*i + 1 >= argc)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s needs a value", a);
    *name = a;
    *value = argv[++*i];
    return KILN_OK;
}

kiln_status kiln_bench_parse_args(int argc, char **argv, kiln_bench_opts *o, kiln_err *err)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8000";
    o->width = o->height = 1024;
    o->format = "png";
    o->latency = o->throughput = 1;
    o->warmup = 3;
    o->n_latency = 20;
    o->conc[0] = 4, o->conc[1] = 8, o->conc[2] = 16, o->n_conc = 3;
    o->images = 32;
    o->repeats = 3;
    o->timeout_s = 600;
    for (int i = 1; i < argc; i++) {
        const char *a = NULL, *v = NULL;
        if (kiln_bench_next_opt(argc, argv, &i, &a, &v, &o->help, err))
            return err->code;
        if (o->help)
            return KILN_OK;
        int bad = 0;
        if (!strcmp(a, "--url"))
            o->url = v;
        else if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--size"))
            bad = kiln_bench_parse_size(v, &o->width, &o->height);
        else if (!strcmp(a, "--steps"))
            bad = kiln_parse_int(v, 1, 1000, &o->steps);
        else if (!strcmp(a, "--format"))
            bad = strcmp(v, "png") && strcmp(v, "jpeg") && strcmp(v, "webp"), o->format = v;
        else if (!strcmp(a, "--prompts"))
            o->prompts = v;
        else if (!strcmp(a, "--mode")) {
            o->latency = !strcmp(v, "latency") || !strcmp(v, "both");
            o->throughput = !strcmp(v, "throughput") || !strcmp(v, "both");
            bad = !o->latency && !o->throughput;
        } else if (!strcmp(a, "--warmup"))
            bad = kiln_parse_int(v, 0, 1000, &o->warmup);
        else if (!strcmp(a, "--requests"))
            bad = kiln_parse_int(v, 1, 100000, &o->n_latency);
        else if (!strcmp(a, "--concurrency"))
            bad = parse_conc(v, o);
        else if (!strcmp(a, "--images"))
            bad = kiln_parse_int(v, 1, 100000, &o->images);
        else if (!strcmp(a, "--repeats"))
            bad = kiln_parse_int(v, 1, 64, &o->repeats);
        else if (!strcmp(a, "--timeout"))
            bad = kiln_bench_parse_seconds(v, &o->timeout_s) || o->timeout_s <= 0;
        else if (!strcmp(a, "--wait-ready"))
            bad = kiln_bench_parse_seconds(v, &o->wait_ready_s);
        else if (!strcmp(a, "--json"))
            o->json = v;
        else if (!strcmp(a, "--label"))
            o->label = v;
        else
            return kiln_err_set(err, KILN_ERR_INVALID, "unknown option %s", a);
        if (bad)
            return kiln_err_set(err, KILN_ERR_INVALID, "bad value for %s: '%s'", a, v);
    }
    return KILN_OK;
}

#include "soak_opts.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"
#include "common/args.h"

const char *kiln_soak_usage(void)
{
    return "usage: kiln-soak [--url http://HOST:PORT] (--duration SECONDS | --minutes M)\n"
           "  [--concurrency 8] [--seed 1] [--min-side 256] [--max-side 2048] [--max-n 4]\n"
           "  [--steps N] [--max-sequence-length L] [--edits 0.15] [--max-refs 4]\n"
           "  [--disconnects 0.05] [--disconnect-max-s 2] [--pool N] [--prompts FILE]\n"
           "  [--first WxH] [--serve-pid PID] [--kill STAGE@S|none] [--stop STAGE@S+D|none]\n"
           "  [--heal-grace 10] [--sample 1] [--warmup S] [--max-rss-growth-mb 256]\n"
           "  [--max-gpu-growth-mb 1024] [--verify KILN --verify-model DIR\n"
           "  [--verify-arg ARG]... --verify-cache DIR] [--out DIR] [--timeout 600]\n"
           "  [--wait-ready 300] [--label TEXT]\n"
           "Mixed traffic against kiln's HTTP API for a given time: generations and edits\n"
           "(1..--max-refs references) of random sizes (multiples of 16, some square),\n"
           "n 1..--max-n, png/jpeg/webp, from --concurrency connections, some clients\n"
           "leaving mid-request; everything follows from --seed.  --pool N draws the\n"
           "requests from N distinct ones (needed by --verify, which checks every image\n"
           "against the bytes `KILN generate/edit` writes for the same request, cached in\n"
           "--verify-cache).  With --serve-pid (a `kiln serve`), its processes' memory\n"
           "(RssAnon from /proc; GPU memory from nvidia-smi when present) is sampled, one\n"
           "replica of --kill's stage gets SIGKILL and one of --stop's SIGSTOP for D s\n"
           "(under kiln serve --colocate: a kiln-stages process, with its other stages)\n"
           "(defaults: denoise at 1/3 and 2/3 of the run, 30 s).  Errors: any status but\n"
           "200, except 503s while a fault heals; wrong or malformed images; memory\n"
           "growth after --warmup over the bounds.  Exit 0 when there were none.\n";
}

const char *kiln_soak_stage_binary(const char *stage)
{
    if (!strncmp(stage, "encode", 6))
        return "kiln-encoder";
    if (!strncmp(stage, "denoise", 7))
        return "kiln-denoiser";
    if (!strncmp(stage, "decode", 6))
        return "kiln-decoder";
    return NULL;
}

static int parse_frac(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0 && v <= 1))
        return -1;
    *out = v;
    return 0;
}

static int parse_mb(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0 && v <= 1e7))
        return -1;
    *out = v;
    return 0;
}

/* STAGE@SECONDS[+SECONDS] or "none" (stage ""). */
static int parse_fault(const char *s, char *stage, size_t cap, double *at, double *dur)
{
    stage[0] = '\0';
    if (!strcmp(s, "none"))
        return 0;
    const char *a = strchr(s, '@');
    if (!a || (size_t)(a - s) >= cap)
        return -1;
    memcpy(stage, s, (size_t)(a - s));
    stage[a - s] = '\0';
    const char *bin = kiln_soak_stage_binary(stage);
    if (!bin)
        return -1;
    snprintf(stage, cap, "%s", bin[5] == 'e' ? "encode" : bin[7] == 'n' ? "denoise" : "decode");
    char num[64];
    const char *plus = strchr(a + 1, '+');
    size_t n = plus ? (size_t)(plus - a - 1) : strlen(a + 1);
    if (n >= sizeof num || (plus && !dur))
        return -1;
    memcpy(num, a + 1, n);
    num[n] = '\0';
    if (kiln_bench_parse_seconds(num, at))
        return -1;
    return plus ? kiln_bench_parse_seconds(plus + 1, dur) : 0;
}

kiln_status kiln_soak_parse_args(int argc, char **argv, kiln_soak_opts *o, kiln_err *err)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8000";
    o->concurrency = 8;
    o->seed = 1;
    o->min_side = 256, o->max_side = 2048;
    o->max_n = 4;
    o->edits = 0.15;
    o->max_refs = 4;
    o->disconnects = 0.05;
    o->disconnect_max_s = 2;
    snprintf(o->kill_stage, sizeof o->kill_stage, "denoise");
    snprintf(o->stop_stage, sizeof o->stop_stage, "denoise");
    o->kill_at_s = o->stop_at_s = o->warmup_s = -1;
    o->stop_for_s = 30;
    o->heal_grace_s = 10;
    o->sample_s = 1;
    o->max_rss_growth_mb = 256;
    o->max_gpu_growth_mb = 1024;
    o->timeout_s = 600;
    o->wait_ready_s = 300;
    for (int i = 1; i < argc; i++) {
        const char *a = NULL, *v = NULL;
        if (kiln_bench_next_opt(argc, argv, &i, &a, &v, &o->help, err))
            return err->code;
        if (o->help)
            return KILN_OK;
        int bad = 0, iv;
        double d;
        if (!strcmp(a, "--url"))
            o->url = v;
        else if (!strcmp(a, "--duration"))
            bad = kiln_bench_parse_seconds(v, &o->duration_s) || o->duration_s <= 0;
        else if (!strcmp(a, "--minutes"))
            bad = kiln_bench_parse_seconds(v, &d) || d <= 0 || d > 1440, o->duration_s = 60 * d;
        else if (!strcmp(a, "--concurrency"))
            bad = kiln_parse_int(v, 1, 256, &o->concurrency);
        else if (!strcmp(a, "--seed"))
            bad = kiln_parse_int(v, 0, 1 << 30, &iv), o->seed = (uint64_t)iv;
        else if (!strcmp(a, "--min-side"))
            bad = kiln_parse_int(v, 16, 4096, &o->min_side) || o->min_side % 16;
        else if (!strcmp(a, "--max-side"))
            bad = kiln_parse_int(v, 16, 4096, &o->max_side) || o->max_side % 16;
        else if (!strcmp(a, "--max-n"))
            bad = kiln_parse_int(v, 1, 10, &o->max_n);
        else if (!strcmp(a, "--steps"))
            bad = kiln_parse_int(v, 1, 200, &o->steps);
        else if (!strcmp(a, "--max-sequence-length"))
            bad = kiln_parse_int(v, 1, 512, &o->max_seq);
        else if (!strcmp(a, "--edits"))
            bad = parse_frac(v, &o->edits);
        else if (!strcmp(a, "--max-refs"))
            bad = kiln_parse_int(v, 1, 8, &o->max_refs);
        else if (!strcmp(a, "--disconnects"))
            bad = parse_frac(v, &o->disconnects);
        else if (!strcmp(a, "--disconnect-max-s"))
            bad = kiln_bench_parse_seconds(v, &o->disconnect_max_s);
        else if (!strcmp(a, "--pool"))
            bad = kiln_parse_int(v, 0, 100000, &o->pool);
        else if (!strcmp(a, "--prompts"))
            o->prompts = v;
        else if (!strcmp(a, "--first"))
            bad = kiln_bench_parse_size(v, &o->first_w, &o->first_h);
        else if (!strcmp(a, "--serve-pid"))
            bad = kiln_parse_int(v, 1, 1 << 30, &iv), o->serve_pid = (pid_t)iv;
        else if (!strcmp(a, "--kill"))
            bad = parse_fault(v, o->kill_stage, sizeof o->kill_stage, &o->kill_at_s, NULL);
        else if (!strcmp(a, "--stop"))
            bad = parse_fault(v, o->stop_stage, sizeof o->stop_stage, &o->stop_at_s,
                              &o->stop_for_s);
        else if (!strcmp(a, "--heal-grace"))
            bad = kiln_bench_parse_seconds(v, &o->heal_grace_s);
        else if (!strcmp(a, "--sample"))
            bad = kiln_bench_parse_seconds(v, &o->sample_s) || o->sample_s < 0.05;
        else if (!strcmp(a, "--warmup"))
            bad = kiln_bench_parse_seconds(v, &o->warmup_s);
        else if (!strcmp(a, "--max-rss-growth-mb"))
            bad = parse_mb(v, &o->max_rss_growth_mb);
        else if (!strcmp(a, "--max-gpu-growth-mb"))
            bad = parse_mb(v, &o->max_gpu_growth_mb);
        else if (!strcmp(a, "--verify"))
            o->verify_kiln = v;
        else if (!strcmp(a, "--verify-model"))
            o->verify_model = v;
        else if (!strcmp(a, "--verify-arg"))
            bad = o->n_verify_args == KILN_SOAK_MAX_ARGS, o->verify_args[o->n_verify_args++] = v;
        else if (!strcmp(a, "--verify-cache"))
            o->verify_cache = v;
        else if (!strcmp(a, "--out"))
            o->out_dir = v;
        else if (!strcmp(a, "--timeout"))
            bad = kiln_bench_parse_seconds(v, &o->timeout_s) || o->timeout_s <= 0;
        else if (!strcmp(a, "--wait-ready"))
            bad = kiln_bench_parse_seconds(v, &o->wait_ready_s);
        else if (!strcmp(a, "--label"))
            o->label = v;
        else
            return kiln_err_set(err, KILN_ERR_INVALID, "unknown option %s", a);
        if (bad)
            return kiln_err_set(err, KILN_ERR_INVALID, "bad value for %s: '%s'", a, v);
    }
    if (o->duration_s <= 0)
        return kiln_err_set(err, KILN_ERR_INVALID, "--duration or --minutes is required");
    if (o->min_side > o->max_side)
        return kiln_err_set(err, KILN_ERR_INVALID, "--min-side is over --max-side");
    if (o->verify_kiln && (!o->verify_model || !o->verify_cache || !o->pool))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "--verify needs --verify-model, --verify-cache and --pool N");
    if (o->kill_at_s < 0)
        o->kill_at_s = o->duration_s / 3;
    if (o->stop_at_s < 0)
        o->stop_at_s = 2 * o->duration_s / 3;
    if (o->warmup_s < 0)
        o->warmup_s = o->duration_s / 5;
    return KILN_OK;
}

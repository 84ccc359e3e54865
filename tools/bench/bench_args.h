/* kiln-bench command line.
 *
 *   kiln_bench_opts o;
 *   if (kiln_bench_parse_args(argc, argv, &o, &err)) { usage; exit 2; }
 *
 * Defaults follow the protocol: latency mode n = 20 after 3
 * warm-ups; throughput mode 3 repeats of 32 images at concurrency 4, 8 and
 * 16; 1024x1024, PNG, the server's default steps and model.  Pointers in
 * the options point into argv.  Thread-safe (no global state).
 */
#ifndef KILN_BENCH_ARGS_H
#define KILN_BENCH_ARGS_H

#include "common/error.h"

#define KILN_BENCH_MAX_CONC 16

typedef struct kiln_bench_opts {
    const char *url;          /* --url, default http://127.0.0.1:8000 */
    const char *model;        /* --model, NULL: the server's default */
    int width, height;        /* --size WxH */
    int steps;                /* --steps, 0: the server's default */
    const char *format;       /* --format png|jpeg|webp */
    const char *prompts;      /* --prompts FILE, NULL: the built-in list's path */
    int latency, throughput;  /* --mode latency|throughput|both */
    int warmup;               /* --warmup */
    int n_latency;            /* --requests (latency mode) */
    int conc[KILN_BENCH_MAX_CONC], n_conc; /* --concurrency 4,8,16 */
    int images;               /* --images per throughput repeat */
    int repeats;              /* --repeats */
    double timeout_s;         /* --timeout per request */
    double wait_ready_s;      /* --wait-ready: poll /readyz this long first, 0: no */
    const char *json;         /* --json FILE ("-" for stdout), NULL: none */
    const char *label;        /* --label, copied into the JSON */
    int help;                 /* --help was given */
} kiln_bench_opts;

/* Fills o (defaults first).  KILN_ERR_INVALID with a message naming the
 * option for anything unknown, missing or out of range. */
kiln_status kiln_bench_parse_args(int argc, char **argv, kiln_bench_opts *o, kiln_err *err);

/* The usage text. */
const char *kiln_bench_usage(void);

/* Option values shared with kiln-soak: seconds (0..86400, a decimal) and
 * "WxH" (16..16384 each).  0, or -1 for anything else. */
int kiln_bench_parse_seconds(const char *s, double *out);
int kiln_bench_parse_size(const char *s, int *w, int *h);

/* The command-line walk shared with kiln-soak: every option is
 * "--name value".  Takes argv[*i] (and its value, moving *i past it):
 * *help = 1 for --help or -h (*name, *value unset); else *name and *value.
 * KILN_ERR_INVALID for a word that is not an option or an option with no
 * value. */
kiln_status kiln_bench_next_opt(int argc, char **argv, int *i, const char **name,
                                const char **value, int *help, kiln_err *err);

#endif

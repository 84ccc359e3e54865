/* kiln-soak command line: mixed traffic against a running kiln service for
 * a while, with replica faults on the way (tools/bench/soak_run.h says what
 * a run does).
 *
 *   kiln_soak_opts o;
 *   if (kiln_soak_parse_args(argc, argv, &o, &err)) { usage; exit 2; }
 *
 * Defaults are the GPU soak's (docs/OPERATIONS.md, "Soak"): sizes 256..2048,
 * n 1..4, 15% edits with 1..4 references, png/jpeg/webp, 5% of clients
 * leaving mid-request, concurrency 8; with --serve-pid, a denoiser killed at
 * a third of the run and one stopped for 30 s at two thirds.  Pointers in
 * the options point into argv (the stage names are copies).  Thread-safe (no global state).
 */
#ifndef KILN_SOAK_OPTS_H
#define KILN_SOAK_OPTS_H

#include <stdint.h>
#include <sys/types.h>

#include "common/error.h"

#define KILN_SOAK_MAX_ARGS 16

typedef struct kiln_soak_opts {
    const char *url;          /* --url, default http://127.0.0.1:8000 */
    double duration_s;        /* --duration SECONDS (or --minutes M) */
    int concurrency;          /* --concurrency, default 8 */
    uint64_t seed;            /* --seed: the whole traffic follows from it */
    int min_side, max_side;   /* --min-side 256, --max-side 2048 (multiples of 16) */
    int max_n;                /* --max-n 4 */
    int steps;                /* --steps, 0: the server's default */
    int max_seq;              /* --max-sequence-length, 0: the server's default */
    double edits;             /* --edits: the share of edit requests, 0.15 */
    int max_refs;             /* --max-refs 4 */
    double disconnects;       /* --disconnects: clients that leave mid-request, 0.05 */
    double disconnect_max_s;  /* --disconnect-max-s: they leave within this, 2 */
    int pool;                 /* --pool N: requests are drawn from N distinct ones; 0: all new */
    const char *prompts;      /* --prompts FILE, NULL: the bench's list */
    int first_w, first_h;     /* --first WxH: one generation of that size before the traffic */
    pid_t serve_pid;          /* --serve-pid: `kiln serve`, whose children are sampled and faulted */
    char kill_stage[16];      /* --kill STAGE@SECONDS ("none": no kill, "" here) */
    double kill_at_s;         /*   negative: a third of the duration */
    char stop_stage[16];      /* --stop STAGE@SECONDS+SECONDS ("none": no stop, "" here) */
    double stop_at_s;         /*   negative: two thirds of the duration */
    double stop_for_s;        /*   default 30 */
    double heal_grace_s;      /* --heal-grace: 503s allowed this long after a fault healed, 10 */
    double sample_s;          /* --sample: memory sampling period, 1 s */
    double warmup_s;          /* --warmup: memory judged from then (and from a process's
                                 start + this), default a fifth of the duration */
    double max_rss_growth_mb; /* --max-rss-growth-mb: RssAnon growth allowed per process, 256 */
    double max_gpu_growth_mb; /* --max-gpu-growth-mb: GPU memory growth per process, 1024 */
    const char *verify_kiln;  /* --verify KILN: check every image against `KILN generate/edit` */
    const char *verify_model; /* --verify-model DIR */
    const char *verify_args[KILN_SOAK_MAX_ARGS]; /* --verify-arg ARG (repeatable) */
    int n_verify_args;
    const char *verify_cache; /* --verify-cache DIR: the CLI's images, kept between runs */
    const char *out_dir;      /* --out DIR: summary.json, samples.csv, requests.csv, memory.png */
    double timeout_s;         /* --timeout per request, 600 */
    double wait_ready_s;      /* --wait-ready, 300 */
    const char *label;        /* --label, copied into the JSON */
    int help;
} kiln_soak_opts;

/* Fills o (defaults first).  KILN_ERR_INVALID with a message naming the
 * option for anything unknown, missing or out of range. */
kiln_status kiln_soak_parse_args(int argc, char **argv, kiln_soak_opts *o, kiln_err *err);

/* The usage text. */
const char *kiln_soak_usage(void);

/* "kiln-encoder", "kiln-denoiser", "kiln-decoder" for "encode(r)",
 * "denoise(r)", "decode(r)"; NULL otherwise. */
const char *kiln_soak_stage_binary(const char *stage);

#endif

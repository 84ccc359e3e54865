/* kiln-stagebench: a checkpoint's pipeline stages in one process, loaded once
 * and timed in steady state, for the speed work: where does the time of one
 * image go before HTTP, queues and transports are added (kiln-bench measures
 * those through the gateway).
 *
 *   kiln-stagebench --model DIR [--device cuda] [--gpu N] [--size 1024x1024]
 *                   [--steps S] [--iters 5] [--warmup 1] [--prompts FILE]
 *                   [--text-encoder-out-layers A,B,C] [--precision exact|fp8]
 *
 * Per iteration (B = 1, prompt i of the list, seed i, resolved as the CLI
 * and the service resolve a request (engine/plan.h): the checkpoint's
 * default steps unless --steps, its default guidance, CFG when the plan
 * runs it): encode (tokenizer +
 * Qwen3 up to the deepest layer used), denoise (noise, scheduler and the DiT
 * loop), decode (VAE, 8-bit conversion, download) and PNG encoding with the
 * default options, each between backend syncs on a host clock.  The denoise
 * loop also runs with 1 step, so that one step's time and the loop's fixed
 * cost separate: step = (T(steps) - T(1)) / (steps - 1).  Prints medians
 * and, on a GPU, the device memory each loading step and the first image
 * added; exit status 1 when a stage fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_run.h"
#include "bench_stats.h"
#include "common/checkpoint.h"
#include "common/image.h"
#include "common/log.h"
#include "engine/decode_stage.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "engine/family.h"
#include "engine/plan.h"

#ifndef KILN_BENCH_PROMPTS
#define KILN_BENCH_PROMPTS "tools/bench/prompts.txt"
#endif

enum { T_ENCODE, T_DENOISE, T_DENOISE1, T_DECODE, T_PNG, T_COUNT };
static const char *const t_names[T_COUNT] = {"encode", "denoise", "denoise (1 step)", "decode",
                                             "png"};

typedef struct opts {
    const char *model, *device, *prompts;
    int gpu, width, height, steps, iters, warmup;
    kiln_encode_opts enc; /* --text-encoder-out-layers, for tiny checkpoints */
    kiln_precision precision; /* --precision (engine/denoise_stage.h) */
} opts;

static int parse(int argc, char **argv, opts *o)
{
    /* steps 0: the checkpoint's default (its traits) */
    *o = (opts){NULL, "cuda", KILN_BENCH_PROMPTS, 0, 1024, 1024, 0, 5, 1, KILN_ENCODE_DEFAULTS,
                KILN_PRECISION_EXACT};
    o->enc.with_references = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            return -1;
        const char *a = argv[i], *v = argv[++i];
        char *end;
        long n = strtol(v, &end, 10);
        int num = *v && !*end && n >= 0 && n <= 100000;
        if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--device"))
            o->device = v;
        else if (!strcmp(a, "--prompts"))
            o->prompts = v;
        else if (!strcmp(a, "--precision")) {
            if (kiln_precision_parse(v, &o->precision))
                return -1;
        }
        else if (!strcmp(a, "--gpu") && num)
            o->gpu = (int)n;
        else if (!strcmp(a, "--steps") && num && n >= 2)
            o->steps = (int)n;
        else if (!strcmp(a, "--iters") && num && n >= 1 && n <= 1000)
            o->iters = (int)n;
        else if (!strcmp(a, "--warmup") && num)
            o->warmup = (int)n;
        else if (!strcmp(a, "--text-encoder-out-layers")) {
            char *tok = (char *)v, *e;
            for (o->enc.n_out_layers = 0; *tok && o->enc.n_out_layers < KILN_MAX_OUT_LAYERS;) {
                o->enc.out_layers[o->enc.n_out_layers++] = (int)strtol(tok, &e, 10);
                if (e == tok || (*e && *e != ','))
                    return -1;
                tok = *e ? e + 1 : e;
            }
            if (*tok)
                return -1;
        } else if (!strcmp(a, "--size")) {
            if (sscanf(v, "%dx%d", &o->width, &o->height) != 2 || o->width < 64 ||
                o->height < 64 || o->width % 16 || o->height % 16)
                return -1;
        } else
            return -1;
    }
    return o->model ? 0 : -1;
}

/* Device memory in use after each loading step and after the first image
 * (the activation arenas and library workspaces a request leaves behind),
 * for the memory breakdown of docs/PERFORMANCE.md.  Device-wide numbers:
 * exact while this is the only process on the GPU. */
enum { M_BACKEND, M_ENCODER, M_DIT, M_VAE, M_FIRST, M_COUNT };
static const char *const m_names[M_COUNT] = {
    "backend created (CUDA context, handles, workspace)", "+ text encoder weights",
    "+ DiT weights", "+ VAE decoder weights", "+ first image (arenas, workspaces)"};

typedef struct stages {
    kiln_checkpoint *ck;
    kiln_model_traits traits;
    int steps; /* as the plans resolve them */
    kiln_backend *be;
    kiln_encode_stage *enc;
    kiln_denoise_stage *den;
    kiln_decode_stage *dec;
    size_t mem[M_COUNT]; /* device bytes in use; 0 = not known */
} stages;

static void mem_mark(stages *s, int at)
{
    size_t used = 0, total = 0;
    kiln_err err = {0};
    if (s->be && !kiln_backend_mem_info(s->be, &used, &total, &err))
        s->mem[at] = used;
}

static void mem_report(const stages *s)
{
    if (!s->mem[M_FIRST])
        return;
    printf("  GPU memory in use on the device (cudaMemGetInfo), GiB:\n");
    for (int k = 0; k < M_COUNT; k++)
        printf("    %-52s %7.2f (%+.2f)\n", m_names[k], s->mem[k] / 1073741824.0,
               k ? ((double)s->mem[k] - (double)s->mem[k - 1]) / 1073741824.0 : 0.0);
}

static void stages_free(stages *s)
{
    kiln_encode_stage_destroy(s->enc);
    kiln_denoise_stage_destroy(s->den);
    kiln_decode_stage_destroy(s->dec);
    kiln_backend_destroy(s->be);
    kiln_checkpoint_close(s->ck);
}

static kiln_status load(stages *s, const opts *o, kiln_err *err)
{
    if (!(s->ck = kiln_checkpoint_open(o->model, err)) ||
        !(s->be = kiln_backend_create(o->device, o->gpu, err)))
        return err->code;
    s->traits = kiln_model_traits_of(s->ck);
    mem_mark(s, M_BACKEND);
    if (!(s->enc = kiln_encode_stage_create(s->be, s->ck, &o->enc, err)))
        return err->code;
    mem_mark(s, M_ENCODER);
    if (!(s->den = kiln_denoise_stage_create_at(s->be, s->ck, o->precision, err)))
        return err->code;
    mem_mark(s, M_DIT);
    if (!(s->dec = kiln_decode_stage_create(s->be, s->ck, err)))
        return err->code;
    mem_mark(s, M_VAE);
    return KILN_OK;
}

/* One image through every stage; t[] gets milliseconds. */
static kiln_status one_image(stages *s, const opts *o, const char *prompt, uint64_t seed,
                             double t[T_COUNT], kiln_err *err)
{
    kiln_backend *be = s->be;
    kiln_request q;
    kiln_request_init(&q);
    q.prompt = prompt, q.seed = seed, q.width = o->width, q.height = o->height, q.steps = o->steps;
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_plan plan;
    if (kiln_plan_make(&plan, &q, NULL, 1, &s->traits, &lim, err))
        return err->code;
    if (plan.req.steps < 2)
        return kiln_err_set(err, KILN_ERR_INVALID, "the step time needs 2 steps or more");
    s->steps = plan.req.steps;
    kiln_tensor emb = {0}, neg = {0}, lat = {0}, lat1 = {0};
    kiln_image img = {0};
    kiln_buf png = {0};
    kiln_image_encode_opts eo = KILN_IMAGE_ENCODE_DEFAULTS;
    int len = 0, neg_len = 0; /* real tokens: Z-Image's DiT reads those rows */
    uint64_t row_seed = kiln_plan_row_seed(&plan, 0);
    kiln_denoise_job job = {.B = 1, .embeds = &emb, .neg_embeds = plan.cfg ? &neg : NULL,
                            .txt_len = &len, .neg_len = &neg_len, .width = plan.req.width,
                            .height = plan.req.height, .steps = plan.req.steps,
                            .guidance = plan.req.guidance, .seeds = &row_seed};
    double t0 = kiln_now_ms();
    kiln_status st = kiln_encode_prompts(s->enc, &prompt, 1, plan.req.max_sequence_length, &emb,
                                         NULL, &len, err);
    if (!st && plan.cfg)
        st = kiln_encode_prompts(s->enc, &plan.negative, 1, plan.req.max_sequence_length, &neg,
                                 NULL, &neg_len, err);
    if (!st) {
        kiln_be_sync(be);
        st = kiln_be_check(be, err);
    }
    double t1 = kiln_now_ms();
    if (!st && !(st = kiln_denoise_run(s->den, &job, &lat, err))) {
        kiln_be_sync(be);
        st = kiln_be_check(be, err);
    }
    double t2 = kiln_now_ms();
    job.steps = 1;
    if (!st && !(st = kiln_denoise_run(s->den, &job, &lat1, err))) {
        kiln_be_sync(be);
        st = kiln_be_check(be, err);
    }
    double t3 = kiln_now_ms();
    if (!st)
        st = kiln_decode_run(s->dec, &lat, o->width, o->height, &img, NULL, err);
    double t4 = kiln_now_ms();
    if (!st)
        st = kiln_image_encode(&img, &eo, &png, err);
    double t5 = kiln_now_ms();
    t[T_ENCODE] = t1 - t0, t[T_DENOISE] = t2 - t1, t[T_DENOISE1] = t3 - t2;
    t[T_DECODE] = t4 - t3, t[T_PNG] = t5 - t4;
    kiln_be_free(be, &emb);
    kiln_be_free(be, &neg);
    kiln_be_free(be, &lat);
    kiln_be_free(be, &lat1);
    kiln_image_free(&img);
    kiln_buf_free(&png);
    return st;
}

int main(int argc, char **argv)
{
    opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: kiln-stagebench --model DIR [--device cuda|cpu] [--gpu N]\n"
                        "  [--size WxH] [--steps N>=2 (the model's default)] [--iters N]\n"
                        "  [--warmup N] [--prompts FILE]\n"
                        "  [--text-encoder-out-layers A,B,C] [--precision exact|fp8]\n");
        return 2;
    }
    kiln_err err = {0};
    kiln_bench_prompts p;
    stages s = {0};
    double t_load = kiln_now_ms();
    if (kiln_bench_prompts_load(o.prompts, &p, &err) || load(&s, &o, &err)) {
        fprintf(stderr, "kiln-stagebench: %s\n", err.msg);
        stages_free(&s);
        return 1;
    }
    t_load = kiln_now_ms() - t_load;
    double *t = calloc((size_t)o.iters * T_COUNT, sizeof *t);
    int rc = !t;
    for (int i = 0; !rc && i < o.warmup + o.iters; i++) {
        double tt[T_COUNT] = {0};
        uint64_t idx = (uint64_t)i % p.n;
        if (one_image(&s, &o, p.v[idx], idx, tt, &err)) {
            fprintf(stderr, "kiln-stagebench: %s\n", err.msg);
            rc = 1;
        } else {
            if (i == 0)
                mem_mark(&s, M_FIRST);
            if (i < o.warmup)
                continue;
            for (int k = 0; k < T_COUNT; k++)
                t[(size_t)k * (size_t)o.iters + (size_t)(i - o.warmup)] = tt[k];
        }
    }
    if (!rc) {
        double med[T_COUNT];
        for (int k = 0; k < T_COUNT; k++)
            med[k] = kiln_bench_median(t + (size_t)k * (size_t)o.iters, (size_t)o.iters);
        double step = (med[T_DENOISE] - med[T_DENOISE1]) / (s.steps - 1);
        printf("kiln-stagebench %s (%s) on %s, %s, %dx%d, %d steps, B=1: median of %d after %d "
               "warm-up(s); load %.0f ms\n",
               o.model, s.traits.family, o.device, kiln_precision_name(o.precision), o.width,
               o.height, s.steps, o.iters, o.warmup, t_load);
        for (int k = 0; k < T_COUNT; k++)
            printf("  %-28s %9.2f ms\n", t_names[k], med[k]);
        printf("  %-28s %9.2f ms\n", "one denoise step", step);
        printf("  %-28s %9.2f ms\n", "denoise fixed cost", med[T_DENOISE1] - step);
        printf("  %-28s %9.2f ms\n", "pipeline (enc+den+dec+png)",
               med[T_ENCODE] + med[T_DENOISE] + med[T_DECODE] + med[T_PNG]);
        mem_report(&s);
    }
    free(t);
    kiln_bench_prompts_free(&p);
    stages_free(&s);
    return rc;
}

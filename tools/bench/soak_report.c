#include "soak_report.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "bench_stats.h"
#include "soak_plot.h"

void kiln_soak_judge(const kiln_soak_run *run, const kiln_soak_opts *o, kiln_soak_verdict *vd)
{
    memset(vd, 0, sizeof *vd);
    double *lat = malloc((run->n_rec ? run->n_rec : 1) * sizeof *lat);
    size_t n = 0;
    for (size_t i = 0; lat && i < run->n_rec; i++)
        if (run->rec[i].status == 200)
            lat[n++] = run->rec[i].t1 - run->rec[i].t0;
    if (lat && n) {
        vd->p50 = kiln_bench_percentile(lat, n, 50);
        vd->p95 = kiln_bench_percentile(lat, n, 95);
        vd->p99 = kiln_bench_percentile(lat, n, 99);
        vd->max = lat[n - 1]; /* sorted by the percentile calls */
    }
    free(lat);
    if (run->mem) {
        size_t ns;
        const kiln_soak_sample *s = kiln_soak_mem_samples(run->mem, &ns);
        vd->n_growth = kiln_soak_mem_growth(s, ns, o->warmup_s, run->mem_end_s,
                                            o->max_rss_growth_mb, o->max_gpu_growth_mb,
                                            &vd->growth);
        for (size_t i = 0; i < vd->n_growth; i++)
            vd->mem_over += vd->growth[i].over;
    }
    for (int i = 0; i < run->n_faults; i++)
        vd->faults_unhealed += !run->faults[i].pid || run->faults[i].healed_s < 0;
    vd->first_failed = o->first_w && run->first_status != 200;
    vd->pass = run->requests > 0 && !run->unexpected && !run->wrong && !run->bad &&
               !vd->mem_over && !vd->faults_unhealed && !vd->first_failed;
}

/* Statuses by code, ascending: fills codes/counts, returns how many. */
static int by_status(const kiln_soak_run *run, int *codes, long *counts, int cap)
{
    int n = 0;
    for (size_t i = 0; i < run->n_rec; i++) {
        int c = run->rec[i].status, j = 0;
        while (j < n && codes[j] != c)
            j++;
        if (j == n) {
            if (n == cap)
                continue;
            codes[n] = c, counts[n++] = 0;
        }
        counts[j]++;
    }
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && codes[j] < codes[j - 1]; j--) {
            int c = codes[j];
            long k = counts[j];
            codes[j] = codes[j - 1], counts[j] = counts[j - 1];
            codes[j - 1] = c, counts[j - 1] = k;
        }
    return n;
}

static const char *status_name(int c)
{
    return c == KILN_SOAK_LEFT ? "left" : c == KILN_SOAK_NO_ANSWER ? "no answer" : NULL;
}

void kiln_soak_report_text(FILE *f, const kiln_soak_run *run, const kiln_soak_opts *o,
                           const kiln_soak_verdict *vd)
{
    fprintf(f, "kiln-soak: %.0f s of traffic (%.1f s with the last answers) at concurrency %d, "
            "seed %llu, sides %d..%d, n 1..%d\n",
            o->duration_s, run->wall_s, o->concurrency, (unsigned long long)o->seed,
            o->min_side, o->max_side, o->max_n);
    if (o->first_w)
        fprintf(f, "  first request %dx%d: HTTP %d in %.2f s %s\n", o->first_w, o->first_h,
                run->first_status, run->first_s, run->first_error);
    fprintf(f, "  requests %ld: answered %ld, clients left %ld, no answer %ld\n", run->requests,
            run->answered, run->left, run->no_answer);
    int codes[32];
    long counts[32];
    int nc = by_status(run, codes, counts, 32);
    fprintf(f, "  statuses:");
    for (int i = 0; i < nc; i++) {
        const char *name = status_name(codes[i]);
        if (name)
            fprintf(f, " %s %ld;", name, counts[i]);
        else
            fprintf(f, " %d: %ld;", codes[i], counts[i]);
    }
    fprintf(f, " 503s the faults allow: %ld\n", run->allowed_503);
    fprintf(f, "  images %ld (200s %ld): verified identical to the CLI %ld, wrong %ld, "
            "malformed answers %ld%s\n",
            run->images, run->ok, run->verified, run->wrong, run->bad,
            o->verify_kiln ? "" : " (no --verify)");
    fprintf(f, "  latency of the 200s: p50 %.3f s, p95 %.3f s, p99 %.3f s, max %.3f s\n", vd->p50,
            vd->p95, vd->p99, vd->max);
    for (int i = 0; i < run->n_faults; i++) {
        const kiln_soak_fault *x = &run->faults[i];
        if (!x->pid) {
            fprintf(f, "  %s %s: no replica found\n", x->what, x->stage);
            continue;
        }
        fprintf(f, "  %s %s pid %d at %.1f s%s", x->what, x->stage, (int)x->pid, x->at_s,
                x->what[0] == 's' ? "" : "");
        if (x->what[0] == 's')
            fprintf(f, ", SIGCONT at %.1f s", x->cont_s);
        if (x->healed_s >= 0)
            fprintf(f, ": healed at %.1f s (%.1f s after)\n", x->healed_s, x->healed_s - x->at_s);
        else
            fprintf(f, ": NOT healed\n");
    }
    if (run->mem) {
        fprintf(f, "  memory after the warm-up (%.0f s; RssAnon, GPU where sampled), bounds "
                "+%.0f / +%.0f MiB:\n",
                o->warmup_s, o->max_rss_growth_mb, o->max_gpu_growth_mb);
        for (size_t i = 0; i < vd->n_growth; i++) {
            const kiln_soak_growth *g = &vd->growth[i];
            fprintf(f, "    %-14s pid %-7d %6.1f-%6.1f s  ", g->name, (int)g->pid, g->first_t,
                    g->last_t);
            if (!g->judged) {
                fprintf(f, "peak %.1f MiB", g->peak_mb);
                if (g->gpu_peak_mb >= 0)
                    fprintf(f, ", GPU %.0f MiB", g->gpu_peak_mb);
                fprintf(f, " (not judged: restarted or gone)\n");
                continue;
            }
            if (g->base_mb >= 0)
                fprintf(f, "%.1f -> %.1f MiB (%+.1f), peak %.1f", g->base_mb, g->end_mb,
                        g->end_mb - g->base_mb, g->peak_mb);
            else
                fprintf(f, "(nvidia-smi's pid, GPU only)");
            if (g->gpu_base_mb >= 0)
                fprintf(f, "; GPU %.0f -> %.0f MiB (%+.0f), peak %.0f", g->gpu_base_mb,
                        g->gpu_end_mb, g->gpu_end_mb - g->gpu_base_mb, g->gpu_peak_mb);
            fprintf(f, "%s", g->over ? "  OVER THE BOUND" : "");
            if (g->refilled)
                fprintf(f, "  (refilled to under its stage's earlier peak: %.1f MiB, GPU %.0f)",
                        g->reach_mb, g->gpu_reach_mb);
            fprintf(f, "\n");
        }
    }
    for (int i = 0; i < run->n_errors; i++)
        fprintf(f, "  error: %s\n", run->errors[i]);
    fprintf(f, "kiln-soak: %s (%ld unexpected answers, %ld wrong images, %ld malformed, "
            "%d memory over bound, %d faults not healed)\n",
            vd->pass ? "PASS" : "FAIL", run->unexpected, run->wrong, run->bad, vd->mem_over,
            vd->faults_unhealed);
}

/* --- files --------------------------------------------------------------- */

static cJSON *summary_json(const kiln_soak_run *run, const kiln_soak_opts *o,
                           const kiln_soak_verdict *vd)
{
    cJSON *j = cJSON_CreateObject(), *opt = cJSON_AddObjectToObject(j, "options");
    if (o->label)
        cJSON_AddStringToObject(j, "label", o->label);
    cJSON_AddStringToObject(opt, "url", o->url);
    cJSON_AddNumberToObject(opt, "duration_s", o->duration_s);
    cJSON_AddNumberToObject(opt, "concurrency", o->concurrency);
    cJSON_AddNumberToObject(opt, "seed", (double)o->seed);
    cJSON_AddNumberToObject(opt, "min_side", o->min_side);
    cJSON_AddNumberToObject(opt, "max_side", o->max_side);
    cJSON_AddNumberToObject(opt, "max_n", o->max_n);
    cJSON_AddNumberToObject(opt, "steps", o->steps);
    cJSON_AddNumberToObject(opt, "edits", o->edits);
    cJSON_AddNumberToObject(opt, "max_refs", o->max_refs);
    cJSON_AddNumberToObject(opt, "disconnects", o->disconnects);
    cJSON_AddNumberToObject(opt, "pool", o->pool);
    cJSON_AddBoolToObject(opt, "verify", o->verify_kiln != NULL);
    cJSON_AddNumberToObject(opt, "warmup_s", o->warmup_s);
    cJSON_AddNumberToObject(j, "wall_s", run->wall_s);
    if (o->first_w) {
        cJSON *fr = cJSON_AddObjectToObject(j, "first");
        char size[32];
        snprintf(size, sizeof size, "%dx%d", o->first_w, o->first_h);
        cJSON_AddStringToObject(fr, "size", size);
        cJSON_AddNumberToObject(fr, "status", run->first_status);
        cJSON_AddNumberToObject(fr, "seconds", run->first_s);
    }
    cJSON_AddNumberToObject(j, "requests", (double)run->requests);
    cJSON_AddNumberToObject(j, "answered", (double)run->answered);
    cJSON_AddNumberToObject(j, "left", (double)run->left);
    cJSON_AddNumberToObject(j, "no_answer", (double)run->no_answer);
    cJSON *st = cJSON_AddObjectToObject(j, "statuses");
    int codes[32];
    long counts[32];
    int nc = by_status(run, codes, counts, 32);
    for (int i = 0; i < nc; i++) {
        char k[16];
        snprintf(k, sizeof k, "%d", codes[i]);
        cJSON_AddNumberToObject(st, status_name(codes[i]) ? status_name(codes[i]) : k,
                                (double)counts[i]);
    }
    cJSON_AddNumberToObject(j, "allowed_503", (double)run->allowed_503);
    cJSON_AddNumberToObject(j, "unexpected", (double)run->unexpected);
    cJSON_AddNumberToObject(j, "images", (double)run->images);
    cJSON_AddNumberToObject(j, "verified", (double)run->verified);
    cJSON_AddNumberToObject(j, "wrong", (double)run->wrong);
    cJSON_AddNumberToObject(j, "malformed", (double)run->bad);
    cJSON *lat = cJSON_AddObjectToObject(j, "latency_s");
    cJSON_AddNumberToObject(lat, "p50", vd->p50);
    cJSON_AddNumberToObject(lat, "p95", vd->p95);
    cJSON_AddNumberToObject(lat, "p99", vd->p99);
    cJSON_AddNumberToObject(lat, "max", vd->max);
    cJSON *fa = cJSON_AddArrayToObject(j, "faults");
    for (int i = 0; i < run->n_faults; i++) {
        const kiln_soak_fault *x = &run->faults[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "what", x->what);
        cJSON_AddStringToObject(e, "stage", x->stage);
        cJSON_AddNumberToObject(e, "pid", x->pid);
        cJSON_AddNumberToObject(e, "at_s", x->at_s);
        if (x->what[0] == 's')
            cJSON_AddNumberToObject(e, "cont_s", x->cont_s);
        cJSON_AddNumberToObject(e, "replicas_before", x->before);
        if (x->healed_s >= 0)
            cJSON_AddNumberToObject(e, "healed_s", x->healed_s);
        else
            cJSON_AddNullToObject(e, "healed_s");
        cJSON_AddItemToArray(fa, e);
    }
    cJSON *mem = cJSON_AddArrayToObject(j, "memory");
    for (size_t i = 0; i < vd->n_growth; i++) {
        const kiln_soak_growth *g = &vd->growth[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "process", g->name);
        cJSON_AddNumberToObject(e, "pid", g->pid);
        cJSON_AddNumberToObject(e, "first_s", g->first_t);
        cJSON_AddNumberToObject(e, "last_s", g->last_t);
        cJSON_AddBoolToObject(e, "judged", g->judged);
        cJSON_AddNumberToObject(e, "rss_anon_peak_mb", g->peak_mb);
        if (g->judged && g->base_mb >= 0) {
            cJSON_AddNumberToObject(e, "rss_anon_base_mb", g->base_mb);
            cJSON_AddNumberToObject(e, "rss_anon_end_mb", g->end_mb);
            cJSON_AddNumberToObject(e, "rss_anon_growth_mb", g->end_mb - g->base_mb);
        }
        if (g->gpu_peak_mb >= 0)
            cJSON_AddNumberToObject(e, "gpu_peak_mb", g->gpu_peak_mb);
        if (g->judged && g->gpu_base_mb >= 0) {
            cJSON_AddNumberToObject(e, "gpu_base_mb", g->gpu_base_mb);
            cJSON_AddNumberToObject(e, "gpu_end_mb", g->gpu_end_mb);
            cJSON_AddNumberToObject(e, "gpu_growth_mb", g->gpu_end_mb - g->gpu_base_mb);
        }
        if (g->reach_mb >= 0)
            cJSON_AddNumberToObject(e, "rss_anon_stage_earlier_peak_mb", g->reach_mb);
        if (g->gpu_reach_mb >= 0)
            cJSON_AddNumberToObject(e, "gpu_stage_earlier_peak_mb", g->gpu_reach_mb);
        cJSON_AddBoolToObject(e, "over", g->over);
        cJSON_AddBoolToObject(e, "refilled", g->refilled);
        cJSON_AddItemToArray(mem, e);
    }
    cJSON_AddNumberToObject(j, "memory_over", vd->mem_over);
    cJSON_AddNumberToObject(j, "faults_unhealed", vd->faults_unhealed);
    cJSON *errs = cJSON_AddArrayToObject(j, "errors");
    for (int i = 0; i < run->n_errors; i++)
        cJSON_AddItemToArray(errs, cJSON_CreateString(run->errors[i]));
    cJSON_AddBoolToObject(j, "pass", vd->pass);
    return j;
}

static kiln_status open_out(const char *dir, const char *name, FILE **f, kiln_err *err)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (!(*f = fopen(path, "w")))
        return kiln_err_set(err, KILN_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return KILN_OK;
}

static kiln_status close_out(FILE *f, const char *name, kiln_err *err)
{
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? kiln_err_set(err, KILN_ERR_IO, "cannot write %s", name) : KILN_OK;
}

/* RssAnon (and GPU) per process as lines, faults and the warm-up as marks. */
static kiln_status plot(const char *dir, const kiln_soak_run *run, const kiln_soak_opts *o,
                        kiln_err *err)
{
    size_t ns;
    const kiln_soak_sample *s = kiln_soak_mem_samples(run->mem, &ns);
    pid_t pids[64];
    char labels[64][48];
    size_t np = 0;
    for (size_t i = 0; i < ns; i++) {
        size_t j = 0;
        while (j < np && pids[j] != s[i].pid)
            j++;
        if (j == np && np < 64) {
            pids[np] = s[i].pid;
            snprintf(labels[np++], sizeof labels[0], "%s %d",
                     strncmp(s[i].name, "kiln-", 5) ? s[i].name : s[i].name + 5, (int)s[i].pid);
        }
    }
    double *x = malloc(2 * (ns ? ns : 1) * sizeof *x), *y = x ? x + ns : NULL;
    double *gx = malloc(2 * (ns ? ns : 1) * sizeof *gx), *gy = gx ? gx + ns : NULL;
    kiln_plot_series rs[64], gs[64];
    size_t nr = 0, ng = 0, off = 0, goff = 0;
    for (size_t p = 0; x && gx && p < np; p++) {
        size_t a = off, ga = goff;
        for (size_t i = 0; i < ns; i++)
            if (s[i].pid == pids[p]) {
                if (s[i].anon_kb >= 0)
                    x[off] = s[i].t, y[off++] = (double)s[i].anon_kb / 1024.0;
                if (s[i].gpu_mib >= 0)
                    gx[goff] = s[i].t, gy[goff++] = (double)s[i].gpu_mib;
            }
        if (off > a)
            rs[nr++] = (kiln_plot_series){labels[p], x + a, y + a, off - a};
        if (goff > ga)
            gs[ng++] = (kiln_plot_series){labels[p], gx + ga, gy + ga, goff - ga};
    }
    kiln_plot_mark marks[8];
    char ml[8][32];
    size_t nm = 0;
    snprintf(ml[nm], 32, "warm-up end");
    marks[nm] = (kiln_plot_mark){ml[nm], o->warmup_s}, nm++;
    for (int i = 0; i < run->n_faults; i++) {
        const kiln_soak_fault *f = &run->faults[i];
        snprintf(ml[nm], 32, "%s %s", f->what, f->stage);
        marks[nm] = (kiln_plot_mark){ml[nm], f->at_s}, nm++;
        if (f->healed_s >= 0) {
            snprintf(ml[nm], 32, "healed");
            marks[nm] = (kiln_plot_mark){ml[nm], f->healed_s}, nm++;
        }
    }
    kiln_status st = KILN_OK;
    int panel = 520, h = ng ? 2 * panel : panel;
    kiln_plot *pl = x && gx ? kiln_plot_new(1400, h, err) : NULL;
    if (!x || !gx)
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    else if (!pl)
        st = err->code;
    if (!st) {
        kiln_plot_panel(pl, 0, panel, "RssAnon per process (MiB)", "seconds", rs, nr, marks, nm);
        if (ng)
            kiln_plot_panel(pl, panel, panel, "GPU memory per process (MiB, nvidia-smi)",
                            "seconds", gs, ng, marks, nm);
        char path[1024];
        snprintf(path, sizeof path, "%s/memory.png", dir);
        st = kiln_plot_write(pl, path, err);
    }
    kiln_plot_free(pl);
    free(x);
    free(gx);
    return st;
}

kiln_status kiln_soak_report_files(const char *dir, const kiln_soak_run *run,
                                   const kiln_soak_opts *o, const kiln_soak_verdict *vd,
                                   kiln_err *err)
{
    if (mkdir(dir, 0755) && errno != EEXIST)
        return kiln_err_set(err, KILN_ERR_IO, "cannot make %s: %s", dir, strerror(errno));
    cJSON *j = summary_json(run, o, vd);
    char *text = j ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!text)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    FILE *f;
    kiln_status st = open_out(dir, "summary.json", &f, err);
    if (!st) {
        fprintf(f, "%s\n", text);
        st = close_out(f, "summary.json", err);
    }
    cJSON_free(text);
    if (!st && !(st = open_out(dir, "requests.csv", &f, err))) {
        fprintf(f, "k,t0_s,t1_s,status,kind,width,height,n,refs,format,verified,wrong,malformed,"
                   "unexpected\n");
        for (size_t i = 0; i < run->n_rec; i++) {
            const kiln_soak_record *r = &run->rec[i];
            fprintf(f, "%llu,%.3f,%.3f,%d,%s,%d,%d,%d,%d,%s,%d,%d,%d,%d\n",
                    (unsigned long long)r->k, r->t0, r->t1, r->status,
                    r->edit ? "edit" : "generation", r->width, r->height, r->n, r->n_refs,
                    kiln_image_format_name(r->format), r->verified, r->wrong, r->bad,
                    r->unexpected);
        }
        st = close_out(f, "requests.csv", err);
    }
    if (!st && run->mem && !(st = open_out(dir, "samples.csv", &f, err))) {
        size_t ns;
        const kiln_soak_sample *s = kiln_soak_mem_samples(run->mem, &ns);
        fprintf(f, "t_s,pid,process,rss_kb,rss_anon_kb,gpu_mib\n");
        for (size_t i = 0; i < ns; i++)
            fprintf(f, "%.2f,%d,%s,%ld,%ld,%ld\n", s[i].t, (int)s[i].pid, s[i].name, s[i].rss_kb,
                    s[i].anon_kb, s[i].gpu_mib);
        st = close_out(f, "samples.csv", err);
    }
    if (!st && run->mem)
        st = plot(dir, run, o, err);
    return st;
}

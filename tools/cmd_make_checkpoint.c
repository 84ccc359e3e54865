/* kiln make-checkpoint: writes a random-weight checkpoint in the published
 * diffusers layout (model_index.json, transformer/, text_encoder/, vae/,
 * scheduler/, tokenizer/) with the real tensor names and shapes, for tests
 * and benchmarks.  The tokenizer files are copied from the real Qwen3
 * tokenizer because the encoder needs the real vocabulary. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_arch.h"
#include "ckpt_presets.h"
#include "ckpt_write.h"
#include "commands.h"
#include "common/linkstub.h"

#ifndef KILN_DATA_DIR
#define KILN_DATA_DIR "data"
#endif

static const char *const tokenizer_files[] = {"vocab.json", "merges.txt",
                                              "tokenizer_config.json", "chat_template.jinja"};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kiln make-checkpoint --preset %s --out DIR [--seed N] [--tokenizer DIR]\n"
            "  Writes a random-weight checkpoint with the real layout, tensor names and shapes.\n"
            "  --tokenizer: folder with the Qwen3 vocab.json, merges.txt, tokenizer_config.json\n"
            "               and chat_template.jinja (default: the copy kiln ships in data/)\n",
            kiln_ckpt_preset_names());
}

/* The tokenizer copy kiln ships: the data/ folder of the source tree the
 * binary was built from; else, next to the executable, ../share/kiln (an
 * installation: `meson install`, the container images) or ../../data (a
 * build tree moved to another machine, e.g. the GPU host).  The first
 * that exists; the source tree's when none does (the error names it). */
static void default_tokenizer_dir(char *buf, size_t len)
{
    snprintf(buf, len, "%s/qwen3-tokenizer", KILN_DATA_DIR);
    if (access(buf, R_OK) == 0)
        return;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = '\0';
    static const char *const rel[] = {"../share/kiln/qwen3-tokenizer", "../../data/qwen3-tokenizer"};
    char try[PATH_MAX + 64];
    for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
        if (snprintf(try, sizeof try, "%s/%s", exe, rel[i]) >= (int)sizeof try)
            continue;
        if (access(try, R_OK) == 0 && strlen(try) < len) {
            snprintf(buf, len, "%s", try);
            return;
        }
    }
}

static kiln_status make_dir(const char *path, kiln_err *err)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return kiln_err_set(err, KILN_ERR_INVALID, "path too long");
    /* mkdir -p: create each parent in turn. */
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return kiln_err_set(err, KILN_ERR_IO, "cannot create %s: %s", buf,
                                    strerror(errno));
            *p = c;
            if (!c)
                break;
        }
    }
    return KILN_OK;
}

static kiln_status copy_file(const char *src_dir, const char *name, const char *dst_dir,
                             kiln_err *err)
{
    char src[PATH_MAX], real[PATH_MAX], dst[PATH_MAX];
    snprintf(src, sizeof src, "%s/%s", src_dir, name);
    snprintf(dst, sizeof dst, "%s/%s", dst_dir, name);
    if (kiln_linkstub_resolve(src, real, sizeof real) != 0)
        return kiln_err_set(err, KILN_ERR_INVALID, "path too long");
    FILE *in = fopen(real, "rb");
    if (!in)
        return kiln_err_set(err, KILN_ERR_NOT_FOUND,
                            "tokenizer file %s not found in %s (pass --tokenizer DIR)", name,
                            src_dir);
    FILE *out = fopen(dst, "wb");
    kiln_status rc = KILN_OK;
    if (!out) {
        rc = kiln_err_set(err, KILN_ERR_IO, "cannot create %s: %s", dst, strerror(errno));
    } else {
        char buf[1 << 16];
        size_t n;
        while (!rc && (n = fread(buf, 1, sizeof buf, in)) > 0)
            if (fwrite(buf, 1, n, out) != n)
                rc = kiln_err_set(err, KILN_ERR_IO, "writing %s failed", dst);
        if (!rc && ferror(in))
            rc = kiln_err_set(err, KILN_ERR_IO, "reading %s failed", src);
        if (fclose(out) != 0 && !rc)
            rc = kiln_err_set(err, KILN_ERR_IO, "writing %s failed", dst);
    }
    fclose(in);
    return rc;
}

static kiln_status write_config(const kiln_ckpt_preset *p, const char *what, const char *path,
                                kiln_err *err)
{
    cJSON *doc = kiln_ckpt_config(p, what);
    if (!doc)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory building %s", what);
    kiln_status rc = kiln_ckpt_write_json(path, doc, err);
    cJSON_Delete(doc);
    return rc;
}

/* One weight-bearing component: its folder, config and weights. */
static kiln_status write_component(const kiln_ckpt_preset *p, const char *out,
                                   const char *component, uint64_t seed, kiln_err *err)
{
    char dir[PATH_MAX], path[PATH_MAX + 32];
    snprintf(dir, sizeof dir, "%s/%s", out, component);
    kiln_status rc = make_dir(dir, err);
    if (rc)
        return rc;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((rc = write_config(p, component, path, err)))
        return rc;
    kiln_arch_list l = {0};
    const char *stem = "diffusion_pytorch_model";
    if (!strcmp(component, "text_encoder")) {
        kiln_arch_qwen3(&l, &p->text);
        stem = "model";
        snprintf(path, sizeof path, "%s/generation_config.json", dir);
        if (p->text.causal_lm && (rc = write_config(p, "text_encoder_generation", path, err)))
            return rc;
    } else if (!strcmp(component, "transformer")) {
        if (p->zimage)
            kiln_arch_zimage(&l, &p->zdit);
        else
            kiln_arch_flux2(&l, &p->flux2);
    } else {
        kiln_arch_vae(&l, &p->vae);
    }
    if (l.oom) {
        kiln_arch_list_free(&l);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc = kiln_ckpt_write_weights(dir, stem, &l, seed, KILN_CKPT_SHARD_BYTES, err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!rc)
        fprintf(stderr, "kiln make-checkpoint: %s: %zu tensors, %.3f GB in %.1f s\n", component,
                l.n, (double)kiln_arch_list_bytes(&l) / 1e9,
                (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    kiln_arch_list_free(&l);
    return rc;
}

static kiln_status make(const kiln_ckpt_preset *p, const char *out, uint64_t seed,
                        const char *tok_dir, kiln_err *err)
{
    char path[PATH_MAX + 64];
    kiln_status rc = make_dir(out, err);
    snprintf(path, sizeof path, "%s/model_index.json", out);
    if (rc || (rc = write_config(p, "model_index", path, err)))
        return rc;
    static const char *const weighted[] = {"transformer", "text_encoder", "vae"};
    for (int c = 0; c < 3; c++)
        if ((rc = write_component(p, out, weighted[c], seed + 0x9e3779b97f4a7c15ull * (c + 1),
                                  err)))
            return kiln_err_wrap(err, "%s", weighted[c]);
    snprintf(path, sizeof path, "%s/scheduler", out);
    if ((rc = make_dir(path, err)))
        return rc;
    snprintf(path, sizeof path, "%s/scheduler/scheduler_config.json", out);
    if ((rc = write_config(p, "scheduler", path, err)))
        return rc;
    snprintf(path, sizeof path, "%s/tokenizer", out);
    if ((rc = make_dir(path, err)))
        return rc;
    for (size_t i = 0; i < sizeof tokenizer_files / sizeof tokenizer_files[0]; i++)
        if ((rc = copy_file(tok_dir, tokenizer_files[i], path, err)))
            return rc;
    return KILN_OK;
}

int kiln_cmd_make_checkpoint(int argc, char **argv)
{
    const char *preset = NULL, *out = NULL, *tok = NULL;
    uint64_t seed = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            usage(stderr);
            return 2;
        }
        if (!strcmp(a, "--preset")) {
            preset = argv[++i];
        } else if (!strcmp(a, "--out")) {
            out = argv[++i];
        } else if (!strcmp(a, "--tokenizer")) {
            tok = argv[++i];
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            seed = strtoull(argv[++i], &end, 10);
            if (errno || *end || !*argv[i] || argv[i][0] == '-') {
                fprintf(stderr, "kiln make-checkpoint: --seed takes a non-negative integer\n");
                return 2;
            }
        } else {
            usage(stderr);
            return 2;
        }
    }
    const kiln_ckpt_preset *p = preset ? kiln_ckpt_preset_find(preset) : NULL;
    if (!p || !out) {
        if (preset && !p)
            fprintf(stderr, "kiln make-checkpoint: unknown preset '%s'\n", preset);
        usage(stderr);
        return 2;
    }
    char tok_default[PATH_MAX];
    if (!tok) {
        default_tokenizer_dir(tok_default, sizeof tok_default);
        tok = tok_default;
    }
    kiln_err err = {0};
    if (make(p, out, seed, tok, &err)) {
        fprintf(stderr, "kiln make-checkpoint: %s\n", err.msg);
        return 1;
    }
    return 0;
}

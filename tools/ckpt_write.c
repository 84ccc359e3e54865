#include "ckpt_write.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* Values are drawn as offset + scale * n with n approximately N(0, 1): the
 * Irwin-Hall sum of four random bytes, rescaled (mean 510, sd 147.8).  Its
 * 1021 possible sums are mapped to bf16 once per tensor, so generating a
 * multi-GB checkpoint costs one table lookup per element, and one 64-bit
 * draw feeds two elements.  Random weights only need the right scale. */
#define IH_LEVELS 1021

typedef struct fill_ctx {
    const kiln_arch_tensor *const *tensors; /* entry index -> tensor */
    uint64_t seed;
    uint64_t state;
    uint16_t table[IH_LEVELS];
} fill_ctx;

static void make_table(uint16_t *table, kiln_arch_init init)
{
    float offset = 0.0f, scale = 0.02f;
    int fold = 0;
    switch (init) {
    case KILN_INIT_WEIGHT:
    case KILN_INIT_BIAS: break;
    case KILN_INIT_NORM: offset = 1.0f, scale = 0.1f; break;
    case KILN_INIT_MEAN: scale = 0.1f; break;
    case KILN_INIT_VAR: offset = 1.0f, scale = 0.5f, fold = 1; break; /* always positive */
    case KILN_INIT_ZERO: scale = 0.0f; break;
    }
    for (int i = 0; i < IH_LEVELS; i++) {
        float n = ((float)i - 510.0f) * (1.0f / 147.80f);
        table[i] = kiln_f32_to_bf16(offset + scale * (fold && n < 0 ? -n : n));
    }
}

static kiln_status fill(void *vctx, size_t index, size_t offset, void *buf, size_t nbytes,
                        kiln_err *err)
{
    (void)err;
    fill_ctx *c = vctx;
    const kiln_arch_tensor *t = c->tensors[index];
    if (t->init == KILN_INIT_ZERO) {
        memset(buf, 0, nbytes);
        return KILN_OK;
    }
    if (offset == 0) {
        c->state = c->seed ^ fnv1a(t->name);
        make_table(c->table, t->init);
    }
    uint16_t *p = buf;
    size_t n = nbytes / 2;
    for (size_t i = 0; i < n; i += 2) {
        uint64_t r = splitmix64(&c->state);
        /* byte pairs summed in 16-bit lanes, then lanes pairwise */
        uint64_t s = (r & 0x00ff00ff00ff00ffull) + ((r >> 8) & 0x00ff00ff00ff00ffull);
        p[i] = c->table[(s & 0xffff) + ((s >> 16) & 0xffff)];
        if (i + 1 < n)
            p[i + 1] = c->table[((s >> 32) & 0xffff) + (s >> 48)];
    }
    return KILN_OK;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp((*(const kiln_arch_tensor *const *)a)->name,
                  (*(const kiln_arch_tensor *const *)b)->name);
}

static uint64_t tensor_bytes(const kiln_arch_tensor *t)
{
    uint64_t n = kiln_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

static kiln_status write_file(const char *path, const kiln_arch_tensor *const *ts, size_t n,
                              uint64_t seed, kiln_err *err)
{
    kiln_st_entry *e = calloc(n ? n : 1, sizeof *e);
    if (!e)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        e[i].name = ts[i]->name;
        e[i].dtype = ts[i]->dtype;
        e[i].ndim = ts[i]->ndim;
        memcpy(e[i].shape, ts[i]->shape, sizeof(int64_t) * (size_t)ts[i]->ndim);
    }
    fill_ctx ctx = {.tensors = ts, .seed = seed};
    kiln_status rc = kiln_st_write_stream(path, e, n, fill, &ctx, err);
    free(e);
    return rc;
}

kiln_status kiln_ckpt_write_json(const char *path, const cJSON *doc, kiln_err *err)
{
    char *text = cJSON_Print(doc);
    if (!text)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory printing %s", path);
    FILE *f = fopen(path, "wb");
    kiln_status rc = KILN_OK;
    if (!f || fputs(text, f) < 0 || fputc('\n', f) == EOF)
        rc = kiln_err_set(err, KILN_ERR_IO, "writing %s failed: %s", path, strerror(errno));
    if (f && fclose(f) != 0 && !rc)
        rc = kiln_err_set(err, KILN_ERR_IO, "writing %s failed: %s", path, strerror(errno));
    free(text);
    return rc;
}

static kiln_status write_index(const char *dir, const char *stem,
                               const kiln_arch_tensor *const *ts, const int *shard_of, size_t n,
                               int nshards, uint64_t total, kiln_err *err)
{
    cJSON *doc = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(doc, "metadata"),
          *wm = cJSON_AddObjectToObject(doc, "weight_map");
    int ok = doc && meta && wm && cJSON_AddNumberToObject(meta, "total_size", (double)total);
    char file[256], path[PATH_MAX];
    for (size_t i = 0; ok && i < n; i++) {
        snprintf(file, sizeof file, "%s-%05d-of-%05d.safetensors", stem, shard_of[i] + 1,
                 nshards);
        ok = cJSON_AddStringToObject(wm, ts[i]->name, file) != NULL;
    }
    kiln_status rc;
    if (!ok)
        rc = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory building the shard index");
    else if (snprintf(path, sizeof path, "%s/%s.safetensors.index.json", dir, stem) >=
             (int)sizeof path)
        rc = kiln_err_set(err, KILN_ERR_IO, "path too long");
    else
        rc = kiln_ckpt_write_json(path, doc, err);
    cJSON_Delete(doc);
    return rc;
}

kiln_status kiln_ckpt_write_weights(const char *dir, const char *stem, const kiln_arch_list *l,
                                    uint64_t seed, uint64_t shard_bytes, kiln_err *err)
{
    const kiln_arch_tensor **ts = malloc((l->n ? l->n : 1) * sizeof *ts);
    int *shard_of = malloc((l->n ? l->n : 1) * sizeof *shard_of);
    kiln_status rc = KILN_OK;
    char path[PATH_MAX];
    if (!ts || !shard_of) {
        rc = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < l->n; i++)
        ts[i] = &l->t[i];
    qsort(ts, l->n, sizeof *ts, cmp_name);
    uint64_t total = kiln_arch_list_bytes(l);
    if (total <= shard_bytes) {
        if (snprintf(path, sizeof path, "%s/%s.safetensors", dir, stem) >= (int)sizeof path)
            rc = kiln_err_set(err, KILN_ERR_IO, "path too long");
        else
            rc = write_file(path, ts, l->n, seed, err);
        goto out;
    }
    /* Greedy in name order, like huggingface_hub's split_torch_state_dict. */
    int nshards = 0;
    uint64_t cur = 0;
    for (size_t i = 0; i < l->n; i++) {
        uint64_t b = tensor_bytes(ts[i]);
        if (nshards == 0 || (cur && cur + b > shard_bytes)) {
            nshards++;
            cur = 0;
        }
        cur += b;
        shard_of[i] = nshards - 1;
    }
    for (int s = 0, first = 0; s < nshards; s++) {
        int last = first;
        while (last < (int)l->n && shard_of[last] == s)
            last++;
        if (snprintf(path, sizeof path, "%s/%s-%05d-of-%05d.safetensors", dir, stem, s + 1,
                     nshards) >= (int)sizeof path) {
            rc = kiln_err_set(err, KILN_ERR_IO, "path too long");
            goto out;
        }
        if ((rc = write_file(path, ts + first, (size_t)(last - first), seed, err)))
            goto out;
        first = last;
    }
    rc = write_index(dir, stem, ts, shard_of, l->n, nshards, total, err);
out:
    free(shard_of);
    free(ts);
    return rc;
}

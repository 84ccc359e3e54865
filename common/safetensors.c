/* safetensors reader.  Format (huggingface/safetensors): an 8-byte
 * little-endian header length N, N bytes of JSON mapping tensor names to
 * {dtype, shape, data_offsets: [begin, end]} (offsets relative to the byte
 * after the header) plus an optional "__metadata__" object of strings, then
 * the data.  Sharded sets add a "*.safetensors.index.json" whose weight_map
 * names each tensor's shard.  The writer lives in safetensors_write.c. */
#include "safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "json.h"
#include "linkstub.h"

/* The reference implementation caps headers at 100 MB; ours is the same
 * order so a hostile length cannot make us parse gigabytes of JSON. */
#define ST_MAX_HEADER (100u << 20)
#define ST_LABEL_MAX 128
#define ST_MAX_EXACT 9007199254740992.0 /* 2^53: integers a double holds exactly */

typedef struct st_map {
    void *base;
    size_t size;
} st_map;

struct kiln_st {
    char label[ST_LABEL_MAX];
    st_map *maps;
    size_t nmaps;
    kiln_st_tensor *tensors; /* sorted by name */
    size_t n;
};

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const kiln_st_tensor *)a)->name, ((const kiln_st_tensor *)b)->name);
}

void kiln_st_close(kiln_st *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->n; i++)
        free((char *)st->tensors[i].name);
    free(st->tensors);
    for (size_t i = 0; i < st->nmaps; i++)
        if (st->maps[i].base)
            munmap(st->maps[i].base, st->maps[i].size);
    free(st->maps);
    free(st);
}

static kiln_status map_file(const char *given, const char *label, st_map *m, kiln_err *err)
{
    char path[PATH_MAX];
    if (kiln_linkstub_resolve(given, path, sizeof path) != 0)
        return kiln_err_set(err, KILN_ERR_IO, "%s: path too long", label);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s",
                            label, errno == ENOENT ? "file not found" : strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kiln_err_set(err, KILN_ERR_IO, "%s: not a regular file", label);
    }
    if (sb.st_size < 8) {
        close(fd);
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: truncated safetensors file (%lld bytes, no header)", label,
                            (long long)sb.st_size);
    }
    void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int saved = errno;
    close(fd);
    if (p == MAP_FAILED)
        return kiln_err_set(err, KILN_ERR_IO, "%s: mmap failed: %s", label, strerror(saved));
    m->base = p;
    m->size = (size_t)sb.st_size;
    return KILN_OK;
}

/* An exact non-negative integer (<= 2^53) from a JSON number. */
static int json_uint(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v))
        return -1;
    double d = v->valuedouble;
    if (!(d >= 0) || d > ST_MAX_EXACT || d != floor(d))
        return -1;
    *out = (uint64_t)d;
    return 0;
}

/* Dtype names the format defines that kiln has no kernel path for: a valid
 * file we refuse with UNSUPPORTED rather than calling it corrupt. */
static int known_foreign_dtype(const char *s)
{
    static const char *const names[] = {"BOOL", "I8", "I16", "U16", "U32", "U64",
                                        "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3",
                                        "F6_E3M2", "F4", "C64"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i]))
            return 1;
    return 0;
}

static kiln_status parse_entry(const cJSON *e, const char *label, uint64_t data_size,
                               const uint8_t *data, kiln_st_tensor *t, uint64_t *begin_out,
                               kiln_err *err)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' is not an object", label, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt) || !cJSON_IsArray(shape) || !cJSON_IsArray(offs))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: tensor '%s' needs a dtype string, a shape array and "
                            "data_offsets", label, name);
    if (kiln_dtype_parse(dt->valuestring, &t->dtype) != 0) {
        if (known_foreign_dtype(dt->valuestring))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                                "%s: tensor '%s' has unsupported dtype %s", label, name,
                                dt->valuestring);
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' has unknown dtype '%.32s'",
                            label, name, dt->valuestring);
    }
    int rank = cJSON_GetArraySize(shape);
    if (rank > KILN_MAX_DIMS)
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' has rank %d (max %d)", label,
                            name, rank, KILN_MAX_DIMS);
    t->ndim = rank;
    uint64_t numel = 1;
    int i = 0;
    int zero = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape)
    {
        uint64_t v;
        if (json_uint(d, &v) != 0)
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "%s: tensor '%s' has a shape entry that is not a non-negative "
                                "integer", label, name);
        t->shape[i++] = (int64_t)v;
        if (v == 0)
            zero = 1;
        else if (numel > UINT64_MAX / v)
            numel = UINT64_MAX; /* saturate; a zero dim may still follow */
        else
            numel *= v;
    }
    for (; i < KILN_MAX_DIMS; i++)
        t->shape[i] = 1;
    if (zero)
        numel = 0;
    size_t esize = kiln_dtype_size(t->dtype);
    if (numel > UINT64_MAX / esize)
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' shape overflows", label,
                            name);
    uint64_t bytes = numel * esize;
    uint64_t b, en;
    if (cJSON_GetArraySize(offs) != 2 || json_uint(cJSON_GetArrayItem(offs, 0), &b) != 0 ||
        json_uint(cJSON_GetArrayItem(offs, 1), &en) != 0 || b > en)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: tensor '%s' data_offsets must be [begin, end] with begin <= end",
                            label, name);
    if (en > data_size)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: tensor '%s' data [%llu, %llu) lies beyond the end of the file "
                            "(%llu data bytes)", label, name, (unsigned long long)b,
                            (unsigned long long)en, (unsigned long long)data_size);
    if (en - b != bytes)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: tensor '%s' holds %llu bytes but its shape and dtype need %llu",
                            label, name, (unsigned long long)(en - b),
                            (unsigned long long)bytes);
    t->data = data + b;
    t->nbytes = (size_t)bytes;
    *begin_out = b;
    return KILN_OK;
}

typedef struct span {
    uint64_t begin, end;
    const char *name;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static kiln_status check_metadata(const cJSON *meta, const char *label, kiln_err *err)
{
    if (!cJSON_IsObject(meta))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: __metadata__ must be an object", label);
    const cJSON *m;
    cJSON_ArrayForEach(m, meta)
    {
        if (!cJSON_IsString(m))
            return kiln_err_set(err, KILN_ERR_FORMAT, "%s: __metadata__ values must be strings",
                                label);
    }
    return KILN_OK;
}

/* Parses and validates one mapped file, appending its tensors to
 * st->tensors (which has room for `cap` entries; grown here). */
static kiln_status parse_file(kiln_st *st, const st_map *m, const char *label, size_t *cap,
                              kiln_err *err)
{
    const uint8_t *base = m->base;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | base[i];
    if (hlen > m->size - 8)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "%s: header length %llu runs past the end of the file (%zu bytes)",
                            label, (unsigned long long)hlen, m->size);
    if (hlen > ST_MAX_HEADER)
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: header of %llu bytes is over the %u MiB "
                            "limit", label, (unsigned long long)hlen, ST_MAX_HEADER >> 20);
    const char *hdr = (const char *)base + 8;
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!doc)
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: header is not valid JSON", label);
    kiln_status rc = KILN_OK;
    span *spans = NULL;
    /* Writers pad the header with spaces; anything else after the object
     * means the length and the JSON disagree. */
    for (const char *p = end; p && p < hdr + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            rc = kiln_err_set(err, KILN_ERR_FORMAT, "%s: trailing bytes after the JSON header",
                              label);
            goto out;
        }
    }
    if (!cJSON_IsObject(doc)) {
        rc = kiln_err_set(err, KILN_ERR_FORMAT, "%s: header is not a JSON object", label);
        goto out;
    }
    size_t count = (size_t)cJSON_GetArraySize(doc);
    spans = malloc((count ? count : 1) * sizeof *spans);
    if (!spans) {
        rc = kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        goto out;
    }
    if (st->n + count > *cap) {
        size_t ncap = st->n + count + 16;
        kiln_st_tensor *nt = realloc(st->tensors, ncap * sizeof *nt);
        if (!nt) {
            rc = kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
            goto out;
        }
        st->tensors = nt;
        *cap = ncap;
    }
    uint64_t data_size = m->size - 8 - hlen;
    const uint8_t *data = base + 8 + hlen;
    size_t ns = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, doc)
    {
        if (!strcmp(e->string, "__metadata__")) {
            if ((rc = check_metadata(e, label, err)))
                goto out;
            continue;
        }
        kiln_st_tensor *t = &st->tensors[st->n];
        memset(t, 0, sizeof *t);
        uint64_t b = 0;
        if ((rc = parse_entry(e, label, data_size, data, t, &b, err)))
            goto out;
        if (!(t->name = strdup(e->string))) {
            rc = kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
            goto out;
        }
        st->n++;
        spans[ns++] = (span){b, b + t->nbytes, t->name};
    }
    if (ns)
        qsort(spans, ns, sizeof *spans, cmp_span);
    for (size_t i = 1; i < ns; i++) {
        if (spans[i].begin < spans[i - 1].end) {
            rc = kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap", label,
                              spans[i - 1].name, spans[i].name);
            goto out;
        }
    }
out:
    free(spans);
    cJSON_Delete(doc);
    return rc;
}

static kiln_st *st_new(const char *label)
{
    kiln_st *st = calloc(1, sizeof *st);
    if (st)
        snprintf(st->label, sizeof st->label, "%s", label);
    return st;
}

/* Sorts the tensors and rejects duplicate names (cJSON keeps both copies of
 * a repeated key, and shards could repeat a name). */
static kiln_status finish(kiln_st *st, kiln_err *err)
{
    if (st->n)
        qsort(st->tensors, st->n, sizeof *st->tensors, cmp_tensor_name);
    for (size_t i = 1; i < st->n; i++)
        if (!strcmp(st->tensors[i].name, st->tensors[i - 1].name))
            return kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' appears twice", st->label,
                                st->tensors[i].name);
    return KILN_OK;
}

static kiln_st *open_file(const char *path, const char *label, kiln_err *err)
{
    kiln_st *st = st_new(label);
    size_t cap = 0;
    if (!st || !(st->maps = calloc(1, sizeof *st->maps))) {
        kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        kiln_st_close(st);
        return NULL;
    }
    st->nmaps = 1;
    if (map_file(path, label, &st->maps[0], err) || parse_file(st, &st->maps[0], label, &cap, err) ||
        finish(st, err)) {
        kiln_st_close(st);
        return NULL;
    }
    return st;
}

/* A shard must be a plain file beside its index: no directories, no
 * parent references, nothing hidden. */
static int plain_file_name(const char *s)
{
    return s[0] && s[0] != '.' && !strchr(s, '/') && !strchr(s, '\\') && !strstr(s, "..") &&
           strlen(s) < 256;
}

static int find_shard(char **names, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(names[i], s))
            return (int)i;
    return -1;
}

static kiln_st *open_index(const char *path, const char *label, kiln_err *err)
{
    char what[ST_LABEL_MAX + 32];
    snprintf(what, sizeof what, "%s: %s", label, base_name(path));
    cJSON *idx = kiln_json_load(path, what, err);
    if (!idx)
        return NULL;
    kiln_st *st = st_new(label);
    char **shards = NULL;
    size_t nshards = 0;
    size_t *owner = NULL; /* shard index of each tensor, parallel to st->tensors */
    if (!st) {
        kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        goto fail;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
    if (!cJSON_IsObject(wm)) {
        kiln_err_set(err, KILN_ERR_FORMAT, "%s: weight_map must be an object", what);
        goto fail;
    }
    size_t nw = (size_t)cJSON_GetArraySize(wm);
    if (!(shards = calloc(nw ? nw : 1, sizeof *shards))) {
        kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        goto fail;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, wm)
    {
        if (!cJSON_IsString(e) || !plain_file_name(e->valuestring)) {
            kiln_err_set(err, KILN_ERR_FORMAT,
                         "%s: tensor '%s' names shard '%.64s', which is not a plain file name",
                         what, e->string, cJSON_IsString(e) ? e->valuestring : "?");
            goto fail;
        }
        if (find_shard(shards, nshards, e->valuestring) < 0)
            shards[nshards++] = e->valuestring; /* owned by idx */
    }
    if (!(st->maps = calloc(nshards ? nshards : 1, sizeof *st->maps))) {
        kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        goto fail;
    }
    const char *slash = strrchr(path, '/');
    int dirlen = slash ? (int)(slash - path + 1) : 0;
    size_t cap = 0, cap_owner = 0;
    for (size_t s = 0; s < nshards; s++) {
        char spath[PATH_MAX], slabel[ST_LABEL_MAX + 280];
        if (snprintf(spath, sizeof spath, "%.*s%s", dirlen, path, shards[s]) >= (int)sizeof spath) {
            kiln_err_set(err, KILN_ERR_IO, "%s: shard path too long", label);
            goto fail;
        }
        snprintf(slabel, sizeof slabel, "%s: %s", label, shards[s]);
        size_t before = st->n;
        st->nmaps = s + 1;
        if (map_file(spath, slabel, &st->maps[s], err) ||
            parse_file(st, &st->maps[s], slabel, &cap, err))
            goto fail;
        if (cap > cap_owner) {
            size_t *no = realloc(owner, cap * sizeof *no);
            if (!no) {
                kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
                goto fail;
            }
            owner = no;
            cap_owner = cap;
        }
        for (size_t i = before; i < st->n; i++)
            owner[i] = s;
    }
    /* Every tensor a shard holds must be listed for that shard, and every
     * listed tensor must be present: a stale index or a missing shard file
     * would otherwise surface later as a confusing missing-weight error. */
    for (size_t i = 0; i < st->n; i++) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(wm, st->tensors[i].name);
        if (!m || strcmp(m->valuestring, shards[owner[i]])) {
            kiln_err_set(err, KILN_ERR_FORMAT,
                         "%s: shard %s holds tensor '%s', which the index does not list there",
                         label, shards[owner[i]], st->tensors[i].name);
            goto fail;
        }
    }
    if (finish(st, err))
        goto fail;
    cJSON_ArrayForEach(e, wm)
    {
        if (!kiln_st_find(st, e->string)) {
            kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' is missing from shard %s", label,
                         e->string, e->valuestring);
            goto fail;
        }
    }
    free(owner);
    free(shards);
    cJSON_Delete(idx);
    return st;
fail:
    free(owner);
    free(shards);
    cJSON_Delete(idx);
    kiln_st_close(st);
    return NULL;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static kiln_st *open_dir(const char *path, const char *label, kiln_err *err)
{
    DIR *d = opendir(path);
    if (!d) {
        kiln_err_set(err, KILN_ERR_IO, "%s: cannot read the folder", label);
        return NULL;
    }
    char index[256] = "", single[256] = "";
    int nindex = 0, nsingle = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || strlen(de->d_name) >= sizeof index)
            continue;
        if (ends_with(de->d_name, ".safetensors.index.json"))
            snprintf(index, sizeof index, "%s", de->d_name), nindex++;
        else if (ends_with(de->d_name, ".safetensors"))
            snprintf(single, sizeof single, "%s", de->d_name), nsingle++;
    }
    closedir(d);
    const char *pick = NULL;
    if (nindex == 1)
        pick = index;
    else if (nindex == 0 && nsingle == 1)
        pick = single;
    if (!pick) {
        if (nindex + nsingle == 0)
            kiln_err_set(err, KILN_ERR_NOT_FOUND, "%s: no .safetensors weights in the folder",
                         label);
        else
            kiln_err_set(err, KILN_ERR_FORMAT,
                         "%s: the folder holds %d index files and %d .safetensors files; "
                         "expected one index or one file", label, nindex, nsingle);
        return NULL;
    }
    char full[PATH_MAX];
    if (snprintf(full, sizeof full, "%s/%s", path, pick) >= (int)sizeof full) {
        kiln_err_set(err, KILN_ERR_IO, "%s: path too long", label);
        return NULL;
    }
    return nindex ? open_index(full, label, err) : open_file(full, label, err);
}

kiln_st *kiln_st_open(const char *path, const char *label, kiln_err *err)
{
    if (!label)
        label = base_name(path);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", label,
                     errno == ENOENT ? "not found" : strerror(errno));
        return NULL;
    }
    if (S_ISDIR(sb.st_mode))
        return open_dir(path, label, err);
    if (ends_with(path, ".json"))
        return open_index(path, label, err);
    return open_file(path, label, err);
}

const kiln_st_tensor *kiln_st_find(const kiln_st *st, const char *name)
{
    if (!st->n)
        return NULL;
    kiln_st_tensor key = {.name = name};
    return bsearch(&key, st->tensors, st->n, sizeof *st->tensors, cmp_tensor_name);
}

size_t kiln_st_count(const kiln_st *st) { return st->n; }

const kiln_st_tensor *kiln_st_at(const kiln_st *st, size_t i)
{
    return i < st->n ? &st->tensors[i] : NULL;
}

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    kiln_tensor t = {.ndim = ndim};
    for (int i = 0; i < ndim; i++)
        t.shape[i] = shape[i];
    kiln_tensor_shape_str(&t, buf, len);
}

const kiln_st_tensor *kiln_st_expect(const kiln_st *st, const char *name, int ndim,
                                     const int64_t *shape, kiln_err *err)
{
    if (ndim < 0 || ndim > KILN_MAX_DIMS) {
        kiln_err_set(err, KILN_ERR_INVALID, "%s: expected rank %d for '%s' is out of range",
                     st->label, ndim, name);
        return NULL;
    }
    const kiln_st_tensor *t = kiln_st_find(st, name);
    if (!t) {
        kiln_err_set(err, KILN_ERR_NOT_FOUND, "%s: tensor '%s' is missing", st->label, name);
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == shape[i];
    if (!ok) {
        char want[128], got[128];
        shape_str(want, sizeof want, ndim, shape);
        shape_str(got, sizeof got, t->ndim, t->shape);
        kiln_err_set(err, KILN_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", st->label,
                     name, got, want);
        return NULL;
    }
    return t;
}

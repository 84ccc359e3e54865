#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <sys/stat.h>

#include "linkstub.h"

/* Config files are a few KiB; index files of sharded checkpoints reach a few
 * hundred KiB.  The cap keeps a hostile file from exhausting memory. */
#define KILN_JSON_MAX_BYTES (64u << 20)

cJSON *kiln_json_load(const char *path, const char *label, kiln_err *err)
{
    if (!label)
        label = path;
    char real[PATH_MAX];
    if (kiln_linkstub_resolve(path, real, sizeof real) != 0) {
        kiln_err_set(err, KILN_ERR_IO, "%s: path too long", label);
        return NULL;
    }
    FILE *f = fopen(real, "rb");
    if (!f) {
        kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", label,
                     errno == ENOENT ? "file not found" : strerror(errno));
        return NULL;
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        kiln_err_set(err, KILN_ERR_IO, "%s: not a regular file", label);
        fclose(f);
        return NULL;
    }
    if ((uint64_t)sb.st_size > KILN_JSON_MAX_BYTES) {
        kiln_err_set(err, KILN_ERR_TOO_LARGE, "%s: %lld bytes is over the %u MiB limit", label,
                     (long long)sb.st_size, KILN_JSON_MAX_BYTES >> 20);
        fclose(f);
        return NULL;
    }
    size_t size = (size_t)sb.st_size;
    char *buf = malloc(size + 1);
    if (!buf) {
        kiln_err_set(err, KILN_ERR_NOMEM, "%s: out of memory", label);
        fclose(f);
        return NULL;
    }
    size_t got = fread(buf, 1, size, f);
    int read_failed = ferror(f);
    fclose(f);
    if (read_failed || got != size) {
        kiln_err_set(err, KILN_ERR_IO, "%s: short read", label);
        free(buf);
        return NULL;
    }
    buf[size] = '\0';
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(buf, size, &end, 0);
    if (!doc) {
        size_t at = end && end >= buf && end <= buf + size ? (size_t)(end - buf) : 0;
        kiln_err_set(err, KILN_ERR_FORMAT, "%s: invalid JSON near byte %zu", label, at);
    }
    free(buf);
    return doc;
}

static const cJSON *lookup(const cJSON *obj, const char *key)
{
    if (!cJSON_IsObject(obj))
        return NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

kiln_status kiln_json_int(const cJSON *obj, const char *key, int64_t def, int64_t *out,
                          kiln_err *err)
{
    const cJSON *v = lookup(obj, key);
    if (!v) {
        if (def == KILN_JSON_REQUIRED)
            return kiln_err_set(err, KILN_ERR_FORMAT, "missing required key '%s'", key);
        *out = def;
        return KILN_OK;
    }
    /* cJSON stores numbers as doubles: accept only exact integers in the
     * range a double represents exactly, so 1e300 or 2.5 is a format error. */
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d != floor(d) || fabs(d) > 9007199254740992.0)
        return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' must be an integer", key);
    *out = (int64_t)d;
    return KILN_OK;
}

kiln_status kiln_json_double(const cJSON *obj, const char *key, int required, double def,
                             double *out, kiln_err *err)
{
    const cJSON *v = lookup(obj, key);
    if (!v) {
        if (required)
            return kiln_err_set(err, KILN_ERR_FORMAT, "missing required key '%s'", key);
        *out = def;
        return KILN_OK;
    }
    if (!cJSON_IsNumber(v))
        return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' must be a number", key);
    *out = v->valuedouble;
    return KILN_OK;
}

kiln_status kiln_json_bool(const cJSON *obj, const char *key, int required, int def, int *out,
                           kiln_err *err)
{
    const cJSON *v = lookup(obj, key);
    if (!v) {
        if (required)
            return kiln_err_set(err, KILN_ERR_FORMAT, "missing required key '%s'", key);
        *out = def;
        return KILN_OK;
    }
    if (!cJSON_IsBool(v))
        return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' must be true or false", key);
    *out = cJSON_IsTrue(v);
    return KILN_OK;
}

const char *kiln_json_string(const cJSON *obj, const char *key, int required, kiln_err *err)
{
    const cJSON *v = lookup(obj, key);
    if (!v) {
        if (required)
            kiln_err_set(err, KILN_ERR_FORMAT, "missing required key '%s'", key);
        return NULL;
    }
    if (!cJSON_IsString(v)) {
        kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' must be a string", key);
        return NULL;
    }
    return v->valuestring;
}

kiln_status kiln_json_int_array(const cJSON *obj, const char *key, int required, int64_t *out,
                                int max, int *n, kiln_err *err)
{
    *n = 0;
    const cJSON *v = lookup(obj, key);
    if (!v) {
        if (required)
            return kiln_err_set(err, KILN_ERR_FORMAT, "missing required key '%s'", key);
        return KILN_OK;
    }
    if (!cJSON_IsArray(v))
        return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' must be an array of integers", key);
    int count = cJSON_GetArraySize(v);
    if (count > max)
        return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' has %d entries, at most %d allowed",
                            key, count, max);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v)
    {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || d != floor(d) || fabs(d) > 9007199254740992.0)
            return kiln_err_set(err, KILN_ERR_FORMAT, "key '%s' entry %d must be an integer", key,
                                i);
        out[i++] = (int64_t)d;
    }
    *n = i;
    return KILN_OK;
}

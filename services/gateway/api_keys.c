#include "api_keys.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define FILE_MAX (1u << 20)

struct kiln_api_keys {
    int n;
    char (*keys)[KILN_API_KEY_MAX + 1];
    size_t *len;
};

void kiln_api_keys_free(kiln_api_keys *k)
{
    if (!k)
        return;
    free(k->keys);
    free(k->len);
    free(k);
}

static kiln_status add(kiln_api_keys *k, const char *s, size_t n, kiln_err *err)
{
    char(*v)[KILN_API_KEY_MAX + 1] = realloc(k->keys, (size_t)(k->n + 1) * sizeof *v);
    if (v)
        k->keys = v;
    size_t *l = v ? realloc(k->len, (size_t)(k->n + 1) * sizeof *l) : NULL;
    if (!l)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    k->len = l;
    memcpy(k->keys[k->n], s, n);
    k->keys[k->n][n] = '\0';
    k->len[k->n++] = n;
    return KILN_OK;
}

static kiln_status parse_line(kiln_api_keys *k, const char *path, int line, char *s,
                              kiln_err *err)
{
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    while (*s == ' ' || *s == '\t')
        s++, n--;
    if (!n || *s == '#')
        return KILN_OK;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= 0x20 || s[i] >= 0x7f)
            return kiln_err_set(err, KILN_ERR_INVALID, "API key file '%s' line %d: a key is "
                                "printable ASCII without spaces", path, line);
    if (n < KILN_API_KEY_MIN || n > KILN_API_KEY_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "API key file '%s' line %d: a key has %d..%d "
                            "characters (this one has %zu)", path, line, KILN_API_KEY_MIN,
                            KILN_API_KEY_MAX, n);
    return add(k, s, n, err);
}

kiln_api_keys *kiln_api_keys_load(const char *path, kiln_err *err)
{
    FILE *f = fopen(path, "re");
    if (!f) {
        kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                     "cannot read API key file '%s': %s", path, strerror(errno));
        return NULL;
    }
    kiln_api_keys *k = calloc(1, sizeof *k);
    if (!k) {
        fclose(f);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    char buf[KILN_API_KEY_MAX + 64];
    size_t total = 0;
    kiln_status st = KILN_OK;
    for (int line = 1; !st && fgets(buf, sizeof buf, f); line++) {
        size_t n = strlen(buf);
        total += n;
        if (n && buf[n - 1] == '\n')
            buf[--n] = '\0';
        else if (!feof(f))
            st = kiln_err_set(err, KILN_ERR_INVALID, "API key file '%s' line %d is longer than "
                              "a key can be", path, line);
        if (!st && total > FILE_MAX)
            st = kiln_err_set(err, KILN_ERR_INVALID, "API key file '%s' is larger than %u bytes",
                              path, FILE_MAX);
        if (!st)
            st = parse_line(k, path, line, buf, err);
    }
    if (!st && ferror(f))
        st = kiln_err_set(err, KILN_ERR_IO, "cannot read API key file '%s'", path);
    if (!st && !k->n)
        st = kiln_err_set(err, KILN_ERR_INVALID, "API key file '%s' holds no key", path);
    fclose(f);
    if (st) {
        kiln_api_keys_free(k);
        return NULL;
    }
    return k;
}

/* Equal in time that depends only on n (the presented key's length). */
static int same(const char *given, size_t n, const char *key, size_t key_len)
{
    unsigned diff = n != key_len;
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)given[i] ^ (unsigned char)key[i % key_len];
    return diff == 0;
}

int kiln_api_keys_check(const kiln_api_keys *k, const char *authorization)
{
    if (!authorization || strncasecmp(authorization, "Bearer ", 7))
        return 0;
    const char *given = authorization + 7;
    while (*given == ' ')
        given++;
    size_t n = strlen(given);
    while (n && given[n - 1] == ' ')
        n--;
    if (!n || n > KILN_API_KEY_MAX)
        return 0;
    int ok = 0;
    for (int i = 0; i < k->n; i++)
        ok |= same(given, n, k->keys[i], k->len[i]);
    return ok;
}

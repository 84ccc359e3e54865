/* Helpers shared by the tokenizer tests: locating fixtures and reading them.
 * Everything aborts the test program on a missing fixture (a setup error, not
 * a tokenizer failure). */
#ifndef KILN_TEST_TOK_FIXTURE_H
#define KILN_TEST_TOK_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

/* $KILN_SHARED/<rel> or $KILN_SOURCE_ROOT/tests/data/<rel>. */
static inline const char *tok_path(const char *env, const char *rel)
{
    static char buf[8][4096];
    static int next;
    const char *root = getenv(env);
    if (!root) {
        fprintf(stderr, "%s is not set (run through meson test)\n", env);
        exit(2);
    }
    char *out = buf[next++ % 8];
    snprintf(out, sizeof buf[0], "%s/%s%s", root,
             strcmp(env, "KILN_SOURCE_ROOT") ? "" : "tests/data/", rel);
    return out;
}

static inline char *tok_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open fixture %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot read fixture %s\n", path);
        exit(2);
    }
    fclose(f);
    buf[n] = '\0';
    if (len)
        *len = (size_t)n;
    return buf;
}

/* A fixture case's text: "text", or "utf8_hex" for text with NUL bytes.
 * Returns a malloc'd buffer. */
static inline char *tok_case_text(const cJSON *c, size_t *len)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "text");
    if (cJSON_IsString(t)) {
        *len = strlen(t->valuestring);
        return strdup(t->valuestring);
    }
    const char *hex = cJSON_GetObjectItemCaseSensitive(c, "utf8_hex")->valuestring;
    *len = strlen(hex) / 2;
    char *s = malloc(*len + 1);
    for (size_t i = 0; i < *len; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        s[i] = (char)v;
    }
    s[*len] = '\0';
    return s;
}

/* 1 when ids[0..n) equal the JSON array `want`. */
static inline int tok_ids_equal(const int32_t *ids, size_t n, const cJSON *want)
{
    if ((size_t)cJSON_GetArraySize(want) != n)
        return 0;
    size_t i = 0;
    for (const cJSON *w = want->child; w; w = w->next, i++)
        if (ids[i] != (int32_t)w->valuedouble)
            return 0;
    return 1;
}

#endif

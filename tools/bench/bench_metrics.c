#include "bench_metrics.h"

#include <stdlib.h>
#include <string.h>

typedef struct sample {
    char *name;
    char *labels;
    double value;
} sample;

struct kiln_prom {
    sample *s;
    size_t n, cap;
    char *text; /* one copy of the input; names and labels point into it */
};

void kiln_prom_free(kiln_prom *p)
{
    if (!p)
        return;
    free(p->s);
    free(p->text);
    free(p);
}

size_t kiln_prom_size(const kiln_prom *p)
{
    return p->n;
}

static int name_char(char c, int first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
           (!first && c >= '0' && c <= '9');
}

/* Parses one sample line in place (NUL-terminating its name and labels). */
static int parse_line(char *line, sample *out)
{
    char *p = line;
    if (!name_char(*p, 1))
        return -1;
    out->name = p;
    while (name_char(*p, 0))
        p++;
    out->labels = p; /* without braces, the separator cut below makes it "" */
    if (*p == '{') {
        *p++ = '\0';
        out->labels = p;
        int quoted = 0;
        for (; *p && (quoted || *p != '}'); p++) {
            if (quoted && *p == '\\' && p[1])
                p++;
            else if (*p == '"')
                quoted = !quoted;
        }
        if (*p != '}')
            return -1;
        *p++ = '\0';
    } else if (*p == ' ' || *p == '\t') {
        *p++ = '\0';
    } else {
        return -1;
    }
    while (*p == ' ' || *p == '\t')
        p++;
    char *end;
    out->value = strtod(p, &end);
    if (end == p || (*end && *end != ' ' && *end != '\t'))
        return -1;
    return 0;
}

kiln_prom *kiln_prom_parse(const char *text, size_t len, kiln_err *err)
{
    kiln_prom *p = calloc(1, sizeof *p);
    if (!p || !(p->text = malloc(len + 1))) {
        free(p);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    memcpy(p->text, text, len);
    p->text[len] = '\0';
    char *line = p->text;
    for (int lineno = 1; line; lineno++) {
        char *nl = memchr(line, '\n', (size_t)(p->text + len - line));
        if (nl)
            *nl = '\0';
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r')
            line[--l] = '\0';
        char *t = line;
        while (*t == ' ' || *t == '\t')
            t++;
        if (*t && *t != '#') {
            if (p->n == p->cap) {
                size_t cap = p->cap ? 2 * p->cap : 64;
                sample *s = realloc(p->s, cap * sizeof *s);
                if (!s) {
                    kiln_prom_free(p);
                    kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
                    return NULL;
                }
                p->s = s, p->cap = cap;
            }
            if (parse_line(t, &p->s[p->n])) {
                kiln_prom_free(p);
                kiln_err_set(err, KILN_ERR_FORMAT, "metrics line %d is not a Prometheus sample",
                             lineno);
                return NULL;
            }
            p->n++;
        }
        line = nl ? nl + 1 : NULL;
    }
    return p;
}

int kiln_prom_get(const kiln_prom *p, const char *name, const char *labels, double *value)
{
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->s[i].name, name) && !strcmp(p->s[i].labels, labels)) {
            *value = p->s[i].value;
            return 1;
        }
    return 0;
}

static int ends_with(const char *s, size_t n, const char *suffix)
{
    size_t k = strlen(suffix);
    return n >= k && !memcmp(s + n - k, suffix, k);
}

kiln_status kiln_bench_stage_deltas(const kiln_prom *before, const kiln_prom *after,
                                    kiln_bench_stage **out, size_t *n, kiln_err *err)
{
    *out = NULL;
    *n = 0;
    kiln_bench_stage *st = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < after->n; i++) {
        const sample *s = &after->s[i];
        size_t l = strlen(s->name);
        if (!ends_with(s->name, l, "_seconds_sum"))
            continue;
        size_t fam_len = l - strlen("_sum");
        char count_name[128];
        if (fam_len + sizeof "_count" > sizeof count_name || fam_len >= sizeof st->family ||
            strlen(s->labels) >= sizeof st->labels)
            continue; /* longer than any kiln family: not ours */
        memcpy(count_name, s->name, fam_len);
        memcpy(count_name + fam_len, "_count", sizeof "_count");
        double c1, c0 = 0, s0 = 0;
        if (!kiln_prom_get(after, count_name, s->labels, &c1))
            continue;
        kiln_prom_get(before, count_name, s->labels, &c0);
        kiln_prom_get(before, s->name, s->labels, &s0);
        if (c1 - c0 <= 0)
            continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            kiln_bench_stage *g = realloc(st, cap * sizeof *g);
            if (!g) {
                free(st);
                *n = 0;
                return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
            }
            st = g;
        }
        kiln_bench_stage *d = &st[(*n)++];
        memcpy(d->family, s->name, fam_len);
        d->family[fam_len] = '\0';
        strcpy(d->labels, s->labels);
        d->count = c1 - c0;
        d->sum_s = s->value - s0;
    }
    *out = st;
    return KILN_OK;
}

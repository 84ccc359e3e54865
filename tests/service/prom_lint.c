#include "prom_lint.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FAMILIES 256
#define MAX_SERIES 8192

typedef struct family {
    char name[128];
    char type[16];
    int help, done; /* done: its samples ended (another family's came) */
} family;

static family fams[MAX_FAMILIES];
static int n_fams;
static char *series[MAX_SERIES];
static int n_series;

/* Histogram state: the series (labels without le) whose buckets run now. */
static char hist_key[1024];
static int hist_on;
static double hist_le, hist_cum;

static int name_ok(const char *s, size_t n, int colon)
{
    if (!n)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                 (colon && c == ':') || (i && c >= '0' && c <= '9');
        if (!ok)
            return 0;
    }
    return 1;
}

static family *find(const char *name, size_t n)
{
    for (int i = 0; i < n_fams; i++)
        if (strlen(fams[i].name) == n && !memcmp(fams[i].name, name, n))
            return &fams[i];
    if (n_fams == MAX_FAMILIES || n >= sizeof fams[0].name)
        return NULL;
    family *f = &fams[n_fams++];
    memset(f, 0, sizeof *f);
    memcpy(f->name, name, n);
    return f;
}

static int ends(const char *s, size_t n, const char *suf)
{
    size_t k = strlen(suf);
    return n >= k && !memcmp(s + n - k, suf, k);
}

#define FAIL(...)                                \
    do {                                         \
        snprintf(why, cap, __VA_ARGS__);         \
        goto out;                                \
    } while (0)

int prom_lint(const char *text, char *why, size_t cap)
{
    n_fams = 0;
    for (int i = 0; i < n_series; i++)
        free(series[i]);
    n_series = 0;
    hist_on = 0;
    family *cur = NULL;
    int rc = -1, lineno = 0;
    char line[2048];
    for (const char *p = text; *p;) {
        size_t len = strcspn(p, "\n");
        lineno++;
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), p);
        p += len + (p[len] == '\n');
        if (!line[0])
            continue;
        if (line[0] == '#') {
            char kind[8], name[160];
            int off = 0;
            if (sscanf(line, "# %7s %159s %n", kind, name, &off) < 2 ||
                (strcmp(kind, "HELP") && strcmp(kind, "TYPE")))
                continue; /* a plain comment */
            if (!name_ok(name, strlen(name), 1))
                FAIL("line %d: bad metric name '%s'", lineno, name);
            family *f = find(name, strlen(name));
            if (!f)
                FAIL("line %d: too many families", lineno);
            if (!strcmp(kind, "HELP")) {
                if (f->help++)
                    FAIL("line %d: second HELP for %s", lineno, name);
            } else {
                const char *t = line + off;
                if (f->type[0])
                    FAIL("line %d: second TYPE for %s", lineno, name);
                if (strcmp(t, "counter") && strcmp(t, "gauge") && strcmp(t, "histogram") &&
                    strcmp(t, "summary") && strcmp(t, "untyped"))
                    FAIL("line %d: bad type '%s'", lineno, t);
                if (f->done || (cur && cur == f))
                    FAIL("line %d: TYPE for %s after its samples", lineno, name);
                snprintf(f->type, sizeof f->type, "%s", t);
                if (!strcmp(t, "counter") && !ends(name, strlen(name), "_total"))
                    FAIL("line %d: counter %s does not end in _total", lineno, name);
            }
            continue;
        }
        /* a sample */
        size_t nl = strcspn(line, "{ ");
        if (!name_ok(line, nl, 1))
            FAIL("line %d: bad metric name", lineno);
        char key[1024], nole[1024];
        size_t kl = 0, nlen = 0;
        const char *q = line + nl;
        double le = NAN;
        if (*q == '{') {
            q++;
            while (*q && *q != '}') {
                size_t ln = strcspn(q, "=");
                if (!name_ok(q, ln, 0) || q[ln] != '=' || q[ln + 1] != '"')
                    FAIL("line %d: bad label", lineno);
                const char *v = q + ln + 2, *e = v;
                while (*e && *e != '"') {
                    if (*e == '\\') {
                        if (e[1] != '\\' && e[1] != '"' && e[1] != 'n')
                            FAIL("line %d: bad escape in a label value", lineno);
                        e++;
                    }
                    e++;
                }
                if (*e != '"')
                    FAIL("line %d: unterminated label value", lineno);
                int is_le = ln == 2 && !memcmp(q, "le", 2);
                if (is_le)
                    le = !strncmp(v, "+Inf\"", 5) ? INFINITY : strtod(v, NULL);
                else
                    nlen += (size_t)snprintf(nole + nlen, sizeof nole - nlen, "%.*s,",
                                             (int)(e + 1 - q), q);
                kl += (size_t)snprintf(key + kl, sizeof key - kl, "%.*s,", (int)(e + 1 - q), q);
                q = e + 1;
                if (*q == ',')
                    q++;
            }
            if (*q != '}')
                FAIL("line %d: unterminated labels", lineno);
            q++;
        }
        nole[nlen] = key[kl] = '\0';
        char *end;
        double value = strtod(q, &end);
        if (end == q || (*end && *end != ' '))
            FAIL("line %d: bad value", lineno);
        /* its family: a histogram's samples carry a suffix */
        family *f = NULL;
        static const char *const sufs[] = {"_bucket", "_sum", "_count"};
        int suf = -1;
        for (int s = 0; s < 3 && !f; s++)
            if (ends(line, nl, sufs[s])) {
                family *h = find(line, nl - strlen(sufs[s]));
                if (h && !strcmp(h->type, "histogram"))
                    f = h, suf = s;
                else if (h && !h->type[0] && !h->help)
                    n_fams--; /* not a family: forget the lookup */
            }
        if (!f)
            f = find(line, nl);
        if (!f || !f->type[0])
            FAIL("line %d: %.*s has no TYPE before it", lineno, (int)nl, line);
        if (!strcmp(f->type, "histogram") && suf < 0)
            FAIL("line %d: histogram %s sample without _bucket/_sum/_count", lineno, f->name);
        if (f != cur) {
            if (f->done)
                FAIL("line %d: samples of %s are not together", lineno, f->name);
            if (cur)
                cur->done = 1;
            cur = f;
        }
        char full[1200];
        snprintf(full, sizeof full, "%.*s{%s}", (int)nl, line, key);
        for (int i = 0; i < n_series; i++)
            if (!strcmp(series[i], full))
                FAIL("line %d: series %s twice", lineno, full);
        if (n_series < MAX_SERIES)
            series[n_series++] = strdup(full);
        if (suf == 0) {
            if (isnan(le))
                FAIL("line %d: bucket without le", lineno);
            if (!hist_on || strcmp(hist_key, nole)) {
                snprintf(hist_key, sizeof hist_key, "%s", nole);
                hist_on = 1, hist_le = -INFINITY, hist_cum = 0;
            }
            if (!(le > hist_le) || value < hist_cum)
                FAIL("line %d: buckets not cumulative in le order", lineno);
            hist_le = le, hist_cum = value;
        } else if (suf == 2) {
            if (!hist_on || strcmp(hist_key, nole) || hist_le != INFINITY || hist_cum != value)
                FAIL("line %d: %s: +Inf bucket %g != count %g", lineno, f->name, hist_cum, value);
            hist_on = 0;
        }
    }
    rc = 0;
out:
    for (int i = 0; i < n_series; i++)
        free(series[i]);
    n_series = 0;
    return rc;
}

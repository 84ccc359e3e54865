#include "traces.h"

#include "api_request.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    char id[KILN_REQUEST_ID_MAX];
    int status;
    kiln_trace t;
} entry;

struct kiln_traces {
    entry *e;
    int cap, next;
};

kiln_trace_span *kiln_trace_span_add(kiln_trace *t, const char *track, const char *name, double t0,
                                     double t1)
{
    if (t->n == KILN_TRACE_MAX_SPANS)
        return NULL;
    kiln_trace_span *s = &t->span[t->n++];
    snprintf(s->track, sizeof s->track, "%s", track);
    s->name = name;
    s->t0 = t0;
    s->t1 = t1 > t0 ? t1 : t0;
    s->gpu_ms = -1;
    return s;
}

kiln_traces *kiln_traces_create(int cap, kiln_err *err)
{
    kiln_traces *s = calloc(1, sizeof *s);
    if (s)
        s->e = calloc((size_t)cap, sizeof *s->e);
    if (!s || !s->e) {
        free(s);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->cap = cap;
    return s;
}

void kiln_traces_destroy(kiln_traces *s)
{
    if (s)
        free(s->e);
    free(s);
}

void kiln_traces_put(kiln_traces *s, const char *id, int status, const kiln_trace *t)
{
    entry *e = &s->e[s->next];
    s->next = (s->next + 1) % s->cap;
    snprintf(e->id, sizeof e->id, "%s", id);
    e->status = status;
    e->t = *t;
}

static const entry *find(const kiln_traces *s, const char *id)
{
    for (int i = 0; i < s->cap; i++)
        if (s->e[i].id[0] && !strcmp(s->e[i].id, id))
            return &s->e[i];
    return NULL;
}

int kiln_traces_json(const kiln_traces *s, const char *id, kiln_buf *out, kiln_err *err)
{
    const entry *e = find(s, id);
    if (!e)
        return 1;
    const kiln_trace *t = &e->t;
    double t0 = t->n ? t->span[0].t0 : 0;
    for (int i = 1; i < t->n; i++)
        if (t->span[i].t0 < t0)
            t0 = t->span[i].t0;
    /* tracks in order of first appearance: pid 1 is the first (the gateway) */
    const char *tracks[KILN_TRACE_MAX_SPANS];
    int n_tracks = 0, pid[KILN_TRACE_MAX_SPANS];
    for (int i = 0; i < t->n; i++) {
        int k = 0;
        while (k < n_tracks && strcmp(tracks[k], t->span[i].track))
            k++;
        if (k == n_tracks)
            tracks[n_tracks++] = t->span[i].track;
        pid[i] = k + 1;
    }
    size_t start = out->len;
    char line[512];
    kiln_status st = kiln_buf_append(out, "{\"traceEvents\":[", 16, err);
    for (int k = 0; !st && k < n_tracks; k++) {
        /* ids are [A-Za-z0-9._:@-]: nothing to escape */
        int n = snprintf(line, sizeof line,
                         "%s{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":1,"
                         "\"args\":{\"name\":\"%s\"}},"
                         "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":1,"
                         "\"args\":{\"sort_index\":%d}}",
                         k ? "," : "", k + 1, tracks[k], k + 1, k);
        st = kiln_buf_append(out, line, (size_t)n, err);
    }
    for (int i = 0; !st && i < t->n; i++) {
        const kiln_trace_span *sp = &t->span[i];
        char args[64] = "";
        if (sp->gpu_ms >= 0)
            snprintf(args, sizeof args, ",\"args\":{\"gpu_ms\":%.3f}", sp->gpu_ms);
        int n = snprintf(line, sizeof line,
                         ",{\"ph\":\"X\",\"name\":\"%s\",\"cat\":\"kiln\",\"pid\":%d,\"tid\":1,"
                         "\"ts\":%.0f,\"dur\":%.0f%s}",
                         sp->name, pid[i], (sp->t0 - t0) * 1000.0, (sp->t1 - sp->t0) * 1000.0,
                         args);
        st = kiln_buf_append(out, line, (size_t)n, err);
    }
    if (!st) {
        /* a client's X-Request-Id may hold anything printable: no quote or
         * backslash reaches the JSON */
        char id[KILN_REQUEST_ID_MAX];
        for (size_t i = 0; i < sizeof id; i++) {
            char c = e->id[i];
            id[i] = c == '"' || c == '\\' || (c && (unsigned char)c < 0x20) ? '_' : c;
            if (!c)
                break;
        }
        int n = snprintf(line, sizeof line,
                         "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"request_id\":\"%s\","
                         "\"status\":%d}}",
                         id, e->status);
        st = kiln_buf_append(out, line, (size_t)n, err);
    }
    if (st)
        out->len = start;
    return st;
}

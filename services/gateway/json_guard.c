#include "json_guard.h"

#include <stdio.h>
#include <string.h>

/* The scan only tracks what it needs: strings (with their escapes),
 * nesting, and where the root object's keys are, to name fields. */
typedef struct scan {
    const char *p, *end;
    int nodes, depth;
    int root_key_next; /* in the root object, the next string is a key */
    char *field;
    size_t field_cap;
} scan;

static kiln_status refuse(scan *s, kiln_err *err, kiln_status st, const char *what)
{
    if (s->field[0])
        return kiln_err_set(err, st, "%s %s", s->field, what);
    return kiln_err_set(err, st, "request body %s", what);
}

static int is_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A string starting at s->p (the opening quote); leaves s->p past its end. */
static kiln_status string(scan *s, int is_key, kiln_err *err)
{
    const char *start = ++s->p;
    while (s->p < s->end && *s->p != '"') {
        unsigned char c = (unsigned char)*s->p;
        if (c < 0x20)
            return refuse(s, err, KILN_ERR_FORMAT,
                          "must not contain raw control characters (JSON escapes them)");
        if (c == '\\') {
            if (s->end - s->p >= 6 && s->p[1] == 'u' && memcmp(s->p + 2, "0000", 4) == 0)
                return refuse(s, err, KILN_ERR_INVALID, "must not contain NUL characters");
            /* \uXXXX is skipped whole; any other escape is two bytes. */
            s->p += s->end - s->p >= 6 && s->p[1] == 'u' && is_hex(s->p[2]) ? 6 : 2;
            continue;
        }
        s->p++;
    }
    if (is_key) {
        size_t n = (size_t)(s->p - start);
        snprintf(s->field, s->field_cap, "%.*s", (int)(n < s->field_cap ? n : s->field_cap - 1),
                 start);
    }
    s->p++; /* the closing quote (past the end for an unterminated string) */
    return KILN_OK;
}

kiln_status kiln_json_guard(const char *text, size_t len, const kiln_json_guard_limits *lim,
                            char *field, size_t field_cap, kiln_err *err)
{
    scan s = {.p = text, .end = text + len, .field = field, .field_cap = field_cap};
    field[0] = '\0';
    int in_root_object = 0;
    while (s.p < s.end) {
        char c = *s.p;
        switch (c) {
        case '"': {
            int is_key = in_root_object && s.depth == 1 && s.root_key_next;
            if (is_key)
                s.root_key_next = 0;
            else
                s.nodes++;
            if (string(&s, is_key, err))
                return err ? err->code : KILN_ERR_FORMAT;
            break;
        }
        case '{':
        case '[':
            if (s.depth == 0 && c == '{')
                in_root_object = 1;
            if (++s.depth > lim->max_depth)
                return refuse(&s, err, KILN_ERR_FORMAT, "is nested too deeply");
            s.nodes++;
            s.root_key_next = s.depth == 1 && c == '{';
            s.p++;
            break;
        case '}':
        case ']':
            s.depth--;
            if (s.depth == 1)
                s.root_key_next = 0;
            s.p++;
            break;
        case ',':
            if (s.depth == 1 && in_root_object) {
                s.root_key_next = 1;
                field[0] = '\0';
            }
            s.p++;
            break;
        case ' ': case '\t': case '\r': case '\n': case ':':
            s.p++;
            break;
        default:
            /* A number or literal: one node for the run of its characters. */
            s.nodes++;
            do
                s.p++;
            while (s.p < s.end && *s.p && !strchr("\"{}[],: \t\r\n", *s.p));
            break;
        }
        if (s.nodes > lim->max_nodes)
            return refuse(&s, err, KILN_ERR_FORMAT, "has too many JSON values");
    }
    return KILN_OK;
}

/* kiln_checkpoint_model_name, apart from the checkpoint reader: the
 * gateway names the model it serves from the folder's path but never opens
 * the checkpoint (the replicas tell it the model's traits), so it links
 * this file and not checkpoint.c. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"

/* [begin, end) of the last path component before `end`. */
static size_t last_part(const char *path, size_t end, size_t *begin)
{
    while (end > 1 && path[end - 1] == '/')
        end--;
    size_t b = end;
    while (b > 0 && path[b - 1] != '/')
        b--;
    *begin = b;
    return end;
}

void kiln_checkpoint_model_name(const char *dir, char *out, size_t cap)
{
    if (!cap)
        return;
    char real[PATH_MAX];
    const char *path = realpath(dir, real) ? real : dir;
    size_t b0, e0 = last_part(path, strlen(path), &b0);
    const char *name = path + b0;
    size_t len = e0 - b0;
    /* models--ORG--NAME/snapshots/<commit> */
    size_t b1 = 0, b2 = 0;
    size_t e1 = b0 ? last_part(path, b0, &b1) : 0;
    size_t e2 = e1 && b1 ? last_part(path, b1, &b2) : 0;
    char hub[256] = "";
    if (e1 && e1 - b1 == 9 && !memcmp(path + b1, "snapshots", 9) && e2 && e2 - b2 > 8 &&
        !memcmp(path + b2, "models--", 8) && e2 - b2 < sizeof hub) {
        snprintf(hub, sizeof hub, "%.*s", (int)(e2 - b2 - 8), path + b2 + 8);
        char *sep = strstr(hub, "--"); /* the hub's cache writes ORG/NAME as ORG--NAME */
        if (sep) {
            sep[0] = '/';
            memmove(sep + 1, sep + 2, strlen(sep + 2) + 1);
        }
        name = hub, len = strlen(hub);
    }
    size_t n = 0;
    for (size_t i = 0; i < len && n + 1 < cap; i++) {
        char ch = name[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                 ch == '.' || ch == '_' || ch == '-' || (ch == '/' && name == hub);
        out[n++] = ok ? ch : '_';
    }
    out[n] = '\0';
    if (!n || !strcmp(out, "/"))
        snprintf(out, cap, "model");
}

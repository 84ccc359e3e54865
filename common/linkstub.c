#include "linkstub.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define STUB_MAX 1024
#define STUB_HOPS 8

/* Reads the stub's target, or returns -1 when the file is not a stub. */
static int read_stub(const char *path, char *target, size_t len)
{
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size == 0 ||
        sb.st_size >= STUB_MAX || (size_t)sb.st_size >= len)
        return -1;
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t n = fread(target, 1, (size_t)sb.st_size, f);
    fclose(f);
    if (n != (size_t)sb.st_size)
        return -1;
    if (target[n - 1] == '\n')
        n--;
    target[n] = '\0';
    if (n == 0 || target[0] == '/')
        return -1;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)target[i] < 0x20 || (unsigned char)target[i] > 0x7e)
            return -1;
    return 0;
}

int kiln_linkstub_resolve(const char *path, char *out, size_t len)
{
    if ((size_t)snprintf(out, len, "%s", path) >= len)
        return -1;
    for (int hop = 0; hop < STUB_HOPS; hop++) {
        char target[STUB_MAX], next[4096];
        if (read_stub(out, target, sizeof target) != 0)
            return 0;
        const char *slash = strrchr(out, '/');
        int dirlen = slash ? (int)(slash - out + 1) : 0;
        if ((size_t)snprintf(next, sizeof next, "%.*s%s", dirlen, out, target) >= sizeof next)
            return 0;
        struct stat sb;
        if (stat(next, &sb) != 0 || !S_ISREG(sb.st_mode))
            return 0; /* not a stub after all: a short text file */
        if ((size_t)snprintf(out, len, "%s", next) >= len)
            return -1;
    }
    return 0;
}

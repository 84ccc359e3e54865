/* File helpers for tests that write files (checkpoint I/O, the CLI end to
 * end tests): a private temporary folder removed at exit, and writing raw
 * bytes.
 *
 *   const char *dir = io_tmpdir();          // "/tmp/kiln-io-XXXXXX", created once
 *   io_write(io_path("a.safetensors"), bytes, n);
 */
#ifndef KILN_TESTS_IO_HELPERS_H
#define KILN_TESTS_IO_HELPERS_H

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char io_dir_[256];

static int io_rm_(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void io_cleanup_(void)
{
    if (io_dir_[0])
        nftw(io_dir_, io_rm_, 16, FTW_DEPTH | FTW_PHYS);
}

static inline const char *io_tmpdir(void)
{
    if (!io_dir_[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(io_dir_, sizeof io_dir_, "%s/kiln-io-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(io_dir_)) {
            perror("mkdtemp");
            exit(1);
        }
        atexit(io_cleanup_);
    }
    return io_dir_;
}

/* Joins name onto the temporary folder (rotating static buffers). */
static inline const char *io_path(const char *name)
{
    static char bufs[8][512];
    static int k;
    char *b = bufs[k++ % 8];
    snprintf(b, sizeof bufs[0], "%s/%s", io_tmpdir(), name);
    return b;
}

static inline int io_write(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = n ? fwrite(data, 1, n, f) : 0;
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

static inline int io_write_str(const char *path, const char *s) { return io_write(path, s, strlen(s)); }

#endif

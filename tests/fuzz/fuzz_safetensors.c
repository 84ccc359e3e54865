/* libFuzzer target for the safetensors reader (built with -Dfuzz=true and
 * clang).  An input starting with '{' is a shard index placed beside a
 * fixed valid shard "a.safetensors"; anything else is a whole .safetensors
 * file.  Files go through a memfd so the real open/mmap path runs.  A
 * successful open must expose only tensors whose bytes lie in the mapping,
 * which the loop over kiln_st_at checks by reading every byte. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/safetensors.h"

static char dir[64];

static void cleanup(void)
{
    char p[128];
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/m.safetensors.index.json", dir);
    unlink(p);
    rmdir(dir);
}

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln-fuzz-XXXXXX");
    if (!mkdtemp(dir))
        abort();
    float v[2] = {1, 2};
    kiln_st_entry e[] = {{"x", KILN_F32, 1, {2}, v}, {"y", KILN_F32, 1, {1}, v}};
    char p[128];
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    kiln_err err = {0};
    if (kiln_st_write(p, e, 2, &err))
        abort();
    atexit(cleanup);
}

static void touch_all(const kiln_st *st)
{
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < kiln_st_count(st); i++) {
        const kiln_st_tensor *t = kiln_st_at(st, i);
        for (size_t b = 0; b < t->nbytes; b++)
            sink ^= ((const uint8_t *)t->data)[b];
        if (kiln_st_find(st, t->name) != t)
            abort();
    }
    (void)sink;
}

static void open_and_check(const char *path)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(path, "fuzz", &err);
    if (st) {
        touch_all(st);
        kiln_st_close(st);
    } else if (err.code == KILN_OK || !err.msg[0]) {
        abort(); /* a refusal must say why */
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0])
        setup();
    if (size && data[0] == '{') {
        char p[128];
        snprintf(p, sizeof p, "%s/m.safetensors.index.json", dir);
        FILE *f = fopen(p, "wb");
        if (!f || fwrite(data, 1, size, f) != size || fclose(f))
            abort();
        open_and_check(p);
        return 0;
    }
    int fd = memfd_create("st", MFD_CLOEXEC);
    if (fd < 0 || (size && write(fd, data, size) != (ssize_t)size))
        abort();
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    open_and_check(p);
    close(fd);
    return 0;
}

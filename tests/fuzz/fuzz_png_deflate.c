/* libFuzzer target for kiln's run-only deflate (common/image_png_deflate.c;
 * built with -Dfuzz=true and clang): any bytes, cut into 1..4 calls by the
 * first byte, are deflated as consecutive PNG stripes would be; the output
 * must stay within kiln_image_png_deflate_bound and zlib's inflate must read
 * back exactly the input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "common/image_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (!len)
        return 0;
    int parts = 1 + data[0] % 4;
    data++, len--;
    size_t cap = 0;
    for (int p = 0; p < parts; p++)
        cap += kiln_image_png_deflate_bound(len);
    uint8_t *z = malloc(cap), *back = malloc(len + 1);
    if (!z || !back)
        abort();
    size_t zn = 0;
    for (int p = 0; p < parts; p++) {
        size_t a = len * p / parts, b = len * (p + 1) / parts;
        size_t got = kiln_image_png_deflate_rle(data + a, b - a, p == parts - 1, z + zn);
        if (got > kiln_image_png_deflate_bound(b - a))
            abort();
        zn += got;
    }
    z_stream s;
    memset(&s, 0, sizeof s);
    if (inflateInit2(&s, -15) != Z_OK)
        abort();
    s.next_in = z;
    s.avail_in = (uInt)zn;
    s.next_out = back;
    s.avail_out = (uInt)len + 1;
    int rc = inflate(&s, Z_FINISH);
    if (rc != Z_STREAM_END || s.avail_in || s.total_out != len || memcmp(back, data, len))
        abort();
    inflateEnd(&s);
    free(z);
    free(back);
    return 0;
}

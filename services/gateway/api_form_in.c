/* multipart/form-data request bodies: files and text fields. */
#include <stdlib.h>

#include "api_impl.h"
#include "multipart.h"

kiln_status api_read_form(api_draft *d, const char *content_type, const void *body, size_t len,
                          kiln_api_error *e)
{
    char boundary[KILN_MULTIPART_BOUNDARY_MAX];
    kiln_err err = {0};
    if (kiln_multipart_boundary(content_type, boundary, &err))
        return api_fail(e, err.code, "", "invalid_multipart", "%s", err.msg);
    kiln_multipart_part *parts = malloc(KILN_MULTIPART_MAX_PARTS * sizeof *parts);
    if (!parts)
        return api_fail(e, KILN_ERR_NOMEM, NULL, "server_error", "out of memory");
    int n = 0;
    kiln_status st = kiln_multipart_parse(body, len, boundary, parts, KILN_MULTIPART_MAX_PARTS,
                                          &n, &err);
    if (st)
        api_fail(e, st, "", "invalid_multipart", "%s", err.msg);
    for (int i = 0; !st && i < n; i++) {
        api_value v = {.text = (const char *)parts[i].data, .len = parts[i].len};
        st = api_set(d, parts[i].name, &v, e);
    }
    free(parts);
    return st;
}

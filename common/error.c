#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

kiln_status kiln_err_set(kiln_err *err, kiln_status code, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

kiln_status kiln_err_wrap(kiln_err *err, const char *fmt, ...)
{
    if (!err)
        return KILN_OK;
    char prefix[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* prefix ": " old message, truncated to the buffer. */
    char joined[KILN_ERR_MSG_MAX];
    size_t p = strnlen(prefix, sizeof joined - 1);
    memcpy(joined, prefix, p);
    const char *sep = ": ";
    for (size_t i = 0; sep[i] && p < sizeof joined - 1; i++)
        joined[p++] = sep[i];
    size_t m = strnlen(err->msg, sizeof err->msg);
    if (m > sizeof joined - 1 - p)
        m = sizeof joined - 1 - p;
    memcpy(joined + p, err->msg, m);
    joined[p + m] = '\0';
    memcpy(err->msg, joined, sizeof joined);
    return err->code;
}

void kiln_err_clear(kiln_err *err)
{
    if (!err)
        return;
    err->code = KILN_OK;
    err->msg[0] = '\0';
}

const char *kiln_status_name(kiln_status code)
{
    switch (code) {
    case KILN_OK: return "ok";
    case KILN_ERR_INVALID: return "invalid";
    case KILN_ERR_NOT_FOUND: return "not_found";
    case KILN_ERR_IO: return "io";
    case KILN_ERR_FORMAT: return "format";
    case KILN_ERR_NOMEM: return "nomem";
    case KILN_ERR_UNSUPPORTED: return "unsupported";
    case KILN_ERR_TOO_LARGE: return "too_large";
    case KILN_ERR_BUSY: return "busy";
    case KILN_ERR_UNAVAILABLE: return "unavailable";
    case KILN_ERR_CANCELLED: return "cancelled";
    case KILN_ERR_DEVICE: return "device";
    case KILN_ERR_INTERNAL: return "internal";
    }
    return "unknown";
}

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
    char old[KILN_ERR_MSG_MAX];
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", prefix, old);
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

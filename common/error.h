/* kiln error reporting: a status code plus a message in a caller-owned buffer.
 *
 *   kiln_err err = {0};
 *   kiln_st *st = kiln_st_open("model.safetensors", &err);
 *   if (!st) { fprintf(stderr, "kiln: %s\n", err.msg); return err.code; }
 *
 * Every fallible function takes a `kiln_err *` as its last argument and
 * returns a status (or NULL / -1).  There is no global error state: each
 * request or context owns its own kiln_err, so this is thread-safe as long
 * as one kiln_err is not shared between threads.
 *
 * Messages must never contain absolute paths when they may reach an HTTP
 * client; code that reads files names the component ("transformer/config.json")
 * rather than the path on disk.
 */
#ifndef KILN_ERROR_H
#define KILN_ERROR_H

#include <stddef.h>

typedef enum kiln_status {
    KILN_OK = 0,
    KILN_ERR_INVALID,     /* bad input from a user or file: HTTP 400 */
    KILN_ERR_NOT_FOUND,   /* a missing file, tensor or component */
    KILN_ERR_IO,          /* read/write/mmap failure */
    KILN_ERR_FORMAT,      /* a corrupt or hostile file */
    KILN_ERR_NOMEM,       /* allocation failure (host or device) */
    KILN_ERR_UNSUPPORTED, /* valid but not implemented here */
    KILN_ERR_TOO_LARGE,   /* input over a configured limit: HTTP 413 */
    KILN_ERR_BUSY,        /* queue full: HTTP 429 */
    KILN_ERR_UNAVAILABLE, /* a stage is down: HTTP 503 */
    KILN_ERR_CANCELLED,   /* the client went away */
    KILN_ERR_DEVICE,      /* CUDA / driver failure */
    KILN_ERR_INTERNAL,    /* a bug or an unexpected fault: HTTP 500 */
} kiln_status;

#define KILN_ERR_MSG_MAX 512

typedef struct kiln_err {
    kiln_status code;
    char msg[KILN_ERR_MSG_MAX];
} kiln_err;

/* Records `code` and a printf-style message in `err` (which may be NULL) and
 * returns `code`, so callers can write `return kiln_err_set(err, ...)`.
 * A later call overwrites an earlier one. */
kiln_status kiln_err_set(kiln_err *err, kiln_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends "context: " to the message already in `err`, keeping its code.
 * Returns err->code (KILN_OK when err is NULL). */
kiln_status kiln_err_wrap(kiln_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears `err` back to KILN_OK with an empty message. */
void kiln_err_clear(kiln_err *err);

/* A short constant name for a status ("invalid", "not_found", ...). */
const char *kiln_status_name(kiln_status code);

#endif

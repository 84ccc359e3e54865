/* kiln gateway API keys: the optional bearer keys of the HTTP API
 * (`--api-key-file`, docs/API.md "Authentication").
 *
 *   kiln_api_keys *k = kiln_api_keys_load("/run/secrets/kiln-api-keys", &err);
 *   if (!kiln_api_keys_check(k, req->authorization)) ...401 invalid_api_key...
 *   kiln_api_keys_free(k);
 *
 * The file holds one key per line (several keys let an operator rotate
 * them without a gap); blank lines and lines starting with '#' are
 * ignored.  A key is 16..256 printable ASCII characters without spaces;
 * anything else is refused with KILN_ERR_INVALID naming the line.  A
 * check compares the presented key with every key in time that depends
 * only on the presented key's length, so timing tells nothing about how
 * much of a key matched.
 *
 * Thread-safety: load once; checks only read and may run on any thread.
 */
#ifndef KILN_GW_API_KEYS_H
#define KILN_GW_API_KEYS_H

#include "common/error.h"

#define KILN_API_KEY_MIN 16
#define KILN_API_KEY_MAX 256

typedef struct kiln_api_keys kiln_api_keys;

/* NULL with err set: KILN_ERR_NOT_FOUND / _IO when the file cannot be read,
 * _INVALID for a bad line or a file without keys. */
kiln_api_keys *kiln_api_keys_load(const char *path, kiln_err *err);
void kiln_api_keys_free(kiln_api_keys *k);

/* 1 when `authorization` (the Authorization header's value, NULL when the
 * request had none) is "Bearer <key>" with one of the keys; the scheme is
 * case-insensitive. */
int kiln_api_keys_check(const kiln_api_keys *k, const char *authorization);

#endif

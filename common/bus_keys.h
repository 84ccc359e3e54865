/* kiln bus keys: the ZeroMQ CURVE keys that authenticate the bus, read
 * from the files an operator gives (docs/OPERATIONS.md, "Securing the
 * bus").
 *
 *   kiln_bus_keys k = {0};
 *   // gateway: its secret key and the replicas' public keys
 *   if (kiln_bus_keys_load_secret(&k, "gateway.key", &err) ||
 *       kiln_bus_keys_load_allow(&k, "replicas.allow", &err)) ...
 *   // replica: its secret key and the gateway's public key
 *   if (kiln_bus_keys_load_secret(&k, "denoiser.key", &err) ||
 *       kiln_bus_keys_load_server(&k, "gateway.pub", &err)) ...
 *   kiln_bus *b = kiln_bus_bind(endpoint, &k, &err);     // common/bus.h
 *   kiln_bus_keys_free(&k);
 *
 * A key is 40 characters of Z85 (ZeroMQ's text form of a 32-byte CURVE
 * key, as zmq_curve_keypair and `kiln keygen` write it).  A key file holds
 * one key on a line of its own; an allow-list holds one public key per
 * line, optionally followed by white space and a label.  In both, blank
 * lines and lines starting with '#' are ignored.  Anything else (a short
 * or long key, a character outside Z85, a second key in a key file, an
 * empty allow-list) is refused with KILN_ERR_INVALID naming the file
 * and line (these are start-up errors for the operator, never shown to
 * an HTTP client).  A secret key file that others can read is
 * accepted with a warning in the log (containers often mount secrets
 * that way).
 *
 * Not thread-safe: fill a kiln_bus_keys before handing it on; after that
 * it is only read.
 */
#ifndef KILN_BUS_KEYS_H
#define KILN_BUS_KEYS_H

#include <stdint.h>

#include "error.h"

#define KILN_BUS_KEY_TEXT 41 /* 40 Z85 characters and the NUL */
#define KILN_BUS_KEY_BYTES 32

typedef struct kiln_bus_keys {
    /* This end's keypair; secret[0] == '\0': the bus runs without CURVE. */
    char secret[KILN_BUS_KEY_TEXT], public_key[KILN_BUS_KEY_TEXT];
    /* A replica: the gateway's public key. */
    char server[KILN_BUS_KEY_TEXT];
    /* The gateway: the public keys of the replicas it lets in (owned). */
    uint8_t (*allow)[KILN_BUS_KEY_BYTES];
    int n_allow;
} kiln_bus_keys;

/* 1 when this build's libzmq supports CURVE (zmq_has("curve")). */
int kiln_bus_curve_available(void);

/* Reads a secret key file into k->secret and derives k->public_key.
 * KILN_ERR_NOT_FOUND / _IO when it cannot be read, _INVALID when it holds
 * no valid key, _UNSUPPORTED without CURVE. */
kiln_status kiln_bus_keys_load_secret(kiln_bus_keys *k, const char *path, kiln_err *err);

/* Reads a public key file (the gateway's) into k->server; errors as above. */
kiln_status kiln_bus_keys_load_server(kiln_bus_keys *k, const char *path, kiln_err *err);

/* Reads an allow-list into k->allow (replacing one loaded before); errors
 * as above, and _INVALID for a list without keys. */
kiln_status kiln_bus_keys_load_allow(kiln_bus_keys *k, const char *path, kiln_err *err);

/* Adds one public key (Z85) to k->allow.  _INVALID for a bad key, _NOMEM. */
kiln_status kiln_bus_keys_allow(kiln_bus_keys *k, const char *z85, kiln_err *err);

/* 1 when the 32-byte key is in k->allow. */
int kiln_bus_keys_allowed(const kiln_bus_keys *k, const uint8_t key[KILN_BUS_KEY_BYTES]);

/* A fresh keypair (zmq_curve_keypair, from libsodium's random source). */
kiln_status kiln_bus_keygen(char public_key[KILN_BUS_KEY_TEXT], char secret[KILN_BUS_KEY_TEXT],
                            kiln_err *err);

/* Makes a fresh keypair and writes the secret key to `secret_path`
 * (mode 0600) and the public key to `public_path` (0644), each created
 * new, never over an existing file; `public_key` (may be NULL) receives
 * the public key.  KILN_ERR_IO naming the path (nothing is left behind). */
kiln_status kiln_bus_keys_write_pair(const char *secret_path, const char *public_path,
                                     char public_key[KILN_BUS_KEY_TEXT], kiln_err *err);

/* Frees k->allow; the rest of k is plain data.  Accepts a zeroed k. */
void kiln_bus_keys_free(kiln_bus_keys *k);

#endif

#include "bus_keys.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "buf.h"
#include "log.h"

#define KEY_FILE_MAX (1u << 20) /* an allow-list of ~20000 keys */

int kiln_bus_curve_available(void) { return zmq_has("curve") == 1; }

static int z85_char(char c)
{
    /* ZeroMQ RFC 32's alphabet. */
    return c && strchr("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                       ".-:+=^!/*?&<>()[]{}@%$#",
                       c) != NULL;
}

/* Decodes one Z85 key of exactly 40 characters; 0 or -1. */
static int decode_key(const char *s, size_t n, uint8_t out[KILN_BUS_KEY_BYTES])
{
    if (n != KILN_BUS_KEY_TEXT - 1)
        return -1;
    char text[KILN_BUS_KEY_TEXT];
    for (size_t i = 0; i < n; i++)
        if (!z85_char(s[i]))
            return -1;
    memcpy(text, s, n);
    text[n] = '\0';
    return zmq_z85_decode(out, text) ? 0 : -1;
}

static kiln_status read_file(const char *path, kiln_buf *out, struct stat *st, kiln_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "cannot read key file '%s': %s", path, strerror(errno));
    kiln_status rc = KILN_OK;
    if (fstat(fd, st) || !S_ISREG(st->st_mode)) {
        rc = kiln_err_set(err, KILN_ERR_INVALID, "key file '%s' is not a regular file", path);
    } else if ((unsigned long long)st->st_size > KEY_FILE_MAX) {
        rc = kiln_err_set(err, KILN_ERR_INVALID, "key file '%s' is larger than %u bytes", path,
                          KEY_FILE_MAX);
    } else if (!(rc = kiln_buf_reserve(out, (size_t)st->st_size + 1, err))) {
        ssize_t n;
        while ((n = read(fd, out->data + out->len, (size_t)st->st_size - out->len)) > 0)
            out->len += (size_t)n;
        if (n < 0 || out->len != (size_t)st->st_size)
            rc = kiln_err_set(err, KILN_ERR_IO, "cannot read key file '%s'", path);
        else
            out->data[out->len] = '\0';
    }
    close(fd);
    return rc;
}

typedef kiln_status (*line_fn)(void *ud, const char *key, size_t n, int line, kiln_err *err);

/* Calls fn for the first word of every line that is not blank or a
 * comment; a word followed by anything but white space and a label is up
 * to fn (which sees only the word). */
static kiln_status each_key(const char *path, int labels, line_fn fn, void *ud, kiln_err *err,
                            struct stat *st)
{
    kiln_buf b = {0};
    kiln_status rc = read_file(path, &b, st, err);
    const char *p = b.len ? (const char *)b.data : "";
    for (int line = 1; !rc && *p; line++) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        size_t i = 0;
        while (i < len && (p[i] == ' ' || p[i] == '\t' || p[i] == '\r'))
            i++;
        if (i < len && p[i] != '#') {
            size_t w = i;
            while (w < len && p[w] != ' ' && p[w] != '\t' && p[w] != '\r')
                w++;
            size_t rest = w;
            while (rest < len && (p[rest] == ' ' || p[rest] == '\t' || p[rest] == '\r'))
                rest++;
            if (rest < len && !labels)
                rc = kiln_err_set(err, KILN_ERR_INVALID,
                                  "key file '%s' line %d: expected one key alone on the line",
                                  path, line);
            else
                rc = fn(ud, p + i, w - i, line, err);
        }
        p += len + (end != NULL);
    }
    kiln_buf_free(&b);
    return rc;
}

typedef struct one_key {
    const char *path;
    char *out;
    int found;
} one_key;

static kiln_status take_one(void *ud, const char *key, size_t n, int line, kiln_err *err)
{
    one_key *o = ud;
    uint8_t bin[KILN_BUS_KEY_BYTES];
    if (o->found)
        return kiln_err_set(err, KILN_ERR_INVALID, "key file '%s' line %d: a second key (a key "
                            "file holds one)", o->path, line);
    if (decode_key(key, n, bin))
        return kiln_err_set(err, KILN_ERR_INVALID, "key file '%s' line %d: not a CURVE key (40 "
                            "characters of Z85 expected, as `kiln keygen` writes)", o->path, line);
    memcpy(o->out, key, n);
    o->out[n] = '\0';
    o->found = 1;
    return KILN_OK;
}

static kiln_status load_one(const char *path, char out[KILN_BUS_KEY_TEXT], struct stat *st,
                            kiln_err *err)
{
    if (!kiln_bus_curve_available())
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this libzmq was built without CURVE "
                            "security, so bus keys cannot be used");
    one_key o = {.path = path, .out = out};
    if (each_key(path, 0, take_one, &o, err, st))
        return err->code;
    if (!o.found)
        return kiln_err_set(err, KILN_ERR_INVALID, "key file '%s' holds no key", path);
    return KILN_OK;
}

kiln_status kiln_bus_keys_load_secret(kiln_bus_keys *k, const char *path, kiln_err *err)
{
    struct stat st;
    char secret[KILN_BUS_KEY_TEXT];
    if (load_one(path, secret, &st, err))
        return err->code;
    if (zmq_curve_public(k->public_key, secret))
        return kiln_err_set(err, KILN_ERR_INVALID, "key file '%s': cannot derive a public key: %s",
                            path, zmq_strerror(zmq_errno()));
    memcpy(k->secret, secret, sizeof secret);
    if (st.st_mode & 077)
        KILN_LOG_WARN("bus key '%s' can be read by other users (mode %03o): a secret key should "
                      "be readable by its owner only", path, (unsigned)(st.st_mode & 0777));
    return KILN_OK;
}

kiln_status kiln_bus_keys_load_server(kiln_bus_keys *k, const char *path, kiln_err *err)
{
    struct stat st;
    return load_one(path, k->server, &st, err);
}

kiln_status kiln_bus_keys_allow(kiln_bus_keys *k, const char *z85, kiln_err *err)
{
    uint8_t bin[KILN_BUS_KEY_BYTES];
    if (decode_key(z85, strlen(z85), bin))
        return kiln_err_set(err, KILN_ERR_INVALID, "not a CURVE public key: 40 characters of Z85 "
                            "expected");
    uint8_t(*v)[KILN_BUS_KEY_BYTES] = realloc(k->allow, (size_t)(k->n_allow + 1) * sizeof *v);
    if (!v)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    k->allow = v;
    memcpy(k->allow[k->n_allow++], bin, sizeof bin);
    return KILN_OK;
}

typedef struct allow_ctx {
    const char *path;
    kiln_bus_keys *k;
} allow_ctx;

static kiln_status allow_line(void *ud, const char *key, size_t n, int line, kiln_err *err)
{
    allow_ctx *a = ud;
    char text[KILN_BUS_KEY_TEXT];
    if (n != sizeof text - 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "allow-list '%s' line %d: not a CURVE public "
                            "key (40 characters of Z85 expected)", a->path, line);
    memcpy(text, key, n);
    text[n] = '\0';
    if (kiln_bus_keys_allow(a->k, text, err))
        return kiln_err_wrap(err, "allow-list '%s' line %d", a->path, line);
    return KILN_OK;
}

kiln_status kiln_bus_keys_load_allow(kiln_bus_keys *k, const char *path, kiln_err *err)
{
    if (!kiln_bus_curve_available())
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this libzmq was built without CURVE "
                            "security, so bus keys cannot be used");
    kiln_bus_keys tmp = {0};
    allow_ctx a = {.path = path, .k = &tmp};
    struct stat st;
    if (each_key(path, 1, allow_line, &a, err, &st)) {
        kiln_bus_keys_free(&tmp);
        return err->code;
    }
    if (!tmp.n_allow)
        return kiln_err_set(err, KILN_ERR_INVALID, "allow-list '%s' holds no key: no replica "
                            "could join", path);
    free(k->allow);
    k->allow = tmp.allow;
    k->n_allow = tmp.n_allow;
    return KILN_OK;
}

int kiln_bus_keys_allowed(const kiln_bus_keys *k, const uint8_t key[KILN_BUS_KEY_BYTES])
{
    for (int i = 0; i < k->n_allow; i++)
        if (!memcmp(k->allow[i], key, KILN_BUS_KEY_BYTES))
            return 1;
    return 0;
}

kiln_status kiln_bus_keygen(char public_key[KILN_BUS_KEY_TEXT], char secret[KILN_BUS_KEY_TEXT],
                            kiln_err *err)
{
    if (!kiln_bus_curve_available())
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this libzmq was built without CURVE "
                            "security");
    if (zmq_curve_keypair(public_key, secret))
        return kiln_err_set(err, KILN_ERR_IO, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
    return KILN_OK;
}

static kiln_status write_file(const char *path, const char *text, unsigned mode, kiln_err *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (mode_t)mode);
    if (fd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "cannot create '%s': %s", path,
                            errno == EEXIST ? "it exists already (not overwritten)"
                                            : strerror(errno));
    size_t len = strlen(text), done = 0;
    while (done < len) {
        ssize_t n = write(fd, text + done, len - done);
        if (n <= 0)
            break;
        done += (size_t)n;
    }
    int bad = done != len || fchmod(fd, (mode_t)mode) || fsync(fd);
    if (close(fd) || bad) {
        unlink(path);
        return kiln_err_set(err, KILN_ERR_IO, "cannot write '%s'", path);
    }
    return KILN_OK;
}

kiln_status kiln_bus_keys_write_pair(const char *secret_path, const char *public_path,
                                     char public_key[KILN_BUS_KEY_TEXT], kiln_err *err)
{
    char pub[KILN_BUS_KEY_TEXT], sec[KILN_BUS_KEY_TEXT], text[160];
    if (kiln_bus_keygen(pub, sec, err))
        return err->code;
    snprintf(text, sizeof text, "# kiln bus secret key (ZeroMQ CURVE, Z85): keep it private\n%s\n",
             sec);
    if (write_file(secret_path, text, 0600, err))
        return err->code;
    snprintf(text, sizeof text, "# kiln bus public key (ZeroMQ CURVE, Z85)\n%s\n", pub);
    if (write_file(public_path, text, 0644, err)) {
        unlink(secret_path);
        return err->code;
    }
    if (public_key)
        memcpy(public_key, pub, sizeof pub);
    return KILN_OK;
}

void kiln_bus_keys_free(kiln_bus_keys *k)
{
    free(k->allow);
    k->allow = NULL;
    k->n_allow = 0;
}

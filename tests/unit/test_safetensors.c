/* safetensors reader and writer: round trips, sharded sets, folders, and a
 * catalogue of corrupt or hostile files that must each be refused with a
 * clear error (never a crash, never the path on disk in the message). */
#include <stdint.h>

#include "common/safetensors.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"

/* Writes a raw file: the 8-byte length (hlen, or strlen(header) when
 * hlen < 0), the header bytes, then `data` zero bytes. */
static const char *raw(const char *name, const char *header, int64_t hlen, size_t data)
{
    const char *path = io_path(name);
    size_t n = strlen(header);
    uint64_t len = hlen < 0 ? n : (uint64_t)hlen;
    unsigned char *buf = calloc(1, 8 + n + data + 1);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(len >> (8 * i));
    memcpy(buf + 8, header, n);
    CHECK(io_write(path, buf, 8 + n + data) == 0);
    free(buf);
    return path;
}

/* raw() of a header holding one tensor "t" with the given dtype and the
 * given JSON shape and data_offsets, then `data` zero bytes. */
static const char *one_tensor(const char *name, const char *dtype, const char *shape,
                              const char *offsets, size_t data)
{
    char header[512];
    snprintf(header, sizeof header, "{\"t\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":%s}}",
             dtype, shape, offsets);
    return raw(name, header, -1, data);
}

static void expect_refused(const char *path, kiln_status code, const char *needle)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(path, "lbl", &err);
    CHECKF(st == NULL, "%s was accepted", path);
    kiln_st_close(st);
    CHECKF(err.code == code, "%s: got %s (%s), want %s", path, kiln_status_name(err.code),
           err.msg, kiln_status_name(code));
    CHECKF(strstr(err.msg, needle) != NULL, "%s: message '%s' lacks '%s'", path, err.msg, needle);
    CHECKF(strstr(err.msg, io_tmpdir()) == NULL, "message leaks the path: %s", err.msg);
    CHECKF(!strncmp(err.msg, "lbl", 3), "message does not start with the label: %s", err.msg);
}

static void test_round_trip(void)
{
    float f[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
    uint16_t h[4] = {0x3f80, 0xbf80, 0x4000, 0x0000};
    int64_t i64 = 42;
    kiln_st_entry e[] = {
        {"z.weight", KILN_F32, 2, {2, 3}, f},
        {"a.bias", KILN_BF16, 1, {4}, h},
        {"m.count", KILN_I64, 0, {0}, &i64},
        {"empty", KILN_F32, 2, {0, 5}, NULL},
        {"q\"uote\\d", KILN_U8, 1, {3}, "abc"},
    };
    kiln_err err = {0};
    const char *path = io_path("rt.safetensors");
    CHECK(kiln_st_write(path, e, 5, &err) == KILN_OK);
    kiln_st *st = kiln_st_open(path, NULL, &err);
    CHECKF(st != NULL, "%s", err.msg);
    if (!st)
        return;
    CHECK(kiln_st_count(st) == 5);
    /* sorted by name; the data block (first tensor) starts 8-byte aligned */
    for (size_t i = 1; i < kiln_st_count(st); i++)
        CHECK(strcmp(kiln_st_at(st, i - 1)->name, kiln_st_at(st, i)->name) < 0);
    CHECK(kiln_st_at(st, 5) == NULL);
    const kiln_st_tensor *t = kiln_st_find(st, "z.weight");
    CHECK(t && t->dtype == KILN_F32 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3);
    CHECK(t && t->nbytes == sizeof f && !memcmp(t->data, f, sizeof f));
    t = kiln_st_find(st, "a.bias");
    CHECK(t && t->dtype == KILN_BF16 && !memcmp(t->data, h, sizeof h));
    CHECK(t && (uintptr_t)t->data % 8 == 0);
    t = kiln_st_find(st, "m.count");
    CHECK(t && t->ndim == 0 && t->nbytes == 8 && *(const int64_t *)t->data == 42);
    t = kiln_st_find(st, "empty");
    CHECK(t && t->nbytes == 0 && t->shape[0] == 0);
    t = kiln_st_find(st, "q\"uote\\d");
    CHECK(t && t->nbytes == 3 && !memcmp(t->data, "abc", 3));
    CHECK(kiln_st_find(st, "missing") == NULL);
    CHECK(kiln_st_find(st, "") == NULL);

    CHECK(kiln_st_expect(st, "z.weight", 2, (int64_t[]){2, 3}, &err) != NULL);
    CHECK(kiln_st_expect(st, "z.weight", 2, (int64_t[]){3, 2}, &err) == NULL);
    CHECK(err.code == KILN_ERR_FORMAT && strstr(err.msg, "z.weight") &&
          strstr(err.msg, "[2, 3]") && strstr(err.msg, "[3, 2]"));
    CHECK(kiln_st_expect(st, "z.weight", KILN_MAX_DIMS + 1, (int64_t[KILN_MAX_DIMS + 1]){0},
                         &err) == NULL && err.code == KILN_ERR_INVALID);
    CHECK(kiln_st_expect(st, "nope", 1, (int64_t[]){1}, &err) == NULL);
    CHECK(err.code == KILN_ERR_NOT_FOUND && strstr(err.msg, "nope") &&
          strstr(err.msg, "rt.safetensors"));
    kiln_st_close(st);

    /* the header is space-padded to 8 bytes */
    FILE *fp = fopen(path, "rb");
    unsigned char len[8];
    CHECK(fp && fread(len, 1, 8, fp) == 8);
    if (fp)
        fclose(fp);
    CHECK(len[0] % 8 == 0);
}

static void test_writer_rejects(void)
{
    float x = 0;
    kiln_err err = {0};
    kiln_st_entry dup[] = {{"a", KILN_F32, 1, {1}, &x}, {"a", KILN_F32, 1, {1}, &x}};
    CHECK(kiln_st_write(io_path("dup.safetensors"), dup, 2, &err) == KILN_ERR_INVALID);
    kiln_st_entry neg[] = {{"a", KILN_F32, 1, {-1}, &x}};
    CHECK(kiln_st_write(io_path("neg.safetensors"), neg, 1, &err) == KILN_ERR_INVALID);
    kiln_st_entry rank[] = {{"a", KILN_F32, KILN_MAX_DIMS + 1, {1}, &x}};
    CHECK(kiln_st_write(io_path("rank.safetensors"), rank, 1, &err) == KILN_ERR_INVALID);
    CHECK(access(io_path("dup.safetensors"), F_OK) != 0);
}

static void test_hostile_files(void)
{
    const char *ok = "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    /* control: the well-formed version of the files below is accepted */
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(raw("good.safetensors", ok, -1, 8), "lbl", &err);
    CHECKF(st != NULL, "%s", err.msg);
    kiln_st_close(st);

    CHECK(io_write(io_path("short.safetensors"), "\x10\0\0", 3) == 0);
    expect_refused(io_path("short.safetensors"), KILN_ERR_FORMAT, "truncated");
    expect_refused(raw("trunc_data.safetensors", ok, -1, 5), KILN_ERR_FORMAT, "beyond the end");
    expect_refused(raw("hlen_eof.safetensors", ok, 1000, 8), KILN_ERR_FORMAT, "past the end");
    expect_refused(raw("hlen_huge.safetensors", ok, INT64_MAX, 8), KILN_ERR_FORMAT,
                   "past the end");
    expect_refused(raw("badjson.safetensors", "{\"t\":{\"dtype\":", -1, 8), KILN_ERR_FORMAT,
                   "not valid JSON");
    expect_refused(raw("empty_hdr.safetensors", "", -1, 0), KILN_ERR_FORMAT, "not valid JSON");
    expect_refused(raw("array.safetensors", "[1,2,3]", -1, 0), KILN_ERR_FORMAT,
                   "not a JSON object");
    expect_refused(raw("trailing.safetensors", "{}  x", -1, 0), KILN_ERR_FORMAT, "trailing");
    expect_refused(one_tensor("dtype.safetensors", "Q7", "[2]", "[0,8]", 8), KILN_ERR_FORMAT,
                   "unknown dtype");
    expect_refused(one_tensor("bool.safetensors", "BOOL", "[2]", "[0,2]", 2), KILN_ERR_UNSUPPORTED,
                   "unsupported dtype BOOL");
    expect_refused(one_tensor("mismatch.safetensors", "F32", "[3]", "[0,8]", 8), KILN_ERR_FORMAT,
                   "need 12");
    expect_refused(one_tensor("beyond.safetensors", "F32", "[4]", "[0,16]", 8), KILN_ERR_FORMAT,
                   "beyond the end");
    expect_refused(one_tensor("reversed.safetensors", "F32", "[0]", "[8,0]", 8), KILN_ERR_FORMAT,
                   "begin <= end");
    expect_refused(raw("overlap.safetensors",
                       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                       -1, 12),
                   KILN_ERR_FORMAT, "overlap");
    expect_refused(one_tensor("negative.safetensors", "F32", "[-2]", "[0,8]", 8), KILN_ERR_FORMAT,
                   "non-negative");
    expect_refused(one_tensor("fraction.safetensors", "F32", "[1.5]", "[0,8]", 8),
                   KILN_ERR_FORMAT, "non-negative integer");
    expect_refused(one_tensor("rank.safetensors", "U8",
                              "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
                              "[0,1]", 1),
                   KILN_ERR_FORMAT, "rank 33");
    expect_refused(one_tensor("overflow.safetensors", "F64", "[4294967296,4294967296,4294967296]",
                              "[0,8]", 8),
                   KILN_ERR_FORMAT, "overflows");
    expect_refused(raw("nooffsets.safetensors", "{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", -1, 8),
                   KILN_ERR_FORMAT, "data_offsets");
    expect_refused(raw("notobj.safetensors", "{\"t\":5}", -1, 0), KILN_ERR_FORMAT,
                   "not an object");
    expect_refused(raw("meta.safetensors", "{\"__metadata__\":{\"format\":1}}", -1, 0),
                   KILN_ERR_FORMAT, "__metadata__");
    expect_refused(raw("meta2.safetensors", "{\"__metadata__\":[]}", -1, 0), KILN_ERR_FORMAT,
                   "__metadata__");
    expect_refused(raw("dupname.safetensors",
                       "{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                       "\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", -1, 8),
                   KILN_ERR_FORMAT, "twice");
    expect_refused(io_path("does-not-exist.safetensors"), KILN_ERR_NOT_FOUND, "not found");

    /* __metadata__ of strings and a tensor-free file are fine */
    st = kiln_st_open(raw("meta_ok.safetensors", "{\"__metadata__\":{\"format\":\"pt\"}}", -1, 0),
                      "lbl", &err);
    CHECKF(st != NULL && kiln_st_count(st) == 0, "%s", err.msg);
    CHECK(st == NULL || kiln_st_find(st, "x") == NULL);
    kiln_st_close(st);
}

/* Writes shard files a (tensors x, y) and b (tensor z) into folder `dir`. */
static void write_shards(const char *dir)
{
    float v[4] = {1, 2, 3, 4};
    char p[600];
    kiln_st_entry a[] = {{"x", KILN_F32, 1, {2}, v}, {"y", KILN_F32, 1, {1}, v + 2}};
    kiln_st_entry b[] = {{"z", KILN_F32, 2, {1, 1}, v + 3}};
    kiln_err err = {0};
    snprintf(p, sizeof p, "%s/m-00001-of-00002.safetensors", dir);
    CHECK(kiln_st_write(p, a, 2, &err) == KILN_OK);
    snprintf(p, sizeof p, "%s/m-00002-of-00002.safetensors", dir);
    CHECK(kiln_st_write(p, b, 1, &err) == KILN_OK);
}

static const char *index_json(const char *name, const char *weight_map)
{
    static char buf[1024];
    snprintf(buf, sizeof buf, "{\"metadata\":{\"total_size\":16},\"weight_map\":{%s}}",
             weight_map);
    CHECK(io_write_str(io_path(name), buf) == 0);
    return io_path(name);
}

static void test_sharded(void)
{
    const char *dir = io_path("sharded");
    CHECK(mkdir(dir, 0755) == 0);
    write_shards(dir);
    const char *good = "\"x\":\"m-00001-of-00002.safetensors\",\"y\":\"m-00001-of-00002."
                       "safetensors\",\"z\":\"m-00002-of-00002.safetensors\"";
    index_json("sharded/m.safetensors.index.json", good);
    kiln_err err = {0};
    /* opened by the index and by the folder */
    for (int k = 0; k < 2; k++) {
        kiln_st *st = kiln_st_open(k ? dir : io_path("sharded/m.safetensors.index.json"),
                                   "transformer", &err);
        CHECKF(st != NULL, "%s", err.msg);
        if (!st)
            continue;
        CHECK(kiln_st_count(st) == 3);
        const kiln_st_tensor *z = kiln_st_find(st, "z");
        CHECK(z && z->ndim == 2 && *(const float *)z->data == 4);
        const kiln_st_tensor *x = kiln_st_find(st, "x");
        CHECK(x && ((const float *)x->data)[1] == 2);
        kiln_st_close(st);
    }
    expect_refused(index_json("sharded/missing.json",
                              "\"x\":\"m-00003-of-00003.safetensors\""),
                   KILN_ERR_NOT_FOUND, "m-00003-of-00003.safetensors");
    expect_refused(index_json("sharded/dotdot.json", "\"x\":\"../rt.safetensors\""),
                   KILN_ERR_FORMAT, "plain file name");
    expect_refused(index_json("sharded/slash.json", "\"x\":\"sub/a.safetensors\""),
                   KILN_ERR_FORMAT, "plain file name");
    expect_refused(index_json("sharded/notstr.json", "\"x\":3"), KILN_ERR_FORMAT,
                   "plain file name");
    expect_refused(index_json("sharded/absent.json",
                              "\"x\":\"m-00001-of-00002.safetensors\",\"y\":\"m-00001-of-00002."
                              "safetensors\",\"z\":\"m-00002-of-00002.safetensors\","
                              "\"w\":\"m-00002-of-00002.safetensors\""),
                   KILN_ERR_FORMAT, "'w' is missing");
    expect_refused(index_json("sharded/unlisted.json", "\"x\":\"m-00001-of-00002.safetensors\""),
                   KILN_ERR_FORMAT, "does not list");
    expect_refused(index_json("sharded/wrongshard.json",
                              "\"x\":\"m-00001-of-00002.safetensors\",\"y\":\"m-00001-of-00002."
                              "safetensors\",\"z\":\"m-00001-of-00002.safetensors\""),
                   KILN_ERR_FORMAT, "'z' is missing from shard m-00001-of-00002");
    CHECK(io_write_str(io_path("sharded/bad.json"), "{\"weight_map\":") == 0);
    expect_refused(io_path("sharded/bad.json"), KILN_ERR_FORMAT, "invalid JSON");
    CHECK(io_write_str(io_path("sharded/nomap.json"), "{\"metadata\":{}}") == 0);
    expect_refused(io_path("sharded/nomap.json"), KILN_ERR_FORMAT, "weight_map");
}

static void test_folders(void)
{
    const char *empty = io_path("emptydir");
    CHECK(mkdir(empty, 0755) == 0);
    expect_refused(empty, KILN_ERR_NOT_FOUND, "no .safetensors");
    const char *two = io_path("twodir");
    CHECK(mkdir(two, 0755) == 0);
    write_shards(two); /* two files, no index: ambiguous */
    expect_refused(two, KILN_ERR_FORMAT, "expected one");
    const char *one = io_path("onedir");
    CHECK(mkdir(one, 0755) == 0);
    float v = 5;
    kiln_st_entry e[] = {{"w", KILN_F32, 1, {1}, &v}};
    kiln_err err = {0};
    CHECK(kiln_st_write(io_path("onedir/model.safetensors"), e, 1, &err) == KILN_OK);
    kiln_st *st = kiln_st_open(one, "vae", &err);
    CHECKF(st && kiln_st_find(st, "w"), "%s", err.msg);
    kiln_st_close(st);
}

/* A sorted lookup must stay fast on full-size checkpoints (hundreds of
 * tensors); this also checks find() against every stored name. */
static void test_many_tensors(void)
{
    enum { N = 600 };
    static char names[N][32];
    static kiln_st_entry e[N];
    uint16_t one = 0x3f80;
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "blocks.%d.weight", (i * 7919) % N);
        e[i] = (kiln_st_entry){names[i], KILN_BF16, 1, {1}, &one};
    }
    kiln_err err = {0};
    CHECK(kiln_st_write(io_path("many.safetensors"), e, N, &err) == KILN_OK);
    kiln_st *st = kiln_st_open(io_path("many.safetensors"), "many", &err);
    CHECKF(st != NULL, "%s", err.msg);
    if (!st)
        return;
    int found = 0;
    for (int i = 0; i < N; i++)
        found += kiln_st_find(st, names[i]) != NULL;
    CHECK(found == N && kiln_st_count(st) == N);
    kiln_st_close(st);
}

int main(void)
{
    RUN(test_round_trip);
    RUN(test_writer_rejects);
    RUN(test_hostile_files);
    RUN(test_sharded);
    RUN(test_folders);
    RUN(test_many_tensors);
    return test_finish();
}

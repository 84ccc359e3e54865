/* The gateway's request and response formats without a server: base64,
 * multipart/form-data, the OpenAI request fields (JSON and multipart, every
 * refusal with its status, param and code), validation through
 * kiln_request_resolve, and the error / image response bodies. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "services/gateway/api_request.h"
#include "services/gateway/api_response.h"
#include "services/gateway/base64.h"
#include "services/gateway/multipart.h"
#include "tests/test.h"

static const kiln_model_traits distilled = {.cfg = 0, .default_steps = 4, .default_guidance = 1.0f,
                                            .shrink_images = 1, .inpaint_strength = 0.8};
static const kiln_model_traits base = {.cfg = 1, .default_steps = 50, .default_guidance = 4.0f,
                                       .shrink_images = 1, .inpaint_strength = 0.8};

static kiln_api_config config(const kiln_model_traits *t)
{
    kiln_api_config c = {.model_id = "klein-tiny", .traits = *t, .limits = KILN_LIMITS_SERVICE,
                         .image_limits = KILN_IMAGE_LIMITS_DEFAULT, .max_body_bytes = 64u << 20};
    c.limits.min_side = 64;
    c.limits.max_side = 1024;
    return c;
}

/* A w x h PNG with a gradient. */
static kiln_buf make_png(int w, int h)
{
    kiln_image img = {0};
    kiln_buf out = {0};
    if (kiln_image_alloc(&img, w, h, NULL))
        abort();
    for (int i = 0; i < w * h * 3; i++)
        img.pixels[i] = (uint8_t)(i * 7);
    if (kiln_image_encode(&img, NULL, &out, NULL))
        abort();
    kiln_image_free(&img);
    return out;
}

static kiln_status parse_json(const char *json, kiln_api_kind kind, const kiln_model_traits *t,
                              kiln_api_request *r, kiln_api_error *e)
{
    kiln_api_config c = config(t);
    return kiln_api_parse(kind, "application/json", json, strlen(json), &c, r, e);
}

/* Expects a 400 (or `status`) naming `param` with `code`. */
static void expect_error(const char *json, kiln_api_kind kind, int status, const char *param,
                         const char *code)
{
    kiln_api_request r;
    kiln_api_error e;
    kiln_status st = parse_json(json, kind, &distilled, &r, &e);
    CHECKF(st != KILN_OK, "accepted: %s", json);
    if (st == KILN_OK) {
        kiln_api_request_free(&r);
        return;
    }
    CHECKF(e.status == status, "%s: status %d", json, e.status);
    CHECKF(strcmp(e.param, param) == 0, "%s: param '%s' (%s)", json, e.param, e.err.msg);
    CHECKF(code == NULL || (e.code && strcmp(e.code, code) == 0), "%s: code %s", json,
           e.code ? e.code : "(null)");
    CHECKF(e.err.msg[0] != '\0', "%s: empty message", json);
    /* Nothing is owned after a failure. */
    CHECK(r.prompt == NULL && r.n_images == 0);
}

static void test_base64(void)
{
    const char *vec[][2] = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                            {"foo", "Zm9v"},  {"foob", "Zm9vYg=="},  {"fooba", "Zm9vYmE="},
                            {"foobar", "Zm9vYmFy"}};
    for (size_t i = 0; i < sizeof vec / sizeof vec[0]; i++) {
        kiln_buf e = {0}, d = {0};
        CHECK(kiln_base64_encode(vec[i][0], strlen(vec[i][0]), &e, NULL) == KILN_OK);
        CHECK(e.len == strlen(vec[i][1]) && (e.len == 0 || memcmp(e.data, vec[i][1], e.len) == 0));
        CHECK(kiln_base64_encoded_len(strlen(vec[i][0])) == e.len);
        CHECK(kiln_base64_decode(vec[i][1], strlen(vec[i][1]), &d, NULL) == KILN_OK);
        CHECK(d.len == strlen(vec[i][0]) && (d.len == 0 || memcmp(d.data, vec[i][0], d.len) == 0));
        kiln_buf_free(&e), kiln_buf_free(&d);
    }
    /* All byte values, both alphabets, no padding, MIME line breaks. */
    uint8_t all[256];
    for (int i = 0; i < 256; i++)
        all[i] = (uint8_t)i;
    kiln_buf e = {0}, d = {0};
    CHECK(kiln_base64_encode(all, sizeof all, &e, NULL) == KILN_OK);
    char *url = malloc(e.len * 2 + 1);
    size_t n = 0;
    for (size_t i = 0; i < e.len; i++) {
        char ch = (char)e.data[i];
        if (ch == '=')
            continue;
        url[n++] = ch == '+' ? '-' : ch == '/' ? '_' : ch;
        if (i % 76 == 75)
            url[n++] = '\n';
    }
    CHECK(kiln_base64_decode(url, n, &d, NULL) == KILN_OK);
    CHECK(d.len == sizeof all && memcmp(d.data, all, sizeof all) == 0);
    free(url);
    kiln_buf_free(&e), kiln_buf_free(&d);
    const char *bad[] = {"Zg=", "Z", "Zm9v!", "Zg==Zg==", "Zh==", "Zm9=", "====", "Zg===", "Z==="};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_buf b = {0};
        kiln_err err = {0};
        CHECKF(kiln_base64_decode(bad[i], strlen(bad[i]), &b, &err) == KILN_ERR_INVALID, "%s",
               bad[i]);
        CHECK(b.len == 0);
        kiln_buf_free(&b);
    }
}

static void test_multipart_boundary(void)
{
    char b[KILN_MULTIPART_BOUNDARY_MAX];
    CHECK(kiln_multipart_boundary("multipart/form-data; boundary=abc123", b, NULL) == KILN_OK);
    CHECK(strcmp(b, "abc123") == 0);
    CHECK(kiln_multipart_boundary("Multipart/Form-Data;charset=utf-8; BOUNDARY=\"a b:c\"", b,
                                  NULL) == KILN_OK);
    CHECK(strcmp(b, "a b:c") == 0);
    CHECK(kiln_multipart_boundary("multipart/form-data", b, NULL) == KILN_ERR_INVALID);
    CHECK(kiln_multipart_boundary("multipart/mixed; boundary=x", b, NULL) == KILN_ERR_INVALID);
    CHECK(kiln_multipart_boundary("multipart/form-data; boundary=\"\"", b, NULL) ==
          KILN_ERR_INVALID);
    CHECK(kiln_multipart_boundary("multipart/form-data; boundary=a\x01", b, NULL) ==
          KILN_ERR_INVALID);
    char longb[200] = "multipart/form-data; boundary=";
    memset(longb + strlen(longb), 'x', 71);
    CHECK(kiln_multipart_boundary(longb, b, NULL) == KILN_ERR_INVALID);
    CHECK(kiln_multipart_boundary("multipart/form-data; boundary=\"abc", b, NULL) ==
          KILN_ERR_INVALID);
}

static void test_multipart_parse(void)
{
    static const char body[] =
        "preamble to ignore\r\n"
        "--XyZ\r\n"
        "Content-Disposition: form-data; name=\"prompt\"\r\n"
        "\r\n"
        "a red \"cat\"\r\n--not the boundary\r\n"
        "--XyZ  \r\n"
        "content-disposition: form-data; name=\"image[]\"; filename=\"a.png\"\r\n"
        "Content-Type: image/png\r\n"
        "\r\n"
        "\x89PNG\r\n\x1a\n\0bytes\r\n"
        "--XyZ\n"
        "Content-Disposition: form-data; name=\"empty\"\n"
        "\n"
        "\r\n"
        "--XyZ--\r\n"
        "epilogue";
    kiln_multipart_part parts[8];
    int n = 0;
    kiln_err err = {0};
    CHECKF(kiln_multipart_parse(body, sizeof body - 1, "XyZ", parts, 4, &n, &err) == KILN_OK, "%s",
           err.msg);
    CHECK(n == 3);
    CHECK(strcmp(parts[0].name, "prompt") == 0 && !parts[0].is_file);
    CHECK(parts[0].len == strlen("a red \"cat\"\r\n--not the boundary") &&
          memcmp(parts[0].data, "a red \"cat\"", 11) == 0);
    CHECK(strcmp(parts[1].name, "image[]") == 0 && parts[1].is_file);
    CHECK(strcmp(parts[1].content_type, "image/png") == 0);
    CHECK(parts[1].len == 14 && parts[1].data[8] == 0);
    CHECK(strcmp(parts[2].name, "empty") == 0 && parts[2].len == 0);

    static const struct {
        const char *body, *why;
    } bad[] = {
        {"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue", "no closing"},
        {"no boundary at all", "missing delimiter"},
        {"--XyZ\r\nContent-Type: text/plain\r\n\r\nv\r\n--XyZ--", "no disposition"},
        {"--XyZ\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nv\r\n--XyZ--", "not form-data"},
        {"--XyZ\r\nContent-Disposition: form-data\r\n\r\nv\r\n--XyZ--", "no name"},
        {"--XyZ\r\nContent-Disposition: form-data; name=\"a\r\n\r\nv\r\n--XyZ--", "unterminated"},
        {"--XyZ\r\nbroken header line\r\n\r\nv\r\n--XyZ--", "header without colon"},
        {"--XyZjunk\r\n", "junk after the delimiter"},
        {"--XyZ\r\nContent-Disposition: form-data; name=\"a\"", "unterminated headers"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err = (kiln_err){0};
        CHECKF(kiln_multipart_parse(bad[i].body, strlen(bad[i].body), "XyZ", parts, 4, &n, &err) ==
                   KILN_ERR_INVALID,
               "%s", bad[i].why);
        CHECK(err.msg[0] != '\0');
    }
    /* Part count limit. */
    char many[4096] = "";
    for (int i = 0; i < 5; i++)
        strcat(many, "--B\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n");
    strcat(many, "--B--");
    CHECK(kiln_multipart_parse(many, strlen(many), "B", parts, 4, &n, NULL) == KILN_ERR_INVALID);
    CHECK(kiln_multipart_parse(many, strlen(many), "B", parts, 5, &n, NULL) == KILN_OK && n == 5);
    /* A field name too long for the buffer. */
    char longname[512];
    snprintf(longname, sizeof longname,
             "--B\r\nContent-Disposition: form-data; name=\"%0100d\"\r\n\r\n1\r\n--B--", 0);
    CHECK(kiln_multipart_parse(longname, strlen(longname), "B", parts, 4, &n, NULL) ==
          KILN_ERR_INVALID);
}

static void test_generation_json(void)
{
    kiln_api_request r;
    kiln_api_error e;
    const char *json =
        "{\"model\":\"klein-tiny\",\"prompt\":\"a cat\",\"n\":3,\"size\":\"128x64\",\"seed\":42,"
        "\"num_inference_steps\":2,\"guidance_scale\":1.5,\"response_format\":\"b64_json\","
        "\"output_format\":\"webp\",\"output_compression\":80,\"max_sequence_length\":77,"
        "\"quality\":\"standard\",\"user\":\"u1\",\"background\":\"opaque\","
        "\"moderation\":\"low\",\"partial_images\":2,\"stream\":false}";
    CHECKF(parse_json(json, KILN_API_GENERATE, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    CHECK(strcmp(r.prompt, "a cat") == 0 && r.plan.req.prompt == r.prompt);
    CHECK(r.plan.req.n == 3 && r.plan.req.width == 128 && r.plan.req.height == 64);
    CHECK(r.seed_given && r.plan.req.seed == 42);
    CHECK(r.plan.req.steps == 2 && r.plan.req.guidance == 1.5f && r.plan.req.max_sequence_length == 77);
    CHECK(r.plan.req.format == KILN_IMAGE_WEBP && r.plan.req.compression == 80);
    CHECK(r.plan.negative == NULL && r.n_images == 0);
    CHECK(strcmp(r.quality, "standard") == 0 && r.user && strcmp(r.user, "u1") == 0);
    /* usage: the transformer's tokens: 77 text, no reference, 2 x (128/16)(64/16). */
    CHECK(r.usage.text_tokens == 77 && r.usage.image_tokens == 0 && r.usage.output_tokens == 96);
    kiln_api_request_free(&r);

    /* Defaults: the model's, resolved; no seed; nulls are "not given". */
    CHECK(parse_json("{\"prompt\":\"x\",\"n\":null,\"seed\":null,\"model\":null}",
                     KILN_API_GENERATE, &distilled, &r, &e) == KILN_OK);
    CHECK(r.plan.req.n == 1 && r.plan.req.width == 1024 && r.plan.req.height == 1024);
    CHECK(!r.seed_given && r.plan.req.steps == 4 && r.plan.req.guidance == 1.0f);
    CHECK(r.plan.req.max_sequence_length == 512 && r.plan.req.format == KILN_IMAGE_PNG);
    CHECK(strcmp(r.quality, "auto") == 0 && r.user == NULL);
    CHECK(r.usage.text_tokens == 512 && r.usage.output_tokens == 64 * 64);
    kiln_api_request_free(&r);
}

/* The default size is 1024x1024 ("auto" too), so a service whose range
 * excludes it needs a size in every request. */
static void test_default_size_limits(void)
{
    kiln_api_request r;
    kiln_api_error e;
    kiln_api_config c = config(&distilled);
    const char *j = "{\"prompt\":\"x\",\"size\":\"auto\"}";
    CHECK(kiln_api_parse(KILN_API_GENERATE, "application/json; charset=utf-8", j, strlen(j), &c,
                         &r, &e) == KILN_OK);
    CHECK(r.plan.req.width == 1024 && r.plan.req.height == 1024);
    kiln_api_request_free(&r);
    c.limits.max_side = 512;
    CHECK(kiln_api_parse(KILN_API_GENERATE, NULL, j, strlen(j), &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(e.status == 400 && strcmp(e.param, "size") == 0);
}

static void test_seeds(void)
{
    kiln_api_request r;
    kiln_api_error e;
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"seed\":\"18446744073709551615\"}",
                     KILN_API_GENERATE, &distilled, &r, &e) == KILN_OK);
    CHECK(r.plan.req.seed == UINT64_MAX && r.seed_given);
    kiln_api_request_free(&r);
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"seed\":9007199254740992}",
                     KILN_API_GENERATE, &distilled, &r, &e) == KILN_OK);
    CHECK(r.plan.req.seed == 9007199254740992ull);
    kiln_api_request_free(&r);
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"seed\":0}", KILN_API_GENERATE,
                     &distilled, &r, &e) == KILN_OK);
    CHECK(r.plan.req.seed == 0 && r.seed_given);
    kiln_api_request_free(&r);
    expect_error("{\"prompt\":\"x\",\"seed\":-1}", KILN_API_GENERATE, 400, "seed", NULL);
    expect_error("{\"prompt\":\"x\",\"seed\":1.5}", KILN_API_GENERATE, 400, "seed", NULL);
    expect_error("{\"prompt\":\"x\",\"seed\":1e300}", KILN_API_GENERATE, 400, "seed", NULL);
    expect_error("{\"prompt\":\"x\",\"seed\":\"18446744073709551616\"}", KILN_API_GENERATE, 400,
                 "seed", NULL);
    expect_error("{\"prompt\":\"x\",\"seed\":\"12a\"}", KILN_API_GENERATE, 400, "seed", NULL);
    expect_error("{\"prompt\":\"x\",\"seed\":true}", KILN_API_GENERATE, 400, "seed", NULL);
}

static void test_json_errors(void)
{
    const kiln_api_kind G = KILN_API_GENERATE;
    expect_error("{\"prompt\":\"x\",", G, 400, "", "invalid_json");
    expect_error("", G, 400, "", "invalid_json");
    expect_error("[1,2]", G, 400, "", "invalid_json");
    expect_error("{\"prompt\":\"x\"} trailing", G, 400, "", "invalid_json");
    expect_error("{}", G, 400, "prompt", NULL);
    expect_error("{\"prompt\":5}", G, 400, "prompt", "invalid_type");
    expect_error("{\"prompt\":\"x\",\"n\":\"2\"}", G, 400, "n", NULL);
    expect_error("{\"prompt\":\"x\",\"n\":2.5}", G, 400, "n", NULL);
    expect_error("{\"prompt\":\"x\",\"n\":0}", G, 400, "n", NULL);
    expect_error("{\"prompt\":\"x\",\"n\":11}", G, 400, "n", NULL);
    expect_error("{\"prompt\":\"x\",\"n\":1e12}", G, 400, "n", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"100x64\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"2048x1024\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"32x32\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"64\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"0x64\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"64x-64\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":\"999999x64\"}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"size\":64}", G, 400, "size", NULL);
    expect_error("{\"prompt\":\"x\",\"num_inference_steps\":0}", G, 400, "num_inference_steps", NULL);
    expect_error("{\"prompt\":\"x\",\"num_inference_steps\":201}", G, 400, "num_inference_steps", NULL);
    expect_error("{\"prompt\":\"x\",\"guidance_scale\":-1}", G, 400, "guidance_scale", NULL);
    expect_error("{\"prompt\":\"x\",\"guidance_scale\":\"1\"}", G, 400, "guidance_scale", NULL);
    expect_error("{\"prompt\":\"x\",\"guidance_scale\":1000}", G, 400, "guidance_scale", NULL);
    expect_error("{\"prompt\":\"x\",\"max_sequence_length\":513}", G, 400, "max_sequence_length", NULL);
    expect_error("{\"prompt\":\"x\",\"max_sequence_length\":0}", G, 400, "max_sequence_length", NULL);
    expect_error("{\"prompt\":\"x\",\"output_compression\":101}", G, 400, "output_compression", NULL);
    expect_error("{\"prompt\":\"x\",\"output_compression\":-5}", G, 400, "output_compression", NULL);
    expect_error("{\"prompt\":\"x\",\"output_format\":\"gif\"}", G, 400, "output_format", NULL);
    expect_error("{\"prompt\":\"x\",\"response_format\":\"url\"}", G, 400, "response_format",
                 "unsupported_value");
    expect_error("{\"prompt\":\"x\",\"response_format\":\"png\"}", G, 400, "response_format", NULL);
    expect_error("{\"prompt\":\"x\",\"model\":\"dall-e-3\"}", G, 400, "model", "model_not_found");
    expect_error("{\"prompt\":\"x\",\"stream\":\"yes\"}", G, 400, "stream", NULL);
    expect_error("{\"prompt\":\"x\",\"negative_prompt\":\"blurry\"}", G, 400, "negative_prompt", NULL);
    expect_error("{\"prompt\":\"x\",\"prompt\":\"y\"}", G, 400, "prompt", NULL);
    expect_error("{\"prompt\":\"\\ud800\"}", G, 400, "", "invalid_json");
    expect_error("{\"prompt\":\"\xff\"}", G, 400, "prompt", NULL);
    expect_error("{\"prompt\":\"x\",\"image\":\"aGk=\"}", G, 400, "image", "unknown_parameter");
    expect_error("{\"prompt\":\"x\"}", KILN_API_EDIT, 400, "image", NULL);
    expect_error("{\"prompt\":\"x\",\"image\":\"not base64!\"}", KILN_API_EDIT, 400, "image",
                 "invalid_image");
    expect_error("{\"prompt\":\"x\",\"image\":\"aGVsbG8gd29ybGQ=\"}", KILN_API_EDIT, 400, "image",
                 "invalid_image");
    expect_error("{\"prompt\":\"x\",\"image\":\"https://example.com/a.png\"}", KILN_API_EDIT, 400,
                 "image", NULL);
    expect_error("{\"prompt\":\"x\",\"image\":\"data:image/png,abc\"}", KILN_API_EDIT, 400,
                 "image", NULL);
    expect_error("{\"prompt\":\"x\",\"image\":[1]}", KILN_API_EDIT, 400, "image", NULL);
    expect_error("{\"prompt\":\"x\",\"image\":\"aGk=\",\"mask\":\"aGk=\"}", KILN_API_EDIT, 400,
                 "image", "invalid_image");
    /* A long prompt is refused by the shared validation, naming its limit. */
    size_t big = (1u << 16) + 10;
    char *json = malloc(big + 32);
    strcpy(json, "{\"prompt\":\"");
    memset(json + 11, 'a', big);
    strcpy(json + 11 + big, "\"}");
    expect_error(json, G, 400, "prompt", NULL);
    free(json);
}

/* The JSON pre-scan: NUL and raw control characters in strings are
 * refused naming the field, the node and nesting budgets hold whatever
 * field carries the values, and bodies are limited by route. */
/* Appends a C string and keeps the buffer NUL-terminated. */
static void put(kiln_buf *b, const char *text)
{
    if (b->len && b->data[b->len - 1] == '\0')
        b->len--;
    kiln_buf_append(b, text, strlen(text) + 1, NULL);
}

static void test_json_limits(void)
{
    const kiln_api_kind G = KILN_API_GENERATE, E = KILN_API_EDIT;
    expect_error("{\"prompt\":\"a\\u0000b\"}", G, 400, "prompt", "invalid_value");
    expect_error("{\"n\":1,\"prompt\":\"\\u0000\"}", G, 400, "prompt", "invalid_value");
    expect_error("{\"prompt\":\"a\x01b\"}", G, 400, "prompt", "invalid_json");
    expect_error("{\"prompt\":\"a\tb\"}", G, 400, "prompt", "invalid_json");
    expect_error("{\"prompt\":\"a\nb\"}", G, 400, "prompt", "invalid_json");
    expect_error("{\"prompt\":\"a\",\"user\":\"\\u0000\"}", G, 400, "user", "invalid_value");
    expect_error("{\"prompt\":\"a\",\"image\":[\"aGk=\",\"\x7f\x02\"]}", E, 400, "image",
                 "invalid_json");
    expect_error("{\"prompt\":\"a\",\"negative_prompt\":\"x\\u0000\"}", G, 400,
                 "negative_prompt", "invalid_value");
    /* An escaped backslash before "u0000" is text, and escaped control
     * characters are fine. */
    kiln_api_request r;
    kiln_api_error e;
    CHECK(parse_json("{\"prompt\":\"a\\\\u0000b\\n\\t\\u0001\"}", G, &distilled, &r, &e) ==
          KILN_OK);
    CHECK(r.prompt && strcmp(r.prompt, "a\\u0000b\n\t\x01") == 0);
    kiln_api_request_free(&r);

    /* Node budget: an ignored field of KILN_API_JSON_MAX_NODES values is
     * refused, naming it; a few hundred pass. */
    kiln_buf b = {0};
    for (int pass = 0; pass < 2; pass++) {
        int count = pass ? 900 : KILN_API_JSON_MAX_NODES;
        kiln_buf_clear(&b);
        put(&b, "{\"prompt\":\"a\",\"junk\":[");
        for (int i = 0; i < count; i++)
            put(&b, i ? ",1" : "1");
        put(&b, "]}");
        if (pass == 0) {
            expect_error((const char *)b.data, G, 400, "junk", "invalid_json");
        } else {
            /* Within the budget the field is read, and refused as unknown
             * unless the server ignores unknown fields. */
            expect_error((const char *)b.data, G, 400, "junk", "unknown_parameter");
            kiln_api_config c = config(&distilled);
            c.ignore_unknown = 1;
            CHECK(kiln_api_parse(G, NULL, b.data, b.len - 1, &c, &r, &e) == KILN_OK);
            kiln_api_request_free(&r);
        }
    }
    /* Nesting. */
    kiln_buf_clear(&b);
    put(&b, "{\"prompt\":\"a\",\"deep\":");
    for (int i = 0; i < KILN_API_JSON_MAX_DEPTH; i++)
        put(&b, "[");
    for (int i = 0; i < KILN_API_JSON_MAX_DEPTH; i++)
        put(&b, "]");
    put(&b, "}");
    expect_error((const char *)b.data, G, 400, "deep", "invalid_json");

    /* Body size by route: the longest legal generation (a prompt of 64 KiB
     * written as \u escapes) fits; one byte over its limit is 413, which
     * an edit's limit allows. */
    kiln_api_config c = config(&distilled);
    size_t limit = kiln_api_body_limit(&c, G);
    CHECK(limit < (2u << 20) && kiln_api_body_limit(&c, E) == c.max_body_bytes);
    kiln_buf_clear(&b);
    put(&b, "{\"prompt\":\"");
    for (int i = 0; i < 65535 / 3; i++)
        put(&b, "\\u4e00");
    put(&b, "\"}");
    CHECK(parse_json((const char *)b.data, G, &distilled, &r, &e) == KILN_OK);
    CHECK(r.prompt && strlen(r.prompt) == 65535 / 3 * 3);
    kiln_api_request_free(&r);
    kiln_buf_clear(&b);
    put(&b, "{\"prompt\":\"x\"}");
    while (b.len - 1 < limit + 1)
        put(&b, " ");
    expect_error((const char *)b.data, G, 413, "", "too_large");
    CHECK(kiln_api_parse(E, "application/json", b.data, b.len - 1, &c, &r, &e) != KILN_OK &&
          e.status == 400);
    kiln_buf_free(&b);
}

/* The cost model (kiln_request_cost) on the examples its header gives,
 * and the per-request ceiling: every normal request passes the default
 * (40 Mtok), a request for hours of denoising is refused naming its cost
 * and the limit. */
static void test_cost(void)
{
    static const kiln_model_traits kv = {.kv_cache = 1, .default_steps = 4, .default_guidance = 1.0f,
                                         .shrink_images = 1, .inpaint_strength = 0.8};
    kiln_request q;
    kiln_request_init(&q);
    q.width = q.height = 1024, q.n = 1, q.steps = 4, q.max_sequence_length = 512;
    CHECK_NEAR(kiln_request_cost(&q, &distilled, 0), 0.023616, 1e-6);
    q.width = q.height = 2048, q.steps = 50;
    CHECK_NEAR(kiln_request_cost(&q, &base, 1), 3.432, 1e-3);
    q.n = 10, q.steps = 200;
    CHECK_NEAR(kiln_request_cost(&q, &distilled, 0), 68.64, 1e-2);
    kiln_image refs[KILN_MAX_REFS];
    for (int i = 0; i < KILN_MAX_REFS; i++)
        refs[i] = (kiln_image){.width = 1024, .height = 1024};
    q.refs = refs, q.n_refs = KILN_MAX_REFS;
    CHECK_NEAR(kiln_request_cost(&q, &distilled, 0), 400.41, 1e-1);
    /* The K/V cache computes the references once. */
    double plain = kiln_request_cost(&q, &distilled, 0), cached = kiln_request_cost(&q, &kv, 0);
    CHECK(cached < plain / 2 && cached > kiln_request_cost(&(kiln_request){.width = 2048,
          .height = 2048, .n = 10, .steps = 200, .max_sequence_length = 512}, &kv, 0));

    kiln_api_config c = config(&base);
    c.limits.max_side = 2048;
    c.max_cost = 40;
    kiln_api_request r;
    kiln_api_error e;
    const char *ok[] = {
        "{\"prompt\":\"x\",\"size\":\"2048x2048\"}",                       /* 50 steps, CFG */
        "{\"prompt\":\"x\",\"size\":\"1024x1024\",\"n\":10}",              /* 50 steps, CFG */
        "{\"prompt\":\"x\",\"size\":\"2048x2048\",\"n\":10,\"num_inference_steps\":50}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        CHECKF(kiln_api_parse(KILN_API_GENERATE, NULL, ok[i], strlen(ok[i]), &c, &r, &e) ==
                   KILN_OK, "%s: %s", ok[i], e.err.msg);
        kiln_api_request_free(&r);
    }
    const char *big = "{\"prompt\":\"x\",\"size\":\"2048x2048\",\"n\":10,"
                      "\"num_inference_steps\":200,\"guidance_scale\":1}";
    CHECK(kiln_api_parse(KILN_API_GENERATE, NULL, big, strlen(big), &c, &r, &e) == KILN_ERR_INVALID);
    CHECKF(e.status == 400 && !strcmp(e.code, "cost_limit_exceeded") &&
               strstr(e.err.msg, "68.6 Mtok") && strstr(e.err.msg, "limit is 40 Mtok"),
           "%d %s: %s", e.status, e.code, e.err.msg);
    /* The same with eight 1 MP references, as an edit. */
    kiln_buf png = make_png(1024, 1024), b64 = {0}, json = {0};
    kiln_base64_encode(png.data, png.len, &b64, NULL);
    put(&json, "{\"prompt\":\"x\",\"size\":\"2048x2048\",\"n\":10,\"num_inference_steps\":200,"
               "\"image\":[");
    for (int i = 0; i < KILN_MAX_REFS; i++) {
        put(&json, i ? ",\"" : "\"");
        json.len--; /* put's NUL */
        kiln_buf_append(&json, b64.data, b64.len, NULL);
        put(&json, "\"");
    }
    put(&json, "]}");
    CHECK(kiln_api_parse(KILN_API_EDIT, NULL, json.data, json.len - 1, &c, &r, &e) ==
          KILN_ERR_INVALID);
    CHECKF(!strcmp(e.code, "cost_limit_exceeded") && strstr(e.err.msg, "8 reference"), "%s",
           e.err.msg);
    /* No ceiling: allowed, with its cost. */
    c.max_cost = 0;
    CHECK(kiln_api_parse(KILN_API_GENERATE, NULL, big, strlen(big), &c, &r, &e) == KILN_OK);
    CHECK_NEAR(r.plan.cost, 68.64, 1e-2);
    kiln_api_request_free(&r);
    kiln_buf_free(&png), kiln_buf_free(&b64), kiln_buf_free(&json);
}

static void test_base_checkpoint(void)
{
    kiln_api_request r;
    kiln_api_error e;
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"negative_prompt\":\"blurry\"}",
                     KILN_API_GENERATE, &base, &r, &e) == KILN_OK);
    CHECK(r.plan.req.steps == 50 && r.plan.req.guidance == 4.0f);
    CHECK(r.plan.negative && strcmp(r.plan.negative, "blurry") == 0);
    kiln_api_request_free(&r);
    /* No negative prompt: CFG still runs, on "" as diffusers does. */
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\"}", KILN_API_GENERATE, &base, &r, &e) ==
          KILN_OK);
    CHECK(r.plan.negative && r.plan.negative[0] == '\0');
    kiln_api_request_free(&r);
    /* guidance <= 1: no CFG, as the CLI decides. */
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"negative_prompt\":\"b\","
                     "\"guidance_scale\":1}",
                     KILN_API_GENERATE, &base, &r, &e) == KILN_OK);
    CHECK(r.plan.negative == NULL);
    kiln_api_request_free(&r);
}

static void test_edit_json(void)
{
    kiln_buf png = make_png(96, 80), b64 = {0};
    CHECK(kiln_base64_encode(png.data, png.len, &b64, NULL) == KILN_OK);
    size_t cap = b64.len * 2 + 256;
    char *json = malloc(cap);
    snprintf(json, cap, "{\"prompt\":\"edit\",\"image\":[\"data:image/png;base64,%.*s\",\"%.*s\"]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    kiln_api_request r;
    kiln_api_error e;
    CHECKF(parse_json(json, KILN_API_EDIT, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    CHECK(r.n_images == 2);
    for (int i = 0; i < r.n_images; i++)
        CHECK(r.images[i].len == png.len && memcmp(r.images[i].data, png.data, png.len) == 0);
    /* Without a size, the output is the first reference's size. */
    CHECK(r.plan.req.width == 96 && r.plan.req.height == 80);
    CHECK(r.plan.req.refs == NULL && r.plan.req.n_refs == 2);
    kiln_api_request_free(&r);
    /* A size taken from an image smaller than the service makes: the
     * error says so (the client sent no size to blame). */
    kiln_api_config big = config(&distilled);
    big.limits.min_side = 256;
    CHECK(kiln_api_parse(KILN_API_EDIT, "application/json", json, strlen(json), &big, &r, &e) ==
          KILN_ERR_INVALID);
    CHECKF(e.status == 400 && !strcmp(e.param, "size") &&
               strstr(e.err.msg, "size was not given, so the output is image 1's 96x80 (from "
                                 "96x80): width must be between 256"),
           "%s", e.err.msg);
    /* One image as a plain string. */
    snprintf(json, cap, "{\"prompt\":\"edit\",\"size\":\"64x64\",\"image\":\"%.*s\"}", (int)b64.len,
             (char *)b64.data);
    CHECK(parse_json(json, KILN_API_EDIT, &distilled, &r, &e) == KILN_OK);
    CHECK(r.n_images == 1 && r.plan.req.width == 64);
    kiln_api_request_free(&r);
    /* Nine references are one too many. */
    size_t off = (size_t)snprintf(json, cap, "{\"prompt\":\"e\",\"image\":[");
    free(json);
    cap = 9 * (b64.len + 4) + 64;
    json = malloc(cap);
    off = (size_t)snprintf(json, cap, "{\"prompt\":\"e\",\"image\":[");
    for (int i = 0; i < 9; i++)
        off += (size_t)snprintf(json + off, cap - off, "%s\"%.*s\"", i ? "," : "", (int)b64.len,
                                (char *)b64.data);
    snprintf(json + off, cap - off, "]}");
    expect_error(json, KILN_API_EDIT, 400, "image", NULL);
    free(json);
    kiln_buf_free(&b64);
    kiln_buf_free(&png);
    /* The references' pixels in all, from their headers: two 96x80
     * references are 15360 pixels; a limit one under refuses the request
     * naming it, the exact limit (and none) takes it. */
    png = make_png(96, 80);
    CHECK(kiln_base64_encode(png.data, png.len, &b64, NULL) == KILN_OK);
    cap = 2 * b64.len + 64;
    json = malloc(cap);
    snprintf(json, cap, "{\"prompt\":\"e\",\"image\":[\"%.*s\",\"%.*s\"]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    kiln_api_config c = config(&distilled);
    for (int64_t lim = 2 * 96 * 80 - 1; lim <= 2 * 96 * 80; lim++) {
        c.max_ref_pixels = lim;
        kiln_status st = kiln_api_parse(KILN_API_EDIT, "application/json", json, strlen(json), &c,
                                        &r, &e);
        if (lim < 2 * 96 * 80)
            CHECKF(st == KILN_ERR_INVALID && e.status == 400 && !strcmp(e.param, "image") &&
                       !strcmp(e.code, "invalid_image") && strstr(e.err.msg, "megapixels in all"),
                   "limit %lld: %s", (long long)lim, e.err.msg);
        else
            CHECKF(st == KILN_OK && r.n_images == 2, "limit %lld: %s", (long long)lim, e.err.msg);
        if (st == KILN_OK)
            kiln_api_request_free(&r);
    }
    free(json);
    kiln_buf_free(&b64);
    kiln_buf_free(&png);
    /* A reference whose header claims 8192x8192 over a few bytes of data
     * (a bomb, or a lie): with a 64 MP limit in all, two of them are
     * refused from their headers. */
    png = make_png(64, 64);
    png.data[18] = 8192 >> 8, png.data[19] = 0, png.data[22] = 8192 >> 8, png.data[23] = 0;
    CHECK(kiln_base64_encode(png.data, png.len, &b64, NULL) == KILN_OK);
    cap = 2 * b64.len + 64;
    json = malloc(cap);
    snprintf(json, cap, "{\"prompt\":\"e\",\"image\":[\"%.*s\",\"%.*s\"]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    c.max_ref_pixels = 64ll << 20;
    CHECK(kiln_api_parse(KILN_API_EDIT, "application/json", json, strlen(json), &c, &r, &e) ==
              KILN_ERR_INVALID &&
          strstr(e.err.msg, "128.0 megapixels in all") && strstr(e.err.msg, "limit is 64.0"));
    free(json);
    kiln_buf_free(&b64);
    kiln_buf_free(&png);
    /* A reference under 64 px a side is refused up front, as the encoder
     * would. */
    png = make_png(32, 64);
    CHECK(kiln_base64_encode(png.data, png.len, &b64, NULL) == KILN_OK);
    json = malloc(b64.len + 64);
    sprintf(json, "{\"prompt\":\"e\",\"image\":\"%.*s\"}", (int)b64.len, (char *)b64.data);
    expect_error(json, KILN_API_EDIT, 400, "image", "invalid_image");
    free(json);
    kiln_buf_free(&b64);
    kiln_buf_free(&png);
}

/* A multipart body with the given text fields and files. */
static kiln_buf form(const char *const *fields, const kiln_buf *files, int nfiles,
                     const char *file_field)
{
    kiln_buf b = {0};
    char tmp[512];
    for (int i = 0; fields[i]; i += 2) {
        snprintf(tmp, sizeof tmp,
                 "--BOUND\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n%s\r\n", fields[i],
                 fields[i + 1]);
        kiln_buf_append(&b, tmp, strlen(tmp), NULL);
    }
    for (int i = 0; i < nfiles; i++) {
        snprintf(tmp, sizeof tmp,
                 "--BOUND\r\nContent-Disposition: form-data; name=\"%s\"; filename=\"f%d.png\"\r\n"
                 "Content-Type: image/png\r\n\r\n",
                 file_field, i);
        kiln_buf_append(&b, tmp, strlen(tmp), NULL);
        kiln_buf_append(&b, files[i].data, files[i].len, NULL);
        kiln_buf_append(&b, "\r\n", 2, NULL);
    }
    kiln_buf_append(&b, "--BOUND--\r\n", 11, NULL);
    return b;
}

static void test_edit_multipart(void)
{
    kiln_buf pngs[2] = {make_png(64, 64), make_png(128, 64)};
    const char *fields[] = {"prompt", "make it blue", "n", "2", "seed", "7", "size", "64x128",
                            "guidance_scale", "1.0", "num_inference_steps", "2",
                            "output_format", "jpeg", "quality", "auto", NULL};
    kiln_buf body = form(fields, pngs, 2, "image[]");
    kiln_api_config c = config(&distilled);
    kiln_api_request r;
    kiln_api_error e;
    const char *ct = "multipart/form-data; boundary=BOUND";
    CHECKF(kiln_api_parse(KILN_API_EDIT, ct, body.data, body.len, &c, &r, &e) == KILN_OK, "%s",
           e.err.msg);
    CHECK(r.n_images == 2 && r.images[1].len == pngs[1].len &&
          memcmp(r.images[1].data, pngs[1].data, pngs[1].len) == 0);
    CHECK(r.plan.req.n == 2 && r.plan.req.seed == 7 && r.seed_given && r.plan.req.width == 64 &&
          r.plan.req.height == 128 && r.plan.req.steps == 2 && r.plan.req.guidance == 1.0f);
    CHECK(r.plan.req.format == KILN_IMAGE_JPEG && r.plan.req.compression == 100);
    CHECK(strcmp(r.prompt, "make it blue") == 0);
    kiln_api_request_free(&r);
    kiln_buf_free(&body);

    /* `image` (no brackets) works the same. */
    const char *f2[] = {"prompt", "p", NULL};
    body = form(f2, pngs, 1, "image");
    CHECK(kiln_api_parse(KILN_API_EDIT, ct, body.data, body.len, &c, &r, &e) == KILN_OK);
    CHECK(r.n_images == 1 && r.plan.req.width == 64 && r.plan.req.height == 64);
    kiln_api_request_free(&r);
    kiln_buf_free(&body);

    /* Text fields are parsed strictly. */
    static const char *bad[][3] = {
        {"n", "2x", "n"}, {"n", " 2", "n"}, {"seed", "-3", "seed"}, {"guidance_scale", "nan", "guidance_scale"},
        {"guidance_scale", "0x10", "guidance_scale"}, {"size", "64*64", "size"},
        {"stream", "1", "stream"}, {"mask", "x", "mask"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *f[] = {"prompt", "p", bad[i][0], bad[i][1], NULL};
        body = form(f, pngs, 1, "image");
        CHECKF(kiln_api_parse(KILN_API_EDIT, ct, body.data, body.len, &c, &r, &e) != KILN_OK,
               "%s=%s accepted", bad[i][0], bad[i][1]);
        CHECKF(e.status == 400 && strcmp(e.param, bad[i][2]) == 0, "%s=%s: %d %s", bad[i][0],
               bad[i][1], e.status, e.param);
        kiln_buf_free(&body);
    }
    /* A NUL inside a text field, a non-image file, a broken body, a bad
     * Content-Type. */
    const char nul_body[] = "--B\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na\0b\r\n--B--";
    CHECK(kiln_api_parse(KILN_API_EDIT, "multipart/form-data; boundary=B", nul_body,
                         sizeof nul_body - 1, &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(strcmp(e.param, "prompt") == 0);
    kiln_buf text = {0};
    kiln_buf_append(&text, "hello", 5, NULL);
    body = form(f2, &text, 1, "image");
    CHECK(kiln_api_parse(KILN_API_EDIT, ct, body.data, body.len, &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(strcmp(e.code, "invalid_image") == 0 && strstr(e.err.msg, "image 1") != NULL);
    body.len -= 13; /* cut the closing delimiter */
    CHECK(kiln_api_parse(KILN_API_EDIT, ct, body.data, body.len, &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(strcmp(e.code, "invalid_multipart") == 0);
    CHECK(kiln_api_parse(KILN_API_EDIT, "multipart/form-data", body.data, body.len, &c, &r, &e) ==
          KILN_ERR_INVALID);
    kiln_buf_free(&body);
    kiln_buf_free(&text);
    /* Generations accept a form too. */
    const char *f3[] = {"prompt", "p", "size", "64x64", NULL};
    body = form(f3, NULL, 0, "image");
    CHECK(kiln_api_parse(KILN_API_GENERATE, ct, body.data, body.len, &c, &r, &e) == KILN_OK);
    CHECK(r.plan.req.width == 64);
    kiln_api_request_free(&r);
    kiln_buf_free(&body);
    kiln_buf_free(&pngs[0]);
    kiln_buf_free(&pngs[1]);
}

/* Expects an error with the exact message. */
static void expect_message(const char *json, kiln_api_kind kind, const char *param,
                           const char *code, const char *msg)
{
    kiln_api_request r;
    kiln_api_error e;
    kiln_status st = parse_json(json, kind, &distilled, &r, &e);
    CHECKF(st != KILN_OK, "accepted: %s", json);
    if (st == KILN_OK) {
        kiln_api_request_free(&r);
        return;
    }
    CHECKF(!strcmp(e.param, param) && e.code && !strcmp(e.code, code), "%s: %s %s", json,
           e.param, e.code ? e.code : "(null)");
    CHECKF(strcmp(e.err.msg, msg) == 0, "%s: message '%s'", json, e.err.msg);
}

/* OpenAI's error codes and wording, as its API answers them: unknown
 * fields, wrong JSON types, ranges, empty and missing strings, values of
 * enumerated fields. */
static void test_openai_errors(void)
{
    const kiln_api_kind G = KILN_API_GENERATE, E = KILN_API_EDIT;
    expect_message("{\"prompt\":\"x\",\"sizee\":\"64x64\"}", G, "sizee", "unknown_parameter",
                   "Unknown parameter: 'sizee'.");
    /* A field of the other route is unknown on this one, as at OpenAI. */
    expect_error("{\"prompt\":\"x\",\"input_fidelity\":\"high\"}", G, 400, "input_fidelity",
                 "unknown_parameter");
    expect_error("{\"prompt\":\"x\",\"image\":\"aGk=\",\"style\":\"vivid\"}", E, 400, "style",
                 "unknown_parameter");
    expect_message("{\"prompt\":\"x\",\"n\":\"2\"}", G, "n", "invalid_type",
                   "Invalid type for 'n': expected an integer, but got a string instead.");
    expect_message("{\"prompt\":\"x\",\"n\":2.5}", G, "n", "invalid_type",
                   "Invalid type for 'n': expected an integer, but got a decimal instead.");
    expect_message("{\"prompt\":[\"x\"]}", G, "prompt", "invalid_type",
                   "Invalid type for 'prompt': expected a string, but got an array instead.");
    expect_error("{\"prompt\":\"x\",\"guidance_scale\":\"1\"}", G, 400, "guidance_scale",
                 "invalid_type");
    expect_error("{\"prompt\":\"x\",\"stream\":1}", G, 400, "stream", "invalid_type");
    expect_error("{\"prompt\":\"x\",\"quality\":1}", G, 400, "quality", "invalid_type");
    expect_message("{\"prompt\":\"x\",\"n\":11}", G, "n", "integer_above_max_value",
                   "Invalid 'n': integer above maximum value. Expected a value <= 10, but got "
                   "11 instead.");
    expect_message("{\"prompt\":\"x\",\"n\":0}", G, "n", "integer_below_min_value",
                   "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 "
                   "instead.");
    expect_error("{\"prompt\":\"x\",\"n\":1e12}", G, 400, "n", "integer_above_max_value");
    expect_error("{\"prompt\":\"x\",\"num_inference_steps\":201}", G, 400, "num_inference_steps",
                 "integer_above_max_value");
    expect_error("{\"prompt\":\"x\",\"num_inference_steps\":-3}", G, 400, "num_inference_steps",
                 "integer_below_min_value");
    expect_error("{\"prompt\":\"x\",\"max_sequence_length\":513}", G, 400, "max_sequence_length",
                 "integer_above_max_value");
    expect_error("{\"prompt\":\"x\",\"output_compression\":-1}", G, 400, "output_compression",
                 "integer_below_min_value");
    expect_error("{\"prompt\":\"x\",\"partial_images\":4}", G, 400, "partial_images",
                 "integer_above_max_value");
    expect_error("{\"prompt\":\"x\",\"partial_images\":-1}", G, 400, "partial_images",
                 "integer_below_min_value");
    expect_message("{\"prompt\":\"x\",\"guidance_scale\":100.5}", G, "guidance_scale",
                   "decimal_above_max_value",
                   "Invalid 'guidance_scale': decimal above maximum value. Expected a value <= "
                   "100, but got 100.5 instead.");
    expect_error("{\"prompt\":\"x\",\"guidance_scale\":-0.5}", G, 400, "guidance_scale",
                 "decimal_below_min_value");
    expect_message("{\"prompt\":\"\"}", G, "prompt", "empty_string",
                   "Invalid 'prompt': empty string. Expected a string with minimum length 1, "
                   "but got an empty string instead.");
    expect_message("{\"n\":1}", G, "prompt", "missing_required_parameter",
                   "Missing required parameter: 'prompt'.");
    expect_error("{\"prompt\":null}", G, 400, "prompt", "missing_required_parameter");
    expect_error("{\"prompt\":\"x\"}", E, 400, "image", "missing_required_parameter");
    expect_message("{\"prompt\":\"x\",\"quality\":\"ultra\"}", G, "quality", "invalid_value",
                   "Invalid value: 'ultra'. Supported values are: 'auto', 'standard', 'low', "
                   "'medium', 'high', and 'hd'.");
    expect_message("{\"prompt\":\"x\",\"background\":\"none\"}", G, "background",
                   "invalid_value",
                   "Invalid value: 'none'. Supported values are: 'auto', 'opaque', and "
                   "'transparent'.");
    expect_message("{\"prompt\":\"x\",\"moderation\":\"high\"}", G, "moderation",
                   "invalid_value", "Invalid value: 'high'. Supported values are: 'auto' and 'low'.");
    expect_error("{\"prompt\":\"x\",\"output_format\":\"gif\"}", G, 400, "output_format",
                 "invalid_value");
    expect_error("{\"prompt\":\"x\",\"response_format\":\"png\"}", G, 400, "response_format",
                 "invalid_value");
    /* A user id longer than the logs take. */
    char json[600];
    snprintf(json, sizeof json, "{\"prompt\":\"x\",\"user\":\"%0300d\"}", 0);
    expect_error(json, G, 400, "user", "string_above_max_length");
}

/* Each OpenAI field kiln cannot honour is refused saying why
 * (unsupported_value); the values it does honour pass. */
static void test_openai_fields(void)
{
    const kiln_api_kind G = KILN_API_GENERATE, E = KILN_API_EDIT;
    static const char *const refused[][2] = {
        {"\"quality\":\"high\"", "quality"},     {"\"quality\":\"low\"", "quality"},
        {"\"quality\":\"medium\"", "quality"},   {"\"quality\":\"hd\"", "quality"},
        {"\"background\":\"transparent\"", "background"},
        {"\"style\":\"vivid\"", "style"},        {"\"style\":\"natural\"", "style"},
        {"\"response_format\":\"url\"", "response_format"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        char json[128];
        snprintf(json, sizeof json, "{\"prompt\":\"x\",%s}", refused[i][0]);
        expect_error(json, G, 400, refused[i][1], "unsupported_value");
    }
    static const char *const accepted[] = {
        "\"quality\":\"auto\"", "\"quality\":\"standard\"", "\"background\":\"auto\"",
        "\"background\":\"opaque\"", "\"moderation\":\"auto\"", "\"moderation\":\"low\"",
        "\"stream\":false", "\"stream\":true", "\"partial_images\":0", "\"partial_images\":3",
        "\"user\":\"\"",
        "\"response_format\":\"b64_json\"", "\"style\":null", "\"quality\":null",
    };
    for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
        char json[128];
        snprintf(json, sizeof json, "{\"prompt\":\"x\",\"size\":\"64x64\",%s}", accepted[i]);
        kiln_api_request r;
        kiln_api_error e;
        CHECKF(parse_json(json, G, &distilled, &r, &e) == KILN_OK, "%s: %s", json, e.err.msg);
        kiln_api_request_free(&r);
    }
    /* input_fidelity (edits): klein always conditions on the whole
     * references, which is "high". */
    kiln_buf png = make_png(96, 80), b64 = {0};
    kiln_base64_encode(png.data, png.len, &b64, NULL);
    char *json = malloc(b64.len + 128);
    sprintf(json, "{\"prompt\":\"e\",\"input_fidelity\":\"high\",\"image\":\"%.*s\"}",
            (int)b64.len, (char *)b64.data);
    kiln_api_request r;
    kiln_api_error e;
    CHECKF(parse_json(json, E, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    /* usage counts the reference's tokens at its prepared size, 96x80. */
    CHECK(r.usage.image_tokens == 6 * 5 && r.usage.output_tokens == 6 * 5);
    kiln_api_request_free(&r);
    sprintf(json, "{\"prompt\":\"e\",\"input_fidelity\":\"low\",\"image\":\"%.*s\"}",
            (int)b64.len, (char *)b64.data);
    expect_error(json, E, 400, "input_fidelity", "unsupported_value");
    free(json);
    kiln_buf_free(&png), kiln_buf_free(&b64);

    /* Multipart: unknown fields are refused the same way; the server
     * option skips them. */
    const char *f[] = {"prompt", "p", "size", "64x64", "colour", "red", NULL};
    kiln_buf body = form(f, NULL, 0, "image");
    kiln_api_config c = config(&distilled);
    const char *ct = "multipart/form-data; boundary=BOUND";
    CHECK(kiln_api_parse(G, ct, body.data, body.len, &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(!strcmp(e.code, "unknown_parameter") && !strcmp(e.param, "colour"));
    c.ignore_unknown = 1;
    CHECK(kiln_api_parse(G, ct, body.data, body.len, &c, &r, &e) == KILN_OK);
    kiln_api_request_free(&r);
    kiln_buf_free(&body);
    const char *f2[] = {"prompt", "p", "n", "x", NULL};
    body = form(f2, NULL, 0, "image");
    CHECK(kiln_api_parse(G, ct, body.data, body.len, &c, &r, &e) == KILN_ERR_INVALID);
    CHECK(!strcmp(e.code, "invalid_type") && !strcmp(e.param, "n"));
    kiln_buf_free(&body);
}

/* OpenAI's JSON edit form: "images": [{"image_url": "data:..."}]. */
static void test_edit_images_form(void)
{
    const kiln_api_kind E = KILN_API_EDIT;
    kiln_buf png = make_png(96, 80), b64 = {0};
    kiln_base64_encode(png.data, png.len, &b64, NULL);
    size_t cap = 2 * b64.len + 256;
    char *json = malloc(cap);
    snprintf(json, cap,
             "{\"prompt\":\"e\",\"images\":[{\"image_url\":\"data:image/png;base64,%.*s\"},"
             "{\"image_url\":\"%.*s\"}]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    kiln_api_request r;
    kiln_api_error e;
    CHECKF(parse_json(json, E, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    CHECK(r.n_images == 2 && r.images[1].len == png.len &&
          memcmp(r.images[1].data, png.data, png.len) == 0);
    CHECK(r.plan.req.width == 96 && r.plan.req.height == 80);
    kiln_api_request_free(&r);
    /* With image as well: one field given twice. */
    snprintf(json, cap, "{\"prompt\":\"e\",\"image\":\"%.*s\",\"images\":[{\"image_url\":\"%.*s\"}]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    expect_error(json, E, 400, "images", "invalid_value");
    free(json);
    expect_error("{\"prompt\":\"e\",\"images\":[{\"file_id\":\"file-abc\"}]}", E, 400,
                 "images[0].file_id", "unsupported_value");
    expect_error("{\"prompt\":\"e\",\"images\":[{}]}", E, 400, "images[0].image_url",
                 "missing_required_parameter");
    expect_error("{\"prompt\":\"e\",\"images\":[{\"image_url\":\"aGk=\",\"detail\":1}]}", E, 400,
                 "images[0].detail", "unknown_parameter");
    expect_error("{\"prompt\":\"e\",\"images\":[\"aGk=\"]}", E, 400, "images[0]", "invalid_type");
    expect_error("{\"prompt\":\"e\",\"images\":\"aGk=\"}", E, 400, "images", "invalid_type");
    expect_error("{\"prompt\":\"e\",\"images\":[{\"image_url\":\"https://x.test/a.png\"}]}", E,
                 400, "images[0].image_url", "unsupported_value");
    expect_error("{\"prompt\":\"e\",\"images\":[{\"image_url\":\"aGVsbG8=\"}]}", E, 400,
                 "images[0].image_url", "invalid_image");
    expect_error("{\"prompt\":\"e\",\"images\":[{\"image_url\":\"aGk=\"}]}", KILN_API_GENERATE,
                 400, "images", "unknown_parameter");
    kiln_buf_free(&png), kiln_buf_free(&b64);
}

/* strength (image-to-image, a kiln extension on edits): (0, 1], one image,
 * the image's size; refused on generations. */
static void test_strength(void)
{
    const kiln_api_kind E = KILN_API_EDIT;
    kiln_buf png = make_png(200, 136), b64 = {0};
    kiln_base64_encode(png.data, png.len, &b64, NULL);
    size_t cap = 2 * b64.len + 256;
    char *json = malloc(cap);
    kiln_api_request r;
    kiln_api_error e;
    snprintf(json, cap, "{\"prompt\":\"e\",\"strength\":0.6,\"image\":\"%.*s\"}", (int)b64.len,
             (char *)b64.data);
    CHECKF(parse_json(json, E, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    CHECK(r.plan.req.strength == 0.6 && r.plan.req.width == 192 && r.plan.req.height == 128);
    kiln_api_request_free(&r);
    /* 4 steps x 0.2 < 1 still runs one step (diffusers' get_timesteps). */
    snprintf(json, cap, "{\"prompt\":\"e\",\"strength\":0.2,\"image\":\"%.*s\"}", (int)b64.len,
             (char *)b64.data);
    CHECKF(parse_json(json, E, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
    kiln_api_request_free(&r);
    static const char *const bad[][3] = {
        {"\"strength\":0", "decimal_below_min_value", "strength"},
        {"\"strength\":-0.5", "decimal_below_min_value", "strength"},
        {"\"strength\":1.5", "decimal_above_max_value", "strength"},
        {"\"strength\":\"0.5\"", "invalid_type", "strength"},
        {"\"strength\":0.5,\"size\":\"64x64\"", "invalid_value", "size"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(json, cap, "{\"prompt\":\"e\",%s,\"image\":\"%.*s\"}", bad[i][0], (int)b64.len,
                 (char *)b64.data);
        CHECK(parse_json(json, E, &distilled, &r, &e) != KILN_OK);
        CHECKF(!strcmp(e.code, bad[i][1]) && !strcmp(e.param, bad[i][2]), "%s: %s %s: %s",
               bad[i][0], e.code, e.param, e.err.msg);
    }
    snprintf(json, cap, "{\"prompt\":\"e\",\"strength\":0.5,\"image\":[\"%.*s\",\"%.*s\"]}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data);
    expect_error(json, E, 400, "strength", "invalid_value");
    expect_error("{\"prompt\":\"x\",\"strength\":0.5}", KILN_API_GENERATE, 400, "strength",
                 "unknown_parameter");
    free(json);
    kiln_buf_free(&png), kiln_buf_free(&b64);
}

/* mask (inpainting, OpenAI's field): a PNG of the one image's size, as a
 * file, a base64 string or {"image_url": ...}; strength 0.8 by default. */
static void test_mask(void)
{
    const kiln_api_kind E = KILN_API_EDIT;
    kiln_buf png = make_png(96, 80), other = make_png(64, 80), b64 = {0}, b64o = {0};
    kiln_base64_encode(png.data, png.len, &b64, NULL);
    kiln_base64_encode(other.data, other.len, &b64o, NULL);
    size_t cap = 3 * b64.len + 256;
    char *json = malloc(cap);
    kiln_api_request r;
    kiln_api_error e;
    const char *forms[] = {"\"%.*s\"", "{\"image_url\":\"data:image/png;base64,%.*s\"}"};
    for (int f = 0; f < 2; f++) {
        char mask[64];
        snprintf(mask, sizeof mask, "%s", forms[f]);
        int k = snprintf(json, cap, "{\"prompt\":\"e\",\"image\":\"%.*s\",\"mask\":", (int)b64.len,
                         (char *)b64.data);
        k += snprintf(json + k, cap - (size_t)k, mask, (int)b64.len, (char *)b64.data);
        snprintf(json + k, cap - (size_t)k, "}");
        CHECKF(parse_json(json, E, &distilled, &r, &e) == KILN_OK, "%s", e.err.msg);
        CHECK(r.mask.len == png.len && !memcmp(r.mask.data, png.data, png.len));
        CHECK(r.plan.req.strength == 0.8 && r.plan.req.width == 96 && r.plan.req.height == 80);
        kiln_api_request_free(&r);
    }
    /* Another size than the image's. */
    snprintf(json, cap, "{\"prompt\":\"e\",\"image\":\"%.*s\",\"mask\":\"%.*s\"}", (int)b64.len,
             (char *)b64.data, (int)b64o.len, (char *)b64o.data);
    expect_error(json, E, 400, "mask", "invalid_value");
    /* Two images. */
    snprintf(json, cap, "{\"prompt\":\"e\",\"image\":[\"%.*s\",\"%.*s\"],\"mask\":\"%.*s\"}",
             (int)b64.len, (char *)b64.data, (int)b64.len, (char *)b64.data, (int)b64.len,
             (char *)b64.data);
    expect_error(json, E, 400, "mask", "invalid_value");
    expect_error("{\"prompt\":\"e\",\"image\":\"aGk=\",\"mask\":{\"file_id\":\"f\"}}", E, 400,
                 "mask.file_id", "unsupported_value");
    expect_error("{\"prompt\":\"e\",\"image\":\"aGk=\",\"mask\":{}}", E, 400,
                 "mask.image_url", "missing_required_parameter");
    expect_error("{\"prompt\":\"e\",\"mask\":\"aGk=\"}", KILN_API_GENERATE, 400, "mask",
                 "unknown_parameter");
    /* Multipart: a file part. */
    kiln_buf files[2] = {png, png};
    const char *f1[] = {"prompt", "p", "strength", "0.5", NULL};
    kiln_buf body = form(f1, files, 1, "image");
    body.len -= 11; /* reopen before the closing delimiter */
    char head[256];
    snprintf(head, sizeof head, "--BOUND\r\nContent-Disposition: form-data; name=\"mask\"; "
                                "filename=\"m.png\"\r\nContent-Type: image/png\r\n\r\n");
    kiln_buf_append(&body, head, strlen(head), NULL);
    kiln_buf_append(&body, png.data, png.len, NULL);
    kiln_buf_append(&body, "\r\n--BOUND--\r\n", 13, NULL);
    kiln_api_config c = config(&distilled);
    CHECKF(kiln_api_parse(E, "multipart/form-data; boundary=BOUND", body.data, body.len, &c, &r,
                          &e) == KILN_OK, "%s", e.err.msg);
    CHECK(r.mask.len == png.len && r.plan.req.strength == 0.5);
    kiln_api_request_free(&r);
    kiln_buf_free(&body);
    (void)files;
    free(json);
    kiln_buf_free(&png), kiln_buf_free(&other), kiln_buf_free(&b64), kiln_buf_free(&b64o);
}

/* stream: true is answered with OpenAI's server-sent events. */
static void test_stream_events(void)
{
    kiln_api_request r;
    kiln_api_error e;
    CHECK(parse_json("{\"prompt\":\"x\",\"size\":\"64x64\",\"stream\":true,\"partial_images\":2}",
                     KILN_API_GENERATE, &distilled, &r, &e) == KILN_OK);
    CHECK(r.stream == 1 && r.partial_images == 2);
    kiln_api_request_free(&r);
    kiln_api_image imgs[2] = {{(const uint8_t *)"\x89PNG", 4, 7}, {(const uint8_t *)"abc", 3, 8}};
    kiln_api_images_meta m = {.created = 1700000000, .format = KILN_IMAGE_PNG, .width = 64,
                              .height = 32, .quality = "auto", .background = "opaque",
                              .usage = {.text_tokens = 512, .image_tokens = 8,
                                        .output_tokens = 16}};
    for (int edit = 0; edit < 2; edit++) {
        kiln_buf b = {0};
        CHECK(kiln_api_stream_events(&b, &m, imgs, 2, edit, NULL) == KILN_OK);
        kiln_buf_append(&b, "", 1, NULL);
        /* Two events, each closed by a blank line. */
        const char *second = strstr((const char *)b.data, "}\n\nevent: ");
        CHECK(second != NULL && strcmp((const char *)b.data + b.len - 4, "}\n\n") == 0);
        const char *type = edit ? "image_edit.completed" : "image_generation.completed";
        char *text = (char *)b.data, *save = NULL;
        int n = 0;
        double in_sum = 0, out_sum = 0;
        /* Events end with a blank line; each is "event: T" then "data: {json}". */
        for (char *ev = strtok_r(text, "\n", &save); ev; ev = strtok_r(NULL, "\n", &save)) {
            char want[64];
            snprintf(want, sizeof want, "event: %s", type);
            CHECKF(strcmp(ev, want) == 0, "event line '%s'", ev);
            char *data = strtok_r(NULL, "\n", &save);
            CHECK(data && strncmp(data, "data: ", 6) == 0);
            if (!data)
                break;
            cJSON *j = cJSON_Parse(data + 6);
            CHECK(j && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "type")), type));
            CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "size")), "64x32"));
            CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "output_format")), "png"));
            CHECK(cJSON_GetObjectItem(j, "created_at")->valuedouble == 1700000000);
            CHECK(cJSON_GetObjectItem(j, "seed")->valuedouble == 7 + n);
            CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "b64_json")),
                          n ? "YWJj" : "iVBORw=="));
            const cJSON *u = cJSON_GetObjectItem(j, "usage");
            in_sum += cJSON_GetObjectItem(u, "input_tokens")->valuedouble;
            out_sum += cJSON_GetObjectItem(u, "output_tokens")->valuedouble;
            cJSON_Delete(j);
            n++;
        }
        CHECK(n == 2 && in_sum == 520 && out_sum == 16);
        kiln_buf_free(&b);
    }
    /* Previews: openai-python's ImageGenPartialImageEvent fields (and the
     * edit one's), the index, no usage; one event per image. */
    for (int edit = 0; edit < 2; edit++) {
        kiln_buf b = {0};
        CHECK(kiln_api_partial_events(&b, &m, imgs, 2, 1, edit, NULL) == KILN_OK);
        kiln_buf_append(&b, "", 1, NULL);
        const char *type = edit ? "image_edit.partial_image" : "image_generation.partial_image";
        char *save = NULL;
        int n = 0;
        for (char *ev = strtok_r((char *)b.data, "\n", &save); ev;
             ev = strtok_r(NULL, "\n", &save), n++) {
            char want[64];
            snprintf(want, sizeof want, "event: %s", type);
            CHECKF(strcmp(ev, want) == 0, "event line '%s'", ev);
            char *data = strtok_r(NULL, "\n", &save);
            cJSON *j = data && !strncmp(data, "data: ", 6) ? cJSON_Parse(data + 6) : NULL;
            CHECK(j && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "type")), type));
            CHECK(j && cJSON_GetObjectItem(j, "partial_image_index")->valuedouble == 1);
            CHECK(j && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "b64_json")),
                               n ? "YWJj" : "iVBORw=="));
            static const char *const fields[] = {"background", "created_at", "output_format",
                                                 "quality", "size", "seed"};
            for (size_t k = 0; j && k < sizeof fields / sizeof *fields; k++)
                CHECKF(cJSON_GetObjectItem(j, fields[k]) != NULL, "no %s", fields[k]);
            CHECK(j && !cJSON_GetObjectItem(j, "usage"));
            cJSON_Delete(j);
        }
        CHECK(n == 2);
        kiln_buf_free(&b);
    }
    /* An error once the stream began: an `error` event whose data has
     * OpenAI's error object under "error" (what openai-python raises). */
    kiln_buf b = {0};
    CHECK(kiln_api_stream_error(&b, 503, "the decode stage is unavailable", "stage_unavailable",
                                NULL) == KILN_OK);
    kiln_buf_append(&b, "", 1, NULL);
    const char *t = (const char *)b.data;
    CHECK(!strncmp(t, "event: error\ndata: ", 19) && !strcmp(t + b.len - 3, "\n\n"));
    cJSON *j = cJSON_Parse(t + 19);
    const cJSON *eo = cJSON_GetObjectItem(j, "error");
    CHECK(j && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "type")), "error"));
    CHECK(eo && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(eo, "code")), "stage_unavailable"));
    CHECK(eo && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(eo, "message")),
                       "the decode stage is unavailable"));
    cJSON_Delete(j);
    kiln_buf_free(&b);
}

static void test_error_body(void)
{
    kiln_buf b = {0};
    const char msg[] = "bad \"x\"\n\t\x01 \xff\xc3\xa9 \\";
    CHECK(kiln_api_error_json(&b, 400, msg, "n", "invalid_value", NULL) == KILN_OK);
    cJSON *j = cJSON_ParseWithLength((const char *)b.data, b.len);
    CHECK(j != NULL);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    CHECK(cJSON_IsObject(e));
    const char *m = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "message"));
    CHECK(m && strcmp(m, "bad \"x\"\n\t\x01 \xef\xbf\xbd\xc3\xa9 \\") == 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type")),
                 "invalid_request_error") == 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "param")), "n") == 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "code")),
                 "invalid_value") == 0);
    cJSON_Delete(j);
    kiln_buf_clear(&b);
    CHECK(kiln_api_error_json(&b, 503, "down", NULL, "", NULL) == KILN_OK);
    j = cJSON_ParseWithLength((const char *)b.data, b.len);
    e = cJSON_GetObjectItemCaseSensitive(j, "error");
    CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(e, "param")));
    CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(e, "code")));
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type")),
                 "server_error") == 0);
    cJSON_Delete(j);
    CHECK(strcmp(kiln_api_error_type(429), "rate_limit_error") == 0);
    kiln_buf_free(&b);
}

static void test_images_body(void)
{
    kiln_api_image imgs[2] = {{(const uint8_t *)"\x89PNG", 4, 42},
                              {(const uint8_t *)"abc", 3, 18446744073709551615ull}};
    kiln_buf b = {0};
    kiln_api_images_meta m = {.created = 1700000000, .format = KILN_IMAGE_WEBP, .width = 128,
                              .height = 64, .quality = "auto", .background = "opaque",
                              .usage = {.text_tokens = 512, .image_tokens = 30,
                                        .output_tokens = 64}};
    CHECK(kiln_api_images_json(&b, &m, imgs, 2, NULL) == KILN_OK);
    cJSON *j = cJSON_ParseWithLength((const char *)b.data, b.len);
    CHECK(j != NULL);
    CHECK(cJSON_GetObjectItemCaseSensitive(j, "created")->valuedouble == 1700000000);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "output_format")),
                 "webp") == 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "size")), "128x64") == 0);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(j, "data");
    CHECK(cJSON_GetArraySize(data) == 2);
    const cJSON *d0 = cJSON_GetArrayItem(data, 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(d0, "b64_json")),
                 "iVBORw==") == 0);
    CHECK(cJSON_GetObjectItemCaseSensitive(d0, "seed")->valuedouble == 42);
    CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(d0, "revised_prompt")));
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "quality")), "auto") == 0);
    CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "background")),
                 "opaque") == 0);
    /* OpenAI's usage object (openai-python types/images_response.py). */
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    const cJSON *ud = cJSON_GetObjectItemCaseSensitive(u, "input_tokens_details");
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "input_tokens")->valuedouble == 542);
    CHECK(cJSON_GetObjectItemCaseSensitive(ud, "text_tokens")->valuedouble == 512);
    CHECK(cJSON_GetObjectItemCaseSensitive(ud, "image_tokens")->valuedouble == 30);
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "output_tokens")->valuedouble == 64);
    CHECK(cJSON_GetObjectItemCaseSensitive(u, "total_tokens")->valuedouble == 606);
    cJSON_Delete(j);
    /* Seeds print exactly, beyond a double's precision. */
    CHECK(strstr((const char *)b.data, "\"seed\":18446744073709551615") != NULL);
    kiln_buf_free(&b);
}

int main(void)
{
    RUN(test_base64);
    RUN(test_multipart_boundary);
    RUN(test_multipart_parse);
    RUN(test_generation_json);
    RUN(test_default_size_limits);
    RUN(test_seeds);
    RUN(test_json_errors);
    RUN(test_json_limits);
    RUN(test_cost);
    RUN(test_base_checkpoint);
    RUN(test_edit_json);
    RUN(test_edit_multipart);
    RUN(test_openai_errors);
    RUN(test_openai_fields);
    RUN(test_edit_images_form);
    RUN(test_strength);
    RUN(test_mask);
    RUN(test_stream_events);
    RUN(test_error_body);
    RUN(test_images_body);
    return test_finish();
}

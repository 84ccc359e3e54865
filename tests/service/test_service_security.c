/* Who may use the service: the bus keys and the API key, on the real
 * executables (tiny klein checkpoint, CPU backend).
 *
 * - kiln-gateway with --bus-key/--bus-allow and replicas holding the keys
 *   `kiln keygen` made: a kiln-denoiser without keys and a kiln-decoder
 *   with a valid keypair the allow-list does not name (and the right
 *   gateway key) try to join; both see their handshake refused, the
 *   gateway counts one replica per stage and logs only the operator's
 *   three replicas registering (the rogues never register), and a request
 *   is served with the CLI's bytes.
 * - --api-key-file: no key or a wrong key is 401 with OpenAI's error
 *   object (before the body is read: the connection closes), the right
 *   key is 200; /healthz and /readyz stay open; with --admin-port,
 *   /metrics needs the key on the API port and is open on the admin port,
 *   which serves nothing else.
 * - `kiln serve` runs its bus with keys of its own: a replica started by
 *   hand without them never registers.
 * - Bad keys and options are refused at start with a clear message:
 *   exit 78 (gateway, replicas) or 2 (usage). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/service/svc_util.h"
#include "tests/test.h"

#define API_KEY "kiln-test-key-0123456789abcdef"
#define REQ "{\"prompt\":\"a locked door\",\"size\":\"64x64\",\"seed\":5,\"num_inference_steps\":1}"

static int port, admin_port;
/* <tmp>/gw.key, gw.pub, rep.key, rep.pub, rogue.key */
static char gw_key[256], gw_pub[256], rep_key[256], rep_pub[256], rogue_key[256];

/* `kiln keygen --out <tmp>/name`; 0 or -1. */
static int keygen(const char *name)
{
    const char *argv[] = {svc_exe("tools/kiln"), "keygen", "--out", svc_tmp(name), NULL};
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("keygen.log"));
    return pid < 0 ? -1 : svc_wait_exit(pid, 30000) == 0 ? 0 : -1;
}

/* One request with an Authorization header (NULL: none) on a new
 * connection; 0 with the response, -1 when none came. */
static int request(int p, const char *method, const char *path, const char *auth,
                   const char *json, gwc_response *r)
{
    char head[1024];
    size_t len = json ? strlen(json) : 0;
    snprintf(head, sizeof head,
             "%s %s HTTP/1.1\r\nHost: x\r\n%s%s%sContent-Type: application/json\r\n"
             "Content-Length: %zu\r\nConnection: close\r\n\r\n",
             method, path, auth ? "Authorization: " : "", auth ? auth : "", auth ? "\r\n" : "",
             len);
    kiln_buf in = {0};
    int fd = gwc_connect(p), rc = -1;
    memset(r, 0, sizeof *r);
    if (fd >= 0 && gwc_send(fd, head, strlen(head), 5000) == 0 &&
        (!len || gwc_send(fd, json, len, 5000) == 0))
        rc = gwc_read_response(fd, &in, r, SVC_T_REQ);
    if (fd >= 0)
        close(fd);
    kiln_buf_free(&in);
    return rc;
}

static int status_of(int p, const char *path, const char *auth)
{
    gwc_response r;
    int st = request(p, "GET", path, auth, NULL, &r) ? -1 : r.status;
    gwc_response_free(&r);
    return st;
}

/* The exact 401 object OpenAI answers (message aside). */
static int is_401(const gwc_response *r)
{
    char www[128];
    const char *b = r->body.data ? (const char *)r->body.data : "";
    return r->status == 401 && strstr(b, "\"type\":\"invalid_request_error\"") &&
           strstr(b, "\"param\":null") && strstr(b, "\"code\":\"invalid_api_key\"") &&
           strstr(b, "{\"error\":{\"message\":\"") == b &&
           gwc_header(r, "WWW-Authenticate", www, sizeof www) == 0;
}

static pid_t start_replica(const char *bin, const char *log, const char *key, const char *server)
{
    char bus[64];
    snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", port + 1);
    const char *argv[16] = {svc_exe(bin), "--model", svc.model, "--bus", bus};
    int n = 5;
    if (!strcmp(bin, "services/kiln-encoder"))
        argv[n++] = "--text-encoder-out-layers", argv[n++] = "1,2,3";
    if (key)
        argv[n++] = "--bus-key", argv[n++] = key, argv[n++] = "--bus-server-key",
        argv[n++] = server;
    argv[n] = NULL;
    return svc_spawn(argv, NULL, svc_tmp(log));
}

static void test_keys_and_api_key(void)
{
    CHECK(keygen("gw") == 0 && keygen("rep") == 0 && keygen("rogue") == 0);
    CHECK(keygen("gw") == -1); /* never over existing keys */
    const char *keys = "# current\n" API_KEY "\n";
    CHECK(svc_write_file(svc_tmp("api-keys"), keys, strlen(keys)) == 0);

    port = svc_free_port_pair();
    admin_port = svc_free_port();
    char p[16], ap[16], bus[64];
    snprintf(p, sizeof p, "%d", port);
    snprintf(ap, sizeof ap, "%d", admin_port);
    snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", port + 1);
    const char *gw_argv[] = {svc_exe("services/gateway/kiln-gateway"), "--model", svc.model,
                             "--host", "127.0.0.1", "--port", p, "--min-size", "64", "--bus",
                             bus, "--bus-key", gw_key, "--bus-allow", rep_pub,
                             "--api-key-file", svc_tmp("api-keys"), "--admin-port", ap, "--admin-host", "127.0.0.1", NULL};
    pid_t gw = svc_spawn(gw_argv, NULL, svc_tmp("gateway.log"));
    pid_t reps[3] = {start_replica("services/kiln-encoder", "encoder.log", rep_key, gw_pub),
                     start_replica("services/kiln-denoiser", "denoiser.log", rep_key, gw_pub),
                     start_replica("services/kiln-decoder", "decoder.log", rep_key, gw_pub)};
    pid_t rogue_plain = start_replica("services/kiln-denoiser", "rogue-plain.log", NULL, NULL);
    pid_t rogue_keyed =
        start_replica("services/kiln-decoder", "rogue-keyed.log", rogue_key, gw_pub);
    CHECK(svc_wait_ready(admin_port, 60000) == 0);
    /* Both rogues tried and were refused (they retry, so twice each). */
    CHECK(svc_wait_log(svc_tmp("rogue-plain.log"), "handshake with the gateway failed", 1,
                       30000) == 0);
    CHECK(svc_wait_log(svc_tmp("rogue-keyed.log"), "does not allow this replica's key", 1,
                       30000) == 0);
    CHECK(svc_wait_log(svc_tmp("gateway.log"), "not in the allow-list", 1, 30000) == 0);

    /* The API key. */
    gwc_response r;
    CHECK(request(port, "POST", "/v1/images/generations", NULL, REQ, &r) == 0 && is_401(&r));
    CHECK(r.body.data && strstr((char *)r.body.data, "didn't provide an API key"));
    gwc_response_free(&r);
    CHECK(request(port, "POST", "/v1/images/generations", "Bearer wrong-key-0123456789", REQ, &r) ==
              0 && is_401(&r));
    CHECK(r.body.data && strstr((char *)r.body.data, "Incorrect API key"));
    gwc_response_free(&r);
    CHECK(request(port, "POST", "/v1/images/generations", "Basic " API_KEY, REQ, &r) == 0 &&
          is_401(&r));
    gwc_response_free(&r);
    /* Refused from the headers: a declared 60 MB body is never waited for. */
    int fd = gwc_connect(port);
    const char *big =
        "POST /v1/images/generations HTTP/1.1\r\nHost: a\r\nContent-Length: 60000000\r\n\r\n";
    kiln_buf in = {0};
    CHECK(fd >= 0 && gwc_send(fd, big, strlen(big), 5000) == 0 &&
          gwc_read_response(fd, &in, &r, 10000) == 0 && r.status == 401);
    CHECK(fd >= 0 && gwc_wait_closed(fd, 10000));
    gwc_response_free(&r);
    kiln_buf_free(&in);
    if (fd >= 0)
        close(fd);
    CHECK(status_of(port, "/v1/models", NULL) == 401);
    CHECK(status_of(port, "/v1/models", "Bearer " API_KEY) == 200);
    CHECK(status_of(port, "/no/such/route", NULL) == 401);
    CHECK(status_of(port, "/no/such/route", "Bearer " API_KEY) == 404);
    CHECK(status_of(port, "/healthz", NULL) == 200);
    CHECK(status_of(port, "/readyz", NULL) == 200);
    CHECK(status_of(port, "/metrics", NULL) == 401);
    CHECK(status_of(port, "/metrics", "Bearer " API_KEY) == 200);
    CHECK(status_of(admin_port, "/metrics", NULL) == 200);
    CHECK(status_of(admin_port, "/healthz", NULL) == 200);
    CHECK(status_of(admin_port, "/v1/models", "Bearer " API_KEY) == 404);

    /* Work reaches the operator's replicas only, and comes back right. */
    const char *args[] = {"--prompt", "a locked door", "--seed", "5", "--width", "64", "--height",
                          "64", "--steps", "1", NULL};
    CHECK(svc_cli("generate", args, svc_tmp("cli.png")) == 0);
    svc_images im;
    CHECK(request(port, "POST", "/v1/images/generations", "Bearer " API_KEY, REQ, &r) == 0 &&
          svc_parse_images(&r, &im) == 0);
    if (r.status == 200) {
        CHECK(im.n == 1 && svc_same_file(svc_tmp("cli.png"), &im.files[0]));
        svc_images_free(&im);
    }
    gwc_response_free(&r);
    kiln_buf m = {0};
    CHECK(svc_metrics(admin_port, &m) == 0);
    CHECK(svc_metric((char *)m.data, "kiln_replicas{stage=\"denoise\"}") == 1);
    CHECK(svc_metric((char *)m.data, "kiln_replicas{stage=\"decode\"}") == 1);
    kiln_buf_free(&m);
    CHECK(svc_log_count(svc_tmp("rogue-plain.log"), "registered with the gateway") == 0);
    CHECK(svc_log_count(svc_tmp("rogue-keyed.log"), "registered with the gateway") == 0);
    CHECK(svc_log_count(svc_tmp("gateway.log"), "registered (epoch") == 3);

    CHECK(svc_stop(rogue_plain, 30000) == 0 && svc_stop(rogue_keyed, 30000) == 0);
    CHECK(svc_stop(gw, 30000) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(svc_stop(reps[i], 30000) == 0);
}

/* `kiln serve`: its children hold keys made for the run; a replica
 * started by hand on its bus without them never registers. */
static void test_serve_keys(void)
{
    port = svc_free_port_pair();
    char p[16];
    snprintf(p, sizeof p, "%d", port);
    const char *argv[] = {svc_exe("tools/kiln"), "serve", "--model", svc.model, "--port", p,
                          "--text-encoder-out-layers", "1,2,3", NULL};
    pid_t serve = svc_spawn(argv, NULL, svc_tmp("serve.log"));
    CHECK(svc_wait_ready(port, 60000) == 0);
    pid_t rogue = start_replica("services/kiln-denoiser", "serve-rogue.log", NULL, NULL);
    CHECK(svc_wait_log(svc_tmp("serve-rogue.log"), "handshake with the gateway failed", 1,
                       30000) == 0);
    kiln_buf m = {0};
    CHECK(svc_metrics(port, &m) == 0 &&
          svc_metric((char *)m.data, "kiln_replicas{stage=\"denoise\"}") == 1);
    kiln_buf_free(&m);
    CHECK(svc_log_count(svc_tmp("serve-rogue.log"), "registered with the gateway") == 0);
    CHECK(svc_stop(rogue, 30000) == 0);
    CHECK(svc_stop(serve, 60000) == 0);
    CHECK(svc_log_count(svc_tmp("serve.log"), "CURVE") >= 4); /* the gateway and 3 replicas */
}

/* Exit status and log of a process expected to refuse its start. */
static void refuses(const char *const *argv, int status, const char *needle)
{
    pid_t pid = svc_spawn(argv, NULL, svc_tmp("refuse.log"));
    int st = pid < 0 ? -1 : svc_wait_exit(pid, 60000);
    CHECKF(st == status, "%s exited %d, not %d", argv[0], st, status);
    CHECKF(svc_wait_log(svc_tmp("refuse.log"), needle, 1, 1000) == 0, "no '%s' in the log", needle);
    unlink(svc_tmp("refuse.log"));
}

static void test_bad_config(void)
{
    const char *gw = svc_exe("services/gateway/kiln-gateway");
    const char *den = svc_exe("services/kiln-denoiser");
    char bad[256], api[256];
    snprintf(bad, sizeof bad, "%s", svc_tmp("bad.key"));
    snprintf(api, sizeof api, "%s", svc_tmp("short-api-keys"));
    CHECK(svc_write_file(bad, "not a key\n", 10) == 0);
    CHECK(svc_write_file(api, "short\n", 6) == 0);
    char p[16];
    snprintf(p, sizeof p, "%d", svc_free_port());
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--bus", "tcp://0.0.0.0:0", NULL};
        refuses(a, 78, "can be reached from other machines and has no keys");
    }
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--bus-key", gw_key, NULL};
        refuses(a, 78, "--bus-key and --bus-allow go together");
    }
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--bus-key", bad, "--bus-allow",
                           rep_pub, NULL};
        refuses(a, 78, "expected one key alone on the line");
    }
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--bus-key", gw_key,
                           "--bus-allow", bad, NULL};
        refuses(a, 78, "line 1");
    }
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--api-key-file", api, NULL};
        refuses(a, 78, "a key has 16..256 characters");
    }
    {
        const char *a[] = {gw, "--model", svc.model, "--port", p, "--admin-port", "x", NULL};
        refuses(a, 2, "invalid value 'x'");
    }
    {
        const char *a[] = {den, "--model", svc.model, "--bus", "tcp://127.0.0.1:1", "--bus-key",
                           gw_key, NULL};
        refuses(a, 2, "--bus-key and --bus-server-key go together");
    }
    {
        const char *a[] = {den, "--model", svc.model, "--bus", "tcp://127.0.0.1:1", "--bus-key",
                           bad, "--bus-server-key", gw_pub, NULL};
        refuses(a, 78, "expected one key alone on the line");
    }
    {
        const char *a[] = {den, "--model", svc.model, "--bus", "tcp://127.0.0.1:1", "--bus-key",
                           gw_key, "--bus-server-key", svc_tmp("missing.pub"), NULL};
        refuses(a, 78, "cannot read key file");
    }
}

int main(void)
{
    if (svc_init("security"))
        return 1;
    snprintf(gw_key, sizeof gw_key, "%s", svc_tmp("gw.key"));
    snprintf(gw_pub, sizeof gw_pub, "%s", svc_tmp("gw.pub"));
    snprintf(rep_key, sizeof rep_key, "%s", svc_tmp("rep.key"));
    snprintf(rep_pub, sizeof rep_pub, "%s", svc_tmp("rep.pub"));
    snprintf(rogue_key, sizeof rogue_key, "%s", svc_tmp("rogue.key"));
    RUN(test_keys_and_api_key);
    RUN(test_serve_keys);
    RUN(test_bad_config);
    svc_cleanup(test_failures);
    return test_finish();
}

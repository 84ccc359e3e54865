/* Helpers for the service tests that run the real processes (`kiln
 * serve`, kiln-gateway and the stage workers) on the tiny klein
 * checkpoint: starting them with their output in a log, bounded waits on
 * logs, /readyz and /metrics, OpenAI image responses, the CLI's images for
 * comparison, and what a process holds (/proc RSS, /dev/shm slabs).
 *
 *   if (svc_init("faults")) return 1;             // env, temporary folder
 *   const char *argv[] = {svc_exe("tools/kiln"), "serve", ..., NULL};
 *   pid_t serve = svc_spawn(argv, NULL, svc_tmp("serve.log"));
 *   if (svc_wait_ready(port, 60000)) ...
 *   gwc_response r;  svc_post_json(port, "/v1/images/generations", json, &r, SVC_T_REQ);
 *   svc_images im;   svc_parse_images(&r, &im);
 *   svc_cli("generate", args, svc_tmp("cli.png"));  svc_same_file(svc_tmp("cli.png"), &im.files[0]);
 *   svc_stop(serve, 30000);  svc_cleanup(test_failures);
 *
 * Every wait is bounded and returns -1 on timeout; the checks themselves
 * stay in the test programs (tests/test.h counts per program), so these
 * return 0 / -1 or values and, where a reason helps, fill a message.
 * Paths and names come from static rotating buffers (svc_exe, svc_tmp:
 * 8 each).  Not thread-safe.
 */
#ifndef KILN_TEST_SVC_UTIL_H
#define KILN_TEST_SVC_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/buf.h"
#include "common/bus.h"
#include "common/proto.h"
#include "tests/service/gw_client.h"

#define SVC_T_REQ 120000 /* ms for one image request on a loaded CI machine */

typedef struct svc_env {
    const char *build_root;
    char model[512];  /* the tiny klein checkpoint */
    char tmpdir[64];  /* this run's logs and files */
} svc_env;

extern svc_env svc;

/* Reads KILN_BUILD_ROOT / KILN_SHARED, makes /tmp/kiln-<name>-XXXXXX and
 * ignores SIGPIPE.  -1 (with a message on stderr) when it cannot. */
int svc_init(const char *name);
/* Removes the temporary folder; when `keep`, prints the last lines of its
 * logs and says where it is kept. */
void svc_cleanup(int keep);

/* $KILN_BUILD_ROOT/rel and <tmpdir>/name (rotating static buffers). */
const char *svc_exe(const char *rel);
const char *svc_tmp(const char *name);

void svc_sleep_ms(int ms);

/* A service process on the tiny checkpoint and `bus`, its output in
 * <tmpdir>/<name>.log: `name` is "gateway" (kiln-gateway on 127.0.0.1, a
 * port the kernel picks: see svc_log_port, and --min-size 64) or a stage,
 * "encoder" (with --text-encoder-out-layers 1,2,3), "denoiser" or
 * "decoder"; `extra` (NULL-terminated, or NULL) is appended to its
 * arguments and `env` as for svc_spawn.  The pid, or -1. */
pid_t svc_spawn_service(const char *name, const char *bus, const char *const *extra,
                        const char *const *env);

/* kiln-gateway and one encoder, denoiser and decoder on the bus
 * ipc://<tmpdir>/bus, as svc_spawn_service starts them with extra[i] (or
 * NULL) added to their arguments, into pids[4] in that order; waits until
 * /readyz answers.  The gateway's port, or -1 (every process was started:
 * stop them). */
int svc_start_service(const char *const *const extra[4], const char *const *env, pid_t pids[4]);

/* fork + exec with stdout and stderr appended to `log`; the child gets
 * SIGTERM if this test dies.  `env` (NULL-terminated "K=V" strings, or
 * NULL) is added to its environment.  The pid, or -1. */
pid_t svc_spawn(const char *const *argv, const char *const *env, const char *log);
/* SIGTERM, then waits up to timeout_ms (SIGKILL after that).  The exit
 * status (128 + signal when killed by one), or -1 when it could not be
 * reaped. */
int svc_stop(pid_t pid, int timeout_ms);
/* Waits for a child to exit on its own; as svc_stop, without signals
 * unless the wait times out (then SIGKILL and -1). */
int svc_wait_exit(pid_t pid, int timeout_ms);

/* The whole log as a NUL-terminated buffer (empty when unreadable). */
void svc_read_log(const char *log, kiln_buf *out);
/* Occurrences of `needle` in the log. */
int svc_log_count(const char *log, const char *needle);
/* Waits until the log holds `needle` at least `times` times; 0 or -1. */
int svc_wait_log(const char *log, const char *needle, int times, int timeout_ms);
/* The log's size in bytes (a position to search from later). */
size_t svc_log_size(const char *log);
/* The first of pids[n] that a kiln-denoiser line "...-<pid>[-...]: batch
 * of" past byte `from` of the log names (its replica id holds its pid),
 * or -1 after timeout_ms. */
pid_t svc_batch_started(const char *log, size_t from, const pid_t *pids, int n, int timeout_ms);
/* The workers' ": at exit:" reports in the log: their number; *bad (cap
 * bytes) receives the first one that holds a job or a range in use, or
 * stays empty. */
int svc_exit_reports(const char *log, char *bad, size_t cap);
/* The same over the log from byte `from` on (svc_log_size before). */
int svc_exit_reports_from(const char *log, size_t from, char *bad, size_t cap);
/* Waits until the worker of pid logs that it registered ("registered with
 * the gateway as <id>", the id holding its pid); 0 or -1. */
int svc_wait_registered(const char *log, pid_t pid, int timeout_ms);
/* The port kiln-gateway logged it listens on ("on http://127.0.0.1:P"),
 * or -1 after timeout_ms. */
int svc_log_port(const char *log, int timeout_ms);
/* A port nobody listens on right now (the kernel's pick, released). */
int svc_free_port(void);
/* A free port P whose P + 1 is free too (the default bus of kiln serve
 * and kiln-gateway, the denoiser's data port of kiln-stages); -1. */
int svc_free_port_pair(void);

/* `kiln serve` on the tiny checkpoint (sizes 64..128, the tiny text
 * encoder layers, bus ipc://<tmpdir>/bus, its log in <tmpdir>/serve.log)
 * with `--denoisers n` and extra[] (NULL-terminated) added, waited until
 * /readyz says ready with n denoisers.  Its pid (*port set), or -1. */
pid_t svc_serve(int denoisers, const char *const *extra, const char *const *env, int *port);

/* One GET on a new connection: the status, or -1. */
int svc_get_status(int port, const char *path);
int svc_post_json(int port, const char *path, const char *json, gwc_response *r, int timeout_ms);
/* Waits until GET /readyz answers 200; 0 or -1. */
int svc_wait_ready(int port, int timeout_ms);

/* GET /metrics into a NUL-terminated buffer; 0 or -1. */
int svc_metrics(int port, kiln_buf *out);
/* Sum of the samples on lines starting with `prefix` (e.g.
 * "kiln_jobs " or "kiln_inflight{"); 0 when none. */
double svc_metric(const char *text, const char *prefix);
/* Waits until the metric at `prefix` equals `want`; 0, or -1 with the
 * last value in *last (when not NULL). */
int svc_wait_metric(int port, const char *prefix, double want, int timeout_ms, double *last);
/* Waits until no job is left in the gateway and no replica still runs
 * one (kiln_jobs, every kiln_queue_depth, kiln_inflight, kiln_cancelling
 * and kiln_replicas_busy at 0: a cancelled job leaves kiln_inflight when
 * the cancel is sent, not when the replica stops it); 0, or -1 with the
 * last values described in `last`. */
int svc_wait_idle(int port, int timeout_ms, char *last, size_t cap);

/* ---- OpenAI images responses ---- */

typedef struct svc_images {
    int n;
    kiln_buf files[16];
    uint64_t seeds[16];
} svc_images;

/* 0 when r is a 200 images response (files decoded from b64_json). */
int svc_parse_images(const gwc_response *r, svc_images *im);
void svc_images_free(svc_images *im);
/* 0 when r's body is an OpenAI error object whose code is `code` (any
 * code when NULL) and whose message names no path; else -1 with why. */
int svc_error_body(const gwc_response *r, const char *code, char *why, size_t cap);

/* ---- requests in flight, each checked against the CLI ---- */

/* A series: request i is prompt "<name> i", seed base + i, 64x64, `steps`
 * steps, max_sequence_length 32, so that no two requests share
 * embeddings; svc_cli_series writes the CLI's image i to <name>-<i>.png. */
void svc_series_json(char *buf, size_t cap, const char *name, int base, int i, const char *steps);
int svc_cli_series(const char *name, int base, int n, const char *steps);

typedef enum svc_verdict {
    SVC_PENDING = 0,
    SVC_IMAGE,       /* 200 with exactly the CLI's image */
    SVC_WRONG_IMAGE, /* 200 with anything else */
    SVC_UNAVAILABLE, /* 503 with an OpenAI error object (stage_unavailable) */
    SVC_OTHER,       /* any other answer, or none */
} svc_verdict;

typedef struct svc_client {
    int fd;
    kiln_buf in;
    char ref[64]; /* the CLI's image for it, under tmpdir */
    svc_verdict verdict;
    char why[256]; /* what was wrong, for SVC_WRONG_IMAGE / SVC_OTHER */
} svc_client;

/* Sends requests first..first+n-1 of a series at once (n <= 16) and waits
 * for their answers (SVC_T_REQ); cs[n] holds them, judged.  Returns the
 * number of SVC_IMAGE. */
int svc_series_run(int port, const char *name, int base, int first, int n, const char *steps,
                   svc_client *cs);
/* The first of cs[n] answered otherwise than with its image (or, when
 * allow_503, a 503 OpenAI error), or NULL. */
const svc_client *svc_series_bad(const svc_client *cs, int n, int allow_503);

/* Sends json to /v1/images/generations on a connection of its own. */
void svc_client_send(svc_client *c, int port, const char *json, const char *ref);
/* Reads c's answer when it comes within wait_ms and judges it; returns its
 * verdict (SVC_PENDING while none came). */
svc_verdict svc_client_poll(svc_client *c, int wait_ms);
/* Polls every pending client until all are answered or timeout_ms passed;
 * the number still pending. */
int svc_clients_wait(svc_client *cs, int n, int timeout_ms);

/* ---- a replica on the bus driven from the test (it may misbehave) ---- */

typedef struct svc_fake {
    kiln_bus *bus;
    char id[64];
    uint64_t epoch;
    double next_hb;
    int fenced; /* it was told so (no more heartbeats) */
    int cancels; /* `cancel`s received */
    int n_jobs;
    kiln_msg *jobs[16]; /* the jobs it received, owned */
} svc_fake;

/* Connects a DEALER with routing id `id` to the bus at `endpoint`; its
 * messages carry `epoch`.  It holds the replicas' CURVE key of the `kiln
 * serve` svc_serve started, when there is one: an insider that
 * misbehaves, not a stranger (the bus refuses those,
 * test_service_security).  0, or -1 (logged). */
int svc_fake_open(svc_fake *f, const char *endpoint, const char *id, uint64_t epoch);
/* Stamps m with the fake's epoch and sends it; 0 or -1. */
int svc_fake_send(svc_fake *f, kiln_msg *m);
/* Registers as a replica of `stage` serving the tiny checkpoint, with
 * `credits` (0: no `ready`). */
void svc_fake_hello(svc_fake *f, kiln_stage stage, int credits);
/* Heartbeats and receives for ms milliseconds: jobs are kept, cancels
 * counted, `fenced` for its epoch noted. */
void svc_fake_pump(svc_fake *f, int ms);
/* Sends `release` for the shm references of a job's inputs. */
void svc_fake_release(svc_fake *f, const kiln_ref_map *in);
void svc_fake_close(svc_fake *f);

/* ---- the CLI and files ---- */

/* Runs `kiln <cmd> --model <tiny> --text-encoder-out-layers 1,2,3 --out
 * <out> args...` (its output in <tmpdir>/cli.log); the exit status or -1. */
int svc_cli(const char *cmd, const char *const *args, const char *out);
/* 1 when the file holds exactly `data`. */
int svc_same_file(const char *path, const kiln_buf *data);
int svc_write_file(const char *path, const void *data, size_t len);
int svc_read_file(const char *path, kiln_buf *out);

/* ---- what a process holds ---- */

/* A field of /proc/<pid>/status in kB ("VmRSS", "RssAnon"), or -1. */
long svc_proc_kb(pid_t pid, const char *field);
/* /dev/shm/kiln-* slabs named after pid (/kiln-<stage>-<epoch>-<pid>-<n>). */
int svc_shm_slabs(pid_t pid);
/* /dev/shm/kiln-* slabs whose name holds `part` (an epoch's 16 digits). */
int svc_shm_slabs_with(const char *part);
/* Unlinks the /dev/shm/kiln-* slabs named after pid, as a cleaner or
 * systemd-logind's RemoveIPC would; the number removed. */
int svc_shm_unlink_of(pid_t pid);
/* Children of `parent` whose command name is `comm`, up to max; the
 * count. */
int svc_children(pid_t parent, const char *comm, pid_t *out, int max);
/* 1 when KILN_REQUIRE_NAMESPACES=1 (.ci/run sets it): a test that cannot
 * make the namespaces it needs here must fail, not skip that part. */
int svc_namespaces_required(void);

#endif

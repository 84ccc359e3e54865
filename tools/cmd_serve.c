/* kiln serve: the whole service on one machine: kiln-gateway plus N
 * replicas of each stage worker as supervised child processes
 * (tools/supervisor.h).  Each child is also its own executable, for
 * deployments that spread them over machines (docs/ARCHITECTURE.md). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "commands.h"
#include "common/bus_keys.h"
#include "common/checkpoint.h"
#include "common/log.h"
#include "common/proto.h"
#include "engine/denoise_stage.h"
#include "models/vae.h"
#include "services/common/pool.h"
#include "supervisor.h"
#include "common/args.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kiln serve --model DIR [--port P] [--host ADDR] [--bus ENDPOINT]\n"
            "  [--device cpu|cuda]\n"
            "  [--gpus N] [--min-size PX] [--max-size PX] [--text-encoder-out-layers A,B,C]\n"
            "  [--encoders N] [--denoisers N] [--decoders N] [--max-batch N]\n"
            "  [--encoder-gpu G] [--denoiser-gpu G] [--decoder-gpu G] [--colocate]\n"
            "  [--prompt-cache-mb N]\n"
            "  [--vae-band-above MP] [--vae-band-rows N] [--image-threads N]\n"
            "  [--precision exact|fp8]\n"
            "  [--served-model-name NAME] [--trace-file FILE]\n"
            "  [kiln-gateway's limits and timeouts: --max-body-mb N --max-header-kb N\n"
            "   --max-connections N --max-client-connections N --body-budget-mb N\n"
            "   --client-body-budget-mb N --body-wait-ms MS --queue-max N\n"
            "   --request-timeout-s S --max-cost MTOK --client-queue-share F\n"
            "   --progress-timeout-s S --cancel-timeout-s S --header-timeout-ms MS\n"
            "   --read-timeout-ms MS --idle-timeout-ms MS --write-timeout-ms MS\n"
            "   --heartbeat-timeout-ms MS --drain-s S --api-key-file FILE --admin-port P\n"
            "   --admin-host ADDR --max-ref-mp N --ignore-unknown-fields]\n"
            "Starts kiln-gateway on ADDR:P (default 127.0.0.1:8000) and the stage replicas\n"
            "(one of each by default), connected over the bus (default\n"
            "tcp://127.0.0.1:<P+1>), secured with a CURVE keypair made for this run (only\n"
            "these children hold it).  --api-key-file: Bearer keys the HTTP API requires.\n"
            "With --gpus N, replica i of each stage runs on GPU i %% N; --<stage>-gpu G pins\n"
            "every replica of that stage to GPU G instead.  --colocate runs replica i of\n"
            "every stage as threads of one process (kiln-stages) sharing one CUDA context,\n"
            "so the stages' kernels overlap instead of time-slicing the GPU between\n"
            "processes; a fault in one restarts all of them.  Each encoder keeps up to N MiB\n"
            "(default 256, 0: off) of prompt embeddings in host memory.  Images of more than\n"
            "--vae-band-above megapixels (default 1 = 1024x1024) run through the VAE in bands\n"
            "of --vae-band-rows rows (default 128), with the same result and less GPU memory.\n"
            "Each decoder encodes images on --image-threads threads (default half the CPUs,\n"
            "1 to 4).\n"
            "--precision fp8 (never the default) runs the denoisers' transformer-block linear\n"
            "layers as FP8 (E4M3) GEMMs: faster on GPUs with FP8 tensor cores, images close\n"
            "to but not the same as the exact ones (docs/PERFORMANCE.md, \"FP8 mode\").\n"
            "A crashed child is\n"
            "restarted; SIGINT/SIGTERM stops the gateway (which drains), then the replicas.\n"
            "The gateway's limits are passed on to it (kiln-gateway --help).  A replica with\n"
            "work whose backend makes no progress for --progress-timeout-s (default 60) is\n"
            "fenced and restarted.  The gateway logs \"ready: http://ADDR:P\" once every stage\n"
            "has loaded, then one access line per request.  The model is served as NAME\n"
            "(default: the folder's name, or ORG/NAME for a Hugging Face cache folder).\n");
}

typedef struct serve_opts {
    const char *model, *bus, *device, *layers, *host;
    const char *min_size, *max_size;
    const char *prompt_cache_mb; /* NULL: the encoder's default */
    const char *band_above, *band_rows; /* NULL: the VAE stages' defaults */
    const char *image_threads;          /* NULL: the decoders' default */
    const char *precision; /* NULL: the denoiser's default (exact) */
    int port, gpus, max_batch;
    int replicas[3]; /* encoders, denoisers, decoders */
    int stage_gpu[3]; /* -1: round robin over --gpus */
    int gw_opt[32];           /* gateway options passed on: gateway_options indices */
    const char *gw_value[32]; /* ... and their values */
    int n_gw_args;
    int ignore_unknown;       /* kiln-gateway --ignore-unknown-fields */
    int colocate;             /* replica i of every stage in one kiln-stages process */
} serve_opts;

/* kiln-gateway's options kiln serve passes on as given (the gateway checks
 * their values and exits 2, which stops the service, when one is bad). */
static const char *const gateway_options[] = {
    "max-body-mb", "max-connections", "max-client-connections", "body-budget-mb",
    "client-body-budget-mb", "body-wait-ms", "queue-max", "request-timeout-s", "max-cost",
    "client-queue-share", "progress-timeout-s",
    "cancel-timeout-s", "api-key-file", "admin-port", "admin-host", "max-header-kb",
    "header-timeout-ms", "read-timeout-ms", "idle-timeout-ms", "write-timeout-ms",
    "heartbeat-timeout-ms", "drain-s", "served-model-name", "max-ref-mp", "trace-file",
};
#define N_GATEWAY_OPTIONS ((int)(sizeof gateway_options / sizeof gateway_options[0]))
_Static_assert(N_GATEWAY_OPTIONS <= 32, "serve_opts.gw_opt holds 32");

/* The GPU of replica i of stage st. */
static int replica_gpu(const serve_opts *o, int st, int i)
{
    return o->stage_gpu[st] >= 0 ? o->stage_gpu[st] : i % o->gpus;
}

/* Under --colocate: how many kiln-stages processes run (process i runs
 * replica i of each stage that has one). */
static int colocated_processes(const serve_opts *o)
{
    int n = o->replicas[0] > o->replicas[1] ? o->replicas[0] : o->replicas[1];
    return n > o->replicas[2] ? n : o->replicas[2];
}

/* The stages (bits of kiln_stage) of colocated process i and their GPU;
 * -1 when the --<stage>-gpu options put them on different GPUs. */
static int colocated(const serve_opts *o, int i, unsigned *stages, int *gpu)
{
    *stages = 0;
    *gpu = -1;
    for (int st = 0; st < 3; st++) {
        if (i >= o->replicas[st])
            continue;
        if (*gpu >= 0 && replica_gpu(o, st, i) != *gpu)
            return -1;
        *gpu = replica_gpu(o, st, i);
        *stages |= 1u << st;
    }
    return 0;
}

static int parse(int argc, char **argv, serve_opts *o)
{
    enum { O_MIN = 256, O_MAX, O_LAYERS, O_ENC, O_DEN, O_DEC, O_GPUS, O_BATCH, O_ENC_GPU,
           O_DEN_GPU, O_DEC_GPU, O_PROMPT_CACHE, O_HOST, O_BAND_ABOVE, O_BAND_ROWS,
           O_IMAGE_THREADS, O_IGNORE_UNKNOWN,
           O_PRECISION, O_COLOCATE, O_GATEWAY };
    static const struct option fixed[] = {
        {"model", required_argument, 0, 'm'},     {"port", required_argument, 0, 'p'},
        {"bus", required_argument, 0, 'b'},       {"device", required_argument, 0, 'd'},
        {"gpus", required_argument, 0, O_GPUS},   {"min-size", required_argument, 0, O_MIN},
        {"max-size", required_argument, 0, O_MAX},
        {"text-encoder-out-layers", required_argument, 0, O_LAYERS},
        {"encoders", required_argument, 0, O_ENC}, {"denoisers", required_argument, 0, O_DEN},
        {"decoders", required_argument, 0, O_DEC}, {"max-batch", required_argument, 0, O_BATCH},
        {"encoder-gpu", required_argument, 0, O_ENC_GPU},
        {"denoiser-gpu", required_argument, 0, O_DEN_GPU},
        {"decoder-gpu", required_argument, 0, O_DEC_GPU},
        {"prompt-cache-mb", required_argument, 0, O_PROMPT_CACHE},
        {"host", required_argument, 0, O_HOST},
        {"vae-band-above", required_argument, 0, O_BAND_ABOVE},
        {"vae-band-rows", required_argument, 0, O_BAND_ROWS},
        {"image-threads", required_argument, 0, O_IMAGE_THREADS},
        {"ignore-unknown-fields", no_argument, 0, O_IGNORE_UNKNOWN},
        {"precision", required_argument, 0, O_PRECISION},
        {"colocate", no_argument, 0, O_COLOCATE},
        {"help", no_argument, 0, 'h'},
    };
    /* The options above, then the gateway's, then the zeroed terminator. */
    enum { N_FIXED = sizeof fixed / sizeof *fixed };
    static struct option longopts[N_FIXED + N_GATEWAY_OPTIONS + 1];
    memcpy(longopts, fixed, sizeof fixed);
    for (int i = 0; i < N_GATEWAY_OPTIONS; i++)
        longopts[N_FIXED + i] = (struct option){gateway_options[i], required_argument, 0, O_GATEWAY};
    /* Loopback by default: a one-machine service is reached from this
     * machine unless the operator says otherwise (--host 0.0.0.0). */
    *o = (serve_opts){.device = "cpu", .host = "127.0.0.1", .port = 8000, .gpus = 1, .max_batch = 4,
                      .replicas = {1, 1, 1}, .stage_gpu = {-1, -1, -1}};
    int c, unused, index = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, &index)) != -1) {
        int bad = 0;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': bad = kiln_parse_int(optarg, 1, 65534, &o->port); break;
        case 'b': o->bus = optarg; break;
        case 'd': o->device = optarg; break;
        case O_GPUS: bad = kiln_parse_int(optarg, 1, 64, &o->gpus); break;
        case O_MIN: o->min_size = optarg, bad = kiln_parse_int(optarg, 16, 16384, &unused); break;
        case O_MAX: o->max_size = optarg, bad = kiln_parse_int(optarg, 16, 16384, &unused); break;
        case O_LAYERS: o->layers = optarg; break;
        case O_ENC: bad = kiln_parse_int(optarg, 1, 64, &o->replicas[0]); break;
        case O_DEN: bad = kiln_parse_int(optarg, 1, 64, &o->replicas[1]); break;
        case O_DEC: bad = kiln_parse_int(optarg, 1, 64, &o->replicas[2]); break;
        case O_BATCH: bad = kiln_parse_int(optarg, 1, 256, &o->max_batch); break;
        case O_ENC_GPU: bad = kiln_parse_int(optarg, 0, 63, &o->stage_gpu[0]); break;
        case O_DEN_GPU: bad = kiln_parse_int(optarg, 0, 63, &o->stage_gpu[1]); break;
        case O_DEC_GPU: bad = kiln_parse_int(optarg, 0, 63, &o->stage_gpu[2]); break;
        case O_PROMPT_CACHE:
            o->prompt_cache_mb = optarg, bad = kiln_parse_int(optarg, 0, 1 << 20, &unused);
            break;
        case O_HOST: o->host = optarg; break;
        case O_BAND_ABOVE: {
            double mp;
            o->band_above = optarg, bad = kiln_parse_double(optarg, 0, 1 << 20, &mp);
            break;
        }
        case O_BAND_ROWS:
            o->band_rows = optarg;
            bad = kiln_parse_int(optarg, 1, KILN_VAE_BAND_ROWS_MAX, &unused);
            break;
        case O_IMAGE_THREADS:
            o->image_threads = optarg;
            bad = kiln_parse_int(optarg, 1, KILN_POOL_MAX_THREADS, &unused);
            break;
        case O_IGNORE_UNKNOWN: o->ignore_unknown = 1; break;
        case O_COLOCATE: o->colocate = 1; break;
        case O_PRECISION: {
            kiln_precision p;
            o->precision = optarg, bad = kiln_precision_parse(optarg, &p);
            break;
        }
        case O_GATEWAY:
            if (o->n_gw_args == N_GATEWAY_OPTIONS) {
                bad = 1;
                break;
            }
            o->gw_opt[o->n_gw_args] = index - N_FIXED;
            o->gw_value[o->n_gw_args++] = optarg;
            break;
        case 'h': usage(stdout); exit(0);
        default: bad = 1;
        }
        if (bad) {
            if (c != '?')
                fprintf(stderr, "kiln serve: invalid value '%s' for %s\n", optarg ? optarg : "",
                        kiln_arg_option(argv, optind, optarg));
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc || !o->model) {
        fprintf(stderr, "kiln serve: %s\n", optind < argc ? "unexpected argument"
                                                          : "--model is required");
        usage(stderr);
        return 2;
    }
    unsigned stages;
    int gpu;
    for (int i = 0; o->colocate && i < colocated_processes(o); i++)
        if (colocated(o, i, &stages, &gpu)) {
            fprintf(stderr, "kiln serve: --colocate runs replica %d of every stage in one process "
                    "on one GPU, but --gpus and the --<stage>-gpu options put them on different "
                    "GPUs\n", i);
            usage(stderr);
            return 2;
        }
    return 0;
}

/* The bus keys of one run: made fresh in a private folder that only this
 * user can enter, handed to the children as files (not argv, which every
 * user can read in /proc), removed at exit. */
typedef struct run_keys {
    char dir[PATH_MAX - 32];
    char gw_key[PATH_MAX], gw_pub[PATH_MAX], rep_key[PATH_MAX], rep_pub[PATH_MAX];
} run_keys;

static void remove_keys(run_keys *k)
{
    if (!k->dir[0])
        return;
    const char *files[] = {k->gw_key, k->gw_pub, k->rep_key, k->rep_pub};
    for (int i = 0; i < 4; i++)
        if (files[i][0])
            unlink(files[i]);
    if (rmdir(k->dir))
        KILN_LOG_WARN("kiln serve: cannot remove %s: %s", k->dir, strerror(errno));
    k->dir[0] = '\0';
}

static kiln_status make_keys(run_keys *k, kiln_err *err)
{
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp || strlen(tmp) > PATH_MAX - 64)
        tmp = "/tmp";
    snprintf(k->dir, sizeof k->dir, "%.4000s/kiln-serve-XXXXXX", tmp);
    if (!mkdtemp(k->dir)) {
        kiln_err_set(err, KILN_ERR_IO, "cannot make a folder for the bus keys in %s: %s", tmp,
                     strerror(errno));
        k->dir[0] = '\0';
        return err->code;
    }
    snprintf(k->gw_key, sizeof k->gw_key, "%s/gateway.key", k->dir);
    snprintf(k->gw_pub, sizeof k->gw_pub, "%s/gateway.pub", k->dir);
    snprintf(k->rep_key, sizeof k->rep_key, "%s/replica.key", k->dir);
    snprintf(k->rep_pub, sizeof k->rep_pub, "%s/replica.pub", k->dir);
    if (kiln_bus_keys_write_pair(k->gw_key, k->gw_pub, NULL, err) ||
        kiln_bus_keys_write_pair(k->rep_key, k->rep_pub, NULL, err)) {
        remove_keys(k);
        return err->code;
    }
    return KILN_OK;
}

static kiln_status add_gateway(kiln_supervisor *s, const serve_opts *o, const char *bus,
                               const run_keys *keys, kiln_err *err)
{
    char exe[PATH_MAX], port[16];
    if (kiln_supervisor_find_exe("kiln-gateway", exe, sizeof exe, err))
        return err->code;
    snprintf(port, sizeof port, "%d", o->port);
    /* The replicas' public key file is the allow-list (one key). */
    const char *argv[23 + 2 * N_GATEWAY_OPTIONS] = {exe, "--port", port, "--host", o->host, "--bus",
                                                     bus, "--model", o->model, "--bus-key",
                                                     keys->gw_key, "--bus-allow", keys->rep_pub};
    char names[N_GATEWAY_OPTIONS][40];
    int k = 13;
    if (o->min_size)
        argv[k++] = "--min-size", argv[k++] = o->min_size;
    if (o->max_size)
        argv[k++] = "--max-size", argv[k++] = o->max_size;
    for (int i = 0; i < o->n_gw_args; i++) {
        snprintf(names[i], sizeof names[i], "--%s", gateway_options[o->gw_opt[i]]);
        argv[k++] = names[i], argv[k++] = o->gw_value[i];
    }
    if (o->ignore_unknown)
        argv[k++] = "--ignore-unknown-fields";
    return kiln_supervisor_add(s, "kiln-gateway", KILN_CHILD_FRONT, argv, err);
}

/* One stage process: `stages` (bits of kiln_stage) on GPU `gpu`, with the
 * options of those stages. */
static kiln_status add_stage_process(kiln_supervisor *s, const serve_opts *o, const char *bus,
                                     const run_keys *keys, const char *bin, const char *name,
                                     unsigned stages, int gpu, kiln_err *err)
{
    char exe[PATH_MAX], gpu_s[16], batch[16], list[64] = "";
    if (kiln_supervisor_find_exe(bin, exe, sizeof exe, err))
        return err->code;
    snprintf(gpu_s, sizeof gpu_s, "%d", gpu);
    snprintf(batch, sizeof batch, "%d", o->max_batch);
    const char *argv[40] = {exe, "--model", o->model, "--bus", bus, "--device", o->device,
                            "--gpu", gpu_s, "--max-batch", batch, "--bus-key", keys->rep_key,
                            "--bus-server-key", keys->gw_pub, "--bus-allow", keys->rep_pub};
    int k = 17;
    const unsigned enc = 1u << KILN_STAGE_ENCODE, den = 1u << KILN_STAGE_DENOISE,
                   dec = 1u << KILN_STAGE_DECODE;
    if (!strcmp(bin, "kiln-stages")) {
        for (int st = 0; st < 3; st++)
            if (stages & (1u << st))
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                         list[0] ? "," : "", kiln_stage_name((kiln_stage)st));
        argv[k++] = "--stages", argv[k++] = list;
    }
    if ((stages & enc) && o->layers)
        argv[k++] = "--text-encoder-out-layers", argv[k++] = o->layers;
    if ((stages & enc) && o->prompt_cache_mb)
        argv[k++] = "--prompt-cache-mb", argv[k++] = o->prompt_cache_mb;
    if ((stages & (enc | dec)) && o->band_above)
        argv[k++] = "--vae-band-above", argv[k++] = o->band_above;
    if ((stages & (enc | dec)) && o->band_rows)
        argv[k++] = "--vae-band-rows", argv[k++] = o->band_rows;
    if ((stages & dec) && o->image_threads)
        argv[k++] = "--image-threads", argv[k++] = o->image_threads;
    if ((stages & den) && o->precision)
        argv[k++] = "--precision", argv[k++] = o->precision;
    return kiln_supervisor_add(s, name, KILN_CHILD_BACK, argv, err);
}

static kiln_status add_replicas(kiln_supervisor *s, const serve_opts *o, const char *bus,
                                const run_keys *keys, kiln_err *err)
{
    static const char *const bins[] = {"kiln-encoder", "kiln-denoiser", "kiln-decoder"};
    char name[64];
    if (!o->colocate) {
        for (int st = 0; st < 3; st++)
            for (int i = 0; i < o->replicas[st]; i++) {
                snprintf(name, sizeof name, "%s[%d]", bins[st], i);
                if (add_stage_process(s, o, bus, keys, bins[st], name, 1u << st,
                                      replica_gpu(o, st, i), err))
                    return err->code;
            }
        return KILN_OK;
    }
    for (int i = 0; i < colocated_processes(o); i++) {
        unsigned stages;
        int gpu;
        colocated(o, i, &stages, &gpu); /* parse refused a process split over GPUs */
        snprintf(name, sizeof name, "kiln-stages[%d]", i);
        if (add_stage_process(s, o, bus, keys, "kiln-stages", name, stages, gpu, err))
            return err->code;
    }
    return KILN_OK;
}

/* Whether host:port can be bound now (the gateway binds it a moment
 * later): a port in use is said at once, by kiln serve, rather than by a
 * gateway restarted in a loop. */
static kiln_status check_port(const char *host, int port, const char *what, kiln_err *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    int rc = getaddrinfo(host, service, &hints, &ai);
    if (rc)
        return kiln_err_set(err, KILN_ERR_INVALID, "--host %s: not an IPv4 or IPv6 address (%s)",
                            host, gai_strerror(rc));
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol), e = 0;
    int one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, ai->ai_addr, ai->ai_addrlen))
        e = errno;
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    if (e)
        return kiln_err_set(err, KILN_ERR_INVALID, "cannot listen on %s:%d for the %s: %s%s", host,
                            port, what, strerror(e),
                            e == EADDRINUSE ? " (another server runs there: choose --port)" : "");
    return KILN_OK;
}

/* The checkpoint opens (every stage would refuse it otherwise, one by
 * one). */
static kiln_status check_model(const char *dir, kiln_err *err)
{
    kiln_checkpoint *ck = kiln_checkpoint_open(dir, err);
    if (!ck)
        return kiln_err_wrap(err, "--model %s", dir);
    kiln_checkpoint_close(ck);
    return KILN_OK;
}

int kiln_cmd_serve(int argc, char **argv)
{
    serve_opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    char bus[256];
    if (o.bus)
        snprintf(bus, sizeof bus, "%s", o.bus);
    else
        snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", o.port + 1);
    kiln_err err = {0};
    run_keys keys = {0};
    kiln_supervisor *s = NULL;
    if (check_model(o.model, &err) || check_port(o.host, o.port, "HTTP API", &err) ||
        (!o.bus && check_port("127.0.0.1", o.port + 1, "bus (--port + 1)", &err))) {
        fprintf(stderr, "kiln serve: %s\n", err.msg);
        return 1;
    }
    if (make_keys(&keys, &err) || !(s = kiln_supervisor_create(&err)) ||
        add_gateway(s, &o, bus, &keys, &err) || add_replicas(s, &o, bus, &keys, &err)) {
        fprintf(stderr, "kiln serve: %s\n", err.msg);
        kiln_supervisor_destroy(s);
        remove_keys(&keys);
        return 1;
    }
    /* No URL yet: the gateway prints "ready: http://..." once every stage
     * has loaded its model and registered. */
    KILN_LOG_INFO("kiln serve: starting %s with %d/%d/%d replicas%s on %s, bus %s (CURVE, keys "
                  "of this run)", o.model, o.replicas[0], o.replicas[1], o.replicas[2],
                  o.colocate ? " (colocated)" : "", o.device, bus);
    rc = kiln_supervisor_run(s);
    kiln_supervisor_destroy(s);
    remove_keys(&keys);
    return rc;
}

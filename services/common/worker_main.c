/* Start-up and shutdown of a stage worker: the command line, the replica
 * id, the model, the transports and the signal handlers. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/family.h"
#include "engine/prompt_cache.h"
#include "models/vae.h"
#include "pool.h"
#include "worker_impl.h"
#include "common/args.h"

/* The set of stages a process runs, as bits of kiln_stage. */
#define STAGE_BIT(st) (1u << (st))

static void usage(FILE *f, const char *binary, const kiln_stage_ops *const *offered, int n_offered)
{
    unsigned can = 0;
    for (int i = 0; i < n_offered; i++)
        can |= STAGE_BIT(offered[i]->stage);
    fprintf(f,
            "usage: %s%s --model DIR --bus ENDPOINT [--bus-key FILE --bus-server-key FILE\n"
            "  [--bus-allow FILE]] [--data-port P] [--data-host HOST] [--health-port P]\n"
            "  [--device cpu|cuda] [--gpu N]\n"
            "  [--max-batch N] [--batch-window-ms MS] [--tensor-transport auto|shm|cuda_ipc]\n"
            "  [--replica-id ID] [--drain-s S]%s%s%s%s\n",
            binary, n_offered > 1 ? " [--stages encode,denoise,decode]" : "",
            can & STAGE_BIT(KILN_STAGE_ENCODE)
                ? "\n  [--text-encoder-out-layers A,B,C] [--prompt-cache-mb N (default 256, 0: off)]"
                : "",
            can & (STAGE_BIT(KILN_STAGE_ENCODE) | STAGE_BIT(KILN_STAGE_DECODE))
                ? "\n  [--vae-band-above MP (default 1)] [--vae-band-rows N (default 128)]"
                : "",
            can & STAGE_BIT(KILN_STAGE_DECODE)
                ? "\n  [--image-threads N (default half the CPUs, 1 to 4)]"
                : "",
            can & STAGE_BIT(KILN_STAGE_DENOISE)
                ? "\n  [--precision exact|fp8 (default exact; fp8: the transformer blocks'\n"
                  "   linear layers as FP8 GEMMs, docs/PERFORMANCE.md)]"
                : "");
    if (n_offered > 1)
        fprintf(f,
                "Serves the stages of the checkpoint's pipeline named by --stages (default all\n"
                "three) as threads of this one process, each a replica of its own to the kiln\n"
                "gateway (replica ids get -<stage> appended), sharing one CUDA context on\n"
                "--gpu; when one halts, all do, and the process exits to be restarted.  A\n"
                "fixed --data-port P is the encode stage's, P + 1 the denoise stage's.\n");
    else
        fprintf(f, "Serves the %s stage of the checkpoint's pipeline to the kiln gateway.\n",
                kiln_stage_name(offered[0]->stage));
    fprintf(f,
            "ENDPOINT is the gateway's bus (e.g. tcp://127.0.0.1:8001); --bus-key is this\n"
            "replica's CURVE secret key and --bus-server-key the gateway's public key (kiln\n"
            "keygen); --bus-allow the replicas' public keys, who may fetch this process's\n"
            "outputs by value from its data socket (--data-port, default any free port, -1:\n"
            "none), which other stages reach at --data-host (default: the address it reaches\n"
            "the gateway from).  --health-port serves\n"
            "GET /healthz (loaded and not hung) and /readyz (registered) for probes.\n"
            "On SIGTERM/SIGINT it leaves gracefully: no new work, the jobs it holds are\n"
            "answered within --drain-s (default 30, 0: stop at once); a second signal\n"
            "stops at once.\n");
}

int64_t kiln_worker_band_pixels(const kiln_worker_opts *o)
{
    return (int64_t)(o->vae_band_above_mp * (double)(1 << 20) + 0.5);
}

static int parse_layers(const char *s, kiln_worker_opts *o)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    o->n_out_layers = 0;
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_out_layers == KILN_MAX_OUT_LAYERS ||
            kiln_parse_int(tok, -1000, 1000, &o->out_layers[o->n_out_layers]))
            return -1;
        o->n_out_layers++;
    }
    return o->n_out_layers ? 0 : -1;
}

static int parse_transport(const char *s, int *out)
{
    kiln_ref_kind k;
    if (!strcmp(s, "auto"))
        *out = -1;
    else if (!kiln_ref_kind_parse(s, &k) && k != KILN_REF_INLINE)
        *out = (int)k;
    else
        return -1;
    return 0;
}

/* A replica id the protocol takes (proto.h): 1..127 characters of
 * [A-Za-z0-9._:@-]. */
static int replica_id_ok(const char *id)
{
    size_t n = strlen(id);
    if (!n || n >= KILN_PROTO_ID_MAX)
        return 0;
    for (const char *p = id; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              strchr("._:@-", *p)))
            return 0;
    return 1;
}

/* --stages: a comma list of the offered stages, each once. */
static int parse_stages(const char *list, const kiln_stage_ops *const *offered, int n_offered,
                        unsigned *stages)
{
    char buf[64];
    if (snprintf(buf, sizeof buf, "%s", list) >= (int)sizeof buf)
        return -1;
    *stages = 0;
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        kiln_stage st;
        int known = 0;
        if (kiln_stage_parse(tok, &st) || (*stages & STAGE_BIT(st)))
            return -1;
        for (int i = 0; i < n_offered; i++)
            known |= offered[i]->stage == st;
        if (!known)
            return -1;
        *stages |= STAGE_BIT(st);
    }
    return *stages ? 0 : -1;
}

/* An option only some stages have, given on the command line: refused
 * after parsing unless the process runs one of them (--stages may come
 * later). */
typedef struct stage_option {
    const char *name;
    unsigned stages;
} stage_option;

static int parse_args(int argc, char **argv, const char *binary, const kiln_stage_ops *const *offered,
                      int n_offered, kiln_worker_opts *o, unsigned *stages)
{
    enum { O_LAYERS = 256, O_WINDOW, O_TRANSPORT, O_PROMPT_CACHE, O_REPLICA_ID, O_BUS_KEY,
           O_BUS_SERVER_KEY, O_BUS_ALLOW, O_DATA_PORT, O_DATA_HOST, O_HEALTH_PORT, O_BAND_ABOVE,
           O_BAND_ROWS, O_DRAIN, O_PRECISION, O_STAGES, O_IMAGE_THREADS };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},      {"bus", required_argument, 0, 'b'},
        {"device", required_argument, 0, 'd'},     {"gpu", required_argument, 0, 'g'},
        {"max-batch", required_argument, 0, 'B'},  {"batch-window-ms", required_argument, 0, O_WINDOW},
        {"text-encoder-out-layers", required_argument, 0, O_LAYERS},
        {"tensor-transport", required_argument, 0, O_TRANSPORT},
        {"prompt-cache-mb", required_argument, 0, O_PROMPT_CACHE},
        {"replica-id", required_argument, 0, O_REPLICA_ID},
        {"bus-key", required_argument, 0, O_BUS_KEY},
        {"bus-server-key", required_argument, 0, O_BUS_SERVER_KEY},
        {"bus-allow", required_argument, 0, O_BUS_ALLOW},
        {"data-port", required_argument, 0, O_DATA_PORT},
        {"data-host", required_argument, 0, O_DATA_HOST},
        {"health-port", required_argument, 0, O_HEALTH_PORT},
        {"vae-band-above", required_argument, 0, O_BAND_ABOVE},
        {"vae-band-rows", required_argument, 0, O_BAND_ROWS},
        {"drain-s", required_argument, 0, O_DRAIN},
        {"precision", required_argument, 0, O_PRECISION},
        {"stages", required_argument, 0, O_STAGES},
        {"image-threads", required_argument, 0, O_IMAGE_THREADS},
        {"help", no_argument, 0, 'h'},             {0, 0, 0, 0},
    };
    const unsigned enc = STAGE_BIT(KILN_STAGE_ENCODE), vae = enc | STAGE_BIT(KILN_STAGE_DECODE);
    /* No batch window by default: an idle stage starts a job at once (a
     * 5 ms window cost every request 15 ms across the three stages), and
     * under load jobs queue while a batch runs, so batches form anyway. */
    *o = (kiln_worker_opts){.device = "cpu", .max_batch = 4, .batch_window_ms = 0,
                            .n_out_layers = 0, /* the checkpoint's */
                            .tensor_transport = -1, .drain_s = 30,
                            .prompt_cache_mb = KILN_PROMPT_CACHE_DEFAULT_MIB,
                            .vae_band_above_mp = 1.0,
                            .vae_band_rows = KILN_VAE_BAND_ROWS_DEFAULT};
    *stages = 0;
    for (int i = 0; i < n_offered; i++)
        *stages |= STAGE_BIT(offered[i]->stage);
    stage_option given[3]; /* the sets of stages below: encode; encode and decode; denoise */
    int n_given = 0, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int bad = 0;
        unsigned only = 0; /* the stages that have this option; 0: all */
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'b': o->bus = optarg; break;
        case 'd': o->device = optarg; break;
        case 'g': bad = kiln_parse_int(optarg, 0, 64, &o->gpu); break;
        case 'B': bad = kiln_parse_int(optarg, 1, KILN_PROTO_MAX_ROWS, &o->max_batch); break;
        case O_WINDOW: bad = kiln_parse_int(optarg, 0, 1000, &o->batch_window_ms); break;
        case O_LAYERS: only = enc, bad = parse_layers(optarg, o); break;
        case O_TRANSPORT: bad = parse_transport(optarg, &o->tensor_transport); break;
        case O_PROMPT_CACHE:
            only = enc, bad = kiln_parse_int(optarg, 0, 1 << 20, &o->prompt_cache_mb);
            break;
        case O_BAND_ABOVE:
            only = vae, bad = kiln_parse_double(optarg, 0, 1 << 20, &o->vae_band_above_mp);
            break;
        case O_BAND_ROWS:
            only = vae, bad = kiln_parse_int(optarg, 1, KILN_VAE_BAND_ROWS_MAX, &o->vae_band_rows);
            break;
        case O_REPLICA_ID: o->replica_id = optarg, bad = !replica_id_ok(optarg); break;
        case O_BUS_KEY: o->bus_key = optarg; break;
        case O_BUS_SERVER_KEY: o->bus_server_key = optarg; break;
        case O_BUS_ALLOW: o->bus_allow = optarg; break;
        case O_DATA_PORT: bad = kiln_parse_int(optarg, -1, 65535, &o->data_port); break;
        case O_HEALTH_PORT: bad = kiln_parse_int(optarg, 1, 65535, &o->health_port); break;
        case O_DRAIN: bad = kiln_parse_int(optarg, 0, 3600, &o->drain_s); break;
        case O_PRECISION:
            only = STAGE_BIT(KILN_STAGE_DENOISE), bad = kiln_precision_parse(optarg, &o->precision);
            break;
        case O_STAGES:
            bad = n_offered < 2 || parse_stages(optarg, offered, n_offered, stages);
            break;
        case O_IMAGE_THREADS:
            only = STAGE_BIT(KILN_STAGE_DECODE);
            bad = kiln_parse_int(optarg, 1, KILN_POOL_MAX_THREADS, &o->image_threads);
            break;
        case O_DATA_HOST:
            o->data_host = optarg;
            bad = !kiln_domain_id_valid(optarg, KILN_PROTO_ENDPOINT_MAX - 24);
            break;
        case 'h': usage(stdout, binary, offered, n_offered); exit(0);
        default: bad = 1;
        }
        if (bad) {
            if (c != '?')
                fprintf(stderr, "%s: invalid value '%s' for %s\n", binary, optarg ? optarg : "",
                        kiln_arg_option(argv, optind, optarg));
            usage(stderr, binary, offered, n_offered);
            return 2;
        }
        int known = 0; /* one option per set of stages is enough to judge it */
        for (int i = 0; i < n_given; i++)
            known |= given[i].stages == only;
        if (only && !known)
            given[n_given++] = (stage_option){kiln_arg_option(argv, optind, optarg), only};
    }
    char msg[160] = "";
    for (int i = 0; i < n_given && !msg[0]; i++)
        if (!(given[i].stages & *stages))
            snprintf(msg, sizeof msg, "%s is not an option of the stage%s it runs", given[i].name,
                     (*stages & (*stages - 1)) ? "s" : "");
    int producers = !!(*stages & enc) + !!(*stages & STAGE_BIT(KILN_STAGE_DENOISE));
    size_t suffix = 0; /* the longest -<stage> a group's replica ids get */
    for (int st = 0; st < KILN_STAGE_COUNT && (*stages & (*stages - 1)); st++)
        if ((*stages & STAGE_BIT(st)) && strlen(kiln_stage_name((kiln_stage)st)) + 1 > suffix)
            suffix = strlen(kiln_stage_name((kiln_stage)st)) + 1;
    const char *why = NULL;
    if (msg[0])
        why = msg;
    else if (optind < argc)
        why = "unexpected argument";
    else if (!o->model || !o->bus)
        why = "--model and --bus are required";
    else if (!o->bus_key != !o->bus_server_key)
        why = "--bus-key and --bus-server-key go together (this replica's secret key and the "
              "gateway's public key)";
    else if (o->bus_allow && !o->bus_key)
        why = "--bus-allow needs --bus-key (it says who may fetch by value on a CURVE bus)";
    else if (o->replica_id && strlen(o->replica_id) + suffix >= KILN_PROTO_ID_MAX)
        why = "--replica-id: too long for the -<stage> each of its stages appends (the ids "
              "are 127 characters at most)";
    else if (o->data_port == 65535 && producers > 1)
        why = "--data-port: the encode stage binds P and the denoise stage P + 1, so P must be "
              "below 65535";
    if (why) {
        fprintf(stderr, "%s: %s\n", binary, why);
        usage(stderr, binary, offered, n_offered);
        return 2;
    }
    return 0;
}

/* Copies s keeping [A-Za-z0-9.-] (the replica id alphabet minus ':' and
 * '@', which stay free as separators) and at most cap - 1 bytes. */
static void sanitize(char *dst, size_t cap, const char *s)
{
    size_t n = 0;
    for (; *s && n + 1 < cap; s++) {
        char ch = *s;
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                 ch == '.' || ch == '-' || ch == '_';
        dst[n++] = ok ? ch : '_';
    }
    dst[n] = '\0';
    if (!n)
        snprintf(dst, cap, "unknown");
}

static void on_signal(int sig)
{
    (void)sig;
    /* Only this handler writes it (the first signal leaves gracefully,
     * the next stops at once: worker.c). */
    kiln_worker_signalled = kiln_worker_signalled + 1;
}

/* On a CUDA backend: a cuda_ipc transport to open such inputs, and to
 * place device outputs in when chosen (worker.h, tensor_transport). */
static kiln_status setup_cuda_ipc(kiln_worker *w, kiln_err *err)
{
    int want = w->opts.tensor_transport;
    if (strcmp(w->be->name, "cuda")) {
        if (want == KILN_REF_CUDA_IPC)
            return kiln_err_set(err, KILN_ERR_INVALID, "--tensor-transport cuda_ipc needs "
                                "--device cuda");
        return KILN_OK;
    }
    w->cuda = kiln_transport_cuda_ipc_create(w->replica, w->epoch, kiln_stage_name(w->ops->stage),
                                             w->opts.gpu, 0, 0, err);
    if (!w->cuda)
        return err->code;
    w->cuda_out = want == KILN_REF_CUDA_IPC || (want < 0 && kiln_transport_cuda_ipc_all_reachable());
    KILN_LOG_INFO("%s: device outputs as %s references", w->ops->binary,
                  w->cuda_out ? "cuda_ipc" : "shm");
    return KILN_OK;
}

/* This incarnation's epoch: random, so that no other process (another
 * PID namespace, a restart under the same replica id) ever draws the
 * same one. */
static kiln_status draw_epoch(kiln_worker *w, kiln_err *err)
{
    do {
        if (getrandom(&w->epoch, sizeof w->epoch, 0) != (ssize_t)sizeof w->epoch)
            return kiln_err_set(err, KILN_ERR_IO, "getrandom: %s", strerror(errno));
    } while (!w->epoch);
    return KILN_OK;
}

/* The bus keys, read before the model so that a bad key fails at once. */
static kiln_status load_bus_keys(kiln_worker *w, kiln_err *err)
{
    const kiln_worker_opts *o = &w->opts;
    if (!o->bus_key) {
        if (!kiln_bus_endpoint_local(o->bus))
            KILN_LOG_WARN("%s: connecting to the bus %s without keys: a gateway that requires "
                          "them refuses this replica (--bus-key, --bus-server-key)",
                          w->ops->binary, o->bus);
        return KILN_OK;
    }
    if (kiln_bus_keys_load_secret(&w->bus_keys, o->bus_key, err) ||
        kiln_bus_keys_load_server(&w->bus_keys, o->bus_server_key, err) ||
        (o->bus_allow && kiln_bus_keys_load_allow(&w->bus_keys, o->bus_allow, err)))
        return err->code;
    KILN_LOG_INFO("%s: bus secured with CURVE, public key %s", w->ops->binary,
                  w->bus_keys.public_key);
    return KILN_OK;
}

/* A producer stage places every output in /dev/shm; the 64 MiB a
 * container gets by default fits no more than one slab, and a full
 * /dev/shm would fail every request later (posix_fallocate's ENOSPC), so
 * too small a one is refused now, with what to do about it. */
#define SHM_MIN_BYTES (256ull << 20)

static kiln_status check_shm(kiln_worker *w, kiln_err *err)
{
    if (w->ops->stage == KILN_STAGE_DECODE)
        return KILN_OK; /* its image files go inline when /dev/shm has no room */
    uint64_t avail, total;
    if (kiln_domain_fs_space("/dev/shm", &avail, &total, err))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "%s: there is no usable /dev/shm; a stage "
                            "hands its outputs on through it (mount a tmpfs there)", err->msg);
    if (avail < SHM_MIN_BYTES)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "/dev/shm has %llu MiB free of %llu MiB; this stage needs at least %llu "
                            "MiB there to hand its outputs on (containers get 64 MiB by default: "
                            "docker/podman --shm-size=2g, compose shm_size, or a Kubernetes "
                            "emptyDir with medium: Memory mounted at /dev/shm)",
                            (unsigned long long)(avail >> 20), (unsigned long long)(total >> 20),
                            SHM_MIN_BYTES >> 20);
    return KILN_OK;
}

/* The address this host reaches the gateway from, which is where the
 * gateway's other clients reach it too (the pod IP in Kubernetes, the
 * container's on a compose network): the local end of a UDP "connection"
 * to the bus's host, which sends nothing.  0, or -1 when the bus is not
 * tcp:// or its host does not resolve. */
static int address_towards_bus(const char *bus, char *out, size_t cap)
{
    char host[256];
    if (strncmp(bus, "tcp://", 6) || snprintf(host, sizeof host, "%s", bus + 6) >= (int)sizeof host)
        return -1;
    char *colon = strrchr(host, ':');
    if (!colon)
        return -1;
    *colon = '\0';
    const char *port = colon + 1, *name = host;
    if (host[0] == '[' && colon[-1] == ']') /* [v6] */
        colon[-1] = '\0', name = host + 1;
    struct addrinfo hints = {.ai_socktype = SOCK_DGRAM}, *ai = NULL;
    if (getaddrinfo(name, port, &hints, &ai) || !ai)
        return -1;
    int rc = -1, fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_storage local;
    socklen_t len = sizeof local;
    if (fd >= 0 && !connect(fd, ai->ai_addr, ai->ai_addrlen) &&
        !getsockname(fd, (struct sockaddr *)&local, &len)) {
        char ip[INET6_ADDRSTRLEN];
        const void *a = local.ss_family == AF_INET6
                            ? (const void *)&((struct sockaddr_in6 *)&local)->sin6_addr
                            : (const void *)&((struct sockaddr_in *)&local)->sin_addr;
        if (inet_ntop(local.ss_family, a, ip, sizeof ip))
            rc = snprintf(out, cap, local.ss_family == AF_INET6 ? "[%s]" : "%s", ip) < (int)cap
                     ? 0
                     : -1;
    }
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    return rc;
}

/* Where this replica's references open (common/domain.h); its GPUs once
 * the backend runs.  The host its data socket is announced at:
 * --data-host, else the address it reaches the gateway from, else its
 * host name. */
static kiln_status probe_domain(kiln_worker *w, kiln_err *err)
{
    if (kiln_domain_probe(&w->domain, err))
        return err->code;
    char host[KILN_PROTO_ENDPOINT_MAX - 24] = "";
    if (w->opts.data_host) {
        snprintf(w->data_host, sizeof w->data_host, "%s", w->opts.data_host);
    } else if (address_towards_bus(w->opts.bus, w->data_host, sizeof w->data_host)) {
        int named = !gethostname(host, sizeof host - 1) && kiln_domain_id_valid(host, (int)sizeof host);
        snprintf(w->data_host, sizeof w->data_host, "%s", named ? host : "localhost");
    }
    return KILN_OK;
}

/* --replica-id as given for a process of one stage, with -<stage>
 * appended for one of several (they are separate replicas; parse_args
 * made sure it fits). */
static void name_replica(kiln_worker *w)
{
    if (w->group->n < 2)
        snprintf(w->replica, sizeof w->replica, "%s", w->opts.replica_id);
    else
        snprintf(w->replica, sizeof w->replica, "%s-%s", w->opts.replica_id,
                 kiln_stage_name(w->ops->stage));
}

kiln_status worker_load(kiln_worker *w, kiln_err *err)
{
    if (draw_epoch(w, err) || load_bus_keys(w, err) || probe_domain(w, err) || check_shm(w, err))
        return err->code;
    char host[64] = "";
    if (gethostname(host, sizeof host - 1))
        snprintf(host, sizeof host, "unknown");
    sanitize(w->host, 48, host);
    /* The epoch's digits make the id unique per process where the rest is
     * not: containers of one pod (one hostname) are each PID 1. */
    if (w->opts.replica_id)
        name_replica(w);
    else
        snprintf(w->replica, sizeof w->replica, "%s-%.48s-%ld-%08llx",
                 kiln_stage_name(w->ops->stage), w->host, (long)getpid(),
                 (unsigned long long)(w->epoch >> 32));
    kiln_proto_model_id(w->opts.model, w->model, KILN_PROTO_MODEL_ID_MAX);

    int stale = kiln_transport_shm_clean_stale(err);
    if (stale < 0)
        KILN_LOG_WARN("%s: %s", w->ops->binary, err->msg);
    /* A decoder's pool holds only the image files the gateway takes by
     * reference, a few MiB each and freed as soon as it has read them:
     * smaller slabs than the tensors' 64 MiB keep its /dev/shm small. */
    size_t slab = w->ops->stage == KILN_STAGE_DECODE ? (size_t)16 << 20 : 0;
    w->shm = kiln_transport_shm_create(w->replica, w->epoch, kiln_stage_name(w->ops->stage), slab,
                                       0, err);
    w->inl = w->shm ? kiln_transport_inline_create(err) : NULL;
    if (!w->inl)
        return err->code;
    w->ck = kiln_checkpoint_open(w->opts.model, err);
    if (!w->ck)
        return err->code;
    w->traits = kiln_model_traits_of(w->ck);
    w->be = kiln_backend_create(w->opts.device, w->opts.gpu, err);
    if (!w->be)
        return err->code;
    if (setup_cuda_ipc(w, err))
        return err->code;
    if (w->cuda && kiln_domain_add_gpus(&w->domain, w->opts.gpu, err))
        return err->code;
    double t0 = kiln_now_ms();
    w->state = w->ops->load(w->be, w->ck, &w->opts, err);
    if (!w->state)
        return err->code;
    worker_sample_memory(w);
    KILN_LOG_INFO("%s: %s loaded on %s in %.0f ms", w->ops->binary, w->model, w->be->name,
                  kiln_now_ms() - t0);
    /* Room for a batch running and the next one gathering. */
    w->capacity = 2 * w->opts.max_batch;
    if (worker_data_start(w, err))
        return err->code;
    atomic_store(&w->loaded, 1);
    KILN_LOG_INFO("%s: transport domain: host %s, /dev/shm %s, ipc ns %llu, pid ns %llu, %d GPU(s)",
                  w->ops->binary, w->domain.host, w->domain.shm[0] ? w->domain.shm : "none",
                  (unsigned long long)w->domain.ipc_ns, (unsigned long long)w->domain.pid_ns,
                  w->domain.n_gpus);
    return KILN_OK;
}

void worker_teardown(kiln_worker *w)
{
    worker_shutdown(w);
    worker_data_stop(w);
    kiln_bus_close(w->bus);
    if (w->state)
        w->ops->unload(w->state);
    kiln_transport_destroy(w->cuda);
    kiln_backend_destroy(w->be);
    kiln_checkpoint_close(w->ck);
    kiln_transport_destroy(w->inl);
    kiln_transport_destroy(w->shm);
    kiln_bus_keys_free(&w->bus_keys);
    for (int i = 0; i < w->n_frames; i++)
        kiln_buf_free(&w->frames[i]);
    free(w->frames);
    free(w->held);
    if (w->efd > 0)
        close(w->efd);
}

int kiln_worker_main(int argc, char **argv, const char *binary, const kiln_stage_ops *const *ops,
                     int n_ops)
{
    kiln_worker_opts opts;
    unsigned stages;
    int rc = parse_args(argc, argv, binary, ops, n_ops, &opts, &stages);
    if (rc)
        return rc;
    worker_group g = {.binary = binary, .health_port = opts.health_port, .health_fd = -1};
    kiln_worker workers[WORKER_GROUP_MAX];
    kiln_err err = {0};
    for (int i = 0; i < n_ops && i < WORKER_GROUP_MAX; i++) {
        if (!(stages & STAGE_BIT(ops[i]->stage)))
            continue;
        kiln_worker *w = &workers[g.n];
        *w = (kiln_worker){.ops = ops[i], .group = &g, .opts = opts, .efd = -1};
        /* Each producer binds its own data socket: a fixed port P is the
         * encode stage's, P + 1 the denoise stage's beside it. */
        if (ops[i]->stage == KILN_STAGE_DENOISE && opts.data_port > 0 &&
            (stages & STAGE_BIT(KILN_STAGE_ENCODE)))
            w->opts.data_port++;
        g.w[g.n++] = w;
        if (worker_init(w, &err)) {
            fprintf(stderr, "%s: %s\n", binary, err.msg);
            return 1;
        }
        if (worker_fault_setup(w))
            return 2;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGINT, &sa, NULL) || sigaction(SIGTERM, &sa, NULL)) {
        fprintf(stderr, "%s: cannot install signal handlers: %s\n", binary, strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    return worker_group_run(&g);
}

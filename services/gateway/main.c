/* kiln-gateway: the HTTP front of the kiln service (see gateway.h). */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kiln-gateway --model DIR [--port P] [--host ADDR] [--bus ENDPOINT]\n"
            "  [--bus-key FILE --bus-allow FILE | --bus-insecure] [--api-key-file FILE]\n"
            "  [--admin-port P] [--admin-host ADDR]\n"
            "  [--min-size PX] [--max-size PX] [--max-body-mb N] [--max-header-kb N]\n"
            "  [--max-connections N] [--queue-max N] [--request-timeout-s S]\n"
            "  [--header-timeout-ms MS] [--read-timeout-ms MS] [--idle-timeout-ms MS]\n"
            "  [--write-timeout-ms MS] [--heartbeat-timeout-ms MS] [--progress-timeout-s S]\n"
            "  [--drain-s S] [--max-client-connections N] [--body-budget-mb N]\n"
            "  [--client-body-budget-mb N] [--body-wait-ms MS] [--max-cost MTOK]\n"
            "  [--client-queue-share F] [--cancel-timeout-s S] [--ignore-unknown-fields]\n"
            "  [--served-model-name NAME] [--max-ref-mp N]\n"
            "  [--trace-file FILE]\n"
            "Defaults: --host 0.0.0.0 --port 8000 --bus tcp://127.0.0.1:<port+1>\n"
            "--bus-key: the gateway's CURVE secret key; --bus-allow: the replicas' public\n"
            "keys (kiln keygen); a bus other hosts can reach needs them or --bus-insecure.\n"
            "--api-key-file: Bearer keys the HTTP API requires (one per line).\n"
            "--admin-port: /healthz, /readyz, /metrics there (open) instead of on --port.\n"
            "--min-size 256 --max-size 2048 --max-body-mb 64 --max-header-kb 16\n"
            "--max-connections 1024 --queue-max 128 --request-timeout-s 300\n"
            "--header-timeout-ms 10000 --read-timeout-ms 60000 --idle-timeout-ms 60000\n"
            "--write-timeout-ms 60000 --heartbeat-timeout-ms 2000 --progress-timeout-s 60\n"
            "--drain-s 30 --max-client-connections 64 (0: no limit) --body-budget-mb 1024\n"
            "--client-body-budget-mb 256 --body-wait-ms 5000 --max-cost 40 (0: no ceiling)\n"
            "--client-queue-share 0.25 (0: no per-client share)\n"
            "--cancel-timeout-s 30 (0: never) --max-ref-mp 128 (an edit's references in all,\n"
            "in megapixels of 2^20; 0: no limit)\n"
            "--ignore-unknown-fields: skip request fields kiln does not know instead of\n"
            "answering 400 unknown_parameter (for clients written for other servers).\n"
            "--served-model-name: the model id clients see (default: the folder's name, or\n"
            "ORG/NAME for a Hugging Face cache folder models--ORG--NAME/snapshots/<commit>).\n"
            "--trace-file: append each request's stage trace (GET /v1/traces/<id>) as one\n"
            "line of Chrome trace-event JSON.\n");
}

static int num(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    enum { O_MIN = 256, O_MAX, O_BODY, O_HEADER, O_CONNS, O_QUEUE, O_REQ_TIMEOUT, O_HDR_TIMEOUT,
           O_READ_TIMEOUT, O_IDLE_TIMEOUT, O_WRITE_TIMEOUT, O_HB, O_PROGRESS, O_DRAIN,
           O_CLIENT_CONNS, O_BODY_BUDGET, O_CLIENT_BODY_BUDGET, O_BODY_WAIT, O_MAX_COST,
           O_CLIENT_SHARE, O_CANCEL_TIMEOUT, O_BUS_KEY, O_BUS_ALLOW, O_BUS_INSECURE, O_API_KEY,
           O_ADMIN_PORT, O_ADMIN_HOST, O_IGNORE_UNKNOWN, O_SERVED_NAME, O_MAX_REF_MP,
           O_TRACE_FILE };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"port", required_argument, 0, 'p'},
        {"host", required_argument, 0, 'H'},
        {"bus", required_argument, 0, 'b'},
        {"min-size", required_argument, 0, O_MIN},
        {"max-size", required_argument, 0, O_MAX},
        {"max-body-mb", required_argument, 0, O_BODY},
        {"max-header-kb", required_argument, 0, O_HEADER},
        {"max-connections", required_argument, 0, O_CONNS},
        {"queue-max", required_argument, 0, O_QUEUE},
        {"request-timeout-s", required_argument, 0, O_REQ_TIMEOUT},
        {"header-timeout-ms", required_argument, 0, O_HDR_TIMEOUT},
        {"read-timeout-ms", required_argument, 0, O_READ_TIMEOUT},
        {"idle-timeout-ms", required_argument, 0, O_IDLE_TIMEOUT},
        {"write-timeout-ms", required_argument, 0, O_WRITE_TIMEOUT},
        {"heartbeat-timeout-ms", required_argument, 0, O_HB},
        {"progress-timeout-s", required_argument, 0, O_PROGRESS},
        {"drain-s", required_argument, 0, O_DRAIN},
        {"max-client-connections", required_argument, 0, O_CLIENT_CONNS},
        {"body-budget-mb", required_argument, 0, O_BODY_BUDGET},
        {"client-body-budget-mb", required_argument, 0, O_CLIENT_BODY_BUDGET},
        {"body-wait-ms", required_argument, 0, O_BODY_WAIT},
        {"max-cost", required_argument, 0, O_MAX_COST},
        {"max-ref-mp", required_argument, 0, O_MAX_REF_MP},
        {"client-queue-share", required_argument, 0, O_CLIENT_SHARE},
        {"cancel-timeout-s", required_argument, 0, O_CANCEL_TIMEOUT},
        {"bus-key", required_argument, 0, O_BUS_KEY},
        {"bus-allow", required_argument, 0, O_BUS_ALLOW},
        {"bus-insecure", no_argument, 0, O_BUS_INSECURE},
        {"api-key-file", required_argument, 0, O_API_KEY},
        {"admin-port", required_argument, 0, O_ADMIN_PORT},
        {"admin-host", required_argument, 0, O_ADMIN_HOST},
        {"ignore-unknown-fields", no_argument, 0, O_IGNORE_UNKNOWN},
        {"served-model-name", required_argument, 0, O_SERVED_NAME},
        {"trace-file", required_argument, 0, O_TRACE_FILE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    kiln_gw_options o = KILN_GW_DEFAULTS;
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        double v = 0;
        int bad = 0;
        switch (c) {
        case 'm': o.model_dir = optarg; break;
        case 'H': o.host = optarg; break;
        case 'b': o.bus = optarg; break;
        case 'p': bad = num(optarg, 0, 65534, &v), o.port = (int)v; break;
        case O_MIN: bad = num(optarg, 16, 1 << 16, &v), o.min_size = (int)v; break;
        case O_MAX: bad = num(optarg, 16, 1 << 16, &v), o.max_size = (int)v; break;
        case O_BODY: bad = num(optarg, 1, 4096, &v), o.max_body_bytes = (size_t)(v * (1 << 20)); break;
        case O_HEADER: bad = num(optarg, 1, 1024, &v), o.max_header_bytes = (size_t)(v * 1024); break;
        case O_CONNS: bad = num(optarg, 1, 1e6, &v), o.max_connections = (int)v; break;
        case O_QUEUE: bad = num(optarg, 1, 1e6, &v), o.queue_max = (int)v; break;
        case O_REQ_TIMEOUT: bad = num(optarg, 0.001, 1e6, &v), o.request_timeout_s = v; break;
        case O_HDR_TIMEOUT: bad = num(optarg, 1, 1e9, &v), o.header_timeout_ms = (int)v; break;
        case O_READ_TIMEOUT: bad = num(optarg, 1, 1e9, &v), o.read_timeout_ms = (int)v; break;
        case O_IDLE_TIMEOUT: bad = num(optarg, 1, 1e9, &v), o.idle_timeout_ms = (int)v; break;
        case O_WRITE_TIMEOUT: bad = num(optarg, 1, 1e9, &v), o.write_timeout_ms = (int)v; break;
        case O_HB: bad = num(optarg, 1, 1e9, &v), o.heartbeat_timeout_ms = v; break;
        case O_PROGRESS: bad = num(optarg, 1, 1e6, &v), o.progress_timeout_s = v; break;
        case O_DRAIN: bad = num(optarg, 0, 1e6, &v), o.drain_s = v; break;
        case O_CLIENT_CONNS: bad = num(optarg, 0, 1e6, &v), o.max_client_connections = (int)v; break;
        case O_BODY_BUDGET:
            bad = num(optarg, 1, 1 << 20, &v), o.body_budget_bytes = (size_t)(v * (1 << 20));
            break;
        case O_CLIENT_BODY_BUDGET:
            bad = num(optarg, 1, 1 << 20, &v), o.client_body_budget_bytes = (size_t)(v * (1 << 20));
            break;
        case O_BODY_WAIT: bad = num(optarg, 1, 1e9, &v), o.body_wait_ms = (int)v; break;
        case O_MAX_COST: bad = num(optarg, 0, 1e12, &v), o.max_cost = v; break;
        case O_MAX_REF_MP:
            bad = num(optarg, 0, 1 << 20, &v), o.max_ref_pixels = (int64_t)(v * (1 << 20));
            break;
        case O_CLIENT_SHARE: bad = num(optarg, 0, 1, &v), o.client_queue_share = v; break;
        case O_CANCEL_TIMEOUT: bad = num(optarg, 0, 1e6, &v), o.cancel_timeout_s = v; break;
        case O_BUS_KEY: o.bus_key = optarg; break;
        case O_BUS_ALLOW: o.bus_allow = optarg; break;
        case O_BUS_INSECURE: o.bus_insecure = 1; break;
        case O_API_KEY: o.api_key_file = optarg; break;
        case O_ADMIN_PORT: bad = num(optarg, 0, 65535, &v), o.admin_port = (int)v; break;
        case O_ADMIN_HOST: o.admin_host = optarg; break;
        case O_IGNORE_UNKNOWN: o.ignore_unknown_fields = 1; break;
        case O_SERVED_NAME: o.served_model_name = optarg; break;
        case O_TRACE_FILE: o.trace_file = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (bad) {
            fprintf(stderr, "kiln-gateway: invalid value '%s' for %s\n", optarg, argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc || !o.model_dir) {
        fprintf(stderr, "kiln-gateway: %s\n", optind < argc ? "unexpected argument"
                                                              : "--model is required");
        usage(stderr);
        return 2;
    }
    /* A client that vanishes mid-response must not kill the process. */
    signal(SIGPIPE, SIG_IGN);
    return kiln_gateway_run(&o);
}

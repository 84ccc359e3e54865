/* kiln keygen: a CURVE keypair for the bus (docs/OPERATIONS.md, "Securing
 * the bus"): PREFIX.key (secret, 0600) and PREFIX.pub (public). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "common/bus_keys.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kiln keygen --out PREFIX\n"
            "Writes a ZeroMQ CURVE keypair for the kiln bus: PREFIX.key (the secret key,\n"
            "readable by its owner only) and PREFIX.pub (the public key), and prints the\n"
            "public key.  Existing files are never overwritten.  The gateway takes its own\n"
            ".key (--bus-key) and an allow-list of the replicas' public keys (--bus-allow:\n"
            "the .pub files concatenated); a replica takes its .key (--bus-key) and the\n"
            "gateway's .pub (--bus-server-key).\n");
}

int kiln_cmd_keygen(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"out", required_argument, 0, 'o'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *prefix = NULL;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'o': prefix = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc || !prefix || !*prefix || strlen(prefix) > 4000) {
        fprintf(stderr, "kiln keygen: %s\n", optind < argc ? "unexpected argument"
                                                           : "--out PREFIX is required");
        usage(stderr);
        return 2;
    }
    char sec[4100], pub[4100], key[KILN_BUS_KEY_TEXT];
    snprintf(sec, sizeof sec, "%s.key", prefix);
    snprintf(pub, sizeof pub, "%s.pub", prefix);
    kiln_err err = {0};
    if (kiln_bus_keys_write_pair(sec, pub, key, &err)) {
        fprintf(stderr, "kiln keygen: %s\n", err.msg);
        return 1;
    }
    printf("%s\n", key);
    return 0;
}

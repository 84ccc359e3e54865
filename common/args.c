#include "args.h"

#include <errno.h>
#include <stdlib.h>

int kiln_parse_int(const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

int kiln_parse_double(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return -1;
    *out = v;
    return 0;
}

const char *kiln_arg_option(char **argv, int optind, const char *optarg)
{
    if (optarg && optind >= 2 && argv[optind - 1] == optarg)
        return argv[optind - 2];
    return argv[optind - 1];
}

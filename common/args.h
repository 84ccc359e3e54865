/* Command-line argument parsing shared by the kiln executables.
 *
 *   int steps;
 *   if (kiln_parse_int(optarg, 1, 1000, &steps)) usage_error();
 *
 * Pure functions, thread-safe. */
#ifndef KILN_ARGS_H
#define KILN_ARGS_H

/* Parses a whole decimal integer in [lo, hi] into *out.  Returns 0, or -1
 * (leaving *out untouched) for empty input, trailing characters, overflow or
 * a value out of range. */
int kiln_parse_int(const char *s, long lo, long hi, int *out);
/* The same for a finite decimal number ("1", "0.25", "2e0") in [lo, hi]. */
int kiln_parse_double(const char *s, double lo, double hi, double *out);

/* The option a getopt_long error is about, as the user wrote it: after an
 * option with a value, argv[optind - 1] is the value itself when it came as
 * a separate argument ("--steps abc") and the option when it came attached
 * ("--steps=abc"). */
const char *kiln_arg_option(char **argv, int optind, const char *optarg);

#endif

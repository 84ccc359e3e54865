/* The end of a CUDA test that found no usable device:
 *
 *   kiln_backend *be = kiln_backend_create("cuda", 0, &err);
 *   if (!be) return gpu_test_unavailable("cuda backend", &err);
 *
 * 77 (meson's SKIP) when there is no usable GPU, unless KILN_REQUIRE_GPU=1
 * (tools/gpu/check.sh) says one must be there; 1 for any other failure.
 * Prints `what: message` to stderr. */
#ifndef KILN_TESTS_CUDA_GPU_SKIP_H
#define KILN_TESTS_CUDA_GPU_SKIP_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

static inline int gpu_test_unavailable(const char *what, const kiln_err *err)
{
    const char *req = getenv("KILN_REQUIRE_GPU");
    int must = req && !strcmp(req, "1");
    fprintf(stderr, "%s: %s%s\n", what, err->msg, must ? "" : " (skipping)");
    return !must && (err->code == KILN_ERR_UNAVAILABLE || err->code == KILN_ERR_UNSUPPORTED) ? 77
                                                                                            : 1;
}

#endif

/* Constructors of the backend implementations, for kernels/backend.c only. */
#ifndef KILN_BACKEND_IMPL_H
#define KILN_BACKEND_IMPL_H

#include "backend.h"

/* The plain fp32 CPU reference (kernels/cpu/). */
kiln_backend *kiln_cpu_backend_create(kiln_err *err);

#ifdef KILN_HAVE_CUDA
/* bf16 storage, fp32 accumulation (kernels/cuda/). */
kiln_backend *kiln_cuda_backend_create(int device, kiln_err *err);
#endif

#endif

/* Following "symlink stubs": copies of a checkpoint made without symlink
 * support (git with core.symlinks=false, some archive tools) store a
 * symbolic link as a small text file holding the relative target path.  The
 * oracle checkpoints share their tokenizer files and klein-base-tiny shares
 * klein-tiny's weights this way.
 *
 *   char real[PATH_MAX];
 *   if (kiln_linkstub_resolve("ckpt/tokenizer/vocab.json", real, sizeof real)) ...error...
 *   FILE *f = fopen(real, "rb");
 *
 * A file counts as a stub only when it is under 1 KiB, holds one line of
 * printable characters forming a relative path, and that path (taken from
 * the stub's folder) names an existing file; anything else, including every
 * real JSON or safetensors file, resolves to itself.  Real symbolic links
 * need nothing from here (the kernel follows them).  Thread-safe.
 */
#ifndef KILN_LINKSTUB_H
#define KILN_LINKSTUB_H

#include <stddef.h>

/* Writes the path to open into out (following up to 8 stubs in a chain).
 * Returns 0, or -1 when out is too small. */
int kiln_linkstub_resolve(const char *path, char *out, size_t len);

#endif

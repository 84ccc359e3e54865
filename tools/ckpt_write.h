/* Writing a component's random weights for the checkpoint maker.
 *
 *   kiln_ckpt_write_weights("out/transformer", "diffusion_pytorch_model", &list, seed,
 *                           KILN_CKPT_SHARD_BYTES, &err);
 *
 * Values come from a counter-free generator seeded by (seed, tensor name),
 * so a tensor's contents do not depend on which other tensors exist or on
 * the sharding, and the same seed always gives the same files.  Each tensor
 * is generated in chunks while it is written: memory stays at a few MiB
 * whatever the model size.  Not thread-safe with itself on one folder.
 */
#ifndef KILN_TOOLS_CKPT_WRITE_H
#define KILN_TOOLS_CKPT_WRITE_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "ckpt_arch.h"
#include "common/error.h"

/* Components above this size are split into shards of at most this size
 * (the Hugging Face writers' default of 5 GB). */
#define KILN_CKPT_SHARD_BYTES 5000000000ull

/* Writes `<stem>.safetensors`, or when the tensors total more than
 * shard_bytes, `<stem>-0000k-of-0000n.safetensors` shards plus
 * `<stem>.safetensors.index.json`.  Returns KILN_OK, _IO or _NOMEM. */
kiln_status kiln_ckpt_write_weights(const char *dir, const char *stem, const kiln_arch_list *l,
                                    uint64_t seed, uint64_t shard_bytes, kiln_err *err);

/* Writes `doc` (indented, with a final newline) to path.  KILN_OK or _IO. */
kiln_status kiln_ckpt_write_json(const char *path, const cJSON *doc, kiln_err *err);

#endif

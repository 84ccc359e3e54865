/* The gateway process's own resources in the Prometheus client libraries'
 * standard names, so that the usual dashboards and alerts work:
 *
 *   kiln_proc_metrics_render(&body, &err);   // appends the families below
 *
 * process_cpu_seconds_total, process_resident_memory_bytes,
 * process_virtual_memory_bytes, process_open_fds, process_max_fds,
 * process_start_time_seconds (unix time), read from /proc/self.  A value
 * that cannot be read is left out (never a made-up 0).  Thread-safe.
 */
#ifndef KILN_GW_PROC_METRICS_H
#define KILN_GW_PROC_METRICS_H

#include "common/buf.h"
#include "common/error.h"

/* Appends the text.  KILN_ERR_NOMEM (out keeps its length). */
kiln_status kiln_proc_metrics_render(kiln_buf *out, kiln_err *err);

#endif

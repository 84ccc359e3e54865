/* The health port of a stage process (--health-port): what a container
 * runtime or Kubernetes probes, since a stage has no HTTP API of its own.
 * It answers for every stage the process runs (worker_group): GET
 * /healthz is 200 once each is loaded while its bus thread keeps running
 * (it heartbeats every 250 ms; 10 s without a turn is a hung process),
 * else 503; GET /readyz is 200 when, besides, each is registered with the
 * gateway, not halted, has room in /dev/shm for its outputs and is not
 * shutting down.  One thread, one connection at a time, answers within a
 * second or drops it. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "worker_impl.h"

#define STUCK_MS 10000.0

static int stage_live(kiln_worker *w)
{
    return atomic_load(&w->loaded) &&
           kiln_now_ms() - (double)atomic_load(&w->bus_tick_ms) < STUCK_MS;
}

/* A halted incarnation (fenced, or its device lost) takes no work and
 * exits to be restarted. */
static int stage_ready(kiln_worker *w)
{
    return stage_live(w) && atomic_load(&w->registered) && !atomic_load(&w->stop) &&
           !atomic_load(&w->leaving) && !worker_halted(w) && !atomic_load(&w->shm_short);
}

static void answer(worker_group *g, int fd)
{
    char req[512];
    size_t n = 0;
    double until = kiln_now_ms() + 1000;
    while (n < sizeof req - 1 && !memchr(req, '\n', n) && kiln_now_ms() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t r = read(fd, req + n, sizeof req - 1 - n);
        if (r <= 0)
            return;
        n += (size_t)r;
    }
    req[n] = '\0';
    int live = 1, ready = 1;
    for (int i = 0; i < g->n; i++) {
        live = live && stage_live(g->w[i]);
        ready = ready && stage_ready(g->w[i]);
    }
    int ok, known = 1;
    if (!strncmp(req, "GET /healthz ", 13) || !strncmp(req, "HEAD /healthz ", 14))
        ok = live;
    else if (!strncmp(req, "GET /readyz ", 12) || !strncmp(req, "HEAD /readyz ", 13))
        ok = ready;
    else
        ok = 0, known = 0;
    char out[256];
    const char *body = !known ? "{\"error\":\"not found\"}\n"
                       : ok   ? "{\"status\":\"ok\"}\n"
                              : live ? "{\"status\":\"not_ready\"}\n" : "{\"status\":\"down\"}\n";
    int len = snprintf(out, sizeof out,
                       "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                       "Connection: close\r\n\r\n%s",
                       !known ? "404 Not Found" : ok ? "200 OK" : "503 Service Unavailable",
                       strlen(body), body);
    if (write(fd, out, (size_t)len) != len)
        KILN_LOG_DEBUG("%s: health probe went away", g->binary);
}

static void *health_main(void *arg)
{
    worker_group *g = arg;
    while (!atomic_load(&g->health_stop)) {
        struct pollfd p = {.fd = g->health_fd, .events = POLLIN};
        if (poll(&p, 1, 200) <= 0)
            continue;
        int fd = accept(g->health_fd, NULL, NULL);
        if (fd < 0)
            continue;
        answer(g, fd);
        close(fd);
    }
    return NULL;
}

/* A listening socket on every address: IPv6 with v4-mapped addresses
 * where the kernel has IPv6, else IPv4 alone (clusters that disable it). */
static int listen_any(int port)
{
    int on = 1, off = 0;
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
                                 .sin6_addr = in6addr_any};
        if (!setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) &&
            !setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) &&
            !bind(fd, (struct sockaddr *)&a, sizeof a) && !listen(fd, 16))
            return fd;
        int e = errno;
        close(fd);
        if (e != EAFNOSUPPORT && e != EADDRNOTAVAIL) {
            errno = e;
            return -1;
        }
    }
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr = {htonl(INADDR_ANY)}};
    if (fd >= 0 && !setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) &&
        !bind(fd, (struct sockaddr *)&a4, sizeof a4) && !listen(fd, 16))
        return fd;
    int e = errno;
    if (fd >= 0)
        close(fd);
    errno = e;
    return -1;
}

kiln_status worker_health_start(worker_group *g, kiln_err *err)
{
    if (g->health_port <= 0)
        return KILN_OK;
    int fd = listen_any(g->health_port);
    if (fd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "--health-port %d: %s", g->health_port,
                            strerror(errno));
    g->health_fd = fd;
    if (pthread_create(&g->health_thread, NULL, health_main, g)) {
        close(fd);
        g->health_fd = -1;
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot start the health thread");
    }
    g->health_started = 1;
    return KILN_OK;
}

void worker_health_stop(worker_group *g)
{
    if (!g->health_started)
        return;
    atomic_store(&g->health_stop, 1);
    pthread_join(g->health_thread, NULL);
    close(g->health_fd);
    g->health_started = 0;
}

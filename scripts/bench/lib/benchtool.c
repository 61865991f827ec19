/* Small load tools for scripts/bench.py (compiled on first use with cc -O2 -pthread).
 *
 *   benchtool echo PORT            epoll TCP echo server on 0.0.0.0:PORT
 *   benchtool echoclose PORT       the same, but it closes each connection after its first
 *                                  echo (the target closes first)
 *   benchtool sink PORT            accepts and never reads (a stalled reader)
 *   benchtool connrate HOST PORT SECONDS THREADS
 *        connect, write 1 byte, read 1 byte, close; prints JSON {count, errors, per_sec}
 *   benchtool connwait HOST PORT SECONDS THREADS
 *        connect, write 1 byte, read 1 byte, wait for the target's close (EOF), close: the
 *        target's FIN has to come back before the next connection (use echoclose)
 *   benchtool rr HOST PORT SECONDS CONNS SIZE
 *        CONNS persistent connections doing request/response of SIZE bytes;
 *        prints JSON {count, errors, p50_us, p99_us, p999_us, max_us}
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

static double now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(fd, (void *)&a, sizeof a) || listen(fd, 4096)) { perror("bind/listen"); exit(1); }
    return fd;
}

static int serve(int port, int echo, int close_after) {
    int lfd = listen_on(port), ep = epoll_create1(0);
    fcntl(lfd, F_SETFL, O_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd}, evs[256];
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    static char buf[65536];
    printf("ready\n"); fflush(stdout);
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == lfd) {
                int c;
                while ((c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    if (!echo) continue;  /* sink: keep it open, never read */
                    int one = 1; setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct epoll_event e = {.events = EPOLLIN, .data.fd = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &e);
                }
                continue;
            }
            ssize_t r = read(fd, buf, sizeof buf);
            if (r <= 0) { if (r == 0 || errno != EAGAIN) close(fd); continue; }
            ssize_t off = 0;
            while (off < r) {  /* echo is small in these benches; spin briefly if full */
                ssize_t w = write(fd, buf + off, r - off);
                if (w < 0) { if (errno == EAGAIN) { usleep(100); continue; } close(fd); break; }
                off += w;
            }
            if (close_after) close(fd);  /* the target closes first */
        }
    }
    return 0;
}

struct job {
    struct sockaddr_in addr; double until; int size;
    long count, errors; double *lat; long nlat, cap;
};

static int connect_to(struct sockaddr_in *a) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (void *)a, sizeof *a)) { close(fd); return -1; }
    return fd;
}

static int readn(int fd, char *b, int n) {
    int got = 0;
    while (got < n) { ssize_t r = read(fd, b + got, n - got); if (r <= 0) return -1; got += r; }
    return 0;
}

static void *connrate_worker(void *p) {
    struct job *j = p; char c = 'x';
    while (now() < j->until) {
        int fd = connect_to(&j->addr);
        if (fd < 0) { j->errors++; usleep(1000); continue; }
        if (write(fd, &c, 1) != 1 || readn(fd, &c, 1)) j->errors++; else j->count++;
        struct linger l = {1, 0};  /* RST on close: no TIME_WAIT pile-up over a long run */
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        close(fd);
    }
    return NULL;
}

static void *connwait_worker(void *p) {
    struct job *j = p; char c = 'x';
    while (now() < j->until) {
        int fd = connect_to(&j->addr);
        if (fd < 0) { j->errors++; usleep(1000); continue; }
        if (write(fd, &c, 1) != 1 || readn(fd, &c, 1) || read(fd, &c, 1) != 0) j->errors++;
        else j->count++;
        close(fd);  /* after the target's FIN: no TIME_WAIT on this side */
    }
    return NULL;
}

static void *rr_worker(void *p) {
    struct job *j = p; char *b = calloc(1, j->size);
    int fd = connect_to(&j->addr);
    if (fd < 0) { j->errors++; return NULL; }
    while (now() < j->until) {
        double t0 = now();
        if (write(fd, b, j->size) != j->size || readn(fd, b, j->size)) { j->errors++; break; }
        if (j->nlat == j->cap) { j->cap = j->cap ? 2 * j->cap : 4096;
                                 j->lat = realloc(j->lat, j->cap * sizeof(double)); }
        j->lat[j->nlat++] = now() - t0; j->count++;
    }
    close(fd); free(b);
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc == 3 && !strcmp(argv[1], "echo")) return serve(atoi(argv[2]), 1, 0);
    if (argc == 3 && !strcmp(argv[1], "echoclose")) return serve(atoi(argv[2]), 1, 1);
    if (argc == 3 && !strcmp(argv[1], "sink")) return serve(atoi(argv[2]), 0, 0);
    int rr = argc == 7 && !strcmp(argv[1], "rr");
    int wait = argc == 6 && !strcmp(argv[1], "connwait");
    if (!rr && !wait && !(argc == 6 && !strcmp(argv[1], "connrate"))) {
        fprintf(stderr, "usage: see the top of benchtool.c\n"); return 2;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
    inet_pton(AF_INET, argv[2], &a.sin_addr);
    double secs = atof(argv[4]); int n = atoi(argv[5]);
    struct job *jobs = calloc(n, sizeof *jobs); pthread_t *th = calloc(n, sizeof *th);
    double t0 = now();
    for (int i = 0; i < n; i++) {
        jobs[i].addr = a; jobs[i].until = t0 + secs; jobs[i].size = rr ? atoi(argv[6]) : 1;
        pthread_create(&th[i], NULL,
                       rr ? rr_worker : wait ? connwait_worker : connrate_worker, &jobs[i]);
    }
    long count = 0, errors = 0, nlat = 0;
    for (int i = 0; i < n; i++) { pthread_join(th[i], NULL); count += jobs[i].count;
                                  errors += jobs[i].errors; nlat += jobs[i].nlat; }
    double el = now() - t0;
    if (!rr) { printf("{\"count\": %ld, \"errors\": %ld, \"per_sec\": %.1f}\n", count, errors,
                      count / el); return 0; }
    double *all = malloc((nlat + 1) * sizeof(double)); long k = 0;
    for (int i = 0; i < n; i++) { memcpy(all + k, jobs[i].lat, jobs[i].nlat * sizeof(double));
                                  k += jobs[i].nlat; }
    qsort(all, nlat, sizeof(double), cmp);
#define PCT(q) (nlat ? all[(long)((nlat - 1) * (q))] * 1e6 : 0)
    printf("{\"count\": %ld, \"errors\": %ld, \"per_sec\": %.1f, \"p50_us\": %.0f, "
           "\"p99_us\": %.0f, \"p999_us\": %.0f, \"max_us\": %.0f}\n", count, errors,
           count / el, PCT(0.5), PCT(0.99), PCT(0.999), PCT(1.0));
    return 0;
}

/* A tunnel endpoint's per-read path in C, for measuring only (scripts.bench.bulk_parity).
 *
 * What does one side of a single stream cost when the per-read work runs with no Python
 * per read? This does the work the splice loop and TLSStream do per read, with the same
 * design, between real sockets, so its CPU per GB is the floor of a compiled per-read path:
 *
 *   sending:   recv(socket, 256 KiB) -> DATA frames of at most 64 KiB (9-byte header, the
 *              payload copied after it: the writer's join) -> SSL_write into a memory BIO
 *              (TLS 1.3 records of 16 KiB) -> BIO_read out of it -> send(tunnel)
 *   receiving: recv(tunnel, 1 MiB) -> BIO_write into a memory BIO -> SSL_read into one
 *              plaintext buffer -> frames parsed in place -> send(socket, payload)
 *
 * Flow control as the tunnel's: 2 MiB per stream and 8 MiB per connection, credit
 * returned in WINDOW frames a quarter window at a time; a side reads its socket only when
 * it has credit and its previous read has left for the tunnel. The frame header is the
 * tunnel protocol's (24-bit length, type, flags, 32-bit stream id, big-endian; DATA with
 * FIN for the half-close); OPEN and ACCEPT carry a prototype payload (the target port),
 * and there is no HELLO: only the per-read path is the tunnel's. One process per side,
 * one thread, poll(2) on non-blocking sockets.
 *
 *   bulk_relay server TUNNEL_PORT CERTDIR LISTEN TARGET [LISTEN TARGET ...]
 *   bulk_relay agent  TUNNEL_PORT CERTDIR
 *
 * The same command line as scripts.bench.splice_bulk's endpoints: the server listens on
 * 127.0.0.1:TUNNEL_PORT for the agent (TLS, CERTDIR/cert.pem and key.pem), prints
 * "listening", then relays each connection to 127.0.0.1:LISTEN as a stream the agent
 * connects to 127.0.0.1:TARGET. BULK_CIPHERSUITES (TLS 1.3 suites, OpenSSL's names) sets
 * the suites both sides offer; the negotiated one is printed on stderr.
 *
 * Built with -shared -fPIC -DBULK_RELAY_LIB it is a library instead (bulk_relay_start,
 * bulk_relay_epoll, bulk_relay_step, at the end of this file): the same relay driven by
 * a trio loop, one wake-up and one call from Python per readiness (`c+trio`).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHUNK (256 * 1024)            /* the splice loop's read */
#define RECEIVE_SIZE (1024 * 1024)    /* the tunnel socket's read */
#define MAX_FRAME (64 * 1024)         /* the peer's max_frame_size */
#define HEADER 9
#define STREAM_WINDOW (2 * 1024 * 1024)
#define CONN_WINDOW (8 * 1024 * 1024)
#define MAX_STREAMS 8
#define MAX_LISTEN 8

enum { OPEN = 1, ACCEPT = 2, DATA = 4, WINDOW = 5 };
enum { FIN = 1 };

static void die(const char *what) {
    fprintf(stderr, "bulk_relay: %s: %s\n", what, errno ? strerror(errno) : "");
    ERR_print_errors_fp(stderr);
    exit(1);
}

/* ------------------------------------------------------------------ buffers */

typedef struct { unsigned char *data; size_t start, end, cap; } buf_t;

static void buf_init(buf_t *b, size_t cap) {
    b->data = malloc(cap);
    if (!b->data) die("malloc");
    b->start = b->end = 0;
    b->cap = cap;
}
static size_t buf_len(const buf_t *b) { return b->end - b->start; }
static void buf_reserve(buf_t *b, size_t more) {
    if (b->start == b->end) b->start = b->end = 0;
    if (b->end + more <= b->cap) return;
    memmove(b->data, b->data + b->start, buf_len(b));
    b->end -= b->start;
    b->start = 0;
    if (b->end + more > b->cap) {
        while (b->end + more > b->cap) b->cap *= 2;
        b->data = realloc(b->data, b->cap);
        if (!b->data) die("realloc");
    }
}
static void buf_append(buf_t *b, const void *p, size_t n) {
    buf_reserve(b, n);
    memcpy(b->data + b->end, p, n);
    b->end += n;
}

/* ------------------------------------------------------------------ state */

typedef struct {
    int used, fd, id, opening;     /* opening: OPEN sent, no ACCEPT yet */
    int local_eof, fin_sent, remote_fin, shut;
    long credit;                   /* what we may still send on this stream */
    long owed;                     /* received and delivered, not yet returned */
    buf_t lout;                    /* payload waiting for the local socket */
} stream_t;

static SSL *ssl;
static BIO *rbio, *wbio;
static int tfd;                    /* the tunnel socket */
static buf_t tout;                 /* TLS records waiting for the tunnel socket */
static unsigned char *rbuf;        /* the tunnel socket's reads */
static unsigned char *pbuf;        /* plaintext: a partial frame, then what SSL_read adds */
static size_t pbuf_len;
static unsigned char *chunk;       /* the local socket's reads */
static unsigned char *fbuf;        /* the frames of one read, joined */
static long conn_credit = CONN_WINDOW, conn_owed;
static stream_t streams[MAX_STREAMS];
static int next_id = 1;
static int lfds[MAX_LISTEN], targets[MAX_LISTEN], nl;  /* the server's listeners */
static struct pollfd fds[MAX_LISTEN + MAX_STREAMS + 1];  /* what the loop waits for */
static stream_t *who[MAX_LISTEN + MAX_STREAMS + 1];
static int nf, first_listener;

static void set_nonblocking(int fd) {
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) die("fcntl");
}
static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static stream_t *find(int id) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i].used && streams[i].id == id) return &streams[i];
    return NULL;
}
static stream_t *slot(void) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i].used) return &streams[i];
    return NULL;
}

static void put_header(unsigned char *h, size_t len, int type, int flags, uint32_t id) {
    uint32_t lt = htonl((uint32_t)(len << 8 | (unsigned)type));
    uint32_t sid = htonl(id);
    memcpy(h, &lt, 4);
    h[4] = (unsigned char)flags;
    memcpy(h + 5, &sid, 4);
}

/* Encrypt `len` bytes into the memory BIO and move the records to `tout`. */
static void tls_send(const unsigned char *p, size_t len) {
    if (len && SSL_write(ssl, p, (int)len) <= 0) die("SSL_write");
    size_t pending = BIO_ctrl_pending(wbio);
    if (!pending) return;
    buf_reserve(&tout, pending);
    int n = BIO_read(wbio, tout.data + tout.end, (int)pending);
    if (n > 0) tout.end += (size_t)n;
}

static void flush_tunnel(void) {
    while (buf_len(&tout)) {
        ssize_t n = send(tfd, tout.data + tout.start, buf_len(&tout), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN) return;
            die("send tunnel");
        }
        tout.start += (size_t)n;
    }
}

static void control(int type, int flags, uint32_t id, const void *payload, size_t len) {
    unsigned char frame[HEADER + 16];
    put_header(frame, len, type, flags, id);
    memcpy(frame + HEADER, payload, len);
    tls_send(frame, HEADER + len);
}

static void window(uint32_t id, long increment) {
    uint32_t inc = htonl((uint32_t)increment);
    control(WINDOW, 0, id, &inc, 4);
}

static void maybe_done(stream_t *s) {
    if (s->remote_fin && !s->shut && !buf_len(&s->lout)) {
        shutdown(s->fd, SHUT_WR);
        s->shut = 1;
    }
    if (s->fin_sent && s->shut) {
        close(s->fd);
        free(s->lout.data);
        memset(s, 0, sizeof *s);
    }
}

/* Payload delivered to the local socket: credit goes back a quarter window at a time. */
static void delivered(stream_t *s, size_t n) {
    s->owed += (long)n;
    conn_owed += (long)n;
    if (s->owed >= STREAM_WINDOW / 4) {
        window((uint32_t)s->id, s->owed);
        s->owed = 0;
    }
    if (conn_owed >= CONN_WINDOW / 4) {
        window(0, conn_owed);
        conn_owed = 0;
    }
}

static void deliver(stream_t *s, const unsigned char *p, size_t n) {
    if (!buf_len(&s->lout)) {
        while (n) {
            ssize_t w = send(s->fd, p, n, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno == EAGAIN) break;
                die("send local");
            }
            delivered(s, (size_t)w);
            p += w;
            n -= (size_t)w;
        }
    }
    if (n) buf_append(&s->lout, p, n);
}

static void flush_local(stream_t *s) {
    while (buf_len(&s->lout)) {
        ssize_t w = send(s->fd, s->lout.data + s->lout.start, buf_len(&s->lout),
                         MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN) return;
            die("send local");
        }
        s->lout.start += (size_t)w;
        delivered(s, (size_t)w);
    }
    maybe_done(s);
}

static int dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) die("connect target");
    nodelay(fd);
    set_nonblocking(fd);
    return fd;
}

static void frame(int type, int flags, uint32_t id, const unsigned char *p, size_t len) {
    stream_t *s = find((int)id);
    switch (type) {
    case OPEN: {  /* the agent: connect to the port in the payload, answer ACCEPT */
        stream_t *n = slot();
        if (!n || len != 2) die("OPEN");
        memset(n, 0, sizeof *n);
        n->used = 1;
        n->id = (int)id;
        n->credit = STREAM_WINDOW;
        n->fd = dial(p[0] << 8 | p[1]);
        buf_init(&n->lout, CHUNK);
        control(ACCEPT, 0, id, NULL, 0);
        break;
    }
    case ACCEPT:
        if (s) s->opening = 0;
        break;
    case DATA:
        if (!s) die("DATA on an unknown stream");
        if (len) deliver(s, p, len);
        if (flags & FIN) {
            s->remote_fin = 1;
            maybe_done(s);
        }
        break;
    case WINDOW: {
        uint32_t inc;
        memcpy(&inc, p, 4);
        if (id == 0) conn_credit += ntohl(inc);
        else if (s) s->credit += ntohl(inc);
        break;
    }
    default:
        die("unknown frame");
    }
}

/* The tunnel socket is readable: one read, decrypted, its whole frames handled. */
static void tunnel_readable(void) {
    ssize_t n = recv(tfd, rbuf, RECEIVE_SIZE, 0);
    if (n == 0) exit(0);
    if (n < 0) {
        if (errno == EAGAIN) return;
        die("recv tunnel");
    }
    if (BIO_write(rbio, rbuf, (int)n) != n) die("BIO_write");
    for (;;) {
        int r = SSL_read(ssl, pbuf + pbuf_len, (int)(RECEIVE_SIZE + MAX_FRAME + HEADER
                                                      - pbuf_len));
        if (r <= 0) {
            int e = SSL_get_error(ssl, r);
            if (e == SSL_ERROR_WANT_READ) break;
            if (e == SSL_ERROR_ZERO_RETURN) exit(0);
            die("SSL_read");
        }
        pbuf_len += (size_t)r;
        size_t off = 0;
        while (pbuf_len - off >= HEADER) {
            uint32_t lt, id;
            memcpy(&lt, pbuf + off, 4);
            memcpy(&id, pbuf + off + 5, 4);
            lt = ntohl(lt);
            size_t len = lt >> 8;
            if (len > MAX_FRAME) die("frame too large");
            if (pbuf_len - off < HEADER + len) break;
            frame((int)(lt & 0xff), pbuf[off + 4], ntohl(id), pbuf + off + HEADER, len);
            off += HEADER + len;
        }
        memmove(pbuf, pbuf + off, pbuf_len - off);  /* at most one partial frame */
        pbuf_len -= off;
    }
    tls_send(NULL, 0);  /* a key update's or ticket's answer, if any */
}

/* The local socket is readable and there is credit: one read, framed, encrypted. */
static void local_readable(stream_t *s) {
    long credit = s->credit < conn_credit ? s->credit : conn_credit;
    size_t want = credit < CHUNK ? (size_t)credit : CHUNK;
    if (credit <= 0) return;
    ssize_t n = recv(s->fd, chunk, want, 0);
    if (n < 0) {
        if (errno == EAGAIN) return;
        die("recv local");
    }
    if (n == 0) {
        control(DATA, FIN, (uint32_t)s->id, NULL, 0);
        s->local_eof = s->fin_sent = 1;
        maybe_done(s);
        return;
    }
    size_t flen = 0;
    for (size_t off = 0; off < (size_t)n; off += MAX_FRAME) {
        size_t len = (size_t)n - off < MAX_FRAME ? (size_t)n - off : MAX_FRAME;
        put_header(fbuf + flen, len, DATA, 0, (uint32_t)s->id);
        memcpy(fbuf + flen + HEADER, chunk + off, len);
        flen += HEADER + len;
    }
    s->credit -= n;
    conn_credit -= n;
    tls_send(fbuf, flen);
    flush_tunnel();
}

/* ------------------------------------------------------------------ set-up */

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 16) < 0) die("listen");
    return fd;
}

static void handshake(void) {
    for (;;) {
        int r = SSL_do_handshake(ssl);
        tls_send(NULL, 0);
        while (buf_len(&tout)) {  /* still blocking here */
            ssize_t n = send(tfd, tout.data + tout.start, buf_len(&tout), MSG_NOSIGNAL);
            if (n < 0) die("send handshake");
            tout.start += (size_t)n;
        }
        if (r == 1) break;
        if (SSL_get_error(ssl, r) != SSL_ERROR_WANT_READ) die("handshake");
        ssize_t n = recv(tfd, rbuf, RECEIVE_SIZE, 0);
        if (n <= 0) die("recv handshake");
        BIO_write(rbio, rbuf, (int)n);
    }
    fprintf(stderr, "bulk_relay: %s %s\n", SSL_get_version(ssl), SSL_get_cipher_name(ssl));
}

/* The set-up: the tunnel's TCP connection and TLS handshake (blocking), the listeners.
 * 0 when ready, 2 for a bad command line. */
int bulk_relay_start(int argc, char **argv) {
    if (argc < 4 || (strcmp(argv[1], "server") && strcmp(argv[1], "agent"))) {
        fprintf(stderr, "usage: bulk_relay server|agent TUNNEL_PORT CERTDIR "
                        "[LISTEN TARGET ...]\n");
        return 2;
    }
    int server = !strcmp(argv[1], "server");
    int tport = atoi(argv[2]);
    char cert[4096], key[4096];
    snprintf(cert, sizeof cert, "%s/cert.pem", argv[3]);
    snprintf(key, sizeof key, "%s/key.pem", argv[3]);
    rbuf = malloc(RECEIVE_SIZE);
    pbuf = malloc(RECEIVE_SIZE + MAX_FRAME + HEADER);
    chunk = malloc(CHUNK);
    fbuf = malloc(CHUNK + (CHUNK / MAX_FRAME + 1) * HEADER);
    buf_init(&tout, 2 * CHUNK);

    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    /* As Python's ssl sets them. */
    SSL_CTX_set_mode(ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_AUTO_RETRY);
    const char *suites = getenv("BULK_CIPHERSUITES");
    if (suites && *suites && !SSL_CTX_set_ciphersuites(ctx, suites)) die("ciphersuites");
    if (server) {
        if (SSL_CTX_use_certificate_chain_file(ctx, cert) != 1 ||
            SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1)
            die("certificate");
    } else {
        if (SSL_CTX_load_verify_locations(ctx, cert, NULL) != 1) die("CA");
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    }
    ssl = SSL_new(ctx);
    rbio = BIO_new(BIO_s_mem());
    wbio = BIO_new(BIO_s_mem());
    SSL_set_bio(ssl, rbio, wbio);

    if (server) {
        int l = listen_on(tport);
        printf("listening\n");
        fflush(stdout);
        tfd = accept(l, NULL, NULL);
        if (tfd < 0) die("accept");
        close(l);
        SSL_set_accept_state(ssl);
        for (int i = 4; i + 1 < argc && nl < MAX_LISTEN; i += 2) {
            lfds[nl] = listen_on(atoi(argv[i]));
            targets[nl++] = atoi(argv[i + 1]);
        }
    } else {
        tfd = dial(tport);  /* blocking until the handshake is done */
        fcntl(tfd, F_SETFL, fcntl(tfd, F_GETFL) & ~O_NONBLOCK);
        SSL_set_connect_state(ssl);
        SSL_set_tlsext_host_name(ssl, "localhost");
        SSL_set1_host(ssl, "localhost");
    }
    nodelay(tfd);
    handshake();
    set_nonblocking(tfd);
    printf("ready\n");
    fflush(stdout);
    return 0;
}

/* What the loop waits for now, in fds[] (who[]: the stream of each). */
static void build(void) {
    int held = 0;
    nf = 0;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i].used && buf_len(&streams[i].lout)) held = 1;
    /* The tunnel: read unless a local socket is full (backpressure), write if due. */
    fds[nf] = (struct pollfd){tfd, (short)((held ? 0 : POLLIN) |
                                           (buf_len(&tout) ? POLLOUT : 0)), 0};
    who[nf++] = NULL;
    for (int i = 0; i < MAX_STREAMS; i++) {
        stream_t *s = &streams[i];
        if (!s->used) continue;
        short ev = 0;
        if (!s->opening && !s->local_eof && s->credit > 0 && conn_credit > 0 &&
            !buf_len(&tout))
            ev |= POLLIN;
        if (buf_len(&s->lout)) ev |= POLLOUT;
        /* Not polled at all when nothing is wanted: a socket shut both ways reports
         * POLLHUP whatever is asked, and would spin the loop while it waits. */
        fds[nf] = (struct pollfd){ev ? s->fd : -1, ev, 0};
        who[nf++] = s;
    }
    first_listener = nf;
    for (int i = 0; i < nl; i++) fds[nf++] = (struct pollfd){lfds[i], POLLIN, 0};
}

/* What fds[]' revents say is ready, done. */
static void handle(void) {
    if (fds[0].revents & POLLOUT) flush_tunnel();
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) tunnel_readable();
    for (int i = 1; i < first_listener; i++) {
        stream_t *s = who[i];
        if (!s->used || s->fd != fds[i].fd) continue;  /* closed meanwhile */
        if (fds[i].revents & POLLOUT) flush_local(s);
        /* Read only if asked to (credit, the last read sent): a POLLHUP alone must not
         * read, a read of 0 bytes would look like the end of the stream. */
        if (s->used && (fds[i].events & POLLIN) && !s->local_eof &&
            (fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
            local_readable(s);
    }
    for (int i = 0; i < nl; i++) {
        stream_t *s;
        if (!(fds[first_listener + i].revents & POLLIN) || !(s = slot())) continue;
        int fd = accept(lfds[i], NULL, NULL);
        if (fd < 0) die("accept local");
        nodelay(fd);
        set_nonblocking(fd);
        memset(s, 0, sizeof *s);
        s->used = s->opening = 1;
        s->fd = fd;
        s->id = next_id;
        next_id += 2;
        s->credit = STREAM_WINDOW;
        buf_init(&s->lout, CHUNK);
        unsigned char port[2] = {(unsigned char)(targets[i] >> 8),
                                 (unsigned char)targets[i]};
        control(OPEN, 0, (uint32_t)s->id, port, 2);
    }
    flush_tunnel();
}

#ifndef BULK_RELAY_LIB
int main(int argc, char **argv) {
    int rc = bulk_relay_start(argc, argv);
    if (rc) return rc;
    for (;;) {
        build();
        if (poll(fds, (nfds_t)nf, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        handle();
    }
}
#else
/* Built as a shared library (-DBULK_RELAY_LIB) for a caller with an event loop of its
 * own (scripts.bench.bulk_parity's `c+trio`): the loop waits for the epoll descriptor
 * bulk_relay_epoll() returns to be readable, then calls bulk_relay_step(), which does
 * what is ready without blocking. The interest list follows fds[] after each step. */
static int epfd, reg_fd[MAX_LISTEN + MAX_STREAMS + 1], reg_ev[MAX_LISTEN + MAX_STREAMS + 1];
static int nreg;

static void sync_interest(void) {
    int keep[MAX_LISTEN + MAX_STREAMS + 1] = {0};
    for (int i = 0; i < nf; i++) {
        if (fds[i].fd < 0 || !fds[i].events) continue;
        struct epoll_event ev = {.events = (uint32_t)fds[i].events, .data.fd = fds[i].fd};
        int j = 0;
        while (j < nreg && reg_fd[j] != fds[i].fd) j++;
        if (j == nreg) {
            if (epoll_ctl(epfd, EPOLL_CTL_ADD, fds[i].fd, &ev) < 0) die("epoll add");
            reg_fd[nreg] = fds[i].fd;
            reg_ev[nreg++] = fds[i].events;
        } else if (reg_ev[j] != fds[i].events) {
            /* The descriptor may be a new socket with a closed one's number. */
            if (epoll_ctl(epfd, EPOLL_CTL_MOD, fds[i].fd, &ev) < 0 &&
                epoll_ctl(epfd, EPOLL_CTL_ADD, fds[i].fd, &ev) < 0)
                die("epoll mod");
            reg_ev[j] = fds[i].events;
        }
        keep[j] = 1;
    }
    for (int j = nreg - 1; j >= 0; j--) {
        if (keep[j]) continue;
        epoll_ctl(epfd, EPOLL_CTL_DEL, reg_fd[j], NULL);  /* closed already: gone */
        reg_fd[j] = reg_fd[nreg - 1];
        reg_ev[j] = reg_ev[nreg - 1];
        keep[j] = keep[nreg - 1];
        nreg--;
    }
}

int bulk_relay_epoll(void) {
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) die("epoll_create1");
    build();
    sync_interest();
    return epfd;
}

void bulk_relay_step(void) {
    struct epoll_event evs[MAX_LISTEN + MAX_STREAMS + 1];
    int n = epoll_wait(epfd, evs, MAX_LISTEN + MAX_STREAMS + 1, 0);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < nf; i++) {
        fds[i].revents = 0;
        for (int k = 0; k < n; k++)
            if (evs[k].data.fd == fds[i].fd) fds[i].revents = (short)evs[k].events;
    }
    handle();
    build();
    sync_interest();
}
#endif

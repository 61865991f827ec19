/* A tunnel endpoint's data path in C, for measuring only (scripts.bench.bulk_parity,
 * scripts.bench.tunnel --c-relay and --c-agent, scripts.bench.c_relay_cost). Nothing in
 * nodeagent/ or tunnel/ uses it.
 *
 * What would a side cost with no Python on its data path? This does, with the tunnel's
 * design, the work the Python endpoints do per read and per connection, between real
 * sockets, so its CPU is the floor of a compiled data path:
 *
 *   sending:   recv(socket, at most 256 KiB) -> DATA frames of at most 64 KiB (9-byte
 *              header, the payload copied after it: the writer's join) -> SSL_write into
 *              a memory BIO (TLS 1.3 records of 16 KiB) -> BIO_read out of it ->
 *              send(tunnel); the frames of one event-loop round go out in one write
 *   receiving: recv(tunnel, 1 MiB) -> BIO_write into a memory BIO -> SSL_read into one
 *              plaintext buffer -> frames parsed in place -> send(socket, payload)
 *   a TCP mapping's connection (server): accept4 -> OPEN (the protocol's JSON payload:
 *              proto, host, port, meta) -> on ACCEPT, relay; on REFUSE, reset the client
 *   a stream the peer opens (agent): the OPEN's host and port read out of its JSON ->
 *              a non-blocking connect (answered at once when getpeername() says it is
 *              connected, as the splice loop does; otherwise when the socket is writable,
 *              SO_ERROR deciding) -> ACCEPT, or REFUSE with the protocol's reason byte
 *   the end:   a socket's EOF is DATA with FIN (with the last bytes when they come in the
 *              same read: sockets wait with EPOLLRDHUP), a FIN received is shutdown(WR);
 *              a stream whose both FINs are done is closed and forgotten; a socket error
 *              sends RST, an RST or REFUSE received resets the socket (SO_LINGER 0)
 *   HTTP (server, `http:` targets): an HTTP/1.1 front routing by Host: each request head
 *              and each response head parsed with http-parser (libhttp-parser, the
 *              nodejs parser), the request's Host looked up in the route list, the
 *              request sent on a tunnel stream to the route's target (a new stream when
 *              the Host of a keep-alive connection's request names another target), the
 *              response relayed to the client, its end found by the parser, then the
 *              connection's next request read.
 *
 * The frame header and frame types are the tunnel protocol's (tunnel/protocol/wire.py:
 * 24-bit length, type, flags, 32-bit stream id, big-endian; OPEN, ACCEPT, REFUSE, DATA
 * with FIN, WINDOW, RST), so is the flow control (2 MiB per stream and 8 MiB per
 * connection, credit returned in WINDOW frames a quarter window at a time; a socket is
 * read only while its stream and the connection have credit and the tunnel's output has
 * left), and the server's stream ids are even and never reused, as the protocol's. What it
 * skips, so its figures are a floor: no HELLO (both sides assume the default settings),
 * no PING, GOAWAY or keepalive, no dial deadline, no allow list, counters or logs, no
 * name resolution (the OPEN's host must be an IPv4 literal), one tunnel connection; a
 * peer's bad frame ends the process rather than the connection; TCP_NODELAY is the only
 * socket option set (the product sets SO_MARK and keepalive too). The HTTP front forwards
 * request and response heads as they came (the product's front applies its header
 * policy: X-Forwarded-*, hop-by-hop headers, and writes the head again), answers no
 * request itself (an unknown Host resets the connection; no 404, no limits, no
 * timeouts), does not pipeline (a request is read once the previous response has
 * ended), assumes no HEAD request (whose response has no body) and no upgrade.
 *
 * One process per side, one thread, epoll edge-triggered: each socket is added once
 * (with EPOLLIN, EPOLLRDHUP and EPOLLET; EPOLLOUT while a connect is in progress or once
 * a write falls short) and removed by its close, so the loop makes no epoll_ctl per wait;
 * a socket with more to read than its credit or the tunnel's output allows waits in a
 * list until that changes. Streams live in slots found by id through a hash table and by
 * epoll through their slot and generation, so a slot reused within one round is not
 * mistaken for the one it was.
 *
 *   bulk_relay server TUNNEL CERTDIR LISTEN TARGET [LISTEN TARGET ...]
 *   bulk_relay agent  TUNNEL CERTDIR
 *
 * The same command line as scripts.bench.splice_bulk's endpoints: the server listens on
 * TUNNEL for the agent (TLS, CERTDIR/cert.pem and key.pem; the agent verifies with
 * CERTDIR/ca.pem if there is one, else cert.pem, for the name "localhost"), prints
 * "listening", then relays each connection to LISTEN as a stream the agent connects to
 * 127.0.0.1:TARGET. TUNNEL and LISTEN are PORT (on 127.0.0.1) or IPV4:PORT. A TARGET of
 * the form http:HOST=PORT[,HOST=PORT...] makes LISTEN an HTTP front: a request whose Host
 * (without its port) is HOST goes to 127.0.0.1:PORT. With BULK_HELLO set (a JSON object:
 * the HELLO's identity, e.g. {"node":"edge-1","token":"..."}) the agent sends the
 * protocol's HELLO first and answers PINGs, so it can serve a real nodeagent server's
 * TCP mappings in place of the Python agent (the server's HELLO is read and ignored; the
 * peer's settings are assumed to be the defaults). BULK_CIPHERSUITES (TLS 1.3 suites,
 * OpenSSL's names) sets the suites both sides offer; the negotiated one is printed on
 * stderr. Each side prints "ready" once the tunnel is up. SIGUSR1 prints the streams and
 * HTTP connections open on stderr.
 *
 * Built with -shared -fPIC -DBULK_RELAY_LIB it is a library instead (bulk_relay_start,
 * bulk_relay_epoll, bulk_relay_step, at the end of this file): the same relay driven by
 * a trio loop, one wake-up and one call from Python per readiness (`c+trio`).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <http_parser.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHUNK (256 * 1024)            /* the splice loop's read */
#define RECEIVE_SIZE (1024 * 1024)    /* the tunnel socket's read */
#define MAX_FRAME (64 * 1024)         /* the peer's max_frame_size */
#define HEADER 9
#define STREAM_WINDOW (2 * 1024 * 1024)
#define CONN_WINDOW (8 * 1024 * 1024)
#define MAX_SLOTS 65536               /* streams and HTTP client connections at once */
#define BUCKETS 65536                 /* the stream id hash table */
#define MAX_LISTEN 16
#define MAX_ROUTES 16
#define HELD_LIMIT CHUNK              /* the tunnel is not read while more waits locally */
#define EVENTS 256
#define ACCEPTS_PER_ROUND 64

enum { HELLO = 0, OPEN = 1, ACCEPT = 2, REFUSE = 3, DATA = 4, WINDOW = 5, RST = 6,
       PING = 7, GOAWAY = 8 };
enum { FIN = 1, ACK = 1 };
/* tunnel/protocol/errors.py StreamReason */
enum { R_REFUSED = 1, R_UNREACHABLE = 2, R_OVERLOADED = 5, R_CANCELLED = 6 };
/* What a slot holds. */
enum { RELAY = 1,        /* a stream joined to a socket (fd) */
       HTTP_CLIENT,      /* an HTTP front's client connection (fd), no stream of its own */
       HTTP_UP };        /* an HTTP client's upstream stream (no fd: its client's) */

#define TAG_TUNNEL (~0ULL)
#define TAG_LISTENER (1ULL << 63)

static void die(const char *what) {
    fprintf(stderr, "bulk_relay: %s: %s\n", what, errno ? strerror(errno) : "");
    ERR_print_errors_fp(stderr);
    exit(1);
}

/* ------------------------------------------------------------------ buffers */

typedef struct { unsigned char *data; size_t start, end, cap; } buf_t;

static size_t buf_len(const buf_t *b) { return b->end - b->start; }
static void buf_reserve(buf_t *b, size_t more) {
    if (b->start == b->end) b->start = b->end = 0;
    if (b->end + more <= b->cap) return;
    if (b->start) {
        memmove(b->data, b->data + b->start, buf_len(b));
        b->end -= b->start;
        b->start = 0;
    }
    if (b->end + more > b->cap) {
        if (!b->cap) b->cap = 16 * 1024;
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
static void buf_free(buf_t *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------ state */

typedef struct slot slot_t;
struct slot {
    int kind, fd;
    uint32_t id, gen, index;
    unsigned opening : 1;      /* server: OPEN sent, no answer yet */
    unsigned connecting : 1;   /* agent: connect() in progress */
    unsigned readable : 1;     /* an edge seen, the socket not drained since */
    unsigned rdhup : 1;        /* the peer's FIN has arrived (EPOLLRDHUP) */
    unsigned local_eof : 1, fin_sent : 1, remote_fin : 1, shut : 1;
    unsigned want_out : 1;     /* EPOLLOUT added to its registration */
    unsigned pending : 1;      /* in the pending list */
    long credit;               /* what we may still send on this stream */
    long owed;                 /* received and delivered, not yet returned */
    buf_t lout;                /* payload waiting for the local socket */
    slot_t *hnext;             /* the id hash chain */
    slot_t *pnext, *pprev;     /* the pending list */
    /* HTTP_CLIENT */
    slot_t *up;                /* its upstream stream (HTTP_UP), or NULL */
    buf_t in;                  /* what the client sent, not yet forwarded */
    size_t parsed;             /* of `in`, what the parser has taken (not yet sent up) */
    http_parser req, resp;
    int listener;              /* its front (an index of listeners[]) */
    int req_target;            /* the port the request in progress goes to (0: none yet) */
    int in_response;           /* a request went up, its response has not ended */
    int req_done;              /* the parser paused at a request's end */
    char host[256];
    size_t host_len;
    int field_is_host, field_len, value_last;
    /* HTTP_UP */
    slot_t *client;            /* its client (HTTP_CLIENT) */
    int port;                  /* its target */
};

static SSL *ssl;
static BIO *rbio, *wbio;
static int tfd, epfd, tunnel_rd;
static buf_t pout;                 /* the round's frames, plaintext */
static buf_t tout;                 /* TLS records waiting for the tunnel socket */
static unsigned char *rbuf;        /* the tunnel socket's reads */
static unsigned char *pbuf;        /* plaintext: a partial frame, then what SSL_read adds */
static size_t pbuf_len;
static unsigned char *chunk;       /* the local sockets' reads */
static long conn_credit = CONN_WINDOW, conn_owed, held;
static slot_t *slots;
static uint32_t *free_slots, nfree;
static slot_t *buckets[BUCKETS];
static slot_t pending = {.pnext = &pending, .pprev = &pending};
static uint32_t next_id = 2;       /* the acceptor's ids: even */
static long live_streams, live_clients;
static volatile sig_atomic_t report;
static struct listener {
    int fd, target;                /* a TCP mapping: the target port */
    int nroutes;                   /* an HTTP front: its routes */
    char hosts[MAX_ROUTES][128];
    int ports[MAX_ROUTES];
} listeners[MAX_LISTEN];
static int nl;

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static struct sockaddr_in address(const char *spec) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    const char *colon = strrchr(spec, ':');
    if (colon) {
        char host[64];
        snprintf(host, sizeof host, "%.*s", (int)(colon - spec), spec);
        if (inet_pton(AF_INET, host, &a.sin_addr) != 1) die("address");
        spec = colon + 1;
    }
    a.sin_port = htons((uint16_t)atoi(spec));
    return a;
}

/* ------------------------------------------------------------------ slots */

static slot_t *find(uint32_t id) {
    for (slot_t *s = buckets[(id >> 1) % BUCKETS]; s; s = s->hnext)
        if (s->id == id) return s;
    return NULL;
}

static slot_t *alloc_slot(int kind) {
    if (!nfree) return NULL;
    slot_t *s = &slots[free_slots[--nfree]];
    uint32_t gen = s->gen, index = s->index;
    memset(s, 0, sizeof *s);
    s->gen = gen;
    s->index = index;
    s->kind = kind;
    s->fd = -1;
    s->credit = STREAM_WINDOW;
    if (kind == HTTP_CLIENT) live_clients++;
    else live_streams++;
    return s;
}

static void insert(slot_t *s, uint32_t id) {
    s->id = id;
    slot_t **b = &buckets[(id >> 1) % BUCKETS];
    s->hnext = *b;
    *b = s;
}

static void unpend(slot_t *s) {
    if (!s->pending) return;
    s->pprev->pnext = s->pnext;
    s->pnext->pprev = s->pprev;
    s->pending = 0;
}
static void pend(slot_t *s) {
    if (s->pending) return;
    s->pnext = &pending;
    s->pprev = pending.pprev;
    pending.pprev->pnext = s;
    pending.pprev = s;
    s->pending = 1;
}

static void free_slot(slot_t *s) {
    if (s->id) {
        slot_t **p = &buckets[(s->id >> 1) % BUCKETS];
        while (*p != s) p = &(*p)->hnext;
        *p = s->hnext;
    }
    unpend(s);
    held -= (long)buf_len(&s->lout);
    buf_free(&s->lout);
    buf_free(&s->in);
    if (s->kind == HTTP_CLIENT) live_clients--;
    else live_streams--;
    s->kind = 0;
    s->gen++;
    free_slots[nfree++] = s->index;
}

static uint64_t tag(const slot_t *s) { return (uint64_t)s->gen << 32 | s->index; }

static void watch(slot_t *s, uint32_t events) {
    struct epoll_event ev = {.events = events | EPOLLIN | EPOLLRDHUP | EPOLLET,
                             .data.u64 = tag(s)};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, s->fd, &ev) < 0) die("epoll add");
}

static void want_out(slot_t *s) {
    if (s->want_out) return;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                             .data.u64 = tag(s)};
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, s->fd, &ev) < 0) die("epoll mod");
    s->want_out = 1;
}

/* ------------------------------------------------------------------ the tunnel's output */

static void put_header(unsigned char *h, size_t len, int type, int flags, uint32_t id) {
    uint32_t lt = htonl((uint32_t)(len << 8 | (unsigned)type));
    uint32_t sid = htonl(id);
    memcpy(h, &lt, 4);
    h[4] = (unsigned char)flags;
    memcpy(h + 5, &sid, 4);
}

/* Encrypt the round's frames into the memory BIO and move the records to `tout`. */
static void seal(void) {
    if (buf_len(&pout) && SSL_write(ssl, pout.data + pout.start, (int)buf_len(&pout)) <= 0)
        die("SSL_write");
    pout.start = pout.end = 0;
    size_t pending_bytes = BIO_ctrl_pending(wbio);
    if (!pending_bytes) return;
    buf_reserve(&tout, pending_bytes);
    int n = BIO_read(wbio, tout.data + tout.end, (int)pending_bytes);
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

static void emit(int type, int flags, uint32_t id, const void *payload, size_t len) {
    buf_reserve(&pout, HEADER + len);
    put_header(pout.data + pout.end, len, type, flags, id);
    if (len) memcpy(pout.data + pout.end + HEADER, payload, len);
    pout.end += HEADER + len;
    if (buf_len(&pout) >= CHUNK) seal();  /* records of a large round leave as they fill */
}

static void window(uint32_t id, long increment) {
    uint32_t inc = htonl((uint32_t)increment);
    emit(WINDOW, 0, id, &inc, 4);
}

static void reason_frame(int type, uint32_t id, int reason, const char *message) {
    unsigned char p[128];
    size_t n = strlen(message);
    if (n > sizeof p - 1) n = sizeof p - 1;
    p[0] = (unsigned char)reason;
    memcpy(p + 1, message, n);
    emit(type, 0, id, p, n + 1);
}

/* ------------------------------------------------------------------ streams */

static void http_upstream_gone(slot_t *up);
static void http_response(slot_t *up, const unsigned char *p, size_t n);
static void http_client_readable(slot_t *c);
static void http_client_closed(slot_t *c, int reset);

/* The socket reset (SO_LINGER 0: an RST, not a FIN) and the slot forgotten. */
static void reset_local(slot_t *s) {
    if (s->fd >= 0) {
        struct linger lg = {1, 0};
        setsockopt(s->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        close(s->fd);
    }
    free_slot(s);
}

/* A local socket failed: the stream reset toward the peer too. */
static void reset_stream(slot_t *s, int reason) {
    if (!(s->fin_sent && s->remote_fin)) reason_frame(RST, s->id, reason, "reset");
    reset_local(s);
}

static void maybe_done(slot_t *s) {
    if (s->remote_fin && !s->shut && !buf_len(&s->lout)) {
        shutdown(s->fd, SHUT_WR);
        s->shut = 1;
    }
    if (s->fin_sent && s->shut) {
        close(s->fd);
        free_slot(s);
    }
}

/* Payload delivered to a local socket: credit goes back a quarter window at a time. */
static void delivered(slot_t *s, size_t n) {
    if (s) {
        s->owed += (long)n;
        if (s->owed >= STREAM_WINDOW / 4) {
            window(s->id, s->owed);
            s->owed = 0;
        }
    }
    conn_owed += (long)n;
    if (conn_owed >= CONN_WINDOW / 4) {
        window(0, conn_owed);
        conn_owed = 0;
    }
}

/* Bytes for `s`'s socket (for an HTTP_UP stream, its client's); `credited`: the stream
 * whose window they count against. 0, or -1 when the socket failed (`s` is then gone). */
static int deliver(slot_t *s, slot_t *credited, const unsigned char *p, size_t n) {
    if (!buf_len(&s->lout)) {
        while (n) {
            ssize_t w = send(s->fd, p, n, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno == EAGAIN) break;
                if (s->kind == HTTP_CLIENT) http_client_closed(s, 1);
                else reset_stream(s, R_CANCELLED);
                return -1;
            }
            delivered(credited, (size_t)w);
            p += w;
            n -= (size_t)w;
        }
    }
    if (n) {
        buf_append(&s->lout, p, n);
        held += (long)n;
        want_out(s);
    }
    return 0;
}

static void flush_local(slot_t *s) {
    slot_t *credited = s->kind == HTTP_CLIENT ? s->up : s;
    while (buf_len(&s->lout)) {
        ssize_t w = send(s->fd, s->lout.data + s->lout.start, buf_len(&s->lout),
                         MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN) return;
            if (s->kind == HTTP_CLIENT) http_client_closed(s, 1);
            else reset_stream(s, R_CANCELLED);
            return;
        }
        s->lout.start += (size_t)w;
        held -= w;
        delivered(credited, (size_t)w);
    }
    if (s->kind == RELAY) maybe_done(s);
    else if (s->kind == HTTP_CLIENT && !s->in_response) http_client_readable(s);
}

static int can_read(const slot_t *s) {
    return s->readable && !s->opening && !s->connecting && !s->local_eof && s->credit > 0 &&
           conn_credit > 0 && !buf_len(&tout);
}

/* A relayed socket with something to read and the credit to send it: one read, framed.
 * The last bytes and the EOF go in one frame when the peer's FIN had arrived. */
static void local_readable(slot_t *s) {
    long credit = s->credit < conn_credit ? s->credit : conn_credit;
    size_t want = credit < CHUNK ? (size_t)credit : CHUNK;
    ssize_t n = recv(s->fd, chunk, want, 0);
    if (n < 0) {
        if (errno == EAGAIN) {
            s->readable = 0;
            return;
        }
        reset_stream(s, R_CANCELLED);
        return;
    }
    if (n == 0) {
        emit(DATA, FIN, s->id, NULL, 0);
        s->local_eof = s->fin_sent = 1;
        s->readable = 0;
        maybe_done(s);
        return;
    }
    /* Short of what was asked: the socket is drained (a new edge will say when more
     * comes); with its FIN arrived, what follows is the EOF. */
    int drained = (size_t)n < want, eof = drained && s->rdhup;
    for (size_t off = 0; off < (size_t)n; off += MAX_FRAME) {
        size_t len = (size_t)n - off < MAX_FRAME ? (size_t)n - off : MAX_FRAME;
        emit(DATA, eof && off + len == (size_t)n ? FIN : 0, s->id, chunk + off, len);
    }
    s->credit -= n;
    conn_credit -= n;
    if (drained) s->readable = 0;
    if (eof) {
        s->local_eof = s->fin_sent = 1;
        maybe_done(s);
    } else if (s->readable) {
        pend(s);
    }
}

static void try_read(slot_t *s) {
    if (can_read(s)) local_readable(s);
    else if (s->readable && !s->local_eof) pend(s);
}

/* The pending sockets that can be read now, once each. */
static void run_pending(void) {
    if (pending.pnext == &pending || buf_len(&tout)) return;
    slot_t todo = {.pnext = pending.pnext, .pprev = pending.pprev};
    todo.pnext->pprev = &todo;
    todo.pprev->pnext = &todo;
    pending.pnext = pending.pprev = &pending;
    while (todo.pnext != &todo) {
        slot_t *s = todo.pnext;
        s->pprev->pnext = s->pnext;  /* off `todo` */
        s->pnext->pprev = s->pprev;
        s->pending = 0;
        if (s->kind == HTTP_CLIENT) {
            http_client_readable(s);
            continue;
        }
        if (can_read(s)) local_readable(s);
        else if (s->readable && !s->local_eof) pend(s);
    }
}

static int has_work(void) {
    if (tunnel_rd && held <= HELD_LIMIT) return 1;
    if (buf_len(&tout)) return 0;
    for (slot_t *s = pending.pnext; s != &pending; s = s->pnext)
        if (s->kind == HTTP_CLIENT || can_read(s)) return 1;
    return 0;
}

/* ------------------------------------------------------------------ opening */

/* The agent: connect to the OPEN's target, answer when connected or refused. */
static void open_received(uint32_t id, const unsigned char *p, size_t len) {
    char doc[1024], host[64] = "";
    int port = 0;
    if (len >= sizeof doc) die("OPEN too large");
    memcpy(doc, p, len);
    doc[len] = 0;
    /* The protocol's JSON: {"proto":"tcp","host":"...","port":N,"meta":{...}} */
    const char *h = strstr(doc, "\"host\":\""), *o = strstr(doc, "\"port\":");
    if (!h || !o) die("OPEN payload");
    h += 8;
    size_t hl = strcspn(h, "\"");
    if (hl >= sizeof host) hl = sizeof host - 1;
    memcpy(host, h, hl);
    host[hl] = 0;
    port = atoi(o + 7);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1 || port <= 0 || port > 65535) {
        reason_frame(REFUSE, id, R_UNREACHABLE, "not an IPv4 literal");
        return;
    }
    slot_t *s = alloc_slot(RELAY);
    if (!s) {
        reason_frame(REFUSE, id, R_OVERLOADED, "too many streams");
        return;
    }
    s->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd < 0) die("socket");
    nodelay(s->fd);
    int r = connect(s->fd, (struct sockaddr *)&a, sizeof a);
    if (r < 0 && errno == EINPROGRESS) {
        struct sockaddr_in peer;
        socklen_t pl = sizeof peer;
        r = getpeername(s->fd, (struct sockaddr *)&peer, &pl);  /* answered already? */
        if (r < 0) s->connecting = 1;
    } else if (r < 0) {
        reason_frame(REFUSE, id, errno == ECONNREFUSED ? R_REFUSED : R_UNREACHABLE,
                     strerror(errno));
        close(s->fd);
        free_slot(s);
        return;
    }
    insert(s, id);
    watch(s, s->connecting ? EPOLLOUT : 0);
    s->want_out = s->connecting;
    if (!s->connecting) emit(ACCEPT, 0, id, NULL, 0);
}

/* The agent: a connect in progress has an answer. */
static void connected(slot_t *s) {
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err) {
        reason_frame(REFUSE, s->id, err == ECONNREFUSED ? R_REFUSED : R_UNREACHABLE,
                     strerror(err));
        close(s->fd);
        free_slot(s);
        return;
    }
    s->connecting = 0;
    emit(ACCEPT, 0, s->id, NULL, 0);
}

static void send_open(uint32_t id, int port, const char *origin) {
    char doc[160];
    int n = snprintf(doc, sizeof doc,
                     "{\"proto\":\"tcp\",\"host\":\"127.0.0.1\",\"port\":%d,"
                     "\"meta\":{\"origin\":\"%s\"}}", port, origin);
    emit(OPEN, 0, id, doc, (size_t)n);
}

/* The server: a TCP mapping's listener is readable. */
static void accept_mapping(struct listener *l) {
    for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == ECONNABORTED) return;
            die("accept");
        }
        slot_t *s = alloc_slot(l->nroutes ? HTTP_CLIENT : RELAY);
        if (!s) {
            close(fd);
            continue;
        }
        nodelay(fd);
        s->fd = fd;
        if (s->kind == HTTP_CLIENT) {
            http_parser_init(&s->req, HTTP_REQUEST);
            s->req.data = s;
            s->listener = (int)(l - listeners);
            watch(s, 0);
            continue;
        }
        s->opening = 1;
        insert(s, next_id);
        next_id += 2;
        watch(s, 0);
        send_open(s->id, l->target, "tcp-mapping");
    }
}

/* ------------------------------------------------------------------ the tunnel's input */

static void frame(int type, int flags, uint32_t id, const unsigned char *p, size_t len) {
    slot_t *s = id ? find(id) : NULL;
    switch (type) {
    case OPEN:
        open_received(id, p, len);
        break;
    case ACCEPT:
        if (!s) break;  /* reset meanwhile */
        s->opening = 0;
        if (s->kind == HTTP_UP) http_client_readable(s->client);
        else try_read(s);
        break;
    case REFUSE:
    case RST:
        if (!s) break;
        if (s->kind == HTTP_UP) http_upstream_gone(s);
        else reset_local(s);
        break;
    case DATA:
        if (!s) {  /* a stream reset meanwhile: the connection's credit still returns */
            delivered(NULL, len);
            break;
        }
        if (s->kind == HTTP_UP) {
            if (len) http_response(s, p, len);
            if ((flags & FIN) && find(id) == s) http_upstream_gone(s);
            break;
        }
        if (len && deliver(s, s, p, len) < 0) break;
        if (flags & FIN) {
            s->remote_fin = 1;
            maybe_done(s);
        }
        break;
    case HELLO:  /* a real server's (BULK_HELLO): its settings are the defaults assumed */
        break;
    case PING:
        if (!(flags & ACK)) emit(PING, ACK, 0, p, len);
        break;
    case GOAWAY:
        fprintf(stderr, "bulk_relay: GOAWAY\n");
        exit(0);
    case WINDOW: {
        uint32_t inc;
        if (len != 4) die("WINDOW");
        memcpy(&inc, p, 4);
        if (id == 0) {
            conn_credit += ntohl(inc);
        } else if (s) {
            s->credit += ntohl(inc);
            if (s->kind == RELAY) try_read(s);
        }
        break;
    }
    default:
        die("unexpected frame");
    }
}

/* The tunnel socket has bytes: one read, decrypted, its whole frames handled. */
static void tunnel_read(void) {
    ssize_t n = recv(tfd, rbuf, RECEIVE_SIZE, 0);
    if (n == 0) exit(0);
    if (n < 0) {
        if (errno == EAGAIN) {
            tunnel_rd = 0;
            return;
        }
        die("recv tunnel");
    }
    if (n < RECEIVE_SIZE) tunnel_rd = 0;
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
}

/* ------------------------------------------------------------------ the HTTP front */

static int on_header_field(http_parser *hp, const char *at, size_t n) {
    slot_t *c = hp->data;
    /* A name or a value may come in pieces (a head split between reads): "host" is
     * matched on the whole name, its pieces counted. */
    if (c->value_last) {
        c->field_len = 0;
        c->field_is_host = 1;
        c->value_last = 0;
    }
    if (c->field_is_host && (c->field_len + n > 4 ||
                             strncasecmp(at, "host" + c->field_len, n)))
        c->field_is_host = 0;
    c->field_len += (int)n;
    return 0;
}
static int on_header_value(http_parser *hp, const char *at, size_t n) {
    slot_t *c = hp->data;
    if (c->field_len == 4 && c->field_is_host && c->host_len + n < sizeof c->host) {
        memcpy(c->host + c->host_len, at, n);
        c->host_len += n;
    }
    c->value_last = 1;
    return 0;
}
static int on_message_begin(http_parser *hp) {
    slot_t *c = hp->data;
    c->host_len = 0;
    c->value_last = 1;
    c->req_target = 0;
    return 0;
}
static int on_headers_complete(http_parser *hp) {
    slot_t *c = hp->data;
    struct listener *l = &listeners[c->listener];
    char *colon = memchr(c->host, ':', c->host_len);
    size_t hl = colon ? (size_t)(colon - c->host) : c->host_len;
    for (int i = 0; i < l->nroutes; i++)
        if (strlen(l->hosts[i]) == hl && !strncasecmp(l->hosts[i], c->host, hl)) {
            c->req_target = l->ports[i];
            return 0;
        }
    return -1;  /* no route: an error (1 and 2 mean "no body"), the connection closed */
}
static int on_request_complete(http_parser *hp) {
    slot_t *c = hp->data;
    c->req_done = 1;
    http_parser_pause(hp, 1);  /* the request's end: forwarded, then its response waited */
    return 0;
}
static int on_response_complete(http_parser *hp) {
    slot_t *up = hp->data;
    up->client->in_response = 0;
    http_parser_pause(hp, 1);
    return 0;
}
static const http_parser_settings request_settings = {
    .on_message_begin = on_message_begin, .on_header_field = on_header_field,
    .on_header_value = on_header_value, .on_headers_complete = on_headers_complete,
    .on_message_complete = on_request_complete};
static const http_parser_settings response_settings = {
    .on_message_complete = on_response_complete};

/* The client's connection ends (closed, or with `reset` reset): its upstream stream ends
 * with it (FIN between responses, RST while one is awaited). */
static void http_client_closed(slot_t *c, int reset) {
    slot_t *up = c->up;
    if (up) {
        if (up->opening || c->in_response) reason_frame(RST, up->id, R_CANCELLED, "closed");
        else emit(DATA, FIN, up->id, NULL, 0);
        free_slot(up);
    }
    if (reset) {
        reset_local(c);
    } else {
        close(c->fd);
        free_slot(c);
    }
}

/* The upstream's stream ended or was refused: mid-response the client is cut off; between
 * responses the client's connection goes on and its next request opens another. */
static void http_upstream_gone(slot_t *up) {
    slot_t *c = up->client;
    c->up = NULL;
    if (c->in_response || up->opening || c->req_done) {
        free_slot(up);
        reset_local(c);
        return;
    }
    emit(DATA, FIN, up->id, NULL, 0);
    free_slot(up);
}

static void http_client_readable(slot_t *c);

/* Response bytes from the upstream: their end found by the parser, relayed to the client. */
static void http_response(slot_t *up, const unsigned char *p, size_t n) {
    slot_t *c = up->client;
    size_t off = 0;
    while (off < n) {
        size_t used = http_parser_execute(&up->resp, &response_settings,
                                          (const char *)p + off, n - off);
        enum http_errno e = HTTP_PARSER_ERRNO(&up->resp);
        off += used;
        if (e == HPE_PAUSED) {
            http_parser_init(&up->resp, HTTP_RESPONSE);  /* the next response */
        } else if (e != HPE_OK || !used) {
            reason_frame(RST, up->id, R_CANCELLED, "bad response");
            c->in_response = 1;
            http_upstream_gone(up);  /* a bad response: the client's connection ends */
            return;
        }
    }
    if (deliver(c, up, p, n) < 0) return;
    if (!c->in_response) http_client_readable(c);  /* its next request, if there */
}

/* The client's next request: read, parsed, routed, sent up as it is parsed. */
static void http_client_readable(slot_t *c) {
    for (;;) {
        if (c->in_response || buf_len(&c->lout) || (c->up && c->up->opening)) return;
        if (c->parsed && c->up && c->up->port == c->req_target) {
            /* What the parser has taken of this request goes up. */
            emit(DATA, 0, c->up->id, c->in.data + c->in.start, c->parsed);
            c->up->credit -= (long)c->parsed;
            conn_credit -= (long)c->parsed;
            c->in.start += c->parsed;
            c->parsed = 0;
        }
        if (c->req_done) {
            if (!c->up) return;
            c->req_done = 0;
            http_parser_pause(&c->req, 0);
            c->in_response = 1;  /* its response awaited */
            return;
        }
        if (c->parsed == buf_len(&c->in)) {
            if (!c->readable) return;
            buf_reserve(&c->in, 16 * 1024);
            size_t room = c->in.cap - c->in.end;
            ssize_t n = recv(c->fd, c->in.data + c->in.end, room, 0);
            if (n <= 0) {
                if (n < 0 && errno == EAGAIN) {
                    c->readable = 0;
                    return;
                }
                http_client_closed(c, n < 0);  /* EOF, or an error */
                return;
            }
            if ((size_t)n < room) c->readable = 0;
            c->in.end += (size_t)n;
        }
        size_t used = http_parser_execute(&c->req, &request_settings,
                                          (const char *)c->in.data + c->in.start + c->parsed,
                                          buf_len(&c->in) - c->parsed);
        enum http_errno e = HTTP_PARSER_ERRNO(&c->req);
        if (e != HPE_OK && e != HPE_PAUSED) {
            http_client_closed(c, 1);  /* a bad request or no route */
            return;
        }
        c->parsed += used;
        if (c->req_target && (!c->up || c->up->port != c->req_target)) {
            /* Routed elsewhere than its upstream: a new stream to the route's target. */
            if (c->up) {
                emit(DATA, FIN, c->up->id, NULL, 0);
                free_slot(c->up);
                c->up = NULL;
            }
            slot_t *up = alloc_slot(HTTP_UP);
            if (!up) {
                http_client_closed(c, 1);
                return;
            }
            up->client = c;
            up->port = c->req_target;
            up->opening = 1;
            http_parser_init(&up->resp, HTTP_RESPONSE);
            up->resp.data = up;
            insert(up, next_id);
            next_id += 2;
            c->up = up;
            send_open(up->id, up->port, "http");
        }
    }
}

/* ------------------------------------------------------------------ set-up */

static int listen_on(const char *spec) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a = address(spec);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 4096) < 0) die("listen");
    return fd;
}

static void handshake(void) {
    for (;;) {
        int r = SSL_do_handshake(ssl);
        seal();
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

static void on_usr1(int sig) {
    (void)sig;
    report = 1;
}

static void parse_target(struct listener *l, const char *spec) {
    if (strncmp(spec, "http:", 5)) {
        l->target = atoi(spec);
        return;
    }
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", spec + 5);
    for (char *save, *r = strtok_r(copy, ",", &save); r && l->nroutes < MAX_ROUTES;
         r = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(r, '=');
        if (!eq) die("http: routes are HOST=PORT");
        snprintf(l->hosts[l->nroutes], sizeof l->hosts[0], "%.*s", (int)(eq - r), r);
        l->ports[l->nroutes++] = atoi(eq + 1);
    }
}

/* The set-up: the tunnel's TCP connection and TLS handshake (blocking), the listeners.
 * 0 when ready, 2 for a bad command line. */
int bulk_relay_start(int argc, char **argv) {
    if (argc < 4 || (strcmp(argv[1], "server") && strcmp(argv[1], "agent"))) {
        fprintf(stderr, "usage: bulk_relay server|agent TUNNEL CERTDIR "
                        "[LISTEN TARGET ...]\n");
        return 2;
    }
    int server = !strcmp(argv[1], "server");
    char cert[4096], key[4096], ca[4096];
    snprintf(cert, sizeof cert, "%s/cert.pem", argv[3]);
    snprintf(key, sizeof key, "%s/key.pem", argv[3]);
    snprintf(ca, sizeof ca, "%s/ca.pem", argv[3]);
    if (access(ca, R_OK) != 0) snprintf(ca, sizeof ca, "%s", cert);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGUSR1, on_usr1);
    rbuf = malloc(RECEIVE_SIZE);
    pbuf = malloc(RECEIVE_SIZE + MAX_FRAME + HEADER);
    chunk = malloc(CHUNK);
    slots = calloc(MAX_SLOTS, sizeof *slots);
    free_slots = malloc(MAX_SLOTS * sizeof *free_slots);
    if (!rbuf || !pbuf || !chunk || !slots || !free_slots) die("malloc");
    for (uint32_t i = 0; i < MAX_SLOTS; i++) {
        slots[i].index = i;
        free_slots[nfree++] = MAX_SLOTS - 1 - i;
    }

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
        if (SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1) die("CA");
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    }
    ssl = SSL_new(ctx);
    rbio = BIO_new(BIO_s_mem());
    wbio = BIO_new(BIO_s_mem());
    SSL_set_bio(ssl, rbio, wbio);

    struct sockaddr_in ta = address(argv[2]);
    if (server) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&ta, sizeof ta) < 0 || listen(l, 16) < 0)
            die("listen tunnel");
        printf("listening\n");
        fflush(stdout);
        tfd = accept(l, NULL, NULL);
        if (tfd < 0) die("accept");
        close(l);
        SSL_set_accept_state(ssl);
        for (int i = 4; i + 1 < argc && nl < MAX_LISTEN; i += 2) {
            listeners[nl].fd = listen_on(argv[i]);
            parse_target(&listeners[nl++], argv[i + 1]);
        }
    } else {
        tfd = socket(AF_INET, SOCK_STREAM, 0);
        if (tfd < 0 || connect(tfd, (struct sockaddr *)&ta, sizeof ta) < 0)
            die("connect tunnel");
        SSL_set_connect_state(ssl);
        SSL_set_tlsext_host_name(ssl, "localhost");
        SSL_set1_host(ssl, "localhost");
    }
    nodelay(tfd);
    handshake();
    const char *identity = getenv("BULK_HELLO");
    if (!server && identity && *identity) {
        /* The dialer's HELLO (wire.py's Hello.encode: the magic, versions 1-1, the JSON
         * of settings, identity and features), for a real nodeagent server. */
        char doc[2048];
        int n = snprintf(doc, sizeof doc, "nodeagent%c%c%c%c{\"settings\":{"
                         "\"max_frame_size\":%d,\"initial_stream_window\":%d,"
                         "\"connection_window\":%d,\"max_streams\":10000,"
                         "\"max_open_size\":8192},\"identity\":%s,\"features\":[]}",
                         0, 1, 0, 1, MAX_FRAME, STREAM_WINDOW, CONN_WINDOW, identity);
        emit(HELLO, 0, 0, doc, (size_t)n);
        seal();
        while (buf_len(&tout)) {  /* still blocking here */
            ssize_t w = send(tfd, tout.data + tout.start, buf_len(&tout), MSG_NOSIGNAL);
            if (w < 0) die("send HELLO");
            tout.start += (size_t)w;
        }
    }
    if (fcntl(tfd, F_SETFL, fcntl(tfd, F_GETFL) | O_NONBLOCK) < 0) die("fcntl");
    printf("ready\n");
    fflush(stdout);
    return 0;
}

/* The loop's descriptor: the tunnel (edge-triggered) and the listeners (level). */
int bulk_relay_epoll(void) {
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                             .data.u64 = TAG_TUNNEL};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, tfd, &ev) < 0) die("epoll add tunnel");
    for (int i = 0; i < nl; i++) {
        struct epoll_event le = {.events = EPOLLIN, .data.u64 = TAG_LISTENER | (uint64_t)i};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, listeners[i].fd, &le) < 0) die("epoll add");
    }
    tunnel_rd = 1;  /* the peer may have sent already */
    return epfd;
}

/* One socket's readiness. */
static void handle(uint64_t t, uint32_t ev) {
    if (t == TAG_TUNNEL) {
        if (ev & EPOLLOUT) flush_tunnel();
        if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) tunnel_rd = 1;
        return;
    }
    if (t & TAG_LISTENER) {
        accept_mapping(&listeners[t & 0xffff]);
        return;
    }
    slot_t *s = &slots[(uint32_t)t];
    if (!s->kind || s->gen != (uint32_t)(t >> 32)) return;  /* gone in this round */
    if (s->connecting) {
        if (!(ev & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        connected(s);
        if (!slots[(uint32_t)t].kind || slots[(uint32_t)t].gen != (uint32_t)(t >> 32))
            return;  /* refused */
    }
    if (s->opening && (ev & EPOLLERR)) {  /* reset before the answer: the open cancelled */
        reason_frame(RST, s->id, R_CANCELLED, "client reset");
        reset_local(s);
        return;
    }
    if (ev & (EPOLLRDHUP | EPOLLHUP)) s->rdhup = 1;
    if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) s->readable = 1;
    if ((ev & EPOLLOUT) && buf_len(&s->lout)) {
        flush_local(s);
        if (!s->kind || s->gen != (uint32_t)(t >> 32)) return;
    }
    if (s->kind == HTTP_CLIENT) http_client_readable(s);
    else try_read(s);
}

/* After a round's events: the tunnel read (unless the local sockets hold too much), the
 * pending sockets read, the round's frames encrypted and sent in one write. */
static void end_round(void) {
    if (tunnel_rd && held <= HELD_LIMIT) tunnel_read();
    run_pending();
    seal();
    flush_tunnel();
    if (report) {
        report = 0;
        fprintf(stderr, "bulk_relay: streams=%ld http_connections=%ld\n", live_streams,
                live_clients);
    }
}

static void step(int timeout) {
    struct epoll_event evs[EVENTS];
    int n = epoll_wait(epfd, evs, EVENTS, timeout);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < n; i++) handle(evs[i].data.u64, evs[i].events);
    end_round();
}

#ifndef BULK_RELAY_LIB
int main(int argc, char **argv) {
    int rc = bulk_relay_start(argc, argv);
    if (rc) return rc;
    bulk_relay_epoll();
    for (;;) step(has_work() ? 0 : -1);
}
#else
/* Built as a shared library (-DBULK_RELAY_LIB) for a caller with an event loop of its
 * own (scripts.bench.bulk_parity's `c+trio`): the loop waits for the epoll descriptor
 * bulk_relay_epoll() returns to be readable, then calls bulk_relay_step(), which does
 * what is ready without blocking, until nothing is left that needs no new readiness. */
void bulk_relay_step(void) {
    do step(0);
    while (has_work());
}
#endif

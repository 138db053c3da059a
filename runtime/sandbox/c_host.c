/* The candidate host: the only process a C candidate's code runs in (see runtime/sandbox/c_host.py).
 *
 * Started by the worker as a fresh executable: argv = host, kernel name, threads, CPU seconds; the
 * worker's socket is descriptor 3, the candidate's library descriptor 4 (and this executable 5), stdout
 * and stderr a file of this host's own. Every other descriptor is closed first, whatever the worker
 * left inheritable, and nothing of the worker's memory was ever here. An empty kernel name starts a
 * calibration host: it loads no library (no descriptor 4) and only answers requests that call nothing,
 * so the round trip the worker subtracts from timings is measured where no candidate code runs.
 * Before the library loads, files are confined (Landlock, read-only beneath the system's directories) and the
 * filter is in force.
 *
 * First message: 'F' + u32 length + BPF program (the filter before the library) + u32 length + BPF
 * program (the one after it), or 'F' + two zero lengths (no filter on this machine). Then:
 *   'M', then (u32 id, u64 size) with a memfd: map a shared arena             -> 'k'
 *   'B' + u32 n + n x (u8 kind: 'i' i32 | 'f' f32 | 'p' u32 arena, u64 offset) -> 'h' + u32 handle
 *   'K' + u32 handles: call each in turn (handle 0 calls nothing)             -> 'd'
 * Answers 'ok' once the library is loaded, or 'E' + why not.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Integer and pointer arguments go in general registers in order, floats in vector registers in order,
   and integer arguments beyond the registers on the stack, in order, 8 bytes each (x86-64 System V,
   AArch64 on Linux): one prototype with all float registers and 10 stack slots after the integer
   registers calls any kernel of up to 8 floats and up to 16 (x86-64) or 18 (AArch64) ints and pointers. */
#define NFLT 8
#define NSTACK 10
#define FLOATS float, float, float, float, float, float, float, float
#define STACK long, long, long, long, long, long, long, long, long, long
#if defined(__aarch64__)
#define NREG 8
typedef void (*kernel_fn)(long, long, long, long, long, long, long, long, FLOATS, STACK);
#else
#define NREG 6
typedef void (*kernel_fn)(long, long, long, long, long, long, FLOATS, STACK);
#endif
#define NINT (NREG + NSTACK)
#define MAX_ARENAS 64
#define MAX_CALLS 4096

typedef struct { long i[NINT]; float f[NFLT]; } bound_call;

static int sock = 3;
static char buf[1 << 16];
static unsigned char *arenas[MAX_ARENAS + 1];
static uint64_t arena_size[MAX_ARENAS + 1];
static bound_call calls[MAX_CALLS];
static int ncalls = 1; /* handle 0: nothing */

static void answer(const void *msg, size_t len) {
    if (send(sock, msg, len, 0) < 0) _exit(71);
}

static void fail(const char *why) {
    char out[1024];
    int n = snprintf(out, sizeof out, "E%s", why);
    answer(out, (size_t)(n < (int)sizeof out ? n : (int)sizeof out - 1));
    _exit(0);
}

static int load_filter(const unsigned char *prog, uint32_t len) {
    struct sock_fprog fprog = {(unsigned short)(len / 8), (struct sock_filter *)prog};
    if (len == 0) return 0;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0);
}

static uint32_t u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void map_arena(void) {
    char data[12];
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {data, sizeof data};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    if (recvmsg(sock, &msg, 0) != (ssize_t)sizeof data) _exit(72);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS) { answer("eno arena descriptor", 20); return; }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    uint32_t id = u32(data);
    uint64_t size = u64(data + 4);
    void *p = id >= 1 && id <= MAX_ARENAS ? mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) { answer("ecannot map the arena", 21); return; }
    arenas[id] = p;
    arena_size[id] = size;
    answer("k", 1);
}

static void bind_call(const char *m, ssize_t len) {
    if (len < 5 || ncalls >= MAX_CALLS) { answer("etoo many bound calls", 21); return; }
    uint32_t n = u32(m + 1);
    const char *p = m + 5, *end = m + len;
    bound_call b;
    memset(&b, 0, sizeof b);
    int ni = 0, nf = 0;
    for (uint32_t a = 0; a < n; a++) {
        if (p >= end) { answer("etruncated argument list", 24); return; }
        char kind = *p++;
        if (kind == 'i' && p + 4 <= end && ni < NINT) { int32_t v; memcpy(&v, p, 4); b.i[ni++] = v; p += 4; }
        else if (kind == 'f' && p + 4 <= end && nf < NFLT) { memcpy(&b.f[nf++], p, 4); p += 4; }
        else if (kind == 'p' && p + 12 <= end && ni < NINT) {
            uint32_t id = u32(p);
            uint64_t off = u64(p + 4);
            if (id < 1 || id > MAX_ARENAS || !arenas[id] || off > arena_size[id]) { answer("eno such arena", 14); return; }
            b.i[ni++] = (long)(arenas[id] + off);
            p += 12;
        } else {
            answer("emore than 8 float or 16 int/pointer arguments", 46);
            return;
        }
    }
    calls[ncalls] = b;
    char out[5] = {'h'};
    uint32_t h = (uint32_t)ncalls++;
    memcpy(out + 1, &h, 4);
    answer(out, 5);
}

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#define LL_READ ((1ULL << 0) | (1ULL << 2) | (1ULL << 3)) /* execute, read a file, read a directory */

struct ll_ruleset { uint64_t handled_access_fs; };
struct ll_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

/* Files, where the kernel has Landlock: read-only, and only beneath the system's own directories (libraries,
 * /proc, /sys, /dev). No run directory, no worker's working directory, no other candidate's source or output:
 * they are the sandbox user's too, and the filter only stops writes. Later rules can only narrow this. */
static void confine_files(void) {
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, 1UL /* the ABI version */);
    if (abi < 1) return;
    struct ll_ruleset attr = {(1ULL << 13) - 1}; /* every right of ABI 1 */
    if (abi >= 2) attr.handled_access_fs |= 1ULL << 13; /* refer */
    if (abi >= 3) attr.handled_access_fs |= 1ULL << 14; /* truncate */
    if (abi >= 5) attr.handled_access_fs |= 1ULL << 15; /* ioctl on devices */
    int rules = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0UL);
    if (rules < 0) return;
    static const char *const roots[] = {"/usr", "/lib", "/lib64", "/lib32", "/etc", "/proc", "/sys", "/dev"};
    for (size_t r = 0; r < sizeof roots / sizeof *roots; r++) {
        int fd = open(roots[r], O_PATH | O_CLOEXEC);
        if (fd < 0) continue;
        struct ll_beneath rule = {LL_READ, fd};
        syscall(SYS_landlock_add_rule, rules, 1 /* path beneath */, &rule, 0UL);
        close(fd);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0) syscall(SYS_landlock_restrict_self, rules, 0UL);
    close(rules);
}

/* Closes every descriptor from `first` on: what the worker (or anything above it) left inheritable. */
static void close_from(unsigned first) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, first, ~0U, 0) == 0) return;
#endif
    struct rlimit r;
    long top = getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur != RLIM_INFINITY ? (long)r.rlim_cur : 65536;
    for (long fd = first; fd < top; fd++) close((int)fd);
}

int main(int argc, char **argv) {
    if (argc != 4) return 64;
    int calibration = argv[1][0] == 0;
    close_from(calibration ? 4 : 5); /* 5: this executable, which the worker started through a descriptor */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* reset by exec: no process of this user may read us */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (getppid() == 1) return 0;
    struct rlimit fsize; /* the worker's hard file-size limit leaves room for its shared buffers; ours is the soft one */
    if (getrlimit(RLIMIT_FSIZE, &fsize) != 0) return 71;
    fsize.rlim_max = fsize.rlim_cur;
    if (setrlimit(RLIMIT_FSIZE, &fsize) != 0) return 71;
    int threads = atoi(argv[2]);
    long cpu = atol(argv[3]);
    if (cpu > 0) {
        struct rlimit r;
        getrlimit(RLIMIT_CPU, &r);
        r.rlim_cur = (rlim_t)cpu;
        if (r.rlim_max != RLIM_INFINITY && r.rlim_cur > r.rlim_max) r.rlim_cur = r.rlim_max;
        setrlimit(RLIMIT_CPU, &r);
    }
    char nthreads[16];
    snprintf(nthreads, sizeof nthreads, "%d", threads > 0 ? threads : 1);
    setenv("OMP_NUM_THREADS", nthreads, 1);
    setenv("OMP_WAIT_POLICY", "passive", 1); /* an OpenMP pool sleeps between calls, it does not spin */

    ssize_t len = recv(sock, buf, sizeof buf, 0);
    if (len < 9 || buf[0] != 'F') return 73;
    uint32_t first = u32(buf + 1);
    if ((ssize_t)(9 + first) > len) return 73;
    uint32_t second = u32(buf + 5 + first);
    if ((ssize_t)(9 + first + second) > len) return 73;
    static unsigned char after[1 << 15];
    if (second > sizeof after) return 73;
    memcpy(after, buf + 9 + first, second);
    confine_files();
    if (load_filter((unsigned char *)buf + 5, first) != 0) fail("cannot load the system-call filter");

    kernel_fn kernel = 0;
    if (!calibration) {
        void *lib = dlopen("/proc/self/fd/4", RTLD_NOW | RTLD_LOCAL);
        if (!lib) fail(dlerror());
        kernel = (kernel_fn)dlsym(lib, argv[1]);
        if (!kernel) {
            char why[300];
            snprintf(why, sizeof why, "the library defines no function '%s'", argv[1]);
            fail(why);
        }
        close(4);
    }
    if (load_filter(after, second) != 0) fail("cannot load the system-call filter");
    answer("ok", 2);

    for (;;) {
        len = recv(sock, buf, sizeof buf, 0);
        if (len <= 0 || buf[0] == 'Q') return 0;
        if (buf[0] == 'K') {
            int real = 0;
            for (ssize_t p = 1; p + 4 <= len; p += 4) {
                uint32_t h = u32(buf + p);
                if (h == 0) continue;
                if (h >= (uint32_t)ncalls || !kernel) _exit(74);
                bound_call *c = &calls[h];
                const long *i = c->i;
                const float *f = c->f;
#if defined(__aarch64__)
                kernel(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7],
                       i[8], i[9], i[10], i[11], i[12], i[13], i[14], i[15], i[16], i[17]);
#else
                kernel(i[0], i[1], i[2], i[3], i[4], i[5], f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], i[6], i[7],
                       i[8], i[9], i[10], i[11], i[12], i[13], i[14], i[15]);
#endif
                real = 1;
            }
            if (real) fflush(stdout); /* what the kernel printed reaches the log now */
            answer("d", 1);
        } else if (buf[0] == 'M') {
            map_arena();
        } else if (buf[0] == 'B') {
            bind_call(buf, len);
        } else {
            answer("eunknown request", 16);
        }
    }
}

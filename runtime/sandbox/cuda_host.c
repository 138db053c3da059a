/* The CUDA candidate host: the only process a CUDA candidate's device code runs in (see runtime/sandbox/cuda_host.py).
 *
 * A fresh executable per candidate, with a CUDA context of its own: the worker's context, which holds the
 * reference's device buffers and its results, is another process's and out of reach of any kernel here.
 * Its code is ours; the candidate is device code only, so the events recorded here around its launch
 * are a clock it cannot touch. The driver is opened with dlopen (nothing links against libcuda), so this
 * builds on any machine with cuda.h.
 *
 * argv = host, kernel name, CPU seconds; descriptor 3 is the worker's socket (SOCK_SEQPACKET), 4 the
 * candidate's cubin, 5 the fill module's PTX, 6 this executable.
 *
 * First message: 'F' + u32 length + BPF program (loaded once the context and modules are up: the driver
 * opens its device files for writing) + u32 0. Answers 'ok' + u32 registers + u32 static shared bytes
 * + u32 L2 bytes once the cubin is loaded, or 'E' + why not. Then:
 *   'M', then (u32 id, u64 size) with a memfd: map a shared arena                          -> 'k'
 *   'A' u32 buffer, u64 bytes, u64 guard, u8 sentinel: allocate between two guard zones     -> 'k'
 *   'U' u32 buffer, u32 arena, u64 offset: upload the buffer's bytes from the arena         -> 'k'
 *   'D' u32 buffer, u32 arena, u64 offset: download them into the arena                     -> 'k'
 *   'P' u32 buffer, u8 byte: fill the buffer's bytes                                        -> 'k'
 *   'G' u32 buffer: are both guard zones intact                                             -> 'g' + u8
 *   'S' u32 buffer, u32 kind (0 f32, 1 f16, 2 bf16), u32 seed, f32 mean, f32 std: fresh values -> 'k'
 *   'B' 3 x u32 grid, 3 x u32 block, u32 shared, u32 n, n x ('p' u32 buffer | 'i' i32 | 'f' f32) -> 'h' + u32
 *   'R' u32 handle: launch and wait                                                         -> 'k'
 *   'T' u32 handle, u8 flush L2: launch between two events                                  -> 't' + f32 ms
 * A driver error answers 'E' + its name; after a fault the context is lost, and the worker ends the host.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
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
#include <sys/stat.h>
#include <unistd.h>

#define MAX_ARENAS 64
#define MAX_BUFFERS 256
#define MAX_CALLS 1024
#define MAX_ARGS 32

/* The driver's entry points, resolved from libcuda.so.1 (cuda.h maps some names to their _v2 symbols). */
#define DRIVER(X)                                                                                        \
    X(cuInit, "cuInit") X(cuDeviceGet, "cuDeviceGet") X(cuDeviceGetAttribute, "cuDeviceGetAttribute")   \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") X(cuCtxSetCurrent, "cuCtxSetCurrent")       \
    X(cuCtxSynchronize, "cuCtxSynchronize") X(cuModuleLoadData, "cuModuleLoadData")                     \
    X(cuModuleGetFunction, "cuModuleGetFunction") X(cuFuncGetAttribute, "cuFuncGetAttribute")           \
    X(cuFuncSetAttribute, "cuFuncSetAttribute") X(cuMemAlloc, "cuMemAlloc_v2")                          \
    X(cuMemsetD8, "cuMemsetD8_v2") X(cuMemcpyHtoD, "cuMemcpyHtoD_v2") X(cuMemcpyDtoH, "cuMemcpyDtoH_v2") \
    X(cuLaunchKernel, "cuLaunchKernel") X(cuEventCreate, "cuEventCreate") X(cuEventRecord, "cuEventRecord") \
    X(cuEventSynchronize, "cuEventSynchronize") X(cuEventElapsedTime, "cuEventElapsedTime")             \
    X(cuGetErrorName, "cuGetErrorName")
#define DECLARE(fn, sym) static __typeof__(fn) *p_##fn;
DRIVER(DECLARE)

typedef struct { CUdeviceptr base, ptr; uint64_t bytes, guard; unsigned char sentinel; } buffer;
typedef struct {
    unsigned grid[3], block[3], shared;
    int n;
    uint64_t value[MAX_ARGS]; /* each argument's bytes (a device pointer, an int, a float) */
    void *param[MAX_ARGS];
} bound_call;

static int sock = 3;
static char buf[1 << 16];
static unsigned char *arenas[MAX_ARENAS + 1];
static uint64_t arena_size[MAX_ARENAS + 1];
static buffer buffers[MAX_BUFFERS + 1];
static bound_call calls[MAX_CALLS];
static int ncalls = 1; /* handle 0: nothing */
static CUfunction kernel, fill;
static CUevent start, end;
static CUdeviceptr flush_buf;
static size_t flush_bytes;

static void answer(const void *msg, size_t len) {
    if (send(sock, msg, len, 0) < 0) _exit(71);
}

static void refuse(const char *why) {
    char out[1024];
    int n = snprintf(out, sizeof out, "E%s", why);
    answer(out, (size_t)(n < (int)sizeof out ? n : (int)sizeof out - 1));
}

static void fail(const char *why) {
    refuse(why);
    _exit(0);
}

/* True when the driver call succeeded; otherwise answers 'E' with the error's name. */
static int ok(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return 1;
    const char *name = 0;
    if (p_cuGetErrorName) p_cuGetErrorName(r, &name);
    char why[256];
    snprintf(why, sizeof why, "%s: %s (%d)", what, name ? name : "CUDA error", (int)r);
    refuse(why);
    return 0;
}

static int load_filter(const unsigned char *prog, uint32_t len) {
    struct sock_fprog fprog = {(unsigned short)(len / 8), (struct sock_filter *)prog};
    if (len == 0) return 0;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0);
}

static uint32_t u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static char *read_all(int fd, size_t *size) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return 0;
    char *data = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (data && got < (size_t)st.st_size) {
        ssize_t n = read(fd, data + got, (size_t)st.st_size - got);
        if (n <= 0) { free(data); return 0; }
        got += (size_t)n;
    }
    if (data) data[got] = 0; /* PTX is text */
    *size = got;
    close(fd);
    return data;
}

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
    if (!c || c->cmsg_type != SCM_RIGHTS) { refuse("no arena descriptor"); return; }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    uint32_t id = u32(data);
    uint64_t size = u64(data + 4);
    void *p = id >= 1 && id <= MAX_ARENAS ? mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) { refuse("cannot map the arena"); return; }
    arenas[id] = p;
    arena_size[id] = size;
    answer("k", 1);
}

static buffer *buffer_at(const char *p) {
    uint32_t id = u32(p);
    if (id < 1 || id > MAX_BUFFERS || !buffers[id].base) { refuse("no such buffer"); return 0; }
    return &buffers[id];
}

/* The arena bytes a transfer of buffer b at (arena, offset) covers, or 0 (answered) when they do not fit. */
static unsigned char *arena_span(const char *p, const buffer *b) {
    uint32_t id = u32(p);
    uint64_t off = u64(p + 4);
    if (id < 1 || id > MAX_ARENAS || !arenas[id] || off > arena_size[id] || b->bytes > arena_size[id] - off) {
        refuse("the transfer does not fit its arena");
        return 0;
    }
    return arenas[id] + off;
}

static void allocate(const char *m, ssize_t len) {
    if (len < 22) { refuse("truncated request"); return; }
    uint32_t id = u32(m + 1);
    if (id < 1 || id > MAX_BUFFERS || buffers[id].base) { refuse("bad buffer id"); return; }
    buffer b = {0, 0, u64(m + 5), u64(m + 13), (unsigned char)m[21]};
    size_t total = (size_t)(b.bytes + 2 * b.guard);
    if (!ok(p_cuMemAlloc(&b.base, total ? total : 1), "cuMemAlloc")) return;
    if (total && !ok(p_cuMemsetD8(b.base, b.sentinel, total), "cuMemsetD8")) return;
    b.ptr = b.base + b.guard;
    buffers[id] = b;
    answer("k", 1);
}

static void guards(const char *m, ssize_t len) {
    buffer *b = len >= 5 ? buffer_at(m + 1) : 0;
    if (!b) return;
    static unsigned char zone[1 << 16];
    int intact = 1;
    for (int side = 0; side < 2 && intact; side++) {
        CUdeviceptr at = side ? b->ptr + b->bytes : b->base;
        for (uint64_t done = 0; done < b->guard && intact; done += sizeof zone) {
            size_t n = (size_t)(b->guard - done < sizeof zone ? b->guard - done : sizeof zone);
            if (!ok(p_cuMemcpyDtoH(zone, at + done, n), "cuMemcpyDtoH")) return;
            for (size_t i = 0; i < n; i++) intact &= zone[i] == b->sentinel;
        }
    }
    char out[2] = {'g', (char)intact};
    answer(out, 2);
}

static void fresh_values(const char *m, ssize_t len) {
    buffer *b = len >= 21 ? buffer_at(m + 1) : 0;
    if (!b) return;
    uint32_t kind = u32(m + 5), seed = u32(m + 9);
    float mean, std;
    memcpy(&mean, m + 13, 4);
    memcpy(&std, m + 17, 4);
    unsigned long long count = b->bytes / (kind == 0 ? 4 : 2);
    void *args[] = {&b->ptr, &count, &kind, &seed, &mean, &std};
    if (!ok(p_cuLaunchKernel(fill, 1024, 1, 1, 256, 1, 1, 0, 0, args, 0), "fill") ||
        !ok(p_cuCtxSynchronize(), "fill")) return;
    answer("k", 1);
}

static void bind_call(const char *m, ssize_t len) {
    if (len < 33 || ncalls >= MAX_CALLS) { refuse("too many bound calls"); return; }
    bound_call c;
    memset(&c, 0, sizeof c);
    for (int i = 0; i < 3; i++) { c.grid[i] = u32(m + 1 + 4 * i); c.block[i] = u32(m + 13 + 4 * i); }
    c.shared = u32(m + 25);
    uint32_t n = u32(m + 29);
    const char *p = m + 33, *stop = m + len;
    if (n > MAX_ARGS) { refuse("more than 32 kernel arguments"); return; }
    for (uint32_t a = 0; a < n; a++) {
        if (p + 5 > stop) { refuse("truncated argument list"); return; }
        char kind = *p++;
        if (kind == 'p') {
            buffer *b = buffer_at(p);
            if (!b) return;
            memcpy(&c.value[a], &b->ptr, sizeof b->ptr);
        } else if (kind == 'i' || kind == 'f') {
            memcpy(&c.value[a], p, 4);
        } else {
            refuse("unknown argument kind");
            return;
        }
        c.param[a] = &calls[ncalls].value[a];
        p += 4;
    }
    c.n = (int)n;
    if (c.shared > 48 * 1024 &&
        !ok(p_cuFuncSetAttribute(kernel, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)c.shared),
            "cuFuncSetAttribute")) return;
    calls[ncalls] = c;
    char out[5] = {'h'};
    uint32_t h = (uint32_t)ncalls++;
    memcpy(out + 1, &h, 4);
    answer(out, 5);
}

static bound_call *call_at(const char *p) {
    uint32_t h = u32(p);
    if (h < 1 || h >= (uint32_t)ncalls) { refuse("no such call"); return 0; }
    return &calls[h];
}

static CUresult launch(bound_call *c) {
    return p_cuLaunchKernel(kernel, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1], c->block[2],
                            c->shared, 0, c->param, 0);
}

static void timed(const char *m, ssize_t len) {
    bound_call *c = len >= 6 ? call_at(m + 1) : 0;
    if (!c) return;
    if (m[5] && flush_bytes && !ok(p_cuMemsetD8(flush_buf, 0x3C, flush_bytes), "L2 flush")) return;
    float ms = 0;
    if (!ok(p_cuEventRecord(start, 0), "cuEventRecord") || !ok(launch(c), "launch") ||
        !ok(p_cuEventRecord(end, 0), "cuEventRecord") || !ok(p_cuEventSynchronize(end), "kernel") ||
        !ok(p_cuEventElapsedTime(&ms, start, end), "cuEventElapsedTime")) return;
    char out[5] = {'t'};
    memcpy(out + 1, &ms, 4);
    answer(out, 5);
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
    if (argc != 3) return 64;
    close_from(6); /* 6: this executable, which the worker started through a descriptor */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (getppid() == 1) return 0;
    struct rlimit fsize; /* the worker's hard file-size limit leaves room for its shared buffers; ours is the soft one */
    if (getrlimit(RLIMIT_FSIZE, &fsize) != 0) return 71;
    fsize.rlim_max = fsize.rlim_cur;
    if (setrlimit(RLIMIT_FSIZE, &fsize) != 0) return 71;
    long cpu = atol(argv[2]);
    if (cpu > 0) {
        struct rlimit r;
        getrlimit(RLIMIT_CPU, &r);
        r.rlim_cur = (rlim_t)cpu;
        if (r.rlim_max != RLIM_INFINITY && r.rlim_cur > r.rlim_max) r.rlim_cur = r.rlim_max;
        setrlimit(RLIMIT_CPU, &r);
    }
    ssize_t len = recv(sock, buf, sizeof buf, 0);
    if (len < 9 || buf[0] != 'F') return 73;
    uint32_t first = u32(buf + 1);
    if ((ssize_t)(9 + first) > len) return 73;
    static unsigned char filter[1 << 15];
    if (first > sizeof filter) return 73;
    memcpy(filter, buf + 5, first);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) fail("no NVIDIA driver (libcuda.so.1 not found)");
#define RESOLVE(fn, sym) if (!(p_##fn = (__typeof__(fn) *)dlsym(lib, sym))) fail("the driver lacks " sym);
    DRIVER(RESOLVE)
    CUdevice dev;
    CUcontext ctx;
    size_t cubin_size = 0, ptx_size = 0;
    char *cubin = read_all(4, &cubin_size), *ptx = read_all(5, &ptx_size);
    CUmodule module, fill_module;
    int l2 = 0, regs = 0, smem = 0;
    if (!cubin || !ptx) fail("cannot read the cubin or the fill module");
    if (!ok(p_cuInit(0), "cuInit") || !ok(p_cuDeviceGet(&dev, 0), "cuDeviceGet") ||
        !ok(p_cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
        !ok(p_cuCtxSetCurrent(ctx), "cuCtxSetCurrent") ||
        !ok(p_cuModuleLoadData(&fill_module, ptx), "the fill module") ||
        !ok(p_cuModuleGetFunction(&fill, fill_module, "evoforge_fill"), "the fill kernel"))
        _exit(0);
    if (p_cuModuleLoadData(&module, cubin) != CUDA_SUCCESS) fail("the driver cannot load the cubin");
    if (p_cuModuleGetFunction(&kernel, module, argv[1]) != CUDA_SUCCESS) {
        char why[300];
        snprintf(why, sizeof why, "the cubin defines no kernel '%s' (declare it extern \"C\")", argv[1]);
        fail(why);
    }
    free(cubin);
    free(ptx);
    if (!ok(p_cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, kernel), "cuFuncGetAttribute") ||
        !ok(p_cuFuncGetAttribute(&smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel), "cuFuncGetAttribute") ||
        !ok(p_cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev), "cuDeviceGetAttribute") ||
        !ok(p_cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate") ||
        !ok(p_cuEventCreate(&end, CU_EVENT_DEFAULT), "cuEventCreate"))
        _exit(0);
    flush_bytes = 2 * (size_t)(l2 > (1 << 20) ? l2 : (1 << 20));
    if (!ok(p_cuMemAlloc(&flush_buf, flush_bytes), "cuMemAlloc")) _exit(0);
    if (load_filter(filter, first) != 0) fail("cannot load the system-call filter");
    char out[14] = {'o', 'k'};
    uint32_t figures[3] = {(uint32_t)regs, (uint32_t)smem, (uint32_t)l2};
    memcpy(out + 2, figures, 12);
    answer(out, 14);

    for (;;) {
        len = recv(sock, buf, sizeof buf, 0);
        if (len <= 0 || buf[0] == 'Q') return 0;
        buffer *b;
        unsigned char *host;
        switch (buf[0]) {
        case 'M': map_arena(); break;
        case 'A': allocate(buf, len); break;
        case 'U':
        case 'D':
            if (len < 17 || !(b = buffer_at(buf + 1)) || !(host = arena_span(buf + 5, b))) break;
            if (buf[0] == 'U' ? ok(p_cuMemcpyHtoD(b->ptr, host, b->bytes), "cuMemcpyHtoD")
                              : ok(p_cuMemcpyDtoH(host, b->ptr, b->bytes), "cuMemcpyDtoH"))
                answer("k", 1);
            break;
        case 'P':
            if (len < 6 || !(b = buffer_at(buf + 1))) break;
            if (!b->bytes || ok(p_cuMemsetD8(b->ptr, (unsigned char)buf[5], b->bytes), "cuMemsetD8")) answer("k", 1);
            break;
        case 'G': guards(buf, len); break;
        case 'S': fresh_values(buf, len); break;
        case 'B': bind_call(buf, len); break;
        case 'R': {
            bound_call *c = len >= 5 ? call_at(buf + 1) : 0;
            if (c && ok(launch(c), "launch") && ok(p_cuCtxSynchronize(), "kernel")) answer("k", 1);
            break;
        }
        case 'T': timed(buf, len); break;
        default: refuse("unknown request");
        }
    }
}

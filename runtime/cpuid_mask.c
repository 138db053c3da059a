/* Preloaded (LD_PRELOAD) into a process, makes every CPUID instruction it runs, in every thread and child, answer
 * as a CPU with AVX2 and FMA and nothing wider: no AVX-512, AMX, AVX-VNNI, AVX-IFMA, GFNI, VAES or VPCLMULQDQ.
 * Libraries that pick their kernels from CPUID (ONNX Runtime's MLAS, OpenVINO's JIT, oneDNN, OpenBLAS, numpy)
 * then pick what such a CPU runs, with no setting of their own.
 *
 * How: the kernel makes CPUID fault (arch_prctl ARCH_SET_CPUID, on CPUs with CPUID faulting); the SIGSEGV handler
 * turns faulting off for its thread, runs the real instruction, turns it back on, clears the bits and steps over
 * it. A process that installs its own SIGSEGV handler keeps this one in front (sigaction and signal are wrapped),
 * and every other fault reaches its handler as before. SIGSEGV is never blocked (the handler runs with
 * SA_NODEFER, and the masks a process sets leave it out): a CPUID that faults while it is blocked would end the
 * process, in a handler's own code say, and blocking it holds back no fault anyway. It is a cap for fair races, not a boundary: code that
 * calls arch_prctl itself can lift it. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);
static struct sigaction theirs; /* the handler the process asked for: every fault that is not CPUID */
static volatile int active;
static volatile unsigned long answered;

int evoforge_cpuid_masked(void) { return active; }
unsigned long evoforge_cpuid_answered(void) { return answered; }

static void clear(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    enum { A, B, C, D };
    if (leaf == 7 && sub == 0) {
        /* AVX512F, DQ, IFMA, PF, ER, CD, BW, VL */
        r[B] &= ~(1u << 16 | 1u << 17 | 1u << 21 | 1u << 26 | 1u << 27 | 1u << 28 | 1u << 30 | 1u << 31);
        /* AVX512_VBMI, VBMI2, GFNI, VAES, VPCLMULQDQ, AVX512_VNNI, BITALG, VPOPCNTDQ */
        r[C] &= ~(1u << 1 | 1u << 6 | 1u << 8 | 1u << 9 | 1u << 10 | 1u << 11 | 1u << 12 | 1u << 14);
        /* AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX_BF16, AVX512_FP16, AMX_TILE, AMX_INT8 */
        r[D] &= ~(1u << 2 | 1u << 3 | 1u << 8 | 1u << 22 | 1u << 23 | 1u << 24 | 1u << 25);
    } else if (leaf == 7 && sub == 1) {
        r[A] &= ~(1u << 4 | 1u << 5 | 1u << 21 | 1u << 23); /* AVX_VNNI, AVX512_BF16, AMX_FP16, AVX_IFMA */
        r[D] &= ~(1u << 4 | 1u << 5 | 1u << 19);            /* AVX_VNNI_INT8, AVX_NE_CONVERT, AVX10 */
    } else if (leaf == 0xd && sub == 0) {
        r[A] &= ~(7u << 5 | 3u << 17); /* state the OS may enable: opmask and ZMM registers, AMX tiles */
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {
        r[A] = r[B] = r[C] = r[D] = 0; /* AMX tile and TMUL information, AVX10 */
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    /* CPUID faults as a general protection fault (SI_KERNEL): its bytes were just fetched, so they are readable */
    if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
        uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
        syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
        __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
        syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
        clear(leaf, sub, r);
        g[REG_RAX] = r[0], g[REG_RBX] = r[1], g[REG_RCX] = r[2], g[REG_RDX] = r[3];
        g[REG_RIP] += 2;
        answered++;
        return;
    }
    if (theirs.sa_flags & SA_SIGINFO) {
        theirs.sa_sigaction(sig, info, context);
    } else if (theirs.sa_handler != SIG_DFL && theirs.sa_handler != SIG_IGN) {
        theirs.sa_handler(sig);
    } else { /* the default: the faulting instruction runs again, and the fault ends the process as it would have */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &dfl, NULL);
    }
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV || !active) return real_sigaction(sig, act, old);
    if (old) *old = theirs;
    if (act) theirs = *act;
    return 0;
}

static const sigset_t *unblocking(int how, const sigset_t *set, sigset_t *copy) {
    if (!active || !set || how == SIG_UNBLOCK || !sigismember(set, SIGSEGV)) return set;
    *copy = *set; /* SIG_BLOCK or SIG_SETMASK: the same set, SIGSEGV left open */
    sigdelset(copy, SIGSEGV);
    return copy;
}

int sigprocmask(int how, const sigset_t *set, sigset_t *old) {
    static int (*real)(int, const sigset_t *, sigset_t *);
    if (!real) real = (int (*)(int, const sigset_t *, sigset_t *))dlsym(RTLD_NEXT, "sigprocmask");
    sigset_t copy;
    return real(how, unblocking(how, set, &copy), old);
}

int pthread_sigmask(int how, const sigset_t *set, sigset_t *old) {
    static int (*real)(int, const sigset_t *, sigset_t *);
    if (!real) real = (int (*)(int, const sigset_t *, sigset_t *))dlsym(RTLD_NEXT, "pthread_sigmask");
    sigset_t copy;
    return real(how, unblocking(how, set, &copy), old);
}

sighandler_t signal(int sig, sighandler_t handler) {
    if (sig != SIGSEGV || !active) {
        sighandler_t (*real_signal)(int, sighandler_t) = (sighandler_t(*)(int, sighandler_t))dlsym(RTLD_NEXT, "signal");
        return real_signal(sig, handler);
    }
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    return sigaction(sig, &act, &old) == 0 ? old.sa_handler : SIG_ERR;
}

__attribute__((constructor)) static void mask_cpuid(void) {
    real_sigaction = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_segv;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    if (!real_sigaction || real_sigaction(SIGSEGV, &act, &theirs) != 0) return;
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) { /* no CPUID faulting here: the process runs unmasked */
        real_sigaction(SIGSEGV, &theirs, NULL);
        return;
    }
    active = 1;
}

"""Landlock: the files a candidate's process may read. A C or CUDA host confines itself (``c_host.c`` does what
:func:`confine_files` does); an engine's host calls :func:`confine_files` before it loads any kernel."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterable

__all__ = ["SYSTEM_ROOTS", "confine_files", "confine_to_code"]


SYSTEM_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/etc", "/proc", "/sys", "/dev")
"""What a candidate's process may read beneath (besides what its caller adds): the system's own directories."""
_LANDLOCK_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read a file, read a directory


def confine_files(roots: Iterable[str] = SYSTEM_ROOTS, fds: Iterable[int] = ()) -> bool:
    """Where the kernel has Landlock, restricts this process (and what it starts) to reading files beneath
    ``roots`` and the directories open at ``fds``; nothing may be written, made or removed anywhere. Sets
    no_new_privs. ``c_host.c`` does the same for a C candidate's host. Returns whether it holds."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: its version
    if abi < 1:
        return False
    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = ctypes.c_uint64(handled)
    rules = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if rules < 0:
        return False

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        opened = []
        for root in dict.fromkeys(roots):
            with contextlib.suppress(OSError):
                opened.append(os.open(root, os.O_PATH | os.O_CLOEXEC))
        for fd in [*opened, *fds]:
            rule = Beneath(_LANDLOCK_READ, fd)
            libc.syscall(445, ctypes.c_int(rules), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        for fd in opened:
            os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return libc.syscall(446, ctypes.c_int(rules), ctypes.c_uint32(0)) == 0
    finally:
        os.close(rules)


def confine_to_code(cache_dir: str | None) -> bool:
    """:func:`confine_files` to what a Python host of candidate kernels reads: the system's directories, the
    interpreter's and evoforge's packages, and the compile cache (``cache_dir``; a ``/proc/self/fd`` path is
    opened through its descriptor). No run directory, no working directory, no source checkout around the
    packages (runs may live in it), no other candidate's source or output."""
    import genome
    import runtime

    ours = [os.path.dirname(m.__file__ or "") for m in (runtime, genome)]
    checkout = os.path.dirname(ours[0])
    closed = {os.getcwd(), *([] if checkout.endswith(("site-packages", "dist-packages")) else [checkout])}
    python = {p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *ours)
              if p and os.path.isdir(p) and os.path.abspath(p) not in closed}  # fmt: skip
    cache = os.open(cache_dir, os.O_PATH | os.O_DIRECTORY) if cache_dir else None
    try:
        return confine_files((*SYSTEM_ROOTS, *sorted(python)), [cache] if cache is not None else [])
    finally:
        if cache is not None:
            os.close(cache)

"""Process-level tuning that keeps large buffers off the slow path.

libzmq allocates a fresh buffer for every large incoming message, and numpy a fresh array
for every intermediate result of a training step. With glibc's defaults a buffer above the
mmap threshold is a new memory mapping, and freed memory at the top of the heap is handed
back to the system at once: every such buffer then faults in its pages afresh. That alone
capped ZeroMQ at ≈0.8 GB/s on 64 MiB messages on this machine kind,
against 2.3–3 GB/s once glibc reuses memory, and made the GPT step as bench/gpt_phases.py
runs it take about 20 % more CPU time (bench/RESULTS.md). :func:`tune_malloc` (called by
:func:`ringcomm.init` in every process) raises the mmap and trim thresholds so freed buffers
are reused. It trades returning memory to the system promptly for speed: the process keeps
what it freed, up to the trim threshold; ``RINGCOMM_MALLOC_TUNING=0`` turns it off. Older
glibc refuses an mmap threshold above 32 MiB; it then gets 32 MiB, and buffers of 32 MiB or
more are still mapped afresh there. If the C library refuses both, nothing is tuned.

:func:`raise_fd_limit` lifts the open-file limit to its hard maximum: every connection to
a rank's sockets holds a descriptor until it is dropped, and libzmq aborts the process when
it cannot make one.
"""
import ctypes
import ctypes.util
import logging
import os
import resource

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 << 20   # allocations up to 64 MiB come from the heap and are reused
OLD_GLIBC_MMAP_THRESHOLD = 32 << 20  # the most older glibc takes (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20  # keep up to 512 MiB of freed heap instead of returning it

mmap_threshold = None  # the mmap threshold applied, once both thresholds took


def tune_malloc():
    """Apply the thresholds once per process (glibc only); returns True if applied."""
    global mmap_threshold
    if mmap_threshold is not None or os.environ.get("RINGCOMM_MALLOC_TUNING", "1") == "0":
        return mmap_threshold is not None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing to tune
    threshold = next((t for t in (MMAP_THRESHOLD, OLD_GLIBC_MMAP_THRESHOLD)
                      if mallopt(M_MMAP_THRESHOLD, t)), None)
    if threshold is not None and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        mmap_threshold = threshold
        return True
    log.info("malloc tuning refused by this C library: large buffers are mapped afresh "
             "each time (slower; see ringcomm.transport.tuning)")
    return False


def raise_fd_limit():
    """Raise this process's soft limit on open files to the hard limit; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft
    return target

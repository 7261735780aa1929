"""A full memory barrier for Python code that shares memory with another process.

x86-64 keeps stores in order and loads in order, but lets a load pass an earlier store to
another address. A handshake where each side stores its own flag, then loads the other's
(the channel's sleeper flag against its head, see :mod:`.channel`) needs a barrier between
the two, and Python has none of its own: :func:`fence` reaches one through ctypes.

>>> head.value = published        # rank 0, the sender: the record is out...
>>> fence()                       # ...and visible before it reads the flag
>>> if sleeper.value: ring()      # rank 1 said it may be asleep on the bell
"""
import ctypes


def _fence_call():
    """The cheapest full memory barrier ctypes can reach: one locked add through libatomic
    (about 0.2 µs), else a spin lock's lock and unlock (two calls, about 0.4 µs)."""
    word = ctypes.c_uint32(0)
    ref = ctypes.byref(word)
    try:
        add = ctypes.CDLL("libatomic.so.1").__atomic_fetch_add_4
    except (OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.pthread_spin_init(ref, 0)
        lock, unlock = libc.pthread_spin_lock, libc.pthread_spin_unlock

        def fence():
            lock(ref)
            unlock(ref)
    else:
        add.restype = ctypes.c_uint32

        def fence():
            add(ref, 0, 5)  # 5: __ATOMIC_SEQ_CST; a lock-prefixed add on x86-64
    fence.__doc__ = ("A full memory barrier: a store before it is visible before any load "
                     "after it.")
    return word, fence


# the word the barrier's add (or lock) works on lives as long as the module
_fence_word, fence = _fence_call()

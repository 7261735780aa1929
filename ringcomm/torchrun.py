"""ringcomm's rendezvous beside a torch store: a port of its own, agreed through the store.

Two stores hold the port ringcomm's rank 0 would otherwise bind: torchrun's agent hosts a
TCPStore at ``MASTER_ADDR:MASTER_PORT`` and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``), and ``init_process_group`` makes one there itself
(the "ringcomm" torch backend). Either way rank 0 takes a free port on the rendezvous address
and publishes ``ADDR:PORT`` in the store, under a key named by a scope and how many worlds
this process joined this way before; every rank reads it there, and rank 0 deletes the key
once every rank has joined (torchrun keeps its store across restarts: a later generation
must never read a dead world's port). Needs torch, which torchrun comes with.

>>> info.master_port, forget = rendezvous_port(info, os.environ)   # in ringcomm.init
"""
import threading
from datetime import timedelta

from .env import free_port

_lock = threading.Lock()
_joins = 0  # worlds this process joined through a torch store


def uses_agent_store(environ):
    """True under a torchrun whose agent holds ``MASTER_PORT`` for its store."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def agree(store, rank, addr, scope):
    """``(addr, port, forget)``: the rendezvous rank 0 published in ``store`` (a free port on
    ``addr``, its own), and for rank 0 to call once every rank has joined: deletes the key."""
    global _joins
    with _lock:
        _joins += 1
        key = f"ringcomm/{scope}/{_joins}/rendezvous"
    if rank == 0:
        store.set(key, f"{addr}:{free_port(addr)}")
    host, port = store.get(key).decode().rsplit(":", 1)
    return host, int(port), lambda: store.delete_key(key)


def rendezvous_port(info, environ):
    """The port of ringcomm's rendezvous on ``info.master_addr``, agreed through torchrun's
    agent store (the others wait at most ``info.timeout`` for rank 0), and ``forget``."""
    from torch.distributed import TCPStore
    # the store is where torchrun says, whatever init() was told about ringcomm's rendezvous
    store = TCPStore(environ.get("MASTER_ADDR", info.master_addr), int(environ["MASTER_PORT"]),
                     is_master=False, timeout=timedelta(seconds=info.timeout))
    # a restart's processes count their joins from 1 again: the restart count keeps a key
    # left by a round that failed before it could forget it out of the next round's way
    scope = f"{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _, port, forget = agree(store, info.rank, info.master_addr, scope)
    return port, forget

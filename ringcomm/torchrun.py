"""Under torchrun: ringcomm's rendezvous beside torch's store.

torchrun's agent hosts a TCPStore at ``MASTER_ADDR:MASTER_PORT`` and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``), so ringcomm's rank 0 cannot bind that port. It takes a
free port on ``MASTER_ADDR`` instead and publishes it in the agent's store, under a key
named by the run and how many worlds this process joined before; every rank
reads it there; rank 0 deletes the key once every rank has joined. Needs torch, which
torchrun comes with.

>>> info.master_port, forget = rendezvous_port(info, os.environ)   # in ringcomm.init
"""
import threading
from datetime import timedelta

from .env import free_port

_lock = threading.Lock()
_joins = 0  # worlds this process joined through the agent's store


def uses_agent_store(environ):
    """True under a torchrun whose agent holds ``MASTER_PORT`` for its store."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def rendezvous_port(info, environ):
    """The port of ringcomm's rendezvous on ``info.master_addr``, agreed through the agent's
    store (rank 0 picks it; the others wait at most ``info.timeout`` for it), and a function
    for rank 0 to call once every rank has joined: it deletes the key, so that a later
    generation of workers (torchrun keeps its store across restarts) never reads this port."""
    global _joins
    from torch.distributed import TCPStore
    with _lock:
        _joins += 1
        key = f"ringcomm/{environ.get('TORCHELASTIC_RUN_ID', '')}/{_joins}/port"
    # the store is where torchrun says, whatever init() was told about ringcomm's rendezvous
    store = TCPStore(environ.get("MASTER_ADDR", info.master_addr), int(environ["MASTER_PORT"]),
                     is_master=False, timeout=timedelta(seconds=info.timeout))
    if info.rank == 0:
        store.set(key, str(free_port(info.master_addr)))
    return int(store.get(key)), lambda: store.delete_key(key)

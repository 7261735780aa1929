"""Under torchrun: ringcomm's rendezvous beside torch's store.

torchrun's agent hosts a TCPStore at ``MASTER_ADDR:MASTER_PORT`` and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``), so ringcomm's rank 0 cannot bind that port. It takes a
free port on ``MASTER_ADDR`` instead and publishes it in the agent's store, under a key
named by the run, the restart and how many worlds this process joined before; every rank
reads it there. Needs torch, which torchrun comes with.

>>> info.master_port = rendezvous_port(info, os.environ)   # in ringcomm.init, under torchrun
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
    store (rank 0 picks it); waits at most ``info.timeout`` for rank 0 to publish it."""
    global _joins
    from torch.distributed import TCPStore
    with _lock:
        _joins += 1
        key = "/".join(("ringcomm", environ.get("TORCHELASTIC_RUN_ID", ""),
                        environ.get("TORCHELASTIC_RESTART_COUNT", "0"), str(_joins), "port"))
    store = TCPStore(info.master_addr, info.master_port, is_master=False,
                     timeout=timedelta(seconds=info.timeout))
    if info.rank == 0:
        store.set(key, str(free_port(info.master_addr)))
    return int(store.get(key))

"""The test module bench/torch_suite.py hands to pytest: PyTorch's backend test suite
(``torch.testing._internal.distributed.distributed_test``) as one TestCase class, with the
plugin backends named in ``TORCH_SUITE_PLUGINS`` registered first.

Not run by hand; bench/torch_suite.py sets the environment (``BACKEND``, ``WORLD_SIZE``,
``TEMP_DIR``, ``INIT_METHOD``, ``TORCH_SUITE_PLUGINS="ringcomm=ringcomm.torch"``) and runs
``pytest bench/torch_suite_plugin.py``.

Why a module of its own: the suite starts each test's ranks with multiprocessing's *spawn*,
and a spawned rank unpickles its target, ``TestDistBackendWithSpawn._run``, by importing the
module that defines the class, i.e. this one. So every rank runs this module's top level
again: the plugin backend is registered (``import ringcomm.torch``) and the suite's feature
tables are patched in each rank as in pytest's own process, and always before
``distributed_test`` is imported, whose decorators read those tables (and ``BACKEND``,
``WORLD_SIZE``) once, when the module is imported.

``TORCH_SUITE_AS=ringcomm`` with ``BACKEND=gloo`` (the driver's backend ``ringcomm-as-gloo``):
the suite runs as for Gloo, taking every skip and branch it keeps for Gloo by name, but each
group torch.distributed creates for "gloo" is a ringcomm group (:func:`run_as`). Both
``init_process_group(backend="gloo")`` and ``new_group`` (``backend="gloo"`` or the default
group's) create their groups in ``distributed_c10d._new_process_group_helper``, which records
the backend it was given; so ``dist.get_backend(group)`` says "ringcomm", and
``dist.monitored_barrier`` is ringcomm's (``import ringcomm.torch`` installs it), which sends
ringcomm groups to their own method before torch's "only implemented for GLOO" check.
"""
import functools
import importlib
import os

import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

# The suite's features a plugin backend claims (TORCH_SUITE_FEATURES overrides): "plugin"
# makes require_backend_is_available accept it, "ddp" and "subgroup" unskip the
# DistributedDataParallel and new_group tests.
FEATURES = ("plugin", "ddp", "subgroup")


def plugins(spec=None):
    """``{backend: module}`` from ``"name=module,name=module"`` (``TORCH_SUITE_PLUGINS``)."""
    spec = os.environ.get("TORCH_SUITE_PLUGINS", "") if spec is None else spec
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, module = item.partition("=")
        out[name.strip()] = module.strip() or name.strip()
    return out


def register(backend):
    """Import ``backend``'s module if it is a plugin (its import registers the backend with
    torch.distributed) and claim the suite's FEATURES for it."""
    module = plugins().get(backend)
    if module is None:
        return False
    importlib.import_module(module)
    features = os.environ.get("TORCH_SUITE_FEATURES") or ",".join(FEATURES)
    for feature in filter(None, (f.strip() for f in features.split(","))):
        DistTestCases.backend_feature.setdefault(feature, set()).add(backend)
    return True


def run_as(name, real):
    """Make every group torch.distributed creates for backend ``name`` (alone, or a device's
    entry of "cpu:gloo,cuda:nccl") a group of backend ``real`` instead."""
    c10d = dist.distributed_c10d
    helper = c10d._new_process_group_helper

    def swap(spec):
        parts = [part.rpartition(":") for part in str(spec).split(",")]
        return dist.Backend(",".join(dev + sep + (real if b == name else b) for dev, sep, b in parts))

    @functools.wraps(helper)
    def _new_process_group_helper(group_size, group_rank, global_ranks, backend, *args, **kwargs):
        return helper(group_size, group_rank, global_ranks, swap(backend), *args, **kwargs)

    c10d._new_process_group_helper = _new_process_group_helper


if os.environ.get("TORCH_SUITE_AS"):
    register(os.environ["TORCH_SUITE_AS"])
    run_as(os.environ["BACKEND"], os.environ["TORCH_SUITE_AS"])
else:
    register(os.environ["BACKEND"])

# Only now: the suite's skip decorators are evaluated as it is imported.
from torch.testing._internal.distributed import distributed_test as _suite  # noqa: E402


class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    """Every test of the suite; each one spawns WORLD_SIZE ranks (what PyTorch's
    test/distributed/test_distributed_spawn.py defines)."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()

"""The process-group names each supported torch calls (ringcomm.torch.versions): that
ProcessGroupRingcomm defines every one, that the installed torch calls no other, and that
the other versions' spellings give what process_group.py's own verbs give (one rank)."""
import ast
import pathlib
import re
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs PyTorch")

import torch.distributed as dist  # noqa: E402
from torch.distributed import _functional_collectives as funcol  # noqa: E402
from torch.distributed.distributed_c10d import (AllgatherOptions, AllToAllOptions,  # noqa: E402
                                                ReduceScatterOptions)

import ringcomm.torch  # noqa: E402,F401  (registers the backend)
from ringcomm.torch.process_group import ProcessGroupRingcomm  # noqa: E402
from ringcomm.torch.versions import BASE, NAMES, VersionNames  # noqa: E402

pytestmark = pytest.mark.timeout(60)

VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])
# torch's modules that call methods on group objects (paths under torch/; folders recursively)
SCANNED = ("distributed/distributed_c10d.py", "distributed/device_mesh.py",
           "distributed/_functional_collectives.py", "distributed/algorithms/join.py",
           "distributed/algorithms/ddp_comm_hooks", "distributed/algorithms/_comm_hooks",
           "distributed/optim/zero_redundancy_optimizer.py", "distributed/fsdp",
           "distributed/_composable", "distributed/checkpoint/_pg_transport.py",
           "nn/parallel/distributed.py")


def _last(node):
    """The last identifier of a call's receiver: ``group`` in ``self.group.f()``,
    ``_get_default_group`` in ``_get_default_group().f()``."""
    if isinstance(node, ast.Call):
        return _last(node.func)
    if isinstance(node, ast.Subscript):
        return _last(node.value)
    return getattr(node, "id", None) or getattr(node, "attr", "")


def called_names(root, methods):
    """The ``methods`` that torch's sources under ``root`` call as ``R.name(...)`` on a
    receiver R whose last identifier contains "pg" or "group"."""
    names = set()
    for rel in SCANNED:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []:
            for n in ast.walk(ast.parse(f.read_text(), str(f))):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in methods
                        and re.search("pg|group", _last(n.func.value), re.I)):
                    names.add(n.func.attr)
    return names


def _definer(name):
    return next((c for c in ProcessGroupRingcomm.__mro__ if name in vars(c)), None)


@pytest.mark.parametrize("version", sorted(NAMES))
def test_every_name_a_version_calls_is_ours(version):
    missing = [n for n in NAMES[version] if _definer(n) is None or not _definer(n).__module__.startswith("ringcomm.")]
    assert not missing, (f"torch {version} calls {missing}, which fall through to torch's C++ ProcessGroup "
                         f"(is ProcessGroupRingcomm(VersionNames, dist.ProcessGroup)?)")


def test_the_installed_torch_calls_no_name_the_table_lacks():
    assert VERSION in NAMES, f"torch {VERSION} is not one of ringcomm.torch.versions.NAMES {sorted(NAMES)}"
    root = pathlib.Path(torch.__file__).parent
    assert (root / SCANNED[0]).exists()
    called = called_names(root, set(dir(dist.ProcessGroup))) - BASE
    assert {"allreduce", "broadcast", "send"} <= called  # the rule still finds the verbs
    assert not called - set(NAMES[VERSION]), f"torch {VERSION} also calls {sorted(called - set(NAMES[VERSION]))}"


# -- the spellings at world size 1 --------------------------------------------------------------
@pytest.fixture(scope="module")
def pg():
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("ringcomm", rank=0, world_size=1, store=dist.HashStore())
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


def _opts(cls, async_op, **fields):
    opts = cls()
    opts.asyncOp = async_op
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


def _tensor_forms(async_op):
    """(2.11's spelling, process_group.py's, the arguments after the tensors, the output / x)."""
    triple = dist._make_nccl_premul_sum(3.0)  # shows the options reach the verb
    return [("_allgather_base", "all_gather_single", [_opts(AllgatherOptions, async_op)], 1),
            ("_reduce_scatter_base", "reduce_scatter_single",
             [_opts(ReduceScatterOptions, async_op, reduceOp=triple)], 3),
            ("alltoall_base", "all_to_all_single", [[], [], _opts(AllToAllOptions, async_op)], 1),
            ("alltoall_base", "all_to_all_single", [[6], [6], _opts(AllToAllOptions, async_op)], 1)]


@pytest.mark.parametrize("async_op", [False, True])
def test_older_spellings_give_what_the_verbs_give(pg, async_op):
    x = torch.arange(1.0, 7.0)
    for spelling, verb, rest, factor in _tensor_forms(async_op):
        spelt, verbs = torch.zeros(6), torch.zeros(6)
        getattr(pg, spelling)(spelt, x, *rest).wait()
        getattr(pg, verb)(verbs, x, *rest).wait()
        assert torch.equal(spelt, verbs) and torch.equal(spelt, factor * x), spelling
    out = torch.zeros(6)
    pg.alltoall_base(out, x, [], [], timedelta(seconds=30)).wait()  # the binding's timeout form
    assert torch.equal(out, x)


@pytest.mark.parametrize("async_op", [False, True])
def test_coalesced_spellings_give_what_the_verbs_give(pg, async_op):
    xs = [torch.arange(1.0, 5.0), torch.arange(10.0, 13.0)]
    # 2.13's spelling, process_group.py's (2.11's)
    for spelling, verb, opts in [("all_gather_single_coalesced", "allgather_into_tensor_coalesced",
                                  _opts(AllgatherOptions, async_op)),
                                 ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
                                  _opts(ReduceScatterOptions, async_op, reduceOp=dist.ReduceOp.SUM))]:
        spelt, verbs = [torch.zeros_like(x) for x in xs], [torch.zeros_like(x) for x in xs]
        getattr(pg, spelling)(spelt, xs, opts).wait()
        getattr(pg, verb)(verbs, xs, opts).wait()
        assert all(torch.equal(a, b) and torch.equal(a, x) for a, b, x in zip(spelt, verbs, xs, strict=True)), spelling


def test_torch_2_11s_coalesced_all_gather_without_options(pg):
    x, out = torch.arange(1.0, 5.0), torch.zeros(4)
    pg.allgather_into_tensor_coalesced([out], [x]).wait()  # 2.11's _coalescing_manager call
    assert torch.equal(out, x)


def _through_torch(pg, case):
    """(what came out, what should have) of one of torch's own functions on the group."""
    x, y = torch.arange(1.0, 7.0), torch.arange(3.0)
    outs = [torch.zeros(6), torch.zeros(3)]
    if case.startswith("coalesced "):
        verb = getattr(dist, case.split()[1])
        with dist._coalescing_manager(group=pg):
            for out, t in zip(outs, (x, y), strict=True):
                verb(out, t, group=pg)
        return outs, [x, y]
    if not case.startswith("functional "):
        getattr(dist, case)(outs[0], x, group=pg)
        return outs[:1], [x]
    c10d, name = torch.ops._c10d_functional, pg.group_name
    started = {"all_gather_into_tensor": lambda: c10d.all_gather_into_tensor(x, 1, name),
               "reduce_scatter_tensor": lambda: c10d.reduce_scatter_tensor(x, "sum", 1, name),
               "all_to_all_single": lambda: c10d.all_to_all_single(x, [6], [6], name)}[case.split()[1]]()
    return [funcol.wait_tensor(started)], [x]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # 2.13 deprecates the *_tensor names
@pytest.mark.parametrize("case", [
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "coalesced all_gather_into_tensor",
    "coalesced reduce_scatter_tensor", "functional all_gather_into_tensor",
    "functional reduce_scatter_tensor", "functional all_to_all_single"])
def test_torchs_own_functions_reach_ringcomms_verbs(pg, case):
    """Whichever names the installed torch calls: its Python's, or (the functional
    collectives) its C++'s, which call the group's Python methods by name."""
    got, want = _through_torch(pg, case)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), case


def test_the_mixin_holds_methods_alone():
    # it sits between ProcessGroupRingcomm and the pybind11 base, whose __init__ must run
    assert all(callable(v) for k, v in vars(VersionNames).items() if not k.startswith("__"))
    assert "__init__" not in vars(VersionNames)

"""The package's import graph, read from the source: no cycle, and no module importing a
layer above its own (trainer -> communicator -> algorithms -> transport / device; inside the
trainer, models -> parallel -> accounting)."""
import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ringcomm"

# layer -> the modules and packages it must never import (every import, lazy ones too)
ABOVE = {
    "ringcomm.transport": ("ringcomm.session", "ringcomm.comm", "ringcomm.collective", "ringcomm.engine",
                           "ringcomm.link", "ringcomm.algorithms", "ringcomm.train", "ringcomm.torch", "ringcomm.device"),
    # the protocol over the wire: below every layer that makes calls
    "ringcomm.session": ("ringcomm.comm", "ringcomm.collective", "ringcomm.engine", "ringcomm.link",
                         "ringcomm.algorithms", "ringcomm.train", "ringcomm.torch", "ringcomm.device"),
    "ringcomm.device": ("ringcomm.comm", "ringcomm.collective", "ringcomm.engine", "ringcomm.link",
                        "ringcomm.algorithms", "ringcomm.train", "ringcomm.torch", "ringcomm.transport"),
    "ringcomm.arrays": ("ringcomm.comm", "ringcomm.device", "ringcomm.transport", "ringcomm.train"),
    "ringcomm.algorithms": ("ringcomm.comm", "ringcomm.train", "ringcomm.torch"),
    "ringcomm.comm": ("ringcomm.train", "ringcomm.torch"),
    # the trainer's rooms: the model maths, how it is split over ranks, what it costs
    "ringcomm.train.models": ("ringcomm.train.parallel.strategy", "ringcomm.train.parallel.zero",
                              "ringcomm.train.parallel.step", "ringcomm.train.optim", "ringcomm.train.trainer"),
    "ringcomm.train.parallel": ("ringcomm.train.models", "ringcomm.train.trainer"),
    "ringcomm.train.accounting": ("ringcomm.train.models", "ringcomm.train.parallel", "ringcomm.train.trainer"),
}


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports():
    """module -> the ringcomm modules it imports (submodules resolved where they exist)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            found.update(t for t in targets if t in files and t != name)
        graph[name] = found
    return graph


def test_the_reader_sees_the_imports_it_should():
    graph = imports()
    assert "ringcomm.device.staged" in graph["ringcomm.device.cuda"]
    assert "ringcomm.device.cuda" in graph["ringcomm.device"]  # a lazy import, inside select()
    assert "ringcomm.arrays" in graph["ringcomm.train.parallel.strategy"]


def test_the_import_graph_has_no_cycle():
    try:
        tuple(graphlib.TopologicalSorter(imports()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"an import cycle: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_module_imports_a_layer_above_its_own(layer):
    wrong = sorted((module, target) for module, targets in imports().items()
                   if module == layer or module.startswith(layer + ".")
                   for target in targets
                   if any(target == up or target.startswith(up + ".") for up in ABOVE[layer]))
    assert not wrong, f"imports that point up from {layer}: {wrong}"


def test_the_public_api_is_annotated_as_py_typed_promises():
    import inspect
    import typing

    import ringcomm
    from ringcomm.comm import Communicator
    from ringcomm.engine import Work
    assert (PACKAGE / "py.typed").exists()
    public = [ringcomm.init]
    for cls in (Communicator, Work):
        for name, member in vars(cls).items():
            if name.startswith("_") and name not in ("__enter__", "__exit__"):
                continue
            member = member.fget if isinstance(member, property) else member
            if callable(member):
                public.append(member)
    assert len(public) > 25
    bare = []
    for fn in public:
        hints = typing.get_type_hints(fn)  # every annotation resolves
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        bare += [f"{fn.__qualname__}({p})" for p in params + ["return"] if p not in hints]
    assert not bare, f"not annotated: {bare}"


def test_no_module_is_past_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules past 400 lines: {long}"
    assert len((PACKAGE / "comm.py").read_text().splitlines()) < 320, "comm.py holds the verbs only"

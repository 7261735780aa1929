"""Where the GPT's training step spends its CPU time, phase by phase, beside PyTorch's.

    python bench/gpt_phases.py [--rounds 5] [--steps 8] [--out bench/out]

The trainer's GPT (``--n-layer 4``, ``--d-model 256``, ``--n-head 4``, ``--seq-len 128``,
vocabulary 256, ``--batch 16``: 3.26 M parameters, 2048 tokens a step), fp32, one thread,
on the same parameters and tokens three ways, each in a process of its own and the three
alternated round by round:

- **ringcomm**: the model's layers (``ringcomm.train.models.gpt``) run as the trainer's
  one-process step runs them: embedding, blocks and head forward, the loss, the head,
  blocks and embedding backward, then Adam on the whole flat fp32 buffer
  (``ringcomm.train.optim.Adam``);
- **ringcomm, malloc untuned**: the same with ``RINGCOMM_MALLOC_TUNING=0`` (glibc's own
  thresholds: large arrays mapped and faulted in afresh, freed memory handed back);
- **torch**: bench/torch_models.py's ``GPT`` forward with its loss, ``backward`` and
  ``torch.optim.Adam``.

Each phase's time is CPU time (``time.process_time``), which a busy machine disturbs far
less than the wall clock: the median over ``--steps`` after two warm-up steps in a process,
then over ``--rounds``. Writes ``gpt_phases.json`` and prints the table.
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("ringcomm", "ringcomm-untuned", "torch")
WARMUP = 2


def _problem(ns):
    import numpy as np

    from ringcomm.train.models.gpt import GPTShape, gpt_init
    shape = GPTShape(256, ns.seq_len, ns.d_model, ns.n_head, ns.n_layer)
    rng = np.random.default_rng(0)
    x = rng.integers(0, shape.vocab, (ns.batch, ns.seq_len))
    y = rng.integers(0, shape.vocab, (ns.batch, ns.seq_len))
    return shape, gpt_init(shape, 0), x, y


def phase(layer):
    """The phase a layer's time is counted in: the embedding, the head, or the blocks."""
    return layer.name if layer.name in ("embedding", "head") else "blocks"


def _ringcomm_step(model, params, x, y, adam, flat, flat_grad, grad_views):
    """{phase: CPU s} of one step."""
    tick, phases = time.process_time(), {}

    def mark(name):
        nonlocal tick
        now = time.process_time()
        phases[name] = phases.get(name, 0.0) + now - tick
        tick = now
    caches, h = [], x
    for layer in model.layers:
        h, cache = layer.forward([params[g] for g in layer.params], h)
        caches.append(cache)
        mark(f"{phase(layer)} forward")
    _, grad = model.loss(h, y, y.size)
    mark("loss")
    for layer, cache in zip(reversed(model.layers), reversed(caches), strict=True):
        grads, grad = layer.backward([params[g] for g in layer.params], cache, grad)
        for g, piece in zip(layer.params, grads, strict=True):
            grad_views[g] += piece  # the tied wte gets the head's and the embedding's
        mark(f"{phase(layer)} backward")
    adam.begin_step()
    adam.update(flat, flat_grad)
    flat_grad[...] = 0
    mark("optimizer")
    return phases


def _ringcomm(ns):
    import numpy as np

    from ringcomm.train.models import gpt
    from ringcomm.train.optim import Adam
    from ringcomm.transport.tuning import tune_malloc
    tune_malloc()  # as ringcomm.init() does (RINGCOMM_MALLOC_TUNING=0 leaves it off)
    shape, init, x, y = _problem(ns)
    model = gpt.GPT(shape, gpt.Context(shape))
    flat = np.concatenate([p.reshape(-1) for p in init])
    flat_grad = np.zeros_like(flat)
    offsets = np.cumsum([0] + [p.size for p in init])
    params = [flat[a:b].reshape(p.shape) for a, b, p in zip(offsets[:-1], offsets[1:], init, strict=True)]
    grad_views = [flat_grad[a:b].reshape(p.shape) for a, b, p in zip(offsets[:-1], offsets[1:], init, strict=True)]
    adam = Adam(flat.size)
    return [_ringcomm_step(model, params, x, y, adam, flat, flat_grad, grad_views)
            for _ in range(ns.steps + WARMUP)][WARMUP:]


def _torch(ns):
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import torch_models
    shape, init, x, y = _problem(ns)
    model = torch_models.GPT(init, shape.n_head, shape.n_layer)
    opt = torch.optim.Adam(model.parameters())
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    steps = []
    for _ in range(ns.steps + WARMUP):
        t0 = time.process_time()
        loss = model(tx, ty)
        t1 = time.process_time()
        loss.backward()
        t2 = time.process_time()
        opt.step()
        opt.zero_grad()
        t3 = time.process_time()
        steps.append({"forward (with the loss)": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
    return steps[WARMUP:]


def _worker(ns):
    steps = _torch(ns) if ns.worker == "torch" else _ringcomm(ns)
    phases = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
    phases["step"] = statistics.median(sum(s.values()) for s in steps)
    json.dump(phases, sys.stdout)


def _table(table):
    ours = [name for name in table["ringcomm"] if name != "step"]
    lines = ["| phase | ringcomm CPU ms | malloc untuned | torch CPU ms |", "|---|---:|---:|---:|"]
    for name in ours:
        lines.append(f"| {name} | {table['ringcomm'][name]:.1f} | {table['ringcomm-untuned'][name]:.1f} | |")
    for name in (n for n in table["torch"] if n != "step"):
        lines.append(f"| torch: {name} | | | {table['torch'][name]:.1f} |")
    step = {kind: table[kind]["step"] for kind in KINDS}
    lines.append(f"| **step** | **{step['ringcomm']:.1f}** | {step['ringcomm-untuned']:.1f} | **{step['torch']:.1f}** |")
    lines.append(f"\nringcomm / torch {step['ringcomm'] / step['torch']:.3f}; "
                 f"untuned / tuned {step['ringcomm-untuned'] / step['ringcomm']:.3f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--worker", choices=("ringcomm", "torch"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return _worker(ns)
    one_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    flags = [f"--{k.replace('_', '-')}={getattr(ns, k)}" for k in ("steps", "batch", "seq_len", "d_model", "n_head", "n_layer")]
    seen = {kind: collections.defaultdict(list) for kind in KINDS}
    for r in range(ns.rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            env = {**os.environ, **one_thread, "RINGCOMM_MALLOC_TUNING": "0" if kind.endswith("untuned") else "1"}
            worker = "torch" if kind == "torch" else "ringcomm"
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", worker, *flags],
                                  capture_output=True, text=True, env=env, timeout=900)
            if done.returncode:
                raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
            for name, seconds in json.loads(done.stdout).items():
                seen[kind][name].append(seconds)
        print(f"round {r + 1}/{ns.rounds} done", flush=True)
    table = {kind: {name: statistics.median(v) * 1e3 for name, v in phases.items()} for kind, phases in seen.items()}
    text = _table(table)
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "gpt_phases.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(ns).items() if k != "worker"}, "cpu_ms": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``make gpu-check``: everything that needs a GPU, in one short script (``--budget``, 540 s).

Run on a machine with a CUDA GPU and CuPy (one without network and without pyzmq gets it as
a wheel in ``.whl/``, see the README). Steps:

1. environment: CuPy version, devices; then first light: each of the four kernel modules
   compiled (a failure names the module) and a one-segment staged all-reduce on 2 workers;
2. the PyTorch backend with CUDA tensors (``import ringcomm.torch`` on 2 workers sharing the
   GPU): all-reduce of float32 and bfloat16 tensors, an all-gather into one tensor, and 5 DDP
   steps of a small model, each checked against its closed form or a one-process run (early:
   it depends on the GPU image's torch);
3. the subnormal probe: the fp32 kernels on subnormal operands (sum, product, max/min ties
   against zero, the avg division, scale, the fp16 cast, unscale, the inf/NaN check, an
   Adam step, the fp64 norm), bit for bit with their numpy references;
4. ``pytest tests/gpu`` on the real CuPy, in four steps: the kernels against their numpy
   references; every collective on CuPy arrays at N = 2 and 4 against numpy; the stream
   order probes (the caller on a non-blocking stream, and with per-thread default streams);
   a few training steps of six layouts (ddp, zero3, zero2 offloaded in fp32 and fp16, and
   zero2 fp16 and ddp fp32 with clipping) against the same run on the CPU;
5. collectives on the GPU: ring vs parameter-server all-reduce at 4 and 64 MiB on 4 workers
   sharing the GPU(s), of CuPy arrays (staged through pinned memory) and of numpy arrays
   (the CPU path) in the same job, checked against the closed form, timed (median of 5);
6. one short training run (TRAINING_STEPS steps) per strategy with ``--device gpu`` (dp,
   ddp, zero1, zero2, zero3, zero2 + offload) in fp16, and the GPT on cp2, tp2 + sp (zero3)
   and pp2 (zero1, recompute), each checked to finish.

Every step is a fresh process group (killed whole when its time is up; ranks a launcher
started in sessions of their own die with it, by their parent-death signal) and all of them share one CuPy kernel cache (``CUPY_CACHE_DIR``, kept across runs),
so a kernel is compiled once per machine, not once per process. Each step's seconds are in
the JSON (``step_seconds``).

``--standin`` runs the same steps on the CPU against the CuPy stand-in of ``tests/standin``
(the tests/gpu selections take its cases instead of the real CuPy's; the torch step, which
needs CUDA tensors, is recorded as skipped): the scripts, the step list, the JSON and the
time limits are tried before a GPU machine's few minutes are spent on them.

Results go to ``OUT/gpu_check.json`` (``--out``; default ``bench/out``) and a summary to
stdout. The JSON is written after every step and names the steps that did not run, so a run
cut short (its own ``--budget`` of seconds, a step's time limit, no GPU at all) still says
what it measured: a step that runs out of time is recorded as timed out, and steps left
when the budget is spent are listed under ``not_run``.
"""
import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

STRATEGIES = [("dp", []), ("ddp", []), ("zero1", []), ("zero2", []), ("zero3", []), ("zero2", ["--offload"]),
              ("zero2", ["--offload", "--precision", "fp32"]),  # host master weights, device gradients
              # the GPT on each model-parallel dimension (2 ranks sharing the GPU)
              ("ddp", ["--model", "gpt", "--cp", "2"]), ("zero3", ["--model", "gpt", "--tp", "2", "--sp"]),
              ("zero1", ["--model", "gpt", "--pp", "2", "--micro-batches", "2", "--recompute"])]
TRAINING_STEPS = 10
CACHE_DIR = os.path.join(tempfile.gettempdir(), "ringcomm-cupy-cache")  # CuPy's compiled kernels
FIRST_LIGHT = r'''
import json, cupy as cp, numpy as np, ringcomm
from ringcomm import kernels
comm = ringcomm.init(device="gpu")
checks = {}
for name in kernels.SOURCES:  # each module by name: a compile error says which
    try:
        kernels._module(name, comm._device.index)
        checks[f"compile {name}"] = True
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        checks[f"compile {name}"] = f"{type(exc).__name__}: {exc}"[:800]
x = cp.full(1024, comm.rank + 1, cp.float32)  # one segment, staged through pinned memory
comm.all_reduce(x)
checks["staged all_reduce"] = bool((x == comm.world_size * (comm.world_size + 1) / 2).all())
if comm.rank == 0:
    print("FIRSTLIGHT " + json.dumps(checks))
'''
BENCH = r'''
import json, statistics, sys, time
import cupy as cp, numpy as np, ringcomm
comm = ringcomm.init(device="gpu")
n, r, rows = comm.world_size, comm.rank, []
for size in (1 << 22, 1 << 26):
    for algo in ("ring", "ps"):
        for xp in (cp, np):  # alternated: device arrays (staged), then host arrays
            x = xp.full(size // 4, r + 1, xp.float32)
            times, wrong = [], 0
            for i in range(6):
                x.fill(r + 1); cp.cuda.get_current_stream().synchronize(); comm.barrier()
                t = time.perf_counter(); comm.all_reduce(x, algorithm=algo); cp.cuda.get_current_stream().synchronize()
                times.append(time.perf_counter() - t)
                wrong += int((x != n * (n + 1) / 2).sum())
            med = statistics.median(times[1:])
            rows.append({"bytes": size, "algorithm": algo, "arrays": "gpu" if xp is cp else "cpu", "time_s": med,
                         "busbw_GBps": size / med * 2 * (n - 1) / n / 1e9, "wrong": wrong})
if r == 0:
    print("GPUBENCH " + json.dumps({"world_size": n, "device": comm.device, "rows": rows}))
'''

TORCH_CHECK = r'''
import json, os, torch, torch.distributed as dist
import ringcomm.torch
dist.init_process_group("ringcomm")
r, n = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())  # the rank's GPU
checks = {}
for dtype in (torch.float32, torch.bfloat16):
    t = torch.full((1 << 20,), float(r + 1), dtype=dtype, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    checks[f"all_reduce {dtype}"] = bool((t == n * (n + 1) / 2).all())
whole = torch.empty(4 * n, device="cuda")
dist.all_gather_into_tensor(whole, torch.full((4,), float(r), device="cuda"))
checks["all_gather_into_tensor"] = whole.cpu().tolist() == [float(i) for i in range(n) for _ in range(4)]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
alone = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
alone.load_state_dict(net.state_dict())
ddp = torch.nn.parallel.DistributedDataParallel(net)
opt, ref = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(alone.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for _ in range(5):
    xs = [torch.randn(8, 32, generator=g) for _ in range(n)]
    ys = [torch.randn(8, 1, generator=g) for _ in range(n)]
    torch.nn.functional.mse_loss(ddp(xs[r].cuda()), ys[r].cuda()).backward(); opt.step(); opt.zero_grad()
    torch.nn.functional.mse_loss(alone(torch.cat(xs).cuda()), torch.cat(ys).cuda()).backward(); ref.step(); ref.zero_grad()
checks["ddp = one process"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(net.parameters(), alone.parameters()))
if r == 0:
    print("TORCHCHECK " + json.dumps(checks))
dist.destroy_process_group()
'''

SUBNORMAL = r'''
import json, cupy as cp, numpy as np
from ringcomm import kernels
ref = kernels.reference
tiny = np.float32(2.0 ** -149)  # the smallest fp32 subnormal
rng = np.random.default_rng(0)
a = (rng.integers(-2 ** 20, 2 ** 20, 4096) * tiny).astype(np.float32)  # all subnormal or zero
b = (rng.integers(-2 ** 20, 2 ** 20, 4096) * tiny).astype(np.float32)
b[::7] = 0.0; a[::11] = -0.0
big = np.float32(1.5) * np.ones(4096, np.float32)
checks = {}
def same(name, got, want):
    checks[name] = bool(np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)))
for op in ("sum", "max", "min"):
    acc = cp.asarray(a); kernels.reduce(op, acc, cp.asarray(b))
    same(f"reduce {op}", acc.get(), ref.reduce(op, a.copy(), b))
acc = cp.asarray(a); kernels.reduce("prod", acc, cp.asarray(big))
same("reduce prod", acc.get(), ref.reduce("prod", a.copy(), big))
acc = cp.asarray(a); kernels.finalize("avg", acc, 3)
same("avg divide", acc.get(), ref.finalize("avg", a.copy(), 3))
# unscale takes an fp16 gradient: random fp16 bit patterns below 2**-4 (fp16 subnormals
# included), over a loss scale of 2**127: every quotient is an fp32 subnormal or zero, many rounded
g16 = (rng.integers(0, 0x2C00, 4096) | rng.integers(0, 2, 4096) << 15).astype(np.uint16).view(np.float16)
dst = cp.empty(4096, cp.float32); kernels.unscale(cp.asarray(g16), dst, 2.0 ** 127)
want = np.empty(4096, np.float32); ref.unscale(g16, want, 2.0 ** 127)
same("unscale", dst.get(), want)
x = cp.asarray(a); kernels.scale(x, 0.5)
same("scale", x.get(), ref.scale(a.copy(), 0.5))
# the fp16 cast: fp32 subnormals (fp16 zeros, sign kept), and the same scaled on the host
# (exactly) by 2**115 into fp16's subnormal range and by 2**125 into its normal range, to round
c = np.concatenate([a, a * np.float32(2.0 ** 115), a * np.float32(2.0 ** 125)])
half = cp.empty(c.size, cp.float16); kernels.cast_to_half(cp.asarray(c), half)
want16 = ref.cast_to_half(c, np.empty(c.size, np.float16))
checks["cast_to_half"] = bool(np.array_equal(half.get().view(np.uint16), want16.view(np.uint16)))
checks["found_nonfinite"] = kernels.found_nonfinite(cp.asarray(a)) == ref.found_nonfinite(a)
p, m, v = a.copy(), np.zeros_like(a), np.zeros_like(a)  # Adam on subnormal weights and gradients
dp, dm, dv = cp.asarray(p), cp.asarray(m), cp.asarray(v)
kernels.adam_step(dp, cp.asarray(b), dm, dv, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
ref.adam_step(p, b, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
same("adam master", dp.get(), p); same("adam m", dm.get(), m); same("adam v", dv.get(), v)
checks["norm f32->f64"] = bool(kernels.sq_norm_partial(cp.asarray(a), 1.0, 4).get().sum() == ref.sq_norm_partial(a, 1.0, 4, kernels.THREADS).sum())
print("SUBNORMAL " + json.dumps(checks))
'''
PYTESTS = [  # (step, what to select in tests/gpu): the real CuPy only, never the stand-in
    ("kernel tests", ["tests/gpu/test_kernels_gpu.py"]),
    ("collectives tests", ["tests/gpu/test_collectives_gpu.py", "-k", "cuda and collectives_on"]),
    ("stream order probes", ["tests/gpu/test_collectives_gpu.py", "-k", "cuda and stream_order"]),
    # a few steps against the CPU: ddp, zero2 offloaded in fp32 and fp16, zero3, and the fp16
    # and fp32 GPU updates with clipping (unscale, the fp16 cast, scale, the squared norm)
    ("training vs cpu", [f"tests/gpu/test_collectives_gpu.py::test_training_on_gpu_matches_cpu[cuda-{layout}]"
                         for layout in ("ddp", "zero2_offload_fp32", "zero2_offload_fp16", "zero3",
                                        "zero2_fp16_clip", "ddp_clip")])]

MIN_STEP_S = 10.0  # a step with less time than this left is not started
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "standin")


def selection(args, standin):
    """A tests/gpu selection for the real CuPy, or for the stand-in's cases of the same tests."""
    return [a.replace("cuda", "standin") for a in args] if standin else list(args)


def training_args(extra):
    """A training run's arguments: fp16 unless it says otherwise."""
    return list(extra) if "--precision" in extra else [*extra, "--precision", "fp16"]


def label(strategy, extra):
    """How a training run is named in the report: ``"zero2 --offload --precision fp32"``."""
    return " ".join([strategy, *training_args(extra)])


class Steps:
    """The check's clock and its JSON: each step's time limit is cut to what is left of the
    budget, and the report is written after every step."""

    def __init__(self, path, budget, skip=()):
        self.path, self.end, self.skip = path, time.monotonic() + budget, set(skip)
        self.report = {"ok": True, "not_run": []}

    def left(self):
        return self.end - time.monotonic()

    def run(self, name, cmd, timeout, env=None):
        """``cmd``'s CompletedProcess, or None when the budget is spent (the step is listed
        under not_run) or the step ran out of time (recorded, with what it printed, and its
        whole process group killed: launched ranks must not hold the GPU for the next step)."""
        if name in self.skip:
            self.report.setdefault("skipped", {})[name] = "--skip"
            return None
        limit = min(timeout, self.left())
        if limit < MIN_STEP_S:
            self.report["not_run"].append(name)
            self.report["ok"] = False
            self.save()
            return None
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        # the pipes are read on threads and the wait is on the process: a process the step
        # left behind (or one stuck in the driver) may hold them open, and must not hold the check
        out, err = _Reader(proc.stdout), _Reader(proc.stderr)
        try:
            proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # whatever the step left behind, or all of it when out of time
        out, err = out.text(), err.text()
        seconds = time.perf_counter() - start
        self.report.setdefault("step_seconds", {})[name] = round(seconds, 2)
        if timed_out:
            self.report.setdefault("timed_out", []).append({"step": name, "after_s": limit, "tail": out[-1500:],
                                                            "stderr_tail": err[-1500:]})
            self.report["ok"] = False
            self.save()
            return None
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        result.seconds = seconds
        return result

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.report, f, indent=1)


class _Reader:
    """A pipe read to its end on a thread of its own; :meth:`text` waits a little for it."""

    def __init__(self, pipe):
        self._pipe, self._chunks = pipe, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for chunk in iter(lambda: self._pipe.read(4096), ""):
            self._chunks.append(chunk)

    def text(self, wait=5.0):
        """What was read; the pipe is given up after ``wait`` seconds (a survivor holds it)."""
        self._thread.join(wait)
        return "".join(self._chunks)


def _kill_group(proc):
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)


def marked(result, tag):
    """The JSON a job printed after ``tag``, or ``{"error": its stderr's tail}``."""
    lines = [ln for ln in result.stdout.splitlines() if tag in ln]
    return json.loads(lines[0].split(tag, 1)[1]) if lines else {"error": result.stderr[-2000:]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check")
    p.add_argument("--standin", action="store_true", help="on the CPU, against tests/standin's CuPy")
    p.add_argument("--skip", default="", help="comma-separated step names not to run (recorded as skipped)")
    args = p.parse_args(argv)
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    steps = Steps(path, args.budget, skip)
    report = steps.report
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("CUPY_CACHE_DIR", CACHE_DIR)
    if args.standin:
        report["standin"] = True
        env.update(PYTHONPATH=os.pathsep.join([STANDIN, ROOT, env.get("PYTHONPATH", "")]),
                   CUPY_STANDIN_DEVICES="4")
        sys.path.insert(0, STANDIN)
    names = ["first light", "torch backend", "subnormal probe", *(name for name, _ in PYTESTS), "collectives",
             *(label(s, e) for s, e in STRATEGIES)]

    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
    except Exception as exc:  # noqa: BLE001 - no CuPy, no driver, no device
        report.update(ok=False, error=f"no GPU here: {exc!r}", not_run=names)
        steps.save()
        print(f"make gpu-check needs CuPy and a CUDA GPU, and this machine has none ({exc!r}); "
              f"run it on a GPU machine (pip install 'ringcomm[gpu]'); wrote {path}", file=sys.stderr)
        return 2
    from ringcomm import kernels
    report["environment"] = {"cupy": cupy.__version__, "devices": cupy.cuda.runtime.getDeviceCount(),
                             "name": "the CuPy stand-in" if args.standin else
                             cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                             "kernels_backend": kernels.backend()}
    print("environment:", report["environment"], flush=True)
    steps.save()

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(FIRST_LIGHT)
    result = steps.run("first light", [sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--device", "gpu",
                                       f.name], 150, env)
    if result is not None:
        report["first_light"] = found = marked(result, "FIRSTLIGHT ")
        report["ok"] &= "error" not in found and all(v is True for v in found.values())
        print("first light:", json.dumps(found)[:1500], flush=True)
        steps.save()

    if args.standin:  # torch's CUDA tensors need a GPU
        report.setdefault("skipped", {})["torch backend"] = "the stand-in has no CUDA tensors"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TORCH_CHECK)
    result = None if args.standin else steps.run("torch backend", [sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--device", "gpu",
                                         f.name], 150, env)
    if result is not None:
        report["torch_backend"] = found = marked(result, "TORCHCHECK ")
        report["ok"] &= "error" not in found and all(found.values())
        print("torch backend:", json.dumps(report["torch_backend"])[:1000], flush=True)
        steps.save()

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(SUBNORMAL)
    result = steps.run("subnormal probe", [sys.executable, f.name], 60, env)
    if result is not None:
        report["subnormal_probe"] = found = marked(result, "SUBNORMAL ")
        report["ok"] &= "error" not in found and all(found.values())
        print("subnormal probe:", json.dumps(found), flush=True)
        steps.save()

    report["gpu_tests"] = {}
    for name, tests in PYTESTS:
        result = steps.run(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                                  *selection(tests, args.standin)], 150, env)
        if result is None:
            continue
        report["gpu_tests"][name] = {"returncode": result.returncode, "seconds": result.seconds,
                                     "tail": result.stdout[-1500:]}
        report["ok"] &= result.returncode == 0
        print(f"{name}:", result.stdout.strip().splitlines()[-1:] or result.stderr[-500:], flush=True)
        steps.save()

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(BENCH)
    result = steps.run("collectives", [sys.executable, "-m", "ringcomm.launch", "--nproc", str(args.nproc),
                                       "--device", "gpu", f.name], 240, env)
    if result is not None:
        report["collectives"] = found = marked(result, "GPUBENCH ")
        report["ok"] &= "error" not in found and all(row["wrong"] == 0 for row in found["rows"])
        print("collectives:", json.dumps(report["collectives"])[:1500], flush=True)
        steps.save()

    report["training"] = []
    for strategy, extra in STRATEGIES:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = os.path.join(tmp, "m.json")
            cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--device", "gpu", "-m", "ringcomm.train",
                   "--strategy", strategy, *training_args(extra), "--steps", str(TRAINING_STEPS),
                   "--metrics-json", metrics]
            result = steps.run(label(strategy, extra), cmd, 120, env)
            if result is None:
                continue
            entry = {"strategy": label(strategy, extra), "returncode": result.returncode,
                     "seconds": result.seconds}
            if result.returncode == 0:
                with open(metrics) as m:
                    doc = json.load(m)
                entry.update(final_loss=doc["final_loss"], accuracy=doc["accuracy"],
                             held_out_bits_per_char=doc.get("held_out_bits_per_char"),
                             step_time_s=doc["per_rank"][0]["step_time_s"])
            else:
                entry["error"] = result.stderr[-1500:]
            report["ok"] &= result.returncode == 0
            report["training"].append(entry)
            print("training:", json.dumps(entry)[:600], flush=True)
            steps.save()

    steps.save()
    print(f"gpu-check: {'PASSED' if report['ok'] else 'FAILED'}; results in {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What a training step costs the GPU beyond its kernels, on the CuPy stand-in, which counts
it: the host waits for the model's stream once a step, for the step's decision (overflow,
clipping norm and loss, brought over in one copy), and a warmed-up step takes no new device
memory (every allocation is served by the memory pool's freed blocks, as CuPy's pool would).

Host synchronisations are counted on the stream the model computes on (the default stream;
ringcomm's communication and copy streams are its own): no boolean mask (a ReLU's), no
per-micro-batch loss read, no scalar pulled back. Device mallocs are counted by the
stand-in's model of CuPy's pool (``tests/standin/cupy/_array.py``); ring attention (``--cp``)
is left out of that count: how many of its segments are in flight at once depends on the
ranks' timing, and the model pool, which splits no blocks, then counts a few more.

ZeRO's gradient shard is also not gathered by concatenation each step (stage 1 owns a slice
of every unit inside the full buffer; they go straight into the fp32 copy the step checks):
the MLP's layouts, whose model concatenates nothing, make no ``concatenate`` call per step.
"""
import json
import os
import textwrap
from pathlib import Path

import pytest

from harness import job_outputs

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[2]
WARM_UP = 2  # steps before memory is expected to be steady
COUNTED = textwrap.dedent("""
    import json, sys
    import cupy
    from cupy import _runtime as rt
    from ringcomm.train.parallel import step as step_mod
    from ringcomm.train.cli import main
    on_default, per_step, joined = [0], [], [0]
    concatenate = cupy.concatenate

    def counted_concatenate(*args, **kwargs):
        joined[0] += 1
        return concatenate(*args, **kwargs)
    cupy.concatenate = counted_concatenate
    waits = rt._host_waits

    def counted(stream, position, pending=None):
        if stream.null or stream.ptds:  # the model's stream (ringcomm's are non-blocking)
            on_default[0] += 1
        return waits(stream, position, pending)
    rt._host_waits = counted
    step = step_mod.StepRunner.step

    def measured(self, *args, **kwargs):
        syncs, mallocs, joins = on_default[0], rt.counts["device mallocs"], joined[0]
        result = step(self, *args, **kwargs)
        per_step.append([on_default[0] - syncs, rt.counts["device mallocs"] - mallocs, joined[0] - joins])
        return result
    step_mod.StepRunner.step = measured
    main(sys.argv[1:])
    print("COSTS " + json.dumps(per_step), flush=True)
""")
GPT = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
       "--vocab", "256", "--batch-size", "4"]
MLP = ["--layers", "32,64,48,10", "--samples", "256", "--batch-size", "32"]
LAYOUTS = {"mlp_zero2_fp16_clip": ["--strategy", "zero2", "--precision", "fp16", "--clip-grad-norm", "0.5", *MLP],
           "mlp_ddp_tp2": ["--strategy", "ddp", "--tp", "2", *MLP],
           "mlp_zero3": ["--strategy", "zero3", *MLP],
           "mlp_zero1_fp16": ["--strategy", "zero1", "--precision", "fp16", *MLP],
           "mlp_zero1_offload": ["--strategy", "zero1", "--offload", *MLP],
           "gpt_pp2_micro_batches": ["--strategy", "zero1", "--pp", "2", "--micro-batches", "2", *GPT]}
# layouts whose model concatenates nothing itself (the MLP without tensor parallelism): a
# concatenation in their step could only be the strategy's
CONCAT_FREE = {"mlp_zero2_fp16_clip", "mlp_zero3", "mlp_zero1_fp16", "mlp_zero1_offload"}
assert LAYOUTS.keys() >= CONCAT_FREE


@pytest.mark.parametrize("backend", ["standin"])  # counts what only the stand-in counts
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_host_sync_and_no_new_device_memory_per_step(layout, backend):
    args = LAYOUTS[layout]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standin"), str(ROOT)]),
           "CUPY_STANDIN_DEVICES": "4", "RINGCOMM_DEVICE": "gpu"}
    argv = ["--device", "gpu", "--steps", str(WARM_UP + 2), *args]
    script = f"import sys; sys.argv = ['train', *{argv!r}]\n" + COUNTED
    for rank, out in enumerate(job_outputs(script, 2, env=env, timeout=180)):
        costs = json.loads(next(x for x in out.splitlines() if x.startswith("COSTS ")).split(" ", 1)[1])
        assert [syncs for syncs, _, _ in costs] == [1] * len(costs), f"rank {rank}: host syncs per step {costs}"
        assert [m for _, m, _ in costs[WARM_UP:]] == [0, 0], f"rank {rank}: device mallocs per step {costs}"
        if layout in CONCAT_FREE:
            assert [j for _, _, j in costs[WARM_UP:]] == [0, 0], f"rank {rank}: concatenations per step {costs}"

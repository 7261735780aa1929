"""A training step waits for the GPU once: for the step's decision (overflow, clipping norm
and loss, brought over in one copy). On the CuPy stand-in, which counts every host
synchronisation of the stream the model computes on (the default stream; ringcomm's own
communication and copy streams are not the model's), each step of each layout here counts
exactly one: no boolean mask (a ReLU's), no per-micro-batch loss read, no scalar pulled back.
"""
import json
import os
import textwrap
from pathlib import Path

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[2]
COUNTED = textwrap.dedent("""
    import json, sys
    import cupy
    from cupy import _runtime as rt
    from ringcomm.train import step as step_mod
    from ringcomm.train.cli import main
    on_default, per_step = [0], []
    waits = rt._host_waits

    def counted(stream, position):
        if stream.null or stream.ptds:  # the model's stream (ringcomm's are non-blocking)
            on_default[0] += 1
        return waits(stream, position)
    rt._host_waits = counted
    step = step_mod.StepRunner.step

    def measured(self, *args, **kwargs):
        before = on_default[0]
        result = step(self, *args, **kwargs)
        per_step.append(on_default[0] - before)
        return result
    step_mod.StepRunner.step = measured
    main(sys.argv[1:])
    print("SYNCS " + json.dumps(per_step), flush=True)
""")
GPT = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
       "--vocab", "256", "--batch-size", "4"]
MLP = ["--layers", "32,64,48,10", "--samples", "256", "--batch-size", "32"]
LAYOUTS = {"mlp_zero2_fp16_clip": ["--strategy", "zero2", "--precision", "fp16", "--clip-grad-norm", "0.5", *MLP],
           "mlp_ddp_tp2": ["--strategy", "ddp", "--tp", "2", *MLP],
           "gpt_pp2_micro_batches": ["--strategy", "zero1", "--pp", "2", "--micro-batches", "2", *GPT]}


@pytest.mark.parametrize("backend", ["standin"])  # counts what only the stand-in counts
@pytest.mark.parametrize("args", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_one_host_sync_per_training_step(args, backend):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standin"), str(ROOT)]),
           "CUPY_STANDIN_DEVICES": "4", "RINGCOMM_DEVICE": "gpu"}
    argv = ["--device", "gpu", "--steps", "3", *args]
    script = f"import sys; sys.argv = ['train', *{argv!r}]\n" + COUNTED
    for rank, (code, out, err) in enumerate(spawn_job(script, 2, env=env, timeout=180)):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
        per_step = json.loads(next(x for x in out.splitlines() if x.startswith("SYNCS ")).split(" ", 1)[1])
        assert per_step == [1, 1, 1], f"rank {rank}: host synchronisations per step {per_step}"

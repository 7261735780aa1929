"""A trainer on ringcomm's public collectives: an MLP or a small GPT, with data parallelism
(parameter server, DDP, ZeRO stages 1–3 with optimizer offload), context, pipeline and
tensor (+ sequence) parallelism composed in one mesh, fp32 or fp16 mixed precision, Adam or
SGD, clipping by the global norm, activation recomputation and checkpoints.

    python -m ringcomm.launch --nproc 4 -m ringcomm.train --model gpt --dp 2 --cp 2 --strategy zero2

The parts, one module each: :mod:`.config` (the options), :mod:`.mesh` (the layout),
:mod:`.models` with :mod:`.mlp` and :mod:`.gpt` (the layers a rank runs), :mod:`.strategy`
and :mod:`.zero` (what each data-parallel strategy keeps and sends), :mod:`.step` (the
pipeline schedule and one step), :mod:`.trainer` (the loop) and :mod:`.report`; the
formulas they are checked against are in :mod:`.memory` and :mod:`.traffic`.
"""

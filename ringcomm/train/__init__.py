"""A trainer on ringcomm's public collectives: an MLP or a small GPT, with data parallelism
(parameter server, DDP, ZeRO stages 1–3 with optimizer offload), context, pipeline and
tensor (+ sequence) parallelism composed in one mesh, fp32 or fp16 mixed precision, Adam or
SGD, clipping by the global norm, activation recomputation and checkpoints.

    python -m ringcomm.launch --nproc 4 -m ringcomm.train --model gpt --dp 2 --cp 2 --strategy zero2

The parts: three rooms, and beside them :mod:`.config` (the options), :mod:`.trainer` (the
loop), :mod:`.cli`, :mod:`.data` and :mod:`.corpus` (what is read), :mod:`.optim` and
:mod:`.checkpoint`.

- :mod:`.models`: the model maths, the MLP and the GPT, and which layers a rank runs
  (:mod:`.models.stage`);
- :mod:`.parallel`: how it is split over ranks, the mesh, tensor parallelism, the flat
  buffers, what each data-parallel strategy keeps and sends, and the pipeline step;
- :mod:`.accounting`: what it costs, the memory and traffic formulas the runs are checked
  against, what is measured beside them, the trace and the report.
"""

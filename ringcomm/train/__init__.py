"""A small MLP trainer on ringcomm's public collectives: parameter-server DP, DDP and
ZeRO stages 1–3 (with optimizer offload), fp32 or fp16 mixed precision, Adam or SGD.

    python -m ringcomm.launch --nproc 4 -m ringcomm.train --strategy zero2 --precision fp16

See :mod:`ringcomm.train.cli` for the options, :mod:`.strategy` and :mod:`.zero` for what
each strategy keeps and sends, and :mod:`ringcomm.memory` for the formulas it is checked
against.
"""

"""``python -m ringcomm.train``: train the MLP or the small GPT on any layout.

    python -m ringcomm.launch --nproc N -m ringcomm.train [--model mlp|gpt]
        [--strategy single|dp|ddp|zero1|zero2|zero3] [--offload] [--precision fp32|fp16]
        [--dp D --cp C --pp P --tp T] [--sp] [--micro-batches M --schedule gpipe|1f1b]
        [--recompute] [--clip-grad-norm X] [--save F.npz] [--checkpoint-dir D --resume] ...

Every option is a field of :class:`ringcomm.train.config.TrainConfig` (``--help`` lists
them); :func:`ringcomm.train.config.validate` refuses a combination that cannot work before
any process sends a byte. Rank 0 prints progress and, at the end, every rank's model-state
memory and bytes sent per step against the formulas. ``--main-job`` is the project's
demonstration run (ZeRO-2, fp16, about a minute on 2 cores), which is what
``python -m ringcomm.launch --nproc 4`` runs with no script.

Checkpoints (:mod:`.checkpoint`): ``--checkpoint-dir D --checkpoint-every K`` saves
every rank's state into ``D/step_NNNNNN/`` every K steps and after the last one; ``--resume``
continues from the newest complete checkpoint in D (or starts fresh, saying so), on the same
or another number of ranks. With ``python -m ringcomm.launch --max-restarts K ... --resume``
a job whose worker dies restarts from its last checkpoint.

``--elastic`` (under ``python -m ringcomm.launch --on-failure continue``): a lost rank does not
end the job; the survivors agree whether the step in progress was taken, shrink the world,
rebuild the job over the ranks left from the model state in their memory and go on, on the
same global batches (:mod:`.elastic`; ``ddp`` and ZeRO, which then keeps a copy of its ring
predecessor's shard; the parameter server and model-parallel layouts say so at start and
fall back to the checkpoint restart).
"""
from .config import parse_args
from .trainer import train


def main(argv=None):
    cfg = parse_args(argv)
    import ringcomm
    comm = ringcomm.init(device=cfg.device)
    try:
        train(comm, cfg)
    finally:
        comm.close()
    return 0

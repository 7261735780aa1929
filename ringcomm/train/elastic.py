"""Training that goes on past a lost rank (``--elastic``, under ``ringcomm.launch --on-failure
continue``): the survivors shrink the world, rebuild the job over the ranks left, and go on
from the step in which the loss happened, on the same global batches.

**The commit point.** A step changes the model state only after every surviving rank has
agreed that it may: right after the step's one job-wide all-reduce (overflow, gradient norm,
loss) and before the loss scaler or the optimizer touch anything, each rank calls
``world.agree(True)`` (:meth:`ringcomm.comm.Communicator.agree`), and a rank whose step failed
before that point (a :class:`~ringcomm.errors.PeerLost` in a gradient all-reduce) calls
``world.agree(False)`` instead, as the same agreement. Every surviving rank decides the same
outcome, so a step is taken everywhere or nowhere: not taken, every survivor still holds the
state from before it and the step is redone; taken with a rank lost on the way (it died
after its gradients had reached everyone), every survivor's own state is the one after it
and the next step is the next one. A loss raised after the commit point (ZeRO-1/2's gather
of the updated shards) leaves the step taken; the survivors whose gather completed fail the
next step before its commit point, so a rank that saw the loss votes against that next step
at once, and all rebuild and run it again. The rebuild itself ends with an agreement on
whether every survivor got through it (another loss meanwhile: all shrink again).

**Rebuilding.** The state the survivors need is in their memory: with ``ddp`` every rank
holds the whole model state (parameters, Adam's moments, the loss scaler); with ZeRO each
rank holds its shard and a copy of its ring predecessor's, kept equal to it step by step
(:mod:`.parallel.shard_copy`: (4 + the optimizer's bytes)·Φ/N more memory, and 4·Φ/N bytes
of gradient more per step). The
world is shrunk (``world.shrink()``), the whole state is put together as a checkpoint's
would be (``ddp``: from this rank alone, :func:`.checkpoint.state.in_memory`; ZeRO: every
survivor's shard and the lost ranks' copies, gathered over the new world,
:func:`.checkpoint.state.gathered`), the job is built again over the ranks left (its data
group is the new world, the global batch split over them: the rows of the lost rank are
shared out, shares differing by one row at most), and each rank cuts its state out of the
whole one. The global batch and the denominator of the loss stay as they were, so the run
goes on as the uninterrupted run would, up to the order of the sums. A rank lost together
with its successor (which held its copy) leaves its shard in no memory: every survivor then
raises :class:`~.checkpoint.files.CheckpointError` saying so, and ``--resume`` continues the
job from its last checkpoint (``ringcomm.launch --on-failure continue --max-restarts K`` then
restarts it so by itself).

Not covered: a loss while a checkpoint is written, or during the final evaluation and
report, ends the job as without ``--elastic``; a rank that times out in an agreement (a peer
silent, not lost) raises :class:`~ringcomm.errors.CommTimeout` and its peers then see it
lost. The rebuild puts the whole state together on every survivor (ZeRO: every shard and
copy, gathered), several times the optimizer state for the moment it takes.

Layouts that split the model (tp, pp, cp) cannot recover in memory (a lost rank takes parts
of the model no other rank holds), nor can the parameter server (``dp``: its optimizer state
lives on rank 0): with those, a lost rank ends the job as without ``--elastic``, and
``--resume`` continues it from its last checkpoint (the trainer says so at start).

>>> elastic = Elastic(world, out=print)
>>> strategy.commit = elastic.commit               # the strategy's commit point
>>> job = elastic.recover(job, rebuild, step=12, taken=False)   # "lost rank(s) [2] in step 13; ..."
"""
import time

from ..errors import CommError, PeerLost
from .accounting import report
from .checkpoint import state as checkpoint_state

IN_MEMORY = ("ddp", "zero1", "zero2", "zero3")  # strategies whose state survives a lost rank


class StepNotTaken(CommError):
    """The survivors agreed that the step in progress is taken nowhere."""


def unsupported(cfg):
    """Why ``cfg`` cannot recover a lost rank in memory (None: it can)."""
    if cfg.model_parallel:
        return ("tp, pp and cp layouts cannot recover a lost rank in memory (it takes parts of the "
                "model no other rank holds)")
    if cfg.strategy not in IN_MEMORY:
        return (f"--strategy {cfg.strategy} keeps the optimizer state on rank 0 alone, so it cannot "
                f"recover a lost rank in memory; use --strategy ddp or zero1, zero2, zero3")
    return None


class Elastic:
    """This rank's part in elastic training over ``world`` (the job's world communicator)."""

    def __init__(self, world, out):
        self.world, self.out = world, out
        self.outcome = None    # (flag, lost) of the latest commit point this rank passed
        self.recoveries = []   # (step, lost global ranks, seconds, taken) per recovery

    def commit(self):
        """The strategy's commit point: raises :class:`StepNotTaken` unless the step is taken,
        else returns the group ranks found lost (alike on every survivor)."""
        flag, lost = self.world.agree(True)
        self.outcome = (flag, lost)
        if not flag:
            raise StepNotTaken(f"ranks {[self.world.ranks[r] for r in lost]} lost: the step is redone")
        return lost

    def failed(self):
        """This rank's step failed before its commit point: it takes part in the same
        agreement, voting against the step (every survivor then redoes it)."""
        self.outcome = self.world.agree(False)

    @property
    def lost(self):
        """The global ranks the latest commit point found lost."""
        return [] if self.outcome is None else [self.world.ranks[r] for r in self.outcome[1]]

    def recover(self, job, rebuild, step, taken):
        """The job over the survivors, with ``job``'s model state (``taken``: whether step
        ``step``, counted from 0, was taken); ``rebuild(world)`` makes a job over a world."""
        start, old = time.monotonic(), self.world.ranks
        while True:
            self.world = self.world.shrink()
            new, ok = None, True
            try:
                if job.strategy.checkpoint_kind == "full":  # every rank holds the whole state
                    full = checkpoint_state.in_memory(job.strategy)
                else:  # the survivors' shards, and the lost ranks' from their successors' copies
                    full = checkpoint_state.gathered(self.world, job.strategy)
                new = rebuild(self.world)
                checkpoint_state.load_full(full, new.strategy)
            except PeerLost:  # another rank lost meanwhile: it may have reached some ranks only
                ok = False
            # every survivor learns alike whether every one of them is rebuilt: else all shrink again
            flag, lost_since = self.world.agree(ok)
            if flag and not lost_since:
                break
        for group in report.dimension_groups(new.mesh).values():
            group.reset_stats()  # the recovery's own traffic is not a step's
        new.strategy.commit = self.commit
        lost = [r for r in old if r not in self.world.ranks]
        seconds = time.monotonic() - start
        self.recoveries.append((step + 1, lost, seconds, taken))  # counted from 1, as progress is
        if self.world.rank == 0:
            self.out(f"ringcomm.train: lost rank(s) {lost} in step {step + 1}; going on with "
                     f"{self.world.world_size} ranks ({'step taken' if taken else 'the step is redone'}), "
                     f"rebuilt in {seconds:.2f} s")
        self.outcome = None
        return new

"""Dynamic fp16 loss scaling: the LossScaler's rules (DeepSpeed's: initial 2^16, double after
``window`` clean steps, hysteresis 2, min scale 1, overflowing steps skipped), and an fp16
run in which gradients really overflow: the skipped steps are the same on every rank, a
skipped step leaves the parameters untouched, the scale drops, and training goes on."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import Job, train
from ringcomm.train.data import synthetic
from ringcomm.train.optim import LossScaler

pytestmark = pytest.mark.timeout(120)


# -- unit tests of LossScaler ---------------------------------------------------------------
def test_defaults_are_deepspeeds():
    s = LossScaler(enabled=True)
    assert s.scale == 2.0 ** 16
    assert (s.window, s.hysteresis, s.min_scale) == (1000, 2, 1.0)
    assert s.skipped == 0


def test_disabled_scaler_is_a_fixed_one():
    s = LossScaler(enabled=False)
    assert s.scale == 1.0
    for overflow in (True, False, True, True):
        assert s.update(overflow) is False
    assert s.scale == 1.0 and s.skipped == 0


def test_doubles_after_window_clean_steps():
    s = LossScaler(enabled=True, initial=8.0, window=3)
    assert [s.update(False) for _ in range(2)] == [False, False]
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0
    assert s.skipped == 0


def test_hysteresis_first_overflow_only_consumes_it_second_halves():
    s = LossScaler(enabled=True, initial=1024.0, window=100, hysteresis=2)
    assert s.update(True) is True          # skipped, but the scale holds
    assert s.scale == 1024.0 and s.skipped == 1
    assert s.update(True) is True          # hysteresis used up: halve
    assert s.scale == 512.0 and s.skipped == 2
    assert s.update(True) is True          # and every further overflow halves again
    assert s.scale == 256.0 and s.skipped == 3
    assert s.update(False) is False        # a clean step does not restore hysteresis ...
    assert s.update(True) is True
    assert s.scale == 128.0 and s.skipped == 4


def test_hysteresis_restored_when_the_scale_grows():
    s = LossScaler(enabled=True, initial=64.0, window=2, hysteresis=2)
    s.update(True)
    s.update(True)
    assert s.scale == 32.0
    s.update(False)
    s.update(False)
    assert s.scale == 64.0                 # grown after 2 clean steps, hysteresis back to 2
    s.update(True)
    assert s.scale == 64.0                 # absorbed again
    s.update(True)
    assert s.scale == 32.0


def test_an_overflow_restarts_the_window():
    s = LossScaler(enabled=True, initial=8.0, window=3, hysteresis=5)
    s.update(False)
    s.update(False)
    s.update(True)                         # absorbed by hysteresis, but resets the count
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0


def test_never_below_min_scale():
    s = LossScaler(enabled=True, initial=4.0, window=1000, hysteresis=1, min_scale=1.0)
    for expected in (2.0, 1.0, 1.0, 1.0):
        assert s.update(True) is True
        assert s.scale == expected
    assert s.skipped == 4
    s = LossScaler(enabled=True, initial=16.0, window=1000, hysteresis=1, min_scale=4.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 4.0


class DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis=False), restated."""

    def __init__(self, init, window, hysteresis, min_scale):
        self.cur_scale, self.scale_window, self.min_scale = init, window, min_scale
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= 2
        self.cur_iter += 1


@settings(max_examples=200, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=80), window=st.integers(1, 6),
       hysteresis=st.integers(1, 4), init_exp=st.integers(0, 20), min_exp=st.integers(0, 3))
def test_matches_deepspeed_on_any_sequence(overflows, window, hysteresis, init_exp, min_exp):
    init, min_scale = 2.0 ** max(init_exp, min_exp), 2.0 ** min_exp
    ours = LossScaler(enabled=True, initial=init, window=window, hysteresis=hysteresis, min_scale=min_scale)
    ref = DeepSpeedReference(init, window, hysteresis, min_scale)
    for i, overflow in enumerate(overflows):
        assert ours.update(overflow) is overflow
        ref.update_scale(overflow)
        assert ours.scale == ref.cur_scale, f"after step {i} of {overflows[:i + 1]}"
    assert ours.skipped == sum(overflows)


def test_state_round_trip():
    s = LossScaler(enabled=True, initial=256.0, window=3, hysteresis=2)
    for overflow in (False, True, False, False):
        s.update(overflow)
    t = LossScaler(enabled=True, initial=256.0, window=3, hysteresis=2)
    t.load_state(s.state())
    for overflow in (True, False, False, False, True, True):
        assert s.update(overflow) == t.update(overflow)
        assert s.scale == t.scale and s.skipped == t.skipped


# -- an fp16 run that really overflows ---------------------------------------------------------
INPUT_SCALE = 300.0  # big inputs: the forward stays finite in fp16, scaled gradients do not
OVERFLOW_CFG = dict(layers=(16, 32, 24, 5), batch_size=64, steps=20, bucket_mb=0.0002, lr=1e-2,
                    precision="fp16", seed=0)


def model_state(strategy):
    """Every parameter-like buffer this rank holds (fp16 params, shard, fp32 master)."""
    parts = [getattr(strategy, name) for name in ("flat_params", "param_shard", "master")
             if getattr(strategy, name, None) is not None]
    return b"".join(p.tobytes() for p in parts)


def stepwise(comm, kw):
    """train()'s loop, step by step, recording what each step did on this rank."""
    job = Job(comm, TrainConfig(**kw))
    strategy = job.strategy
    steps = []
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(job.cfg.steps):
            x, y = job.batch(step)
            before, skipped_before = model_state(strategy), strategy.scaler.skipped
            loss, _ = job.runner.step(x, y, job.denominator)
            steps.append({"loss": loss, "skipped": strategy.scaler.skipped > skipped_before,
                          "scale": strategy.scaler.scale, "unchanged": model_state(strategy) == before})
    job.meta.close()
    return steps


def whole_run(comm, kw):
    with np.errstate(over="ignore", invalid="ignore"):
        doc, strategy = train(comm, TrainConfig(**kw), out=lambda *a: None)
    return doc["losses"], doc["skipped_steps"], doc["loss_scale"]


@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory):
    data = synthetic(16, 5, 512, seed=0)
    path = tmp_path_factory.mktemp("overflow") / "big.npz"
    np.savez(path, x=data.x * INPUT_SCALE, y=data.y)
    return str(path)


@pytest.mark.parametrize("strategy", ["zero2", "ddp", "zero3", "dp"])
def test_overflow_skips_steps_alike_and_training_recovers(pools, big_inputs, strategy):
    kw = dict(OVERFLOW_CFG, strategy=strategy, data=big_inputs)
    per_rank = pools(2).run(stepwise, kw)
    steps = per_rank[0]
    for rank, mine in enumerate(per_rank):
        assert [s["skipped"] for s in mine] == [s["skipped"] for s in steps], f"rank {rank} skipped other steps"
        assert [s["scale"] for s in mine] == [s["scale"] for s in steps]
        assert [s["loss"] for s in mine] == [s["loss"] for s in steps]
        for i, s in enumerate(mine):
            # a skipped step leaves every parameter buffer bitwise as it was; a clean one moves it
            assert s["unchanged"] == s["skipped"], f"rank {rank} step {i}: {s}"
    skipped = [i for i, s in enumerate(steps) if s["skipped"]]
    assert len(skipped) >= 3, f"the run was meant to overflow repeatedly: {steps}"
    # hysteresis 2: the first overflow keeps the scale, the second halves it
    assert steps[skipped[0]]["scale"] == 2.0 ** 16
    assert steps[skipped[1]]["scale"] == 2.0 ** 15
    scale_after = steps[-1]["scale"]
    assert scale_after == 2.0 ** (16 - (len(skipped) - 1))
    # training proceeds after the scale has settled: clean steps follow and the loss falls
    last = skipped[-1]
    assert len(steps) - last - 1 >= 5
    clean = [s["loss"] for s in steps[last + 1:]]
    assert clean[-1] < 0.5 * steps[0]["loss"]
    # train() itself does the same and reports it
    losses, n_skipped, final_scale = pools(2).run(whole_run, kw)[0]
    assert losses == [s["loss"] for s in steps]
    assert n_skipped == len(skipped) and final_scale == scale_after


def test_no_overflow_on_tame_inputs(pools):
    """The overflow above comes from the inputs, not from the scaler: normal data at 2^16
    trains without skipping."""
    losses, n_skipped, scale = pools(2).run(whole_run, dict(OVERFLOW_CFG, strategy="zero2", samples=512))[0]
    assert n_skipped == 0 and scale == 2.0 ** 16
    assert losses[-1] < losses[0]

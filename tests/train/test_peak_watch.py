"""The step's memory watch: by default a sample of the steps (tracing slows a step), the
same peak (up to Python's own small objects) as watching every one; ``--memory-watch every`` watches each step."""
import numpy as np
import pytest

import ringcomm
from ringcomm.train.accounting.peak import SAMPLED_EVERY, SAMPLED_FIRST, PeakWatch
from ringcomm.train.config import TrainConfig, parse_args
from ringcomm.train.trainer import train

pytestmark = pytest.mark.timeout(120)


def test_a_sampled_watch_takes_the_first_steps_then_one_in_every_so_many():
    watch = PeakWatch()
    watched = [i for i in range(2 * SAMPLED_EVERY + 1) if watch.watches(i)]
    assert watched == [*range(SAMPLED_FIRST), SAMPLED_EVERY, 2 * SAMPLED_EVERY]
    assert all(PeakWatch(every=True).watches(i) for i in range(10))
    assert not any(PeakWatch(enabled=False).watches(i) for i in range(10))


def test_the_command_line_chooses_the_watch():
    assert parse_args([]).memory_watch == "sampled"
    assert parse_args(["--memory-watch", "every"]).memory_watch == "every"
    with pytest.raises(SystemExit):
        parse_args(["--memory-watch", "never"])


def run(every, steps):
    comm = ringcomm.init(world_size=1, rank=0)
    try:
        cfg = TrainConfig(strategy="single", layers=(32, 64, 64, 8), batch_size=64, samples=512, steps=steps,
                          memory_watch="every" if every else "sampled")
        document, _ = train(comm, cfg, out=lambda *a: None)
    finally:
        comm.close()
    return document["per_rank"][0]


def test_the_sampled_peak_is_the_peak_of_every_step():
    steps = SAMPLED_FIRST + 3
    sampled, every = run(False, steps), run(True, steps)
    assert (sampled["peak_steps_watched"], every["peak_steps_watched"]) == (SAMPLED_FIRST, steps)
    # the same step's arrays; Python's own small objects (traced too) vary by a few KiB
    assert every["peak_activation_bytes"] > 0
    assert sampled["peak_activation_bytes"] == pytest.approx(every["peak_activation_bytes"], rel=0.05)
    assert np.isclose(sampled["saved_activation_bytes"], every["saved_activation_bytes"])

"""The configuration: one dataclass, the command line generated from it, and every refusal
made in one place, naming the flags, before any process sends a byte."""
import dataclasses

import pytest

from ringcomm.train.config import TrainConfig, build_parser, parse_args, validate

pytestmark = pytest.mark.timeout(60)


def test_every_field_is_a_documented_flag():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(TrainConfig):
        assert f.name in flags, f"--{f.name.replace('_', '-')} missing"
        assert f.metadata["help"] and flags[f.name].help == f.metadata["help"]
        assert flags[f.name].default == f.default
    assert parse_args([]) == TrainConfig()


def test_flags_parse_into_the_dataclass():
    cfg = parse_args(["--model", "gpt", "--cp", "2", "--tp", "2", "--sp", "--no-overlap", "--layers", "8,4",
                      "--recompute", "--clip-grad-norm", "1.5", "--n-layer", "3"])
    assert (cfg.model, cfg.cp, cfg.tp, cfg.sp, cfg.overlap, cfg.layers) == ("gpt", 2, 2, True, False, (8, 4))
    assert cfg.recompute and cfg.clip_grad_norm == 1.5 and cfg.n_layer == 3


REFUSED = [
    (dict(model="mlp", cp=2), "--cp and --sp"),
    (dict(model="gpt", n_head=3, d_model=16), "--d-model 16 must divide by --n-head 3"),
    (dict(model="gpt", n_head=4, tp=3), "--n-head 4 must divide by --tp 3"),
    (dict(model="gpt", seq_len=10, cp=2), "--seq-len 10 must divide by 2·--cp"),
    (dict(model="gpt", sp=True), "--sp .* needs --tp > 1"),
    (dict(strategy="ddp", offload=True), "--offload needs --strategy zero"),
    (dict(strategy="single", tp=2), "--strategy single .* no --cp/--pp/--tp"),
    (dict(micro_batches=2), "--micro-batches .* --pp > 1"),
    (dict(resume=True), "--resume and --checkpoint-every need --checkpoint-dir"),
    (dict(clip_grad_norm=-1.0), "--clip-grad-norm must be > 0"),
    (dict(layers=(4,)), "--layers needs at least"),
    (dict(pp=4, layers=(8, 4, 2)), "--pp 4 exceeds the MLP's 2 layers"),
    (dict(model="gpt", pp=5, n_layer=2), "--pp 5 exceeds the GPT's 4 layers"),
]


@pytest.mark.parametrize("changes,message", REFUSED, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_impossible_combinations_are_refused_naming_the_flags(changes, message):
    with pytest.raises(ValueError, match=message):
        validate(TrainConfig(**changes))


@pytest.mark.parametrize("changes,world,message", [
    (dict(tp=2, pp=2), 2, r"--cp 1 × --pp 2 × --tp 2 = 4 does not divide the world of 2 ranks"),
    (dict(dp=3), 4, "the world has 4 ranks"),
    (dict(batch_size=6, dp=4), 4, "--batch-size 6 does not divide by the world size 4"),
    (dict(batch_size=6, pp=2, micro_batches=4), 4, "do not divide into --micro-batches 4"),
    (dict(strategy="single"), 2, "launch it with --nproc 1"),
])
def test_layout_is_checked_against_the_world(changes, world, message):
    with pytest.raises(ValueError, match=message):
        validate(TrainConfig(**changes), world)


def test_dp_is_filled_in_from_the_world():
    assert validate(TrainConfig(model="gpt", cp=2, tp=2), 8).dp == 2
    assert validate(TrainConfig(model="gpt", cp=2, tp=2, dp=2), 8).dp == 2


def test_command_line_refusal_exits_2_with_the_message(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "gpt", "--n-head", "4", "--tp", "3"])
    assert exc.value.code == 2
    assert "--n-head 4 must divide by --tp 3" in capsys.readouterr().err


def test_abbreviated_flags_are_refused_not_silently_overridden(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "gpt", "--batch", "32"])
    assert "unrecognized arguments: --batch" in capsys.readouterr().err
    cfg = parse_args(["--model", "gpt", "--batch-size", "32", "--steps", "5"])
    assert (cfg.batch_size, cfg.steps, cfg.lr) == (32, 5, 3e-3)  # the GPT's lr, the user's others
    with pytest.raises(SystemExit):
        parse_args(["--main-job", "--model", "gpt"])
    assert "--main-job is the MLP demonstration run" in capsys.readouterr().err

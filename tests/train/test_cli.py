"""``python -m ringcomm.launch --nproc N -m ringcomm.train ...`` end to end, as a user runs it:
the --metrics-json contract, --save, --data, --trace, the errors, the main job."""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringcomm
from ringcomm.train.accounting.memory import CATEGORIES, device_total
from ringcomm.train.config import TrainConfig, parse_args
from ringcomm.train.trainer import load_data, train
from ringcomm.train.data import load_npz
from ringcomm.train.models.mlp import init_params, param_specs

pytestmark = pytest.mark.timeout(120)

SMALL = ["--layers", "16,32,24,5", "--batch-size", "48", "--samples", "480", "--lr", "0.01"]
CONTRACT_FIELDS = {"strategy", "world_size", "precision", "steps", "losses", "final_loss", "accuracy",
                   "num_params", "param_sha256", "predicted_bytes", "per_rank"}
PER_RANK_FIELDS = {"rank", "model_state_bytes", "peak_model_state_bytes", "bytes_sent", "bytes_received",
                   "step_time_s"}


ROOT = Path(ringcomm.__file__).resolve().parent.parent  # this checkout, installed or not
ENV = dict(os.environ, PYTHONWARNINGS="ignore",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def launch(nproc, *args, timeout=60):
    cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(nproc), "--timeout", "30",
           "-m", "ringcomm.train", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def saved(path):
    with np.load(path) as f:
        names = list(f.files)
        arrays = {name: f[name] for name in names}
    return names, arrays


def sha_of(arrays, layers):
    h = hashlib.sha256()
    for name, _ in param_specs(layers):
        h.update(np.ascontiguousarray(arrays[name], np.float32).tobytes())
    return h.hexdigest()


def check_table(stdout, doc):
    """Rank 0's closing table shows, per rank, the document's measured memory and traffic
    beside the formulas (MiB with 3 decimals, KiB per step with 1)."""
    lines = [line[len("[rank 0]: "):] for line in stdout.splitlines() if line.startswith("[rank 0]: ")]
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["rank", "params", "grads", "optimizer"])
    mib = 2.0 ** 20
    for row, line in zip(doc["per_rank"], lines[header + 1:header + 1 + doc["world_size"]], strict=True):
        cells = [float(w.rstrip("/")) for w in line.split()]
        m, f = row["model_state_bytes"], row["predicted_model_state_bytes"]
        assert cells[0] == row["rank"]
        want = [m["params"], f["params"], m["grads"], f["grads"], m["optimizer"] + m["optimizer_host"],
                f["optimizer"] + f["optimizer_host"], device_total(m), device_total(f),
                row["peak_model_state_bytes"]]
        assert cells[1:10] == pytest.approx([w / mib for w in want], abs=6e-4), line
        sent_per_step = row["bytes_sent"] / doc["steps"] / 1024
        assert cells[10:12] == pytest.approx([sent_per_step, row["predicted_bytes_sent_per_step"] / 1024], abs=0.06)


# -- --metrics-json, --save, and the CLI path reaching single's parameters ----------------------
@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    ok(launch(1, "--strategy", "single", *SMALL, "--steps", 5, "--save", folder / "p.npz",
              "--metrics-json", folder / "m.json"))
    return json.loads((folder / "m.json").read_text()), saved(folder / "p.npz")[1]


@pytest.mark.parametrize("nproc,strategy,extra", [
    (2, "zero2", ["--precision", "fp16"]),
    (3, "zero3", ["--offload"]),
    (2, "dp", []),
])
def test_metrics_json_contract_and_save(tmp_path, single_run, nproc, strategy, extra):
    metrics, save = tmp_path / "m.json", tmp_path / "p.npz"
    steps = 5
    result = ok(launch(nproc, "--strategy", strategy, *extra, *SMALL, "--steps", steps, "--bucket-mb", "0.0002",
                       "--metrics-json", metrics, "--save", save))
    doc = json.loads(metrics.read_text())
    check_table(result.stdout, doc)
    assert set(doc) >= CONTRACT_FIELDS, f"missing: {CONTRACT_FIELDS - set(doc)}"
    precision = "fp16" if "fp16" in extra else "fp32"
    assert doc["strategy"] == strategy and doc["world_size"] == nproc and doc["precision"] == precision
    assert doc["steps"] == steps and len(doc["losses"]) == steps
    assert len(doc["step_times_s"]) == len(doc["step_cpu_s"]) == steps
    assert all(c > 0.0 for c in doc["step_cpu_s"]), doc["step_cpu_s"]  # every step computes
    assert all(isinstance(x, float) and np.isfinite(x) for x in doc["losses"])
    assert doc["final_loss"] == doc["losses"][-1]
    assert 0.0 <= doc["accuracy"] <= 1.0
    layers = (16, 32, 24, 5)
    assert doc["num_params"] == sum(a * b + b for a, b in zip(layers[:-1], layers[1:], strict=False))
    assert set(doc["predicted_bytes"]) == set(CATEGORIES)
    assert len(doc["per_rank"]) == nproc
    for rank, row in enumerate(doc["per_rank"]):
        assert set(row) >= PER_RANK_FIELDS, f"missing: {PER_RANK_FIELDS - set(row)}"
        assert row["rank"] == rank
        assert set(row["model_state_bytes"]) == set(CATEGORIES)
        assert all(isinstance(v, int) and v >= 0 for v in row["model_state_bytes"].values())
        assert isinstance(row["peak_model_state_bytes"], int)
        assert row["peak_model_state_bytes"] >= device_total(row["model_state_bytes"]) > 0
        for what in ("bytes_sent", "bytes_received"):
            assert isinstance(row[what], int) and row[what] > 0
        assert row["step_time_s"] > 0
        # what the strategy allocated, as tracemalloc saw it, covers the registry's records
        recorded = device_total(row["model_state_bytes"]) + row["model_state_bytes"]["optimizer_host"]
        assert recorded <= row["model_state_traced_bytes"] <= 1.1 * recorded + 64 * 1024
    if "--offload" in extra:
        assert all(r["model_state_bytes"]["optimizer"] == 0 for r in doc["per_rank"])
    # --save: W0, b0, W1, b1, ... in model order, (in, out) and (out,), fp32
    names, arrays = saved(save)
    assert names == [name for name, _ in param_specs(layers)]
    for name, shape in param_specs(layers):
        assert arrays[name].shape == shape and arrays[name].dtype == np.float32
    assert doc["param_sha256"] == sha_of(arrays, layers)
    # the saved model is the trained one, not the initial one
    assert doc["param_sha256"] != sha_of(dict(zip(names, init_params(layers, 0), strict=True)), layers)
    # and, in fp32, the one the single-process reference trains (same seed, data, batch)
    ref_doc, ref = single_run
    assert ref_doc["per_rank"][0]["bytes_sent"] == 0 and ref_doc["world_size"] == 1
    if precision == "fp32":
        for name in names:
            err = np.abs(arrays[name] - ref[name]).max() / np.abs(ref[name]).max()
            assert err <= 1e-5, (name, err)
        np.testing.assert_allclose(doc["losses"], ref_doc["losses"], rtol=1e-5)
    else:
        np.testing.assert_allclose(doc["losses"], ref_doc["losses"], atol=5e-3)


def test_steps_zero_saves_the_initial_parameters_everywhere(tmp_path):
    layers = (16, 32, 24, 5)
    want = init_params(layers, 7)
    # the three ways full_params() assembles the model: a flat buffer, ZeRO-3 fp16 master
    # shards gathered, the parameter server's rank-0 master broadcast
    runs = [(1, "single", []), (2, "zero3", ["--precision", "fp16", "--offload"]),
            (2, "dp", ["--precision", "fp16"])]
    for i, (nproc, strategy, extra) in enumerate(runs):
        path, metrics = tmp_path / f"init{i}.npz", tmp_path / f"m{i}.json"
        ok(launch(nproc, "--strategy", strategy, *extra, "--layers", "16,32,24,5", "--batch-size", "48",
                  "--samples", "480", "--seed", 7, "--steps", 0, "--save", path, "--metrics-json", metrics))
        names, arrays = saved(path)
        assert names == [name for name, _ in param_specs(layers)]
        for (name, _), w in zip(param_specs(layers), want, strict=True):
            assert np.array_equal(arrays[name], w), f"{strategy} on {nproc}: {name} is not the initial value"
        doc = json.loads(metrics.read_text())
        assert doc["steps"] == 0 and doc["losses"] == []
        assert doc["param_sha256"] == sha_of(arrays, layers)


# -- errors ------------------------------------------------------------------------------------
def test_batch_size_not_divisible_by_world_size():
    result = launch(2, "--strategy", "ddp", "--layers", "16,32,5", "--batch-size", 49, "--steps", 2)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "--batch-size 49 does not divide by the world size 2" in out, out


@pytest.mark.parametrize("strategy", ["dp", "ddp", "single"])
def test_offload_needs_zero(capsys, strategy):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--strategy", strategy, "--offload"])
    assert exc.value.code != 0
    assert "--offload needs --strategy zero1, zero2 or zero3" in capsys.readouterr().err
    for stage in ("zero1", "zero2", "zero3"):
        assert parse_args(["--strategy", stage, "--offload"]).offload is True


class TwoRankStub:
    rank, world_size = 0, 2


def test_single_refuses_several_ranks():
    with pytest.raises(ValueError, match="--nproc 1"):
        train(TwoRankStub(), TrainConfig(strategy="single"), out=lambda *a: None)


@pytest.mark.parametrize("args,message", [
    (["--layers", "16"], "--layers needs at least"),
    (["--layers", "16,x,5"], "--layers must be comma-separated"),
    (["--strategy", "zero4"], "invalid choice"),
    (["--batch-size", "0"], "--batch-size >= 1"),
    (["--precision", "bf16"], "invalid choice"),
])
def test_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_arguments_reach_the_config():
    cfg = parse_args(["--strategy", "zero3", "--precision", "fp16", "--steps", "7", "--batch-size", "96",
                      "--layers", "8,4,2", "--lr", "0.5", "--seed", "9", "--optimizer", "sgd",
                      "--data", "f.npz", "--bucket-mb", "0.5", "--no-overlap", "--clip-grad-norm", "1.5",
                      "--trace", "T", "--metrics-json", "m.json", "--save", "s.npz"])
    assert (cfg.strategy, cfg.precision, cfg.steps, cfg.batch_size, cfg.layers) == ("zero3", "fp16", 7, 96, (8, 4, 2))
    assert (cfg.lr, cfg.seed, cfg.optimizer, cfg.data, cfg.bucket_mb) == (0.5, 9, "sgd", "f.npz", 0.5)
    assert (cfg.overlap, cfg.clip_grad_norm, cfg.trace, cfg.metrics_json, cfg.save) == \
        (False, 1.5, "T", "m.json", "s.npz")
    default = parse_args([])
    assert (default.bucket_mb, default.overlap, default.precision, default.optimizer) == (25.0, True, "fp32", "adam")
    main = parse_args(["--main-job", "--steps", "15"])
    assert (main.strategy, main.precision, main.steps) == ("zero2", "fp16", 15)


# -- --data FILE.npz --------------------------------------------------------------------------------
def separable(n, features, classes, seed):
    """Gaussian clusters around well-separated centres."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)) * 4
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.standard_normal((n, features))).astype(np.float32), y


def test_data_file_is_used(tmp_path):
    x, y = separable(384, 8, 3, seed=1)
    x, y, xt, yt = x[:256], y[:256], x[256:], y[256:]
    path, metrics = tmp_path / "d.npz", tmp_path / "m.json"
    np.savez(path, x=x, y=y, x_test=xt, y_test=yt)
    # full-batch training (batch = dataset size) on 2 ranks
    ok(launch(2, "--strategy", "zero1", "--data", path, "--layers", "8,16,3", "--batch-size", 256,
              "--steps", 30, "--lr", "0.05", "--metrics-json", metrics))
    doc = json.loads(metrics.read_text())
    assert doc["num_params"] == 8 * 16 + 16 + 16 * 3 + 3
    assert doc["accuracy"] > 0.9  # well-separated clusters, measured on x_test/y_test


def test_data_file_with_wrong_feature_count_or_classes(tmp_path):
    x, y = separable(64, 7, 3, seed=1)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    with pytest.raises(ValueError, match="the data has 7 features but --layers starts with 8"):
        load_data(TrainConfig(data=str(path), layers=(8, 16, 3)))
    row = int(np.flatnonzero(y == 2)[0])
    with pytest.raises(ValueError, match=rf"y row {row} is 2; labels must be whole numbers in \[0, 2\) "
                                         rf"\(--layers ends with 2\)"):
        load_data(TrainConfig(data=str(path), layers=(7, 16, 2)))
    assert load_data(TrainConfig(data=str(path), layers=(7, 16, 3))).x.shape == (64, 7)


@pytest.mark.parametrize("array,row,value,message", [
    ("x", 3, np.nan, r"x row 3 is not finite \(column 1 is nan\)"),
    ("x", 5, np.inf, r"x row 5 is not finite \(column 1 is inf\)"),
    ("x_test", 2, -np.inf, r"x_test row 2 is not finite \(column 1 is -inf\)"),
    ("y", 4, -1, r"y row 4 is -1; labels must be whole numbers in \[0, 3\)"),
    ("y", 6, 2.7, r"y row 6 is 2.7; labels must be whole numbers in \[0, 3\)"),
    ("y", 1, np.nan, r"y row 1 is nan; labels must be whole numbers in \[0, 3\)"),
    ("y_test", 7, 3, r"y_test row 7 is 3; labels must be whole numbers in \[0, 3\)"),
])
def test_data_file_with_a_bad_row(tmp_path, array, row, value, message):
    """A NaN or inf input, a label outside the classes or not whole, is refused by its row
    (each used to train silently: NaN losses, -1 as the last class, 2.7 as class 2)."""
    x, y = separable(16, 4, 3, seed=2)
    labels = np.int64 if float(value).is_integer() else np.float64  # -1 as an int, 2.7 a float
    arrays = dict(x=x, y=y.astype(labels), x_test=x.copy(), y_test=y.astype(labels))
    arrays[array][(row, 1) if array.startswith("x") else row] = value  # inputs: in column 1
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message):
        load_data(TrainConfig(data=str(path), layers=(4, 8, 3)))


def test_data_file_with_whole_float_labels_is_read(tmp_path):
    x, y = separable(16, 4, 3, seed=2)
    np.savez(tmp_path / "d.npz", x=x.astype(np.float64), y=y.astype(np.float32))
    data = load_npz(tmp_path / "d.npz", classes=3)
    assert data.y.dtype == np.int64 and np.array_equal(data.y, y) and data.x.dtype == np.float32


def test_the_trainer_refuses_a_bad_data_file_by_its_row(tmp_path):
    x, y = separable(64, 8, 3, seed=1)
    x[9, 0] = np.nan
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    result = launch(1, "--strategy", "single", "--data", path, "--layers", "8,16,3", "--batch-size", 64,
                    "--steps", 2)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "x row 9 is not finite (column 0 is nan)" in out, out


def test_data_file_without_arrays(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, inputs=np.zeros((4, 8)), labels=np.zeros(4))
    with pytest.raises(ValueError, match="needs arrays 'x' and 'y'"):
        load_npz(path)
    np.savez(path, x=np.zeros((4, 8)), y=np.zeros(5))
    with pytest.raises(ValueError, match="same length"):
        load_npz(path)
    np.savez(path, x=np.zeros((4, 8)), y=np.zeros(4), x_test=np.zeros((2, 7)), y_test=np.zeros(2))
    with pytest.raises(ValueError, match="x_test has 7 features a row, x has 8"):
        load_npz(path)
    np.save(tmp_path / "one.npy", np.zeros((4, 8)))
    with pytest.raises(ValueError, match=r"needs an \.npz file with arrays 'x' and 'y'"):
        load_npz(tmp_path / "one.npy")


# -- learning ----------------------------------------------------------------------------------
def test_synthetic_set_is_learned_well_above_chance(tmp_path):
    metrics = tmp_path / "m.json"
    ok(launch(2, "--strategy", "ddp", "--layers", "16,64,10", "--batch-size", 64, "--samples", 1024,
              "--lr", "0.01", "--steps", 40, "--metrics-json", metrics))
    doc = json.loads(metrics.read_text())
    assert doc["accuracy"] > 3 * (1 / 10), doc["accuracy"]
    assert doc["final_loss"] < 0.7 * doc["losses"][0]


# -- --trace -------------------------------------------------------------------------------------
def load_trace(folder, rank):
    doc = json.loads((folder / f"trace_rank{rank}.json").read_text())
    events = doc["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid"} <= set(e)
        assert e["pid"] == rank
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float)) and e["tid"] in (0, 1)
    return [e for e in events if e["ph"] == "X"]


def per_step(events):
    """Split a rank's events (in recording order) at each optimizer step."""
    steps, current = [], []
    for e in events:
        current.append(e)
        if e["name"] == "optimizer step":
            steps.append(current)
            current = []
    return steps


TRACE_ARGS = ["--layers", "256,512,10", "--batch-size", 512, "--samples", 1024, "--steps", 6,
              "--bucket-mb", "0.01"]


def overlapped_steps(folder, rank):
    count = 0
    for events in per_step(load_trace(folder, rank)):
        backward_end = max(e["ts"] + e["dur"] for e in events if e["name"].startswith("backward"))
        comm_start = min(e["ts"] for e in events if e["tid"] == 1)
        count += comm_start < backward_end
    return count


def test_trace_ddp_overlaps_backward(tmp_path):
    ok(launch(2, "--strategy", "ddp", *TRACE_ARGS, "--trace", tmp_path))
    for rank in range(2):
        events = load_trace(tmp_path, rank)
        names = {e["name"] for e in events}
        assert {"forward L0", "forward L1", "backward L0", "backward L1", "optimizer step"} <= names
        steps = per_step(events)
        assert len(steps) == 6
        for step in steps:
            buckets = sorted(e["name"] for e in step if e["tid"] == 1)
            assert buckets == ["all_reduce bucket 0", "all_reduce bucket 1"], buckets
            assert all(e["tid"] == 0 for e in step if not e["name"].startswith("all_reduce"))
        assert overlapped_steps(tmp_path, rank) >= 1


def test_trace_ddp_without_overlap_communicates_after_backward(tmp_path):
    ok(launch(2, "--strategy", "ddp", *TRACE_ARGS, "--no-overlap", "--trace", tmp_path))
    for rank in range(2):
        assert overlapped_steps(tmp_path, rank) == 0


def test_trace_zero3_gathers_each_layer_twice(tmp_path):
    ok(launch(2, "--strategy", "zero3", "--layers", "16,32,24,5", "--batch-size", 48, "--samples", 480,
              "--steps", 3, "--trace", tmp_path))
    for rank in range(2):
        events = load_trace(tmp_path, rank)
        names = [e["name"] for e in events]
        for layer in range(3):
            for phase in ("forward", "backward"):
                assert names.count(f"all_gather L{layer} ({phase})") == 3, (layer, phase)
        assert sum(n.startswith("reduce_scatter") for n in names) == 3 * 3


# -- the main job ----------------------------------------------------------------------------------
def test_main_job_prints_progress_and_the_table():
    result = ok(launch(2, "--main-job", "--steps", 15, timeout=90))
    lines = result.stdout.splitlines()
    rank0 = [line[len("[rank 0]: "):] for line in lines if line.startswith("[rank 0]: ")]
    assert not any(line.startswith("[rank 1]: ") for line in lines), "only rank 0 prints"
    assert "zero2" in rank0[0] and "fp16" in rank0[0] and "2 rank(s)" in rank0[0]
    progress = [line for line in rank0 if re.match(r"step\s+\d+/15\s+loss [\d.]+\s+\d+ samples/s", line)]
    assert progress and progress[-1].startswith("step    15/15")
    header = next(i for i, line in enumerate(rank0) if line.split()[:4] == ["rank", "params", "grads", "optimizer"])
    rows = [line.split() for line in rank0[header + 1:header + 3]]
    assert [row[0] for row in rows] == ["0", "1"]
    for row in rows:  # measured/formula cells
        assert all(re.fullmatch(r"[\d.]+/", cell) for cell in row[1:8:2]), row
    assert any(line.startswith("DDP would need") and "zero2 uses" in line for line in rank0)
    accuracy = float(re.search(r"accuracy ([\d.]+)", result.stdout).group(1))
    assert accuracy > 3 * 0.1


def test_default_gpt_run_learns_well_below_the_unigram_entropy(tmp_path):
    """``--model gpt`` with its defaults on 4 ranks, on the standard library's source text:
    the held-out bits per character fall well below what byte frequencies alone give."""
    metrics = tmp_path / "m.json"
    result = ok(launch(4, "--model", "gpt", "--metrics-json", metrics, timeout=240))
    doc = json.loads(metrics.read_text())
    assert doc["model"] == "gpt" and doc["steps"] == 300 and doc["accuracy"] is None
    assert doc["held_out_bits_per_char"] < doc["unigram_bits"] - 1.0, doc["held_out_bits_per_char"]
    assert "bits/char" in result.stdout and "unigram entropy" in result.stdout

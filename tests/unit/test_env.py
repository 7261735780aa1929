"""Reading the job layout and settings from launcher environments (ringcomm.env)."""
import dataclasses
import math

import pytest

from ringcomm import env

pytestmark = pytest.mark.timeout(30)


def layout(info):
    return (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size)


# -- launchers ---------------------------------------------------------------------------------------

def test_no_launcher_is_a_single_process():
    info = env.from_environ({})
    assert layout(info) == ("none", 0, 1, 0, 1)
    assert info.master_addr == "127.0.0.1"
    assert info.master_port == 0
    assert info.timeout == env.DEFAULT_TIMEOUT == 300.0
    assert info.segment_bytes == env.DEFAULT_LANE_SEGMENT_BYTES == 4 << 20
    assert info.force_tcp is False
    assert info.shared_memory is True and info.shm_slots == 4
    env.validate(info)


@pytest.mark.parametrize("extra, expected", [
    ({}, 4 << 20),                                        # all ranks on this host: lanes
    ({"LOCAL_WORLD_SIZE": "2"}, 1 << 20),                 # other hosts too: ZeroMQ over TCP
    ({"RINGCOMM_SHM": "0"}, 1 << 20),
    ({"RINGCOMM_TRANSPORT": "tcp"}, 1 << 20),
    ({"RINGCOMM_SEGMENT_BYTES": "65536"}, 65536),         # the user's choice wins
    ({"LOCAL_WORLD_SIZE": "2", "RINGCOMM_SEGMENT_BYTES": "8388608"}, 8 << 20),
])
def test_segment_size_default_follows_the_transport(extra, expected):
    environ = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", **extra}
    assert env.from_environ(environ).segment_bytes == expected


def test_shared_memory_settings_are_checked():
    assert env.from_environ({"RINGCOMM_SHM": "off"}).shared_memory is False
    with pytest.raises(ValueError, match="SHM_SLOTS"):
        env.validate(env.from_environ({"RINGCOMM_SHM_SLOTS": "0"}))


def test_collective_window_is_read_once_and_checked():
    assert env.from_environ({}).collective_window == 16
    assert env.from_environ({"RINGCOMM_COLLECTIVE_WINDOW": "4"}).collective_window == 4
    with pytest.raises(ValueError, match="at least 2, got 1"):
        env.validate(env.from_environ({"RINGCOMM_COLLECTIVE_WINDOW": "1"}))
    with pytest.raises(ValueError, match="RINGCOMM_COLLECTIVE_WINDOW='many'"):
        env.from_environ({"RINGCOMM_COLLECTIVE_WINDOW": "many"})


def test_from_environ_does_not_read_os_environ_when_given_a_dict(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert layout(env.from_environ({})) == ("none", 0, 1, 0, 1)
    assert layout(env.from_environ()) == ("launcher", 3, 4, 0, 4)


def test_torchrun_style():
    info = env.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7",
                             "MASTER_PORT": "29500"})
    assert layout(info) == ("launcher", 5, 8, 1, 4)
    assert (info.master_addr, info.master_port) == ("10.0.0.7", 29500)
    env.validate(info)


def test_torchrun_style_local_defaults():
    info = env.from_environ({"RANK": "2", "WORLD_SIZE": "3", "MASTER_PORT": "1234"})
    # without LOCAL_*: local rank 0, every rank on one host
    assert layout(info) == ("launcher", 2, 3, 0, 3)


def test_open_mpi():
    info = env.from_environ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "12",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_PORT": "4000"})
    assert layout(info) == ("mpirun", 6, 12, 2, 4)
    env.validate(info)


def test_slurm():
    info = env.from_environ({"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
                             "SLURM_NTASKS_PER_NODE": "2(x3)", "MASTER_PORT": "4000"})
    assert layout(info) == ("srun", 3, 6, 1, 2)
    env.validate(info)


@pytest.mark.parametrize("counts, node, here", [("3,1(x2)", "0", 3), ("3,1(x2)", "2", 1), ("2(x3)", "1", 2),
                                               ("4", None, 4)])
def test_slurm_tasks_on_this_node(counts, node, here):
    """What srun sets by default (no --ntasks-per-node): the step's per-node counts."""
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "5", "SLURM_STEP_TASKS_PER_NODE": counts}
    if node is not None:
        environ["SLURM_NODEID"] = node
    assert env.from_environ(environ).local_world_size == here


def test_slurm_without_per_node_counts_takes_one_node():
    assert env.from_environ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}).local_world_size == 3


def test_slurm_ntasks_per_node_is_one_count_for_every_node():
    environ = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1"}
    assert env.from_environ(environ).local_world_size == 4
    environ["SLURM_TASKS_PER_NODE"] = "1(x4),4"  # the layout granted wins over the request
    assert env.from_environ(environ).local_world_size == 1


def test_slurm_several_nodes_without_a_node_id_is_an_error():
    with pytest.raises(ValueError, match="SLURM_NODEID is not set"):
        env.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})


def test_slurm_node_beyond_the_counts_is_an_error():
    with pytest.raises(ValueError, match="SLURM_NODEID=3"):
        env.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
                          "SLURM_NODEID": "3"})


def test_slurm_plain_tasks_per_node():
    info = env.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                             "SLURM_NTASKS_PER_NODE": "4"})
    assert layout(info) == ("srun", 0, 4, 0, 4)


def test_launcher_variables_take_precedence():
    info = env.from_environ({"RANK": "1", "WORLD_SIZE": "2",
                             "OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "9",
                             "SLURM_PROCID": "4", "SLURM_NTASKS": "5"})
    assert layout(info)[:3] == ("launcher", 1, 2)
    info = env.from_environ({"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "9",
                             "SLURM_PROCID": "4", "SLURM_NTASKS": "5"})
    assert layout(info)[:3] == ("mpirun", 7, 9)


@pytest.mark.parametrize("environ, missing", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE"),
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
])
def test_rank_without_size_is_an_error(environ, missing):
    with pytest.raises(ValueError, match=missing):
        env.from_environ(environ)


@pytest.mark.parametrize("name, value", [
    ("RANK", "abc"), ("RANK", "-1"), ("RANK", " 1"), ("RANK", "x1"),
    ("WORLD_SIZE", "four"), ("LOCAL_RANK", "?"), ("LOCAL_WORLD_SIZE", "-4"),
    ("MASTER_PORT", "http"), ("RINGCOMM_SEGMENT_BYTES", "big"),
])
def test_non_integer_value_names_the_variable(name, value):
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234", name: value}
    with pytest.raises(ValueError) as info:
        env.from_environ(environ)
    assert name in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["1.5", "1x", "1e3", "2(x3)", "1,2"])
def test_rank_with_trailing_garbage_is_rejected(value):
    # a value that merely starts with digits must not be read as that number
    with pytest.raises(ValueError, match="RANK"):
        env.from_environ({"RANK": value, "WORLD_SIZE": "2000", "MASTER_PORT": "1234"})


@pytest.mark.parametrize("name", ["WORLD_SIZE", "MASTER_PORT", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_slurm_count_syntax_only_for_slurm_variables(name):
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234",
               "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", name: "2(x3)"}
    if name.startswith("OMPI"):
        del environ["RANK"]
    with pytest.raises(ValueError, match=name):
        env.from_environ(environ)


@pytest.mark.parametrize("value", ["2(x3)x", "(x3)", "2(3)", "2.5"])
def test_slurm_tasks_per_node_garbage_is_rejected(value):
    with pytest.raises(ValueError, match="SLURM_NTASKS_PER_NODE"):
        env.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "6",
                          "SLURM_NTASKS_PER_NODE": value})


# -- master and settings ----------------------------------------------------------------------------

def test_empty_master_addr_falls_back_to_loopback():
    info = env.from_environ({"MASTER_ADDR": "", "MASTER_PORT": ""})
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 0)


def test_ringcomm_settings():
    info = env.from_environ({"RINGCOMM_TIMEOUT": "2.5", "RINGCOMM_SEGMENT_BYTES": "65536",
                             "RINGCOMM_SECRET": "s3cret", "RINGCOMM_TRANSPORT": "TCP"})
    assert info.timeout == 2.5
    assert info.segment_bytes == 65536
    assert info.secret == "s3cret"
    assert info.force_tcp is True
    env.validate(info)


@pytest.mark.parametrize("value, tcp", [("tcp", True), ("Tcp", True), ("", False),
                                        ("ipc", False), ("auto", False)])
def test_transport_setting(value, tcp):
    assert env.from_environ({"RINGCOMM_TRANSPORT": value}).force_tcp is tcp


def test_no_secret_is_derived_from_public_values():
    job = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "5000", "WORLD_SIZE": "2", "RANK": "0"}
    assert env.from_environ(job).secret == ""  # ringcomm.secret.resolve decides at init
    assert env.from_environ({**job, "RINGCOMM_SECRET": "s"}).secret == "s"


def test_job_id_names_the_launch():
    assert env.job_id({}) == ""
    assert env.job_id({"RINGCOMM_JOB_ID": "a", "RINGCOMM_RESTART_COUNT": "2"}) == "a:::2"
    assert env.job_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == "7:0"
    assert env.job_id({"TORCHELASTIC_RUN_ID": "r"}) != env.job_id({"TORCHELASTIC_RUN_ID": "s"})


def test_bad_timeout_value_is_value_error():
    with pytest.raises(ValueError):
        env.from_environ({"RINGCOMM_TIMEOUT": "soon"})


# -- validate ---------------------------------------------------------------------------------------------

def job(**changes):
    base = env.JobInfo(rank=0, world_size=2, master_port=29500)
    return dataclasses.replace(base, **changes)


def test_validate_accepts_good_job():
    env.validate(job())
    env.validate(job(rank=1))
    env.validate(env.JobInfo())  # a single process needs no port


@pytest.mark.parametrize("rank, world", [(2, 2), (5, 2), (-1, 2), (1, 1)])
def test_validate_rank_out_of_range(rank, world):
    with pytest.raises(ValueError, match="outside world size"):
        env.validate(job(rank=rank, world_size=world))


@pytest.mark.parametrize("world", [0, -3])
def test_validate_world_size(world):
    with pytest.raises(ValueError, match="world size"):
        env.validate(job(world_size=world))


def test_validate_world_without_master_port():
    with pytest.raises(ValueError, match="MASTER_PORT"):
        env.validate(job(master_port=0))
    with pytest.raises(ValueError, match="MASTER_PORT"):
        env.validate(env.from_environ({"RANK": "0", "WORLD_SIZE": "2"}))


@pytest.mark.parametrize("timeout", [0.0, -1.0, -math.inf, math.inf])
def test_validate_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        env.validate(job(timeout=timeout))


def test_validate_bad_timeout_from_environ():
    with pytest.raises(ValueError, match="timeout"):
        env.validate(env.from_environ({"RINGCOMM_TIMEOUT": "0"}))


def test_validate_rejects_nan_timeout():
    # with a NaN deadline Transport.recv would never time out
    with pytest.raises(ValueError, match="timeout"):
        env.validate(env.from_environ({"RINGCOMM_TIMEOUT": "nan"}))


@pytest.mark.parametrize("segment_bytes", [0, 1, 1023])
def test_validate_small_segments(segment_bytes):
    with pytest.raises(ValueError, match="segment"):
        env.validate(job(segment_bytes=segment_bytes))
    env.validate(job(segment_bytes=1024))


@pytest.mark.parametrize("setting, local, expected", [
    (None, 4, False), (None, 2, True),          # unset: encrypted exactly when hosts are several
    ("1", 4, True), ("yes", 4, True), ("0", 2, False), ("off", 2, False)])
def test_encryption_defaults_to_on_across_hosts(setting, local, expected):
    environ = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(local),
               "MASTER_PORT": "1234", **({"RINGCOMM_ENCRYPT": setting} if setting else {})}
    assert env.encrypts(env.from_environ(environ)) is expected


def test_a_garbled_encryption_setting_is_refused():
    with pytest.raises(ValueError, match="RINGCOMM_ENCRYPT='maybe': expected 1 or 0"):
        env.from_environ({"RINGCOMM_ENCRYPT": "maybe"})


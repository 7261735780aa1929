"""Where the job secret comes from: never from public values unless the user opts out."""
import logging
import os
import stat

import pytest

from ringcomm import env, rundir, secret
from ringcomm.errors import CommTimeout


def job(**overrides):
    info = env.JobInfo(rank=0, world_size=2, local_rank=0, local_world_size=2,
                       master_addr="127.0.0.1", master_port=4321, timeout=0.5)
    for name, value in overrides.items():
        setattr(info, name, value)
    return info


@pytest.fixture(autouse=True)
def private_run_dir(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


def test_the_environment_wins():
    assert secret.resolve(job(), {"RINGCOMM_SECRET": "abc"}) == ("abc", "")


def test_a_secret_file(tmp_path, caplog):
    path = tmp_path / "s"
    path.write_text("  xyz\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        assert secret.resolve(job(), {"RINGCOMM_SECRET_FILE": str(path)}) == ("xyz", "")
    assert "may be read by other users" in caplog.text
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        secret.resolve(job(), {"RINGCOMM_SECRET_FILE": str(path)})
    with pytest.raises(ValueError, match="cannot be read"):
        secret.resolve(job(), {"RINGCOMM_SECRET_FILE": str(tmp_path / "missing")})


def test_several_hosts_without_a_secret_are_refused():
    with pytest.raises(ValueError, match="RINGCOMM_SECRET_FILE") as err:
        secret.resolve(job(world_size=4), {})
    assert "RINGCOMM_SECRET" in str(err.value) and "RINGCOMM_INSECURE" in str(err.value)


def test_insecure_opt_out_derives_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        value, made = secret.resolve(job(world_size=4), {"RINGCOMM_INSECURE": "1"})
    assert value == secret.derived("127.0.0.1", 4321) and made == ""
    assert "RINGCOMM_INSECURE=1" in caplog.text


def test_ranks_of_one_host_agree_through_a_private_file():
    value, path = secret.resolve(job(), {})
    assert len(value) == 32 and value != secret.derived("127.0.0.1", 4321)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert secret.resolve(job(rank=1, local_rank=1), {}) == (value, "")
    again, _ = secret.resolve(job(), {})
    assert again != value  # a fresh launch draws a fresh secret
    os.unlink(path)


def test_a_file_left_by_a_dead_rank_is_not_trusted():
    value, path = secret.resolve(job(), {})
    with open(path, "w") as f:
        f.write(f"{rundir.owner(2 ** 22 + 12345)} {'f' * 32}\n")  # no such process
    with pytest.raises(CommTimeout, match="RINGCOMM_SECRET"):
        secret.resolve(job(rank=1, local_rank=1), {})
    os.unlink(path)


@pytest.mark.parametrize("other", [{"TORCHELASTIC_RESTART_COUNT": "1"}, {"RINGCOMM_RESTART_COUNT": "2"},
                                   {"RINGCOMM_JOB_ID": "another"}])
def test_another_launch_on_the_same_port_does_not_share_it(other):
    """Another restart round or another job name on the same port and launcher: another file."""
    value, path = secret.resolve(job(job=env.job_id({})), {})
    with pytest.raises(CommTimeout):
        secret.resolve(job(rank=1, local_rank=1, job=env.job_id(other)), other)
    os.unlink(path)


def test_a_file_from_another_pid_namespace_is_trusted_not_judged():
    value, path = secret.resolve(job(), {})
    with open(path, "w") as f:
        f.write(f"1.{2 ** 22 + 12345} {'e' * 32}\n")  # pid namespace 1: not this one
    assert secret.resolve(job(rank=1, local_rank=1), {}) == ("e" * 32, "")
    os.unlink(path)

"""Which timeout, backend and thread count a multi-rank test gets, and from where."""

import pytest

from pytest_weightsync.ranks import RankPool, dispatch


class Config:
    """Just the two lookups the resolvers make, so every precedence case is one line."""

    def __init__(self, ini="180", start_ini="", **options):
        self.options = options
        self.ini = {"weightsync_rank_timeout": ini, "weightsync_startup_timeout": start_ini}

    def getoption(self, name, default=None):
        return self.options.get(name, default)

    def getini(self, name):
        return self.ini[name]


def test_timeout_precedence_marker_then_option_then_ini():
    assert dispatch.resolve_timeout(Config(weightsync_rank_timeout=7.0), 3) == (3.0, "the ranks marker / timeout argument")
    assert dispatch.resolve_timeout(Config(weightsync_rank_timeout=7.0), None) == (7.0, "--weightsync-rank-timeout")
    assert dispatch.resolve_timeout(Config(ini="45"), None) == (45.0, "ini weightsync_rank_timeout")
    assert dispatch.resolve_timeout(Config(), None) == (180.0, "ini weightsync_rank_timeout")


def test_start_timeout_is_its_own_option_and_ini_never_the_rank_timeout():
    assert dispatch.resolve_start_timeout(Config(weightsync_startup_timeout=40.0)) == (
        40.0, "--weightsync-startup-timeout")
    assert dispatch.resolve_start_timeout(Config(start_ini="600")) == (
        600.0, "ini weightsync_startup_timeout")
    # a short rank timeout bounds test bodies, not start-up (a cold start can take minutes)
    assert dispatch.resolve_start_timeout(Config(weightsync_rank_timeout=7.0)) == (
        300.0, "the default start-up limit")
    assert dispatch.resolve_start_timeout(Config(ini="20")) == (300.0, "the default start-up limit")
    assert dispatch.resolve_start_timeout(Config()) == (300.0, "the default start-up limit")
    for bad in ("soon", "0"):
        with pytest.raises(pytest.UsageError, match="weightsync_startup_timeout"):
            dispatch.resolve_start_timeout(Config(start_ini=bad))
    with pytest.raises(pytest.UsageError, match="--weightsync-startup-timeout"):
        dispatch.resolve_start_timeout(Config(weightsync_startup_timeout=-1.0))


@pytest.mark.parametrize("ini", ["soon", "0", "-1"])
def test_bad_ini_timeout_names_the_key_and_value(ini):
    with pytest.raises(pytest.UsageError, match=rf"weightsync_rank_timeout must be .*{ini!r}"):
        dispatch.resolve_timeout(Config(ini=ini), None)


def test_threads_default_to_one_and_zero_keeps_torch_default():
    assert dispatch.resolve_threads(Config()) == 1
    assert dispatch.resolve_threads(Config(weightsync_threads=0)) == 0
    with pytest.raises(pytest.UsageError, match="-2"):
        dispatch.resolve_threads(Config(weightsync_threads=-2))


class Item:
    def __init__(self, gpu: bool):
        self.gpu = gpu

    def get_closest_marker(self, name):
        return object() if (name == "gpu" and self.gpu) else None


def test_backend_precedence(monkeypatch):
    monkeypatch.setattr(dispatch, "_gpu_count", lambda: 2)
    assert dispatch.resolve_backend(Config(weightsync_backend="nccl"), Item(False), "gloo") == "gloo"
    assert dispatch.resolve_backend(Config(weightsync_backend="gloo"), Item(True), None) == "gloo"
    assert dispatch.resolve_backend(Config(weightsync_backend="auto"), Item(True), None) == "nccl"
    assert dispatch.resolve_backend(Config(weightsync_backend="auto"), Item(False), None) == "gloo"
    monkeypatch.setattr(dispatch, "_gpu_count", lambda: 0)
    assert dispatch.resolve_backend(Config(weightsync_backend="auto"), Item(True), None) == "gloo"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive int, got 0"),
        ({"world_size": 2, "backend": "mpi"}, "backend must be one of .*'mpi'"),
        ({"world_size": 2, "threads": -1}, "threads must be an int >= 0"),
        ({"world_size": 2, "timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ],
)
def test_rank_pool_rejects_bad_settings_before_spawning(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RankPool(**kwargs)

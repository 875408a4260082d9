"""The users file (``prefetchd_client.users``): a guest's shared hold, the starter's wait for it,
and what a hostile or missing file does (nothing waits on it)."""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from conftest import wait_until
from prefetchd_client import users

from prefetchd.format.progress import USERS_NAME

# A guest in another process: holds the users file shared until its stdin closes
GUEST = textwrap.dedent("""
    import sys
    from prefetchd_client import users
    g = users.Guest.join(sys.argv[1], lambda: True)
    print("held", flush=True)
    sys.stdin.read()
    g.close()
""")


def _guest(directory) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", GUEST, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_the_starter_waits_for_a_guest_naming_it_once_and_holds_the_file_until_released(tmp_path):
    g = _guest(tmp_path)
    said: list[str] = []
    got: list[users.OwnerHold] = []
    t = threading.Thread(target=lambda: got.append(users.wait_for_guests(str(tmp_path), 42, said.append, lambda: False)))
    t.start()
    wait_until(lambda: said, 10, "the line naming the guest")
    assert t.is_alive(), "it did not wait"
    assert said[0].startswith(f"the daemon (pid 42) is still used by pid {g.pid} ("), said
    assert "waiting for that to end before stopping the daemon (a stop signal stops it now)" in said[0]
    g.stdin.close()
    assert g.wait(10) == 0
    t.join(10)
    assert not t.is_alive() and len(said) == 1, said
    # held exclusively now: a guest arriving waits until the release, then finds no daemon
    serving = [True]
    late: list[object] = []
    lines: list[str] = []
    lt = threading.Thread(target=lambda: late.append(users.Guest.join(str(tmp_path), lambda: serving[0],
                                                                      lines.append)))
    lt.start()
    wait_until(lambda: lines, 10, "the arriving guest's line")
    assert lt.is_alive() and late == [], "a guest got in while the starter held the file"
    serving[0] = False
    got[0].release()
    lt.join(10)
    assert late == [None]


def test_no_guest_no_wait_and_a_stop_ends_a_wait(tmp_path):
    said: list[str] = []
    hold = users.wait_for_guests(str(tmp_path), 1, said.append, lambda: False)
    assert said == [] and os.path.isfile(tmp_path / USERS_NAME)
    hold.release()
    g = _guest(tmp_path)
    try:
        hold = users.wait_for_guests(str(tmp_path), 1, said.append, lambda: True)  # a stop signal came
        assert len(said) == 1 and str(g.pid) in said[0]
        hold.release()
    finally:
        g.stdin.close()
        g.wait(10)


def test_a_guest_that_dies_is_not_waited_for(tmp_path):
    g = _guest(tmp_path)
    g.kill()
    g.wait(10)
    said: list[str] = []
    users.wait_for_guests(str(tmp_path), 1, said.append, lambda: False).release()
    assert said == []


def test_a_guest_of_a_daemon_gone_meanwhile_holds_nothing(tmp_path):
    assert users.Guest.join(str(tmp_path), lambda: False) is None
    said: list[str] = []
    users.wait_for_guests(str(tmp_path), 1, said.append, lambda: False).release()  # nothing left held
    assert said == []


def test_a_fifo_or_a_symlink_at_the_name_is_never_waited_on(tmp_path):
    os.mkfifo(tmp_path / USERS_NAME)
    g = users.Guest.join(str(tmp_path), lambda: True)  # no hold, but it does not block either
    assert g is not None
    g.close()
    users.wait_for_guests(str(tmp_path), 1, lambda line: None, lambda: False).release()
    os.unlink(tmp_path / USERS_NAME)
    (tmp_path / "target").write_text("")
    os.symlink(tmp_path / "target", tmp_path / USERS_NAME)
    assert users.Guest.join(str(tmp_path), lambda: True) is not None


def test_a_directory_that_is_not_there_holds_nothing_and_waits_for_nothing(tmp_path):
    missing = str(tmp_path / "no" / "such")
    g = users.Guest.join(missing, lambda: True)
    assert g is not None
    g.close()
    users.wait_for_guests(missing, 1, lambda line: None, lambda: False).release()
    assert not os.path.exists(missing)


# A guest whose trainer forks a worker (a DataLoader's, multiprocessing's "fork") while it holds
# the daemon, then ends its use of it (serve()'s block ends) with the worker still alive
FORKING_GUEST = textwrap.dedent("""
    import multiprocessing, sys
    from prefetchd_client import users
    g = users.Guest.join(sys.argv[1], lambda: True)
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    worker = ctx.Process(target=done.wait, args=(60,))
    worker.start()
    g.close()
    print("closed", flush=True)
    sys.stdin.read()
    done.set()
    worker.join(10)
""")


def test_a_worker_forked_by_a_guest_does_not_hold_the_daemon_after_the_guest_let_go(tmp_path):
    """The forked worker shares the guest's open file and with it the lock: the starter waited
    for the worker (naming the guest, which had let go) until it exited, for ever for a
    persistent one in a notebook."""
    p = subprocess.Popen([sys.executable, "-c", FORKING_GUEST, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "closed"
        deadline = time.monotonic() + 5  # the worker closes its copy as it starts: a moment, not the worker's life
        hold = users.wait_for_guests(str(tmp_path), 1, lambda line: None, lambda: time.monotonic() > deadline)
        try:
            assert _held_exclusively(tmp_path), "the worker holds it still"
        finally:
            hold.release()
    finally:
        p.stdin.close()
        p.wait(30)


def _held_exclusively(directory) -> bool:
    fd = os.open(os.path.join(directory, USERS_NAME), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_forked_child_that_ends_the_guests_block_too_closes_nothing_of_its_own(tmp_path):
    """A child forked without exec that runs on through the block's end (``guest.close()``): the
    descriptor's number, closed at the fork, may be a file of the child's own by then."""
    g = users.Guest.join(str(tmp_path), lambda: True)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(os.devnull, os.O_RDONLY)  # the lowest free number: the one closed at the fork
            g.close()
            os.fstat(fd)
            code = 0
        finally:
            os._exit(code)
    _, st = os.waitpid(pid, 0)
    g.close()
    assert os.waitstatus_to_exitcode(st) == 0


def test_a_filesystem_without_flock_neither_fails_nor_waits_and_the_guest_says_it_holds_nothing(tmp_path, monkeypatch):
    """A progress.dir where flock fails (Lustre mounted without -o flock: ENOSYS; some NFS and FUSE
    mounts): it raised out of the guest's start, and out of the starter's clean-up (a traceback,
    the daemon left to die with launch and its directories left behind)."""
    def no_flock(fd, how):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    said: list[str] = []
    g = users.Guest.join(str(tmp_path), lambda: True, said.append)
    assert g is not None
    g.close()
    assert said == [f"cannot lock {tmp_path / USERS_NAME} (Function not implemented): the launch or serve() that "
                    f"started the daemon cannot know this one uses it, and may stop it when its own command ends"]
    said.clear()
    users.wait_for_guests(str(tmp_path), 1, said.append, lambda: False).release()
    assert said == [f"cannot lock {tmp_path / USERS_NAME} (Function not implemented): stopping the daemon (pid 1) "
                    f"without waiting for launches or serve() blocks that may use it"]


def test_on_nfs_the_starter_still_sees_a_guest(tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, where an exclusive lock needs a descriptor open for
    writing (EBADF otherwise): the starter, opening the file read-only, took the EBADF for "no
    flock here" and stopped the daemon under the guest's trainers."""
    real = fcntl.flock

    def nfs_flock(fd, how):
        if how & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, how)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    g = users.Guest.join(str(tmp_path), lambda: True)
    assert g is not None and g.held
    said: list[str] = []
    users.wait_for_guests(str(tmp_path), 7, said.append, lambda: True).release()  # a stop signal ends the wait
    g.close()
    assert len(said) == 1 and said[0].startswith("the daemon (pid 7) is still used by another process"), said
    said.clear()
    users.wait_for_guests(str(tmp_path), 7, said.append, lambda: False).release()  # the guest gone: no wait
    assert said == []


def test_a_guest_whose_check_raises_holds_nothing(tmp_path):
    """The daemon's meta.json said another stream by the time the guest looked again
    (``running_daemon`` raises): the shared lock stayed taken, and every later starter waited for
    it as long as the process lived (a notebook's kernel)."""
    def other_stream():
        raise RuntimeError("another prefetchd already serves it with a different stream")

    with pytest.raises(RuntimeError):
        users.Guest.join(str(tmp_path), other_stream)
    said: list[str] = []
    users.wait_for_guests(str(tmp_path), 1, said.append, lambda: False).release()
    assert said == []


@pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (nobody)")
def test_a_guest_that_cannot_open_another_users_file_says_it_holds_nothing():
    """The file of another user of the group, mode 0600 (made under a umask of 077, or planted): the
    guest went without the hold, silently, and the launch that started the daemon stopped it under
    the guest's trainers."""
    d = tempfile.mkdtemp(prefix="prefetchd-users-")  # outside pytest's 0700 tmp: nobody can reach it
    try:
        os.chmod(d, 0o777)  # a progress directory the group writes
        fd = os.open(os.path.join(d, USERS_NAME), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the guest, as another user
            try:
                nobody = pwd.getpwnam("nobody").pw_uid
                os.setgroups([])
                os.setgid(nobody)
                os.setuid(nobody)
                said: list[str] = []
                g = users.Guest.join(d, lambda: True, said.append)
                os.write(w, ("\n".join(said) if g is not None else "None").encode())
            except BaseException as e:
                os.write(w, repr(e).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            out = f.read().decode()
        os.waitpid(pid, 0)
        assert out == (f"cannot open {d}/{USERS_NAME} (Permission denied): the launch or serve() that started the "
                       f"daemon cannot know this one uses it, and may stop it when its own command ends"), out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_users_file_is_readable_by_every_user_of_the_daemon_whatever_the_umask(tmp_path):
    """Made under a umask of 077 (common on shared clusters) it was 0600: the trainers of another
    user of the group could not open it, and held nothing."""
    old = os.umask(0o077)
    try:
        users.Guest.join(str(tmp_path), lambda: True).close()
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / USERS_NAME).st_mode & 0o777) == oct(0o644)


def _users_fds() -> list[str]:
    fds = []
    for n in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{n}").endswith(USERS_NAME):
                fds.append(n)
        except FileNotFoundError:  # the directory's own descriptor, closed since
            pass
    return fds


def test_a_ctrl_c_in_the_wait_leaves_nothing_open(tmp_path):
    """serve()'s wait ends at a Ctrl-C (a KeyboardInterrupt from its sleep): the users file stayed
    open in the trainer, one more each time a notebook's cell was interrupted so."""
    g = _guest(tmp_path)
    try:
        def ctrl_c() -> bool:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            users.wait_for_guests(str(tmp_path), 1, lambda line: None, ctrl_c)
        assert _users_fds() == []
    finally:
        g.stdin.close()
        g.wait(10)


def test_a_guest_arriving_while_the_daemon_is_stopped_says_why_it_waits(tmp_path):
    """The starter holds the file while it stops the daemon (up to its 20 s stop timeout, and
    while it removes the buffer): the guest's launch waited there without a word."""
    hold = users.wait_for_guests(str(tmp_path), 1, lambda line: None, lambda: False)  # the starter, stopping
    said: list[str] = []
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(users.Guest.join(str(tmp_path), lambda: False, said.append)))
    t.start()
    try:
        wait_until(lambda: said, 10, "the guest's line")
        assert t.is_alive()
        assert said == [f"the daemon is being stopped by the launch or serve() that started it "
                        f"({tmp_path / USERS_NAME} is held); waiting for that"]
    finally:
        hold.release()
        t.join(10)
    assert got == [None] and len(said) == 1  # the daemon is gone: the guest starts its own

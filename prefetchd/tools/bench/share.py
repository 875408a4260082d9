"""``prefetchd bench --share``: does a CPU-bound trainer keep its core while the daemon works?

Issue 30's two figures, for each ``workers.priority`` (``--share-priorities``, default
``normal,batch,idle,nice``; ``normal`` is what every worker ran at before), alternated
``--repeats`` times so drifting load from other users of the machine falls on every variant alike:

* **CPU-bound step** (``toggled_run``): a trainer (a process at normal priority) times steps of
  one thread's work (``--share-step python``: a pure-Python loop; ``torch``: matmuls under
  ``torch.set_num_threads(1)``) back to back, while the daemon (workers ``auto``) produces flat
  out (rank 1 reads batches as fast as it can; rank 0's window is full, so the daemon produces
  for rank 1). Every ``--share-phase-s`` (0.5 s) the daemon's process group is stopped (SIGSTOP)
  or continued, for ``--share-cycles`` cycles (30). The figure is the geometric mean over the
  running phases of each one's mean step over the mean step of the stopped phases either side of
  it, with its 95 % bootstrap interval: the machine's own speed, which drifts over seconds (a VM's
  neighbours), cancels out of each pair. Target: <= 1.05. Beside it the median step running over
  the median stopped, the mean over the mean, and the share of the steps' time the trainer was
  runnable while another task held its CPU (its schedstat run-queue delay): what the scheduler
  took from it, as against what caches or memory bandwidth would. The summary pools every pair
  of every round.
* **GPU-like trainers**: ranks 0 and 1 each sleep ``--step-ms`` per step (a step that waits on the
  GPU) and read ``--batches`` batches; images/s of both together, against the ``normal`` run of
  the same round. Target: >= 0.97. The summary gives, beside the median, the geometric mean of
  the rounds' ratios with a 95 % bootstrap interval: one round moves by more than 3 %, so only
  its lower end at or above 0.97 shows the target met. ``--share-only gpu`` runs just this figure
  (``step``, just the other), so many rounds fit in a few minutes. ``--share-only gpu-paired``
  (root only) pairs it in time instead, as the step is: one daemon, the two trainers reading
  throughout, its workers switched between SCHED_IDLE and normal every ``--share-phase-s``; each
  idle phase's images/s over the normal phases beside it (``gpu_paired_run``).

``--share-pin`` binds the CPU-bound trainer to the first CPU and rank 1 to the second (the GPU-like
ranks too), as a job that gives each rank its own cores does (Slurm's ``--cpu-bind``, ``taskset``);
the daemon is not bound. Each round prints one line per variant with the 1-minute load average
beside it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context

from prefetchd.tools.demo import write_config
from prefetchd.tools.samples import make_image_folder

_STEP_LOOP = 400_000  # about 30 ms of one thread's pure Python on this machine's cores


def _python_step() -> float:
    t = time.perf_counter()
    s = 0
    for i in range(_STEP_LOOP):
        s += i * i
    return time.perf_counter() - t


def _torch_step_fn():
    import torch

    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def step() -> float:
        t = time.perf_counter()
        for _ in range(8):
            (a @ a).sum()
        return time.perf_counter() - t
    return step


def _trainer(cfg: str | None, rank: int, steps: int, kind: str, start, out, cpu: int | None = None) -> None:
    """Rank ``rank``'s trainer: ``steps`` timed steps of ``kind`` (cpu steps, or ``sleep:MS``), a
    batch read between steps when ``cfg`` is set. Puts (rank, step times, images, t0, t1)."""
    _pin(cpu)
    step = _torch_step_fn() if kind == "torch" else _python_step
    if kind.startswith("sleep:"):
        ms = float(kind.split(":")[1]) / 1000

        def step() -> float:
            t = time.perf_counter()
            time.sleep(ms)
            return time.perf_counter() - t
    for _ in range(3):  # warm up (and, for torch, its kernels)
        step()
    client = None
    if cfg is not None:
        from prefetchd_client import PrefetchClient

        client = PrefetchClient(cfg, rank=rank, timeout=300, as_numpy=True)
        it = _endless(client)
        next(it)  # the daemon is producing: the clock starts with the first batch
    start.wait()
    times, images = [], 0
    t0 = time.monotonic()
    for _ in range(steps):
        if kind != "none":
            times.append(step())
        if client is not None:
            _, y = next(it)
            images += len(y)
    t1 = time.monotonic()
    if client is not None:
        client.close()
    out.put((rank, times, images, t0, t1))


def _endless(client):
    """Batches epoch after epoch (the daemon's epochs are endless here)."""
    e = 0
    while True:
        yield from client.iter_epoch(e)
        e += 1


def _pin(cpu: int | None) -> None:
    """Bind this process to the ``cpu``-th CPU it may use (``--share-pin``), as a job binds its ranks."""
    if cpu is not None:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu]})


def _reader(cfg: str, rank: int, start, stop, out, cpu: int | None = None, rate: float | None = None) -> None:
    """Rank ``rank`` reading batches until ``stop``: as fast as it can (it waits for each batch,
    keeping the daemon producing), or ``rate`` batches a second from a ring filled ahead (a GPU
    trainer's pace). Puts (rank, [seconds spent in ``next`` over the run's seconds], images, t0, t1)."""
    from prefetchd_client import PrefetchClient

    _pin(cpu)
    with PrefetchClient(cfg, rank=rank, timeout=300, as_numpy=True) as c:
        it = _endless(c)
        next(it)
        start.wait()
        n = k = 0
        waited = 0.0
        t0 = time.monotonic()
        while not stop.is_set():
            if rate is not None and (ahead := t0 + k / rate - time.monotonic()) > 0:
                time.sleep(ahead)
            t = time.monotonic()
            _, y = next(it)
            waited += time.monotonic() - t
            n += len(y)
            k += 1
        t1 = time.monotonic()
        out.put((rank, [waited / max(t1 - t0, 1e-9)], n, t0, t1))


def _ready(buffer: str, rank: int) -> int:
    """Batches of ``rank`` in the ring now (its published files)."""
    from prefetchd.format.batchfile import parse_name

    with os.scandir(buffer) as it:
        return sum(1 for e in it if (p := parse_name(e.name)) is not None and e.name[0] == "r" and p[0] == rank)


def _fill(buffer: str, proc: subprocess.Popen, ahead: int) -> float:
    """Wait until ranks 0 and 1 each have ``ahead`` batches ready; the daemon's batches a second."""
    t0 = time.monotonic()
    deadline = t0 + 600
    while (n := _ready(buffer, 0) + _ready(buffer, 1)) < 2 * ahead:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the share bench's daemon filled {n} of {2 * ahead} batches and stopped or stalled")
        time.sleep(0.1)
    return n / (time.monotonic() - t0)


def _start_daemon(root: str, work: str, priority: str, batch_size: int, capacity: int,
                  refill_at: int | None = None) -> tuple[subprocess.Popen, str, str]:
    run = tempfile.mkdtemp(prefix=f"share-{priority}-", dir=work)
    buffer = tempfile.mkdtemp(prefix="prefetchd-share-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else run)
    os.rmdir(buffer)
    cfg = os.path.join(run, "share.yaml")
    write_config(cfg, root, buffer, os.path.join(work, "cache"), batch_size, None, "auto", capacity,
                 extra={"loader": {"world_size": 2}, "workers": {"priority": priority},
                        "buffer": {"max_bytes": "auto", "refill_at": refill_at}})
    log_path = os.path.join(run, "daemon.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(buffer, "meta.json")):  # up, or say why not (the trainers would wait)
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_daemon(proc, buffer)
            with open(log_path, errors="replace") as f:
                last = (f.read().strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"the share bench's daemon did not start (exit status {proc.returncode}): {last}")
        time.sleep(0.05)
    return proc, cfg, buffer


def _stop_daemon(proc: subprocess.Popen, buffer: str) -> None:
    import shutil

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    shutil.rmtree(buffer, ignore_errors=True)


def _collect(out, n: int, procs: list) -> dict:
    import queue

    got = {}
    deadline = time.monotonic() + 600
    while len(got) < n:
        try:
            rank, times, images, t0, t1 = out.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a trainer of the share bench failed or hung (see above)") from None
            continue
        got[rank] = (times, images, t0, t1)
    return got


def _stepper(kind: str, stop, out, cpu: int | None = None) -> None:
    """A trainer that only computes: (start, duration, seconds runnable but waiting for a CPU) of
    each step until ``stop`` (the wait from the kernel's schedstat; 0 where it cannot be read)."""
    from prefetchd_client.clock import run_queue_delay

    _pin(cpu)
    step = _torch_step_fn() if kind == "torch" else _python_step
    for _ in range(3):
        step()
    got = []
    while not stop.is_set():
        d0 = run_queue_delay()
        t = time.monotonic()
        d = step()
        d1 = run_queue_delay()
        got.append((t, d, d1 - d0 if d0 is not None and d1 is not None else 0.0))
    out.put((0, got, 0, 0.0, 0.0))


def _paired_ratios(per_phase: list[float | None]) -> list[float]:
    """Each running phase's mean step over the mean of the stopped phases either side of it
    (phases alternate, running first): drift slower than two phases cancels out of each ratio."""
    out = []
    for i in range(0, len(per_phase), 2):
        near = [per_phase[j] for j in (i - 1, i + 1) if 0 <= j < len(per_phase) and per_phase[j] is not None]
        if per_phase[i] is not None and near:
            out.append(per_phase[i] / statistics.fmean(near))
    return out


def toggled_run(root: str, work: str, priority: str, cycles: int, kind: str, batch_size: int,
                phase_s: float = 0.5, pin: bool = False, refill: int = 0) -> dict:
    """The trainer's step with the daemon producing flat out against its step with the daemon
    stopped (SIGSTOP of its process group: workers, loop), the two alternating every ``phase_s``
    within one run, so that other users' load, which drifts over seconds, falls on both alike. The
    first step of each phase is dropped.

    Rank 1 reads as fast as it can, waiting at the head of the ring for each batch (a data-bound
    trainer; with the daemon stopped it waits for nothing), or, with ``refill`` batches a rank,
    from a ring first filled that deep, at 1.2 x the daemon's rate beside the trainer (a trainer reading ahead of a
    refill, as after a restart): it never waits and reads alike whether the daemon runs or not,
    and the daemon, always below its refill mark, produces flat out while it runs."""
    ctx = get_context("fork")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc, cfg, buffer = _start_daemon(root, work, priority, batch_size, refill or 8, refill or None)
    phases: list[tuple[float, float, bool]] = []  # (from, to, daemon running)
    try:
        tstop = ctx.Event()
        trainer = ctx.Process(target=_stepper, args=(kind, tstop, out, 0 if pin else None))
        rate = None
        if refill:  # the daemon's rate beside the trainer, as in the phases it runs: rank 1 reads 1.2 x that
            trainer.start()
            rate = 1.2 * _fill(buffer, proc, refill)  # rank 0 full: all it makes goes to rank 1 then
        reader = ctx.Process(target=_reader, args=(cfg, 1, start, stop, out, 1 if pin else None, rate))
        reader.start()
        start.set()
        if not refill:
            time.sleep(2.0)  # the reader has its first batch: the daemon is producing
            trainer.start()
        time.sleep(1.0)
        for i in range(2 * cycles):
            running = i % 2 == 0
            os.killpg(proc.pid, signal.SIGCONT if running else signal.SIGSTOP)
            t0 = time.monotonic()
            time.sleep(phase_s)
            phases.append((t0, time.monotonic(), running))
        left = _ready(buffer, 1)
        os.killpg(proc.pid, signal.SIGCONT)
        tstop.set()
        got = _collect(out, 1, [trainer])
        stop.set()
        got.update(_collect(out, 1, [reader]))
        trainer.join(30)
        reader.join(30)
        steps = got[0][0]
        busy, idle = [], []
        per_phase: list[float | None] = []  # each phase's mean step (None: no whole step in it)
        for a, b, running in phases:
            mine = [(d, w) for t, d, w in steps if a <= t and t + d <= b][1:]
            (busy if running else idle).extend(mine)
            per_phase.append(statistics.fmean(d for d, _ in mine) if mine else None)
        paired = _paired_ratios(per_phase)
        if not paired:
            raise RuntimeError(f"no phase of {phase_s} s held a whole step of the trainer: give --share-phase-s more")
        waits, n1, r0, r1 = got[1]
        return {"busy_s": statistics.median(d for d, _ in busy), "idle_s": statistics.median(d for d, _ in idle),
                "mean_ratio": statistics.fmean(d for d, _ in busy) / statistics.fmean(d for d, _ in idle),
                "pair_ratios": paired,
                "busy_n": len(busy), "idle_n": len(idle), "rank1_img_s": n1 / max(r1 - r0, 1e-9),
                # the share of the steps' time the trainer was runnable but another task had its CPU
                "busy_wait": sum(w for _, w in busy) / sum(d for d, _ in busy),
                "idle_wait": sum(w for _, w in idle) / sum(d for d, _ in idle),
                "rank1_in_next": waits[0], "rank1_left": left, "rank1_rate": rate}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        _stop_daemon(proc, buffer)


def gpu_run(root: str, work: str, priority: str, batches: int, step_ms: float, batch_size: int,
            pin: bool = False) -> dict:
    """Two GPU-like trainers (sleeping steps): images/s of both together."""
    ctx = get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    proc, cfg, buffer = _start_daemon(root, work, priority, batch_size, 8)
    try:
        procs = [ctx.Process(target=_trainer, args=(cfg, r, batches, f"sleep:{step_ms}", start, out, r if pin else None))
                 for r in (0, 1)]
        for p in procs:
            p.start()
        start.set()
        got = _collect(out, 2, procs)
        for p in procs:
            p.join(60)
        images = sum(g[1] for g in got.values())
        span = max(g[3] for g in got.values()) - min(g[2] for g in got.values())
        return {"img_s": images / span}
    finally:
        _stop_daemon(proc, buffer)


def _gpu_reader(cfg: str, rank: int, step_s: float, start, stop, out, cpu: int | None = None) -> None:
    """A GPU-like trainer for ``gpu_paired_run``: sleeps ``step_s`` a step and reads a batch, until
    ``stop``. Puts (rank, [(arrival time, images) of each batch], 0, 0.0, 0.0)."""
    from prefetchd_client import PrefetchClient

    _pin(cpu)
    with PrefetchClient(cfg, rank=rank, timeout=300, as_numpy=True) as c:
        it = _endless(c)
        next(it)
        start.wait()
        got = []
        while not stop.is_set():
            time.sleep(step_s)
            _, y = next(it)
            got.append((time.monotonic(), len(y)))
    out.put((rank, got, 0, 0.0, 0.0))


def _set_workers_policy(daemon_pid: int, policy: int) -> None:
    """Every thread of the daemon's child processes (its workers) to ``policy`` (nice 0): the
    daemon's own process keeps its priority, as it does under either setting."""
    import psutil

    for p in psutil.Process(daemon_pid).children(recursive=True):
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except PermissionError:  # root without CAP_SYS_NICE (a container): every phase would be idle
                raise RuntimeError("cannot switch the workers out of SCHED_IDLE (no CAP_SYS_NICE): gpu-paired "
                                   "needs it") from None
            if os.sched_getscheduler(int(tid)) != policy:
                raise RuntimeError(f"a worker thread ({tid}) did not take the policy asked for")


def _wait_serving(buffer: str, proc, timeout_s: float = 120.0) -> None:
    """Until the daemon has made a few batches (its status says), or the deadline."""
    from prefetchd.format import status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ((status.read_json(buffer, status.STATUS_NAME) or {}).get("produced_batches") or 0) >= 4:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the daemon made no batch in {timeout_s:.0f} s" if proc.poll() is None else
                       f"the daemon exited with status {proc.returncode} before it made a batch")


def gpu_paired_run(root: str, work: str, batch_size: int, step_ms: float, cycles: int, phase_s: float = 1.0,
                   pin: bool = False) -> list[float]:
    """The GPU-like figure, paired in time: one daemon, two GPU-like trainers reading throughout,
    and the workers switched between SCHED_IDLE and normal priority every ``phase_s`` (root only:
    only a privileged process may raise a thread out of SCHED_IDLE). Each idle phase's images/s
    over the mean of the normal phases either side of it (the first fifth of each phase left out:
    batches made before the switch). Run-to-run spread, which is larger than 3 % here, cancels."""
    ctx = get_context("fork")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc, cfg, buffer = _start_daemon(root, work, "idle", batch_size, 8)
    phases: list[tuple[float, float]] = []
    try:
        readers = [ctx.Process(target=_gpu_reader, args=(cfg, r, step_ms / 1000, start, stop, out, r if pin else None))
                   for r in (0, 1)]
        for p in readers:
            p.start()
        start.set()
        _wait_serving(buffer, proc)  # a slow start (a loaded machine) must not starve the first phase
        time.sleep(1.0)
        for i in range(2 * cycles):
            _set_workers_policy(proc.pid, os.SCHED_IDLE if i % 2 == 0 else os.SCHED_OTHER)
            t0 = time.monotonic()
            time.sleep(phase_s)
            phases.append((t0, time.monotonic()))
        stop.set()
        got = _collect(out, 2, readers)
        for p in readers:
            p.join(30)
    finally:
        _stop_daemon(proc, buffer)
    arrivals = [a for g in got.values() for a in g[0]]
    rates: list[float | None] = []
    for a, b in phases:
        a += (b - a) / 5
        n = sum(k for t, k in arrivals if a <= t < b)
        if not n:  # a starved phase is a finding, not a gap to leave out
            raise RuntimeError(f"no batch reached the trainers in a phase of {phase_s} s (workers "
                               f"{'idle' if len(rates) % 2 == 0 else 'normal'}): give --share-phase-s more, or "
                               f"look at the machine")
        rates.append(n / (b - a))
    return _paired_ratios(rates)


def run_share_bench(args) -> int:
    priorities = [p.strip() for p in args.share_priorities.split(",") if p.strip()]
    if "normal" not in priorities:
        priorities.insert(0, "normal")
    if args.share_pin and len(os.sched_getaffinity(0)) < 2:
        print("prefetchd bench: --share-pin binds two ranks to a CPU each: this process may use only one", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="prefetchd-share-")
    root = os.path.join(work, "data")
    n = make_image_folder(root, classes=4, per_class=max(1, args.images // 4), seed=0, long_side=args.image_side)
    batch = args.batch_size or 16
    print(f"share bench: {n} images (long side {args.image_side}), batches of {batch}, world size 2, workers auto, "
          f"step {args.share_step}, {args.repeats} rounds alternated; cores {len(os.sched_getaffinity(0))}"
          + ("; the trainer bound to the first CPU, rank 1 to the second" if args.share_pin else ""))
    try:
        if args.share_only == "gpu-paired":
            return _gpu_paired_rounds(args, root, work, batch)
        rows = _rounds(args, priorities, root, work, batch)
    except RuntimeError as e:  # the daemon did not start, a trainer failed: one line
        print(f"prefetchd bench: {e}", file=sys.stderr)
        return 1
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print("summary (step: geometric mean of every round's phase pairs, 95 % bootstrap interval, and the median "
          "step ratio over rounds [range]; GPU-like: median over rounds [range] and the geometric mean of the "
          "rounds' ratios, 95 % bootstrap interval):")
    for pr in priorities:
        mine = [r for r in rows if r["priority"] == pr]
        parts = []
        if args.share_only != "gpu":
            pairs = [x for r in mine for x in r["pair_ratios"]]
            g, lo, hi = paired_interval(pairs)
            parts.append(f"step {g:.3f} x daemon stopped [{lo:.3f}-{hi:.3f}] over {_n(len(pairs), 'phase pair')} "
                         f"(median step {statistics.median(r['ratio'] for r in mine):.3f} x "
                         f"[{min(r['ratio'] for r in mine):.2f}-{max(r['ratio'] for r in mine):.2f}]"
                         f"{_by_round([r['paired'] for r in mine])})")
        if args.share_only != "step":
            vs = [r["img_s_vs_normal"] for r in mine]
            g, lo, hi = paired_interval(vs)
            parts.append(f"GPU-like img/s {statistics.median(vs):.3f} x normal [{min(vs):.2f}-{max(vs):.2f}]"
                         + ("" if pr == "normal" else f", geometric mean {g:.3f} [{lo:.3f}-{hi:.3f}] over {len(vs)}"))
        print(f"  {pr:>6}: " + ", ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _gpu_paired_rounds(args, root: str, work: str, batch: int) -> int:
    """``--share-only gpu-paired``: ``gpu_paired_run`` ``--repeats`` times, each round's line and
    the pooled pairs' geometric mean with its interval."""
    if os.geteuid() != 0:
        print("prefetchd bench: --share-only gpu-paired switches the workers out of SCHED_IDLE, which only root may do",
              file=sys.stderr)
        return 2
    pairs: list[float] = []
    rounds: list[float] = []
    for rnd in range(args.repeats):
        mine = gpu_paired_run(root, work, batch, args.step_ms, args.share_cycles, args.share_phase_s, pin=args.share_pin)
        if not mine:
            raise RuntimeError("no phase pair had batches in both phases: give --share-phase-s more")
        pairs += mine
        g, lo, hi = paired_interval(mine)
        rounds.append(g)
        print(f"round {rnd}: GPU-like img/s, workers idle against normal phase by phase: {g:.3f} x [{lo:.3f}-{hi:.3f}] "
              f"over {_n(len(mine), 'pair')} (load {os.getloadavg()[0]:.2f})", flush=True)
    g, lo, hi = paired_interval(pairs)
    print(f"summary: GPU-like img/s, workers idle against normal: {g:.3f} x [{lo:.3f}-{hi:.3f}] (geometric mean of "
          f"{_n(len(pairs), 'phase pair')}, 95 % bootstrap interval){_by_round(rounds)}")
    return 0


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


# Student's t, 97.5 % point, for 1..10 degrees of freedom (more: 2.2 is within 1 % up to 30)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def round_interval(ratios: list[float]) -> tuple[float, float, float]:
    """The geometric mean of per-round ratios and its 95 % t interval: the rounds as the unit,
    so that the spread between runs counts (phase pairs within a run are neither independent,
    each sharing a stopped phase with the next, nor free of that spread)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    half = _T975[min(len(logs) - 2, len(_T975) - 1)] * statistics.stdev(logs) / math.sqrt(len(logs))
    if len(logs) > 11:
        half = half / _T975[-1] * 2.2
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def _by_round(rounds: list[float]) -> str:
    """The summary's per-round part: each round's figure, and the t interval over rounds (3 or more)."""
    said = "; rounds " + ", ".join(f"{r:.3f}" for r in rounds)
    if len(rounds) >= 3:
        g, lo, hi = round_interval(rounds)
        said += f", their geometric mean {g:.3f} x [{lo:.3f}-{hi:.3f}] (95 % t interval over rounds)"
    return said


def paired_interval(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of paired ratios (rounds against the ``normal`` run beside each, or a
    run's phases against the stopped ones beside each) and its 95 % percentile-bootstrap
    interval: whether they resolve a difference of a few per cent at all."""
    import random

    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * resamples)]),
            math.exp(means[int(0.975 * resamples) - 1]))


def _rounds(args, priorities: list[str], root: str, work: str, batch: int) -> list[dict]:
    """``--repeats`` rounds, each variant's two figures (its line printed as it ends)."""
    rows: list[dict] = []
    for rnd in range(args.repeats):
        order = priorities if rnd % 2 == 0 else priorities[::-1]
        for pr in order:
            row: dict = {"round": rnd, "priority": pr}
            said = []
            if args.share_only != "gpu":
                c = toggled_run(root, work, pr, args.share_cycles, args.share_step, batch, phase_s=args.share_phase_s,
                                pin=args.share_pin, refill=args.share_refill)
                g, lo, hi = paired_interval(c["pair_ratios"])
                row.update(idle_s=c["idle_s"], step_s=c["busy_s"], ratio=c["busy_s"] / c["idle_s"], paired=g,
                           pair_ratios=c["pair_ratios"], mean_ratio=c["mean_ratio"], steps=(c["busy_n"], c["idle_n"]),
                           rank1_img_s=c["rank1_img_s"], cpu_wait=(c["busy_wait"], c["idle_wait"]))
                said.append(f"step {g:.3f} x daemon stopped [{lo:.3f}-{hi:.3f}] over "
                            f"{_n(len(c['pair_ratios']), 'phase pair')} (median {c['busy_s'] * 1e3:.1f} ms daemon busy, {c['idle_s'] * 1e3:.1f} ms stopped: "
                            f"{row['ratio']:.3f} x; mean {c['mean_ratio']:.3f} x; {c['busy_n']}/{c['idle_n']} steps; "
                            f"waiting for a CPU "
                            f"{c['busy_wait']:.1%} / {c['idle_wait']:.1%} of them; rank 1 got "
                            f"{c['rank1_img_s']:.0f} img/s"
                            + (f" at {c['rank1_rate']:.1f} batches/s, in next() {c['rank1_in_next']:.1%} of its "
                               f"time, {c['rank1_left']} left in its ring"
                               + (" (it ran dry: not a refill; give --share-refill more)" if not c["rank1_left"] else "")
                               if args.share_refill else "") + ")")
            if args.share_only != "step":
                row["gpu_img_s"] = gpu_run(root, work, pr, args.batches or 60, args.step_ms, batch,
                                           pin=args.share_pin)["img_s"]
                said.append(f"GPU-like trainers {row['gpu_img_s']:.0f} img/s")
            row["load1"] = os.getloadavg()[0]
            rows.append(row)
            print(f"round {rnd}: {pr:>6}: " + "; ".join(said) + f" (load {row['load1']:.2f})", flush=True)
        if args.share_only != "step":
            base_img_s = next(r["gpu_img_s"] for r in rows if r["round"] == rnd and r["priority"] == "normal")
            for r in rows:
                if r["round"] == rnd:
                    r["img_s_vs_normal"] = r["gpu_img_s"] / base_img_s
    return rows

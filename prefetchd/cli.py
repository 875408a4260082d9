"""Command line: ``prefetchd run|launch|node-config|check|clean|status|demo|bench`` (also ``python -m prefetchd``).

Exit codes: 0 clean stop, 1 runtime failure (for ``check``: a problem with the deployment),
2 usage, 78 bad configuration (EX_CONFIG, so systemd's ``RestartPreventExitStatus=78`` stops a
restart loop on a config error). ``launch`` exits with its command's status (128 + n for signal
n), or 78 / 1 when the daemon cannot start, before the command runs (``prefetchd.tools.launch``).
``status --ready`` exits 0 once every rank has a batch ready, 1 before, 3 when no daemon runs;
``status --live`` 0 while the daemon's loop and pipeline move, 1 when stuck, 3 when none runs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import sys
import time

from prefetchd import __version__
from prefetchd.core.config import EX_CONFIG, EX_TEMPFAIL, Config, ConfigError, format_size
from prefetchd.core.config import load as load_config

log = logging.getLogger("prefetchd")

_JOURNAL_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    """For stderr captured by journald: a ``<N>`` priority prefix, no timestamp (the journal has one)."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _JOURNAL_PRIORITY.get(record.levelno, 6)
        return f"<{prio}>{record.name}: {super().format(record)}"


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


def _fail_config(err: Exception) -> int:
    print(f"prefetchd: {getattr(err, 'said', 'configuration error')}: {err}", file=sys.stderr)
    return getattr(err, "exit_code", EX_CONFIG)  # StorageUnavailable's 75: a bucket not answering


def _load(path: str) -> Config:
    return load_config(path)


def cmd_run(args) -> int:
    # Record stop/reload signals from the first moment; the daemon acts on them once it runs.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: early.append(signum))
    from prefetchd.format import procstate

    parent = os.environ.pop(procstate.PARENT_ENV, "")  # started by a trainer's serve(): go when it goes
    if parent:
        why = (f"is not a pid ({parent!r})" if not parent.isascii() or not parent.isdigit() else None if
               procstate.die_with_parent(int(parent), signal.SIGTERM) else
               f"names pid {parent}, which is not this daemon's parent (pid {os.getppid()}): the trainer that "
               "started it has gone, or it was set by hand")
        if why is not None:
            with contextlib.suppress(OSError):  # the pipe of a trainer gone
                print(f"prefetchd: {procstate.PARENT_ENV} {why}; it is set by the client's serve() for the daemon "
                      "it starts: unset it to start a daemon by hand", file=sys.stderr, flush=True)
            return EX_CONFIG
    from prefetchd.daemon.ring import BufferBusy, RingError
    from prefetchd.sources.base import DatasetError, StorageUnavailable

    try:
        cfg = _load(args.config)
    except ConfigError as e:
        return _fail_config(e)
    setup_logging(args.log_level or cfg.log.level)
    from prefetchd.daemon.loop import Daemon
    from prefetchd.daemon.sdnotify import Notifier
    from prefetchd.daemon.stopguard import StopGuard
    from prefetchd.executors.helpers import become_subreaper

    become_subreaper()  # the workers of a forkserver that died stay ours: watched, reaped

    notifier = Notifier()
    daemon = None
    # a stop signal ends this process within the guard's deadline even if the loop never gets it
    guard = StopGuard(lambda: daemon.pool.child_pids() if getattr(daemon, "pool", None) else []).start()
    try:
        daemon = Daemon(cfg, notify=notifier, early_signals=early, stop_guard=guard)
        return daemon.run()
    except BufferBusy as e:
        log.error("%s", e)
        return 1
    except (ConfigError, DatasetError, RingError) as e:  # a bucket that did not answer: 75, started again
        log.error("%s" if isinstance(e, StorageUnavailable) else "configuration error: %s", e)
        return EX_TEMPFAIL if isinstance(e, StorageUnavailable) else EX_CONFIG
    except KeyboardInterrupt:
        return 0
    except OSError as e:  # e.g. the metrics port is taken
        hint = ""
        if e.errno == errno.EAFNOSUPPORT and cfg.metrics.enabled:  # the shipped unit allows AF_UNIX only
            hint = ("; the metrics endpoint needs AF_INET: add the drop-in of docs/systemd.md, \"Metrics under "
                    "systemd\" (RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6, PrivateNetwork=no), "
                    "or set metrics.enabled: false")
        log.error("cannot run: %s%s", e, hint)
        return 1
    finally:
        notifier.close()
        pool = getattr(daemon, "pool", None)
        if pool is None or pool.stopped_clean:  # this process exits now: its multiprocessing helpers too
            from prefetchd.executors.pool import stop_helpers

            stop_helpers()
        guard.done()


def _print_skipped(section: str, index) -> None:
    """What the index of ``section`` left out and why, as its cache keeps it (the rules:
    prefetchd/sources/dataset.py's and imagenet.py's docstrings)."""
    if not index.skipped:
        return
    print(f"{section}: {len(index.skipped)} {index.skipped_what[len(index.skipped) != 1]} not indexed "
          f"({index.skipped_rule}):")
    for what in index.skipped[:20]:
        print(f"  skipped {what}")
    if len(index.skipped) > 20:
        print(f"  ... and {len(index.skipped) - 20} more")


def _warn_grouped_labels(sampler, labels) -> None:
    """A block shuffle of files whose rows are grouped by label (class-sorted exports): each
    window then holds few classes, so does every batch; said with the numbers."""
    import numpy as np

    perm, bs = sampler.permutation(0), sampler.blocks
    rows = max(1, min(len(perm), round(bs.total * bs.window / len(bs.sizes))))  # a window's rows, about
    chunks = [perm[a:a + rows] for a in range(0, len(perm) - rows + 1, rows)][:200] or [perm]
    distinct = float(np.mean([len(np.unique(labels[c])) for c in chunks]))
    share = np.unique(labels, return_counts=True)[1] / len(labels)
    classes = len(share)
    expected = float(np.sum(1 - (1 - share) ** rows))  # a window's rows drawn from the whole set, as often as they are
    if distinct < 0.7 * expected:  # rows in no order: 0.9 to 1.05 of it (measured); sorted: 0.03 to 0.55
        print(f"warning: loader.shuffle: block: a window of ~{rows} rows holds ~{distinct:.1f} of the "
              f"{classes} labels (~{expected:.0f} if the rows were in no order): the files' rows are grouped by "
              "label, so every batch holds few classes; write them shuffled (datasets: "
              "ds.shuffle(seed=0).flatten_indices()) or use loader.shuffle: true")


def cmd_check(args) -> int:
    from prefetchd.core.sampler import for_index
    from prefetchd.core.words import plural
    from prefetchd.daemon.ring import is_tmpfs
    from prefetchd.format import batchfile
    from prefetchd.sources.classlike import class_counts, describe_classes
    from prefetchd.sources.dataset import DatasetError, load_index, val_labels
    from prefetchd.sources.objectstore import probe

    try:
        cfg = _load(args.config)
        where = cfg.dataset.root or (cfg.dataset.file_list or "").rpartition("/")[0]  # a file list's folder
        if "://" in where:  # a bucket: who asks where, can it list, can it read (one line each)
            print("\n".join(probe(where, cfg.dataset.storage_options or None, f"dataset.{'root' if cfg.dataset.root else 'file_list'}")))
        t0 = time.monotonic()
        index, cached = load_index(cfg.dataset.root, cfg.dataset.file_list, cfg.dataset.extensions,
                                   cfg.dataset.cache_dir, **cfg.dataset.index_options())
        dt = time.monotonic() - t0
    except (ConfigError, DatasetError) as e:
        return _fail_config(e)
    from prefetchd.core.hostread import read_host
    from prefetchd.core.limits import describe
    from prefetchd.core.sizing import resolve

    host = read_host(cfg.buffer.dir)
    sizing = resolve(cfg, host)
    cfg = sizing.cfg  # workers.count and buffer.max_bytes: auto made numbers
    L, B = cfg.loader, cfg.buffer
    try:
        sampler = for_index(L, index)
    except ConfigError as e:
        return _fail_config(e)
    transform_said: list[str] = []  # augment.transform made and run on the first samples, as the daemon's start does
    from prefetchd.core.augment import transform

    try:  # each view's (height, width): the transform's, learned by the probe, or the config's
        shapes = transform.check(cfg.augment, index, L.seed, transform_said.append).shapes
    except ConfigError as e:
        return _fail_config(e)
    s = cfg.augment.output_size
    per_batch = batchfile.views_file_size(L.batch_size, shapes)
    need = per_batch * B.capacity * len(L.ranks)
    print(f"config {cfg.source}: ok")
    print(f"dataset: {plural(len(index), 'sample')}, {plural(len(index.classes), 'class', 'classes')} "
          f"({'cached index' if cached else 'scanned'} in {dt:.2f} s); {index.describe()}")
    print(f"classes: {describe_classes(index.classes, class_counts(index))}")
    _print_skipped("dataset", index)
    nb = sampler.batches_per_epoch
    first, last = sampler.batch_len(0), sampler.batch_len(nb - 1)
    sizes = f"{plural(nb, 'batch', 'batches')} of {first}" + (f" (the last of {last})" if last != first else "")
    if first < L.batch_size:  # drop_last: false, a batch larger than a rank's share: one short batch
        sizes += (f" (loader.batch_size {L.batch_size} is more than a rank's {sampler.samples_per_rank} samples: "
                  f"with drop_last: false its one batch holds {first})")
    print(f"stream: {sizes} per epoch for each of ranks {list(L.ranks)} (world size {L.world_size}), seed {L.seed}, "
          f"{'endless' if L.epochs is None else plural(L.epochs, 'epoch')}, augment "
          f"{'transform' if transform_said else 'views' if cfg.augment.views else cfg.augment.mode} -> "
          f"{', '.join(f'{h}x{w}' for h, w in shapes)}")
    if sampler.blocks is not None:
        bs = sampler.blocks
        if bs.window >= len(bs.sizes):  # one window: every row permuted together, each group kept (as memory allows)
            print(f"shuffle: block: loader.shuffle_window {bs.window} is at least the {plural(len(bs.sizes), 'row group')}"
                  f": each epoch permutes all {bs.total} rows together, as loader.shuffle: true does, and a worker "
                  "keeps every row group it reads (up to 512 MiB)" + ("; a smaller window mixes less and keeps fewer"
                                                                  if len(bs.sizes) > 1 else ""))
        else:
            print(f"shuffle: block: {plural(len(bs.sizes), 'row group')} permuted each epoch, then the rows of each "
                  f"{bs.window} consecutive ones (~{bs.total * bs.window // len(bs.sizes)} rows) permuted together "
                  "(loader.shuffle_window)")
        _warn_grouped_labels(sampler, index.labels)
    elif getattr(index, "block_sizes", lambda: None)() is not None and L.shuffle is True:
        print("shuffle: full (each epoch a permutation of every row: each row's read is its row group's; "
              "loader.shuffle: block reads each row group about once per window and worker)")
    for said in transform_said:
        print(f"transform: {said}")
    V = cfg.validation
    if V.enabled:
        from prefetchd.core.sampler import ValSampler

        try:
            val, _ = load_index(V.root, V.file_list, cfg.dataset.extensions, cfg.dataset.cache_dir, devkit=V.devkit,
                                section="validation", **cfg.dataset.index_options(validation=True))
            val = val_labels(val, index)
        except DatasetError as e:
            return _fail_config(e)
        vs = ValSampler(len(val), V.batch_size, L.world_size, V.pad)
        repeats = vs.share(0) * L.world_size - len(val) if V.pad else 0
        shares = (f"padded: {plural(repeats, 'sample')} repeated, marked in BatchInfo.padding" if repeats else
                  "each sample once" + ("" if V.pad else " (validation.pad: false): batch counts may differ"))
        print(f"validation: {len(val)} samples ({val.describe()}); {[vs.batches(r) for r in L.ranks]} batches of up to {V.batch_size} "
              f"per pass for ranks {list(L.ranks)} ({shares}); eval resize {V.resize} -> {s}x{s}, capacity {V.capacity}")
        _print_skipped("validation", val)  # from the cache too: the scan's warnings were said once
    existing = B.dir
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # the filesystem it will be created on
    fs = "tmpfs" if is_tmpfs(existing) else "NOT tmpfs: batches would go to disk"
    where = "" if existing == B.dir else f", not created yet (on {existing})"
    print(f"buffer: {B.dir} ({fs}{where}); "
          f"{format_size(per_batch)} per batch, capacity {B.capacity} x {len(L.ranks)} rank(s) = {format_size(need)}, "
          f"max_bytes {format_size(B.max_bytes)}")
    if need > B.max_bytes:
        print(f"note: buffer.max_bytes holds only {B.max_bytes // per_batch} batches, fewer than capacity x ranks")
    if V.enabled:
        _check_val_room(cfg, per_batch, need)
    print(f"workers: {cfg.workers.resolved_count()}")
    print("limits: " + "; ".join(describe(host)))
    print("sizing: " + "; ".join(sizing.why.values()))
    return _check_deployment(cfg, args, [f"warning: {w}" for w in sizing.warnings])


def _check_val_room(cfg: Config, per_batch: int, need: int) -> None:
    """While a validation pass is read, its lanes keep ``depth`` batches each (enough to keep the
    workers busy: ``ceil(workers / ranks) + 1``, within ``validation.capacity``), room that train's
    windows give up from their far end (train is not read meanwhile) and take back when the pass
    ends: said in a note. Warned of, with the numbers: max_bytes cannot hold that beside train's
    front batches (validation then has fewer batches in flight, and is slower), or not even one
    validation batch per rank beside them (validation goes over max_bytes by that much)."""
    from prefetchd.format import batchfile

    B, V, ranks, s = cfg.buffer, cfg.validation, len(cfg.loader.ranks), cfg.augment.output_size
    workers = cfg.workers.resolved_count()
    depth = max(1, min(V.capacity, -(-workers // ranks) + 1))
    one = batchfile.max_file_size(V.batch_size, s, s)
    room, fronts = one * ranks * depth, per_batch * ranks
    if need + room <= B.max_bytes:
        return
    kept = (f"{ranks} rank(s) x {depth} validation batch(es) of {format_size(one)} = {format_size(room)}, "
            f"enough to keep {workers} workers busy")
    if fronts + room <= B.max_bytes:
        print(f"note: while a validation pass is read, train's windows give up to "
              f"{format_size(min(need, B.max_bytes) + room - B.max_bytes)} from their far end for validation "
              f"({kept}); they are made again once the pass ends")
        return
    fit = max(1, (B.max_bytes - fronts) // (one * ranks)) if B.max_bytes > fronts else 1
    print(f"warning: buffer.max_bytes ({format_size(B.max_bytes)}) cannot hold train's front batches "
          f"({ranks} x {format_size(per_batch)} = {format_size(fronts)}) plus what a validation pass keeps in "
          f"flight ({kept}): validation gets {fit} batch(es) per rank at a time and is slower; raise "
          f"buffer.max_bytes to {format_size(fronts + room)} to keep the workers busy")
    if fronts + one * ranks > B.max_bytes:
        print(f"warning: buffer.max_bytes ({format_size(B.max_bytes)}) cannot even hold one train batch and one "
              f"validation batch per rank ({format_size(fronts + one * ranks)}): validation will go over it")


def _check_deployment(cfg: Config, args, sizing: list[str] = ()) -> int:
    """One line per problem or warning with users, groups, modes and the RAM disk; exit 1 on a problem."""
    import pwd

    from prefetchd.core.words import plural
    from prefetchd.tools.deploy import Account, check_deployment

    try:
        daemon = Account.lookup(args.user or pwd.getpwuid(os.geteuid()).pw_name)
        trainers = [Account.lookup(t) for t in args.trainer or []]
    except ValueError as e:
        print(f"prefetchd: {e}", file=sys.stderr)
        return 2
    findings = [*sizing, *check_deployment(cfg, daemon, trainers)]
    for line in findings:
        print(line)
    problems = sum(line.startswith("problem:") for line in findings)
    warnings = sum(line.startswith("warning:") for line in findings)  # notes are neither
    who = f"daemon user {daemon.name}" + (f", trainer(s) {', '.join(t.name for t in trainers)}" if trainers else "")
    print(f"deployment ({who}): " + (plural(problems, "problem") if problems else "no problems")
          + (f", {plural(warnings, 'warning')}" if warnings else ""))
    return 1 if problems else 0


def cmd_status(args) -> int:
    try:
        cfg = _load(args.config)
    except ConfigError as e:
        return _fail_config(e)
    if args.ready:
        return _ready(cfg)
    if args.live:
        from prefetchd.format import status

        code, line = status.liveness(status.read_json(cfg.buffer.dir, status.STATUS_NAME),
                                     status.daemon_alive(cfg.buffer.dir), status.lock_pid(cfg.buffer.dir),
                                     time.time(), status.LIVE_AFTER_S if args.live_after is None else args.live_after)
        print(line)
        return code
    try:
        return _status_loop(cfg, args)
    except KeyboardInterrupt:  # Ctrl-C ends --watch, wherever it lands
        return 0


def _ready(cfg: Config) -> int:
    """``status --ready``, a probe (Kubernetes' startupProbe): 0 once every rank has a batch ready
    (or is done; what the daemon's READY=1 means), 1 while it runs but not yet, 3 when none runs."""
    from prefetchd.format import status

    if not status.daemon_alive(cfg.buffer.dir):
        print(f"not running: no daemon serves {cfg.buffer.dir}")
        return 3
    rec = status.read_json(cfg.buffer.dir, status.STATUS_NAME)
    ranks = (rec or {}).get("ranks") or {}
    waiting = sorted((r for r, v in ranks.items() if not (v.get("ahead", 0) > 0 or v.get("done"))), key=int)
    if rec is None or status.is_stale(rec) or rec.get("state") != "running" or not ranks or waiting:
        print("running, not ready" + (f": no batch ready yet for rank(s) {', '.join(waiting)}" if waiting else ""))
        return 1
    print(f"ready: every rank of {cfg.buffer.dir} has a batch ready")
    return 0


def _status_loop(cfg: Config, args) -> int:
    from prefetchd.format import status
    from prefetchd.format.status import daemon_alive

    while True:
        rec = status.read_json(cfg.buffer.dir, status.STATUS_NAME)
        alive = daemon_alive(cfg.buffer.dir)
        if args.json:
            out = {"alive": alive, "status": rec}
            if rec is not None:  # a live daemon's figures it could not rewrite (a full filesystem)
                out["stale"] = bool(alive) and status.is_stale(rec)
            print(json.dumps(out, indent=1, sort_keys=True))
        elif rec is None:
            print(f"no status in {cfg.buffer.dir}: the daemon has not run there"
                  + ("" if alive is False else " (a daemon holds the lock; starting?)"))
        else:
            text = status.format_status(rec, alive)
            if args.watch:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
                sys.stdout.flush()
            else:
                print(text)
        if not args.watch:
            return 0 if alive else 3  # 3: not running (LSB status convention)
        time.sleep(args.interval)


def cmd_node_config(args) -> int:
    from prefetchd.tools.nodeconfig import run_node_config

    return run_node_config(args)


def cmd_demo(args) -> int:
    from prefetchd.tools.demo import run_demo

    setup_logging("warning" if not args.verbose else "info")
    return run_demo(images=args.images, classes=args.classes, epochs=args.epochs, batch_size=args.batch_size,
                    workers=args.workers, keep=args.keep, quiet=args.quiet)


def cmd_preview(args) -> int:
    from prefetchd.sources.dataset import DatasetError
    from prefetchd.tools.preview import run_preview

    try:
        cfg = _load(args.config)
        source = run_preview(cfg, args.out, args.count, args.rank)
    except (ConfigError, DatasetError) as e:
        return _fail_config(e)
    print(f"wrote {args.out}: {args.count} samples of {source}")
    return 0


def cmd_bench(args) -> int:
    setup_logging("warning")
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: every bar, here and in what bench starts
    if args.client:
        from prefetchd.tools.bench.client import run_client_bench

        return run_client_bench(args)
    if args.share:
        from prefetchd.tools.bench.share import run_share_bench

        return run_share_bench(args)
    if args.train:
        from prefetchd.tools.bench.train import run_train_bench

        return run_train_bench(args)
    from prefetchd.tools.bench.throughput import run_bench

    try:
        return run_bench(args)
    except (ConfigError, RuntimeError, ValueError) as e:  # a daemon that would not start, nothing decodable
        print(f"prefetchd bench: {e}", file=sys.stderr)
        return 1


def cmd_clean(args) -> int:
    from prefetchd.tools.clean import run_clean

    return run_clean(args.config)


def cmd_launch(args) -> int:
    from prefetchd.tools.launch import run_launch

    return run_launch(args.config, args.cmd, args.ready_timeout or None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefetchd", description="A data-loading daemon: JPEG folder -> augmented "
                                "uint8 batches in a RAM-disk ring buffer -> your trainer.")
    p.add_argument("--version", action="version", version=f"prefetchd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the daemon in the foreground (what systemd runs)")
    r.add_argument("--config", "-c", required=True)
    r.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    r.set_defaults(fn=cmd_run)
    la = sub.add_parser("launch", help="run CMD with the daemon serving it: started (or the running one used), "
                        "ready, restarted if it dies, stopped when CMD exits; exits with CMD's status")
    la.add_argument("--config", "-c", help="the config (default: $PREFETCHD_CONFIG); CMD gets its path in "
                    "$PREFETCHD_CONFIG")
    la.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                    help="seconds to wait for the daemon to be ready before CMD runs (0: no limit; default 600)")
    la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")
    la.set_defaults(fn=cmd_launch)
    n = sub.add_parser("node-config", help="write one node's config from the job's: the job's world size, the "
                       "node's ranks (for a multi-node job: Slurm, a Kubernetes Indexed Job)")
    n.add_argument("--config", "-c", required=True, help="the job's config")
    n.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    n.add_argument("--node", type=int, required=True, help="this node's number, 0 .. nodes-1")
    n.add_argument("--per-node", type=int, required=True, help="ranks per node (node I runs I*G .. I*G+G-1)")
    n.add_argument("--out", "-o", required=True, help="the node's config, written whole")
    n.add_argument("--buffer-dir", help="the ring's directory (and the progress files in it) instead of the job's")
    n.set_defaults(fn=cmd_node_config)
    c = sub.add_parser("check", help="validate the config, scan the dataset, check users, modes and the RAM disk")
    c.add_argument("--config", "-c", required=True)
    c.add_argument("--user", help="the daemon's user (default: the user running check)")
    c.add_argument("--trainer", action="append", metavar="USER", help="a user that runs a trainer (repeatable)")
    c.set_defaults(fn=cmd_check)
    cl = sub.add_parser("clean", help="remove a stopped daemon's buffer directory (the batches it left in RAM); "
                        "refused while a daemon serves it")
    cl.add_argument("--config", "-c", required=True)
    cl.set_defaults(fn=cmd_clean)
    s = sub.add_parser("status", help="show the running daemon's status")
    s.add_argument("--config", "-c", required=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--ready", action="store_true", help="a probe: exit 0 once every rank has a batch ready, 1 while "
                   "the daemon runs but not yet, 3 when none runs")
    s.add_argument("--live", action="store_true", help="a probe (Kubernetes' livenessProbe, the systemd watchdog's "
                   "judgement): exit 0 while the daemon's loop turns and its pipeline moves (or it starts), 1 when "
                   "either has stopped for --live-after seconds, 3 when none runs")
    s.add_argument("--live-after", type=float, metavar="S", help="seconds without a status rewrite, "
                   "or with batches in the making and none made, before --live fails (default 30)")
    s.set_defaults(fn=cmd_status)
    d = sub.add_parser("demo", help="make sample JPEGs, start the daemon, train two epochs through the client")
    d.add_argument("--images", type=int, default=640)
    d.add_argument("--classes", type=int, default=8)
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--workers", default="auto")
    d.add_argument("--keep", action="store_true", help="keep the sample data and buffer directory")
    d.add_argument("--verbose", action="store_true", help="show the daemon's log")
    d.add_argument("--quiet", "-q", action="store_true", help="no progress bar (none is drawn off a terminal either)")
    d.set_defaults(fn=cmd_demo)
    v = sub.add_parser("preview", help="save a grid of augmented samples with their labels as a PNG")
    v.add_argument("--config", "-c", required=True)
    v.add_argument("--out", "-o", default="preview.png")
    v.add_argument("--count", type=int, default=16)
    v.add_argument("--rank", type=int, default=0)
    v.set_defaults(fn=cmd_preview)
    b = sub.add_parser("bench", help="measure the pipeline against the decode-only limit")
    b.add_argument("--config", "-c", help="a config to measure (default: a generated sample corpus)")
    b.add_argument("--root", action="append", help="an existing dataset root (an ImageFolder, a train tar, a folder of "
                   "class tars, shards, Parquet) to measure on; repeated: each root's throughput side by side, alternated "
                   "--repeats times; ROOT@block reads a Parquet ROOT with loader.shuffle: block")
    b.add_argument("--images", type=int, default=2000, help="sample images to generate when no --config or --root")
    b.add_argument("--epochs", type=int, default=2, help="epochs the daemon makes and the client reads per run")
    b.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="ray: the local executor against Ray actors on a one-node cluster of the same cores")
    b.add_argument("--buffer-parent", help="directory (a tmpfs) for the buffers (default /dev/shm)")
    b.add_argument("--peer", action="store_true", help="also run the torch DataLoader peer (needs torch)")
    b.add_argument("--index-scale", type=int, metavar="N", help="measure memory and start-up with an N-entry index")
    b.add_argument("--workers", type=int, default=None, help="worker processes (default: the config's, or cores)")
    b.add_argument("--batch-size", type=int, default=None)
    b.add_argument("--jitter", action="store_true", help="turn colour jitter on (0.4, 0.4, 0.4)")
    b.add_argument("--mode", choices=("scale", "random_resized_crop", "eval"), default=None)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--sweep-workers", action="store_true", help="throughput against worker count")
    b.add_argument("--ranks", help="N consumer processes (world size N) against one daemon; a list runs each in turn")
    b.add_argument("--capacity", type=int, default=None, help="buffer.capacity for --ranks (default 1000) and for "
                   "--train's steady rows (default the config's, 64)")
    b.add_argument("--batches", type=int, default=None,
                   help="--ranks: batches each rank reads (default 200); --client: batch files in the ring (default 24)")
    b.add_argument("--output-size", type=int, default=None, help="augment.output_size (and a scale to match)")
    b.add_argument("--image-side", type=int, default=500, help="long side of the generated sample images")
    b.add_argument("--daemon-src", help="run the daemon from this source tree (an A/B comparison)")
    b.add_argument("--plot", help="PNG path for the sweep's error-bar plot (needs matplotlib)")
    b.add_argument("--json", help="write the figures to this JSON file")
    k = b.add_argument_group("client cost (--client) and training (--train); see tools/bench/client.py, tools/bench/train.py")
    k.add_argument("--client", action="store_true", help="time the trainer's thread inside next(), next batch ready")
    k.add_argument("--train", metavar="MODEL", help="train MODEL (tiny, or a torchvision model such as resnet50) fed "
                   "from a batch on the device, the client and a DataLoader")
    k.add_argument("--device", default=None, help="--train: cuda or cpu (default: cuda when available)")
    k.add_argument("--size", type=int, default=224, help="image side (default 224)")
    k.add_argument("--passes", type=int, default=3, help="--client: passes over them")
    k.add_argument("--step-ms", type=float, default=60.0, help="--client: the training step between batches")
    k.add_argument("--prefetch", type=int, default=2, help="the client's read-ahead")
    k.add_argument("--steps", type=int, default=40, help="--train: measured steps per feed")
    k.add_argument("--warmup", type=int, default=8, help="--train: steps before the clock starts (steady rows: at "
                   "least these, then until the feed's backlog is drained or holds)")
    k.add_argument("--warmup-max-s", type=float, default=30.0, help="--train: the longest a steady row warms up "
                   "after its first batch before it is measured anyway (and says so)")
    k.add_argument("--decodes", default=None, help="--train: the augment.decode of each prefetchd "
                   "row (default cpu,hybrid,gpu, the GPU rows left out with a note where nvImageCodec cannot run; without a GPU, "
                   "hybrid and gpu decode with a CPU stand-in)")
    k.add_argument("--gpu-share", type=float, default=0.5, help="--train: augment.gpu_share of the hybrid row")
    k.add_argument("--freeze-daemon", action="store_true", help="--train: SIGSTOP the daemon once the ring holds "
                   "every measured batch (few cores: its refills would compete with the training)")
    h = b.add_argument_group("sharing the node (--share); see tools/bench/share.py")
    h.add_argument("--share", action="store_true", help="a CPU-bound trainer's step beside the busy daemon, and "
                   "GPU-like trainers' img/s, for each workers.priority, alternated --repeats times")
    h.add_argument("--share-priorities", default="normal,batch,idle,nice", help="--share: the workers.priority values")
    h.add_argument("--share-step", choices=("python", "torch"), default="python",
                   help="--share: the trainer's CPU-bound step (pure Python, or torch with one thread)")
    h.add_argument("--share-cycles", type=int, default=30, help="--share: daemon running/stopped cycles per run")
    h.add_argument("--share-phase-s", type=float, default=0.5, metavar="S",
                   help="--share: seconds the daemon runs, then is stopped, in each cycle")
    h.add_argument("--share-pin", action="store_true", help="--share: bind the CPU-bound trainer to the first CPU and "
                   "rank 1 to the second, as a job that gives each rank its own cores (the daemon is not bound)")
    h.add_argument("--share-refill", type=int, default=0, metavar="BATCHES", help="--share: rank 1 reads at 1.2 x "
                   "the daemon's rate from a ring first filled this deep a rank (refilling ahead of a trainer, "
                   "as after a restart), so it reads alike with the daemon running or stopped; 0 (default): "
                   "it waits at the head of the ring for each batch")
    h.add_argument("--share-only", choices=("step", "gpu", "gpu-paired"), help="--share: only the CPU-bound step, "
                   "or only the GPU-like trainers' img/s (more rounds in the same time); gpu-paired: one daemon whose "
                   "workers are switched between idle and normal every --share-phase-s, the GPU-like img/s of each "
                   "idle phase against the normal ones beside it (root only)")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bars (none are drawn off a terminal either)")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fn is cmd_run:  # the daemon's own errors are its to say (cmd_run)
        return args.fn(args)
    try:
        rc = args.fn(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:  # `prefetchd status --json | head`: the reader has gone, as for any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE

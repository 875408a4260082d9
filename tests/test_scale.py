"""Many ranks, many nodes, and opt-in data echoing."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient
from test_daemon import published, reference_batches

from prefetchd.format import status


def _collect_with_indices(cfg: str, rank: int) -> dict:
    out = {}
    with PrefetchClient(cfg, rank=rank, timeout=60, as_numpy=True) as c:
        for e in (0, 1):
            for x, y in c.iter_epoch(e):
                info = c.last_batch
                out[(rank, e, info.batch)] = (np.ascontiguousarray(x), y.copy(), info.indices.copy())
    return out


def test_two_nodes_serve_disjoint_shares_identical_to_one_daemon_serving_all(tmp_path, image_root, daemon_factory):
    nodes = {}
    for name, ranks in (("node_a", [0, 1]), ("node_b", [2, 3]), ("single", "all")):
        (tmp_path / name).mkdir()
        cfg = small_config(tmp_path / name, image_root, loader={"world_size": 4, "ranks": ranks},
                           workers={"count": 1})
        nodes[name] = (cfg, daemon_factory(cfg), ranks)
    split = {}
    for r in range(4):
        split.update(_collect_with_indices(nodes["node_a" if r < 2 else "node_b"][0], r))
    single = {}
    for r in range(4):
        single.update(_collect_with_indices(nodes["single"][0], r))
    assert sorted(split) == sorted(single) and len(split) == 4 * 2 * 2  # 48 samples / 4 ranks / batch 6
    for k in split:
        for a, b in zip(split[k], single[k], strict=True):
            assert np.array_equal(a, b), k
    for e in (0, 1):
        shares = [np.concatenate([v[2] for k, v in split.items() if k[0] == r and k[1] == e]) for r in range(4)]
        everything = np.concatenate(shares)
        assert len(set(everything.tolist())) == len(everything) == 48  # disjoint, and together the dataset
    for _, d, _ in nodes.values():
        assert d.stop() == 0


def test_a_slow_rank_does_not_starve_the_others(tmp_path, image_root, daemon_factory):
    # rank 0's trainer never reads; rank 1's reads everything: rank 1 must not wait on rank 0's share
    cfg = small_config(tmp_path, image_root, loader={"world_size": 2}, buffer={"capacity": 3, "refill_at": 3})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, rank=1, timeout=30, as_numpy=True) as c:
        n = sum(1 for e in (0, 1) for _ in c.iter_epoch(e))
    assert n == 8
    # rank 0 kept at its capacity (its last batches may still be in flight when rank 1 is done:
    # with rank 1 finished, both workers go to rank 0)
    wait_until(lambda: len([p for p in published(buf) if p.startswith("r0000")]) == 3, 30, "rank 0's 3 batches")
    assert len([p for p in published(buf) if p.startswith("r0000")]) == 3
    assert d.stop() == 0


def test_data_echoing_serves_the_current_batch_again_instead_of_waiting_and_counts_it(tmp_path, image_root,
                                                                                    daemon_factory):
    cfg = small_config(tmp_path, image_root, client={"echo_factor": 3}, loader={"epochs": 1})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.killpg(d.pid, signal.SIGSTOP)  # the daemon stalls: batch 4 will not be ready in time
    seen = []
    try:
        with PrefetchClient(cfg, timeout=30, as_numpy=True) as c:
            for x, _ in c.iter_epoch(0):
                seen.append((c.last_batch.batch, c.last_batch.echo, x.copy()))
                if c.last_batch.echo == 2:
                    os.killpg(d.pid, signal.SIGCONT)
            echoed = c.echoed
    finally:
        os.killpg(d.pid, signal.SIGCONT)
    assert [(b, e) for b, e, _ in seen][:6] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2)]
    assert echoed >= 2 and all(e <= 2 for _, e, _ in seen)
    ref, _ = reference_batches(cfg, epochs=1)
    firsts = [(b, x) for b, e, x in seen if e == 0]
    assert [b for b, _ in firsts] == list(range(8))
    for b, x in firsts:
        assert np.array_equal(x.transpose(0, 2, 3, 1), ref[(0, 0, b)][0])
    wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("echoed")
               == echoed, 10, "the echo count in status")
    assert d.stop() == 0


def test_data_echoing_does_not_echo_while_the_reader_holds_the_next_batch(tmp_path, image_root, daemon_factory):
    # the daemon deletes a file once the reader has it; while the reader still converts it (a copy,
    # a GPU decode) the next batch is on its way: the trainer waits for it instead of echoing
    cfg = small_config(tmp_path, image_root, client={"echo_factor": 3, "prefetch": 1}, loader={"epochs": 1})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=30, as_numpy=True) as c:
        convert = c._convert
        in_convert, release = threading.Event(), threading.Event()

        def slow_convert(b, host, *rest):
            if b.batch == 1:
                wait_until(lambda: not os.path.exists(c._path(0, 1)), 30, "the daemon to delete batch 1's file")
                in_convert.set()
                release.wait(30)
            return convert(b, host, *rest)

        c._convert = slow_convert
        it = c.iter_epoch(0)
        next(it)
        wait_until(in_convert.is_set, 30, "the reader converting batch 1, its file deleted")
        timer = threading.Timer(1.0, release.set)  # lets the conversion finish a while later
        timer.start()
        next(it)
        assert (c.last_batch.batch, c.last_batch.echo, c.echoed) == (1, 0, 0)
        timer.join()
        assert [c.last_batch.batch for _ in it if c.last_batch.echo == 0] == list(range(2, 8))
    assert d.stop() == 0

"""Read-ahead of a bucket's samples in the order a worker will make its batches.

A worker knows the batches it will make next: the tasks queued in its pipe (the pool sends each
worker up to ``workers.max_tasks_in_flight``; ``executors.worker`` reads them out when it starts a
batch). ``fetch_ahead(root, batches, fetch, size_of)`` is given the batch being started first,
then the queued ones in the order they will be made, and starts ``fetch(i)`` for their samples in
that order in this process's pool of ``IN_FLIGHT`` threads; ``fetched(root, i, read)`` takes a
sample's result (or calls ``read()`` when it was not fetched ahead).

**Bounds.** Requests in flight: at most ``IN_FLIGHT`` a worker process (the pool's threads). Bytes:
the batch being made is always fetched whole (it is read now anyway); of the batches after it,
samples are fetched in order while their sizes (``size_of``: the listed object's, the indexed
member's) add up to at most ``MAX_AHEAD_BYTES``, the first one past it and everything after is
left for a later call. A fetch no longer wanted by the next call (its batch was made, or was
never this worker's) is cancelled if not started, and its bytes dropped.

**The same bytes.** What is fetched ahead is what ``fetch(i)`` returns: the very call a read makes
now, only earlier, with its identity checks (an ImageFolder object's bytes cached only under the
listed ETag, a shard member's ranged GET sent with ``If-Match``: ``objectstore``). A batch's bytes
stay a function of seed, epoch and batch; an object overwritten between the read-ahead and the
batch is read as it was at the read-ahead (as a read a few batches earlier would have), never as
another sample's bytes. An error is raised by ``fetched`` as the read would have raised it
(``executors.storage`` judges it; a retried read then reads directly).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

IN_FLIGHT = 32  # GETs a worker process keeps in flight (obstore releases the GIL while they wait)
MAX_AHEAD_BYTES = 64 << 20  # bytes of later batches' samples a worker process fetches before it needs them
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own
_AHEAD: dict[tuple[str, int], tuple[int, Future]] = {}  # (root, sample) -> (pid, its fetch), in fetch order


def pool() -> ThreadPoolExecutor:
    """This process's pool of ``IN_FLIGHT`` threads for GETs (a forked child makes its own)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="prefetchd-get"))
        _AHEAD.clear()  # a parent's futures: never completed here
    return _POOL[1]


def plan(batches: Iterable[Iterable[int]], size_of: Callable[[int], int] | None,
         max_ahead_bytes: int = MAX_AHEAD_BYTES) -> list[int]:
    """The samples to have fetched, in the order they will be read: all of the first batch, then
    the later ones' while their sizes fit in ``max_ahead_bytes`` (pure: see the module docstring)."""
    out: dict[int, None] = {}
    left = max_ahead_bytes
    for b, batch in enumerate(batches):
        for i in batch:
            i = int(i)
            if i in out:
                continue
            if b:
                left -= size_of(i) if size_of is not None else 0
                if left < 0:
                    return list(out)
            out[i] = None
    return list(out)


def fetch_ahead(root: str, batches: list, fetch: Callable[[int], object],
                size_of: Callable[[int], int] | None = None) -> None:
    """Have the samples of ``batches`` (the one being made, then those queued after it) of the
    index at ``root`` fetched by ``fetch(i)``, in order, within the bounds above."""
    ex = pool()
    wanted = plan(batches, size_of, MAX_AHEAD_BYTES)
    keep = set(wanted)
    for key in [k for k in _AHEAD if k[0] == root and k[1] not in keep]:
        _AHEAD.pop(key)[1].cancel()
    for i in wanted:
        if (root, i) not in _AHEAD:
            _AHEAD[(root, i)] = (os.getpid(), ex.submit(fetch, i))


def fetched(root: str, i: int, read: Callable[[], object]):
    """Sample ``i``'s result as ``fetch_ahead`` fetched it (what the fetch raised, raised), else ``read()``."""
    ahead = _AHEAD.pop((root, i), None)
    if ahead is not None and ahead[0] == os.getpid():
        return ahead[1].result()
    return read()


def pending(root: str, done: bool = False) -> int:
    """Samples of ``root`` fetched or being fetched ahead and not taken yet (``done``: only those
    whose fetch has ended)."""
    return sum(1 for k, (_, f) in _AHEAD.items() if k[0] == root and (f.done() or not done))

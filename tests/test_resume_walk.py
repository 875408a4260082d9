"""A seeded random walk over the moves a trainer makes with its loader's position, against a pure
reference model of that position, on the real daemon and client (issue 29).

The model (``Model``) knows only the sampler (``prefetchd.core.sampler``, a pure function tested
against ``DistributedSampler``) and the rules a user reads in the README: where ``next`` goes,
what ``seek``, ``set_epoch`` and ``load_state_dict`` do, how a state saved at another world or
batch size goes on (the rest of its epoch, shared out as a whole epoch is), which states are
refused. The walk (``Walk``) makes the moves on real ``PrefetchClient``s served by a real
daemon: next batch, break out of a ``for``, a new ``for``, ``seek`` forward and back,
``set_epoch`` smaller, equal or larger, ``load_state_dict`` of any earlier state (each rank its
own, rank 0's on every rank, another rank's; of another world or batch size), bad states, a
daemon restart, a change of world and batch size. After each move a rank's next batch must hold
the samples the model predicts (and a sample's pixels in an epoch never change), within the
loader's timeout; every refused state must be refused with a message and move nothing.

``make test`` runs a bounded walk (``PREFETCHD_WALK_STEPS``, default 120 moves). The soak:
``PREFETCHD_WALK_STEPS=3000 PREFETCHD_WALK_SEED=5 pytest tests/test_resume_walk.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import threading
from dataclasses import dataclass, field

import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError

from prefetchd.core.sampler import Sampler
from prefetchd.format import status

N = 48  # conftest's image_root
SEED = 7  # small_config's loader.seed
STEPS = int(os.environ.get("PREFETCHD_WALK_STEPS", "120"))
WALK_SEED = int(os.environ.get("PREFETCHD_WALK_SEED", "29"))
TIMEOUT_S = float(os.environ.get("PREFETCHD_WALK_TIMEOUT_S", "20"))
# moves (and "other_rank_same_world": loading rank 0's or another rank's state at the same world
# size) to leave out, comma-separated: to learn which moves a bug needs
OMIT = set(filter(None, os.environ.get("PREFETCHD_WALK_OMIT", "").split(",")))
EPOCHS = 4  # seeks go to epochs below this; reading on may go past it (loader.epochs is open)


@dataclass(frozen=True)
class Geo:
    """How a job cuts the stream: world size, batch size, drop_last."""

    world: int
    batch: int
    drop_last: bool

    def sampler(self) -> Sampler:
        return Sampler(N, self.batch, SEED, True, self.drop_last, self.world)


GEOS = (Geo(2, 5, True), Geo(3, 4, False), Geo(1, 6, True), Geo(4, 3, True))


# --- the model ---------------------------------------------------------------------------------------


@dataclass
class Model:
    """Per rank ``(epoch, batch, offset)``: the next batch is ``batch`` of the segment of ``epoch``
    from sample ``offset`` (0: the whole epoch)."""

    geo: Geo
    pos: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pos = self.pos or {r: (0, 0, 0) for r in range(self.geo.world)}

    def _norm(self, r: int) -> tuple[int, int, int]:
        e, b, o = self.pos[r]
        return (e + 1, 0, 0) if b >= self.geo.sampler().batches_in(o) else (e, b, o)

    def next(self, r: int) -> list[int]:
        """The samples of rank ``r``'s next batch (a new ``for`` at an epoch's end starts the next)."""
        e, b, o = self._norm(r)
        self.pos[r] = (e, b + 1, o)
        self.pos[r] = self._norm(r)  # the last batch of an epoch moves the loader to the next one
        return self.geo.sampler().batch_indices(e, r, b, o).tolist()

    def epoch_after_next(self, r: int) -> int:
        return self._norm(r)[0]

    def seek(self, r: int, e: int, b: int) -> None:
        self.pos[r] = (e, b, 0)

    def set_epoch(self, r: int, e: int) -> None:
        if e != self.pos[r][0]:
            self.pos[r] = (e, 0, 0)

    def end_of(self, o: int) -> int:
        return self.geo.sampler().batches_in(o)

    def load(self, r: int, st: Saved) -> None:
        """Rank ``r`` loads ``st``: its position at the same geometry (any rank's: ranks step in
        lock-step); at another, the first sample no rank of the saving job consumed."""
        e, b, o = st.pos
        if st.geo == self.geo:
            self.pos[r] = (e, b, o)
            return
        done = o + b * st.geo.world * st.geo.batch
        self.pos[r] = (e, 0, done) if done < N else (e + 1, 0, 0)


@dataclass(frozen=True)
class Saved:
    geo: Geo
    rank: int
    pos: tuple[int, int, int]  # the model's, when it was saved
    state: dict


# --- the walk ----------------------------------------------------------------------------------------


class Walk:
    def __init__(self, tmp_path, root: str, daemon_factory, rng: random.Random):
        self.tmp, self.root, self.start, self.rng = tmp_path, root, daemon_factory, rng
        self.configs: dict[Geo, str] = {}
        self.daemon = None
        self.loaders: list[PrefetchClient] = []
        self.iters: dict[int, object] = {}
        self.abandoned: list = []  # fors left suspended by a Ctrl-C, closed by a later "gc" move
        self.saved: list[Saved] = []
        self.pixels: dict[tuple[int, int], str] = {}
        self.log: list[str] = []
        self.model: Model | None = None

    def config(self, geo: Geo) -> str:
        if geo not in self.configs:
            d = self.tmp / f"w{geo.world}b{geo.batch}d{int(geo.drop_last)}"
            d.mkdir()
            self.configs[geo] = small_config(
                d, self.root, loader={"world_size": geo.world, "ranks": list(range(geo.world)),
                                      "batch_size": geo.batch, "drop_last": geo.drop_last, "epochs": None},
                buffer={"dir": str(self.tmp / "buffer")}, dataset={"cache_dir": str(self.tmp / "cache")})
        return self.configs[geo]

    def open(self, geo: Geo) -> None:
        self.close()
        self.daemon = self.start(self.config(geo))
        self.wait_up()
        self.loaders = [PrefetchClient(self.config(geo), rank=r, timeout=TIMEOUT_S, as_numpy=True)
                        for r in range(geo.world)]
        self.model = Model(geo)

    def close(self) -> None:
        self.iters.clear()
        for ld in self.loaders:
            ld.close()
        self.loaders = []
        if self.daemon is not None:
            assert self.daemon.stop() == 0, self.daemon.log()[-2000:]
            self.daemon = None

    # --- moves ---

    def next(self, r: int) -> None:
        ld, want_epoch = self.loaders[r], self.model.epoch_after_next(r)
        want = self.model.next(r)
        it = self.iters.get(r)
        x = next(it, None) if it is not None else None
        if x is None:  # no for under way, or its epoch ended: a new for
            it = self.iters[r] = iter(ld)
            x = next(it, None)
            if x is None:  # a for at an epoch's end ends at once; the next one runs the next epoch
                it = self.iters[r] = iter(ld)
                x = next(it)
        info = ld.last_batch
        got = info.indices.tolist()
        assert (info.epoch, got) == (want_epoch, want), (
            f"rank {r}'s next batch is epoch {info.epoch} samples {got}, the model says epoch {want_epoch} {want}")
        for i, img in zip(got, x[0], strict=True):
            h = hashlib.blake2b(img.tobytes(), digest_size=8).hexdigest()
            assert self.pixels.setdefault((info.epoch, i), h) == h, f"sample {i} of epoch {info.epoch}: other pixels"

    def drop_iter(self, r: int) -> None:
        it = self.iters.pop(r, None)
        if it is not None:
            it.close()

    def save(self) -> None:
        for r, ld in enumerate(self.loaders):
            self.saved.append(Saved(self.model.geo, r, self.model.pos[r], ld.state_dict()))

    def seek(self, e: int, b: int) -> None:
        for r, ld in enumerate(self.loaders):
            self.drop_iter(r)
            ld.seek(e, b)
            self.model.seek(r, e, b)

    def set_epoch(self, e: int) -> None:
        for r, ld in enumerate(self.loaders):
            self.drop_iter(r)
            ld.set_epoch(e)
            self.model.set_epoch(r, e)

    def load(self, how: str, pick: list[Saved]) -> None:
        """Every rank loads: its own rank's state of the step (``own``), rank 0's, or one rank's."""
        for r, ld in enumerate(self.loaders):
            st = pick[r % len(pick)] if how == "own" else pick[0]
            self.drop_iter(r)
            ld.load_state_dict(st.state)
            self.model.load(r, st)

    def refuse(self, r: int, state: dict, why: str) -> None:
        ld = self.loaders[r]
        self.drop_iter(r)
        before = (ld.epoch, ld.batch, ld.state_dict()["offset"])
        with pytest.raises(PrefetchError) as e:
            ld.load_state_dict(state)
        assert str(e.value).strip(), f"refused without a message: {why}"
        assert (ld.epoch, ld.batch, ld.state_dict()["offset"]) == before, f"a refused state moved the loader: {why}"

    def collect(self) -> None:
        for it in self.abandoned:
            it.close()
        self.abandoned.clear()

    def restart(self) -> None:
        self.iters.clear()
        assert self.daemon.stop() == 0
        self.daemon = self.start(self.config(self.model.geo))  # the trainers go on as they are
        self.wait_up()

    def wait_up(self) -> None:
        """Until the daemon holds the buffer: the loaders may read on from batches an earlier one left,
        and a daemon stopped before its signal handlers are set dies of the signal."""
        wait_until(lambda: status.daemon_alive(str(self.tmp / "buffer")), 60, "the daemon up")

    def regeo(self, geo: Geo, how: str) -> None:
        """The job restarts at another world and batch size and resumes its last step."""
        self.save()
        old = self.model.geo
        step = self.saved[-old.world:]
        self.open(geo)
        self.load(how, [step[self.rng.randrange(len(step))] if how == "any" else step[0]])

    def regeo_starting(self, geo: Geo, how: str) -> None:
        """The job restarts at another world and batch size while its daemon restarts with it: the
        trainers start (each makes its loader and loads the last step's state, in threads, as ranks
        do) while the new daemon is starting, the old daemon's meta.json of the old world size still
        in the buffer; each must wait for the new daemon's, never judge the old one's stream."""
        self.save()
        step = self.saved[-self.model.geo.world:]
        st = step[self.rng.randrange(len(step))] if how == "any" else step[0]
        self.close()
        # half the time, the new daemon's first moment held open: its lock taken, daemon.lock and
        # meta.json still the dead daemon's (of the old world size) while the trainers start
        moment = self.rng.random() < 0.5
        held = os.open(str(self.tmp / "buffer"), os.O_RDONLY | os.O_DIRECTORY) if moment else -1
        if moment:
            fcntl.flock(held, fcntl.LOCK_EX)
        else:
            self.daemon = self.start(self.config(geo))  # not waited for: the trainers start beside it
        got: dict[int, object] = {}

        def trainer(r: int) -> None:
            try:
                ld = PrefetchClient(self.config(geo), rank=r, timeout=TIMEOUT_S, as_numpy=True)
                got[r] = ld
                ld.load_state_dict(st.state)
            except BaseException as e:  # noqa: BLE001 -- said below, with the rank
                got[-1 - r] = e

        threads = [threading.Thread(target=trainer, args=(r,), daemon=True) for r in range(geo.world)]
        for t in threads:
            t.start()
        if moment:  # long enough for every trainer to read the old meta.json many times
            for t in threads:
                t.join(0.5 / len(threads))
            os.close(held)
            self.daemon = self.start(self.config(geo))
        for t in threads:
            t.join(TIMEOUT_S + 30)
        self.loaders = [got[r] for r in range(geo.world) if r in got]
        errors = {-1 - k: e for k, e in got.items() if k < 0}
        assert not errors and len(self.loaders) == geo.world, f"trainers starting beside the daemon: {errors}"
        self.model = Model(geo)
        for r in range(geo.world):
            self.model.load(r, st)
        self.wait_up()

    # --- the walk ---

    def bad_states(self, st: Saved) -> list[tuple[str, dict]]:
        g = st.geo.sampler()
        e, b, o = st.pos
        s = st.state
        past = g.batches_in(o) + 1 + self.rng.randrange(30)
        return [
            (f"batch {past} past the end of its epoch (saved at {st.geo})",
             {**s, "batch": past, "_sampler_iter_state": {"epoch": e, "batch": past}}),
            ("world_size 0", {**s, "world_size": 0}),
            ("batch_size 0", {**s, "batch_size": 0}),
            ("a garbage fingerprint", {**s, "fingerprint": "0123456789abcdef"}),
            ("the val split's", {**s, "split": "val"}),
        ]

    def step(self) -> None:
        rng, m = self.rng, self.model
        W = m.geo.world
        moves = {"next": 30, "next3": 12, "break": 6, "save": 10, "seek": 8, "set_epoch": 8, "load": 10,
                 "refuse": 6, "restart": 2, "regeo": 3, "regeo_starting": 3, "wrong_then_right": 3, "ctrl_c": 3,
                 "gc": 2, "load_load_seek": 3}
        names = [k for k in moves if k not in OMIT]
        move = rng.choices(names, [moves[k] for k in names])[0]
        r = rng.randrange(W)
        if move in ("next", "next3"):
            for _ in range(1 if move == "next" else 3):
                self.job_step()
            return
        if move == "break":
            self.note(f"break r{r}")
            self.drop_iter(r)
        elif move == "save":
            self.note("save")
            self.save()
        elif move == "seek":
            e = m.pos[0][0] if rng.random() < 0.5 else rng.randrange(EPOCHS)  # within the epoch, or any
            b = rng.randrange(m.end_of(0) + 1)
            self.note(f"seek({e}, {b})")
            self.seek(e, b)
        elif move == "set_epoch":
            cur = m.pos[0][0]
            e = max(0, cur + rng.choice([-1, 0, 0, 1]))
            self.note(f"set_epoch({e}) at {m.pos}")
            self.set_epoch(e)
        elif move in ("load", "wrong_then_right") and self.saved:
            i = rng.randrange(len(self.saved))
            st, group = self.saved[i], _step_of(self.saved, i)
            how = rng.choice(["own", "rank0", "any"]) if st.geo == m.geo else rng.choice(["rank0", "any"])
            if st.geo == m.geo and "other_rank_same_world" in OMIT:
                how = "own"
            group = group if how == "own" else [group[0]] if how == "rank0" else [st]
            if move == "wrong_then_right":  # one rank loads another step's state first, then the right one
                other = self.saved[rng.randrange(len(self.saved))]
                self.note(f"rank {r} loads {other.geo} {other.pos} first")
                self.drop_iter(r)
                try:
                    self.loaders[r].load_state_dict(other.state)
                except PrefetchError:
                    pass
            self.note(f"load {how} of {st.geo} {[s.pos for s in group]} (model {m.pos})")
            self.load(how, group)
        elif move == "ctrl_c":  # a KeyboardInterrupt in the loop's body: the for is not closed, a new one starts
            self.note(f"Ctrl-C r{r}: its for left suspended")
            it = self.iters.pop(r, None)
            if it is not None:
                self.abandoned.append(it)
        elif move == "gc":  # the collector finalizes the interrupted fors (of this job's loaders or an earlier one's)
            self.note(f"the collector closes {len(self.abandoned)} interrupted fors")
            self.collect()
        elif move == "load_load_seek" and self.saved:  # two loads and a seek, no batch read in between
            a, b = (self.saved[rng.randrange(len(self.saved))] for _ in range(2))
            e, bb = rng.randrange(EPOCHS), rng.randrange(m.end_of(0) + 1)
            self.note(f"load rank0 of {a.geo} {a.pos}, then of {b.geo} {b.pos}, then seek({e}, {bb})")
            self.load("rank0", [a])
            self.load("rank0", [b])
            self.seek(e, min(bb, self.model.end_of(0)))
        elif move == "refuse" and self.saved:
            st = self.saved[rng.randrange(len(self.saved))]
            why, bad = rng.choice(self.bad_states(st))
            self.note(f"refuse r{r}: {why}")
            self.refuse(r, bad, why)
        elif move == "restart":
            self.note("restart the daemon")
            self.restart()
        elif move == "regeo":
            geo = rng.choice([g for g in GEOS if g != m.geo])
            how = rng.choice(["rank0", "any"])
            self.note(f"world {m.geo} -> {geo}, each rank loads {how} (model {m.pos})")
            self.regeo(geo, how)
        elif move == "regeo_starting":
            geo = rng.choice([g for g in GEOS if g.world != m.geo.world])
            how = rng.choice(["rank0", "any"])
            self.note(f"world {m.geo} -> {geo} with the trainers starting while the daemon does, each loads {how} "
                      f"(model {m.pos})")
            self.regeo_starting(geo, how)
        else:
            return
        self.job_step()  # after each move, every rank's next batch is the model's

    def job_step(self) -> None:
        """One training step: every rank takes its next batch (ranks step in lock-step)."""
        order = list(range(self.model.geo.world))
        self.rng.shuffle(order)
        for r in order:
            self.note(f"next r{r} (model {self.model.pos[r]})")
            self.next(r)

    def note(self, what: str) -> None:
        self.log.append(what)


def _step_of(saved: list[Saved], i: int) -> list[Saved]:
    """The states every rank saved at the step of ``saved[i]`` (``Walk.save`` appends them in rank order)."""
    st = saved[i]
    first = i - st.rank
    return saved[first:first + st.geo.world]


def test_a_random_walk_of_the_trainers_moves_reads_what_the_model_says(tmp_path, image_root, daemon_factory):
    walk = Walk(tmp_path, image_root, daemon_factory, random.Random(WALK_SEED))
    walk.open(GEOS[0])
    try:
        for _ in range(STEPS):
            walk.step()
        if not any("trainers starting" in line for line in walk.log):  # the walk always has one (issue 41)
            geo = next(g for g in GEOS if g.world != walk.model.geo.world)
            walk.note(f"world {walk.model.geo} -> {geo} with the trainers starting while the daemon does (forced)")
            walk.regeo_starting(geo, "rank0")
            walk.job_step()
        print(f"{sum('trainers starting' in line for line in walk.log)} restarts at another world size with the "
              f"trainers starting, of {len(walk.log)} moves")
    except BaseException as e:
        tail = "\n  ".join(walk.log[-25:])
        raise AssertionError(f"after {len(walk.log)} moves (seed {WALK_SEED}), the last:\n  {tail}\n{e}") from e
    finally:
        try:
            walk.close()
        finally:
            walk.collect()

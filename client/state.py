"""Loader states: what ``state_dict()`` saves and how ``load_state_dict()`` checks and resumes it
(a mixin of ``PrefetchClient``).

A state names its position (``epoch``, ``batch``; in a resumed epoch the ``offset`` of its segment),
its stream (``fingerprint``) and ``split``, and what a job at another world or batch size needs to
go on from it (``world_size``, ``batch_size``, ``drop_last``, ``sample_fingerprint``).

One rule for which state to load: rank 0's, on every rank, at the same world size or another
(each rank's own works too). The ranks of a job step in lock-step, so every state of one step
names the same position; ``rank`` is kept for the record only.

Refused with a message saying why: another stream's state, the other split's, a position past the
end of its epoch (as the job that saved it cut the epoch: its world size, batch size and
drop_last), a world or batch size of 0, a state naming no stream (unless
``allow_unverified=True``). A state saved at another world size or batch size resumes the rest of
its epoch shared out among this job's ranks as the sampler shares a whole epoch
(``prefetchd.core.sampler``); its ``fingerprint`` must be the stream of this dataset at its own
world size, batch size and drop_last (meta.json's ``dataset_fingerprint``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from prefetchd.core.sampler import Sampler
from prefetchd.format import status

from .common import _STATE_FORMAT, PrefetchError

_log = logging.getLogger("prefetchd_client")


class LoaderState:
    """``state_dict`` and ``load_state_dict`` (see the module docstring)."""

    def state_dict(self) -> dict:
        """The trainer's position (not the reader's read-ahead), shaped like torchdata's
        StatefulDataLoader state: ``_num_yielded`` batches of epoch ``epoch`` are done. Names its
        stream (``fingerprint``, from the daemon's meta.json: waits for it up to the timeout,
        also before the first batch) and its ``split``. In a resumed epoch, ``offset`` is where its
        segment starts (0 otherwise); ``world_size``, ``batch_size`` and ``sample_fingerprint`` let
        it resume at another world or batch size."""
        fp = self._fingerprint()
        # torchdata's count is of the whole epoch: in a resumed epoch the batches before its segment
        # count as done (this job's epoch length less the segment's), so it ends at len() of a whole one
        done = self.batch + (self.batches_per_epoch - self._epoch_len(self.epoch) if self._offset_of(self.epoch) else 0)
        return {"_num_yielded": done, "_sampler_iter_yielded": done,
                "_sampler_iter_state": {"epoch": self.epoch, "batch": self.batch}, "_iterator_finished": False,
                "format": _STATE_FORMAT, "epoch": self.epoch, "batch": self.batch, "rank": self.rank,
                "world_size": self.world_size, "fingerprint": fp, "split": self.split, **self._resume_fields()}

    def _resume_fields(self) -> dict:
        """What a job at another world or batch size needs to resume this state (see ``_reshard``)."""
        return {"offset": self._offset_of(self.epoch), "batch_size": self.batch_size, "drop_last": self.drop_last,
                "sample_fingerprint": self._meta.get("sample_fingerprint") if self._meta else None,
                # loader.shuffle as the stream holds it (block: with its window): a switch is named as such
                "shuffle": self.cfg.loader.shuffle_key() if self.split == "train" else None,
                # the dataset's length: files added or removed since are named as such
                "num_samples": self._meta.get("num_samples") if self._meta else None,
                # augment.transform's module file (its digits are in the fingerprints): a change is named as such
                "transform_code": self._meta.get("transform_code") if self._meta else None}

    def load_state_dict(self, state: Mapping, allow_unverified: bool = False) -> None:
        """Continue where ``state`` (from :meth:`state_dict`, or the older ``{epoch, batch, rank,
        fingerprint}``) was. Which state: rank 0's, on every rank (any rank's works as well: the
        ranks of a job step in lock-step, so the states of one step name one position), at the
        same world size or another. Refuses another stream's state, the other split's, a position
        past the end of its epoch (counted as the job that saved it cut the epoch), a world or
        batch size of 0, and a state that names no stream (no ``fingerprint``) unless
        ``allow_unverified=True``. A state saved at another world size or batch size resumes the
        rest of its epoch shared out among this job's ranks (``_reshard``)."""
        if not isinstance(state, Mapping):
            raise PrefetchError(f"a loader state is a dict from state_dict(), got {type(state).__name__}")
        pos = state.get("_sampler_iter_state") if isinstance(state.get("_sampler_iter_state"), Mapping) else state
        try:
            epoch, batch = _state_int(pos, "epoch"), _state_int(pos, "batch")
            world, saved_batch_size = _state_int(state, "world_size", None), _state_int(state, "batch_size", None)
            _state_int(state, "rank", None)
            offset = _state_int(state, "offset", 0)
            for key, v in (("world_size", world), ("batch_size", saved_batch_size)):
                if v == 0:
                    raise ValueError(f"{key} must be positive, got 0")
        except ValueError as e:
            raise PrefetchError(f"not a prefetchd loader state ({e}); keys {sorted(map(str, state))}") from None
        self._check_state_split(state)
        if self._resharded(world, saved_batch_size):
            epoch, offset = self._reshard(state, epoch, batch, offset, world, saved_batch_size)
            return self._seek(epoch, 0, offset)
        if world is not None and world != self.world_size:
            raise PrefetchError(f"this loader state is from a job of world_size {state['world_size']}, this config "
                                f"has loader.world_size {self.world_size}; a split={self.split!r} position does not "
                                "carry over to another world size")
        self._check_state_stream(state, allow_unverified)
        self._check_offset(epoch, offset)
        self._check_state_position(epoch, batch, offset)
        self._seek(epoch, batch, offset)

    # --- resuming at another world size or batch size -----------------------------------------------

    def _resharded(self, world: int | None, batch_size: int | None) -> bool:
        """Was the state saved by a job that cut the train stream otherwise (world or batch size)?"""
        return self.split == "train" and world is not None and (
            world != self.world_size or (batch_size is not None and batch_size != self.batch_size))

    def _reshard(self, state: Mapping, epoch: int, batch: int, offset: int, world: int,
                 batch_size: int | None) -> tuple[int, int]:
        """Where a state saved at ``world`` x ``batch_size`` goes on here, as ``(epoch, offset)``:
        the samples of its epoch not consumed globally (its ``batch`` steps of ``world x
        batch_size`` samples each, from its own ``offset``) are shared out among this config's
        ranks as a whole epoch is (``core.sampler``); the epochs after it are whole. The state is
        checked as its own job cut the stream: its ``fingerprint`` must be that job's stream of
        this dataset, its position inside that job's epoch."""
        saved, have = state.get("sample_fingerprint"), self.meta().get("sample_fingerprint")
        was = f"world_size {world}" + (f", batch_size {batch_size}" if batch_size is not None else "")
        if not saved or batch_size is None:
            raise PrefetchError(f"this loader state is from a job of {was} and does not say what its samples were "
                                "(saved by an older prefetchd): it resumes only at that world and batch size")
        self._check_transform_file(state)
        if saved != have:
            raise PrefetchError(f"this loader state is for samples {saved}, the daemon serving {self.dir} makes samples "
                                f"{have} ({self._shuffle_changed(state) or 'dataset, seed or augment settings changed'}); "
                                "resuming would not continue the same epoch: start the loader afresh or use the old config")
        drop_last = self._saved_drop_last(state, world, batch_size)
        self._check_offset(epoch, offset)
        L = self.cfg.loader
        theirs = Sampler(self._sampler().num_samples, batch_size, L.seed, L.shuffle, drop_last, world)
        n = theirs.batches_in(offset)
        if batch > n:
            raise PrefetchError(f"this loader state is at batch {batch} of epoch {epoch}, which has {n} batches in the "
                                f"job of {was} that saved it: past its end, so it is no position of that job's stream")
        sampler = self._sampler()
        new = sampler.resume(epoch, offset, batch, world, batch_size)
        _log.info("resuming epoch %d at sample %d of %d with world size %d (saved at %d)%s", new[0], new[1],
                 sampler.num_samples, self.world_size, world,
                 "" if batch_size == self.batch_size else f", batch size {self.batch_size} (saved at {batch_size})")
        return new

    def _saved_drop_last(self, state: Mapping, world: int, batch_size: int) -> bool:
        """The saving job's ``drop_last``, checked with its ``fingerprint``: the stream of this
        dataset at that job's world size, batch size and drop_last (this config's other settings).
        Unknown (an older state naming no stream): False, the longer epoch, so no position of
        either is refused."""
        said = state.get("drop_last")
        if said is not None and not isinstance(said, bool):
            raise PrefetchError(f"not a prefetchd loader state (drop_last must be true or false, got {said!r})")
        fp, dataset = state.get("fingerprint"), self.meta().get("dataset_fingerprint")
        if not fp or dataset is None:  # nothing to compare (the samples are: sample_fingerprint), or a
            return bool(said)  # daemon before meta.json's dataset_fingerprint
        for d in (said,) if said is not None else (self.drop_last, not self.drop_last):
            if status.stream_id(self.cfg.stream_fingerprint(world_size=world, batch_size=batch_size, drop_last=d),
                                dataset, self.meta().get("transform_code")) == fp:
                return d
        raise PrefetchError(f"this loader state is for stream {fp}, which is not this dataset's at world_size {world}, "
                            f"batch_size {batch_size} with this config's seed and augment settings (the daemon "
                            f"serving {self.dir} makes samples {self.meta().get('sample_fingerprint')}); it is no "
                            "state of this dataset: start the loader afresh or use the old config")

    def _check_offset(self, epoch: int, offset: int) -> None:
        if offset and offset >= self._sampler().num_samples:
            raise PrefetchError(f"this loader state resumes epoch {epoch} at sample {offset}, past its "
                                f"{self._sampler().num_samples} samples; it is not a state of this dataset")

    def _sampler(self) -> Sampler:
        """The daemon's sampler (its counts, for resumed epochs' lengths and offsets)."""
        L = self.cfg.loader
        return Sampler(int(self.meta()["num_samples"]), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)

    def _check_state_split(self, state: Mapping) -> None:
        """A train state into a ``split="val"`` client, or the reverse: said as such (by the
        state's ``split``, or, in a state without one, by the other stream's fingerprint)."""
        split = state.get("split")
        if split is None and state.get("fingerprint"):
            m = self.meta()
            theirs = {"train": m.get("fingerprint"), "val": (m.get("validation") or {}).get("fingerprint")}
            split = next((k for k, v in theirs.items() if k != self.split and v == state["fingerprint"]), None)
        if split is not None and split != self.split:
            raise PrefetchError(f"this loader state is a split={split!r} loader's, this client reads "
                                f"split={self.split!r}; load each loader's own state (the train loader's into the "
                                "train loader, the val loader's into the val loader)")

    def _check_state_stream(self, state: Mapping, allow_unverified: bool) -> None:
        """The state's stream is the daemon's; a state naming none is refused unless the caller says so."""
        fp = state.get("fingerprint")
        if not fp:
            if allow_unverified:
                return
            raise PrefetchError("this loader state names no stream (its fingerprint is missing), so it cannot be "
                                "checked against the stream the daemon makes; save it again with state_dict(), or "
                                "pass allow_unverified=True to load_state_dict() to use its position anyway")
        have = self._fingerprint()
        self._check_transform_file(state)
        if fp != have:
            changed = self._changed_setting(state, fp)
            raise PrefetchError(f"this loader state is for stream {fp}, the daemon serving {self.dir} makes stream "
                                f"{have} ({changed or 'dataset, loader or augment settings changed'}); resuming "
                                "would not continue the same stream: start the loader afresh or use the old config"
                                + (f" ({changed.split(' ')[0]} as it was)" if changed and changed.startswith("loader.")
                                   else ""))

    def _changed_setting(self, state: Mapping, fp: str) -> str | None:
        """The one loader setting whose change alone makes this dataset's stream ``fp`` (the state's)
        out of this config's, said with both values; None when it is not one of them (or unknown)."""
        dataset = self.meta().get("dataset_fingerprint")
        if self.split != "train" or not dataset:
            return None
        L = self.cfg.loader
        if said := self._shuffle_changed(state):
            return said
        for key, theirs in (("drop_last", not L.drop_last), ("shuffle", not L.shuffle)):
            if status.stream_id(self.cfg.stream_fingerprint(**{key: theirs}), dataset) == fp:
                return (f"loader.{key} changed: {str(theirs).lower()} in the job that saved it, "
                        f"{str(getattr(L, key)).lower()} in this config")
        return None

    def _shuffle_changed(self, state: Mapping) -> str | None:
        """``loader.shuffle`` (or a block shuffle's window) as the state's job had it, when it is not
        this config's: true and block make other orders of the same samples, so their streams differ.
        Before it: the dataset's length, when files were added or removed since the state was saved."""
        then, now = state.get("num_samples"), (self._meta or {}).get("num_samples")
        if self.split == "train" and isinstance(then, int) and isinstance(now, int) and then != now:
            return f"the dataset changed: {now} samples now, {then} when the state was saved: files were added or removed"
        saved, mine = state.get("shuffle"), self.cfg.loader.shuffle_key()
        if self.split != "train" or not isinstance(saved, (bool, str)) or saved == mine:
            return None
        if isinstance(saved, str) and isinstance(mine, str):  # both block: the window changed
            return (f"loader.shuffle_window changed: {saved.partition(':')[2]} in the job that saved it, "
                    f"{mine.partition(':')[2]} in this config")
        return f"loader.shuffle changed: {_shuffle_words(saved)} in the job that saved it, {_shuffle_words(mine)} in this config"

    def _check_transform_file(self, state: Mapping) -> None:
        """A state saved before augment.transform's module file changed: said as such."""
        saved, m = state.get("transform_code"), self.meta()
        if saved and m.get("transform_code") and saved != m["transform_code"]:
            raise PrefetchError(f"this loader state was saved when augment.transform's module file had sha256 "
                                f"{saved}; the daemon serving {self.dir} runs {m.get('transform_file')} with sha256 "
                                f"{m['transform_code']}: the file changed, so resuming would not give the same samples; "
                                "restore the file, or start the loader afresh")

    def _check_state_position(self, epoch: int, batch: int, offset: int = 0) -> None:
        """A position past the end of its epoch (or pass, or resumed epoch's segment) is no
        position of this stream."""
        n = self._sampler().batches_in(offset) if offset else self.batches_per_epoch
        if batch > n:
            what = "pass" if self.split == "val" else "epoch"
            raise PrefetchError(f"this loader state is at batch {batch} of {what} {epoch}, which has {n} batches: "
                                "past its end, so it is no position of this stream (another batch size, dataset "
                                "or world size?)")


def _shuffle_words(key: bool | str) -> str:
    """A ``LoaderConfig.shuffle_key`` as the config spells it: ``true``, ``false``, ``block``."""
    if isinstance(key, bool):
        return str(key).lower()
    return f"block (shuffle_window {key.partition(':')[2]})" if key.startswith("block:") else key


def _state_int(state: Mapping, key: str, *default):
    """``state[key]`` as a non-negative int (or ``default`` when absent or None)."""
    if key not in state and not default:
        raise ValueError(f"no {key!r}")
    v = state.get(key)
    if v is None and default:
        return default[0]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
    return int(v)

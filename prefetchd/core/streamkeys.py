"""The settings that make a stream, by key, and which of them differ between two configs.

``Config.stream_fingerprint`` hashes these settings; a trainer whose fingerprint is not the
daemon's is refused. The daemon also writes the settings themselves into its ``meta.json``
(``"stream"``: ``{"loader.batch_size": 64, "augment.flip": true, ...}``), so the refusal names the
keys that differ and both values: ``loader.batch_size 32 here, 64 in the daemon's config``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from prefetchd.core.policyspec import ErasingConfig, OpsConfig

LOADER_KEYS = ("batch_size", "seed", "shuffle", "drop_last", "world_size")
# the extras' keys as a config with none of them has them (left out of its fingerprint)
_EXTRAS_OFF = {"policy": "none", "policy_args": {}, "random_erasing": ErasingConfig().stream_dict(),
               "ops": dataclasses.asdict(OpsConfig())}


def stream_settings(cfg) -> dict[str, Any]:
    """``{"section.key": value}`` of every setting in ``cfg``'s stream fingerprint (JSON types). A
    block shuffle's window is named; the policy, erasing and op keys a config without any leaves
    out of its fingerprint are given at their defaults, so turning one on is said as that key."""
    out: dict[str, Any] = {f"loader.{k}": getattr(cfg.loader, k) for k in LOADER_KEYS}
    if cfg.loader.shuffle == "block":
        out["loader.shuffle_window"] = cfg.loader.shuffle_window
    d = cfg.augment.stream_dict()
    if cfg.augment.transform is None and "policy" not in d:
        d.update(_EXTRAS_OFF)
    if isinstance(d.get("random_erasing"), dict):  # erase_on: daemon is left out of the fingerprint, not of this
        d["random_erasing"] = {"erase_on": "daemon", **d["random_erasing"]}
    for k, v in d.items():
        out[f"augment.{k}"] = json.loads(json.dumps(v))  # tuples, also nested ones, as meta.json reads them
    return out


def differences(mine: dict[str, Any], theirs: dict[str, Any], limit: int = 4) -> str:
    """``key A here, B in the daemon's config; ...`` for each key whose values differ (at most
    ``limit`` named, then how many more), or "" when none do. Of a mapping (``augment.random_erasing``)
    the keys inside it that differ are named (``augment.random_erasing.erase_on``)."""
    def norm(v):
        return json.loads(json.dumps(v))

    flat_mine, flat_theirs = {}, {}
    for k in set(mine) | set(theirs):
        a, b = norm(mine.get(k)), norm(theirs.get(k))
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in set(a) | set(b):
                flat_mine[f"{k}.{sub}"], flat_theirs[f"{k}.{sub}"] = a.get(sub), b.get(sub)
        else:
            flat_mine[k], flat_theirs[k] = a, b
    keys = [k for k in sorted(flat_mine) if flat_mine[k] != flat_theirs[k]]
    said = [f"{k} {_show(flat_mine[k])} here, {_show(flat_theirs[k])} in the daemon's config" for k in keys[:limit]]
    if len(keys) > limit:
        said.append(f"and {len(keys) - limit} more")
    return "; ".join(said)


def _show(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)

"""The settings that make a stream, by key, and which of them differ between two configs.

``Config.stream_fingerprint`` hashes these settings; a trainer whose fingerprint is not the
daemon's is refused. The daemon also writes the settings themselves into its ``meta.json``
(``"stream"``: ``{"loader.batch_size": 64, "augment.flip": true, ...}``), so the refusal names the
keys that differ and both values: ``loader.batch_size 32 here, 64 in the daemon's config``.
"""

from __future__ import annotations

from typing import Any

LOADER_KEYS = ("batch_size", "seed", "shuffle", "drop_last", "world_size")


def stream_settings(cfg) -> dict[str, Any]:
    """``{"section.key": value}`` of every setting in ``cfg``'s stream fingerprint (JSON types)."""
    out: dict[str, Any] = {f"loader.{k}": getattr(cfg.loader, k) for k in LOADER_KEYS}
    for k, v in cfg.augment.stream_dict().items():
        out[f"augment.{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def differences(mine: dict[str, Any], theirs: dict[str, Any], limit: int = 4) -> str:
    """``key A here, B in the daemon's config; ...`` for each key whose values differ (at most
    ``limit`` named, then how many more), or "" when none do."""
    def norm(v):
        return list(v) if isinstance(v, tuple) else v

    keys = [k for k in sorted(set(mine) | set(theirs)) if norm(mine.get(k)) != norm(theirs.get(k))]
    said = [f"{k} {_show(mine.get(k))} here, {_show(theirs.get(k))} in the daemon's config" for k in keys[:limit]]
    if len(keys) > limit:
        said.append(f"and {len(keys) - limit} more")
    return "; ".join(said)


def _show(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)

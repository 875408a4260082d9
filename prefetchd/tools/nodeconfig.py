"""``prefetchd node-config``: one node's config, written from the job's.

    prefetchd node-config --config train.yaml --nodes 2 --node 1 --per-node 8 --out node.yaml

A multi-node job runs one daemon per node, each serving that node's ranks of the whole job. Its
config is the job's (dataset, loader, augment, ...) with ``loader.world_size`` = nodes x ranks per
node and ``loader.ranks`` the node's ranks (node I has I*G .. I*G+G-1: a Slurm step with
``--distribution=block``, torchrun's ``--node-rank``, an Indexed Job's completion index), and,
with ``--buffer-dir``, the ring somewhere else (a job-private directory) and the progress files
in it. The Slurm recipe and the Kubernetes Indexed Job write it on each node before the daemon
starts.

Relative paths (dataset, buffer, progress) are made absolute against the job config's directory, as prefetchd reads
them: the copy lives elsewhere. The copy is checked as the daemon would read it (exit 78 and one
line when it is not a valid config) and written whole (a temporary file renamed over ``--out``),
so a task or container waiting for it never reads half of it.
"""

from __future__ import annotations

import os
import sys

import yaml

from prefetchd.core.config import ConfigError, _resolve_relative
from prefetchd.core.config import load as load_config


def node_config(doc: dict, template_dir: str, nodes: int, node: int, per_node: int,
                buffer_dir: str | None = None) -> dict:
    """The job config ``doc`` (as parsed from YAML, in ``template_dir``) as node ``node``'s of
    ``nodes``, each running ``per_node`` ranks. Pure: ``doc`` is not changed."""
    if not (nodes >= 1 and per_node >= 1 and 0 <= node < nodes):
        raise ValueError(f"node {node} of {nodes} nodes with {per_node} ranks each: need nodes >= 1, "
                         f"per-node >= 1 and 0 <= node < nodes")
    cfg = _resolve_relative(doc, template_dir)  # a copy, its paths absolute as prefetchd reads the job's
    loader = cfg.setdefault("loader", {})
    loader.update(world_size=nodes * per_node, ranks=list(range(node * per_node, (node + 1) * per_node)))
    if buffer_dir is not None:
        cfg.setdefault("buffer", {})["dir"] = buffer_dir
        cfg.setdefault("progress", {})["dir"] = None  # in the ring: <buffer.dir>/progress
    return cfg


def write_node_config(template: str, out: str, nodes: int, node: int, per_node: int,
                      buffer_dir: str | None = None) -> None:
    """Read ``template``, write node ``node``'s config to ``out`` whole, check it. Raises
    ``ConfigError`` (the copy is not a valid config) or ``OSError``."""
    template = os.path.abspath(template)
    with open(template) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ConfigError("", f"{template} is not a mapping of sections")
    cfg = node_config(doc, os.path.dirname(template), nodes, node, per_node, buffer_dir)
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        load_config(tmp)  # as the daemon and the clients will read it
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run_node_config(args) -> int:
    try:
        write_node_config(args.config, args.out, args.nodes, args.node, args.per_node, args.buffer_dir)
    except (ConfigError, ValueError) as e:
        print(f"prefetchd node-config: configuration error: {e}", file=sys.stderr)
        return 78
    except OSError as e:
        print(f"prefetchd node-config: {e.filename or args.out}: {e.strerror}", file=sys.stderr)
        return 1
    return 0

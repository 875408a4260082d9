"""The real daemon over a local root, then over its copy in a bucket (s3:// or gs://): one helper
for every layout's and provider's test that the batches match byte for byte and no secret is written."""

from __future__ import annotations

import os


def same_batches_from_the_bucket_and_no_secret(tmp_path, local_root: str, bucket_root: str, env: dict,
                                               daemon_factory, cache_meta: str, secret: bytes) -> None:
    """The real daemon over ``local_root``, then over ``bucket_root`` (``env``: the store's
    credentials and endpoint, any provider's): the same batches, byte for byte; and no file it
    wrote (its index cache, ``cache_meta`` among them, and its log) holds ``secret`` (the S3 secret
    key, a line of a service account's private key)."""
    import numpy as np
    from conftest import small_config
    from test_daemon import collect

    local_dir, bucket_dir = tmp_path / "local", tmp_path / "bucket"
    local_dir.mkdir()
    bucket_dir.mkdir()
    refs = []
    for folder, root, extra in ((local_dir, local_root, None), (bucket_dir, bucket_root, env)):
        cfg = small_config(folder, root)
        d = daemon_factory(cfg, env=extra) if extra else daemon_factory(cfg)
        refs.append(collect(cfg))
        assert d.stop() == 0
    ref, got = refs
    assert sorted(got) == sorted(ref) and len(ref) >= 8
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
    written = [os.path.join(p, n) for p, _, names in os.walk(bucket_dir) for n in names] + [d.log_path]
    assert any(p.endswith(cache_meta) for p in written)  # the index cache among them
    for path in written:
        with open(path, "rb") as f:
            assert secret not in f.read(), path

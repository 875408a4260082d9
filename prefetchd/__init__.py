"""prefetchd: a data-loading daemon that keeps a RAM-disk ring of ready, augmented batches.

This package's ``__init__`` imports nothing, so the trainer's client can use the shared format
modules (``config``, ``batchfile``, ``progress``, ``status``) without loading the daemon.
"""

__version__ = "0.1.0"

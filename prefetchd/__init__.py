"""prefetchd: a data-loading daemon that keeps a RAM-disk ring of ready, augmented batches.

Sub-packages, each importing only those before it: ``format`` (what the daemon and the client
share on disk), ``core`` (config, samplers, augmentation, planner, dataset index), ``executors``
(worker pool, Ray, batch builders), ``daemon`` (the loop and its shell), ``tools`` (bench, demo,
preview, deployment check). ``cli`` is the command line over all of them. This ``__init__``
imports nothing, so the trainer's client loads only ``format`` and ``core.config``.
"""

__version__ = "0.1.0"

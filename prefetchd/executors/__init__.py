"""Executors make batches: the local process pool and its worker, Ray actors, and the batch
builders (pixels, or compact batches for GPU decode) a worker fills. One interface per role:
every executor offers ``idle``, ``submit``, ``results``, ``waitables``, ``stop``; every builder
``reset``, ``add``, ``fit``, ``write``. Imports ``format`` and ``core`` only."""

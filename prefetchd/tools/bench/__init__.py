"""``prefetchd bench`` and its kinds: throughput against the decode-only limit and the peers
(``throughput``), the client's cost in the trainer's thread (``client``), training fed three ways
(``train``), and hybrid decode's daemon-side cost (``hybrid``)."""

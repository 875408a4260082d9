"""The dataset layouts: which bytes are a sample and its label, read in place.

One module per layout (``folder``: an ImageFolder or a file list; ``imagenet``: ImageNet's tars;
``webdataset`` with ``shardnames``: WebDataset shards; ``parquet``: Parquet as Hugging Face stores
images), each indexing from names, headers or metadata alone and reading
through one storage interface (``store``); ``archive``, ``tarheaders`` and ``tarrecheck`` are the
tar reading and identity checks the archive layouts share; ``dataset`` chooses the layout and
loads its index. Core-like: functions of files, no processes. Imports ``prefetchd.format``,
``prefetchd.core`` and itself; the client imports none of it."""

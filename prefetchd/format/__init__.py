"""The wire formats the daemon and the client share on disk: batch files (``batchfile``), compact
batches for GPU decode (``jpegbatch``), progress files (``progress``), and status, meta and lock
files (``status``). Each module's docstring is its spec. Imports nothing else of prefetchd: the
client loads these modules, so they stay free of Pillow, OpenCV and the daemon."""

"""The daemon: its main loop (``loop``) and the shell around it (the ring on disk, the progress
watcher, trainer sessions, the quarantine log, metrics, sd_notify). Imports ``format``, ``core``
and ``executors``; nothing here is imported by them."""

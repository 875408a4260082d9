"""Commands that are not the daemon: benchmarks (``bench``), the demo, the preview grid, sample
data, the deployment check. May import anything below them; nothing below imports them."""

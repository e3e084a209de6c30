"""What every pdserve process shares about itself: the metrics text format, tracing, the log
format, the `PDSERVE_*` option names, and the start-up heap's freeze."""

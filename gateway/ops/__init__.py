"""Operator endpoints: health, readiness, metrics, the cluster page, role changes, request
history, and the start-up gate."""

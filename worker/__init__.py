"""The worker process, whatever its role: `main.py` wires a role gate over a prefill half and
a decode half sharing one engine; `runtime.py` is the process lifecycle (load → register →
serve → drain → deregister)."""

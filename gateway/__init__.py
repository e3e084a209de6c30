"""The gateway process (`pdserve gateway`): `main.py` wires the wings, bottom up:

    routing/    pure policies over a snapshot of the workers
    admission/  SLO tiers, API keys, admission, capacity, shared limits
    api/        the OpenAI-compatible HTTP surface and the response writer
    upstream/   the backend: cluster view, worker clients, handoff, relay
    ops/        operator endpoints
"""

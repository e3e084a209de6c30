"""The cross-process contract: every type and format two pdserve processes exchange.

The lowest layer: it imports nothing of pdserve's and does no I/O, so every other room
(engine, KV transfer, workers, gateway, agent) can depend on it.
"""

"""The cross-process contract: every type and format two pdserve processes exchange.

Lowest layer of the tree: it imports nothing of pdserve's, so the engine, the KV transfer,
the workers and the gateway can all depend on it.
"""

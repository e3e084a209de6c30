"""The Redis key schema and its clients: the worker registry, load reports, the global
prefix index (and its mirror), and the operations agent's state. The only room that knows
the keys (docs/redis_schema.md)."""

"""The transport from the gateway and the agent to the workers' control ports: the channel
(one persistent connection per worker, streams multiplexed on it), its frames and errors,
and the worker's control app (limits, routes by message type)."""

"""The worker process: options, lifecycle (load, register, serve, drain), registry publisher,
metrics, and the engine-output-to-frame conversion both roles share."""

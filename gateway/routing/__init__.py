"""Pure policies over a snapshot of the workers: where a request runs (router, plan model)
and what a failure means (retry policy)."""

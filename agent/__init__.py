"""The operations agent: watches the cluster and ejects, restarts and rebalances workers.

Its policies are pure functions: `health_rules` (what a window of samples says about a
worker), `guard_rails` (which actions those findings lead to, and which are held back),
`rebalance` (which worker changes role) and `worker_case` (where each worker's case stands,
and what moves it). `control_loop` carries out what they decide, through `actuator`, and
records each `decision` in the `audit` trail.
"""

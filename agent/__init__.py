"""The operations agent: watches the cluster and ejects, restarts and rebalances workers.

So far its policies, as pure functions: `health_rules` (what a window of samples says about
a worker) and `guard_rails` (which actions those findings lead to, and which are held back).
"""

"""`pdserve bench`: SLO-aware load generation and goodput search for OpenAI-compatible servers.

Module map (data flows top to bottom):

    workload.py   TOML workload spec -> typed classes, length distributions, SLO targets
    corpus.py     real public-domain text cut into prompts of a target token length
    planner.py    seeded stream of concrete requests (prompt, max_tokens, tier)
    arrivals.py   seeded Poisson / gamma inter-arrival gaps (pure)
    sse_client.py one streamed request -> RequestRecord (timings, tokens, error kind)
    loadgen.py    open-loop (rate) or closed-loop (concurrency) run -> RunResult
    report.py     RunResult + SLOs -> RunReport (JSON schema, terminal table)
    goodput.py    bracketing + bisection over rate (policy is pure) -> GoodputReport
    plot.py       PNG plots (matplotlib, Agg)
    stub_server.py an OpenAI-compatible streaming server with injected latencies and faults
"""

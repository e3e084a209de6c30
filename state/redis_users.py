"""The Redis users of a cluster that `pdserve up` starts: one per role, each with its own
password and only the keys its role writes.

    user           reads                      writes
    gateway        every {ns}:* key           every {ns}:* key: it purges lapsed workers'
                                              entries and holds the replicas' shared limits
    agent          every {ns}:* key           its own keys (state/agent_state.py)
    worker-{id}    what it writes             its own entry {ns}:worker:{id}:* and the index
                                              keys every worker shares (state/redis_state.py)
    default        everything                 the launcher's own (it creates the users and
                                              shuts the server down); no child holds it

Commands: reads, writes, scripts, connection commands and TIME (the limits' scripts), nothing
@dangerous (no FLUSHALL, CONFIG, KEYS, CLIENT KILL, DEBUG, SHUTDOWN, ACL changes).

So a worker's password cannot eject a worker, hold admission slots or write another worker's
registry entry (its lease, load or epoch). What it still can, because the key schema shares
these keys among workers: add ids to `{ns}:workers` (an id without a lease is never routed
to), append to the index event stream, and write any worker's field of a `{ns}:prefix:*` hash
(prefix hits steer routing, never credentials). Closing that needs per-worker index keys.

Redis 6 has ACL users but no read-only key patterns (`%R~`, Redis 7): there the agent's reads
become read-write (`rules(read_only_patterns=False)`). A server without ACLs (Redis 5) gets
the default user's password alone (launcher/redis_server.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from state.agent_state import agent_write_patterns
from state.redis_state import namespace_pattern, worker_write_patterns

GATEWAY_USER = "gateway"
AGENT_USER = "agent"
COMMANDS = ("-@all", "+@read", "+@write", "+@scripting", "+@connection", "-@dangerous",
            "+time")


@dataclass(frozen=True, slots=True)
class RedisGrant:
    """One ACL user: its name and the glob patterns of the keys it may touch."""

    username: str
    read_write: tuple[str, ...]
    read_only: tuple[str, ...] = ()

    def rules(self, password: str, read_only_patterns: bool = True) -> list[str]:
        """The arguments of `ACL SETUSER username ...` that (re)define this user from
        scratch: on, this password only, these keys, COMMANDS, no pub/sub channels."""
        keys = [f"~{p}" for p in self.read_write]
        keys += [f"%R~{p}" if read_only_patterns else f"~{p}" for p in self.read_only]
        return ["reset", "on", f">{password}", "resetchannels", *keys, *COMMANDS]


def worker_username(worker_id: str) -> str:
    return f"worker-{worker_id}"


def cluster_grants(namespace: str, worker_ids: Iterable[str]) -> list[RedisGrant]:
    """The users of one cluster: the gateway (all its replicas), the agent and each worker."""
    everything = (namespace_pattern(namespace),)
    grants = [RedisGrant(GATEWAY_USER, everything),
              RedisGrant(AGENT_USER, tuple(agent_write_patterns(namespace)), everything)]
    grants += [RedisGrant(worker_username(w), tuple(worker_write_patterns(namespace, w)))
               for w in worker_ids]
    return grants

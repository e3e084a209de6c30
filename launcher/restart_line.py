"""The line between `pdserve up`'s supervisor and the operations agent it started: the
agent asks for a worker's restart, the supervisor does it by its own handle of the process.

    supervisor                                           agent (--supervisor-fd N)
      socketpair(AF_UNIX, SOCK_SEQPACKET): one end kept, the other inherited by the agent
      (and by every restart of it), by no other child
      answer() ◀── RestartWorkerRequest(number, worker_id, pid) ── SupervisorRestarter
               ──▶ RestartWorkerResponse(number, status, outcome) ──▶

Why a line and not a pid: the agent learns of workers from the Redis registry, which a
process that can reach Redis may write. A restart asked for here names a worker id; the
supervisor looks it up among the workers *it started* and signals that child through its
own Popen handle, or refuses. A registry entry naming the gateway's pid, Redis's, the
agent's or any other process (or an id such as `gateway`) can therefore kill nothing.
Given a pid (from the worker's bound registry entry), the supervisor kills only when it is
the child's current process: a request about an incarnation that was restarted meanwhile
kills nothing (GONE).

`answer` never blocks: the supervisor's loop calls it every tick (0.2 s). While the
cluster starts (`allow=False`) every request is refused: a kill then would end start-up.

Lifecycle: open (socketpair) → answer()* → close(). Invariant: only the supervisor and the
agent hold the line's descriptors (the supervisor passes `agent_fd` to the agent alone;
Popen closes every other descriptor in its children).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from launcher.supervisor import Child, Supervisor
from protocol.agent_messages import RestartStatus, RestartWorkerRequest, RestartWorkerResponse
from protocol.messages import MessageDecoder, ProtocolError, encode

MAX_REQUEST_BYTES = 4096
MAX_REQUESTS_PER_ANSWER = 64  # a flood waits for the next tick rather than stall the loop


class RestartLine:
    def __init__(self) -> None:
        self._mine, self._agents = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._mine.setblocking(False)
        self._requests: MessageDecoder[RestartWorkerRequest] = MessageDecoder(
            RestartWorkerRequest, MAX_REQUEST_BYTES)

    @property
    def agent_fd(self) -> int:
        """The agent's end: passed to the agent process (and its restarts) only."""
        return self._agents.fileno()

    def answer(self, supervisor: Supervisor, workers: Mapping[str, Child],
               allow: bool) -> list[str]:
        """Answer every request waiting (up to a bound); `workers`: the worker children by
        worker id. Returns one line per request, for the supervisor's output."""
        said = []
        for _ in range(MAX_REQUESTS_PER_ANSWER):
            try:
                data = self._mine.recv(MAX_REQUEST_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            try:
                request = self._requests.decode(data)
            except ProtocolError as exc:
                said.append(f"agent: a restart request that does not decode: {exc}")
                continue
            status, outcome = decide(request, supervisor, workers, allow)
            said.append(f"agent: restart of {request.worker_id}: {outcome}")
            reply = RestartWorkerResponse(number=request.number, status=status,
                                          outcome=outcome[:1000])
            try:
                self._mine.send(encode(reply))
            except (BlockingIOError, InterruptedError, ConnectionError):
                pass  # the agent is gone or not reading: it times out on its own
        return said

    def close(self) -> None:
        self._mine.close()
        self._agents.close()


def decide(request: RestartWorkerRequest, supervisor: Supervisor, workers: Mapping[str, Child],
           allow: bool) -> tuple[RestartStatus, str]:
    """What to do with one request, and do it; the kill goes through `supervisor`."""
    child = workers.get(request.worker_id)
    if child is None:
        return RestartStatus.REFUSED, (f"refused: {request.worker_id!r} is no worker this "
                                       f"supervisor started; nothing killed")
    if not allow:
        return RestartStatus.REFUSED, "refused: the cluster is still starting"
    if child.returncode() is not None:
        return RestartStatus.GONE, f"{child.name} exited already: its supervisor restarts it"
    if request.pid and request.pid != child.pid:
        return RestartStatus.GONE, (f"pid {request.pid} is not {child.name}'s process (pid "
                                    f"{child.pid}): restarted since; nothing killed")
    pid = child.pid
    if not supervisor.kill(child):
        return RestartStatus.GONE, f"{child.name} exited meanwhile: its supervisor restarts it"
    return RestartStatus.KILLED, (f"killed pid {pid} ({child.name}, SIGKILL by its "
                                  f"supervisor): it starts again")

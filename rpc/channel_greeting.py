"""The channel's greeting at both ends, without I/O: who proves what, in which order.

    caller (CallerGreeting)                          worker (WorkerGreeting)
      hello() ── ChannelHello(nonce_c) ─────────────▶ challenge(hello)
              ◀─ ChannelChallenge(nonce_w, proof_w) ─
      answer(challenge): proof_w checked first;
        wrong or missing → PeerUnverifiedError,
        and nothing more is sent
              ── ChannelProof(proof_c) ─────────────▶ admits(proof): else UNAUTHORIZED
              ◀─ ChannelWelcome ─────────────────────

The MACs are protocol/cluster_secret.py's (the channel key, never the token); why the worker
proves first, and for the endpoint the caller dialled, is in rpc/channel_wire.py. A side
without a key proves nothing and takes the other on trust.

Lifecycle (each greeting is used for one connection): fresh → (caller) answered, or
(worker) challenged → done. Invariant: a CallerGreeting hands out its proof only after the
worker's proof verified; a WorkerGreeting admits only after it sent its own challenge.
"""

from __future__ import annotations

import secrets

from protocol.cluster_secret import NONCE_BYTES, ProofSide, channel_proof, proof_matches
from protocol.messages import encode
from rpc.channel_wire import ChannelChallenge, ChannelHello, ChannelProof
from rpc.errors import PeerUnverifiedError


class CallerGreeting:
    def __init__(self, key: bytes | None, dialled: str) -> None:
        """`key`: the cluster's channel key (None: no token); `dialled`: host:port dialled,
        which the worker's proof must name."""
        self.key = key
        self.dialled = dialled
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.answered = False

    def hello(self) -> bytes:
        return encode(ChannelHello(nonce=self.nonce))

    def answer(self, challenge: ChannelChallenge) -> bytes:
        """The caller's proof, once the worker's checked out; raises PeerUnverifiedError."""
        nonces = self.nonce, challenge.nonce
        if self.key is None:
            proof = None
        elif proof_matches(challenge.proof, self.key, ProofSide.WORKER, self.dialled, *nonces):
            proof = channel_proof(self.key, ProofSide.CALLER, self.dialled, *nonces)
        else:
            raise PeerUnverifiedError(
                f"the peer did not prove it holds this cluster's internal token for "
                f"{self.dialled} (not this cluster's worker, or a wrong token here): nothing "
                f"was sent to it")
        self.answered = True
        return encode(ChannelProof(proof=proof))


class WorkerGreeting:
    def __init__(self, key: bytes | None, served_endpoint: str) -> None:
        """`key`: the cluster's channel key (None: no token); `served_endpoint`: host:port
        of the control URL this worker registered."""
        self.key = key
        self.endpoint = served_endpoint
        self.nonces: tuple[bytes, bytes] | None = None  # (caller's, ours) once challenged

    @property
    def challenged(self) -> bool:
        return self.nonces is not None

    def challenge(self, hello: ChannelHello) -> bytes:
        self.nonces = nonces = hello.nonce, secrets.token_bytes(NONCE_BYTES)
        proof = None if self.key is None else channel_proof(
            self.key, ProofSide.WORKER, self.endpoint, *nonces)
        return encode(ChannelChallenge(nonce=nonces[1], proof=proof))

    def admits(self, proof: ChannelProof) -> bool:
        if self.nonces is None:
            return False
        return self.key is None or proof_matches(proof.proof, self.key, ProofSide.CALLER,
                                                 self.endpoint, *self.nonces)

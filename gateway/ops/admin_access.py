"""Who may call the gateway's /admin endpoints: a pure verdict over one request's facts.

Two credentials, sent as `Authorization: Bearer <credential>`:

- the cluster's **admin token** (`--admin-token`, or `PDSERVE_ADMIN_TOKEN`; `pdserve up`
  generates one and writes it to LOG_DIR/admin-token, mode 0600). It is not the internal
  token: that one is held by every worker and the agent and opens the workers' control
  ports; the admin token is held by the gateways and the operator only, and opens nothing
  but /admin.
- an API key with `admin = true`, where the tiers file or PDSERVE_API_KEYS configures keys.

What each call needs:

                         no API keys configured                keys configured
    READ    (GET views)  nothing, on a gateway that listens    an admin key or the
                         on loopback only, asked by a loopback  admin token
                         Host name; else the admin token
    CHANGE  (role        the admin token (no token configured:  an admin key or the
             changes)    403, changes are off)                  admin token

and on every /admin call: an `Origin` header (what a browser sends with a cross-site
request; curl sends none) must name the gateway itself, the host and port the request's
Host names (403 otherwise); a CHANGE must be `Content-Type: application/json` (415 otherwise: a
browser cannot send that cross-site without a preflight this gateway never grants).
The Host check of an open READ refuses a page whose own name resolves to 127.0.0.1 (DNS
rebinding): its requests carry that name, not a loopback one. Checked in that order:
Origin, credential, Content-Type.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.admission.tiers import TierConfig, TierError, resolve
from gateway.api.errors import ApiError


class AdminCall(enum.Enum):
    READ = "read"  # a view: workers, cluster, state, agent events
    CHANGE = "change"  # changes the cluster: a role change


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """The gateway's side: its admin token and whether it listens on loopback only."""

    admin_token: str | None
    loopback_only: bool

    @classmethod
    def for_host(cls, admin_token: str | None, host: str) -> AdminAccess:
        return cls(admin_token or None, is_loopback(host))


@dataclass(frozen=True, slots=True)
class AdminRequest:
    """What the verdict reads of one request."""

    credential: str | None  # the bearer token
    host: str | None  # the Host header
    origin: str | None  # the Origin header
    content_type: str  # without parameters


def is_loopback(host: str) -> bool:
    """A name or address of this host's loopback interface (brackets and a port allowed)."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_foreign_origin(origin: str | None, host: str | None) -> bool:
    """Does `origin` name a site other than the one the request addresses (its host and
    port; not its scheme, which a TLS proxy in front of the gateway changes)?"""
    if origin is None:
        return False  # not a browser's cross-site request (curl, the SDKs)
    parts = urlsplit(origin.strip().lower())
    return host is None or not parts.scheme or parts.netloc != host.strip().lower() \
        or parts.path not in ("", "/")


def admin_refusal(call: AdminCall, request: AdminRequest, access: AdminAccess,
                  tiers: TierConfig) -> ApiError | None:
    """Why the request may not make `call` (the error to answer), or None; side-effect
    free."""
    if is_foreign_origin(request.origin, request.host):
        return ApiError(403, "Cross-site requests to /admin are refused (the Origin header "
                             "names another site).", code="foreign_origin")
    refusal = _credential_refusal(call, request, access, tiers)
    if refusal is not None:
        return refusal
    if call is AdminCall.CHANGE and request.content_type != "application/json":
        return ApiError(415, f"Content-Type must be application/json, got "
                             f"{request.content_type!r}.", code="unsupported_media_type")
    return None


def _credential_refusal(call: AdminCall, request: AdminRequest, access: AdminAccess,
                        tiers: TierConfig) -> ApiError | None:
    credential, token = request.credential, access.admin_token
    if token and credential and hmac.compare_digest(credential.encode(), token.encode()):
        return None
    if not tiers.is_open:
        caller = resolve(credential, None, tiers)
        if isinstance(caller, TierError):
            return ApiError(caller.kind.status, caller.message, code=caller.kind.value)
        if not caller.is_admin:
            return ApiError(403, "This API key may not call /admin endpoints.",
                            code="not_admin")
        return None
    if call is AdminCall.READ and access.loopback_only and \
            (request.host is None or is_loopback(request.host)):
        return None
    if token is None:
        what = "Changes to the cluster" if call is AdminCall.CHANGE else \
            "The /admin views of a gateway that listens beyond loopback"
        return ApiError(403, f"{what} need the cluster's admin token, and this gateway has "
                             "none: set PDSERVE_ADMIN_TOKEN (or an admin API key).",
                        code="admin_disabled")
    if credential is None:
        return ApiError(401, "This endpoint needs the cluster's admin token "
                             "(Authorization: Bearer <token>; `pdserve up` writes it to "
                             "LOG_DIR/admin-token).", code="missing_admin_token")
    return ApiError(401, "Incorrect admin token provided.", code="invalid_admin_token")

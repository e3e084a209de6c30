"""Who may call /admin: the pure verdict of gateway/ops/admin_access.py, case by case."""

from __future__ import annotations

import pytest

from gateway.admission.tiers import load_tier_config
from gateway.ops.admin_access import (AdminAccess, AdminCall, AdminRequest, admin_refusal,
                                      is_foreign_origin, is_loopback)

TOKEN = "admin-token-0123456789abcdef"
OPEN = load_tier_config(None, {})
KEYED = load_tier_config(None, {"PDSERVE_API_KEYS": "sk-admin:standard:admin,sk-user:standard"})
LOOPBACK = AdminAccess(admin_token=TOKEN, loopback_only=True)
EXPOSED = AdminAccess(admin_token=TOKEN, loopback_only=False)
NO_TOKEN = AdminAccess(admin_token=None, loopback_only=True)
READ, CHANGE = AdminCall.READ, AdminCall.CHANGE
HOST = "127.0.0.1:8000"


def ask(credential=None, host=HOST, origin=None, content_type="application/json"
        ) -> AdminRequest:
    return AdminRequest(credential=credential, host=host, origin=origin,
                        content_type=content_type)


def status(call, request, access=LOOPBACK, tiers=OPEN) -> int | None:
    refusal = admin_refusal(call, request, access, tiers)
    return None if refusal is None else refusal.status


@pytest.mark.parametrize("call, request_, access, tiers, expected", [
    # Views: open on a loopback-only gateway without keys, asked by a loopback name ...
    (READ, ask(), LOOPBACK, OPEN, None),
    (READ, ask(host="localhost:8000"), NO_TOKEN, OPEN, None),
    (READ, ask(host="[::1]:8000"), LOOPBACK, OPEN, None),
    (READ, ask(host=None), LOOPBACK, OPEN, None),  # HTTP/1.0 without Host: no browser
    # ... not by another name resolving to it (DNS rebinding), nor beyond loopback.
    (READ, ask(host="evil.example:8000"), LOOPBACK, OPEN, 401),
    (READ, ask(host="evil.example:8000"), NO_TOKEN, OPEN, 403),
    (READ, ask(), EXPOSED, OPEN, 401),
    (READ, ask("wrong"), EXPOSED, OPEN, 401),
    (READ, ask(TOKEN), EXPOSED, OPEN, None),
    # Changes: the admin token, always.
    (CHANGE, ask(), LOOPBACK, OPEN, 401),
    (CHANGE, ask("wrong"), LOOPBACK, OPEN, 401),
    (CHANGE, ask(TOKEN), LOOPBACK, OPEN, None),
    (CHANGE, ask(TOKEN), EXPOSED, OPEN, None),
    (CHANGE, ask("anything"), NO_TOKEN, OPEN, 403),  # no token configured: changes are off
    (CHANGE, ask(TOKEN, content_type="text/plain"), LOOPBACK, OPEN, 415),
    (CHANGE, ask(TOKEN, content_type="application/x-www-form-urlencoded"), LOOPBACK, OPEN, 415),
    (CHANGE, ask(TOKEN, origin="http://evil.example"), LOOPBACK, OPEN, 403),
    (CHANGE, ask(TOKEN, origin="null"), LOOPBACK, OPEN, 403),
    (CHANGE, ask(TOKEN, origin="http://127.0.0.1:9999"), LOOPBACK, OPEN, 403),
    (CHANGE, ask(TOKEN, origin="http://127.0.0.1:8000"), LOOPBACK, OPEN, None),  # its own page
    (CHANGE, ask(TOKEN, origin="https://127.0.0.1:8000"), LOOPBACK, OPEN, None),  # TLS proxy
    (READ, ask(origin="http://evil.example"), LOOPBACK, OPEN, 403),
    # The Origin is judged first, the credential next, the Content-Type last.
    (CHANGE, ask(origin="http://evil.example", content_type="text/plain"), LOOPBACK, OPEN, 403),
    (CHANGE, ask(content_type="text/plain"), LOOPBACK, OPEN, 401),
    # With API keys: an admin key or the admin token, for views and changes alike.
    (READ, ask(), LOOPBACK, KEYED, 401),
    (READ, ask("sk-user"), LOOPBACK, KEYED, 403),
    (READ, ask("sk-admin"), LOOPBACK, KEYED, None),
    (CHANGE, ask("sk-admin"), NO_TOKEN, KEYED, None),
    (CHANGE, ask("sk-user"), LOOPBACK, KEYED, 403),
    (CHANGE, ask(TOKEN), LOOPBACK, KEYED, None),
    (CHANGE, ask("sk-admin", content_type="text/plain"), LOOPBACK, KEYED, 415),
])
def test_who_may_call_admin(call, request_, access, tiers, expected) -> None:
    assert status(call, request_, access, tiers) == expected


def test_refusals_say_what_is_missing() -> None:
    missing = admin_refusal(CHANGE, ask(), LOOPBACK, OPEN)
    assert missing.code == "missing_admin_token" and "admin-token" in missing.message
    assert admin_refusal(CHANGE, ask("x"), NO_TOKEN, OPEN).code == "admin_disabled"
    assert admin_refusal(CHANGE, ask(TOKEN, origin="http://a.b"), LOOPBACK,
                         OPEN).code == "foreign_origin"
    assert admin_refusal(CHANGE, ask(TOKEN, content_type="text/plain"), LOOPBACK,
                         OPEN).code == "unsupported_media_type"


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", True), ("127.0.0.1:8000", True), ("127.1.2.3", True), ("localhost", True),
    ("LOCALHOST:80", True), ("::1", True), ("[::1]:8000", True), ("a.localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False),
    ("example.com", False), ("127.0.0.1.nip.io", False), ("[::ffff:10.0.0.1]:80", False),
])
def test_loopback_names(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_an_origin_is_foreign_unless_it_names_the_requests_host() -> None:
    assert not is_foreign_origin(None, HOST)
    assert not is_foreign_origin("http://127.0.0.1:8000", HOST)
    assert is_foreign_origin("http://127.0.0.1:8000", None)
    assert is_foreign_origin("http://127.0.0.1:8000/x", HOST)
    assert is_foreign_origin("127.0.0.1:8000", HOST)  # not an origin at all

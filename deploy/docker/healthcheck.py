#!/usr/bin/env python3
"""Container health check: exit 0 when the process in this container answers /ready with 200.

Usage: pdserve-healthcheck [PATH]   (PATH defaults to /ready; /health checks liveness only)

The URL is the one the process serves on, from the same variables it reads:
PDSERVE_HOST (`container-ip` resolves as in entrypoint.sh; a wildcard or unset host is
checked on loopback) and PDSERVE_PORT (default 8000, the gateway's). PDSERVE_HEALTH_URL,
when set, replaces the base URL. With PDSERVE_INTERNAL_TOKEN set, the request carries it, since
a worker's control server may demand the token on every path. Standard library only: it runs before anything else is known
to work, and must finish well inside Docker's health-check timeout.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.0


def base_url(env: dict[str, str]) -> str:
    if env.get("PDSERVE_HEALTH_URL"):
        return env["PDSERVE_HEALTH_URL"].rstrip("/")
    host = env.get("PDSERVE_HOST", "") or "127.0.0.1"
    if host == "container-ip":
        host = socket.gethostbyname(socket.gethostname())
    elif host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{env.get('PDSERVE_PORT', '') or '8000'}"


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    url = base_url(env) + (argv[1] if len(argv) > 1 else "/ready")
    request = urllib.request.Request(url)
    if env.get("PDSERVE_INTERNAL_TOKEN"):
        request.add_header("Authorization", f"Bearer {env['PDSERVE_INTERNAL_TOKEN']}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"pdserve-healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""A real Prometheus server (Debian's `prometheus` package) for the tests: scrapes the given
targets every second and answers PromQL over its HTTP API.

Prometheus cannot be told to pick its own port, so a free one is found by binding port 0
and the server is retried on another port if it loses that race.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from up_process import terminate

PACKAGE_HINT = ("Prometheus is not installed: `apt-get install prometheus` (Debian's package; "
                ".ci/run and `make test` install it when run as root)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """Scrapes `jobs` ({job name: ["host:port", ...]}) every second."""

    def __init__(self, jobs: dict[str, list[str]], work_dir: Path,
                 start_timeout_s: float = 60.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(PACKAGE_HINT)
        config = work_dir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()]}))
        self.log_path = work_dir / "prometheus.log"
        for _ in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
                     f"--storage.tsdb.path={work_dir / 'data'}"],
                    stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(start_timeout_s):
                return
            self.stop()
        raise RuntimeError(f"prometheus did not start:\n{self.log_path.read_text()[-4000:]}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at_unix_s: float) -> list[dict]:
        """An instant query's result vector at `at_unix_s` (raises on a PromQL error)."""
        data = self.api("query", query=expr, time=f"{at_unix_s:.3f}")
        assert data["resultType"] == "vector", data
        return data["result"]

    def targets_up(self) -> dict[str, str]:
        """{scrape URL: health} of the active targets."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def stop(self) -> None:
        terminate(self.process)

"""Times GET /health in a process of its own, so what it measures is the gateway's event
loop and not the GIL of the test that loads it.

    python health_probe.py URL      prints "ready" once /health answers, then on each
                                    "go" line probes back to back (a 5 ms pause between
                                    two) until a "stop" line, and answers with one JSON
                                    line: every latency in seconds; "quit" ends it.

`HealthProbe` runs it from a test.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

PAUSE_S = 0.005


class HealthProbe:
    def __init__(self, url: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__)), url],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def _say(self, word: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()

    def start(self) -> None:
        self._say("go")

    def stop(self) -> list[float]:
        """The latencies since start(), in seconds."""
        self._say("stop")
        return json.loads(self._line())

    def close(self) -> None:
        self._say("quit")
        self.process.wait(10)


def main(url: str) -> None:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)

    def probe() -> float:
        started = time.perf_counter()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        return time.perf_counter() - started

    probe()
    print("ready", flush=True)
    for command in sys.stdin:
        if command.strip() != "go":
            break
        stop = threading.Event()
        reader = threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()),
                                  daemon=True)
        reader.start()
        latencies = []
        while not stop.is_set():
            latencies.append(probe())
            time.sleep(PAUSE_S)
        print(json.dumps(latencies), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

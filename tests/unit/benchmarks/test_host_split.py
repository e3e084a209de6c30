"""benchmarks/host_split.py: phases timed on one engine's objects, then put back."""

from __future__ import annotations

import time

from benchmarks.host_split import PHASES, REPLAY, HostSplit


class Part:
    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s

    def call(self, value: int) -> int:
        time.sleep(self.pause_s)
        return value + 1

    schedule = execute = launch = update_from_output = call


class Engine:
    def __init__(self) -> None:
        self.scheduler, self.runner, self.sampler = Part(0.002), Part(0.0), Part(0.0)

    def _resolve(self, value: int) -> int:
        return value * 2


def test_phases_are_timed_and_the_wrappers_go_away() -> None:
    engine, other = Engine(), Engine()
    split = HostSplit(engine)
    assert engine.scheduler.schedule(1) == 2 and engine._resolve(3) == 6  # same results
    other.scheduler.schedule(1)  # another instance is not timed
    ms = split.per_step_ms(1)
    assert list(ms) == [*PHASES, REPLAY] and ms[REPLAY] == 0.0  # no graphs here
    assert ms["scheduler.schedule"] >= 2.0 and ms["runner.execute"] == 0.0
    assert 0 < ms["_resolve"] < ms["scheduler.schedule"]
    split.close()
    assert "schedule" not in vars(engine.scheduler) and "_resolve" not in vars(engine)
    assert engine.scheduler.schedule(1) == 2


class Graph:
    def __init__(self, pause_s: float = 0.001) -> None:
        self.pause_s = pause_s

    def replay(self) -> None:
        time.sleep(self.pause_s)


class Graphs:
    def __init__(self, *graphs: Graph) -> None:
        self.graphs = list(graphs)

    def captured_graphs(self) -> list[Graph]:
        return self.graphs


def test_the_replays_of_captured_graphs_are_timed_and_put_back() -> None:
    engine = Engine()
    decode, mixed = Graph(), Graph()
    engine.runner.graphs, engine.runner.mixed_graphs = Graphs(decode), Graphs(mixed)
    split = HostSplit(engine)
    decode.replay()
    mixed.replay()
    Graph(0.1).replay()  # not one of this engine's: its 100 ms are not counted
    ms = split.per_step_ms(2)
    assert 1.0 <= ms[REPLAY] < 50.0
    split.close()
    assert "replay" not in vars(decode) and "replay" not in vars(mixed)

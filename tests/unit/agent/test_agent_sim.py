"""The rebalancer on the simulated cluster (benchmarks/agent_sim.py): its targets hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.rebalance import RebalanceConfig
from benchmarks.agent_sim import RunResult, arg_parser, main, scenarios, simulate
from benchmarks.agent_sim_cluster import Hardware, Scenario, Simulation, Traffic

CFG, HW = RebalanceConfig(), Hardware()
CHAT = Traffic("chat", 10.0, 200, 300)
LONG_DOC = Traffic("long-doc", 3.2, 6000, 50)


def run(name: str, seed: int = 1, rebalancer: bool = True) -> RunResult:
    args = arg_parser().parse_args(["--seed", str(seed)])
    runs = {(s.name, on): s for s, on in scenarios({"shift", "steady", "failure"}, args)}
    return simulate(runs[name, rebalancer], rebalancer, HW, CFG, 10.0, 1.0, seed)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_shift_to_long_documents_moves_a_decode_worker_to_prefill_within_60_s(
        seed: int) -> None:
    on, off = run("shift", seed), run("shift", seed, rebalancer=False)
    assert on.split_start == (2, 4) and on.split_end == (3, 3)
    first = on.first_move_after_shift_s
    assert first is not None and first + HW.drain_s <= 60 and on.met
    _, move = on.moves[0]
    assert (move.from_role, move.to_role) == ("decode", "prefill")
    assert "prefill queue delay" in move.reason
    # No move in the chat phase, and the long documents wait far less for their prefill.
    assert all(t >= 120 for t, _ in on.moves)
    assert off.moves == () and off.split_end == (2, 4)
    assert on.phases["long-doc"].ttft_p90_s < off.phases["long-doc"].ttft_p90_s / 2
    assert on.phases["long-doc"].num_done == on.phases["long-doc"].num_requests


def test_steady_load_changes_no_role_over_600_s() -> None:
    chat = run("steady-chat")
    assert chat.moves == () and chat.met and chat.split_end == (2, 4)
    assert chat.phases["chat"].num_requests > 5000  # 600 s at 10 requests/s
    long_doc = run("steady-long-doc")
    assert long_doc.moves == () and long_doc.split_end == (3, 3)


def test_a_dead_prefill_worker_is_replaced_and_the_split_stays_sane() -> None:
    result = run("failure")
    assert result.min_routable >= 1 and result.num_reversals == 0 and result.met
    assert [(m.from_role, m.to_role) for _, m in result.moves] == [("decode", "prefill")]
    assert 60 < result.moves[0][0] < 180  # while w-0 was out
    assert result.split_end == (4, 2)  # w-0 came back as a prefill worker


def test_results_are_deterministic_for_a_seed() -> None:
    assert run("shift", seed=3) == run("shift", seed=3)
    assert run("shift", seed=3).phases != run("shift", seed=4).phases


def test_the_simulated_cluster_keeps_its_invariants() -> None:
    # Two workers die, one of them the only prefill worker: its requests wait for it.
    scenario = Scenario("two-die", ((CHAT, 20.0), (LONG_DOC, 40.0)), 4, 1,
                        ((0, 10.0, 25.0), (3, 15.0, 45.0)))
    sim = Simulation(scenario, HW, CFG, 10.0, 1.0, seed=5).run(check=True)
    assert all(r.done_s is not None for r in sim.requests)
    assert all(w.alive and w.routable for w in sim.workers)


def test_the_command_prints_the_table_and_writes_json(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["--scenario", "failure", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "| failure | on | 3+3 → 4+2 | 1 | 0 |" in printed.out
    assert ">> failure, rebalancer on" in printed.err
    (figures,) = json.loads(out.read_text())
    assert figures["scenario"] == "failure" and figures["met"] is True
    with pytest.raises(SystemExit):
        main(["--scenario", "nonsense"])

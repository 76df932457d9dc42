"""The engine bench's transport floor: the empty-exchange measurement and how a task's
counted calls become exchanges (the figures behind its "tasks/s the cores allow" column)."""

from __future__ import annotations

import pytest

from bench import engine as engine_bench
from bench.engine import exchanges_per_task
from bench.transport import KINDS, STREAMS, measure_transport


def test_transport_measures_both_ends_of_every_kind() -> None:
    measured = measure_transport(calls=64)
    for kind in KINDS:
        ends = measured[kind]
        assert ends["client_cpu_ms"] > 0 and ends["server_cpu_ms"] > 0
        assert ends["both_cpu_ms"] == round(ends["client_cpu_ms"] + ends["server_cpu_ms"], 4)
        assert ends["wall_p50_ms"] > 0
    assert [measured[kind]["in_flight"] for kind in KINDS] == [1, 1, STREAMS]


def test_a_tasks_calls_become_exchanges() -> None:
    counted = {
        "engine SubmitEvent": 10,
        "storage CreateTask": 10,
        "storage ClaimTasks": 2,
        "storage Multiplex/RecordStep": 20,
        "storage Multiplex/Commit": 10,
        "gateway Multiplex/CallGameTool": 20,
        "engine Multiplex/SubmitEvent": 10,
    }
    per_task = exchanges_per_task(counted, tasks=10)
    assert per_task["unary_per_task"] == 2.2  # SubmitEvent, CreateTask, a share of a claim
    # SubmitEvent, 3 journal calls, 2 relayed ones, 2 to the game
    assert per_task["stream_per_task"] == 8.0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--replicas", "2,2"),  # run against the database its first run filled: no gives come
        ("--replicas", "0"),
        ("--replicas", "1,x"),
        ("--replicas", ","),
        ("--rounds", "0"),
        ("--rounds", "11"),
        ("--tasks", "0"),
        ("--tasks", "10000"),  # past MAX_TASKS: a player each, joined before the clock starts
    ],
)
def test_settings_that_cannot_run_are_refused_before_anything_starts(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        engine_bench.main([option, value, "--backends", "postgres"])
    assert exited.value.code == 2
    assert option in capsys.readouterr().err


def test_the_median_pair_is_reported_whole() -> None:
    rounds = [
        {"tasks_per_s": 240.0, "over_dbos": 1.58},
        {"tasks_per_s": 217.0, "over_dbos": 1.33},
        {"tasks_per_s": 236.0, "over_dbos": 1.65},
    ]
    assert engine_bench._median_round(rounds) is rounds[0]
    # An even number: the lower of the two middle pairs (no figure made up between them).
    assert engine_bench._median_round(rounds[1:]) is rounds[1]
    assert engine_bench._median_round(rounds[:1]) is rounds[0]


def test_each_round_is_judged_against_the_floor_measured_with_it() -> None:
    def transport(stream_ms: float) -> dict[str, dict[str, float]]:
        return {
            "unary": {"both_cpu_ms": 0.5},
            "stream": {"both_cpu_ms": stream_ms},
            "streams": {"both_cpu_ms": stream_ms / 2},
        }

    def run(tasks_per_s: float) -> dict[str, object]:
        return {
            "tasks_per_s": tasks_per_s,
            "exchanges": {"unary_per_task": 0.0, "stream_per_task": 10.0},
            "cpu_ms_per_task": {"postgres": 1.0},
        }

    slow, fast, alone = run(200.0), run(200.0), run(100.0)
    slow["transport"], fast["transport"] = transport(0.3), transport(0.1)
    results = {
        "postgres": {"rounds": [slow, fast], "events_2_replicas": fast, "events_1_replicas": alone}
    }
    engine_bench._add_floors(results, transport(0.2), cores=2)
    # 10 stream exchanges at the round's own cost plus 1 ms of database, over two cores.
    assert slow["floor"]["tasks_per_s_at_floor"] == 500.0 and slow["of_floor"] == 0.4
    assert fast["floor"]["tasks_per_s_at_floor"] == 1000.0 and fast["of_floor"] == 0.2
    # A run that is no round is judged against the floor measured at the start.
    assert alone["floor"]["tasks_per_s_at_floor"] == round(2000 / 3.0, 1)


def test_the_targets_are_read_on_the_round_measured_beside_dbos() -> None:
    dbos = {"workflows_per_s": 100.0}
    paired = {
        "tasks_per_s": 210.0,
        "over_dbos": 2.1,
        "of_floor": 0.61,
        "of_loaded_floor": 0.3,
        "dbos": dbos,
    }
    # One replica, measured before the rounds on a faster moment of the machine: more tasks/s,
    # but no DBOS beside it.
    alone = {"tasks_per_s": 230.0, "of_floor": 0.55, "of_loaded_floor": 0.28}
    peers = engine_bench._peers({"events_1_replicas": alone, "events_2_replicas": paired})
    assert peers is not None
    assert peers["ours_over_dbos"]["run"] == "events_2_replicas"
    assert peers["ours_over_dbos"]["value"] == 2.1 and peers["ours_over_dbos"]["met"]
    assert peers["ours_of_floor"]["value"] == 0.61 and peers["ours_of_floor"]["met"]
    assert alone["over_dbos"] == 2.3  # shown beside it, against the same DBOS


def test_the_loaded_floor_prices_stream_exchanges_as_measured_in_flight_together() -> None:
    run = {
        "tasks_per_s": 200.0,
        "exchanges": {"unary_per_task": 0.0, "stream_per_task": 10.0},
        "cpu_ms_per_task": {"postgres": 1.0},
        "transport": {
            "unary": {"both_cpu_ms": 0.5},
            "stream": {"both_cpu_ms": 0.3},
            "streams": {"both_cpu_ms": 0.1},
        },
    }
    engine_bench._add_floors({"postgres": {"rounds": [run], "events_2_replicas": run}}, {}, 2)
    # One in flight: 10 x 0.3 + 1 ms; together: 10 x 0.1 + 1 ms, over two cores.
    assert run["floor"]["tasks_per_s_at_floor"] == 500.0 and run["of_floor"] == 0.4
    assert run["floor"]["tasks_per_s_at_loaded_floor"] == 1000.0
    assert run["of_loaded_floor"] == 0.2
    run["dbos"], run["over_dbos"] = {"workflows_per_s": 100.0}, 2.0
    peers = engine_bench._peers({"events_2_replicas": run})
    assert peers is not None and peers["ours_of_loaded_floor"] == {
        "run": "events_2_replicas",
        "value": 0.2,
        "target_at_least": engine_bench.OF_FLOOR_TARGET,
        "met": False,
    }

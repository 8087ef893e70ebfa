"""A soak with faults (petite_llm.bench.soak) against a real server on 127.0.0.1: for a bounded
time, Poisson arrivals of whole, streamed and slowly read requests, among clients that hang up
mid-stream, send bad input or time out. Then every well-formed request must have got exactly its
lone greedy answer (float32), /metrics must show nothing running or waiting and an empty KV pool,
the block manager's invariants must hold with no sequence left, the process's memory must be flat
after the warm-up (within 64 MiB: the server and this client share the process), and the server
must still answer.

The short form (15 s) runs with every test run; the long form (180 s) is marked slow. Its figures
are printed (pytest -s shows them)."""
import asyncio
import json

import pytest

from petite_llm.bench.serving import make_load
from petite_llm.bench.soak import FAULTS, soak, soak_report
from petite_llm.engine.paging import check_block_accounting
from test_server_http import NAME
from test_server_limits import served_engine

pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    "(base URL, AsyncLLMEngine): a float32 tiny Qwen3 behind build_app's default limits."
    yield from served_engine(tmp_path_factory.mktemp("qwen3_soak"))


def soak_for(served, seconds: float) -> dict:
    "Soak the server for `seconds`; its report, once the block manager has been checked."
    base, engine = served
    load = make_load(engine.engine.tokenizer, 8, 4, 24, seed=1, out_min=4, out_max=24)
    run = asyncio.run(asyncio.wait_for(soak(base, NAME, load, seconds, rate=6.0, seed=1),
                                       seconds + 300))
    check_block_accounting(engine.engine.block_manager, [])
    report = soak_report(run)
    print(json.dumps(report, indent=1))
    return report


def check(report: dict):
    assert report["problems"] == []
    assert report["served"] == report["well_formed"] > 0
    assert all(report["faults"][kind] > 0 for kind in FAULTS), report["faults"]
    ends = report["fault_ends"]
    assert ends.get("refused 400", 0) + ends.get("refused 413", 0) == report["faults"]["bad"]
    assert report["metrics_after"] == {"num_requests_running": 0, "num_requests_waiting": 0,
                                       "kv_cache_usage_perc": 0}


def test_a_short_soak_with_faults(served):
    check(soak_for(served, 15))


@pytest.mark.slow
def test_a_long_soak_with_faults(served):
    check(soak_for(served, 180))

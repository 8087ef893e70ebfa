"""`petite-llm bench serve` (petite_llm.bench.serving): the workload, the arithmetic of the figures,
the server subprocesses, and a whole run that starts and stops its own server.

No timing is asserted: only counts, token totals, and that latencies are positive and ordered. The
servers run on 127.0.0.1, on free ports, and are stopped by the code under test; the load generator
against an already running server is tested in test_server_http.py."""
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from petite_llm.bench.serving import (RequestResult, ServerFailed, exact_length_body, free_port,
                                    latency_stats, make_load, poisson_arrivals, running_server,
                                    serve_ratios, server_command, summarize)
from petite_llm.cli.main import main
from petite_llm.model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_tokenizer import qwen3_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="module")
def qwen3():
    return Tokenizer.from_pretrained(qwen3_tokenizer_dir())


def test_prompts_are_words_of_one_token_each(qwen3):
    load = make_load(qwen3, 30, 5, 40, seed=7, out_min=2, out_max=9)
    assert load == make_load(qwen3, 30, 5, 40, seed=7, out_min=2, out_max=9)   # seeded
    for r in load:
        words = r.prompt.split(" ")[1:]                  # each word comes with its space
        assert 5 <= len(words) <= 40 and 2 <= r.max_tokens <= 9
        assert len(qwen3.encode(r.prompt)) == len(words) == r.prompt_tokens
    assert len({r.prompt_tokens for r in load}) > 5      # the lengths do vary
    with pytest.raises(ValueError, match="min_len <= max_len"):
        make_load(qwen3, 3, 10, 5)


def test_poisson_arrivals():
    arrivals = poisson_arrivals(5000, rate=10.0, seed=1)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and (gaps >= 0).all()
    # exponential gaps: the standard deviation is the mean
    assert abs(gaps.mean() - 0.1) < 0.01 and abs(gaps.std() - 0.1) < 0.01
    assert arrivals == poisson_arrivals(5000, rate=10.0, seed=1)
    assert poisson_arrivals(4, float("inf")) == [0.0] * 4
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="request rate must be > 0"):
            poisson_arrivals(3, bad)


def test_figures_of_known_results():
    "TTFT, TPOT, ITL and E2E of two hand-made requests and one failure, to the millisecond."
    done = [RequestResult(0.0, 0.0, [0.1, 0.2, 0.4], 0.5, 8, 3, 3),
            RequestResult(1.0, 1.5, [1.8, 2.0], 2.0, 4, 2, 2)]
    failed = RequestResult(2.0, 2.0, end=2.1, error="APIConnectionError: refused")
    assert [r.ttft for r in done] == pytest.approx([0.1, 0.3])
    assert done[0].itl == pytest.approx([0.1, 0.2]) and done[0].tpot == pytest.approx(0.15)
    assert done[1].tpot == pytest.approx(0.2) and done[1].e2e == pytest.approx(0.5)
    s = summarize(done + [failed], duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["APIConnectionError: refused"]
    assert (s["prompt_tokens"], s["output_tokens"], s["output_tokens_expected"]) == (12, 5, 5)
    assert s["request_throughput"] == 1.0 and s["total_token_throughput"] == 8.5
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) == s["ttft_ms"]["p50"]
    assert s["itl_ms"]["mean"] == pytest.approx(500 / 3)
    assert s["e2e_ms"]["p99"] == pytest.approx(500.0)
    stats = latency_stats([0.001 * i for i in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5) and stats["p90"] == pytest.approx(90.1)
    assert stats["p50"] <= stats["p90"] <= stats["p99"]
    assert latency_stats([]) == dict(mean=None, p50=None, p90=None, p99=None)


def test_server_commands_and_exact_lengths():
    command, name = server_command("transformers", "/m/model.Q4.gguf", 9, "float32", "cpu")
    assert name == "/m:model.Q4.gguf" and command[3:5] == ["serve", name]
    assert command[-6:] == ["--port", "9", "--dtype", "float32", "--device", "cpu"]
    command, _ = server_command("transformers", "/m/f", 9, "float32", "cpu",
                                ["--continuous-batching"])
    assert command[-1] == "--continuous-batching"
    command, name = server_command("petite_llm", "/m/folder", 9, "float64", "cpu")
    assert name == "/m/folder" and "127.0.0.1" in command
    with pytest.raises(ValueError, match="unknown server"):
        server_command("vllm", "/m", 9, "float32", "cpu")
    assert exact_length_body("petite_llm", 5) == {"ignore_eos": True}
    config = json.loads(exact_length_body("transformers", 5)["generation_config"])
    assert config["min_new_tokens"] == config["max_new_tokens"] == 5


def test_ratios_need_both_engines():
    def run(rate, ms):
        return dict(request_throughput=rate, output_throughput=10 * rate,
                    **{k: dict(p50=ms) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")})
    res = dict(petite_llm=run(3.0, 20.0), transformers=run(1.0, 80.0))
    assert serve_ratios(res)["request_throughput_vs_transformers"] == 3.0
    assert serve_ratios(res)["e2e_p50_vs_transformers"] == 0.25
    assert serve_ratios({**res, "transformers": {"error": "exited"}}) == {}
    assert serve_ratios({"petite_llm": res["petite_llm"]}) == {}


def test_a_server_that_exits_is_reported_with_its_last_line(tmp_path):
    script = "import sys; print('loading'); print('TypeError: no architectures'); sys.exit(3)"
    with pytest.raises(ServerFailed, match="status 3.*TypeError: no architectures") as e:
        with running_server([sys.executable, "-c", script], 1, tmp_path / "log"):
            pass
    assert e.value.log_tail == ["loading", "TypeError: no architectures"]


def test_a_server_that_never_answers_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    script = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "time.sleep(60)")
    with pytest.raises(ServerFailed, match="did not answer"):
        with running_server([sys.executable, "-c", script], free_port(), tmp_path / "log",
                            timeout=1.0):
            pass
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):                # terminated and reaped
        os.kill(pid, 0)


def _checkpoint(tmp_path_factory):
    from test_server_http import write_checkpoint      # the tiny float64 Qwen3 with a tokenizer
    path = tmp_path_factory.mktemp("qwen3_bench_serve")
    write_checkpoint(path)
    return path


def _bench_serve(capsys, *args) -> dict:
    "Run `petite-llm bench serve ARGS` in this process; its stdout, which must be pure JSON."
    assert main(["bench", "serve", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_serve_starts_measures_and_stops_its_server(tmp_path_factory, tmp_path, capsys):
    path = _checkpoint(tmp_path_factory)
    started = time.monotonic()
    res = _bench_serve(capsys, "--model", path, "--engines", "petite_llm", "--requests", 5,
                       "--request-rate", 20, "--min-len", 4, "--max-len", 12, "--dtype",
                       "float64", "--device", "cpu", "--threads", 1, "--out", tmp_path)
    s = res["petite_llm"]
    assert (s["requests"], s["completed"], s["failed"]) == (5, 5, 0)
    assert s["output_tokens"] == s["output_tokens_expected"] == res["lengths"]["output_tokens"]
    assert s["prompt_tokens"] == res["lengths"]["prompt_tokens"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = s[f"{name}_ms"]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], name
    assert "transformers" not in res and res["ratios"] == {}
    assert json.loads((tmp_path / "bench_serve.json").read_text()) == res
    logs = Path(res["logs"])                              # the server's log, kept for a reader
    assert (logs / "petite_llm.log").exists()
    shutil.rmtree(logs)
    assert time.monotonic() - started < 300


def test_bench_serve_soak_starts_a_server_soaks_it_and_reports(tmp_path_factory, capsys):
    "`--soak`: the figures of a short soak with faults against a server it starts (float32)."
    path = _checkpoint(tmp_path_factory)
    res = _bench_serve(capsys, "--model", path, "--soak", 6, "--soak-rate", 6, "--requests", 4,
                       "--min-len", 4, "--max-len", 12, "--device", "cpu", "--threads", 1)
    assert res["problems"] == [] and res["served"] == res["well_formed"] > 0
    assert res["requests"] == res["well_formed"] + sum(res["faults"].values())
    assert res["metrics_after"] == {"num_requests_running": 0, "num_requests_waiting": 0,
                                    "kv_cache_usage_perc": 0}
    assert 0 < res["memory_mib"]["warm"] <= res["memory_mib"]["peak"]
    assert 0 < res["latency_ms"]["p50"] <= res["latency_ms"]["p99"]
    shutil.rmtree(Path(res["log"]).parent)


def test_bench_serve_bad_values_fail_before_any_server_starts(capsys):
    for args, message in [(["--request-rate", "0"], "request rate must be > 0"),
                          (["--max-concurrency", "0"], "max_concurrency must be at least 1"),
                          (["--engines", "vllm"], "unknown engines")]:
        assert main(["bench", "serve", *args]) == 1
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serve_against_transformers_serve(tmp_path_factory, capsys):
    "Both servers on the same float64 weights: the same work done, and the ratios reported."
    path = _checkpoint(tmp_path_factory)
    res = _bench_serve(capsys, "--model", path, "--requests", 4, "--request-rate", 20,
                       "--min-len", 4, "--max-len", 12, "--dtype", "float64", "--device", "cpu",
                       "--threads", 1)
    for engine in ("petite_llm", "transformers"):
        assert res[engine]["completed"] == 4, res[engine]
        assert res[engine]["output_tokens"] == res["lengths"]["output_tokens"]
    assert res["ratios"]["output_throughput_vs_transformers"] > 0
    shutil.rmtree(res["logs"])

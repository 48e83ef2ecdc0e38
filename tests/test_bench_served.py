"""`python -m bench.served`: servers started in turn (or together), each benchmarked and stopped;
one that cannot start is reported and the next still runs."""

import json
import os

import pytest

from bench import served


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        served.main(["--server", "no-equals-sign"])
    with pytest.raises(SystemExit):
        served.main(["--server", "a=--max-batch 2", "--server", "a=--max-batch 4"])  # one name twice
    with pytest.raises(SystemExit):
        served.main(["--server", "a=", "--bench", "--base-url http://x"])  # the tool's own flag
    with pytest.raises(SystemExit):
        served.main(["--server", "a=", "--bench", "--num-prompts 2 --output-json=x.json"])
    assert served.named("mixed=--mixed-iteration on --max-batch 2") == ("mixed", "--mixed-iteration on --max-batch 2")


@pytest.mark.parametrize("together", [False, True])
def test_servers_run_and_a_failed_start_is_reported(tmp_path, tmp_path_factory, monkeypatch, capsys, together):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    cache = tmp_path_factory.getbasetemp() / "bench-served-jax-cache"  # the second start loads the first's programs
    rc = served.main(["--server", "broken=--max-batch 0",
                      "--server", f"small=--max-batch 2 --max-seq-len 512 --batch-buckets off --compile-cache {cache}",
                      "--bench", "--num-prompts 2 --random-input-len 16 --random-output-len 4 --concurrency 2",
                      "--start-timeout", "600"] + (["--together", "--iteration-log"] if together else []))
    doc = json.loads((tmp_path / "served.json").read_text())["results"]
    assert rc == 1 and "exited" in doc["broken"]["error"] and doc["broken"]["bench"] is None
    small = doc["small"]
    assert small["error"] is None and small["bench_status"] == 0 and small["startup_s"] > 0
    assert small["bench"]["completed"] == 2 and small["bench"]["failed"] == 0
    assert os.path.exists(tmp_path / "small.server.log") and os.path.exists(tmp_path / "small.bench.json")
    out = capsys.readouterr().out
    assert "mean TPOT ms" in out and "broken: the server exited" in out
    if together:  # the iteration log: a line per step the engine read, summarised over 1.3x the median
        assert small["iterations"]["iterations"] > 0 and small["iterations"]["over_ms"] > 0
        assert os.path.exists(tmp_path / "small.iterations.jsonl") and "[small] " in out
    else:
        assert "iterations" not in small and not os.path.exists(tmp_path / "small.iterations.jsonl")


def test_together_stops_every_server_that_never_serves(tmp_path, monkeypatch):
    """Started together, servers that do not serve within --start-timeout are each reported, none
    is benchmarked, and every process group is gone at the end."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    started = []
    launch = served.launch

    def spy(name, server_args, out_dir, log_iterations=False):
        started.append(launch(name, server_args, out_dir, log_iterations))
        return started[-1]

    monkeypatch.setattr(served, "launch", spy)
    results = {}
    served.run_all([("slow", "--max-batch 1 --max-seq-len 256"), ("slower", "--max-batch 2 --max-seq-len 256")],
                   ["--num-prompts", "1", "--random-input-len", "8", "--random-output-len", "2"], str(tmp_path),
                   together=True, start_timeout=1.0, bench_timeout=None, grace=5.0, results=results)
    assert all("did not serve within 1 s" in r["error"] and r["bench"] is None for r in results.values())
    assert len(started) == 2 and all(proc.poll() is not None for proc, _, _ in started)

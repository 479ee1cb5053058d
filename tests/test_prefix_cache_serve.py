"""Prefix caching as a server shows it: vLLM's `prefix_cache_queries` / `prefix_cache_hits`
counters on /metrics, and `metrale bench serve --multi-turn --compare-prefix-caching` (two
servers started by the bench, on CPU): identical greedy replies, the hit rate, TTFT by turn."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from metrale.cli import main
from tests.test_server import Server


def test_metrics_count_prefix_cache_queries_and_hits(tiny_model_dir):
    srv = Server(tiny_model_dir, page_size=4)
    try:
        prompt = list(range(10, 40))  # 30 tokens: 7 full pages
        for _ in range(2):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 200
        srv.wait_idle()
        families = {
            f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
        }
        value = {
            n: families[f"metrale:prefix_cache_{n}"].samples[0].value for n in ("queries", "hits")
        }
        assert value == {"queries": 60, "hits": 28}
    finally:
        srv.close()


def test_bench_serve_multi_turn_compares_prefix_caching(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    args = ["bench", "serve", "--model", str(tiny_model_dir), "--multi-turn"]
    args += ["--num-clients", "3", "--num-turns", "2", "--system-prompt-len", "120"]
    args += ["--input-len", "8", "--output-len", "8", "--ignore-eos", "--compare-prefix-caching"]
    args += ["--server-args", "--device cpu --page-size 8", "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    on, off = report["with_prefix_caching"], report["without_prefix_caching"]
    assert on["completed"] == off["completed"] == 6 and on["workload"] == "multi-turn"
    assert report["identical_replies"] == report["replies"] == 6
    assert on["system_prompt_tokens"] >= 120 and len(on["p50_ttft_ms_by_turn"]) == 2
    # Turn 2 always reuses its own conversation (about 45% of all queried tokens); turn 1
    # shares the system prompt only when an earlier client's pages were committed first, which
    # the clients' timing decides, so the bound holds for any arrival order.
    assert on["prefix_cache_hit_rate"] > 0.35 and off["prefix_cache_hits"] == 0
    assert report["ttft_p50_speedup"] > 0
    assert "replies identical" in capsys.readouterr().out

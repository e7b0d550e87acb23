"""Prometheus metrics: a real worker with ``--metrics-port`` and the gateway's ``/metrics``, scraped
after real traffic; the counts must add up with what the clients received."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from helpers import ROOT, read_result
from producer_helpers import serve_gateway, wait_for
from prometheus_client.parser import text_string_to_metric_families

from common.local_redis import free_port
from common.settings import Settings


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text endpoint."""
    text = httpx.get(url, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, metric: str, **labels) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def total(samples: dict, metric: str, **labels) -> float:
    """Sum over the samples of ``metric`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == metric and want <= set(lab))


def test_worker_and_gateway_metrics_add_up(r, prefix, redis_url, worker_factory):
    port = free_port()
    w = worker_factory(prefix, args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--max-num-seqs", "8"])
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    assert value(before, "tokenq:num_requests_running") == 0
    assert value(before, "tokenq:request_success_total", finish_reason="stop") == 0
    assert value(before, "tokenq:worker_info", name=w.name, model=w.proc.args[w.proc.args.index("--model") + 1],
                 device="cpu", prefix=prefix) == 1

    # Raw protocol traffic, every priority; token counts fixed by ignore_eos.
    sent = {"high": 2, "normal": 3, "low": 2}
    keys = []
    for level, n in sent.items():
        for i in range(n):
            rid = f"m-{level}-{i}"
            r.xadd(f"{prefix}:requests:{level}", {"id": rid, "prompt": "Once upon a time " * (i + 1),
                                                  "max_tokens": str(3 + i), "temperature": "0", "ignore_eos": "1"})
            keys.append(f"{prefix}:result:{rid}")
    r.xadd(f"{prefix}:requests:normal", {"id": "m-bad", "prompt": "x", "max_tokens": "many"})  # invalid_request
    r.xadd(f"{prefix}:requests:normal", {"id": "m-long", "input_ids": json.dumps([5] * 20), "max_tokens": "4090"})  # too_long
    dones = [read_result(r, k)[2] for k in keys]
    assert all(d["type"] == "done" and d["finish_reason"] == "length" for d in dones)
    assert read_result(r, f"{prefix}:result:m-bad")[2]["code"] == "invalid_request"
    assert read_result(r, f"{prefix}:result:m-long")[2]["code"] == "too_long"

    # The same worker behind the gateway, with the openai client.
    with serve_gateway(Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny")) as base:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        usages = []
        for i in range(3):
            c = oai.completions.create(model="tiny", prompt=f"request {i}", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
            usages.append(c.usage)
        stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        usages.append([ch.usage for ch in stream if ch.usage][0])
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model="tiny", prompt="x", max_tokens=0)
        g = scrape(base + "/metrics")

    # Gateway: HTTP counts and latencies per route and status; tokens served.
    assert value(g, "tokenq_gateway_requests_total", method="POST", route="/v1/completions", status="200") == 3
    assert value(g, "tokenq_gateway_requests_total", method="POST", route="/v1/completions", status="400") == 1
    assert value(g, "tokenq_gateway_requests_total", method="POST", route="/v1/chat/completions", status="200") == 1
    assert value(g, "tokenq_gateway_request_duration_seconds_count", method="POST", route="/v1/completions") == 4
    assert value(g, "tokenq_gateway_tokens_total", kind="completion") == sum(u.completion_tokens for u in usages) == 17
    assert value(g, "tokenq_gateway_tokens_total", kind="prompt") == sum(u.prompt_tokens for u in usages)

    # Worker: everything it served, by both routes.
    n_ok = sum(sent.values()) + len(usages)
    completion = sum(int(d["completion_tokens"]) for d in dones) + sum(u.completion_tokens for u in usages)
    prompt = sum(int(d["prompt_tokens"]) for d in dones) + sum(u.prompt_tokens for u in usages)
    m = wait_for(lambda: (s := scrape(url)) and value(s, "tokenq:num_requests_running") == 0 and s, what="idle worker")
    assert value(m, "tokenq:request_success_total", finish_reason="length") == n_ok
    assert total(m, "tokenq:request_success_total") == n_ok
    assert value(m, "tokenq:request_errors_total", code="invalid_request") == 1
    assert value(m, "tokenq:request_errors_total", code="too_long") == 1
    assert value(m, "tokenq:generation_tokens_total") == completion
    assert value(m, "tokenq:prompt_tokens_total") == prompt
    assert value(m, "tokenq:prefill_tokens_computed_total") >= prompt
    assert value(m, "tokenq:time_to_first_token_seconds_count") == n_ok
    assert value(m, "tokenq:e2e_request_latency_seconds_count") == n_ok
    assert value(m, "tokenq:inter_token_latency_seconds_count") == completion - n_ok  # one gap less than tokens
    for level, n in sent.items():
        extra = len(usages) if level == "normal" else 0  # the gateway's default priority
        assert value(m, "tokenq:request_queue_time_seconds_count", priority=level) == n + extra
    # The histograms and the done entries measure the same moments.
    ttft = sum(float(d["ttft_s"]) for d in dones)
    e2e_hist = value(m, "tokenq:e2e_request_latency_seconds_sum")
    assert value(m, "tokenq:time_to_first_token_seconds_sum") >= ttft - 0.01 * n_ok
    assert e2e_hist >= sum(float(d["total_s"]) for d in dones) - 0.01 * n_ok
    assert value(m, "tokenq:e2e_request_latency_seconds_bucket", le="+Inf") == n_ok
    # Admission: every served request admitted once, the too-long one rejected.
    assert value(m, "tokenq:admission_decisions_total", decision="admit") >= n_ok
    assert value(m, "tokenq:admission_decisions_total", decision="reject") == 1
    # Idle now: gauges back to zero, the queue in Redis drained.
    assert value(m, "tokenq:num_requests_waiting") == 0
    assert value(m, "tokenq:kv_cache_usage_perc") == 0
    assert value(m, "tokenq:redis_connected") == 1
    for level in sent:
        assert value(m, "tokenq:queue_depth", priority=level) == 0
        assert value(m, "tokenq:queue_pending", priority=level) == 0
    # The heartbeat and the metrics tell the same story.
    hb = {k.decode(): v.decode() for k, v in r.hgetall(f"{prefix}:worker:{w.name}").items()}
    assert int(hb["preemptions"]) == value(m, "tokenq:num_preemptions_total")
    assert "process_resident_memory_bytes" in {n for n, _ in m}


def test_queue_depth_while_busy(r, prefix, worker_factory):
    """One sequence slot: a long request runs, the rest wait in Redis where the gauge counts them."""
    port = free_port()
    worker_factory(prefix, args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--max-num-seqs", "1"])
    url = f"http://127.0.0.1:{port}/metrics"
    pipe = r.pipeline(transaction=True)  # one round trip: the idle worker sees all of them at once
    pipe.xadd(f"{prefix}:requests:normal", {"id": "long", "prompt": "go", "max_tokens": "1500", "ignore_eos": "1"})
    for i in range(3):
        pipe.xadd(f"{prefix}:requests:normal", {"id": f"short{i}", "prompt": "go", "max_tokens": "2"})
    pipe.execute()

    def busy():
        s = scrape(url)
        return s if value(s, "tokenq:num_requests_running") == 1 and value(s, "tokenq:queue_depth", priority="normal") == 3 else None

    m = wait_for(busy, timeout=30, what="one running, three queued")
    assert value(m, "tokenq:queue_pending", priority="normal") == 1
    assert value(m, "tokenq:queue_depth", priority="high") == 0
    assert value(m, "tokenq:kv_cache_usage_perc") > 0
    r.xadd(f"{prefix}:control", {"type": "cancel", "id": "long"})
    assert read_result(r, f"{prefix}:result:long")[2]["finish_reason"] == "cancelled"
    for i in range(3):
        assert read_result(r, f"{prefix}:result:short{i}")[2]["type"] == "done"
    m = scrape(url)
    assert value(m, "tokenq:request_success_total", finish_reason="cancelled") == 1
    assert total(m, "tokenq:request_success_total") == 4
    assert value(m, "tokenq:queue_depth", priority="normal") == 0


def test_preemptions_are_counted(r, prefix, worker_factory):
    """A cache too small for three growing sequences: they preempt each other and are recomputed."""
    port = free_port()
    worker_factory(prefix, args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--num-pages", "6",
                                 "--page-size", "4", "--max-num-seqs", "3"])
    pipe = r.pipeline(transaction=True)
    for i in range(3):
        pipe.xadd(f"{prefix}:requests:low", {"id": f"lo{i}", "input_ids": json.dumps([7 + i] * 6), "max_tokens": "12",
                                             "temperature": "0", "ignore_eos": "1"})
    pipe.execute()
    dones = [read_result(r, f"{prefix}:result:lo{i}")[2] for i in range(3)]
    assert all(d["finish_reason"] == "length" for d in dones)
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(m, "tokenq:request_success_total", finish_reason="length") == 3
    assert value(m, "tokenq:generation_tokens_total") == 3 * 12
    assert value(m, "tokenq:prompt_tokens_total") == 3 * 6
    assert value(m, "tokenq:num_preemptions_total") > 0
    assert value(m, "tokenq:prefill_tokens_computed_total") > 3 * 6  # the recomputation shows
    assert value(m, "tokenq:inter_token_latency_seconds_count") == 3 * 11


def test_prefix_cache_is_counted(r, prefix, worker_factory):
    """The same 40-token prompt twice, one after the other: the second finds 2 full pages of 16
    cached (its last token is always computed), as vLLM counts queries and hits, in tokens."""
    port = free_port()
    w = worker_factory(prefix, args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--heartbeat-s", "0.2"])
    prompt = json.dumps(list(range(10, 50)))
    dones = []
    for i in range(2):
        r.xadd(f"{prefix}:requests:normal", {"id": f"pc{i}", "input_ids": prompt, "max_tokens": "3", "temperature": "0",
                                             "ignore_eos": "1"})
        dones.append(read_result(r, f"{prefix}:result:pc{i}")[2])
    assert [(d["finish_reason"], d["prompt_tokens"], d["cached_tokens"]) for d in dones] == [("length", "40", "0"),
                                                                                          ("length", "40", "32")]
    hb = wait_for(lambda: (h := r.hgetall(f"{prefix}:worker:{w.name}")) and h.get(b"prefix_cache_hits") == b"32" and h,
                  what="a heartbeat after both requests")
    assert hb[b"prefix_cache_queries"] == b"80"
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(m, "tokenq:prefix_cache_queries_total") == 80
    assert value(m, "tokenq:prefix_cache_hits_total") == 32
    assert value(m, "tokenq:prefill_tokens_computed_total") == 80 - 32
    assert value(m, "tokenq:prompt_tokens_total") == 80


def test_port_in_use_is_a_clear_error(prefix, redis_url, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "worker.main", "--model", tiny_model_dir, "--redis-url", redis_url,
                            "--prefix", prefix, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in p.stderr

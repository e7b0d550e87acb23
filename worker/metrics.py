"""Prometheus metrics of one worker, served on ``--metrics-port`` (``TOKENQ_METRICS_PORT``).

Names follow vLLM's (``vllm:`` becomes ``tokenq:``) where they mean the same thing, so
dashboards and alerts carry over:

==========================================  =========  =====================================================
name                                        type       what
==========================================  =========  =====================================================
tokenq:num_requests_running                 gauge      sequences in the running batch
tokenq:num_requests_waiting                 gauge      requests pulled by this worker, not yet admitted
tokenq:kv_cache_usage_perc                  gauge      KV-cache pages in use, 0..1 (1 = full), as vLLM
tokenq:num_preemptions_total                counter    sequences evicted to make room
tokenq:prompt_tokens_total                  counter    prompt tokens of requests started here
tokenq:generation_tokens_total              counter    tokens generated
tokenq:prefill_tokens_computed_total        counter    tokens run through prefill, recomputation included
tokenq:prefix_cache_queries_total           counter    tokens of admitted sequences looked up in the prefix cache
tokenq:prefix_cache_hits_total              counter    of those, tokens found cached (not computed)
tokenq:request_success_total                counter    requests ended with a ``done`` entry, by finish_reason
tokenq:request_errors_total                 counter    requests ended with an ``error`` entry, by code
tokenq:admission_decisions_total            counter    admission verdicts (admit / defer / reject)
tokenq:time_to_first_token_seconds          histogram  request entered the queue -> its first token
tokenq:inter_token_latency_seconds          histogram  between two tokens of one request
tokenq:e2e_request_latency_seconds          histogram  request entered the queue -> its final entry
tokenq:request_queue_time_seconds           histogram  request entered the queue -> first scheduled, by priority
tokenq:queue_depth                          gauge      entries in Redis no worker has taken yet, by priority
tokenq:queue_pending                        gauge      entries taken by some worker, not yet acknowledged
tokenq:requests_claimed_total               counter    entries taken over from dead workers
tokenq:requests_dead_lettered_total         counter    entries given up after too many deliveries
tokenq:redis_connected                      gauge      1 while the worker's loop reaches Redis
tokenq:redis_data_lost_total                counter    times Redis came back without the consumer groups
tokenq:worker_info                          gauge      1, labelled with name, model, device, prefix
==========================================  =========  =====================================================

Where the clocks come from: the engine stamps every request with monotonic times (arrival,
first scheduled, first token, finished; preemptions are counted). "Entered the queue" is the
time Redis appended the request entry (its id), carried onto the monotonic clock, so the
histograms include the time a request waited in Redis and agree with the ``queue_s``,
``ttft_s`` and ``total_s`` of its ``done`` entry. A request resumed from a dead worker is left
out of the queue-time and TTFT histograms (its first token came from the other worker).

``queue_depth`` / ``queue_pending`` are read from Redis at scrape time; they describe the
shared queue, so every worker reports the same value: aggregate with ``max``, not ``sum``.

Cost on the hot path: one call per engine step that appends inter-token gaps to a buffer
(folded into the histogram at scrape time) and copies a few counters; nothing when metrics
are off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.process_collector import ProcessCollector

from common.errors import CODES
from common.keys import LEVELS
from common.redis import connect

if TYPE_CHECKING:
    from worker.outputs import EngineStats, RequestOutput
    from worker.service import InFlight, Service

log = logging.getLogger("tokenq.metrics")

# vLLM's buckets, so histograms from both line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITL_FLUSH = 4096  # fold buffered inter-token gaps into the histogram at least this often


class WorkerMetrics:
    """The metrics of one :class:`~worker.service.Service`; :meth:`attach` hooks it in."""

    def __init__(self, service: Service, registry: CollectorRegistry | None = None):
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.prompt_tokens = Counter("tokenq:prompt_tokens", "Prompt tokens of requests started on this worker "
                                     "(counted at their first token).", registry=reg)
        self.success = Counter("tokenq:request_success", "Requests that ended with a done entry, by finish reason.",
                               ["finish_reason"], registry=reg)
        self.errors = Counter("tokenq:request_errors", "Requests that ended with an error entry, by error code.",
                              ["code"], registry=reg)
        self.ttft = Histogram("tokenq:time_to_first_token_seconds",
                              "From the request entering the queue (its entry id) to its first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.e2e = Histogram("tokenq:e2e_request_latency_seconds",
                             "From the request entering the queue (its entry id) to its final entry.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("tokenq:request_queue_time_seconds",
                                    "From the request entering the queue (its entry id) to its first scheduling.",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=reg)
        # Observed from the scrape thread (see collect), so the step loop only appends to a deque.
        self.itl = Histogram("tokenq:inter_token_latency_seconds", "Time between two tokens of one request.",
                             buckets=ITL_BUCKETS, registry=None)
        for level in LEVELS:
            self.queue_time.labels(level)
        for reason in ("stop", "length", "cancelled", "timeout"):
            self.success.labels(reason)
        for code in CODES:
            self.errors.labels(code)
        self._itl_buffer: deque[float] = deque()
        self._last_token: dict[str, float] = {}  # request id -> monotonic time of its latest token here
        self._stats: EngineStats = dataclasses.replace(service.engine.stats)
        self._redis = None
        reg.register(_Collector(self))
        try:
            ProcessCollector(registry=reg)
        except Exception:  # not on every platform
            pass
        self._warned = False

    # ------------------------------------------------------------------ hooks (the service's thread)

    def attach(self) -> WorkerMetrics:
        svc = self.service
        previous = svc.on_finished

        def on_finished(f: InFlight | None, output: RequestOutput | None, reason: str) -> None:
            if previous is not None:
                previous(f, output, reason)
            self._guard(self.on_finished, f, output, reason)

        svc.on_finished = on_finished
        svc.on_step = lambda outputs: self._guard(self.on_step, outputs)
        return self

    def _guard(self, fn: Any, *args: Any) -> None:
        """Metrics never take the worker down: log the first failure, carry on."""
        try:
            fn(*args)
        except Exception:
            if not self._warned:
                self._warned = True
                log.exception("event=metrics_failed (further failures are not logged)")

    def on_step(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        last = self._last_token
        for o in outputs:
            if o.new_token_ids:
                prev = last.get(o.request_id)
                if prev is None:
                    self.prompt_tokens.inc(o.num_prompt_tokens)
                else:
                    self._itl_buffer.append(now - prev)
                last[o.request_id] = now
            if o.finished:
                last.pop(o.request_id, None)
        if len(last) > 2 * len(self.service.inflight) + 256:  # requests dropped without a final output
            for rid in [r for r in last if r not in self.service.inflight]:
                del last[rid]
        if len(self._itl_buffer) >= ITL_FLUSH:
            self._flush_itl()
        self._stats = dataclasses.replace(self.service.engine.stats)

    def on_finished(self, f: InFlight | None, output: RequestOutput | None, reason: str) -> None:
        if reason.startswith("error:"):
            self.errors.labels(reason[len("error:"):]).inc()
            return
        self.success.labels(reason).inc()
        if f is None:
            return
        now = time.monotonic()
        enqueued = f.enqueued_wall - (time.time() - now)  # the entry's time on the monotonic clock
        m = output.metrics if output is not None else None
        end = m.finished_time if m is not None and m.finished_time is not None else now
        self.e2e.observe(max(0.0, end - enqueued))
        if m is None or f.resumed_tokens:
            return
        if m.first_scheduled_time is not None:
            level = self.service.keys.level_of_stream(f.stream) or "normal"
            self.queue_time.labels(level).observe(max(0.0, m.first_scheduled_time - enqueued))
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - enqueued))

    # ------------------------------------------------------------------ scrape time (the HTTP thread)

    def _flush_itl(self) -> None:
        buf = self._itl_buffer
        while True:
            try:
                v = buf.popleft()
            except IndexError:
                return
            self.itl.observe(v)

    def queue_depths(self) -> dict[str, tuple[int, int]] | None:
        """(waiting, pending) per level, from Redis; None when Redis does not answer."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        keys = self.service.keys
        if self._redis is None:
            self._redis = connect(self.service.s.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                  retry=Retry(NoBackoff(), 0), retry_on_error=[])
        try:
            pipe = self._redis.pipeline(transaction=False)
            for level in LEVELS:
                pipe.xlen(keys.requests(level))
                pipe.xinfo_groups(keys.requests(level))
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError):
            return None
        out = {}
        for i, level in enumerate(LEVELS):
            length, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(length, Exception):
                return None
            pending = 0
            for g in groups if isinstance(groups, list) else []:
                name = g.get("name", b"")
                if (name.decode() if isinstance(name, bytes) else name) == keys.group:
                    pending = int(g.get("pending") or 0)
            out[level] = (max(0, int(length) - pending), pending)
        return out


class _Collector:
    """Values read when Prometheus scrapes: engine gauges and counters, Redis queue depth."""

    def __init__(self, m: WorkerMetrics):
        self.m = m

    def collect(self):
        m, svc = self.m, self.m.service
        m._flush_itl()
        yield from m.itl.collect()
        st = m._stats  # a copy taken by the service's thread after its latest step
        for name, doc, value in (
            ("tokenq:num_requests_running", "Sequences in the running batch.", st.num_running),
            ("tokenq:num_requests_waiting", "Requests pulled by this worker and not yet admitted.", st.num_waiting),
            ("tokenq:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", st.kv_cache_usage),
            ("tokenq:redis_connected", "1 while the worker loop reaches Redis.", 1.0 if svc.connected else 0.0),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("tokenq:num_preemptions", "Sequences evicted to make room (recompute or swap).", st.num_preemptions),
            ("tokenq:generation_tokens", "Tokens generated.", st.num_generated_tokens),
            ("tokenq:prefill_tokens_computed", "Tokens run through prefill, recomputation after preemption included.",
             st.num_prompt_tokens),
            ("tokenq:prefix_cache_queries", "Tokens of admitted sequences looked up in the prefix cache.",
             st.prefix_cache_queries),
            ("tokenq:prefix_cache_hits", "Tokens of admitted sequences found in the prefix cache (not computed).",
             st.prefix_cache_hits),
            ("tokenq:requests_claimed", "Request entries taken over from dead workers.", svc.counts.get("claimed", 0)),
            ("tokenq:requests_dead_lettered", "Request entries given up after too many deliveries.",
             svc.counts.get("dead", 0)),
            ("tokenq:redis_data_lost", "Times Redis came back without the consumer groups (restarted without "
             "persistence): entries waiting in it were lost.", svc.counts.get("data_lost", 0)),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        adm = CounterMetricFamily("tokenq:admission_decisions",
                                  "Admission verdicts, one per waiting request each step it is judged.",
                                  labels=["decision"])
        for decision in ("admit", "defer", "reject"):
            adm.add_metric([decision], st.admissions.get(decision, 0))
        yield adm
        yield InfoMetricFamily("tokenq:worker", "This worker.", value={
            "name": svc.name, "model": svc.model_name, "device": svc.device, "prefix": svc.keys.prefix})
        depths = m.queue_depths()
        if depths is not None:
            waiting = GaugeMetricFamily("tokenq:queue_depth", "Request entries in Redis that no worker has taken yet "
                                        "(the same for every worker: aggregate with max).", labels=["priority"])
            pending = GaugeMetricFamily("tokenq:queue_pending", "Request entries taken by a worker and not yet "
                                        "acknowledged.", labels=["priority"])
            for level, (w, p) in depths.items():
                waiting.add_metric([level], w)
                pending.add_metric([level], p)
            yield waiting
            yield pending


def serve_metrics(service: Service, port: int, host: str = "0.0.0.0") -> WorkerMetrics:
    """Hook metrics into ``service`` and serve them on ``http://host:port/metrics`` from a thread."""
    m = WorkerMetrics(service).attach()
    start_http_server(port, addr=host, registry=m.registry)
    log.info("event=metrics_serving addr=%s:%d", host, port)
    return m

"""RQ job functions: a real ``rq`` SimpleWorker (burst mode) runs ``producer.jobs.generate`` against a real
tokenq worker; results chain with ``depends_on``; errors and timeouts fail the job with the reason."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import drop_rq_queue
from producer_helpers import done, publish, shared_worker, wait_for
from rq import Queue, SimpleWorker
from rq.job import JobStatus

from common.keys import Keys
from common.protocol import parse_control
from producer import Client
from producer.jobs import dependency_result, generate


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


@pytest.fixture
def queue(r, prefix):
    """An rq queue of this test's own (its name holds the test's prefix); rq's keys removed after."""
    q = Queue(f"{prefix}-jobs", connection=r)
    yield q
    drop_rq_queue(r, q.name)


class BurstWorker(SimpleWorker):
    """rq's SimpleWorker without its command channel (these tests send it no commands): at the end
    of a run rq stops the channel's thread, which polls every 60 s, and on a loaded machine one
    run waited out that whole minute (a CI run: 60.5 s for a job that fails in 0.5 s)."""

    def subscribe(self) -> None:
        pass

    def unsubscribe(self) -> None:
        pass


def work(queue) -> None:
    BurstWorker([queue], connection=queue.connection, name=f"{queue.name}-worker").work(
        burst=True, logging_level="WARNING")


def failure(job) -> str:
    res = job.latest_result()
    return res.exc_string if res is not None else ""


def collect(note: str) -> dict:
    """A pipeline step after generation: it reads the generated result it depends on."""
    prev = dependency_result()
    return {"note": note, "words": len(prev["text"].split()), "tokens": prev["usage"]["completion_tokens"]}


def test_generate_job(worker, redis_url, queue):
    prefix, _ = worker
    job = queue.enqueue(generate, prompt="Once upon a time", max_tokens=5, temperature=0, priority="high",
                        redis_url=redis_url, prefix=prefix)
    work(queue)
    assert job.get_status() == JobStatus.FINISHED, failure(job)
    out = job.return_value()
    assert type(out) is dict and set(out) == {"id", "text", "token_ids", "finish_reason", "usage", "timings"}
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5
    assert out["usage"]["completion_tokens"] == 5 and out["usage"]["total_tokens"] > 5
    job.refresh()
    assert job.meta["tokenq_id"] == out["id"]
    with Client(redis_url, prefix) as c:
        assert out["token_ids"] == c.generate("Once upon a time", max_tokens=5, temperature=0, timeout=60).token_ids


def test_chained_jobs(worker, redis_url, queue):
    prefix, _ = worker
    conn = dict(redis_url=redis_url, prefix=prefix)
    story = queue.enqueue(generate, messages=[{"role": "user", "content": "a story"}], max_tokens=6,
                          temperature=0, **conn)
    summary = queue.enqueue(generate, prompt_template="Summarise: {text}", max_tokens=4, temperature=0,
                            depends_on=story, **conn)
    report = queue.enqueue(collect, "done", depends_on=summary)
    assert summary.get_status() == JobStatus.DEFERRED
    work(queue)
    for job in (story, summary, report):
        assert job.get_status() == JobStatus.FINISHED, failure(job)
    first, second = story.return_value(), summary.return_value()
    with Client(redis_url, prefix) as c:  # the second step really was generated from the first's text
        direct = c.generate(f"Summarise: {first['text']}", max_tokens=4, temperature=0, timeout=60)
    assert second["token_ids"] == direct.token_ids
    assert report.return_value() == {"note": "done", "words": len(second["text"].split()), "tokens": 4}


def test_worker_error_fails_the_job(worker, redis_url, queue):
    prefix, _ = worker
    job = queue.enqueue(generate, input_ids=[4] * 3000, max_tokens=4, redis_url=redis_url, prefix=prefix)
    after = queue.enqueue(collect, "never", depends_on=job)
    work(queue)
    assert job.get_status() == JobStatus.FAILED
    assert "GenerationError" in failure(job) and "too_long" in failure(job)
    assert after.get_status() == JobStatus.DEFERRED  # a failed step stops the chain


def test_bad_arguments_fail_the_job(redis_url, prefix, queue, r):
    job = queue.enqueue(generate, prompt="x", max_tokens=0, redis_url=redis_url, prefix=prefix)
    lone = queue.enqueue(generate, prompt_template="{text}", redis_url=redis_url, prefix=prefix)
    work(queue)
    assert job.get_status() == JobStatus.FAILED and "ValueError: max_tokens" in failure(job)
    assert lone.get_status() == JobStatus.FAILED and "needs a dependency" in failure(lone)
    assert list(r.scan_iter(match=f"{prefix}:*")) == []  # nothing reached the tokenq queue


def test_wait_timeout_fails_and_cancels(redis_url, prefix, queue, r):
    """No tokenq worker serves this prefix: the job's wait_s runs out, the job fails, the request is cancelled."""
    job = queue.enqueue(generate, prompt="anyone?", wait_s=0.5, redis_url=redis_url, prefix=prefix)
    t0 = time.monotonic()
    work(queue)
    assert time.monotonic() - t0 < 15
    assert job.get_status() == JobStatus.FAILED and "GenerationTimeout" in failure(job)
    job.refresh()
    assert [parse_control(f) for _, f in r.xrange(Keys(prefix).control)] == [("cancel", job.meta["tokenq_id"])]


def test_queue_timeout_fails_the_job(redis_url, prefix, queue, r):
    """A request the worker gave up on (``finish_reason timeout``) fails the job. The result entry is
    written here with the protocol's encoder (a worker would write the same) once the request is queued."""
    k = Keys(prefix)

    def worker_gives_up():
        entries = wait_for(lambda: r.xrange(k.requests("low")), 30, what="the request")
        rid = entries[0][1][b"id"].decode()
        publish(r, k.result(rid), [done(rid, "timeout")])

    t = threading.Thread(target=worker_gives_up)
    t.start()
    job = queue.enqueue(generate, prompt="late", priority="low", timeout_s=5, redis_url=redis_url, prefix=prefix)
    work(queue)
    t.join()
    assert job.get_status() == JobStatus.FAILED and "GenerationTimeout" in failure(job)


def test_rq_job_timeout_cancels_the_request(worker, redis_url, queue):
    """RQ kills a job that runs past job_timeout: the tokenq request it was waiting on is cancelled."""
    prefix, _ = worker
    job = queue.enqueue(generate, prompt="on and on", max_tokens=2000, ignore_eos=True, redis_url=redis_url,
                        prefix=prefix, job_timeout=1)
    work(queue)
    assert job.get_status() == JobStatus.FAILED and "JobTimeoutException" in failure(job)
    job.refresh()
    with Client(redis_url, prefix) as c:
        res = c.attach(job.meta["tokenq_id"]).result(timeout=60)
    assert res.finish_reason == "cancelled" and len(res.token_ids) < 2000


def test_generate_job_with_outputs(worker, redis_url, queue):
    """The output keywords reach the worker from an RQ job; choices and logprobs come back in the dict."""
    prefix, _ = worker
    job = queue.enqueue(generate, prompt="Answer:", max_tokens=6, n=2, seed=1, logprobs=1,
                        structured_outputs={"choice": ["yes", "no"]}, redis_url=redis_url, prefix=prefix)
    work(queue)
    assert job.get_status() == JobStatus.FINISHED, failure(job)
    out = job.return_value()
    assert [c["text"] in ("yes", "no") for c in out["choices"]] == [True, True]
    assert len(out["logprobs"]) == len(out["token_ids"]) and out["choices"][0]["text"] == out["text"]

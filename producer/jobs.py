"""RQ job functions: generation as a step of a backend pipeline.

    from rq import Queue
    from producer.jobs import generate

    q = Queue("pipeline", connection=redis_conn)
    story = q.enqueue(generate, prompt="Once upon a time", max_tokens=64, priority="low")
    summary = q.enqueue(generate, prompt_template="Summarise: {text}", max_tokens=16, depends_on=story)
    report = q.enqueue(store_report, depends_on=summary)   # reads dependency_result()

``generate`` returns a plain dict (``id``, ``text``, ``token_ids``, ``finish_reason``,
``usage``, ``timings``) and raises when the request ends in an error entry, times out or is
cancelled, so RQ marks the job failed with that reason. An RQ job timeout (or a stopped job)
cancels the tokenq request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import Unpack

from common.protocol import RequestOptions
from producer.client import Client
from producer.types import GenerationError, GenerationTimeout

__all__ = ["GenerationError", "GenerationTimeout", "dependency_result", "generate"]


def dependency_result() -> Any:
    """Inside an RQ job: the return value of the job it ``depends_on`` (None outside a job)."""
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        return None
    dep = job.dependency
    return None if dep is None else dep.return_value()


def generate(
    prompt: str | None = None,
    *,
    prompt_template: str | None = None,
    redis_url: str | None = None,
    prefix: str | None = None,
    wait_s: float | None = None,
    **options: Unpack[RequestOptions],
) -> dict[str, Any]:
    """Generate and return the result as a plain dict; ``options`` are those of ``Client.submit``.

    ``prompt_template`` builds the prompt from the job this one ``depends_on``: ``{text}`` is
    replaced by that job's generated text. ``timeout_s`` is the tokenq timeout (give up if no
    worker starts the request in time); ``wait_s`` bounds the whole wait here (RQ's own job
    timeout applies as well). Raises ValueError for bad arguments, :class:`GenerationError` for
    an error entry or a cancelled request, :class:`GenerationTimeout` for a timeout.
    """
    if prompt_template is not None:
        if prompt is not None or options.get("input_ids") is not None or options.get("messages") is not None:
            raise ValueError("prompt_template replaces prompt, input_ids and messages: give only one")
        dep = dependency_result()
        if not isinstance(dep, Mapping) or not isinstance(dep.get("text"), str):
            raise ValueError("prompt_template needs a dependency (depends_on) that returned a generate() result")
        prompt = prompt_template.replace("{text}", dep["text"])
    with Client(redis_url, prefix) as client:
        h = client.submit(prompt, **options)
        _note_request_id(h.id)
        try:
            result = h.result(timeout=wait_s).check()
        except BaseException:  # an error entry, our wait_s, RQ's job timeout, a stopped job, Ctrl-C
            if not h.done:
                try:
                    h.cancel()
                except Exception:
                    pass
            raise
        return result.to_dict()


def _note_request_id(rid: str) -> None:
    """Record the tokenq request id in the RQ job's meta (so it can be cancelled or traced)."""
    try:
        from rq import get_current_job

        job = get_current_job()
        if job is not None:
            job.meta["tokenq_id"] = rid
            job.save_meta()
    except Exception:
        pass

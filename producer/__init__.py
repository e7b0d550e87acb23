"""Everything that sends work to tokenq or reads its results. Torch-free.

``Client`` / ``AsyncClient`` submit requests and stream results; the ``tokenq`` CLI lives in
:mod:`producer.cli`, the OpenAI-compatible gateway in :mod:`producer.gateway`, RQ job
functions in :mod:`producer.jobs`.
"""

from producer.aio import AsyncClient, AsyncHandle
from producer.client import Client, Handle
from producer.types import (
    Choice,
    Chunk,
    GenerationCancelled,
    GenerationError,
    GenerationTimeout,
    Result,
    Timings,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncHandle",
    "Choice",
    "Chunk",
    "Client",
    "GenerationCancelled",
    "GenerationError",
    "GenerationTimeout",
    "Handle",
    "Result",
    "Timings",
    "Usage",
]

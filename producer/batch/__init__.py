"""Batch jobs: OpenAI's Batch API on the queue, its state in Redis.

``records`` (the OpenAI objects), ``store`` (files and batches in Redis), ``lines`` (one input
line judged and answered as the synchronous endpoint does), ``scripts`` (the lease-fenced Lua
writes), ``carrier`` (one batch carried to its end), ``runner`` (finds batches, holds leases),
``routes`` (the HTTP API), ``cli`` (``tokenq batch``).
"""

"""The worker: paged KV cache, admission, scheduler, model runner, engine and the Redis service.

This package imports torch; ``common`` and ``producer`` never import it.
"""

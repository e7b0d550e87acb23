"""Error codes that travel on result streams (``type error``) and the exception that carries them."""

from __future__ import annotations

INVALID_REQUEST = "invalid_request"  # a field is missing, malformed or out of range
TOO_LONG = "too_long"  # prompt (+ max_tokens) can never fit the model or the cache
INTERNAL = "internal"  # the worker failed; the request was retried and gave up
CODES = (INVALID_REQUEST, TOO_LONG, INTERNAL)


class ProtocolError(ValueError):
    """A request that cannot be served, with the code and message its client will read.

    ``request_id`` and ``reply_to`` are filled in when they could be derived before the
    fault was found, so the worker knows where to publish the error.
    """

    def __init__(self, code: str, message: str, *, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply_to = reply_to

"""The wire protocol as code, one element a module, each with its encoder and its decoder:

- :mod:`~common.protocol.fields`: field coercion, the payload merge, ids;
- :mod:`~common.protocol.request`: the request record, ``to_fields`` and ``parse_request``;
- :mod:`~common.protocol.options`: the request keywords, declared once, and ``build_request``;
- :mod:`~common.protocol.entries`: result entries (token, done, error) and dead letters;
- :mod:`~common.protocol.control`: cancel;
- :mod:`~common.protocol.heartbeat`: the worker heartbeat hash.

Key names live in :mod:`common.keys`. docs/protocol.md is the contract this code implements.
Everything here is torch-free and pure.
"""

from common.protocol.control import CONTROL_MAXLEN, cancel_fields, parse_control
from common.protocol.entries import (
    FINISH_REASONS,
    ResultEntry,
    dead_entry,
    decode_result,
    done_entry,
    error_entry,
    token_entry,
)
from common.protocol.fields import ID_RE, field_map
from common.protocol.heartbeat import Heartbeat, parse_heartbeat
from common.protocol.options import REQUEST_KEYWORDS, RequestOptions, build_request
from common.protocol.request import ROLES, Limits, Request, SamplingParams, parse_request, reply_key_for

__all__ = [
    "CONTROL_MAXLEN", "FINISH_REASONS", "ID_RE", "REQUEST_KEYWORDS", "ROLES", "Heartbeat", "Limits", "Request",
    "RequestOptions", "ResultEntry", "SamplingParams", "build_request", "cancel_fields", "dead_entry",
    "decode_result", "done_entry", "error_entry", "field_map", "parse_control", "parse_heartbeat",
    "parse_request", "reply_key_for", "token_entry",
]

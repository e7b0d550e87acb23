"""Torch-free parts shared by producers and workers: the wire protocol, settings, errors."""

from common.errors import ProtocolError
from common.keys import LEVELS, PRIORITIES, Keys
from common.protocol import SamplingParams

__all__ = ["LEVELS", "PRIORITIES", "Keys", "ProtocolError", "SamplingParams"]

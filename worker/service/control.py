"""Control messages (docs/protocol.md, "Control"): cancel a running request, or remember the
cancel of one not pulled yet (it is answered ``cancelled`` when pulled, or by the sweep)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from common.protocol import parse_control
from common.protocol.control import CANCEL_MEMORY_S
from worker.service.inflight import text

if TYPE_CHECKING:
    from worker.service.loop import Service

log = logging.getLogger("tokenq.service")


class Control:
    """Where the worker is in the control stream, and the ids cancelled before it pulled them."""

    def __init__(self) -> None:
        self.last = "$"
        self.cancelled: OrderedDict[str, float] = OrderedDict()  # id -> monotonic time of the cancel

    def start_from_recent(self) -> None:
        """On first contact: cancels sent in the last CANCEL_MEMORY_S still apply to entries we may pull."""
        if self.last == "$":
            self.last = f"{int((time.time() - CANCEL_MEMORY_S) * 1000)}-0"

    def forget_old(self) -> None:
        while self.cancelled and next(iter(self.cancelled.values())) < time.monotonic() - CANCEL_MEMORY_S:
            self.cancelled.popitem(last=False)


def read(svc: Service) -> None:
    """Apply every new control entry."""
    ctl = svc.control
    if not svc.doorbell.take(svc.keys.control):
        ctl.forget_old()
        return
    reply = svc.r.xread({svc.keys.control: ctl.last}, count=1000)
    if sum(len(entries) for _, entries in reply or []) >= 1000:
        svc.doorbell.ring(svc.keys.control)
    for _, entries in reply or []:
        for entry_id, fields in entries:
            ctl.last = text(entry_id)
            msg = parse_control(fields)
            if msg is None:
                continue
            _, rid = msg
            if svc.engine.abort(rid):
                svc.inflight[rid].cancelled = True
                log.info("event=cancel id=%s", rid)
            else:
                ctl.cancelled[rid] = time.monotonic()
    ctl.forget_old()

"""The worker's Redis side, one concept a module:

- :mod:`~worker.service.loop`: :class:`Service`, the loop (control, intake, timers, step, publish);
- :mod:`~worker.service.intake`: pulling entries under the engine's budget, aging, accepting;
- :mod:`~worker.service.answers`: token, final and bad-entry answers;
- :mod:`~worker.service.outbox`: the typed operations waiting to be written (by a writer thread);
- :mod:`~worker.service.doorbell`: which streams may hold unread entries (a thread blocked on XREAD);
- :mod:`~worker.service.scripts`: the Lua scripts, each behind one typed function;
- :mod:`~worker.service.recovery`: resume, claims, ownership refresh, release;
- :mod:`~worker.service.sweeps`: unread entries past their deadline, unknown streams;
- :mod:`~worker.service.control`, :mod:`~worker.service.heartbeat`, :mod:`~worker.service.connection`,
  :mod:`~worker.service.inflight`.

docs/protocol.md is the contract it serves.
"""

from worker.service.inflight import InFlight, entry_time
from worker.service.loop import Service

__all__ = ["InFlight", "Service", "entry_time"]

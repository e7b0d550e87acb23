"""The doorbell: which streams may hold entries this worker has not read.

A busy worker used to poll the request and control streams every few ms, two or three round
trips each time, most of them finding nothing (a small model's step is a few ms, and its
round trips queue behind the step's threads on a loaded machine). Instead, a thread of its
own blocks on XREAD over all those streams (its own client: the blocking read holds a
connection) and marks a stream "rung" when a new entry lands there; the loop reads a stream
only while it is rung.

The race that matters: an entry that lands while the loop is reading. The loop takes the
mark *before* it reads (:meth:`take`), and marks the stream again itself when its read came
back full (more may wait: :meth:`ring`), so an entry that lands during a read rings anew and
is read on the next poll. A stream only ever misses a read while its mark is down, and the
mark goes down only just before a read.

Every stream starts rung, and all are rung again each time the thread (re)starts from the
streams' newest ids and whenever it cannot read (Redis down, when the loop polls as before). On a cluster the streams live in different slots and
one XREAD cannot block on them all: there every stream is always rung (plain polling).
"""

from __future__ import annotations

import logging
import threading
import weakref

log = logging.getLogger("tokenq.service")
BLOCK_MS = 1000
RETRY_S = 0.5


class Doorbell:
    def __init__(self, streams: list[str], connect=None):
        """``connect``: makes the thread's client (None: no thread, every stream always rung)."""
        self.streams = list(streams)
        self._rung = dict.fromkeys(self.streams, True)
        self._lock = threading.Lock()
        self._connect = connect
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Start the thread (once); it ends with :meth:`stop` or when the doorbell is collected."""
        if self._connect is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=_listen, args=(weakref.ref(self), self._connect(), self._stop),
                                        name="tokenq-doorbell", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def take(self, stream: str) -> bool:
        """Whether ``stream`` may hold unread entries; the mark goes down (call just before reading)."""
        if self._connect is None:
            return True
        with self._lock:
            rung = self._rung.get(stream, True)
            self._rung[stream] = False
        return rung

    def rung(self, stream: str) -> bool:
        """Whether ``stream`` may hold unread entries (the mark stays)."""
        return self._connect is None or self._rung.get(stream, True)

    def ring(self, *streams: str) -> None:
        """Mark streams as possibly holding entries (a read came back full, a new entry landed)."""
        with self._lock:
            for s in streams:
                self._rung[s] = True

    def ring_all(self) -> None:
        """Every stream (Redis was away, or lost our groups: poll everything once)."""
        self.ring(*self.streams)


def _listen(bell: weakref.ref, r, stop: threading.Event) -> None:
    """The thread: block on XREAD from each stream's newest id; ring what moved."""
    last: dict[str, str] | None = None
    while not stop.is_set():
        me = bell()
        if me is None:
            return
        streams = me.streams
        del me  # hold no reference while blocked: the doorbell may be collected meanwhile
        try:
            if last is None:  # (again) from here on: whatever landed before is read once more
                last = _newest(r, streams)
                if (me := bell()) is not None:
                    me.ring_all()
                del me
            reply = r.xread(last, count=1, block=BLOCK_MS)
            moved = [s.decode() if isinstance(s, bytes) else s for s, _ in reply or []]
            if moved:
                last.update(_newest(r, moved))  # skip past the rest: one wake-up per burst
                if (me := bell()) is not None:
                    me.ring(*moved)
        except Exception as e:  # noqa: BLE001  (Redis away or refusing: poll everything meanwhile)
            log.debug("event=doorbell_error error=%r", e)
            last = None
            if (me := bell()) is not None:
                me.ring_all()
            del me
            stop.wait(RETRY_S)
    try:
        r.close()
    except Exception:  # noqa: BLE001
        pass


def _newest(r, streams: list[str]) -> dict[str, str]:
    """Each stream's newest entry id ("0-0" for an empty or missing stream)."""
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xrevrange(s, count=1)
    out = {}
    for s, got in zip(streams, pipe.execute()):
        eid = got[0][0] if got else b"0-0"
        out[s] = eid.decode() if isinstance(eid, bytes) else eid
    return out


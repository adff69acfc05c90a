#!/usr/bin/env python3
"""kv_publisher.py with a sleeping pacer, for kvroute's latency example.

kv_publisher.py paces `publish` steps by polling its sockets with a zero timeout
until the next send time: at 10 K batches/s it spins a CPU at 100 %. Real engines
publish from a thread that blocks between steps. This wrapper keeps every other
behaviour (same CLI, same script steps, same bytes) and paces with short sleeps,
with the thread's timer slack lowered to 1 us so a 100 us sleep is not rounded up
by the kernel's default 50 us slack.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_publisher  # noqa: E402

PR_SET_TIMERSLACK = 29


def lower_timer_slack() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except OSError:
        pass  # not Linux: default slack


def sleeping_publish(self: kv_publisher.Publisher, count: int, rate: float, kind: str) -> None:
    interval = 1.0 / rate if rate > 0 else 0.0
    next_at = time.monotonic()
    for _ in range(count):
        if interval:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at + interval, time.monotonic() - 0.05)
        self.send(kind)
    kv_publisher.say(f"PUBLISHED epoch={self.epoch} next_seq={self.seq}")


if __name__ == "__main__":
    lower_timer_slack()
    kv_publisher.Publisher.publish = sleeping_publish
    sys.exit(kv_publisher.main())

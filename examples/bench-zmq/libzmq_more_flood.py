"""What libzmq's ZMQ_MAXMSGSIZE bounds, against the attacks of
kvroute-engines/tests/hostile_zmq.rs.

A libzmq SUB (pyzmq, the libzmq the engines themselves use) with
ZMQ_MAXMSGSIZE = 16 MiB, kvroute's default `max_message_bytes`, binds on
127.0.0.1; a raw ZMTP 3.0 peer completes the NULL handshake as a PUB and then

* `more`: sends 24 frames of 8 MiB, each flagged MORE (one endless multipart
  message, 192 MiB), or
* `huge`: sends one long-frame header declaring 2^40 bytes.

It prints whether libzmq closed the connection and how much the SUB process's
peak resident memory (VmHWM) grew.

    .venv/bin/python examples/bench-zmq/libzmq_more_flood.py more
    .venv/bin/python examples/bench-zmq/libzmq_more_flood.py huge
"""

import socket
import struct
import sys
import threading
import time

import zmq


def vm_hwm() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "more"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    result = {}

    def attacker() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        greeting = bytearray(64)
        greeting[0], greeting[9], greeting[10] = 0xFF, 0x7F, 3
        greeting[12:16] = b"NULL"
        s.sendall(greeting)
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB"
        s.sendall(bytes([4, len(ready)]) + ready)
        time.sleep(0.2)
        sent = 0
        try:
            if mode == "more":
                body = b"\xa5" * (8 << 20)
                for _ in range(24):
                    s.sendall(bytes([3]) + struct.pack(">Q", len(body)))
                    s.sendall(body)
                    sent += 1
            else:
                s.sendall(bytes([2]) + struct.pack(">Q", 1 << 40))
                sent = 1
            s.settimeout(5)
            while s.recv(1 << 16):
                pass
            result["closed"] = True
        except OSError as e:
            result["closed"] = f"no ({e!r})"
        result["sent"] = sent

    base = vm_hwm()
    t = threading.Thread(target=attacker)
    t.start()
    t.join(60)
    time.sleep(0.5)
    print(
        f"libzmq {zmq.zmq_version()} mode={mode}: frames sent {result.get('sent')}, "
        f"connection closed by the SUB: {result.get('closed')}, "
        f"SUB VmHWM growth {(vm_hwm() - base) / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()

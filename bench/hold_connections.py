#!/usr/bin/env python3
"""Holds N connections to a Postgres instance for the benchmarks, mostly idle.

One process, N sockets speaking the protocol (no Postgres driver needed): startup with trust
authentication, then SELECT 1 round-robin at RATE per second over all of them, so that every
backend wakes now and then and nearly all are idle at any instant. Prints `held N` once all
are connected; runs until killed.

Usage: bench/hold_connections.py SOCKET_PATH N RATE APPLICATION_NAME
"""
import socket, struct, sys, time
path, n, rate, name = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

def until_ready(s):
    buf = b""
    while True:
        while len(buf) < 5 or len(buf) < 1 + struct.unpack("!i", buf[1:5])[0]:
            chunk = s.recv(65536)
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        kind, size = buf[:1], struct.unpack("!i", buf[1:5])[0]
        body, buf = buf[5:1 + size], buf[1 + size:]
        if kind == b"E":
            raise RuntimeError(body.decode(errors="replace"))
        if kind == b"Z":
            return

conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    body = struct.pack("!i", 196608) + b"user\0postgres\0database\0postgres\0application_name\0" + name.encode() + b"\0\0"
    s.sendall(struct.pack("!i", 4 + len(body)) + body)
    until_ready(s)
    conns.append(s)
print("held", n, flush=True)
query = b"SELECT 1\0"
message = b"Q" + struct.pack("!i", 4 + len(query)) + query
deadline, i = time.monotonic(), 0
while True:
    s = conns[i % n]
    i += 1
    s.sendall(message)
    until_ready(s)
    deadline += 1 / rate
    time.sleep(max(0, deadline - time.monotonic()))

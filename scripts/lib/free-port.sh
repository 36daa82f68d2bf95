# shellcheck shell=bash
# For the benchmarks and scripts (sourced, not run).

# A free loopback port; with an argument N, the first of N free consecutive ports.
free_port() {
  python3 - "${1:-1}" <<'PY'
import socket, sys
n = int(sys.argv[1])
for _ in range(100):
    held = [socket.socket()]
    held[0].bind(("127.0.0.1", 0))
    port = held[0].getsockname()[1]
    try:
        for i in range(1, n):
            s = socket.socket(); held.append(s); s.bind(("127.0.0.1", port + i))
    except OSError:
        continue
    finally:
        for s in held: s.close()
    print(port)
    break
else:
    sys.exit("no free ports")
PY
}

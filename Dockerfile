# pgscope agent image: the same `make release` build the tests exercise, on Debian 12 (the
# distro pgscope is developed and tested on), then only the binary on a slim runtime.
#
# BPF needs root (with the capabilities the Helm chart grants), so the image does not switch to
# a non-root user: the chart sets runAsUser 0, drops every other capability and mounts the
# root filesystem read-only.

FROM rust:1.95-bookworm AS build
# Build dependencies of the BPF programs (the Makefile's `deps` installs the same packages).
# Versions come from the pinned Debian release (bookworm): pinning each package's exact
# version would break the build at every Debian point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      clang llvm libbpf-dev bpftool libelf-dev zlib1g-dev build-essential pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN make release

FROM debian:bookworm-slim AS runtime
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Without its DWARF (`make release` splits it off): every node pulls this binary.
COPY --from=build /src/target/release/dist/pgscope /usr/local/bin/pgscope
# /metrics, /healthz, /readyz
EXPOSE 9437
ENTRYPOINT ["/usr/local/bin/pgscope"]
CMD ["agent", "--config", "/etc/pgscope/agent.toml"]

# The same image with the debug info, for file and line in a panic's backtrace and for gdb
# (`docker build --target debug .`): the binary's .gnu_debuglink finds it under /usr/lib/debug.
FROM runtime AS debug
COPY --from=build /src/target/release/dist/pgscope.debug /usr/lib/debug/usr/local/bin/pgscope.debug

# The default image: the runtime stage, without the debug info.
FROM runtime

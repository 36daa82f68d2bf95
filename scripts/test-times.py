#!/usr/bin/env python3
"""The time each test file took, from the output of `cargo test` (read on stdin or from the files
named): one line per test binary, slowest first, and the total. `make integration-test` prints it
at its end, so that a file that grows slower is seen.

cargo prints `Running tests/NAME.rs (target/...)` before a binary's tests and `test result: ...
finished in 12.34s` after them; a binary that crashed before its result line is shown as such.
"""
import re
import sys

RUNNING = re.compile(r"^\s*Running (unittests )?(\S+)(?: \((\S+)\))?")
DOCTESTS = re.compile(r"^\s*Doc-tests (\S+)")
RESULT = re.compile(r"^test result: (\w+)\..*finished in ([0-9.]+)s")


def name_of(running):
    """`tests/smoke.rs`; a crate's unit tests by their binary (every crate has a src/lib.rs)."""
    unit, source, binary = running.groups()
    if unit and binary:
        crate = re.sub(r"-[0-9a-f]{16}$", "", binary.rsplit("/", 1)[-1])
        return f"{crate} (unit tests, {source})"
    return source


def times(lines):
    current = None
    for line in lines:
        running = RUNNING.match(line)
        doctests = DOCTESTS.match(line)
        if running or doctests:
            if current:
                yield current, None, "no result line (crashed or killed)"
            current = name_of(running) if running else f"{doctests.group(1)} (doc tests)"
            continue
        result = RESULT.match(line)
        if result and current:
            yield current, float(result.group(2)), result.group(1)
            current = None
    if current:
        yield current, None, "no result line (crashed or killed)"


def main():
    if len(sys.argv) > 1:
        lines = []
        for path in sys.argv[1:]:
            with open(path, errors="replace") as f:
                lines.extend(f)
    else:
        lines = sys.stdin
    rows = list(times(lines))
    if not rows:
        print("test times: no test binary ran")
        return
    rows.sort(key=lambda r: -(r[1] or 0.0))
    width = max(len(name) for name, _, _ in rows)
    print("test times (seconds, slowest first):")
    for name, secs, result in rows:
        shown = f"{secs:8.1f}" if secs is not None else "       ?"
        print(f"  {name:<{width}} {shown}  {result}")
    total = sum(secs or 0.0 for _, secs, _ in rows)
    print(f"  {'total':<{width}} {total:8.1f}  ({total / 60:.1f} min in {len(rows)} test binaries)")


if __name__ == "__main__":
    main()

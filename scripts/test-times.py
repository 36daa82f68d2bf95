#!/usr/bin/env python3
"""The time each test file took, from the output of `cargo test` (read on stdin or from the files
named): one line per test binary, slowest first, and the total. `make integration-test` prints it
at its end, so that a file that grows slower is seen.

cargo prints `Running tests/NAME.rs (target/...)` before a binary's tests and `test result: ...
finished in 12.34s` after them; a binary that crashed before its result line is shown as such.

Below the table, each failed test's own error (its `Error:` or `panicked at` lines, from the end
of its captured output): a test's output can run to hundreds of lines (a trace's whole report),
and a CI log cut to its head and tail would otherwise show every failure but not its reason.
"""
import re
import sys

RUNNING = re.compile(r"^\s*Running (unittests )?(\S+)(?: \((\S+)\))?")
DOCTESTS = re.compile(r"^\s*Doc-tests (\S+)")
RESULT = re.compile(r"^test result: (\w+)\..*finished in ([0-9.]+)s")
FAILED_OUTPUT = re.compile(r"^---- (\S+) stdout ----$")
ERROR_START = re.compile(r"^Error: |^thread '.*' panicked at ")
# Lines of one failure's error shown at most: enough for a table in the message.
ERROR_LINES = 40


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


def failure_errors(lines):
    """(test name, its error's lines) for each `---- NAME stdout ----` section of a failure, the
    error taken from the last line that starts one to the end of the section."""
    name, section = None, []

    def error_of(section):
        starts = [i for i, line in enumerate(section) if ERROR_START.match(line)]
        if not starts:
            return ["(no `Error:` or panic line in its output)"]
        error = section[starts[-1]:]
        # anyhow's backtrace (RUST_BACKTRACE) says where, at length; the log keeps it.
        if "Stack backtrace:" in error:
            error = error[: error.index("Stack backtrace:")]
        while error and not error[-1].strip():
            error.pop()
        if len(error) > ERROR_LINES:
            error = error[:ERROR_LINES] + [f"... ({len(error) - ERROR_LINES} more lines in the log)"]
        return error

    for line in lines:
        line = line.rstrip("\n")
        header = FAILED_OUTPUT.match(line)
        if name and (header or line == "failures:"):
            yield name, error_of(section)
            name = None
        if header:
            name, section = header.group(1), []
        elif name:
            section.append(line)
    if name:
        yield name, error_of(section)


def main():
    if len(sys.argv) > 1:
        lines = []
        for path in sys.argv[1:]:
            with open(path, errors="replace") as f:
                lines.extend(f)
    else:
        lines = list(sys.stdin)
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
    failures = list(failure_errors(lines))
    if failures:
        print(f"why the {len(failures)} failed test(s) failed (the end of each one's output):")
        for name, error in failures:
            print(f"  {name}:")
            for line in error:
                print(f"    {line}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Ground truth for sampled off-CPU time, from perf's record of every context switch.

Reads `perf script -F comm,time,trace,ip,sym` of `perf record -e sched:sched_switch -a -g
--kernel-callchains` (standard input) taken around one run of the eviction-storm agreement test,
and that test's output (the file named on the command line). For the storm's client backends
(the postgres threads that switched more than MIN_SWITCHES times) it prints, per off-CPU class:

- truth: the off-CPU time perf saw (a switch-out to the next switch-in), classed as the
  tracers class it: runnable at the switch-out is `preempted`, uninterruptible is `io`, a
  kernel stack through futex is `futex`, through epoll is `latch` (client reads, left out of
  the test's comparison), anything else `other`;
- at instants: the same truth read only at the wait sampler's instants (each switch-in of its
  thread `pgscope-waits`), each weighing the time since the previous one, as the sampler
  weighs its samples: what a sampler that judged every thread rightly at its instant reports;
- exact and sampled: the two tracers' own figures for the client backends, from the test's
  table of every row (idle, a client read between statements, counted as `latch`).

So exact/truth tells whether the exact tracer is right, instants/truth what sampling at those
instants costs (few independent samples, instants that coincide with the sampler's own doing),
and sampled/instants what the sampler misjudges at its instants. Also: how many of the threads
off CPU at an instant ran before the sampler's thread went back to sleep, by class at the
instant and after (the visits come later than the instant; a thread seen after it ran is seen
in its new wait); and the noise floor: a perfect sampler, as many instants drawn at random
over the same time, TRIALS times, how often its futex and comparable (futex + preempted + io)
totals land within 10% of the truth. The lock waits come in convoys (many backends at once,
for microseconds), so an instant that hits one counts many, and few are independent.

The last line: `offcpu-groundtruth: futex_exact_over_truth=… futex_instants_over_truth=…
futex_sampled_over_instants=… preempted_… ran_during_run_per_instant=…
perfect_futex_within_10pct=… perfect_comparable_within_10pct=…`.
"""

import bisect
import collections
import random
import re
import sys

MIN_SWITCHES = 1000
SAMPLER_THREAD = "pgscope-waits"
SWITCH = re.compile(
    r".*?([\d.]+): prev_comm=(\S+) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) "
    r"==> next_comm=(\S+) next_pid=(\d+)"
)
TEST_ROW = re.compile(r"^(.{36}) (\S+)\s+client backend\s+([\d.]+)\s+([\d.]+)\s*$")
CLASSES = ("futex", "preempted", "io")
TRIALS = 50


def switches(lines):
    """(time, prev_comm, prev_pid, prev_state, next_comm, next_pid, kernel frames) per switch."""
    current = None
    for line in lines:
        match = SWITCH.match(line)
        if match:
            if current:
                yield current
            t, prev_comm, prev_pid, prev_state, next_comm, next_pid = match.groups()
            current = (float(t), prev_comm, int(prev_pid), prev_state, next_comm, int(next_pid), [])
        elif current is not None and line.strip():
            current[6].append(line.strip())
    if current:
        yield current


def class_of(prev_state, frames):
    if prev_state.startswith("R"):
        return "preempted"
    if prev_state == "D":
        return "io"
    stack = " ".join(frames)
    if "futex" in stack:
        return "futex"
    if "epoll" in stack or "ep_poll" in stack:
        return "latch"
    return "other"


def tracer_rows(path):
    """Per class, the exact and the sampled ms of the client backends' rows of the test."""
    exact, sampled = collections.Counter(), collections.Counter()
    in_table = False
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            if "every row by backend type" in line:
                in_table = True
                continue
            if in_table:
                match = TEST_ROW.match(line.rstrip("\n"))
                if match:
                    _, cls, e, s = match.groups()
                    # Idle is a client read between statements: blocked in epoll, as perf sees it.
                    cls = "latch" if cls == "idle" else cls
                    exact[cls] += float(e)
                    sampled[cls] += float(s)
                elif not line.strip():
                    in_table = False
    return exact, sampled


def main():
    events = list(switches(sys.stdin))
    counts = collections.Counter(e[2] for e in events if e[1] == "postgres")
    busy = {tid for tid, n in counts.items() if n > MIN_SWITCHES}
    if not busy:
        sys.exit("offcpu_groundtruth: no postgres thread switched often enough: no storm recorded")
    off = {}  # tid -> (class, switch-out time), while off CPU
    truth = collections.Counter()
    at_instants = collections.Counter()
    last_instant = None
    snapshot = None
    ran = set()
    transitions = collections.Counter()
    instants = 0
    first_instant = None
    intervals = collections.defaultdict(list)  # tid -> [(left, back, class)]
    for t, prev_comm, prev_pid, prev_state, next_comm, next_pid, frames in events:
        if next_comm == SAMPLER_THREAD and (last_instant is None or t - last_instant > 0.002):
            if last_instant is not None:
                weight = t - last_instant
                for cls, _ in off.values():
                    at_instants[cls] += weight
                instants += 1
                snapshot = {tid: cls for tid, (cls, _) in off.items()}
                ran = set()
            last_instant = t
            first_instant = first_instant if first_instant is not None else t
        if prev_comm == SAMPLER_THREAD and prev_state.startswith("S") and snapshot is not None:
            for tid, cls in snapshot.items():
                if tid in ran:
                    transitions[(cls, off[tid][0] if tid in off else "on CPU")] += 1
            snapshot = None
        # An exiting thread's last switch (X, Z) does not start a wait.
        if prev_comm == "postgres" and prev_pid in busy and prev_state[0] not in "XZ":
            off[prev_pid] = (class_of(prev_state, frames), t)
        if next_pid in off:
            cls, left = off.pop(next_pid)
            truth[cls] += t - left
            intervals[next_pid].append((left, t, cls))
            if snapshot is not None:
                ran.add(next_pid)
    if not instants:
        sys.exit(f"offcpu_groundtruth: no run of the wait sampler ({SAMPLER_THREAD}) recorded")
    exact, sampled = tracer_rows(sys.argv[1])

    print(f"{len(busy)} client backends, {instants} sampler instants")
    print(f"{'class':<10} {'truth ms':>10} {'instants ms':>12} {'exact ms':>10} {'sampled ms':>11}")
    for cls in CLASSES + ("latch", "other"):
        print(
            f"{cls:<10} {truth[cls] * 1e3:>10.1f} {at_instants[cls] * 1e3:>12.1f} "
            f"{exact.get(cls, 0.0):>10.1f} {sampled.get(cls, 0.0):>11.1f}"
        )
    print("off CPU at an instant, ran before the sampler slept again: class then -> now, per instant")
    for (then, now), n in sorted(transitions.items(), key=lambda kv: -kv[1]):
        print(f"  {then:<10} -> {now:<10} {n / instants:.3f}")

    def ratio(a, b):
        return f"{a / b:.3f}" if b else "nan"

    figures = []
    for cls in ("futex", "preempted"):
        t_ms, i_ms = truth[cls] * 1e3, at_instants[cls] * 1e3
        figures += [
            f"{cls}_exact_over_truth={ratio(exact.get(cls, 0.0), t_ms)}",
            f"{cls}_instants_over_truth={ratio(i_ms, t_ms)}",
            f"{cls}_sampled_over_instants={ratio(sampled.get(cls, 0.0), i_ms)}",
        ]
    ran_per_instant = sum(transitions.values()) / instants
    floor = noise_floor(intervals, first_instant, last_instant, instants)
    print(
        f"a perfect sampler at {instants} random instants, {TRIALS} draws: futex within 10% of the "
        f"truth in {floor['futex']:.0%}, futex + preempted + io in {floor['comparable']:.0%}"
    )
    print(
        "offcpu-groundtruth: "
        + " ".join(figures)
        + f" ran_during_run_per_instant={ran_per_instant:.2f}"
        + f" perfect_futex_within_10pct={floor['futex']:.2f}"
        + f" perfect_comparable_within_10pct={floor['comparable']:.2f}"
    )


def noise_floor(intervals, start, end, count):
    """How often a sampler that judged every thread rightly, at `count` instants drawn at random
    in [start, end), lands within 10% of the true futex and comparable time over that span."""
    truth = collections.Counter()
    for waits in intervals.values():
        for left, back, cls in waits:
            overlap = min(back, end) - max(left, start)
            if overlap > 0:
                truth[cls] += overlap
    starts = {tid: [w[0] for w in waits] for tid, waits in intervals.items()}
    weight = (end - start) / count
    comparable = sum(truth[c] for c in CLASSES)
    rng = random.Random(1)
    within = collections.Counter()
    for _ in range(TRIALS):
        seen = collections.Counter()
        for t in (start + rng.random() * (end - start) for _ in range(count)):
            for tid, waits in intervals.items():
                i = bisect.bisect_right(starts[tid], t) - 1
                if i >= 0 and waits[i][1] > t:
                    seen[waits[i][2]] += weight
        if truth["futex"] and abs(seen["futex"] / truth["futex"] - 1) <= 0.1:
            within["futex"] += 1
        if comparable and abs(sum(seen[c] for c in CLASSES) / comparable - 1) <= 0.1:
            within["comparable"] += 1
    return {k: within[k] / TRIALS for k in ("futex", "comparable")}


if __name__ == "__main__":
    main()

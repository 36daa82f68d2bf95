#!/usr/bin/env python3
"""Generates agent/src/postgres/vNN/pointer_tables.rs: the tables of function pointers through
which a stripped PostgreSQL of major NN reaches static functions (TTSOpsVirtual & co., the heap
table AM `heapam_methods`), and which function each field holds.

    scripts/gen-pg-pointer-tables.py --major 17          # write agent/src/postgres/v17/pointer_tables.rs
    scripts/gen-pg-pointer-tables.py --major 17 --check  # regenerate and fail if it differs

How: each struct's function-pointer fields are read from that major's server headers, and the C
compiler gives their offsets, the struct's size and its NodeTag. Which function a table holds in
each field is read from a build of the same major that has a symbol table: the table's address
(its symbol, or the `lea` of `GetHeapamTableAmRoutine`), the R_X86_64_RELATIVE relocation of each
field, and the symbol at the relocation's target. Null fields are left out.

Builds: 14, 16, 17, 18 are the upstream builds and headers `scripts/pg-majors.sh` caches (they
keep `.symtab`); 15 is Debian's postgresql-15 headers with the no-frame-pointer build of the same
source (`scripts/build-postgres-nofp.sh`), whose debug file has the symbols. The agent's tests
check the result against the headers and, stripped, against each build's own symbols.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTRO_15_INCLUDE = "/usr/include/postgresql/15/server"

# (symbol, the generated constant's name) of the exported TupleTableSlotOps tables.
SLOT_OPS = [
    ("TTSOpsVirtual", "VIRTUAL"),
    ("TTSOpsHeapTuple", "HEAP_TUPLE"),
    ("TTSOpsMinimalTuple", "MINIMAL_TUPLE"),
    ("TTSOpsBufferHeapTuple", "BUFFER_HEAP_TUPLE"),
]
HEAPAM_GETTER = "GetHeapamTableAmRoutine"


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, check=True, **kw).stdout


def pointer_fields(include, header, struct):
    """Names of the function-pointer fields of `struct`, in declaration order."""
    src = open(os.path.join(include, header)).read()
    m = re.search(r"(typedef )?struct %s\s*\{(.*?)\}\s*(%s)?\s*;" % (struct, struct), src, re.S)
    if not m:
        sys.exit("%s: no struct %s" % (header, struct))
    body = re.sub(r"/\*.*?\*/", "", m.group(2), flags=re.S)
    return re.findall(r"\(\*\s*(\w+)\)", body)


def layout(include, header, struct, fields, tagged):
    """(sizeof, NodeTag or None, offsets of `fields`), as that major's compiler lays it out."""
    tag = "(int) T_%s" % struct if tagged else "-1"
    lines = ['    printf("%%zu %%d\\n", sizeof(%s), %s);' % (struct, tag)]
    lines += ['    printf("%%zu\\n", offsetof(%s, %s));' % (struct, f) for f in fields]
    # port.h maps printf to pg_printf, which lives in libpgport; the program links only libc.
    prog = '#include "postgres.h"\n#undef printf\n#include <stddef.h>\n#include <stdio.h>\n'
    prog += '#include "%s"\nint main(void)\n{\n%s\n    return 0;\n}\n' % (header, "\n".join(lines))
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "p.c"), "w").write(prog)
        run(["cc", "-I" + include, "-o", os.path.join(d, "p"), os.path.join(d, "p.c")])
        out = run([os.path.join(d, "p")]).split("\n")
    size, tag = (int(x) for x in out[0].split())
    return size, (tag if tagged else None), [int(x) for x in out[1 : 1 + len(fields)]]


def relocations(binary):
    relative = {}
    for line in run(["readelf", "-rW", binary]).splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "R_X86_64_RELATIVE":
            relative[int(f[0], 16)] = int(f[3], 16)
    return relative


def symbols(binary):
    functions, objects = {}, {}
    for line in run(["readelf", "-Ws", "--dyn-syms", binary]).splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] in ("FUNC", "OBJECT"):
            address, name = int(f[1], 16), f[7].split("@")[0]
            if f[3] == "FUNC":
                functions.setdefault(address, name)
            else:
                objects.setdefault(name, address)
    return functions, objects


def heapam_address(binary, getter):
    out = run(["objdump", "-d", "--no-show-raw-insn", "--start-address=%d" % getter,
               "--stop-address=%d" % (getter + 16), binary])
    m = re.search(r"lea\s+0x\w+\(%rip\),%rax\s+#\s*(\w+)", out)
    if not m:
        sys.exit("%s does not return its table with lea rax, [rip+X]" % HEAPAM_GETTER)
    return int(m.group(1), 16)


def slots(base, fields, offsets, relative, functions):
    rows = []
    for field, offset in zip(fields, offsets):
        target = relative.get(base + offset)
        if target is None:
            continue
        name = functions.get(target)
        if name is None:
            sys.exit("field %s holds %#x, which no symbol names" % (field, target))
        rows.append('    slot(%d, "%s", "%s"),' % (offset, field, name))
    return "\n".join(rows)


def builds(major):
    """(include dir, build with relocations, file with its symbols, description)."""
    if major == 15:
        prefix = run([os.path.join(REPO, "scripts/build-postgres-nofp.sh")]).strip().splitlines()[-1]
        binary = os.path.join(prefix, "bin/postgres")
        build_id = re.search(r"Build ID: (\w+)", run(["readelf", "-n", binary])).group(1)
        debug = os.path.join(prefix, "debug/.build-id/%s/%s.debug" % (build_id[:2], build_id[2:]))
        return DISTRO_15_INCLUDE, binary, debug, "Debian's 15 headers and the no-frame-pointer build of that source"
    for line in run([os.path.join(REPO, "scripts/pg-majors.sh")]).splitlines():
        m, d = line.split(" ", 1)
        if int(m) == major:
            binary = os.path.join(d, "bin/postgres")
            return os.path.join(d, "include/server"), binary, binary, "the upstream build and headers %s" % os.path.basename(d)
    sys.exit("scripts/pg-majors.sh lists no PostgreSQL %d" % major)


def generate(major):
    include, binary, symbol_file, source = builds(major)
    relative = relocations(binary)
    functions, objects = symbols(symbol_file)
    out = [
        "//! The tables of function pointers of PostgreSQL %d that name static functions of a" % major,
        "//! stripped build (see `crate::postgres::pointer_tables`).",
        "//!",
        "//! Generated by `scripts/gen-pg-pointer-tables.py --major %d`, do not edit; from" % major,
        "//! %s." % source,
        "",
        "use symbolizer::{PointerTable, Slot, TableAt};",
        "",
        "use crate::postgres::pointer_tables::slot;",
        "",
    ]
    fields = pointer_fields(include, "executor/tuptable.h", "TupleTableSlotOps")
    size, _, offsets = layout(include, "executor/tuptable.h", "TupleTableSlotOps", fields, False)
    tables = []
    for symbol, const in SLOT_OPS:
        if symbol not in objects:
            sys.exit("no symbol %s" % symbol)
        out.append("const TTS_OPS_%s: &[Slot] = &[" % const)
        out.append(slots(objects[symbol], fields, offsets, relative, functions))
        out.append("];")
        out.append("")
        tables.append("    PointerTable {\n        at: TableAt::Symbol(\"%s\"),\n        struct_name: \"TupleTableSlotOps\",\n"
                      "        size: %d,\n        tag: None,\n        slots: TTS_OPS_%s,\n    }," % (symbol, size, const))
    fields = pointer_fields(include, "access/tableam.h", "TableAmRoutine")
    size, tag, offsets = layout(include, "access/tableam.h", "TableAmRoutine", fields, True)
    getter = next((a for a, n in functions.items() if n == HEAPAM_GETTER), None)
    if getter is None:
        sys.exit("no function %s" % HEAPAM_GETTER)
    out.append("const HEAPAM_METHODS: &[Slot] = &[")
    out.append(slots(heapam_address(binary, getter), fields, offsets, relative, functions))
    out.append("];")
    out.append("")
    tables.append("    PointerTable {\n        at: TableAt::ReturnedBy(\"%s\"),\n        struct_name: \"TableAmRoutine\",\n"
                  "        size: %d,\n        tag: Some(%d),\n        slots: HEAPAM_METHODS,\n    }," % (HEAPAM_GETTER, size, tag))
    out.append("pub(crate) const POINTER_TABLES: &[PointerTable] = &[")
    out.extend(tables)
    out.append("];")
    return rustfmt("\n".join(out) + "\n")


def rustfmt(text):
    """Formats like `cargo fmt` does in this repo, so `cargo fmt` leaves the generated file alone."""
    cmd = ["rustfmt", "--edition", "2021", "--config-path", os.path.join(REPO, "rustfmt.toml")]
    res = subprocess.run(cmd, input=text, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit("rustfmt failed on the generated code:\n" + res.stderr)
    return res.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--major", type=int, required=True, choices=[14, 15, 16, 17, 18])
    ap.add_argument("--check", action="store_true", help="fail if the file differs")
    args = ap.parse_args()
    path = os.path.join(REPO, "agent/src/postgres/v%d/pointer_tables.rs" % args.major)
    text = generate(args.major)
    if args.check:
        old = open(path).read() if os.path.exists(path) else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), path, "generated"))
            sys.exit("%s is not what the generator gives" % path)
        return
    open(path, "w").write(text)
    print("wrote " + path)


if __name__ == "__main__":
    main()

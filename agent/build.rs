//! Compiles the BPF programs in `bpf/` with clang into one object in OUT_DIR, against a
//! `vmlinux.h` that bpftool generates from the build machine's BTF. Relocations are CO-RE, so
//! the object runs on any kernel with BTF; the header only provides type definitions.
//!
//! The programs are split by family in `bpf/`, and [`BPF_PARTS`] lists them: one object, so
//! that every program shares the maps, built from a unit this script writes that includes
//! each part in order. [`KFUNC_PARTS`] make a second object, of the programs that call kfuncs
//! (aya cannot load those; libbpf loads it, sharing the first object's maps).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The parts of the BPF object, relative to `bpf/`, in the order they are included: each may
/// use what the parts before it define.
const BPF_PARTS: &[&str] = &[
    // Shared: maps, attribution readers, stack capture.
    "maps.bpf.h",
    "attribution.bpf.h",
    "stacks.bpf.h",
    "off_cpu_classes.bpf.h",
    "wait_sampler.bpf.h",
    // Program families.
    "on_cpu.bpf.c",
    "function_probes.bpf.c",
    "triggers.bpf.c",
    "processes.bpf.c",
    "off_cpu.bpf.c",
    "wait_iter.bpf.c",
];

/// The parts of the kfunc object: the shared parts its programs use, then its programs. Every
/// map it defines is also the main object's (it is created there and shared).
const KFUNC_PARTS: &[&str] = &[
    "maps.bpf.h",
    "attribution.bpf.h",
    "stacks.bpf.h",
    "off_cpu_classes.bpf.h",
    "wait_sampler.bpf.h",
    "wait_targets.bpf.c",
];

/// The objects the agent embeds (`agent/src/bpf/mod.rs`, `agent/src/bpf/wait_targets.rs`).
const BPF_OBJECT: &str = "pgscope.bpf.o";
const KFUNC_OBJECT: &str = "pgscope-kfunc.bpf.o";

/// The open-coded task iterator's state (include/uapi/linux/bpf.h, Linux 6.7): declared in
/// the kfunc unit when the build machine's BTF predates it, so that the object builds anywhere
/// (the kernel it runs on decides whether it loads).
const BPF_ITER_TASK: &str = "struct bpf_iter_task { __u64 __opaque[3]; } __attribute__((aligned(8)));";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let bpf_dir = manifest_dir.join("../bpf");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));

    println!("cargo:rerun-if-changed={}", bpf_dir.join("include").display());
    println!("cargo:rerun-if-env-changed=PGSCOPE_VMLINUX_BTF");
    let vmlinux_h = out_dir.join("vmlinux.h");
    generate_vmlinux_h(&vmlinux_h);

    // A part added to bpf/ but not to the list would be silently left out of the object.
    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    check_every_part_is_listed(&bpf_dir);
    let unit = out_dir.join("pgscope.bpf.c");
    std::fs::write(&unit, unit_source(&bpf_dir, BPF_PARTS, "")).expect("write the BPF unit into OUT_DIR");
    let vmlinux = std::fs::read_to_string(&vmlinux_h).expect("read vmlinux.h back");
    let iter_task = if vmlinux.contains("struct bpf_iter_task {") {
        ""
    } else {
        BPF_ITER_TASK
    };
    let kfunc_unit = out_dir.join("pgscope-kfunc.bpf.c");
    std::fs::write(&kfunc_unit, unit_source(&bpf_dir, KFUNC_PARTS, iter_task))
        .expect("write the kfunc BPF unit into OUT_DIR");
    generate_abi(
        &bpf_dir.join("include/pgscope.h"),
        &out_dir.join("pgscope_abi.rs"),
    );
    for (unit, object) in [(&unit, BPF_OBJECT), (&kfunc_unit, KFUNC_OBJECT)] {
        compile_bpf(unit, &out_dir.join(object), &out_dir, &bpf_dir.join("include"));
    }
}

fn check_every_part_is_listed(bpf_dir: &Path) {
    let entries =
        std::fs::read_dir(bpf_dir).unwrap_or_else(|e| panic!("cannot list `{}`: {e}", bpf_dir.display()));
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_part = name.ends_with(".bpf.c") || name.ends_with(".bpf.h");
        let listed = BPF_PARTS.contains(&name.as_str()) || KFUNC_PARTS.contains(&name.as_str());
        assert!(
            !is_part || listed,
            "bpf/{name} is in neither BPF_PARTS nor KFUNC_PARTS (agent/build.rs): add it where it belongs in the order"
        );
    }
}

/// The Rust side of `pgscope.h`: its structs, enums and constants as the header defines them,
/// so that one cannot change without the other (`agent/src/bpf/abi.rs` builds on them).
fn generate_abi(header: &Path, out: &Path) {
    println!("cargo:rerun-if-changed={}", header.display());
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_item("pgscope_.*")
        .allowlist_item("PGSCOPE_.*")
        .constified_enum_module("pgscope_.*")
        .derive_default(true)
        .derive_eq(true)
        .derive_hash(true)
        .layout_tests(false)
        .use_core()
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "bindgen cannot read `{}`: {e}; run `make deps` (libclang)",
                header.display()
            )
        });
    bindings
        .write_to_file(out)
        .unwrap_or_else(|e| panic!("cannot write `{}`: {e}", out.display()));
}

/// The C unit: the headers every part needs, `extra` declarations, the license, then each part
/// by absolute path.
fn unit_source(bpf_dir: &Path, parts: &[&str], extra: &str) -> String {
    let mut unit = String::from(
        "// SPDX-License-Identifier: GPL-2.0\n\
         /* Written by agent/build.rs from its list of parts: one BPF object. */\n\
         #include \"vmlinux.h\"\n\
         #include <bpf/bpf_helpers.h>\n\
         #include <bpf/bpf_tracing.h>\n\
         #include <bpf/bpf_core_read.h>\n\
         #include \"pgscope.h\"\n\n\
         char LICENSE[] SEC(\"license\") = \"GPL\";\n\n",
    );
    if !extra.is_empty() {
        unit.push_str(extra);
        unit.push_str("\n\n");
    }
    for part in parts {
        let path = bpf_dir
            .join(part)
            .canonicalize()
            .unwrap_or_else(|e| panic!("BPF part `bpf/{part}` listed in build.rs: {e}"));
        println!("cargo:rerun-if-changed={}", path.display());
        unit.push_str(&format!("#include \"{}\"\n", path.display()));
    }
    unit
}

fn generate_vmlinux_h(out: &Path) {
    let btf = env::var("PGSCOPE_VMLINUX_BTF").unwrap_or_else(|_| "/sys/kernel/btf/vmlinux".into());
    let output = Command::new("bpftool")
        .args(["btf", "dump", "file", &btf, "format", "c"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run bpftool ({e}); run `make deps` to install it"));
    if !output.status.success() {
        panic!(
            "bpftool could not dump `{btf}`: {}; the kernel needs CONFIG_DEBUG_INFO_BTF, or set PGSCOPE_VMLINUX_BTF",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    std::fs::write(out, output.stdout).expect("write vmlinux.h into OUT_DIR");
}

fn compile_bpf(src: &Path, object: &Path, vmlinux_dir: &Path, include_dir: &Path) {
    let status = Command::new("clang")
        .args([
            "-g",
            "-O2",
            "-target",
            "bpf",
            "-D__TARGET_ARCH_x86",
            "-Wall",
            "-Werror",
        ])
        .arg("-I")
        .arg(vmlinux_dir)
        .arg("-I")
        .arg(include_dir)
        .arg("-c")
        .arg(src)
        .arg("-o")
        .arg(object)
        .status()
        .unwrap_or_else(|e| panic!("cannot run clang ({e}); run `make deps` to install it"));
    assert!(status.success(), "clang failed on `{}`", src.display());
}

//! Compiles the BPF programs in `bpf/` with clang into OUT_DIR, against a `vmlinux.h` that
//! bpftool generates from the build machine's BTF. Relocations are CO-RE, so the objects run on
//! any kernel with BTF; the header only provides type definitions.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every BPF program the agent embeds, relative to `bpf/`.
const BPF_SOURCES: &[&str] = &["pgscope.bpf.c"];

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let bpf_dir = manifest_dir.join("../bpf");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));

    println!("cargo:rerun-if-changed={}", bpf_dir.join("include").display());
    println!("cargo:rerun-if-env-changed=PGSCOPE_VMLINUX_BTF");
    let vmlinux_h = out_dir.join("vmlinux.h");
    generate_vmlinux_h(&vmlinux_h);

    for source in BPF_SOURCES {
        let src = bpf_dir.join(source);
        println!("cargo:rerun-if-changed={}", src.display());
        let object = out_dir.join(source.replace(".bpf.c", ".bpf.o"));
        compile_bpf(&src, &object, &out_dir, &bpf_dir.join("include"));
    }
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

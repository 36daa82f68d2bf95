//! Building the C fixtures with `cc` and reading the snapshots they record.

#![allow(dead_code)] // each test binary uses a different part

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use symbolizer::{parse_maps, Location, MapEntry, Symbolizer, UnwoundStack, UserRegs};
use tempfile::TempDir;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// Flags of the main fixture: no frame pointers (like glibc and RHEL's Postgres), PIE, exported
/// dynamic symbols (like Postgres), functions emitted in source order.
const EXE_FLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-fomit-frame-pointer",
    "-fno-inline",
    "-fno-optimize-sibling-calls",
    "-fno-toplevel-reorder",
    "-rdynamic",
    "-Wl,--build-id",
    "-Wl,-rpath,$ORIGIN",
];

/// Frame pointers and no unwind info at all (not even linker-generated PLT unwind info).
const LIB_FLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-fno-omit-frame-pointer",
    "-fno-asynchronous-unwind-tables",
    "-fno-unwind-tables",
    "-fPIC",
    "-shared",
    "-nostartfiles",
    "-Wl,--no-ld-generated-unwind-info",
    "-Wl,--build-id",
];

/// A temp dir with `libfp.so` built in it.
pub struct Fixtures {
    pub dir: TempDir,
}

/// What a fixture run recorded.
pub struct Snapshot {
    pub regs: UserRegs,
    pub stack: Vec<u8>,
    pub maps: Vec<MapEntry>,
}

impl Fixtures {
    pub fn new() -> Fixtures {
        let dir = tempfile::tempdir().expect("create temp dir");
        let fixtures = Fixtures { dir };
        let lib = fixtures.path("libfp.so");
        let mut args: Vec<String> = LIB_FLAGS.iter().map(|s| s.to_string()).collect();
        args.extend([
            "-o".into(),
            lib.display().to_string(),
            format!("{FIXTURES}/libfp.c"),
        ]);
        tool("cc", &args);
        fixtures
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Build `fixture.c` as `name` with the standard flags plus `extra`.
    pub fn build_exe(&self, name: &str, extra: &[&str]) -> PathBuf {
        let exe = self.path(name);
        let mut args: Vec<String> = EXE_FLAGS.iter().map(|s| s.to_string()).collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend([
            "-o".into(),
            exe.display().to_string(),
            format!("{FIXTURES}/fixture.c"),
            "-L".into(),
            self.dir.path().display().to_string(),
            "-lfp".into(),
        ]);
        tool("cc", &args);
        exe
    }

    /// Copy `from` to `name` and strip the copy (no .symtab, .dynsym kept).
    pub fn stripped_copy(&self, from: &Path, name: &str) -> PathBuf {
        let to = self.path(name);
        std::fs::copy(from, &to).expect("copy fixture");
        tool("strip", &["--strip-all".into(), to.display().to_string()]);
        to
    }

    /// Run `exe` in `mode` and read what it recorded.
    pub fn run(&self, exe: &Path, mode: &str) -> Snapshot {
        let out = self.out_dir(exe, mode);
        let status = while_busy(|| Command::new(exe).arg(mode).env("FIXTURE_OUT", &out).status())
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
        assert!(status.success(), "{} {mode} failed: {status}", exe.display());
        read_snapshot(&out)
    }

    /// Start `exe` in `mode`, keep it alive (blocked on stdin) once it has recorded its stack.
    pub fn spawn_waiting(&self, exe: &Path, mode: &str) -> (Child, Snapshot) {
        let out = self.out_dir(exe, mode);
        let mut child = while_busy(|| {
            Command::new(exe)
                .arg(mode)
                .env("FIXTURE_OUT", &out)
                .env("FIXTURE_WAIT", "1")
                .stdin(Stdio::piped())
                .spawn()
        })
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
        let ready = out.join("ready");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready.exists() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{} exited early: {status}", exe.display());
            }
            assert!(Instant::now() < deadline, "fixture never became ready");
            std::thread::sleep(Duration::from_millis(5));
        }
        (child, read_snapshot(&out))
    }

    fn out_dir(&self, exe: &Path, mode: &str) -> PathBuf {
        let name = exe
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let out = self.path(&format!("out-{name}-{mode}"));
        std::fs::create_dir_all(&out).expect("create output dir");
        out
    }
}

fn read_snapshot(out: &Path) -> Snapshot {
    let regs = std::fs::read_to_string(out.join("regs.txt")).expect("regs.txt");
    let words: Vec<u64> = regs
        .split_whitespace()
        .map(|w| u64::from_str_radix(w, 16).expect("hex register"))
        .collect();
    assert_eq!(words.len(), 3, "regs.txt: {regs:?}");
    let maps_path = out.join("maps.txt");
    let maps_text = std::fs::read(&maps_path).expect("maps.txt");
    Snapshot {
        regs: UserRegs {
            ip: words[0],
            sp: words[1],
            bp: words[2],
        },
        stack: std::fs::read(out.join("stack.bin")).expect("stack.bin"),
        maps: parse_maps(&maps_text, &maps_path).expect("recorded maps parse"),
    }
}

/// Run a tool, failing the test with its stderr if it fails.
pub fn tool(program: &str, args: &[String]) {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{program}` (needed to build test fixtures): {e}"));
    assert!(
        output.status.success(),
        "`{program} {}` failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Defined symbols of `path` from `nm -S`: name -> (address, size).
pub fn nm(path: &Path) -> HashMap<String, (u64, u64)> {
    let output = Command::new("nm")
        .args(["-S", "--defined-only"])
        .arg(path)
        .output()
        .expect("run nm");
    assert!(output.status.success(), "nm {} failed", path.display());
    let mut symbols = HashMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (addr, size, name) = match fields.as_slice() {
            [addr, size, _kind, name] => (addr, u64::from_str_radix(size, 16).unwrap_or(0), name),
            [addr, _kind, name] => (addr, 0, name),
            _ => continue,
        };
        if let Ok(addr) = u64::from_str_radix(addr, 16) {
            symbols.insert(name.to_string(), (addr, size));
        }
    }
    symbols
}

/// Names of all frames.
pub fn names(symbolizer: &mut Symbolizer, stack: &UnwoundStack) -> Vec<String> {
    stack
        .frames
        .iter()
        .map(|loc| symbolizer.symbolize(loc).name.to_string())
        .collect()
}

/// The module-relative address of a frame.
pub fn addr(loc: &Location) -> u64 {
    match loc {
        Location::InModule { addr, .. } => *addr,
        Location::Unmapped { addr } => panic!("frame at {addr:#x} is unmapped"),
    }
}

/// Runs `start` again while it fails with "Text file busy": a fixture this process just wrote
/// is still open for writing in a child another test thread forked meanwhile, until that child
/// execs (`ETXTBSY`, seen in CI). Gives up after a few seconds.
fn while_busy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match start() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            result => return result,
        }
    }
}

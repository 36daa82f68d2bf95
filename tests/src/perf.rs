//! `perf record` with DWARF unwinding as the reference profiler.
//!
//! perf cannot name static functions of a stripped binary and prints `[unknown]` for each of
//! them (pgscope prints `postgres+0x…`); [`comparable_name`] maps both spellings to `[unknown]`
//! so self-time tables can be compared. This merges all unnamed functions into one row.
//!
//! perf does not read a `.build-id/xx/rest.debug` tree outside `/usr/lib/debug`, so for a build
//! with separate debug files [`PerfRecording::finish`] puts them into a build-id cache of its
//! own (see [`BuildIdCache`]), and perf names every function, as pgscope does with `--debug-dir`.
//! perf never uses `~/.debug`: each recording has its own cache in the test's temp dir, so
//! nothing leaks between runs or into the machine's cache.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::process::{describe, run_checked, wait_timeout};
use crate::profile::{is_unnamed_frame, strip_kernel_suffix, Profile, Stack, KERNEL_SUFFIX};

/// perf's name for a function it cannot symbolize.
pub const PERF_UNKNOWN: &str = "[unknown]";

/// Longest a `perf script`, `buildid-list` or `buildid-cache` may run.
const POSTPROCESS_TIMEOUT: Duration = Duration::from_secs(300);

/// How perf's sampling timer runs: with the process, or on every CPU.
///
/// With `-p` (`Process`) the timer counts the process's own CPU time: stopped when it leaves
/// its CPU, restarted with what was left of the period when it is back. A period that ran out
/// while the process was leaving its CPU (interrupts are off in the scheduler) is sampled when
/// it is back, where it wakes: a backend that waits for its client between short statements
/// had 1.22% of perf's samples at `finish_task_switch` under `secure_read` this way, against
/// 0.07% with `-a` and 0.12-0.45% with pgscope, and every share under the statements was that
/// much lower. With `-a` (`AllCpus`) each CPU's timer runs on its own and the process is
/// sampled when it is the one on that CPU, as pgscope samples: the two then differ in how
/// they unwind and name, not in where their timers fire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfTimer {
    Process,
    AllCpus,
}

/// A `perf record` running in the background on one process.
pub struct PerfRecording {
    child: Child,
    data: PathBuf,
    log: PathBuf,
    cache: BuildIdCache,
    duration: Duration,
    pid: u32,
    timer: PerfTimer,
}

impl PerfRecording {
    /// Starts `perf record -F <frequency> --call-graph dwarf,16384 -p <pid> -- sleep <secs>`,
    /// writing into `dir`. 16 KiB of stack reaches the process root in >99% of Postgres samples.
    pub fn start(pid: u32, duration: Duration, frequency: u32, dir: &Path) -> Result<Self> {
        Self::start_with(pid, duration, frequency, dir, PerfTimer::Process)
    }

    /// [`PerfRecording::start`] with the sampling timer `timer`; with [`PerfTimer::AllCpus`]
    /// perf records every CPU (`-a`) and [`PerfRecording::finish`] keeps `pid`'s samples.
    pub fn start_with(
        pid: u32,
        duration: Duration,
        frequency: u32,
        dir: &Path,
        timer: PerfTimer,
    ) -> Result<Self> {
        let data = dir.join(format!("perf-{pid}.data"));
        let log = dir.join(format!("perf-{pid}.log"));
        let cache = BuildIdCache::create(&dir.join(format!("perf-{pid}.buildid")))?;
        let log_file = File::create(&log).with_context(|| format!("cannot create `{}`", log.display()))?;
        let mut cmd = cache.perf();
        cmd.args(["record", "--no-buildid-cache", "-F", &frequency.to_string()])
            .args(["--call-graph", "dwarf,16384"]);
        match timer {
            PerfTimer::Process => cmd.args(["-p", &pid.to_string()]),
            PerfTimer::AllCpus => cmd.arg("-a"),
        };
        cmd.arg("-o")
            .arg(&data)
            .args(["--", "sleep", &format!("{}", duration.as_secs_f64())])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot run `{}` (is linux-perf installed?)", describe(&cmd)))?;
        Ok(PerfRecording {
            child,
            data,
            log,
            cache,
            duration,
            pid,
            timer,
        })
    }

    /// Waits for the recording to end and returns its samples (leaf frame included). With
    /// `debug_dir` (the root of a `.build-id/xx/rest.debug` tree, what `pgscope --debug-dir`
    /// takes), perf names the static functions of the recorded binaries that have a debug file
    /// there; it is an error if none has.
    pub fn finish(mut self, debug_dir: Option<&Path>) -> Result<Profile> {
        self.wait_recorded()?;
        if let Some(debug_dir) = debug_dir {
            self.cache.add_debug_files(&self.data, debug_dir)?;
        }
        let mut script = self.cache.perf();
        script
            .args(["script", "--no-inline", "-F", "comm,pid,ip,sym,dso", "-i"])
            .arg(&self.data);
        if self.timer == PerfTimer::AllCpus {
            script.arg(format!("--pid={}", self.pid));
        }
        let script = run_checked(&mut script, POSTPROCESS_TIMEOUT)?;
        let profile = parse_perf_script(&script)?;
        if profile.total() == 0 {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("perf recorded no samples: {}", log.trim());
        }
        Ok(profile)
    }

    /// Waits for the recording to end (its `sleep` to exit), without reading it: to end another
    /// profiler's window with perf's.
    pub fn wait_recorded(&mut self) -> Result<()> {
        let status = wait_timeout(&mut self.child, self.duration + Duration::from_secs(60))?;
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        match status {
            Some(s) if s.success() => {}
            Some(s) => bail!("perf record failed ({s}): {}", log.trim()),
            None => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("perf record did not finish: {}", log.trim());
            }
        }
        Ok(())
    }
}

impl Drop for PerfRecording {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Records `pid` for `duration` and returns the samples, named without debug files.
pub fn perf_record(pid: u32, duration: Duration, frequency: u32, dir: &Path) -> Result<Profile> {
    PerfRecording::start(pid, duration, frequency, dir)?.finish(None)
}

/// A perf build-id cache (`perf --buildid-dir`) private to one recording.
///
/// perf looks for a binary's symbols and unwind tables in its build-id cache first, then at the
/// binary's path and in `/usr/lib/debug`. `perf buildid-cache --add` of a stripped binary
/// caches it as `<cache>/<path>/<build-id>/elf`, and perf reads a `debug` file next to it (where
/// it puts the debug file it finds in `/usr/lib/debug/.build-id`) for symbols, while unwinding
/// with `elf`'s `.eh_frame`. Adding the `.debug` file itself instead names every function, but
/// perf then unwinds with the debug file's empty `.eh_frame` and every stack is its leaf alone.
#[derive(Debug)]
pub struct BuildIdCache {
    dir: PathBuf,
}

impl BuildIdCache {
    /// An empty cache at `dir` (created).
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
        Ok(BuildIdCache {
            dir: dir.to_path_buf(),
        })
    }

    /// `perf --buildid-dir <cache>`, to which the subcommand is appended.
    pub fn perf(&self) -> Command {
        let mut cmd = Command::new("perf");
        cmd.arg("--buildid-dir").arg(&self.dir);
        cmd
    }

    /// Caches every binary recorded in `data` whose build-id has a debug file in `debug_dir`,
    /// with that debug file. Returns how many were cached; fails when none was.
    pub fn add_debug_files(&self, data: &Path, debug_dir: &Path) -> Result<usize> {
        let list = run_checked(
            self.perf().args(["buildid-list", "-i"]).arg(data),
            POSTPROCESS_TIMEOUT,
        )?;
        let mut added = 0;
        for (build_id, binary) in parse_buildid_list(&list) {
            let debug = build_id_path(debug_dir, build_id, ".debug");
            // `[kernel.kallsyms]` and `[vdso]` are no files; binaries without a debug file keep
            // what perf finds on its own.
            if !debug.is_file() || !Path::new(binary).is_file() {
                continue;
            }
            run_checked(
                self.perf().args(["buildid-cache", "--add", binary]),
                POSTPROCESS_TIMEOUT,
            )?;
            let link = build_id_path(&self.dir, build_id, "");
            let entry = fs::canonicalize(&link).with_context(|| {
                format!(
                    "`perf buildid-cache --add {binary}` did not create `{}`",
                    link.display()
                )
            })?;
            ensure!(
                entry.join("elf").is_file(),
                "`{}` has no `elf`: perf's build-id cache layout is not the one this harness knows",
                entry.display()
            );
            std::os::unix::fs::symlink(&debug, entry.join("debug"))
                .with_context(|| format!("cannot link `{}` into `{}`", debug.display(), entry.display()))?;
            added += 1;
        }
        ensure!(
            added > 0,
            "no binary in `{}` has a debug file in `{}`; perf recorded:\n{}",
            data.display(),
            debug_dir.display(),
            list.trim()
        );
        Ok(added)
    }
}

/// `<root>/.build-id/<first two hex digits>/<rest><suffix>`, the layout of both a debug tree and
/// perf's build-id links.
fn build_id_path(root: &Path, build_id: &str, suffix: &str) -> PathBuf {
    let (head, rest) = build_id.split_at(2.min(build_id.len()));
    root.join(".build-id").join(head).join(format!("{rest}{suffix}"))
}

/// `perf buildid-list` lines: `<build-id hex> <path or [name]>`.
fn parse_buildid_list(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines().filter_map(|line| {
        let (id, path) = line.trim().split_once(' ')?;
        (id.len() > 2 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some((id, path.trim()))
    })
}

/// Parses `perf script -F comm,pid,ip,sym,dso` with call graphs: a `comm pid` header per sample,
/// then one `ip sym (dso)` line per frame, leaf first, and a blank line. Returns stacks root
/// first with kernel frames suffixed `_[k]`, each sample counted once.
pub fn parse_perf_script(text: &str) -> Result<Profile> {
    let mut stacks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            if let Some(frames) = current.take() {
                stacks.push(finish_stack(frames));
            }
        } else if line.starts_with(char::is_whitespace) {
            let frames = current.as_mut().with_context(|| {
                format!("perf script line {} is a frame outside a sample: `{line}`", i + 1)
            })?;
            frames.push(parse_frame(line).with_context(|| format!("perf script line {}", i + 1))?);
        } else {
            if let Some(frames) = current.take() {
                stacks.push(finish_stack(frames));
            }
            current = Some(Vec::new());
        }
    }
    if let Some(frames) = current {
        stacks.push(finish_stack(frames));
    }
    Ok(Profile { stacks })
}

fn finish_stack(mut leaf_first: Vec<String>) -> Stack {
    leaf_first.reverse();
    Stack {
        frames: leaf_first,
        count: 1,
    }
}

/// `    ffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])` → name.
fn parse_frame(line: &str) -> Result<String> {
    let line = line.trim();
    let (_ip, rest) = line
        .split_once(char::is_whitespace)
        .with_context(|| format!("no symbol in `{line}`"))?;
    let rest = rest.trim();
    let (sym, dso) = match rest.rfind(" (") {
        Some(at) if rest.ends_with(')') => (&rest[..at], &rest[at + 2..rest.len() - 1]),
        _ => (rest, ""),
    };
    let sym = if sym.is_empty() { PERF_UNKNOWN } else { sym };
    if dso.starts_with("[kernel") {
        Ok(format!("{sym}{KERNEL_SUFFIX}"))
    } else {
        Ok(sym.to_owned())
    }
}

/// A frame name both profilers spell the same: no `_[k]`, and pgscope's `object+0x…` becomes
/// perf's `[unknown]`.
pub fn comparable_name(frame: &str) -> String {
    let frame = strip_kernel_suffix(frame);
    if is_unnamed_frame(frame) {
        PERF_UNKNOWN.to_owned()
    } else {
        frame.to_owned()
    }
}

/// `true` for a function name either profiler prints when it cannot name one: perf's
/// `[unknown]` or pgscope's `object+0x…`.
pub fn is_unnamed(name: &str) -> bool {
    let name = strip_kernel_suffix(name);
    name == PERF_UNKNOWN || is_unnamed_frame(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = "\
postgres 18291 
\t          4eb757 generate_series_step_int4 (/usr/lib/postgresql/15/bin/postgres)
\t          3335e5 [unknown] (/usr/lib/postgresql/15/bin/postgres)
\t          155975 main (/usr/lib/postgresql/15/bin/postgres)
\t           27249 __libc_start_call_main (/usr/lib/x86_64-linux-gnu/libc.so.6)
\t          155f50 _start (/usr/lib/postgresql/15/bin/postgres)

postgres 18291 
\tffffffff817dafd9 ext4_nonda_switch ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t           f6483 __libc_pwrite64 (/usr/lib/x86_64-linux-gnu/libc.so.6)
";

    #[test]
    fn parses_samples_root_first() {
        let p = parse_perf_script(SCRIPT).unwrap();
        assert_eq!(p.total(), 2);
        assert_eq!(
            p.stacks[0].frames,
            [
                "_start",
                "__libc_start_call_main",
                "main",
                "[unknown]",
                "generate_series_step_int4"
            ]
        );
        assert!(p.stacks[0].starts_at_process_root());
        assert_eq!(
            p.stacks[1].frames,
            [
                "__libc_pwrite64",
                "entry_SYSCALL_64_after_hwframe_[k]",
                "ext4_nonda_switch_[k]"
            ]
        );
        let t = p.self_table(comparable_name);
        assert_eq!(t.pct("ext4_nonda_switch"), 50.0);
    }

    #[test]
    fn comparable_names() {
        assert_eq!(comparable_name("postgres+0x47c61c"), "[unknown]");
        assert_eq!(comparable_name("do_syscall_64_[k]"), "do_syscall_64");
        assert_eq!(comparable_name("int4mod"), "int4mod");
        assert!(is_unnamed("postgres+0x47c61c") && is_unnamed("[unknown]"));
        assert!(!is_unnamed("ExecInterpExpr"));
    }

    #[test]
    fn reads_buildid_list() {
        let list = "2931049c7947960f10da883c164e292835954ea1 /opt/pg/bin/postgres\n\
                    e17735e083bee5962b452ede4e28f9520fb75fa7 [vdso]\n";
        let entries: Vec<_> = parse_buildid_list(list).collect();
        assert_eq!(
            entries,
            [
                ("2931049c7947960f10da883c164e292835954ea1", "/opt/pg/bin/postgres"),
                ("e17735e083bee5962b452ede4e28f9520fb75fa7", "[vdso]")
            ]
        );
        assert_eq!(
            build_id_path(Path::new("/opt/pg/debug"), entries[0].0, ".debug"),
            Path::new("/opt/pg/debug/.build-id/29/31049c7947960f10da883c164e292835954ea1.debug")
        );
    }
}

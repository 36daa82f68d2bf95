//! `perf record` with DWARF unwinding as the reference profiler.
//!
//! perf cannot name static functions of a stripped binary and prints `[unknown]` for each of
//! them (pgscope prints `postgres+0x…`); [`comparable_name`] maps both spellings to `[unknown]`
//! so self-time tables can be compared. This merges all unnamed functions into one row.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::{describe, run_checked, wait_timeout};
use crate::profile::{is_unnamed_frame, strip_kernel_suffix, Profile, Stack, KERNEL_SUFFIX};

/// perf's name for a function it cannot symbolize.
pub const PERF_UNKNOWN: &str = "[unknown]";

/// A `perf record` running in the background on one process.
pub struct PerfRecording {
    child: Child,
    data: PathBuf,
    log: PathBuf,
    duration: Duration,
}

impl PerfRecording {
    /// Starts `perf record -F <frequency> --call-graph dwarf,16384 -p <pid> -- sleep <secs>`,
    /// writing into `dir`. 16 KiB of stack reaches the process root in >99% of Postgres samples.
    pub fn start(pid: u32, duration: Duration, frequency: u32, dir: &Path) -> Result<Self> {
        let data = dir.join(format!("perf-{pid}.data"));
        let log = dir.join(format!("perf-{pid}.log"));
        let log_file = File::create(&log).with_context(|| format!("cannot create `{}`", log.display()))?;
        let mut cmd = Command::new("perf");
        cmd.args(["record", "--no-buildid-cache", "-F", &frequency.to_string()])
            .args(["--call-graph", "dwarf,16384", "-p", &pid.to_string(), "-o"])
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
            duration,
        })
    }

    /// Waits for the recording to end and returns its samples (leaf frame included).
    pub fn finish(mut self) -> Result<Profile> {
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
        let script = run_checked(
            Command::new("perf")
                .args(["script", "--no-inline", "-F", "comm,pid,ip,sym,dso", "-i"])
                .arg(&self.data),
            Duration::from_secs(300),
        )?;
        let profile = parse_perf_script(&script)?;
        if profile.total() == 0 {
            bail!("perf recorded no samples: {}", log.trim());
        }
        Ok(profile)
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

/// Records `pid` for `duration` and returns the samples.
pub fn perf_record(pid: u32, duration: Duration, frequency: u32, dir: &Path) -> Result<Profile> {
    PerfRecording::start(pid, duration, frequency, dir)?.finish()
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
    }
}

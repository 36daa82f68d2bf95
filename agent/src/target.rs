//! Resolves what the user asked to profile (`--pid`, `--instance`) into Postgres processes, and
//! refuses anything that is not Postgres with a sentence saying what to pass instead.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// One process as seen in /proc.
#[derive(Clone, Debug)]
pub struct ProcessInfo {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
    /// Basename of the executable, when /proc/PID/exe is readable.
    pub exe_name: Option<String>,
}

impl ProcessInfo {
    pub fn read(pid: u32) -> Option<Self> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (comm, ppid) = parse_stat(&stat)?;
        let exe_name = fs::read_link(format!("/proc/{pid}/exe"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .map(|n| n.trim_end_matches(" (deleted)").to_string());
        Some(Self {
            pid,
            ppid,
            comm,
            exe_name,
        })
    }

    /// Postgres processes run the `postgres` binary (`postmaster` is an old alias of it).
    pub fn is_postgres(&self) -> bool {
        match &self.exe_name {
            Some(exe) => exe == "postgres" || exe == "postmaster",
            None => self.comm == "postgres" || self.comm == "postmaster",
        }
    }
}

/// Parses `comm` and `ppid` out of /proc/PID/stat; comm may contain spaces and parentheses.
fn parse_stat(stat: &str) -> Option<(String, u32)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let _state = rest.next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some((comm, ppid))
}

/// What one trace session profiles.
#[derive(Clone, Debug)]
pub enum Target {
    /// One backend (or any single Postgres process).
    Backend(ProcessInfo),
    /// A postmaster and every process it forks, now and during the trace. Its children are
    /// scanned when the probes attach, after the postmaster is in the filter, so that no
    /// backend forked in between is missed.
    Instance { postmaster: ProcessInfo },
}

impl Target {
    /// The traced backend, or the instance's postmaster.
    pub fn pid(&self) -> u32 {
        match self {
            Target::Backend(process) => process.pid,
            Target::Instance { postmaster } => postmaster.pid,
        }
    }

    /// A short description for headers and titles.
    pub fn describe(&self) -> String {
        match self {
            Target::Backend(p) => format!("backend {}", p.pid),
            Target::Instance { postmaster, .. } => format!("instance of postmaster {}", postmaster.pid),
        }
    }
}

/// Resolves `--pid`.
pub fn backend(pid: u32) -> Result<Target> {
    let process = postgres_process(pid)?;
    Ok(Target::Backend(process))
}

/// Resolves `--instance`, given a postmaster PID or a data directory.
pub fn instance(spec: &str) -> Result<Target> {
    let pid = match spec.parse::<u32>() {
        Ok(pid) => pid,
        Err(_) => postmaster_pid_of(Path::new(spec))?,
    };
    let postmaster = postgres_process(pid)?;
    if let Some(parent) = ProcessInfo::read(postmaster.ppid) {
        if parent.is_postgres() {
            bail!(
                "PID {pid} is a backend of the instance run by postmaster {}: pass --instance {} \
                 for the whole instance, or --pid {pid} for this backend",
                parent.pid,
                parent.pid
            );
        }
    }
    Ok(Target::Instance { postmaster })
}

fn postgres_process(pid: u32) -> Result<ProcessInfo> {
    let Some(process) = ProcessInfo::read(pid) else {
        bail!(
            "no process with PID {pid}: find backend PIDs with \
             `SELECT pid, state, query FROM pg_stat_activity`"
        );
    };
    if !process.is_postgres() {
        bail!(
            "PID {pid} is not a Postgres process (it runs `{}`): pass the PID of a backend from \
             pg_stat_activity, or a postmaster PID / data directory with --instance",
            process.exe_name.as_deref().unwrap_or(&process.comm)
        );
    }
    Ok(process)
}

/// The first line of `postmaster.pid` is the postmaster's PID.
fn postmaster_pid_of(data_dir: &Path) -> Result<u32> {
    let pid_file: PathBuf = data_dir.join("postmaster.pid");
    if !data_dir.is_dir() {
        bail!(
            "`{}` is neither a PID nor a data directory: pass a postmaster PID or the data \
             directory of a running instance to --instance",
            data_dir.display()
        );
    }
    let text = fs::read_to_string(&pid_file).with_context(|| {
        format!(
            "`{}` has no readable postmaster.pid: is the instance running?",
            data_dir.display()
        )
    })?;
    text.lines()
        .next()
        .and_then(|line| line.trim().parse().ok())
        .with_context(|| format!("`{}` does not start with a PID", pid_file.display()))
}

/// Current children of `pid` (backends and auxiliary processes of a postmaster).
pub fn children_of(pid: u32) -> Vec<ProcessInfo> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: Vec<ProcessInfo> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(ProcessInfo::read)
        .filter(|p| p.ppid == pid)
        .collect();
    children.sort_by_key(|p| p.pid);
    children
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let stat = "4242 (postgres: user db (x) [local] idle) S 4000 4242 4242 0 -1";
        let (comm, ppid) = parse_stat(stat).expect("parses");
        assert_eq!(comm, "postgres: user db (x) [local] idle");
        assert_eq!(ppid, 4000);
    }

    #[test]
    fn rejects_garbage_stat() {
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber").is_none());
    }

    #[test]
    fn this_test_process_is_not_postgres() {
        let me = ProcessInfo::read(std::process::id()).expect("own /proc entry");
        assert!(!me.is_postgres());
        let err = backend(std::process::id()).expect_err("must refuse");
        assert!(err.to_string().contains("is not a Postgres process"), "{err}");
    }

    #[test]
    fn missing_pid_says_what_to_do() {
        let err = backend(u32::MAX - 1).expect_err("no such pid");
        assert!(err.to_string().contains("pg_stat_activity"), "{err}");
    }
}

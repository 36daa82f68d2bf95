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
pub(crate) fn parse_stat(stat: &str) -> Option<(String, u32)> {
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

/// The postmaster named by a data directory's `postmaster.pid`, once proven to be that
/// directory's postmaster: a pid file left by a crash names a PID the kernel may since have
/// given to any process, even another Postgres.
fn postmaster_pid_of(data_dir: &Path) -> Result<u32> {
    let pid_file: PathBuf = data_dir.join("postmaster.pid");
    if !data_dir.is_dir() {
        bail!(
            "`{}` is neither a PID nor a data directory: pass a postmaster PID or the data \
             directory of a running instance to --instance",
            data_dir.display()
        );
    }
    // A regular file of bounded size: a FIFO or device planted as the pid file cannot hang us.
    let text =
        crate::input_file::read_to_string(&pid_file, "postmaster.pid", crate::postgres::PID_FILE_MAX_BYTES)
            .with_context(|| {
            format!(
                "`{}` has no readable postmaster.pid: is the instance running?",
                data_dir.display()
            )
        })?;
    let pid_line = PidFile::parse(&text)
        .with_context(|| format!("`{}` does not start with a PID", pid_file.display()))?;
    let stale = |why: String| {
        anyhow::anyhow!(
            "`{}` names PID {}, {why}: the pid file is stale (the instance is not running, \
             or crashed); start the instance, or pass its postmaster PID",
            pid_file.display(),
            pid_line.pid
        )
    };
    let Some(process) = ProcessInfo::read(pid_line.pid) else {
        return Err(stale("which is not running".into()));
    };
    if !process.is_postgres() {
        return Err(stale(format!(
            "which now runs `{}`",
            process.exe_name.as_deref().unwrap_or(&process.comm)
        )));
    }
    // Every Postgres process works in its data directory; compared by inode, since the
    // process may see it under another path (a container's mount namespace).
    if !same_file(&PathBuf::from(format!("/proc/{}/cwd", pid_line.pid)), data_dir) {
        return Err(stale("a Postgres process of another data directory".into()));
    }
    if let (Some(written), Some(started)) = (pid_line.started_unix, process_start_unix(pid_line.pid)) {
        if started_after_pid_file(started, written) {
            return Err(stale(format!(
                "whose process started {} s after the pid file was written",
                started - written
            )));
        }
    }
    Ok(pid_line.pid)
}

/// What `postmaster.pid` says of the postmaster: its PID (line 1) and start time (line 3,
/// seconds since the epoch; absent in files of very old majors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PidFile {
    pub(crate) pid: u32,
    pub(crate) started_unix: Option<u64>,
}

impl PidFile {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let pid = lines.next()?.trim().parse().ok().filter(|&pid| pid > 0)?;
        let started_unix = lines.nth(1).and_then(|line| line.trim().parse().ok());
        Some(Self { pid, started_unix })
    }
}

/// Whether a process started after the pid file naming it was written, so is not the one that
/// wrote it. The postmaster writes its start time after it started; both are whole seconds
/// derived from different clocks (jiffies since boot + boot time), hence the slack.
fn started_after_pid_file(process_started_unix: u64, pid_file_unix: u64) -> bool {
    const SLACK_SECS: u64 = 2;
    process_started_unix > pid_file_unix + SLACK_SECS
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// When process `pid` started, in seconds since the epoch: its start in clock ticks after boot
/// (field 22 of /proc/PID/stat) plus the boot time (`btime` of /proc/stat).
fn process_start_unix(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = start_ticks(&stat)?;
    let boot = fs::read_to_string("/proc/stat").ok()?;
    let btime: u64 = boot
        .lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| btime + ticks / hz as u64)
}

/// Field 22 (starttime) of /proc/PID/stat, counted after comm's closing parenthesis (comm may
/// hold spaces and parentheses).
pub(crate) fn start_ticks(stat: &str) -> Option<u64> {
    let close = stat.rfind(')')?;
    // Fields after comm start at 3 (state); starttime is field 22.
    stat.get(close + 1..)?
        .split_whitespace()
        .nth(22 - 3)?
        .parse()
        .ok()
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
    fn pid_file_gives_pid_and_start_time() {
        let text = "4242\n/var/lib/postgresql/15/main\n1732400000\n5432\n/var/run/postgresql\n";
        assert_eq!(
            PidFile::parse(text),
            Some(PidFile {
                pid: 4242,
                started_unix: Some(1732400000)
            })
        );
        assert_eq!(
            PidFile::parse("17\n"),
            Some(PidFile {
                pid: 17,
                started_unix: None
            })
        );
        assert_eq!(PidFile::parse("0\n"), None);
        assert_eq!(PidFile::parse("x\n"), None);
        assert_eq!(PidFile::parse(""), None);
    }

    #[test]
    fn start_ticks_counts_fields_after_an_odd_comm() {
        let fields: Vec<String> = (3..=30).map(|n| n.to_string()).collect();
        let stat = format!("4242 (postgres: a) b (c) {}", fields.join(" "));
        assert_eq!(start_ticks(&stat), Some(22));
        assert_eq!(start_ticks("4242 (x) S 1 2"), None);
    }

    #[test]
    fn a_process_started_after_its_pid_file_is_not_its_postmaster() {
        assert!(!started_after_pid_file(1000, 1000));
        assert!(!started_after_pid_file(1002, 1000));
        assert!(started_after_pid_file(1003, 1000));
        assert!(!started_after_pid_file(900, 1000));
    }

    #[test]
    fn own_start_time_is_in_the_past() {
        let started = process_start_unix(std::process::id()).expect("own start time");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        assert!(
            started <= now + 1 && started + 3600 > now,
            "started {started}, now {now}"
        );
    }

    #[test]
    fn stale_pid_file_naming_a_dead_pid_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("postmaster.pid"), format!("{}\n", u32::MAX - 1)).expect("write");
        let err = instance(dir.path().to_str().expect("utf-8")).expect_err("stale");
        assert!(err.to_string().contains("stale"), "{err}");
    }

    #[test]
    fn missing_pid_says_what_to_do() {
        let err = backend(u32::MAX - 1).expect_err("no such pid");
        assert!(err.to_string().contains("pg_stat_activity"), "{err}");
    }
}

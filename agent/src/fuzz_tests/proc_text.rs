//! Text the agent parses itself from /proc and from data directories: `/proc/PID/stat`
//! (`target::parse_stat`, `start_ticks`), `/proc/PID/status` (`NSpid`), `/proc/PID/cmdline`
//! (process titles naming cluster_name), `postmaster.pid`, `PG_VERSION` and `/etc/passwd`.
//! Any bytes give an answer or none, never a panic; real seeds (captured from a Postgres 15
//! cluster on this machine, plus odd but valid forms) parse to what they say.
//!
//! The data-directory files are read through the working directory of any process named
//! `postgres`, which may be a container's: a FIFO or `/dev/zero` there must be refused, not
//! waited on or read forever (a bug found here: both were read with `fs::read_to_string`).

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;

use crate::collect::instance::{cluster_name_of_title, port_of_pid_file, title_of_cmdline};
use crate::container::namespace_pid;
use crate::fuzzing;
use crate::postgres::major_of_pg_version;
use crate::postgres::sql::user_name_in;
use crate::target::{parse_stat, start_ticks, PidFile};

/// Runs every parser on `bytes` (as the agent would get them: text files read as UTF-8, lossily
/// for cmdline) and checks what any answer must satisfy.
fn parse_all(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    if let Some((comm, _)) = parse_stat(&text) {
        assert!(text.contains(&format!("({comm})")));
    }
    let _ = start_ticks(&text);
    if let Some(pid_file) = PidFile::parse(&text) {
        assert!(pid_file.pid > 0);
    }
    let _ = port_of_pid_file(&text);
    let _ = namespace_pid(&text);
    let _ = user_name_in(&text, 0);
    let _ = user_name_in(&text, 101);
    let _ = major_of_pg_version(bytes);
    let title = title_of_cmdline(bytes);
    assert!(!title.contains('\0'));
    if let Some(name) = cluster_name_of_title(&title) {
        assert!(!name.is_empty() && !name.contains(' ') && title.contains(&name));
    }
}

fn seeds(kind: &str) -> Vec<(String, Vec<u8>)> {
    fuzzing::corpus(kind)
        .into_iter()
        .map(|(path, bytes)| {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (name, bytes)
        })
        .collect()
}

fn text(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).expect("seeds are UTF-8")
}

const KINDS: [&str; 6] = [
    "proc_stat",
    "proc_status",
    "cmdline",
    "postmaster_pid",
    "pg_version",
    "passwd",
];

#[test]
fn seeds_parse_to_what_they_say() {
    for (name, bytes) in seeds("proc_stat") {
        let expected = match name.as_str() {
            "postmaster.stat" => (("postgres", 1), 793528),
            "checkpointer.stat" => (("postgres", 2798), 793533),
            "backend-select.stat" => (("postgres", 2798), 793646),
            "odd-comm.stat" => (("x) S 1 (y", 17), 793646),
            "kernel-thread.stat" => (("kthreadd", 0), 2),
            other => panic!("no expectation for `{other}`"),
        };
        let (comm, ppid) = parse_stat(text(&bytes)).unwrap_or_else(|| panic!("`{name}` parses"));
        assert_eq!(
            ((comm.as_str(), ppid), start_ticks(text(&bytes))),
            (expected.0, Some(expected.1)),
            "{name}"
        );
    }
    for (name, bytes) in seeds("proc_status") {
        let expected = match name.as_str() {
            "backend.status" => 2809,
            "container-backend.status" => 87,
            other => panic!("no expectation for `{other}`"),
        };
        assert_eq!(namespace_pid(text(&bytes)), Some(expected), "{name}");
    }
    for (name, bytes) in seeds("cmdline") {
        let expected = match name.as_str() {
            "checkpointer.cmdline" | "backend-select.cmdline" => Some("15/fuzz"),
            "postmaster.cmdline"
            | "container-postmaster.cmdline"
            | "checkpointer-no-cluster-name.cmdline" => None,
            other => panic!("no expectation for `{other}`"),
        };
        let title = title_of_cmdline(&bytes);
        assert_eq!(
            cluster_name_of_title(&title).as_deref(),
            expected,
            "{name}: `{title}`"
        );
    }
    for (name, bytes) in seeds("postmaster_pid") {
        let expected = match name.as_str() {
            "pg15-running.pid" => (2798, Some(1795570100), Some(54399)),
            "pg15-no-socket.pid" => (4242, Some(1700000000), Some(5432)),
            "crash-truncated.pid" => (4242, None, None),
            other => panic!("no expectation for `{other}`"),
        };
        let pid_file = PidFile::parse(text(&bytes)).unwrap_or_else(|| panic!("`{name}` parses"));
        let port = port_of_pid_file(text(&bytes));
        assert_eq!((pid_file.pid, pid_file.started_unix, port), expected, "{name}");
    }
    for (name, bytes) in seeds("pg_version") {
        let expected = match name.as_str() {
            "pg15" | "pg15-no-newline" => Some(15),
            "not-a-number" => None,
            other => panic!("no expectation for `{other}`"),
        };
        assert_eq!(major_of_pg_version(&bytes), expected, "{name}");
    }
    for (name, bytes) in seeds("passwd") {
        let passwd = text(&bytes);
        assert_eq!(user_name_in(passwd, 0).as_deref(), Some("root"), "{name}");
        assert_eq!(user_name_in(passwd, 101).as_deref(), Some("postgres"), "{name}");
        assert_eq!(user_name_in(passwd, 4_000_000_000), None, "{name}");
    }
}

#[test]
fn mutated_seeds_never_panic_a_parser() {
    let all: Vec<Vec<u8>> = KINDS
        .iter()
        .flat_map(|kind| seeds(kind))
        .map(|(_, bytes)| bytes)
        .collect();
    let count = all.len();
    let strategy = (0..count, proptest::collection::vec(fuzzing::mutation(), 1..6));
    TestRunner::new(fuzzing::config(512))
        .run(&strategy, |(index, mutations)| {
            parse_all(&fuzzing::mutate(&all[index], &mutations));
            Ok(())
        })
        .expect("mutated /proc text");
}

#[test]
fn random_bytes_never_panic_a_parser() {
    let bytes = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        "[0-9 ()\n\t:\0a-z/-]{0,300}".prop_map(String::into_bytes),
        "\\PC{0,200}".prop_map(String::into_bytes),
    ];
    TestRunner::new(fuzzing::config(512))
        .run(&bytes, |bytes| {
            parse_all(&bytes);
            Ok(())
        })
        .expect("random /proc text");
}

#[test]
fn written_fields_read_back() {
    // comm is at most 15 bytes and holds anything but NUL (prctl(PR_SET_NAME)), even ") (".
    let stat = (
        any::<u32>(),
        "[^\0\n]{0,15}",
        "[RSDZTtWXxKWP]",
        any::<u32>(),
        any::<u64>(),
    );
    let pid_file = (1u32.., "/[a-z0-9/_.-]{1,40}", any::<u64>(), any::<u16>());
    let strategy = (
        stat,
        pid_file,
        any::<u32>(),
        "[A-Za-z0-9/_.-]{1,20}",
        (any::<u32>(), any::<u32>()),
    );
    TestRunner::new(fuzzing::config(256))
        .run(&strategy, |(stat, pid_file, major, cluster, (uid, inner))| {
            let (pid, comm, state, ppid, ticks) = stat;
            let zeros = vec!["0"; 17].join(" ");
            let line = format!("{pid} ({comm}) {state} {ppid} {zeros} {ticks} 225034240 3821\n");
            prop_assert_eq!(parse_stat(&line), Some((comm.clone(), ppid)));
            prop_assert_eq!(start_ticks(&line), Some(ticks));

            let (pid, dir, started, port) = pid_file;
            let text = format!(
                "{pid}\n{dir}\n{started}\n{port}\n/var/run/postgresql\n*\n  5432001    131072\nready   \n"
            );
            let parsed = PidFile::parse(&text).expect("a pid file");
            prop_assert_eq!((parsed.pid, parsed.started_unix), (pid, Some(started)));
            prop_assert_eq!(port_of_pid_file(&text), Some(port));

            prop_assert_eq!(major_of_pg_version(format!("{major}\n").as_bytes()), Some(major));

            let mut title = format!("postgres: {cluster}: autovacuum launcher").into_bytes();
            title.resize(title.len() + 40, 0);
            prop_assert_eq!(
                cluster_name_of_title(&title_of_cmdline(&title)),
                Some(cluster.clone())
            );

            let passwd = format!(
                "root:x:0:0:root:/root:/bin/bash\npg{uid}:x:{uid}:104::/var/lib/postgresql:/bin/sh\n"
            );
            let expected = if uid == 0 {
                "root".to_string()
            } else {
                format!("pg{uid}")
            };
            prop_assert_eq!(user_name_in(&passwd, uid), Some(expected));

            let status = format!("Name:\tpostgres\nNSpid:\t{pid}\t{inner}\nNSpgid:\t1\n");
            prop_assert_eq!(namespace_pid(&status), Some(inner));
            Ok(())
        })
        .expect("written fields read back");
}

/// A process (`sleep`) whose working directory is `dir`: what a postmaster's data directory is
/// to the agent.
struct Squatter(std::process::Child);

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mkfifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL in a temp path");
    // SAFETY: mkfifo reads a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Runs `read` on a thread and gives its result, or None if it did not return in 10 s.
fn bounded<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(read());
    });
    result.recv_timeout(Duration::from_secs(10)).ok()
}

#[test]
fn a_fifo_or_dev_zero_in_a_data_directory_is_refused_at_once() {
    for hostile in ["fifo", "dev-zero"] {
        let dir = tempfile::tempdir().expect("temp dir");
        for name in ["PG_VERSION", "postmaster.pid"] {
            let path = dir.path().join(name);
            match hostile {
                "fifo" => mkfifo(&path),
                _ => std::os::unix::fs::symlink("/dev/zero", &path).expect("symlink"),
            }
        }
        let squatter = Squatter(
            std::process::Command::new("sleep")
                .arg("60")
                .current_dir(dir.path())
                .spawn()
                .expect("spawn sleep"),
        );
        let pid = squatter.0.id();
        let major = bounded(move || crate::postgres::detect_major(pid).map_err(|e| format!("{e:#}")))
            .unwrap_or_else(|| panic!("reading PG_VERSION ({hostile}) did not return within 10 s"));
        let error = major.expect_err("refused");
        assert!(error.contains("not a regular file"), "{hostile}: {error}");
        let pid_file = bounded(move || crate::postgres::read_pid_file(pid).map_err(|e| format!("{e:#}")))
            .unwrap_or_else(|| panic!("reading postmaster.pid ({hostile}) did not return within 10 s"));
        let error = pid_file.expect_err("refused");
        assert!(error.contains("not a regular file"), "{hostile}: {error}");
        let facts = bounded(move || crate::collect::InstanceFacts::read(pid))
            .unwrap_or_else(|| panic!("reading the instance's facts ({hostile}) did not return within 10 s"));
        assert_eq!((facts.port, facts.major), (None, None), "{hostile}");
        drop(squatter);
    }
}

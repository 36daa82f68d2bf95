//! Whether a process (or thread) still exists, asked of the kernel without a path lookup.
//!
//! The agent asks this of every profiled process every second (1000 connected backends: 1000
//! questions a second). A `stat` of `/proc/PID` walks procfs and revalidates its dentries,
//! ~2-3 us each here, a fifth of an idle agent's CPU with 1000 backends; `getpgid(2)` finds
//! the task in the PID table and reads one field, with the same answer: a zombie, whose
//! `/proc/PID` also stays until it is reaped, exists.

/// True while `pid` names a process or thread in the agent's PID namespace (zombies
/// included), as `/proc/PID` would exist.
pub fn exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // pid 0 asks about the caller, not about a process 0.
    if pid == 0 {
        return false;
    }
    // SAFETY: getpgid takes a pid by value and touches no memory of ours.
    let group = unsafe { libc::getpgid(pid) };
    // ESRCH: no such process. Any other failure (a seccomp filter refusing the call) tells
    // nothing, and the process is kept: kept wrongly it costs some memory until the next
    // question, forgotten wrongly it loses its mappings and names.
    group >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_thread_exist() {
        assert!(exists(std::process::id()));
        // SAFETY: gettid takes no arguments.
        let tid = unsafe { libc::gettid() };
        assert!(exists(tid as u32));
    }

    #[test]
    fn a_reaped_child_does_not_exist_and_a_zombie_does() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        // Exited but not reaped: a zombie, with its /proc entry.
        while std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| !stat.contains(") Z "))
            .unwrap_or(false)
        {
            std::thread::yield_now();
        }
        assert!(exists(pid));
        assert_eq!(
            exists(pid),
            std::path::Path::new(&format!("/proc/{pid}")).exists()
        );
        child.wait().expect("reap true");
        assert!(!exists(pid));
    }

    #[test]
    fn pid_zero_and_out_of_range_pids_do_not_exist() {
        assert!(!exists(0));
        assert!(!exists(u32::MAX));
    }
}

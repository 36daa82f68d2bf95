//! Stops one thread of another process (not its siblings) for as long as the test holds it:
//! what a reader starved of its CPU looks like to the kernel, made on purpose. `PTRACE_SEIZE`
//! and `PTRACE_INTERRUPT` stop only the thread named (a `SIGSTOP` would stop the whole process);
//! dropping the guard detaches, and the thread runs on.

use anyhow::{bail, Result};

/// A thread held stopped by this (the tracing) thread. Must be dropped on the thread that made
/// it: ptrace ties a tracee to the thread that seized it.
pub struct FrozenThread {
    tid: libc::pid_t,
}

impl FrozenThread {
    /// Stops thread `tid` (needs root, or the same user and ptrace allowed) and returns once it
    /// is stopped.
    pub fn freeze(tid: u32) -> Result<Self> {
        let tid = tid as libc::pid_t;
        // SAFETY: ptrace requests on a thread id, with null addr/data, as these requests take.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) } != 0 {
            bail!("cannot seize thread {tid}: {}", std::io::Error::last_os_error());
        }
        let frozen = FrozenThread { tid };
        // SAFETY: as above; the thread is now our tracee.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) } != 0 {
            bail!("cannot stop thread {tid}: {}", std::io::Error::last_os_error());
        }
        let mut status = 0;
        // SAFETY: waits for our tracee's stop; `status` is a valid out-pointer.
        if unsafe { libc::waitpid(tid, &mut status, libc::__WALL) } != tid {
            bail!("thread {tid} did not stop: {}", std::io::Error::last_os_error());
        }
        Ok(frozen)
    }
}

impl Drop for FrozenThread {
    fn drop(&mut self) {
        // SAFETY: detaches our stopped tracee; a thread gone since has nothing to detach.
        unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0usize, 0usize) };
    }
}

//! The kernel's process events (the netlink proc connector): every fork on the machine, as it
//! happens, with no polling to miss a process that lives a millisecond.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// `NETLINK_CONNECTOR`, the netlink family of kernel connectors (linux/netlink.h).
const NETLINK_CONNECTOR: libc::c_int = 11;
/// The process-events connector's index and value (linux/connector.h), also its multicast group.
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
/// `PROC_CN_MCAST_LISTEN` (linux/cn_proc.h): start sending events to this socket.
const PROC_CN_MCAST_LISTEN: u32 = 1;
/// `PROC_EVENT_FORK` (linux/cn_proc.h).
const PROC_EVENT_FORK: u32 = 1;
/// `NLMSG_DONE`: the connector sends each event as one message of this type.
const NLMSG_DONE: u16 = 3;
const NLMSG_HEADER: usize = 16;
const CN_MSG_HEADER: usize = 20;
/// `struct proc_event`: what (u32), cpu (u32), timestamp_ns (u64), then the event's data.
const EVENT_DATA: usize = 16;
/// Room for bursts of forks (a pgbench connecting many clients) while the reader is late.
const RECEIVE_BUFFER: libc::c_int = 8 << 20;

/// One fork: `parent` (a process) made `child` (a process, or a thread when `child` is a
/// thread's id in the same process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fork {
    pub parent_tgid: u32,
    pub child_pid: u32,
    pub child_tgid: u32,
}

/// What one receive gave.
pub enum Received {
    Forks(Vec<Fork>),
    /// Nothing within the timeout.
    Nothing,
    /// The socket's buffer overflowed: events were lost.
    Overflowed,
}

/// A socket subscribed to the machine's process events (root only).
pub struct ForkEvents {
    socket: OwnedFd,
}

impl ForkEvents {
    /// Subscribes; events from now on are received, each receive waiting at most `timeout`.
    pub fn subscribe(timeout: Duration) -> Result<Self> {
        // SAFETY: a plain socket(2) call; the descriptor is owned right after.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                NETLINK_CONNECTOR,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a netlink connector socket");
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        set_option(&socket, libc::SO_RCVBUFFORCE, RECEIVE_BUFFER).context("sizing its receive buffer")?;
        let timeval = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: libc::suseconds_t::from(timeout.subsec_micros() as i32),
        };
        // SAFETY: the option value is a timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeval as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error()).context("setting its receive timeout");
        }
        // SAFETY: sockaddr_nl is plain data; all zero is a valid value before the fields set.
        let mut address: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        address.nl_groups = CN_IDX_PROC;
        // SAFETY: the address is a sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                socket.as_raw_fd(),
                (&address as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error())
                .context("joining the process-events group (needs root and CONFIG_PROC_EVENTS)");
        }
        let events = ForkEvents { socket };
        events.listen()?;
        Ok(events)
    }

    /// Asks the connector to send events: a netlink message holding a connector message
    /// holding `PROC_CN_MCAST_LISTEN`.
    fn listen(&self) -> Result<()> {
        let total = NLMSG_HEADER + CN_MSG_HEADER + 4;
        let mut message = Vec::with_capacity(total);
        message.extend_from_slice(&(total as u32).to_ne_bytes());
        message.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        message.extend_from_slice(&0u16.to_ne_bytes()); // flags
        message.extend_from_slice(&0u32.to_ne_bytes()); // sequence
        message.extend_from_slice(&std::process::id().to_ne_bytes());
        message.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
        message.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
        message.extend_from_slice(&0u32.to_ne_bytes()); // sequence
        message.extend_from_slice(&0u32.to_ne_bytes()); // acknowledgement
        message.extend_from_slice(&4u16.to_ne_bytes()); // data length
        message.extend_from_slice(&0u16.to_ne_bytes()); // flags
        message.extend_from_slice(&PROC_CN_MCAST_LISTEN.to_ne_bytes());
        // SAFETY: sends `message.len()` bytes from a live buffer.
        let sent = unsafe { libc::send(self.socket.as_raw_fd(), message.as_ptr().cast(), message.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error()).context("subscribing to process events");
        }
        Ok(())
    }

    /// Waits for the next datagram (at most the timeout) and returns its forks.
    pub fn receive(&self) -> Result<Received> {
        let mut buffer = [0u8; 4096];
        // SAFETY: receives at most `buffer.len()` bytes into a live buffer.
        let n = unsafe {
            libc::recv(
                self.socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                0,
            )
        };
        if n < 0 {
            let error = io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::EAGAIN | libc::EINTR) => Ok(Received::Nothing),
                Some(libc::ENOBUFS) => Ok(Received::Overflowed),
                _ => Err(error).context("receiving process events"),
            };
        }
        Ok(Received::Forks(parse_forks(&buffer[..n as usize])?))
    }
}

fn set_option(socket: &OwnedFd, option: libc::c_int, value: libc::c_int) -> Result<()> {
    // SAFETY: the option value is a c_int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}

/// The forks among the netlink messages of one datagram.
fn parse_forks(datagram: &[u8]) -> Result<Vec<Fork>> {
    let u32_at = |bytes: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let mut forks = Vec::new();
    let mut rest = datagram;
    while rest.len() >= NLMSG_HEADER {
        let Some(length) = u32_at(rest, 0).map(|l| l as usize) else {
            break;
        };
        if length < NLMSG_HEADER || length > rest.len() {
            bail!(
                "a netlink message of {length} bytes in a datagram of {} left",
                rest.len()
            );
        }
        let message = &rest[..length];
        let event = &message[NLMSG_HEADER..];
        if event.len() >= CN_MSG_HEADER + EVENT_DATA + 16 {
            let event = &event[CN_MSG_HEADER..];
            if u32_at(event, 0) == Some(PROC_EVENT_FORK) {
                let data = &event[EVENT_DATA..];
                if let (Some(parent_tgid), Some(child_pid), Some(child_tgid)) =
                    (u32_at(data, 4), u32_at(data, 8), u32_at(data, 12))
                {
                    forks.push(Fork {
                        parent_tgid,
                        child_pid,
                        child_tgid,
                    });
                }
            }
        }
        // Messages are aligned to 4 bytes.
        let next = (length + 3) & !3;
        rest = rest.get(next..).unwrap_or_default();
    }
    Ok(forks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fork_message(parent_tgid: u32, child: u32) -> Vec<u8> {
        let total = NLMSG_HEADER + CN_MSG_HEADER + EVENT_DATA + 16;
        let mut m = Vec::new();
        m.extend_from_slice(&(total as u32).to_ne_bytes());
        m.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[0; CN_MSG_HEADER]);
        m.extend_from_slice(&PROC_EVENT_FORK.to_ne_bytes());
        m.extend_from_slice(&[0; 12]);
        for value in [parent_tgid, parent_tgid, child, child] {
            m.extend_from_slice(&value.to_ne_bytes());
        }
        m
    }

    #[test]
    fn reads_every_fork_of_a_datagram() {
        let mut datagram = fork_message(10, 11);
        datagram.extend(fork_message(10, 12));
        let forks = parse_forks(&datagram).unwrap();
        assert_eq!(
            forks
                .iter()
                .map(|f| (f.parent_tgid, f.child_tgid))
                .collect::<Vec<_>>(),
            vec![(10, 11), (10, 12)]
        );
    }

    #[test]
    fn refuses_a_length_past_the_datagram() {
        let mut datagram = fork_message(10, 11);
        datagram[0] = 200;
        assert!(parse_forks(&datagram).is_err());
    }

    #[test]
    fn sees_its_own_fork() {
        let events = ForkEvents::subscribe(Duration::from_millis(100)).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let mut seen = false;
        for _ in 0..100 {
            if let Received::Forks(forks) = events.receive().unwrap() {
                if forks
                    .iter()
                    .any(|f| f.child_tgid == pid && f.parent_tgid == std::process::id())
                {
                    seen = true;
                    break;
                }
            }
        }
        assert!(seen, "no fork event for child {pid}");
    }
}

//! The Pyroscope server the tests start (`scripts/pyroscope-server.sh start`) binds and
//! advertises loopback only, and keeps all its data in the directory it is given: a test server
//! must not listen on, or announce, the host's interfaces, nor write into the repository.

use std::collections::BTreeSet;
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use pgscope_tests::workspace_root;

/// Ring and gossip pages that list the addresses instances advertise.
const RING_PAGES: [&str; 6] = [
    "/ring",
    "/distributor/ring",
    "/compactor/ring",
    "/store-gateway/ring",
    "/overrides-exporter/ring",
    "/memberlist",
];

struct Server {
    pid: u32,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the server this test started.
        unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
    }
}

fn start(cwd: &std::path::Path) -> Result<Server> {
    let dir = tempfile::Builder::new().prefix("pgscope-pyroscope-").tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let script = workspace_root().join("scripts/pyroscope-server.sh");
    let output = Command::new(&script)
        .current_dir(cwd)
        .arg("start")
        .arg(port.to_string())
        .arg(dir.path())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "cannot start Pyroscope ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let pid = String::from_utf8_lossy(&output.stdout).trim().parse()?;
    Ok(Server { pid, port, dir })
}

#[test]
fn test_pyroscope_binds_and_advertises_loopback_only() -> Result<()> {
    let cwd = tempfile::tempdir()?;
    let server = start(cwd.path())?;

    let listening = listening_addresses(server.pid)?;
    ensure!(
        !listening.is_empty(),
        "Pyroscope {} listens on nothing",
        server.pid
    );
    let exposed: Vec<_> = listening.iter().filter(|a| !a.starts_with("127.")).collect();
    ensure!(
        exposed.is_empty(),
        "Pyroscope listens beyond loopback on {exposed:?} (all: {listening:?})"
    );

    for page in RING_PAGES {
        let url = format!("http://127.0.0.1:{}{page}", server.port);
        let mut response = ureq::get(&url).call().with_context(|| format!("GET {url}"))?;
        let html = response.body_mut().read_to_string()?;
        let addresses = ipv4_addresses(&html);
        let foreign: Vec<_> = addresses.iter().filter(|a| !a.starts_with("127.")).collect();
        ensure!(
            foreign.is_empty(),
            "{page} advertises {foreign:?}: a ring or gossip address is not loopback"
        );
    }

    // Runs in its data directory, and writes nothing where it was started from.
    let server_cwd = std::fs::read_link(format!("/proc/{}/cwd", server.pid))?;
    ensure!(
        server_cwd.starts_with(std::fs::canonicalize(server.dir.path())?),
        "Pyroscope works in `{}`, not in its data directory",
        server_cwd.display()
    );
    let left: Vec<_> = std::fs::read_dir(cwd.path())?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    ensure!(left.is_empty(), "Pyroscope wrote {left:?} where it was started");
    Ok(())
}

/// Local addresses of the TCP sockets process `pid` listens on, from /proc/PID/net/tcp{,6}
/// (IPv4 as dotted quads; IPv6 in hex, `::ffff:` mapped ones as dotted quads).
fn listening_addresses(pid: u32) -> Result<BTreeSet<String>> {
    let own_sockets: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut out = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))?;
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state (0A = LISTEN), inode
            let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            if *state == "0A" && own_sockets.contains(*inode) {
                let hex = local.split(':').next().unwrap_or_default();
                out.insert(address_of(hex));
            }
        }
    }
    Ok(out)
}

/// A /proc/net address in hex: 8 digits (IPv4, little-endian) or 32 (IPv6, four little-endian
/// words).
fn address_of(hex: &str) -> String {
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    let word = |w: &[u8]| [w[3], w[2], w[1], w[0]];
    match bytes.len() {
        4 => std::net::Ipv4Addr::from(word(&bytes)).to_string(),
        16 => {
            let mut octets = [0u8; 16];
            for (i, chunk) in bytes.chunks(4).enumerate() {
                octets[4 * i..4 * i + 4].copy_from_slice(&word(chunk));
            }
            let v6 = std::net::Ipv6Addr::from(octets);
            v6.to_ipv4_mapped().map_or(v6.to_string(), |v4| v4.to_string())
        }
        _ => hex.to_owned(),
    }
}

fn ipv4_addresses(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|word| word.parse::<std::net::Ipv4Addr>().is_ok())
        .map(str::to_owned)
        .collect()
}

#[test]
fn proc_net_addresses_decode() {
    assert_eq!(address_of("0100007F"), "127.0.0.1");
    assert_eq!(address_of("00000000000000000000000000000000"), "::");
    assert_eq!(address_of("0000000000000000FFFF00000100007F"), "127.0.0.1");
    assert_eq!(
        ipv4_addresses("<td>192.0.2.2:4040</td><td>127.0.0.1:1</td> v1.12.0"),
        BTreeSet::from(["192.0.2.2".to_owned(), "127.0.0.1".to_owned()])
    );
}

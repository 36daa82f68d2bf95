//! A Postgres "container" without a container runtime: its own mount and PID namespaces
//! (`unshare`), its own root directory holding a copy of a Postgres build at a path the host
//! does not have (`/opt/pg`), and a cgroup named the way containerd names a Kubernetes pod's
//! container. What a profiler on the node sees of a Postgres pod, built from the same kernel
//! features.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use crate::install::PgInstall;
use crate::process::wait_for;

/// The container ID the cgroup is named after (unless [`NamespacedPostgres::start_as`] names
/// another).
pub const CONTAINER_ID: &str = "7c0de5a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d";
/// The pod UID of the parent cgroup.
pub const POD_UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

pub struct NamespacedPostgres {
    root: TempDir,
    port: u16,
    postmaster: u32,
    container_id: String,
    child: Child,
    cgroup: Vec<PathBuf>,
}

impl NamespacedPostgres {
    /// Copies `install` (a relocatable build: the no-frame-pointer one) into a new root,
    /// initialises a cluster there and starts it in new mount and PID namespaces, in a
    /// containerd-style cgroup named after [`CONTAINER_ID`].
    pub fn start(install: &PgInstall) -> Result<Self> {
        Self::start_as(install, CONTAINER_ID)
    }

    /// The same, in the cgroup of container `container_id` (64 hex digits): several containers,
    /// or a container replaced by one with a new ID.
    pub fn start_as(install: &PgInstall, container_id: &str) -> Result<Self> {
        let prefix = install.bindir.parent().context("the build has a prefix")?;
        let root = tempfile::Builder::new().prefix("pgscope-container-").tempdir()?;
        let r = root.path();
        set_mode(r, 0o755)?;
        fs::create_dir_all(r.join("opt"))?;
        run(
            Command::new("cp").arg("-a").arg(prefix).arg(r.join("opt/pg")),
            "copying the build",
        )?;
        fs::create_dir_all(r.join("data"))?;
        fs::create_dir_all(r.join("ns"))?;
        run(
            Command::new("chown")
                .args(["postgres:postgres"])
                .arg(r.join("data")),
            "chown data",
        )?;
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(install.bin("initdb"))
                .arg("-D")
                .arg(r.join("data"))
                .args(["-U", "postgres", "--auth=trust", "--no-sync", "--locale=C"])
                .current_dir("/"),
            "initdb",
        )?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut conf = fs::read_to_string(r.join("data/postgresql.conf"))?;
        conf.push_str(&format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '/tmp'\n\
             fsync = off\nshared_preload_libraries = 'pg_stat_statements'\njit = off\n"
        ));
        fs::write(r.join("data/postgresql.conf"), conf)?;

        let cgroup = containerd_cgroup(container_id)?;
        let procs = cgroup.last().context("cgroup")?.join("cgroup.procs");
        // The shell joins the cgroup, then becomes unshare. Inside, PID 1 builds the container's
        // root on a tmpfs and pivots into it, dropping the old root, as container runtimes do:
        // the host then sees the container's own paths (`/opt/pg/bin/postgres`) in
        // /proc/PID/maps and exe, which exist only through /proc/PID/root. Then it becomes the
        // postmaster. (`\\$n`: expanded by the inner shell, not the outer one.)
        let inner = format!(
            "set -e; mount --make-rprivate /; n={r}/ns; mount -t tmpfs tmpfs \\$n; \
             cp -a {r}/opt {r}/data \\$n/; mkdir -p \\$n/usr \\$n/etc \\$n/dev \\$n/proc \\$n/tmp \\$n/old; \
             chmod 1777 \\$n/tmp; ln -s usr/lib \\$n/lib; ln -s usr/lib64 \\$n/lib64; ln -s usr/bin \\$n/bin; \
             ln -s usr/sbin \\$n/sbin; mount --rbind /usr \\$n/usr; mount --rbind /etc \\$n/etc; \
             mount --rbind /dev \\$n/dev; mount -t proc proc \\$n/proc; \
             cd \\$n; pivot_root . old; exec chroot . sh -c 'umount -l /old; rmdir /old; \
             exec setpriv --reuid=postgres --regid=postgres --init-groups /opt/pg/bin/postgres -D /data'",
            r = r.display()
        );
        let outer = format!(
            "echo $$ > {procs}; exec unshare --mount --pid --fork --kill-child sh -c \"{inner}\"",
            procs = procs.display()
        );
        let log = fs::File::create(r.join("postgres.log"))?;
        let child = Command::new("sh")
            .args(["-c", &outer])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the namespaced Postgres")?;
        let mut started = Self {
            root,
            port,
            postmaster: 0,
            container_id: container_id.to_string(),
            child,
            cgroup,
        };
        let isready = install.bin("pg_isready");
        wait_for(
            "the namespaced Postgres to accept connections",
            Duration::from_secs(60),
            || {
                if let Some(status) = started.child.try_wait()? {
                    bail!("it exited ({status}):\n{}", started.log());
                }
                let ready = Command::new(&isready)
                    .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-q"])
                    .status()?
                    .success();
                Ok(ready.then_some(()))
            },
        )?;
        started.postmaster = started.find_postmaster()?;
        Ok(started)
    }

    /// The postmaster's PID on the host: the process running the container's binary that is
    /// PID 1 of its namespace, in our cgroup.
    fn find_postmaster(&self) -> Result<u32> {
        for entry in fs::read_dir("/proc")? {
            let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let exe = fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
            let cgroup = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            if exe != Path::new("/opt/pg/bin/postgres") || !cgroup.contains(&self.container_id) {
                continue;
            }
            let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
            if status
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1"))
            {
                return Ok(pid);
            }
        }
        bail!("no postmaster of the container found:\n{}", self.log())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `pgbench <args> postgres` against this instance, with `install`'s client.
    pub fn pgbench(&self, install: &PgInstall, args: &[&str]) -> Command {
        let mut command = Command::new(install.bin("pgbench"));
        command
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"])
            .args(args)
            .arg("postgres");
        command
    }

    /// The postmaster's PID on the host (in its namespace it is 1).
    pub fn postmaster_pid(&self) -> u32 {
        self.postmaster
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.root.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for NamespacedPostgres {
    fn drop(&mut self) {
        if self.postmaster != 0 {
            // SIGQUIT: immediate shutdown; PID 1 of the namespace exits, taking everything.
            // SAFETY: kill(2) on the postmaster this harness started.
            unsafe { libc::kill(self.postmaster as libc::pid_t, libc::SIGQUIT) };
        } else if let Some(scope) = self.cgroup.last() {
            // Not found: kill what runs in the container's cgroup (unshare's --kill-child does not
            // reach a PID 1 that changed its uid: the kernel clears the parent-death signal).
            for pid in fs::read_to_string(scope.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                if let Ok(pid) = pid.trim().parse::<libc::pid_t>() {
                    // SAFETY: kill(2) on processes of the cgroup this harness created.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        let _ = self.child.wait();
        for dir in self.cgroup.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// `<cgroup2 mount>/kubepods.slice/kubepods-pod<uid>.slice/cri-containerd-<id>.scope`, created.
fn containerd_cgroup(container_id: &str) -> Result<Vec<PathBuf>> {
    let mounts = fs::read_to_string("/proc/mounts")?;
    let mount = mounts
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, path, kind) = (fields.next()?, fields.next()?, fields.next()?);
            (kind == "cgroup2").then(|| PathBuf::from(path))
        })
        .context("no cgroup2 hierarchy mounted")?;
    let slice = mount.join("kubepods.slice");
    let pod = slice.join(format!("kubepods-pod{}.slice", POD_UID.replace('-', "_")));
    let scope = pod.join(format!("cri-containerd-{container_id}.scope"));
    fs::create_dir_all(&scope).with_context(|| format!("creating `{}`", scope.display()))?;
    Ok(vec![slice, pod, scope])
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

fn run(command: &mut Command, what: &str) -> Result<()> {
    let output = command.output().with_context(|| format!("{what}: cannot run"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

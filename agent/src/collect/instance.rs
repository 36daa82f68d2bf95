//! One Postgres instance (or one backend) being profiled: what attribution needs to decode its
//! samples, the facts its labels are made of, and attaching it to the BPF programs. `trace`
//! attaches one, the agent every instance it discovers.

use std::fs;
use std::path::PathBuf;

use anyhow::Result;
use tracing::debug;

use crate::bpf::abi::{PgLayout, TARGET_FOLLOW_FORKS, TARGET_PROFILE};
use crate::bpf::OnCpuProbes;
use crate::container::ContainerIdentity;
use crate::postgres::{self, instance_names::InstanceNames, VersionTable};
use crate::target::{self, ProcessInfo};

/// What is being profiled: a whole instance, or one backend of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The postmaster and every process it forks.
    Instance,
    /// One backend (`trace --pid`).
    Backend,
}

/// Facts that name an instance: where it lives and how its operators call it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstanceFacts {
    /// The postmaster's working directory, which Postgres sets to the data directory.
    pub data_dir: Option<PathBuf>,
    /// From `postmaster.pid` (line 4).
    pub port: Option<u16>,
    /// `cluster_name`, as the instance's processes show it in their titles
    /// (`postgres: 15/main: checkpointer`).
    pub cluster_name: Option<String>,
    /// The executable (`/proc/PID/exe`).
    pub binary: Option<PathBuf>,
    pub major: Option<u32>,
    /// The container the postmaster runs in, if any.
    pub container: ContainerIdentity,
}

impl InstanceFacts {
    /// Reads what the postmaster `pid` and its children show; every field is best effort.
    pub fn read(pid: u32) -> Self {
        // The path as the postmaster sees it (in a container: inside it)...
        let data_dir = fs::read_link(format!("/proc/{pid}/cwd")).ok();
        // ...and its files read through /proc/PID/cwd, which resolves in its mount namespace.
        let port = postgres::read_pid_file(pid)
            .ok()
            .and_then(|text| port_of_pid_file(&text));
        let cluster_name = target::children_of(pid)
            .iter()
            .find_map(|child| cluster_name_of_title(&command_line(child.pid)));
        Self {
            data_dir,
            port,
            cluster_name,
            binary: fs::read_link(format!("/proc/{pid}/exe")).ok(),
            major: postgres::detect_major(pid).ok(),
            container: ContainerIdentity::of_process(pid),
        }
    }

    /// The instance's name in labels and logs: its cluster_name, else `host:port` (in a
    /// container, the container ID's first 12 digits for the host: many pods of a node listen
    /// on 5432), else the data directory.
    pub fn name(&self, host: &str) -> String {
        if let Some(name) = &self.cluster_name {
            return name.clone();
        }
        let host = match &self.container.container_id {
            Some(id) => id.get(..12).unwrap_or(id),
            None => host,
        };
        match (&self.port, &self.data_dir) {
            (Some(port), _) => format!("{host}:{port}"),
            (None, Some(dir)) => dir.display().to_string(),
            (None, None) => "unknown".to_string(),
        }
    }
}

/// The port in a `postmaster.pid` file: PID, data directory, start time, port, … one per line.
pub(crate) fn port_of_pid_file(text: &str) -> Option<u16> {
    text.lines().nth(3)?.trim().parse().ok()
}

fn command_line(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| title_of_cmdline(&bytes))
        .unwrap_or_default()
}

/// `/proc/PID/cmdline` as one line: a process title set by Postgres is NUL-padded, the
/// arguments of others NUL-separated.
pub(crate) fn title_of_cmdline(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .replace('\0', " ")
        .trim()
        .to_string()
}

/// `postgres: 15/main: checkpointer` → `15/main`. Postgres puts cluster_name between the
/// program name and the process's role only when it is set; without it the title is
/// `postgres: checkpointer`.
pub(crate) fn cluster_name_of_title(title: &str) -> Option<String> {
    let rest = title.strip_prefix("postgres: ")?;
    let (first, role) = rest.split_once(": ")?;
    // A backend's title without cluster_name is `user db host state`: no colon-space pair
    // before its role. Roles of auxiliary processes never contain ": ".
    (!first.is_empty() && !role.is_empty() && !first.contains(' ')).then(|| first.to_string())
}

/// An attached instance (or backend): how to decode and name its samples.
pub struct InstanceContext {
    /// The process everything was attached from: the postmaster, or the one backend.
    pub root: u32,
    pub scope: Scope,
    /// How to decode attribution, when the layout could be resolved.
    pub version: Option<&'static VersionTable>,
    /// Names only the server knows: extension tranches, background workers' types.
    pub names: InstanceNames,
    pub facts: InstanceFacts,
}

impl InstanceContext {
    /// The postmaster whose mappings every process of the instance shares (backends fork
    /// without exec), to unwind a process that exited before its samples were read.
    pub fn postmaster(&self) -> Option<u32> {
        (self.scope == Scope::Instance).then_some(self.root)
    }
}

/// What attaching found out besides the context, for the front end to report.
pub struct Attached {
    pub context: InstanceContext,
    /// Why samples will carry no query or wait-event labels, if they will not.
    pub no_attribution: Option<anyhow::Error>,
    /// Why extension LWLocks and background workers keep generic names, if they do.
    pub no_instance_names: Option<anyhow::Error>,
    /// The layout, for the callers that read more of the status array.
    pub layout: Option<(PgLayout, &'static VersionTable)>,
    /// Processes besides the root that were attached.
    pub children: usize,
}

/// Attaches `root` (a postmaster with `Scope::Instance`, else one backend): its layout for
/// attribution, then the process(es) as targets with `extra_flags` (e.g. off-CPU).
/// Attribution is best effort: without it stacks are still right, only unlabelled.
pub fn attach(
    probes: &mut OnCpuProbes,
    root: &ProcessInfo,
    scope: Scope,
    extra_flags: u8,
) -> Result<Attached> {
    let pid = root.pid;
    let (layout, no_attribution) = match postgres::resolve_layout(pid) {
        Ok((layout, table)) => {
            probes.set_layout(pid, layout)?;
            (Some((layout, table)), None)
        }
        Err(error) => (None, Some(error)),
    };
    // Read once: the postmaster fills the named tranches in at startup, and every process of
    // the instance has MyBgworkerEntry at the same address.
    let (names, no_instance_names) = match &layout {
        Some((_, table)) => match InstanceNames::resolve(pid, table) {
            Ok(names) => {
                debug!(
                    pid,
                    tranches = names.tranche_count(),
                    "named LWLock tranches read"
                );
                (names, None)
            }
            Err(error) => (InstanceNames::default(), Some(error)),
        },
        None => (InstanceNames::default(), None),
    };
    let mut children = 0;
    match scope {
        Scope::Backend => probes.add_target(pid, TARGET_PROFILE | extra_flags)?,
        Scope::Instance => {
            // The postmaster goes in first: a backend forked from now on is caught by the fork
            // tracepoint, one forked earlier by the /proc scan that follows.
            let flags = TARGET_PROFILE | TARGET_FOLLOW_FORKS | extra_flags;
            probes.add_target(pid, flags)?;
            for child in target::children_of(pid) {
                // Children forked before the postmaster's layout was set need their own copy.
                if let Some((layout, _)) = layout {
                    probes.set_layout(child.pid, layout)?;
                }
                probes.add_target(child.pid, flags)?;
                children += 1;
            }
        }
    }
    let facts = match scope {
        Scope::Instance => InstanceFacts::read(pid),
        Scope::Backend => InstanceFacts::read(root.ppid),
    };
    Ok(Attached {
        context: InstanceContext {
            root: pid,
            scope,
            version: layout.map(|(_, table)| table),
            names,
            facts,
        },
        no_attribution,
        no_instance_names,
        layout,
        children,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_name_comes_from_process_titles_that_carry_one() {
        assert_eq!(
            cluster_name_of_title("postgres: 15/main: checkpointer"),
            Some("15/main".to_string())
        );
        assert_eq!(
            cluster_name_of_title("postgres: prod: app appdb [local] idle"),
            Some("prod".to_string())
        );
        assert_eq!(cluster_name_of_title("postgres: checkpointer"), None);
        assert_eq!(cluster_name_of_title("postgres: app appdb [local] idle"), None);
        assert_eq!(
            cluster_name_of_title("/usr/lib/postgresql/15/bin/postgres -D /data"),
            None
        );
    }

    #[test]
    fn the_port_is_the_fourth_line_of_postmaster_pid() {
        let text = "4242\n/var/lib/postgresql/15/main\n1700000000\n5433\n/var/run/postgresql\n*\n";
        assert_eq!(port_of_pid_file(text), Some(5433));
        assert_eq!(port_of_pid_file("4242\n"), None);
    }

    #[test]
    fn an_instance_is_named_by_cluster_name_then_host_and_port() {
        let mut facts = InstanceFacts {
            port: Some(5432),
            ..InstanceFacts::default()
        };
        assert_eq!(facts.name("db1"), "db1:5432");
        facts.cluster_name = Some("15/main".to_string());
        assert_eq!(facts.name("db1"), "15/main");
    }
}

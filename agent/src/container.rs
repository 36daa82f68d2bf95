//! Which container a process runs in, as far as the host can tell without asking a runtime:
//! the container ID in its cgroup path (containerd, CRI-O and Docker name their cgroups after
//! it, on cgroup v1 and v2, with the systemd or the cgroupfs driver), the pod UID Kubernetes
//! puts in the parent cgroup, and the process's PID inside its PID namespace.

use std::fs;

/// A process's container identity; every field is absent on a plain host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerIdentity {
    /// The 64-hex-digit container ID.
    pub container_id: Option<String>,
    /// The pod UID (dashes restored), for processes in a Kubernetes pod.
    pub pod_uid: Option<String>,
    /// The PID as the process sees itself, when it lives in another PID namespace.
    pub namespace_pid: Option<u32>,
}

impl ContainerIdentity {
    pub fn of_process(pid: u32) -> Self {
        let (container_id, pod_uid) = fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map(|text| parse_cgroup(&text))
            .unwrap_or_default();
        let namespace_pid = fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|status| namespace_pid(&status))
            .filter(|&inner| inner != pid);
        Self {
            container_id,
            pod_uid,
            namespace_pid,
        }
    }
}

/// The innermost PID of the `NSpid:` line of `/proc/PID/status` (host PID first, then one per
/// nested namespace).
pub(crate) fn namespace_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// (container ID, pod UID) from `/proc/PID/cgroup`: cgroup v2 has one `0::/path` line, v1 one
/// line per hierarchy; any of them names the container. Path segments seen in the wild:
/// - systemd driver: `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`,
///   under `kubepods-burstable-pod<uid_with_underscores>.slice`;
/// - cgroupfs driver: `/kubepods/burstable/pod<uid>/<id>`, `/docker/<id>`;
/// - CRI-O conmon: `crio-conmon-<id>.scope` (the monitor, not the container: skipped).
pub fn parse_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let mut container = None;
    let mut pod = None;
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or_default();
        for segment in path.split('/') {
            if let Some(id) = container_id_of(segment) {
                container.get_or_insert(id);
            }
            if let Some(uid) = pod_uid_of(segment) {
                pod.get_or_insert(uid);
            }
        }
    }
    (container, pod)
}

fn container_id_of(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-", "libpod-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
        .unwrap_or(name);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

fn pod_uid_of(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = name.rfind("pod")?;
    let uid = name.get(at + 3..)?.replace('_', "-");
    let valid = uid.len() == 36
        && uid.bytes().enumerate().all(|(i, b)| {
            if [8, 13, 18, 23].contains(&i) {
                b == b'-'
            } else {
                b.is_ascii_hexdigit()
            }
        });
    valid.then_some(uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1c2b8e9d7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e";
    const UID: &str = "5e1b2c3d-4f5a-6b7c-8d9e-0f1a2b3c4d5e";

    #[test]
    fn containerd_with_the_systemd_driver_on_cgroup_v2() {
        let text = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{ID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(parse_cgroup(&text), (Some(ID.to_string()), Some(UID.to_string())));
    }

    #[test]
    fn cgroupfs_driver_on_cgroup_v1() {
        let text = format!(
            "12:memory:/kubepods/besteffort/pod{UID}/{ID}\n11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{ID}\n1:name=systemd:/\n"
        );
        assert_eq!(parse_cgroup(&text), (Some(ID.to_string()), Some(UID.to_string())));
    }

    #[test]
    fn crio_and_docker() {
        let crio = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/crio-{ID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(parse_cgroup(&crio).0.as_deref(), Some(ID));
        let conmon = format!("0::/machine.slice/crio-conmon-{ID}.scope\n");
        assert_eq!(parse_cgroup(&conmon).0, None);
        assert_eq!(
            parse_cgroup(&format!("0::/system.slice/docker-{ID}.scope\n"))
                .0
                .as_deref(),
            Some(ID)
        );
        assert_eq!(
            parse_cgroup(&format!("4:pids:/docker/{ID}\n")).0.as_deref(),
            Some(ID)
        );
    }

    #[test]
    fn a_plain_host_has_no_container() {
        assert_eq!(
            parse_cgroup("0::/system.slice/postgresql@15-main.service\n"),
            (None, None)
        );
        assert_eq!(
            parse_cgroup("0::/user.slice/user-0.slice/session-3.scope\n"),
            (None, None)
        );
    }

    #[test]
    fn the_innermost_namespace_pid() {
        assert_eq!(namespace_pid("Name:\tpostgres\nNSpid:\t41234\t1\n"), Some(1));
        assert_eq!(namespace_pid("NSpid:\t41234\n"), Some(41234));
    }
}

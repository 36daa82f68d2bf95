//! The agent against a real API server (issue 22), authenticated as the chart's ServiceAccount
//! (a TokenRequest token, what the kubelet would mount), with `PGSCOPE_NODE_NAME` set. Two
//! namespaced Postgres "containers" run on the node; pods bound to the node name them in their
//! `status.containerStatuses` (patched through the status subresource: there is no kubelet).
//! Checked on the pushed series: host labels while the API server is down at the agent's start,
//! pod labels once it is up, a replaced container's new ID, labels gone after a delete, an API
//! server restart survived, and pods of another node never asked for (the audit log).

use std::ffi::OsStr;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use pgscope_tests::container_pg::{NamespacedPostgres, CONTAINER_ID};
use pgscope_tests::kube::{KubeControlPlane, CHART_NAMESPACE, CHART_RELEASE};
use pgscope_tests::pyroscope_capture::{decode_push, PyroscopeCapture, Series};
use pgscope_tests::{require_root_and_bpf, wait_for, PgInstall, RunningAgent};

const NODE: &str = "node-a";
const OTHER_NODE: &str = "node-b";
const APP_NAMESPACE: &str = "payments";
/// The second container: first a pod of another node claims it, then it replaces the first.
const SECOND_ID: &str = "5ec0d0000000000000000000000000000000000000000000000000000000b0b0";
const INTERVAL: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(90);

/// A rate-limited pgbench on one container, so that every interval has samples of it.
struct Load(Child);

impl Drop for Load {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_container(install: &PgInstall, id: &str) -> Result<(NamespacedPostgres, Load)> {
    let postgres = NamespacedPostgres::start_as(install, id)?;
    let pgbench = |args: &[&str]| postgres.pgbench(install, args);
    let init = pgbench(&["-i", "-s", "1", "-q"]).output()?;
    ensure!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    let load = pgbench(&["-S", "-c", "1", "-R", "200", "-T", "900"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok((postgres, Load(load)))
}

fn pod(name: &str, node: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"cnpg.io/cluster": "pg-payments"}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "postgres", "image": "postgres:15"}],
        },
    })
}

/// What the kubelet reports once the container runs: its ID, with the runtime's prefix.
fn report_container(kube: &KubeControlPlane, pod: &str, id: &str) -> Result<()> {
    let status = json!({"status": {
        "phase": "Running",
        "containerStatuses": [{
            "name": "postgres", "image": "postgres:15", "imageID": "",
            "containerID": format!("containerd://{id}"),
            "ready": true, "restartCount": 0,
            "state": {"running": {"startedAt": "2026-11-27T00:00:00Z"}},
        }],
    }});
    kube.admin(
        "PATCH",
        &format!("/api/v1/namespaces/{APP_NAMESPACE}/pods/{pod}/status"),
        Some(&status),
    )
    .map(drop)
}

/// The process_cpu series of container `id` pushed after `since`, oldest first.
fn series_of(capture: &PyroscopeCapture, id: &str, since: Instant) -> Result<Vec<Series>> {
    let mut found = Vec::new();
    for request in capture.requests() {
        if request.status != 200 || request.received <= since {
            continue;
        }
        found.extend(
            decode_push(&request)?.into_iter().filter(|s| {
                s.label("__name__") == Some("process_cpu") && s.label("container_id") == Some(id)
            }),
        );
    }
    Ok(found)
}

const POD_LABELS: [&str; 4] = ["namespace", "pod", "container", "service_name"];

fn pod_labels(series: &Series) -> Vec<String> {
    POD_LABELS
        .iter()
        .map(|name| format!("{name}={}", series.label(name).unwrap_or("-")))
        .collect()
}

/// Waits until a push after `since` has container `id`'s series labelled with pod `pod`
/// (`None`: with no pod at all); returns that series' pod labels.
fn wait_labels(
    capture: &PyroscopeCapture,
    id: &str,
    pod: Option<&str>,
    since: Instant,
) -> Result<Vec<String>> {
    wait_for(
        &format!("container {}'s series with pod {pod:?}", &id[..12]),
        WAIT,
        || {
            let series = series_of(capture, id, since)?;
            Ok(series
                .iter()
                .rev()
                .find(|s| s.label("pod") == pod)
                .map(pod_labels))
        },
    )
}

#[test]
fn the_agent_labels_its_nodes_pods_through_outages_and_restarts() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = install.debug_dir.clone().context("debug files")?;
    let kube = KubeControlPlane::start()?;
    let capture = PyroscopeCapture::start()?;
    kube.install_chart(&capture.url(), &[])?;
    let token = kube.service_account_token(CHART_NAMESPACE, CHART_RELEASE)?;
    let kubeconfig = kube.kubeconfig_for("agent", &token)?;
    kube.admin(
        "POST",
        "/api/v1/namespaces",
        Some(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": APP_NAMESPACE}})),
    )?;
    // What the controller manager (not run here) creates in every namespace; pods need it.
    kube.admin(
        "POST",
        &format!("/api/v1/namespaces/{APP_NAMESPACE}/serviceaccounts"),
        Some(&json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})),
    )?;

    let (first, _first_load) = start_container(&install, CONTAINER_ID)?;
    let (second, _second_load) = start_container(&install, SECOND_ID)?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"{}s\"\nfrequency = 49\n\
         debug_dirs = [\"{}\"]\n[[discovery.include]]\nport = {}\n[[discovery.include]]\nport = {}\n",
        capture.url(),
        INTERVAL.as_secs(),
        debug_dir.display(),
        first.port(),
        second.port(),
    );

    // The API server is down when the agent starts: it profiles with host labels meanwhile.
    kube.stop_apiserver()?;
    let agent = RunningAgent::start_with_env(
        &config,
        &[],
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            ("PGSCOPE_NODE_NAME", OsStr::new(NODE)),
        ],
    )?;
    let started = Instant::now();
    let host = wait_labels(&capture, CONTAINER_ID, None, started)
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
    eprintln!("API server down at start: {}", host.join(" "));
    let node_label = series_of(&capture, CONTAINER_ID, started)?
        .first()
        .and_then(|s| s.label("node").map(str::to_string));
    ensure!(node_label.as_deref() == Some(NODE), "node label {node_label:?}");

    // Up again: the pod of this node names the first container; a pod of another node claims
    // the second, which the agent must never learn of.
    kube.start_apiserver()?;
    for (name, node) in [("pg-payments-1", NODE), ("pg-elsewhere-1", OTHER_NODE)] {
        kube.admin(
            "POST",
            &format!("/api/v1/namespaces/{APP_NAMESPACE}/pods"),
            Some(&pod(name, node)),
        )?;
    }
    report_container(&kube, "pg-payments-1", CONTAINER_ID)?;
    report_container(&kube, "pg-elsewhere-1", SECOND_ID)?;
    let up = Instant::now();
    let labelled = wait_labels(&capture, CONTAINER_ID, Some("pg-payments-1"), up)
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let expected: Vec<String> = [
        "namespace=payments",
        "pod=pg-payments-1",
        "container=postgres",
        "service_name=payments/pg-payments",
    ]
    .map(String::from)
    .to_vec();
    ensure!(labelled == expected, "pod labels {labelled:?}");
    eprintln!(
        "pod labels after the API server came back ({:.1} s): {}",
        up.elapsed().as_secs_f64(),
        labelled.join(" ")
    );

    // A restart: the agent's watch breaks; a change made right after the restart (the
    // container replaced, a new ID) must still reach it.
    let audit_before = kube.audit_events()?.len();
    kube.stop_apiserver()?;
    std::thread::sleep(INTERVAL);
    kube.start_apiserver()?;
    report_container(&kube, "pg-payments-1", SECOND_ID)?;
    let restarted = Instant::now();
    wait_labels(&capture, SECOND_ID, Some("pg-payments-1"), restarted)
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let replaced = Instant::now();
    wait_labels(&capture, CONTAINER_ID, None, replaced)?;
    let after_restart: Vec<String> = kube.audit_events()?[audit_before..]
        .iter()
        .filter(|e| is_agent_pod_request(e) && e["stage"] == "RequestReceived")
        .map(|e| {
            format!(
                "{} {}",
                e["verb"].as_str().unwrap_or("?"),
                e["requestURI"].as_str().unwrap_or("?")
            )
        })
        .collect();
    ensure!(
        !after_restart.is_empty(),
        "the agent asked the restarted API server nothing about pods"
    );
    eprintln!(
        "after the restart ({:.1} s to the replaced container's labels), the agent asked: {after_restart:?}",
        restarted.elapsed().as_secs_f64()
    );

    // Deleted (at once: no kubelet here finishes a graceful deletion) → no pod labels from the
    // first push whose interval began after the delete.
    kube.admin(
        "DELETE",
        &format!("/api/v1/namespaces/{APP_NAMESPACE}/pods/pg-payments-1?gracePeriodSeconds=0"),
        None,
    )?;
    let deleted = Instant::now();
    wait_for("pushes a full interval after the delete", WAIT, || {
        Ok(
            (series_of(&capture, SECOND_ID, deleted + INTERVAL + Duration::from_secs(1))?.len() >= 2)
                .then_some(()),
        )
    })?;
    let late: Vec<Vec<String>> = series_of(&capture, SECOND_ID, deleted + INTERVAL + Duration::from_secs(1))?
        .iter()
        .filter(|s| s.label("pod").is_some())
        .map(pod_labels)
        .collect();
    ensure!(
        late.is_empty(),
        "labels of the deleted pod an interval later: {late:?}"
    );

    // Never the other node's pod, and never labels of the replaced container after the swap.
    let all = series_of(&capture, SECOND_ID, started)?;
    ensure!(
        all.iter().all(|s| s.label("pod") != Some("pg-elsewhere-1")),
        "a pod of {OTHER_NODE} labelled a container of {NODE}"
    );
    let stale = series_of(&capture, CONTAINER_ID, replaced + INTERVAL)?
        .iter()
        .filter(|s| s.label("pod").is_some())
        .count();
    ensure!(
        stale == 0,
        "{stale} series of the replaced container kept pod labels"
    );
    let pod_requests: Vec<Value> = kube
        .audit_events()?
        .into_iter()
        .filter(is_agent_pod_request)
        .collect();
    let selector = format!("fieldSelector=spec.nodeName%3D{NODE}");
    for event in &pod_requests {
        let uri = event["requestURI"].as_str().unwrap_or("");
        ensure!(
            matches!(event["verb"].as_str(), Some("list" | "watch")) && uri.contains(&selector),
            "the agent asked for pods without its node's selector: {event}"
        );
    }
    ensure!(
        !pod_requests.is_empty(),
        "no pod request of the agent in the audit log"
    );

    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    ensure!(
        log.contains("watching this node's pods again"),
        "the agent did not say it recovered:\n{log}"
    );
    for line in log
        .lines()
        .filter(|l| l.contains("node's pods") || l.contains("pod metadata"))
    {
        eprintln!("agent: {line}");
    }
    eprintln!(
        "{} pod requests of the agent in the audit log, each with `{selector}`",
        pod_requests.len()
    );
    eprintln!("kubernetes: labels=ok relist=ok");
    Ok(())
}

/// A request of the chart's ServiceAccount about pods.
fn is_agent_pod_request(event: &Value) -> bool {
    event["user"]["username"] == format!("system:serviceaccount:{CHART_NAMESPACE}:{CHART_RELEASE}")
        && event["objectRef"]["resource"] == "pods"
}

//! The Helm chart in a real API server (issue 22): `helm install`, `upgrade` and `uninstall` for
//! real, the objects as the API server validated, defaulted and stored them, and the RBAC it
//! grants checked by the real authorizer with a token of the chart's own ServiceAccount.
//! Needs no root; needs the control plane that `scripts/kube-control-plane.sh` builds (cached).

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use pgscope_tests::kube::{KubeControlPlane, CHART_NAMESPACE as NAMESPACE, CHART_RELEASE as RELEASE};

const PYROSCOPE_URL: &str = "http://127.0.0.1:4040";
const SELECTOR: &str = "app.kubernetes.io/instance=pgscope";

/// The release's objects, by API path, as the admin lists them.
const KINDS: [(&str, &str); 7] = [
    ("DaemonSet", "/apis/apps/v1/namespaces/observability/daemonsets"),
    ("ConfigMap", "/api/v1/namespaces/observability/configmaps"),
    (
        "ServiceAccount",
        "/api/v1/namespaces/observability/serviceaccounts",
    ),
    ("Secret", "/api/v1/namespaces/observability/secrets"),
    ("Service", "/api/v1/namespaces/observability/services"),
    ("ClusterRole", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
    (
        "ClusterRoleBinding",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ),
];

/// Names of the release's objects of each kind.
fn release_objects(kube: &KubeControlPlane) -> Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    for (kind, path) in KINDS {
        let list = kube.admin("GET", &format!("{path}?labelSelector={SELECTOR}"), None)?;
        for item in list["items"].as_array().into_iter().flatten() {
            found.push((
                kind.to_string(),
                item["metadata"]["name"].as_str().unwrap_or("").to_string(),
            ));
        }
    }
    Ok(found)
}

fn config_text(kube: &KubeControlPlane) -> Result<String> {
    let map = kube.admin(
        "GET",
        &format!("/api/v1/namespaces/{NAMESPACE}/configmaps/{RELEASE}"),
        None,
    )?;
    map["data"]
        .as_object()
        .and_then(|data| data.values().next())
        .and_then(Value::as_str)
        .map(str::to_string)
        .context("the ConfigMap holds no file")
}

#[test]
fn the_chart_installs_upgrades_and_uninstalls_in_a_real_api_server() -> Result<()> {
    let kube = KubeControlPlane::start()?;
    kube.install_chart(PYROSCOPE_URL, &[])?;

    let objects = release_objects(&kube)?;
    eprintln!("installed: {objects:?}");
    for kind in [
        "DaemonSet",
        "ConfigMap",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
    ] {
        ensure!(
            objects.iter().any(|(k, _)| k == kind),
            "no {kind} of the release in the API server: {objects:?}"
        );
    }
    // As the API server stored it: validated, and defaulted where the chart says nothing.
    let daemonset = kube.admin(
        "GET",
        &format!("/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{RELEASE}"),
        None,
    )?;
    let spec = &daemonset["spec"]["template"]["spec"];
    ensure!(spec["hostPID"] == json!(true), "hostPID is {}", spec["hostPID"]);
    ensure!(
        daemonset["spec"]["updateStrategy"]["type"].is_string(),
        "no update strategy defaulted: {}",
        daemonset["spec"]
    );
    let container = &spec["containers"][0];
    let added: Vec<&str> = container["securityContext"]["capabilities"]["add"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        added.contains(&"BPF") && added.contains(&"PERFMON") && !added.contains(&"SYS_ADMIN"),
        "capabilities added: {added:?}"
    );
    ensure!(
        container["securityContext"]["privileged"] != json!(true),
        "the agent runs privileged"
    );
    let env: Vec<&str> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .collect();
    ensure!(
        env.contains(&"PGSCOPE_NODE_NAME"),
        "no PGSCOPE_NODE_NAME in {env:?}"
    );
    let generation = daemonset["metadata"]["generation"].as_i64().unwrap_or(0);

    // An upgrade with other values changes the stored config and rolls the pod template.
    ensure!(
        config_text(&kube)?.contains("top_queryids = 100"),
        "default top_queryids not in the config"
    );
    kube.helm(&[
        "upgrade",
        RELEASE,
        "helm/pgscope",
        "--namespace",
        NAMESPACE,
        "--reuse-values",
        "--set",
        "labels.topQueryids=20",
    ])?;
    ensure!(
        config_text(&kube)?.contains("top_queryids = 20"),
        "the upgrade did not reach the ConfigMap"
    );
    let upgraded = kube.admin(
        "GET",
        &format!("/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{RELEASE}"),
        None,
    )?;
    ensure!(
        upgraded["metadata"]["generation"].as_i64().unwrap_or(0) > generation,
        "the pod template did not change with the config (checksum annotation)"
    );

    // Uninstalled: nothing of the release is left, not even helm's own release records.
    kube.helm(&["uninstall", RELEASE, "--namespace", NAMESPACE, "--wait"])?;
    let left = release_objects(&kube)?;
    ensure!(left.is_empty(), "left behind after uninstall: {left:?}");
    let records = kube.admin(
        "GET",
        &format!("/api/v1/namespaces/{NAMESPACE}/secrets?labelSelector=owner=helm"),
        None,
    )?;
    let records = records["items"].as_array().map_or(0, Vec::len);
    ensure!(records == 0, "{records} helm release records left");
    eprintln!("kubernetes: install=ok upgrade=ok uninstall=ok");
    Ok(())
}

#[test]
fn the_charts_service_account_may_read_pods_and_nothing_else() -> Result<()> {
    let kube = KubeControlPlane::start()?;
    kube.install_chart(PYROSCOPE_URL, &[])?;
    let token = kube.service_account_token(NAMESPACE, RELEASE)?;

    // What the agent does: list and watch the pods of its node.
    let node_pods = "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-a";
    let allowed = kube.request_as(&token, "GET", node_pods, None)?;
    ensure!(
        allowed.status == 200,
        "listing the node's pods: {} {}",
        allowed.status,
        allowed.body
    );
    let watch = kube.request_as(
        &token,
        "GET",
        &format!("{node_pods}&watch=true&timeoutSeconds=1"),
        None,
    );
    ensure!(watch.is_ok(), "watching the node's pods: {watch:?}");

    // Anything else is refused by the real authorizer.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "intruder"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    });
    let denied: [(&str, &str, Option<&Value>); 6] = [
        ("GET", "/api/v1/namespaces/observability/secrets", None),
        ("GET", "/api/v1/secrets", None),
        ("GET", "/api/v1/nodes", None),
        ("POST", "/api/v1/namespaces/default/pods", Some(&pod)),
        ("DELETE", "/api/v1/namespaces/default/pods/anything", None),
        ("GET", "/api/v1/namespaces/default/configmaps", None),
    ];
    for (method, path, body) in denied {
        let answer = kube.request_as(&token, method, path, body)?;
        ensure!(
            answer.status == 403,
            "{method} {path} as the chart's ServiceAccount: {} {}",
            answer.status,
            answer.body
        );
        let user = format!("system:serviceaccount:{NAMESPACE}:{RELEASE}");
        ensure!(
            answer.body["message"].as_str().is_some_and(|m| m.contains(&user)),
            "the refusal does not name the ServiceAccount: {}",
            answer.body
        );
        eprintln!(
            "{method} {path}: {} {}",
            answer.status,
            answer.body["message"].as_str().unwrap_or_default()
        );
    }
    // A token of no one is not a way in either.
    let anonymous = kube.request_as("not-a-token", "GET", node_pods, None)?;
    ensure!(anonymous.status == 401, "a bad token: {}", anonymous.status);
    eprintln!("kubernetes: denied=403");
    Ok(())
}

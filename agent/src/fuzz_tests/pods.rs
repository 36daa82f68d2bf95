//! Kubernetes pod JSON (`daemon::pods`) and the cgroup lines of `/proc/PID/cgroup`
//! (`container::parse_cgroup`): how a profile finds its pod. Any JSON and any cgroup text
//! leave the index consistent and never panic; in real-looking seeds the container ID is
//! found, and the ID a cgroup line names finds its container in the index of its pod.
//!
//! Seeds: `agent/tests/corpus/pods/` (a CloudNativePG pod on containerd with three containers,
//! an init container and a restarted one; a StatefulSet pod on CRI-O; an annotated Deployment
//! pod on Docker) and `agent/tests/corpus/cgroup/` (cgroup v1 and v2, systemd and cgroupfs
//! drivers, Burstable/BestEffort/Guaranteed pods, CRI-O's conmon, Docker, Podman, plain hosts).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use serde_json::Value;

use crate::container::parse_cgroup;
use crate::daemon::pods::PodIndex;
use crate::fuzzing;

const ORDERS_UID: &str = "8d2f4c1a-77b3-4e0f-9a55-3c6e1b2d4f80";
const ORDERS_PG: &str = "0d9c8b7a6f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6b5a";
const ANALYTICS_UID: &str = "f47ac10b-58cc-4372-a567-0e02b2c3d479";
const ANALYTICS_PG: &str = "c0ffee00deadbeef0123456789abcdef0123456789abcdef0123456789abcdef";
const BILLING_UID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
const BILLING_PG: &str = "4b3a2f1e0d9c8b7a69584736251403f2e1d0c9b8a79685746352413f2e1d0c9b";

/// What each cgroup seed names: (container ID, pod UID).
const CGROUP_SEEDS: [(&str, Option<&str>, Option<&str>); 13] = [
    (
        "containerd-cgroupfs-v1-besteffort",
        Some(ORDERS_PG),
        Some(ORDERS_UID),
    ),
    (
        "containerd-systemd-v1-burstable",
        Some(ORDERS_PG),
        Some(ORDERS_UID),
    ),
    (
        "containerd-systemd-v2-burstable",
        Some(ORDERS_PG),
        Some(ORDERS_UID),
    ),
    // conmon watches the container from inside the pod's slice: the pod, not a container.
    ("crio-conmon-v2", None, Some(ANALYTICS_UID)),
    (
        "crio-nested-container-v2",
        Some(ANALYTICS_PG),
        Some(ANALYTICS_UID),
    ),
    (
        "crio-systemd-v2-besteffort",
        Some(ANALYTICS_PG),
        Some(ANALYTICS_UID),
    ),
    (
        "docker-cgroupfs-v1-guaranteed",
        Some(BILLING_PG),
        Some(BILLING_UID),
    ),
    ("docker-cgroupfs-v1-plain", Some(BILLING_PG), None),
    ("docker-systemd-v1-plain", Some(BILLING_PG), None),
    ("host-postgresql-service", None, None),
    ("host-v1-hybrid", None, None),
    ("podman-libpod-v2", Some(ANALYTICS_PG), None),
    // This sandbox's own cgroup: a 32-hex-digit name that is no container ID.
    ("sandbox-host", None, None),
];

fn pod_seeds() -> Vec<(String, Vec<u8>)> {
    fuzzing::corpus("pods")
        .into_iter()
        .map(|(path, bytes)| (path.display().to_string(), bytes))
        .collect()
}

/// Every `containerID` of the pod's statuses (init containers too), with its container's name.
fn container_ids(pod: &Value) -> Vec<(String, String)> {
    ["containerStatuses", "initContainerStatuses"]
        .iter()
        .filter_map(|field| pod["status"][field].as_array())
        .flatten()
        .filter_map(|status| {
            let id = status["containerID"].as_str()?;
            Some((id.to_string(), status["name"].as_str()?.to_string()))
        })
        .collect()
}

/// Applies a pod, checks that each of its container IDs finds it, deletes it and checks that
/// none is left.
fn check_pod(pod: &Pod) {
    let mut index = PodIndex::default();
    index.apply(pod);
    index.apply(pod);
    let value = serde_json::to_value(pod).expect("a pod serialises");
    let named = pod.metadata.namespace.is_some() && pod.metadata.name.is_some();
    let ids = container_ids(&value);
    for (id, name) in &ids {
        let bare = id.split_once("://").map_or(id.as_str(), |(_, bare)| bare);
        match index.lookup(bare) {
            Some(found) if named => {
                // Two statuses may carry one ID (a mutation duplicated it): either name is right.
                assert!(
                    ids.iter().any(|(other, n)| other == id && *n == found.container),
                    "`{bare}` found `{}`, not `{name}`",
                    found.container
                );
                assert_eq!(Some(&found.namespace), pod.metadata.namespace.as_ref());
                assert!(!found.service_name.is_empty());
            }
            None => assert!(!named, "`{bare}` of a named pod is not indexed"),
            Some(found) => panic!("a pod without namespace or name is indexed: {found:?}"),
        }
    }
    index.delete(pod);
    for (id, _) in &ids {
        let bare = id.split_once("://").map_or(id.as_str(), |(_, bare)| bare);
        assert!(index.lookup(bare).is_none(), "`{bare}` outlived its pod");
    }
}

#[test]
fn seed_pods_map_every_container_id_to_its_container() {
    let seeds = pod_seeds();
    let mut index = PodIndex::default();
    for (name, bytes) in &seeds {
        let pod: Pod = serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("seed `{name}`: {e}"));
        check_pod(&pod);
        index.apply(&pod);
    }
    let expect = |id: &str, container: &str, service: &str| {
        let found = index.lookup(id).unwrap_or_else(|| panic!("`{id}` not indexed"));
        assert_eq!(
            (found.container.as_str(), found.service_name.as_str()),
            (container, service)
        );
    };
    expect(ORDERS_PG, "postgres", "shop/pg-orders");
    expect(
        "7e6d5c4b3a2918070f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a6978",
        "metrics-exporter",
        "shop/pg-orders",
    );
    expect(
        "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90",
        "bootstrap-controller",
        "shop/pg-orders",
    );
    expect(ANALYTICS_PG, "postgresql", "analytics/analytics-pg");
    expect(BILLING_PG, "db", "billing-primary");
    // A previous instance's ID (lastState) is gone with it.
    assert!(index
        .lookup("ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff")
        .is_none());
}

#[test]
fn mutated_pod_json_is_a_pod_or_an_error() {
    let seeds: Vec<Vec<u8>> = pod_seeds().into_iter().map(|(_, bytes)| bytes).collect();
    let count = seeds.len();
    let strategy = (0..count, proptest::collection::vec(fuzzing::mutation(), 1..6));
    TestRunner::new(fuzzing::config(256))
        .run(&strategy, |(index, mutations)| {
            let bytes = fuzzing::mutate(&seeds[index], &mutations);
            if let Ok(pod) = serde_json::from_slice::<Pod>(&bytes) {
                check_pod(&pod);
            }
            Ok(())
        })
        .expect("mutated pods");
}

/// Any JSON value, with the keys a pod has more often than not.
fn json_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("metadata".to_string()),
        Just("name".to_string()),
        Just("namespace".to_string()),
        Just("annotations".to_string()),
        Just("labels".to_string()),
        Just("ownerReferences".to_string()),
        Just("controller".to_string()),
        Just("status".to_string()),
        Just("containerStatuses".to_string()),
        Just("initContainerStatuses".to_string()),
        Just("containerID".to_string()),
        Just("cnpg.io/cluster".to_string()),
        Just("pgscope.io/service-name".to_string()),
        ".{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        Just(Value::from("containerd://")),
        Just(Value::from("://")),
        ".{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 64, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(key.clone(), inner, 0..6)
                .prop_map(|map: BTreeMap<String, Value>| Value::Object(map.into_iter().collect())),
        ]
    })
}

#[test]
fn arbitrary_json_is_a_pod_or_an_error() {
    // Some random values spliced into a real pod, some on their own.
    let seeds: Vec<Value> = pod_seeds()
        .iter()
        .map(|(name, bytes)| serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("`{name}`: {e}")))
        .collect();
    let count = seeds.len();
    let paths = prop_oneof![
        Just(vec![]),
        Just(vec!["metadata"]),
        Just(vec!["metadata", "labels"]),
        Just(vec!["metadata", "ownerReferences"]),
        Just(vec!["status"]),
        Just(vec!["status", "containerStatuses"]),
    ];
    let strategy = (0..count, paths, json_value());
    TestRunner::new(fuzzing::config(256))
        .run(&strategy, |(seed, path, value)| {
            let mut pod = seeds[seed].clone();
            match path.split_last() {
                None => pod = value,
                Some((last, parents)) => {
                    let slot = parents.iter().fold(&mut pod, |v, key| &mut v[*key]);
                    if slot.is_object() || slot.is_null() {
                        slot[*last] = value;
                    }
                }
            }
            if let Ok(pod) = serde_json::from_value::<Pod>(pod) {
                check_pod(&pod);
            }
            Ok(())
        })
        .expect("arbitrary JSON pods");
}

/// The line the kubelet's runtime makes for `id` of pod `uid`, as each runtime names its cgroups
/// (containerd with the systemd driver on v2, CRI-O likewise, Docker with cgroupfs on v1).
fn cgroup_of(runtime: &str, uid: &str, id: &str) -> String {
    let slice = uid.replace('-', "_");
    match runtime {
        "containerd" => format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice}.slice/cri-containerd-{id}.scope\n"
        ),
        "cri-o" => format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{slice}.slice/crio-{id}.scope\n"
        ),
        "docker" => format!("11:memory:/kubepods/pod{uid}/{id}\n1:name=systemd:/kubepods/pod{uid}/{id}\n"),
        other => panic!("no cgroup form for runtime `{other}`"),
    }
}

#[test]
fn a_containers_cgroup_finds_its_pod_container() {
    let mut index = PodIndex::default();
    for (name, bytes) in pod_seeds() {
        let value: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("`{name}`: {e}"));
        let pod: Pod = serde_json::from_value(value.clone()).expect("seed pods are pods");
        index.apply(&pod);
        let uid = value["metadata"]["uid"].as_str().expect("seed pods have a uid");
        for (id, container) in container_ids(&value) {
            let (runtime, bare) = id.split_once("://").expect("runtime://id");
            let (found_id, found_uid) = parse_cgroup(&cgroup_of(runtime, uid, bare));
            assert_eq!(found_id.as_deref(), Some(bare), "{runtime} in `{name}`");
            assert_eq!(found_uid.as_deref(), Some(uid), "{runtime} in `{name}`");
            let found = index.lookup(bare).expect("indexed");
            assert_eq!(found.container, container);
        }
    }
}

#[test]
fn seed_cgroups_name_their_container_and_pod() {
    let seeds = fuzzing::corpus("cgroup");
    assert_eq!(seeds.len(), CGROUP_SEEDS.len(), "every seed has its expectation");
    for (path, bytes) in seeds {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (_, id, uid) = CGROUP_SEEDS
            .iter()
            .find(|(seed, ..)| *seed == name)
            .unwrap_or_else(|| panic!("no expectation for the seed `{name}`"));
        let text = std::str::from_utf8(&bytes).expect("seed cgroups are text");
        let (found_id, found_uid) = parse_cgroup(text);
        assert_eq!(
            (found_id.as_deref(), found_uid.as_deref()),
            (*id, *uid),
            "seed `{name}`"
        );
    }
}

/// What any answer of `parse_cgroup` must be: a 64-hex-digit ID and a pod UID that the text
/// holds (the UID with dashes or, as systemd slices write it, underscores).
fn check_cgroup(text: &str) {
    let (id, uid) = parse_cgroup(text);
    if let Some(id) = id {
        assert!(
            id.len() == 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert!(
            text.to_ascii_lowercase().contains(&id),
            "`{id}` is not in the text"
        );
    }
    if let Some(uid) = uid {
        assert_eq!(uid.len(), 36);
        assert!(
            text.contains(&uid) || text.contains(&uid.replace('-', "_")),
            "`{uid}` is not in the text"
        );
    }
}

#[test]
fn mutated_cgroup_text_never_panics() {
    let seeds: Vec<Vec<u8>> = fuzzing::corpus("cgroup").into_iter().map(|(_, b)| b).collect();
    let count = seeds.len();
    let strategy = (0..count, proptest::collection::vec(fuzzing::mutation(), 1..6));
    TestRunner::new(fuzzing::config(512))
        .run(&strategy, |(index, mutations)| {
            let bytes = fuzzing::mutate(&seeds[index], &mutations);
            check_cgroup(&String::from_utf8_lossy(&bytes));
            Ok(())
        })
        .expect("mutated cgroup files");
}

/// A path segment that names no container or pod (hex IDs of other lengths, slices, words).
fn noise_segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("kubepods.slice".to_string()),
        Just("kubepods-burstable.slice".to_string()),
        Just("system.slice".to_string()),
        Just("crio-conmon-".to_string()),
        Just("pod".to_string()),
        "[0-9a-f]{0,63}",
        "(cri-containerd-|crio-|docker-)?[0-9a-f]{65,70}(\\.scope)?",
        "[a-z_.@-]{0,30}",
        "\\PC{0,20}".prop_filter("no slash", |s| !s.contains('/')),
    ]
}

#[test]
fn random_cgroup_lines_find_the_planted_id() {
    let forms = prop_oneof![
        Just(("cri-containerd-", ".scope")),
        Just(("crio-", ".scope")),
        Just(("docker-", ".scope")),
        Just(("libpod-", ".scope")),
        Just(("", "")),
    ];
    let line = (
        prop_oneof![Just("0:".to_string()), "[0-9]{1,2}:[a-z,=_]{0,20}"],
        proptest::collection::vec(noise_segment(), 0..6),
        forms,
        "[0-9a-fA-F]{64}",
        proptest::collection::vec(noise_segment(), 0..3),
    );
    TestRunner::new(fuzzing::config(512))
        .run(&line, |(hierarchy, before, (prefix, suffix), id, after)| {
            let path = before
                .iter()
                .cloned()
                .chain(std::iter::once(format!("{prefix}{id}{suffix}")))
                .chain(after.iter().cloned())
                .collect::<Vec<_>>()
                .join("/");
            let text = format!("{hierarchy}:/{path}\n");
            check_cgroup(&text);
            let (found, _) = parse_cgroup(&text);
            prop_assert_eq!(found, Some(id.to_ascii_lowercase()), "{}", text);
            Ok(())
        })
        .expect("planted container IDs");
}

#[test]
fn random_text_never_panics_the_cgroup_parser() {
    TestRunner::new(fuzzing::config(512))
        .run(&"\\PC{0,300}|[0-9:/a-z_.-]{0,300}", |text| {
            check_cgroup(&text);
            Ok(())
        })
        .expect("random cgroup text");
}

//! Pod metadata from the Kubernetes API: which pod and container a container ID belongs to,
//! from a watch on the pods of this node only (`fieldSelector=spec.nodeName=<node>`), so that
//! profiles carry `namespace`, `pod` and `container` and a service name operators recognise.
//! Without API access (a plain host, no service account) everything works with host labels.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use futures_util::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tracing::{info, warn};

/// The annotation a pod sets to choose its profiles' `service_name`.
pub const SERVICE_NAME_ANNOTATION: &str = "pgscope.io/service-name";

/// Labels Postgres operators put on their pods naming the cluster a pod belongs to:
/// CloudNativePG, Zalando's postgres-operator, Crunchy PGO, StackGres.
const CLUSTER_LABELS: [&str; 4] = [
    "cnpg.io/cluster",
    "cluster-name",
    "postgres-operator.crunchydata.com/cluster",
    "stackgres.io/cluster-name",
];

/// What a container ID maps to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodContainer {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The annotation, else `<namespace>/<operator cluster, else owner, else pod>`.
    pub service_name: String,
}

/// Container ID → pod container, for the pods of this node.
#[derive(Default, Debug)]
pub struct PodIndex {
    by_pod: HashMap<String, Vec<(String, PodContainer)>>,
    by_container: HashMap<String, PodContainer>,
}

impl PodIndex {
    pub fn lookup(&self, container_id: &str) -> Option<&PodContainer> {
        self.by_container.get(container_id)
    }

    /// Adds or replaces a pod (its containers may have restarted with new IDs).
    pub fn apply(&mut self, pod: &Pod) {
        let Some(key) = pod_key(pod) else { return };
        self.delete_key(&key);
        let containers = containers_of(pod);
        for (id, container) in &containers {
            self.by_container.insert(id.clone(), container.clone());
        }
        self.by_pod.insert(key, containers);
    }

    pub fn delete(&mut self, pod: &Pod) {
        if let Some(key) = pod_key(pod) {
            self.delete_key(&key);
        }
    }

    fn delete_key(&mut self, key: &str) {
        for (id, _) in self.by_pod.remove(key).unwrap_or_default() {
            self.by_container.remove(&id);
        }
    }
}

fn pod_key(pod: &Pod) -> Option<String> {
    let meta = &pod.metadata;
    Some(format!(
        "{}/{}",
        meta.namespace.as_deref()?,
        meta.name.as_deref()?
    ))
}

/// Every running container of the pod with its ID (`containerd://<id>`, `cri-o://<id>`,
/// `docker://<id>`: the runtime prefix dropped).
fn containers_of(pod: &Pod) -> Vec<(String, PodContainer)> {
    let meta = &pod.metadata;
    let (Some(namespace), Some(name)) = (meta.namespace.clone(), meta.name.clone()) else {
        return Vec::new();
    };
    let service_name = service_name(pod, &namespace, &name);
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .filter_map(|container| {
            let id = container.container_id.as_deref()?;
            let id = id.split_once("://").map_or(id, |(_, id)| id);
            Some((
                id.to_string(),
                PodContainer {
                    namespace: namespace.clone(),
                    pod: name.clone(),
                    container: container.name.clone(),
                    service_name: service_name.clone(),
                },
            ))
        })
        .collect()
}

fn service_name(pod: &Pod, namespace: &str, name: &str) -> String {
    let meta = &pod.metadata;
    if let Some(chosen) = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SERVICE_NAME_ANNOTATION))
        .filter(|v| !v.is_empty())
    {
        return chosen.clone();
    }
    let empty = BTreeMap::new();
    let labels = meta.labels.as_ref().unwrap_or(&empty);
    let cluster = CLUSTER_LABELS.iter().find_map(|label| labels.get(*label));
    let owner = meta
        .owner_references
        .as_ref()
        .and_then(|owners| {
            owners
                .iter()
                .find(|o| o.controller == Some(true))
                .or(owners.first())
        })
        .map(|owner| &owner.name);
    format!("{namespace}/{}", cluster.or(owner).map_or(name, String::as_str))
}

/// Watches this node's pods into `index` until the process ends; returns at once (saying so)
/// when there is no Kubernetes API to ask. While the API server is unreachable (down at start,
/// restarting) the index keeps what it had and the watch is retried with backoff; after a
/// re-list the index is swapped whole at its end, so lookups never see a half-loaded node.
pub async fn watch(node: String, index: Arc<RwLock<PodIndex>>) {
    let client = match Client::try_default().await {
        Ok(client) => client,
        Err(error) => {
            info!("no Kubernetes API ({error}): profiles carry host labels only");
            return;
        }
    };
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = std::pin::pin!(watcher::watcher(api, config));
    // Retries back off exponentially (0.8 s doubling to 30 s, with jitter): an API server coming
    // back is seen within seconds, and one that stays down is not hammered by every node.
    let mut backoff = watcher::DefaultBackoff::default();
    let mut pods = NodePods {
        index,
        relisting: None,
    };
    let mut failing = false;
    loop {
        match events.try_next().await {
            Ok(Some(event)) => {
                // `Init` comes before the list is asked for: not yet a sign the API answers.
                if !matches!(event, Event::Init) {
                    backoff.reset();
                    if failing {
                        info!(node, "watching this node's pods again");
                        failing = false;
                    }
                }
                if let Some(count) = pods.handle(event) {
                    info!(node, pods = count, "pod metadata of this node listed");
                }
            }
            Ok(None) => return,
            // 410 Gone: the last resourceVersion is too old (an API server restarted, etcd
            // compacted); the watcher lists again at its next step, and waiting would only keep
            // the labels stale longer.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {}
            Err(error) => {
                // The watcher resumes from the last resourceVersion, or lists again; say it
                // once per outage.
                if !failing {
                    warn!("watching this node's pods: {error} (pod labels may lag; retrying)");
                    failing = true;
                }
                if let Some(delay) = backoff.next() {
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

/// The shared index, and a re-list in progress: built aside and swapped in whole at its end,
/// so that lookups never see a half-listed node (nor lose the labels they had meanwhile).
struct NodePods {
    index: Arc<RwLock<PodIndex>>,
    relisting: Option<PodIndex>,
}

impl NodePods {
    /// Applies one watch event; the node's pod count when a (re-)list completes.
    fn handle(&mut self, event: Event<Pod>) -> Option<usize> {
        let shared = || self.index.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Init => self.relisting = Some(PodIndex::default()),
            Event::InitApply(pod) => self.relisting.get_or_insert_with(PodIndex::default).apply(&pod),
            Event::InitDone => {
                let fresh = self.relisting.take().unwrap_or_default();
                let count = fresh.by_pod.len();
                *shared() = fresh;
                return Some(count);
            }
            Event::Apply(pod) => shared().apply(&pod),
            Event::Delete(pod) => shared().delete(&pod),
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pods as the API server returns them (trimmed to the fields pgscope reads, plus a few
    /// it must ignore): a CloudNativePG instance and a plain StatefulSet pod.
    const PODS: &str = include_str!("../../tests/fixtures/pods.json");

    fn pods() -> Vec<Pod> {
        let list: serde_json::Value = serde_json::from_str(PODS).expect("fixture parses");
        serde_json::from_value(list["items"].clone()).expect("items are pods")
    }

    #[test]
    fn containers_map_to_their_pod_and_a_service_name() {
        let mut index = PodIndex::default();
        for pod in &pods() {
            index.apply(pod);
        }
        let cnpg = index
            .lookup("9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0")
            .expect("the CloudNativePG container");
        assert_eq!(
            cnpg,
            &PodContainer {
                namespace: "payments".into(),
                pod: "pg-payments-1".into(),
                container: "postgres".into(),
                service_name: "payments/pg-payments".into(),
            }
        );
        let plain = index
            .lookup("1111111111111111111111111111111111111111111111111111111111111111")
            .expect("the StatefulSet pod");
        assert_eq!(plain.service_name, "default/legacy-db");
        let annotated = index
            .lookup("2222222222222222222222222222222222222222222222222222222222222222")
            .expect("the annotated pod");
        assert_eq!(annotated.service_name, "billing-primary");
        assert_eq!(annotated.container, "db");
    }

    #[test]
    fn deleted_and_restarted_pods_leave_no_stale_ids() {
        let all = pods();
        let mut index = PodIndex::default();
        index.apply(&all[0]);
        let mut restarted = all[0].clone();
        if let Some(status) = restarted.status.as_mut() {
            for container in status.container_statuses.iter_mut().flatten() {
                container.container_id = Some(
                    "containerd://aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".into(),
                );
            }
        }
        index.apply(&restarted);
        assert!(index
            .lookup("9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0")
            .is_none());
        assert!(index
            .lookup("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
            .is_some());
        index.delete(&restarted);
        assert!(index
            .lookup("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
            .is_none());
    }

    #[test]
    fn a_relist_replaces_the_index_whole_and_only_when_complete() {
        const CNPG: &str = "9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0";
        const PLAIN: &str = "1111111111111111111111111111111111111111111111111111111111111111";
        let all = pods();
        let index = Arc::new(RwLock::new(PodIndex::default()));
        let found = |id: &str| index.read().expect("not poisoned").lookup(id).is_some();
        let mut node = NodePods {
            index: index.clone(),
            relisting: None,
        };
        node.handle(Event::Apply(all[0].clone()));
        // A re-list (after a restart of the API server) in which the first pod is gone, broken
        // off once half-way and started again.
        assert_eq!(node.handle(Event::Init), None);
        node.handle(Event::InitApply(all[0].clone()));
        node.handle(Event::Init);
        node.handle(Event::InitApply(all[1].clone()));
        assert!(found(CNPG), "labels kept while the re-list runs");
        assert!(!found(PLAIN), "a half-listed node is not shown");
        assert_eq!(node.handle(Event::InitDone), Some(1));
        assert!(!found(CNPG), "the pod gone from the list is gone from the index");
        assert!(found(PLAIN));
    }
}

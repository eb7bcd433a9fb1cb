//! The pods bound to this node and the huge pages they request: the agent
//! watches them (`spec.nodeName=<node>`, the index the kubelet's own watch
//! uses) and reports the pages per size in its status, so the operator can
//! show memory reserved that no pod asked for without watching every pod
//! of the fleet (docs/design.md, "Stranded pages").

use super::*;
use k8s_openapi::api::core::v1::Pod;

/// Pages per size that one pod requests.
type PodPages = BTreeMap<PageSize, u64>;

/// The node's pods as the watch delivers them, each kept only as the pages
/// it requests (nothing else of a pod is held).
#[derive(Debug, Default)]
pub struct NodePods {
    pods: BTreeMap<String, PodPages>,
    /// A re-list in progress: it replaces `pods` when it ends.
    relisting: Option<BTreeMap<String, PodPages>>,
    /// Whether a list has ended: before it, nothing is known.
    listed: bool,
}

fn key(pod: &Pod) -> String {
    let meta = &pod.metadata;
    meta.uid.clone().unwrap_or_else(|| {
        format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        )
    })
}

/// What one pod requests; nothing once it has ended.
fn pod_pages(pod: &Pod) -> PodPages {
    hugepool_crds::pod::requested_pages_by_size([pod])
}

impl NodePods {
    /// Takes one watch event; returns the pages per size the node's pods
    /// request when a list has ended, else `None`.
    pub fn apply(&mut self, event: watcher::Event<Pod>) -> Option<BTreeMap<PageSize, u64>> {
        match event {
            watcher::Event::Init => {
                self.relisting = Some(BTreeMap::new());
                return None;
            }
            watcher::Event::InitApply(pod) => {
                let pages = pod_pages(&pod);
                let list = self.relisting.get_or_insert_with(BTreeMap::new);
                if !pages.is_empty() {
                    list.insert(key(&pod), pages);
                }
                return None;
            }
            watcher::Event::InitDone => {
                self.pods = self.relisting.take().unwrap_or_default();
                self.listed = true;
            }
            watcher::Event::Apply(pod) => {
                let pages = pod_pages(&pod);
                if pages.is_empty() {
                    self.pods.remove(&key(&pod));
                } else {
                    self.pods.insert(key(&pod), pages);
                }
            }
            watcher::Event::Delete(pod) => {
                self.pods.remove(&key(&pod));
            }
        }
        self.listed.then(|| self.requested())
    }

    /// Pages per size over every pod.
    pub fn requested(&self) -> BTreeMap<PageSize, u64> {
        let mut total: BTreeMap<PageSize, u64> = BTreeMap::new();
        for (size, pages) in self.pods.values().flatten() {
            let sum = total.entry(*size).or_default();
            *sum = sum.saturating_add(*pages);
        }
        total
    }
}

/// Follows the pods bound to `node` and keeps the agent's count of the
/// pages they request (a status write when it changes).
pub(super) async fn watch_pods(api: Api<Pod>, node: String, shared: Arc<Shared>) {
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut pods = NodePods::default();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                let Some(requested) = pods.apply(event) else {
                    continue;
                };
                let mut memory = shared.memory();
                if memory.requested.as_ref() != Some(&requested) {
                    debug!(?requested, "pages the node's pods request");
                    memory.requested = Some(requested);
                    drop(memory);
                    shared.touch(false);
                }
            }
            Err(err) => {
                warn!(error = %err, "watch of the node's pods failed; retrying with backoff")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn pod(uid: &str, size: &str, amount: &str, phase: &str) -> Pod {
        let mut pod = Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "app".into(),
                    resources: Some(ResourceRequirements {
                        requests: Some(BTreeMap::from([(
                            format!("hugepages-{size}"),
                            Quantity(amount.into()),
                        )])),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        pod.metadata.uid = Some(uid.into());
        pod
    }

    #[test]
    fn nothing_is_known_before_the_first_list_ends() {
        let mut pods = NodePods::default();
        assert_eq!(pods.apply(watcher::Event::Init), None);
        assert_eq!(
            pods.apply(watcher::Event::InitApply(pod(
                "a", "2Mi", "64Mi", "Running"
            ))),
            None
        );
        assert_eq!(
            pods.apply(watcher::Event::InitDone),
            Some(BTreeMap::from([(PageSize::SIZE_2MI, 32)]))
        );
    }

    #[test]
    fn pods_are_counted_until_they_end_or_go() {
        let mut pods = NodePods::default();
        pods.apply(watcher::Event::Init);
        pods.apply(watcher::Event::InitDone);
        let two = PageSize::SIZE_2MI;
        let gig = PageSize::SIZE_1GI;
        pods.apply(watcher::Event::Apply(pod("a", "2Mi", "64Mi", "Running")));
        let both = pods.apply(watcher::Event::Apply(pod("b", "1Gi", "2Gi", "Pending")));
        assert_eq!(both, Some(BTreeMap::from([(two, 32), (gig, 2)])));
        // The same pod again is not counted twice.
        let again = pods.apply(watcher::Event::Apply(pod("a", "2Mi", "64Mi", "Running")));
        assert_eq!(again, Some(BTreeMap::from([(two, 32), (gig, 2)])));
        let ended = pods.apply(watcher::Event::Apply(pod("a", "2Mi", "64Mi", "Succeeded")));
        assert_eq!(ended, Some(BTreeMap::from([(gig, 2)])));
        let gone = pods.apply(watcher::Event::Delete(pod("b", "1Gi", "2Gi", "Pending")));
        assert_eq!(gone, Some(BTreeMap::new()));
    }

    #[test]
    fn a_relist_replaces_what_was_known() {
        let mut pods = NodePods::default();
        pods.apply(watcher::Event::Init);
        pods.apply(watcher::Event::InitApply(pod(
            "a", "2Mi", "64Mi", "Running",
        )));
        pods.apply(watcher::Event::InitDone);
        // "a" went while the watch was down; "c" came.
        pods.apply(watcher::Event::Init);
        pods.apply(watcher::Event::InitApply(pod("c", "2Mi", "8Mi", "Running")));
        assert_eq!(
            pods.apply(watcher::Event::InitDone),
            Some(BTreeMap::from([(PageSize::SIZE_2MI, 4)]))
        );
    }
}

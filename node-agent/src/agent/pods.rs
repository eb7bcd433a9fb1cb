//! The pages this node's pods request, reported in the agent's status so
//! the operator can show memory reserved that no pod asked for: read from
//! the hugetlb limits the kubelet sets on the pods' cgroups
//! (crate::pod_cgroups), so the agent reads no pod from the API
//! (docs/design.md, "Stranded pages").

use super::*;
use crate::pod_cgroups::PodCgroups;

/// Reads the pod cgroups every `interval` and keeps the agent's count of
/// the pages they request (a status write when it changes). A node whose
/// pods no hugetlb controller holds reports nothing (unknown, not 0).
pub(super) async fn read_pod_cgroups(cgroups: PodCgroups, interval: Duration, shared: Arc<Shared>) {
    let mut said_unknown = false;
    let mut failing = false;
    loop {
        let reader = cgroups.clone();
        let read = tokio::task::spawn_blocking(move || reader.requested())
            .await
            .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())));
        match read {
            Ok(requested) => {
                if failing {
                    info!("the pods' cgroups read again");
                    failing = false;
                }
                if requested.is_none() && !said_unknown {
                    info!(
                        "no hugetlb controller holds the kubelet's pods: the pages they request are not reported"
                    );
                    said_unknown = true;
                }
                let mut memory = shared.memory();
                if memory.requested != requested {
                    debug!(?requested, "pages the node's pods request");
                    memory.requested = requested;
                    drop(memory);
                    shared.touch(false);
                }
            }
            // The last count stands: a read that fails says nothing new.
            Err(err) if !failing => {
                warn!(error = %err, "reading the pods' cgroups failed; the last count stands");
                failing = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_count_follows_the_pod_cgroups_and_turns_unknown_without_them() {
        let root = tempfile::tempdir().expect("temp dir");
        let kubepods = root.path().join("hugetlb/kubepods");
        std::fs::create_dir_all(kubepods.join("pod1")).expect("mkdir");
        std::fs::write(kubepods.join("hugetlb.2MB.limit_in_bytes"), "0").expect("write");
        std::fs::write(kubepods.join("pod1/hugetlb.2MB.limit_in_bytes"), "16777216")
            .expect("write");
        let shared = Arc::new(Shared::new(Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        )));
        let task = tokio::spawn(read_pod_cgroups(
            PodCgroups::new(root.path()),
            Duration::from_millis(20),
            Arc::clone(&shared),
        ));
        let wait = |want: Option<BTreeMap<PageSize, u64>>| {
            let shared = Arc::clone(&shared);
            async move {
                tokio::time::timeout(Duration::from_secs(30), async {
                    while shared.memory().requested != want {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("requested never became {want:?}"));
            }
        };
        wait(Some(BTreeMap::from([(PageSize::SIZE_2MI, 8)]))).await;
        std::fs::remove_dir_all(kubepods.join("pod1")).expect("pod goes");
        wait(Some(BTreeMap::new())).await;
        std::fs::remove_dir_all(&kubepods).expect("no controller");
        wait(None).await;
        task.abort();
    }
}

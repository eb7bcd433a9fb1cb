//! `kubectl hugepool wait POOL`: waits until every node the pool selects
//! holds its pages, and fails at once, with the reason, when the rollout
//! ended any other way (where `kubectl wait --for=condition=...` would
//! succeed on a pool that selects nothing, or wait out its timeout).

use std::time::Duration;

use futures::StreamExt;
use hugepool_crds::conditions::find_condition;
use hugepool_crds::{HugePagePool, PoolConditionType};
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};

use super::PluginError;

/// Where a pool's rollout stands, for `wait`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Every selected node holds the pool's pages at this generation.
    Done(String),
    /// The rollout ended without that: the reason and what it says.
    Failed { reason: String, message: String },
    /// Still moving, or the operator has not seen this generation yet.
    Waiting(String),
}

/// Judges a pool by its conditions: done once the operator has seen its
/// generation and says the rollout is complete with nothing degraded; failed
/// when the rollout ended otherwise, or ended complete beside a Degraded
/// reason (nodes that do not answer, a conflict); waiting otherwise.
pub fn judge(pool: &HugePagePool) -> Settled {
    let conditions = pool
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let Some(progressing) = find_condition(conditions, PoolConditionType::Progressing) else {
        return Settled::Waiting("the operator has not reported on it yet".into());
    };
    let generation = pool.metadata.generation;
    if progressing.observed_generation != generation {
        return Settled::Waiting(format!(
            "the operator has not seen generation {} yet",
            generation.unwrap_or_default()
        ));
    }
    if progressing.status == "True" {
        return Settled::Waiting(format!("{}: {}", progressing.reason, progressing.message));
    }
    let degraded =
        find_condition(conditions, PoolConditionType::Degraded).filter(|d| d.status == "True");
    match (progressing.reason.as_str(), degraded) {
        ("RolloutComplete", None) => Settled::Done(progressing.message.clone()),
        ("RolloutComplete", Some(degraded)) => Settled::Failed {
            reason: degraded.reason.clone(),
            message: degraded.message.clone(),
        },
        // Paused with nothing changing: waiting for the user.
        ("Paused", _) => Settled::Waiting(format!("Paused: {}", progressing.message)),
        (reason, _) => Settled::Failed {
            reason: reason.to_string(),
            message: progressing.message.clone(),
        },
    }
}

/// Watches the pool until [`judge`] says done or failed, or `timeout`
/// passes; returns the last judgement (Waiting after a timeout).
pub async fn wait(client: &Client, name: &str, timeout: Duration) -> Result<Settled, PluginError> {
    let api: Api<HugePagePool> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut pools = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
    let mut last = Settled::Waiting(format!("no pool named {name} seen yet"));
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let next = tokio::time::timeout_at(deadline, pools.next()).await;
        match next {
            Err(_) | Ok(None) => return Ok(last),
            Ok(Some(Err(source))) => {
                return Err(PluginError::Watch {
                    what: "the pool",
                    source,
                });
            }
            Ok(Some(Ok(pool))) => {
                last = judge(&pool);
                if !matches!(last, Settled::Waiting(_)) {
                    return Ok(last);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use hugepool_crds::conditions::{ConditionUpdate, set_condition};
    use hugepool_crds::{HugePagePoolStatus, Reason};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn pool_with(
        generation: i64,
        conditions: &[(PoolConditionType, bool, Reason, i64)],
    ) -> HugePagePool {
        let mut pool: HugePagePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "hugepool.dev/v1alpha1",
            "kind": "HugePagePool",
            "metadata": {"name": "p", "generation": generation},
            "spec": {"nodeSelector": {}, "pageSize": "2Mi", "pages": 1},
        }))
        .expect("a pool");
        let mut status = HugePagePoolStatus::default();
        for &(type_, value, reason, seen) in conditions {
            let update = ConditionUpdate::new(type_, value, reason, format!("{reason:?}"))
                .generation(Some(seen));
            set_condition(
                &mut status.conditions,
                update,
                &Time(jiff::Timestamp::UNIX_EPOCH),
            );
        }
        pool.status = Some(status);
        pool
    }

    #[test]
    fn only_a_complete_rollout_at_this_generation_with_nothing_degraded_is_done() {
        use PoolConditionType::{Degraded, Progressing};
        let done = pool_with(
            2,
            &[
                (Progressing, false, Reason::RolloutComplete, 2),
                (Degraded, false, Reason::AsExpected, 2),
            ],
        );
        assert!(matches!(judge(&done), Settled::Done(_)));
        // The operator has not seen the change yet: the old "complete" says nothing.
        let stale = pool_with(3, &[(Progressing, false, Reason::RolloutComplete, 2)]);
        assert!(matches!(judge(&stale), Settled::Waiting(_)));
        let moving = pool_with(2, &[(Progressing, true, Reason::RollingOut, 2)]);
        assert!(matches!(judge(&moving), Settled::Waiting(_)));
    }

    #[test]
    fn a_rollout_that_ended_otherwise_fails_with_its_reason() {
        use PoolConditionType::{Degraded, Progressing};
        for (progressing, degraded, expected) in [
            (
                Reason::NoMatchingNodes,
                Reason::NoMatchingNodes,
                "NoMatchingNodes",
            ),
            (
                Reason::RolloutIncomplete,
                Reason::AllocationFailed,
                "RolloutIncomplete",
            ),
            (
                Reason::RolloutHalted,
                Reason::RolloutHalted,
                "RolloutHalted",
            ),
            (
                Reason::RolloutComplete,
                Reason::NodesUnresponsive,
                "NodesUnresponsive",
            ),
        ] {
            let ended = pool_with(
                1,
                &[
                    (Progressing, false, progressing, 1),
                    (Degraded, true, degraded, 1),
                ],
            );
            match judge(&ended) {
                Settled::Failed { reason, .. } => assert_eq!(reason, expected),
                other => panic!("{progressing:?}/{degraded:?}: {other:?}"),
            }
        }
    }
}

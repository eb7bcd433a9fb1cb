//! `hugepool-operator uninstall`: what `helm uninstall` runs before it deletes
//! anything (the chart's pre-delete hook), so that removing the operator
//! leaves no Node tainted `hugepool.dev/draining` and no pool held by the
//! `hugepool.dev/release` finalizer that only a running operator removes.
//!
//! The order matters: first the operator Deployment goes to 0 replicas and
//! its pods are gone, so that no leader puts a taint or a finalizer back;
//! then the taints and finalizers are removed. Kernel pools, HugePageNodes
//! and pools themselves are left as they are (docs/design.md, "Uninstall").

use std::time::Duration;

use hugepool_crds::{DRAINING_TAINT, HugePagePool, NOT_READY_TAINT, POOL_FINALIZER};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::time::Instant;
use tracing::info;

use crate::controller::{has_drain_taint, release_patch, taints_patch};
use crate::planner::has_taint;

/// What to stop and how long to wait for it.
#[derive(Clone, Debug)]
pub struct UninstallConfig {
    /// Namespace of the operator Deployment.
    pub namespace: String,
    /// Name of the operator Deployment.
    pub deployment: String,
    /// How long the operator's pods may take to exit.
    pub timeout: Duration,
}

/// What `uninstall` changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Operator pods that were running and have exited.
    pub stopped_pods: usize,
    /// Nodes the draining taint was removed from.
    pub untainted: Vec<String>,
    /// Pools the release finalizer was removed from.
    pub released: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("{action}: {source}")]
    Api {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("operator pods still running after {timeout:?}: {pods:?}")]
    OperatorStillRunning {
        timeout: Duration,
        pods: Vec<String>,
    },
}

fn api_error(action: impl Into<String>) -> impl FnOnce(kube::Error) -> UninstallError {
    let action = action.into();
    move |source| UninstallError::Api { action, source }
}

/// Stops the operator, then lifts its taints and finalizers (module docs).
pub async fn uninstall(client: Client, config: &UninstallConfig) -> Result<Report, UninstallError> {
    let mut report = Report {
        stopped_pods: stop_operator(&client, config).await?,
        ..Report::default()
    };
    let nodes: Api<Node> = Api::all(client.clone());
    for node in nodes
        .list(&ListParams::default())
        .await
        .map_err(api_error("listing Nodes"))?
    {
        if has_drain_taint(&node) || has_taint(&node, NOT_READY_TAINT) {
            let name = node.name_any();
            untaint(&nodes, node).await?;
            report.untainted.push(name);
        }
    }
    let pools: Api<HugePagePool> = Api::all(client);
    for pool in pools
        .list(&ListParams::default())
        .await
        .map_err(api_error("listing HugePagePools"))?
    {
        if pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
            let name = pool.name_any();
            release(&pools, pool).await?;
            report.released.push(name);
        }
    }
    info!(
        ?report,
        "uninstall: operator stopped, taints and finalizers removed"
    );
    Ok(report)
}

/// Scales the Deployment to 0 and waits until none of its pods is left
/// (terminating ones included: a leader still finishing a pass could write).
/// Returns how many pods were running. A missing Deployment is not an error.
async fn stop_operator(client: &Client, config: &UninstallConfig) -> Result<usize, UninstallError> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &config.namespace);
    let what = format!("Deployment {}/{}", config.namespace, config.deployment);
    let Some(deployment) = deployments
        .get_opt(&config.deployment)
        .await
        .map_err(api_error(format!("reading {what}")))?
    else {
        info!(deployment = %what, "uninstall: no operator Deployment");
        return Ok(0);
    };
    let selector = deployment
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .map(|labels| {
            labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    deployments
        .patch_scale(
            &config.deployment,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .map_err(api_error(format!("scaling {what} to 0")))?;
    info!(deployment = %what, "uninstall: scaled the operator to 0");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    let list = ListParams::default().labels(&selector);
    let deadline = Instant::now() + config.timeout;
    let mut seen = 0;
    loop {
        let left: Vec<String> = pods
            .list(&list)
            .await
            .map_err(api_error(format!("listing the pods of {what}")))?
            .into_iter()
            .map(|p| p.name_any())
            .collect();
        seen = seen.max(left.len());
        if left.is_empty() {
            return Ok(seen);
        }
        if Instant::now() >= deadline {
            return Err(UninstallError::OperatorStillRunning {
                timeout: config.timeout,
                pods: left,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Writes `patch(object)` guarded by the object's resourceVersion; on a
/// conflict reads the object again and retries (a Node's status moves often).
async fn patch_fresh<K, F>(api: &Api<K>, mut object: K, patch: F) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    F: Fn(&K) -> Option<serde_json::Value>,
{
    for _ in 0..5 {
        let Some(body) = patch(&object) else {
            return Ok(());
        };
        match api
            .patch(
                &object.name_any(),
                &PatchParams::default(),
                &Patch::Merge(body),
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                match api.get_opt(&object.name_any()).await? {
                    Some(fresh) => object = fresh,
                    None => return Ok(()),
                }
            }
            Err(other) => return Err(other),
        }
    }
    // Five conflicts in a row: one last read-modify-write, its error returned.
    let fresh = api.get(&object.name_any()).await?;
    match patch(&fresh) {
        Some(body) => api
            .patch(
                &fresh.name_any(),
                &PatchParams::default(),
                &Patch::Merge(body),
            )
            .await
            .map(|_| ()),
        None => Ok(()),
    }
}

async fn untaint(nodes: &Api<Node>, node: Node) -> Result<(), UninstallError> {
    let name = node.name_any();
    patch_fresh(nodes, node, |n| {
        (has_drain_taint(n) || has_taint(n, NOT_READY_TAINT))
            .then(|| taints_patch(n, &[(DRAINING_TAINT, false), (NOT_READY_TAINT, false)]))
    })
    .await
    .map_err(api_error(format!(
        "removing {DRAINING_TAINT} and {NOT_READY_TAINT} from Node {name}"
    )))?;
    info!(node = %name, "uninstall: hugepool taints removed");
    Ok(())
}

async fn release(pools: &Api<HugePagePool>, pool: HugePagePool) -> Result<(), UninstallError> {
    let name = pool.name_any();
    patch_fresh(pools, pool, release_patch)
        .await
        .map_err(api_error(format!(
            "removing {POOL_FINALIZER} from HugePagePool {name}"
        )))?;
    info!(pool = %name, "uninstall: release finalizer removed");
    Ok(())
}

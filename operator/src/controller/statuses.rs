//! Pools: their finalizer first, then their status (with the eviction
//! records), then the finalizer again once a deleted pool released its
//! nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use hugepool_crds::conditions::bounded_message;
use hugepool_crds::{HugePagePool, HugePagePoolStatus, POOL_FINALIZER};
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::info;

use super::evictions::{Evictions, Finished};
use super::writes::{apply_status_where_read, count_unlanded, fenced};
use super::{Context, Worker};
use crate::drain::Eviction;
use crate::error::{Error, Result};
use crate::events;
use crate::planner::{self, Plan};

/// Gives every pool that lacks it the finalizer. A pool is planned only
/// once its finalizer landed (or while it is being deleted): a pool
/// planned without one could be deleted with its pages still on the nodes.
pub(super) async fn add_finalizers(
    ctx: &Context,
    worker: &mut Worker,
    pools: &mut Vec<HugePagePool>,
    started: Instant,
) -> Result<()> {
    let api: Api<HugePagePool> = Api::all(ctx.client.clone());
    for pool in pools.iter_mut() {
        let name = pool.name_any();
        if pool.metadata.deletion_timestamp.is_some()
            || has_finalizer(pool)
            || !worker.pool_retries.due(&name, started)
        {
            continue;
        }
        match fenced(ctx, add_finalizer(&api, pool)).await {
            Ok(updated) => {
                ctx.deliveries.await_write("HugePagePool", &updated);
                *pool = updated;
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => {
                ctx.metrics.count_error(err.metric_label());
                worker.pool_retries.fail(&name, &err);
            }
        }
    }
    pools.retain(|pool| pool.metadata.deletion_timestamp.is_some() || has_finalizer(pool));
    Ok(())
}

fn has_finalizer(pool: &HugePagePool) -> bool {
    pool.finalizers().iter().any(|f| f == POOL_FINALIZER)
}

/// A pool's planned status with its eviction records as they stand: those
/// taken back left out, those whose real eviction waits for them added; a
/// draining pool's Progressing message names the evictions of its nodes
/// that are slow or refused (which pod, since when, what the API answered),
/// as their nodes' Draining conditions do.
pub(super) fn planned_status(
    name: &str,
    pool_plan: &planner::PoolPlan,
    evictions: &Evictions,
    now: jiff::Timestamp,
) -> HugePagePoolStatus {
    let mut status = pool_plan.status.clone();
    status
        .evicted_pods
        .retain(|record| !evictions.is_withdrawn(name, &record.uid));
    status.record_evictions(evictions.to_record(name).cloned());
    let notes: Vec<String> = pool_plan
        .draining
        .iter()
        .flat_map(|node| evictions.notes(node, now))
        .collect();
    if !notes.is_empty()
        && let Some(progressing) = status
            .conditions
            .iter_mut()
            .find(|c| c.type_ == "Progressing" && c.reason == "Draining")
    {
        progressing.message =
            bounded_message(format!("{}; {}", progressing.message, notes.join("; ")));
    }
    status
}

/// Every pool's status as planned, written where it changed; then the
/// evictions whose records landed are let go, and a deleted pool that
/// released every node loses its finalizer.
pub(super) async fn write_statuses(
    ctx: &Context,
    worker: &mut Worker,
    plan: &Plan,
    pools: Vec<HugePagePool>,
    started: Instant,
) -> Result<()> {
    let api: Api<HugePagePool> = Api::all(ctx.client.clone());
    // Each pool's status as it now stands on the API server, where known.
    let mut landed: BTreeMap<String, HugePagePoolStatus> = BTreeMap::new();
    // Pools whose write failed (a conflict is not a failure: it is retried).
    let mut failed: BTreeSet<String> = BTreeSet::new();
    let mut pools: BTreeMap<String, HugePagePool> =
        pools.into_iter().map(|p| (p.name_any(), p)).collect();
    for (name, pool_plan) in &plan.pools {
        let Some(pool) = pools.get_mut(name) else {
            continue;
        };
        ctx.metrics.observe_pool(name, pool_plan);
        worker.pools_seen.insert(name.clone());
        let status = planned_status(name, pool_plan, &worker.evictions, (ctx.now)());
        let old_status = pool.status.clone().unwrap_or_default();
        if status == old_status {
            landed.insert(name.clone(), status);
        } else if worker.pool_retries.due(name, started) {
            match write_pool_status(ctx, pool, &status).await {
                Ok(()) => {
                    worker.pool_retries.succeeded(name);
                    if !pool_plan.admitted.is_empty() {
                        info!(pool = %name, admitted = ?pool_plan.admitted, "nodes admitted to the rollout");
                    }
                    for event in events::pool_events(&old_status, &status) {
                        ctx.publish(event, &pool.object_ref(&())).await;
                    }
                    landed.insert(name.clone(), status);
                }
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(err) => {
                    if count_unlanded(ctx, &err) {
                        failed.insert(name.clone());
                    }
                    worker.pool_retries.fail(name, &err);
                }
            }
        }
        if landed.contains_key(name) {
            worker.evictions.pool_written(name);
        }
        if pool_plan.remove_finalizer && has_finalizer(pool) {
            match fenced(ctx, remove_finalizer(&api, pool)).await {
                Ok(()) => {
                    worker.pool_retries.succeeded(name);
                    worker.pools_seen.remove(name);
                    ctx.metrics.forget_pool(name);
                    info!(pool = %name, "pool released every node; finalizer removed");
                }
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(err) => {
                    ctx.metrics.count_error(err.metric_label());
                    worker.pool_retries.fail(name, &err);
                }
            }
        }
    }
    worker.evictions.release_recorded(
        |pool, uid| {
            landed
                .get(pool)
                .is_some_and(|status| status.evicted_pods.iter().any(|r| r.uid == uid))
        },
        |pool| failed.contains(pool),
    );
    Ok(())
}

/// Counts and tells the evictions that ended since the last pass: an
/// accepted one once, a refusal once per streak.
pub(super) async fn tell_evictions(ctx: &Context, finished: Vec<Finished>) {
    for Finished {
        eviction,
        outcome,
        first_refusal,
    } in finished
    {
        // (A pool gone has no metrics any more: none made anew.)
        for pool in &eviction.pools {
            if ctx
                .pools
                .get(&kube::runtime::reflector::ObjectRef::new(pool))
                .is_some()
            {
                ctx.metrics.count_eviction(pool, outcome.metric_label());
            }
        }
        match &outcome {
            Eviction::Evicted => {
                info!(node = %eviction.node, pod = %eviction.key(), pools = ?eviction.pools, "evicted");
            }
            Eviction::Gone => {
                tracing::debug!(node = %eviction.node, pod = %eviction.key(), "already gone; not an eviction");
            }
            Eviction::Blocked(message) | Eviction::Failed(message) => {
                tracing::debug!(node = %eviction.node, pod = %eviction.key(), %message, "eviction refused");
            }
            Eviction::Abandoned(why) => {
                info!(node = %eviction.node, pod = %eviction.key(), %why, "eviction abandoned");
            }
        }
        let tell = matches!(outcome, Eviction::Evicted | Eviction::Abandoned(_)) || first_refusal;
        if tell
            && let Some(event) = events::eviction_event(eviction.key(), &outcome)
            && let Some(node) = ctx
                .nodes
                .get(&kube::runtime::reflector::ObjectRef::new(&eviction.node))
        {
            ctx.publish(event, &super::node_reference(&node)).await;
        }
    }
}

/// Writes `status` as the pool's (server-side apply), on the condition
/// that the pool is still the version this pass holds: a deposed leader's
/// late write cannot overwrite what the new leader wrote since.
async fn write_pool_status(
    ctx: &Context,
    pool: &mut HugePagePool,
    status: &HugePagePoolStatus,
) -> Result<()> {
    let name = pool.name_any();
    let api: Api<HugePagePool> = Api::all(ctx.client.clone());
    let mut updated = fenced(ctx, async {
        apply_status_where_read(&api, pool, status)
            .await
            .map_err(|source| Error::PoolStatus {
                pool: name.clone(),
                source,
            })
    })
    .await?;
    updated.metadata.managed_fields = None;
    ctx.deliveries.await_write("HugePagePool", &updated);
    // The finalizer patch must carry the newest resourceVersion.
    *pool = updated;
    Ok(())
}

async fn add_finalizer(api: &Api<HugePagePool>, pool: &HugePagePool) -> Result<HugePagePool> {
    let mut finalizers = pool.finalizers().to_vec();
    finalizers.push(POOL_FINALIZER.into());
    let patch = json!({
        "metadata": {
            "resourceVersion": pool.resource_version(),
            "finalizers": finalizers,
        }
    });
    api.patch(
        &pool.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .map_err(|source| Error::Finalizer {
        pool: pool.name_any(),
        source,
    })
}

/// The merge patch that removes `hugepool.dev/release` from the pool's
/// finalizers (an atomic list: guarded by the resourceVersion it was read
/// at), or `None` when the pool does not carry it.
pub fn release_patch(pool: &HugePagePool) -> Option<serde_json::Value> {
    let kept: Vec<&String> = pool
        .finalizers()
        .iter()
        .filter(|f| *f != POOL_FINALIZER)
        .collect();
    (kept.len() != pool.finalizers().len()).then(|| {
        json!({
            "metadata": {
                "resourceVersion": pool.resource_version(),
                "finalizers": kept,
            }
        })
    })
}

async fn remove_finalizer(api: &Api<HugePagePool>, pool: &HugePagePool) -> Result<()> {
    let Some(patch) = release_patch(pool) else {
        return Ok(());
    };
    match api
        .patch(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Already gone: nothing left to release.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(Error::Finalizer {
            pool: pool.name_any(),
            source,
        }),
    }
}

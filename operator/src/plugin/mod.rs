//! `kubectl hugepool`: what users ask of a running hugepool, answered from
//! the operator's own planner over the live cluster. `plan`, `status` and
//! `why` decide in pure functions; this module reads the cluster and
//! prints.

pub mod check;
pub mod plan;
pub mod pod;
#[cfg(test)]
mod samples;
pub mod status;
pub mod top;
pub mod wait;
pub mod why;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hugepool_crds::settings::Consumption;
use hugepool_crds::{HugePageNode, HugePagePool};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};

use crate::drain;

/// Field manager of the dry runs `plan` sends (nothing is stored).
pub const PLUGIN_MANAGER: &str = "kubectl-hugepool";

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        source: kube::Error,
    },
    #[error("the API server refused the pool: {0}")]
    Refused(String),
    #[error("{0} is not a HugePagePool: {1}")]
    NotAPool(String, String),
    #[error("no pool named {0}")]
    NoSuchPool(String),
    #[error("no Node or HugePageNode named {0}")]
    NoSuchNode(String),
    #[error("no pod {1} in namespace {0}")]
    NoSuchPod(String, String),
    #[error("watching {what}: {source}")]
    Watch {
        what: &'static str,
        source: kube::runtime::watcher::Error,
    },
}

/// Pools, Nodes and HugePageNodes, listed once.
pub struct Cluster {
    pub pools: Vec<HugePagePool>,
    pub nodes: Vec<Node>,
    pub node_states: Vec<HugePageNode>,
}

impl Cluster {
    pub async fn read(client: &Client) -> Result<Self, PluginError> {
        let params = ListParams::default();
        let pools = Api::<HugePagePool>::all(client.clone())
            .list(&params)
            .await
            .map_err(|source| PluginError::List {
                what: "HugePagePools",
                source,
            })?
            .items;
        let nodes = Api::<Node>::all(client.clone())
            .list(&params)
            .await
            .map_err(|source| PluginError::List {
                what: "Nodes",
                source,
            })?
            .items;
        let node_states = Api::<HugePageNode>::all(client.clone())
            .list(&params)
            .await
            .map_err(|source| PluginError::List {
                what: "HugePageNodes",
                source,
            })?
            .items;
        Ok(Self {
            pools,
            nodes,
            node_states,
        })
    }

    pub fn view(&self) -> plan::ClusterView<'_> {
        plan::ClusterView {
            pools: &self.pools,
            nodes: &self.nodes,
            node_states: &self.node_states,
        }
    }
}

/// The pool in `text` (YAML or JSON) as the API server would store it: a
/// server-side dry run fills in the defaults and runs the schema's checks,
/// so a pool the server would refuse is refused here with its message.
pub async fn dry_run_pool(
    client: &Client,
    source: &str,
    text: &str,
) -> Result<HugePagePool, PluginError> {
    let pool: serde_json::Value = serde_saphyr::from_str(text)
        .map_err(|err| PluginError::NotAPool(source.to_string(), err.to_string()))?;
    if pool["kind"] != "HugePagePool" {
        return Err(PluginError::NotAPool(
            source.to_string(),
            format!("kind is {}", pool["kind"]),
        ));
    }
    let name = pool["metadata"]["name"]
        .as_str()
        .ok_or_else(|| PluginError::NotAPool(source.to_string(), "no metadata.name".into()))?
        .to_string();
    // Forced: the file is what the user means to apply, whoever set the
    // pool's fields before (a pool made by `kubectl create` or another
    // manager would otherwise conflict on every field the file changes).
    let params = PatchParams::apply(PLUGIN_MANAGER)
        .force()
        .dry_run()
        .validation_strict();
    Api::<HugePagePool>::all(client.clone())
        .patch(&name, &params, &Patch::Apply(&pool))
        .await
        .map_err(|err| match err {
            kube::Error::Api(status) => PluginError::Refused(status.message),
            other => PluginError::Refused(other.to_string()),
        })
}

/// Pods on `node` (all namespaces).
pub async fn pods_on(client: &Client, node: &str) -> Result<Vec<Pod>, PluginError> {
    let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
    Ok(Api::<Pod>::all(client.clone())
        .list(&params)
        .await
        .map_err(|source| PluginError::List {
            what: "Pods",
            source,
        })?
        .items)
}

/// What the claims of `pods` hold on `node` (DRA pools).
async fn claims_on(
    client: &Client,
    node: &str,
    pods: &[Pod],
) -> Result<drain::Claims, PluginError> {
    drain::Claims::read(client, node, pods)
        .await
        .map_err(|e| PluginError::List {
            what: "ResourceClaims",
            source: e.source,
        })
}

/// The plan for `pool` over the live cluster, with the pods of every node
/// that would need a drain (and, for a pool consumed through DRA, what
/// their claims hold).
pub async fn plan_pool(
    client: &Client,
    pool: &HugePagePool,
) -> Result<plan::PlanReport, PluginError> {
    let cluster = Cluster::read(client).await?;
    let now = jiff::Timestamp::now();
    let first = plan::simulate(&cluster.view(), pool, &BTreeMap::new(), now);
    let mut pods = BTreeMap::new();
    for node in plan::nodes_to_drain(&first) {
        let on_node = pods_on(client, &node).await?;
        let claims = if pool.spec.consumption == Some(Consumption::DynamicResourceAllocation) {
            claims_on(client, &node, &on_node).await?
        } else {
            drain::Claims::default()
        };
        pods.insert(
            node,
            drain::OnNode {
                pods: on_node,
                claims,
            },
        );
    }
    if pods.is_empty() {
        return Ok(first);
    }
    Ok(plan::simulate(&cluster.view(), pool, &pods, now))
}

/// Names of the pools `selector` (a label selector) picks; None without one.
async fn pools_selected(
    client: &Client,
    selector: Option<&str>,
) -> Result<Option<Vec<String>>, PluginError> {
    let Some(selector) = selector else {
        return Ok(None);
    };
    let pools = Api::<HugePagePool>::all(client.clone())
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|source| PluginError::List {
            what: "HugePagePools",
            source,
        })?;
    Ok(Some(
        pools
            .items
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect(),
    ))
}

/// `status`: every pool (or `only`, or those `selector` picks), planned
/// over the whole cluster (other pools' conflicts count).
pub async fn status(
    client: &Client,
    only: Option<&str>,
    selector: Option<&str>,
) -> Result<Vec<status::PoolRow>, PluginError> {
    let cluster = Cluster::read(client).await?;
    let picked = pools_selected(client, selector).await?;
    let mut rows = status::report(&cluster.view(), only, jiff::Timestamp::now());
    if let Some(picked) = &picked {
        rows.retain(|r| picked.contains(&r.name));
    }
    match only {
        Some(name) if rows.is_empty() => Err(PluginError::NoSuchPool(name.to_string())),
        _ => Ok(rows),
    }
}

/// `top`: pools and nodes by memory reserved that no pod requests (the
/// pools of `selector` only, and the nodes they manage, with one).
pub async fn top(client: &Client, selector: Option<&str>) -> Result<top::TopReport, PluginError> {
    let cluster = Cluster::read(client).await?;
    let picked = pools_selected(client, selector).await?;
    let mut report = top::report(&cluster.view(), jiff::Timestamp::now());
    if let Some(picked) = &picked {
        report.pools.retain(|p| picked.contains(&p.name));
        report
            .nodes
            .retain(|n| n.pool.as_ref().is_some_and(|pool| picked.contains(pool)));
    }
    Ok(report)
}

/// `status -w`: calls `show` with the status now and again whenever a
/// pool, Node or HugePageNode changes and the status with it, until `show`
/// returns false or `stop` resolves. Changes that come together (a watch
/// delivers a burst) are read once, after `settle`.
pub async fn watch_status(
    client: &Client,
    only: Option<&str>,
    selector: Option<&str>,
    settle: std::time::Duration,
    stop: impl std::future::Future<Output = ()>,
    mut show: impl FnMut(&[status::PoolRow]) -> bool,
) -> Result<(), PluginError> {
    use futures::StreamExt;
    use kube::runtime::watcher;
    let config = watcher::Config::default();
    let events = futures::stream::select_all([
        watcher::watcher(Api::<HugePagePool>::all(client.clone()), config.clone())
            .map(|e| e.map(|_| ()).map_err(|source| ("HugePagePools", source)))
            .boxed(),
        watcher::watcher(Api::<HugePageNode>::all(client.clone()), config.clone())
            .map(|e| e.map(|_| ()).map_err(|source| ("HugePageNodes", source)))
            .boxed(),
        watcher::watcher(Api::<Node>::all(client.clone()), config)
            .map(|e| e.map(|_| ()).map_err(|source| ("Nodes", source)))
            .boxed(),
    ]);
    tokio::pin!(stop);
    let mut events = events;
    let mut last: Option<Vec<status::PoolRow>> = None;
    loop {
        let rows = status(client, only, selector).await?;
        if last.as_ref() != Some(&rows) {
            if !show(&rows) {
                return Ok(());
            }
            last = Some(rows);
        }
        // Wait for a change, then let the burst it belongs to arrive.
        tokio::select! {
            _ = &mut stop => return Ok(()),
            event = events.next() => match event {
                None => return Ok(()),
                Some(Err((what, source))) => return Err(PluginError::Watch { what, source }),
                Some(Ok(())) => {}
            },
        }
        let quiet = tokio::time::sleep(settle);
        tokio::pin!(quiet);
        loop {
            tokio::select! {
                _ = &mut quiet => break,
                _ = &mut stop => return Ok(()),
                event = events.next() => match event {
                    None => break,
                    Some(Err((what, source))) => return Err(PluginError::Watch { what, source }),
                    Some(Ok(())) => {}
                },
            }
        }
    }
}

/// `why pod/NAME`: the pod, every Node and HugePageNode, and the pods
/// bound to nodes.
pub async fn why_pod(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<pod::PodReport, PluginError> {
    let target = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|source| PluginError::List {
            what: "Pods",
            source,
        })?
        .ok_or_else(|| PluginError::NoSuchPod(namespace.to_string(), name.to_string()))?;
    let cluster = Cluster::read(client).await?;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields("spec.nodeName!="))
        .await
        .map_err(|source| PluginError::List {
            what: "Pods",
            source,
        })?
        .items;
    let objects = if drain::uses_claims(&target) {
        dra_objects(client).await?
    } else {
        pod::DraObjects::default()
    };
    Ok(pod::report(
        &target,
        &cluster.nodes,
        &cluster.node_states,
        &pods,
        &objects,
    ))
}

/// hugepool's ResourceSlices and every ResourceClaim, as JSON.
async fn dra_objects(client: &Client) -> Result<pod::DraObjects, PluginError> {
    let slices = drain::list_served(
        &Api::all_with(client.clone(), &hugepool_crds::dra::resource_slices()),
        &ListParams::default().fields(&format!("spec.driver={}", hugepool_crds::dra::DRIVER)),
    )
    .await
    .map_err(|source| PluginError::List {
        what: "ResourceSlices",
        source,
    })?;
    let claims = drain::list_served(
        &Api::all_with(client.clone(), &hugepool_crds::dra::resource_claims()),
        &ListParams::default(),
    )
    .await
    .map_err(|source| PluginError::List {
        what: "ResourceClaims",
        source,
    })?;
    let json = |items: Vec<DynamicObject>| {
        items
            .into_iter()
            .filter_map(|o| serde_json::to_value(o).ok())
            .collect()
    };
    Ok(pod::DraObjects {
        slices: json(slices),
        claims: json(claims),
    })
}

pub async fn why(client: &Client, name: &str) -> Result<why::WhyReport, PluginError> {
    let node = Api::<Node>::all(client.clone())
        .get_opt(name)
        .await
        .map_err(|source| PluginError::List {
            what: "Nodes",
            source,
        })?;
    let state = Api::<HugePageNode>::all(client.clone())
        .get_opt(name)
        .await
        .map_err(|source| PluginError::List {
            what: "HugePageNodes",
            source,
        })?;
    if node.is_none() && state.is_none() {
        return Err(PluginError::NoSuchNode(name.to_string()));
    }
    // Events about the Node, its HugePageNode (same name) and nothing else.
    let events: Vec<Event> = Api::<Event>::all(client.clone())
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await
        .map_err(|source| PluginError::List {
            what: "Events",
            source,
        })?
        .items
        .into_iter()
        .filter(|e| {
            matches!(
                e.involved_object.kind.as_deref(),
                Some("Node" | "HugePageNode")
            )
        })
        .collect();
    let pods = pods_on(client, name).await?;
    let claims = match &state {
        Some(state) if state.spec.page_sizes.iter().any(|e| e.by_claims()) => {
            claims_on(client, name, &pods).await?
        }
        _ => drain::Claims::default(),
    };
    Ok(why::report(
        name,
        node.as_ref(),
        state.as_ref(),
        &events,
        &drain::OnNode { pods, claims },
        jiff::Timestamp::now(),
    ))
}

/// Columns padded to their widest cell, two spaces apart.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, width)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<width$}  ");
            }
        }
        text.push_str(out.trim_end());
        text.push('\n');
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    text
}

fn or_dash(value: Option<i64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn age(seconds: Option<i64>) -> String {
    match seconds {
        None => "-".into(),
        Some(s) if s < 120 => format!("{s}s"),
        Some(s) if s < 7200 => format!("{}m", s / 60),
        Some(s) if s < 172_800 => format!("{}h", s / 3600),
        Some(s) => format!("{}d", s / 86_400),
    }
}

/// `status` as text: one row per pool, then (for one pool) its nodes.
pub fn render_status(rows: &[status::PoolRow], with_nodes: bool) -> String {
    let mut text = table(
        &[
            "POOL",
            "SIZE",
            "PAGES",
            "SELECTED",
            "REACHED",
            "CHANGING",
            "PENDING",
            "FAILED",
            "STALLED",
            "BLOCKED",
            "AVAILABLE",
            "ROLLOUT",
        ],
        &rows
            .iter()
            .map(|r| {
                vec![
                    r.name.clone(),
                    r.page_size.to_string(),
                    or_dash(r.pages),
                    r.selected.to_string(),
                    r.converged.to_string(),
                    r.changing.to_string(),
                    r.pending.to_string(),
                    r.failed.to_string(),
                    r.stalled.to_string(),
                    r.blocked.to_string(),
                    r.available.short(),
                    if r.paused {
                        format!("{} (paused)", r.reason)
                    } else {
                        r.reason.clone()
                    },
                ]
            })
            .collect::<Vec<_>>(),
    );
    if with_nodes {
        for row in rows {
            let _ = writeln!(
                text,
                "\n{}: Available {}: {}",
                row.name,
                row.available.short(),
                row.available.message
            );
            let _ = writeln!(
                text,
                "{}: rollout {}: {}",
                row.name, row.reason, row.message
            );
            text.push_str(&table(
                &[
                    "NODE", "STATE", "CURRENT", "TARGET", "STALLED", "BLOCKED", "REASON",
                ],
                &row.nodes
                    .iter()
                    .map(|n| {
                        vec![
                            n.node.clone(),
                            n.state.clone(),
                            n.current.to_string(),
                            or_dash(n.target),
                            yes(n.stalled),
                            yes(n.blocked),
                            n.reason.clone(),
                        ]
                    })
                    .collect::<Vec<_>>(),
            ));
        }
    }
    text
}

/// `top` as text: pools, then nodes, memory in binary units.
pub fn render_top(report: &top::TopReport) -> String {
    let memory = |pages: i64, size: hugepool_crds::PageSize| {
        top::human_bytes(
            u64::try_from(pages)
                .unwrap_or(0)
                .saturating_mul(size.bytes()),
        )
    };
    let mut text = table(
        &[
            "POOL",
            "SIZE",
            "NODES",
            "ALLOCATED",
            "REQUESTED",
            "IN USE",
            "UNREQUESTED",
        ],
        &report
            .pools
            .iter()
            .map(|p| {
                let unreported = if p.unreported > 0 {
                    format!(" ({} node(s) not reporting requests)", p.unreported)
                } else {
                    String::new()
                };
                vec![
                    p.name.clone(),
                    p.page_size.to_string(),
                    p.nodes.to_string(),
                    memory(p.allocated, p.page_size),
                    memory(p.requested, p.page_size),
                    memory(p.in_use, p.page_size),
                    format!("{}{unreported}", top::human_bytes(p.unrequested_bytes)),
                ]
            })
            .collect::<Vec<_>>(),
    );
    text.push('\n');
    text.push_str(&table(
        &[
            "NODE",
            "SIZE",
            "POOL",
            "ALLOCATED",
            "REQUESTED",
            "IN USE",
            "UNREQUESTED",
        ],
        &report
            .nodes
            .iter()
            .map(|n| {
                vec![
                    n.node.clone(),
                    n.page_size.to_string(),
                    n.pool.clone().unwrap_or_else(|| "-".into()),
                    memory(n.allocated, n.page_size),
                    n.requested
                        .map_or_else(|| "-".into(), |r| memory(r, n.page_size)),
                    memory(n.in_use, n.page_size),
                    n.unrequested_bytes
                        .map_or_else(|| "-".into(), top::human_bytes),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    text
}

fn yes(flag: bool) -> String {
    if flag { "yes".into() } else { "-".into() }
}

/// `plan` as text.
pub fn render_plan(report: &plan::PlanReport) -> String {
    let changes: usize = report.waves.iter().map(Vec::len).sum();
    let mut text = format!(
        "HugePagePool {} ({}): {} node(s) change in {} wave(s) of at most {} ({}), {} unchanged, {} in conflict.\n",
        report.pool,
        if report.exists { "a change" } else { "new" },
        changes,
        report.waves.len(),
        report.max_unavailable,
        report.page_size,
        report.unchanged.len(),
        report.conflicts.len(),
    );
    let mut rows = Vec::new();
    for (wave, changes) in report.waves.iter().enumerate() {
        for change in changes {
            let drain = match &change.drain {
                None => "-".to_string(),
                Some(need) if need.policy == hugepool_crds::settings::DrainPolicy::Never => {
                    format!("blocked: {} pages held, drain.policy Never", need.held)
                }
                Some(need) if need.evict.is_empty() => need
                    .unexplained
                    .clone()
                    .unwrap_or_else(|| "nothing to evict".into()),
                Some(need) => format!("evicts {}", need.evict.join(", ")),
            };
            rows.push(vec![
                (wave + 1).to_string(),
                change.node.clone(),
                change.from.to_string(),
                change.to.to_string(),
                change
                    .estimated_seconds
                    .map_or_else(|| "-".into(), |s| format!("{s:.1}s")),
                match (change.predicted, change.short()) {
                    (None, _) => "-".into(),
                    (Some(p), None) => p.to_string(),
                    (Some(p), Some(short)) => format!("{p} (short {short})"),
                },
                drain,
            ]);
        }
    }
    if !rows.is_empty() {
        text.push_str(&table(
            &[
                "WAVE",
                "NODE",
                "FROM",
                "TO",
                "ESTIMATE",
                "PREDICTED",
                "DRAIN",
            ],
            &rows,
        ));
    }
    let short: Vec<&plan::NodeChange> = report
        .waves
        .iter()
        .flatten()
        .filter(|c| c.short().is_some())
        .collect();
    if !short.is_empty() {
        let _ = writeln!(
            text,
            "{} node(s) predicted to come short by their agents' free lists (after compaction, within minMemAvailable): {}",
            short.len(),
            short
                .iter()
                .map(|c| format!("{} by {}", c.node, c.short().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for conflict in &report.conflicts {
        let _ = writeln!(
            text,
            "conflict: {} is owned by the older pool {}; this pool waits there",
            conflict.node, conflict.owner
        );
    }
    for stuck in &report.stuck {
        let _ = writeln!(text, "stuck: {}: {}", stuck.node, stuck.reason);
    }
    if let Some(seconds) = report.estimated_seconds {
        let _ = writeln!(
            text,
            "estimated time of the kernel writes: {seconds:.1}s (from each node's last measured rate)"
        );
    }
    text.push_str("Nothing was written.\n");
    text
}

/// `why` as text.
pub fn render_why(report: &why::WhyReport) -> String {
    let mut text = format!("Node {}", report.node);
    if !report.node_exists {
        text.push_str(" (no Node object)");
    }
    if !report.taints.is_empty() {
        let taints: Vec<&str> = report.taints.iter().map(|t| t.taint.as_str()).collect();
        let _ = write!(text, " (tainted {})", taints.join(", "));
    }
    text.push('\n');
    for taint in &report.taints {
        let _ = writeln!(text, "  {}: {}", taint.taint, taint.meaning);
    }
    text.push_str(&table(
        &[
            "SIZE",
            "POOL",
            "TARGET",
            "TOTAL",
            "FREE",
            "RESERVED",
            "IN USE",
            "REQUESTED",
            "SURPLUS",
            "KUBELET",
        ],
        &report
            .sizes
            .iter()
            .map(|s| {
                vec![
                    s.size.to_string(),
                    s.pool.clone().unwrap_or_else(|| "-".into()),
                    or_dash(s.target),
                    s.total.to_string(),
                    s.free.to_string(),
                    s.reserved.to_string(),
                    s.in_use.to_string(),
                    or_dash(s.requested),
                    s.surplus.to_string(),
                    or_dash(s.kubelet_capacity),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    for size in &report.sizes {
        if let Some(resize) = &size.last_resize {
            let _ = writeln!(
                text,
                "last resize of {}: {} -> {} ({}), reached {} in {} writes, {:.2}s, longest write {:.1}ms",
                size.size,
                resize.from,
                resize.to,
                resize.outcome,
                resize.achieved,
                resize.steps,
                resize.duration_seconds,
                resize.max_step_seconds * 1000.0
            );
        }
    }
    text.push_str("\nConditions:\n");
    text.push_str(&table(
        &["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
        &report
            .conditions
            .iter()
            .map(|c| {
                vec![
                    c.type_.clone(),
                    c.status.clone(),
                    c.reason.clone(),
                    age(c.age_seconds),
                    c.message.clone(),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    text.push_str("\nPods holding pages:\n");
    if report.pods.is_empty() {
        text.push_str("none\n");
    } else {
        text.push_str(&table(
            &["POD", "SIZE", "PAGES", "EVICTABLE"],
            &report
                .pods
                .iter()
                .map(|p| {
                    vec![
                        p.pod.clone(),
                        p.size.to_string(),
                        p.pages.to_string(),
                        if p.unevictable.is_empty() {
                            "yes".into()
                        } else {
                            format!("no ({})", p.unevictable)
                        },
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    text.push_str("\nRecent events:\n");
    if report.events.is_empty() {
        text.push_str("none\n");
    } else {
        text.push_str(&table(
            &["AGE", "OBJECT", "TYPE", "REASON", "MESSAGE"],
            &report
                .events
                .iter()
                .map(|e| {
                    let count = if e.count > 1 {
                        format!(" (x{})", e.count)
                    } else {
                        String::new()
                    };
                    vec![
                        age(e.age_seconds),
                        e.object.clone(),
                        e.type_.clone(),
                        e.reason.clone(),
                        format!("{}{count}", e.message),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    text
}

/// `why pod/NAME` as text.
pub fn render_why_pod(report: &pod::PodReport) -> String {
    let mut text = format!("Pod {} ({}", report.pod, report.phase);
    if let Some(node) = &report.node {
        let _ = write!(text, " on {node}");
    }
    text.push_str(")\n");
    let requests: Vec<String> = report
        .requests
        .iter()
        .map(|r| format!("{} pages of {}", r.pages, r.size))
        .collect();
    let _ = writeln!(
        text,
        "requests: {}",
        if requests.is_empty() && !report.claims.is_empty() {
            "no hugepages-<size>; pages through ResourceClaims".to_string()
        } else if requests.is_empty() {
            "no hugepages".to_string()
        } else {
            requests.join(", ")
        }
    );
    if let Some(scheduler) = &report.scheduler {
        let _ = writeln!(text, "scheduler: {scheduler}");
    }
    if report.excluded_by_node_selector > 0 {
        let _ = writeln!(
            text,
            "{} node(s) with the size left out: the pod's nodeSelector rules them out",
            report.excluded_by_node_selector
        );
    }
    if !report.nodes.is_empty() {
        text.push('\n');
        text.push_str(&table(
            &[
                "NODE",
                "SIZE",
                "POOL",
                "TARGET",
                "KERNEL",
                "ALLOCATABLE",
                "REQUESTED",
                "STALE",
                "TAINTS",
                "BLOCKED BY",
            ],
            &report
                .nodes
                .iter()
                .map(|n| {
                    vec![
                        n.node.clone(),
                        n.size.to_string(),
                        n.pool.clone().unwrap_or_else(|| "-".into()),
                        or_dash(n.target),
                        or_dash(n.kernel),
                        or_dash(n.allocatable),
                        n.requested.to_string(),
                        yes(n.stale),
                        if n.taints.is_empty() {
                            "-".into()
                        } else {
                            n.taints.join(",")
                        },
                        if n.blocked_by.is_empty() {
                            "- (fits)".into()
                        } else {
                            n.blocked_by.clone()
                        },
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    if !report.claims.is_empty() {
        text.push('\n');
        text.push_str(&table(
            &["CLAIM", "REQUEST", "SIZE", "PAGES", "ALLOCATED ON"],
            &report
                .claims
                .iter()
                .map(|c| {
                    vec![
                        c.claim.clone(),
                        c.request.clone(),
                        c.size.to_string(),
                        c.pages.to_string(),
                        c.allocated.clone().unwrap_or_else(|| "- (pending)".into()),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    if !report.devices.is_empty() {
        text.push('\n');
        text.push_str(&table(
            &[
                "NODE",
                "DEVICE",
                "SIZE",
                "CAPACITY",
                "ALLOCATED",
                "BLOCKED BY",
            ],
            &report
                .devices
                .iter()
                .map(|d| {
                    vec![
                        d.node.clone(),
                        d.device.clone(),
                        d.size.to_string(),
                        d.capacity.to_string(),
                        d.allocated.to_string(),
                        if d.blocked_by.is_empty() {
                            "- (fits)".into()
                        } else {
                            d.blocked_by.clone()
                        },
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    let _ = writeln!(text, "\nverdict: {}", report.verdict);
    text
}

/// `check` as text: one line a check.
pub fn render_check(report: &check::CheckReport) -> String {
    let mut text = String::new();
    for check in &report.checks {
        let _ = writeln!(
            text,
            "{:<4}  {}: {}",
            if check.ok { "OK" } else { "FAIL" },
            check.name,
            check.detail
        );
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed == 0 {
        let _ = writeln!(text, "all {} checks passed", report.checks.len());
    } else {
        let _ = writeln!(text, "{failed} of {} checks failed", report.checks.len());
    }
    text
}

/// `check`: reads what [`check::report`] decides on. The operator and agent
/// are found by the chart's labels, in `namespace` or in any.
pub async fn check(
    client: &Client,
    namespace: Option<&str>,
    selector: Option<&str>,
) -> Result<check::CheckReport, PluginError> {
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::CustomResourceExt;

    let list = |what: &'static str| move |source| PluginError::List { what, source };
    let crd_api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut crds = Vec::new();
    for name in [HugePagePool::crd_name(), HugePageNode::crd_name()] {
        let crd = crd_api
            .get_opt(name)
            .await
            .map_err(list("CustomResourceDefinitions"))?;
        crds.push((name.to_string(), crd));
    }
    let (deployments, daemonsets): (Api<Deployment>, Api<DaemonSet>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let operators = deployments
        .list(&ListParams::default().labels(check::OPERATOR_SELECTOR))
        .await
        .map_err(list("Deployments"))?
        .items;
    let agents = daemonsets
        .list(&ListParams::default().labels(check::AGENT_SELECTOR))
        .await
        .map_err(list("DaemonSets"))?
        .items;
    let lease = match operators.first().and_then(check::lease_of) {
        Some((ns, name)) => {
            let lease = Api::<Lease>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await
                .map_err(list("Leases"))?;
            Some((ns, name, lease))
        }
        None => None,
    };
    // Without the CRDs these fail: the agents check says so, the rest run.
    let read = async {
        let pools = status(client, None, selector).await?;
        let node_states = Api::<HugePageNode>::all(client.clone())
            .list(&ListParams::default())
            .await
            .map_err(list("HugePageNodes"))?
            .items;
        Ok::<_, PluginError>((pools, node_states))
    };
    let (pools, node_states, unreadable) = match read.await {
        Ok((pools, node_states)) => (pools, node_states, None),
        Err(err) => (Vec::new(), Vec::new(), Some(err.to_string())),
    };
    Ok(check::report(
        &check::CheckInput {
            crds,
            operators,
            agents,
            lease,
            pools,
            unreadable,
            node_states,
            plugin_version: env!("CARGO_PKG_VERSION").to_string(),
        },
        jiff::Timestamp::now(),
    ))
}

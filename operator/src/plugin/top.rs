//! `kubectl hugepool top`: where huge page memory sits reserved with no pod
//! asking for it. Pools, then nodes, by unrequested memory (pages the
//! kernel holds less the pages that pods bound to the node request), from
//! the pools' plan and the agents' reports.

use hugepool_crds::PageSize;
use jiff::Timestamp;
use serde::Serialize;

use super::plan::ClusterView;

/// One pool, summed over its nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolTop {
    pub name: String,
    pub page_size: PageSize,
    pub nodes: usize,
    /// Pages the kernels hold (`status.pages.current`).
    pub allocated: i64,
    /// Pages the pods bound to the nodes request.
    pub requested: i64,
    /// Pages processes have mapped.
    pub in_use: i64,
    /// Allocated less requested, per node (at least 0), summed.
    pub unrequested: i64,
    pub unrequested_bytes: u64,
    /// Nodes whose agent does not report requests yet (counted in
    /// allocated and in use, not in requested or unrequested).
    pub unreported: usize,
}

/// One page size on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeTop {
    pub node: String,
    pub page_size: PageSize,
    /// The pool whose entry the node's spec holds for the size.
    pub pool: Option<String>,
    pub allocated: i64,
    /// `None`: the agent does not report requests (yet).
    pub requested: Option<i64>,
    pub in_use: i64,
    pub unrequested: Option<i64>,
    pub unrequested_bytes: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopReport {
    pub pools: Vec<PoolTop>,
    pub nodes: Vec<NodeTop>,
}

fn bytes(pages: i64, size: PageSize) -> u64 {
    u64::try_from(pages)
        .unwrap_or(0)
        .saturating_mul(size.bytes())
}

/// Pools and nodes, most unrequested memory first (then by name); nodes
/// whose agent does not report requests last. Sizes a node holds no pages
/// of, and no pod asks for, are left out.
pub fn report(view: &ClusterView<'_>, now: Timestamp) -> TopReport {
    let plan = view.plan(now);
    let mut pools: Vec<PoolTop> = view
        .pools
        .iter()
        .filter_map(|pool| {
            let name = pool.metadata.name.clone()?;
            let pool_plan = plan.pools.get(&name)?;
            let pages = &pool_plan.status.pages;
            let size = pool.spec.page_size;
            Some(PoolTop {
                page_size: size,
                nodes: pool_plan.members.len(),
                allocated: pages.current,
                requested: pages.requested,
                in_use: pages.in_use,
                unrequested: pages.unrequested,
                unrequested_bytes: bytes(pages.unrequested, size),
                unreported: pool_plan
                    .members
                    .iter()
                    .filter(|m| m.requested.is_none())
                    .count(),
                name,
            })
        })
        .collect();
    pools.sort_by(|a, b| (b.unrequested_bytes, &a.name).cmp(&(a.unrequested_bytes, &b.name)));
    let mut rows: Vec<NodeTop> = Vec::new();
    for state in view.node_states {
        let Some(node) = state.metadata.name.clone() else {
            continue;
        };
        for reported in state.status.iter().flat_map(|s| &s.page_sizes) {
            let asked = reported.requested.unwrap_or(0);
            if reported.total == 0 && asked == 0 {
                continue;
            }
            let unrequested = reported.requested.map(|r| (reported.total - r).max(0));
            rows.push(NodeTop {
                node: node.clone(),
                page_size: reported.size,
                pool: state
                    .spec
                    .page_sizes
                    .iter()
                    .find(|e| e.size == reported.size && !e.pool.is_empty())
                    .map(|e| e.pool.clone()),
                allocated: reported.total,
                requested: reported.requested,
                in_use: reported.in_use,
                unrequested,
                unrequested_bytes: unrequested.map(|u| bytes(u, reported.size)),
            });
        }
    }
    rows.sort_by(|a, b| {
        let rank = |r: &NodeTop| std::cmp::Reverse(r.unrequested_bytes);
        (rank(a), &a.node, a.page_size).cmp(&(rank(b), &b.node, b.page_size))
    });
    TopReport { pools, nodes: rows }
}

/// Bytes in the largest binary unit they reach, with one decimal when not
/// whole: `1.5Gi`, `600Mi`, `0`.
pub fn human_bytes(bytes: u64) -> String {
    for (suffix, shift) in [("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
        let unit = 1u64 << shift;
        if bytes >= unit {
            let tenths = (u128::from(bytes) * 10 + u128::from(unit) / 2) / u128::from(unit);
            return if tenths % 10 == 0 {
                format!("{}{suffix}", tenths / 10)
            } else {
                format!("{}.{}{suffix}", tenths / 10, tenths % 10)
            };
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{apply_specs, converge, node, pool, run_plan};
    use hugepool_crds::HugePageNode;

    fn cluster() -> (
        Vec<hugepool_crds::HugePagePool>,
        Vec<k8s_openapi::api::core::v1::Node>,
        Vec<HugePageNode>,
    ) {
        let pools = vec![
            pool("dpdk", 0, "dpdk", "2Mi", 512),
            pool("vms", 0, "vms", "1Gi", 4),
        ];
        let nodes = vec![
            node("w-1", &["dpdk"]),
            node("w-2", &["dpdk"]),
            node("w-3", &["vms"]),
        ];
        let mut states = Vec::new();
        for pass in 0..10 {
            apply_specs(&run_plan(&pools, &nodes, &states, pass), &mut states);
            states.iter_mut().for_each(converge);
        }
        (pools, nodes, states)
    }

    fn ask(states: &mut [HugePageNode], node: &str, requested: Option<i64>, in_use: i64) {
        let state = states
            .iter_mut()
            .find(|s| s.metadata.name.as_deref() == Some(node))
            .expect("the node");
        let entry = &mut state.status.as_mut().expect("a status").page_sizes[0];
        entry.requested = requested;
        entry.in_use = in_use;
    }

    #[test]
    fn pools_and_nodes_are_ranked_by_memory_no_pod_requests() {
        let (pools, nodes, mut states) = cluster();
        // dpdk: w-1 all requested, w-2 112 of 512 x 2Mi (800Mi idle);
        // vms: 1 of 4 x 1Gi (3Gi idle).
        ask(&mut states, "w-1", Some(512), 500);
        ask(&mut states, "w-2", Some(112), 100);
        ask(&mut states, "w-3", Some(1), 1);
        let view = ClusterView {
            pools: &pools,
            nodes: &nodes,
            node_states: &states,
        };
        let top = report(&view, crate::fixtures::at(0));
        let ranked: Vec<(&str, i64, u64)> = top
            .pools
            .iter()
            .map(|p| (p.name.as_str(), p.requested, p.unrequested_bytes))
            .collect();
        assert_eq!(ranked, [("vms", 1, 3 << 30), ("dpdk", 624, 800 << 20)]);
        assert_eq!((top.pools[1].allocated, top.pools[1].in_use), (1024, 600));
        let ranked: Vec<(&str, Option<u64>)> = top
            .nodes
            .iter()
            .map(|n| (n.node.as_str(), n.unrequested_bytes))
            .collect();
        assert_eq!(
            ranked,
            [
                ("w-3", Some(3 << 30)),
                ("w-2", Some(800 << 20)),
                ("w-1", Some(0))
            ]
        );
        assert_eq!(top.nodes[0].pool.as_deref(), Some("vms"));
    }

    #[test]
    fn a_node_whose_agent_does_not_report_requests_comes_last_and_is_counted_apart() {
        let (pools, nodes, mut states) = cluster();
        ask(&mut states, "w-1", None, 0);
        ask(&mut states, "w-2", Some(0), 0);
        ask(&mut states, "w-3", Some(4), 4);
        let view = ClusterView {
            pools: &pools,
            nodes: &nodes,
            node_states: &states,
        };
        let top = report(&view, crate::fixtures::at(0));
        let dpdk = top.pools.iter().find(|p| p.name == "dpdk").expect("dpdk");
        assert_eq!((dpdk.unrequested, dpdk.unreported), (512, 1));
        assert_eq!(top.nodes.last().map(|n| n.node.as_str()), Some("w-1"));
        assert_eq!(top.nodes.last().and_then(|n| n.unrequested), None);
    }

    #[test]
    fn memory_is_shown_in_the_largest_unit_it_reaches() {
        assert_eq!(human_bytes(0), "0");
        assert_eq!(human_bytes(600 << 20), "600Mi");
        assert_eq!(human_bytes(3 << 29), "1.5Gi");
        assert_eq!(human_bytes(1 << 40), "1Ti");
        assert_eq!(human_bytes(1023), "1023");
    }
}

//! Operator metrics (docs/design.md, "Dashboards and tooling") and the one
//! HTTP port that serves them with `/healthz` and `/readyz`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::planner::PoolPlan;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolStateLabels {
    pub pool: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolKindLabels {
    pub pool: String,
    pub kind: String,
}

/// The kinds `hugepool_pool_pages` and `hugepool_pool_bytes` publish:
/// sums over the pool's nodes (docs/design.md, "Dashboards and tooling").
/// They overlap (requested and unrequested are parts of current), so a sum
/// over `kind` means nothing; pick one.
pub const POOL_PAGE_KINDS: &[&str] = &["target", "current", "requested", "in_use", "unrequested"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    pub pool: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

/// Every `error` label `Error::metric_label` names (a test holds the two
/// together), exported at 0 so that a first error is an increase.
pub const RECONCILE_ERROR_LABELS: &[&str] = &[
    "node_spec",
    "drain_condition",
    "allocated_claims",
    "taint",
    "list_pods",
    "list_claims",
    "pool_status",
    "finalizer",
    "not_leader",
    "leader",
    "serve",
    "event",
    "timeout",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabels {
    pub watch: String,
}

/// The kinds the operator watches, as `hugepool_watch_errors_total` names
/// them.
pub const WATCHES: &[&str] = &["HugePagePool", "Node", "HugePageNode", "Pod", "Lease"];

/// Every metric the operator exports, registered in `registry`.
pub struct Metrics {
    pub registry: Registry,
    pub pool_nodes: Family<PoolStateLabels, Gauge>,
    pub pool_pages: Family<PoolKindLabels, Gauge>,
    /// The same in bytes (pages times the pool's page size), so pools of
    /// different sizes compare and an alert's threshold is memory.
    pub pool_bytes: Family<PoolKindLabels, Gauge>,
    /// Converged nodes whose kubelet reports a stale capacity, per pool.
    pub pool_kubelet_stale_nodes: Family<PoolLabels, Gauge>,
    pub evictions: Family<EvictionLabels, Counter>,
    pub reconciles: Counter,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    /// Writes that found their object changed since the plan read it.
    pub write_conflicts: Counter,
    /// Errors of each watch (the watcher backs off and lists anew).
    pub watch_errors: Family<WatchLabels, Counter>,
    /// Events of each watch that woke the worker for a pass.
    pub watch_wakeups: Family<WatchLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub plan_duration: Histogram,
    pub leader: Gauge,
    /// Whether this replica leads; held while pool series change.
    leading: Mutex<bool>,
}

/// What the operator counts of one watch that wakes its worker.
#[derive(Clone, Default)]
pub struct WatchCounters {
    /// Its errors (`hugepool_watch_errors_total`).
    pub errors: Counter,
    /// Its events that woke the worker (`hugepool_watch_wakeups_total`).
    pub wakeups: Counter,
}

impl Metrics {
    /// The counter of errors of the watch of `kind` (one of [`WATCHES`]).
    pub fn watch_errors_of(&self, kind: &str) -> Counter {
        self.watch_errors
            .get_or_create(&WatchLabels { watch: kind.into() })
            .clone()
    }

    /// The errors and wakeups of the watch of `kind`.
    pub fn watch_of(&self, kind: &str) -> WatchCounters {
        WatchCounters {
            errors: self.watch_errors_of(kind),
            wakeups: self
                .watch_wakeups
                .get_or_create(&WatchLabels { watch: kind.into() })
                .clone(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let pool_nodes = Family::<PoolStateLabels, Gauge>::default();
        let pool_pages = Family::<PoolKindLabels, Gauge>::default();
        let pool_bytes = Family::<PoolKindLabels, Gauge>::default();
        let pool_kubelet_stale_nodes = Family::<PoolLabels, Gauge>::default();
        let evictions = Family::<EvictionLabels, Counter>::default();
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let write_conflicts = Counter::default();
        let watch_errors = Family::<WatchLabels, Counter>::default();
        let watch_wakeups = Family::<WatchLabels, Counter>::default();
        for watch in WATCHES {
            let _ = watch_errors.get_or_create(&WatchLabels {
                watch: (*watch).into(),
            });
            if *watch != "Lease" {
                let _ = watch_wakeups.get_or_create(&WatchLabels {
                    watch: (*watch).into(),
                });
            }
        }
        let reconcile_duration = Histogram::new([
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ]);
        let plan_duration =
            Histogram::new([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]);
        let leader = Gauge::default();
        for label in RECONCILE_ERROR_LABELS {
            let _ = reconcile_errors.get_or_create(&ErrorLabels {
                error: (*label).into(),
            });
        }
        registry.register(
            "hugepool_pool_nodes",
            "Nodes of a pool by state (selected, converged, updating, pending, failed)",
            pool_nodes.clone(),
        );
        registry.register(
            "hugepool_pool_pages",
            "Pages of a pool summed over its nodes by kind: target, current (allocated in the kernel), \
             requested (by pods bound to the nodes), in_use (mapped by processes), unrequested \
             (current less requested, per node, at least 0)",
            pool_pages.clone(),
        );
        registry.register(
            "hugepool_pool_bytes",
            "hugepool_pool_pages in bytes (pages times the pool's page size)",
            pool_bytes.clone(),
        );
        registry.register(
            "hugepool_pool_kubelet_stale_nodes",
            "Converged nodes of a pool whose kubelet still reports another hugepages-<size> capacity \
             (pods cannot use the pages there until it restarts; with every node converged the pool \
             is Available=False/KubeletCapacityStale)",
            pool_kubelet_stale_nodes.clone(),
        );
        registry.register(
            "hugepool_evictions",
            "Evictions of hugepage consumers by result (evicted, blocked, failed)",
            evictions.clone(),
        );
        registry.register(
            "hugepool_reconciles",
            "Reconciles of pools",
            reconciles.clone(),
        );
        registry.register(
            "hugepool_reconcile_errors",
            "Failed reconciles by error",
            reconcile_errors.clone(),
        );
        registry.register(
            "hugepool_write_conflicts",
            "Writes that found their object changed since the plan read it (retried for that node or pool)",
            write_conflicts.clone(),
        );
        registry.register(
            "hugepool_watch_errors",
            "Errors of the operator's watches by kind (HugePagePool, Node, HugePageNode, Pod, Lease): \
             each is retried with backoff; one that repeats (an RBAC refusal) leaves the operator blind to that kind",
            watch_errors.clone(),
        );
        registry.register(
            "hugepool_watch_wakeups",
            "Events of the operator's watches that woke it for a pass, by kind (HugePagePool, Node, \
             HugePageNode, Pod; ResourceClaim with DRA): with hugepool_reconciles_total, what its \
             passes are for (the rest are its deadlines and retries)",
            watch_wakeups.clone(),
        );
        registry.register(
            "hugepool_reconcile_duration_seconds",
            "Duration of one reconcile",
            reconcile_duration.clone(),
        );
        registry.register(
            "hugepool_plan_duration_seconds",
            "Time one pass spends planning the cluster (reading the caches and the pure planner), without API calls",
            plan_duration.clone(),
        );
        registry.register(
            "hugepool_operator_build",
            "The operator's version",
            prometheus_client::metrics::info::Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
            }),
        );
        registry.register(
            "hugepool_leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        Self {
            registry,
            pool_nodes,
            pool_pages,
            pool_bytes,
            pool_kubelet_stale_nodes,
            evictions,
            reconciles,
            reconcile_errors,
            write_conflicts,
            watch_errors,
            watch_wakeups,
            reconcile_duration,
            plan_duration,
            leader,
            leading: Mutex::new(false),
        }
    }
}

impl Metrics {
    /// Publishes one pool's counts and pages, while this replica leads (a
    /// pass that ends after the Lease went publishes nothing).
    pub fn observe_pool(&self, pool: &str, plan: &PoolPlan) {
        let leading = self.leading.lock().unwrap_or_else(|e| e.into_inner());
        if !*leading {
            return;
        }
        let nodes = &plan.status.nodes;
        for (state, value) in [
            ("selected", nodes.selected),
            ("converged", nodes.converged),
            ("updating", nodes.updating),
            ("pending", nodes.pending),
            ("failed", nodes.failed),
            ("unresponsive", nodes.unresponsive),
        ] {
            self.pool_nodes
                .get_or_create(&PoolStateLabels {
                    pool: pool.into(),
                    state: state.into(),
                })
                .set(value);
        }
        let pages = &plan.status.pages;
        for (kind, value) in [
            ("target", pages.target),
            ("current", pages.current),
            ("requested", pages.requested),
            ("in_use", pages.in_use),
            ("unrequested", pages.unrequested),
        ] {
            let labels = PoolKindLabels {
                pool: pool.into(),
                kind: kind.into(),
            };
            self.pool_pages.get_or_create(&labels).set(value);
            if let Some(size) = plan.page_size {
                let bytes = i128::from(value) * i128::from(size.bytes());
                let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
                self.pool_bytes.get_or_create(&labels).set(bytes);
            }
        }
        self.pool_kubelet_stale_nodes
            .get_or_create(&PoolLabels { pool: pool.into() })
            .set(plan.capacity_stale.len() as i64);
    }

    /// Drops the series of a pool that is gone.
    pub fn forget_pool(&self, pool: &str) {
        for state in [
            "selected",
            "converged",
            "updating",
            "pending",
            "failed",
            "unresponsive",
        ] {
            self.pool_nodes.remove(&PoolStateLabels {
                pool: pool.into(),
                state: state.into(),
            });
        }
        for kind in POOL_PAGE_KINDS {
            let labels = PoolKindLabels {
                pool: pool.into(),
                kind: (*kind).into(),
            };
            self.pool_pages.remove(&labels);
            self.pool_bytes.remove(&labels);
        }
        self.pool_kubelet_stale_nodes
            .remove(&PoolLabels { pool: pool.into() });
    }

    /// Records whether this replica leads. Only the leader plans, so only it
    /// publishes pools: a replica that stops leading drops every pool's
    /// series at once (stale ones would keep alerts such as
    /// HugepoolPoolNodesFailed firing from a former leader).
    pub fn set_leading(&self, leading: bool) {
        let mut current = self.leading.lock().unwrap_or_else(|e| e.into_inner());
        *current = leading;
        self.leader.set(i64::from(leading));
        if !leading {
            self.pool_nodes.clear();
            self.pool_pages.clear();
            self.pool_bytes.clear();
            self.pool_kubelet_stale_nodes.clear();
        }
    }

    pub fn count_eviction(&self, pool: &str, result: &str) {
        self.evictions
            .get_or_create(&EvictionLabels {
                pool: pool.into(),
                result: result.into(),
            })
            .inc();
    }

    pub fn observe_reconcile(&self, duration: Duration) {
        self.reconciles.inc();
        self.reconcile_duration.observe(duration.as_secs_f64());
    }

    pub fn count_error(&self, label: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                error: label.into(),
            })
            .inc();
    }

    /// The registry in OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// What the HTTP endpoints read (`/healthz` is always ok: the watches and
/// the controller restart themselves; `/readyz` waits for the caches).
#[derive(Clone)]
pub struct Health {
    pub metrics: Arc<Metrics>,
    /// Set once the watches have listed everything (the planner never plans
    /// from a partial view).
    pub ready: Arc<AtomicBool>,
}

impl hugepool_runtime::Probes for Health {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn live(&self) -> Result<(), String> {
        Ok(())
    }

    fn ready(&self) -> Result<(), String> {
        if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("caches not synced".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::planner::PoolPlan;
    use hugepool_crds::pool::{HugePagePoolStatus, PoolNodeCounts};

    fn plan_with_failed(failed: i64) -> PoolPlan {
        PoolPlan {
            status: HugePagePoolStatus {
                nodes: PoolNodeCounts {
                    selected: 3,
                    failed,
                    ..Default::default()
                },
                ..Default::default()
            },
            max_unavailable: 1,
            ..Default::default()
        }
    }

    /// One error of each variant; the match fails to compile when a variant
    /// is added, so its label cannot be left out of RECONCILE_ERROR_LABELS.
    fn one_error_of_each_kind() -> Vec<Error> {
        let kube = || kube::Error::TlsRequired;
        let errors = vec![
            Error::NodeSpec {
                node: "w-1".into(),
                source: kube(),
            },
            Error::DrainCondition {
                node: "w-1".into(),
                source: kube(),
            },
            Error::AllocatedClaims {
                node: "w-1".into(),
                source: kube(),
            },
            Error::Taint {
                node: "w-1".into(),
                source: kube(),
            },
            Error::ListPods {
                node: "w-1".into(),
                source: kube(),
            },
            Error::ListClaims {
                node: "w-1".into(),
                namespace: "apps".into(),
                source: kube(),
            },
            Error::PoolStatus {
                pool: "db".into(),
                source: kube(),
            },
            Error::Finalizer {
                pool: "db".into(),
                source: kube(),
            },
            Error::NotLeader,
            Error::Leader(kube_lease_manager::LeaseManagerError::InconsistentState(
                "test".into(),
            )),
            Error::Serve {
                addr: ([127, 0, 0, 1], 8080).into(),
                source: std::io::Error::other("test"),
            },
            Error::Event { source: kube() },
            Error::Timeout(std::time::Duration::from_secs(1)),
        ];
        for error in &errors {
            match error {
                Error::NodeSpec { .. }
                | Error::DrainCondition { .. }
                | Error::AllocatedClaims { .. }
                | Error::Taint { .. }
                | Error::ListPods { .. }
                | Error::ListClaims { .. }
                | Error::PoolStatus { .. }
                | Error::Finalizer { .. }
                | Error::NotLeader
                | Error::Leader(_)
                | Error::Serve { .. }
                | Error::Event { .. }
                | Error::Timeout(_) => {}
            }
        }
        errors
    }

    #[test]
    fn every_error_label_is_exported_at_zero_before_the_first_error() {
        let mut labels: Vec<&str> = one_error_of_each_kind()
            .iter()
            .map(Error::metric_label)
            .collect();
        labels.sort_unstable();
        let mut listed = RECONCILE_ERROR_LABELS.to_vec();
        listed.sort_unstable();
        assert_eq!(
            labels, listed,
            "RECONCILE_ERROR_LABELS is metric_label's list"
        );

        let metrics = Metrics::default();
        let text = metrics.encode();
        for label in RECONCILE_ERROR_LABELS {
            let series = format!(r#"hugepool_reconcile_errors_total{{error="{label}"}} 0"#);
            assert!(
                text.lines().any(|l| l == series),
                "no {series:?} in:\n{text}"
            );
        }
        metrics.count_error("taint");
        assert!(
            metrics
                .encode()
                .contains(r#"hugepool_reconcile_errors_total{error="taint"} 1"#),
            "the first error moves its series from 0 to 1"
        );
    }

    #[test]
    fn stale_kubelets_are_counted_per_pool_and_dropped_with_it() {
        let metrics = Metrics::default();
        metrics.set_leading(true);
        let mut stale = plan_with_failed(0);
        stale.capacity_stale = vec!["w-1".into(), "w-2".into()];
        metrics.observe_pool("db", &stale);
        metrics.observe_pool("web", &plan_with_failed(0));
        let text = metrics.encode();
        assert!(
            text.contains(r#"hugepool_pool_kubelet_stale_nodes{pool="db"} 2"#),
            "{text}"
        );
        // A pool with none exports 0, so an alert's quiet side is a series.
        assert!(
            text.contains(r#"hugepool_pool_kubelet_stale_nodes{pool="web"} 0"#),
            "{text}"
        );

        // The kubelets restarted: the next pass sets the count back.
        metrics.observe_pool("db", &plan_with_failed(0));
        assert!(
            metrics
                .encode()
                .contains(r#"hugepool_pool_kubelet_stale_nodes{pool="db"} 0"#)
        );

        metrics.forget_pool("db");
        let text = metrics.encode();
        assert!(!text.contains(r#"stale_nodes{pool="db"}"#), "{text}");
        assert!(text.contains(r#"stale_nodes{pool="web"}"#), "{text}");
        metrics.set_leading(false);
        assert!(
            !metrics
                .encode()
                .contains("hugepool_pool_kubelet_stale_nodes{"),
            "a replica that lost the Lease drops the series"
        );
    }

    /// docs/operations.md's operator table names every metric the operator
    /// exports, each with the labels its samples carry: every family is
    /// given a sample here, so a metric or a label added without the docs
    /// (or documented and gone) fails.
    #[test]
    fn the_operations_table_lists_every_metric_with_its_labels() {
        use hugepool_runtime::metrics_doc;
        let metrics = Metrics::default();
        metrics.set_leading(true);
        let mut plan = plan_with_failed(1);
        plan.page_size = Some(hugepool_crds::PageSize::SIZE_2MI);
        metrics.observe_pool("p", &plan);
        metrics.count_eviction("p", "evicted");
        metrics.observe_reconcile(Duration::from_millis(5));
        let text = metrics.encode();
        let docs = include_str!("../../docs/operations.md");
        let table = metrics_doc::documented(docs, "Operator (published by the leader only):");
        let problems = metrics_doc::differences(&table, &metrics_doc::exported(&text));
        assert!(problems.is_empty(), "{problems:#?}\n{text}");
    }

    #[test]
    fn pool_pages_are_published_by_kind_in_pages_and_bytes_and_dropped_with_the_pool() {
        let metrics = Metrics::default();
        metrics.set_leading(true);
        let mut plan = plan_with_failed(0);
        plan.page_size = Some(hugepool_crds::PageSize::SIZE_1GI);
        plan.status.pages = hugepool_crds::pool::PoolPages {
            target: 8,
            current: 8,
            requested: 3,
            in_use: 2,
            unrequested: 5,
        };
        metrics.observe_pool("vms", &plan);
        let text = metrics.encode();
        for (kind, pages) in [
            ("target", 8_i32),
            ("current", 8),
            ("requested", 3),
            ("in_use", 2),
            ("unrequested", 5),
        ] {
            let series = format!(r#"hugepool_pool_pages{{pool="vms",kind="{kind}"}} {pages}"#);
            assert!(text.contains(&series), "no {series} in {text}");
            let bytes = i64::from(pages) << 30;
            let series = format!(r#"hugepool_pool_bytes{{pool="vms",kind="{kind}"}} {bytes}"#);
            assert!(text.contains(&series), "no {series} in {text}");
        }
        metrics.forget_pool("vms");
        let text = metrics.encode();
        assert!(!text.contains(r#"pool="vms""#), "{text}");
    }

    #[test]
    fn only_a_leader_publishes_pools_and_a_lost_lease_drops_them() {
        let metrics = Metrics::default();
        metrics.observe_pool("a", &plan_with_failed(1));
        assert!(
            !metrics.encode().contains("hugepool_pool_nodes{"),
            "a follower publishes no pool"
        );

        metrics.set_leading(true);
        metrics.observe_pool("a", &plan_with_failed(1));
        metrics.observe_pool("b", &plan_with_failed(0));
        let text = metrics.encode();
        assert!(
            text.contains(r#"hugepool_pool_nodes{pool="a",state="failed"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"hugepool_pool_pages{pool="b",kind="target"} 0"#),
            "{text}"
        );
        assert!(text.contains("hugepool_leader 1"), "{text}");
        let build = format!(
            r#"hugepool_operator_build_info{{version="{}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&build), "{text}");

        metrics.set_leading(false);
        let text = metrics.encode();
        assert!(!text.contains("hugepool_pool_nodes{"), "{text}");
        assert!(!text.contains("hugepool_pool_pages{"), "{text}");
        assert!(text.contains("hugepool_leader 0"), "{text}");
        // A pass that finishes after the Lease went publishes nothing.
        metrics.observe_pool("a", &plan_with_failed(1));
        assert!(!metrics.encode().contains("hugepool_pool_nodes{"));
    }
}

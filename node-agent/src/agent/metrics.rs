//! The agent's Prometheus metrics (docs/design.md, "Dashboards and tooling"),
//! encoded as OpenMetrics by prometheus-client.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use hugepool_crds::node::PageSizeTarget;
use hugepool_crds::{PageSize, Reason};

use crate::kernel::freelists::GrowEstimate;
use crate::kernel::{NumaCounts, PoolCounts};

/// Where a huge page is. The states partition a pool, so a `sum` over
/// `state` is the pool's total (HugePages_Total, surplus pages included).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum PageState {
    /// Faulted into some process.
    in_use,
    /// Free, but promised to a mapping that has not touched it yet.
    reserved,
    /// Free and promised to no one.
    free,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PagesLabels {
    pub size: String,
    pub state: PageState,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NumaPagesLabels {
    pub size: String,
    pub numa: String,
    pub state: PageState,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NumaLabels {
    pub size: String,
    pub numa: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub size: String,
    /// `grow` or `shrink`.
    pub direction: String,
}

/// The reasons `hugepool_stalls_total` counts: a kernel write over the
/// stall threshold and the stalls the kernel log reports. NoProgress is a
/// Stalled condition only, never counted.
pub const STALL_REASONS: &[Reason] = &[
    Reason::SlowKernelWrite,
    Reason::SoftLockup,
    Reason::RcuStall,
    Reason::HungTask,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StallLabels {
    pub reason: String,
}

/// The taints the operator puts on a Node (`hugepool_node_taint`).
pub const OPERATOR_TAINTS: &[&str] = &[
    hugepool_crds::NOT_READY_TAINT,
    hugepool_crds::DRAINING_TAINT,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaintLabels {
    pub taint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SizeLabels {
    pub size: String,
}

/// Which estimate of what a grow can get (docs/design.md, "What a grow can
/// get").
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Obtainable {
    /// From the free lists as they are.
    now,
    /// After compacting, keeping the memory guard free.
    after_compaction,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObtainableLabels {
    pub size: String,
    pub when: Obtainable,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NumaObtainableLabels {
    pub size: String,
    pub numa: String,
    pub when: Obtainable,
}

/// How a ResourceSlice write ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum WriteResult {
    ok,
    error,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: WriteResult,
}

impl ResultLabels {
    pub fn ok() -> Self {
        Self {
            result: WriteResult::ok,
        }
    }
    pub fn error() -> Self {
        Self {
            result: WriteResult::error,
        }
    }
}

fn step_histogram() -> Histogram {
    // 1 ms .. ~16 s: covers a 2Mi step under budget and a stalled 1Gi write.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 15,
    ))
}

/// Every metric the agent exports, registered once.
#[derive(Clone)]
pub struct Metrics {
    /// Node-wide pages of a size by state; sums over state to the total.
    pub pages: Family<PagesLabels, Gauge>,
    /// The same in bytes, so sums across sizes mean something.
    pub pages_bytes: Family<PagesLabels, Gauge>,
    /// Per NUMA node (sysfs has no per-node reserved count: in_use and free).
    pub numa_pages: Family<NumaPagesLabels, Gauge>,
    /// Surplus pages (overcommit), a part of the total, by size.
    pub surplus_pages: Family<SizeLabels, Gauge>,
    /// The agent's target by size, and per NUMA node where the target is split.
    pub target_pages: Family<SizeLabels, Gauge>,
    pub numa_target_pages: Family<NumaLabels, Gauge>,
    pub step_seconds: Family<StepLabels, Histogram, fn() -> Histogram>,
    pub pages_moved: Family<StepLabels, Counter>,
    pub stalls: Family<StallLabels, Counter>,
    pub shortfall_pages: Family<SizeLabels, Gauge>,
    pub mem_available_bytes: Gauge,
    /// 1 while the kernel log is read, 0 when it is off or unreadable.
    pub kernel_log_watching: Gauge,
    /// Events not published because the queue to the API was full.
    pub events_dropped: Counter,
    /// Writes of a pool by someone else, seen as the pool moving away from
    /// a target the agent had reached.
    pub foreign_writes: Family<SizeLabels, Counter>,
    /// 1 while this node's Node carries the operator's taint, else 0.
    pub node_taints: Family<TaintLabels, Gauge>,
    /// Pages of a size that the pods bound to the node request.
    pub requested_pages: Family<SizeLabels, Gauge>,
    /// The same in bytes, to set against `hugepool_pages_bytes`.
    pub requested_bytes: Family<SizeLabels, Gauge>,
    /// Pages a grow could add, machine-wide and per NUMA node.
    pub obtainable_pages: Family<ObtainableLabels, Gauge>,
    pub numa_obtainable_pages: Family<NumaObtainableLabels, Gauge>,
    /// 1 while /proc/buddyinfo and /proc/pagetypeinfo read, else 0.
    pub free_lists_readable: Gauge,
    /// Pages published as claimable in the node's ResourceSlice, by size and
    /// NUMA node.
    pub claimable_pages: Family<NumaLabels, Gauge>,
    /// ResourceSlice writes (apply or delete) by result.
    pub slice_writes: Family<ResultLabels, Counter>,
    /// HugePageNode status writes by result.
    pub status_writes: Family<ResultLabels, Counter>,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            pages: Family::default(),
            pages_bytes: Family::default(),
            numa_pages: Family::default(),
            surplus_pages: Family::default(),
            target_pages: Family::default(),
            numa_target_pages: Family::default(),
            step_seconds: Family::new_with_constructor(step_histogram),
            pages_moved: Family::default(),
            stalls: Family::default(),
            shortfall_pages: Family::default(),
            mem_available_bytes: Gauge::default(),
            kernel_log_watching: Gauge::default(),
            events_dropped: Counter::default(),
            foreign_writes: Family::default(),
            node_taints: Family::default(),
            requested_pages: Family::default(),
            requested_bytes: Family::default(),
            obtainable_pages: Family::default(),
            numa_obtainable_pages: Family::default(),
            free_lists_readable: Gauge::default(),
            claimable_pages: Family::default(),
            slice_writes: Family::default(),
            status_writes: Family::default(),
        };
        // At 0 from the start: increase() over a series born at 1 is 0, so
        // a node's first stall would never fire HugepoolResizeStalled.
        for reason in STALL_REASONS {
            let _ = metrics.stalls.get_or_create(&StallLabels {
                reason: reason.as_str().into(),
            });
        }
        // At 0 until the Node is seen with the taint: an alert's quiet side
        // is a series, and the series outlives the taint.
        metrics.set_node_taints(&[]);
        let prefix = registry.sub_registry_with_prefix("hugepool");
        prefix.register(
            "agent_build",
            "The agent's version",
            prometheus_client::metrics::info::Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
            }),
        );
        prefix.register(
            "pages",
            "Huge pages of a size on the node by state (in_use, reserved, free); the states add up to the pool's total",
            metrics.pages.clone(),
        );
        prefix.register(
            "pages_bytes",
            "Memory in huge pages by size and state; sum without(size) for all sizes",
            metrics.pages_bytes.clone(),
        );
        prefix.register(
            "numa_pages",
            "Huge pages of a size on one NUMA node by state (in_use, free); they add up to that node's total",
            metrics.numa_pages.clone(),
        );
        prefix.register(
            "surplus_pages",
            "Surplus (overcommitted) huge pages of a size, counted in hugepool_pages too",
            metrics.surplus_pages.clone(),
        );
        prefix.register(
            "target_pages",
            "The pool size the agent is moving the node to, by page size",
            metrics.target_pages.clone(),
        );
        prefix.register(
            "numa_target_pages",
            "The target of one NUMA node, where the target is split by NUMA node",
            metrics.numa_target_pages.clone(),
        );
        prefix.register(
            "resize_step_seconds",
            "Duration of one kernel pool write",
            metrics.step_seconds.clone(),
        );
        prefix.register(
            "resize_pages",
            "Pages added (grow) or freed (shrink) by resizes",
            metrics.pages_moved.clone(),
        );
        prefix.register(
            "stalls",
            "Stalls seen during resizes, by reason",
            metrics.stalls.clone(),
        );
        prefix.register(
            "allocation_shortfall_pages",
            "Pages the last grow came up short",
            metrics.shortfall_pages.clone(),
        );
        prefix.register(
            "mem_available_bytes",
            "MemAvailable from /proc/meminfo",
            metrics.mem_available_bytes.clone(),
        );
        prefix.register(
            "kernel_log_watching",
            "1 while the agent reads the kernel log (/dev/kmsg), 0 when it is off or unreadable",
            metrics.kernel_log_watching.clone(),
        );
        prefix.register(
            "events_dropped",
            "Events not published because the queue to the API server was full",
            metrics.events_dropped.clone(),
        );
        prefix.register(
            "foreign_writes",
            "Times another writer moved a pool away from a target the agent had reached",
            metrics.foreign_writes.clone(),
        );
        prefix.register(
            "node_taint",
            "1 while this node carries the operator's taint (hugepool.dev/not-ready, hugepool.dev/draining), else 0",
            metrics.node_taints.clone(),
        );
        prefix.register(
            "requested_pages",
            "Huge pages of a size that the pods bound to the node request (hugepages-<size>, ended pods left out); \
             the node's total less this is reserved memory no pod asked for",
            metrics.requested_pages.clone(),
        );
        prefix.register(
            "requested_bytes",
            "hugepool_requested_pages in bytes; sum by (node) (hugepool_pages_bytes) less sum by (node) of this is memory reserved that no pod asked for",
            metrics.requested_bytes.clone(),
        );
        prefix.register(
            "obtainable_pages",
            "Huge pages of a size a grow could add (when=now: from the free lists as they are; \
             when=after_compaction: after compacting, keeping the memory guard free)",
            metrics.obtainable_pages.clone(),
        );
        prefix.register(
            "numa_obtainable_pages",
            "The same per NUMA node",
            metrics.numa_obtainable_pages.clone(),
        );
        prefix.register(
            "free_lists_readable",
            "1 while the agent reads /proc/buddyinfo and /proc/pagetypeinfo (what a grow can get), else 0",
            metrics.free_lists_readable.clone(),
        );
        prefix.register(
            "claimable_pages",
            "Huge pages of a size on one NUMA node published in the node's ResourceSlice for ResourceClaims \
             (pools with consumption DynamicResourceAllocation: the node's pages the kubelet does not advertise)",
            metrics.claimable_pages.clone(),
        );
        prefix.register(
            "resource_slice_writes",
            "Writes of the node's ResourceSlice (apply or delete) by result (ok, error)",
            metrics.slice_writes.clone(),
        );
        prefix.register(
            "status_writes",
            "Writes of the node's HugePageNode status by result (ok, error): what the agent costs the API server",
            metrics.status_writes.clone(),
        );
        metrics
    }

    /// Publishes the claimable pages of the node's ResourceSlice as
    /// desired, dropping devices that went.
    pub fn set_claimable(&self, devices: &[super::slice::Device]) {
        self.claimable_pages.clear();
        for device in devices {
            self.claimable_pages
                .get_or_create(&NumaLabels {
                    size: device.size.to_string(),
                    numa: device.numa.to_string(),
                })
                .set(gauge(device.pages));
        }
    }

    /// Publishes what a grow can get, per size and NUMA node (`None`: the
    /// machine), dropping what is no longer estimated.
    pub fn set_obtainable(
        &self,
        readable: bool,
        estimates: &std::collections::BTreeMap<(PageSize, Option<u32>), GrowEstimate>,
    ) {
        self.free_lists_readable.set(i64::from(readable));
        self.obtainable_pages.clear();
        self.numa_obtainable_pages.clear();
        for ((size, numa), estimate) in estimates {
            for (when, pages) in [
                (Obtainable::now, estimate.obtainable_now),
                (Obtainable::after_compaction, estimate.after_compaction),
            ] {
                let size = size.to_string();
                match numa {
                    None => self
                        .obtainable_pages
                        .get_or_create(&ObtainableLabels { size, when })
                        .set(gauge(pages)),
                    Some(node) => self
                        .numa_obtainable_pages
                        .get_or_create(&NumaObtainableLabels {
                            size,
                            numa: node.to_string(),
                            when,
                        })
                        .set(gauge(pages)),
                };
            }
        }
    }

    /// Publishes the pages of `size` the node's pods request.
    pub fn set_requested_pages(&self, size: PageSize, pages: u64) {
        let labels = SizeLabels {
            size: size.to_string(),
        };
        self.requested_pages
            .get_or_create(&labels)
            .set(gauge(pages));
        self.requested_bytes
            .get_or_create(&labels)
            .set(gauge(pages.saturating_mul(size.bytes())));
    }

    /// Publishes which of the operator's taints the Node carries, from the
    /// keys of all its taints.
    pub fn set_node_taints(&self, keys: &[&str]) {
        for taint in OPERATOR_TAINTS {
            self.node_taints
                .get_or_create(&TaintLabels {
                    taint: (*taint).into(),
                })
                .set(i64::from(keys.contains(taint)));
        }
    }

    /// Publishes one page size's kernel counts, node-wide and per NUMA node.
    pub fn set_kernel_pages(&self, size: PageSize, pool: &PoolCounts, numa: &[NumaCounts]) {
        let name = size.to_string();
        let free = pool.free.saturating_sub(pool.reserved);
        let in_use = pool.total.saturating_sub(pool.free);
        for (state, pages) in [
            (PageState::in_use, in_use),
            (PageState::reserved, pool.reserved.min(pool.free)),
            (PageState::free, free),
        ] {
            let labels = PagesLabels {
                size: name.clone(),
                state,
            };
            self.pages.get_or_create(&labels).set(gauge(pages));
            self.pages_bytes
                .get_or_create(&labels)
                .set(gauge(pages.saturating_mul(size.bytes())));
        }
        self.surplus_pages
            .get_or_create(&SizeLabels { size: name.clone() })
            .set(gauge(pool.surplus));
        for counts in numa {
            for (state, pages) in [
                (PageState::in_use, counts.total.saturating_sub(counts.free)),
                (PageState::free, counts.free),
            ] {
                self.numa_pages
                    .get_or_create(&NumaPagesLabels {
                        size: name.clone(),
                        numa: counts.node.to_string(),
                        state,
                    })
                    .set(gauge(pages));
            }
        }
    }

    /// Publishes the targets, dropping those of sizes no longer targeted.
    pub fn set_targets(&self, targets: &[PageSizeTarget]) {
        self.target_pages.clear();
        self.numa_target_pages.clear();
        for target in targets {
            let size = target.size.to_string();
            self.target_pages
                .get_or_create(&SizeLabels { size: size.clone() })
                .set(target.pages.max(0));
            for numa in target.numa.iter().flatten() {
                self.numa_target_pages
                    .get_or_create(&NumaLabels {
                        size: size.clone(),
                        numa: numa.id.to_string(),
                    })
                    .set(numa.pages.max(0));
            }
        }
    }
}

fn gauge(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Encodes a registry as OpenMetrics text.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use hugepool_crds::settings::NumaTarget;

    fn mi2() -> PageSize {
        PageSize::from_bytes(2 << 20).unwrap()
    }

    #[test]
    fn exports_the_design_names_with_labels() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics
            .step_seconds
            .get_or_create(&StepLabels {
                size: "2Mi".into(),
                direction: "grow".into(),
            })
            .observe(0.02);
        metrics
            .pages_moved
            .get_or_create(&StepLabels {
                size: "2Mi".into(),
                direction: "grow".into(),
            })
            .inc_by(4096);
        metrics
            .stalls
            .get_or_create(&StallLabels {
                reason: "SlowKernelWrite".into(),
            })
            .inc();
        metrics.mem_available_bytes.set(1 << 30);
        let text = encode(&registry);
        for line in [
            &format!(
                r#"hugepool_agent_build_info{{version="{}"}} 1"#,
                env!("CARGO_PKG_VERSION")
            ),
            r#"hugepool_resize_step_seconds_count{size="2Mi",direction="grow"} 1"#,
            r#"hugepool_resize_pages_total{size="2Mi",direction="grow"} 4096"#,
            r#"hugepool_stalls_total{reason="SlowKernelWrite"} 1"#,
            "hugepool_mem_available_bytes 1073741824",
            "# EOF",
        ] {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn what_a_grow_can_get_is_exported_per_size_and_numa_node_and_dropped_when_unread() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let estimate = |now, after_compaction| GrowEstimate {
            obtainable_now: now,
            after_compaction,
        };
        let estimates = std::collections::BTreeMap::from([
            ((PageSize::SIZE_2MI, None), estimate(4576, 4889)),
            ((PageSize::SIZE_2MI, Some(0)), estimate(4576, 4889)),
            ((PageSize::SIZE_1GI, None), estimate(0, 6)),
        ]);
        metrics.set_obtainable(true, &estimates);
        let text = encode(&registry);
        for (series, value) in [
            (r#"hugepool_obtainable_pages{size="2Mi",when="now"}"#, 4576),
            (
                r#"hugepool_obtainable_pages{size="2Mi",when="after_compaction"}"#,
                4889,
            ),
            (r#"hugepool_obtainable_pages{size="1Gi",when="now"}"#, 0),
            (
                r#"hugepool_obtainable_pages{size="1Gi",when="after_compaction"}"#,
                6,
            ),
            (
                r#"hugepool_numa_obtainable_pages{size="2Mi",numa="0",when="now"}"#,
                4576,
            ),
            ("hugepool_free_lists_readable", 1),
        ] {
            assert_eq!(sample(&text, series), Some(value), "{series} in:\n{text}");
        }
        metrics.set_obtainable(false, &std::collections::BTreeMap::new());
        let text = encode(&registry);
        assert_eq!(sample(&text, "hugepool_free_lists_readable"), Some(0));
        assert!(!text.contains("hugepool_obtainable_pages{"), "{text}");
    }

    #[test]
    fn node_taints_are_exported_at_zero_and_follow_the_node() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let not_ready = r#"hugepool_node_taint{taint="hugepool.dev/not-ready"}"#;
        let draining = r#"hugepool_node_taint{taint="hugepool.dev/draining"}"#;
        let text = encode(&registry);
        assert_eq!(sample(&text, not_ready), Some(0), "{text}");
        assert_eq!(sample(&text, draining), Some(0), "{text}");

        metrics.set_node_taints(&["node.kubernetes.io/not-ready", "hugepool.dev/not-ready"]);
        let text = encode(&registry);
        assert_eq!(sample(&text, not_ready), Some(1), "{text}");
        assert_eq!(sample(&text, draining), Some(0), "{text}");
        assert!(
            !text.contains("node.kubernetes.io"),
            "only the operator's taints are exported: {text}"
        );

        metrics.set_node_taints(&[]);
        let text = encode(&registry);
        assert_eq!(sample(&text, not_ready), Some(0), "{text}");
    }

    /// The sample of `series` in `text`.
    fn sample(text: &str, series: &str) -> Option<i64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_stall_reason_is_exported_at_zero_before_the_first_stall() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let text = encode(&registry);
        for reason in ["SlowKernelWrite", "SoftLockup", "RcuStall", "HungTask"] {
            let series = format!(r#"hugepool_stalls_total{{reason="{reason}"}}"#);
            assert_eq!(sample(&text, &series), Some(0), "{series} in:\n{text}");
        }
        metrics
            .stalls
            .get_or_create(&StallLabels {
                reason: "HungTask".into(),
            })
            .inc();
        let text = encode(&registry);
        assert_eq!(
            sample(&text, r#"hugepool_stalls_total{reason="HungTask"}"#),
            Some(1),
            "the first stall moves the series from 0 to 1:\n{text}"
        );
    }

    #[test]
    fn every_kernel_log_report_is_a_listed_stall_reason() {
        use crate::kernel::kmsg::KernelLogKind;
        for kind in [
            KernelLogKind::SoftLockup,
            KernelLogKind::RcuStall,
            KernelLogKind::HungTask,
        ] {
            // Exhaustive, so a new kind does not compile until it is listed above.
            match kind {
                KernelLogKind::SoftLockup | KernelLogKind::RcuStall | KernelLogKind::HungTask => {}
            }
            let reason =
                Reason::parse(kind.as_str()).unwrap_or_else(|| panic!("{kind:?} is no Reason"));
            assert!(
                STALL_REASONS.contains(&reason),
                "{reason} not in STALL_REASONS"
            );
        }
        assert!(STALL_REASONS.contains(&Reason::SlowKernelWrite));
    }

    #[test]
    fn page_states_add_up_to_the_total_node_wide_and_per_numa_node() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        // 1000 pages, 10 of them surplus, 400 free of which 150 reserved;
        // NUMA 0 holds 600 (100 free), NUMA 1 holds 400 (300 free).
        let pool = PoolCounts {
            total: 1000,
            free: 400,
            reserved: 150,
            surplus: 10,
        };
        let numa = [
            NumaCounts {
                node: 0,
                total: 600,
                free: 100,
                surplus: 10,
            },
            NumaCounts {
                node: 1,
                total: 400,
                free: 300,
                surplus: 0,
            },
        ];
        metrics.set_kernel_pages(mi2(), &pool, &numa);
        let text = encode(&registry);
        let pages = |state: &str| {
            sample(
                &text,
                &format!(r#"hugepool_pages{{size="2Mi",state="{state}"}}"#),
            )
            .unwrap_or_else(|| panic!("no {state} in\n{text}"))
        };
        assert_eq!(
            (pages("in_use"), pages("reserved"), pages("free")),
            (600, 150, 250)
        );
        assert_eq!(pages("in_use") + pages("reserved") + pages("free"), 1000);
        assert_eq!(
            sample(&text, r#"hugepool_pages_bytes{size="2Mi",state="in_use"}"#),
            Some(600 << 21)
        );
        assert_eq!(
            sample(&text, r#"hugepool_surplus_pages{size="2Mi"}"#),
            Some(10)
        );
        let mut numa_sum = 0;
        for (id, in_use, free) in [(0, 500, 100), (1, 100, 300)] {
            let of = |state: &str| {
                sample(
                    &text,
                    &format!(r#"hugepool_numa_pages{{size="2Mi",numa="{id}",state="{state}"}}"#),
                )
            };
            assert_eq!((of("in_use"), of("free")), (Some(in_use), Some(free)));
            numa_sum += in_use + free;
        }
        assert_eq!(numa_sum, 1000, "NUMA nodes add up to the node");
        // No series mixes the target or a node-wide `all` with the counts.
        assert!(!text.contains("numa=\"all\""), "{text}");
        assert!(!text.contains("state=\"target\""), "{text}");
        assert!(!text.contains("state=\"total\""), "{text}");
    }

    /// docs/operations.md's agent table names every metric the agent
    /// exports, each with the labels its samples carry: every family is
    /// given a sample here, so a metric or a label added without the docs
    /// (or documented and gone) fails.
    #[test]
    fn the_operations_table_lists_every_metric_with_its_labels() {
        use hugepool_runtime::metrics_doc;
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let pool = PoolCounts {
            total: 10,
            free: 4,
            reserved: 1,
            surplus: 1,
        };
        let numa = [NumaCounts {
            node: 0,
            total: 10,
            free: 4,
            surplus: 1,
        }];
        metrics.set_kernel_pages(mi2(), &pool, &numa);
        let split = Some(vec![NumaTarget { id: 0, pages: 10 }]);
        metrics.set_targets(&[target(mi2(), 10, split)]);
        metrics.set_requested_pages(mi2(), 2);
        metrics.set_obtainable(
            true,
            &std::collections::BTreeMap::from([
                ((mi2(), None), GrowEstimate::default()),
                ((mi2(), Some(0)), GrowEstimate::default()),
            ]),
        );
        metrics.set_node_taints(&[]);
        let step = StepLabels {
            size: "2Mi".into(),
            direction: "grow".into(),
        };
        metrics.step_seconds.get_or_create(&step).observe(0.01);
        metrics.pages_moved.get_or_create(&step).inc();
        metrics
            .shortfall_pages
            .get_or_create(&SizeLabels { size: "2Mi".into() })
            .set(1);
        metrics
            .foreign_writes
            .get_or_create(&SizeLabels { size: "2Mi".into() })
            .inc();
        metrics.set_claimable(&[super::super::slice::Device {
            size: mi2(),
            numa: 0,
            pages: 4,
        }]);
        metrics
            .slice_writes
            .get_or_create(&ResultLabels::ok())
            .inc();
        metrics
            .status_writes
            .get_or_create(&ResultLabels::ok())
            .inc();
        let text = encode(&registry);
        let docs = include_str!("../../../docs/operations.md");
        let table = metrics_doc::documented(docs, "Agent (per node):");
        let problems = metrics_doc::differences(&table, &metrics_doc::exported(&text));
        assert!(problems.is_empty(), "{problems:#?}\n{text}");
    }

    fn target(size: PageSize, pages: i64, numa: Option<Vec<NumaTarget>>) -> PageSizeTarget {
        PageSizeTarget {
            numa,
            pool: "pool".into(),
            pool_generation: 1,
            ..PageSizeTarget::new(size, pages)
        }
    }

    #[test]
    fn targets_replace_the_previous_ones() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let gi1 = PageSize::from_bytes(1 << 30).unwrap();
        let split = vec![
            NumaTarget { id: 0, pages: 100 },
            NumaTarget { id: 1, pages: 200 },
        ];
        metrics.set_targets(&[target(mi2(), 300, Some(split)), target(gi1, 4, None)]);
        let text = encode(&registry);
        assert_eq!(
            sample(&text, r#"hugepool_target_pages{size="2Mi"}"#),
            Some(300)
        );
        assert_eq!(
            sample(&text, r#"hugepool_target_pages{size="1Gi"}"#),
            Some(4)
        );
        assert_eq!(
            sample(&text, r#"hugepool_numa_target_pages{size="2Mi",numa="1"}"#),
            Some(200)
        );
        metrics.set_targets(&[target(gi1, 2, None)]);
        let text = encode(&registry);
        assert_eq!(sample(&text, r#"hugepool_target_pages{size="2Mi"}"#), None);
        assert_eq!(
            sample(&text, r#"hugepool_numa_target_pages{size="2Mi",numa="1"}"#),
            None
        );
        assert_eq!(
            sample(&text, r#"hugepool_target_pages{size="1Gi"}"#),
            Some(2)
        );
    }
}

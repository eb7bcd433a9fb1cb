//! The agent's Prometheus metrics (docs/design.md, "Dashboards and tooling"),
//! encoded as OpenMetrics by prometheus-client.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Which count of a pool a `hugepool_pages` sample is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum PageState {
    total,
    free,
    reserved,
    surplus,
    target,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PagesLabels {
    pub size: String,
    /// A NUMA node id, or `all` for the size's system-wide pool.
    pub numa: String,
    pub state: PageState,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub size: String,
    /// `grow` or `shrink`.
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StallLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SizeLabels {
    pub size: String,
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
    pub pages: Family<PagesLabels, Gauge>,
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
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            pages: Family::default(),
            step_seconds: Family::new_with_constructor(step_histogram),
            pages_moved: Family::default(),
            stalls: Family::default(),
            shortfall_pages: Family::default(),
            mem_available_bytes: Gauge::default(),
            kernel_log_watching: Gauge::default(),
            events_dropped: Counter::default(),
            foreign_writes: Family::default(),
        };
        let prefix = registry.sub_registry_with_prefix("hugepool");
        prefix.register(
            "pages",
            "Huge pages of a size as the kernel reports them, and the target",
            metrics.pages.clone(),
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
        metrics
    }

    pub fn set_pages(&self, size: &str, numa: &str, state: PageState, value: u64) {
        let labels = PagesLabels {
            size: size.to_string(),
            numa: numa.to_string(),
            state,
        };
        self.pages.get_or_create(&labels).set(value as i64);
    }
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

    #[test]
    fn exports_the_design_names_with_labels() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.set_pages("2Mi", "all", PageState::total, 4096);
        metrics.set_pages("2Mi", "0", PageState::free, 100);
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
            r#"hugepool_pages{size="2Mi",numa="all",state="total"} 4096"#,
            r#"hugepool_pages{size="2Mi",numa="0",state="free"} 100"#,
            r#"hugepool_resize_step_seconds_count{size="2Mi",direction="grow"} 1"#,
            r#"hugepool_resize_pages_total{size="2Mi",direction="grow"} 4096"#,
            r#"hugepool_stalls_total{reason="SlowKernelWrite"} 1"#,
            "hugepool_mem_available_bytes 1073741824",
            "# EOF",
        ] {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
    }
}

//! Settings that a pool carries and the operator copies into each
//! HugePageNode entry, so the agent never needs to read pools.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::duration;

/// How the agent paces kernel writes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("duration(self.stallThreshold) >= duration(self.maxStepDuration)").message("stallThreshold must not be shorter than maxStepDuration").field_path(".stallThreshold"))]
pub struct ResizeSettings {
    /// Time budget of one kernel write (Go duration, > 0, at most 10s).
    #[serde(default = "default_max_step_duration")]
    #[schemars(regex(pattern = duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("maxStepDuration must be greater than 0"))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('10s')").message("maxStepDuration must be at most 10s"))]
    pub max_step_duration: String,
    /// Pause after a write that took the whole maxStepDuration, so other
    /// writers of the pool get a turn; a shorter write is followed by a
    /// pause in proportion (half the budget, half the pause), so writes
    /// take at most maxStepDuration / (maxStepDuration + stepPause) of a
    /// resize (Go duration, at most 1m).
    #[serde(default = "default_step_pause")]
    #[schemars(regex(pattern = duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('1m')").message("stepPause must be at most 1m"))]
    pub step_pause: String,
    /// One write slower than this is reported as a stall (Go duration, > 0,
    /// at most 10m).
    #[serde(default = "default_stall_threshold")]
    #[schemars(regex(pattern = duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("stallThreshold must be greater than 0"))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('10m')").message("stallThreshold must be at most 10m"))]
    pub stall_threshold: String,
}

fn default_max_step_duration() -> String {
    "50ms".into()
}
fn default_step_pause() -> String {
    "5ms".into()
}
fn default_stall_threshold() -> String {
    "2s".into()
}

impl Default for ResizeSettings {
    fn default() -> Self {
        Self {
            max_step_duration: default_max_step_duration(),
            step_pause: default_step_pause(),
            stall_threshold: default_stall_threshold(),
        }
    }
}

/// What the agent does when growth comes up short.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocationSettings {
    /// Compaction + retry rounds after a short grow.
    #[serde(default = "default_retries")]
    #[schemars(range(min = 0, max = 20))]
    pub retries: i32,
    /// Compact memory before retrying.
    #[serde(default = "default_compact")]
    pub compact: bool,
    /// Growth never takes MemAvailable below this (a byte quantity, at least
    /// 100Mi: the kubelet's default hard-eviction threshold).
    #[serde(default = "default_min_mem_available")]
    #[schemars(regex(pattern = crate::quantity::BYTES_PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("quantity(self).compareTo(quantity('100Mi')) >= 0").message("minMemAvailable must be at least 100Mi, the kubelet's default hard-eviction threshold (memory.available<100Mi)"))]
    pub min_mem_available: String,
}

fn default_retries() -> i32 {
    3
}
fn default_compact() -> bool {
    true
}
fn default_min_mem_available() -> String {
    "1Gi".into()
}

impl Default for AllocationSettings {
    fn default() -> Self {
        Self {
            retries: default_retries(),
            compact: default_compact(),
            min_mem_available: default_min_mem_available(),
        }
    }
}

/// How a node's pages are placed on its NUMA nodes.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum NumaPolicy {
    /// Even split, remainder to the lowest ids; one write per NUMA node.
    #[default]
    Spread,
    /// Exactly the per-NUMA counts listed in `numa.nodes`.
    Explicit,
    /// One write of the size's global file; the kernel places the pages.
    Kernel,
}

/// Whether the operator may evict hugepage consumers to let a shrink finish.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum DrainPolicy {
    #[default]
    IfNeeded,
    Never,
}

/// Whether the agent restarts kubelet so it sees the new capacity.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum KubeletRestart {
    #[default]
    Never,
    AfterResize,
}

/// How pods take a pool's pages.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum Consumption {
    /// `hugepages-<size>` requests, against what the kubelet advertises. The
    /// kubelet reads the pool when it starts, so a grow reaches pods after a
    /// kubelet restart (`kubelet.restart`).
    #[default]
    Kubelet,
    /// ResourceClaims on the agent's ResourceSlice (driver
    /// `hugepages.hugepool.dev`): consumable capacity that follows every
    /// resize, so a grow is usable at once, with no kubelet restart
    /// (Kubernetes 1.36 or later).
    DynamicResourceAllocation,
}

/// What happens to the pages when a pool is deleted or a node leaves it.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum DeletionPolicy {
    /// Leave the pages where they are and stop managing them.
    #[default]
    Retain,
    /// Shrink every node to 0 through the same bounded rollout first.
    Release,
}

/// An exact page count for one NUMA node.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NumaTarget {
    /// The NUMA node's id (`/sys/devices/system/node/node<id>`).
    #[schemars(range(min = 0, max = 1023))]
    pub id: i32,
    /// Pages on that NUMA node (at most 16777216).
    #[schemars(range(min = 0, max = 16777216))]
    pub pages: i64,
}

//! hugepool-operator: turns HugePagePools into per-node HugePageNode targets
//! with a bounded rollout (docs/design.md, "The operator").
//!
//! `planner` decides (pure); `controller` watches and writes; `drain`,
//! `events`, `metrics` and `leader` are the edges it uses; `plugin` is
//! `kubectl hugepool`, the same planner run for users.

pub mod controller;
pub mod drain;
pub mod error;
pub mod events;
#[cfg(test)]
pub mod fixtures;
pub mod leader;
pub mod metrics;
pub mod planner;
pub mod plugin;
pub mod uninstall;

pub use controller::{Config, run};
pub use error::Error;
pub use leader::LeaderConfig;

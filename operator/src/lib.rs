//! hugepool-operator: turns HugePagePools into per-node HugePageNode targets
//! with a bounded rollout (docs/design.md, "The operator").

#[cfg(test)]
pub mod fixtures;
pub mod planner;

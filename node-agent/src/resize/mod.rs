//! The resize engine: a pure [`planner`] (the algorithm), the online cost
//! [`model`] it sizes steps with (kept across restarts by [`model_file`]),
//! and a thin [`executor`] that runs the
//! planner's writes against a [`Kernel`](crate::kernel::Kernel).

pub mod entry;
pub mod executor;
pub mod model;
pub mod model_file;
pub mod planner;

pub use entry::{settings_for, targets_for};
pub use executor::{Event, Goal, Options, StepEvent, Summary, run};
pub use model::{CostModels, Direction};
pub use planner::{Decision, Observation, Outcome, Planner, Settings, ShortfallReason, Target};

//! The online cost model: `latency = fixed + per_page * pages`, fitted by
//! least squares over a sliding window of recent writes, one model per
//! (page size, direction).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use hugepool_crds::PageSize;
use serde::{Deserialize, Serialize};

/// Recent writes a fit looks at; old ones age out as the kernel's state
/// (HVO, memory pressure) changes.
pub const WINDOW: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Direction {
    Grow,
    Shrink,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Grow => "grow",
            Direction::Shrink => "shrink",
        }
    }
}

/// One measured write.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub pages: u64,
    pub latency: Duration,
}

/// A fitted `fixed + per_page * pages`; both terms non-negative.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Fit {
    pub fixed_seconds: f64,
    pub seconds_per_page: f64,
}

impl Fit {
    pub fn estimate(&self, pages: u64) -> Duration {
        Duration::from_secs_f64(
            (self.fixed_seconds + self.seconds_per_page * pages as f64).max(0.0),
        )
    }

    /// The most pages one write can take within `limit`; `u64::MAX` when the
    /// per-page cost is too small to measure.
    pub fn pages_within(&self, limit: Duration) -> u64 {
        let room = limit.as_secs_f64() - self.fixed_seconds;
        if room <= 0.0 {
            return 0;
        }
        if self.seconds_per_page <= 0.0 {
            return u64::MAX;
        }
        // The epsilon keeps 10 ms / 0.01 ms from flooring to 999.
        let pages = room / self.seconds_per_page + 1e-9;
        if pages >= u64::MAX as f64 {
            u64::MAX
        } else {
            pages as u64
        }
    }
}

/// The window of one (size, direction).
#[derive(Clone, Debug, Default)]
pub struct CostModel {
    samples: VecDeque<Sample>,
}

impl CostModel {
    pub fn record(&mut self, sample: Sample) {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    pub fn samples(&self) -> impl Iterator<Item = &Sample> {
        self.samples.iter()
    }

    /// Largest write in the window that stayed within `budget`.
    pub fn largest_within(&self, budget: Duration) -> Option<u64> {
        self.samples
            .iter()
            .filter(|s| s.latency <= budget)
            .map(|s| s.pages)
            .max()
    }

    /// The fit, leaning conservative where the data cannot tell the terms
    /// apart: with one distinct write size all cost is charged per page;
    /// when noise makes the slope negative, the worst latency is taken as a
    /// fixed cost.
    pub fn fit(&self) -> Option<Fit> {
        let count = self.samples.len() as f64;
        if count == 0.0 {
            return None;
        }
        let xs = || self.samples.iter().map(|s| s.pages as f64);
        let ys = || self.samples.iter().map(|s| s.latency.as_secs_f64());
        let mean_x = xs().sum::<f64>() / count;
        let mean_y = ys().sum::<f64>() / count;
        let var_x: f64 = xs().map(|x| (x - mean_x).powi(2)).sum();
        if var_x < 1e-9 {
            return Some(Fit {
                fixed_seconds: 0.0,
                seconds_per_page: mean_y / mean_x.max(1.0),
            });
        }
        let cov: f64 = xs()
            .zip(ys())
            .map(|(x, y)| (x - mean_x) * (y - mean_y))
            .sum();
        let slope = cov / var_x;
        if slope <= 0.0 {
            return Some(Fit {
                fixed_seconds: ys().fold(0.0, f64::max),
                seconds_per_page: 0.0,
            });
        }
        let intercept = mean_y - slope * mean_x;
        if intercept < 0.0 {
            // A line through the origin fitted to the same points.
            let sxy: f64 = xs().zip(ys()).map(|(x, y)| x * y).sum();
            let sxx: f64 = xs().map(|x| x * x).sum();
            return Some(Fit {
                fixed_seconds: 0.0,
                seconds_per_page: (sxy / sxx).max(slope),
            });
        }
        Some(Fit {
            fixed_seconds: intercept,
            seconds_per_page: slope,
        })
    }
}

/// All models of one agent; kept across resizes so a later resize starts
/// from what earlier ones measured.
#[derive(Clone, Debug, Default)]
pub struct CostModels {
    models: HashMap<(PageSize, Direction), CostModel>,
}

impl CostModels {
    pub fn get(&self, size: PageSize, direction: Direction) -> Option<&CostModel> {
        self.models.get(&(size, direction))
    }

    pub fn fit(&self, size: PageSize, direction: Direction) -> Option<Fit> {
        self.get(size, direction).and_then(CostModel::fit)
    }

    pub fn record(&mut self, size: PageSize, direction: Direction, sample: Sample) {
        self.models
            .entry((size, direction))
            .or_default()
            .record(sample);
    }

    /// The windows as plain data, to keep the models across restarts.
    pub fn to_saved(&self) -> Vec<SavedModel> {
        let mut saved: Vec<SavedModel> = self
            .models
            .iter()
            .map(|((size, direction), model)| SavedModel {
                size: size.to_string(),
                direction: *direction,
                samples: model
                    .samples()
                    .map(|s| SavedSample {
                        pages: s.pages,
                        seconds: s.latency.as_secs_f64(),
                    })
                    .collect(),
            })
            .collect();
        saved.sort_by(|a, b| (&a.size, a.direction.as_str()).cmp(&(&b.size, b.direction.as_str())));
        saved
    }

    /// Models from saved windows; entries that do not parse are skipped
    /// (a stale file must not stop a resize).
    pub fn from_saved(saved: &[SavedModel]) -> Self {
        let mut models = Self::default();
        for entry in saved {
            let Ok(size) = entry.size.parse::<PageSize>() else {
                continue;
            };
            for sample in &entry.samples {
                if let Ok(latency) = Duration::try_from_secs_f64(sample.seconds) {
                    models.record(
                        size,
                        entry.direction,
                        Sample {
                            pages: sample.pages,
                            latency,
                        },
                    );
                }
            }
        }
        models
    }
}

/// One model's window as stored in a model file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedModel {
    pub size: String,
    pub direction: Direction,
    pub samples: Vec<SavedSample>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedSample {
    pub pages: u64,
    pub seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    fn model_of(points: &[(u64, f64)]) -> CostModel {
        let mut model = CostModel::default();
        for &(pages, latency_ms) in points {
            model.record(Sample {
                pages,
                latency: ms(latency_ms),
            });
        }
        model
    }

    #[test]
    fn recovers_the_measured_hvo_cost() {
        // 13 ms per write + 0.013 ms per page, as measured with HVO on.
        let points: Vec<(u64, f64)> = [16, 32, 64, 128, 256, 512, 1024]
            .iter()
            .map(|&n| (n, 13.0 + 0.013 * n as f64))
            .collect();
        let fit = model_of(&points).fit().unwrap();
        assert!((fit.fixed_seconds - 0.013).abs() < 1e-6, "{fit:?}");
        assert!((fit.seconds_per_page - 0.000013).abs() < 1e-9, "{fit:?}");
        // 0.7 x 50 ms leaves room for (35 - 13) / 0.013 = 1692 pages.
        assert_eq!(fit.pages_within(ms(35.0)), 1692);
    }

    #[test]
    fn one_write_size_charges_everything_per_page() {
        let fit = model_of(&[(16, 8.0)]).fit().unwrap();
        assert_eq!(fit.fixed_seconds, 0.0);
        assert_eq!(fit.pages_within(ms(35.0)), 70);
    }

    #[test]
    fn noise_that_inverts_the_slope_is_read_as_fixed_cost() {
        let fit = model_of(&[(16, 16.0), (32, 8.0)]).fit().unwrap();
        assert_eq!(fit.seconds_per_page, 0.0);
        assert_eq!(fit.pages_within(ms(35.0)), u64::MAX);
        assert_eq!(fit.pages_within(ms(10.0)), 0);
    }

    #[test]
    fn the_window_forgets_old_writes() {
        let mut model = model_of(&[(100, 1000.0); WINDOW]);
        for _ in 0..WINDOW {
            model.record(Sample {
                pages: 100,
                latency: ms(1.0),
            });
        }
        assert_eq!(model.fit().unwrap().pages_within(ms(10.0)), 1000);
    }

    #[test]
    fn saved_models_round_trip_and_skip_garbage() {
        let mut models = CostModels::default();
        models.record(
            PageSize::SIZE_2MI,
            Direction::Shrink,
            Sample {
                pages: 16,
                latency: ms(13.0),
            },
        );
        models.record(
            PageSize::SIZE_2MI,
            Direction::Shrink,
            Sample {
                pages: 32,
                latency: ms(14.0),
            },
        );
        let mut saved = models.to_saved();
        let restored = CostModels::from_saved(&saved);
        assert_eq!(restored.to_saved(), saved);
        saved.push(SavedModel {
            size: "3Mi".into(),
            direction: Direction::Grow,
            samples: vec![SavedSample {
                pages: 1,
                seconds: -1.0,
            }],
        });
        saved[0].samples.push(SavedSample {
            pages: 1,
            seconds: f64::NAN,
        });
        assert_eq!(CostModels::from_saved(&saved).to_saved(), models.to_saved());
    }

    proptest! {
        #[test]
        fn fit_is_never_negative_and_never_panics(
            points in proptest::collection::vec((1u64..100_000, 0.0f64..5_000.0), 1..20),
        ) {
            let fit = model_of(&points).fit().unwrap();
            prop_assert!(fit.fixed_seconds >= 0.0 && fit.seconds_per_page >= 0.0);
            prop_assert!(fit.fixed_seconds.is_finite() && fit.seconds_per_page.is_finite());
        }

        #[test]
        fn exact_lines_are_recovered(fixed in 0.0f64..50.0, per_page in 0.0001f64..1.0, sizes in proptest::collection::btree_set(1u64..10_000, 2..8)) {
            let points: Vec<(u64, f64)> = sizes.iter().map(|&n| (n, fixed + per_page * n as f64)).collect();
            let fit = model_of(&points).fit().unwrap();
            prop_assert!((fit.fixed_seconds * 1000.0 - fixed).abs() < 1e-3);
            prop_assert!((fit.seconds_per_page * 1000.0 - per_page).abs() < 1e-6);
        }
    }
}

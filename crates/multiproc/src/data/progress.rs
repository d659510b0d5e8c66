//! The optional progress bar of an epoch (feature `progress`): indicatif, with rates
//! written for people — `117 batches/s`, `7.49k samples/s` — not `117.1943/s`.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::stats::LoaderStats;

/// One epoch's bar on stderr.
pub(crate) struct Bar {
    bar: ProgressBar,
    start: Instant,
    batches: std::cell::Cell<u64>,
    samples: std::cell::Cell<u64>,
}

impl Bar {
    pub(crate) fn new(batches: usize, epoch: u64) -> Self {
        let bar = ProgressBar::with_draw_target(Some(batches as u64), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("epoch {prefix} {bar:30} {pos}/{len} {msg} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(epoch.to_string());
        Bar {
            bar,
            start: Instant::now(),
            batches: 0.into(),
            samples: 0.into(),
        }
    }

    /// One more batch of `samples` samples was handed over; `stats` is the epoch's so
    /// far (the share of the time spent waiting for batches is shown).
    pub(crate) fn batch_done(&self, samples: usize, stats: &LoaderStats) {
        self.batches.set(self.batches.get() + 1);
        self.samples.set(self.samples.get() + samples as u64);
        let secs = self.start.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.bar.set_message(format!(
                "{}, {}, waited {:.0}%",
                per_second(self.batches.get() as f64 / secs, "batches"),
                per_second(self.samples.get() as f64 / secs, "samples"),
                (stats.waiting.as_secs_f64() / secs * 100.0).min(100.0)
            ));
        }
        self.bar.inc(1);
    }

    /// Ends the bar: finished, or abandoned where it stopped.
    pub(crate) fn finish(self, complete: bool) {
        if complete {
            self.bar.finish();
        } else {
            self.bar.abandon();
        }
    }
}

/// A rate with three significant digits and a k/M/G suffix: `117 batches/s`,
/// `9.80 batches/s`, `7.49k samples/s`, `0.412 batches/s`.
pub(crate) fn per_second(rate: f64, unit: &str) -> String {
    let (value, suffix) = match rate {
        r if r >= 1e9 => (r / 1e9, "G"),
        r if r >= 1e6 => (r / 1e6, "M"),
        r if r >= 1e3 => (r / 1e3, "k"),
        r => (r, ""),
    };
    let digits = match value {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        v if v >= 1.0 => 2,
        _ => 3,
    };
    format!("{value:.digits$}{suffix} {unit}/s")
}

#[cfg(test)]
mod tests {
    use super::per_second;

    #[test]
    fn rates_read_like_a_person_wrote_them() {
        assert_eq!(per_second(117.1943, "batches"), "117 batches/s");
        assert_eq!(per_second(9.8, "batches"), "9.80 batches/s");
        assert_eq!(per_second(7493.0, "samples"), "7.49k samples/s");
        assert_eq!(per_second(12_345_678.0, "samples"), "12.3M samples/s");
        assert_eq!(per_second(0.4123, "batches"), "0.412 batches/s");
    }
}

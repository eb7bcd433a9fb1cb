//! Durations as the API spells them: Go's `time.ParseDuration` syntax
//! (`50ms`, `2s`, `1m30s`, `1.5h`), which is also what `kubectl` users write.
//! Negative durations are not accepted anywhere in the API.

use std::time::Duration;

use crate::ParseError;

/// The schema pattern that matches exactly what [`parse`] accepts.
pub const PATTERN: &str = r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|μs|ms|s|m|h))+)$";

const UNITS: [(&str, u128); 8] = [
    ("ns", 1),
    ("us", 1_000),
    ("µs", 1_000),
    ("μs", 1_000),
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
];

/// Parses a non-negative Go duration.
pub fn parse(text: &str) -> Result<Duration, ParseError> {
    let err = || ParseError::Duration(text.to_string());
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err(err());
    }
    let mut rest = text;
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        let (number, after) = rest.split_at(number_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty()
            || (number.contains('.') && fraction.is_empty())
            || fraction.contains('.')
        {
            return Err(err());
        }
        // Longest unit first so "ms" is not read as "m" followed by "s".
        let (unit, scale) = UNITS
            .iter()
            .filter(|(unit, _)| after.starts_with(unit))
            .max_by_key(|(unit, _)| unit.len())
            .ok_or_else(err)?;
        let whole: u128 = whole.parse().map_err(|_| err())?;
        let mut part = whole.checked_mul(*scale).ok_or_else(err)?;
        let mut place = *scale;
        for digit in fraction.bytes().take(18) {
            place /= 10;
            part += u128::from(digit - b'0') * place;
        }
        total_nanos = total_nanos.checked_add(part).ok_or_else(err)?;
        rest = &after[unit.len()..];
    }
    let secs = u64::try_from(total_nanos / 1_000_000_000).map_err(|_| err())?;
    Ok(Duration::new(secs, (total_nanos % 1_000_000_000) as u32))
}

/// Formats like Go's `Duration.String` for the values we show: `50ms`,
/// `2s`, `1m30s`, `1.5s`, `0s`.
pub fn format(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}us", trim_fraction(nanos, 1_000));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", trim_fraction(nanos, 1_000_000));
    }
    let hours = nanos / 3_600_000_000_000;
    let minutes = (nanos / 60_000_000_000) % 60;
    let seconds = trim_fraction(nanos % 60_000_000_000, 1_000_000_000);
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, m) => format!("{m}m{seconds}s"),
        (h, m) => format!("{h}h{m}m{seconds}s"),
    }
}

fn trim_fraction(value: u128, unit: u128) -> String {
    let whole = value / unit;
    let fraction = value % unit;
    if fraction == 0 {
        return whole.to_string();
    }
    let width = unit.ilog10() as usize;
    let digits = format!("{fraction:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_spellings_users_write() {
        assert_eq!(parse("50ms").unwrap(), Duration::from_millis(50));
        assert_eq!(parse("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse("0").unwrap(), Duration::ZERO);
        assert_eq!(parse("0s").unwrap(), Duration::ZERO);
    }

    #[test]
    fn rejects_what_go_would_reject_and_negatives() {
        for bad in [
            "", "5", "ms", "-1s", "1.s", ".5s", "1..5s", "1 s", "1sec", "1d", "2s ", "1e3ms",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn formats_like_go() {
        assert_eq!(format(Duration::from_millis(50)), "50ms");
        assert_eq!(format(Duration::from_secs(90)), "1m30s");
        assert_eq!(format(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(format(Duration::ZERO), "0s");
    }

    proptest! {
        #[test]
        fn format_then_parse_is_identity(nanos in 0u64..10_000_000_000_000) {
            let duration = Duration::from_nanos(nanos);
            prop_assert_eq!(parse(&format(duration)).unwrap(), duration);
        }
    }
}

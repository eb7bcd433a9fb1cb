//! The two quantity-like values of the API: byte amounts (`8Gi`, `512M`) and
//! `maxUnavailable` (an integer or a percentage of the selected nodes).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::ParseError;

/// Schema pattern for a non-negative byte quantity, matching what
/// [`parse_bytes`] accepts: binary or decimal suffixes, or a positive exponent.
pub const BYTES_PATTERN: &str = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][0-9]+)?$";

/// Parses a byte quantity; a fractional byte count rounds up, like Kubernetes.
pub fn parse_bytes(text: &str) -> Result<u64, ParseError> {
    let err = || ParseError::Quantity(text.to_string());
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_len);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let fraction_ok = !number.contains('.') || (!fraction.is_empty() && !fraction.contains('.'));
    if whole.is_empty() || !fraction_ok || fraction.len() > 18 {
        return Err(err());
    }
    let (binary_shift, decimal_exp): (u32, u32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        exp => {
            let digits = exp.strip_prefix(['e', 'E']).ok_or_else(err)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(err());
            }
            (0, digits.parse().map_err(|_| err())?)
        }
    };
    let scaled: u128 = format!("{whole}{fraction}").parse().map_err(|_| err())?;
    let multiplier = 10u128
        .checked_pow(decimal_exp)
        .and_then(|m| m.checked_mul(1u128 << binary_shift))
        .ok_or_else(err)?;
    let divisor = 10u128.pow(fraction.len() as u32);
    let bytes = scaled
        .checked_mul(multiplier)
        .ok_or_else(err)?
        .div_ceil(divisor);
    u64::try_from(bytes).map_err(|_| err())
}

/// Formats bytes with the largest binary suffix that divides them exactly.
pub fn format_bytes(bytes: u64) -> String {
    for (suffix, shift) in [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ] {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Resolves `maxUnavailable` against the number of selected nodes. Percentages
/// round up (as a DaemonSet's do), so any non-empty selection admits at least
/// one node; integers must be at least 1.
pub fn resolve_max_unavailable(value: &IntOrString, selected: usize) -> Result<usize, ParseError> {
    let err = |text: String| ParseError::IntOrPercent(text);
    match value {
        IntOrString::Int(n) if *n >= 1 => Ok(*n as usize),
        IntOrString::Int(n) => Err(err(n.to_string())),
        IntOrString::String(text) => {
            let percent: usize = text
                .strip_suffix('%')
                .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|digits| digits.parse().ok())
                .filter(|p| (1..=100).contains(p))
                .ok_or_else(|| err(text.clone()))?;
            Ok((selected * percent).div_ceil(100).max(1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_memory_amounts() {
        assert_eq!(parse_bytes("1Gi").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("8Gi").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5Gi").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512M").unwrap(), 512_000_000);
        assert_eq!(parse_bytes("1e9").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("0").unwrap(), 0);
        assert_eq!(
            parse_bytes("0.5").unwrap(),
            1,
            "fractions of a byte round up"
        );
    }

    #[test]
    fn rejects_bad_quantities() {
        for bad in [
            "", "-1Gi", "1GB", "Gi", "1.Gi", ".5Gi", "1e", "1e-3", "20Ei", "1 Gi", "1m",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn max_unavailable_resolution() {
        let pct = |s: &str| IntOrString::String(s.into());
        assert_eq!(resolve_max_unavailable(&pct("25%"), 40).unwrap(), 10);
        assert_eq!(resolve_max_unavailable(&pct("25%"), 50).unwrap(), 13);
        assert_eq!(resolve_max_unavailable(&pct("1%"), 3).unwrap(), 1);
        assert_eq!(resolve_max_unavailable(&pct("100%"), 7).unwrap(), 7);
        assert_eq!(resolve_max_unavailable(&pct("10%"), 0).unwrap(), 1);
        assert_eq!(resolve_max_unavailable(&IntOrString::Int(3), 2).unwrap(), 3);
        for bad in [
            pct("0%"),
            pct("101%"),
            pct("%"),
            pct("5"),
            pct("-5%"),
            IntOrString::Int(0),
            IntOrString::Int(-1),
        ] {
            assert!(
                resolve_max_unavailable(&bad, 10).is_err(),
                "{bad:?} resolved"
            );
        }
    }

    proptest! {
        #[test]
        fn bytes_round_trip(bytes in 0u64..(1 << 62)) {
            prop_assert_eq!(parse_bytes(&format_bytes(bytes)).unwrap(), bytes);
        }

        #[test]
        fn percent_never_exceeds_selection_nor_drops_below_one(selected in 1usize..5000, percent in 1usize..=100) {
            let n = resolve_max_unavailable(&IntOrString::String(format!("{percent}%")), selected).unwrap();
            prop_assert!(n >= 1 && n <= selected);
        }
    }
}

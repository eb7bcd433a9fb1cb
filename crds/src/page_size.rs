//! Huge page sizes in the three spellings that meet in this project: the API's
//! quantity (`2Mi`), the kernel's kB count (`2048`, in `hugepages-2048kB`), and
//! Kubernetes' resource name (`hugepages-2Mi`).

use std::fmt;
use std::str::FromStr;

use crate::ParseError;

/// A huge page size, kept in bytes; always a power of two of at least 1 KiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageSize {
    bytes: u64,
}

const UNITS: [(&str, u32); 5] = [("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10), ("", 0)];

impl PageSize {
    pub const SIZE_2MI: PageSize = PageSize { bytes: 2 << 20 };
    pub const SIZE_1GI: PageSize = PageSize { bytes: 1 << 30 };

    pub fn from_bytes(bytes: u64) -> Option<Self> {
        (bytes >= 1024 && bytes.is_power_of_two()).then_some(Self { bytes })
    }

    pub fn from_kb(kb: u64) -> Option<Self> {
        kb.checked_mul(1024).and_then(Self::from_bytes)
    }

    pub fn bytes(self) -> u64 {
        self.bytes
    }

    pub fn kb(self) -> u64 {
        self.bytes / 1024
    }

    /// Directory name under `/sys/kernel/mm/hugepages/`: `hugepages-2048kB`.
    pub fn sysfs_dir(self) -> String {
        format!("hugepages-{}kB", self.kb())
    }

    /// Parses a sysfs directory name such as `hugepages-2048kB`.
    pub fn from_sysfs_dir(name: &str) -> Option<Self> {
        let kb = name.strip_prefix("hugepages-")?.strip_suffix("kB")?;
        if kb.is_empty() || !kb.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Self::from_kb(kb.parse().ok()?)
    }

    /// Kubernetes extended resource name: `hugepages-2Mi`.
    pub fn resource_name(self) -> String {
        format!("hugepages-{self}")
    }
}

impl fmt::Display for PageSize {
    /// The canonical quantity: the largest binary unit that divides exactly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (suffix, shift) in UNITS {
            if shift > 0 && self.bytes.trailing_zeros() >= shift {
                return write!(f, "{}{}", self.bytes >> shift, suffix);
            }
        }
        write!(f, "{}", self.bytes)
    }
}

impl FromStr for PageSize {
    type Err = ParseError;

    /// Accepts binary-suffixed quantities (`2Mi`, `1Gi`, `64Ki`, `2048Ki`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = || ParseError::PageSize(text.to_string());
        let (digits, shift) = UNITS
            .iter()
            .filter(|(suffix, _)| !suffix.is_empty())
            .find_map(|(suffix, shift)| text.strip_suffix(suffix).map(|d| (d, *shift)))
            .ok_or_else(err)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let count: u64 = digits.parse().map_err(|_| err())?;
        let bytes = count.checked_mul(1u64 << shift).ok_or_else(err)?;
        Self::from_bytes(bytes).ok_or_else(err)
    }
}

/// In the API a page size is its canonical quantity (`2Mi`): objects are
/// parsed once, where they are read, and every schema-valid spelling
/// (`PAGE_SIZE_PATTERN`) parses.
impl serde::Serialize for PageSize {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PageSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for PageSize {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PageSize".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn common_sizes_in_every_spelling() {
        let two_mi: PageSize = "2Mi".parse().unwrap();
        assert_eq!(two_mi, PageSize::SIZE_2MI);
        assert_eq!(two_mi.kb(), 2048);
        assert_eq!(two_mi.sysfs_dir(), "hugepages-2048kB");
        assert_eq!(two_mi.resource_name(), "hugepages-2Mi");
        let one_gi = PageSize::from_sysfs_dir("hugepages-1048576kB").unwrap();
        assert_eq!(one_gi.to_string(), "1Gi");
        assert_eq!("2048Ki".parse::<PageSize>().unwrap().to_string(), "2Mi");
        assert_eq!("64Ki".parse::<PageSize>().unwrap().kb(), 64);
    }

    #[test]
    fn rejects_what_is_not_a_power_of_two_size() {
        for bad in [
            "",
            "2",
            "3Mi",
            "0Mi",
            "2MB",
            "2M",
            "-2Mi",
            "1.5Gi",
            "Mi",
            "2 Mi",
            "99999999999999999999Gi",
        ] {
            assert!(bad.parse::<PageSize>().is_err(), "{bad:?} parsed");
        }
        for bad in [
            "hugepages-kB",
            "hugepages-3000kB",
            "hugepages-2048",
            "huge-2048kB",
        ] {
            assert_eq!(PageSize::from_sysfs_dir(bad), None, "{bad:?} parsed");
        }
    }

    #[test]
    fn every_size_the_schema_admits_parses_and_reads_back_the_same() {
        let pattern = crate::pool::PAGE_SIZE_PATTERN;
        let (counts, units) = ("1|2|4|8|16|32|64|128|256|512", "Ki|Mi|Gi|Ti");
        assert_eq!(pattern, format!("^({counts})({units})$"));
        for count in counts.split('|') {
            for unit in units.split('|') {
                let text = format!("{count}{unit}");
                let size: PageSize = serde_json::from_value(serde_json::json!(text)).unwrap();
                assert_eq!(serde_json::to_value(size).unwrap(), serde_json::json!(text));
            }
        }
        let err = serde_json::from_value::<PageSize>(serde_json::json!("3Mi")).unwrap_err();
        assert!(
            err.to_string().contains("invalid page size \"3Mi\""),
            "{err}"
        );
    }

    proptest! {
        #[test]
        fn quantity_round_trip(shift in 10u32..50) {
            let size = PageSize::from_bytes(1u64 << shift).unwrap();
            prop_assert_eq!(size.to_string().parse::<PageSize>().unwrap(), size);
        }

        #[test]
        fn sysfs_round_trip(shift in 10u32..50) {
            let size = PageSize::from_bytes(1u64 << shift).unwrap();
            prop_assert_eq!(PageSize::from_sysfs_dir(&size.sysfs_dir()), Some(size));
        }

        #[test]
        fn canonical_form_matches_schema_pattern(shift in 10u32..50) {
            let text = PageSize::from_bytes(1u64 << shift).unwrap().to_string();
            let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
            let n: u64 = digits.parse().unwrap();
            prop_assert!(n.is_power_of_two() && n < 1024, "{}", text);
        }
    }
}

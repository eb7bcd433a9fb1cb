//! Pure parsers for the kernel's text files: `&str` in, values out. The path
//! argument only names the file in errors.

use std::path::Path;

use crate::kernel::MemInfo;
use crate::{Error, Result};

fn parse_error(path: &Path, detail: impl Into<String>) -> Error {
    Error::Parse {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// A sysfs counter such as `nr_hugepages`: one non-negative integer, a newline.
pub fn count(path: &Path, text: &str) -> Result<u64> {
    let trimmed = text.trim();
    if trimmed.is_empty() || !trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(parse_error(
            path,
            format!("expected a count, got {trimmed:?}"),
        ));
    }
    trimmed
        .parse()
        .map_err(|_| parse_error(path, format!("count {trimmed:?} out of range")))
}

/// A 0/1 sysctl such as `hugetlb_optimize_vmemmap`.
pub fn flag(path: &Path, text: &str) -> Result<bool> {
    match text.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        other => Err(parse_error(path, format!("expected 0 or 1, got {other:?}"))),
    }
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo` (values in kB).
pub fn meminfo(path: &Path, text: &str) -> Result<MemInfo> {
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            _ => continue,
        };
        let mut fields = rest.split_whitespace();
        let value = fields.next().unwrap_or_default();
        let kb: u64 = value
            .parse()
            .map_err(|_| parse_error(path, format!("{key}: expected kB, got {value:?}")))?;
        if fields.next().is_some_and(|unit| unit != "kB") {
            return Err(parse_error(path, format!("{key}: unit is not kB")));
        }
        *slot = kb.checked_mul(1024);
    }
    match (total, available) {
        (Some(total_bytes), Some(available_bytes)) => Ok(MemInfo {
            total_bytes,
            available_bytes,
        }),
        _ => Err(parse_error(path, "MemTotal or MemAvailable missing")),
    }
}

/// A NUMA node directory name, `node3` -> 3.
pub fn node_dir(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("node")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `/proc/thread-self/schedstat`: nanoseconds on a CPU, nanoseconds waiting
/// on a run queue, timeslices (Documentation/scheduler/sched-stats.rst).
pub fn schedstat(path: &Path, text: &str) -> Result<(u64, u64)> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let [on_cpu, waiting, _slices] = fields[..] else {
        return Err(parse_error(
            path,
            format!("expected 3 fields, got {}", fields.len()),
        ));
    };
    let number = |field: &str| {
        field
            .parse::<u64>()
            .map_err(|_| parse_error(path, format!("expected nanoseconds, got {field:?}")))
    };
    Ok((number(on_cpu)?, number(waiting)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MEMINFO: &str = "MemTotal:       24683652 kB\nMemFree:        21190136 kB\nMemAvailable:   23915520 kB\nBuffers:            4096 kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n";

    #[test]
    fn reads_meminfo_of_a_real_machine() {
        let info = meminfo(Path::new("meminfo"), MEMINFO).unwrap();
        assert_eq!(info.total_bytes, 24683652 * 1024);
        assert_eq!(info.available_bytes, 23915520 * 1024);
    }

    #[test]
    fn meminfo_without_mem_available_is_an_error() {
        let text = "MemTotal: 100 kB\nMemFree: 50 kB\n";
        let err = meminfo(Path::new("/proc/meminfo"), text).unwrap_err();
        assert!(err.to_string().contains("/proc/meminfo"), "{err}");
    }

    #[test]
    fn counts_and_flags_reject_garbage() {
        let path = Path::new("nr_hugepages");
        assert_eq!(count(path, "4096\n").unwrap(), 4096);
        assert_eq!(count(path, "0").unwrap(), 0);
        for bad in ["", "-1", "1 2", "12a", "0x10", "99999999999999999999999"] {
            assert!(count(path, bad).is_err(), "{bad:?} parsed");
        }
        assert!(flag(path, "1\n").unwrap());
        assert!(!flag(path, "0\n").unwrap());
        assert!(flag(path, "2").is_err());
    }

    #[test]
    fn node_directories() {
        assert_eq!(node_dir("node0"), Some(0));
        assert_eq!(node_dir("node12"), Some(12));
        for bad in ["node", "nodes", "node-1", "possible", "has_cpu", "node1a"] {
            assert_eq!(node_dir(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn schedstat_of_a_thread() {
        // As this machine printed it for a writer thread.
        assert_eq!(
            schedstat(Path::new("s"), "24020113 5312 2\n").unwrap(),
            (24_020_113, 5312)
        );
        for bad in ["", "1 2", "1 2 3 4", "1 x 3", "-1 2 3"] {
            let err = schedstat(Path::new("/proc/thread-self/schedstat"), bad).unwrap_err();
            assert!(err.to_string().contains("schedstat"), "{err}");
        }
    }

    proptest! {
        #[test]
        fn count_round_trips(n in any::<u64>(), newline in any::<bool>()) {
            let text = if newline { format!("{n}\n") } else { n.to_string() };
            prop_assert_eq!(count(Path::new("x"), &text).unwrap(), n);
        }

        #[test]
        fn meminfo_finds_values_in_any_order(total in 0u64..1 << 40, avail in 0u64..1 << 40, noise in proptest::collection::vec("[A-Z][a-z_]{1,12}", 0..8)) {
            let mut lines: Vec<String> = noise.iter().map(|k| format!("{k}:  7 kB")).collect();
            lines.push(format!("MemAvailable:   {avail} kB"));
            lines.insert(0, format!("MemTotal:       {total} kB"));
            let info = meminfo(Path::new("m"), &lines.join("\n")).unwrap();
            prop_assert_eq!(info.total_bytes, total * 1024);
            prop_assert_eq!(info.available_bytes, avail * 1024);
        }

        #[test]
        fn schedstat_reads_its_two_times(on_cpu in any::<u64>(), waiting in any::<u64>(), slices in any::<u32>()) {
            let text = format!("{on_cpu} {waiting} {slices}\n");
            prop_assert_eq!(schedstat(Path::new("s"), &text).unwrap(), (on_cpu, waiting));
        }

        #[test]
        fn count_never_panics(text in ".{0,24}") {
            let _ = schedstat(Path::new("x"), &text);
            let _ = count(Path::new("x"), &text);
            let _ = flag(Path::new("x"), &text);
            let _ = meminfo(Path::new("x"), &text);
        }
    }
}

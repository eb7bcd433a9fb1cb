//! The least privilege the DaemonSet asks for is measured here: as uid 0 with
//! every capability dropped, the agent's kernel writes still work (sysfs and
//! procfs files are root-owned and writable by their owner), and reading the
//! kernel log is the one thing that needs a capability (CAP_SYSLOG, because
//! `kernel.dmesg_restrict` is set). docs/design.md has the securityContext.

mod support;

use std::process::{Command, Output};

use support::{GIB, MI2, RealKernel};

/// Runs `args` as uid 0 with the bounding set reduced to `keep` (e.g. "-all"
/// or "-all,+syslog"), so the command starts with exactly those capabilities.
fn with_caps(keep: &str, args: &[&str]) -> Output {
    Command::new("setpriv")
        .arg(format!("--bounding-set={keep}"))
        .arg("--inh-caps=-all")
        .arg("--")
        .args(args)
        .output()
        .expect("run setpriv (util-linux)")
}

fn nr_hugepages() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn kernel_writes_work_with_every_capability_dropped() {
    let Some(real) = RealKernel::acquire(GIB) else {
        return;
    };
    real.set_pool(MI2, 0);
    let caps = with_caps("-all", &["grep", "^CapEff", "/proc/self/status"]);
    assert_eq!(
        String::from_utf8_lossy(&caps.stdout)
            .split_whitespace()
            .nth(1),
        Some("0000000000000000"),
        "no capabilities at all"
    );

    let agent = env!("CARGO_BIN_EXE_hugepool-agent");
    for pages in ["64", "0"] {
        let run = with_caps(
            "-all",
            &[
                agent,
                "--kmsg",
                "/nonexistent",
                "resize",
                "--page-size",
                "2Mi",
                "--pages",
                pages,
                "--output",
                "json",
            ],
        );
        assert!(
            run.status.success(),
            "resize to {pages} without capabilities: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(nr_hugepages().to_string(), pages);
    }
    // Compaction (after a short grow) is a plain write too.
    let compact = with_caps(
        "-all",
        &["sh", "-c", "echo 1 > /proc/sys/vm/compact_memory"],
    );
    assert!(
        compact.status.success(),
        "{}",
        String::from_utf8_lossy(&compact.stderr)
    );
    // The free lists (what a grow can get): pagetypeinfo is readable by its
    // owner, root, and by no one else, so uid 0 needs no capability for it.
    for file in ["/proc/buddyinfo", "/proc/pagetypeinfo"] {
        let read = with_caps("-all", &["cat", file]);
        assert!(
            read.status.success()
                && (read.stdout.starts_with(b"Node 0")
                    || read.stdout.starts_with(b"Page block order")),
            "{file} without capabilities: {}",
            String::from_utf8_lossy(&read.stderr)
        );
    }
    let other = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(["cat", "/proc/pagetypeinfo"])
        .output()
        .expect("run setpriv (util-linux)");
    assert!(
        !other.status.success(),
        "/proc/pagetypeinfo is root only: a non-root agent could not estimate"
    );
    drop(real);
}

/// Sets `kernel.dmesg_restrict` for a test and puts the machine's value back
/// on drop, also on panic.
struct DmesgRestrict {
    saved: String,
}

const DMESG_RESTRICT: &str = "/proc/sys/kernel/dmesg_restrict";

impl DmesgRestrict {
    fn set(value: &str) -> Result<Self, String> {
        let saved = std::fs::read_to_string(DMESG_RESTRICT)
            .map_err(|e| format!("read {DMESG_RESTRICT}: {e}"))?;
        std::fs::write(DMESG_RESTRICT, value)
            .map_err(|e| format!("write {DMESG_RESTRICT}: {e}"))?;
        Ok(Self {
            saved: saved.trim().to_string(),
        })
    }
}

impl Drop for DmesgRestrict {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(DMESG_RESTRICT, &self.saved) {
            eprintln!("could not restore {DMESG_RESTRICT} to {}: {e}", self.saved);
        }
    }
}

#[test]
fn reading_the_kernel_log_is_what_needs_cap_syslog() {
    // Distributions set kernel.dmesg_restrict=1 (Debian does); the test sets
    // it for its run, whatever this machine has, so it always measures.
    let _restricted = match DmesgRestrict::set("1") {
        Ok(guard) => guard,
        Err(reason) if hugepool_e2e::in_ci_mode() => {
            panic!("cannot set kernel.dmesg_restrict under CI=true: {reason}")
        }
        Err(reason) => {
            eprintln!("skipping: {reason} (needs root)");
            return;
        }
    };
    let read = [
        "dd",
        "if=/dev/kmsg",
        "of=/dev/null",
        "count=1",
        "iflag=nonblock",
    ];
    let without = with_caps("-all", &read);
    assert!(
        !without.status.success(),
        "read /dev/kmsg without CAP_SYSLOG"
    );
    assert!(String::from_utf8_lossy(&without.stderr).contains("Operation not permitted"));
    let with = with_caps("-all,+syslog", &read);
    assert!(
        with.status.success(),
        "read /dev/kmsg with CAP_SYSLOG: {}",
        String::from_utf8_lossy(&with.stderr)
    );
    // In a container the device cgroup refuses /dev/kmsg whatever the
    // capabilities (e2e/tests/node.rs); the agent then reads syslog(2), which
    // the same capability governs.
    let syslog = ["dmesg", "--syslog", "--raw"];
    let without = with_caps("-all", &syslog);
    assert!(!without.status.success(), "syslog(2) without CAP_SYSLOG");
    let with = with_caps("-all,+syslog", &syslog);
    assert!(
        with.status.success() && !with.stdout.is_empty(),
        "syslog(2) with CAP_SYSLOG: {}",
        String::from_utf8_lossy(&with.stderr)
    );
}

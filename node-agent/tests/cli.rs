//! The `hugepool-agent resize` command against fake sysfs trees: argument
//! errors, exit codes and output, with no real kernel involved.

use std::path::Path;
use std::process::{Command, Output};

use hugepool_agent::kernel::fixture::FakeSysfs;

const GLOBAL_2MI: &str = "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";

fn agent(fake: &FakeSysfs, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hugepool-agent"))
        .arg("--sys-root")
        .arg(fake.sys_root())
        .arg("--proc-root")
        .arg(fake.proc_root())
        .arg("--kmsg")
        .arg(Path::new("/nonexistent/kmsg"))
        .args(args)
        .output()
        .expect("run hugepool-agent")
}

#[test]
fn bad_arguments_exit_1_with_one_line_and_no_kernel_write() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
    let before = fake.read(GLOBAL_2MI);
    let cases: [(&[&str], &str); 7] = [
        (
            &["resize", "--page-size", "3Mi", "--pages", "1"],
            "--page-size",
        ),
        (
            &["resize", "--page-size", "64Ki", "--pages", "1"],
            "--page-size",
        ),
        (
            &["resize", "--page-size", "2Mi", "--pages", "-4"],
            "--pages",
        ),
        (
            &[
                "resize",
                "--page-size",
                "2Mi",
                "--pages",
                "4",
                "--step-pause",
                "soon",
            ],
            "--step-pause",
        ),
        (
            &[
                "resize",
                "--page-size",
                "1Gi",
                "--pages",
                "1",
                "--numa-node",
                "1",
            ],
            "--numa-node",
        ),
        (
            &[
                "resize",
                "--page-size",
                "2Mi",
                "--pages",
                "4",
                "--output",
                "yaml",
            ],
            "--output",
        ),
        (&["resize", "--pages", "4"], "--page-size"),
    ];
    for (args, name) in cases {
        let output = agent(&fake, args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(name), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    assert_eq!(
        fake.read(GLOBAL_2MI),
        before,
        "a bad argument wrote to the kernel"
    );
}

#[test]
fn resize_of_a_fake_tree_exits_0_and_prints_one_json_object() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::single_size_no_numa(dir.path());
    let output = agent(
        &fake,
        &[
            "resize",
            "--page-size",
            "2Mi",
            "--pages",
            "600",
            "--output",
            "json",
        ],
    );
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["outcome"]["kind"], "reached");
    assert_eq!(
        (report["from"].as_u64(), report["achieved"].as_u64()),
        (Some(0), Some(600))
    );
    assert!(
        report["steps"].as_u64().unwrap() >= 2,
        "a 256-page probe first"
    );
    // Each write says what sized it: the probe first, the rest last.
    let reasons = report["writeReasons"].as_array().expect("writeReasons");
    assert_eq!(reasons.len() as u64, report["steps"].as_u64().unwrap());
    assert_eq!(reasons[0]["limit"], "probe", "{reasons:?}");
    assert_eq!(reasons[reasons.len() - 1]["limit"], "rest", "{reasons:?}");
    assert!(
        reasons.iter().all(|r| r["aim"].as_f64().unwrap() > 0.0),
        "{reasons:?}"
    );
    assert!(report["peakRssBytes"].as_u64().unwrap() > 0);
    assert_eq!(fake.read(GLOBAL_2MI), "600\n");
}

#[test]
fn text_output_has_a_line_per_step_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::single_size_no_numa(dir.path());
    let output = agent(&fake, &["resize", "--page-size", "2Mi", "--pages", "100"]);
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("step   1 grow"), "{stdout}");
    assert!(
        lines[0].ends_with("; size: the rest of the change, cold"),
        "{stdout}"
    );
    assert!(
        lines
            .last()
            .unwrap()
            .starts_with("target reached: 2Mi global pages 0 -> 100"),
        "{stdout}"
    );
}

#[test]
fn growth_the_memory_guard_forbids_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::single_size_no_numa(dir.path());
    let output = agent(
        &fake,
        &[
            "resize",
            "--page-size",
            "2Mi",
            "--pages",
            "100",
            "--min-mem-available",
            "8Gi",
            "--output",
            "json",
        ],
    );
    assert_eq!(output.status.code(), Some(2));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["outcome"]["kind"], "shortfall");
    assert_eq!(report["outcome"]["reason"], "MemoryGuard");
    assert_eq!(fake.read(GLOBAL_2MI), "0\n");
}

fn boot_file(dir: &Path, node: &str, pages: i64, min_mem_available: &str) -> std::path::PathBuf {
    let path = dir.join("boot-targets.json");
    let targets = serde_json::json!({
        "version": 1,
        "node": node,
        "pageSizes": [{
            "size": "2Mi",
            "pages": pages,
            "pool": "p",
            "poolGeneration": 3,
            "allocation": {"minMemAvailable": min_mem_available},
        }],
    });
    std::fs::write(&path, targets.to_string()).unwrap();
    path
}

#[test]
fn boot_applies_the_file_of_its_own_node_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::single_size_no_numa(&dir.path().join("tree"));
    let file = boot_file(dir.path(), "worker-1", 300, "1Gi");
    let boot = |node: &str, file: &Path| {
        agent(
            &fake,
            &[
                "boot",
                "--boot-file",
                file.to_str().unwrap(),
                "--node-name",
                node,
            ],
        )
    };

    // Another node's file (a disk moved): refused, the pool untouched.
    let refused = boot("worker-2", &file);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("worker-1"), "{stderr}");
    assert_eq!(fake.read(GLOBAL_2MI), "0\n");

    // No file (a node that never converged): nothing to apply, success.
    let missing = boot("worker-1", &dir.path().join("absent.json"));
    assert_eq!(missing.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&missing.stdout).contains("no boot file"));
    assert_eq!(fake.read(GLOBAL_2MI), "0\n");

    let applied = boot("worker-1", &file);
    let stdout = String::from_utf8_lossy(&applied.stdout);
    assert_eq!(applied.status.code(), Some(0), "{stdout}");
    assert_eq!(fake.read(GLOBAL_2MI), "300\n");
    assert!(
        stdout.contains("2Mi: 0 -> 300 of 300 pages (reached)"),
        "{stdout}"
    );

    // A target the memory guard forbids: short, exit 2, as `resize`.
    let guarded = boot_file(dir.path(), "worker-1", 400, "1Ti");
    let short = boot("worker-1", &guarded);
    let stdout = String::from_utf8_lossy(&short.stdout);
    assert_eq!(short.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("2Mi: 300 -> 300 of 400 pages"), "{stdout}");
    assert_eq!(fake.read(GLOBAL_2MI), "300\n");
}

//! The kubelet's Memory Manager checkpoint (`<root-dir>/memory_manager_state`),
//! read so that a kubelet restart after a resize never ends in a crash loop.
//!
//! With `memoryManagerPolicy: Static` the kubelet saves each NUMA node's
//! memory and hugepage totals in that file and, when it starts, refuses to
//! run if the machine's totals differ ("the expected machine state is
//! different from the real one"; kubelet v1.37 `policy_static.go`,
//! `validateState`). Any change of `nr_hugepages` changes them. Without the
//! file the kubelet starts from the machine as it is. So before a restart
//! the agent removes the file, but only when no container holds a memory
//! assignment in it: those assignments would be forgotten. The kubelet drops
//! a removed pod's entries only when it admits the next pod, so an entry
//! whose pod directory (`<root-dir>/pods/<uid>`) is gone holds nothing.
//!
//! The CPU Manager's `cpu_manager_state` holds CPU sets only; hugepages do
//! not enter it, and it is left alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The file's name under the kubelet's root directory.
pub const STATE_FILE: &str = "memory_manager_state";

/// What the checkpoint says, as far as a restart cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryManagerState {
    /// `Static`, `None` or `BestEffort`; only `Static` validates hugepages.
    pub policy: String,
    /// Containers holding memory or hugepages, by pod UID, sorted.
    pub assignments: Vec<Assignment>,
}

/// One pod's containers with a memory assignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub pod_uid: String,
    pub containers: Vec<String>,
    /// The resources assigned (`memory`, `hugepages-2Mi`, ...), sorted.
    pub resources: Vec<String>,
}

impl MemoryManagerState {
    /// Whether a restart after a hugepage change fails its state check.
    pub fn validates_hugepages(&self) -> bool {
        self.policy == "Static"
    }
}

/// The checkpoint as the kubelet writes it: v1 and v2 hold everything at the
/// top level; v3 keeps `policyName`, `machineState` and `entries` there and
/// adds `data`, the same with pod-level `podEntries`, as a JSON string.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Checkpoint {
    #[serde(default)]
    policy_name: String,
    #[serde(default)]
    entries: BTreeMap<String, BTreeMap<String, Vec<Block>>>,
    #[serde(default)]
    pod_entries: BTreeMap<String, Vec<Block>>,
    #[serde(default)]
    data: Option<String>,
}

#[derive(Deserialize)]
struct Block {
    #[serde(rename = "type", default)]
    resource: String,
}

/// Parses the checkpoint's JSON.
pub fn parse(text: &str) -> Result<MemoryManagerState, String> {
    let top: Checkpoint = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let inner = match top.data.as_deref() {
        Some(data) => {
            Some(serde_json::from_str::<Checkpoint>(data).map_err(|e| format!("in data: {e}"))?)
        }
        None => None,
    };
    let mut by_pod: BTreeMap<String, (Vec<String>, Vec<String>)> = BTreeMap::new();
    let checkpoints = std::iter::once(&top).chain(inner.as_ref());
    for checkpoint in checkpoints.clone() {
        for (uid, containers) in &checkpoint.entries {
            for (name, blocks) in containers {
                let (names, resources) = by_pod.entry(uid.clone()).or_default();
                names.push(name.clone());
                resources.extend(blocks.iter().map(|b| b.resource.clone()));
            }
        }
        for (uid, blocks) in &checkpoint.pod_entries {
            let (_, resources) = by_pod.entry(uid.clone()).or_default();
            resources.extend(blocks.iter().map(|b| b.resource.clone()));
        }
    }
    let policy = inner
        .as_ref()
        .map(|c| c.policy_name.clone())
        .filter(|p| !p.is_empty())
        .unwrap_or(top.policy_name);
    let assignments = by_pod
        .into_iter()
        .map(|(pod_uid, (mut containers, mut resources))| {
            containers.sort();
            containers.dedup();
            resources.sort();
            resources.dedup();
            Assignment {
                pod_uid,
                containers,
                resources,
            }
        })
        .collect();
    Ok(MemoryManagerState {
        policy,
        assignments,
    })
}

/// The kubelet's root directory as this agent sees it (`--kubelet-root-dir`).
#[derive(Clone, Debug)]
pub struct KubeletRootDir(pub PathBuf);

impl KubeletRootDir {
    pub fn state_file(&self) -> PathBuf {
        self.0.join(STATE_FILE)
    }

    /// Reads the checkpoint, keeping only the assignments of pods the kubelet
    /// still has (their directory exists). `Ok(None)` when there is no file:
    /// the Memory Manager is off or has not started yet.
    pub fn read(&self) -> Result<Option<MemoryManagerState>, String> {
        let path = self.state_file();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let mut state = parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        state
            .assignments
            .retain(|a| self.pod_dir(&a.pod_uid).is_some_and(|dir| dir.exists()));
        Ok(Some(state))
    }

    /// Removes the checkpoint so that the next kubelet starts from the
    /// machine as it is. A file already gone is fine.
    pub fn clear(&self) -> Result<(), String> {
        let path = self.state_file();
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("cannot remove {}: {e}", path.display())),
        }
    }

    /// Reads the checkpoint once more and removes it unless a pod holds
    /// memory in it now (one admitted since the caller last read it): then
    /// nothing is removed and those assignments are returned, so that the
    /// restart waits for them rather than forget them.
    pub fn clear_unless_assigned(&self) -> Result<Vec<Assignment>, String> {
        match self.read()? {
            Some(state) if state.validates_hugepages() && !state.assignments.is_empty() => {
                Ok(state.assignments)
            }
            _ => self.clear().map(|()| Vec::new()),
        }
    }

    /// `<root>/pods/<uid>`, for a UID that is one path component.
    fn pod_dir(&self, uid: &str) -> Option<PathBuf> {
        let plain = !uid.is_empty() && uid != "." && uid != ".." && !uid.contains('/');
        plain.then(|| Path::new(&self.0).join("pods").join(uid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape kubelet v1.37 writes (v3): a Guaranteed pod with memory and
    /// 2Mi hugepages on NUMA node 0.
    const V3_WITH_ENTRY: &str = r#"{"policyName":"Static","machineState":{"0":{"numberOfAssignments":2,"memoryMap":{"hugepages-2Mi":{"total":134217728,"systemReserved":0,"allocatable":134217728,"reserved":8388608,"free":125829120},"memory":{"total":25000000000,"systemReserved":104857600,"allocatable":24895142400,"reserved":67108864,"free":24828033536}},"cells":[0]}},"entries":{"5b1c-uid":{"holder":[{"numaAffinity":[0],"type":"memory","size":67108864},{"numaAffinity":[0],"type":"hugepages-2Mi","size":8388608}]}},"data":"{\"policyName\":\"Static\",\"machineState\":{},\"entries\":{\"5b1c-uid\":{\"holder\":[{\"numaAffinity\":[0],\"type\":\"memory\",\"size\":67108864},{\"numaAffinity\":[0],\"type\":\"hugepages-2Mi\",\"size\":8388608}]}}}","dataChecksum":1,"checksum":2}"#;

    #[test]
    fn the_checkpoint_is_kept_when_a_pod_was_assigned_memory_since_it_was_read() {
        let dir = tempfile::tempdir().unwrap();
        let root = KubeletRootDir(dir.path().to_path_buf());
        std::fs::write(root.state_file(), V3_WITH_ENTRY).unwrap();
        // The pod's directory is gone: its entry holds nothing; removed.
        assert_eq!(root.clear_unless_assigned(), Ok(Vec::new()));
        assert!(!root.state_file().exists());
        // A pod admitted since (its directory exists): kept, and named.
        std::fs::write(root.state_file(), V3_WITH_ENTRY).unwrap();
        std::fs::create_dir_all(dir.path().join("pods").join("5b1c-uid")).unwrap();
        let held = root.clear_unless_assigned().unwrap();
        assert_eq!(
            held.iter().map(|a| a.pod_uid.as_str()).collect::<Vec<_>>(),
            ["5b1c-uid"]
        );
        assert!(root.state_file().exists(), "the assignment is not lost");
        // No file: nothing to do.
        std::fs::remove_file(root.state_file()).unwrap();
        assert_eq!(root.clear_unless_assigned(), Ok(Vec::new()));
    }

    #[test]
    fn a_v3_checkpoint_names_the_pods_holding_memory() {
        let state = parse(V3_WITH_ENTRY).unwrap();
        assert!(state.validates_hugepages());
        assert_eq!(
            state.assignments,
            [Assignment {
                pod_uid: "5b1c-uid".into(),
                containers: vec!["holder".into()],
                resources: vec!["hugepages-2Mi".into(), "memory".into()],
            }]
        );
    }

    #[test]
    fn an_empty_static_checkpoint_has_no_assignments() {
        let text = r#"{"policyName":"Static","machineState":{"0":{"numberOfAssignments":0,"memoryMap":{},"cells":[0]}},"checksum":3}"#;
        let state = parse(text).unwrap();
        assert_eq!(state.policy, "Static");
        assert!(state.assignments.is_empty());
        let none = parse(r#"{"policyName":"None","machineState":{},"checksum":1}"#).unwrap();
        assert!(!none.validates_hugepages());
    }

    #[test]
    fn pod_level_entries_in_data_count_as_assignments() {
        let text = r#"{"policyName":"Static","machineState":{},"data":"{\"policyName\":\"Static\",\"podEntries\":{\"p-uid\":[{\"type\":\"hugepages-1Gi\",\"size\":1073741824}]}}"}"#;
        let state = parse(text).unwrap();
        assert_eq!(state.assignments.len(), 1);
        assert_eq!(state.assignments[0].pod_uid, "p-uid");
        assert_eq!(state.assignments[0].resources, ["hugepages-1Gi"]);
    }

    #[test]
    fn a_checkpoint_that_does_not_parse_is_an_error() {
        assert!(parse("not json").is_err());
        assert!(parse(r#"{"policyName":"Static","data":"{"}"#).is_err());
    }

    #[test]
    fn only_pods_the_kubelet_still_has_hold_assignments_and_clear_removes_the_file() {
        let root = tempfile::tempdir().unwrap();
        let dir = KubeletRootDir(root.path().to_path_buf());
        assert_eq!(dir.read(), Ok(None), "no checkpoint: no Memory Manager");
        std::fs::write(dir.state_file(), V3_WITH_ENTRY).unwrap();
        assert!(
            dir.read().unwrap().unwrap().assignments.is_empty(),
            "the pod's directory is gone: its entry is stale"
        );
        std::fs::create_dir_all(root.path().join("pods").join("5b1c-uid")).unwrap();
        assert_eq!(dir.read().unwrap().unwrap().assignments.len(), 1);
        let cpu = root.path().join("cpu_manager_state");
        std::fs::write(&cpu, "{}").unwrap();
        dir.clear().unwrap();
        assert!(!dir.state_file().exists());
        assert!(cpu.exists(), "the CPU Manager's state is left alone");
        dir.clear().unwrap();
    }
}

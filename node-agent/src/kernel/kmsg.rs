//! The kernel log watcher: reads `/dev/kmsg` records and recognises the
//! reports that mean a node is stalling: soft lockups, RCU stalls and hung
//! tasks. Recognition is pure ([`parse_record`], [`parse_syslog_line`]);
//! [`watch`] reads the device and [`watch_syslog`] polls syslog(2), which a
//! container may use where its runtime's device cgroup refuses `/dev/kmsg`.

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{Error, Result};

/// What a recognised record reports; the names are the Stalled reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum KernelLogKind {
    SoftLockup,
    RcuStall,
    HungTask,
}

impl KernelLogKind {
    pub fn as_str(self) -> &'static str {
        match self {
            KernelLogKind::SoftLockup => "SoftLockup",
            KernelLogKind::RcuStall => "RcuStall",
            KernelLogKind::HungTask => "HungTask",
        }
    }
}

/// One recognised record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KernelLogEvent {
    pub kind: KernelLogKind,
    /// The message text, without the record header.
    pub message: String,
    /// The record's sequence number, when the line had a kmsg header.
    pub sequence: Option<u64>,
    /// Microseconds since boot, when the line had a kmsg header.
    pub timestamp_us: Option<u64>,
}

/// Classifies a message (the text after the `;` of a kmsg record).
pub fn classify(message: &str) -> Option<KernelLogKind> {
    if message.contains("BUG: soft lockup") {
        return Some(KernelLogKind::SoftLockup);
    }
    // "rcu: INFO: rcu_sched self-detected stall on CPU",
    // "rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:"
    if message.contains("rcu")
        && (message.contains("self-detected stall") || message.contains("detected stalls"))
    {
        return Some(KernelLogKind::RcuStall);
    }
    // "INFO: task khugepaged:89 blocked for more than 120 seconds."
    if message.contains("INFO: task ") && message.contains(" blocked for more than ") {
        return Some(KernelLogKind::HungTask);
    }
    None
}

/// Whether a record's priority (`facility << 3 | level`) is the kernel's
/// own: facility 0. Anything a process writes into `/dev/kmsg` is stored
/// with the user facility (1) however it is spelled, exactly so that it can
/// be told from the kernel's records; only the kernel's may count as a stall,
/// or any root process could fake one.
pub fn from_kernel(priority: u32) -> bool {
    priority >> 3 == 0
}

/// The header of a `/dev/kmsg` record, `prio,seq,usec,flags;message`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub priority: u32,
    pub sequence: u64,
    pub timestamp_us: u64,
}

/// Splits a record line into its header and message; `None` for lines
/// without a kmsg header (continuation lines, plain dmesg text).
pub fn split_record(line: &str) -> Option<(RecordHeader, &str)> {
    let (header, message) = line.split_once(';')?;
    let mut fields = header.split(',');
    let mut number = || {
        fields
            .next()
            .filter(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
    };
    let priority = number()?.parse().ok()?;
    let sequence = number()?.parse().ok()?;
    let timestamp_us = number()?.parse().ok()?;
    fields.next()?;
    Some((
        RecordHeader {
            priority,
            sequence,
            timestamp_us,
        },
        message,
    ))
}

/// Parses one line of `/dev/kmsg` or a plain message line, and returns it if
/// it reports a stall. Continuation lines (starting with a space) are never
/// events, nor are records of any facility but the kernel's. A line without
/// a kmsg header (a file of dmesg text) has no facility and is read as is.
pub fn parse_record(line: &str) -> Option<KernelLogEvent> {
    let line = line.trim_end_matches(['\n', '\r']);
    if line.starts_with(' ') {
        return None;
    }
    let (header, message) = match split_record(line) {
        Some((header, _)) if !from_kernel(header.priority) => return None,
        Some((header, message)) => (Some(header), message),
        None => (None, line),
    };
    Some(KernelLogEvent {
        kind: classify(message)?,
        message: message.to_string(),
        sequence: header.map(|h| h.sequence),
        timestamp_us: header.map(|h| h.timestamp_us),
    })
}

/// Reads records from `path` (`/dev/kmsg`, or a file of record lines) and
/// calls `on_event` for each recognised one, until the file ends or
/// `on_event` returns false. With `from_end`, records already in the log are
/// skipped. Blocks: run it on its own thread.
pub fn watch(
    path: &Path,
    from_end: bool,
    mut on_event: impl FnMut(KernelLogEvent) -> bool,
) -> Result<()> {
    read_lines(path, from_end, |line| match parse_record(line) {
        Some(event) => on_event(event),
        None => true,
    })
}

/// Every line of the log, recognised or not, until the file ends or
/// `on_line` returns false.
pub fn read_lines(
    path: &Path,
    from_end: bool,
    mut on_line: impl FnMut(&str) -> bool,
) -> Result<()> {
    let read_err = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(read_err)?;
    if from_end {
        match file.seek(SeekFrom::End(0)) {
            Ok(_) => {}
            // A pipe (a test's stand-in for the device) has no past to skip.
            Err(err) if err.raw_os_error() == Some(libc::ESPIPE) => {}
            Err(err) => return Err(read_err(err)),
        }
    }
    // /dev/kmsg returns one whole record per read and EINVAL if it does not
    // fit; records are at most about 8 KiB.
    let mut buffer = vec![0u8; 16 * 1024];
    let mut pending = String::new();
    loop {
        let read = match file.read(&mut buffer) {
            Ok(0) => return Ok(()),
            Ok(read) => read,
            // The ring buffer overwrote records we had not read yet.
            Err(err) if err.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(err) if err.kind() == ErrorKind::Interrupted => continue,
            Err(err) => return Err(read_err(err)),
        };
        pending.push_str(&String::from_utf8_lossy(&buffer[..read]));
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            if !on_line(line.trim_end_matches('\n')) {
                return Ok(());
            }
        }
    }
}

/// Splits a line of syslog(2)'s `SYSLOG_ACTION_READ_ALL` text,
/// `<priority>[seconds.micros] message` (the timestamp is there unless
/// `printk.time` is off), into priority, microseconds since boot and message.
pub fn split_syslog_line(line: &str) -> Option<(u32, Option<u64>, &str)> {
    let rest = line.strip_prefix('<')?;
    let (priority, rest) = rest.split_once('>')?;
    let priority = priority.parse().ok()?;
    let Some(stamped) = rest.strip_prefix('[') else {
        return Some((priority, None, rest));
    };
    let (stamp, message) = stamped.split_once(']')?;
    let (seconds, micros) = stamp.trim().split_once('.')?;
    let micros: u64 = format!("{micros:0<6}").get(..6)?.parse().ok()?;
    // A line that claims more seconds than fit is not a kernel's: no stamp.
    let timestamp_us = seconds
        .parse::<u64>()
        .ok()?
        .checked_mul(1_000_000)?
        .checked_add(micros)?;
    Some((
        priority,
        Some(timestamp_us),
        message.strip_prefix(' ').unwrap_or(message),
    ))
}

/// One syslog(2) line as an event, if the kernel itself reports a stall
/// (facility 0, as for `/dev/kmsg`).
pub fn parse_syslog_line(line: &str) -> Option<KernelLogEvent> {
    let (priority, timestamp_us, message) = split_syslog_line(line)?;
    if !from_kernel(priority) {
        return None;
    }
    Some(KernelLogEvent {
        kind: classify(message)?,
        message: message.to_string(),
        sequence: None,
        timestamp_us,
    })
}

/// The size of the kernel log buffer, through syslog(2).
fn syslog_buffer_size() -> std::io::Result<usize> {
    const SYSLOG_ACTION_SIZE_BUFFER: libc::c_int = 10;
    // SAFETY: SIZE_BUFFER takes no buffer.
    let size = unsafe { libc::klogctl(SYSLOG_ACTION_SIZE_BUFFER, std::ptr::null_mut(), 0) };
    if size < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size.max(4096) as usize)
}

/// The last `len` bytes of the kernel log, through syslog(2), without
/// consuming them (needs CAP_SYSLOG while `kernel.dmesg_restrict=1`; not
/// subject to the device cgroup).
fn read_syslog_tail(len: usize) -> std::io::Result<String> {
    const SYSLOG_ACTION_READ_ALL: libc::c_int = 3;
    let mut buffer = vec![0u8; len];
    let len = libc::c_int::try_from(len).unwrap_or(libc::c_int::MAX);
    // SAFETY: the kernel writes at most `len` bytes into buffer.
    let read = unsafe { libc::klogctl(SYSLOG_ACTION_READ_ALL, buffer.as_mut_ptr().cast(), len) };
    if read < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buffer.truncate(read as usize);
    Ok(String::from_utf8_lossy(&buffer).into_owned())
}

/// How much of the log's end a poll reads first: a second of even a busy
/// kernel log fits, so a poll copies what is new, not the whole buffer.
const SYSLOG_TAIL: usize = 16 * 1024;

/// The complete lines of a read of the log's last bytes: the first line is
/// cut unless the read began at the start of the log (`whole`).
fn complete_lines(text: &str, whole: bool) -> impl Iterator<Item = &str> {
    text.lines().skip(usize::from(!whole))
}

/// Whether a read holds every record newer than `seen_up_to`: it reaches
/// back to a record at or before it, or it is the whole log.
fn reaches_back(text: &str, whole: bool, seen_up_to: u64) -> bool {
    whole
        || complete_lines(text, whole)
            .filter_map(|l| split_syslog_line(l).and_then(|(_, stamp, _)| stamp))
            .any(|stamp| stamp <= seen_up_to)
}

/// The log's records newer than `seen_up_to`, reading only its end: the
/// last `SYSLOG_TAIL` bytes, doubled until the read reaches back to a record
/// already seen (or is the whole log). Returns the text and whether it is
/// the whole log.
fn read_syslog_since(seen_up_to: u64) -> std::io::Result<(String, bool)> {
    let size = syslog_buffer_size()?;
    let mut len = SYSLOG_TAIL.min(size);
    loop {
        let text = read_syslog_tail(len)?;
        // Less than asked for: the log holds no more than this.
        let whole = len >= size || text.len() < len;
        if reaches_back(&text, whole, seen_up_to) {
            return Ok((text, whole));
        }
        len = (len * 2).min(size);
    }
}

/// Polls the kernel log through syslog(2) every `poll` and calls `on_event`
/// for each recognised record newer than the newest one seen (records
/// already in the log at the start are skipped), until `on_event` returns
/// false. Each poll reads only the log's end (`read_syslog_since`). Fails
/// at once if syslog(2) is refused, and when the log has no timestamps
/// (`printk.time` off), since new records could not be told from old ones.
/// Blocks: run it on its own thread.
pub fn watch_syslog(
    poll: std::time::Duration,
    mut on_event: impl FnMut(KernelLogEvent) -> bool,
) -> Result<()> {
    let read_err = |source| Error::Read {
        path: PathBuf::from("syslog(2)"),
        source,
    };
    let (first, whole) = read_syslog_tail(SYSLOG_TAIL)
        .map(|text| {
            let whole = text.len() < SYSLOG_TAIL;
            (text, whole)
        })
        .map_err(read_err)?;
    let mut seen_up_to = match complete_lines(&first, whole)
        .filter_map(|l| split_syslog_line(l).and_then(|(_, stamp, _)| stamp))
        .max()
    {
        Some(stamp) => stamp,
        None if first.trim().is_empty() => 0,
        None => {
            return Err(read_err(std::io::Error::other(
                "kernel log lines carry no timestamps (printk.time is off)",
            )));
        }
    };
    loop {
        std::thread::sleep(poll);
        let (text, whole) = read_syslog_since(seen_up_to).map_err(read_err)?;
        for line in complete_lines(&text, whole) {
            let Some((_, Some(stamp), _)) = split_syslog_line(line) else {
                continue;
            };
            if stamp <= seen_up_to {
                continue;
            }
            seen_up_to = stamp;
            if let Some(event) = parse_syslog_line(line)
                && !on_event(event)
            {
                return Ok(());
            }
        }
    }
}

/// How many recognised records wait for the reader of [`spawn`]'s channel;
/// past that the watcher thread waits for it.
pub const CHANNEL_CAPACITY: usize = 64;

/// Watches the log on its own thread (from now on with `from_end`, as the
/// agent does; from the start for a file of records in tests); recognised
/// records arrive on the returned channel (bounded: the thread waits while
/// it is full). The thread ends when the receiver is dropped and the next
/// record arrives, or when the log cannot be read (logged, as the agent
/// works without it).
pub fn spawn(path: PathBuf, from_end: bool) -> tokio::sync::mpsc::Receiver<KernelLogEvent> {
    let (sender, receiver) = tokio::sync::mpsc::channel(CHANNEL_CAPACITY);
    let spawned = std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            if let Err(err) = watch(&path, from_end, |event| sender.blocking_send(event).is_ok()) {
                tracing::warn!(%err, "not watching the kernel log");
            }
        });
    if let Err(err) = spawned {
        tracing::warn!(%err, "cannot start the kernel log watcher");
    }
    receiver
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;

    /// Lines as the kernel writes them (formats from kernel/watchdog.c,
    /// kernel/rcu/tree_stall.h and kernel/hung_task.c), with continuation
    /// lines and records that must not match.
    const LOG: &str = "\
5,0,0,-;Linux version 6.18.44 (builder@sandboxing) #1 SMP PREEMPT_DYNAMIC
6,410,1523042,-;rcu: Hierarchical RCU implementation.
4,1234,5678901,-;watchdog: BUG: soft lockup - CPU#16 stuck for 67s! [sh:12883]
 SUBSYSTEM=cpu
 DEVICE=+cpu:16
3,1300,5700000,-;rcu: INFO: rcu_sched self-detected stall on CPU
3,1301,5700001,c;rcu: \t16-....: (5249 ticks this GP) idle=8fe/1/0x4000000000000002
3,1400,5800000,-;rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:
3,1500,125000000,-;INFO: task khugepaged:89 blocked for more than 122 seconds.
3,1501,125000001,-;      Not tainted 6.18.44 #1
4,1600,130000000,-;hugetlb: allocating 1024 of page size 2.00 MiB failed.  Only allocated 980 hugepages.
6,1700,130000001,-;a user wrote: the task blocked for a while
";

    #[test]
    fn a_read_of_the_logs_end_skips_its_cut_first_line_and_knows_when_it_reaches_back() {
        let tail = "9>[  10.000001] cut in the middle\n<4>[  11.000000] a\n<4>[  12.500000] b\n";
        let lines: Vec<&str> = complete_lines(tail, false).collect();
        assert_eq!(lines, ["<4>[  11.000000] a", "<4>[  12.500000] b"]);
        // Seen up to 11 s: this read holds everything newer.
        assert!(reaches_back(tail, false, 11_000_000));
        // Seen up to 10.5 s: the cut line could hide a record after it, and
        // the next line is newer: read more.
        assert!(!reaches_back(tail, false, 10_500_000));
        // The whole log always reaches back.
        assert!(reaches_back(tail, true, 0));
        assert_eq!(complete_lines(tail, true).count(), 3);
    }

    #[test]
    fn a_poll_of_the_real_log_reads_its_end_and_holds_every_new_record() {
        // syslog(2) needs CAP_SYSLOG while dmesg_restrict is 1; as root here.
        let size = match syslog_buffer_size() {
            Ok(size) => size,
            Err(err) => {
                let reason = format!("syslog(2) refused: {err} (run as root)");
                assert!(!hugepool_e2e::in_ci_mode(), "{reason}");
                eprintln!("skipping: {reason}");
                return;
            }
        };
        let (text, whole) = read_syslog_since(0).expect("read");
        // Reaching back to the first record needs the whole log.
        assert!(whole || reaches_back(&text, whole, 0));
        let newest = complete_lines(&text, whole)
            .filter_map(|l| split_syslog_line(l).and_then(|(_, stamp, _)| stamp))
            .max()
            .unwrap_or(0);
        let (tail, whole_tail) = read_syslog_since(newest).expect("read");
        assert!(tail.len() <= SYSLOG_TAIL.max(size), "{}", tail.len());
        assert!(reaches_back(&tail, whole_tail, newest));
    }

    #[test]
    fn syslog_lines_give_priority_timestamp_and_message() {
        assert_eq!(
            split_syslog_line(
                "<4>[ 5678.901234] watchdog: BUG: soft lockup - CPU#16 stuck for 67s!"
            ),
            Some((
                4,
                Some(5_678_901_234),
                "watchdog: BUG: soft lockup - CPU#16 stuck for 67s!"
            ))
        );
        // Facility 1 (user) is in the priority: 1 << 3 | 4.
        assert_eq!(
            split_syslog_line("<12>[    0.5] x"),
            Some((12, Some(500_000), "x"))
        );
        assert_eq!(
            split_syslog_line("<6>no timestamp"),
            Some((6, None, "no timestamp"))
        );
        assert_eq!(split_syslog_line("plain text"), None);
        // At the bound of u64 microseconds, and one second past it.
        let max_seconds = u64::MAX / 1_000_000;
        let max_micros = u64::MAX % 1_000_000;
        assert_eq!(
            split_syslog_line(&format!("<6>[{max_seconds}.{max_micros:06}] edge")),
            Some((6, Some(u64::MAX), "edge"))
        );
        assert_eq!(
            split_syslog_line(&format!("<6>[{}.000000] past", max_seconds + 1)),
            None
        );
        let event = parse_syslog_line(
            "<3>[  125.000001] INFO: task khugepaged:89 blocked for more than 122 seconds.",
        )
        .expect("a hung task");
        assert_eq!(
            (event.kind, event.timestamp_us, event.sequence),
            (KernelLogKind::HungTask, Some(125_000_001), None)
        );
        assert_eq!(
            parse_syslog_line("<6>[ 1.000000] rcu: Hierarchical RCU implementation."),
            None
        );
    }

    #[test]
    fn recognises_lockups_stalls_and_hung_tasks_in_real_records() {
        let events: Vec<KernelLogEvent> = LOG.lines().filter_map(parse_record).collect();
        let kinds: Vec<KernelLogKind> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            vec![
                KernelLogKind::SoftLockup,
                KernelLogKind::RcuStall,
                KernelLogKind::RcuStall,
                KernelLogKind::HungTask
            ]
        );
        assert_eq!(
            events[0],
            KernelLogEvent {
                kind: KernelLogKind::SoftLockup,
                message: "watchdog: BUG: soft lockup - CPU#16 stuck for 67s! [sh:12883]".into(),
                sequence: Some(1234),
                timestamp_us: Some(5678901),
            }
        );
        assert_eq!(events[3].sequence, Some(1500));
    }

    #[test]
    fn only_the_kernels_own_records_count() {
        let lockup = "watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [sh:1]";
        // The kernel's record (facility 0, level 0-7).
        assert!(parse_record(&format!("4,9,10,-;{lockup}")).is_some());
        assert!(parse_record(&format!("0,9,10,-;{lockup}")).is_some());
        // What `echo '<4>...' > /dev/kmsg` stores: facility 1 (user), level 4.
        assert_eq!(parse_record(&format!("12,9,10,-;{lockup}")), None);
        // Any other facility (daemon = 3, local7 = 23).
        assert_eq!(parse_record(&format!("28,9,10,-;{lockup}")), None);
        assert_eq!(parse_record(&format!("190,9,10,-;{lockup}")), None);
        // syslog(2) lines carry the same priority.
        assert!(parse_syslog_line(&format!("<4>[ 1.000000] {lockup}")).is_some());
        assert_eq!(
            parse_syslog_line(&format!("<12>[ 1.000000] {lockup}")),
            None
        );
    }

    #[test]
    fn plain_dmesg_lines_are_recognised_too() {
        let event =
            parse_record("INFO: task kworker/0:1:42 blocked for more than 120 seconds.").unwrap();
        assert_eq!(event.kind, KernelLogKind::HungTask);
        assert_eq!(event.sequence, None);
    }

    #[test]
    fn watch_reads_a_file_of_records_and_stops_when_asked() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(LOG.as_bytes()).unwrap();
        let mut seen = Vec::new();
        watch(file.path(), false, |event| {
            seen.push(event.kind);
            true
        })
        .unwrap();
        assert_eq!(seen.len(), 4);
        let mut first = None;
        watch(file.path(), false, |event| {
            first = Some(event.kind);
            false
        })
        .unwrap();
        assert_eq!(first, Some(KernelLogKind::SoftLockup));
        let mut none = 0;
        watch(file.path(), true, |_| {
            none += 1;
            true
        })
        .unwrap();
        assert_eq!(none, 0);
    }

    #[tokio::test]
    async fn spawned_watcher_delivers_events_on_a_channel() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(LOG.as_bytes()).unwrap();
        let mut events = spawn(file.path().to_path_buf(), false);
        let mut kinds = Vec::new();
        while let Some(event) = events.recv().await {
            kinds.push(event.kind);
        }
        assert_eq!(kinds.len(), 4);
        assert_eq!(kinds[3], KernelLogKind::HungTask);
    }

    proptest! {
        #[test]
        fn never_panics_on_any_line(line in ".{0,200}") {
            let _ = parse_record(&line);
        }
    }
}

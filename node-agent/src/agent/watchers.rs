//! The watches of the node's own HugePageNode and Node, and the kernel log
//! watcher.

use super::*;

/// Follows this node's HugePageNode; `None` when it does not exist.
pub(super) async fn watch_own_node_spec(
    api: Api<HugePageNode>,
    name: String,
    spec_tx: watch::Sender<Option<HugePageNode>>,
    seen_tx: watch::Sender<bool>,
    shared: Arc<Shared>,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut listed: Option<HugePageNode> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => listed = None,
            Ok(watcher::Event::InitApply(object)) => listed = Some(object),
            Ok(watcher::Event::InitDone) => {
                if listed.is_none() {
                    // Nothing to converge or report: ready as it is.
                    shared.ready.store(true, Ordering::Relaxed);
                }
                let allocated = listed
                    .as_ref()
                    .map(crate::dra::allocated)
                    .unwrap_or_default();
                shared.set_claims(None, Some(allocated));
                publish_spec(&spec_tx, listed.take());
                let _ = seen_tx.send(true);
            }
            Ok(watcher::Event::Apply(object)) => {
                shared.set_claims(None, Some(crate::dra::allocated(&object)));
                publish_spec(&spec_tx, Some(object));
            }
            Ok(watcher::Event::Delete(_)) => {
                shared.set_claims(None, Some(Default::default()));
                publish_spec(&spec_tx, None);
            }
            Err(err) => {
                warn!(error = %err, "watch of the HugePageNode failed; retrying with backoff")
            }
        }
    }
}

/// Sends only when the spec (or existence) changed, so status-only updates
/// do not wake the resize loop.
pub(super) fn publish_spec(
    spec_tx: &watch::Sender<Option<HugePageNode>>,
    object: Option<HugePageNode>,
) {
    spec_tx.send_if_modified(|current| {
        let same = match (current.as_ref(), object.as_ref()) {
            (Some(a), Some(b)) => {
                a.spec == b.spec
                    && a.metadata.generation == b.metadata.generation
                    && a.metadata.uid == b.metadata.uid
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            *current = object;
        }
        !same
    });
}

/// Follows this node's `hugepages-<size>` capacity, as kubelet reports it.
pub(super) async fn watch_kubelet_capacity(api: Api<Node>, name: String, shared: Arc<Shared>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(node) => {
                let capacity = node_capacity(&node);
                let ready = node_ready(&node);
                shared.metrics.set_node_taints(&taint_keys(&node));
                let mut memory = shared.memory();
                memory.kubelet.node_ready = ready;
                memory.kubelet.node_uid = node.metadata.uid.clone();
                if memory.kubelet.capacity.as_ref() != Some(&capacity) {
                    memory.kubelet.capacity = Some(capacity);
                    drop(memory);
                    shared.touch(true);
                }
            }
            Err(err) => warn!(error = %err, "watch of the Node failed; retrying with backoff"),
        }
    }
}

/// The keys of a Node's taints.
fn taint_keys(node: &Node) -> Vec<&str> {
    node.spec
        .iter()
        .flat_map(|spec| spec.taints.iter().flatten())
        .map(|taint| taint.key.as_str())
        .collect()
}

/// `hugepages-<size>` capacities of a Node, in bytes (none before the
/// kubelet has reported any).
pub fn node_capacity(node: &Node) -> BTreeMap<PageSize, u64> {
    hugepool_crds::kubelet::hugepage_capacity(node).unwrap_or_default()
}

/// The Node's Ready condition in a line: `True (KubeletReady: kubelet is
/// posting ready status)`.
fn node_ready(node: &Node) -> Option<String> {
    let conditions = node.status.as_ref()?.conditions.as_ref()?;
    let ready = conditions.iter().find(|c| c.type_ == "Ready")?;
    Some(format!(
        "{} ({}: {})",
        ready.status,
        ready.reason.as_deref().unwrap_or(""),
        ready.message.as_deref().unwrap_or("")
    ))
}

/// How often syslog(2) is read when `/dev/kmsg` cannot be opened.
pub(super) const KERNEL_LOG_POLL: Duration = Duration::from_secs(1);

/// Reads `/dev/kmsg` (or polls syslog(2)) on its own thread; stalls the kernel reports while a
/// resize runs set Stalled with the kernel's line.
pub(super) fn watch_kernel_log(path: PathBuf, shared: Arc<Shared>, events: EventSender) {
    let set_state = |shared: &Shared, state: KernelLogState| {
        let watching = matches!(state, KernelLogState::Watching(_));
        shared.metrics.kernel_log_watching.set(i64::from(watching));
        shared.memory().kernel_log = state;
        shared.touch(!watching);
    };
    let thread_shared = Arc::clone(&shared);
    let spawned = std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            let shared = thread_shared;
            let on_record = |record: KernelLogEvent| {
                let reason = Reason::parse(record.kind.as_str()).unwrap_or(Reason::SoftLockup);
                shared
                    .metrics
                    .stalls
                    .get_or_create(&StallLabels {
                        reason: reason.as_str().into(),
                    })
                    .inc();
                let mut memory = shared.memory();
                let running: Vec<PageSize> = memory
                    .sizes
                    .iter()
                    .filter(|(_, r)| r.running.is_some())
                    .map(|(s, _)| *s)
                    .collect();
                for size in &running {
                    if let Some(record_of_size) = memory.sizes.get_mut(size) {
                        record_of_size.stall = Some(StallRecord {
                            reason,
                            message: format!("kernel: {}", record.message),
                        });
                    }
                }
                drop(memory);
                if running.is_empty() {
                    info!(kernel = %record.message, "kernel reported a stall while no resize ran");
                } else {
                    warn!(kernel = %record.message, "kernel reported a stall during a resize");
                    queue_event(
                        &events,
                        &shared.metrics,
                        PendingEvent {
                            type_: EventType::Warning,
                            reason: "KernelStall",
                            note: record.message.clone(),
                        },
                    );
                    shared.touch(true);
                }
                true
            };
            // A container runtime's device cgroup refuses opening /dev/kmsg
            // even with CAP_SYSLOG; syslog(2) needs only the capability.
            let result = match std::fs::File::open(&path) {
                Ok(_) => {
                    set_state(
                        &shared,
                        KernelLogState::Watching(path.display().to_string()),
                    );
                    crate::kernel::kmsg::watch(&path, true, on_record)
                        .map_err(|err| err.to_string())
                }
                Err(open_error) => {
                    let refused = format!("cannot open {}: {open_error}", path.display());
                    info!(%refused, "reading the kernel log through syslog(2) instead");
                    set_state(
                        &shared,
                        KernelLogState::Watching(format!("syslog(2) ({refused})")),
                    );
                    crate::kernel::kmsg::watch_syslog(KERNEL_LOG_POLL, on_record)
                        .map_err(|err| format!("{refused}; {err}"))
                }
            };
            let error = match result {
                Err(error) => error,
                Ok(()) => format!("{} ended", path.display()),
            };
            warn!(%error, "kernel log watcher stopped");
            set_state(&shared, KernelLogState::Unavailable(error));
        });
    if let Err(err) = spawned {
        warn!(error = %err, "cannot start the kernel log watcher");
        set_state(
            &shared,
            KernelLogState::Unavailable(format!("no watcher thread: {err}")),
        );
    }
}

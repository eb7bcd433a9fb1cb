//! Events the agent publishes on its HugePageNode: queued without waiting
//! (a kernel write never waits for the API server), bounded, published by
//! one task.

use super::*;

/// Events waiting for the API server at most; beyond, new ones are dropped
/// and counted (`hugepool_events_dropped_total`), so an unreachable API never
/// grows the agent's memory.
pub(super) const EVENT_QUEUE: usize = 256;

pub(super) type EventSender = mpsc::Sender<PendingEvent>;

/// Queues an Event without waiting; a full queue drops it and counts it.
pub(super) fn queue_event(events: &EventSender, metrics: &Metrics, event: PendingEvent) {
    if let Err(mpsc::error::TrySendError::Full(event)) = events.try_send(event) {
        metrics.events_dropped.inc();
        debug!(reason = event.reason, "event queue full; event dropped");
    }
}

/// An Event the resize loop wants published (publishing is async and must
/// never hold up a kernel write).
pub(super) struct PendingEvent {
    pub(super) type_: EventType,
    pub(super) reason: &'static str,
    pub(super) note: String,
}

/// Publishes Events on the HugePageNode, once it is known.
pub(super) async fn publish_events(
    client: Client,
    node_name: String,
    mut events_rx: mpsc::Receiver<PendingEvent>,
    object_rx: watch::Receiver<Option<HugePageNode>>,
) {
    let reporter = Reporter {
        controller: "hugepool-agent".into(),
        instance: Some(node_name),
    };
    let recorder = Recorder::new(client, reporter);
    while let Some(pending) = events_rx.recv().await {
        let Some(object) = object_rx.borrow().clone() else {
            continue;
        };
        let reference = object.object_ref(&());
        let event = KubeEvent {
            type_: pending.type_,
            reason: pending.reason.into(),
            note: Some(pending.note),
            action: "Resize".into(),
            secondary: None,
        };
        if let Err(err) = recorder.publish(&event, &reference).await {
            debug!(error = %err, "could not publish an event");
        }
    }
}

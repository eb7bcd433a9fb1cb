//! What a Node's kubelet says about hugepages, read the same way by the
//! operator and the agent: the capacities it publishes and the one rule for
//! when they are stale.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

use crate::{PageSize, quantity};

/// The `hugepages-<size>` capacities the Node's kubelet publishes, in bytes
/// by size; `None` while the Node has no capacity at all (no kubelet has
/// reported yet). Entries that do not parse are left out.
pub fn hugepage_capacity(node: &Node) -> Option<BTreeMap<PageSize, u64>> {
    let capacity = node.status.as_ref()?.capacity.as_ref()?;
    Some(
        capacity
            .iter()
            .filter_map(|(name, amount)| {
                let size: PageSize = name.strip_prefix("hugepages-")?.parse().ok()?;
                Some((size, quantity::parse_bytes(&amount.0).ok()?))
            })
            .collect(),
    )
}

/// Whether a kubelet publishing `capacity` misreports a pool of `pages` of
/// `size`: the one rule for stale capacity (the agent restarts a kubelet by
/// it, the operator keeps a pool from Available by it).
///
/// The kubelet reads the pools once when it starts, so after a resize this
/// holds until it restarts. A kubelet lists every size its kernel offers
/// (0 included), so a Node that does not list `hugepages-<size>` has no
/// kubelet publishing that size: a restart cannot change it, and it is not
/// stale. A pool too large to count in bytes is stale.
pub fn capacity_stale(capacity: &BTreeMap<PageSize, u64>, size: PageSize, pages: u64) -> bool {
    capacity
        .get(&size)
        .is_some_and(|&bytes| pages.checked_mul(size.bytes()) != Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn node(capacity: &[(&str, &str)]) -> Node {
        Node {
            status: Some(NodeStatus {
                capacity: Some(
                    capacity
                        .iter()
                        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                        .collect(),
                ),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    #[test]
    fn capacity_is_read_in_bytes_by_page_size() {
        let read = hugepage_capacity(&node(&[
            ("cpu", "2"),
            ("hugepages-2Mi", "128Mi"),
            ("hugepages-1Gi", "0"),
            ("hugepages-bogus", "1"),
        ]))
        .unwrap();
        assert_eq!(
            read,
            BTreeMap::from([(PageSize::SIZE_2MI, 128 << 20), (PageSize::SIZE_1GI, 0)])
        );
        assert_eq!(hugepage_capacity(&Node::default()), None);
    }

    #[test]
    fn stale_when_the_listed_capacity_differs_from_the_pool() {
        let capacity = BTreeMap::from([(PageSize::SIZE_2MI, 128 << 20)]);
        assert!(!capacity_stale(&capacity, PageSize::SIZE_2MI, 64));
        assert!(capacity_stale(&capacity, PageSize::SIZE_2MI, 63));
        assert!(capacity_stale(&capacity, PageSize::SIZE_2MI, 0));
        let none = BTreeMap::from([(PageSize::SIZE_2MI, 0)]);
        assert!(capacity_stale(&none, PageSize::SIZE_2MI, 1));
        assert!(!capacity_stale(&none, PageSize::SIZE_2MI, 0));
    }

    #[test]
    fn a_size_the_node_does_not_list_is_not_stale() {
        let capacity = BTreeMap::from([(PageSize::SIZE_2MI, 0)]);
        assert!(!capacity_stale(&capacity, PageSize::SIZE_1GI, 8));
        assert!(!capacity_stale(&BTreeMap::new(), PageSize::SIZE_2MI, 64));
    }

    #[test]
    fn a_pool_too_large_to_count_in_bytes_is_stale() {
        let capacity = BTreeMap::from([(PageSize::SIZE_1GI, u64::MAX)]);
        assert!(capacity_stale(&capacity, PageSize::SIZE_1GI, u64::MAX));
    }
}

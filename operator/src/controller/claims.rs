//! What ResourceClaims allocated on each node hold, told to its agent
//! (`status.allocatedClaims` of the HugePageNode): the scheduler allocates a
//! claim before the kubelet prepares it, and a shrink in between must not
//! free the pages the claim's pod is about to take.

use super::*;
use hugepool_crds::node::ClaimedPagesOnNuma;
use kube::Resource;
use kube::api::{DynamicObject, Patch, PatchParams};
use serde_json::json;

/// The nodes whose HugePageNode does not show what the claims allocated
/// there hold, with what it should show.
pub(super) fn to_tell(
    claims: &Store<DynamicObject>,
    states: &[Arc<HugePageNode>],
) -> Vec<(String, Vec<ClaimedPagesOnNuma>)> {
    let claims = claims.state();
    let values: Vec<serde_json::Value> = claims
        .iter()
        .filter_map(|claim| serde_json::to_value(claim.as_ref()).ok())
        .collect();
    let mut allocated = hugepool_crds::dra::allocated_by_node(&values);
    states
        .iter()
        .filter_map(|state| {
            let name = state.metadata.name.as_deref()?;
            let wanted = allocated.remove(name).unwrap_or_default();
            let shown = state
                .status
                .as_ref()
                .map_or(&[][..], |s| s.allocated_claims.as_slice());
            (shown != wanted.as_slice()).then(|| (name.to_string(), wanted))
        })
        .collect()
}

/// Writes `allocated` as the node's `status.allocatedClaims` (removes it
/// when empty), under the claims' own field manager.
pub(super) async fn write_allocated(
    ctx: &Context,
    node: &str,
    allocated: &[ClaimedPagesOnNuma],
) -> Result<HugePageNode> {
    let api: Api<HugePageNode> = Api::all(ctx.client.clone());
    let status = if allocated.is_empty() {
        json!({})
    } else {
        json!({"allocatedClaims": allocated})
    };
    fenced(ctx, async {
        api.patch_status(
            node,
            &PatchParams::apply(hugepool_crds::CLAIMS_MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": HugePageNode::api_version(&()),
                "kind": HugePageNode::kind(&()),
                "status": status,
            })),
        )
        .await
        .map_err(|source| Error::AllocatedClaims {
            node: node.to_string(),
            source,
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use hugepool_crds::PageSize;
    use kube::runtime::reflector::store::Writer;

    fn claim(pool: &str, memory: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "apps", "name": format!("c-{pool}-{memory}")},
            "status": {"allocation": {"devices": {"results": [{
                "request": "pages", "driver": hugepool_crds::dra::DRIVER, "pool": pool,
                "device": "hugepages-2mi-numa0", "consumedCapacity": {"memory": memory},
            }]}}},
        }))
        .unwrap()
    }

    #[test]
    fn only_nodes_whose_status_differs_from_their_claims_are_told() {
        let resource = hugepool_crds::dra::resource_claims();
        let mut writer: Writer<DynamicObject> = Writer::new(resource);
        for c in [
            claim("w-1", "8Mi"),
            claim("w-1", "2Mi"),
            claim("gone", "2Mi"),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(c));
        }
        let store = writer.as_reader();
        let state = |name: &str, shown: Vec<ClaimedPagesOnNuma>| {
            let mut state = HugePageNode::new(name, Default::default());
            state.status = Some(hugepool_crds::HugePageNodeStatus {
                allocated_claims: shown,
                ..Default::default()
            });
            Arc::new(state)
        };
        let five = vec![ClaimedPagesOnNuma {
            size: PageSize::SIZE_2MI,
            numa: 0,
            pages: 5,
        }];
        // w-1 shows nothing yet, w-2 shows a claim that went, w-3 is right.
        let states = [
            state("w-1", vec![]),
            state("w-2", five.clone()),
            state("w-3", vec![]),
        ];
        let told = to_tell(&store, &states);
        assert_eq!(
            told,
            [("w-1".to_string(), five), ("w-2".to_string(), vec![])]
        );
    }
}

//! HugePageNode specs: created with their owner, then changed only on the
//! condition that the spec is still the one the plan read.
//!
//! The condition is the object's `metadata.generation`, tested by the JSON
//! patch that writes the spec: the API server bumps it for every change of
//! the spec and never for a status write, so the agents' status writes
//! (every refresh, on every node) never make a spec write fail, while a
//! spec another replica wrote since the plan read it does.

use hugepool_crds::{HugePageNode, OPERATOR_MANAGER};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tracing::debug;

use super::Context;
use super::writes::fenced;
use crate::error::{Error, Result};
use crate::planner::NodePlan;

/// The HugePageNode is owned by its Node (so it goes with it).
pub(super) fn owned_by(node_state: &HugePageNode, node: &Node) -> bool {
    node_state
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Node" && Some(&o.uid) == node.metadata.uid.as_ref())
}

fn node_owner(node: &Node) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.name_any(),
        uid: node.metadata.uid.clone().unwrap_or_default(),
        ..OwnerReference::default()
    }
}

/// The HugePageNode a plan creates for `node`: named after it, owned by it.
pub fn new_node_state(node: &Node, plan: &NodePlan) -> HugePageNode {
    HugePageNode {
        metadata: ObjectMeta {
            name: Some(node.name_any()),
            owner_references: Some(vec![node_owner(node)]),
            ..ObjectMeta::default()
        },
        spec: plan.spec.clone(),
        status: None,
    }
}

/// The JSON patch that sets an existing HugePageNode's spec (and, with
/// `with_owner`, its owner) on the condition that it is still `current`'s:
/// its generation, or its resourceVersion when it has no generation.
pub fn node_spec_patch(
    current: &HugePageNode,
    node: &Node,
    plan: &NodePlan,
    with_owner: bool,
) -> json_patch::Patch {
    let condition = match current.metadata.generation {
        Some(generation) => {
            json!({"op": "test", "path": "/metadata/generation", "value": generation})
        }
        None => json!({
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": current.resource_version().unwrap_or_default(),
        }),
    };
    let mut operations = vec![
        condition,
        json!({"op": "add", "path": "/spec", "value": plan.spec}),
    ];
    if with_owner {
        operations.push(json!({
            "op": "add",
            "path": "/metadata/ownerReferences",
            "value": [node_owner(node)],
        }));
    }
    serde_json::from_value(json!(operations)).expect("a JSON patch of test and add operations")
}

/// Creates the node's HugePageNode, or writes its spec (and owner, when
/// `needs_owner`) on the condition that it is still `current`; returns it
/// as it now is. A creation that finds one already there, or a spec
/// changed since the plan read it, is a conflict (retried soon for this
/// node alone).
pub(super) async fn write_node_spec(
    ctx: &Context,
    node: &Node,
    current: Option<&HugePageNode>,
    plan: &NodePlan,
    needs_owner: bool,
) -> (String, Result<HugePageNode>) {
    let name = node.name_any();
    let api: Api<HugePageNode> = Api::all(ctx.client.clone());
    let error = |source| Error::NodeSpec {
        node: name.clone(),
        source,
    };
    let result = fenced(ctx, async {
        let written = match current {
            None => {
                let params = PostParams {
                    field_manager: Some(OPERATOR_MANAGER.into()),
                    ..PostParams::default()
                };
                api.create(&params, &new_node_state(node, plan)).await
            }
            Some(current) => {
                let params = PatchParams {
                    field_manager: Some(OPERATOR_MANAGER.into()),
                    ..PatchParams::default()
                };
                let patch = node_spec_patch(current, node, plan, needs_owner);
                api.patch(&name, &params, &Patch::Json::<()>(patch)).await
            }
        };
        written.map_err(error).map(|mut updated| {
            // Only its name, version, generation, spec and status are read.
            super::watches::slim_node_state(&mut updated);
            updated
        })
    })
    .await;
    if let Ok(updated) = &result {
        debug!(node = %name, generation = ?updated.metadata.generation, "wrote HugePageNode spec");
    }
    (name, result)
}

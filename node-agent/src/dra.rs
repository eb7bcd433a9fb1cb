//! The kubelet plugin of pools claimed through DRA (driver
//! `hugepages.hugepool.dev`): the DRA service (v1) the kubelet calls to
//! prepare a pod's claims before it creates the pod's sandbox and to
//! unprepare them after the pod is gone. Its registration (the socket the
//! kubelet finds in its `plugins_registry`) is served by `hugepool-hooks`
//! (hooks/registration.go says why not here).
//!
//! Preparing a claim reads it (the kubelet names it; the agent may `get`
//! claims), checks that its allocation is this node's, and records which
//! pages of which size and NUMA node it holds, for whom (`reservedFor`), in
//! [`Prepared`], kept in a file on the host so that a restarted agent still
//! knows. Each prepared claim also gets a CDI spec whose devices put one
//! environment variable ([`ENV_PREFIX`]) in the containers that use the
//! claim; the NRI plugin (`nri/`) sets those containers' hugetlb limits
//! and memory nodes from it (docs/design.md, "Pools claimed through DRA").
//!
//! The protos in `proto/` are compiled by build.rs (protox, tonic).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hugepool_crds::PageSize;
use kube::Client;
use kube::api::{Api, DynamicObject};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

pub use hugepool_crds::dra::{
    ClaimedPages, DRIVER, HugepageClaim as PreparedClaim, claimed_pages, resource_claims,
};

/// The generated services and messages.
pub mod proto {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
}

use proto::v1::dra_plugin_server::{DraPlugin, DraPluginServer};
use proto::v1::{
    NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};

/// The DRA service version this plugin serves, as the kubelet names it.
pub const DRA_SERVICE: &str = "v1.DRAPlugin";

/// Where the plugin's files go: the kubelet's plugins directory (the DRA
/// socket, `<plugins>/<driver>/dra.sock`, and the prepared claims) and the
/// CDI specs' directory.
#[derive(Clone, Debug)]
pub struct PluginDirs {
    pub plugins: PathBuf,
    /// Where the container runtime reads CDI specs (containerd 2.x and
    /// CRI-O: /etc/cdi and /var/run/cdi).
    pub cdi: PathBuf,
}

impl PluginDirs {
    pub fn dra_socket(&self) -> PathBuf {
        self.plugins.join(DRIVER).join("dra.sock")
    }

    /// The CDI spec of the claim with `uid`.
    pub fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.cdi
            .join(format!("{CDI_VENDOR}-{CDI_CLASS}-{uid}.json"))
    }
}

/// The CDI kind of a claim's pages: `hugepool.dev/hugepages`.
pub const CDI_VENDOR: &str = "hugepool.dev";
pub const CDI_CLASS: &str = "hugepages";

/// The environment variable a claim's pages put in each container that
/// uses the claim, one per allocation result:
/// `HUGEPOOL_PAGES_<claim uid>_<n>=size=2Mi,numa=0,pages=16`. The NRI plugin
/// sets the container's hugetlb limits and memory nodes from them; the
/// application may read them to know where its pages are.
pub const ENV_PREFIX: &str = "HUGEPOOL_PAGES_";

/// The CDI device of allocation result `index` of the claim with `uid`.
fn cdi_device(uid: &str, index: usize) -> String {
    format!("{uid}-{index}")
}

/// The fully qualified CDI device ids the kubelet hands the runtime for
/// each of the claim's results, in order.
pub fn cdi_device_ids(uid: &str, claim: &PreparedClaim) -> Vec<String> {
    (0..claim.pages.len())
        .map(|index| format!("{CDI_VENDOR}/{CDI_CLASS}={}", cdi_device(uid, index)))
        .collect()
}

/// The variable naming where allocation result `n` of a claim is mounted as
/// hugetlbfs: `HUGEPOOL_HUGETLBFS_<claim uid>_<n>=/hugepages/<claim uid>-<n>`.
pub const HUGETLBFS_ENV_PREFIX: &str = "HUGEPOOL_HUGETLBFS_";

/// Where allocation result `index` of the claim with `uid` is mounted as a
/// hugetlbfs of its page size in each container that uses it.
pub fn hugetlbfs_path(uid: &str, index: usize) -> String {
    format!("/hugepages/{}", cdi_device(uid, index))
}

/// The CDI spec of a prepared claim: one device per allocation result, whose
/// edits are its environment variable ([`ENV_PREFIX`]) and a hugetlbfs of
/// its page size ([`hugetlbfs_path`], named by [`HUGETLBFS_ENV_PREFIX`])
/// that holds at most the result's pages (`size=`): for what maps files
/// there (DPDK without `--in-memory`, SPDK), as `emptyDir: {medium:
/// HugePages}` is for a pod that requests `hugepages-<size>`.
pub fn cdi_spec(uid: &str, claim: &PreparedClaim) -> serde_json::Value {
    let env_uid = uid.replace('-', "_").to_uppercase();
    let devices: Vec<_> = claim
        .pages
        .iter()
        .enumerate()
        .map(|(index, pages)| {
            let path = hugetlbfs_path(uid, index);
            serde_json::json!({
                "name": cdi_device(uid, index),
                "containerEdits": {
                    "env": [
                        format!(
                            "{ENV_PREFIX}{env_uid}_{index}=size={},numa={},pages={}",
                            pages.size, pages.numa, pages.pages
                        ),
                        format!("{HUGETLBFS_ENV_PREFIX}{env_uid}_{index}={path}"),
                    ],
                    "mounts": [{
                        "hostPath": "nodev",
                        "containerPath": path,
                        "type": "hugetlbfs",
                        "options": [
                            "nosuid",
                            "nodev",
                            "noexec",
                            format!("pagesize={}", pages.size.bytes()),
                            format!("size={}", pages.pages.saturating_mul(pages.size.bytes())),
                            "mode=0777",
                        ],
                    }],
                },
            })
        })
        .collect();
    serde_json::json!({
        "cdiVersion": "0.6.0",
        "kind": format!("{CDI_VENDOR}/{CDI_CLASS}"),
        "devices": devices,
    })
}

/// Writes `bytes` to `path` whole or not at all (a temporary file whose name
/// no reader of the directory picks up, renamed over it).
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, path)
}

/// Prepared claims by uid.
pub type Prepared = BTreeMap<String, PreparedClaim>;

/// Pages prepared claims hold, by page size and NUMA node.
pub type Claimed = BTreeMap<(PageSize, u32), u64>;

/// Pages of `size` that `claimed` counts on NUMA node `numa`, or on all of
/// them (`None`).
pub fn claimed_of(claimed: &Claimed, size: PageSize, numa: Option<u32>) -> u64 {
    claimed
        .iter()
        .filter(|((s, n), _)| *s == size && numa.is_none_or(|numa| *n == numa))
        .map(|(_, pages)| pages)
        .sum()
}

/// What claims hold, prepared or only allocated: on each size and NUMA
/// node the larger of the two (an allocated claim is prepared later, and
/// the operator's view of the allocations may lag the kubelet's).
pub fn held(prepared: &Claimed, allocated: &Claimed) -> Claimed {
    let mut held = prepared.clone();
    for (key, pages) in allocated {
        let entry = held.entry(*key).or_default();
        *entry = (*entry).max(*pages);
    }
    held.retain(|_, pages| *pages > 0);
    held
}

/// What the operator tells the agent the allocated claims hold
/// (`status.allocatedClaims`).
pub fn allocated(object: &hugepool_crds::HugePageNode) -> Claimed {
    let mut allocated = Claimed::new();
    for entry in object.status.iter().flat_map(|s| &s.allocated_claims) {
        let (Ok(numa), Ok(pages)) = (u32::try_from(entry.numa), u64::try_from(entry.pages)) else {
            continue;
        };
        *allocated.entry((entry.size, numa)).or_default() += pages;
    }
    allocated
}

/// What `claims` hold together, by page size and NUMA node.
pub fn claimed<'a>(claims: impl IntoIterator<Item = &'a PreparedClaim>) -> Claimed {
    let mut held = Claimed::new();
    for pages in claims.into_iter().flat_map(|claim| &claim.pages) {
        *held.entry((pages.size, pages.numa)).or_default() += pages.pages;
    }
    held
}

/// Reads the prepared claims kept in `path` (none when it does not exist).
pub fn load(path: &Path) -> std::io::Result<Prepared> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|err| std::io::Error::new(std::io::ErrorKind::InvalidData, err)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(Prepared::new()),
        Err(err) => Err(err),
    }
}

/// Writes `prepared` to `path` whole or not at all (a temporary file renamed
/// over it).
pub fn save(path: &Path, prepared: &Prepared) -> std::io::Result<()> {
    write_whole(path, &serde_json::to_vec_pretty(prepared)?)
}

/// Persistent pages of one size on one NUMA node, as the kernel has them now.
pub type PoolReader = Box<dyn Fn(PageSize, u32) -> Result<u64, String> + Send + Sync>;

/// Whether claim `uid` fits the pool beside the claims prepared already: on
/// each NUMA node it takes pages of, the other prepared claims' pages and
/// its own are at most what the node's pool holds. A claim the scheduler
/// allocated from a slice published before a shrink may not: it is refused
/// with the counts (the kubelet retries, the pod waits) rather than
/// prepared on pages that are gone.
pub fn fits(
    prepared: &Prepared,
    uid: &str,
    claim: &PreparedClaim,
    pool: impl Fn(PageSize, u32) -> Result<u64, String>,
) -> Result<(), String> {
    let others = claimed(
        prepared
            .iter()
            .filter(|(other, _)| *other != uid)
            .map(|(_, claim)| claim),
    );
    for ((size, numa), pages) in claimed([claim]) {
        let held = others.get(&(size, numa)).copied().unwrap_or(0);
        let pool = pool(size, numa)?;
        if held + pages > pool {
            return Err(format!(
                "NUMA node {numa}'s {size} pool holds {pool} pages: prepared claims hold {held} \
                 and this claim asks {pages} (the pool shrank after the claim was allocated)"
            ));
        }
    }
    Ok(())
}

/// What preparing claim `uid`, as read now, records: the claim, or the
/// record of its first preparation when the kubelet prepares it again (the
/// pod it was prepared for keeps it; pods added to its `reservedFor` since
/// gain nothing). A claim's pages go to one pod: the hugetlb limits they
/// raise are a pod cgroup's, so a claim shared by pods would let each pod
/// fault all of its pages. One reserved for several pods is refused, with
/// the reason the kubelet shows on the pod; hugepool-hooks refuses the
/// containers of a pod a claim was not prepared for.
pub fn to_record(
    prepared: &Prepared,
    uid: &str,
    claim: PreparedClaim,
) -> Result<PreparedClaim, String> {
    if let Some(recorded) = prepared.get(uid) {
        return Ok(recorded.clone());
    }
    match claim.pods.len() {
        1 => Ok(claim),
        n => Err(format!(
            "ResourceClaim {}/{} is reserved for {n} pods: a claim's pages go to one pod \
             (hugetlb limits are a pod's; shared, each pod could fault all of them): give each \
             pod its own claim, e.g. from a ResourceClaimTemplate (docs/user-guide.md, \
             \"One claim, one pod\")",
            claim.namespace, claim.name
        )),
    }
}

/// How often prepared claims are checked against the API
/// ([`KubeletPlugin::forget_gone`]).
pub const FORGET_GONE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// The plugin's state, shared by both services.
pub struct KubeletPlugin {
    client: Client,
    node: String,
    dirs: PluginDirs,
    prepared: Mutex<Prepared>,
    /// Where `prepared` is kept across restarts.
    file: Option<PathBuf>,
    /// Told what the prepared claims hold after each change.
    on_change: Option<Box<dyn Fn(Claimed) + Send + Sync>>,
    /// Where a claim's pages are checked before it is prepared.
    pool: Option<PoolReader>,
}

impl KubeletPlugin {
    pub fn new(client: Client, node: String, dirs: PluginDirs, file: Option<PathBuf>) -> Self {
        let prepared = match file.as_deref().map(load) {
            Some(Ok(prepared)) => prepared,
            Some(Err(err)) => {
                warn!(error = %err, "cannot read the prepared claims: starting with none");
                Prepared::new()
            }
            None => Prepared::new(),
        };
        Self {
            client,
            node,
            dirs,
            prepared: Mutex::new(prepared),
            file,
            on_change: None,
            pool: None,
        }
    }

    /// Checks each claim against the pool before preparing it ([`fits`]).
    pub fn with_pool(mut self, pool: PoolReader) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Calls `tell` with what the prepared claims hold now and after every
    /// change.
    pub fn on_change(mut self, tell: impl Fn(Claimed) + Send + Sync + 'static) -> Self {
        tell(claimed(self.lock().values()));
        self.on_change = Some(Box::new(tell));
        self
    }

    /// The claims prepared now.
    pub fn prepared(&self) -> Prepared {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Prepared> {
        self.prepared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a change and keeps it in the file; a failed write is said
    /// and fails the call, so the kubelet retries it.
    fn update(
        &self,
        change: impl FnOnce(&mut Prepared) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut prepared = self.lock();
        change(&mut prepared)?;
        if let Some(tell) = &self.on_change {
            tell(claimed(prepared.values()));
        }
        if let Some(path) = &self.file {
            save(path, &prepared).map_err(|err| {
                format!(
                    "cannot keep the prepared claims in {}: {err}",
                    path.display()
                )
            })?;
        }
        Ok(())
    }

    async fn prepare(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<PreparedClaim, String> {
        let claims: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &resource_claims());
        let claim = claims
            .get(name)
            .await
            .map_err(|err| format!("cannot read ResourceClaim {namespace}/{name}: {err}"))?;
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Err(format!(
                "ResourceClaim {namespace}/{name} has uid {:?}, not {uid}",
                claim.metadata.uid
            ));
        }
        let json = serde_json::to_value(&claim).map_err(|err| err.to_string())?;
        let read = claimed_pages(&json, &self.node)?;
        let spec = self.dirs.cdi_spec(uid);
        let mut recorded = None;
        // Checked and recorded under one lock: two claims prepared at once
        // cannot both take the pool's last pages.
        self.update(|all| {
            let prepared = to_record(all, uid, read)?;
            if let Some(pool) = &self.pool {
                fits(all, uid, &prepared, pool)?;
            }
            let bytes = serde_json::to_vec_pretty(&cdi_spec(uid, &prepared))
                .map_err(|err| err.to_string())?;
            write_whole(&spec, &bytes)
                .map_err(|err| format!("cannot write the CDI spec {}: {err}", spec.display()))?;
            all.insert(uid.to_string(), prepared.clone());
            recorded = Some(prepared);
            Ok(())
        })?;
        recorded.ok_or_else(|| "the claim was not recorded".to_string())
    }

    /// Forgets the prepared claims that are gone from the API (deleted, or
    /// another claim now under the name) and returns their names. The
    /// kubelet unprepares a claim when its pod goes; one it never
    /// unprepared (its pod deleted while the kubelet was down, its
    /// checkpoint lost) would hold its pages against every shrink for good.
    /// A claim a pod still uses is not gone: its finalizer keeps it while it
    /// is reserved. Claims that cannot be read now are kept.
    pub async fn forget_gone(&self) -> Vec<String> {
        let mut forgotten = Vec::new();
        for (uid, claim) in self.prepared() {
            let claims: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &claim.namespace, &resource_claims());
            let found = match claims.get_opt(&claim.name).await {
                Ok(found) => found.and_then(|c| c.metadata.uid),
                Err(err) => {
                    warn!(claim = %format!("{}/{}", claim.namespace, claim.name), error = %err,
                        "cannot check a prepared claim");
                    continue;
                }
            };
            if found.as_deref() == Some(uid.as_str()) {
                continue;
            }
            let name = format!("{}/{}", claim.namespace, claim.name);
            match self.unprepare(&uid) {
                Ok(()) => {
                    warn!(claim = %name, %uid, "forgot a prepared claim gone from the API (the kubelet never unprepared it)");
                    forgotten.push(name);
                }
                Err(error) => warn!(claim = %name, %error, "cannot forget a prepared claim"),
            }
        }
        forgotten
    }

    /// Forgets a claim and removes its CDI spec (already gone is done).
    fn unprepare(&self, uid: &str) -> Result<(), String> {
        let spec = self.dirs.cdi_spec(uid);
        match std::fs::remove_file(&spec) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(format!(
                    "cannot remove the CDI spec {}: {err}",
                    spec.display()
                ));
            }
        }
        self.update(|all| {
            all.remove(uid);
            Ok(())
        })
    }
}

/// The DRA service.
struct Claims(Arc<KubeletPlugin>);

#[tonic::async_trait]
impl DraPlugin for Claims {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for claim in request.into_inner().claims {
            let answer = match self
                .0
                .prepare(&claim.namespace, &claim.name, &claim.uid)
                .await
            {
                Ok(prepared) => {
                    info!(claim = %format!("{}/{}", claim.namespace, claim.name), pages = ?prepared.pages, "claim prepared");
                    NodePrepareResourceResponse {
                        devices: prepared
                            .pages
                            .iter()
                            .zip(cdi_device_ids(&claim.uid, &prepared))
                            .map(|(p, cdi)| proto::v1::Device {
                                request_names: vec![p.request.clone()],
                                pool_name: self.0.node.clone(),
                                device_name: p.device.clone(),
                                cdi_device_ids: vec![cdi],
                                share_id: p.share_id.clone(),
                            })
                            .collect(),
                        error: String::new(),
                    }
                }
                Err(error) => {
                    warn!(claim = %format!("{}/{}", claim.namespace, claim.name), %error, "claim not prepared");
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            claims.insert(claim.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for claim in request.into_inner().claims {
            let error = match self.0.unprepare(&claim.uid) {
                Ok(()) => String::new(),
                Err(error) => error,
            };
            claims.insert(claim.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// Binds a unix socket at `path`, replacing a stale one a previous agent
/// left.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    UnixListener::bind(path)
}

/// Serves the DRA service until `shutdown` resolves.
pub async fn serve(
    plugin: Arc<KubeletPlugin>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let socket = plugin.dirs.dra_socket();
    let dra = bind(&socket)?;
    info!(dra = %socket.display(), "kubelet plugin serving");
    let served = tonic::transport::Server::builder()
        .add_service(DraPluginServer::new(Claims(Arc::clone(&plugin))))
        .serve_with_incoming_shutdown(UnixListenerStream::new(dra), shutdown)
        .await;
    if let Err(err) = served {
        warn!(error = %err, "kubelet plugin server failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_hold_is_the_larger_of_prepared_and_allocated_on_each_numa_node() {
        let mi2 = PageSize::SIZE_2MI;
        let mut object = hugepool_crds::HugePageNode::new("w-1", Default::default());
        let on = |numa, pages| hugepool_crds::node::ClaimedPagesOnNuma {
            size: mi2,
            numa,
            pages,
        };
        object.status = Some(hugepool_crds::HugePageNodeStatus {
            allocated_claims: vec![on(0, 10), on(1, 4), on(-1, 9)],
            ..Default::default()
        });
        let allocated = allocated(&object);
        assert_eq!(allocated, Claimed::from([((mi2, 0), 10), ((mi2, 1), 4)]));
        // NUMA node 0: 6 prepared of the 10 allocated (the rest not
        // prepared yet); node 1: 7 prepared, the operator not caught up.
        let prepared = Claimed::from([((mi2, 0), 6), ((mi2, 1), 7), ((mi2, 2), 0)]);
        assert_eq!(
            held(&prepared, &allocated),
            Claimed::from([((mi2, 0), 10), ((mi2, 1), 7)])
        );
        assert_eq!(held(&Claimed::new(), &Claimed::new()), Claimed::new());
    }

    fn claim(results: serde_json::Value) -> serde_json::Value {
        json!({
            "metadata": {"namespace": "apps", "name": "pages", "uid": "u1"},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
            },
        })
    }

    #[test]
    fn each_result_is_a_cdi_device_naming_its_pages_in_the_environment() {
        let prepared = claimed_pages(
            &claim(json!([{"request": "pages", "driver": DRIVER, "pool": "w-1",
                           "device": "hugepages-2mi-numa1", "consumedCapacity": {"memory": "32Mi"}},
                          {"request": "big", "driver": DRIVER, "pool": "w-1",
                           "device": "hugepages-1gi-numa0", "consumedCapacity": {"memory": "2Gi"}}])),
            "w-1",
        )
        .unwrap();
        let uid = "6d1e-42";
        assert_eq!(
            cdi_device_ids(uid, &prepared),
            [
                "hugepool.dev/hugepages=6d1e-42-0",
                "hugepool.dev/hugepages=6d1e-42-1"
            ]
        );
        let spec = cdi_spec(uid, &prepared);
        assert_eq!(spec["kind"], "hugepool.dev/hugepages");
        let edits: Vec<_> = spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| (d["name"].clone(), d["containerEdits"]["env"].clone()))
            .collect();
        assert_eq!(
            edits,
            [
                (
                    json!("6d1e-42-0"),
                    json!([
                        "HUGEPOOL_PAGES_6D1E_42_0=size=2Mi,numa=1,pages=16",
                        "HUGEPOOL_HUGETLBFS_6D1E_42_0=/hugepages/6d1e-42-0"
                    ])
                ),
                (
                    json!("6d1e-42-1"),
                    json!([
                        "HUGEPOOL_PAGES_6D1E_42_1=size=1Gi,numa=0,pages=2",
                        "HUGEPOOL_HUGETLBFS_6D1E_42_1=/hugepages/6d1e-42-1"
                    ])
                ),
            ]
        );
        // Each result a hugetlbfs of its size holding at most its pages.
        assert_eq!(
            spec["devices"][1]["containerEdits"]["mounts"],
            json!([{
                "hostPath": "nodev",
                "containerPath": "/hugepages/6d1e-42-1",
                "type": "hugetlbfs",
                "options": ["nosuid", "nodev", "noexec", "pagesize=1073741824", "size=2147483648", "mode=0777"],
            }])
        );
        let dirs = PluginDirs {
            plugins: "/p".into(),
            cdi: "/var/run/cdi".into(),
        };
        assert_eq!(
            dirs.cdi_spec(uid),
            Path::new("/var/run/cdi/hugepool.dev-hugepages-6d1e-42.json")
        );
    }

    #[test]
    fn a_claim_is_prepared_only_on_pages_the_pool_still_has() {
        let on = |device: &str, memory: &str| {
            claimed_pages(
                &claim(json!([{"request": "pages", "driver": DRIVER, "pool": "w-1",
                               "device": device, "consumedCapacity": {"memory": memory}}])),
                "w-1",
            )
            .unwrap()
        };
        // NUMA node 0 holds 20 pages, node 1 holds 4.
        let pool = |size: PageSize, numa: u32| match (size, numa) {
            (PageSize::SIZE_2MI, 0) => Ok(20),
            (PageSize::SIZE_2MI, 1) => Ok(4),
            _ => Err(format!("no {size} pool on NUMA node {numa}")),
        };
        let prepared = Prepared::from([("a".to_string(), on("hugepages-2mi-numa0", "24Mi"))]);
        // 12 prepared on node 0: 8 more fit, 9 do not.
        assert_eq!(
            fits(&prepared, "b", &on("hugepages-2mi-numa0", "16Mi"), pool),
            Ok(())
        );
        let refused = fits(&prepared, "b", &on("hugepages-2mi-numa0", "18Mi"), pool).unwrap_err();
        assert!(
            refused.contains("NUMA node 0's 2Mi pool holds 20 pages: prepared claims hold 12 and this claim asks 9"),
            "{refused}"
        );
        // Another NUMA node counts its own pool; the same claim again (the
        // kubelet retrying) is not counted twice.
        assert_eq!(
            fits(&prepared, "b", &on("hugepages-2mi-numa1", "8Mi"), pool),
            Ok(())
        );
        assert!(fits(&prepared, "b", &on("hugepages-2mi-numa1", "10Mi"), pool).is_err());
        assert_eq!(
            fits(&prepared, "a", &on("hugepages-2mi-numa0", "40Mi"), pool),
            Ok(())
        );
        // A pool that cannot be read prepares nothing.
        assert!(
            fits(&prepared, "b", &on("hugepages-1gi-numa0", "1Gi"), pool)
                .unwrap_err()
                .contains("no 1Gi pool")
        );
    }

    #[test]
    fn a_claims_pages_go_to_the_one_pod_it_was_first_prepared_for() {
        let reserved = |pods: &[&str]| {
            let mut claim = claim(json!([{"request": "pages", "driver": DRIVER, "pool": "w-1",
                                          "device": "hugepages-2mi-numa0", "consumedCapacity": {"memory": "20Mi"}}]));
            claim["status"]["reservedFor"] = pods
                .iter()
                .map(|uid| json!({"resource": "pods", "name": uid, "uid": uid}))
                .collect();
            claimed_pages(&claim, "w-1").unwrap()
        };
        let none = Prepared::new();
        assert_eq!(
            to_record(&none, "u1", reserved(&["a"])).map(|c| c.pods),
            Ok(vec!["a".to_string()])
        );
        let shared = to_record(&none, "u1", reserved(&["a", "b"])).unwrap_err();
        assert!(
            shared.contains(
                "ResourceClaim apps/pages is reserved for 2 pods: a claim's pages go to one pod"
            ),
            "{shared}"
        );
        // Prepared for a, then b joins: prepared again (a kubelet restart),
        // the record stays a's.
        let first = Prepared::from([("u1".to_string(), reserved(&["a"]))]);
        assert_eq!(
            to_record(&first, "u1", reserved(&["a", "b"])).map(|c| c.pods),
            Ok(vec!["a".to_string()])
        );
    }

    #[test]
    fn claimed_pages_add_up_by_size_and_numa_node() {
        let claim = |uid: &str, device: &str, memory: &str| {
            (
                uid.to_string(),
                claimed_pages(
                    &claim(json!([{"request": "pages", "driver": DRIVER, "pool": "w-1",
                                   "device": device, "consumedCapacity": {"memory": memory}}])),
                    "w-1",
                )
                .unwrap(),
            )
        };
        let prepared = Prepared::from([
            claim("a", "hugepages-2mi-numa0", "20Mi"),
            claim("b", "hugepages-2mi-numa0", "4Mi"),
            claim("c", "hugepages-2mi-numa1", "2Mi"),
            claim("d", "hugepages-1gi-numa0", "1Gi"),
        ]);
        assert_eq!(
            claimed(prepared.values()),
            Claimed::from([
                ((PageSize::SIZE_2MI, 0), 12),
                ((PageSize::SIZE_2MI, 1), 1),
                ((PageSize::SIZE_1GI, 0), 1),
            ])
        );
    }

    #[test]
    fn prepared_claims_survive_in_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claims.json");
        assert!(load(&path).unwrap().is_empty());
        let prepared = Prepared::from([(
            "u1".to_string(),
            claimed_pages(
                &claim(json!([{"request": "pages", "driver": DRIVER, "pool": "w-1",
                               "device": "hugepages-1gi-numa0", "consumedCapacity": {"memory": "2Gi"}}])),
                "w-1",
            )
            .unwrap(),
        )]);
        save(&path, &prepared).unwrap();
        assert_eq!(load(&path).unwrap(), prepared);
        assert_eq!(load(&path).unwrap()["u1"].pages[0].pages, 2);
        std::fs::write(&path, b"{").unwrap();
        assert!(load(&path).is_err());
    }
}

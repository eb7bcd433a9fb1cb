//! An in-memory kernel with the hugetlb pool semantics of the real one (as
//! measured in docs/kernel.md), write costs `a + b*pages`, and injectable faults.
//!
//! Cheap to clone (shared state behind an `Arc`), so one test process can run
//! many simulated agents. `time_scale` shrinks the real time a write sleeps.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hugepool_crds::PageSize;

use crate::kernel::{Kernel, MemInfo, NumaCounts, PoolCounts, PoolScope, freelists};
use crate::{Error, Result};

/// Cost of one pool write: `fixed + per_page * pages`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WriteCost {
    pub fixed: Duration,
    pub per_page: Duration,
}

impl WriteCost {
    pub fn of(&self, pages: u64) -> Duration {
        self.fixed + self.per_page.mul_f64(pages as f64)
    }
}

/// One page size the simulated kernel offers.
#[derive(Clone, Debug)]
pub struct SimSize {
    pub size: PageSize,
    pub grow: WriteCost,
    pub shrink: WriteCost,
    /// NUMA nodes without a pool of this size.
    pub missing_on: Vec<u32>,
}

impl SimSize {
    /// 2Mi with the costs measured on the development machine (HVO off).
    pub fn measured_2mi() -> Self {
        Self {
            size: PageSize::SIZE_2MI,
            grow: WriteCost {
                fixed: Duration::from_micros(100),
                per_page: Duration::from_micros(12),
            },
            shrink: WriteCost {
                fixed: Duration::from_micros(50),
                per_page: Duration::from_micros(7),
            },
            missing_on: Vec::new(),
        }
    }

    /// 1Gi as measured: alloc 8 pages 173 ms, free 8 pages 19 ms.
    pub fn measured_1gi() -> Self {
        Self {
            size: PageSize::SIZE_1GI,
            grow: WriteCost {
                fixed: Duration::from_micros(500),
                per_page: Duration::from_millis(21),
            },
            shrink: WriteCost {
                fixed: Duration::from_micros(200),
                per_page: Duration::from_micros(2400),
            },
            missing_on: Vec::new(),
        }
    }
}

/// One simulated NUMA node.
#[derive(Clone, Debug)]
pub struct SimNode {
    pub memory_bytes: u64,
    /// Share of the node's memory, as it starts, that can become huge
    /// pages (1.0 = none lost to fragmentation); the rest stays scattered
    /// free memory until a compaction.
    pub contiguous_fraction: f64,
    /// The share of free memory a compaction of this node leaves usable.
    pub contiguous_after_compaction: f64,
}

impl SimNode {
    pub fn unfragmented(memory_bytes: u64) -> Self {
        Self {
            memory_bytes,
            contiguous_fraction: 1.0,
            contiguous_after_compaction: 1.0,
        }
    }
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub nodes: Vec<SimNode>,
    pub sizes: Vec<SimSize>,
    pub hvo: bool,
    /// With HVO, freeing costs this many times the per-page cost...
    pub hvo_multiplier: f64,
    /// ...plus this per write (a grace period, measured about 13 ms).
    pub hvo_fixed: Duration,
    /// Real time slept per simulated second of write cost (0 = no sleep).
    pub time_scale: f64,
}

impl SimConfig {
    /// One node of `memory_bytes` offering 2Mi and 1Gi with measured costs.
    pub fn single_node(memory_bytes: u64) -> Self {
        Self {
            nodes: vec![SimNode::unfragmented(memory_bytes)],
            sizes: vec![SimSize::measured_2mi(), SimSize::measured_1gi()],
            hvo: false,
            hvo_multiplier: 1.9,
            hvo_fixed: Duration::from_millis(13),
            time_scale: 1.0,
        }
    }

    /// Two nodes of `memory_per_node` each; 1Gi only on node 0.
    pub fn two_nodes(memory_per_node: u64) -> Self {
        let mut config = Self::single_node(memory_per_node);
        config.nodes.push(SimNode::unfragmented(memory_per_node));
        for size in &mut config.sizes {
            if size.size == PageSize::SIZE_1GI {
                size.missing_on.push(1);
            }
        }
        config
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct NodePool {
    total: u64,
    free: u64,
    surplus: u64,
}

impl NodePool {
    fn persistent(&self) -> u64 {
        self.total - self.surplus
    }
}

#[derive(Debug)]
struct SizeState {
    spec: SimSize,
    reserved: u64,
    /// Per NUMA node; `None` where the size is missing.
    nodes: Vec<Option<NodePool>>,
}

#[derive(Debug)]
struct State {
    config: SimConfig,
    sizes: Vec<SizeState>,
    other_used: Vec<u64>,
    /// Free bytes per node no huge page can come from (scattered) until a
    /// compaction gathers them.
    fragmented: Vec<u64>,
    failing_writes: u32,
    hang_next_write: Option<Duration>,
    writes: u64,
    compactions: Vec<PoolScope>,
    pageblock_reads: u64,
}

/// A shareable in-memory kernel; see the module docs.
#[derive(Clone, Debug)]
pub struct SimulatedKernel {
    state: Arc<Mutex<State>>,
    /// Held for a whole write, as the kernel serialises pool resizes.
    resize_lock: Arc<Mutex<()>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SimulatedKernel {
    pub fn new(config: SimConfig) -> Self {
        let node_count = config.nodes.len();
        let sizes = config
            .sizes
            .iter()
            .map(|spec| SizeState {
                spec: spec.clone(),
                reserved: 0,
                nodes: (0..node_count as u32)
                    .map(|id| (!spec.missing_on.contains(&id)).then(NodePool::default))
                    .collect(),
            })
            .collect();
        let fragmented = config
            .nodes
            .iter()
            .map(|n| (n.memory_bytes as f64 * (1.0 - n.contiguous_fraction).clamp(0.0, 1.0)) as u64)
            .collect();
        Self {
            state: Arc::new(Mutex::new(State {
                config,
                sizes,
                other_used: vec![0; node_count],
                fragmented,
                failing_writes: 0,
                hang_next_write: None,
                writes: 0,
                compactions: Vec::new(),
                pageblock_reads: 0,
            })),
            resize_lock: Arc::new(Mutex::new(())),
        }
    }

    pub fn set_hvo(&self, on: bool) {
        lock(&self.state).config.hvo = on;
    }

    pub fn set_time_scale(&self, scale: f64) {
        lock(&self.state).config.time_scale = scale;
    }

    /// Memory used by everything but huge pages on a node (a memory hog).
    pub fn set_other_memory(&self, node: u32, bytes: u64) {
        if let Some(slot) = lock(&self.state).other_used.get_mut(node as usize) {
            *slot = bytes;
        }
    }

    /// Fails the next `writes` pool writes with EIO, changing nothing.
    pub fn fail_next_writes(&self, writes: u32) {
        lock(&self.state).failing_writes = writes;
    }

    /// Makes the next pool write take `extra` longer (real time).
    pub fn hang_next_write(&self, extra: Duration) {
        lock(&self.state).hang_next_write = Some(extra);
    }

    /// Pool writes attempted so far.
    pub fn writes(&self) -> u64 {
        lock(&self.state).writes
    }

    /// Compactions requested so far, in order.
    pub fn compactions(&self) -> Vec<PoolScope> {
        lock(&self.state).compactions.clone()
    }

    /// Reads of the free lists with their pageblock counts (the costly
    /// `/proc/pagetypeinfo` of a real kernel) so far.
    pub fn pageblock_reads(&self) -> u64 {
        lock(&self.state).pageblock_reads
    }

    /// Free lists as this model sees them, one Normal zone per node: the
    /// contiguous share of free memory in 4 MiB blocks, the rest in 4 KiB
    /// pages; the share a compaction would reach in Movable pageblocks, the
    /// rest of the node Unmovable. [`freelists::estimate`] on them gives
    /// what one write of this model gets now and after a compaction.
    fn lists(&self) -> freelists::FreeLists {
        const BLOCK: u64 = 2 << 20;
        const TOP: u64 = 4 << 20;
        let state = lock(&self.state);
        let mut zones = Vec::new();
        let mut blocks = Vec::new();
        for (n, node) in state.config.nodes.iter().enumerate() {
            let free = state.node_free_bytes(n);
            let contiguous = state.contiguous_bytes(n) / TOP;
            let mut free_blocks = vec![0; 11];
            free_blocks[10] = contiguous;
            free_blocks[0] = (free - contiguous * TOP) / freelists::BASE_PAGE_BYTES;
            zones.push(freelists::ZoneFree {
                node: n as u32,
                zone: "Normal".into(),
                free_blocks,
            });
            let all = node.memory_bytes / BLOCK;
            let movable =
                ((free as f64 * node.contiguous_after_compaction) as u64 / BLOCK).min(all);
            blocks.push(freelists::ZoneBlocks {
                node: n as u32,
                zone: "Normal".into(),
                by_type: vec![
                    ("Unmovable".into(), all - movable),
                    ("Movable".into(), movable),
                ],
            });
        }
        let nodes = state.config.nodes.len() as u32;
        freelists::FreeLists {
            file_bytes: (0..nodes).map(|n| (n, 0)).collect(),
            mem_available: (0..state.config.nodes.len())
                .map(|n| state.node_free_bytes(n))
                .sum(),
            zones,
            pagetypeinfo: Some(freelists::PageTypeInfo {
                pageblock_order: 9,
                pages_per_block: BLOCK / freelists::BASE_PAGE_BYTES,
                free: Vec::new(),
                blocks,
            }),
        }
    }

    /// Sets a pool instantly (no cost, no faults): a starting state.
    pub fn preset(&self, size: PageSize, scope: PoolScope, pages: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        state.apply_write(index, scope, pages)?;
        Ok(())
    }

    /// Faults in up to `pages` free pages on `node`, as a process mapping
    /// them would; returns how many it got.
    pub fn hold_pages(&self, size: PageSize, node: u32, pages: u64) -> Result<u64> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        let size_state = &mut state.sizes[index];
        let reserved = size_state.reserved;
        let free_total: u64 = size_state.nodes.iter().flatten().map(|p| p.free).sum();
        let pool = node_pool(size_state, size, node)?;
        let unreserved = free_total.saturating_sub(reserved);
        let held = pages.min(pool.free).min(unreserved);
        pool.free -= held;
        Ok(held)
    }

    /// Releases pages held on `node`: surplus pages go back to the system,
    /// the rest become free, exactly as the kernel does.
    pub fn release_pages(&self, size: PageSize, node: u32, pages: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        let pool = node_pool(&mut state.sizes[index], size, node)?;
        let held = pool.total - pool.free;
        for _ in 0..pages.min(held) {
            if pool.surplus > 0 {
                pool.surplus -= 1;
                pool.total -= 1;
            } else {
                pool.free += 1;
            }
        }
        Ok(())
    }

    /// Drops reservations (the mapping went away before faulting them in);
    /// reserved surplus pages go back to the system, as the kernel's
    /// `return_unused_surplus_pages` does.
    pub fn unreserve_pages(&self, size: PageSize, pages: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        let size_state = &mut state.sizes[index];
        let dropped = pages.min(size_state.reserved);
        size_state.reserved -= dropped;
        for _ in 0..dropped {
            let Some(pool) = size_state
                .nodes
                .iter_mut()
                .flatten()
                .find(|p| p.surplus > 0 && p.free > 0)
            else {
                break;
            };
            pool.surplus -= 1;
            pool.free -= 1;
            pool.total -= 1;
        }
        Ok(())
    }

    /// Reserves free pages (an mmap not yet faulted in).
    pub fn reserve_pages(&self, size: PageSize, pages: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        let size_state = &mut state.sizes[index];
        let free: u64 = size_state.nodes.iter().flatten().map(|p| p.free).sum();
        size_state.reserved = (size_state.reserved + pages).min(free);
        Ok(())
    }
}

fn node_pool(state: &mut SizeState, size: PageSize, node: u32) -> Result<&mut NodePool> {
    state
        .nodes
        .get_mut(node as usize)
        .and_then(Option::as_mut)
        .ok_or(Error::NoNumaPool { node, size })
}

/// What one write changed, for its cost.
struct WriteEffect {
    grew: bool,
    pages: u64,
}

impl State {
    fn size_index(&self, size: PageSize) -> Result<usize> {
        self.sizes
            .iter()
            .position(|s| s.spec.size == size)
            .ok_or_else(|| Error::SizeNotOffered {
                size,
                offered: self
                    .sizes
                    .iter()
                    .map(|s| s.spec.size.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Free bytes of a node that huge pages can come from now.
    fn contiguous_bytes(&self, node: usize) -> u64 {
        self.node_free_bytes(node)
            .saturating_sub(self.fragmented[node])
    }

    fn node_free_bytes(&self, node: usize) -> u64 {
        let huge: u64 = self
            .sizes
            .iter()
            .filter_map(|s| s.nodes[node].map(|p| p.total * s.spec.size.bytes()))
            .sum();
        self.config.nodes[node]
            .memory_bytes
            .saturating_sub(self.other_used[node])
            .saturating_sub(huge)
    }

    /// The kernel's `set_max_huge_pages`: promote surplus, then allocate; or
    /// free free pages down to in-use + reserved, then turn the rest of the
    /// requested cut into surplus.
    fn apply_write(&mut self, index: usize, scope: PoolScope, count: u64) -> Result<WriteEffect> {
        let size = self.sizes[index].spec.size;
        let allowed: Vec<usize> = match scope {
            PoolScope::Global => (0..self.config.nodes.len())
                .filter(|&n| self.sizes[index].nodes[n].is_some())
                .collect(),
            PoolScope::Node(node) => {
                node_pool(&mut self.sizes[index], size, node)?;
                vec![node as usize]
            }
        };
        let pools = |state: &State| -> Vec<NodePool> {
            state.sizes[index].nodes.iter().flatten().copied().collect()
        };
        let all = pools(self);
        let persistent: u64 = all.iter().map(NodePool::persistent).sum();
        let target = match scope {
            PoolScope::Global => count,
            PoolScope::Node(node) => {
                let own = self.sizes[index].nodes[node as usize].map_or(0, |p| p.persistent());
                (count + persistent).saturating_sub(own)
            }
        };
        let mut persistent = persistent;
        if target > persistent {
            for &n in &allowed {
                if let Some(pool) = self.sizes[index].nodes[n].as_mut() {
                    let promote = pool.surplus.min(target - persistent);
                    pool.surplus -= promote;
                    persistent += promote;
                }
            }
            // What fragmentation lets this one write find on each node.
            let mut allowance: Vec<u64> = (0..self.config.nodes.len())
                .map(|n| self.contiguous_bytes(n) / size.bytes())
                .collect();
            let mut allocated = 0;
            'alloc: while persistent < target {
                let mut progressed = false;
                for &n in &allowed {
                    if persistent >= target {
                        break 'alloc;
                    }
                    if allowance[n] == 0 {
                        continue;
                    }
                    allowance[n] -= 1;
                    if let Some(pool) = self.sizes[index].nodes[n].as_mut() {
                        pool.total += 1;
                        pool.free += 1;
                        persistent += 1;
                        allocated += 1;
                        progressed = true;
                    }
                }
                if !progressed {
                    break;
                }
            }
            return Ok(WriteEffect {
                grew: true,
                pages: allocated,
            });
        }
        let total: u64 = all.iter().map(|p| p.total).sum();
        let free: u64 = all.iter().map(|p| p.free).sum();
        let min_count = target.max(self.sizes[index].reserved + total - free);
        let mut freed = 0;
        while persistent > min_count {
            let nodes = &mut self.sizes[index].nodes;
            let Some(n) = allowed
                .iter()
                .copied()
                .find(|&n| nodes[n].is_some_and(|p| p.free > 0))
            else {
                break;
            };
            let Some(pool) = nodes[n].as_mut() else { break };
            pool.total -= 1;
            pool.free -= 1;
            persistent -= 1;
            freed += 1;
        }
        while target < persistent {
            let nodes = &mut self.sizes[index].nodes;
            let Some(n) = allowed
                .iter()
                .copied()
                .find(|&n| nodes[n].is_some_and(|p| p.surplus < p.total))
            else {
                break;
            };
            let Some(pool) = nodes[n].as_mut() else { break };
            pool.surplus += 1;
            persistent -= 1;
        }
        Ok(WriteEffect {
            grew: false,
            pages: freed,
        })
    }
}

impl Kernel for SimulatedKernel {
    fn page_sizes(&self) -> Result<Vec<PageSize>> {
        let mut sizes: Vec<PageSize> = lock(&self.state)
            .sizes
            .iter()
            .map(|s| s.spec.size)
            .collect();
        sizes.sort();
        Ok(sizes)
    }

    fn numa_nodes(&self) -> Result<Vec<u32>> {
        Ok((0..lock(&self.state).config.nodes.len() as u32).collect())
    }

    fn pool(&self, size: PageSize) -> Result<PoolCounts> {
        let state = lock(&self.state);
        let size_state = &state.sizes[state.size_index(size)?];
        let mut counts = PoolCounts {
            reserved: size_state.reserved,
            ..PoolCounts::default()
        };
        for pool in size_state.nodes.iter().flatten() {
            counts.total += pool.total;
            counts.free += pool.free;
            counts.surplus += pool.surplus;
        }
        Ok(counts)
    }

    fn numa_pool(&self, size: PageSize, node: u32) -> Result<NumaCounts> {
        let mut state = lock(&self.state);
        let index = state.size_index(size)?;
        let pool = *node_pool(&mut state.sizes[index], size, node)?;
        Ok(NumaCounts {
            node,
            total: pool.total,
            free: pool.free,
            surplus: pool.surplus,
        })
    }

    fn meminfo(&self) -> Result<MemInfo> {
        let state = lock(&self.state);
        Ok(MemInfo {
            total_bytes: state.config.nodes.iter().map(|n| n.memory_bytes).sum(),
            available_bytes: (0..state.config.nodes.len())
                .map(|n| state.node_free_bytes(n))
                .sum(),
        })
    }

    fn hvo(&self) -> Result<Option<bool>> {
        Ok(Some(lock(&self.state).config.hvo))
    }

    fn write_pool(&self, size: PageSize, scope: PoolScope, pages: u64) -> Result<()> {
        let _resize = lock(&self.resize_lock);
        let (cost, hang) = {
            let mut state = lock(&self.state);
            state.writes += 1;
            let index = state.size_index(size)?;
            if state.failing_writes > 0 {
                state.failing_writes -= 1;
                return Err(Error::Write {
                    path: PathBuf::from(format!(
                        "simulated/{}/{scope}/nr_hugepages",
                        size.sysfs_dir()
                    )),
                    value: pages.to_string(),
                    source: io::Error::from_raw_os_error(libc::EIO),
                });
            }
            let effect = state.apply_write(index, scope, pages)?;
            let spec = &state.sizes[index].spec;
            let config = &state.config;
            let cost = if effect.grew {
                spec.grow.of(effect.pages)
            } else if config.hvo {
                config.hvo_fixed
                    + spec.shrink.fixed
                    + spec
                        .shrink
                        .per_page
                        .mul_f64(effect.pages as f64 * config.hvo_multiplier)
            } else {
                spec.shrink.of(effect.pages)
            };
            (
                cost.mul_f64(config.time_scale),
                state.hang_next_write.take(),
            )
        };
        let sleep = cost + hang.unwrap_or_default();
        if !sleep.is_zero() {
            std::thread::sleep(sleep);
        }
        Ok(())
    }

    /// The free lists, with what a real kernel reads from pagetypeinfo.
    fn free_lists(&self) -> Result<freelists::FreeLists> {
        lock(&self.state).pageblock_reads += 1;
        Ok(self.lists())
    }

    /// As a real kernel without a recent pagetypeinfo: no pageblock counts.
    fn free_blocks(&self) -> Result<freelists::FreeLists> {
        Ok(freelists::FreeLists {
            pagetypeinfo: None,
            ..self.lists()
        })
    }

    fn compact(&self, scope: PoolScope) -> Result<()> {
        let mut state = lock(&self.state);
        state.compactions.push(scope);
        let nodes: Vec<usize> = match scope {
            PoolScope::Global => (0..state.config.nodes.len()).collect(),
            PoolScope::Node(node) => vec![node as usize],
        };
        for n in nodes {
            if let Some(after) = state
                .config
                .nodes
                .get(n)
                .map(|c| c.contiguous_after_compaction)
            {
                let free = state.node_free_bytes(n);
                state.fragmented[n] = (free as f64 * (1.0 - after).clamp(0.0, 1.0)) as u64;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MI2: PageSize = PageSize::SIZE_2MI;

    fn instant(config: SimConfig) -> SimulatedKernel {
        SimulatedKernel::new(SimConfig {
            time_scale: 0.0,
            ..config
        })
    }

    #[test]
    fn shrink_below_in_use_turns_the_rest_into_surplus_like_the_kernel() {
        // docs/kernel.md: 100 pages, 60 in use, write 10 -> nr 60, free 0, surplus 50.
        let kernel = instant(SimConfig::single_node(8 << 30));
        kernel.preset(MI2, PoolScope::Global, 100).unwrap();
        assert_eq!(kernel.hold_pages(MI2, 0, 60).unwrap(), 60);
        kernel.write_pool(MI2, PoolScope::Global, 10).unwrap();
        let pool = kernel.pool(MI2).unwrap();
        assert_eq!((pool.total, pool.free, pool.surplus), (60, 0, 50));
        assert_eq!(pool.persistent(), 10);
        kernel.release_pages(MI2, 0, 60).unwrap();
        let pool = kernel.pool(MI2).unwrap();
        assert_eq!((pool.total, pool.free, pool.surplus), (10, 10, 0));
    }

    #[test]
    fn shrink_never_frees_reserved_pages() {
        let kernel = instant(SimConfig::single_node(8 << 30));
        kernel.preset(MI2, PoolScope::Global, 100).unwrap();
        kernel.reserve_pages(MI2, 30).unwrap();
        kernel.write_pool(MI2, PoolScope::Global, 0).unwrap();
        let pool = kernel.pool(MI2).unwrap();
        assert_eq!((pool.total, pool.free, pool.surplus), (30, 30, 30));
    }

    #[test]
    fn growth_promotes_surplus_first_then_stops_at_free_memory() {
        let kernel = instant(SimConfig::single_node(1 << 30));
        kernel.preset(MI2, PoolScope::Global, 10).unwrap();
        kernel.hold_pages(MI2, 0, 10).unwrap();
        kernel.write_pool(MI2, PoolScope::Global, 0).unwrap();
        assert_eq!(kernel.pool(MI2).unwrap().surplus, 10);
        kernel.write_pool(MI2, PoolScope::Global, 5000).unwrap();
        let pool = kernel.pool(MI2).unwrap();
        assert_eq!((pool.total, pool.surplus), (512, 0));
        assert_eq!(kernel.meminfo().unwrap().available_bytes, 0);
    }

    #[test]
    fn fragmentation_limits_growth_until_compaction() {
        let mut config = SimConfig::single_node(1 << 30);
        config.nodes[0].contiguous_fraction = 0.5;
        config.nodes[0].contiguous_after_compaction = 1.0;
        let kernel = instant(config);
        kernel.write_pool(MI2, PoolScope::Global, 400).unwrap();
        let first = kernel.pool(MI2).unwrap().total;
        assert!(first < 400, "got {first}");
        kernel.compact(PoolScope::Node(0)).unwrap();
        kernel.write_pool(MI2, PoolScope::Global, 400).unwrap();
        assert_eq!(kernel.pool(MI2).unwrap().total, 400);
        assert_eq!(kernel.compactions(), vec![PoolScope::Node(0)]);
    }

    #[test]
    fn node_writes_touch_only_that_node_and_missing_sizes_are_errors() {
        let kernel = instant(SimConfig::two_nodes(4 << 30));
        kernel.write_pool(MI2, PoolScope::Global, 100).unwrap();
        assert_eq!(kernel.numa_pool(MI2, 0).unwrap().total, 50);
        kernel.write_pool(MI2, PoolScope::Node(1), 10).unwrap();
        assert_eq!(kernel.numa_pool(MI2, 0).unwrap().total, 50);
        assert_eq!(kernel.numa_pool(MI2, 1).unwrap().total, 10);
        assert_eq!(kernel.pool(MI2).unwrap().total, 60);
        assert!(matches!(
            kernel.numa_pool(PageSize::SIZE_1GI, 1),
            Err(Error::NoNumaPool { node: 1, .. })
        ));
        assert_eq!(kernel.numa_pools(PageSize::SIZE_1GI).unwrap().len(), 1);
    }

    #[test]
    fn injected_eio_changes_nothing() {
        let kernel = instant(SimConfig::single_node(4 << 30));
        kernel.fail_next_writes(1);
        let err = kernel.write_pool(MI2, PoolScope::Global, 10).unwrap_err();
        assert_eq!(err.os_error(), Some(libc::EIO));
        assert_eq!(kernel.pool(MI2).unwrap().total, 0);
        kernel.write_pool(MI2, PoolScope::Global, 10).unwrap();
        assert_eq!(kernel.pool(MI2).unwrap().total, 10);
    }

    proptest! {
        /// Whatever is written, in-use pages stay allocated, the counters stay
        /// consistent, and a global write always sets the persistent pool
        /// (the part it cannot free becomes surplus).
        #[test]
        fn writes_never_lose_pages_in_use(
            start in 0u64..300, held in 0u64..300, writes in proptest::collection::vec(0u64..400, 1..6),
        ) {
            let kernel = instant(SimConfig::two_nodes(1 << 30));
            kernel.preset(MI2, PoolScope::Global, start).unwrap();
            let held = kernel.hold_pages(MI2, 0, held).unwrap();
            for (i, pages) in writes.iter().enumerate() {
                let scope = if i % 2 == 0 { PoolScope::Global } else { PoolScope::Node(0) };
                kernel.write_pool(MI2, scope, *pages).unwrap();
                let pool = kernel.pool(MI2).unwrap();
                prop_assert!(pool.in_use() == held);
                prop_assert!(pool.free <= pool.total && pool.surplus <= pool.total);
                if scope == PoolScope::Global {
                    prop_assert_eq!(pool.persistent(), *pages);
                }
            }
        }
    }
}

//! The kernel's free lists (`/proc/buddyinfo`, `/proc/pagetypeinfo`) and
//! what a grow can get from them, per NUMA node and page size.
//!
//! Parsing is pure (`&str` in, values out; the path only names the file in
//! errors). [`estimate`] is the model written down in docs/design.md, "What
//! a grow can get".

use std::path::Path;

use hugepool_crds::PageSize;

use crate::kernel::PoolScope;
use crate::{Error, Result};

/// The base page the buddy allocator counts in (x86_64 and 4K arm64).
pub const BASE_PAGE_BYTES: u64 = 4096;

/// `/proc/pagetypeinfo` counts at most this many free blocks per list and
/// prints `>100000` beyond (kernel 5.5+, to bound the zone lock hold time).
pub const PAGETYPEINFO_CAP: u64 = 100_000;

/// The largest order the buddy allocator keeps free lists of (4 MiB);
/// larger pages (1Gi) come from `alloc_contig_pages`.
pub const MAX_BUDDY_ORDER: u32 = 10;

/// Zones a hugetlb page can come from. hugetlb allocates with a
/// highuser(-movable) mask, so any zone up to Movable; DMA (the first
/// 16 MiB on x86) is left out: the lowmem reserve keeps such allocations off it.
pub const HUGEPAGE_ZONES: [&str; 3] = ["DMA32", "Normal", "Movable"];

/// One `/proc/buddyinfo` row: free blocks per order of one zone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneFree {
    pub node: u32,
    pub zone: String,
    /// `free_blocks[order]`: free blocks of `2^order` base pages.
    pub free_blocks: Vec<u64>,
}

/// One free-list row of `/proc/pagetypeinfo`: one zone, one migrate type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypedFree {
    pub node: u32,
    pub zone: String,
    pub migrate_type: String,
    /// As in [`ZoneFree`]; a `>100000` reads as [`PAGETYPEINFO_CAP`].
    pub free_blocks: Vec<u64>,
}

/// One row of the "Number of blocks type" table: pageblocks of one zone per
/// migrate type, in the table's column order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneBlocks {
    pub node: u32,
    pub zone: String,
    pub by_type: Vec<(String, u64)>,
}

impl ZoneBlocks {
    /// Pageblocks of one migrate type; 0 when the kernel has no such column.
    pub fn of(&self, migrate_type: &str) -> u64 {
        self.by_type
            .iter()
            .find(|(name, _)| name == migrate_type)
            .map_or(0, |(_, blocks)| *blocks)
    }

    pub fn total(&self) -> u64 {
        self.by_type.iter().map(|(_, blocks)| blocks).sum()
    }
}

/// `/proc/pagetypeinfo`, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageTypeInfo {
    pub pageblock_order: u32,
    pub pages_per_block: u64,
    pub free: Vec<TypedFree>,
    pub blocks: Vec<ZoneBlocks>,
}

fn line_error(path: &Path, number: usize, line: &str, detail: impl std::fmt::Display) -> Error {
    const SHOWN: usize = 80;
    let shown: String = line.chars().take(SHOWN).collect();
    let cut = if line.chars().count() > SHOWN {
        "..."
    } else {
        ""
    };
    Error::Parse {
        path: path.to_path_buf(),
        detail: format!("line {number}: {detail} in {shown:?}{cut}"),
    }
}

/// The labels of a zone row and the count tokens after them.
struct ZoneRow<'a> {
    node: u32,
    zone: String,
    migrate_type: Option<String>,
    counts: Vec<&'a str>,
}

/// `Node 0, zone   Normal` (buddyinfo, blocks table) or, with `typed`,
/// `Node 0, zone Normal, type Movable` (free lists).
fn zone_row(line: &str, typed: bool) -> std::result::Result<ZoneRow<'_>, String> {
    let mut tokens = line.split_whitespace();
    if tokens.next() != Some("Node") {
        return Err("expected a row starting with \"Node\"".into());
    }
    let node = tokens
        .next()
        .and_then(|t| t.strip_suffix(','))
        .and_then(|t| t.parse().ok())
        .ok_or("expected a NUMA node number and a comma after \"Node\"")?;
    if tokens.next() != Some("zone") {
        return Err("expected \"zone\" after the node number".into());
    }
    let zone = tokens.next().ok_or("expected a zone name")?;
    let (zone, migrate_type) = if typed {
        let zone = zone
            .strip_suffix(',')
            .ok_or("expected a comma after the zone name")?;
        if tokens.next() != Some("type") {
            return Err("expected \"type\" after the zone name".into());
        }
        let migrate_type = tokens.next().ok_or("expected a migrate type")?;
        (zone, Some(migrate_type.to_string()))
    } else {
        (zone, None)
    };
    if zone.is_empty() || zone.contains(',') {
        return Err(format!("zone name {zone:?} is not a name"));
    }
    Ok(ZoneRow {
        node,
        zone: zone.to_string(),
        migrate_type,
        counts: tokens.collect(),
    })
}

fn counts(tokens: &[&str], capped: bool) -> std::result::Result<Vec<u64>, String> {
    tokens
        .iter()
        .map(|token| {
            if capped && *token == ">100000" {
                return Ok(PAGETYPEINFO_CAP);
            }
            if token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("expected a count, got {token:?}"));
            }
            token
                .parse()
                .map_err(|_| format!("count {token:?} out of range"))
        })
        .collect()
}

/// `/proc/buddyinfo`: one row per populated zone of each NUMA node.
pub fn buddyinfo(path: &Path, text: &str) -> Result<Vec<ZoneFree>> {
    let mut zones = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let ZoneRow {
            node,
            zone,
            counts: tokens,
            ..
        } = zone_row(line, false).map_err(|detail| line_error(path, number, line, detail))?;
        let free_blocks =
            counts(&tokens, false).map_err(|detail| line_error(path, number, line, detail))?;
        if free_blocks.is_empty() {
            return Err(line_error(path, number, line, "no free block counts"));
        }
        zones.push(ZoneFree {
            node,
            zone,
            free_blocks,
        });
    }
    if zones.is_empty() {
        return Err(Error::Parse {
            path: path.to_path_buf(),
            detail: "no zones: is this /proc/buddyinfo?".into(),
        });
    }
    Ok(zones)
}

/// `/proc/pagetypeinfo`: the pageblock size, free blocks per order per
/// migrate type, and pageblocks per migrate type per zone. A "Number of
/// mixed blocks" table (kernels with page_owner) is read and dropped.
pub fn pagetypeinfo(path: &Path, text: &str) -> Result<PageTypeInfo> {
    #[derive(PartialEq)]
    enum Section {
        Header,
        Free,
        Blocks,
        Mixed,
    }
    let mut section = Section::Header;
    let mut pageblock_order = None;
    let mut pages_per_block = None;
    let mut orders = 0;
    let mut block_types: Vec<String> = Vec::new();
    let mut free = Vec::new();
    let mut blocks = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let error = |detail: &dyn std::fmt::Display| line_error(path, number, line, detail);
        if line.trim().is_empty() {
            continue;
        }
        if let Some((key, value)) = line.split_once(':') {
            let slot = match key.trim() {
                "Page block order" => Some(&mut pageblock_order),
                "Pages per block" => Some(&mut pages_per_block),
                _ => None,
            };
            if let Some(slot) = slot {
                if section != Section::Header {
                    return Err(error(&"header line after the tables"));
                }
                let value = counts(&[value.trim()], false).map_err(|detail| error(&detail))?;
                *slot = Some(value[0]);
                continue;
            }
        }
        if let Some(rest) = line.strip_prefix("Free pages count per migrate type at order") {
            let header = counts(&rest.split_whitespace().collect::<Vec<_>>(), false)
                .map_err(|detail| error(&detail))?;
            if header.is_empty() || header.iter().enumerate().any(|(i, o)| *o != i as u64) {
                return Err(error(&"expected the orders 0, 1, 2, ... as column heads"));
            }
            orders = header.len();
            section = Section::Free;
            continue;
        }
        if let Some(rest) = line.strip_prefix("Number of blocks type") {
            block_types = rest.split_whitespace().map(str::to_string).collect();
            if block_types.is_empty() {
                return Err(error(&"no migrate types as column heads"));
            }
            section = Section::Blocks;
            continue;
        }
        if line.starts_with("Number of mixed blocks") {
            section = Section::Mixed;
            continue;
        }
        match section {
            Section::Header => {
                return Err(error(
                    &"expected \"Page block order\", \"Pages per block\" or a table head",
                ));
            }
            Section::Free => {
                let ZoneRow {
                    node,
                    zone,
                    migrate_type,
                    counts: tokens,
                } = zone_row(line, true).map_err(|detail| error(&detail))?;
                let free_blocks = counts(&tokens, true).map_err(|detail| error(&detail))?;
                if free_blocks.len() != orders {
                    return Err(error(&format!(
                        "{} counts under {orders} orders",
                        free_blocks.len()
                    )));
                }
                free.push(TypedFree {
                    node,
                    zone,
                    migrate_type: migrate_type.unwrap_or_default(),
                    free_blocks,
                });
            }
            Section::Blocks | Section::Mixed => {
                let ZoneRow {
                    node,
                    zone,
                    counts: tokens,
                    ..
                } = zone_row(line, false).map_err(|detail| error(&detail))?;
                let values = counts(&tokens, false).map_err(|detail| error(&detail))?;
                if values.len() != block_types.len() {
                    return Err(error(&format!(
                        "{} counts under {} migrate types",
                        values.len(),
                        block_types.len()
                    )));
                }
                if section == Section::Blocks {
                    blocks.push(ZoneBlocks {
                        node,
                        zone,
                        by_type: block_types.iter().cloned().zip(values).collect(),
                    });
                }
            }
        }
    }
    let whole = |detail: String| Error::Parse {
        path: path.to_path_buf(),
        detail,
    };
    let (Some(order), Some(pages_per_block)) = (pageblock_order, pages_per_block) else {
        return Err(whole(
            "\"Page block order\" or \"Pages per block\" missing: is this /proc/pagetypeinfo?"
                .into(),
        ));
    };
    let pageblock_order = u32::try_from(order)
        .ok()
        .filter(|order| *order < 32 && 1u64 << order == pages_per_block)
        .ok_or_else(|| {
            whole(format!(
                "page block order {order} does not give {pages_per_block} pages per block"
            ))
        })?;
    if blocks.is_empty() {
        return Err(whole("no \"Number of blocks type\" table".into()));
    }
    Ok(PageTypeInfo {
        pageblock_order,
        pages_per_block,
        free,
        blocks,
    })
}

/// Page cache in a meminfo file, `Active(file) + Inactive(file)`, in bytes:
/// `/proc/meminfo` or a NUMA node's (`Node 0 Active(file):  123 kB`).
pub fn file_bytes(path: &Path, text: &str) -> Result<u64> {
    let mut found = [None, None];
    for (number, line) in text.lines().enumerate() {
        let mut tokens = line
            .split_whitespace()
            .skip_while(|t| !t.ends_with("(file):"));
        let slot = match tokens.next() {
            Some("Active(file):") => 0,
            Some("Inactive(file):") => 1,
            _ => continue,
        };
        let kib: u64 = tokens
            .next()
            .and_then(|t| t.parse().ok())
            .filter(|_| tokens.next() == Some("kB"))
            .ok_or_else(|| line_error(path, number + 1, line, "expected a count of kB"))?;
        found[slot] = Some(kib.saturating_mul(1024));
    }
    match found {
        [Some(active), Some(inactive)] => Ok(active.saturating_add(inactive)),
        _ => Err(Error::Parse {
            path: path.to_path_buf(),
            detail: "no Active(file) and Inactive(file)".into(),
        }),
    }
}

/// Both files, and what reclaim and the memory guard make of them, as
/// [`crate::kernel::Kernel::free_lists`] reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeLists {
    pub zones: Vec<ZoneFree>,
    /// None when the pageblock counts were not read
    /// ([`crate::kernel::Kernel::free_blocks`]): a compaction's gain is
    /// then unknown and `after_compaction` is what needs none.
    pub pagetypeinfo: Option<PageTypeInfo>,
    /// Page cache per NUMA node (`Active(file) + Inactive(file)` of the
    /// node's meminfo), in bytes: a grow reclaims it (`__GFP_RETRY_MAYFAIL`).
    pub file_bytes: Vec<(u32, u64)>,
    /// MemAvailable: the memory guard is taken from it, as the engine does.
    pub mem_available: u64,
}

impl FreeLists {
    /// The two files alone: no page cache, nothing guarded.
    pub fn of_files(zones: Vec<ZoneFree>, pagetypeinfo: PageTypeInfo) -> Self {
        Self {
            zones,
            pagetypeinfo: Some(pagetypeinfo),
            file_bytes: Vec::new(),
            mem_available: u64::MAX,
        }
    }

    /// [`estimate`] for one NUMA node, with its page cache, no guard.
    pub fn estimate(&self, node: u32, size: PageSize) -> GrowEstimate {
        let file = self
            .file_bytes
            .iter()
            .find(|(n, _)| *n == node)
            .map_or(0, |(_, bytes)| *bytes);
        let unread = PageTypeInfo::default();
        let pagetypeinfo = self.pagetypeinfo.as_ref().unwrap_or(&unread);
        estimate(&self.zones, pagetypeinfo, node, size, file)
    }

    /// The NUMA nodes the files list, ascending.
    pub fn nodes(&self) -> Vec<u32> {
        let mut nodes: Vec<u32> = self.zones.iter().map(|z| z.node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// What a grow of `size` can get on the whole machine and on each NUMA
    /// node. The guard is one figure for the machine, as in the engine: a
    /// grow stops `guard_bytes` above MemAvailable, so no more than
    /// `(MemAvailable - guard) / size` pages come after compaction, on the
    /// machine or on any one node.
    pub fn estimates(&self, size: PageSize, guard_bytes: u64) -> SizeEstimates {
        let numa: Vec<(u32, GrowEstimate)> = self
            .nodes()
            .into_iter()
            .map(|node| (node, self.estimate(node, size)))
            .collect();
        let now: u64 = numa.iter().map(|(_, e)| e.obtainable_now).sum();
        let reachable: u64 = numa.iter().map(|(_, e)| e.after_compaction).sum();
        let guarded = self.mem_available.saturating_sub(guard_bytes) / size.bytes();
        let total = GrowEstimate {
            obtainable_now: now,
            after_compaction: reachable.min(guarded),
        };
        let numa = numa
            .into_iter()
            .map(|(node, e)| {
                let after = e.after_compaction.min(total.after_compaction);
                (
                    node,
                    GrowEstimate {
                        obtainable_now: e.obtainable_now,
                        after_compaction: after,
                    },
                )
            })
            .collect();
        SizeEstimates { total, numa }
    }

    /// What a grow of `size` in `scope` (a pool file) can get.
    pub fn for_scope(&self, size: PageSize, scope: PoolScope, guard_bytes: u64) -> GrowEstimate {
        let estimates = self.estimates(size, guard_bytes);
        match scope {
            PoolScope::Global => estimates.total,
            PoolScope::Node(node) => estimates
                .numa
                .iter()
                .find(|(id, _)| *id == node)
                .map_or_else(GrowEstimate::default, |(_, e)| *e),
        }
    }
}

/// [`FreeLists::estimates`]: one page size, machine-wide and per NUMA node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SizeEstimates {
    pub total: GrowEstimate,
    pub numa: Vec<(u32, GrowEstimate)>,
}

/// What a grow of one page size can get on one NUMA node, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GrowEstimate {
    /// Free blocks at or above the page's order, in usable zones.
    pub obtainable_now: u64,
    /// What a grow gets: compacting, reclaiming page cache and stopping at
    /// the memory guard (which may make it less than `obtainable_now`).
    pub after_compaction: u64,
}

/// A page beyond the buddy lists (1Gi): its estimate after compaction is the
/// worst layout of the unmovable blocks, a floor the kernel may beat, never
/// a ceiling a grow can be stopped at.
pub fn beyond_the_buddy_lists(size: PageSize) -> bool {
    page_order(size) > MAX_BUDDY_ORDER
}

/// `log2(page bytes / 4096)`: the buddy order of one huge page.
pub fn page_order(size: PageSize) -> u32 {
    (size.bytes() / BASE_PAGE_BYTES).max(1).ilog2()
}

/// The model (docs/design.md, "What a grow can get"), for `node` and `size`,
/// with `file_bytes` of page cache on the node a grow can reclaim; no
/// guard (see [`FreeLists::estimates`]). Zones in `free` without a row in
/// `pagetypeinfo.blocks` count for `obtainable_now` only.
pub fn estimate(
    free: &[ZoneFree],
    pagetypeinfo: &PageTypeInfo,
    node: u32,
    size: PageSize,
    file_bytes: u64,
) -> GrowEstimate {
    let order = page_order(size);
    let block_pages = pagetypeinfo.pages_per_block;
    let mut now = 0u64;
    let mut reachable = 0u64;
    let mut total = 0u64;
    // Clearable room that free memory does not fill: reclaimed page cache
    // can become huge pages there.
    let mut room = 0u64;
    for zone in free
        .iter()
        .filter(|z| z.node == node && HUGEPAGE_ZONES.contains(&z.zone.as_str()))
    {
        // A free block of order o >= order splits into 2^(o - order) pages.
        let zone_now: u64 = zone
            .free_blocks
            .iter()
            .enumerate()
            .skip(order as usize)
            .map(|(o, blocks)| blocks.saturating_mul(1u64 << (o as u32 - order).min(63)))
            .fold(0, u64::saturating_add);
        now = now.saturating_add(zone_now);
        let Some(blocks) = pagetypeinfo
            .blocks
            .iter()
            .find(|b| b.node == node && b.zone == zone.zone)
        else {
            continue;
        };
        let free_pages: u64 = zone
            .free_blocks
            .iter()
            .enumerate()
            .map(|(o, n)| n.saturating_mul(1u64 << (o as u32).min(63)))
            .fold(0, u64::saturating_add);
        // Compaction only moves pages: it cannot make more free memory than
        // there is, nor free a block holding unmovable pages. Reclaimable
        // blocks count half (slab is freed only in part).
        let clearable = blocks
            .of("Movable")
            .saturating_mul(block_pages)
            .saturating_add(blocks.of("Reclaimable").saturating_mul(block_pages) / 2);
        reachable = reachable.saturating_add(free_pages.min(clearable) >> order);
        room = room.saturating_add(clearable.saturating_sub(free_pages));
        let spans = blocks.total().saturating_mul(block_pages) >> order;
        total = total.saturating_add(if order > MAX_BUDDY_ORDER {
            // A page beyond the buddy lists is a whole aligned range the
            // kernel isolates and empties (alloc_contig_range); one block
            // holding unmovable pages spoils its range. Where they lie is
            // not published, so count the worst: each spoils its own.
            spans.saturating_sub(
                blocks.of("Unmovable") + blocks.of("Reclaimable") + blocks.of("HighAtomic"),
            )
        } else {
            spans
        });
    }
    let reclaimed = (file_bytes / BASE_PAGE_BYTES).min(room) >> order;
    GrowEstimate {
        obtainable_now: now,
        after_compaction: now.max(reachable.saturating_add(reclaimed).min(total)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BUDDYINFO_REAL: &str = include_str!("../../tests/fixtures/freelists/buddyinfo.real");
    const PAGETYPEINFO_REAL: &str =
        include_str!("../../tests/fixtures/freelists/pagetypeinfo.real");
    const BUDDYINFO_TWO_NODES: &str =
        include_str!("../../tests/fixtures/freelists/buddyinfo.two-nodes");
    const PAGETYPEINFO_TWO_NODES: &str =
        include_str!("../../tests/fixtures/freelists/pagetypeinfo.two-nodes");

    fn buddy(text: &str) -> Vec<ZoneFree> {
        buddyinfo(Path::new("/proc/buddyinfo"), text).unwrap()
    }

    fn types(text: &str) -> PageTypeInfo {
        pagetypeinfo(Path::new("/proc/pagetypeinfo"), text).unwrap()
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn reads_buddyinfo_of_this_machine() {
        let zones = buddy(BUDDYINFO_REAL);
        let names: Vec<_> = zones.iter().map(|z| (z.node, z.zone.as_str())).collect();
        assert_eq!(names, [(0, "DMA"), (0, "DMA32"), (0, "Normal")]);
        assert_eq!(zones[0].free_blocks, [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 3]);
        assert_eq!(
            zones[1].free_blocks,
            [36, 72, 66, 66, 55, 38, 26, 24, 16, 14, 736]
        );
        assert_eq!(
            zones[2].free_blocks,
            [17058, 2315, 1690, 575, 291, 91, 578, 446, 187, 30, 1530]
        );
    }

    #[test]
    fn reads_pagetypeinfo_of_this_machine() {
        let info = types(PAGETYPEINFO_REAL);
        assert_eq!(info.pageblock_order, 9);
        assert_eq!(info.pages_per_block, 512);
        // 3 zones x 5 migrate types (this kernel has no CMA).
        assert_eq!(info.free.len(), 15);
        let normal_movable = info
            .free
            .iter()
            .find(|f| f.zone == "Normal" && f.migrate_type == "Movable")
            .unwrap();
        assert_eq!(normal_movable.node, 0);
        assert_eq!(normal_movable.free_blocks.len(), 11);
        assert_eq!(normal_movable.free_blocks[10], 1530);
        let heads: Vec<_> = info.blocks[0]
            .by_type
            .iter()
            .map(|(t, _)| t.as_str())
            .collect();
        assert_eq!(
            heads,
            [
                "Unmovable",
                "Movable",
                "Reclaimable",
                "HighAtomic",
                "Isolate"
            ]
        );
        let normal = &info.blocks[2];
        assert_eq!((normal.node, normal.zone.as_str()), (0, "Normal"));
        assert_eq!(normal.of("Unmovable"), 300);
        assert_eq!(normal.of("Movable"), 10075);
        assert_eq!(normal.of("Reclaimable"), 377);
        assert_eq!(normal.of("CMA"), 0);
        assert_eq!(normal.total(), 10752);
        assert_eq!(info.blocks[1].of("Movable"), 1507);
        assert_eq!(info.blocks[0].total(), 8);
    }

    #[test]
    fn reads_the_two_node_fixture() {
        let zones = buddy(BUDDYINFO_TWO_NODES);
        assert_eq!(zones.len(), 5);
        assert_eq!((zones[4].node, zones[4].zone.as_str()), (1, "Movable"));
        assert_eq!(
            zones[3].free_blocks,
            [1000, 500, 200, 100, 0, 0, 0, 0, 0, 0, 0]
        );
        let info = types(PAGETYPEINFO_TWO_NODES);
        assert_eq!(info.free.len(), 30);
        assert_eq!(info.blocks.len(), 5);
        assert_eq!(info.blocks[3].of("Unmovable"), 10);
        assert_eq!(info.blocks[3].of("CMA"), 0);
        assert_eq!(info.blocks[4].of("Movable"), 8);
        // The free lists per migrate type add up to buddyinfo, zone by zone.
        for zone in &zones {
            let mut sum = vec![0; 11];
            for typed in info
                .free
                .iter()
                .filter(|f| f.node == zone.node && f.zone == zone.zone)
            {
                for (order, n) in typed.free_blocks.iter().enumerate() {
                    sum[order] += n;
                }
            }
            assert_eq!(sum, zone.free_blocks, "{}/{}", zone.node, zone.zone);
        }
    }

    #[test]
    fn capped_free_list_reads_as_the_cap() {
        let text = "Page block order: 9\nPages per block:  512\n\n\
            Free pages count per migrate type at order       0      1 \n\
            Node    0, zone   Normal, type      Movable >100000  12345 \n\n\
            Number of blocks type     Unmovable      Movable \n\
            Node 0, zone   Normal            1            2 \n";
        let info = types(text);
        assert_eq!(info.free[0].free_blocks, [PAGETYPEINFO_CAP, 12345]);
    }

    #[test]
    fn mixed_blocks_table_is_read_and_dropped() {
        let text = format!(
            "{PAGETYPEINFO_TWO_NODES}\nNumber of mixed blocks     Unmovable      Movable  Reclaimable   HighAtomic          CMA      Isolate \n\
             Node 0, zone   Normal            0            3            0            0            0            0 \n"
        );
        assert_eq!(types(&text).blocks, types(PAGETYPEINFO_TWO_NODES).blocks);
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let path = Path::new("/proc/buddyinfo");
        let text = "Node 0, zone      DMA      0      1 \nNode 0, zone   Normal      0     x1 \n";
        let err = buddyinfo(path, text).unwrap_err().to_string();
        assert!(err.contains("/proc/buddyinfo"), "{err}");
        assert!(err.contains("line 2"), "{err}");
        assert!(err.contains("\"x1\""), "{err}");

        let short = PAGETYPEINFO_TWO_NODES.replacen("      0 \n", "\n", 1);
        let err = pagetypeinfo(Path::new("p"), &short)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 5: 10 counts under 11 orders"), "{err}");

        let err = buddyinfo(path, "").unwrap_err().to_string();
        assert!(err.contains("is this /proc/buddyinfo?"), "{err}");
        let err = pagetypeinfo(path, BUDDYINFO_REAL).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");

        let wrong_block =
            PAGETYPEINFO_TWO_NODES.replace("Pages per block:  512", "Pages per block:  500");
        let err = pagetypeinfo(Path::new("p"), &wrong_block)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("page block order 9 does not give 500"),
            "{err}"
        );
    }

    #[test]
    fn reads_the_page_cache_of_a_meminfo_file() {
        let node = "Node 0 MemFree:        15981580 kB\nNode 0 Active(file):    2779596 kB\nNode 0 Inactive(file):  4850736 kB\n";
        assert_eq!(
            file_bytes(Path::new("node0/meminfo"), node).unwrap(),
            (2_779_596 + 4_850_736) * 1024
        );
        let global = "Active(file):     10 kB\nInactive(file):   5 kB\n";
        assert_eq!(file_bytes(Path::new("meminfo"), global).unwrap(), 15 * 1024);
        let err = file_bytes(Path::new("m"), "Active(file): x kB\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        let err = file_bytes(Path::new("m"), "Active(file): 1 kB\n").unwrap_err();
        assert!(err.to_string().contains("Inactive(file)"), "{err}");
    }

    #[test]
    fn page_orders() {
        assert_eq!(page_order(PageSize::SIZE_2MI), 9);
        assert_eq!(page_order(PageSize::SIZE_1GI), 18);
    }

    // Hand-computed from the fixture (base pages of 4 KiB):
    // 2Mi now = DMA32 (14 + 736 * 2) + Normal (30 + 1530 * 2) = 1486 + 3090 = 4576.
    // Free base pages: DMA32 = 36 + 72*2 + 66*4 + 66*8 + 55*16 + 38*32 + 26*64
    // + 24*128 + 16*256 + 14*512 + 736*1024 = 772_732 -> 1509 x 2Mi (below
    // its clearable (1507 + 12/2) * 512); Normal = 1_764_648 -> 3446 x 2Mi,
    // below (10075 + 377/2) * 512. Total pageblocks 1528 + 10752 = 12280.
    #[test]
    fn estimate_on_this_machine() {
        let zones = buddy(BUDDYINFO_REAL);
        let info = types(PAGETYPEINFO_REAL);
        assert_eq!(
            estimate(&zones, &info, 0, PageSize::SIZE_2MI, 0),
            GrowEstimate {
                obtainable_now: 4576,
                after_compaction: 1509 + 3446,
            }
        );
        // Page cache a grow reclaims fills the clearable room free memory
        // leaves: DMA32 774_656 - 772_732 = 1_924 pages, Normal 5_254_912 -
        // 1_764_648 = 3_490_264. 1 GiB of it is 512 more pages; 100 GiB
        // fills the room: 3_492_188 >> 9 = 6820 more.
        assert_eq!(
            estimate(&zones, &info, 0, PageSize::SIZE_2MI, 1 << 30).after_compaction,
            4955 + 512
        );
        assert_eq!(
            estimate(&zones, &info, 0, PageSize::SIZE_2MI, 100 << 30).after_compaction,
            4955 + 6820
        );
        // No free list holds 1 GiB: nothing now. Free memory would make
        // 6 + 2, but Normal's 21 ranges of 1 GiB face 677 Unmovable and
        // Reclaimable blocks, DMA32's 2 face 20: none is sure to be clean
        // (the kernel gave 0 of 16 on this machine, 2026-12-05).
        assert_eq!(
            estimate(&zones, &info, 0, PageSize::SIZE_1GI, 0),
            GrowEstimate::default()
        );
        // A node the files do not list can give nothing.
        assert_eq!(
            estimate(&zones, &info, 1, PageSize::SIZE_2MI, 0),
            GrowEstimate::default()
        );
    }

    // Node 0: DMA is skipped; DMA32 now 2 + 1*2 = 4, free 2048 -> 4;
    // Normal now 3 + 5*2 = 13, free 2000 + 1000 + 3*512 + 5*1024 = 9656 ->
    // 18 (clearable (20 + 4/2) * 512 = 11264). Total 16 + 28 blocks.
    // Node 1: Normal now 0, free 3600 but only (2 + 4/2) * 512 = 2048
    // clearable -> 4; Movable now 1 + 2*2 = 5, free 2560 -> 5.
    #[test]
    fn estimate_on_two_nodes() {
        let zones = buddy(BUDDYINFO_TWO_NODES);
        let info = types(PAGETYPEINFO_TWO_NODES);
        let at = |node, size, guard| estimate(&zones, &info, node, size, guard);
        assert_eq!(
            at(0, PageSize::SIZE_2MI, 0),
            GrowEstimate {
                obtainable_now: 17,
                after_compaction: 22,
            }
        );
        assert_eq!(
            at(1, PageSize::SIZE_2MI, 0),
            GrowEstimate {
                obtainable_now: 5,
                after_compaction: 9,
            }
        );
        // Node 1's Normal zone has no room left (free 3600 > clearable
        // 2048); its Movable zone 4096 - 2560 = 1536 pages: 3 more 2Mi.
        assert_eq!(at(1, PageSize::SIZE_2MI, 100 * MIB).after_compaction, 12);
        assert_eq!(at(1, PageSize::SIZE_1GI, 0), GrowEstimate::default());
    }

    // The two-node pair: node 0 (17, 22), node 1 (5, 9) with no guard.
    // The guard comes off MemAvailable once, for the machine, as in the
    // engine: with 64 MiB available and a 3 MiB guard, 30 pages at most.
    #[test]
    fn estimates_take_the_guard_once_from_mem_available() {
        let mut lists =
            FreeLists::of_files(buddy(BUDDYINFO_TWO_NODES), types(PAGETYPEINFO_TWO_NODES));
        lists.mem_available = 64 * MIB;
        assert_eq!(lists.nodes(), [0, 1]);
        let e = |now, after_compaction| GrowEstimate {
            obtainable_now: now,
            after_compaction,
        };
        let sized = lists.estimates(PageSize::SIZE_2MI, 3 * MIB);
        assert_eq!(sized.total, e(22, 30));
        assert_eq!(sized.numa, [(0, e(17, 22)), (1, e(5, 9))]);
        // 40 MiB: 12 pages for the machine, and so for each node, though
        // node 0 holds 17 free now.
        let sized = lists.estimates(PageSize::SIZE_2MI, 40 * MIB);
        assert_eq!(sized.total, e(22, 12));
        assert_eq!(sized.numa, [(0, e(17, 12)), (1, e(5, 9))]);
        // A guard above MemAvailable: nothing.
        let sized = lists.estimates(PageSize::SIZE_2MI, 1 << 30);
        assert_eq!(sized.total, e(22, 0));
        assert_eq!(sized.numa, [(0, e(17, 0)), (1, e(5, 0))]);
        // Page cache on a node counts there.
        lists.file_bytes = vec![(1, 100 * MIB)];
        assert_eq!(
            lists.for_scope(PageSize::SIZE_2MI, PoolScope::Node(1), 3 * MIB),
            e(5, 12)
        );
        assert_eq!(
            lists.for_scope(PageSize::SIZE_2MI, PoolScope::Global, 3 * MIB),
            e(22, 30)
        );
        assert_eq!(
            lists.for_scope(PageSize::SIZE_2MI, PoolScope::Node(7), 0),
            GrowEstimate::default()
        );
    }

    #[test]
    fn a_gigantic_page_needs_a_range_no_unmovable_block_spoils() {
        // 4 GiB of Normal, 2 GiB free in 4 MiB blocks: 2 pages of memory,
        // 4 ranges of 1 GiB; each unmovable block may spoil one range.
        let zones = vec![ZoneFree {
            node: 0,
            zone: "Normal".into(),
            free_blocks: vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 512],
        }];
        let blocks = |unmovable, reclaimable| PageTypeInfo {
            pageblock_order: 9,
            pages_per_block: 512,
            free: vec![],
            blocks: vec![ZoneBlocks {
                node: 0,
                zone: "Normal".into(),
                by_type: vec![
                    ("Unmovable".into(), unmovable),
                    ("Movable".into(), 2048 - unmovable - reclaimable),
                    ("Reclaimable".into(), reclaimable),
                ],
            }],
        };
        let after = |unmovable, reclaimable, file| {
            estimate(
                &zones,
                &blocks(unmovable, reclaimable),
                0,
                PageSize::SIZE_1GI,
                file,
            )
            .after_compaction
        };
        assert_eq!(after(0, 0, 0), 2);
        assert_eq!(after(1, 1, 0), 2);
        // Reclaimed page cache fills the memory, the clean ranges cap it.
        assert_eq!(after(1, 1, 8 << 30), 2);
        assert_eq!(after(0, 1, 8 << 30), 3);
        assert_eq!(after(3, 1, 8 << 30), 0);
        assert_eq!(after(2, 2, 0), 0);
    }

    #[test]
    fn estimate_is_capped_by_the_zone() {
        // Free lists bigger than the zone (a torn read): capped at 2 blocks,
        // but never below what the free lists show now.
        let zones = vec![ZoneFree {
            node: 0,
            zone: "Normal".into(),
            free_blocks: vec![4096, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        }];
        let info = PageTypeInfo {
            pageblock_order: 9,
            pages_per_block: 512,
            free: vec![],
            blocks: vec![ZoneBlocks {
                node: 0,
                zone: "Normal".into(),
                by_type: vec![("Movable".into(), 2)],
            }],
        };
        assert_eq!(
            estimate(&zones, &info, 0, PageSize::SIZE_2MI, 0),
            GrowEstimate {
                obtainable_now: 2,
                after_compaction: 2,
            }
        );
    }

    #[test]
    fn sysfs_kernel_reads_both_files_under_its_proc_root() {
        use crate::kernel::Kernel;
        let proc_root = tempfile::tempdir().unwrap();
        std::fs::write(proc_root.path().join("buddyinfo"), BUDDYINFO_TWO_NODES).unwrap();
        let kernel = crate::kernel::SysfsKernel::new("/nonexistent-sys", proc_root.path());
        let err = kernel.free_lists().unwrap_err().to_string();
        assert!(err.contains("pagetypeinfo"), "{err}");
        std::fs::write(
            proc_root.path().join("pagetypeinfo"),
            PAGETYPEINFO_TWO_NODES,
        )
        .unwrap();
        // No NUMA sysfs: the page cache of /proc/meminfo is node 0's.
        std::fs::write(
            proc_root.path().join("meminfo"),
            "MemTotal: 4096 kB\nMemAvailable: 2048 kB\nActive(file):  300 kB\nInactive(file): 200 kB\n",
        )
        .unwrap();
        let lists = kernel.free_lists().unwrap();
        assert_eq!(lists.zones, buddy(BUDDYINFO_TWO_NODES));
        assert_eq!(lists.pagetypeinfo, Some(types(PAGETYPEINFO_TWO_NODES)));
        assert_eq!(lists.file_bytes, [(0, 500 * 1024)]);
        assert_eq!(lists.mem_available, 2048 * 1024);
        assert_eq!(
            lists.estimate(1, PageSize::SIZE_2MI),
            GrowEstimate {
                obtainable_now: 5,
                after_compaction: 9,
            }
        );
    }

    #[test]
    fn sysfs_kernel_reads_pagetypeinfo_only_when_its_counts_are_old() {
        use crate::kernel::Kernel;
        let proc_root = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| std::fs::write(proc_root.path().join(name), text);
        file("buddyinfo", BUDDYINFO_TWO_NODES).unwrap();
        file(
            "meminfo",
            "MemTotal: 4096 kB\nMemAvailable: 2048 kB\nActive(file): 0 kB\nInactive(file): 0 kB\n",
        )
        .unwrap();
        let kernel = crate::kernel::SysfsKernel::new("/nonexistent-sys", proc_root.path());
        // The free blocks alone never need pagetypeinfo.
        let blocks = kernel.free_blocks().unwrap();
        assert_eq!(blocks.pagetypeinfo, None);
        assert_eq!(blocks.zones, buddy(BUDDYINFO_TWO_NODES));
        // Unread pageblock counts: what a compaction adds is unknown, so
        // after compaction is what needs none.
        assert_eq!(
            blocks.estimate(1, PageSize::SIZE_2MI),
            GrowEstimate {
                obtainable_now: 5,
                after_compaction: 5,
            }
        );
        file("pagetypeinfo", PAGETYPEINFO_TWO_NODES).unwrap();
        let fresh = kernel.free_lists().unwrap();
        // Gone now: the counts read a moment ago serve both calls (and the
        // clones that share them); buddyinfo is read every time.
        std::fs::remove_file(proc_root.path().join("pagetypeinfo")).unwrap();
        file("buddyinfo", BUDDYINFO_REAL).unwrap();
        let clone = kernel.clone();
        assert_eq!(clone.free_lists().unwrap().pagetypeinfo, fresh.pagetypeinfo);
        let blocks = kernel.free_blocks().unwrap();
        assert_eq!(blocks.pagetypeinfo, fresh.pagetypeinfo);
        assert_eq!(blocks.zones, buddy(BUDDYINFO_REAL));
        // Counts of age zero are always old: the file is read again.
        let always = crate::kernel::SysfsKernel::new("/nonexistent-sys", proc_root.path())
            .with_pageblock_counts_max_age(std::time::Duration::ZERO);
        file("pagetypeinfo", PAGETYPEINFO_TWO_NODES).unwrap();
        always.free_lists().unwrap();
        std::fs::remove_file(proc_root.path().join("pagetypeinfo")).unwrap();
        let err = always.free_lists().unwrap_err().to_string();
        assert!(err.contains("pagetypeinfo"), "{err}");
        assert_eq!(always.free_blocks().unwrap().pagetypeinfo, None);
    }

    const ZONES: [&str; 5] = ["DMA", "DMA32", "Normal", "Movable", "HighMem"];
    const MIGRATE_TYPES: [&str; 6] = [
        "Unmovable",
        "Movable",
        "Reclaimable",
        "HighAtomic",
        "CMA",
        "Isolate",
    ];

    fn render_buddyinfo(zones: &[ZoneFree]) -> String {
        let mut text = String::new();
        for zone in zones {
            text += &format!("Node {}, zone {:>8} ", zone.node, zone.zone);
            for n in &zone.free_blocks {
                text += &format!("{n:6} ");
            }
            text += "\n";
        }
        text
    }

    // The kernel's seq_printf formats (mm/vmstat.c).
    fn render_pagetypeinfo(info: &PageTypeInfo, orders: usize) -> String {
        let mut text = format!(
            "Page block order: {}\nPages per block:  {}\n\n",
            info.pageblock_order, info.pages_per_block
        );
        text += &format!("{:<43} ", "Free pages count per migrate type at order");
        for order in 0..orders {
            text += &format!("{order:6} ");
        }
        text += "\n";
        for row in &info.free {
            text += &format!(
                "Node {:4}, zone {:>8}, type {:>12} ",
                row.node, row.zone, row.migrate_type
            );
            for n in &row.free_blocks {
                let cap = if *n >= PAGETYPEINFO_CAP { ">" } else { "" };
                text += &format!("{cap}{n:6} ");
            }
            text += "\n";
        }
        text += &format!("\n{:<23}", "Number of blocks type ");
        for (name, _) in &info.blocks[0].by_type {
            text += &format!("{name:>12} ");
        }
        text += "\n";
        for row in &info.blocks {
            text += &format!("Node {}, zone {:>8} ", row.node, row.zone);
            for (_, n) in &row.by_type {
                text += &format!("{n:12} ");
            }
            text += "\n";
        }
        text
    }

    fn zone_free(orders: usize) -> impl Strategy<Value = ZoneFree> {
        (
            0u32..64,
            proptest::sample::select(&ZONES[..]),
            proptest::collection::vec(0u64..2_000_000, orders),
        )
            .prop_map(|(node, zone, free_blocks)| ZoneFree {
                node,
                zone: zone.into(),
                free_blocks,
            })
    }

    fn page_type_info() -> impl Strategy<Value = PageTypeInfo> {
        (
            9u32..=13,
            1usize..=12,
            proptest::sample::subsequence(&MIGRATE_TYPES[..], 1..=6),
        )
            .prop_flat_map(|(pageblock_order, orders, heads)| {
                let width = heads.len();
                let heads: Vec<String> = heads.into_iter().map(str::to_string).collect();
                let free_row = (
                    0u32..64,
                    proptest::sample::select(&ZONES[..]),
                    proptest::sample::select(heads.clone()),
                    proptest::collection::vec(0u64..=PAGETYPEINFO_CAP, orders),
                )
                    .prop_map(|(node, zone, migrate_type, free_blocks)| TypedFree {
                        node,
                        zone: zone.into(),
                        migrate_type,
                        free_blocks,
                    });
                let block_row = (
                    0u32..64,
                    proptest::sample::select(&ZONES[..]),
                    proptest::collection::vec(0u64..10_000_000, width),
                )
                    .prop_map(move |(node, zone, counts)| ZoneBlocks {
                        node,
                        zone: zone.into(),
                        by_type: heads.iter().cloned().zip(counts).collect(),
                    });
                (
                    proptest::collection::vec(free_row, 0..12),
                    proptest::collection::vec(block_row, 1..6),
                )
                    .prop_map(move |(free, blocks)| PageTypeInfo {
                        pageblock_order,
                        pages_per_block: 1 << pageblock_order,
                        free,
                        blocks,
                    })
            })
    }

    /// A one-node zone set with pageblocks that agree with the free pages.
    fn node_state() -> impl Strategy<Value = (Vec<ZoneFree>, PageTypeInfo)> {
        proptest::collection::vec(
            (
                proptest::sample::select(&ZONES[..]),
                proptest::collection::vec(0u64..5_000, 11),
                proptest::collection::vec(0u64..3_000, 3),
            ),
            1..5,
        )
        .prop_map(|zones| {
            let free = zones
                .iter()
                .map(|(zone, free_blocks, _)| ZoneFree {
                    node: 0,
                    zone: (*zone).into(),
                    free_blocks: free_blocks.clone(),
                })
                .collect();
            let blocks = zones
                .iter()
                .map(|(zone, _, counts)| ZoneBlocks {
                    node: 0,
                    zone: (*zone).into(),
                    by_type: ["Unmovable", "Movable", "Reclaimable"]
                        .iter()
                        .map(|t| t.to_string())
                        .zip(counts.iter().copied())
                        .collect(),
                })
                .collect();
            (
                free,
                PageTypeInfo {
                    pageblock_order: 9,
                    pages_per_block: 512,
                    free: vec![],
                    blocks,
                },
            )
        })
    }

    fn any_size() -> impl Strategy<Value = PageSize> {
        proptest::sample::select(vec![
            PageSize::SIZE_2MI,
            PageSize::SIZE_1GI,
            PageSize::from_bytes(64 << 10).unwrap(),
            PageSize::from_bytes(32 << 20).unwrap(),
        ])
    }

    proptest! {
        #[test]
        fn buddyinfo_round_trips(
            zones in (1usize..=12).prop_flat_map(|orders| proptest::collection::vec(zone_free(orders), 1..8)),
        ) {
            prop_assert_eq!(buddy(&render_buddyinfo(&zones)), zones);
        }

        #[test]
        fn pagetypeinfo_round_trips(info in page_type_info()) {
            let orders = info.free.first().map_or(11, |row| row.free_blocks.len());
            let text = render_pagetypeinfo(&info, orders);
            prop_assert_eq!(types(&text), info);
        }

        #[test]
        fn garbage_never_panics(text in "(?s).{0,400}") {
            let _ = buddyinfo(Path::new("b"), &text);
            let _ = pagetypeinfo(Path::new("p"), &text);
        }

        #[test]
        fn damaged_files_fail_on_the_damaged_line(
            line in 0usize..40,
            junk in "[A-Za-z,:>#-]{1,6}",
        ) {
            for (name, text) in [("b", BUDDYINFO_TWO_NODES), ("p", PAGETYPEINFO_TWO_NODES)] {
                let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
                let index = line % lines.len();
                // A word on the heads line is one more migrate type: the
                // rows under it fail instead.
                if lines[index].trim().is_empty() || lines[index].starts_with("Number of blocks type") {
                    continue;
                }
                lines[index] = format!("{} {junk}", lines[index]);
                let damaged = lines.join("\n");
                let parsed = if name == "b" {
                    buddyinfo(Path::new(name), &damaged).map(|_| ())
                } else {
                    pagetypeinfo(Path::new(name), &damaged).map(|_| ())
                };
                let err = parsed.unwrap_err().to_string();
                let expected = format!("line {}:", index + 1);
                prop_assert!(err.contains(&expected), "{}", err);
            }
        }

        #[test]
        fn now_never_exceeds_after_compaction(
            (zones, info) in node_state(),
            size in any_size(),
            file in 0u64..1 << 34,
        ) {
            let got = estimate(&zones, &info, 0, size, file);
            prop_assert!(got.obtainable_now <= got.after_compaction, "{:?}", got);
        }

        #[test]
        fn more_free_blocks_never_lower_an_estimate(
            (zones, info) in node_state(),
            size in any_size(),
            zone in any::<proptest::sample::Index>(),
            order in 0usize..11,
            added in 1u64..5_000,
        ) {
            let before = estimate(&zones, &info, 0, size, 0);
            let mut more = zones.clone();
            let index = zone.index(more.len());
            more[index].free_blocks[order] += added;
            let after = estimate(&more, &info, 0, size, 0);
            prop_assert!(after.obtainable_now >= before.obtainable_now, "{:?} -> {:?}", before, after);
            prop_assert!(after.after_compaction >= before.after_compaction, "{:?} -> {:?}", before, after);
        }
    }
}

package main

import (
	"context"
	"fmt"
	"log"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/containerd/nri/pkg/api"
)

// envPrefix starts the variable a claim's CDI device puts in a container
// (the agent's dra::ENV_PREFIX).
const envPrefix = "HUGEPOOL_PAGES_"

// claimed is what one allocation result of a claim holds.
type claimed struct {
	pageBytes uint64
	numa      int
	pages     uint64
}

// claimedPages reads a container's environment: the claims' pages by
// variable name (one name per claim result, the same in every container
// that uses the claim).
func claimedPages(env []string) (map[string]claimed, error) {
	found := map[string]claimed{}
	for _, kv := range env {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, envPrefix) {
			continue
		}
		var c claimed
		var seen int
		for _, field := range strings.Split(value, ",") {
			key, v, _ := strings.Cut(field, "=")
			var err error
			switch key {
			case "size":
				c.pageBytes, err = parseSize(v)
			case "numa":
				c.numa, err = strconv.Atoi(v)
			case "pages":
				c.pages, err = strconv.ParseUint(v, 10, 64)
			default:
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %s: %v", name, field, err)
			}
			seen++
		}
		if seen != 3 {
			return nil, fmt.Errorf("%s=%s: want size=,numa=,pages=", name, value)
		}
		found[name] = c
	}
	return found, nil
}

// parseSize reads a page size as the agent writes it (2Mi, 1Gi, 64Ki).
func parseSize(s string) (uint64, error) {
	for suffix, shift := range map[string]uint{"Ki": 10, "Mi": 20, "Gi": 30} {
		if n, ok := strings.CutSuffix(s, suffix); ok {
			v, err := strconv.ParseUint(n, 10, 64)
			if err != nil || v == 0 {
				return 0, fmt.Errorf("bad page size %q", s)
			}
			return v << shift, nil
		}
	}
	return 0, fmt.Errorf("bad page size %q", s)
}

// hugetlbLabel names a page size as the hugetlb controller and the OCI
// spec do: 2MB, 1GB, 64KB.
func hugetlbLabel(pageBytes uint64) string {
	switch {
	case pageBytes >= 1<<30:
		return fmt.Sprintf("%dGB", pageBytes>>30)
	case pageBytes >= 1<<20:
		return fmt.Sprintf("%dMB", pageBytes>>20)
	default:
		return fmt.Sprintf("%dKB", pageBytes>>10)
	}
}

// bytesBySize sums claims by hugetlb label.
func bytesBySize(claims map[string]claimed) map[string]uint64 {
	sum := map[string]uint64{}
	for _, c := range claims {
		sum[hugetlbLabel(c.pageBytes)] += c.pages * c.pageBytes
	}
	return sum
}

// podState is what the plugin added to one pod's cgroup: the limits the
// kubelet gave it, by label, and the claims seen in its containers.
type podState struct {
	kubelet map[string]uint64
	claims  map[string]claimed
}

type plugin struct {
	cgroups cgroups
	mu      sync.Mutex
	pods    map[string]*podState
	// ready: synchronised with the runtime, and not disconnected since.
	ready atomic.Bool
}

func newPlugin(c cgroups) *plugin {
	return &plugin{cgroups: c, pods: map[string]*podState{}}
}

// CreateContainer gives a container that uses claims their bytes on top of
// the kubelet's limits, binds its memory to their NUMA nodes, and raises
// the pod's limits before the container starts.
func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	claims, err := claimedPages(ctr.GetEnv())
	if err != nil || len(claims) == 0 {
		return nil, nil, err
	}
	adjust := &api.ContainerAdjustment{}
	kubelet := map[string]uint64{}
	for _, l := range ctr.GetLinux().GetResources().GetHugepageLimits() {
		kubelet[l.GetPageSize()] = l.GetLimit()
	}
	added := bytesBySize(claims)
	for _, label := range sortedKeys(added) {
		adjust.AddLinuxHugepageLimit(label, addSat(kubelet[label], added[label]))
	}
	nodes := map[int]bool{}
	for _, c := range claims {
		nodes[c.numa] = true
	}
	mems := memsList(nodes)
	if set := ctr.GetLinux().GetResources().GetCpu().GetMems(); set != "" {
		// Pinned already (the kubelet's Memory Manager): the claims' pages
		// must lie inside, or the container could not fault them.
		if !memsCover(set, nodes) {
			return nil, nil, fmt.Errorf("container %s: its memory is pinned to NUMA nodes %s but its claimed pages are on %s (docs/user-guide.md: Memory Manager pods and claims)", ctr.GetName(), set, mems)
		}
	} else {
		adjust.SetLinuxCPUSetMems(mems)
	}
	if err := p.raisePod(pod, claims); err != nil {
		return nil, nil, err
	}
	log.Printf("pod %s/%s container %s: hugetlb %v added, memory on NUMA %s", pod.GetNamespace(), pod.GetName(), ctr.GetName(), added, mems)
	return adjust, nil, nil
}

// raisePod sets the pod cgroup's limits to the kubelet's plus every claim
// its containers use (a claim two containers share counts once).
func (p *plugin) raisePod(pod *api.PodSandbox, claims map[string]claimed) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	parent := pod.GetLinux().GetCgroupParent()
	state, ok := p.pods[pod.GetUid()]
	if !ok {
		kubelet := map[string]uint64{}
		for label := range bytesBySize(claims) {
			limit, err := p.cgroups.podLimit(parent, label)
			if err != nil {
				return err
			}
			kubelet[label] = limit
		}
		state = &podState{kubelet: kubelet, claims: map[string]claimed{}}
		p.pods[pod.GetUid()] = state
	}
	for name, c := range claims {
		state.claims[name] = c
	}
	for label, bytes := range bytesBySize(state.claims) {
		if _, ok := state.kubelet[label]; !ok {
			limit, err := p.cgroups.podLimit(parent, label)
			if err != nil {
				return err
			}
			state.kubelet[label] = limit
		}
		if err := p.cgroups.setPodLimit(parent, label, addSat(state.kubelet[label], bytes)); err != nil {
			return err
		}
	}
	return nil
}

// Synchronize learns, after a restart, what it had added to the pods still
// running: the kubelet's share is what the pod has less its claims.
func (p *plugin) Synchronize(_ context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	byPod := map[string]map[string]claimed{}
	for _, ctr := range ctrs {
		claims, err := claimedPages(ctr.GetEnv())
		if err != nil || len(claims) == 0 {
			continue
		}
		if byPod[ctr.GetPodSandboxId()] == nil {
			byPod[ctr.GetPodSandboxId()] = map[string]claimed{}
		}
		for name, c := range claims {
			byPod[ctr.GetPodSandboxId()][name] = c
		}
	}
	p.pods = map[string]*podState{}
	for _, pod := range pods {
		claims := byPod[pod.GetId()]
		if len(claims) == 0 {
			continue
		}
		parent := pod.GetLinux().GetCgroupParent()
		state := &podState{kubelet: map[string]uint64{}, claims: claims}
		for label, bytes := range bytesBySize(claims) {
			limit, err := p.cgroups.podLimit(parent, label)
			if err != nil {
				log.Printf("pod %s/%s: %v", pod.GetNamespace(), pod.GetName(), err)
				continue
			}
			state.kubelet[label] = limit - min(limit, bytes)
		}
		p.pods[pod.GetUid()] = state
	}
	log.Printf("synchronised: %d pods use claimed pages", len(p.pods))
	p.ready.Store(true)
	return nil, nil
}

// RemovePodSandbox forgets the pod.
func (p *plugin) RemovePodSandbox(_ context.Context, pod *api.PodSandbox) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.pods, pod.GetUid())
	return nil
}

// addSat adds, unlimited staying unlimited.
func addSat(a, b uint64) uint64 {
	if a > unlimited-b {
		return unlimited
	}
	return a + b
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// memsList writes NUMA nodes as cpuset.mems does: "0", "0,1".
func memsList(nodes map[int]bool) string {
	ids := make([]int, 0, len(nodes))
	for n := range nodes {
		ids = append(ids, n)
	}
	sort.Ints(ids)
	parts := make([]string, len(ids))
	for i, n := range ids {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ",")
}

// memsCover tells whether a cpuset.mems list ("0-1,3") holds every node.
func memsCover(list string, nodes map[int]bool) bool {
	in := map[int]bool{}
	for _, part := range strings.Split(list, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return false
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil {
				return false
			}
		}
		for n := a; n <= b; n++ {
			in[n] = true
		}
	}
	for n := range nodes {
		if !in[n] {
			return false
		}
	}
	return true
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"slices"
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

// preparedClaim is one claim as the agent's kubelet plugin recorded it when
// it prepared the claim (prepared-claims.json, the agent's dra::Prepared):
// the pods it is reserved for and the pages of each allocation result.
type preparedClaim struct {
	Namespace string   `json:"namespace"`
	Name      string   `json:"name"`
	Pods      []string `json:"pods"`
	Pages     []struct {
		Size  string `json:"size"`
		Numa  int    `json:"numa"`
		Pages uint64 `json:"pages"`
	} `json:"pages"`
}

// readPrepared reads the agent's prepared claims by uid; no file is none
// prepared.
func readPrepared(path string) (map[string]preparedClaim, error) {
	bytes, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]preparedClaim{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cannot read the agent's prepared claims: %v", err)
	}
	prepared := map[string]preparedClaim{}
	if err := json.Unmarshal(bytes, &prepared); err != nil {
		return nil, fmt.Errorf("cannot read the agent's prepared claims %s: %v", path, err)
	}
	return prepared, nil
}

// envName is the variable the CDI device of result index of claim uid puts
// in a container (the agent's dra::cdi_spec).
func envName(uid string, index int) string {
	return fmt.Sprintf("%s%s_%d", envPrefix, strings.ToUpper(strings.ReplaceAll(uid, "-", "_")), index)
}

// envValue is that variable's value: size=2Mi,numa=0,pages=16.
func envValue(size string, numa int, pages uint64) string {
	return fmt.Sprintf("size=%s,numa=%d,pages=%d", size, numa, pages)
}

// granted is what a container of pod podUID may have on top of the
// kubelet's limits: the pages of the claims the agent prepared for that pod
// whose variables its environment holds (one name per claim result, the
// same in every container that uses the claim), read from what the agent
// prepared, never from the environment. A pod writes its own environment,
// so a variable that no claim prepared for this pod set, or whose value is
// not the one the agent wrote, refuses the container with the reason, which
// the kubelet shows in the pod's events.
func granted(env []string, podUID string, prepared map[string]preparedClaim) (map[string]claimed, error) {
	found := map[string]claimed{}
	var results map[string]result
	for _, kv := range env {
		name, value, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, envPrefix) {
			continue
		}
		if results == nil {
			results = resultsFor(podUID, prepared)
		}
		r, ok := results[name]
		switch {
		case !ok:
			return nil, fmt.Errorf("%s names hugepool pages that no claim prepared on this node holds: "+
				"pages come only from a ResourceClaim of %s, never from a pod's environment", name, driver)
		case r.err != nil:
			return nil, fmt.Errorf("%s: %v", name, r.err)
		case value != r.value:
			return nil, fmt.Errorf("%s=%s is not what the agent prepared (%s): a pod may not set it", name, value, r.value)
		}
		found[name] = r.claimed
	}
	return found, nil
}

// result is one prepared claim result as a container of one pod sees it:
// its pages and its variable's value, or why the pod may not have them.
type result struct {
	claimed
	value string
	err   error
}

// resultsFor maps each prepared claim result's variable to what it gives a
// container of pod podUID.
func resultsFor(podUID string, prepared map[string]preparedClaim) map[string]result {
	results := map[string]result{}
	for uid, claim := range prepared {
		for index, p := range claim.Pages {
			r := result{value: envValue(p.Size, p.Numa, p.Pages)}
			bytes, err := parseSize(p.Size)
			switch {
			case !slices.Contains(claim.Pods, podUID):
				r.err = fmt.Errorf("ResourceClaim %s/%s was prepared for pod %s, not for this pod (%s): "+
					"a claim's pages go to one pod (docs/user-guide.md, \"One claim, one pod\")",
					claim.Namespace, claim.Name, strings.Join(claim.Pods, ", "), podUID)
			case err != nil:
				r.err = err
			default:
				r.claimed = claimed{pageBytes: bytes, numa: p.Numa, pages: p.Pages}
			}
			results[envName(uid, index)] = r
		}
	}
	return results
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
	// prepared: the agent's prepared claims file.
	prepared string
	mu       sync.Mutex
	pods     map[string]*podState
	// ready: synchronised with the runtime, and not disconnected since.
	ready atomic.Bool
}

func newPlugin(c cgroups, prepared string) *plugin {
	return &plugin{cgroups: c, prepared: prepared, pods: map[string]*podState{}}
}

// claimsOf is what a container of pod may have from claims (granted): none
// when its environment names no pages.
func (p *plugin) claimsOf(podUID string, env []string) (map[string]claimed, error) {
	if !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, envPrefix) }) {
		return nil, nil
	}
	prepared, err := readPrepared(p.prepared)
	if err != nil {
		return nil, err
	}
	return granted(env, podUID, prepared)
}

// CreateContainer gives a container that uses claims their bytes on top of
// the kubelet's limits, binds its memory to their NUMA nodes, and raises
// the pod's limits before the container starts.
func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	claims, err := p.claimsOf(pod.GetUid(), ctr.GetEnv())
	if err != nil {
		log.Printf("pod %s/%s container %s refused: %v", pod.GetNamespace(), pod.GetName(), ctr.GetName(), err)
		return nil, nil, fmt.Errorf("hugepool: container %s: %v", ctr.GetName(), err)
	}
	if len(claims) == 0 {
		return nil, nil, nil
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
	uids := map[string]string{}
	for _, pod := range pods {
		uids[pod.GetId()] = pod.GetUid()
	}
	byPod := map[string]map[string]claimed{}
	for _, ctr := range ctrs {
		claims, err := p.claimsOf(uids[ctr.GetPodSandboxId()], ctr.GetEnv())
		if err != nil {
			log.Printf("container %s: %v", ctr.GetName(), err)
			continue
		}
		if len(claims) == 0 {
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

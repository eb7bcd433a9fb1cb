package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/nri/pkg/api"
)

const mib = 1 << 20

// tree lays out a pod cgroup whose 2MB limit the kubelet set to kubelet
// bytes: v1 (the hugetlb hierarchy, with reservation files) or v2 (one
// hierarchy, hugetlb.2MB.max), under the cgroupfs or the systemd driver's
// parent. It returns the root, the pod's cgroup parent and its directory.
func tree(t *testing.T, unified bool, parent string, kubelet string) (string, string, string) {
	t.Helper()
	root := t.TempDir()
	c := cgroups{root: root}
	if unified {
		if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("cpuset memory hugetlb\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := c.dir(parent)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	limit, reserved := c.files("2MB")
	for _, f := range []string{limit, reserved} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(kubelet+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root, parent, dir
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func pod(uid, parent string) *api.PodSandbox {
	return &api.PodSandbox{Id: "sandbox-" + uid, Uid: uid, Name: "p", Namespace: "apps", Linux: &api.LinuxPodSandbox{CgroupParent: parent}}
}

func container(name, podID string, env []string, kubelet2MB uint64, mems string) *api.Container {
	return &api.Container{
		Name: name, PodSandboxId: podID, Env: env,
		Linux: &api.LinuxContainer{Resources: &api.LinuxResources{
			HugepageLimits: []*api.HugepageLimit{{PageSize: "2MB", Limit: kubelet2MB}, {PageSize: "1GB", Limit: 0}},
			Cpu:            &api.LinuxCPU{Mems: mems},
		}},
	}
}

// claim is a claim as the agent records it when it prepares it, with one
// allocation result.
func claim(name string, pods []string, size string, numa int, pages uint64) preparedClaim {
	c := preparedClaim{Namespace: "apps", Name: name, Pods: pods}
	c.Pages = append(c.Pages, struct {
		Size  string `json:"size"`
		Numa  int    `json:"numa"`
		Pages uint64 `json:"pages"`
	}{size, numa, pages})
	return c
}

// preparedFile writes the agent's prepared claims by uid and returns the
// file's path.
func preparedFile(t *testing.T, claims map[string]preparedClaim) string {
	t.Helper()
	bytes, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "prepared-claims.json")
	if err := os.WriteFile(path, bytes, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func limits(a *api.ContainerAdjustment) map[string]uint64 {
	out := map[string]uint64{}
	for _, l := range a.GetLinux().GetResources().GetHugepageLimits() {
		out[l.GetPageSize()] = l.GetLimit()
	}
	return out
}

func TestAContainerGetsItsClaimsOnTopOfTheKubeletsLimitsAndThePodIsRaised(t *testing.T) {
	for _, layout := range []struct {
		name    string
		unified bool
		parent  string
		dir     string
	}{
		{"v1 cgroupfs", false, "/kubepods/burstable/pod1", "hugetlb/kubepods/burstable/pod1"},
		{"v2 cgroupfs", true, "/kubepods/burstable/pod1", "kubepods/burstable/pod1"},
		{"v2 systemd", true, "kubepods-burstable-pod1.slice", "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"},
	} {
		t.Run(layout.name, func(t *testing.T) {
			// The kubelet gave the pod 4 MiB (a classic request of 2 pages).
			root, parent, dir := tree(t, layout.unified, layout.parent, "4194304")
			if want := filepath.Join(root, layout.dir); dir != want {
				t.Fatalf("pod cgroup %s, want %s", dir, want)
			}
			prepared := preparedFile(t, map[string]preparedClaim{
				"c1": claim("one", []string{"u1"}, "2Mi", 1, 16),
				"c2": claim("two", []string{"u1"}, "2Mi", 0, 8),
			})
			p := newPlugin(cgroups{root: root}, prepared)
			sandbox := pod("u1", parent)
			env := []string{"PATH=/bin", "HUGEPOOL_PAGES_C1_0=size=2Mi,numa=1,pages=16"}
			adjust, updates, err := p.CreateContainer(context.Background(), sandbox, container("app", sandbox.Id, env, 4*mib, ""))
			if err != nil || updates != nil {
				t.Fatalf("CreateContainer: %v %v", updates, err)
			}
			if got := limits(adjust); len(got) != 1 || got["2MB"] != 36*mib {
				t.Fatalf("container limits %v, want 2MB: 4 MiB from the kubelet + 32 MiB claimed", got)
			}
			if got := adjust.GetLinux().GetResources().GetCpu().GetMems(); got != "1" {
				t.Fatalf("memory nodes %q, want the claim's NUMA node 1", got)
			}
			limit, reserved := cgroups{root: root}.files("2MB")
			for _, f := range []string{limit, reserved} {
				if got := read(t, filepath.Join(dir, f)); got != "37748736" {
					t.Fatalf("pod %s = %s, want 36 MiB", f, got)
				}
			}
			// A second container sharing the claim and adding another:
			// the shared claim counts once in the pod.
			env2 := append(env, "HUGEPOOL_PAGES_C2_0=size=2Mi,numa=0,pages=8")
			adjust, _, err = p.CreateContainer(context.Background(), sandbox, container("side", sandbox.Id, env2, 0, ""))
			if err != nil {
				t.Fatal(err)
			}
			if got := limits(adjust)["2MB"]; got != 48*mib {
				t.Fatalf("second container 2MB limit %d, want 48 MiB", got)
			}
			if got := adjust.GetLinux().GetResources().GetCpu().GetMems(); got != "0,1" {
				t.Fatalf("memory nodes %q, want 0,1", got)
			}
			if got := read(t, filepath.Join(dir, limit)); got != "54525952" {
				t.Fatalf("pod limit %s, want 4 + 32 + 16 MiB", got)
			}

			// Restarted: synchronised from the running containers, the
			// kubelet's share is known again and nothing is added twice.
			again := newPlugin(cgroups{root: root}, prepared)
			if again.ready.Load() {
				t.Fatal("ready before synchronising")
			}
			if _, err := again.Synchronize(context.Background(), []*api.PodSandbox{sandbox},
				[]*api.Container{container("app", sandbox.Id, env, 4*mib, ""), container("side", sandbox.Id, env2, 0, "")}); err != nil {
				t.Fatal(err)
			}
			if !again.ready.Load() {
				t.Fatal("not ready once synchronised")
			}
			if _, _, err := again.CreateContainer(context.Background(), sandbox, container("app", sandbox.Id, env, 4*mib, "")); err != nil {
				t.Fatal(err)
			}
			if got := read(t, filepath.Join(dir, limit)); got != "54525952" {
				t.Fatalf("pod limit after a restart %s, want 52 MiB still", got)
			}
		})
	}
}

func TestContainersWithoutClaimsAreLeftAlone(t *testing.T) {
	root, parent, dir := tree(t, false, "/kubepods/pod2", "0")
	p := newPlugin(cgroups{root: root}, filepath.Join(t.TempDir(), "none.json"))
	adjust, updates, err := p.CreateContainer(context.Background(), pod("u2", parent), container("c", "s", []string{"HOME=/"}, 0, ""))
	if adjust != nil || updates != nil || err != nil {
		t.Fatalf("want nothing, got %v %v %v", adjust, updates, err)
	}
	if got := read(t, filepath.Join(dir, "hugetlb.2MB.limit_in_bytes")); got != "0" {
		t.Fatalf("pod limit %s, want the kubelet's 0", got)
	}
}

func TestAMemoryManagerPinOutsideTheClaimsNodeIsRefusedWithTheReason(t *testing.T) {
	root, parent, _ := tree(t, false, "/kubepods/pod3", "0")
	p := newPlugin(cgroups{root: root}, preparedFile(t, map[string]preparedClaim{"c3": claim("three", []string{"u3"}, "2Mi", 1, 1)}))
	env := []string{"HUGEPOOL_PAGES_C3_0=size=2Mi,numa=1,pages=1"}
	_, _, err := p.CreateContainer(context.Background(), pod("u3", parent), container("c", "s", env, 0, "0"))
	if err == nil || !strings.Contains(err.Error(), "pinned to NUMA nodes 0 but its claimed pages are on 1") {
		t.Fatalf("want the pin refused, got %v", err)
	}
	// Pinned where the pages are: kept as the kubelet set it.
	adjust, _, err := p.CreateContainer(context.Background(), pod("u3", parent), container("c", "s", env, 0, "0-1"))
	if err != nil {
		t.Fatal(err)
	}
	if got := adjust.GetLinux().GetResources().GetCpu().GetMems(); got != "" {
		t.Fatalf("memory nodes adjusted to %q, want the kubelet's pin kept", got)
	}
}

func TestAnUnlimitedPodStaysUnlimited(t *testing.T) {
	root, parent, dir := tree(t, true, "/kubepods/pod4", "max")
	p := newPlugin(cgroups{root: root}, preparedFile(t, map[string]preparedClaim{"c4": claim("four", []string{"u4"}, "2Mi", 0, 2)}))
	env := []string{"HUGEPOOL_PAGES_C4_0=size=2Mi,numa=0,pages=2"}
	if _, _, err := p.CreateContainer(context.Background(), pod("u4", parent), container("c", "s", env, 0, "")); err != nil {
		t.Fatal(err)
	}
	if got := read(t, filepath.Join(dir, "hugetlb.2MB.max")); got != "max" {
		t.Fatalf("pod limit %s, want max", got)
	}
}

func TestPagesComeOnlyFromAClaimPreparedForTheContainersPod(t *testing.T) {
	prepared := map[string]preparedClaim{
		"1a2b-3c": claim("mine", []string{"u5"}, "1Gi", 2, 3),
		"9f":      claim("theirs", []string{"u6"}, "2Mi", 0, 10),
	}
	got, err := granted([]string{"HUGEPOOL_PAGES_1A2B_3C_0=size=1Gi,numa=2,pages=3", "OTHER=1"}, "u5", prepared)
	if err != nil || len(got) != 1 || got["HUGEPOOL_PAGES_1A2B_3C_0"] != (claimed{pageBytes: 1 << 30, numa: 2, pages: 3}) {
		t.Fatalf("the pod's own claim: %v %v", got, err)
	}
	for _, refused := range []struct {
		what, pod, env, because string
	}{
		{"a variable of no claim", "u7", "HUGEPOOL_PAGES_FORGED_0=size=2Mi,numa=0,pages=10",
			"no claim prepared on this node holds"},
		{"another pod's claim copied", "u5", "HUGEPOOL_PAGES_9F_0=size=2Mi,numa=0,pages=10",
			"ResourceClaim apps/theirs was prepared for pod u6, not for this pod (u5): a claim's pages go to one pod"},
		{"its own claim, more pages", "u5", "HUGEPOOL_PAGES_1A2B_3C_0=size=1Gi,numa=2,pages=300",
			"is not what the agent prepared (size=1Gi,numa=2,pages=3)"},
		{"its own claim, another result", "u5", "HUGEPOOL_PAGES_1A2B_3C_1=size=1Gi,numa=2,pages=3",
			"no claim prepared on this node holds"},
	} {
		if got, err := granted([]string{refused.env}, refused.pod, prepared); err == nil || !strings.Contains(err.Error(), refused.because) {
			t.Fatalf("%s: got %v %v, want refused because %q", refused.what, got, err, refused.because)
		}
	}

	// Through the plugin: the container is refused with the reason, and
	// the pod's cgroup is not touched.
	root, parent, dir := tree(t, false, "/kubepods/pod7", "0")
	p := newPlugin(cgroups{root: root}, preparedFile(t, prepared))
	forged := []string{"HUGEPOOL_PAGES_9F_0=size=2Mi,numa=0,pages=10"}
	adjust, _, err := p.CreateContainer(context.Background(), pod("u7", parent), container("c", "s", forged, 0, ""))
	if adjust != nil || err == nil || !strings.Contains(err.Error(), "container c: HUGEPOOL_PAGES_9F_0: ResourceClaim apps/theirs was prepared for pod u6") {
		t.Fatalf("want the container refused, got %v %v", adjust, err)
	}
	if got := read(t, filepath.Join(dir, "hugetlb.2MB.limit_in_bytes")); got != "0" {
		t.Fatalf("pod limit %s, want the kubelet's 0", got)
	}
	// No prepared claims at all: refused too.
	p = newPlugin(cgroups{root: root}, filepath.Join(t.TempDir(), "none.json"))
	if _, _, err := p.CreateContainer(context.Background(), pod("u7", parent), container("c", "s", forged, 0, "")); err == nil {
		t.Fatal("a variable with no prepared claims at all was accepted")
	}
	// A restarted plugin adds nothing for a container whose variable it
	// would have refused.
	if _, err := p.Synchronize(context.Background(), []*api.PodSandbox{pod("u7", parent)}, []*api.Container{container("c", "sandbox-u7", forged, 0, "")}); err != nil {
		t.Fatal(err)
	}
	if len(p.pods) != 0 {
		t.Fatalf("synchronised %d pods from forged variables", len(p.pods))
	}
}

func TestPageSizesAndSlicesAreNamedAsTheKernelDoes(t *testing.T) {
	for bytes, label := range map[uint64]string{2 * mib: "2MB", 1 << 30: "1GB", 64 << 10: "64KB", 32 * mib: "32MB"} {
		if got := hugetlbLabel(bytes); got != label {
			t.Fatalf("label of %d: %s, want %s", bytes, got, label)
		}
	}
	if expandSlice("kubepods-besteffort-pod9_8.slice") != "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod9_8.slice" {
		t.Fatal(expandSlice("kubepods-besteffort-pod9_8.slice"))
	}
}

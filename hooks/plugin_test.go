package main

import (
	"context"
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
			p := newPlugin(cgroups{root: root})
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
			again := newPlugin(cgroups{root: root})
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
	p := newPlugin(cgroups{root: root})
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
	p := newPlugin(cgroups{root: root})
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
	p := newPlugin(cgroups{root: root})
	env := []string{"HUGEPOOL_PAGES_C4_0=size=2Mi,numa=0,pages=2"}
	if _, _, err := p.CreateContainer(context.Background(), pod("u4", parent), container("c", "s", env, 0, "")); err != nil {
		t.Fatal(err)
	}
	if got := read(t, filepath.Join(dir, "hugetlb.2MB.max")); got != "max" {
		t.Fatalf("pod limit %s, want max", got)
	}
}

func TestTheEnvironmentIsReadStrictly(t *testing.T) {
	got, err := claimedPages([]string{"HUGEPOOL_PAGES_A_0=size=1Gi,numa=2,pages=3", "OTHER=1"})
	if err != nil || len(got) != 1 || got["HUGEPOOL_PAGES_A_0"] != (claimed{pageBytes: 1 << 30, numa: 2, pages: 3}) {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{
		"HUGEPOOL_PAGES_A_0=size=3Xi,numa=0,pages=1",
		"HUGEPOOL_PAGES_A_0=size=2Mi,numa=0",
		"HUGEPOOL_PAGES_A_0=size=2Mi,numa=x,pages=1",
	} {
		if _, err := claimedPages([]string{bad}); err == nil {
			t.Fatalf("%s accepted", bad)
		}
	}
	for bytes, label := range map[uint64]string{2 * mib: "2MB", 1 << 30: "1GB", 64 << 10: "64KB", 32 * mib: "32MB"} {
		if got := hugetlbLabel(bytes); got != label {
			t.Fatalf("label of %d: %s, want %s", bytes, got, label)
		}
	}
	if expandSlice("kubepods-besteffort-pod9_8.slice") != "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod9_8.slice" {
		t.Fatal(expandSlice("kubepods-besteffort-pod9_8.slice"))
	}
}

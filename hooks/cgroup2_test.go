package main

// The plugin's v2 writes against this machine's kernel: a cgroup2 hierarchy
// mounted in a private mount namespace, with the hugetlb controller (free
// for v2 while no v1 hierarchy holds it), enforcing hugetlb.2MB.max and
// .rsvd.max on a process in a pod cgroup.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// faultEnv, when set, makes the test binary a process that maps and faults
// that many 2 MiB pages (after a line on stdin, once it is in its cgroup)
// and exits 0, or exits 3 saying why it could not.
const faultEnv = "HUGEPOOL_FAULT_PAGES"

// namespacedEnv marks the test binary run again in a private mount
// namespace.
const namespacedEnv = "HUGEPOOL_IN_MOUNT_NS"

func TestMain(m *testing.M) {
	if pages := os.Getenv(faultEnv); pages != "" {
		os.Exit(fault(pages))
	}
	os.Exit(m.Run())
}

func fault(pages string) int {
	n, err := strconv.Atoi(pages)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	// Wait until the parent has put this process in its cgroup.
	var line [1]byte
	if _, err := os.Stdin.Read(line[:]); err != nil {
		fmt.Println("stdin:", err)
		return 2
	}
	length := n * 2 * mib
	memory, err := syscall.Mmap(-1, 0, length, syscall.PROT_READ|syscall.PROT_WRITE,
		syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|syscall.MAP_HUGETLB)
	if err != nil {
		fmt.Println("mmap:", err)
		return 3
	}
	for offset := 0; offset < length; offset += 2 * mib {
		memory[offset] = 1
	}
	fmt.Println("faulted", n)
	return 0
}

// needsRoot skips the test where it cannot run, or fails it under CI.
func needsRoot(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("a real-kernel test cannot run under CI=true: %s", why)
	}
	t.Skipf("skipping the real-kernel test: %s", why)
}

func TestAPodCgroupOnARealV2HierarchyFaultsItsClaimAndOneMorePageIsRefused(t *testing.T) {
	if os.Getenv(namespacedEnv) == "" {
		if os.Geteuid() != 0 {
			needsRoot(t, "not root (it mounts cgroup2 and writes the 2 MiB pool)")
		}
		if _, err := exec.LookPath("unshare"); err != nil {
			needsRoot(t, "no unshare(1)")
		}
		// One real-kernel test at a time on the machine (the Rust tests'
		// lock, hugepool_e2e::lock_machine_kernel).
		lock, err := os.Create(filepath.Join(os.TempDir(), "hugepool-real-kernel.lock"))
		if err != nil {
			t.Fatal(err)
		}
		defer lock.Close()
		if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("unshare", "--mount", "--propagation", "private", os.Args[0],
			"-test.run=^"+t.Name()+"$", "-test.v")
		cmd.Env = append(os.Environ(), namespacedEnv+"=1")
		out, err := cmd.CombinedOutput()
		t.Logf("in a private mount namespace:\n%s", out)
		if err != nil {
			t.Fatalf("the test in its mount namespace failed: %v", err)
		}
		if !strings.Contains(string(out), "--- PASS") {
			t.Fatal("the test in its mount namespace did not pass")
		}
		return
	}

	unified := freeHugetlbForV2(t)
	saved := strings.TrimSpace(read(t, filepath.Join(unified, "cgroup.subtree_control")))
	if !strings.Contains(saved, "hugetlb") {
		write(t, filepath.Join(unified, "cgroup.subtree_control"), "+hugetlb")
		t.Cleanup(func() {
			_ = os.WriteFile(filepath.Join(unified, "cgroup.subtree_control"), []byte("-hugetlb"), 0o644)
		})
	}
	// 5 free 2 MiB pages at least: the claim's 4 and the one refused.
	pool := "/proc/sys/vm/nr_hugepages"
	before := read(t, pool)
	free := func() int {
		v, _ := strconv.Atoi(read(t, "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"))
		return v
	}
	if free() < 5 {
		total, _ := strconv.Atoi(before)
		write(t, pool, strconv.Itoa(total+5-free()))
	}
	t.Cleanup(func() { _ = os.WriteFile(pool, []byte(before), 0o644) })
	if free() < 5 {
		t.Fatalf("the 2 MiB pool has %d free pages, want 5", free())
	}

	// A pod cgroup as the kubelet makes one under the cgroupfs driver, its
	// 2 MiB limits 0 (the pod requests no hugepages-2Mi).
	top := fmt.Sprintf("hugepool-test-%d", os.Getpid())
	parent := "/" + top + "/kubepods/burstable/podu1"
	c := cgroups{root: unified}
	dir, err := c.dir(parent)
	if err != nil {
		t.Fatal(err)
	}
	path := unified
	for _, part := range strings.Split(strings.TrimPrefix(parent, "/"), "/") {
		path = filepath.Join(path, part)
		if err := os.Mkdir(path, 0o755); err != nil {
			t.Fatal(err)
		}
		if path != dir {
			write(t, filepath.Join(path, "cgroup.subtree_control"), "+hugetlb")
		}
	}
	t.Cleanup(func() { removeTree(filepath.Join(unified, top)) })
	limit, reserved := c.files("2MB")
	for _, f := range []string{limit, reserved} {
		write(t, filepath.Join(dir, f), "0")
	}
	// With the kubelet's limits, not one page.
	if code, out := faultIn(t, dir, 1); code != 3 {
		t.Fatalf("a page faulted in a pod cgroup limited to 0: exit %d, %s", code, out)
	}

	prepared := preparedFile(t, map[string]preparedClaim{"c1": claim("one", []string{"u1"}, "2Mi", 0, 4)})
	p := newPlugin(c, prepared)
	sandbox := pod("u1", parent)
	env := []string{"HUGEPOOL_PAGES_C1_0=size=2Mi,numa=0,pages=4"}
	if _, _, err := p.CreateContainer(context.Background(), sandbox, container("app", sandbox.Id, env, 0, "")); err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	for _, f := range []string{limit, reserved} {
		if got := read(t, filepath.Join(dir, f)); got != strconv.Itoa(8*mib) {
			t.Fatalf("the kernel's %s reads %s, want 8 MiB", f, got)
		}
	}
	// The claim's 4 pages fault; 5 are refused at the reservation.
	if code, out := faultIn(t, dir, 4); code != 0 {
		t.Fatalf("the claim's 4 pages did not fault: exit %d, %s", code, out)
	}
	if code, out := faultIn(t, dir, 5); code != 3 || !strings.Contains(out, "cannot allocate memory") {
		t.Fatalf("5 pages in a pod limited to 4: exit %d, %s", code, out)
	}
	if err := p.RemovePodSandbox(context.Background(), sandbox); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
}

// freeHugetlbForV2 mounts cgroup2 and returns where. A v1 hugetlb
// hierarchy left by an earlier run (empty kubepods cgroups of a test
// node) holds the controller: its empty cgroups are removed and it is
// unmounted first, so that the kernel frees the controller for v2.
func freeHugetlbForV2(t *testing.T) string {
	t.Helper()
	// The kernel lets the hierarchy go once it is unmounted with no
	// cgroup left, not always at the first unmount: a few tries, a state
	// waited for.
	for try := 0; try < 50 && hierarchy(t) != 0; try++ {
		v1 := t.TempDir()
		if err := syscall.Mount("none", v1, "cgroup", 0, "hugetlb"); err != nil {
			t.Fatalf("mount the v1 hugetlb hierarchy that holds the controller: %v", err)
		}
		removeTree(v1)
		if err := syscall.Unmount(v1, 0); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if id := hierarchy(t); id != 0 {
		t.Fatalf("the hugetlb controller is held by v1 hierarchy %d (a test node running?): "+
			"a v2 hierarchy cannot have it", id)
	}
	unified := t.TempDir()
	if err := syscall.Mount("none", unified, "cgroup2", 0, ""); err != nil {
		t.Fatalf("mount cgroup2: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(unified, syscall.MNT_DETACH) })
	if controllers := read(t, filepath.Join(unified, "cgroup.controllers")); !strings.Contains(controllers, "hugetlb") {
		t.Fatalf("cgroup2 offers %q, not hugetlb", controllers)
	}
	return unified
}

// hierarchy is the v1 hierarchy that holds hugetlb (0: none).
func hierarchy(t *testing.T) int {
	t.Helper()
	for _, line := range strings.Split(read(t, "/proc/cgroups"), "\n") {
		fields := strings.Fields(line)
		if len(fields) >= 2 && fields[0] == "hugetlb" {
			id, _ := strconv.Atoi(fields[1])
			return id
		}
	}
	t.Fatal("the kernel has no hugetlb controller")
	return 0
}

// removeTree removes the empty cgroups under root (deepest first); a cgroup
// with processes stays.
func removeTree(root string) {
	var dirs []string
	_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && path != root {
			dirs = append(dirs, path)
		}
		return nil
	})
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, dir := range dirs {
		_ = syscall.Rmdir(dir)
	}
	_ = syscall.Rmdir(root)
}

// faultIn runs a process in cgroup dir that faults pages 2 MiB pages;
// returns its exit code and output.
func faultIn(t *testing.T, dir string, pages int) (int, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), faultEnv+"="+strconv.Itoa(pages))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "cgroup.procs"), strconv.Itoa(cmd.Process.Pid))
	_, _ = stdin.Write([]byte("\n"))
	_ = stdin.Close()
	err = cmd.Wait()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), out.String()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, out.String()
}

func write(t *testing.T, path, value string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		t.Fatalf("write %s to %s: %v", value, path, err)
	}
}

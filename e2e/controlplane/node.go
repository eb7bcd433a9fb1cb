package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Debian's packages the node runs on; installed by ensureNodePackages when
// missing. containerd is not among them: the node runs containerd 2.x, built
// from its Go module beside the kubelet (build.sh); Debian 12 has only 1.6.
var nodePackages = map[string]string{
	"/usr/sbin/runc":        "runc",
	"/usr/lib/cni/loopback": "containernetworking-plugins",
	"/usr/sbin/ip":          "iproute2",
	"/usr/bin/mount":        "mount",
	"/usr/bin/nsenter":      "util-linux",
	"/lib/systemd/systemd":  "systemd",
}

// The pod network: a bridge in this machine's network namespace. Pods reach
// the apiserver at the gateway address (the apiserver listens on every local
// address with --node); nothing is routed off the machine.
const (
	podBridge  = "hugepool0"
	podSubnet  = "10.88.0.0/24"
	podGateway = "10.88.0.1"
	// DIR/pod-apiserver holds host:port of the apiserver as pods reach it.
	podAPIServerFile = "pod-apiserver"
)

// One node at a time on a machine: its pods live in the kubepods cgroups and
// write this machine's kernel.
const nodeLockPath = "/run/hugepool-controlplane-node.lock"

// node is the kubelet and containerd of `up --node`, with their state under
// DIR/node.
type node struct {
	dir, name, images, apiURL string
	// HOST:PORT of registries containerd reaches over plain HTTP
	// (hosts.toml under DIR/node/certs.d).
	registries []string
	// The kubelet's memoryManagerPolicy: None or Static.
	memoryManager string
	ports         ports
	pki           *pki
	admin         *http.Client
	timeout       time.Duration

	// systemd, PID 1 of the node's namespaces (systemd.go); it runs
	// containerd.service and kubelet.service.
	init     *child
	children []*child // exiting ends `up`: the init
}

func defaultNodeName() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "hugepool-node"
	}
	return strings.ToLower(strings.ReplaceAll(h, "_", "-"))
}

func (n *node) path(parts ...string) string {
	return filepath.Join(append([]string{n.dir, "node"}, parts...)...)
}
func (n *node) socket() string { return n.path("containerd.sock") }

// prepare takes the machine's node lock, installs missing packages and
// clears what a node that died without stopping left running.
func (n *node) prepare(phase func(string, ...any)) (func(), error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("--node runs containerd and the kubelet: run as root")
	}
	f, err := os.OpenFile(nodeLockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if !retryFor(30*time.Second, func() bool { return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil }) {
		f.Close()
		return nil, fmt.Errorf("another controlplane up --node holds %s", nodeLockPath)
	}
	if pid := runningKubelet(); pid != 0 {
		f.Close()
		return nil, fmt.Errorf("a kubelet (pid %d) already runs on this machine: --node needs its pod cgroups to itself", pid)
	}
	if err := ensureNodePackages(phase); err != nil {
		f.Close()
		return nil, err
	}
	if killed := killPods(""); killed > 0 {
		phase("killed %d processes a previous node left in kubepods", killed)
	}
	if unmounted := unmountUnder(n.path()); unmounted > 0 {
		phase("removed %d mounts a previous node left in %s", unmounted, n.path())
	}
	return func() { f.Close() }, nil
}

func ensureNodePackages(phase func(string, ...any)) error {
	seen := map[string]bool{}
	var missing []string
	for path, pkg := range nodePackages {
		if _, err := os.Stat(path); err != nil && !seen[pkg] {
			seen[pkg] = true
			missing = append(missing, pkg)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	phase("apt-get install %s", strings.Join(missing, " "))
	env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	for _, args := range [][]string{{"update", "-qq"}, append([]string{"install", "-y", "-qq"}, missing...)} {
		cmd := exec.Command("apt-get", args...)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("apt-get %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// start runs containerd, imports the images, runs the kubelet and waits for
// the Node to be Ready.
func (n *node) start(ctx context.Context, phase func(string, ...any)) error {
	// prepare killed every pod of an earlier run: their addresses are free.
	if err := os.RemoveAll(n.path("cni-ipam")); err != nil {
		return err
	}
	for _, d := range []string{n.path("cni"), n.path("manifests"), n.path("pod-logs"), n.path("kubelet")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := n.writeContainerdConfig(); err != nil {
		return err
	}
	nodeCert, err := n.pki.ensureNodeCert(n.name)
	if err != nil {
		return err
	}
	kubeconfig := n.path("kubelet.kubeconfig")
	if err := n.pki.writeKubeconfig(kubeconfig, n.apiURL, nodeCert); err != nil {
		return err
	}
	if err := n.writeKubeletConfig(); err != nil {
		return err
	}
	kubeletBin, err := siblingBinary("kubelet")
	if err != nil {
		return err
	}
	containerdBin, err := siblingBinary("containerd")
	if err != nil {
		return err
	}
	if err := n.writeUnits(containerdBin, []string{kubeletBin,
		"--config=" + n.path("kubelet.yaml"),
		"--kubeconfig=" + kubeconfig,
		"--root-dir=" + n.path("kubelet"),
		"--hostname-override=" + n.name,
	}); err != nil {
		return err
	}
	if err := n.startInit(ctx); err != nil {
		return err
	}
	phase("systemd is PID 1 of the node (pid %d here; %s, %s)", n.init.cmd.Process.Pid, n.path("systemctl"), n.path("journalctl"))
	if err := n.init.waitUntil(ctx, n.timeout, func(context.Context) error { _, err := n.ctr("version"); return err }); err != nil {
		return fmt.Errorf("containerd: %w\n%s", err, n.journalTail("containerd", 30))
	}
	phase("containerd.service ready on %s", n.socket())

	if n.images != "" {
		archives, err := filepath.Glob(filepath.Join(n.images, "*.tar"))
		if err != nil {
			return err
		}
		if len(archives) == 0 {
			return fmt.Errorf("--images %s holds no *.tar archives (run `make images`)", n.images)
		}
		for _, archive := range archives {
			out, err := n.ctr("images", "import", "--no-unpack=false", archive)
			if err != nil {
				return fmt.Errorf("importing %s: %w", archive, err)
			}
			phase("imported %s", strings.TrimSpace(lastLine(out)))
		}
	}

	if out, err := n.systemctl(ctx, "start", "kubelet.service"); err != nil {
		return fmt.Errorf("systemctl start kubelet: %v: %s\n%s", err, out, n.journalTail("kubelet", 40))
	}
	nodeURL := n.apiURL + "/api/v1/nodes/" + n.name
	if err := n.init.waitUntil(ctx, n.timeout, n.nodeReady(nodeURL)); err != nil {
		return fmt.Errorf("kubelet: %w\n%s", err, n.journalTail("kubelet", 40))
	}
	phase("node %s Ready (kubelet.service, on 127.0.0.1:%d)", n.name, n.ports.Kubelet)
	podAPI := fmt.Sprintf("%s:%d\n", podGateway, n.ports.APIServer)
	return writeFileAtomic(filepath.Join(n.dir, podAPIServerFile), []byte(podAPI), 0o644)
}

// stop stops the kubelet, ends the node's systemd and with it every process
// of its namespaces (containerd, shims, pods), then removes what a node
// that was not stopped this way left: pod processes and mounts.
func (n *node) stop(phase func(string, ...any)) {
	if n.init == nil {
		return
	}
	n.stopInit()
	killed := killPods(n.socket())
	unmounted := unmountUnder(n.path())
	phase("node stopped (%d pod and shim processes left to kill, %d mounts removed)", killed, unmounted)
}

// unmountUnder detaches every mount below dir (pod volumes, container root
// filesystems), deepest first, so the directory can be removed.
func unmountUnder(dir string) int {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0
	}
	var points []string
	for _, line := range strings.Split(string(data), "\n") {
		// "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 ..."
		fields := strings.Fields(line)
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			points = append(points, fields[4])
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	unmounted := 0
	for _, p := range points {
		if unix.Unmount(p, unix.MNT_DETACH) == nil {
			unmounted++
		}
	}
	return unmounted
}

func (n *node) nodeReady(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := n.admin.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var obj struct {
			Status struct {
				Conditions []struct{ Type, Status, Message string }
			}
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %d", url, resp.StatusCode)
		}
		if err := json.NewDecoder(resp.Body).Decode(&obj); err != nil {
			return err
		}
		for _, c := range obj.Status.Conditions {
			if c.Type == "Ready" {
				if c.Status == "True" {
					return nil
				}
				return fmt.Errorf("node not Ready: %s", c.Message)
			}
		}
		return errors.New("node has no Ready condition yet")
	}
}

func (n *node) ctr(args ...string) (string, error) {
	ctr, err := siblingBinary("ctr")
	if err != nil {
		return "", err
	}
	cmd := exec.Command(ctr, append([]string{"--address", n.socket(), "--namespace", "k8s.io"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

func (n *node) writeContainerdConfig() error {
	// The sandbox (pause) image is built by `make images`: nothing is pulled.
	sandbox, err := sandboxImage(n.images)
	if err != nil {
		return err
	}
	// containerd 2.x's configuration (version 3). NRI is on, its socket in
	// the node's own /run. disable_hugetlb_controller defaults to true in
	// containerd (1.6 and 2.x alike): containers would get no hugetlb limit
	// of their own, only the pod's from the kubelet. The node sets it false,
	// so each container is limited to its request too, and NRI plugins may
	// adjust hugetlb limits (containerd drops them while it is disabled).
	conf := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[plugins.'io.containerd.internal.v1.opt']
  path = %[5]q

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = %[8]q
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[6]q

[plugins.'io.containerd.cri.v1.runtime']
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its
  # oom_score_adj (the kubelet asks -998 for sandboxes): clamp instead.
  restrict_oom_score_adj = true
  disable_hugetlb_controller = false
  tolerate_missing_hugetlb_controller = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '/usr/sbin/runc'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = %[7]q

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'

[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = '/run/nri/nri.sock'
`, n.path("containerd", "root"), n.path("containerd", "state"), n.socket(), n.socket()+".ttrpc",
		n.path("containerd", "opt"), sandbox, n.path("cni"), n.path("certs.d"))
	if err := writeFileAtomic(n.path("containerd.toml"), []byte(conf), 0o644); err != nil {
		return err
	}
	// Each --registry: pulled from over plain HTTP (containerd's hosts.toml,
	// one directory per HOST:PORT).
	for _, registry := range n.registries {
		hosts := fmt.Sprintf("server = %[1]q\n\n[host.%[1]q]\n  capabilities = [\"pull\", \"resolve\"]\n", "http://"+registry)
		if err := os.MkdirAll(n.path("certs.d", registry), 0o755); err != nil {
			return err
		}
		if err := writeFileAtomic(n.path("certs.d", registry, "hosts.toml"), []byte(hosts), 0o644); err != nil {
			return err
		}
	}
	// Each pod gets its own network namespace on a bridge that exists only
	// on this machine (no masquerade, no route out); the bridge's address is
	// where pods reach the apiserver.
	cni := fmt.Sprintf(`{"cniVersion": "0.4.0", "name": "hugepool-node", "plugins": [{
  "type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q}]], "dataDir": %q}
}]}
`, podBridge, podSubnet, podGateway, n.path("cni-ipam"))
	return writeFileAtomic(n.path("cni", "10-hugepool-node.conflist"), []byte(cni), 0o644)
}

func (n *node) writeKubeletConfig() error {
	conf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 (hybrid); kubelet v1.37 refuses it unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://%[1]s
# Everything on loopback: the kubelet's API, healthz, no read-only port.
address: 127.0.0.1
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %[4]q}
authorization: {mode: AlwaysAllow}
staticPodPath: %[5]q
podLogsDir: %[6]q
failSwapOn: false
# Images come from make images; never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%%, imagefs.available: 1%%, nodefs.inodesFree: 1%%}
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
shutdownGracePeriod: 0s
%[7]s`, n.socket(), n.ports.Kubelet, n.ports.KubeletHealthz, n.pki.path(caName, "crt"), n.path("manifests"), n.path("pod-logs"), n.memoryManagerConfig())
	return writeFileAtomic(n.path("kubelet.yaml"), []byte(conf), 0o644)
}

// memoryManagerConfig is the kubelet configuration of a Static Memory
// Manager, as the nodes that use hugepages most run it: Guaranteed pods get
// memory and hugepages pinned to NUMA nodes, and the kubelet checks its
// saved state against the machine when it starts. The kubelet requires the
// reserved memory to equal kube-reserved + system-reserved + the hard
// eviction threshold (100Mi here), on NUMA node 0.
func (n *node) memoryManagerConfig() string {
	if n.memoryManager != "Static" {
		return ""
	}
	return `memoryManagerPolicy: Static
reservedMemory: [{numaNode: 0, limits: {memory: 100Mi}}]
topologyManagerPolicy: single-numa-node
topologyManagerScope: container
`
}

// sandboxImage is the pause image: hugepool-e2e from `make images`, named
// with the version in the archive's file name.
func sandboxImage(images string) (string, error) {
	matches, _ := filepath.Glob(filepath.Join(images, "hugepool-e2e-*.tar"))
	if len(matches) != 1 {
		return "", fmt.Errorf("--images %q must hold exactly one hugepool-e2e-VERSION.tar (the pause image; run `make images`), found %d", images, len(matches))
	}
	version := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(matches[0]), "hugepool-e2e-"), ".tar")
	return "localhost/hugepool-e2e:" + version, nil
}

func siblingBinary(name string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	path := filepath.Join(filepath.Dir(self), name)
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("%s missing beside %s: run e2e/controlplane/build.sh", name, self)
	}
	return path, nil
}

// killPods SIGKILLs every process in the kubelet's pod cgroups and, when
// socket is set, the containerd shims serving it (or every shim of a
// hugepool node when socket is empty). Returns how many it killed.
func killPods(socket string) int {
	killed := 0
	kill := func(pid int) {
		if pid > 1 && pid != os.Getpid() && syscall.Kill(pid, syscall.SIGKILL) == nil {
			killed++
		}
	}
	for _, hierarchy := range []string{"pids", "memory", "cpu"} {
		root := filepath.Join("/sys/fs/cgroup", hierarchy, "kubepods")
		_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			data, _ := os.ReadFile(path)
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil {
					kill(pid)
				}
			}
			return nil
		})
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		args := strings.Split(string(cmdline), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != "containerd-shim-runc-v2" {
			continue
		}
		for i, a := range args {
			if a == "-address" && i+1 < len(args) {
				if (socket == "" && strings.HasSuffix(args[i+1], "/node/containerd.sock")) || args[i+1] == socket {
					kill(pid)
				}
			}
		}
	}
	return killed
}

// runningKubelet returns the pid of a kubelet process on this machine, or 0.
func runningKubelet() int {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		if comm, _ := os.ReadFile(filepath.Join("/proc", p.Name(), "comm")); strings.TrimSpace(string(comm)) == "kubelet" {
			return pid
		}
	}
	return 0
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

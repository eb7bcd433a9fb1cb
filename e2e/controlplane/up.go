package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Files in DIR written by up.
const (
	portsFile      = "ports.json"
	kubeconfigFile = "kubeconfig"
	readyFile      = "ready"
	lockFile       = "lock"
)

// ports are chosen once and persisted, so a restarted control plane serves on
// the same URL and old kubeconfigs stay valid.
type ports struct {
	EtcdClient        int `json:"etcdClient"`
	EtcdPeer          int `json:"etcdPeer"`
	APIServer         int `json:"apiserver"`
	ControllerManager int `json:"controllerManager"`
	Scheduler         int `json:"scheduler"`
	Kubelet           int `json:"kubelet"`
	KubeletHealthz    int `json:"kubeletHealthz"`
}

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, " ") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func runUp(args []string) error {
	fs := flag.NewFlagSet("up", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "directory for certs, etcd data, logs, kubeconfig and the ready file (required)")
	timeout := fs.Duration("timeout", 3*time.Minute, "how long each component may take to become ready")
	var apiExtra, kcmExtra stringList
	fs.Var(&apiExtra, "apiserver-arg", "extra kube-apiserver flag, e.g. --apiserver-arg=--v=4 (repeatable)")
	fs.Var(&kcmExtra, "controller-manager-arg", "extra kube-controller-manager flag (repeatable)")
	withNode := fs.Bool("node", false, "also run a kubelet and containerd on this machine (root), with kube-scheduler")
	withScheduler := fs.Bool("scheduler", false, "also run kube-scheduler (--node does), to schedule pods on Nodes a test writes")
	nodeName := fs.String("node-name", defaultNodeName(), "the Node's name (--node)")
	memoryManager := fs.String("memory-manager", "None", "the kubelet's memoryManagerPolicy, None or Static (Static adds the Topology Manager, single-numa-node) (--node)")
	images := fs.String("images", "", "import every *.tar OCI archive in this directory into the node's containerd (--node)")
	var registries stringList
	fs.Var(&registries, "registry", "HOST:PORT of an OCI registry the node's containerd pulls from over plain HTTP, e.g. a local test registry (--node, repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dataDir == "" || fs.NArg() > 0 {
		return errors.New("usage: controlplane up --data-dir DIR")
	}
	dir, err := filepath.Abs(*dataDir)
	if err != nil {
		return err
	}

	start := time.Now()
	phase := func(format string, a ...any) {
		fmt.Printf("controlplane: %-60s %6.2fs\n", fmt.Sprintf(format, a...), time.Since(start).Seconds())
	}

	// Stop on SIGTERM/SIGINT/SIGHUP, and when our parent dies. We poll
	// getppid rather than using PR_SET_PDEATHSIG because the latter fires when
	// the parent *thread* exits, and a Rust test harness spawns us from
	// short-lived test threads.
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	go func() {
		s := <-sigs
		cancel(fmt.Errorf("got signal %v", s))
		<-sigs
		// Second signal: give up on a clean stop; children die via Pdeathsig.
		os.Exit(1)
	}()
	go watchParent(ctx, cancel)
	// If our stdout is a pipe to a parent that died, printing must not kill
	// us with SIGPIPE before the children are stopped.
	signal.Ignore(syscall.SIGPIPE)

	for _, d := range []string{dir, filepath.Join(dir, "logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	unlock, err := lockDir(dir)
	if err != nil {
		return err
	}
	defer unlock()
	readyPath := filepath.Join(dir, readyFile)
	if err := os.Remove(readyPath); err != nil && !os.IsNotExist(err) {
		return err
	}

	p, err := ensurePKI(filepath.Join(dir, "pki"))
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	phase("certificates in %s", p.dir)

	pt, err := loadOrPickPorts(filepath.Join(dir, portsFile))
	if err != nil {
		return err
	}
	apiURL := fmt.Sprintf("https://127.0.0.1:%d", pt.APIServer)
	if err := p.writeKubeconfig(filepath.Join(dir, "controller-manager.kubeconfig"), apiURL, kcmName); err != nil {
		return err
	}

	var running []*child
	defer func() {
		// Stop in reverse start order: controller-manager, apiserver, etcd.
		os.Remove(readyPath)
		for i := len(running) - 1; i >= 0; i-- {
			running[i].stop(30 * time.Second)
		}
		if len(running) > 0 {
			phase("stopped")
		}
	}()
	startAndWait := func(name string, args []string, check func(context.Context) error) error {
		c, err := startChild(dir, name, args)
		if err != nil {
			return err
		}
		running = append(running, c)
		if err := c.waitUntil(ctx, *timeout, check); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("stopped while starting %s: %w", name, err)
			}
			return fmt.Errorf("%s: %w\n%s", name, err, c.logTail(30))
		}
		return nil
	}

	plain := &http.Client{Timeout: 5 * time.Second}
	etcdHealth := fmt.Sprintf("http://127.0.0.1:%d/health", pt.EtcdClient)
	if err := startAndWait("etcd", etcdArgs(dir, pt), httpCheck(plain, etcdHealth, `"health":"true"`)); err != nil {
		return err
	}
	phase("etcd ready on http://127.0.0.1:%d", pt.EtcdClient)

	adminTLS, err := p.tlsConfig(adminName)
	if err != nil {
		return err
	}
	admin := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: adminTLS}}
	if err := startAndWait("apiserver", apiserverArgs(dir, pt, *withNode, apiExtra), httpCheck(admin, apiURL+"/readyz", "ok")); err != nil {
		return err
	}
	phase("apiserver ready on %s", apiURL)

	caTLS, err := p.tlsConfig("")
	if err != nil {
		return err
	}
	caOnly := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: caTLS}}
	kcmHealth := fmt.Sprintf("https://127.0.0.1:%d/healthz", pt.ControllerManager)
	if err := startAndWait("controller-manager", controllerManagerArgs(dir, pt, *withNode, kcmExtra), httpCheck(caOnly, kcmHealth, "ok")); err != nil {
		return err
	}
	phase("controller-manager healthy on https://127.0.0.1:%d", pt.ControllerManager)

	// Pods can only be created once the serviceaccount controller made the
	// namespace's "default" ServiceAccount; wait for it in "default".
	saURL := apiURL + "/api/v1/namespaces/default/serviceaccounts/default"
	kcm := running[len(running)-1]
	if err := kcm.waitUntil(ctx, *timeout, httpCheck(admin, saURL, `"name":"default"`)); err != nil {
		return fmt.Errorf("waiting for default/default ServiceAccount: %w", err)
	}
	phase("default ServiceAccount exists")

	startScheduler := func() error {
		if err := p.writeKubeconfig(filepath.Join(dir, "scheduler.kubeconfig"), apiURL, schedName); err != nil {
			return err
		}
		schedHealth := fmt.Sprintf("https://127.0.0.1:%d/healthz", pt.Scheduler)
		if err := startAndWait("scheduler", schedulerArgs(dir, pt), httpCheck(caOnly, schedHealth, "ok")); err != nil {
			return err
		}
		phase("scheduler healthy on %s", schedHealth)
		return nil
	}

	var n *node
	if *withNode {
		if *memoryManager != "None" && *memoryManager != "Static" {
			return fmt.Errorf("--memory-manager must be None or Static, not %q", *memoryManager)
		}
		n = &node{dir: dir, name: *nodeName, images: *images, registries: registries, memoryManager: *memoryManager, apiURL: apiURL, ports: pt, pki: p, admin: admin, timeout: *timeout}
		unlockNode, err := n.prepare(phase)
		if err != nil {
			return err
		}
		defer unlockNode()
		// Stopped before the control plane, after the kubelet: see node.stop.
		defer n.stop(phase)
		if err := startScheduler(); err != nil {
			return err
		}
		if err := n.start(ctx, phase); err != nil {
			return err
		}
	} else if *withScheduler {
		if err := startScheduler(); err != nil {
			return err
		}
	}

	if err := p.writeKubeconfig(filepath.Join(dir, kubeconfigFile), apiURL, adminName); err != nil {
		return err
	}
	if err := writeFileAtomic(readyPath, []byte(apiURL+"\n"), 0o644); err != nil {
		return err
	}
	phase("ready: %s", filepath.Join(dir, kubeconfigFile))

	watched := running
	if n != nil {
		watched = append(append([]*child{}, running...), n.children...)
	}
	exited := make(chan *child, len(watched))
	for _, c := range watched {
		go func() { <-c.done; exited <- c }()
	}
	select {
	case <-ctx.Done():
		phase("shutting down: %v", context.Cause(ctx))
		return nil
	case c := <-exited:
		return fmt.Errorf("%s exited unexpectedly: %v\n%s", c.name, c.err, c.logTail(30))
	}
}

func watchParent(ctx context.Context, cancel context.CancelCauseFunc) {
	ppid := os.Getppid()
	if ppid == 1 {
		return // already orphaned (e.g. started via setsid/nohup chains); nothing to watch
	}
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if os.Getppid() != ppid {
				cancel(fmt.Errorf("parent process %d died", ppid))
				return
			}
		}
	}
}

// lockDir keeps two `up`s from sharing one DIR. The kernel drops the flock
// when we die, so a crashed run never blocks the next one.
func lockDir(dir string) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	// A previous `up` given SIGTERM may still be stopping its children.
	if !retryFor(30*time.Second, func() bool {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		return err == nil
	}) {
		pid, _ := os.ReadFile(f.Name())
		f.Close()
		return nil, fmt.Errorf("another controlplane up (pid %s) is running on %s: %w", strings.TrimSpace(string(pid)), dir, err)
	}
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, err
	}
	if _, err := fmt.Fprintf(f, "%d\n", os.Getpid()); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// retryFor polls ok every 100ms until it returns true or d has passed.
func retryFor(d time.Duration, ok func() bool) bool {
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
	return true
}

func loadOrPickPorts(path string) (ports, error) {
	var p ports
	data, err := os.ReadFile(path)
	switch {
	case err == nil:
		if err := json.Unmarshal(data, &p); err != nil {
			return p, fmt.Errorf("%s: %w", path, err)
		}
	case !os.IsNotExist(err):
		return p, err
	}
	// The apiserver port is part of every kubeconfig handed out, so it must
	// not change; the internal ports may move if something took them.
	// A previous apiserver killed via Pdeathsig may still be exiting.
	if p.APIServer != 0 && !retryFor(10*time.Second, func() bool { return portFree(p.APIServer) }) {
		return p, fmt.Errorf("apiserver port %d (from %s) is in use", p.APIServer, path)
	}
	taken := map[int]bool{}
	for _, port := range []*int{&p.APIServer, &p.EtcdClient, &p.EtcdPeer, &p.ControllerManager, &p.Scheduler, &p.Kubelet, &p.KubeletHealthz} {
		if *port == 0 || taken[*port] || !portFree(*port) {
			if *port, err = freePort(taken); err != nil {
				return p, err
			}
		}
		taken[*port] = true
	}
	data, err = json.MarshalIndent(p, "", "  ")
	if err != nil {
		return p, err
	}
	return p, writeFileAtomic(path, append(data, '\n'), 0o644)
}

// freePort picks a random free port below the kernel's ephemeral range:
// while the control plane is stopped for a restart, a client's outgoing
// connection could otherwise be given the apiserver's port.
func freePort(taken map[int]bool) (int, error) {
	const lowest = 10000
	ephemeralStart := 32768
	if data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(data)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				ephemeralStart = n
			}
		}
	}
	for i := 0; i < 100 && ephemeralStart > lowest; i++ {
		port := lowest + rand.IntN(ephemeralStart-lowest)
		if !taken[port] && portFree(port) {
			return port, nil
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func portFree(port int) bool {
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// httpCheck succeeds once url answers 200 with a body containing want.
func httpCheck(c *http.Client, url, want string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
			return fmt.Errorf("GET %s: %d %s", url, resp.StatusCode, strings.TrimSpace(string(body)))
		}
		return nil
	}
}

// child is one component running as `controlplane <name> <args>`.
type child struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
}

func startChild(dir, name string, args []string) (*child, error) {
	// /proc/self/exe runs exactly this binary even if build.sh replaced the
	// file meanwhile.
	return startProcess(dir, name, "/proc/self/exe", append([]string{os.Args[0], name}, args...))
}

// startProcess starts path with argv (argv[0] included), logging to
// DIR/logs/NAME.log.
func startProcess(dir, name, path string, argv []string) (*child, error) {
	return startProcessIn(dir, name, path, argv, 0)
}

// startProcessIn is startProcess in the new namespaces of cloneflags.
func startProcessIn(dir, name, path string, argv []string, cloneflags uintptr) (*child, error) {
	logPath := filepath.Join(dir, "logs", name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "==== %s %s\n", time.Now().Format(time.RFC3339), strings.Join(argv, " "))

	cmd := &exec.Cmd{
		Path:   path,
		Args:   argv,
		Stdout: logf,
		Stderr: logf,
		SysProcAttr: &syscall.SysProcAttr{
			// Dies with us even on SIGKILL; its own process group so a
			// terminal's Ctrl-C reaches only us and we stop children in order.
			Pdeathsig:  syscall.SIGKILL,
			Setpgid:    true,
			Cloneflags: cloneflags,
		},
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	c := &child{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// waitUntil polls check until it succeeds, the child exits, ctx ends or the
// timeout passes.
func (c *child) waitUntil(ctx context.Context, timeout time.Duration, check func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		last = check(cctx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-c.done:
			return fmt.Errorf("exited during startup: %v", c.err)
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: %v", timeout, last)
		}
	}
}

func (c *child) stop(grace time.Duration) {
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(grace):
		fmt.Fprintf(os.Stderr, "controlplane: %s did not stop within %v, killing it\n", c.name, grace)
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// logTail returns the last n lines of the child's log for error messages.
func (c *child) logTail(n int) string {
	f, err := os.Open(c.logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return fmt.Sprintf("--- last lines of %s ---\n%s", c.logPath, strings.Join(lines, "\n"))
}

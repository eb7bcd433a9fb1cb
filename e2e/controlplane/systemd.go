package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// The node's init: Debian's systemd as PID 1 of its own PID and mount
// namespaces, as a node's init is. containerd and the kubelet run as its
// units (containerd.service, kubelet.service), so an agent pod with hostPID
// sees systemd as PID 1 and restarts the kubelet exactly as on a real node,
// with the agent's default `nsenter --target 1 ... systemctl restart
// kubelet`. The VM's own PID 1 is not systemd (and refuses setns).
//
// The mount namespace is private: /proc is the namespace's, /run a fresh
// tmpfs holding the units and a volatile journal; everything else (the
// node's directory, /sys, the cgroup hierarchies) is the machine's, plus
// the hugetlb cgroup controller at /sys/fs/cgroup/hugetlb, as every real
// node has it: this machine's cgroup v1 hierarchies leave it unmounted, and
// without it the kubelet and runc would set no hugetlb limit at all. The
// mount is the namespace's own (the machine sees an empty directory); the
// hierarchy is the kernel's one hugetlb hierarchy, so a node started again
// finds the kubepods cgroups an earlier one left. Killing
// systemd ends every process of the namespace, pods included, as a power
// cut would.

// Set in the init's environment: systemd then runs as a container's init
// (no console, no kernel tunables).
const initContainerEnv = "container=hugepool-node"

// initTarget is the unit systemd starts: journald and containerd. The
// kubelet is started once the images are imported.
const initTarget = "hugepool-node.target"

// writeUnits writes the units systemd is given, into DIR/node/systemd.
func (n *node) writeUnits(containerd string, kubeletArgs []string) error {
	units := map[string]string{
		initTarget: `[Unit]
Description=The hugepool test node (controlplane up --node)
DefaultDependencies=no
Wants=systemd-journald.service containerd.service
`,
		"containerd.service": fmt.Sprintf(`[Unit]
Description=containerd of the hugepool test node
DefaultDependencies=no
After=systemd-journald.service

[Service]
ExecStart=%s --config %s
# containerd finds its runc shim on PATH: the one built beside it.
Environment=PATH=%s:/usr/sbin:/usr/bin:/sbin:/bin
# The shims and their containers outlive a containerd restart, as in
# Debian's own containerd.service.
KillMode=process
Delegate=yes
Restart=always
RestartSec=1
`, containerd, n.path("containerd.toml"), filepath.Dir(containerd)),
		// As kubeadm's kubelet.service: restarted whenever it exits, never
		// given up on.
		"kubelet.service": fmt.Sprintf(`[Unit]
Description=kubelet of the hugepool test node
DefaultDependencies=no
After=containerd.service
Wants=containerd.service
StartLimitIntervalSec=0

[Service]
ExecStart=%s
Restart=always
RestartSec=1
`, strings.Join(kubeletArgs, " ")),
	}
	dir := n.path("systemd")
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, text := range units {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			return err
		}
	}
	// Each start of the node begins a journal of its own, in /run.
	return os.WriteFile(filepath.Join(dir, "journald.conf"),
		[]byte("[Journal]\nStorage=volatile\nRateLimitIntervalSec=0\n"), 0o644)
}

// startInit starts systemd in new PID and mount namespaces with the units
// of writeUnits and waits until it answers systemctl.
func (n *node) startInit(ctx context.Context) error {
	script := fmt.Sprintf(`set -eu
mount --make-rprivate /
mount -t proc proc /proc
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /sys/fs/cgroup/hugetlb
mountpoint -q /sys/fs/cgroup/hugetlb || mount -t cgroup -o hugetlb hugetlb /sys/fs/cgroup/hugetlb
mkdir -p /run/systemd/system /run/systemd/journald.conf.d
cp %[1]s/*.target %[1]s/*.service /run/systemd/system/
cp %[1]s/journald.conf /run/systemd/journald.conf.d/hugepool.conf
exec env %[2]s /lib/systemd/systemd --unit=%[3]s
`, n.path("systemd"), initContainerEnv, initTarget)
	c, err := startProcessIn(n.dir, "systemd", "/bin/sh", []string{"sh", "-c", script},
		syscall.CLONE_NEWPID|syscall.CLONE_NEWNS)
	if err != nil {
		return err
	}
	n.init = c
	n.children = append(n.children, c)
	if err := c.waitUntil(ctx, n.timeout, func(ctx context.Context) error {
		out, err := n.systemctl(ctx, "is-active", "containerd.service")
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("systemd: %w\n%s", err, c.logTail(30))
	}
	return n.writeInitTools()
}

// writeInitTools writes DIR/node/systemctl and DIR/node/journalctl, which
// run those commands against the node's systemd from this machine, and
// DIR/node/init.pid, its PID here: /proc/PID/root is the node's file system
// as the kubelet and its pods see it (its /run is the node's own).
func (n *node) writeInitTools() error {
	pid := fmt.Sprintf("%d\n", n.init.cmd.Process.Pid)
	if err := writeFileAtomic(n.path("init.pid"), []byte(pid), 0o644); err != nil {
		return err
	}
	for _, tool := range []string{"systemctl", "journalctl"} {
		script := fmt.Sprintf("#!/bin/sh\n# %s of the node in %s (written by controlplane up --node).\nexec %s -- %s \"$@\"\n",
			tool, n.dir, strings.Join(n.enterInit(), " "), tool)
		if err := writeFileAtomic(n.path(tool), []byte(script), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// enterInit is the nsenter into the namespaces of the node's systemd, from
// this machine (an agent with hostPID enters them as `--target 1`).
func (n *node) enterInit() []string {
	return []string{"nsenter", "--target", fmt.Sprint(n.init.cmd.Process.Pid),
		"--mount", "--uts", "--ipc", "--net", "--pid"}
}

func (n *node) inInit(ctx context.Context, args ...string) (string, error) {
	argv := append(append(n.enterInit(), "--"), args...)
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	return string(out), err
}

func (n *node) systemctl(ctx context.Context, args ...string) (string, error) {
	return n.inInit(ctx, append([]string{"systemctl"}, args...)...)
}

// journalTail is the end of a unit's journal, for error messages.
func (n *node) journalTail(unit string, lines int) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, _ := n.inInit(ctx, "journalctl", "--unit", unit, "--lines", fmt.Sprint(lines), "--no-pager")
	return fmt.Sprintf("--- journalctl --unit %s (%s) ---\n%s", unit, n.path("journalctl"), out)
}

// stopInit stops the kubelet as systemd does, then ends the namespace.
func (n *node) stopInit() {
	if n.init == nil {
		return
	}
	select {
	case <-n.init.done:
		return
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	if out, err := n.systemctl(ctx, "stop", "kubelet.service"); err != nil {
		fmt.Fprintf(os.Stderr, "controlplane: systemctl stop kubelet: %v: %s\n", err, out)
	}
	_ = n.init.cmd.Process.Kill()
	<-n.init.done
}

package main

import (
	"fmt"
	"path/filepath"
	"strings"

	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"

	// Same side-effect imports as the upstream kube-apiserver and
	// kube-controller-manager main packages.
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	_ "time/tzdata"
)

// serviceCIDR is never routed: no kube-proxy runs, and pods on the --node
// kubelet reach the apiserver on the pod bridge's address instead.
const serviceCIDR = "10.0.0.0/24"

// controllers is the minimal set the e2e tests need. nodelifecycle must stay
// off: with no kubelet heartbeats it would taint every Node unreachable and
// evict its pods. serviceaccount creates the "default" ServiceAccount that
// the ServiceAccount admission plugin requires before a Pod can be created.
var controllers = []string{
	"garbage-collector-controller",
	"namespace-controller",
	"disruption-controller",
	"serviceaccount-controller",
}

// nodeControllers are added with --node, for the workloads a kubelet runs:
// Deployments, DaemonSets, Jobs (the chart's uninstall hook), the
// kube-root-ca.crt ConfigMap that every pod's
// service-account volume mounts, and node lifecycle, which lifts the
// not-ready taint a kubelet registers with, and the ResourceClaims of pods
// that name a ResourceClaimTemplate. Without --node it stays off: the
// e2e tests create Nodes that no kubelet heartbeats. Taint-based eviction
// stays off in both modes.
var nodeControllers = []string{
	"node-lifecycle-controller",
	"deployment-controller",
	"replicaset-controller",
	"daemonset-controller",
	"job-controller",
	"root-ca-certificate-publisher-controller",
	"resourceclaim-controller",
}

func runAPIServer(args []string) int {
	cmd := apiserver.NewAPIServerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runControllerManager(args []string) int {
	cmd := controllermanager.NewControllerManagerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runScheduler(args []string) int {
	cmd := scheduler.NewSchedulerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func etcdArgs(dir string, p ports) []string {
	return []string{
		"--data-dir=" + filepath.Join(dir, "etcd"),
		fmt.Sprintf("--client-url=http://127.0.0.1:%d", p.EtcdClient),
		fmt.Sprintf("--peer-url=http://127.0.0.1:%d", p.EtcdPeer),
	}
}

func apiserverArgs(dir string, p ports, node bool, extra []string) []string {
	pki := filepath.Join(dir, "pki")
	// With --node, pods reach the apiserver on the pod bridge's address.
	bind := "127.0.0.1"
	if node {
		bind = "0.0.0.0"
	}
	args := []string{
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", p.EtcdClient),
		"--bind-address=" + bind,
		"--advertise-address=127.0.0.1",
		// The endpoint reconciler refuses loopback addresses; nothing in the
		// tests routes to the "kubernetes" Service anyway.
		"--endpoint-reconciler-type=none",
		fmt.Sprintf("--secure-port=%d", p.APIServer),
		"--tls-cert-file=" + filepath.Join(pki, "serving.crt"),
		"--tls-private-key-file=" + filepath.Join(pki, "serving.key"),
		"--client-ca-file=" + filepath.Join(pki, "ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + filepath.Join(pki, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(pki, "sa.key"),
		"--service-cluster-ip-range=" + serviceCIDR,
		"--authorization-mode=Node,RBAC",
		"--profiling=false",
	}
	return append(args, extra...)
}

func controllerManagerArgs(dir string, p ports, node bool, extra []string) []string {
	enabled := controllers
	if node {
		enabled = append(append([]string{}, controllers...), nodeControllers...)
	}
	args := []string{
		"--kubeconfig=" + filepath.Join(dir, "controller-manager.kubeconfig"),
		"--controllers=" + strings.Join(enabled, ","),
		"--kube-api-qps=100",
		"--kube-api-burst=200",
	}
	args = append(args, componentArgs(dir, p.ControllerManager)...)
	return append(args, extra...)
}

// componentArgs are the flags the controller-manager and the scheduler share:
// no leader election (a restart must not wait for a stale lease to expire),
// the serving certificate on loopback, no profiling.
func componentArgs(dir string, port int) []string {
	pki := filepath.Join(dir, "pki")
	return []string{
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", port),
		"--tls-cert-file=" + filepath.Join(pki, "serving.crt"),
		"--tls-private-key-file=" + filepath.Join(pki, "serving.key"),
		"--profiling=false",
	}
}

func schedulerArgs(dir string, p ports) []string {
	kubeconfig := filepath.Join(dir, "scheduler.kubeconfig")
	args := []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
	}
	return append(args, componentArgs(dir, p.Scheduler)...)
}

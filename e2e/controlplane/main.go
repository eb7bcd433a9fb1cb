// Command controlplane runs a real etcd, kube-apiserver and
// kube-controller-manager on loopback for hugepool's end-to-end tests, and
// with --node a real kubelet and containerd on this machine.
//
//	controlplane up --data-dir DIR     start everything, write DIR/kubeconfig, then DIR/ready
//	controlplane version               print the Kubernetes version this binary was built from
//	controlplane webhook --data-dir DIR --dir WDIR
//	                                   a pods/eviction admission webhook the fault tests steer
//
// The etcd, apiserver and controller-manager subcommands are internal: `up`
// re-executes this binary with them, one process per component, because the
// Kubernetes components register global flags and metrics that clash when two
// of them run in one process.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"

	"k8s.io/component-base/version"
)

const usageText = `usage:
  controlplane up --data-dir DIR [--timeout 3m] [--apiserver-arg=--flag=value]... [--controller-manager-arg=--flag=value]...
                  [--node [--node-name NAME] [--images DIR]]
  controlplane version
  controlplane webhook --data-dir DIR --dir WDIR   (a pods/eviction webhook for fault tests)

internal (started by up):
  controlplane etcd --data-dir DIR --client-url URL --peer-url URL
  controlplane apiserver <kube-apiserver flags>
  controlplane controller-manager <kube-controller-manager flags>
  controlplane scheduler <kube-scheduler flags>

With --node, up also runs a real node on this machine: containerd (Debian's,
with runc and the CNI loopback plugin), the OCI archives in --images imported
into it, the kubelet built beside this binary, and kube-scheduler plus the
Deployment, DaemonSet and root-CA controllers; DIR/ready is written once the
Node is Ready. Pods get addresses on a bridge that exists only on this machine
(10.88.0.0/24) and reach the apiserver at DIR/pod-apiserver (10.88.0.1:PORT).
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usageText)
		os.Exit(2)
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "up":
		if err := runUp(args); errors.Is(err, flag.ErrHelp) {
			return
		} else if err != nil {
			fmt.Fprintf(os.Stderr, "controlplane: %v\n", err)
			os.Exit(1)
		}
	case "etcd":
		if err := runEtcd(args); err != nil {
			fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
			os.Exit(1)
		}
	case "apiserver":
		os.Exit(runAPIServer(args))
	case "controller-manager":
		os.Exit(runControllerManager(args))
	case "scheduler":
		os.Exit(runScheduler(args))
	case "webhook":
		if err := runWebhook(args); errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		} else if err != nil {
			fmt.Fprintf(os.Stderr, "webhook: %v\n", err)
			os.Exit(1)
		}
	case "version", "--version":
		fmt.Println(version.Get().GitVersion)
	case "help", "-h", "--help":
		fmt.Print(usageText)
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n%s", os.Args[1], usageText)
		os.Exit(2)
	}
}

//go:build tools

// Package tools pins the node's container runtime: containerd 2.x (its CRI
// plugin serves the kubelet; NRI is on by default), its runc shim and ctr,
// built from the Go module by e2e/controlplane/build.sh, as the kubelet is.
// A module of its own, so containerd's dependencies never move the
// Kubernetes modules the control plane is built from.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)

// hugepool-nri: the NRI plugin of pools claimed through DRA.
//
// The kubelet gives a container hugetlb limits for the hugepages-<size>
// resources it requests and 0 for every other size, so a container using
// a ResourceClaim of the driver hugepages.hugepool.dev could fault none of
// its pages. The agent's kubelet plugin gives each prepared claim a CDI
// device whose only edit is an environment variable naming the claim's
// pages (HUGEPOOL_PAGES_<claim>_<n>=size=2Mi,numa=0,pages=16). When the
// runtime creates a container, this plugin reads those variables, adds the
// claimed bytes to the container's hugetlb limits, binds the container's
// memory to the claims' NUMA nodes, and raises the pod's cgroup limits by
// the pod's claims, which NRI cannot adjust (docs/design.md, "Pools claimed
// through DRA").
//
// Go, not Rust: containerd/nri's stub does the NRI connection (its
// multiplexed ttrpc, registration, synchronisation) that the agent would
// otherwise implement by hand.
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/containerd/nri/pkg/stub"
)

func main() {
	socket := flag.String("socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
	cgroupRoot := flag.String("cgroup-root", "/sys/fs/cgroup", "where the host's cgroup hierarchies are mounted")
	index := flag.String("index", "50", "the plugin's place among NRI plugins (two digits)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	plugin := newPlugin(cgroups{root: *cgroupRoot})
	// The runtime closes the connection when it restarts: connect again,
	// and synchronise, rather than leave containers created meanwhile
	// without their limits for longer than the restart.
	for ctx.Err() == nil {
		s, err := stub.New(plugin,
			stub.WithPluginName("hugepool"),
			stub.WithPluginIdx(*index),
			stub.WithSocketPath(*socket),
			stub.WithOnClose(func() { log.Printf("the runtime closed the NRI connection") }))
		if err != nil {
			log.Fatalf("hugepool-nri: %v", err)
		}
		if err := s.Run(ctx); err != nil && ctx.Err() == nil {
			log.Printf("hugepool-nri: %v; connecting again", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
	os.Exit(0)
}

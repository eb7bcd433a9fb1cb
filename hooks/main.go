// hugepool-hooks: the two node hooks of pools claimed through DRA that are
// served in Go, beside the agent.
//
// The NRI plugin. The kubelet gives a container hugetlb limits for the
// hugepages-<size> resources it requests and 0 for every other size, so a
// container using a ResourceClaim of the driver hugepages.hugepool.dev could
// fault none of its pages. The agent's kubelet plugin gives each prepared
// claim a CDI device whose only edit is an environment variable naming the
// claim's pages (HUGEPOOL_PAGES_<claim>_<n>=size=2Mi,numa=0,pages=16). When
// the runtime creates a container, this plugin looks each such variable up
// in the claims the agent prepared (a pod writes its own environment: a
// variable of no claim prepared for the container's pod refuses the
// container), adds the prepared claims' bytes to the container's hugetlb
// limits, binds the
// container's memory to the claims' NUMA nodes, and raises the pod's cgroup
// limits by the pod's claims, which NRI cannot adjust. containerd/nri's stub
// does the NRI connection (its multiplexed ttrpc, registration,
// synchronisation).
//
// The kubelet plugin's registration (--kubelet-registry-dir): GetInfo names
// the agent's DRA socket (registration.go says why it is not the agent's).
//
// docs/design.md, "Pools claimed through DRA".
package main

import (
	"context"
	"flag"
	"log"
	"net/http"
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
	healthAddr := flag.String("health-addr", ":9479", "where /healthz and /readyz answer (ready: synchronised with the runtime); empty: nowhere")
	registry := flag.String("kubelet-registry-dir", "", "serve the registration of the agent's kubelet plugin in this directory (the kubelet's plugins_registry); empty: not")
	endpoint := flag.String("dra-endpoint", "/var/lib/kubelet/plugins/hugepages.hugepool.dev/dra.sock", "the agent's DRA socket, as the kubelet dials it")
	prepared := flag.String("prepared-claims", "/var/lib/kubelet/plugins/hugepages.hugepool.dev/prepared-claims.json", "the claims the agent's kubelet plugin prepared: a container gets pages only from those prepared for its pod")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	plugin := newPlugin(cgroups{root: *cgroupRoot}, *prepared)
	if *healthAddr != "" {
		go serveHealth(*healthAddr, plugin)
	}
	registered := make(chan struct{})
	go func() {
		defer close(registered)
		if *registry == "" {
			return
		}
		if err := serveRegistration(ctx, *registry, *endpoint, plugin.ready.Load); err != nil {
			log.Fatalf("hugepool-hooks: %v", err)
		}
	}()
	// The runtime closes the connection when it restarts: connect again,
	// and synchronise, rather than leave containers created meanwhile
	// without their limits for longer than the restart.
	for ctx.Err() == nil {
		s, err := stub.New(plugin,
			stub.WithPluginName("hugepool"),
			stub.WithPluginIdx(*index),
			stub.WithSocketPath(*socket),
			stub.WithOnClose(func() {
				plugin.ready.Store(false)
				log.Printf("the runtime closed the NRI connection")
			}))
		if err != nil {
			log.Fatalf("hugepool-hooks: %v", err)
		}
		if err := s.Run(ctx); err != nil && ctx.Err() == nil {
			log.Printf("hugepool-hooks: %v; connecting again", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
	// The registration socket goes with the process: the kubelet drops the
	// plugin rather than dial an agent that may be going too.
	<-registered
	os.Exit(0)
}

// serveHealth answers /healthz while the process runs and /readyz while it
// is connected to the runtime and synchronised with it.
func serveHealth(addr string, p *plugin) {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !p.ready.Load() {
			http.Error(w, "not connected to the runtime's NRI socket", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	log.Fatalf("hugepool-hooks: health server: %v", http.ListenAndServe(addr, mux))
}

package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// The kubelet's plugin watcher dials the registration socket by its bare
// path (pkg/kubelet/pluginmanager/operationexecutor, v1.37.2), so its
// :authority is the path: dialled the same way, GetInfo names the agent's
// DRA socket. The socket is there only while the DRA socket listens and
// the NRI plugin is synchronised.
func TestTheKubeletLearnsTheAgentsDRASocketWhileBothHalvesAreUp(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "reg")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	endpoint := filepath.Join(dir, "dra.sock")
	ctx, cancel := context.WithCancel(context.Background())
	var nri atomic.Bool
	done := make(chan error, 1)
	go func() { done <- serveRegistration(ctx, dir, endpoint, nri.Load) }()

	time.Sleep(1500 * time.Millisecond)
	if _, err := os.Stat(registrationSocket(dir)); !os.IsNotExist(err) {
		t.Fatalf("registration served before the DRA socket listens: %v", err)
	}
	agent, err := net.Listen("unix", endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	socket := registrationSocket(dir)
	time.Sleep(1500 * time.Millisecond)
	if _, err := os.Stat(socket); !os.IsNotExist(err) {
		t.Fatalf("registration served before the NRI plugin is synchronised: %v", err)
	}
	nri.Store(true)
	waitFor(t, "a registration socket once both halves are up", func() bool {
		_, err := os.Stat(socket)
		return err == nil
	})
	dialCtx, dialCancel := context.WithTimeout(ctx, 30*time.Second)
	defer dialCancel()
	conn, err := grpc.DialContext(dialCtx, socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := registration.NewRegistrationClient(conn)
	info, err := client.GetInfo(dialCtx, &registration.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo as the kubelet dials it: %v", err)
	}
	if info.Type != "DRAPlugin" || info.Name != "hugepages.hugepool.dev" || info.Endpoint != endpoint ||
		len(info.SupportedVersions) != 1 || info.SupportedVersions[0] != "v1.DRAPlugin" {
		t.Fatalf("GetInfo: %v", info)
	}
	if _, err := client.NotifyRegistrationStatus(dialCtx, &registration.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}

	// The runtime's NRI connection lost: withdrawn; back: served again.
	nri.Store(false)
	waitFor(t, "the registration withdrawn", func() bool {
		_, err := os.Stat(socket)
		return os.IsNotExist(err)
	})
	nri.Store(true)
	waitFor(t, "the registration served again", func() bool {
		_, err := os.Stat(socket)
		return err == nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(socket); !os.IsNotExist(err) {
		t.Fatalf("registration socket left behind: %v", err)
	}
}

// waitFor polls until ok() holds, failing after a minute.
func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not within 60s: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// driver is the DRA driver the agent's kubelet plugin serves.
const driver = "hugepages.hugepool.dev"

// registrar answers the kubelet's plugin watcher for the agent's kubelet
// plugin: GetInfo names the agent's DRA socket. It is here, in Go, because
// the kubelet dials the registration socket with its path as the HTTP/2
// :authority, which the agent's Rust HTTP/2 server refuses as malformed
// (RST_STREAM PROTOCOL_ERROR, kubelet v1.37.2); the kubelet's DRA client
// sends "localhost" and reaches the agent directly.
type registrar struct {
	registration.UnimplementedRegistrationServer
	endpoint string
}

func (r registrar) GetInfo(context.Context, *registration.InfoRequest) (*registration.PluginInfo, error) {
	return &registration.PluginInfo{
		Type:              registration.DRAPlugin,
		Name:              driver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"v1.DRAPlugin"},
	}, nil
}

func (r registrar) NotifyRegistrationStatus(_ context.Context, status *registration.RegistrationStatus) (*registration.RegistrationStatusResponse, error) {
	if status.PluginRegistered {
		log.Printf("the kubelet registered the DRA plugin %s at %s", driver, r.endpoint)
	} else {
		log.Printf("the kubelet refused the DRA plugin %s: %s", driver, status.Error)
	}
	return &registration.RegistrationStatusResponse{}, nil
}

// registrationSocket is where the kubelet's plugin watcher finds the driver.
func registrationSocket(registry string) string {
	return filepath.Join(registry, driver+"-reg.sock")
}

// serveRegistration serves the registration socket while the agent's DRA
// socket accepts connections and ready() holds (the NRI plugin is
// synchronised with the runtime), until ctx ends: the kubelet sees the
// driver only while both halves can do their part, so a claim's pod waits
// (the kubelet retries "not registered") rather than start without its
// hugetlb limits. Between those times the socket is removed, which makes
// the kubelet drop the plugin.
func serveRegistration(ctx context.Context, registry, endpoint string, ready func() bool) error {
	socket := registrationSocket(registry)
	up := func() bool {
		if !ready() {
			return false
		}
		conn, err := net.DialTimeout("unix", endpoint, time.Second)
		if err != nil {
			return false
		}
		conn.Close()
		return true
	}
	for {
		for !up() {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(time.Second):
			}
		}
		if err := serveWhile(ctx, socket, endpoint, up); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		log.Printf("registration of %s withdrawn: the DRA socket or the NRI connection is gone", driver)
	}
}

// serveWhile serves the registration on socket until ctx ends or up()
// fails, then removes the socket.
func serveWhile(ctx context.Context, socket, endpoint string, up func() bool) error {
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("the registration socket: %w", err)
	}
	server := grpc.NewServer()
	registration.RegisterRegistrationServer(server, registrar{endpoint: endpoint})
	stop := make(chan struct{})
	go func() {
		defer server.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-stop:
				return
			case <-time.After(time.Second):
				if !up() {
					return
				}
			}
		}
	}()
	log.Printf("registration of %s served on %s (DRA endpoint %s)", driver, socket, endpoint)
	err = server.Serve(listener)
	close(stop)
	_ = os.Remove(socket)
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

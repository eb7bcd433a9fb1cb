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

// serveRegistration waits until the agent's DRA socket accepts connections
// (the kubelet never registers an endpoint that is not there), then serves
// the registration socket until ctx ends, and removes it so the kubelet
// drops the plugin.
func serveRegistration(ctx context.Context, registry, endpoint string) error {
	for {
		conn, err := net.DialTimeout("unix", endpoint, time.Second)
		if err == nil {
			conn.Close()
			break
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
	socket := registrationSocket(registry)
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("the registration socket: %w", err)
	}
	server := grpc.NewServer()
	registration.RegisterRegistrationServer(server, registrar{endpoint: endpoint})
	go func() {
		<-ctx.Done()
		server.Stop()
	}()
	log.Printf("registration of %s served on %s (DRA endpoint %s)", driver, socket, endpoint)
	err = server.Serve(listener)
	_ = os.Remove(socket)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

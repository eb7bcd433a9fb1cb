package main

import (
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// runEtcd runs a single-member embedded etcd until SIGTERM/SIGINT.
func runEtcd(args []string) error {
	fs := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "etcd data directory")
	clientURL := fs.String("client-url", "", "client listen URL, e.g. http://127.0.0.1:2379")
	peerURL := fs.String("peer-url", "", "peer listen URL, e.g. http://127.0.0.1:2380")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dataDir == "" || *clientURL == "" || *peerURL == "" {
		return errors.New("--data-dir, --client-url and --peer-url are required")
	}
	cu, err := url.Parse(*clientURL)
	if err != nil {
		return err
	}
	pu, err := url.Parse(*peerURL)
	if err != nil {
		return err
	}

	cfg := embed.NewConfig()
	cfg.Name = "controlplane"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	// A test cluster survives process kills (the page cache keeps the data),
	// only a machine crash could lose writes; fsync would dominate latency.
	cfg.UnsafeNoFsync = true

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return err
	}
	defer e.Close()

	select {
	case <-e.Server.ReadyNotify():
		fmt.Fprintf(os.Stderr, "etcd ready, serving clients on %s\n", cu)
	case err := <-e.Err():
		return err
	case <-time.After(2 * time.Minute):
		e.Server.Stop()
		return errors.New("etcd did not become ready within 2m")
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-sig:
		fmt.Fprintf(os.Stderr, "etcd: got %v, stopping\n", s)
		return nil
	case err := <-e.Err():
		return err
	}
}

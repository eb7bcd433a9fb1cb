package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Files under DIR/pki. Existing files are never regenerated, so a kubeconfig
// written by an earlier `up` keeps working.
const (
	caName      = "ca"                 // self-signed CA for serving and client certs
	servingName = "serving"            // apiserver and controller-manager serving cert
	adminName   = "admin"              // client cert in system:masters, used by DIR/kubeconfig
	kcmName     = "controller-manager" // client cert of the controller-manager
	schedName   = "scheduler"          // client cert of the scheduler (--node)
	saKeyName   = "sa"                 // service-account token signing key pair
)

type pki struct {
	dir    string
	caCert *x509.Certificate
	caKey  crypto.Signer
}

func (p *pki) path(name, ext string) string { return filepath.Join(p.dir, name+"."+ext) }

func ensurePKI(dir string) (*pki, error) {
	p := &pki{dir: dir}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	if err := p.ensureCA(); err != nil {
		return nil, err
	}
	// The apiserver's endpoint is 127.0.0.1; the in-cluster names are
	// included so a pod-style client would also verify.
	serving := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 0, 0, 1), net.ParseIP(podGateway)},
	}
	admin := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kubernetes-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	// system:masters because without per-controller service-account
	// credentials the garbage collector and namespace controller act with
	// this identity on every resource type.
	kcm := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "system:kube-controller-manager", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	sched := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "system:kube-scheduler", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for name, tmpl := range map[string]*x509.Certificate{servingName: serving, adminName: admin, kcmName: kcm, schedName: sched} {
		if err := p.ensureLeaf(name, tmpl); err != nil {
			return nil, err
		}
	}
	if err := p.ensureSAKey(); err != nil {
		return nil, err
	}
	return p, nil
}

func exists(paths ...string) bool {
	for _, path := range paths {
		if _, err := os.Stat(path); err != nil {
			return false
		}
	}
	return true
}

func (p *pki) ensureCA() error {
	certPath, keyPath := p.path(caName, "crt"), p.path(caName, "key")
	if exists(certPath, keyPath) {
		pair, err := tls.LoadX509KeyPair(certPath, keyPath)
		if err != nil {
			return fmt.Errorf("loading CA: %w", err)
		}
		p.caCert, err = x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			return err
		}
		signer, ok := pair.PrivateKey.(crypto.Signer)
		if !ok {
			return errors.New("CA key is not a signer")
		}
		p.caKey = signer
		return nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "hugepool-e2e-ca"},
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := sign(tmpl, tmpl, key.Public(), key)
	if err != nil {
		return err
	}
	if p.caCert, err = x509.ParseCertificate(der); err != nil {
		return err
	}
	p.caKey = key
	return writePair(certPath, keyPath, der, key)
}

func (p *pki) ensureLeaf(name string, tmpl *x509.Certificate) error {
	certPath, keyPath := p.path(name, "crt"), p.path(name, "key")
	if exists(certPath, keyPath) {
		return nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := sign(tmpl, p.caCert, key.Public(), p.caKey)
	if err != nil {
		return err
	}
	return writePair(certPath, keyPath, der, key)
}

// ensureNodeCert issues the kubelet's client cert as the Node authorizer
// expects it (system:node:NAME in system:nodes) and returns its name.
func (p *pki) ensureNodeCert(node string) (string, error) {
	name := "node-" + node
	return name, p.ensureLeaf(name, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "system:node:" + node, Organization: []string{"system:nodes"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}

func (p *pki) ensureSAKey() error {
	keyPath, pubPath := p.path(saKeyName, "key"), p.path(saKeyName, "pub")
	if exists(keyPath, pubPath) {
		return nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return err
	}
	if err := writeKey(keyPath, key); err != nil {
		return err
	}
	return writeFileAtomic(pubPath, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644)
}

func sign(tmpl, parent *x509.Certificate, pub crypto.PublicKey, signer crypto.Signer) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	// Backdated to tolerate clock skew; long-lived because DIRs are throwaway.
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
}

func writePair(certPath, keyPath string, der []byte, key *ecdsa.PrivateKey) error {
	if err := writeKey(keyPath, key); err != nil {
		return err
	}
	return writeFileAtomic(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

// writeFileAtomic makes readers (the Rust harness polls DIR) never see a
// partially written file.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// writeKubeconfig writes a kubeconfig with the CA and client cert embedded, so
// it stays valid if DIR moves.
func (p *pki) writeKubeconfig(path, server, user string) error {
	read := func(name, ext string) ([]byte, error) { return os.ReadFile(p.path(name, ext)) }
	ca, err := read(caName, "crt")
	if err != nil {
		return err
	}
	cert, err := read(user, "crt")
	if err != nil {
		return err
	}
	key, err := read(user, "key")
	if err != nil {
		return err
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["controlplane"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}
	cfg.Contexts["controlplane"] = &clientcmdapi.Context{Cluster: "controlplane", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = "controlplane"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, data, 0o600)
}

// tlsConfig returns a client config trusting the CA, optionally presenting
// one of the client certs.
func (p *pki) tlsConfig(user string) (*tls.Config, error) {
	pool := x509.NewCertPool()
	pool.AddCert(p.caCert)
	cfg := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if user != "" {
		pair, err := tls.LoadX509KeyPair(p.path(user, "crt"), p.path(user, "key"))
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

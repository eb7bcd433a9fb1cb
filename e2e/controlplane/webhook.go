package main

// `controlplane webhook`: a validating admission webhook for pods/eviction
// that the fault tests steer through a file, so that they can make the
// Eviction API slow, hang, or refuse a real eviction whose dry run it
// allowed, on the real apiserver.

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const webhookUsage = `controlplane webhook --data-dir DIR --dir WDIR

Serves https://127.0.0.1:PORT/evict with the control plane's serving
certificate (DIR/pki/serving.crt, signed by DIR/pki/ca.crt) and writes
WDIR/addr (host:port) once listening. Every request reads WDIR/mode:

  allow           (or no file) allow
  delay=DURATION  wait DURATION (e.g. 20s), then allow
  delay-real=DURATION
                  allow dry runs at once; real evictions after DURATION
  hang            never answer (the apiserver gives up at the webhook's timeout)
  deny-real       allow dry runs, deny real evictions

and appends "dryRun=BOOL namespace/name mode" to WDIR/requests.
`

func runWebhook(args []string) error {
	fs := flag.NewFlagSet("webhook", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "the control plane's data directory")
	dir := fs.String("dir", "", "the webhook's directory: mode, addr, requests")
	fs.Usage = func() { fmt.Fprint(os.Stderr, webhookUsage) }
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dataDir == "" || *dir == "" {
		fs.Usage()
		return flag.ErrHelp
	}
	pkiDir := filepath.Join(*dataDir, "pki")
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hook := &evictionHook{dir: *dir}
	mux := http.NewServeMux()
	mux.HandleFunc("/evict", hook.serve)
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if err := writeFileAtomic(filepath.Join(*dir, "addr"), []byte(listener.Addr().String()), 0o644); err != nil {
		return err
	}
	return server.ServeTLS(listener, filepath.Join(pkiDir, servingName+".crt"), filepath.Join(pkiDir, servingName+".key"))
}

type evictionHook struct {
	dir string
	mu  sync.Mutex
}

func (h *evictionHook) mode() string {
	data, err := os.ReadFile(filepath.Join(h.dir, "mode"))
	if err != nil {
		return "allow"
	}
	return strings.TrimSpace(string(data))
}

func (h *evictionHook) log(line string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	f, err := os.OpenFile(filepath.Join(h.dir, "requests"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, line)
}

func (h *evictionHook) serve(w http.ResponseWriter, r *http.Request) {
	var review admissionv1.AdmissionReview
	if err := json.NewDecoder(r.Body).Decode(&review); err != nil || review.Request == nil {
		http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
		return
	}
	request := review.Request
	dryRun := request.DryRun != nil && *request.DryRun
	mode := h.mode()
	h.log(fmt.Sprintf("dryRun=%t %s/%s %s", dryRun, request.Namespace, request.Name, mode))
	allowed, message := true, ""
	switch {
	case strings.HasPrefix(mode, "delay="),
		strings.HasPrefix(mode, "delay-real=") && !dryRun:
		wait, err := time.ParseDuration(mode[strings.Index(mode, "=")+1:])
		if err == nil {
			select {
			case <-time.After(wait):
			case <-r.Context().Done():
				return
			}
		}
	case mode == "hang":
		<-r.Context().Done()
		return
	case mode == "deny-real" && !dryRun:
		allowed, message = false, "the fault test's webhook refuses real evictions"
	}
	response := &admissionv1.AdmissionResponse{UID: request.UID, Allowed: allowed}
	if !allowed {
		response.Result = &metav1.Status{Message: message, Code: http.StatusForbidden}
	}
	review.Response = response
	review.Request = nil
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(review)
}

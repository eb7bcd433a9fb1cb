package main

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// unlimited is a limit of "max" (v2) or the v1 controller's largest value.
const unlimited = math.MaxUint64

// cgroups writes pod cgroups' hugetlb limits under root: cgroup v1 (the
// hugetlb hierarchy at root/hugetlb: hugetlb.<size>.limit_in_bytes and,
// where the kernel has them, .rsvd.limit_in_bytes) or v2 (root holds
// cgroup.controllers: hugetlb.<size>.max and .rsvd.max).
type cgroups struct {
	root string
}

func (c cgroups) unified() bool {
	_, err := os.Stat(filepath.Join(c.root, "cgroup.controllers"))
	return err == nil
}

// dir is the pod cgroup's directory for the kubelet's cgroup parent, with
// the cgroupfs driver (/kubepods/burstable/pod<uid>) or the systemd one
// (kubepods-burstable-pod<uid>.slice, nested under each prefix's slice).
func (c cgroups) dir(parent string) (string, error) {
	if parent == "" {
		return "", errors.New("the pod has no cgroup parent")
	}
	path := parent
	if strings.HasSuffix(parent, ".slice") && !strings.Contains(parent, "/") {
		path = expandSlice(parent)
	}
	if c.unified() {
		return filepath.Join(c.root, path), nil
	}
	return filepath.Join(c.root, "hugetlb", path), nil
}

// expandSlice turns a systemd slice name into its path:
// a-b-c.slice is a.slice/a-b.slice/a-b-c.slice.
func expandSlice(slice string) string {
	name := strings.TrimSuffix(slice, ".slice")
	parts := strings.Split(name, "-")
	path := make([]string, len(parts))
	for i := range parts {
		path[i] = strings.Join(parts[:i+1], "-") + ".slice"
	}
	return filepath.Join(path...)
}

func (c cgroups) files(label string) (limit, reserved string) {
	if c.unified() {
		return "hugetlb." + label + ".max", "hugetlb." + label + ".rsvd.max"
	}
	return "hugetlb." + label + ".limit_in_bytes", "hugetlb." + label + ".rsvd.limit_in_bytes"
}

// podLimit reads the pod cgroup's limit for one page size.
func (c cgroups) podLimit(parent, label string) (uint64, error) {
	dir, err := c.dir(parent)
	if err != nil {
		return 0, err
	}
	limit, _ := c.files(label)
	raw, err := os.ReadFile(filepath.Join(dir, limit))
	if err != nil {
		return 0, fmt.Errorf("the pod's hugetlb limit: %w", err)
	}
	text := strings.TrimSpace(string(raw))
	if text == "max" {
		return unlimited, nil
	}
	v, err := strconv.ParseUint(text, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("the pod's hugetlb limit %s: %q: %w", filepath.Join(dir, limit), text, err)
	}
	// v1 prints its largest value, a multiple of the page below 2^63.
	if v >= math.MaxInt64-(1<<30) {
		return unlimited, nil
	}
	return v, nil
}

// setPodLimit writes the pod cgroup's limit, and its reservation limit
// where the kernel has one, for one page size; an unlimited pod is left so.
func (c cgroups) setPodLimit(parent, label string, bytes uint64) error {
	dir, err := c.dir(parent)
	if err != nil {
		return err
	}
	current, err := c.podLimit(parent, label)
	if err != nil {
		return err
	}
	if current == unlimited || current == bytes {
		return nil
	}
	limit, reserved := c.files(label)
	value := []byte(strconv.FormatUint(bytes, 10))
	// Reservations first when raising (a reservation above its limit is
	// allowed; a fault is checked against both), last when lowering.
	order := []string{reserved, limit}
	if bytes < current {
		order = []string{limit, reserved}
	}
	for _, file := range order {
		path := filepath.Join(dir, file)
		if file == reserved {
			if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
				continue
			}
		}
		if err := os.WriteFile(path, value, 0o644); err != nil {
			return fmt.Errorf("the pod's hugetlb limit: %w", err)
		}
	}
	return nil
}

//go:build tools

// Package tools names Prometheus' and promtool's main packages. go.sum holds what they need with the
// build tags install.sh uses; after changing the version in go.mod, refresh it with
//   GOFLAGS=-mod=mod go list -tags remove_all_sd,enable_kubernetes_sd -deps \
//     github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)

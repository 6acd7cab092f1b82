//go:build tools

// Package tools pins helm's main package so `go mod tidy` keeps its dependencies in go.sum.
package tools

import _ "helm.sh/helm/v4/cmd/helm"

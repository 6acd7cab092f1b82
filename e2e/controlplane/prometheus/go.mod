// Module wrapper that pins Prometheus (server and promtool) for Lockstep's monitoring tests.
// Built by e2e/controlplane/prometheus/install.sh with -tags remove_all_sd,enable_kubernetes_sd
// (Kubernetes pod discovery only, as manifests/monitoring/prometheus.yaml uses).
module lockstep.dev/e2e/controlplane/prometheus

go 1.26.7

require github.com/prometheus/prometheus v0.316.0

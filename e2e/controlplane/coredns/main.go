// Command coredns is CoreDNS with only the plugins the local cluster's real node uses, so that it
// builds in a fraction of the time of the full plugin set (which links every cloud provider's SDK).
// Built by e2e/controlplane/node/build.sh; started by e2e/controlplane/realnode.py.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func main() {
	coremain.Run()
}

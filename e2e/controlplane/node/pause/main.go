// Command pause holds a pod's namespaces open: it sleeps until SIGTERM/SIGINT and reaps any child
// that ends up parented to it (it is PID 1 of the sandbox). Packed into the sandbox image by
// e2e/controlplane/node/images.py, because no registry (and so no upstream pause image) is reachable.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

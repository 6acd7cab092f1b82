// The sandbox (pause) process of the real node's pods; no dependencies. Built by ../build.sh.
module lockstep.dev/e2e/controlplane/node/pause

go 1.25.0

// coredns: the real node's cluster DNS, CoreDNS with only the plugins a one-node test cluster
// needs (the kubernetes plugin answers Service names; forward sends the rest to the host's resolver).
// Built from CoreDNS's own Go module by scripts/get-k8s.sh --node, as CoreDNS documents for a custom
// plugin set: the directives list picks the plugins and their order.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"errors", "log", "health", "ready", "cache", "kubernetes", "forward"}
}

func main() { coremain.Run() }

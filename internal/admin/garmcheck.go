package admin

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// GuardConfEnv names the network guard's configuration file, as for the
// hook itself (deploy/network/libvirt-executor-guard).
const GuardConfEnv = "LIBVIRT_EXECUTOR_GUARD_CONF"

// DefaultGuardConf is where the guard's configuration is installed.
const DefaultGuardConf = "/etc/libvirt/hooks/libvirt-executor-guard.conf"

// guardConfPath is the guard configuration doctor reads.
func guardConfPath() string {
	if p := os.Getenv(GuardConfEnv); p != "" {
		return p
	}
	return DefaultGuardConf
}

// garmEndpointChecks checks each of garm.endpoints: it answers from this
// host, and when it is the job network's own address (where the guard
// decides what guests reach) the guard lets the guests reach its port.
// gateway is the network's address on the host ("" when unknown).
func garmEndpointChecks(ctx context.Context, cfg *config.Config, gateway, guardConf string) []Check {
	var out []Check
	for _, e := range cfg.Garm.Endpoints {
		c := Check{Name: "garm endpoint " + e}
		origin, err := config.Origin(e)
		if err != nil {
			c.Info, c.Fix = err.Error(), "fix garm.endpoints"
			out = append(out, c)
			continue
		}
		u, _ := url.Parse(origin)
		host, port := u.Hostname(), u.Port()
		if !cfg.LocalLibvirt() {
			// The guests are another host's: what answers here may not
			// answer there, and that host's guard decides what they reach.
			c.OK, c.Warn = true, true
			c.Info = fmt.Sprintf("not checked from here: the guests run on the host of %s; its guard configuration must let network %q reach port %s of %s", cfg.LibvirtURI, cfg.Network, port, host)
			c.Fix = "on that host: libvirt-executor doctor with this [garm] section and libvirt_uri = \"qemu:///system\""
			out = append(out, c)
			continue
		}
		if gateway != "" && host == gateway {
			if g := guardAllows(guardConf, cfg.Network, port); !g.OK || g.Warn {
				g.Name = c.Name
				out = append(out, g)
				if !g.OK {
					continue
				}
			}
		}
		dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		conn, err := (&net.Dialer{}).DialContext(dctx, "tcp", net.JoinHostPort(host, port))
		cancel()
		if err != nil {
			c.Info = fmt.Sprintf("%s does not answer from this host: %v", net.JoinHostPort(host, port), err)
			c.Fix = "start garm (or the download mirror) there, or correct garm.endpoints"
			out = append(out, c)
			continue
		}
		_ = conn.Close()
		c.OK, c.Info = true, "answers"
		if gateway != "" && host == gateway {
			c.Info += "; the guard lets the guests reach port " + port
		} else {
			c.Info += " (the guests reach it through the network's NAT, not checked from inside a guest)"
		}
		out = append(out, c)
	}
	return out
}

// guardAllows says whether the guard configuration lets guests of network
// reach port on the host. OK and Warn: the network is not guarded at all
// (guests reach every host port), or the configuration cannot be read.
func guardAllows(conf, network, port string) Check {
	fix := fmt.Sprintf("list port %s on the line of network %q in %s, then restart the network (virsh net-destroy %s && virsh net-start %s)", port, network, conf, network, network)
	f, err := os.Open(conf)
	if err != nil {
		return Check{OK: true, Warn: true, Info: fmt.Sprintf("cannot read the guard's configuration (%v): whether the guests may reach port %s is not checked", err, port),
			Fix: "run doctor as root, or set " + GuardConfEnv + " to the guard's configuration"}
	}
	defer f.Close()
	want, err := strconv.Atoi(port)
	if err != nil {
		return Check{Info: fmt.Sprintf("port %q is not a number", port), Fix: "correct garm.endpoints"}
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") || fields[0] != network {
			continue
		}
		if len(fields) > 1 && portListed(fields[1], want) {
			return Check{OK: true}
		}
		allowed := "none"
		if len(fields) > 1 {
			allowed = fields[1]
		}
		return Check{Info: fmt.Sprintf("the guard keeps the guests of network %q from port %s of the host (allowed: %s)", network, port, allowed), Fix: fix}
	}
	return Check{OK: true, Warn: true, Info: fmt.Sprintf("network %q is not guarded (%s does not list it): its guests reach every port of the host", network, conf),
		Fix: "guard the network (docs/security.md) and list garm's port for it"}
}

// portListed says whether an iptables port list (8080 | 3128,8080 |
// 20000:20999) holds port.
func portListed(list string, port int) bool {
	for _, item := range strings.Split(list, ",") {
		lo, hi, ok := strings.Cut(item, ":")
		if !ok {
			hi = lo
		}
		l, err1 := strconv.Atoi(lo)
		h, err2 := strconv.Atoi(hi)
		if err1 == nil && err2 == nil && l <= port && port <= h {
			return true
		}
	}
	return false
}

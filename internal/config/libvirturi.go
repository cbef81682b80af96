package config

import (
	"net/url"
	"strings"
)

// uriParam is one parameter of a libvirt URI's query, as libvirt reads it.
type uriParam struct{ name, value string }

// libvirtParams splits a libvirt URI's raw query as libvirt does
// (virURIParseParams): sections end at the next '&' or, when none is left,
// at the next ';'; "name" alone has the value ""; "=value" is skipped; both
// sides are %-unescaped ('+' stays '+'). Go's url.Query differs (it skips a
// section with a ';' in it), so what libvirt will act on is read here.
func libvirtParams(query string) []uriParam {
	var params []uriParam
	for query != "" {
		end := strings.IndexByte(query, '&')
		if end < 0 {
			end = strings.IndexByte(query, ';')
		}
		if end < 0 {
			end = len(query)
		}
		section := query[:end]
		query = query[min(end+1, len(query)):]
		name, value, _ := strings.Cut(section, "=")
		if name == "" {
			continue // "" (as in "&&") or "=value"
		}
		params = append(params, uriParam{unescapeParam(name), unescapeParam(value)})
	}
	return params
}

func unescapeParam(s string) string {
	if u, err := url.PathUnescape(s); err == nil {
		return u
	}
	return s
}

// lastParam is the value libvirt's remote driver takes for name: names match
// in any case and the last one given wins. ok is false when it is absent.
func lastParam(params []uriParam, name string) (value string, ok bool) {
	for _, p := range params {
		if strings.EqualFold(p.name, name) {
			value, ok = p.value, true
		}
	}
	return value, ok
}

// validateHostVerification checks what a libvirt URI says of checking the
// other end: no no_verify (remote only: it is what validateRemote reports)
// and, for the libssh transports (every libssh URI goes through SSH, to
// localhost too), no known_hosts_verify but normal, libvirt's default.
func validateHostVerification(p *problems, u *url.URL, remote bool) {
	params := libvirtParams(u.RawQuery)
	if v, ok := lastParam(params, "no_verify"); remote && ok && v != "" && v != "0" {
		p.bad("libvirt_uri", "no_verify=%s accepts any host as %s: pin its key (ssh) or certificate (tls) instead", v, u.Hostname())
	}
	_, transport, _ := strings.Cut(strings.ToLower(u.Scheme), "+")
	if transport != "libssh" && transport != "libssh2" {
		return
	}
	if v, ok := lastParam(params, "known_hosts_verify"); ok && !strings.EqualFold(v, "normal") {
		p.bad("libvirt_uri", "known_hosts_verify %q is not allowed (allowed: normal, libvirt's default): "+
			"ignore accepts any host as %s and auto adds an unknown host's key without asking; pin the host's key in known_hosts instead", v, u.Hostname())
	}
}

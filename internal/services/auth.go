package services

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// Credential is one of the job payload's `credentials`: GitLab sends the
// job token for its own container registry this way (type "registry").
type Credential struct {
	Type     string `json:"type"`
	URL      string `json:"url"`
	Username string `json:"username"`
	Password string `json:"password"`
}

// AuthPath is where the guest gets the registry credentials of a job's
// pulls (podman pull --authfile), mode 0600, removed once the pulls are
// done: a secret never stays readable in the guest for the job's scripts.
const AuthPath = "/run/lve-services-auth.json"

// Bounds on what a job may hand over as credentials.
const (
	maxAuthConfig  = 64 << 10 // DOCKER_AUTH_CONFIG's bytes
	maxAuthEntries = 32       // registries
	maxSecretLen   = 4 << 10  // a user name or password
)

// hostRE is a registry as podman's auth file keys it: a DNS name or an
// IPv4 address, with an optional port, and optionally a repository path
// (credentials for that namespace only).
var hostRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?(/[a-z0-9._-]+)*$`)

// registryHost turns what a job names a registry by (a host, a host with a
// port, or a URL such as https://index.docker.io/v1/) into the key of the
// auth file; ok is false for anything else.
func registryHost(s string) (string, bool) {
	s = strings.TrimSpace(s)
	if strings.Contains(s, "://") {
		u, err := url.Parse(s)
		if err != nil || u.Host == "" {
			return "", false
		}
		s = u.Host
	}
	s = strings.TrimSuffix(s, "/")
	if len(s) > 512 || !hostRE.MatchString(s) {
		return "", false
	}
	switch strings.ToLower(s) {
	case "index.docker.io", "registry-1.docker.io", "docker.io":
		return "docker.io", true
	}
	return strings.ToLower(s), true
}

// authEntry is one registry's entry in containers-auth.json.
type authEntry struct {
	Auth string `json:"auth"`
}

// AuthFile is the containers-auth.json a job's pulls use: the job's
// DOCKER_AUTH_CONFIG variable first (its "auths": each entry's "auth", or
// "username" and "password"), then the payload's registry credentials for
// registries it did not name, as GitLab Runner's Docker executor orders
// them. nil when the job gives none. An entry it cannot use (a credential
// helper's or an identity token's, a key that is no registry) is skipped
// with a note for the job log; DOCKER_AUTH_CONFIG that is no JSON object
// or too long is an error. Notes and errors name the variable or the
// credential's place, never a value.
func AuthFile(p *Payload) (file []byte, notes []string, err error) {
	auths := map[string]authEntry{}
	for _, v := range p.Variables {
		if v.Key != "DOCKER_AUTH_CONFIG" || v.Value == "" {
			continue
		}
		if len(v.Value) > maxAuthConfig {
			return nil, nil, exitcodes.Userf("DOCKER_AUTH_CONFIG: longer than %d bytes", maxAuthConfig)
		}
		var dc struct {
			Auths map[string]struct {
				Auth     string `json:"auth"`
				Username string `json:"username"`
				Password string `json:"password"`
			} `json:"auths"`
		}
		if err := json.Unmarshal([]byte(v.Value), &dc); err != nil {
			return nil, nil, exitcodes.Userf(`DOCKER_AUTH_CONFIG: not a JSON object of the shape {"auths": {"REGISTRY": {"auth": "BASE64(USER:PASSWORD)"}}}`)
		}
		hosts := make([]string, 0, len(dc.Auths))
		for h := range dc.Auths {
			hosts = append(hosts, h)
		}
		slices.Sort(hosts)
		for _, h := range hosts {
			e := dc.Auths[h]
			host, ok := registryHost(h)
			if !ok {
				notes = append(notes, fmt.Sprintf("DOCKER_AUTH_CONFIG: entry %q skipped: not a registry (HOST, HOST:PORT, HOST/PATH or https://HOST/)", clipName(h)))
				continue
			}
			a := e.Auth
			if a == "" && e.Username != "" {
				a = base64.StdEncoding.EncodeToString([]byte(e.Username + ":" + e.Password))
			}
			if !validAuth(a) {
				notes = append(notes, fmt.Sprintf("DOCKER_AUTH_CONFIG: entry for %s skipped: no \"auth\" (base64 of USER:PASSWORD) or \"username\" and \"password\" (credential helpers and identity tokens are not used)", host))
				continue
			}
			auths[host] = authEntry{Auth: a}
		}
	}
	for i, c := range p.Credentials {
		if c.Type != "registry" {
			continue
		}
		host, ok := registryHost(c.URL)
		if !ok {
			notes = append(notes, fmt.Sprintf("credentials[%d] skipped: %q is not a registry", i, clipName(c.URL)))
			continue
		}
		if _, named := auths[host]; named {
			continue
		}
		if c.Username == "" || len(c.Username) > maxSecretLen || len(c.Password) > maxSecretLen || strings.Contains(c.Username, ":") {
			notes = append(notes, fmt.Sprintf("credentials[%d] (%s) skipped: not a user name without ':' and a password of at most %d bytes each", i, host, maxSecretLen))
			continue
		}
		auths[host] = authEntry{Auth: base64.StdEncoding.EncodeToString([]byte(c.Username + ":" + c.Password))}
	}
	if len(auths) == 0 {
		return nil, notes, nil
	}
	if len(auths) > maxAuthEntries {
		return nil, nil, exitcodes.Userf("registry credentials for %d registries: at most %d", len(auths), maxAuthEntries)
	}
	b, err := json.Marshal(struct {
		Auths map[string]authEntry `json:"auths"`
	}{auths})
	if err != nil {
		return nil, nil, fmt.Errorf("registry credentials: %w", err)
	}
	return b, notes, nil
}

// validAuth: base64 of USER:PASSWORD, bounded.
func validAuth(a string) bool {
	if a == "" || len(a) > 2*maxSecretLen {
		return false
	}
	b, err := base64.StdEncoding.DecodeString(a)
	if err != nil {
		return false
	}
	u, _, ok := strings.Cut(string(b), ":")
	return ok && u != ""
}

// clipName shows at most 64 bytes of a name a job gave.
func clipName(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

package services

import (
	"fmt"
	"regexp"
	"strings"
)

// Allowlist matches image names against an administrator's patterns, as
// GitLab Runner's allowed_images and allowed_services do: "*" matches
// within one path component (no "/"), "**" matches across components, "?"
// one character that is not "/"; everything else matches itself. An empty
// list allows every image.
type Allowlist struct {
	patterns []string
	res      []*regexp.Regexp
}

// NewAllowlist compiles the patterns; a pattern that is empty or longer
// than MaxImageName is an error naming it.
func NewAllowlist(patterns []string) (*Allowlist, error) {
	a := &Allowlist{patterns: patterns}
	for _, p := range patterns {
		if p == "" || len(p) > MaxImageName {
			return nil, fmt.Errorf("image pattern %q: must be 1 to %d characters", p, MaxImageName)
		}
		var b strings.Builder
		b.WriteString("^")
		for i := 0; i < len(p); i++ {
			switch {
			case strings.HasPrefix(p[i:], "**"):
				b.WriteString(".*")
				i++
			case p[i] == '*':
				b.WriteString("[^/]*")
			case p[i] == '?':
				b.WriteString("[^/]")
			default:
				b.WriteString(regexp.QuoteMeta(p[i : i+1]))
			}
		}
		b.WriteString("$")
		a.res = append(a.res, regexp.MustCompile(b.String()))
	}
	return a, nil
}

// Allows reports whether name (as the job wrote it, after variable
// expansion) or its fully qualified form (ref) matches a pattern.
func (a *Allowlist) Allows(name string, ref Ref) bool {
	if a == nil || len(a.res) == 0 {
		return true
	}
	_, ok := a.Match(name, ref)
	return ok
}

// Match is the first pattern that name or ref matches, in the order
// configured; ok is false when none does (an empty list matches nothing
// here: Allows is the check where empty means any).
func (a *Allowlist) Match(name string, ref Ref) (pattern string, ok bool) {
	if a == nil {
		return "", false
	}
	full := ref.String()
	for i, re := range a.res {
		if re.MatchString(name) || re.MatchString(full) {
			return a.patterns[i], true
		}
	}
	return "", false
}

// Patterns are the patterns as configured (for messages).
func (a *Allowlist) Patterns() []string {
	if a == nil {
		return nil
	}
	return a.patterns
}

package services

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The aliases GitLab Runner's Docker executor derives (its documented
// cases): the tag or digest dropped, the registry's port dropped and its
// host kept, "/" as "__" and, where that differs, as "-".
func TestDerivedAliases(t *testing.T) {
	digest := "@sha256:" + strings.Repeat("ab", 32)
	for name, want := range map[string][]string{
		"postgres":                                 {"postgres"},
		"postgres:15":                              {"postgres"},
		"postgres" + digest:                        {"postgres"},
		"group/img":                                {"group__img", "group-img"},
		"group/img:1.2":                            {"group__img", "group-img"},
		"domain.tld/svc":                           {"domain.tld__svc", "domain.tld-svc"},
		"domain.tld:8080/ns/svc:v":                 {"domain.tld__ns__svc", "domain.tld-ns-svc"},
		"sub.domain.tld:8080/svc" + digest:         {"sub.domain.tld__svc", "sub.domain.tld-svc"},
		"localhost:5000/redis":                     {"localhost__redis", "localhost-redis"},
		"registry.example:5000/team/db:1":          {"registry.example__team__db", "registry.example-team-db"},
		"registry.example:5000/team/db:1" + digest: {"registry.example__team__db", "registry.example-team-db"},
	} {
		require.Equal(t, want, DerivedAliases(name), name)
	}
}

func TestUserAliases(t *testing.T) {
	require.Equal(t, []string{"db", "pg", "sql"}, UserAliases("db,pg sql"))
	require.Equal(t, []string{"db"}, UserAliases(" db , "))
	require.Empty(t, UserAliases(""))
}

func TestParseRef(t *testing.T) {
	digest := "sha256:" + strings.Repeat("ab", 32)
	for name, want := range map[string]string{
		"postgres":                        "docker.io/library/postgres:latest",
		"postgres:15":                     "docker.io/library/postgres:15",
		"bitnami/redis:7":                 "docker.io/bitnami/redis:7",
		"registry.example:5000/team/db:1": "registry.example:5000/team/db:1",
		"localhost:5000/redis":            "localhost:5000/redis:latest",
		"redis@" + digest:                 "docker.io/library/redis@" + digest,
		"redis:7@" + digest:               "docker.io/library/redis:7@" + digest,
	} {
		r, err := ParseRef(name)
		require.NoError(t, err, name)
		require.Equal(t, want, r.String(), name)
	}
	for _, bad := range []string{"", "Postgres", "-x", "a b", "redis:", "redis@sha256:12", "x;rm -rf /", "$(id)",
		"a/../b", strings.Repeat("a", MaxImageName+1)} {
		_, err := ParseRef(bad)
		require.Error(t, err, bad)
	}
}

func TestValidAlias(t *testing.T) {
	for _, ok := range []string{"db", "domain.tld__svc", "a-b", "A1"} {
		require.True(t, ValidAlias(ok), ok)
	}
	for _, bad := range []string{"", "-db", "db-", "a b", "a\nb", "a#b", "a/b", strings.Repeat("a", MaxAlias+1)} {
		require.False(t, ValidAlias(bad), bad)
	}
}

func TestAllowlist(t *testing.T) {
	a, err := NewAllowlist([]string{"postgres:*", "registry.example:5000/**", "docker.io/library/redis:?"})
	require.NoError(t, err)
	check := func(name string) bool {
		r, err := ParseRef(name)
		require.NoError(t, err, name)
		return a.Allows(name, r)
	}
	require.True(t, check("postgres:15"))
	require.False(t, check("postgres/evil:15"), "* stays within a component")
	require.True(t, check("registry.example:5000/team/db:1"), "** crosses components")
	require.True(t, check("redis:7"), "the fully qualified form matches too")
	require.False(t, check("redis:77"))
	require.False(t, check("mysql:8"))
	none, err := NewAllowlist(nil)
	require.NoError(t, err)
	require.True(t, none.Allows("anything", Ref{}))
	_, err = NewAllowlist([]string{""})
	require.ErrorContains(t, err, "must be 1 to")
}

func TestNetworkName(t *testing.T) {
	require.Equal(t, "lve-job-42", NetworkName(42))
	require.Equal(t, "lve-services", NetworkName(0))
}

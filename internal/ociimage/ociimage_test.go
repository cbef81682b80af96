package ociimage

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseSource(t *testing.T) {
	for _, ok := range []string{
		"oci://registry.example:5000/vm/tiny:v1",
		"oci://127.0.0.1:5000/tiny:latest",
		"oci://ghcr.io/org/images/debian@sha256:" + strings.Repeat("a", 64),
	} {
		src, err := ParseSource(ok)
		require.NoError(t, err, ok)
		require.Equal(t, ok, src.String())
	}
	src, _ := ParseSource("oci://r.example/x@sha256:" + strings.Repeat("b", 64))
	require.True(t, src.Pinned())
	src, _ = ParseSource("oci://r.example/x:v1")
	require.False(t, src.Pinned())
	for bad, want := range map[string]string{
		"/var/lib/images/tiny.qcow2":                    "must start with oci://",
		"docker://r.example/x:v1":                       "must start with oci://",
		"oci://r.example/x":                             "names no tag or digest",
		"oci://r.example/X:v1":                          "invalid",
		"oci://r.example/x@sha256:1234":                 "invalid",
		"oci://r.example/x@sha512:" + "0":               "invalid",
		"oci://r.example/x:v1; rm -rf /":                "invalid",
		"oci://r.example/../../etc/passwd:v1":           "invalid",
		"oci://r.example/x:" + strings.Repeat("t", 200): "invalid",
	} {
		_, err := ParseSource(bad)
		require.Error(t, err, bad)
		require.Contains(t, strings.ToLower(err.Error()), want, bad)
	}
}

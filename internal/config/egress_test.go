package config

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseEgress(t *testing.T) {
	for in, want := range map[string]string{
		"10.1.0.0/16": "10.1.0.0/16 0", "10.1.2.3": "10.1.2.3/32 0", "10.1.0.0/16:443": "10.1.0.0/16 443",
		"10.1.2.3:53": "10.1.2.3/32 53", "0.0.0.0/0": "0.0.0.0/0 0", "0.0.0.0/0:65535": "0.0.0.0/0 65535",
	} {
		e, err := ParseEgress(in)
		require.NoError(t, err, in)
		require.Equal(t, want, fmt.Sprintf("%s %d", e.Net, e.Port), in)
	}
	for in, why := range map[string]string{
		"10.1.0.1/16":  "host bits set (the network is 10.1.0.0/16)",
		"10.1.0.0/33":  "not an IPv4 CIDR",
		"fd00::/8":     "the port must be a number", // the last ':' is taken for a port
		"fd00::1:80":   "not an IPv4 address",
		"10.1.2.3:0":   "the port must be a number 1-65535",
		"10.1.2.3:080": "the port must be a number 1-65535",
		"10.1.2.3:x":   "the port must be a number 1-65535",
		"10.1.2.3:":    "the port must be a number 1-65535",
		":443":         "no address",
		"example.com":  "not an IPv4 address",
		"":             "no address",
	} {
		_, err := ParseEgress(in)
		require.ErrorContains(t, err, why, in)
		require.ErrorContains(t, err, "allowed forms:", in)
		require.ErrorContains(t, err, fmt.Sprintf("%q", in))
	}
}

func TestEgressAllowConfig(t *testing.T) {
	img := "[images.a]\nbase = \"/a.qcow2\"\n"
	c, err := Parse([]byte(img))
	require.NoError(t, err)
	require.True(t, *c.L2Filter, "on by default")
	require.Nil(t, c.Images["a"].Egress(), "unset: no limit")

	c, err = Parse([]byte(img + "egress_allow = []\n"))
	require.NoError(t, err)
	require.NotNil(t, c.Images["a"].Egress(), "empty: the gateway only")
	require.Empty(t, c.Images["a"].Egress())

	c, err = Parse([]byte(img + "egress_allow = [\"10.1.0.0/16\", \"10.2.3.4:443\"]\n"))
	require.NoError(t, err)
	require.Len(t, c.Images["a"].Egress(), 2)
	require.Equal(t, 443, c.Images["a"].Egress()[1].Port)

	_, err = Parse([]byte(img + "egress_allow = [\"10.1.0.0/16\", \"10.2.3.4:http\"]\n"))
	require.ErrorContains(t, err, `images.a.egress_allow[1]: "10.2.3.4:http": the port must be a number 1-65535; allowed forms:`)

	_, err = Parse([]byte("l2_filter = false\n" + img + "egress_allow = [\"10.1.0.0/16\"]\n"))
	require.ErrorContains(t, err, "images.a.egress_allow: needs l2_filter = true")

	many := make([]string, maxEgress+1)
	for i := range many {
		many[i] = fmt.Sprintf("%q", fmt.Sprintf("10.0.%d.0/24", i))
	}
	_, err = Parse([]byte(img + "egress_allow = [" + strings.Join(many, ",") + "]\n"))
	require.ErrorContains(t, err, "65 entries: at most 64")
}

func TestGarmPorts(t *testing.T) {
	c, err := Parse([]byte("[images.a]\nbase = \"/a.qcow2\"\n"))
	require.NoError(t, err)
	require.Empty(t, c.GarmPorts())
	c.Garm.Endpoints = []string{"http://192.168.150.1:9997", "https://192.168.150.1", "http://192.168.150.1:9997/x"}
	require.Equal(t, []int{9997, 443}, c.GarmPorts())
}

package registrytest

import (
	"net"
	"net/http"
	"testing"
)

// A registry started with a login answers 401 without it and 200 with it.
func TestStartWithLogin(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	r := StartWithLogin(t, addr, "ci", "pw-1")
	get := func(user, pw string) int {
		req, err := http.NewRequest(http.MethodGet, "http://"+r.Host+"/v2/", nil)
		if err != nil {
			t.Fatal(err)
		}
		if user != "" {
			req.SetBasicAuth(user, pw)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if c := get("", ""); c != http.StatusUnauthorized {
		t.Fatalf("without a login: %d, want 401", c)
	}
	if c := get("ci", "wrong"); c != http.StatusUnauthorized {
		t.Fatalf("a wrong password: %d, want 401", c)
	}
	if c := get("ci", "pw-1"); c != http.StatusOK {
		t.Fatalf("the login: %d, want 200", c)
	}
}

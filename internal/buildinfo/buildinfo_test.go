package buildinfo

import "testing"

func TestString(t *testing.T) {
	defer func(v, c, d string) { Version, Commit, Date = v, c, d }(Version, Commit, Date)
	Version, Commit, Date = "0.0.300+gabc1234", "abc1234def", "2026-11-27T21:00:00Z"
	if got, want := String(), "0.0.300+gabc1234 (commit abc1234def, built 2026-11-27T21:00:00Z), MIT License"; got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}
	Commit, Date = "", ""
	if got, want := String(), "0.0.300+gabc1234 (commit unknown, built unknown), MIT License"; got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}
}

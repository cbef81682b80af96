package config

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// docKeys reads the key tables of docs/configuration.md: under each
// second-level heading that names a table ("## `[limits]`: ...",
// "## `[images.NAME.pool]`: ...", or "## Top level"), every Markdown table
// whose first column is headed "key" lists its keys, each written as
// `key` in the first cell (several in one cell: "`kernel`, `initrd`").
// Names in capitals (NAME) stand for any name: MapKey. It returns each
// key, dotted with its table, and the text of its row.
func docKeys(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var (
		tableRE    = regexp.MustCompile("^## `\\[([a-zA-Z0-9_.]+)\\]`")
		tickRE     = regexp.MustCompile("`([^`]+)`")
		keyRE      = regexp.MustCompile(`^[a-z0-9_]+(\.([a-z0-9_]+|[A-Z]+))*$`)
		heading    string
		section    *string // the table the heading names; nil: none
		inKeys     bool    // in a key table's rows
		out        = map[string]string{}
		lineNo     int
		toWildcard = func(k string) string {
			parts := strings.Split(k, ".")
			for i, p := range parts {
				if strings.ToUpper(p) == p && strings.ToLower(p) != p {
					parts[i] = MapKey
				}
			}
			return strings.Join(parts, ".")
		}
	)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		lineNo++
		switch {
		case strings.HasPrefix(line, "## "):
			heading, section, inKeys = line, nil, false
			if m := tableRE.FindStringSubmatch(line); m != nil {
				s := toWildcard(m[1]) + "."
				section = &s
			} else if line == "## Top level" {
				s := ""
				section = &s
			}
		case !strings.HasPrefix(line, "|"):
			inKeys = false
		default:
			cells := strings.Split(strings.Trim(line, "| "), "|")
			first := strings.TrimSpace(cells[0])
			switch {
			case first == "key":
				if section == nil {
					return nil, fmt.Errorf("%s:%d: a key table under %q, which names no table (\"## `[TABLE]`: ...\")", path, lineNo, heading)
				}
				inKeys = true
			case !inKeys || strings.Trim(first, "- :") == "":
			default:
				keys := tickRE.FindAllStringSubmatch(first, -1)
				if len(keys) == 0 {
					return nil, fmt.Errorf("%s:%d: a row of a key table without a `key`", path, lineNo)
				}
				for _, k := range keys {
					if !keyRE.MatchString(k[1]) {
						return nil, fmt.Errorf("%s:%d: %q is not a key", path, lineNo, k[1])
					}
					out[*section+toWildcard(k[1])] = line
				}
			}
		}
	}
	return out, sc.Err()
}

// docsDisagree lists the keys of the configuration (code: Keys) missing
// from the documented ones (docs: docKeys), and the documented keys that
// the configuration does not have.
func docsDisagree(code []string, docs map[string]string, path string) []string {
	var out []string
	for _, k := range code {
		if _, ok := docs[k]; ok {
			continue
		}
		// A named table's keys may be listed in the row of the table
		// itself: `flavors.NAME` ... `vcpus` 1-64, `memory_mib` ...
		covered := false
		for d, row := range docs {
			if rest, ok := strings.CutPrefix(k, d+"."); ok && !strings.Contains(rest, ".") && strings.Contains(row, "`"+rest+"`") {
				covered = true
			}
		}
		if !covered {
			out = append(out, k+" is a key of the configuration (internal/config) missing from the key tables of "+path)
		}
	}
	for _, d := range sortedKeys(docs) {
		if !slices.ContainsFunc(code, func(k string) bool { return k == d || strings.HasPrefix(k, d+".") }) {
			out = append(out, path+" documents "+d+", which is not a key of the configuration (internal/config)")
		}
	}
	return out
}

// Every key of the configuration is documented in docs/configuration.md's
// key tables, and every key documented there is one of the configuration.
func TestDocsListEveryKey(t *testing.T) {
	const path = "../../docs/configuration.md"
	docs, err := docKeys(path)
	require.NoError(t, err)
	require.Greater(t, len(docs), 50, "the key tables of %s were not found", path)
	require.Empty(t, docsDisagree(Keys(), docs, path))
}

// docKeys reads what it should from a small document, and refuses a key
// table it cannot place.
func TestDocKeysParser(t *testing.T) {
	dir := t.TempDir()
	doc := dir + "/c.md"
	require.NoError(t, os.WriteFile(doc, []byte("# x\n\n## Top level\n\n| key | default | meaning |\n|---|---|---|\n| `a` | 1 | `b` too |\n\n"+
		"## `[images.NAME]`\n\n| key | default |\n| --- | --- |\n| `kernel`, `initrd` | — |\n| `pool` | none |\n\n"+
		"## `[garm]`: g\n\n| key | allowed |\n|---|---|\n| `flavors.NAME` | `vcpus` 1-64 |\n\n| other | table |\n|---|---|\n| `zzz` | x |\n"), 0o600))
	got, err := docKeys(doc)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"a", "images.*.kernel", "images.*.initrd", "images.*.pool", "garm.flavors.*"}, sortedKeys(got))

	code := []string{"a", "c", "images.*.kernel", "images.*.pool.idle_count", "garm.flavors.*.vcpus", "garm.flavors.*.memory_mib"}
	require.Equal(t, []string{
		"c is a key of the configuration (internal/config) missing from the key tables of c.md",
		"images.*.pool.idle_count is a key of the configuration (internal/config) missing from the key tables of c.md",
		"garm.flavors.*.memory_mib is a key of the configuration (internal/config) missing from the key tables of c.md",
		"c.md documents images.*.initrd, which is not a key of the configuration (internal/config)",
	}, docsDisagree(code, got, "c.md"))

	require.NoError(t, os.WriteFile(doc, []byte("## Notes\n\n| key | meaning |\n|---|---|\n| `a` | x |\n"), 0o600))
	_, err = docKeys(doc)
	require.ErrorContains(t, err, `c.md:3: a key table under "## Notes", which names no table`)
}

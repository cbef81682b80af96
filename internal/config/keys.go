package config

import (
	"reflect"
	"slices"
	"strings"

	"github.com/pelletier/go-toml/v2/unstable"
)

// MapKey stands for the name part of a key under a table of named tables
// in Keys: "images.*.boot", "garm.flavors.*.vcpus".
const MapKey = "*"

// Keys lists every key of the configuration, dotted with its tables'
// names ("limits.max_disk_gib", "images.*.pool.idle_count"), in the order
// of the Go structs. Tables themselves are not listed, only what they hold.
func Keys() []string {
	var out []string
	walkType(reflect.TypeOf(Config{}), "", func(key string) { out = append(out, key) })
	return out
}

// tomlField is a struct field decoded from TOML, with its key.
type tomlField struct {
	key   string
	index int
}

// tomlFields lists the fields of struct type t that TOML decodes, in
// order: exported, and not tagged toml:"-".
func tomlFields(t reflect.Type) []tomlField {
	var out []tomlField
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, tomlField{key: name, index: i})
	}
	return out
}

// isTable reports whether values of t are TOML tables of known keys (a
// struct, or a pointer to one) rather than values.
func isTable(t reflect.Type) bool {
	return deref(t).Kind() == reflect.Struct
}

// walkType calls leaf with every key under the struct type t, prefixed.
func walkType(t reflect.Type, prefix string, leaf func(string)) {
	for _, f := range tomlFields(t) {
		ft := t.Field(f.index).Type
		key := prefix + f.key
		switch {
		case isTable(ft):
			walkType(deref(ft), key+".", leaf)
		case ft.Kind() == reflect.Map && isTable(ft.Elem()):
			walkType(deref(ft.Elem()), key+"."+MapKey+".", leaf)
		default:
			leaf(key)
		}
	}
}

// tableKeys lists the keys a table of the configuration may hold, given
// the table's dotted name as written in a file ("" for the top level,
// "limits", "images.debian"); ok is false when there is no such table.
func tableKeys(table string) (keys []string, ok bool) {
	var parts []string
	if table != "" {
		parts = strings.Split(table, ".")
	}
	t, ok := keyType(parts)
	if !ok || t.Kind() != reflect.Struct {
		return nil, false
	}
	for _, f := range tomlFields(t) {
		keys = append(keys, f.key)
	}
	return keys, true
}

// keyType is the Go type (pointers taken away) of the value at key, as
// written in a file (["images", "debian", "boot"]); none: the top level.
func keyType(key []string) (reflect.Type, bool) {
	t := reflect.TypeOf(Config{})
	for _, part := range key {
		switch t.Kind() {
		case reflect.Map:
			t = deref(t.Elem())
		case reflect.Struct:
			found := false
			for _, f := range tomlFields(t) {
				if f.key == part {
					t, found = deref(t.Field(f.index).Type), true
					break
				}
			}
			if !found {
				return nil, false
			}
		default:
			return nil, false
		}
	}
	return t, true
}

// deref is the type a pointer type points to, else t.
func deref(t reflect.Type) reflect.Type {
	if t.Kind() == reflect.Pointer {
		return t.Elem()
	}
	return t
}

// keyLines maps every key a TOML text sets, dotted with its tables'
// names ("images.debian.boot"), and every table it opens ("images.debian"),
// to the line it is on. Keys inside an inline table are included. A text
// that does not parse gives what was read before the fault.
func keyLines(data []byte) map[string]int {
	lines := map[string]int{}
	var p unstable.Parser
	p.Reset(data)
	var table []string
	for p.NextExpression() {
		e := p.Expression()
		switch e.Kind {
		case unstable.Table, unstable.ArrayTable:
			table = nil
			it := e.Key()
			line := 0
			for it.Next() {
				n := it.Node()
				table = append(table, string(n.Data))
				if line == 0 {
					line = p.Shape(n.Raw).Start.Line
				}
			}
			// Every table a header implies, like [a] for [a.b], is
			// "opened" there unless it has a line of its own.
			for i := 1; i <= len(table); i++ {
				k := strings.Join(table[:i], ".")
				if _, seen := lines[k]; !seen || i == len(table) {
					lines[k] = line
				}
			}
		case unstable.KeyValue:
			addKeyValue(&p, e, table, lines)
		}
	}
	return lines
}

// addKeyValue records a key = value expression under table, and the keys
// of an inline table value.
func addKeyValue(p *unstable.Parser, e *unstable.Node, table []string, lines map[string]int) {
	key := slices.Clone(table)
	it := e.Key()
	line := 0
	for it.Next() {
		n := it.Node()
		key = append(key, string(n.Data))
		if line == 0 {
			line = p.Shape(n.Raw).Start.Line
		}
	}
	for i := len(table) + 1; i < len(key); i++ {
		if k := strings.Join(key[:i], "."); lines[k] == 0 {
			lines[k] = line
		}
	}
	lines[strings.Join(key, ".")] = line
	if v := e.Value(); v != nil && v.Kind == unstable.InlineTable {
		children := v.Children()
		for children.Next() {
			if c := children.Node(); c.Kind == unstable.KeyValue {
				addKeyValue(p, c, key, lines)
			}
		}
	}
}

package config

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// Problem is one thing wrong with a configuration text, for
// `libvirt-executor config check`.
type Problem struct {
	// Key is the dotted key at fault ("images.debian.boot"); empty when
	// the text does not parse as TOML at all.
	Key string `json:"key,omitempty"`
	// Line is where Key is set in the text (Set), or else where its table
	// is opened (Table); 0 when neither is in the text.
	Line int `json:"line,omitempty"`
	// Set reports whether Key itself is written in the text.
	Set bool `json:"set"`
	// Table is the enclosing table Line points to when Key is not set.
	Table string `json:"table,omitempty"`
	// Message says what is wrong and what is allowed.
	Message string `json:"message"`
}

// String is the problem as `config check` prints it after the file name
// and a colon: "12: images.a.boot: ...", "3: images.a.base (not set in
// [images.a]): ...", " limits.max_vcpus (not set in the file): ...".
func (p Problem) String() string {
	switch {
	case p.Key == "" && p.Line > 0:
		return fmt.Sprintf("%d: %s", p.Line, p.Message)
	case p.Key == "":
		return " " + p.Message
	case p.Set:
		return fmt.Sprintf("%d: %s: %s", p.Line, p.Key, p.Message)
	case p.Line > 0:
		return fmt.Sprintf("%d: %s (not set in [%s]): %s", p.Line, p.Key, p.Table, p.Message)
	default:
		return fmt.Sprintf(" %s (not set in the file): %s", p.Key, p.Message)
	}
}

// Check decodes and validates a configuration text as Parse does, and
// returns every problem instead of the first error: each unknown key
// (with the keys its table allows), or the value that does not decode,
// and then everything Validate finds, each with the line of its key where
// the text has it. None: the configuration is valid. It looks at nothing
// outside the text (the image store, the base files: doctor does).
func Check(data []byte) []Problem {
	var c Config
	err := toml.NewDecoder(bytes.NewReader(data)).DisallowUnknownFields().Decode(&c)
	var out []Problem
	var strict *toml.StrictMissingError
	var de *toml.DecodeError
	switch {
	case err == nil:
	case errors.As(err, &strict):
		// The known keys are decoded all the same: go on to validate them.
		for _, e := range strict.Errors {
			row, _ := e.Position()
			out = append(out, Problem{Key: strings.Join(e.Key(), "."), Line: row, Set: true, Message: unknownKey(e.Key())})
		}
	case errors.As(err, &de):
		row, _ := de.Position()
		key := strings.Join(de.Key(), ".")
		msg := de.Error()
		if want := expectedValue(de.Key()); want != "" && strings.Contains(msg, "cannot decode") {
			msg += "; " + key + " takes " + want
		}
		return []Problem{{Key: key, Line: row, Set: key != "", Message: msg}}
	default:
		return []Problem{{Message: err.Error()}}
	}
	c.applyDefaults()
	lines := keyLines(data)
	var inv *invalidError
	if err := c.Validate(); errors.As(err, &inv) {
		for _, s := range inv.errs {
			key, msg, _ := strings.Cut(s, ": ")
			out = append(out, problemAt(lines, key, msg))
		}
	} else if err != nil {
		out = append(out, Problem{Message: err.Error()})
	}
	return out
}

// unknownKey is the message for a key no table has: what its table
// allows instead.
func unknownKey(key []string) string {
	// The deepest table of the key that exists is the one it is unknown in
	// (an unknown table name is an unknown key of its parent).
	for i := len(key) - 1; i >= 0; i-- {
		table := strings.Join(key[:i], ".")
		if allowed, ok := tableKeys(table); ok {
			where := "the top level"
			if table != "" {
				where = "[" + table + "]"
			}
			return fmt.Sprintf("unknown key %q in %s; it allows %s (docs/configuration.md)", key[i], where, strings.Join(allowed, ", "))
		}
	}
	return "unknown key (see docs/configuration.md for the allowed keys)"
}

// expectedValue says what kind of value key takes ("a whole number"), or
// "" for a key it does not know.
func expectedValue(key []string) string {
	t, ok := keyType(key)
	if !ok || len(key) == 0 {
		return ""
	}
	switch {
	case t == reflect.TypeOf(Duration(0)):
		return `a duration string ("90s", "5m", "1h30m")`
	case t.Kind() == reflect.Struct || t.Kind() == reflect.Map:
		return "a table"
	case t.Kind() == reflect.Slice:
		return "a list of strings"
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() == reflect.Int:
		return "a whole number"
	case t.Kind() == reflect.String:
		return "a string"
	}
	return ""
}

// problemAt is Validate's problem with key, placed on its line in the
// text (lines: keyLines), or its table's.
func problemAt(lines map[string]int, key, msg string) Problem {
	k, _, _ := strings.Cut(key, "[") // images.a.egress_allow[2]
	if l, ok := lines[k]; ok {
		return Problem{Key: key, Line: l, Set: true, Message: msg}
	}
	for t := k; strings.Contains(t, "."); {
		t = t[:strings.LastIndexByte(t, '.')]
		if l, ok := lines[t]; ok {
			return Problem{Key: key, Line: l, Table: t, Message: msg}
		}
	}
	return Problem{Key: key, Message: msg}
}

// invalidError is Validate's error: every problem, each "key: what is
// wrong", in Validate's order.
type invalidError struct{ errs []string }

func (e *invalidError) Error() string { return strings.Join(e.errs, "; ") }

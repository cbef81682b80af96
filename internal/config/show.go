package config

import (
	"net/url"
	"reflect"
	"regexp"
	"slices"
	"strings"
)

// Where a setting's value came from (Setting.Source).
const (
	// SourceFile: the key is written in the configuration file.
	SourceFile = "file"
	// SourceDefault: the driver's default, or what follows from other keys
	// (limits.max_vcpus from defaults.vcpus, the only image as
	// default_image).
	SourceDefault = "default"
	// SourceStore: an image with a source; the file of the image this
	// host's store has for it (base, kernel, initrd).
	SourceStore = "store"
)

// Setting is one key of the configuration with its effective value.
type Setting struct {
	// Key is the dotted key, with the image's or flavor's name for a
	// named table ("images.debian.boot").
	Key string `json:"key"`
	// Value is the effective value: a string (durations as Go duration
	// strings), a number, a bool, a list of strings, or nil for a key
	// that is not set and has no default (an absent egress_allow).
	Value any `json:"value"`
	// Source is SourceFile, SourceDefault or SourceStore.
	Source string `json:"source"`
}

// Redacted replaces a secret in a value Settings shows.
const Redacted = "REDACTED"

// secretKeyRE matches the names of keys whose values Settings never shows.
// No key of the configuration holds a secret today (registry.credentials
// is a path): this is for one added later.
var secretKeyRE = regexp.MustCompile(`(?i)token|password|passwd|secret|private_key`)

// Settings lists every key of c with its effective value and where it
// came from, in the order of Keys, each image's and flavor's keys in name
// order. c is a loaded configuration (Load, Parse): its Text tells which
// keys the file sets. A secret is never shown: a key named like one
// (secretKeyRE) shows Redacted, a URL's password is replaced.
func (c *Config) Settings() []Setting {
	lines := keyLines(c.Text)
	var out []Setting
	add := func(key string, v reflect.Value, img *Image) {
		s := Setting{Key: key, Value: settingValue(key, v, c), Source: SourceDefault}
		if _, ok := lines[key]; ok {
			s.Source = SourceFile
		} else if img != nil && img.Source != "" && slices.Contains([]string{"base", "kernel", "initrd"}, key[strings.LastIndexByte(key, '.')+1:]) {
			s.Source = SourceStore
		}
		if secretKeyRE.MatchString(key[strings.LastIndexByte(key, '.')+1:]) && s.Value != nil && s.Value != "" {
			s.Value = Redacted
		}
		out = append(out, s)
	}
	walkValue(reflect.ValueOf(c).Elem(), "", nil, add)
	return out
}

// walkValue calls add with every key under the struct value v, prefixed;
// img is the image whose table v is part of, if any.
func walkValue(v reflect.Value, prefix string, img *Image, add func(string, reflect.Value, *Image)) {
	for _, f := range tomlFields(v.Type()) {
		fv := v.Field(f.index)
		key := prefix + f.key
		switch {
		case isTable(fv.Type()):
			if fv.Kind() == reflect.Pointer {
				if fv.IsNil() {
					continue // an absent optional table ([images.NAME.pool])
				}
				fv = fv.Elem()
			}
			walkValue(fv, key+".", img, add)
		case fv.Kind() == reflect.Map && isTable(fv.Type().Elem()):
			names := make([]string, 0, fv.Len())
			for _, k := range fv.MapKeys() {
				names = append(names, k.String())
			}
			slices.Sort(names)
			for _, name := range names {
				ev := fv.MapIndex(reflect.ValueOf(name))
				if ev.Kind() == reflect.Pointer {
					if ev.IsNil() {
						continue
					}
					if i, ok := ev.Interface().(*Image); ok {
						img = i
					}
					ev = ev.Elem()
				}
				walkValue(ev, key+"."+name+".", img, add)
			}
		default:
			add(key, fv, img)
		}
	}
}

// settingValue is the effective value of the key's field v.
func settingValue(key string, v reflect.Value, c *Config) any {
	switch key {
	// Optional values whose default is applied where they are used.
	case "ssh.connection_holder":
		return c.SSH.HolderEnabled()
	case "cache.disk_min_mib":
		return int(c.Cache.DiskMin() >> 20)
	}
	if d, ok := v.Interface().(Duration); ok {
		return d.D().String()
	}
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			return nil
		}
		return settingValue(key, v.Elem(), c)
	case reflect.Slice:
		if v.IsNil() {
			return nil
		}
		list := make([]string, v.Len())
		for i := range list {
			list[i] = hidePassword(v.Index(i).String())
		}
		return list
	case reflect.String:
		return hidePassword(v.String())
	case reflect.Bool:
		return v.Bool()
	case reflect.Int, reflect.Int64:
		return int(v.Int())
	}
	return v.Interface()
}

// hidePassword replaces the password of a URL with user information
// ("qemu+ssh://user:pw@host/system").
func hidePassword(s string) string {
	if !strings.Contains(s, "@") || !strings.Contains(s, "://") {
		return s
	}
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	if _, has := u.User.Password(); !has {
		return s
	}
	u.User = url.UserPassword(u.User.Username(), Redacted)
	return u.String()
}

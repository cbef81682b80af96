package gitlab

import "os"

// maxExpanded bounds an expanded image name. Configured names have at most
// 63 characters, so anything longer is refused anyway; the bound keeps a job
// from making the driver build huge strings out of nested references.
const maxExpanded = 1024

// expandImage expands the job's variables in the payload's image name the
// way GitLab Runner does before it uses the name (and before it exports it
// as CI_JOB_IMAGE, which is why that one arrives expanded): $VAR and ${VAR},
// an unknown variable is empty, and $$ is a dollar sign. The runner first
// expands every variable's value once against the unexpanded values (except
// raw variables), then the image name against the result: so a reference in
// a value is followed one level, no deeper. The last entry of a key wins, as
// in the runner's JobVariables.Get. The runner's own variables (its
// config.toml environment, CI_RUNNER_VERSION, ...) are not in the payload
// and expand to nothing here.
func expandImage(written string, vars []jobVariable) ImageRequest {
	x := &expander{vars: vars, memo: map[string]string{}}
	name := x.expand(written, false)
	return ImageRequest{Name: name, Written: written, Hidden: x.hidden, TooLong: x.tooLong}
}

type expander struct {
	vars    []jobVariable
	memo    map[string]string // key -> its value expanded once
	hidden  bool
	tooLong bool
}

// expand replaces the references in s. Outside a value (inner false) a
// reference yields the variable's value expanded once; inside one, the
// value as it is.
func (x *expander) expand(s string, inner bool) string {
	n := 0
	out := os.Expand(s, func(key string) string {
		v := x.ref(key, inner)
		if n += len(v); n > maxExpanded {
			x.tooLong = true
			return ""
		}
		return v
	})
	if len(out) > maxExpanded {
		x.tooLong = true
		out = out[:maxExpanded]
	}
	return out
}

// ref is what a reference to key stands for.
func (x *expander) ref(key string, inner bool) string {
	switch key {
	case "$":
		return "$"
	case "*", "#", "@", "!", "?", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9":
		return "" // shell parameters, never variables (as in the runner)
	}
	v, ok := x.last(key)
	if !ok {
		return ""
	}
	if v.Masked || !v.Public {
		// A secret, or a variable from the CI/CD settings (GitLab sends
		// those as not public): the result must not be shown.
		x.hidden = true
	}
	if v.File {
		// The runner substitutes the path of the file that holds the
		// value; that path is not known here. Never the content: this
		// stands for the path, and is no image name.
		return "<file variable " + key + ">"
	}
	if inner || v.Raw {
		return v.Value
	}
	if e, ok := x.memo[key]; ok {
		return e
	}
	e := x.expand(v.Value, true)
	x.memo[key] = e
	return e
}

// last finds the last entry of key.
func (x *expander) last(key string) (jobVariable, bool) {
	for i := len(x.vars) - 1; i >= 0; i-- {
		if x.vars[i].Key == key {
			return x.vars[i], true
		}
	}
	return jobVariable{}, false
}

// expanded reports whether the name came out of an expansion.
func (r ImageRequest) expanded() bool { return r.Written != r.Name }

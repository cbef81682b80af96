package admin

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// logFormats and logLevels are what --log-format and --log-level allow.
var (
	logFormats = []string{"text", "json"}
	logLevels  = []string{"debug", "info", "warn", "error"}
)

// logFlags are --log-format and --log-level, for the application (before
// the command) and for serve (after it).
func logFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "log-format", Usage: "log lines as " + strings.Join(logFormats, " or ") + " (default text)",
			EnvVars: []string{"LIBVIRT_EXECUTOR_LOG_FORMAT"}, Action: func(_ *cli.Context, v string) error { return oneOf("--log-format", v, logFormats) }},
		&cli.StringFlag{Name: "log-level", Usage: "log from this level up: " + strings.Join(logLevels, ", ") + " (default info)",
			EnvVars: []string{"LIBVIRT_EXECUTOR_LOG_LEVEL"}, Action: func(_ *cli.Context, v string) error { return oneOf("--log-level", v, logLevels) }},
	}
}

func oneOf(flag, v string, allowed []string) error {
	if v == "" || slices.Contains(allowed, strings.ToLower(v)) {
		return nil
	}
	return fmt.Errorf("%s %q: allowed values are %s", flag, v, strings.Join(allowed, ", "))
}

// logFlag is the value of the log flag name given nearest the command
// (the command's own, else the application's).
func logFlag(c *cli.Context, name string) string {
	for _, l := range c.Lineage() {
		if l != nil && l.IsSet(name) {
			if v := l.String(name); v != "" {
				return strings.ToLower(v)
			}
		}
	}
	return ""
}

// logger is the logger --log-format and --log-level ask for, on stderr.
func logger(c *cli.Context) *slog.Logger {
	l, err := newLogger(os.Stderr, logFlag(c, "log-format"), logFlag(c, "log-level"))
	if err != nil { // refused by the flags' own checks before any command runs
		return obs.NewTextLogger(os.Stderr, nil)
	}
	return l
}

// newLogger is a logger to w in format ("text", "json"; "": text) from
// level ("debug" ... "error"; "": info).
func newLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	if err := oneOf("--log-format", format, logFormats); err != nil {
		return nil, err
	}
	if err := oneOf("--log-level", level, logLevels); err != nil {
		return nil, err
	}
	var lv slog.Level
	if level != "" {
		if err := lv.UnmarshalText([]byte(level)); err != nil {
			return nil, fmt.Errorf("--log-level %q: %w", level, err)
		}
	}
	opts := &slog.HandlerOptions{Level: lv}
	if strings.EqualFold(format, "json") {
		return slog.New(obs.BoundedHandler{Inner: slog.NewJSONHandler(w, opts)}), nil
	}
	return obs.NewTextLogger(w, opts), nil
}

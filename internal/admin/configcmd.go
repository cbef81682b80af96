package admin

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// ExitConfigInvalid is the exit status of `config check` for a
// configuration it read and found wrong (each problem on stdout). A file
// that cannot be read exits 1, like any other error.
const ExitConfigInvalid = 2

// configInvalidError is config check's error for a configuration with
// problems: exit status ExitConfigInvalid.
type configInvalidError struct {
	path string
	n    int
}

func (e *configInvalidError) Error() string {
	if e.n == 1 {
		return fmt.Sprintf("config %s: 1 problem", e.path)
	}
	return fmt.Sprintf("config %s: %d problems", e.path, e.n)
}

// configCommand is `libvirt-executor config`: check and show.
func configCommand() *cli.Command {
	return &cli.Command{
		Name:  "config",
		Usage: "check the driver configuration, or show every key's effective value and where it came from",
		Subcommands: []*cli.Command{
			{
				Name: "check",
				Usage: fmt.Sprintf("check the configuration as the stages read it: \"OK: FILE\", or each problem (FILE:LINE: KEY: what is wrong and what is allowed; an unknown key is one) and exit status %d",
					ExitConfigInvalid),
				Action: func(c *cli.Context) error {
					return configCheck(os.Stdout, configPath(c))
				},
			},
			{
				Name:  "show",
				Usage: "print every key with its effective value and its source: file (set in the file), default, or store (an image's files from the host's image store)",
				Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print one JSON object (for scripts) instead of the table"}},
				Action: func(c *cli.Context) error {
					return configShow(os.Stdout, configPath(c), c.Bool("json"))
				},
			},
		},
	}
}

// configPath is the configuration file the command reads: --config, else
// $LIBVIRT_EXECUTOR_CONFIG, else the default path.
func configPath(c *cli.Context) string { return config.Resolve(c.String("config"), os.Getenv) }

// configCheck is config check: "OK: PATH", or every problem of the file
// at path and a *configInvalidError.
func configCheck(w io.Writer, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("config %s: %w (set --config or %s to choose another file)", path, err, config.EnvPath)
	}
	problems := config.Check(data)
	if len(problems) == 0 {
		_, err := fmt.Fprintf(w, "OK: %s\n", path)
		return err
	}
	for _, p := range problems {
		fmt.Fprintf(w, "%s:%s\n", path, p)
	}
	return &configInvalidError{path: path, n: len(problems)}
}

// configShow is config show: the settings of the configuration at path,
// as a table or one JSON object.
func configShow(w io.Writer, path string, asJSON bool) error {
	cfg, err := config.Load(path)
	if err != nil {
		return fmt.Errorf("%w (libvirt-executor config check lists every problem)", err)
	}
	settings := cfg.Settings()
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			File     string           `json:"file"`
			Settings []config.Setting `json:"settings"`
		}{cfg.Path, settings})
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "KEY\tVALUE\tSOURCE\n")
	for _, s := range settings {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", s.Key, showValue(s.Value), s.Source)
	}
	return tw.Flush()
}

// showValue writes a setting's value as TOML would ("unset" for none).
func showValue(v any) string {
	switch v := v.(type) {
	case nil:
		return "unset"
	case string:
		return strconv.Quote(v)
	case []string:
		q := make([]string, len(v))
		for i, s := range v {
			q[i] = strconv.Quote(s)
		}
		return "[" + strings.Join(q, ", ") + "]"
	}
	return fmt.Sprint(v)
}

// withConfigFlag gives every command (and subcommand) a --config flag of
// its own, so that `libvirt-executor doctor --config FILE` works as
// `libvirt-executor --config FILE doctor` does: urfave/cli takes the
// application's flags only before the command. A command whose own
// --config is not given takes the nearest one given before it.
func withConfigFlag(cmds []*cli.Command) []*cli.Command {
	for _, cmd := range cmds {
		if !slices.ContainsFunc(cmd.Flags, func(f cli.Flag) bool { return slices.Contains(f.Names(), "config") }) {
			cmd.Flags = append(cmd.Flags, &cli.StringFlag{Name: "config", Usage: "driver configuration file (as before the command)"})
		}
		before := cmd.Before
		cmd.Before = func(c *cli.Context) error {
			if err := inheritConfig(c); err != nil {
				return err
			}
			if before != nil {
				return before(c)
			}
			return nil
		}
		withConfigFlag(cmd.Subcommands)
	}
	return cmds
}

// inheritConfig sets the command's --config, when not given, to the one
// given before the command (to the application or a parent command).
func inheritConfig(c *cli.Context) error {
	if slices.Contains(c.LocalFlagNames(), "config") {
		return nil
	}
	for _, p := range c.Lineage()[1:] {
		if slices.Contains(p.LocalFlagNames(), "config") {
			return c.Set("config", p.String("config"))
		}
	}
	return nil
}

package gitlab

import (
	"context"
	"encoding/json"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// ConfigOutput is the JSON the runner reads from config_exec.
type ConfigOutput struct {
	BuildsDir         string            `json:"builds_dir"`
	CacheDir          string            `json:"cache_dir"`
	BuildsDirIsShared bool              `json:"builds_dir_is_shared"`
	Hostname          string            `json:"hostname"`
	Driver            ConfigDriver      `json:"driver"`
	Shell             string            `json:"shell"`
	JobEnv            map[string]string `json:"job_env,omitempty"`
}

// ConfigDriver names the driver.
type ConfigDriver struct {
	Name    string `json:"name"`
	Version string `json:"version"`
}

// Config is the config stage: it prints the runner's JSON on stdout.
func Config(ctx context.Context, e Env, cfg *config.Config) error {
	j, img, _, err := e.plan(cfg)
	if err != nil {
		return err
	}
	defer j.jobs.Close()
	out := ConfigOutput{
		BuildsDir: img.BuildsDir, CacheDir: img.CacheDir, Hostname: j.name,
		Driver: ConfigDriver{Name: DriverName, Version: buildinfo.Version}, Shell: "bash",
	}
	return json.NewEncoder(e.Stdout).Encode(out)
}

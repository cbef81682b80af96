package services

import (
	"slices"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// OptionsFrom are the Options of a job from the configuration's [services]
// section: jobID names its network, vmImage its VM image in messages, and
// user is the image's login user (podman runs through sudo when it is not
// root).
func OptionsFrom(c config.Services, jobID int64, vmImage, user string) (Options, error) {
	allowed, err := NewAllowlist(c.AllowedImages)
	if err != nil {
		return Options{}, err
	}
	var mirrors []Mirror
	regs := make([]string, 0, len(c.Mirrors))
	for r := range c.Mirrors {
		regs = append(regs, r)
	}
	slices.Sort(regs)
	for _, r := range regs {
		m := Mirror{Registry: r}
		for _, l := range c.Mirrors[r] {
			m.Locations = append(m.Locations, MirrorLocation{Location: l, Insecure: slices.Contains(c.PlainHTTP, l)})
		}
		mirrors = append(mirrors, m)
	}
	conf, err := RegistriesConf(mirrors)
	if err != nil {
		return Options{}, err
	}
	return Options{
		JobID: jobID, WaitTimeout: c.WaitTimeout.D(), Allowed: allowed, DefaultPullPolicy: c.PullPolicy,
		AllowedPullPolicies: c.AllowedPullPolicies, Sudo: user != "" && user != "root", Registries: conf, VMImage: vmImage,
	}, nil
}

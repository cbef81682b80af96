// Package services starts a GitLab job's `services:` as containers in the
// job's own VM, the way GitLab Runner's Docker executor starts them beside a
// job container, with podman in the guest (docs/services.md).
//
// It owns the pure part (reading the job payload's `image` and `services`,
// service aliases, the per-job network's name, every podman argument
// vector, the guest's /etc/hosts block, the registries.conf drop-in, the
// allow-list) and a driver (Start) that runs them in the guest over a small
// seam, Guest: one program with arguments and an environment, never a
// shell command line. It knows nothing of how the job's VM was made or how
// its connection was opened; a front end hands it a Guest for the job.
//
// Everything read from the payload is untrusted: names, aliases, entry
// points, commands and variables are validated and bounded, reach podman
// only as separate arguments, and variable values only as the podman
// process's environment (never an argument, a log line or a file).
package services

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Image is the payload's `image` or one entry of its `services` (GitLab
// Runner's job response: name, alias, entrypoint, command, variables,
// pull_policy; ports and executor options are not used here).
type Image struct {
	// Name is the image reference as the job wrote it (variables are
	// expanded here, as the runner's Docker executor does).
	Name string `json:"name"`
	// Alias is the job's own host name(s) for a service: one name or a
	// list separated by commas and/or spaces.
	Alias string `json:"alias,omitempty"`
	// Entrypoint and Command replace the image's, as argument vectors.
	Entrypoint []string `json:"entrypoint,omitempty"`
	Command    []string `json:"command,omitempty"`
	// Variables are the service's own (public, from .gitlab-ci.yml).
	Variables []Variable `json:"variables,omitempty"`
	// PullPolicy lists pull policies in order of preference (always,
	// if-not-present, never); empty is the configured default.
	PullPolicy []string `json:"pull_policy,omitempty"`
}

// Variable is one of the payload's job variables or a service's.
type Variable struct {
	Key    string `json:"key"`
	Value  string `json:"value"`
	Public bool   `json:"public"`
	Masked bool   `json:"masked"`
	Raw    bool   `json:"raw"`
	File   bool   `json:"file"`
}

// secret says the value must never be shown: masked, or not public (a
// CI/CD setting, a token).
func (v Variable) secret() bool { return v.Masked || !v.Public }

// Payload is the part of the job payload (JOB_RESPONSE_FILE) this package
// reads. The payload also holds the job token: it is decoded into these
// fields only, kept in memory, and never written anywhere.
type Payload struct {
	Image     Image      `json:"image"`
	Services  []Image    `json:"services"`
	Variables []Variable `json:"variables"`
	// Credentials are the registries' (the job token for GitLab's own
	// registry): they reach the guest only as AuthFile, never a log line
	// or an argument.
	Credentials []Credential `json:"credentials"`
}

// MaxPayload bounds the payload read by DecodePayload (GitLab's job
// responses are kilobytes; a big one with many variables is a few hundred).
const MaxPayload = 16 << 20

// DecodePayload reads the fields of Payload from a job payload, at most
// MaxPayload bytes of it.
func DecodePayload(r io.Reader) (*Payload, error) {
	lr := &io.LimitedReader{R: r, N: MaxPayload + 1}
	var p Payload
	if err := json.NewDecoder(lr).Decode(&p); err != nil {
		if lr.N <= 0 {
			return nil, fmt.Errorf("the job payload exceeds %d bytes", MaxPayload)
		}
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return nil, fmt.Errorf("the job payload is not valid JSON (offset %d)", syn.Offset)
		}
		return nil, fmt.Errorf("cannot decode the job payload: %v", err)
	}
	return &p, nil
}

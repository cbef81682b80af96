package ghhooks

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// State is what the hook keeps between its calls: the runner hands back,
// with every later command, the state prepare_job answered. It names the
// job's VM and what runs in it; the hook proves the VM is its own before
// it acts on it.
type State struct {
	// Machine is the job's VM; Job the key its record is kept under.
	Machine string `json:"machine"`
	Job     string `json:"job"`
	// Network is the job's container network in the VM, Container the
	// job container's name, Services each service's container by its
	// contextName.
	Network   string            `json:"network"`
	Container string            `json:"container"`
	Services  map[string]string `json:"services,omitempty"`
}

// ContainerContext is what the runner learns of one container.
type ContainerContext struct {
	ID      string            `json:"id,omitempty"`
	Network string            `json:"network,omitempty"`
	Ports   map[string]string `json:"ports,omitempty"`
}

// Response is prepare_job's answer.
type Response struct {
	State   State `json:"state"`
	Context struct {
		Container ContainerContext `json:"container"`
		Services  []ServiceContext `json:"services"`
	} `json:"context"`
	IsAlpine bool `json:"isAlpine"`
}

// ServiceContext is one service's part of the answer.
type ServiceContext struct {
	ContextName string            `json:"contextName"`
	Image       string            `json:"image"`
	ID          string            `json:"id"`
	Ports       map[string]string `json:"ports,omitempty"`
}

// DecodeState reads the state the runner handed back: a state this hook
// wrote (a machine and a job), else an error saying so.
func (in *Input) DecodeState() (*State, error) {
	if len(in.State) == 0 || string(in.State) == "null" || string(in.State) == "{}" {
		return nil, errors.New("state: empty (prepare_job did not run, or the runner lost its answer)")
	}
	var st State
	if err := json.Unmarshal(in.State, &st); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	if st.Machine == "" || st.Job == "" {
		return nil, errors.New("state: names no machine or job (not a state this hook wrote)")
	}
	return &st, nil
}

// WriteResponse writes r to path as the runner reads it: the whole answer
// or nothing (a file beside it, renamed into place), mode 0600. The
// directory must exist; a file already there is replaced.
func WriteResponse(path string, r *Response) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		if err == nil || errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("responseFile %s: its directory %s does not exist", path, dir)
		}
		return fmt.Errorf("responseFile %s: %w", path, err)
	}
	f, err := os.CreateTemp(dir, ".lve-hook-response-*")
	if err != nil {
		return fmt.Errorf("responseFile %s: cannot write in %s: %w", path, dir, err)
	}
	tmp := f.Name()
	_, werr := f.Write(b)
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("responseFile %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("responseFile %s: %w", path, err)
	}
	return nil
}

package vm

import (
	"context"
	"errors"
	"fmt"
)

// Halt makes the named machine run nothing more, at once: it pauses the
// guest's vCPUs (Hypervisor.Suspend), which takes milliseconds, where
// Destroy waits for QEMU's process to be gone. Its ownership record must
// name this controller; a missing domain is success.
func (e *Engine) Halt(ctx context.Context, name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	if _, found, err := e.provenOwner(ctx, name); err != nil || !found {
		return err
	}
	return ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.Suspend(ctx, name) }))
}

// provenOwner reads the named domain's ownership record and proves it is
// this controller's; found is false when there is no such domain. A domain
// without a record, or with another controller's, is ErrNotOurs.
func (e *Engine) provenOwner(ctx context.Context, name string) (o Owner, found bool, err error) {
	ownerXML, err := e.HV.Owner(ctx, name)
	switch {
	case errors.Is(err, ErrNotFound):
		return Owner{}, false, nil
	case errors.Is(err, ErrNoOwner):
		return Owner{}, true, fmt.Errorf("%s: %w (no ownership metadata)", name, ErrNotOurs)
	case err != nil:
		return Owner{}, true, fmt.Errorf("read ownership of %s: %w", name, err)
	}
	o, err = ParseOwner(ownerXML)
	if err != nil {
		return Owner{}, true, fmt.Errorf("%s: %w: %v", name, ErrNotOurs, err)
	}
	if o.Controller != e.Controller {
		return Owner{}, true, fmt.Errorf("%s: %w (owned by controller %s)", name, ErrNotOurs, o.Controller)
	}
	return o, true, nil
}

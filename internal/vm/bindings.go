package vm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// FilterBinding is libvirt's record that a network filter is applied on a
// tap device (virNWFilterBinding): the device, the filter, and the domain
// that owned the interface when the binding was made.
type FilterBinding struct {
	PortDev, Filter, OwnerName, OwnerUUID string
}

// String names the binding for logs and reports: "vnet10 (lve-vm-v1 of
// lve-...-540709)".
func (b FilterBinding) String() string {
	return fmt.Sprintf("%s (%s of %s)", b.PortDev, b.Filter, b.OwnerName)
}

// RemoveStaleFilterBindings removes this installation's stale network
// filter bindings (with dryRun it only lists them): bindings of one of the
// project's filters (FilterNames) whose owner is named as this
// installation's machines are (NamePrefix) and does not run. Nothing is
// done without a NamePrefix.
//
// libvirt leaves such a binding when it cannot release a stopped domain's
// interface; under its polkit access driver that happens when the client
// whose call stopped the domain has exited before libvirt's teardown asked
// polkit about it (libvirtd logs "Unable to release network device
// 'vnetN'"; a prepare or cleanup killed in the middle of a start or a
// destroy). The binding keeps the old machine's firewall rules for that
// tap name, and libvirt refuses to start the next domain it gives that name
// ("binding 'vnetN' already exists"). Create's start removes them and
// starts again; the sweep removes them too.
func (e *Engine) RemoveStaleFilterBindings(ctx context.Context, dryRun bool) ([]FilterBinding, error) {
	if e.NamePrefix == "" {
		return nil, nil
	}
	all, err := e.HV.FilterBindings(ctx)
	if err != nil && len(all) == 0 {
		return nil, fmt.Errorf("list network filter bindings: %w", err)
	}
	var stale []FilterBinding
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("list network filter bindings: %w", err))
	}
	for _, b := range all {
		if !slices.Contains(FilterNames, b.Filter) || !strings.HasPrefix(b.OwnerName, e.NamePrefix) || b.PortDev == "" {
			continue // not ours: never touched
		}
		active, err := e.HV.IsActive(ctx, b.OwnerName)
		if err != nil && !errors.Is(err, ErrNotFound) {
			errs = append(errs, fmt.Errorf("network filter binding %s: is its machine running: %w", b, err))
			continue
		}
		if active {
			continue // a running (or starting) machine's own
		}
		if !dryRun {
			err := change(ctx, func(ctx context.Context) error { return e.HV.DeleteFilterBinding(ctx, b.PortDev, b.OwnerName) })
			if errors.Is(err, ErrNotFound) {
				continue // released meanwhile
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("remove the stale network filter binding %s: %w", b, err))
				continue
			}
		}
		stale = append(stale, b)
	}
	return stale, errors.Join(errs...)
}

// removeOwnFilterBindings is Remove's step, once the machine's domain is
// gone (or never was): the network filter bindings of the project's
// filters that name the machine as their owner are removed. libvirt leaves
// one when the client whose call stopped the domain had exited first (a
// prepare killed in the middle of its start); removed here, the job's own
// cleanup leaves nothing behind instead of the next start or sweep.
func (e *Engine) removeOwnFilterBindings(ctx context.Context, name string) error {
	all, err := e.HV.FilterBindings(ctx)
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("list network filter bindings: %w", err))
	}
	for _, b := range all {
		if b.OwnerName != name || !slices.Contains(FilterNames, b.Filter) || b.PortDev == "" {
			continue
		}
		err := change(ctx, func(ctx context.Context) error { return e.HV.DeleteFilterBinding(ctx, b.PortDev, b.OwnerName) })
		if err != nil && !errors.Is(err, ErrNotFound) {
			errs = append(errs, fmt.Errorf("remove the network filter binding %s: %w", b, err))
			continue
		}
		e.progress("removed the network filter binding %s libvirt had left", b)
	}
	return errors.Join(errs...)
}

// startAgain is start's recovery from a start libvirt refused because a
// stale filter binding holds the tap name it chose: it removes this
// installation's stale bindings and, when it removed one, starts once more.
// It returns start's first error when there was nothing to remove.
func (c *creation) startAgain(ctx context.Context, first error) error {
	if c.s.Filter == nil || ctx.Err() != nil {
		return first
	}
	removed, err := c.e.RemoveStaleFilterBindings(ctx, false)
	if len(removed) == 0 {
		if err != nil {
			return fmt.Errorf("%w (and looking for stale network filter bindings: %v)", first, err)
		}
		return first
	}
	names := make([]string, len(removed))
	for i, b := range removed {
		names[i] = b.String()
	}
	c.e.progress("removed %d stale network filter binding(s) left by machines libvirt could not release (%s); starting again", len(removed), strings.Join(names, ", "))
	return change(ctx, func(ctx context.Context) error { return c.e.HV.Start(ctx, c.s.Name) })
}

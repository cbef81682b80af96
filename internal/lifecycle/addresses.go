package lifecycle

import (
	"context"
	"net"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// addressLock serialises the hand-out of spare DHCP host entries.
const addressLock = "_addresses"

// AddressBook is vm.AddressBook on the state store: a machine's hold is a
// file in its state directory (state.Store.HoldAddress), taken under a
// lock of its own, so it ends at the latest when teardown removes the
// directory, after the domain.
type AddressBook struct{ Store state.Store }

// Take implements vm.AddressBook: the first spare, in the order given
// (the network's), that no machine of this installation holds.
func (b AddressBook) Take(ctx context.Context, name string, spares []vm.DHCPHost) (vm.DHCPHost, bool, error) {
	if len(spares) == 0 {
		return vm.DHCPHost{}, false, nil
	}
	unlock, err := b.Store.Lock(ctx, addressLock)
	if err != nil {
		return vm.DHCPHost{}, false, err
	}
	defer unlock()
	held, err := b.Store.AddressHolds()
	if err != nil {
		return vm.DHCPHost{}, false, err
	}
	for _, h := range spares {
		ip := net.ParseIP(h.IP)
		if ip == nil {
			continue
		}
		if owner, ok := held[ip.String()]; ok && owner != name {
			continue
		}
		if err := b.Store.HoldAddress(name, ip.String()); err != nil {
			return vm.DHCPHost{}, false, err
		}
		return h, true, nil
	}
	return vm.DHCPHost{}, false, nil
}

// Give implements vm.AddressBook.
func (b AddressBook) Give(name string) error { return b.Store.DropAddress(name) }

package vm

import (
	"encoding/xml"
	"fmt"
	"time"
)

// OwnerNamespace is the XML namespace of the ownership record kept in each
// domain's <metadata>. A domain without it is not ours and is never touched.
const OwnerNamespace = "https://libvirt-executor.dev/xmlns/owner/1"

// Owner is the ownership record of a machine.
type Owner struct {
	XMLName xml.Name `xml:"https://libvirt-executor.dev/xmlns/owner/1 owner"`
	// Controller identifies the installation that created the machine.
	Controller string `xml:"controller"`
	// Frontend names what asked for the machine ("gitlab", ...).
	Frontend string `xml:"frontend"`
	// Job is the front end's job identity.
	Job string `xml:"job"`
	// Created is when the machine was created.
	Created time.Time `xml:"created"`
	// Deadline is when a sweep may remove the machine regardless of state.
	Deadline time.Time `xml:"deadline"`
	// Volumes are the storage volumes that belong to the machine.
	Volumes []string `xml:"volume"`
	// Tags are the front end's own marks (garm: its controller and pool
	// ids and the instance name), so that it can list and remove its
	// machines by them.
	Tags []Tag `xml:"tag" json:",omitempty"`
}

// Tag is one front-end mark of a machine.
type Tag struct {
	Key   string `xml:"key,attr"`
	Value string `xml:",chardata"`
}

// Tag is the value of the tag key ("" without one).
func (o Owner) Tag(key string) string {
	for _, t := range o.Tags {
		if t.Key == key {
			return t.Value
		}
	}
	return ""
}

// MarshalOwner renders the record as an XML element (encoding/xml escapes
// every value).
func MarshalOwner(o Owner) (string, error) {
	b, err := xml.Marshal(o)
	if err != nil {
		return "", fmt.Errorf("ownership metadata: %w", err)
	}
	return string(b), nil
}

// ParseOwner reads a record written by MarshalOwner. libvirt looks the
// element up by OwnerNamespace and hands it back without the namespace, so
// any namespace (or none) is accepted here.
func ParseOwner(s string) (Owner, error) {
	var w struct {
		XMLName xml.Name `xml:"owner"`
		Owner
	}
	if err := xml.Unmarshal([]byte(s), &w); err != nil {
		return Owner{}, fmt.Errorf("ownership metadata: %w", err)
	}
	o := w.Owner
	o.XMLName = xml.Name{Space: OwnerNamespace, Local: "owner"}
	if o.Controller == "" {
		return Owner{}, fmt.Errorf("ownership metadata: no controller id")
	}
	return o, nil
}

package bench

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"
)

// stampedLine is one job-log line and when it reached the harness's log.
type stampedLine struct {
	At   time.Time
	Text string
}

// lineStamper is the harness's job log sink: it records every complete line
// with its arrival time. The driver writes each prepare line as the step
// ends, unbuffered, so arrival times give the breakdown with millisecond
// precision, where the printed figures are rounded to 100 ms above a second.
type lineStamper struct {
	mu      sync.Mutex
	partial bytes.Buffer
	lines   []stampedLine
	now     func() time.Time
}

func (l *lineStamper) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now
	if l.now != nil {
		now = l.now
	}
	at := now()
	l.partial.Write(p)
	for {
		line, err := l.partial.ReadString('\n')
		if err != nil { // no newline yet: keep the rest
			rest := line
			l.partial.Reset()
			l.partial.WriteString(rest)
			break
		}
		l.lines = append(l.lines, stampedLine{At: at, Text: strings.TrimRight(line, "\r\n")})
	}
	return len(p), nil
}

func (l *lineStamper) snapshot() []stampedLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]stampedLine(nil), l.lines...)
}

// Timeline is the prepare stage cut at the arrival of its progress lines.
type Timeline struct {
	Launch   time.Duration // process started .. its first line (exec, configuration, job)
	ToStart  time.Duration // first line .. domain started (leftovers, admission, keys, clone, define, start)
	ToAddr   time.Duration // domain started .. address known
	ToSSH    time.Duration // address known .. SSH login succeeded
	AfterSSH time.Duration // SSH login .. prepare exited (record, guest tool check, exit)
	// StartCall is the start call's own duration as printed; StartToSSH is
	// then from the start call's beginning to the SSH login, the span the
	// floor measures.
	StartCall  time.Duration
	StartToSSH time.Duration
}

var (
	firstPrepareLine = regexp.MustCompile(`^Preparing a fresh `)
	startDoneLine    = regexp.MustCompile(`^\s+start done in (\S+)$`)
)

// prepareTimeline cuts the prepare stage that was launched at launch and
// exited at exit, from the lines that arrived in between.
func prepareTimeline(lines []stampedLine, launch, exit time.Time) (Timeline, error) {
	var tFirst, tStart, tAddr, tSSH time.Time
	var startCall time.Duration
	for _, l := range lines {
		if l.At.Before(launch) || l.At.After(exit) {
			continue
		}
		switch {
		case firstPrepareLine.MatchString(l.Text):
			tFirst = l.At
		case startDoneLine.MatchString(l.Text):
			tStart = l.At
			startCall, _ = time.ParseDuration(startDoneLine.FindStringSubmatch(l.Text)[1])
		case bootedLine.MatchString(l.Text):
			tAddr = l.At
		case sshLine.MatchString(l.Text):
			tSSH = l.At
		}
	}
	var missing []string
	for _, m := range []struct {
		t    time.Time
		what string
	}{{tFirst, "first"}, {tStart, "start done"}, {tAddr, "booted"}, {tSSH, "SSH ready"}} {
		if m.t.IsZero() {
			missing = append(missing, m.what)
		}
	}
	if len(missing) > 0 {
		return Timeline{}, fmt.Errorf("prepare timeline: no %s line during the prepare stage", strings.Join(missing, ", "))
	}
	if !(tFirst.Compare(tStart) <= 0 && tStart.Compare(tAddr) <= 0 && tAddr.Compare(tSSH) <= 0) {
		return Timeline{}, fmt.Errorf("prepare timeline: lines out of order")
	}
	return Timeline{
		Launch: tFirst.Sub(launch), ToStart: tStart.Sub(tFirst), ToAddr: tAddr.Sub(tStart),
		ToSSH: tSSH.Sub(tAddr), AfterSSH: exit.Sub(tSSH),
		StartCall: startCall, StartToSSH: tSSH.Sub(tStart) + startCall,
	}, nil
}

package bench

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLineStamperSplitsLinesAcrossWrites(t *testing.T) {
	base := time.Unix(1000, 0)
	now := base
	l := &lineStamper{now: func() time.Time { return now }}
	_, _ = l.Write([]byte("one\ntw"))
	now = now.Add(time.Second)
	_, _ = l.Write([]byte("o\r\nthree"))
	require.Equal(t, []stampedLine{{base, "one"}, {base.Add(time.Second), "two"}}, l.snapshot(),
		"a line is stamped when its end arrives; an unterminated one waits")
	now = now.Add(time.Second)
	_, _ = l.Write([]byte("\n"))
	require.Equal(t, "three", l.snapshot()[2].Text)
	require.Equal(t, base.Add(2*time.Second), l.snapshot()[2].At)
}

func TestPrepareTimeline(t *testing.T) {
	launch := time.Unix(2000, 0)
	at := func(ms int) time.Time { return launch.Add(time.Duration(ms) * time.Millisecond) }
	var lines []stampedLine
	// A previous attempt's lines must not count.
	lines = append(lines, stampedLine{at(-5000), "  start done in 1ms"})
	msAt := []int{25, 40, 60, 70, 80, 470, 480, 6200, 6900, 6900, 7150}
	for i, text := range strings.Split(strings.TrimSuffix(prepareLog[strings.Index(prepareLog, "Preparing a fresh"):], "\n"), "\n") {
		if i < len(msAt) {
			lines = append(lines, stampedLine{at(msAt[i]), text})
		}
	}
	tl, err := prepareTimeline(lines, launch, at(7200))
	require.NoError(t, err)
	require.Equal(t, Timeline{
		Launch:     25 * time.Millisecond,
		ToStart:    (470 - 25) * time.Millisecond,
		ToAddr:     (6200 - 470) * time.Millisecond,
		ToSSH:      700 * time.Millisecond,
		AfterSSH:   300 * time.Millisecond,
		StartCall:  398 * time.Millisecond,
		StartToSSH: (6900 - 470 + 398) * time.Millisecond,
	}, tl)

	_, err = prepareTimeline(lines[:8], launch, at(7200))
	require.ErrorContains(t, err, "no booted, SSH ready line")
	_, err = prepareTimeline(lines, launch, at(100))
	require.Error(t, err, "lines after the exit do not belong to the stage")
}

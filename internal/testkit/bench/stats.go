package bench

import (
	"math"
	"slices"
)

// Summary is the median and range of repeated measurements of one figure.
// N = 0 means the figure was never measured; its other fields are then 0.
type Summary struct {
	N      int     `json:"n"`
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

// Summarize returns the median, minimum and maximum of xs. NaN values (a
// figure missing in one run) are left out. With an even count the median is
// the mean of the two middle values.
func Summarize(xs []float64) Summary {
	v := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return Summary{}
	}
	slices.Sort(v)
	n := len(v)
	med := v[n/2]
	if n%2 == 0 {
		med = (v[n/2-1] + v[n/2]) / 2
	}
	return Summary{N: n, Median: med, Min: v[0], Max: v[n-1]}
}

// Known reports whether at least one measurement went into s.
func (s Summary) Known() bool { return s.N > 0 }

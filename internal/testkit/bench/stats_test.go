package bench

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []float64
		want Summary
	}{
		{"empty", nil, Summary{}},
		{"one", []float64{7}, Summary{N: 1, Median: 7, Min: 7, Max: 7}},
		{"odd, unsorted", []float64{9, 1, 5}, Summary{N: 3, Median: 5, Min: 1, Max: 9}},
		{"even: mean of the middle two", []float64{4, 1, 3, 10}, Summary{N: 4, Median: 3.5, Min: 1, Max: 10}},
		{"outlier does not move the median", []float64{100, 101, 102, 99, 5000}, Summary{N: 5, Median: 101, Min: 99, Max: 5000}},
		{"NaN (missing) left out", []float64{math.NaN(), 2, math.NaN(), 4}, Summary{N: 2, Median: 3, Min: 2, Max: 4}},
		{"only NaN", []float64{math.NaN()}, Summary{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, Summarize(tc.in))
			require.Equal(t, tc.want.N > 0, Summarize(tc.in).Known())
		})
	}
}

func TestSummarizeDoesNotReorderInput(t *testing.T) {
	in := []float64{3, 1, 2}
	Summarize(in)
	require.Equal(t, []float64{3, 1, 2}, in)
}

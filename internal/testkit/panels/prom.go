package panels

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/client_golang/api"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
)

// maxAnswer bounds the answer to one query that is read.
const maxAnswer = 256 << 20

// client asks one Prometheus' HTTP API, through client_golang's v1 API.
type client struct {
	api promv1.API
}

// newClient returns a client of the Prometheus at base, whose queries
// time out after 30 s.
func newClient(base *url.URL) (*client, error) {
	hc := &http.Client{Timeout: 30 * time.Second, Transport: boundedBody{http.DefaultTransport}}
	c, err := api.NewClient(api.Config{Address: base.String(), Client: hc})
	if err != nil {
		return nil, fmt.Errorf("prometheus %s: %w", base.Redacted(), err)
	}
	return &client{api: promv1.NewAPI(checkedClient{c})}, nil
}

// query runs an instant query (/api/v1/query) at t; only its success
// matters.
func (c *client) query(ctx context.Context, expr string, t time.Time) error {
	_, _, _, err := c.api.Query(ctx, expr, t)
	return err
}

// queryRange runs a range query (/api/v1/query_range) and returns its
// series.
func (c *client) queryRange(ctx context.Context, expr string, start, end time.Time, step time.Duration) ([]series, error) {
	v, _, _, err := c.api.QueryRange(ctx, expr, promv1.Range{Start: start, End: end, Step: step})
	if err != nil {
		return nil, err
	}
	m, ok := v.(model.Matrix)
	if !ok {
		return nil, fmt.Errorf("result type %q, want matrix", resultType(v))
	}
	out := make([]series, 0, len(m))
	for _, ss := range m {
		s := series{Labels: make(map[string]string, len(ss.Metric))}
		for k, v := range ss.Metric {
			s.Labels[string(k)] = string(v)
		}
		for _, p := range ss.Values {
			s.Points = append(s.Points, point{T: p.Timestamp.Time(), V: float64(p.Value)})
		}
		out = append(out, s)
	}
	return out, nil
}

// series is one line of a panel.
type series struct {
	Labels map[string]string
	Points []point
}

type point struct {
	T time.Time
	V float64 // NaN and ±Inf are drawn as gaps
}

// resultType names a query result's type as the API does.
func resultType(v model.Value) string {
	if v == nil {
		return ""
	}
	return v.Type().String()
}

// checkedClient is the api.Client that the v1 API asks through. It turns
// every answer that is not a successful one of the API into this tool's
// errors, which name the HTTP status and Prometheus' own error type and
// message (the v1 API's errors name neither the status nor a page that is
// not the API's), and leaves the decoding of the data to the v1 API.
type checkedClient struct{ api.Client }

func (c checkedClient) Do(ctx context.Context, req *http.Request) (*http.Response, []byte, error) {
	resp, body, err := c.Client.Do(ctx, req)
	switch {
	case err != nil && resp == nil:
		return nil, nil, fmt.Errorf("unreachable: %w", err)
	case err != nil:
		return resp, nil, fmt.Errorf("reading the answer: %w", err)
	}
	return resp, body, answerError(resp.StatusCode, body)
}

// answerError is nil for a successful API answer, else Prometheus' error,
// or what the answer shows when it is not the API's at all.
func answerError(code int, body []byte) error {
	var r struct {
		Status    string `json:"status"`
		ErrorType string `json:"errorType"`
		Error     string `json:"error"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		// Not the API: a proxy's error page, a wrong URL.
		snippet := strings.TrimSpace(string(body))
		if len(snippet) > 200 {
			snippet = snippet[:200] + "..."
		}
		return fmt.Errorf("HTTP %d, not a Prometheus API answer: %q", code, snippet)
	}
	if r.Status != "success" {
		return fmt.Errorf("HTTP %d: %s: %s", code, r.ErrorType, r.Error)
	}
	return nil
}

// boundedBody reads at most maxAnswer bytes of an answer: past that the
// answer is cut, and so not the API's.
type boundedBody struct{ http.RoundTripper }

func (b boundedBody) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := b.RoundTripper.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.LimitReader(resp.Body, maxAnswer), resp.Body}
	return resp, nil
}

package cachexfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

const testMachine = "lve-0123abcd-89abcdef-42"

// A request the admin tool cannot take is refused, saying what is wrong
// and what is allowed: an unknown operation or field, a machine name that
// is not one, a project or file name out of bounds, more than one value,
// more bytes than MaxAdminRequest.
func TestReadAdminRequestRefuses(t *testing.T) {
	long := strings.Repeat("x", maxFileName+1)
	files := make([]string, maxFiles+1)
	for i := range files {
		files[i] = "k/cache.zip"
	}
	many, err := json.Marshal(AdminRequest{Op: OpKeep, Machine: testMachine, Project: "p", Files: files})
	require.NoError(t, err)
	for in, want := range map[string]string{
		`{"op":"format","machine":"` + testMachine + `"}`:                                      "want one of attach, scratch, keep, drop",
		`{"op":"drop","machine":"` + testMachine + `","shell":"rm -rf /"}`:                     `unknown field "shell"`,
		`{"op":"drop","machine":"../../etc"}`:                                                  "cache-disk drop:",
		`{"op":"attach","machine":"` + testMachine + `"}`:                                      "want a project's cache name",
		`{"op":"attach","machine":"` + testMachine + `","project":"a/b"}`:                      "want a project's cache name",
		`{"op":"keep","machine":"` + testMachine + `","project":"p","files":[""]}`:             "want a path of 1 to 4096 bytes",
		`{"op":"keep","machine":"` + testMachine + `","project":"p","files":["` + long + `"]}`: "want a path of 1 to 4096 bytes",
		string(many): "65 files named, at most 64",
		`{"op":"scratch","machine":"` + testMachine + `","project":"p"}`: "takes a machine only",
		`{"op":"drop","machine":"` + testMachine + `"} {"op":"drop"}`:    "more than one JSON value",
		`drop ` + testMachine: "not the JSON wanted",
		`{"op":"drop","machine":"` + testMachine + `"}` + strings.Repeat(" ", MaxAdminRequest): "over 1048576 bytes",
	} {
		_, err := ReadAdminRequest(strings.NewReader(in))
		require.ErrorContains(t, err, want, "%.200s", in)
	}
	req, err := ReadAdminRequest(strings.NewReader(`{"op":"attach","machine":"` + testMachine + `","project":"p","files":["a/cache.zip"]}`))
	require.NoError(t, err)
	require.Equal(t, AdminRequest{Op: OpAttach, Machine: testMachine, Project: "p", Files: []string{"a/cache.zip"}}, req)
}

// An answer is bounded and must be the one for the operation asked.
func TestReadAdminAnswerRefuses(t *testing.T) {
	for _, tc := range []struct{ op, in, want string }{
		{OpAttach, `{}`, "want attached only"},
		{OpAttach, `{"attached":{"files":1,"bytes":-2}}`, "want numbers of 0 or more"},
		{OpKeep, `{"attached":{"files":1,"bytes":2}}`, "want kept only"},
		{OpDrop, `{"kept":{"result":{}}}`, "want an empty answer"},
		{OpDrop, ``, "not the JSON wanted"},
		{OpDrop, `{} []`, "more than one JSON value"},
		{OpAttach, `{"attached":{"files":1,"bytes":2},"pad":"` + strings.Repeat("x", MaxAdminAnswer) + `"}`, "over 65536 bytes"},
	} {
		_, err := ReadAdminAnswer(strings.NewReader(tc.in), tc.op)
		require.ErrorContains(t, err, tc.want, "%s %.100s", tc.op, tc.in)
		require.ErrorContains(t, err, "cache-disk "+tc.op+": answer")
	}
	a, err := ReadAdminAnswer(strings.NewReader(`{"attached":{"files":1,"bytes":2},"newer":true}`), OpAttach)
	require.NoError(t, err, "a newer tool's fields are left aside")
	require.Equal(t, Attached{Files: 1, Bytes: 2}, *a.Attached)
}

// fakeDisks is a Disk that records what it was asked.
type fakeDisks struct {
	asked []string
	fail  error
}

func (f *fakeDisks) Attach(_ context.Context, name, project string, want []string) (hostcache.RestoreResult, error) {
	f.asked = append(f.asked, "attach "+name+" "+project+" "+strings.Join(want, ","))
	return hostcache.RestoreResult{Files: int64(len(want)), Bytes: 7}, f.fail
}

func (f *fakeDisks) AttachScratch(_ context.Context, name string) error {
	f.asked = append(f.asked, "scratch "+name)
	return f.fail
}

func (f *fakeDisks) Keep(_ context.Context, name, project string, keep []string) jobvm.Kept {
	f.asked = append(f.asked, "keep "+name+" "+project+" "+strings.Join(keep, ","))
	return jobvm.Kept{Result: hostcache.SaveResult{Files: 1, Bytes: 3}, Err: f.fail}
}

func (f *fakeDisks) Drop(_ context.Context, name string) error {
	f.asked = append(f.asked, "drop "+name)
	return f.fail
}

// The admin tool's side and the stage's side speak the same protocol:
// each operation crosses it with its arguments and its answer, and a
// failed one is the tool's error.
func TestAdminRoundTrip(t *testing.T) {
	ctx := context.Background()
	host := &fakeDisks{}
	var served error
	d := AdminDisk(func(ctx context.Context, request []byte) ([]byte, error) {
		var out bytes.Buffer
		served = ServeAdmin(ctx, bytes.NewReader(request), &out, host)
		return out.Bytes(), served
	})
	res, err := d.Attach(ctx, testMachine, "p", []string{"a b/cache.zip", "c/cache.zip"})
	require.NoError(t, err)
	require.Equal(t, hostcache.RestoreResult{Files: 2, Bytes: 7}, res)
	require.NoError(t, d.AttachScratch(ctx, testMachine))
	k := d.Keep(ctx, testMachine, "p", []string{"a b/cache.zip"})
	require.NoError(t, k.Err)
	require.NoError(t, k.DropErr)
	require.Equal(t, hostcache.SaveResult{Files: 1, Bytes: 3}, k.Result)
	require.NoError(t, d.Drop(ctx, testMachine))
	require.Equal(t, []string{
		"attach " + testMachine + " p a b/cache.zip,c/cache.zip",
		"scratch " + testMachine,
		"keep " + testMachine + " p a b/cache.zip",
		"drop " + testMachine,
	}, host.asked)

	host.fail = errors.New("libvirt said no")
	require.ErrorContains(t, d.Drop(ctx, testMachine), "libvirt said no")
	k = d.Keep(ctx, testMachine, "p", nil)
	require.ErrorContains(t, k.Err, "libvirt said no", "keep's failure is in its answer")

	// A request the stage itself would send wrong never leaves it.
	host.asked = nil
	require.ErrorContains(t, d.Drop(ctx, "not a machine; rm -rf /"), "cache-disk drop:")
	require.Empty(t, host.asked)
}

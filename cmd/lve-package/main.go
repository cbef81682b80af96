// Command lve-package writes the libvirt-executor package as a .deb and an .rpm
// from one description (internal/packaging, nfpm's packagers), and prints each
// package's path on a line. deploy/package/build.sh (make package) and
// deploy/package/release.sh (make release) run it; it needs no root and, besides
// binutils' strip, no packaging tool.
//
//	lve-package --version V --commit C --date RFC3339 [--binaries DIR] [--prebuilt]
//	            [--format deb,rpm] [--fast] [--strip strip|none] OUTDIR
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/packaging"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "package: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	var b packaging.Build
	var date, formats string
	flag.StringVar(&b.Top, "top", ".", "the repository's root")
	flag.StringVar(&b.Binaries, "binaries", "", "the executables (default: TOP/bin)")
	flag.BoolVar(&b.Prebuilt, "prebuilt", false, "the executables are an earlier build's, given with --binaries (one without lve-agent is packaged without it)")
	flag.StringVar(&b.Version, "version", "", "the package version (deploy/package/version.sh's first line)")
	flag.StringVar(&b.Commit, "commit", "", "the commit built (version.sh's second line)")
	flag.StringVar(&date, "date", "", "the build date, RFC 3339 (version.sh's third line): every file's time")
	flag.StringVar(&formats, "format", "deb", "the packages to write, comma-separated: deb, rpm")
	flag.BoolVar(&b.Fast, "fast", false, "gzip instead of xz (tests)")
	flag.StringVar(&b.Strip, "strip", "strip", `the tool that strips the executables ("none": copied as they are)`)
	flag.Parse()
	if flag.NArg() != 1 {
		return fmt.Errorf("usage: lve-package --version V --commit C --date D [--binaries DIR] [--format deb,rpm] OUTDIR")
	}
	var err error
	if b.Date, err = time.Parse(time.RFC3339, date); err != nil {
		return fmt.Errorf("--date: %w", err)
	}
	if b.Top, err = filepath.Abs(b.Top); err != nil {
		return err
	}
	if b.Binaries == "" {
		b.Binaries = filepath.Join(b.Top, "bin")
	}
	paths, err := b.Write(flag.Arg(0), strings.Split(formats, ",")...)
	if err != nil {
		return err
	}
	for _, p := range paths {
		fmt.Println(p)
	}
	return nil
}

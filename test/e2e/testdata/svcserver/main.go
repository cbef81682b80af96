// Command svcserver is the service image of the services e2e test
// (TestServicesInPodmanVM): a static HTTP server that answers every request
// with "marker=$MARKER" on port $PORT (default 5432), so a job can tell
// which service answered at an alias; "svcserver get URL" prints the
// answer at URL instead (a client on the services' network). It prints a
// line for each request it answers (CI_DEBUG_SERVICES shows them). The test
// builds it with
// CGO_ENABLED=0 and packs it as a one-layer OCI image.
package main

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
)

func main() {
	if len(os.Args) == 3 && os.Args[1] == "get" {
		resp, err := http.Get(os.Args[2])
		if err != nil {
			log.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(os.Stdout, resp.Body)
		return
	}
	port := os.Getenv("PORT")
	if port == "" {
		port = "5432"
	}
	marker := os.Getenv("MARKER")
	fmt.Printf("svcserver: listening on :%s\n", port)
	log.Fatal(http.ListenAndServe(":"+port, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Printf("svcserver: %s %s answered\n", r.Method, r.URL.Path)
		fmt.Fprintf(w, "marker=%s\n", marker)
	})))
}
